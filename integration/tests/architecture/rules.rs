//! The rules the architecture test holds a measured tree to, each broken
//! rule a [`Violation`]: a file over [`MAX_FILE_LINES`], a function over
//! [`MAX_FN_LINES`], a glob re-export, an import cycle between the modules
//! of one parent (the crate root's, or a folder module's), and what would
//! hide an import from that check.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::measure::{ModPath, Tree, resolve};

/// The most lines a source file may have.
pub const MAX_FILE_LINES: usize = 800;
/// The most lines a function may have, from its `fn` line to its closing
/// brace.
pub const MAX_FN_LINES: usize = 100;

/// One broken rule.
#[derive(Debug)]
pub struct Violation {
    /// What it is without line numbers, stable while the code moves: how
    /// the list of known violations names it.
    pub key: String,
    /// Where it is and what it measures.
    pub detail: String,
}

/// Every rule `tree` breaks.
pub fn violations(tree: &Tree) -> Vec<Violation> {
    let mut out = Vec::new();
    for file in &tree.files {
        let name = tree.name(file);
        if file.lines > MAX_FILE_LINES {
            out.push(Violation {
                key: format!("file over {MAX_FILE_LINES} lines: {name}"),
                detail: format!("{name}: {} lines", file.lines),
            });
        }
        for f in file.fns.iter().filter(|f| f.lines > MAX_FN_LINES) {
            out.push(Violation {
                key: format!("fn over {MAX_FN_LINES} lines: {name}: {}", f.name),
                detail: format!("{name}:{}: fn {}: {} lines", f.line, f.name, f.lines),
            });
        }
        if !file.glob_reexports.is_empty() {
            let lines: Vec<String> = file.glob_reexports.iter().map(|l| l.to_string()).collect();
            out.push(Violation {
                key: format!("glob re-export: {name}"),
                detail: format!("{name}: `pub use ...::*` at lines {}", lines.join(", ")),
            });
        }
        for (at, what) in &file.hidden_edges {
            out.push(Violation {
                key: format!("hidden module edge: {name}: {what}"),
                detail: format!("{name}:{at}: {what} hides its imports from the cycle check"),
            });
        }
    }
    out.extend(cycles(tree));
    out
}

/// Sibling modules' edges, by parent: `parent -> from -> to -> where`.
type Graphs = BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>>;

/// The graphs of the modules of each parent module: an edge `a -> b` where
/// a file of `parent::a` names `parent::b` or an item in it, directly or
/// through a name a `use` brought into `parent` (`crate::Root` for
/// `crate::root::Root`), with the first place it does.
pub fn graphs(tree: &Tree) -> Graphs {
    let modules: BTreeSet<&[String]> = tree
        .files
        .iter()
        .flat_map(|f| &f.modules)
        .map(Vec::as_slice)
        .collect();
    let aliases = aliases(tree, &modules);
    let mut graphs = Graphs::new();
    for file in &tree.files {
        for r in &file.refs {
            let to = through_aliases(&r.to, &modules, &aliases);
            let k = r.from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if k >= r.from.len() || k >= to.len() || !modules.contains(&to[..=k]) {
                continue;
            }
            graphs
                .entry(r.from[..k].to_vec())
                .or_default()
                .entry(r.from[k].clone())
                .or_default()
                .entry(to[k].clone())
                .or_insert_with(|| format!("{}:{}", tree.name(file), r.line));
        }
    }
    graphs
}

/// `(module, name) -> path from the crate root`.
type Aliases = BTreeMap<(ModPath, String), Vec<String>>;

/// The names `use` items bring into modules from this crate.
fn aliases(tree: &Tree, modules: &BTreeSet<&[String]>) -> Aliases {
    let mut out = BTreeMap::new();
    for a in tree.files.iter().flat_map(|f| &f.aliases) {
        let child = |first: &String| {
            let mut m = a.module.clone();
            m.push(first.clone());
            modules.contains(m.as_slice())
        };
        let target = resolve(&a.module, &a.path).or_else(|| {
            let first = a.path.first()?;
            child(first).then(|| a.module.iter().chain(&a.path).cloned().collect())
        });
        if let Some(target) = target {
            out.insert((a.module.clone(), a.name.clone()), target);
        }
    }
    out
}

/// `path` with each name a `use` brought in replaced by what it names,
/// until it runs through modules to an item (at most a few rounds: a
/// re-export of a re-export).
fn through_aliases(
    path: &[String],
    modules: &BTreeSet<&[String]>,
    aliases: &Aliases,
) -> Vec<String> {
    let mut path = path.to_vec();
    'rounds: for _ in 0..8 {
        for i in 0..path.len() {
            if modules.contains(&path[..=i]) {
                continue;
            }
            if let Some(target) = aliases.get(&(path[..i].to_vec(), path[i].clone())) {
                let rest = path.split_off(i + 1);
                path = target.iter().chain(&rest).cloned().collect();
                continue 'rounds;
            }
            break 'rounds;
        }
        break;
    }
    path
}

/// One violation for each set of sibling modules that reach each other,
/// naming one cycle through it and where each of its edges is.
fn cycles(tree: &Tree) -> Vec<Violation> {
    let mut out = Vec::new();
    for (parent, edges) in graphs(tree) {
        let reach = |from: &str| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from.to_owned()];
            while let Some(n) = todo.pop() {
                for next in edges.get(&n).into_iter().flat_map(|e| e.keys()) {
                    if seen.insert(next.clone()) {
                        todo.push(next.clone());
                    }
                }
            }
            seen
        };
        let mut done = BTreeSet::new();
        for node in edges.keys() {
            if done.contains(node) || !reach(node).contains(node) {
                continue;
            }
            let from_node = reach(node);
            let members: BTreeSet<String> = from_node
                .into_iter()
                .filter(|m| reach(m).contains(node))
                .collect();
            done.extend(members.iter().cloned());
            let cycle = shortest_cycle(node, &edges);
            let scope = match parent.is_empty() {
                true => format!("{} (crate root)", tree.label),
                false => format!("{}: crate::{}", tree.label, parent.join("::")),
            };
            let names: Vec<&str> = members.iter().map(String::as_str).collect();
            let inner: Vec<String> = members
                .iter()
                .flat_map(|a| {
                    edges
                        .get(a)
                        .into_iter()
                        .flatten()
                        .map(move |(b, at)| (a, b, at))
                })
                .filter(|(_, b, _)| members.contains(*b))
                .map(|(a, b, at)| format!("{a} -> {b} ({at})"))
                .collect();
            out.push(Violation {
                key: format!("import cycle in {scope} between {}", names.join(", ")),
                detail: format!(
                    "import cycle in {scope} between {}: {}; its edges: {}",
                    names.join(", "),
                    cycle.join(" -> "),
                    inner.join("; ")
                ),
            });
        }
    }
    out
}

/// The shortest `start -> ... -> start` path, by breadth first.
fn shortest_cycle(start: &str, edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<String> {
    let mut back: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(n) = queue.pop_front() {
        for next in edges.get(n).into_iter().flat_map(|e| e.keys()) {
            if next == start {
                let mut path = vec![start.to_owned()];
                let mut at = n;
                while at != start {
                    path.push(at.to_owned());
                    at = back[at];
                }
                path.push(start.to_owned());
                path.reverse();
                return path;
            }
            if !back.contains_key(next.as_str()) {
                back.insert(next, n);
                queue.push_back(next);
            }
        }
    }
    vec![start.to_owned()]
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::measure::measure;
    use super::*;

    /// The violations of a tree of `files` (`(path, text)`) in a temp dir.
    fn check(files: &[(&str, &str)]) -> Vec<Violation> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
        for (path, text) in files {
            let path = dir.path().join(path);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
            }
            fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let tree = measure(dir.path(), "t/src").unwrap_or_else(|e| panic!("{e}"));
        violations(&tree)
    }

    fn details(v: &[Violation]) -> Vec<&str> {
        v.iter().map(|v| v.detail.as_str()).collect()
    }

    /// A function of `lines` lines, its body all statements.
    fn fn_of(name: &str, lines: usize) -> String {
        let body: String = (0..lines - 2)
            .map(|i| format!("    let _x{i} = {i};\n"))
            .collect();
        format!("fn {name}() {{\n{body}}}\n")
    }

    #[test]
    fn a_clean_tree_breaks_no_rule() {
        let lib = format!("mod a;\nmod b;\n{}", fn_of("long", MAX_FN_LINES));
        let v = check(&[
            ("lib.rs", &lib),
            (
                "a.rs",
                "use crate::b::X;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
            ),
            ("b.rs", "pub struct X;\npub use crate::Y as Z;\n"),
            ("bin/tool.rs", "use crate::a::B;\nfn main() {}\n"),
        ]);
        assert!(v.is_empty(), "{:?}", details(&v));
    }

    #[test]
    fn a_fn_one_line_over_is_named_with_its_owner() {
        let body = fn_of("long", MAX_FN_LINES + 1).replace('\n', "\n    ");
        let lib = format!("struct S;\nimpl S {{\n    {body}}}\n");
        let v = check(&[("lib.rs", &lib)]);
        assert_eq!(details(&v), ["t/src/lib.rs:3: fn S::long: 101 lines"]);
    }

    #[test]
    fn a_file_one_line_over_is_named() {
        let v = check(&[("lib.rs", &"//\n".repeat(MAX_FILE_LINES + 1))]);
        assert_eq!(details(&v), ["t/src/lib.rs: 801 lines"]);
    }

    #[test]
    fn a_glob_reexport_is_named_with_its_lines() {
        let v = check(&[("lib.rs", "mod a;\npub use a::*;\n"), ("a.rs", "")]);
        assert_eq!(details(&v), ["t/src/lib.rs: `pub use ...::*` at lines 2"]);
    }

    #[test]
    fn two_top_level_modules_naming_each_other_are_a_cycle() {
        let v = check(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a.rs", "use crate::b::X;\n"),
            ("b/mod.rs", "mod inner;\n"),
            ("b/inner.rs", "fn f() { crate::c::g(); }\n"),
            (
                "c.rs",
                "fn g() { tracing::warn!(\"{}\", super::a::h()); }\n",
            ),
        ]);
        assert_eq!(
            details(&v),
            [
                "import cycle in t/src (crate root) between a, b, c: a -> b -> c -> a; its edges: \
              a -> b (t/src/a.rs:1); b -> c (t/src/b/inner.rs:1); c -> a (t/src/c.rs:1)"
            ]
        );
        assert_eq!(
            v[0].key,
            "import cycle in t/src (crate root) between a, b, c"
        );
    }

    #[test]
    fn submodules_naming_each_other_are_a_cycle_of_their_folder() {
        let v = check(&[
            ("lib.rs", "mod s;\n"),
            ("s/mod.rs", "mod x;\nmod y;\n"),
            ("s/x.rs", "use super::y::Y;\n"),
            ("s/y.rs", "use crate::s::x::X;\n"),
        ]);
        assert_eq!(
            details(&v),
            [
                "import cycle in t/src: crate::s between x, y: x -> y -> x; its edges: \
              x -> y (t/src/s/x.rs:1); y -> x (t/src/s/y.rs:1)"
            ]
        );
    }

    #[test]
    fn a_name_the_parent_reexports_leads_to_its_module() {
        let v = check(&[
            (
                "lib.rs",
                "mod a;\nmod b;\npub use a::A;\nuse b::B as Bee;\n",
            ),
            ("a.rs", "pub struct A;\nfn f() -> crate::Bee { todo!() }\n"),
            ("b.rs", "pub struct B(crate::A);\n"),
        ]);
        assert_eq!(
            details(&v),
            [
                "import cycle in t/src (crate root) between a, b: a -> b -> a; its edges: \
              a -> b (t/src/a.rs:2); b -> a (t/src/b.rs:1)"
            ]
        );
    }

    #[test]
    fn what_would_hide_an_import_is_named() {
        let v = check(&[
            ("lib.rs", "mod a;\n#[path = \"elsewhere.rs\"]\nmod b;\n"),
            (
                "a.rs",
                "use super::*;\nuse std::io::*;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n\
                 #[cfg(all(test, feature = \"x\"))]\nmod more {\n    use crate::*;\n}\n",
            ),
            ("elsewhere.rs", "pub fn f() {}\n"),
        ]);
        assert_eq!(
            details(&v),
            [
                "t/src/a.rs:1: a glob import of the crate's own modules hides its imports from \
                 the cycle check",
                "t/src/lib.rs:3: a `#[path]` module hides its imports from the cycle check",
            ]
        );
    }

    #[test]
    fn a_path_to_an_item_of_the_parent_is_no_edge() {
        let v = check(&[
            ("lib.rs", "mod a;\nmod b;\npub struct R;\n"),
            ("a.rs", "use crate::R;\nuse crate::b;\n"),
            ("b.rs", "pub(crate) fn f(_: crate::R) {}\n"),
        ]);
        assert!(v.is_empty(), "{:?}", details(&v));
    }
}
