//! The library crates keep the shape the project's rules give them: no
//! source file over 800 lines, no function over 100 (from its `fn` line to
//! its closing brace, methods and nested functions included), no glob
//! re-export (`pub use ...::*`, which hides what a public API is from its
//! reader), and no import cycle between the modules of the crate root or
//! of any folder module (`a -> b` where a file of `a` names `crate::b`,
//! `super::b` or `self::b`, in a `use`, a path or a macro's tokens, or an
//! item the parent brought in from `b` by a `use`, as `crate::Root` for
//! `crate::root::Root`). Test modules count too.
//!
//! The library crates are the workspace's members with a library target,
//! from `cargo metadata`, but the harness (`integration`) and the
//! fixtures; every `.rs` file of their `src` is read, `src/bin` included
//! (the rules hold for the tools too; a bin, a crate of its own, has no
//! place in its library's module graph).
//!
//! A violation known when the check was written is listed in [`KNOWN`],
//! printed on every run, and must go: the test fails once one is fixed
//! and still listed, so the list only shrinks. Run with `--nocapture` for
//! the figures per crate.

mod measure;
mod rules;

use std::path::{Path, PathBuf};
use std::process::Command;

use measure::Tree;
use rules::Violation;

/// Known violations, by [`Violation::key`], each with what removes it.
const KNOWN: &[(&str, &str)] = &[];

/// The workspace's root directory.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// `(name, src dir)` of each library crate, in name order.
fn library_crates(root: &Path) -> Vec<(String, PathBuf)> {
    let out = test_fs::run(
        Command::new(env!("CARGO"))
            .args([
                "metadata",
                "--no-deps",
                "--offline",
                "--format-version",
                "1",
            ])
            .arg("--manifest-path")
            .arg(root.join("Cargo.toml")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("cargo metadata: {e}"));
    let fixtures = root.join("fixtures");
    let mut crates: Vec<(String, PathBuf)> = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"] != "integration")
        .filter(|p| {
            p["manifest_path"]
                .as_str()
                .is_some_and(|m| !Path::new(m).starts_with(&fixtures))
        })
        .filter_map(|p| {
            let lib = p["targets"].as_array()?.iter().find(|t| {
                t["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == "lib"))
            })?;
            let src = Path::new(lib["src_path"].as_str()?).parent()?.to_path_buf();
            Some((p["name"].as_str()?.to_owned(), src))
        })
        .collect();
    crates.sort();
    crates
}

/// One line of figures for a crate: files, the largest, the longest fn.
/// The imports between sibling modules the cycle check saw in `tree`.
fn edges(tree: &Tree) -> usize {
    rules::graphs(tree)
        .values()
        .flat_map(|g| g.values())
        .map(|e| e.len())
        .sum()
}

fn figures(name: &str, tree: &Tree) -> String {
    let largest = tree.files.iter().max_by_key(|f| f.lines);
    let longest = tree
        .files
        .iter()
        .flat_map(|f| f.fns.iter().map(move |g| (f, g)))
        .max_by_key(|(_, g)| g.lines);
    let fns: usize = tree.files.iter().map(|f| f.fns.len()).sum();
    let lines: usize = tree.files.iter().map(|f| f.lines).sum();
    let edges = edges(tree);
    let files = tree.files.len();
    let largest = largest.map_or_else(
        || "-".to_owned(),
        |f| format!("{} ({} lines)", tree.name(f), f.lines),
    );
    let longest = longest.map_or_else(
        || "-".to_owned(),
        |(f, g)| {
            format!(
                "{} in {}:{} ({} lines)",
                g.name,
                tree.name(f),
                g.line,
                g.lines
            )
        },
    );
    let parents = rules::graphs(tree).len();
    format!(
        "{name}: {files} files, {lines} lines, {fns} fns; largest file {largest}; \
         longest fn {longest}; {edges} imports between sibling modules in {parents} module graphs"
    )
}

#[test]
fn library_crates_keep_their_shape() {
    let root = workspace();
    let crates = library_crates(&root);
    let names: Vec<&str> = crates.iter().map(|(n, _)| n.as_str()).collect();
    for expected in [
        "models",
        "startos-core",
        "test-fs",
        "volume",
        "volume-migrate",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} is not among {names:?}"
        );
    }
    let mut found: Vec<Violation> = Vec::new();
    for (name, src) in &crates {
        let label = src.strip_prefix(&root).unwrap_or(src).display().to_string();
        let tree = measure::measure(src, &label).unwrap_or_else(|e| panic!("{e}"));
        // A walk or a resolver that found nothing would pass every rule.
        assert!(
            tree.files.iter().any(|f| f.path == Path::new("lib.rs"))
                && tree.files.iter().any(|f| !f.fns.is_empty()),
            "{name}: no lib.rs or no function measured in {label}"
        );
        if name == "volume" {
            assert!(
                edges(&tree) > 10,
                "volume: its module imports were not seen"
            );
        }
        println!("{}", figures(name, &tree));
        found.extend(rules::violations(&tree));
    }
    let (known, new): (Vec<&Violation>, Vec<&Violation>) = found
        .iter()
        .partition(|v| KNOWN.iter().any(|(k, _)| *k == v.key));
    for v in &known {
        let why = KNOWN
            .iter()
            .find(|(k, _)| *k == v.key)
            .map_or("", |(_, w)| w);
        println!("known: {}\n  to be fixed by {why}", v.detail);
    }
    let fixed: Vec<&str> = KNOWN
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| !found.iter().any(|v| v.key == *k))
        .collect();
    let new: Vec<&str> = new.iter().map(|v| v.detail.as_str()).collect();
    assert!(
        new.is_empty(),
        "the library crates break the workspace's rules:\n  {}",
        new.join("\n  ")
    );
    assert!(
        fixed.is_empty(),
        "fixed, so delete from KNOWN in {}:\n  {}",
        file!(),
        fixed.join("\n  ")
    );
}
