//! The dry run says what the run will do, through the CLI: with the method
//! forced to a snapshot of the parent, it refuses what the run refuses,
//! with the run's reason; with `--keep-old`, it promises no removal the
//! run does not make. And the run says what it removed.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use integration::{LoopFs, fs_or_skip};

/// `volume-migrate --root root args`: (exit code, stdout, stderr).
fn cli(root: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(volume_migrate_bin())
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("running volume-migrate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn package(root: &Path, name: &str) {
    fs::create_dir_all(root.join(name).join("data/main")).unwrap();
    fs::write(root.join(name).join("data/main/db"), name).unwrap();
}

/// The dry run with the method forced, then the run: the dry run refuses
/// every one of `packages` (none would convert), those of `caused` with a
/// reason containing `cause`, and the run refuses each with that same
/// reason, converting nothing.
#[track_caller]
fn refused_alike(root: &Path, packages: &[&str], caused: &[&str], cause: &str) {
    let forced = ["--method", "snapshot-parent"];
    let (code, dry, err) = cli(root, &["--dry-run", forced[0], forced[1]]);
    assert_eq!(code, 0, "{dry}{err}");
    assert!(!dry.contains("would convert"), "{dry}");
    let (code, run, err) = cli(root, &forced);
    assert_eq!(code, 1, "{run}{err}");
    assert!(!run.contains("converted"), "{run}");
    for p in packages {
        let prefix = format!("would refuse {p}: ");
        let why = dry
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no refusal of {p}:\n{dry}"));
        assert!(!caused.contains(p) || why.contains(cause), "{why}");
        assert!(
            err.lines()
                .any(|l| l.ends_with(&format!("package {p}: {why}"))),
            "the run's reason for {p} differs from the dry run's ({why}):\n{err}"
        );
    }
}

/// A tmpfs mounted inside one package's tree, then a preallocated file in
/// the parent outside the packages: each makes the run refuse a forced
/// snapshot of every package, and the dry run said it would convert them.
#[test]
fn a_forced_snapshot_the_run_refuses_is_refused_by_the_dry_run() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let packages = ["p1", "p2", "p3"];
    for p in packages {
        package(&root, p);
    }
    let mount = MountGuard::tmpfs(&root.join("p2/data/main/mnt"));
    // p2 is refused whatever the method (its tree holds a mount), the
    // others for the snapshot, which the mount would leave out.
    let mounted = "is mounted inside its subvolume";
    refused_alike(&root, &packages, &["p1", "p3"], mounted);
    mount.unmount();

    fs::create_dir(fs.path("elsewhere")).unwrap();
    let prealloc = fs::File::create(fs.path("elsewhere/prealloc.log")).unwrap();
    rustix::fs::fallocate(&prealloc, rustix::fs::FallocateFlags::empty(), 0, 1 << 20).unwrap();
    drop(prealloc);
    refused_alike(&root, &packages, &packages, "NOCOW or preallocated");
}

/// After a run that kept the old trees, the dry run with `--keep-old`
/// promises nothing (a run with it removes nothing), and without it
/// promises the removal, which the run then reports, package by package,
/// in text and in JSON.
#[test]
fn old_trees_kept_or_removed_as_the_dry_run_says() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    package(&root, "k1");
    let (code, out, err) = cli(&root, &["--keep-old", "--method", "clone"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(root.join("k1.migrate-old").exists(), "{out}");

    let (_, dry, err) = cli(&root, &["--dry-run", "--keep-old"]);
    assert_eq!(dry.trim(), "nothing to convert", "{err}");
    let (code, out, err) = cli(&root, &["--keep-old"]);
    assert_eq!((code, out.trim()), (0, "nothing to convert"), "{err}");
    assert!(root.join("k1.migrate-old").exists(), "{out}");

    let (_, dry, _) = cli(&root, &["--dry-run"]);
    assert!(
        dry.contains("would finish k1:") && dry.contains("old trees to remove"),
        "{dry}"
    );
    let (code, out, err) = cli(&root, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.trim(), "removed the old trees of k1", "{err}");
    assert!(!root.join("k1.migrate-old").exists(), "{out}");

    package(&root, "k2");
    let (code, out, err) = cli(&root, &["--keep-old", "--method", "clone"]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&root, &["--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let removed: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "old-removed")
        .collect();
    assert_eq!(removed.len(), 1, "{out}");
    assert_eq!(removed[0]["package"], "k2", "{out}");
    assert!(!root.join("k2.migrate-old").exists(), "{out}");
}
