//! The conversion's identity promise wherever the volumes root sits: at the
//! top of the filesystem, one level below, inside a subvolume mounted with
//! `subvol=`, beside and around other subvolumes, on a `nodatasum` mount.
//! On each, the dry run and the run agree package by package, and every
//! package the dry run says is snapshotted keeps every file's inode number
//! and birth time. A run that falls back from a snapshot to a clone says so
//! in its report, by package and why.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use integration::identity::Identity;
use integration::{FsKind, LoopFs, fs_or_skip};
use volume_migrate::{Decision, MigrateOptions, Migrator, Outcome, Progress};

fn no_progress(_: &Progress) {}

/// Every entry below the top of each package: inode number and birth time.
fn identities(root: &Path, packages: &[&str]) -> BTreeMap<String, BTreeMap<PathBuf, Identity>> {
    packages
        .iter()
        .map(|p| {
            let ids = integration::identity::identities(&root.join(p))
                .unwrap_or_else(|e| panic!("{p}: {e}"))
                .into_iter()
                .map(|(path, mut id)| {
                    // A rename changes the ctime of what it moves: only the
                    // inode number and birth time are the identity.
                    id.ctime = (0, 0);
                    (path, id)
                })
                .collect();
            (p.to_string(), ids)
        })
        .collect()
}

/// A plain package directory, as a service fills it.
fn plain_package(root: &Path, name: &str) {
    fs::create_dir_all(root.join(name).join("data/main")).unwrap();
    populate_volume(&root.join(name), false);
}

/// The dry run's decisions, then a run's: the same for every package, no
/// fallback, and every plain package of `plain` converted by a snapshot of
/// its parent with every file's identity kept.
#[track_caller]
fn assert_run_as_planned(layout: &str, root: &Path, plain: &[&str]) {
    let m = Migrator::open(root).unwrap_or_else(|e| panic!("{layout}: {e}"));
    let plan: BTreeMap<String, Option<Decision>> = m
        .plan()
        .unwrap_or_else(|e| panic!("{layout}: {e}"))
        .into_iter()
        .map(|p| (p.package.to_string(), p.decision))
        .collect();
    for p in plain {
        assert_eq!(
            plan.get(*p),
            Some(&Some(Decision::SnapshotParent)),
            "{layout}: {p} planned: {plan:?}"
        );
    }
    let before = identities(root, plain);
    let reports = m
        .run(&MigrateOptions::default(), &mut no_progress, &mut |_| {})
        .unwrap_or_else(|e| panic!("{layout}: {e}"));
    for r in &reports {
        let p = r.package.to_string();
        assert_eq!(r.outcome, Outcome::Converted, "{layout}: {p}: {r:?}");
        assert_eq!(
            Some(&r.decision),
            plan.get(&p),
            "{layout}: {p}: the dry run and the run disagree: {r:?}"
        );
        assert_eq!(r.fallback, None, "{layout}: {p}");
    }
    assert_eq!(reports.len(), plain.len(), "{layout}: {reports:?}");
    assert_eq!(
        identities(root, plain),
        before,
        "{layout}: every file keeps its inode number and birth time"
    );
}

/// The volumes root at the top of the filesystem, one package already a
/// subvolume: every snapshot's top holds its stub, which cannot be moved
/// aside, only removed.
#[test]
fn root_at_the_top_of_the_filesystem_beside_a_converted_package() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = fs.mount_point().to_path_buf();
    subvolume_create(&root.join("conv"));
    fs::write(root.join("conv/data"), b"converted").unwrap();
    for p in ["p1", "p2"] {
        plain_package(&root, p);
    }
    assert_run_as_planned("top of the filesystem", &root, &["p1", "p2"]);
}

/// The volumes root at the top of a subvolume of its own, two plain
/// packages and nothing else: the first converted, its stub is at the top
/// of the second's snapshot.
#[test]
fn root_at_the_top_of_its_own_subvolume_two_plain_packages() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = fs.path("own");
    subvolume_create(&root);
    for p in ["p1", "p2"] {
        plain_package(&root, p);
    }
    assert_run_as_planned("own subvolume", &root, &["p1", "p2"]);
}

/// The volumes root one level below the top, a subvolume beside it at the
/// top and a converted package inside it, and a plain file elsewhere.
#[test]
fn root_one_level_below_with_subvolumes_beside_and_inside() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    subvolume_create(&fs.path("beside"));
    fs::write(fs.path("beside/f"), b"beside").unwrap();
    fs::create_dir(fs.path("elsewhere")).unwrap();
    fs::write(fs.path("elsewhere/log"), b"log").unwrap();
    subvolume_create(&root.join("conv"));
    for p in ["p1", "p2"] {
        plain_package(&root, p);
    }
    assert_run_as_planned("one level below", &root, &["p1", "p2"]);
}

/// The volumes root inside a subvolume that is not the top one, mounted
/// with `subvol=` (as `@package-data`), a subvolume `tmp-sub` beside
/// `volumes` at that subvolume's top.
#[test]
fn root_inside_a_subvolume_mounted_with_subvol() {
    let mut top = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    subvolume_create(&top.path("@package-data"));
    top.unmount().unwrap();
    let image = top.image_path().to_path_buf();
    let fs = fs_or_skip!(LoopFs::from_image(
        FsKind::Btrfs,
        &image,
        "subvol=@package-data"
    ));
    let root = volumes_root(&fs);
    subvolume_create(&fs.path("tmp-sub"));
    fs::write(fs.path("tmp-sub/f"), b"tmp").unwrap();
    subvolume_create(&root.join("conv"));
    for p in ["p1", "p2"] {
        plain_package(&root, p);
    }
    assert_run_as_planned("subvol=@package-data", &root, &["p1", "p2"]);
}

/// On a `nodatasum` mount every new file carries NODATASUM, not
/// NODATACOW: copied on write, so nothing there vetoes a snapshot, and the
/// packages keep their identity.
#[test]
fn a_nodatasum_mount_converts_by_snapshot() {
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        BTRFS_SIZE,
        "nodatasum"
    ));
    let root = volumes_root(&fs);
    fs::create_dir(fs.path("elsewhere")).unwrap();
    fs::write(fs.path("elsewhere/log"), vec![1u8; 20_000]).unwrap();
    for p in ["p1", "p2"] {
        plain_package(&root, p);
    }
    assert_run_as_planned("nodatasum", &root, &["p1", "p2"]);
}

fn cli(root: &Path, args: &[&str], failpoint: Option<&str>) -> String {
    let mut cmd = Command::new(volume_migrate_bin());
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    if let Some(fp) = failpoint {
        cmd.env(volume::FAILPOINT_ENV, fp);
    }
    let out = cmd.output().expect("running volume-migrate");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The JSON objects of `--json` output with `"event": event`.
fn events(out: &str, event: &str) -> Vec<serde_json::Value> {
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

/// The reproduction, through the CLIs: a volume created by the
/// store at the top of the filesystem, then a plain package beside it.
/// The dry run says snapshot, and the run does it: every inode number and
/// birth time of the package kept.
#[test]
fn a_package_beside_a_store_volume_keeps_its_identity() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let m = fs.mount_point();
    let store = integration::workspace_bin("startos-volume").expect("the startos-volume binary");
    integration::run(
        Command::new(store)
            .arg("--root")
            .arg(m)
            .args(["create", "s", "main"]),
    )
    .expect("startos-volume create");
    fs::create_dir_all(m.join("q/data/main")).unwrap();
    fs::write(m.join("q/data/main/g"), b"y\n").unwrap();
    let before = identities(m, &["q"]);

    let plan = events(&cli(m, &["--dry-run", "--json"], None), "plan");
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!(plan[0]["decision"]["method"], "snapshot-parent", "{plan:?}");
    let run = cli(m, &["--json"], None);
    let reports = events(&run, "package");
    assert_eq!(reports.len(), 1, "{run}");
    assert_eq!(
        reports[0]["report"]["decision"], plan[0]["decision"],
        "{run}"
    );
    assert!(reports[0]["report"]["fallback"].is_null(), "{run}");
    assert_eq!(identities(m, &["q"]), before, "{run}");
}

/// A cut that fails falls back to a clone: the run's report says so, by
/// package and why, in text and in JSON, not only in a log line.
#[test]
fn a_fallback_to_a_clone_is_in_the_report() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    plain_package(&root, "p1");
    let fp = Some("migrate.carve-set-aside@1=eio");
    let text = cli(&root, &[], fp);
    let line = text
        .lines()
        .find(|l| l.starts_with("p1: cloned, not snapshotted as planned"))
        .unwrap_or_else(|| panic!("failpoints compiled in? no fallback line:\n{text}"));
    assert!(
        line.contains("cutting") && line.contains("p1.migrate-parent"),
        "{line}"
    );

    plain_package(&root, "p2");
    let run = cli(&root, &["--json"], fp);
    let reports = events(&run, "package");
    assert_eq!(reports.len(), 1, "{run}");
    let report: &serde_json::Value = &reports[0]["report"];
    assert_eq!(report["package"], "p2");
    assert_eq!(report["method"], "clone", "{run}");
    assert_eq!(report["fallback"]["kind"], "failed", "{run}");
    assert_eq!(report["decision"]["reason"], report["fallback"], "{run}");
}
