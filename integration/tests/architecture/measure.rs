//! What the architecture test reads from one crate's `src` directory: each
//! file's length, its functions' extents, its glob re-exports, and every
//! path it names through `crate::`, `super::` or `self::`, resolved to a
//! path from the crate root. Parsed by `syn`, so strings, comments and
//! `r#"..."#` never pass for code; what a macro invocation holds is only
//! tokens to `syn`, so paths are also picked out of those.

use std::fs;
use std::path::{Path, PathBuf};

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// A module's path from the crate root (`[]` is the root, `["store",
/// "removal"]` is `crate::store::removal`).
pub type ModPath = Vec<String>;

/// One function: its name with the impl, trait or function it sits in,
/// and its extent from the `fn` line to the closing brace's line.
pub struct FnLen {
    /// `Type::method`, `outer::inner`, or the bare name.
    pub name: String,
    /// The `fn` keyword's line.
    pub line: usize,
    /// Lines from the `fn` line to the closing brace, both included.
    pub lines: usize,
}

/// A path a file names, resolved from the crate root.
pub struct Ref {
    /// The module the path is named in (inline modules included).
    pub from: ModPath,
    /// The path named, from the crate root: a module, or an item in one.
    pub to: Vec<String>,
    /// Where it is named.
    pub line: usize,
}

/// A name a `use` brings into a module: `use root::Root;` in `lib.rs`
/// makes `crate::Root` name `crate::root::Root`.
pub struct Alias {
    /// The module the `use` is in.
    pub module: ModPath,
    /// The name it brings in (the last segment, or the `as` name).
    pub name: String,
    /// The path as written: from `crate`, `super`, `self`, a child module
    /// of `module`, or another crate.
    pub path: Vec<String>,
}

/// One source file, measured.
pub struct SourceFile {
    /// Relative to the tree's root.
    pub path: PathBuf,
    /// Its lines.
    pub lines: usize,
    /// Every function with a body: free, method, trait default, nested.
    pub fns: Vec<FnLen>,
    /// The lines of its `use` items with a visibility and a `*`.
    pub glob_reexports: Vec<usize>,
    /// What would hide an import from the cycle check, with its line: a
    /// glob import of the crate's own modules outside a `#[cfg(test)]`
    /// module (its names are used bare), a `#[path]` module (its file is
    /// not where the layout puts it).
    pub hidden_edges: Vec<(usize, &'static str)>,
    /// Paths named through `crate::`, `super::`, `self::` (none for a
    /// file of `src/bin`, a crate of its own).
    pub refs: Vec<Ref>,
    /// The names its `use` items bring in (none for a file of `src/bin`).
    pub aliases: Vec<Alias>,
    /// The modules it defines: its own and its inline ones (none for a
    /// file of `src/bin`).
    pub modules: Vec<ModPath>,
}

/// A crate's `src` directory, measured.
pub struct Tree {
    /// How messages name the directory (`volume/src`).
    pub label: String,
    /// Every `.rs` file below it, in path order.
    pub files: Vec<SourceFile>,
}

impl Tree {
    /// `label/path`, how a message names a file of the tree.
    pub fn name(&self, file: &SourceFile) -> String {
        format!("{}/{}", self.label, file.path.display())
    }
}

/// Reads and parses every `.rs` file below `src`.
pub fn measure(src: &Path, label: &str) -> Result<Tree, String> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths)?;
    paths.sort();
    let mut files = Vec::new();
    for path in paths {
        let rel = path
            .strip_prefix(src)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .to_path_buf();
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        files.push(measure_file(rel, &text).map_err(|e| format!("{label}/{e}"))?);
    }
    Ok(Tree {
        label: label.to_owned(),
        files,
    })
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The module a file of `src` is, by the 2018 layout (`lib.rs`, `foo.rs`,
/// `foo/mod.rs`, `foo/bar.rs`); `None` for `src/bin` and `main.rs`, crates
/// of their own.
fn module_of(rel: &Path) -> Option<ModPath> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") || parts == ["main.rs"] {
        return None;
    }
    let file = parts.pop()?;
    match file.strip_suffix(".rs")? {
        "lib" if parts.is_empty() => {}
        "mod" => {}
        stem => parts.push(stem.to_owned()),
    }
    Some(parts)
}

/// Measures one file, `rel` from the tree's root, holding `text`.
pub fn measure_file(rel: PathBuf, text: &str) -> Result<SourceFile, String> {
    let ast = syn::parse_file(text).map_err(|e| {
        let at = e.span().start();
        format!("{}:{}: does not parse: {e}", rel.display(), at.line)
    })?;
    let module = module_of(&rel);
    let mut v = Visitor {
        module: module.clone().unwrap_or_default(),
        graph: module.is_some(),
        owners: Vec::new(),
        fns: Vec::new(),
        globs: Vec::new(),
        hidden: Vec::new(),
        tests: 0,
        refs: Vec::new(),
        aliases: Vec::new(),
        modules: module.into_iter().collect(),
    };
    v.visit_file(&ast);
    Ok(SourceFile {
        path: rel,
        lines: text.lines().count(),
        fns: v.fns,
        glob_reexports: v.globs,
        hidden_edges: v.hidden,
        refs: v.refs,
        aliases: v.aliases,
        modules: v.modules,
    })
}

struct Visitor {
    module: ModPath,
    /// Whether the file is part of the library's module tree.
    graph: bool,
    /// The impl types, traits and functions around the current item.
    owners: Vec<String>,
    fns: Vec<FnLen>,
    globs: Vec<usize>,
    hidden: Vec<(usize, &'static str)>,
    /// How many `#[cfg(test)]` modules enclose the current item.
    tests: usize,
    refs: Vec<Ref>,
    aliases: Vec<Alias>,
    modules: Vec<ModPath>,
}

fn line(span: Span) -> usize {
    span.start().line
}

impl Visitor {
    fn record_fn(&mut self, sig: &syn::Signature, block: &syn::Block) {
        let first = line(sig.fn_token.span);
        let last = block.brace_token.span.close().end().line;
        let mut name = self.owners.join("::");
        if !name.is_empty() {
            name.push_str("::");
        }
        name.push_str(&sig.ident.to_string());
        self.fns.push(FnLen {
            name,
            line: first,
            lines: last + 1 - first,
        });
    }

    /// Records `segs` (as written, `crate`/`super`/`self` first) if it
    /// resolves from the current module.
    fn record_ref(&mut self, segs: &[String], at: usize) {
        if !self.graph {
            return;
        }
        if let Some(to) = resolve(&self.module, segs) {
            self.refs.push(Ref {
                from: self.module.clone(),
                to,
                line: at,
            });
        }
    }

    fn with_owner(&mut self, owner: String, f: impl FnOnce(&mut Self)) {
        self.owners.push(owner);
        f(self);
        self.owners.pop();
    }
}

/// `segs`, named in `module`, as a path from the crate root; `None` for a
/// path that does not start at `crate`, `super` or `self`.
pub fn resolve(module: &[String], segs: &[String]) -> Option<Vec<String>> {
    let (base, rest): (&[String], &[String]) = match segs.first()?.as_str() {
        "crate" => (&[], &segs[1..]),
        "self" => (module, &segs[1..]),
        "super" => {
            let ups = segs.iter().take_while(|s| *s == "super").count();
            (module.get(..module.len().checked_sub(ups)?)?, &segs[ups..])
        }
        _ => return None,
    };
    Some(base.iter().chain(rest).cloned().collect())
}

/// A leaf of a use tree: the path, the name it brings in (none for a
/// glob), its line.
type UseLeaf = (Vec<String>, Option<String>, usize);

/// The leaves of a use tree (`a::{self, b as c}` gives `a` named `a` and
/// `a::b` named `c`; a glob gives the path it globs).
fn use_leaves(prefix: &mut Vec<String>, tree: &syn::UseTree, out: &mut Vec<UseLeaf>) {
    let at = |id: &syn::Ident| line(id.span());
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(prefix, &p.tree, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) if n.ident == "self" => {
            out.push((prefix.clone(), prefix.last().cloned(), at(&n.ident)));
        }
        syn::UseTree::Name(n) => {
            out.push((
                with(prefix, &n.ident),
                Some(n.ident.to_string()),
                at(&n.ident),
            ));
        }
        syn::UseTree::Rename(r) => {
            out.push((
                with(prefix, &r.ident),
                Some(r.rename.to_string()),
                at(&r.ident),
            ));
        }
        syn::UseTree::Glob(g) => out.push((prefix.clone(), None, line(g.star_token.span))),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| use_leaves(prefix, t, out)),
    }
}

fn with(prefix: &[String], ident: &syn::Ident) -> Vec<String> {
    let mut p = prefix.to_vec();
    p.push(ident.to_string());
    p
}

/// `#[cfg(test)]`, or `#[cfg(all(test, ...))]`: compiled for tests only.
fn is_cfg_test(a: &syn::Attribute) -> bool {
    match &a.meta {
        syn::Meta::List(l) if l.path.is_ident("cfg") => test_only(l.tokens.clone()),
        _ => false,
    }
}

/// Whether the cfg predicate `ts` holds only under test: `test`, or an
/// `all(...)` with such a predicate among its own.
fn test_only(ts: proc_macro2::TokenStream) -> bool {
    use proc_macro2::TokenTree;
    let tokens: Vec<TokenTree> = ts.into_iter().collect();
    match tokens.as_slice() {
        [TokenTree::Ident(i)] => i == "test",
        [TokenTree::Ident(i), TokenTree::Group(g)] if i == "all" => {
            let mut parts = vec![Vec::new()];
            for t in g.stream() {
                match t {
                    TokenTree::Punct(p) if p.as_char() == ',' => parts.push(Vec::new()),
                    t => {
                        if let Some(part) = parts.last_mut() {
                            part.push(t);
                        }
                    }
                }
            }
            parts
                .into_iter()
                .any(|part| test_only(part.into_iter().collect()))
        }
        _ => false,
    }
}

fn has_glob(tree: &syn::UseTree) -> bool {
    match tree {
        syn::UseTree::Path(p) => has_glob(&p.tree),
        syn::UseTree::Glob(_) => true,
        syn::UseTree::Group(g) => g.items.iter().any(has_glob),
        syn::UseTree::Name(_) | syn::UseTree::Rename(_) => false,
    }
}

/// The `crate::a::b`, `super::a`, `self::a` paths in a macro's tokens, with
/// their lines.
fn token_paths(tokens: TokenStream, out: &mut Vec<(Vec<String>, usize)>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let is_sep = |i: usize| {
        matches!((tokens.get(i), tokens.get(i + 1)),
            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) if a.as_char() == ':' && b.as_char() == ':')
    };
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Group(g) => token_paths(g.stream(), out),
            TokenTree::Ident(id)
                if matches!(id.to_string().as_str(), "crate" | "super" | "self")
                    && !(i >= 2 && is_sep(i - 2)) =>
            {
                let mut segs = vec![id.to_string()];
                let mut j = i + 1;
                while is_sep(j)
                    && let Some(TokenTree::Ident(next)) = tokens.get(j + 2)
                {
                    segs.push(next.to_string());
                    j += 3;
                }
                if segs.len() > 1 {
                    out.push((segs, line(id.span())));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
}

impl<'ast> Visit<'ast> for Visitor {
    fn visit_item_fn(&mut self, i: &'ast syn::ItemFn) {
        self.record_fn(&i.sig, &i.block);
        self.with_owner(i.sig.ident.to_string(), |v| visit::visit_item_fn(v, i));
    }

    fn visit_impl_item_fn(&mut self, i: &'ast syn::ImplItemFn) {
        self.record_fn(&i.sig, &i.block);
        self.with_owner(i.sig.ident.to_string(), |v| visit::visit_impl_item_fn(v, i));
    }

    fn visit_trait_item_fn(&mut self, i: &'ast syn::TraitItemFn) {
        if let Some(block) = &i.default {
            self.record_fn(&i.sig, block);
        }
        self.with_owner(i.sig.ident.to_string(), |v| {
            visit::visit_trait_item_fn(v, i)
        });
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        let owner = match &*i.self_ty {
            syn::Type::Path(p) => p
                .path
                .segments
                .last()
                .map_or_else(|| "impl".to_owned(), |s| s.ident.to_string()),
            _ => "impl".to_owned(),
        };
        self.with_owner(owner, |v| visit::visit_item_impl(v, i));
    }

    fn visit_item_trait(&mut self, i: &'ast syn::ItemTrait) {
        self.with_owner(i.ident.to_string(), |v| visit::visit_item_trait(v, i));
    }

    fn visit_item_mod(&mut self, i: &'ast syn::ItemMod) {
        if i.attrs.iter().any(|a| a.path().is_ident("path")) {
            self.hidden
                .push((line(i.ident.span()), "a `#[path]` module"));
        }
        if i.content.is_none() {
            return;
        }
        let test = i.attrs.iter().any(is_cfg_test);
        self.tests += usize::from(test);
        self.module.push(i.ident.to_string());
        if self.graph {
            self.modules.push(self.module.clone());
        }
        let owners = std::mem::take(&mut self.owners);
        visit::visit_item_mod(self, i);
        self.owners = owners;
        self.module.pop();
        self.tests -= usize::from(test);
    }

    fn visit_item_use(&mut self, i: &'ast syn::ItemUse) {
        if !matches!(i.vis, syn::Visibility::Inherited) && has_glob(&i.tree) {
            self.globs.push(line(i.use_token.span));
        }
        let mut leaves = Vec::new();
        use_leaves(&mut Vec::new(), &i.tree, &mut leaves);
        for (segs, name, at) in leaves {
            let own = segs
                .first()
                .is_some_and(|f| ["crate", "super", "self"].contains(&f.as_str()));
            if self.graph && name.is_none() && own && self.tests == 0 {
                self.hidden
                    .push((at, "a glob import of the crate's own modules"));
            }
            self.record_ref(&segs, at);
            if let Some(name) = name.filter(|n| self.graph && n != "_") {
                self.aliases.push(Alias {
                    module: self.module.clone(),
                    name,
                    path: segs,
                });
            }
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() {
            let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
            if let Some(first) = p.segments.first() {
                self.record_ref(&segs, line(first.ident.span()));
            }
        }
        visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        let mut found = Vec::new();
        token_paths(m.tokens.clone(), &mut found);
        for (segs, at) in found {
            self.record_ref(&segs, at);
        }
        visit::visit_macro(self, m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(rel: &str, text: &str) -> SourceFile {
        measure_file(PathBuf::from(rel), text).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_fn_runs_from_its_fn_line_to_its_closing_brace() {
        let text = "/// Doc.\n#[inline]\nfn a() {\n    let s = \"}\";\n    // }\n}\n\
                    struct S;\nimpl S {\n    fn m(&self) {\n        fn inner() {}\n    }\n}\n";
        let f = file("lib.rs", text);
        let fns: Vec<(&str, usize, usize)> = f
            .fns
            .iter()
            .map(|f| (f.name.as_str(), f.line, f.lines))
            .collect();
        assert_eq!(fns, [("a", 3, 4), ("S::m", 9, 3), ("S::m::inner", 10, 1)]);
    }

    #[test]
    fn files_are_the_modules_of_the_2018_layout() {
        let m = |p: &str| module_of(Path::new(p));
        assert_eq!(m("lib.rs"), Some(vec![]));
        assert_eq!(m("store.rs"), Some(vec!["store".to_owned()]));
        assert_eq!(m("store/mod.rs"), Some(vec!["store".to_owned()]));
        assert_eq!(
            m("store/removal.rs"),
            Some(vec!["store".to_owned(), "removal".to_owned()])
        );
        assert_eq!(m("bin/tool.rs"), None);
    }

    #[test]
    fn paths_resolve_from_the_module_they_are_named_in() {
        let text = "use super::b::X;\nuse crate::{c, d::{self, Y}};\nfn f() { self::e::g(); \
                    tracing::warn!(\"{}\", crate::h::i()); }\n";
        let f = file("a/x.rs", text);
        let to: Vec<String> = f.refs.iter().map(|r| r.to.join("::")).collect();
        assert_eq!(to, ["a::b::X", "c", "d", "d::Y", "a::x::e::g", "h::i"]);
    }

    #[test]
    fn only_a_use_with_a_visibility_and_a_star_is_a_glob_reexport() {
        let text = "pub use a::*;\npub(crate) use b::{c, d::*};\nuse e::*;\n\
                    #[cfg(test)]\nmod tests {\n    use super::*;\n}\n";
        assert_eq!(file("lib.rs", text).glob_reexports, [1, 2]);
    }
}
