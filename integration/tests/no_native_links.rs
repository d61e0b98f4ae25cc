//! The default build links no native library: no crate in the dependency
//! graph of `startos-core`, `volume` and `volume-migrate` (default
//! features, host target, normal and build dependencies) declares `links`
//! in its manifest. Upstream builds static musl binaries with cargo
//! zigbuild for several targets and the core crate for macOS: a `links`
//! crate (libbtrfsutil through bindgen, say) needs a C toolchain, libclang
//! or a C library there.
//!
//! The graph comes from `cargo tree -p ...`, which resolves features for
//! the packages named alone, as `cargo build -p` does; `cargo metadata`
//! resolves the union of every workspace member's features, so it only
//! supplies each package's `links` field.
//!
//! A few pure-Rust crates declare `links` only to forbid two versions in
//! one build (prettyplease, rayon-core): should one become a dependency,
//! name it here with that reason rather than weaken the check.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

const PACKAGES: [&str; 3] = ["startos-core", "volume", "volume-migrate"];

fn cargo(args: &[&str]) -> String {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args(args)
        .arg("--manifest-path")
        .arg(&manifest)
        .output()
        .unwrap_or_else(|e| panic!("running cargo {args:?}: {e}"));
    assert!(
        out.status.success(),
        "cargo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cargo prints UTF-8")
}

/// The host triple, as cargo reports it.
fn host() -> String {
    let out = Command::new(env!("CARGO"))
        .arg("-vV")
        .output()
        .expect("running cargo -vV");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("cargo -vV names the host")
}

/// (name, version) of every package in the default-feature graph of
/// [`PACKAGES`] for `target`.
fn default_graph(target: &str) -> BTreeSet<(String, String)> {
    let mut args = vec!["tree", "-e", "normal,build", "--prefix", "none"];
    args.extend(["--format", "{p}", "--target", target]);
    for p in PACKAGES {
        args.extend(["-p", p]);
    }
    cargo(&args)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?;
            let version = words.next()?.strip_prefix('v')?;
            Some((name.to_owned(), version.to_owned()))
        })
        .collect()
}

/// The `links` value of each package cargo metadata knows for `target`.
fn links(target: &str) -> HashMap<(String, String), Option<String>> {
    let text = cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--filter-platform",
        target,
    ]);
    let meta: serde_json::Value = serde_json::from_str(&text).expect("cargo metadata is JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            let key = (
                p["name"].as_str().expect("name").to_owned(),
                p["version"].as_str().expect("version").to_owned(),
            );
            (key, p["links"].as_str().map(str::to_owned))
        })
        .collect()
}

#[test]
fn the_default_build_links_no_native_library() {
    let target = host();
    let graph = default_graph(&target);
    for must in ["volume", "volume-migrate", "startos-core", "rustix"] {
        assert!(
            graph.iter().any(|(n, _)| n == must),
            "{must} missing from the graph: {graph:?}"
        );
    }
    let links = links(&target);
    let mut native = Vec::new();
    for pkg in &graph {
        let Some(l) = links.get(pkg) else {
            panic!(
                "{} {} is in cargo tree but not in cargo metadata",
                pkg.0, pkg.1
            );
        };
        if let Some(l) = l {
            native.push(format!("{} {} (links = {l:?})", pkg.0, pkg.1));
        }
    }
    assert!(
        native.is_empty(),
        "the default build links native libraries: {}",
        native.join(", ")
    );
}
