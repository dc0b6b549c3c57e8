//! `cargo xtask docs`: builds the guide (docs/, mdBook) into target/guide/ and checks every internal
//! link and anchor in it and in README.md, and that every file an `{{#include}}` takes in exists.
//!
//! mdBook comes from crates.io, installed when missing as bpf-linker is (toolchain.rs). The link
//! checker reads the markdown with pulldown-cmark, the parser mdBook renders with, and makes each
//! heading's anchor as the page's renderer does: GitHub's rule for README.md, mdBook's for the
//! guide (`id_from_content` and `unique_id` in mdbook-html 0.5's utils.rs).

use std::{
    collections::{BTreeMap, HashSet},
    path::{Component, Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use pulldown_cmark::{BrokenLink, Event, LinkType, Options, Parser, Tag, TagEnd};

use crate::{cargo, run, workspace_root};

/// The mdBook the guide is built with: its major version (0.x counts its minor as major), pinned.
const MDBOOK_VERSION: &str = "0.5";
/// mdBook without its `serve` and `watch` features (a web server, a file watcher): a shorter build.
const MDBOOK_FEATURES: [&str; 3] = ["--no-default-features", "--features", "search"];
/// The guide's source, relative to the workspace.
const GUIDE_SRC: &str = "docs/src";
/// The anchors README.md had when it held the whole manual: links from elsewhere may point at
/// them, so each stays in README.md (an `<a id>` beside the link to where its section went).
const KEPT_README_ANCHORS: &[&str] = &[
    "usage",
    "privileges",
    "process-trees",
    "what-is-counted",
    "which-allocator",
    "memory-levels",
    "sampling",
    "the-allocators-own-samples---app-sampled",
    "windows---window-onevery",
    "stacks-and-leaks",
    "python-frames",
    "perl-subs",
    "interpreter-frames-cut-short",
    "subsystem-counters-usdt",
    "outputs",
    "oom-kills",
    "live-view-memtrace-top",
    "fleet-agent-memtrace-serve",
    "containers-and-pods",
    "kubernetes",
    "kernels",
    "what-the-bpf-programs-hold-to-on-every-kernel",
    "memtrace-doctor",
    "layout",
    "architecture",
    "building-by-hand",
    "real-servers-cargo-xtask-bench---servers",
    "kernel-matrix",
];

/// Builds the guide into target/guide/, then checks the links of the guide and README.md.
pub fn build_and_check() -> Result<()> {
    let root = workspace_root();
    let mdbook = mdbook()?;
    let out = root.join("target/guide");
    eprintln!("xtask: building the guide with {} into {}", mdbook.display(), out.display());
    run(Command::new(&mdbook).args(["build", "docs", "--dest-dir"]).arg(&out))?;
    eprintln!("xtask: checking the links of README.md and {GUIDE_SRC}");
    check(&root, KEPT_README_ANCHORS)?;
    eprintln!("xtask: the guide is at {}", out.join("index.html").display());
    Ok(())
}

/// An mdBook of the pinned version: the one on PATH or in cargo's bin directory, else installed
/// there from crates.io (`cargo install --locked`, without its `serve` and `watch` features).
fn mdbook() -> Result<PathBuf> {
    let cargo_bin = cargo_home().map(|home| home.join("bin/mdbook"));
    let candidates = [Some(PathBuf::from("mdbook")), cargo_bin.clone()];
    let mut found = None;
    for candidate in candidates.into_iter().flatten() {
        match mdbook_version(&candidate) {
            Some(version) if is_pinned(&version) => return Ok(candidate),
            Some(version) => found = Some(version),
            None => {}
        }
    }
    if let Some(version) = found {
        eprintln!("xtask: found {version}; the guide is built with mdbook {MDBOOK_VERSION}");
    }
    eprintln!(
        "xtask: installing mdbook {MDBOOK_VERSION} from crates.io (cargo install --locked; takes a few minutes)"
    );
    let version = format!("^{MDBOOK_VERSION}");
    run(cargo().args(["install", "mdbook", "--locked", "--version", &version]).args(MDBOOK_FEATURES))?;
    let installed = cargo_bin.context("no cargo home (neither $CARGO_HOME nor $HOME is set)")?;
    match mdbook_version(&installed) {
        Some(version) if is_pinned(&version) => Ok(installed),
        other => bail!("cargo installed mdbook, but {} reports {other:?}", installed.display()),
    }
}

/// What `mdbook --version` prints (`mdbook v0.5.4`); None if it does not run.
fn mdbook_version(program: &Path) -> Option<String> {
    let output = Command::new(program).arg("--version").output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn is_pinned(version: &str) -> bool {
    version
        .strip_prefix("mdbook v")
        .and_then(|number| number.strip_prefix(MDBOOK_VERSION))
        .is_some_and(|rest| rest.starts_with('.'))
}

fn cargo_home() -> Option<PathBuf> {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cargo")))
}

/// Checks README.md and every page of docs/src under `root`; fails naming every problem found.
pub fn check(root: &Path, kept_readme_anchors: &[&str]) -> Result<()> {
    let problems = problems(root, kept_readme_anchors)?;
    if problems.is_empty() {
        return Ok(());
    }
    for problem in &problems {
        eprintln!("xtask: {problem}");
    }
    bail!("{} broken link(s) or anchor(s) in README.md and {GUIDE_SRC} (listed above)", problems.len())
}

/// Whose rules make a page's anchors: GitHub's (README.md) or mdBook's (the guide).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Renderer {
    GitHub,
    MdBook,
}

/// A markdown file as the checker needs it: the anchors it defines, the links it makes, and what
/// is wrong within it alone (a line and what).
#[derive(Debug, Default)]
struct Page {
    anchors: HashSet<String>,
    links: Vec<Link>,
    problems: Vec<(usize, String)>,
}

#[derive(Clone, Debug)]
struct Link {
    /// The destination as written (`usage.md#privileges`).
    dest: String,
    line: usize,
}

fn problems(root: &Path, kept_readme_anchors: &[&str]) -> Result<Vec<String>> {
    let guide = root.join(GUIDE_SRC);
    let mut files = vec![PathBuf::from("README.md")];
    files.extend(markdown_files(&guide)?.into_iter().map(|file| relative(root, &file)));
    let mut pages = BTreeMap::new();
    for file in &files {
        let renderer = if file.starts_with(GUIDE_SRC) { Renderer::MdBook } else { Renderer::GitHub };
        let text = std::fs::read_to_string(root.join(file))
            .with_context(|| format!("reading {}", file.display()))?;
        pages.insert(file.clone(), parse(&text, renderer));
    }
    let mut problems = Vec::new();
    for file in &files {
        let page_problems = pages[file].problems.iter();
        problems.extend(page_problems.map(|(line, problem)| format!("{}:{line}: {problem}", file.display())));
        let in_guide = file.starts_with(GUIDE_SRC);
        let links = pages[file].links.clone();
        for link in &links {
            if let Some(problem) = check_link(root, file, in_guide, link, &mut pages)? {
                problems.push(format!("{}:{}: link `{}`: {problem}", file.display(), link.line, link.dest));
            }
        }
    }
    problems.extend(pages_outside_summary(&files, &pages));
    let readme = &pages[Path::new("README.md")];
    for anchor in kept_readme_anchors {
        if !readme.anchors.contains(*anchor) {
            problems.push(format!(
                "README.md: no anchor `{anchor}`, which links from elsewhere may point at (a section the README \
                 once held): keep an `<a id=\"{anchor}\"></a>` beside the link to where that section is now"
            ));
        }
    }
    Ok(problems)
}

/// What is wrong with one link of `file`, or None. External links (with a scheme) are not followed.
fn check_link(
    root: &Path,
    file: &Path,
    in_guide: bool,
    link: &Link,
    pages: &mut BTreeMap<PathBuf, Page>,
) -> Result<Option<String>> {
    let dest = link.dest.as_str();
    if dest.is_empty() {
        return Ok(Some("an empty destination".into()));
    }
    if has_scheme(dest) || dest.starts_with("//") {
        return Ok(None);
    }
    let (path, fragment) = match dest.split_once('#') {
        Some((path, fragment)) => (path, Some(fragment)),
        None => (dest, None),
    };
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    let target = if path.is_empty() {
        file.to_owned()
    } else if let Some(from_root) = path.strip_prefix('/') {
        if in_guide {
            return Ok(Some(
                "an absolute path, which the built guide would resolve against its web server's root".into(),
            ));
        }
        normalize(Path::new(&percent_decode(from_root)))
    } else {
        normalize(&file.parent().unwrap_or(Path::new("")).join(percent_decode(path)))
    };
    if target.starts_with("..") {
        return Ok(Some("leads out of the repository".into()));
    }
    if in_guide && !target.starts_with(GUIDE_SRC) {
        return Ok(Some(format!(
            "{} is outside {GUIDE_SRC}, which mdBook does not copy into the built guide",
            target.display()
        )));
    }
    if !root.join(&target).exists() {
        return Ok(Some(format!("no file {}", target.display())));
    }
    let Some(fragment) = fragment else { return Ok(None) };
    let fragment = percent_decode(fragment);
    if target.extension().is_none_or(|extension| extension != "md") {
        return Ok(None);
    }
    if !pages.contains_key(&target) {
        // A markdown file outside the checked set (linked from README.md): GitHub renders it.
        let text = std::fs::read_to_string(root.join(&target))
            .with_context(|| format!("reading {}", target.display()))?;
        pages.insert(target.clone(), parse(&text, Renderer::GitHub));
    }
    if pages[&target].anchors.contains(&fragment) {
        return Ok(None);
    }
    Ok(Some(format!("no heading or anchor `{fragment}` in {}", target.display())))
}

/// Every markdown page of the guide must be a chapter of SUMMARY.md: mdBook leaves out the others.
fn pages_outside_summary(files: &[PathBuf], pages: &BTreeMap<PathBuf, Page>) -> Vec<String> {
    let summary = Path::new(GUIDE_SRC).join("SUMMARY.md");
    let Some(summary_page) = pages.get(&summary) else {
        return vec![format!("{}: missing: mdBook needs it", summary.display())];
    };
    let chapters: HashSet<PathBuf> = summary_page
        .links
        .iter()
        .map(|link| normalize(&Path::new(GUIDE_SRC).join(link.dest.split('#').next().unwrap_or(""))))
        .collect();
    files
        .iter()
        .filter(|file| file.starts_with(GUIDE_SRC) && **file != summary && !chapters.contains(*file))
        .map(|file| {
            format!("{}: in no chapter of SUMMARY.md, so mdBook leaves it out of the guide", file.display())
        })
        .collect()
}

/// The anchors a page defines and the links it makes, as `renderer` reads it.
fn parse(text: &str, renderer: Renderer) -> Page {
    let mut options = Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS;
    options |= Options::ENABLE_GFM;
    if renderer == Renderer::MdBook {
        // mdbook-markdown 0.5's new_cmark_parser, with its defaults.
        options |= Options::ENABLE_HEADING_ATTRIBUTES
            | Options::ENABLE_SMART_PUNCTUATION
            | Options::ENABLE_DEFINITION_LIST;
    }
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut broken_references = Vec::new();
    let parser = Parser::new_with_broken_link_callback(
        text,
        options,
        Some(|broken: BrokenLink<'_>| {
            if broken.link_type == LinkType::Reference {
                broken_references.push((broken.reference.to_string(), broken.span.start));
            }
            None
        }),
    );
    let mut page = Page::default();
    let mut used_ids = HashSet::new();
    // The heading (or mdBook's definition term) being read: its text, its explicit id, its line.
    let mut heading: Option<(String, Option<String>, usize)> = None;
    for (event, range) in parser.into_offset_iter() {
        match event {
            Event::Start(Tag::Heading { id, .. }) => {
                heading = Some((String::new(), id.map(|id| id.to_string()), line_of(range.start)))
            }
            Event::Start(Tag::DefinitionListTitle) if renderer == Renderer::MdBook => {
                heading = Some((String::new(), None, line_of(range.start)))
            }
            Event::End(TagEnd::Heading(_) | TagEnd::DefinitionListTitle) => {
                if let Some((text, id, line)) = heading.take() {
                    let id = match id {
                        Some(id) => id,
                        None => unique_id(&slug(&text, renderer), &mut used_ids),
                    };
                    page.add_anchor(id, line);
                }
            }
            Event::Text(text) | Event::Code(text) => {
                if let Some((heading_text, ..)) = &mut heading {
                    heading_text.push_str(&text);
                }
            }
            Event::Start(Tag::Link { link_type, dest_url, .. } | Tag::Image { link_type, dest_url, .. })
                if !matches!(link_type, LinkType::Email) =>
            {
                page.links.push(Link { dest: dest_url.to_string(), line: line_of(range.start) });
            }
            Event::Html(html) | Event::InlineHtml(html) => {
                let line = line_of(range.start);
                for id in html_attributes(&html, &["id", "name"]) {
                    page.add_anchor(id, line);
                }
                page.links.extend(html_attributes(&html, &["href", "src"]).map(|dest| Link { dest, line }));
            }
            _ => {}
        }
    }
    if renderer == Renderer::MdBook {
        page.links.extend(includes(text));
    }
    for (reference, offset) in broken_references {
        page.problems
            .push((line_of(offset), format!("link `[{reference}]`: no definition of that reference")));
    }
    page
}

/// The files mdBook's `{{#include PATH}}` directives of `text` take in (code blocks included:
/// the guide's examples of real output sit in them), as links to check: mdBook logs a missing file
/// and still builds, the directive left in the page. A `:anchor` or `:lines` suffix is
/// left out; a directive escaped as `\{{#include ...}}` is not one.
fn includes(text: &str) -> Vec<Link> {
    const OPEN: &str = "{{#include ";
    let mut links = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find(OPEN) {
            let escaped = rest[..at].ends_with('\\');
            let after = &rest[at + OPEN.len()..];
            let Some(end) = after.find("}}") else { break };
            let argument = after[..end].trim();
            let path = argument.split_once(':').map_or(argument, |(path, _)| path);
            if !escaped {
                links.push(Link { dest: path.to_owned(), line: index + 1 });
            }
            rest = &after[end + 2..];
        }
    }
    links
}

impl Page {
    /// Adds an anchor; one the page already has is a problem: a link to it would find the first.
    fn add_anchor(&mut self, id: String, line: usize) {
        if let Some(id) = self.anchors.replace(id) {
            self.problems.push((line, format!("anchor `{id}` is defined twice on the page")));
        }
    }
}

/// A heading's anchor. GitHub: lowercase, every character but letters, digits, `-`, `_` and spaces
/// dropped, spaces made `-`. mdBook (0.5): the same from the trimmed text, every whitespace made
/// `-`. Both take the heading's text with its inline code, without the backticks.
fn slug(text: &str, renderer: Renderer) -> String {
    let text = if renderer == Renderer::MdBook { text.trim() } else { text };
    text.to_lowercase()
        .chars()
        .filter_map(|ch| match ch {
            ch if ch.is_alphanumeric() || ch == '_' || ch == '-' => Some(ch),
            ' ' => Some('-'),
            ch if ch.is_whitespace() && renderer == Renderer::MdBook => Some('-'),
            _ => None,
        })
        .collect()
}

/// A page's second heading with the same anchor gets `-1`, the third `-2` ..., in both renderers.
fn unique_id(id: &str, used: &mut HashSet<String>) -> String {
    if used.insert(id.to_owned()) {
        return id.to_owned();
    }
    (1..)
        .map(|counter| format!("{id}-{counter}"))
        .find(|candidate| used.insert(candidate.clone()))
        .expect("an unused suffix")
}

/// The values of the named attributes in a piece of raw HTML (`<a id="usage"></a>`).
fn html_attributes<'a>(html: &'a str, names: &'a [&str]) -> impl Iterator<Item = String> + 'a {
    names.iter().flat_map(move |name| {
        let mut values = Vec::new();
        let mut rest = html;
        while let Some(at) = rest.find(&format!("{name}=")) {
            let preceded = rest[..at].chars().next_back().is_some_and(|ch| ch.is_whitespace());
            rest = &rest[at + name.len() + 1..];
            let Some(quote) = rest.chars().next().filter(|ch| *ch == '"' || *ch == '\'') else { continue };
            let Some(end) = rest[1..].find(quote) else { break };
            if preceded {
                values.push(rest[1..1 + end].to_owned());
            }
            rest = &rest[1 + end..];
        }
        values
    })
}

fn has_scheme(dest: &str) -> bool {
    let Some((scheme, _)) = dest.split_once(':') else { return false };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|ch| ch.is_ascii_alphabetic())
        && chars.all(|ch| ch.is_ascii_alphanumeric() || "+-.".contains(ch))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a/./b/../c` as `a/c`, without touching the file system; a `..` above the start stays.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.components().next_back(), Some(Component::Normal(_))) => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn relative(root: &Path, file: &Path) -> PathBuf {
    file.strip_prefix(root).unwrap_or(file).to_owned()
}

/// The markdown files under `dir`, sorted.
fn markdown_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(markdown_files(&path)?);
        } else if path.extension().is_some_and(|extension| extension == "md") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A workspace of its own under the system's temporary directory, removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str, files: &[(&str, &str)]) -> Tree {
            let root = std::env::temp_dir().join(format!("xtask-docs-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for (path, text) in files {
                let path = root.join(path);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, text).unwrap();
            }
            Tree(root)
        }

        fn problems(&self, kept: &[&str]) -> Vec<String> {
            problems(&self.0, kept).unwrap()
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const SUMMARY: &str = "# Summary\n\n- [Usage](usage.md)\n- [Outputs](outputs.md)\n";
    const USAGE: &str =
        "# Usage\n\n## Privileges\n\nSee [outputs](outputs.md#oom-kills) and [below](#process-trees).\n\n\
                         ## Process trees\n\nText.\n";
    const OUTPUTS: &str = "# Outputs\n\n## OOM kills\n\nBack to [usage](usage.md).\n";

    fn good_files(readme: &'static str) -> Vec<(&'static str, &'static str)> {
        vec![
            ("README.md", readme),
            ("docs/src/SUMMARY.md", SUMMARY),
            ("docs/src/usage.md", USAGE),
            ("docs/src/outputs.md", OUTPUTS),
            ("deploy/kubernetes/daemonset.yaml", "kind: DaemonSet\n"),
        ]
    }

    #[test]
    fn good_links_pass() {
        let readme =
            "# memtrace\n\n## Usage\n\n<a id=\"privileges\"></a>[Privileges](docs/src/usage.md#privileges), \
                      [the DaemonSet](deploy/kubernetes/daemonset.yaml), [up](#memtrace), \
                      [elsewhere](https://example.org/x.md#nothing).\n";
        let tree = Tree::new("good", &good_files(readme));
        assert_eq!(tree.problems(&["usage", "privileges"]), Vec::<String>::new());
    }

    #[test]
    fn broken_links_fail_naming_file_link_and_what_is_missing() {
        let readme = "# memtrace\n\n<a id=\"memtrace\"></a>[Privileges](docs/src/usage.md#privilege) and \
                      [gone](docs/src/gone.md) and [here](#nowhere).\n";
        let mut files = good_files(readme);
        files[2].1 = "# Usage\n\n[out](../../README.md) and [ref][nope]\n";
        let tree = Tree::new("broken", &files);
        let problems = tree.problems(&["privileges"]);
        let expect = [
            "README.md:3: link `docs/src/usage.md#privilege`: no heading or anchor `privilege` in docs/src/usage.md",
            "README.md:3: link `docs/src/gone.md`: no file docs/src/gone.md",
            "README.md:3: link `#nowhere`: no heading or anchor `nowhere` in README.md",
            "docs/src/usage.md:3: link `../../README.md`: README.md is outside docs/src",
            "docs/src/usage.md:3: link `[nope]`: no definition of that reference",
            "README.md: no anchor `privileges`",
            "README.md:3: anchor `memtrace` is defined twice on the page",
        ];
        for expected in expect {
            assert!(problems.iter().any(|p| p.starts_with(expected)), "no `{expected}` in {problems:#?}");
        }
        assert_eq!(problems.len(), 7, "{problems:#?}");
    }

    #[test]
    fn a_page_left_out_of_summary_is_named() {
        let mut files = good_files("# memtrace\n");
        files.push(("docs/src/orphan.md", "# Orphan\n"));
        let tree = Tree::new("orphan", &files);
        assert_eq!(
            tree.problems(&[]),
            ["docs/src/orphan.md: in no chapter of SUMMARY.md, so mdBook leaves it out of the guide"]
        );
    }

    #[test]
    fn anchors_are_made_as_each_renderer_makes_them() {
        let text =
            "# Windows (`--window ON/EVERY`)\n\n## The allocator's own samples\n\n## Usage\n\n## Usage\n\n\
                    ## Custom {#mine}\n\n## Real -- servers\n\nTerm\n: its definition\n";
        let book = parse(text, Renderer::MdBook).anchors;
        for anchor in [
            "windows---window-onevery",
            "the-allocators-own-samples",
            "usage",
            "usage-1",
            "mine",
            "real--servers",
            "term",
        ] {
            assert!(book.contains(anchor), "no {anchor} in {book:?}");
        }
        let github = parse(text, Renderer::GitHub).anchors;
        for anchor in ["windows---window-onevery", "usage", "usage-1", "custom-mine", "real----servers"] {
            assert!(github.contains(anchor), "no {anchor} in {github:?}");
        }
    }

    #[test]
    fn an_include_directive_must_name_a_file_of_the_guide() {
        let mut files = good_files("# memtrace\n");
        files[3].1 = "# Outputs\n\n## OOM kills\n```text\n{{#include examples/run.txt}}\n```\n\n\
                      ```text\n{{#include examples/gone.txt:2:3}}\n```\n\n\\{{#include not/a/directive.txt}}\n";
        files.push(("docs/src/examples/run.txt", "memtrace: tracing can work here\n"));
        let tree = Tree::new("include", &files);
        assert_eq!(
            tree.problems(&[]),
            ["docs/src/outputs.md:9: link `examples/gone.txt`: no file docs/src/examples/gone.txt"]
        );
    }

    #[test]
    fn html_anchors_and_paths() {
        let ids: Vec<String> =
            html_attributes("<a id=\"usage\"></a><a name='top' data-id=\"no\">", &["id", "name"]).collect();
        assert_eq!(ids, ["usage", "top"]);
        assert_eq!(normalize(Path::new("docs/src/../../README.md")), Path::new("README.md"));
        assert_eq!(normalize(Path::new("docs/../../x")), Path::new("../x"));
        assert_eq!(percent_decode("a%20b%2"), "a b%2");
        assert!(has_scheme("https://x") && has_scheme("mailto:a@b") && !has_scheme("usage.md#a:b"));
    }
}
