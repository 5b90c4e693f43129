//! No two files of `actors/src/` import each other: the modules' uses form
//! a graph without two-way edges, so each file can be read (and changed)
//! knowing only what it uses. Every `crate::…`, `super::…` and `self::…`
//! path of a file (in `use` items and in code) is resolved to the file that
//! defines it; a pair of files that reach each other fails the test.

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

/// `src/api/openai.rs` → `api::openai`; `src/api/mod.rs` → `api`.
fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// Collects the module-relative paths a file names.
struct Paths<'a> {
    here: &'a ModulePath,
    /// Modules (inline `mod x { … }`) entered so far inside the file.
    inline: Vec<String>,
    found: BTreeSet<ModulePath>,
}

impl Paths<'_> {
    /// Resolves a path's leading `crate`/`super`/`self` to a module path.
    fn resolve(&mut self, segments: &[String]) {
        let mut base: ModulePath = self.here.clone();
        base.extend(self.inline.iter().cloned());
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("super") | Some("self") => {
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
            _ => return,
        }
        base.extend(rest.iter().cloned());
        self.found.insert(base);
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(prefix, &path.tree);
                prefix.pop();
            }
            syn::UseTree::Name(name) => {
                prefix.push(name.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Rename(rename) => {
                prefix.push(rename.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.resolve(&prefix.clone()),
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }
}

impl Paths<'_> {
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
            self.resolve(&path.clone());
        }
        path.clear();
    }
}

impl<'ast> Visit<'ast> for Paths<'_> {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.resolve(&segments);
        syn::visit::visit_path(self, path);
    }

    /// Macro bodies are tokens to syn: paths in them are read off the
    /// tokens (`crate :: a :: b`).
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.inline.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.inline.pop();
    }
}

/// The file that defines the longest prefix of `path`.
fn file_of(path: &ModulePath, files: &BTreeMap<ModulePath, PathBuf>) -> Option<PathBuf> {
    (0..=path.len())
        .rev()
        .find_map(|n| files.get(&path[..n]).cloned())
}

#[test]
fn no_two_files_of_the_crate_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = Vec::new();
    source_files(&src, &mut sources);
    let files: BTreeMap<ModulePath, PathBuf> = sources
        .iter()
        .map(|f| (module_of(&src, f), f.clone()))
        .collect();
    let mut edges: BTreeSet<(PathBuf, PathBuf)> = BTreeSet::new();
    for (module, file) in &files {
        let text = std::fs::read_to_string(file).expect("a readable file");
        let syntax = syn::parse_file(&text).expect("a file that parses");
        let mut paths = Paths {
            here: module,
            inline: Vec::new(),
            found: BTreeSet::new(),
        };
        paths.visit_file(&syntax);
        for used in &paths.found {
            if let Some(target) = file_of(used, &files) {
                if &target != file {
                    edges.insert((file.clone(), target));
                }
            }
        }
    }
    assert!(edges.len() > 20, "the graph was not read: {edges:?}");
    let name = |f: &PathBuf| f.strip_prefix(&src).unwrap_or(f).display().to_string();
    let two_way: Vec<String> = edges
        .iter()
        .filter(|(a, b)| a < b && edges.contains(&(b.clone(), a.clone())))
        .map(|(a, b)| format!("{} <-> {}", name(a), name(b)))
        .collect();
    assert!(
        two_way.is_empty(),
        "files that import each other: {two_way:#?}"
    );
}
