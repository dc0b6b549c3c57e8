//! `cargo xtask circles`, and a check of `cargo xtask test`: no module of memtrace-user or
//! memtrace-ebpf imports one that imports it back.
//!
//! Each crate's sources are read as text and parsed with syn into a file-level import graph: an
//! edge `a.rs -> b.rs` when a.rs names something defined in b.rs, through `use crate::...`,
//! `use super::...`, `use self::...`, a `use` or path that starts at a module a.rs declares, or a
//! path such as `crate::x::y::Z` or `super::Z` in code (macro arguments included). A path resolves
//! to the file of its longest module prefix: `crate::a::b::C` to a/b.rs (or a/b/mod.rs), or to
//! a/b/c.rs when `c` is itself a module. A `mod x;` declaration is not an edge; a `pub use`
//! re-export is. A module imported under another name (`use process::allocator;` in main.rs) is
//! that module: `crate::allocator::X` names process/allocator.rs. Inline modules
//! (`mod tests { ... }`) belong to their file, so a test's `use super::*` ties nothing.
//!
//! Every edge that lies on a circle is shown once, in the shortest circle through it (shortest
//! circles first), with the names that tie each edge: they say what to move. A name only
//! `#[cfg(test)]` code uses is marked "(in tests)": it counts all the same, as the test is the
//! module's too, but it is often the cheaper side to move.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// The crates whose module graphs must run one way, relative to the workspace root.
pub const CHECKED: [&str; 2] = ["memtrace-user/src", "memtrace-ebpf/src"];

/// Marks a name that only `#[cfg(test)]` code uses.
const IN_TESTS: &str = " (in tests)";

/// What to do about a circle, as every report ends.
const ADVICE: &str = "cut each circle by moving the type or function to the side it belongs to (a lower \
                      module both sides can use), not by re-exporting it";

/// A crate's files (paths relative to its source directory) and who names what in whom.
#[derive(Debug, Default)]
pub struct Graph {
    /// Each module path (`["serve", "http"]`) and the file that holds it; inline modules share
    /// their file.
    modules: BTreeMap<Vec<String>, String>,
    /// Modules brought in by `use` under another path (`use process::allocator;` in main.rs makes
    /// `crate::allocator` the module `process::allocator`): a path through one names the module.
    aliases: BTreeMap<Vec<String>, Vec<String>>,
    /// `(from, to)` and the names by which `from` reaches into `to`.
    edges: BTreeMap<(String, String), BTreeSet<String>>,
}

/// One circle: the files in order, the first repeated at the end.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Circle(pub Vec<String>);

impl Graph {
    /// Reads the crate rooted at `src/main.rs` (or `src/lib.rs`) and every module it declares.
    pub fn read(src: &Path) -> Result<Self> {
        let root = ["main.rs", "lib.rs"]
            .iter()
            .map(|name| src.join(name))
            .find(|path| path.is_file())
            .with_context(|| format!("{} has neither main.rs nor lib.rs", src.display()))?;
        let mut graph = Graph::default();
        let mut parsed = Vec::new();
        let mut pending = vec![(Vec::new(), root)];
        while let Some((module, path)) = pending.pop() {
            let text =
                std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let file = syn::parse_file(&text).with_context(|| format!("parsing {}", path.display()))?;
            let name = relative(src, &path);
            let dir = children_dir(&path);
            declare(&mut graph.modules, &mut pending, &name, &module, &dir, &file.items)?;
            parsed.push((name, module, file));
        }
        graph.find_aliases(&parsed);
        for (name, module, file) in &parsed {
            let mut names =
                Names { graph: &graph, module: module.clone(), in_tests: false, found: Vec::new() };
            names.visit_file(file);
            let found = std::mem::take(&mut names.found);
            for (to, what) in found {
                if &to != name {
                    graph.edges.entry((name.clone(), to)).or_default().insert(what);
                }
            }
        }
        for names in graph.edges.values_mut() {
            let also_outside: Vec<String> = names
                .iter()
                .filter(|name| names.contains(name.trim_end_matches(IN_TESTS)))
                .cloned()
                .collect();
            for name in also_outside.into_iter().filter(|name| name.ends_with(IN_TESTS)) {
                names.remove(&name);
            }
        }
        Ok(graph)
    }

    /// Every `use` that names a module, as an alias; a few rounds, for aliases of aliases.
    fn find_aliases(&mut self, parsed: &[(String, Vec<String>, syn::File)]) {
        for _ in 0..4 {
            let mut found = Vec::new();
            for (_, module, file) in parsed {
                uses_in(module, &file.items, &mut |module, path, name| {
                    let real = self.absolute(module, path).and_then(|path| self.module_at(&path));
                    if let Some(real) = real {
                        let mut alias = module.to_vec();
                        alias.push(name);
                        if alias != real {
                            found.push((alias, real));
                        }
                    }
                });
            }
            let before = self.aliases.len();
            self.aliases.extend(found);
            if self.aliases.len() == before {
                return;
            }
        }
    }

    /// A path written in `module` from the crate's root; None for paths that start anywhere but
    /// at `crate`, `super`, `self` or a module seen here (another crate, a local item).
    fn absolute(&self, module: &[String], segments: &[String]) -> Option<Vec<String>> {
        let first = segments.first()?;
        let (base, rest) = match first.as_str() {
            "crate" => (Vec::new(), &segments[1..]),
            "self" => (module.to_vec(), &segments[1..]),
            "super" => {
                let supers = segments.iter().take_while(|segment| *segment == "super").count();
                (module[..module.len().checked_sub(supers)?].to_vec(), &segments[supers..])
            }
            _ => {
                let mut child = module.to_vec();
                child.push(first.clone());
                self.module_at(&child)?;
                (module.to_vec(), segments)
            }
        };
        Some(base.into_iter().chain(rest.iter().cloned()).collect())
    }

    /// The module a path from the root names, through aliases; None if it names none.
    fn module_at(&self, path: &[String]) -> Option<Vec<String>> {
        let mut at = Vec::new();
        for segment in path {
            at.push(segment.clone());
            if !self.modules.contains_key(&at) {
                at = self.aliases.get(&at)?.clone();
            }
        }
        Some(at)
    }

    /// The file that holds what a path from the root names (its longest module prefix), and the
    /// name: the first segment past that prefix, or the module's own when the path names one.
    fn locate(&self, path: &[String]) -> Option<(String, String)> {
        let mut at: Vec<String> = Vec::new();
        for segment in path {
            let mut next = at.clone();
            next.push(segment.clone());
            if !self.modules.contains_key(&next) {
                match self.aliases.get(&next) {
                    Some(real) => next = real.clone(),
                    None => return Some((self.modules.get(&at)?.clone(), segment.clone())),
                }
            }
            at = next;
        }
        Some((self.modules.get(&at)?.clone(), path.last()?.clone()))
    }

    /// The names by which `from` reaches into `to`, if it does.
    pub fn names(&self, from: &str, to: &str) -> Option<&BTreeSet<String>> {
        self.edges.get(&(from.to_owned(), to.to_owned()))
    }

    fn next<'a>(&'a self, from: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.edges.keys().filter(move |(a, _)| a == from).map(|(_, b)| b.as_str())
    }

    /// The shortest way from `from` to `to`, both included.
    fn shortest_path(&self, from: &str, to: &str) -> Option<Vec<String>> {
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([from]);
        while let Some(at) = queue.pop_front() {
            if at == to {
                let mut path = vec![to.to_owned()];
                let mut step = to;
                while step != from {
                    step = came_from[step];
                    path.push(step.to_owned());
                }
                path.reverse();
                return Some(path);
            }
            for next in self.next(at) {
                if next != from && !came_from.contains_key(next) {
                    came_from.insert(next, at);
                    queue.push_back(next);
                }
            }
        }
        None
    }

    /// The circles to report: the shortest way back through each edge that lies on a circle,
    /// shortest first, each kept only if it shows an edge that no circle kept before it does (in a
    /// knot of many files, every edge of every circle is shown once, not every circle).
    pub fn circles(&self) -> Vec<Circle> {
        let mut candidates: Vec<Circle> = self
            .edges
            .keys()
            .filter_map(|(from, to)| {
                let back = self.shortest_path(to, from)?;
                Some(Circle::starting_at_least(std::iter::once(from.clone()).chain(back).collect()))
            })
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        candidates.sort_by_key(|circle| circle.0.len());
        let mut shown: BTreeSet<(&str, &str)> = BTreeSet::new();
        let mut circles = Vec::new();
        for circle in &candidates {
            let edges: Vec<(&str, &str)> =
                circle.0.windows(2).map(|pair| (pair[0].as_str(), pair[1].as_str())).collect();
            if edges.iter().any(|edge| !shown.contains(edge)) {
                shown.extend(edges);
                circles.push(circle.clone());
            }
        }
        circles
    }
}

impl Circle {
    /// The same circle told from its (alphabetically) first file, so that each is listed once.
    fn starting_at_least(mut files: Vec<String>) -> Self {
        files.pop();
        let start = (0..files.len()).min_by_key(|&at| &files[at]).unwrap_or(0);
        files.rotate_left(start);
        files.push(files[0].clone());
        Circle(files)
    }

    /// `a.rs -> b.rs -> a.rs`.
    pub fn line(&self) -> String {
        self.0.join(" -> ")
    }
}

/// Records the modules `items` declare (in `module`, held by `file`) and queues their files.
fn declare(
    modules: &mut BTreeMap<Vec<String>, String>,
    pending: &mut Vec<(Vec<String>, PathBuf)>,
    file: &str,
    module: &[String],
    dir: &Path,
    items: &[syn::Item],
) -> Result<()> {
    modules.insert(module.to_vec(), file.to_owned());
    for item in items {
        let syn::Item::Mod(declared) = item else { continue };
        let name = declared.ident.to_string();
        let mut path = module.to_vec();
        path.push(name.clone());
        match &declared.content {
            Some((_, inner)) => declare(modules, pending, file, &path, &dir.join(&name), inner)?,
            None => {
                let candidates = [dir.join(format!("{name}.rs")), dir.join(&name).join("mod.rs")];
                let found =
                    candidates.iter().find(|candidate| candidate.is_file()).cloned().with_context(|| {
                        format!(
                            "{file} declares `mod {name};` but neither {} nor {} exists (the circles check \
                         follows no #[path] attribute)",
                            candidates[0].display(),
                            candidates[1].display()
                        )
                    })?;
                pending.push((path, found));
            }
        }
    }
    Ok(())
}

/// Where the files of a file's child modules are: beside main.rs, lib.rs and mod.rs; in a folder
/// named after any other file.
fn children_dir(path: &Path) -> PathBuf {
    let parent = path.parent().unwrap_or(Path::new("")).to_owned();
    match path.file_name().and_then(|name| name.to_str()) {
        Some("main.rs" | "lib.rs" | "mod.rs") => parent,
        _ => parent.join(path.file_stem().unwrap_or_default()),
    }
}

fn relative(src: &Path, path: &Path) -> String {
    path.strip_prefix(src).unwrap_or(path).to_string_lossy().into_owned()
}

/// Calls `each(module, path, local name)` for every name that a `use` in `items` brings in.
fn uses_in(module: &[String], items: &[syn::Item], each: &mut impl FnMut(&[String], &[String], String)) {
    for item in items {
        match item {
            syn::Item::Use(used) => {
                let mut paths = Vec::new();
                flatten(&used.tree, &mut Vec::new(), &mut paths);
                for (path, name) in paths.into_iter().filter(|(_, name)| name != "*") {
                    each(module, &path, name);
                }
            }
            syn::Item::Mod(syn::ItemMod { ident, content: Some((_, inner)), .. }) => {
                let mut inner_module = module.to_vec();
                inner_module.push(ident.to_string());
                uses_in(&inner_module, inner, each);
            }
            _ => {}
        }
    }
}

/// A `use` tree as whole paths and the names they take here: `use a::{b::{self, C as D}, *}`
/// gives `a::b` as b, `a::b::C` as D and `a::*` as *.
fn flatten(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    let mut leaf = |prefix: &mut Vec<String>, segment: String, name: String| {
        if segment == "self" {
            let name = prefix.last().cloned().unwrap_or(name);
            out.push((prefix.clone(), name));
        } else {
            let mut path = prefix.clone();
            path.push(segment);
            out.push((path, name));
        }
    };
    match tree {
        syn::UseTree::Path(path) => {
            prefix.push(path.ident.to_string());
            flatten(&path.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(name) => leaf(prefix, name.ident.to_string(), name.ident.to_string()),
        syn::UseTree::Rename(rename) => leaf(prefix, rename.ident.to_string(), rename.rename.to_string()),
        syn::UseTree::Glob(_) => leaf(prefix, "*".to_owned(), "*".to_owned()),
        syn::UseTree::Group(group) => {
            for tree in &group.items {
                flatten(tree, prefix, out);
            }
        }
    }
}

/// Walks one file and finds every file it names something of, with the name.
struct Names<'a> {
    graph: &'a Graph,
    /// The module being walked (deeper than the file's own inside an inline module).
    module: Vec<String>,
    /// Inside a `#[cfg(test)]` item: what it names is marked IN_TESTS.
    in_tests: bool,
    found: Vec<(String, String)>,
}

impl Names<'_> {
    /// Notes the file that a path written in `self.module` names something of, if any.
    fn resolve(&mut self, segments: &[String]) {
        if segments.len() < 2 {
            return;
        }
        let found = self.graph.absolute(&self.module, segments).and_then(|path| self.graph.locate(&path));
        let mark = if self.in_tests { IN_TESTS } else { "" };
        self.found.extend(found.map(|(file, name)| (file, format!("{name}{mark}"))));
    }

    /// Paths inside a macro's arguments, which syn leaves as tokens: every `a::b::c` run.
    fn tokens(&mut self, tokens: TokenStream) {
        let mut run: Vec<String> = Vec::new();
        let mut colons = 0;
        for token in tokens {
            match token {
                TokenTree::Ident(ident) if run.is_empty() || colons == 2 => {
                    run.push(ident.to_string());
                    colons = 0;
                }
                TokenTree::Punct(punct) if punct.as_char() == ':' && !run.is_empty() && colons < 2 => {
                    colons += 1;
                }
                other => {
                    self.end_run(&mut run);
                    colons = 0;
                    match other {
                        TokenTree::Group(group) => self.tokens(group.stream()),
                        TokenTree::Ident(ident) => run.push(ident.to_string()),
                        _ => {}
                    }
                }
            }
        }
        self.end_run(&mut run);
    }

    fn end_run(&mut self, run: &mut Vec<String>) {
        if run.len() > 1 {
            self.resolve(run);
        }
        run.clear();
    }
}

impl<'ast> Visit<'ast> for Names<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let was_in_tests = self.in_tests;
        self.in_tests |= is_test_only(item);
        syn::visit::visit_item(self, item);
        self.in_tests = was_in_tests;
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut paths = Vec::new();
        flatten(&item.tree, &mut Vec::new(), &mut paths);
        for (path, _) in paths {
            self.resolve(&path);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if let Some((_, items)) = &item.content {
            self.module.push(item.ident.to_string());
            for item in items {
                self.visit_item(item);
            }
            self.module.pop();
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments: Vec<String> =
                path.segments.iter().map(|segment| segment.ident.to_string()).collect();
            if segments.len() > 1 {
                self.resolve(&segments);
            }
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.tokens(mac.tokens.clone());
    }

    /// `pub(crate)`, `pub(super)` and `pub(in crate::x)` say who may see an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}
}

/// Whether an item is compiled only for tests (`#[cfg(test)]`).
fn is_test_only(item: &syn::Item) -> bool {
    let attrs: &[syn::Attribute] = match item {
        syn::Item::Mod(item) => &item.attrs,
        syn::Item::Fn(item) => &item.attrs,
        syn::Item::Impl(item) => &item.attrs,
        syn::Item::Use(item) => &item.attrs,
        syn::Item::Struct(item) => &item.attrs,
        syn::Item::Const(item) => &item.attrs,
        _ => &[],
    };
    attrs.iter().any(|attr| match &attr.meta {
        syn::Meta::List(list) => list.path.is_ident("cfg") && list.tokens.to_string() == "test",
        _ => false,
    })
}

/// The report of one crate's circles: each circle, then the names that tie each of its edges.
pub fn report(crate_dir: &str, graph: &Graph, circles: &[Circle]) -> String {
    let mut text = format!(
        "{crate_dir}: {} circle(s) between modules (a module imports one that imports it back):\n",
        circles.len()
    );
    for circle in circles {
        let _ = writeln!(text, "  {}", circle.line());
        for pair in circle.0.windows(2) {
            let names =
                graph.names(&pair[0], &pair[1]).map(|names| names.iter().cloned().collect::<Vec<_>>());
            let _ =
                writeln!(text, "      {} -> {}: {}", pair[0], pair[1], names.unwrap_or_default().join(", "));
        }
    }
    text
}

/// Reads every checked crate under `root` (or the crates in `dirs`, if any); fails naming each
/// circle, and says so when there is none.
pub fn check(root: &Path, dirs: &[PathBuf]) -> Result<()> {
    let dirs: Vec<PathBuf> =
        if dirs.is_empty() { CHECKED.iter().map(|dir| root.join(dir)).collect() } else { dirs.to_vec() };
    let mut found = String::new();
    for dir in &dirs {
        let graph = Graph::read(dir)?;
        let circles = graph.circles();
        if !circles.is_empty() {
            let shown = dir.strip_prefix(root).unwrap_or(dir).display().to_string();
            found.push_str(&report(&shown, &graph, &circles));
        }
    }
    if !found.is_empty() {
        bail!("{found}{ADVICE}");
    }
    let shown: Vec<String> =
        dirs.iter().map(|dir| dir.strip_prefix(root).unwrap_or(dir).display().to_string()).collect();
    eprintln!("xtask: no circles between modules in {}", shown.join(" or "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate in a fresh temporary directory, removed when the test is done with it.
    struct Tree(PathBuf);

    impl std::ops::Deref for Tree {
        type Target = Path;

        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A crate in a fresh temporary directory, from `(path, text)` pairs.
    fn tree(name: &str, files: &[(&str, &str)]) -> Tree {
        let dir = std::env::temp_dir().join(format!("xtask-circles-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        Tree(dir)
    }

    fn lines(dir: &Path) -> Vec<String> {
        Graph::read(dir).unwrap().circles().iter().map(Circle::line).collect()
    }

    #[test]
    fn a_circle_through_a_nested_module_is_reported_with_its_names() {
        let dir = tree(
            "circle",
            &[
                ("main.rs", "mod a;\nmod b;\nfn main() {}\n"),
                ("a.rs", "use crate::b::inner::Thing;\npub struct Other;\n"),
                ("b/mod.rs", "pub mod inner;\n"),
                ("b/inner.rs", "pub struct Thing;\nfn make() -> crate::a::Other { crate::a::Other }\n"),
            ],
        );
        let graph = Graph::read(&dir).unwrap();
        let circles = graph.circles();
        assert_eq!(circles.iter().map(Circle::line).collect::<Vec<_>>(), ["a.rs -> b/inner.rs -> a.rs"]);
        assert_eq!(graph.names("a.rs", "b/inner.rs").unwrap().iter().collect::<Vec<_>>(), ["Thing"]);
        assert_eq!(graph.names("b/inner.rs", "a.rs").unwrap().iter().collect::<Vec<_>>(), ["Other"]);
        let report = report("src", &graph, &circles);
        assert!(report.contains("a.rs -> b/inner.rs: Thing"), "{report}");
        // `mod inner;` is no edge: b/mod.rs is on no circle.
        assert!(graph.names("b/mod.rs", "b/inner.rs").is_none());
    }

    #[test]
    fn one_way_imports_make_no_circle() {
        let dir = tree(
            "one-way",
            &[
                ("main.rs", "mod low;\nmod high;\nuse high::run;\nfn main() { run() }\n"),
                ("low.rs", "pub struct Fact;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n"),
                ("high.rs", "use crate::low::Fact;\npub(crate) fn run() { let _ = format!(\"{:?}\", 1); }\n"),
            ],
        );
        let graph = Graph::read(&dir).unwrap();
        assert_eq!(graph.names("high.rs", "low.rs").unwrap().iter().collect::<Vec<_>>(), ["Fact"]);
        assert!(lines(&dir).is_empty(), "{:?}", lines(&dir));
        // pub(crate) is no reference to the crate root.
        assert!(Graph::read(&dir).unwrap().names("high.rs", "main.rs").is_none());
    }

    #[test]
    fn a_childs_use_super_counts_when_the_parent_uses_the_child() {
        let dir = tree(
            "super",
            &[
                ("main.rs", "mod serve;\nfn main() {}\n"),
                ("serve/mod.rs", "mod http;\npub struct Shared;\nfn start() { http::Server::start(); }\n"),
                ("serve/http.rs", "use super::Shared;\npub struct Server;\n"),
            ],
        );
        assert_eq!(lines(&dir), ["serve/http.rs -> serve/mod.rs -> serve/http.rs"]);
    }

    #[test]
    fn what_only_tests_use_is_marked_and_still_counts() {
        let dir = tree(
            "tests",
            &[
                ("main.rs", "mod low;\nmod high;\nfn main() {}\n"),
                ("low.rs", "pub struct Fact;\n#[cfg(test)]\nmod tests {\n    use crate::high::run;\n}\n"),
                (
                    "high.rs",
                    "use crate::low::Fact;\npub fn run() {}\n#[cfg(test)]\nfn t() -> Fact { Fact }\n",
                ),
            ],
        );
        let graph = Graph::read(&dir).unwrap();
        assert_eq!(lines(&dir), ["high.rs -> low.rs -> high.rs"]);
        assert_eq!(graph.names("low.rs", "high.rs").unwrap().iter().collect::<Vec<_>>(), ["run (in tests)"]);
        // Named outside tests too: not marked.
        assert_eq!(graph.names("high.rs", "low.rs").unwrap().iter().collect::<Vec<_>>(), ["Fact"]);
    }

    #[test]
    fn a_module_imported_at_the_root_is_that_module() {
        let dir = tree(
            "alias",
            &[
                (
                    "main.rs",
                    "mod process;
mod session;
use process::allocator;
fn main() { session::run() }
",
                ),
                (
                    "process/mod.rs",
                    "pub mod allocator;
",
                ),
                (
                    "process/allocator.rs",
                    "pub fn find() {}
",
                ),
                (
                    "session.rs",
                    "pub fn run() { crate::allocator::find() }
",
                ),
            ],
        );
        let graph = Graph::read(&dir).unwrap();
        assert!(graph.circles().is_empty(), "{:?}", graph.circles());
        assert_eq!(
            graph.names("session.rs", "process/allocator.rs").unwrap().iter().collect::<Vec<_>>(),
            ["find"]
        );
    }

    #[test]
    fn re_exports_and_paths_in_macros_are_edges() {
        let dir = tree(
            "macros",
            &[
                ("main.rs", "mod a;\nmod b;\nmod c;\nfn main() {}\n"),
                ("a.rs", "pub use crate::b::B;\npub struct A;\n"),
                ("b.rs", "pub struct B;\nfn f() { println!(\"{}\", crate::c::C); }\n"),
                ("c.rs", "pub struct C;\nfn g() -> usize { std::mem::size_of::<super::a::A>() }\n"),
            ],
        );
        assert_eq!(lines(&dir), ["a.rs -> b.rs -> c.rs -> a.rs"]);
    }
}
