//! `--usdt [PATH:]PROVIDER:NAME[=argN]`: what the user asked to count, and which sites and files it
//! wants.

use std::path::PathBuf;

use super::notes::ProbeSite;
use crate::process::{file_identity, FileId, ObjectFile};

/// One `--usdt [PATH:]PROVIDER:NAME[=argN]` option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsdtRequest {
    /// The option as written; names the counter in the trace and the summary.
    pub label: String,
    /// Only sites in this object: a path (with a `/`) or a file name.
    pub path: Option<PathBuf>,
    pub provider: String,
    pub name: String,
    /// Track this argument (0-based, as in `arg0`) instead of only counting hits.
    pub argument: Option<usize>,
}

impl UsdtRequest {
    /// Parses the option's value; the error says what a valid one looks like.
    pub fn parse(text: &str) -> Result<Self, String> {
        let usage = "write [PATH:]PROVIDER:NAME or [PATH:]PROVIDER:NAME=argN, e.g. \
                     --usdt myapp:request_done or --usdt ./libfoo.so:foo:alloc=arg1";
        let (probe, argument) = match text.rsplit_once('=') {
            Some((probe, arg)) => {
                let index = arg
                    .strip_prefix("arg")
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&n| n < 12)
                    .ok_or_else(|| {
                        format!(
                            "`{arg}` in `{text}` is not an argument: write arg0 ... arg11 \
                             (arg0 is the first argument)"
                        )
                    })?;
                (probe, Some(index))
            }
            None => (text, None),
        };
        let mut parts = probe.rsplitn(3, ':');
        let name = parts.next().unwrap_or_default();
        let provider = parts.next().unwrap_or_default();
        let path = parts.next();
        let valid = |part: &str| {
            !part.is_empty()
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
        };
        if !valid(provider) || !valid(name) {
            return Err(format!("`{text}` is not a USDT probe; {usage}"));
        }
        if path.is_some_and(str::is_empty) {
            return Err(format!("`{text}` has an empty PATH; {usage}"));
        }
        Ok(Self {
            label: text.to_owned(),
            path: path.map(PathBuf::from),
            provider: provider.to_owned(),
            name: name.to_owned(),
            argument,
        })
    }

    pub(super) fn matches(&self, site: &ProbeSite) -> bool {
        site.provider == self.provider && site.name == self.name
    }

    /// Whether this request's PATH (if any) names `object`.
    pub(super) fn wants_object(&self, object: &ObjectFile, explicit: &[FileId]) -> bool {
        let Some(path) = &self.path else {
            return true;
        };
        if path.to_string_lossy().contains('/') {
            file_identity(&object.host_path).is_some_and(|id| explicit.contains(&id))
        } else {
            object.path.file_name() == Some(path.as_os_str())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usdt_options() {
        let request = UsdtRequest::parse("myapp:tick").unwrap();
        assert_eq!(
            (request.path, request.provider.as_str(), request.name.as_str(), request.argument),
            (None, "myapp", "tick", None)
        );
        let request = UsdtRequest::parse("./lib/libfoo.so:foo:alloc=arg1").unwrap();
        assert_eq!(request.path, Some(PathBuf::from("./lib/libfoo.so")));
        assert_eq!((request.provider.as_str(), request.name.as_str()), ("foo", "alloc"));
        assert_eq!(request.argument, Some(1));
        assert_eq!(request.label, "./lib/libfoo.so:foo:alloc=arg1");
        let request = UsdtRequest::parse("/a:b/c:p:n").unwrap();
        assert_eq!(request.path, Some(PathBuf::from("/a:b/c")));
        for bad in
            ["", "tick", ":tick", "p:", "p:n=1", "p:n=arg", "p:n=arg99", "p:n=argx", ":p:n", "p:n/x", "p q:n"]
        {
            let err = UsdtRequest::parse(bad).unwrap_err();
            assert!(err.contains("write"), "{bad}: {err}");
        }
    }
}
