//! No circles among the modules of any crate of the workspace: every crate's
//! `use` graph between its files has no strongly connected component of more
//! than one file. So each file can be read, and changed, knowing only the
//! files below it.
//!
//! Every `crate::…`, `super::…` and `self::…` path of a file (in `use` items,
//! in code and in macro bodies) is resolved to the file that defines it. A
//! path through a re-export (`pub use`) is followed to where the item is
//! defined: a re-export is transparent, so it neither makes a circle (a
//! facade `mod.rs` re-exporting its children) nor hides one (the user of a
//! re-exported item uses the file that defines it). A parent's `mod child;`
//! is not a use; a path that starts with a child module's name is.

// Test code: an unwrap or expect that fails is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module's path from the crate root, e.g. `["api", "openai"]`.
type ModulePath = Vec<String>;

fn source_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).expect("a readable source folder");
    for entry in entries.map(|e| e.expect("a folder entry").path()) {
        if entry.is_dir() {
            source_files(&entry, found);
        } else if entry.extension().is_some_and(|e| e == "rs") {
            found.push(entry);
        }
    }
}

/// `src/api/openai.rs` → `api::openai`; `src/api/mod.rs` → `api`;
/// `src/main.rs` and `src/lib.rs` → the root. (`src/bin/*` are crates of
/// their own and are skipped by the caller.)
fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let crate_root = parts.len() == 1 && matches!(parts[0].as_str(), "lib" | "main");
    if crate_root || parts.last().map(String::as_str) == Some("mod") {
        parts.pop();
    }
    parts
}

/// Resolves a path's leading `crate`/`super`/`self`, or a child module's
/// name, against the module `here`; `None` for paths into other crates and
/// for names of the module's own items.
fn resolve(
    modules: &BTreeSet<ModulePath>,
    here: &ModulePath,
    segments: &[String],
) -> Option<ModulePath> {
    let mut base = here.clone();
    let mut rest = segments;
    match rest.first().map(String::as_str) {
        Some(child) if !matches!(child, "crate" | "super" | "self") => {
            base.push(child.to_string());
            if !modules.contains(&base) {
                return None;
            }
            base.pop();
        }
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("super" | "self") => {
            while let Some(first) = rest.first() {
                match first.as_str() {
                    "super" => {
                        base.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// What one file names: the module paths it uses, and what it re-exports.
struct Paths<'a> {
    modules: &'a BTreeSet<ModulePath>,
    file_module: &'a ModulePath,
    /// Modules (inline `mod x { … }`) entered so far inside the file.
    inline: Vec<String>,
    used: BTreeSet<ModulePath>,
    /// `pub use a::b::C as D` → `D` to `a::b::C` (resolved).
    reexports: BTreeMap<String, ModulePath>,
    /// The first names of every path in the file: a re-exported name among
    /// them is used by the file itself too.
    first_names: BTreeSet<String>,
}

impl Paths<'_> {
    fn here(&self) -> ModulePath {
        let mut here = self.file_module.clone();
        here.extend(self.inline.iter().cloned());
        here
    }

    fn note(&mut self, segments: &[String]) {
        if let Some(resolved) = resolve(self.modules, &self.here(), segments) {
            self.used.insert(resolved);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, public: bool) {
        // A re-export at the file's top is recorded, not used; one in an
        // inline module (rare) counts as a use.
        let leaf = |paths: &mut Self, prefix: &[String], name: Option<String>| {
            let resolved = resolve(paths.modules, &paths.here(), prefix);
            match (public && paths.inline.is_empty(), resolved, name) {
                (true, Some(resolved), Some(name)) => {
                    paths.reexports.insert(name, resolved);
                }
                (true, _, None) => {}
                (_, Some(resolved), _) => {
                    paths.used.insert(resolved);
                }
                _ => {}
            }
        };
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(prefix, &path.tree, public);
                prefix.pop();
            }
            syn::UseTree::Name(name) => {
                prefix.push(name.ident.to_string());
                leaf(self, prefix, Some(name.ident.to_string()));
                prefix.pop();
            }
            syn::UseTree::Rename(rename) => {
                prefix.push(rename.ident.to_string());
                leaf(self, prefix, Some(rename.rename.to_string()));
                prefix.pop();
            }
            syn::UseTree::Glob(_) => leaf(self, prefix, None),
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(prefix, tree, public);
                }
            }
        }
    }

    /// Macro bodies are tokens to syn: paths in them are read off the
    /// tokens (`crate :: a :: b`).
    fn tokens(&mut self, tokens: proc_macro2::TokenStream) {
        let mut path: Vec<String> = Vec::new();
        // After an identifier of a path: a `::` continues it.
        let mut colons = 0;
        for token in tokens {
            match token {
                proc_macro2::TokenTree::Group(group) => {
                    self.end_path(&mut path);
                    self.tokens(group.stream());
                }
                proc_macro2::TokenTree::Ident(ident) => {
                    let name = ident.to_string();
                    let starts = matches!(name.as_str(), "crate" | "super" | "self");
                    if !path.is_empty() && colons == 2 {
                        path.push(name);
                    } else {
                        self.end_path(&mut path);
                        if starts {
                            path.push(name);
                        }
                    }
                    colons = 0;
                }
                proc_macro2::TokenTree::Punct(punct) if punct.as_char() == ':' => colons += 1,
                _ => {
                    self.end_path(&mut path);
                    colons = 0;
                }
            }
        }
        self.end_path(&mut path);
    }

    fn end_path(&mut self, path: &mut Vec<String>) {
        if path.len() > 1 {
            self.note(&path.clone());
        }
        path.clear();
    }
}

impl<'ast> Visit<'ast> for Paths<'_> {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let public = !matches!(item.vis, syn::Visibility::Inherited);
        self.use_tree(&mut Vec::new(), &item.tree, public);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if let Some(first) = segments.first() {
            self.first_names.insert(first.clone());
        }
        // One segment names a local or an imported item (the `use` was
        // noted), never a module: a variable may share a module's name.
        if segments.len() > 1 {
            self.note(&segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }

    /// `pub(super)` names a module without using it.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.inline.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.inline.pop();
    }
}

/// One crate's files: each module's file and what the file re-exports.
struct Crate {
    src: PathBuf,
    files: BTreeMap<ModulePath, PathBuf>,
    reexports: BTreeMap<PathBuf, BTreeMap<String, ModulePath>>,
}

impl Crate {
    /// The file that defines `path`: the longest prefix that is a module's
    /// file, through that file's re-exports to where the item lives.
    fn file_of(&self, path: &ModulePath) -> Option<PathBuf> {
        let mut path = path.clone();
        // A re-export chain longer than this is itself a circle.
        for _ in 0..16 {
            let n = (0..=path.len())
                .rev()
                .find(|&n| self.files.contains_key(&path[..n]))?;
            let file = self.files[&path[..n]].clone();
            let through = path
                .get(n)
                .and_then(|name| self.reexports.get(&file)?.get(name));
            match through {
                Some(target) if *target != path[..=n] => {
                    let mut next = target.clone();
                    next.extend(path[n + 1..].iter().cloned());
                    path = next;
                }
                _ => return Some(file),
            }
        }
        None
    }
}

/// The files each file uses, with one path (`a::b::C`) that uses it.
type Edges = BTreeMap<PathBuf, BTreeMap<PathBuf, String>>;

/// Each file of the crate at `src`, and the files it uses.
fn use_graph(src: &Path) -> (Crate, Edges) {
    let mut sources = Vec::new();
    source_files(src, &mut sources);
    sources.retain(|f| !f.strip_prefix(src).is_ok_and(|r| r.starts_with("bin")));
    let mut krate = Crate {
        src: src.to_path_buf(),
        files: sources
            .iter()
            .map(|f| (module_of(src, f), f.clone()))
            .collect(),
        reexports: BTreeMap::new(),
    };
    let modules: BTreeSet<ModulePath> = krate.files.keys().cloned().collect();
    let mut used: BTreeMap<PathBuf, BTreeSet<ModulePath>> = BTreeMap::new();
    for (module, file) in &krate.files {
        let text = std::fs::read_to_string(file).expect("a readable file");
        let syntax = syn::parse_file(&text).expect("a file that parses");
        let mut paths = Paths {
            modules: &modules,
            file_module: module,
            inline: Vec::new(),
            used: BTreeSet::new(),
            reexports: BTreeMap::new(),
            first_names: BTreeSet::new(),
        };
        paths.visit_file(&syntax);
        for (name, target) in &paths.reexports {
            if paths.first_names.contains(name) {
                paths.used.insert(target.clone());
            }
        }
        used.insert(file.clone(), paths.used);
        krate.reexports.insert(file.clone(), paths.reexports);
    }
    let mut edges = Edges::new();
    for (file, paths) in &used {
        let targets = edges.entry(file.clone()).or_default();
        for path in paths {
            if let Some(target) = krate.file_of(path) {
                if &target != file {
                    targets.entry(target).or_insert_with(|| path.join("::"));
                }
            }
        }
    }
    (krate, edges)
}

/// Tarjan's strongly connected components of more than one node.
fn circles(edges: &Edges) -> Vec<Vec<PathBuf>> {
    struct Walk<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, node: &'a PathBuf) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            self.on_stack.insert(node);
            for next in self.edges.get(node).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(top) = self.stack.pop() {
                    self.on_stack.remove(top);
                    component.push(top.clone());
                    if top == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in edges.keys() {
        if !walk.index.contains_key(node) {
            walk.visit(node);
        }
    }
    walk.found
}

/// The workspace's crates: the root package and each folder beside it with
/// a `Cargo.toml` and a `src/`.
fn crate_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = vec![root.join("src")];
    let mut folders: Vec<PathBuf> = std::fs::read_dir(root)
        .expect("the workspace folder")
        .map(|e| e.expect("a folder entry").path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .map(|p| p.join("src"))
        .collect();
    folders.sort();
    found.extend(folders);
    found
}

#[test]
fn no_crate_has_a_circle_of_modules() {
    let mut report = Vec::new();
    let mut files_read = 0;
    for src in crate_sources() {
        let (krate, edges) = use_graph(&src);
        files_read += krate.files.len();
        let name = |f: &PathBuf| {
            f.strip_prefix(&krate.src)
                .unwrap_or(f)
                .display()
                .to_string()
        };
        for circle in circles(&edges) {
            let names: Vec<String> = circle.iter().map(name).collect();
            report.push(format!("{}: {}", src.display(), names.join(" ⇄ ")));
            // The edges inside the circle, with a path that makes each.
            for from in &circle {
                for (to, why) in &edges[from] {
                    if circle.contains(to) {
                        report.push(format!("    {} → {} ({why})", name(from), name(to)));
                    }
                }
            }
        }
    }
    assert!(
        files_read > 100,
        "the workspace was not read: {files_read} files"
    );
    assert!(
        report.is_empty(),
        "circles of modules:\n{}",
        report.join("\n")
    );
}

/// The checker itself finds what it must: a three-file circle, a circle
/// through a parent's `super::`, and none through a facade's re-export.
#[test]
fn the_checker_finds_circles_of_three_and_follows_reexports() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let src = dir.path().join("src");
    let write = |path: &str, text: &str| {
        let file = src.join(path);
        std::fs::create_dir_all(file.parent().expect("a parent")).expect("a folder");
        std::fs::write(file, text).expect("a written file");
    };
    write("lib.rs", "mod a; mod b; mod c; mod facade; pub use a::A;");
    write("a.rs", "pub struct A; fn f() -> crate::b::B { todo!() }");
    write("b.rs", "pub struct B(crate::c::C);");
    write("c.rs", "pub struct C; use super::A;");
    write(
        "facade/mod.rs",
        "mod inner; pub use inner::Inner; pub struct Top;",
    );
    write(
        "facade/inner.rs",
        "pub struct Inner; pub fn g() -> crate::facade::Top { todo!() }",
    );
    let (_, edges) = use_graph(&src);
    let found = circles(&edges);
    let names: Vec<Vec<String>> = found
        .iter()
        .map(|c| {
            c.iter()
                .map(|f| f.strip_prefix(&src).unwrap_or(f).display().to_string())
                .collect()
        })
        .collect();
    assert_eq!(
        names,
        vec![vec!["a.rs".to_string(), "b.rs".into(), "c.rs".into()]]
    );
    // The facade's child naming its parent is no circle (the parent only
    // re-exports the child) until the parent uses the child's items, here
    // through a path that starts with the child's name.
    write(
        "facade/mod.rs",
        "mod inner; pub use inner::Inner; pub struct Top; fn h() { inner::g(); }",
    );
    let (_, edges) = use_graph(&src);
    assert_eq!(circles(&edges).len(), 2, "{edges:#?}");
}
