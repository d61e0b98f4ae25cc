//! The first boot of a real node (issue 12), in miniature: a box of eight
//! plain package directories on one subvolume, one dominant database among
//! them ([`integration::node`]). It converts losslessly, each package by
//! the method the cost rule gives, the dominant one first; a run killed at
//! any step, then run again, loses nothing and redoes no finished package.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::rich::{expected_after, flags_and_blocks, setflags};
use common::*;
use integration::node::{self, DOMINANT, NOCOW_PACKAGE, NodeShape};
use integration::{LoopFs, TreeDigest, fs_or_skip, tree_digest};
use volume::{SnapshotOutcome, VolumeStore};
use volume_migrate::cost::{CLONE_ENTRY_US, CLONE_EXTENT_US, CUT_ENTRY_US, CUT_EXTENT_US};
use volume_migrate::{
    CloneReason, Decision, Method, MigrateOptions, Migrator, Outcome, Planned, Progress,
};

fn no_progress(_: &Progress) {}

/// Each package's digest (its top as a subvolume's), and its inode flags
/// and allocated blocks, by name.
type Packages = BTreeMap<String, (TreeDigest, Vec<(PathBuf, String, u64)>)>;

/// The deferred cut's directory at the top of the dominant volume.
const REST_DIR: &str = ".startos-carve-rest";

fn new_box_fs(shape: &NodeShape) -> Option<LoopFs> {
    Some(fs_or_skip!(LoopFs::btrfs(shape.image_bytes()), None))
}

/// What each package is now: its digest (the top as a subvolume's) and its
/// flags and allocated blocks, by name.
fn snapshot_of(root: &Path, shape: &NodeShape) -> Packages {
    snapshot_of_some(root, &shape.packages())
}

/// [`snapshot_of`] for the packages named.
fn snapshot_of_some(root: &Path, packages: &[&str]) -> Packages {
    packages
        .iter()
        .map(|p| {
            let dir = root.join(p);
            let digest = tree_digest(&dir).unwrap_or_else(|e| panic!("{p}: {e}"));
            (
                p.to_string(),
                (expected_after(&digest), flags_and_blocks(&dir)),
            )
        })
        .collect()
}

fn is_subvolume(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

fn uuid_of(path: &Path) -> [u8; 16] {
    let dir = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    volume::sys::subvolume_info(dir.as_fd())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .uuid
}

/// Names under the root that are not a package's volume.
fn leftovers(root: &Path, shape: &NodeShape) -> Vec<String> {
    let packages = shape.packages();
    let mut out: Vec<String> = fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !packages.contains(&n.as_str()))
        .collect();
    out.sort();
    out
}

#[track_caller]
fn assert_lossless(root: &Path, shape: &NodeShape, before: &Packages, when: &str) {
    for (p, (digest, flags)) in before {
        let dir = root.join(p);
        assert!(is_subvolume(&dir), "{when}: {p} is not a subvolume");
        assert_same(digest, &tree_digest(&dir).unwrap(), &format!("{when}: {p}"));
        assert_eq!(
            flags,
            &flags_and_blocks(&dir),
            "{when}: {p}: inode flags or holes"
        );
    }
    assert_eq!(leftovers(root, shape), Vec::<String>::new(), "{when}");
}

/// Entries and extents of a tree, counted the test's own way (a walk and
/// FIEMAP), weighed with `entry` and `extent` microseconds.
fn weigh(dir: &Path, entry: u64, extent: u64) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            total += entry;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                total += extent * integration::extent_count(&e.path()).unwrap();
            }
        }
    }
    total
}

fn planned_of<'a>(plan: &'a [Planned], p: &str) -> &'a Planned {
    plan.iter()
        .find(|e| e.package.as_str() == p)
        .unwrap_or_else(|| panic!("{p} not planned: {plan:?}"))
}

/// The box converts losslessly; the dominant package is converted first by
/// snapshotting the parent, with a cut that costs what the rule says, and
/// the others are cloned; NOCOW files of packages converted in the same run
/// do not veto the snapshot, those of anything else do.
#[test]
fn the_box_converts_losslessly_each_package_by_the_rule() {
    let shape = NodeShape::small();
    let Some(fs) = new_box_fs(&shape) else { return };
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root).unwrap();
    let (_, extents) = node::build(&root, &shape).expect("building the box");
    assert!(
        extents >= shape.monerod_extents * 9 / 10,
        "{extents} extents"
    );
    let before = snapshot_of(&root, &shape);
    let m = Migrator::open(&root).unwrap();
    let all: Vec<_> = shape.packages().iter().map(|p| pkg(p)).collect();
    let auto = MigrateOptions::default();

    // The rule, from the test's own counts: the dominant package's clone
    // against removing every other package from the parent's snapshot.
    let clone = weigh(&root.join(DOMINANT), CLONE_ENTRY_US, CLONE_EXTENT_US);
    let cut: u64 = shape
        .packages()
        .iter()
        .filter(|p| **p != DOMINANT)
        .map(|p| CUT_ENTRY_US + weigh(&root.join(p), CUT_ENTRY_US, CUT_EXTENT_US))
        .sum();
    assert!(
        cut * 2 <= clone,
        "the box is meant to be one the rule snapshots: cut {cut} us, clone {clone} us"
    );

    let plan = m.schedule(&all, &auto).expect("schedule");
    assert_eq!(plan.len(), all.len(), "{plan:?}");
    assert_eq!(plan[0].package.as_str(), DOMINANT, "the dominant one first");
    assert_eq!(
        plan[0].decision,
        Some(Decision::SnapshotParent),
        "{:?}",
        plan[0]
    );
    let planned_cut = plan[0].cut.expect("the cut's cost");
    let planned_clone = plan[0].clone.expect("the clone's cost");
    assert!(!planned_cut.at_least, "{planned_cut:?}");
    assert!(
        planned_cut.micros.abs_diff(cut) * 5 <= cut,
        "the cut's estimate {planned_cut:?} is off the test's count {cut} us by over 20%"
    );
    assert!(
        planned_cut.micros * 2 <= planned_clone.micros,
        "{planned_cut:?} against {planned_clone:?}"
    );
    assert!(
        planned_clone.micros <= clone,
        "counting stops early, never overshoots: {planned_clone:?} against {clone} us"
    );
    for p in &plan[1..] {
        assert_eq!(
            p.decision,
            Some(Decision::Clone(CloneReason::NotDominant {
                dominant: pkg(DOMINANT)
            })),
            "{p:?}"
        );
    }
    // By name, those with NOCOW files (bitcoind) last: their clones'
    // removals of the old copies would slow the clones after them.
    let names: Vec<&str> = plan[1..].iter().map(|p| p.package.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable_by_key(|n| (*n == node::NOCOW_PACKAGE, *n));
    assert_eq!(sorted.last(), Some(&node::NOCOW_PACKAGE));
    assert_eq!(names, sorted, "the others by name, NOCOW last");

    // bitcoind's NOCOW files count as the rest's when bitcoind is not
    // converted in the same run; a NOCOW file outside every package always.
    let without_bitcoind: Vec<_> = all
        .iter()
        .filter(|p| p.as_str() != NOCOW_PACKAGE)
        .cloned()
        .collect();
    let plan = m.schedule(&without_bitcoind, &auto).unwrap();
    let nocow_files = u64::from(shape.block_files + shape.leveldb_files);
    assert_eq!(
        planned_of(&plan, DOMINANT).decision,
        Some(Decision::Clone(CloneReason::InPlaceFiles {
            files: nocow_files
        })),
    );
    let outside = fs.path("swap.img");
    fs::File::create(&outside).unwrap();
    setflags(&outside, rustix::fs::IFlags::NOCOW);
    fs::write(&outside, vec![1u8; 1 << 20]).unwrap();
    let plan = m.schedule(&all, &auto).unwrap();
    assert_eq!(
        planned_of(&plan, DOMINANT).decision,
        Some(Decision::Clone(CloneReason::InPlaceFiles { files: 1 })),
    );
    fs::remove_file(&outside).unwrap();
    let (before_plan, _) = (m.plan().unwrap(), ());
    assert_eq!(
        before_plan[0].method(),
        Some(Method::SnapshotParent),
        "the dry run gives the same"
    );
    assert!(before_plan.iter().all(|p| p.estimate.is_some()));

    // The run: the dominant one first, each package as planned.
    let opts = MigrateOptions {
        defer_cut: true,
        remove_old: false,
        ..MigrateOptions::default()
    };
    let mut order = Vec::new();
    let reports = m
        .run(&opts, &mut no_progress, &mut |r| {
            order.push((r.package.to_string(), r.method, r.outcome))
        })
        .expect("run");
    assert_eq!(reports.len(), all.len());
    assert_eq!(
        order[0],
        (
            DOMINANT.to_owned(),
            Some(Method::SnapshotParent),
            Outcome::Converted
        )
    );
    for (p, method, outcome) in &order[1..] {
        assert_eq!(
            (*method, *outcome),
            (Some(Method::Clone), Outcome::Converted),
            "{p}"
        );
    }
    // Every volume is in place before any old tree goes; the dominant one
    // holds the rest of the parent, set aside, root's and closed.
    let rest = root.join(DOMINANT).join(REST_DIR);
    let meta = fs::symlink_metadata(&rest).expect("the rest, set aside");
    assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (0, 0o700));
    for (p, (digest, _)) in &before {
        let mut now = tree_digest(&root.join(p)).unwrap();
        if p == DOMINANT {
            now = now.without(REST_DIR);
        }
        assert_same(digest, &now, &format!("{p} before the old trees go"));
    }
    assert!(
        fs::symlink_metadata(root.join(format!("{DOMINANT}.migrate-rest"))).is_ok(),
        "the cut's record"
    );
    // bitcoind's NOCOW files share no extent with an old copy by the time
    // it is reported done: its old tree and its directory in the rest are
    // gone (the others' stay for the cleanup), and its first writes are in
    // place.
    let bitcoind = reports
        .iter()
        .find(|r| r.package.as_str() == NOCOW_PACKAGE)
        .expect("bitcoind's report");
    assert_eq!(bitcoind.nocow_files, nocow_files);
    assert!(bitcoind.old_removed);
    let in_rest = rest.join("package-data/volumes");
    assert!(
        !in_rest.join(NOCOW_PACKAGE).exists(),
        "bitcoind's old copy in the rest"
    );
    assert!(fs::symlink_metadata(root.join(format!("{NOCOW_PACKAGE}.migrate-old"))).is_err());
    assert!(
        in_rest.join("electrs").is_dir(),
        "the others' are the cleanup's"
    );
    assert!(root.join("electrs.migrate-old").is_dir());
    let block = node::block_file(&root, 0);
    let extents = integration::extent_count(&block).unwrap();
    // The same bytes written back, the times put back: the box stays as
    // it was for the lossless check below.
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&block)
        .unwrap();
    let meta = f.metadata().unwrap();
    let blocks = meta.len() / 4096;
    let mut buf = [0u8; 4096];
    for i in 0..64u64 {
        let at = (i * 37 % blocks) * 4096;
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, at).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &buf, at).unwrap();
    }
    f.sync_data().unwrap();
    f.set_times(
        fs::FileTimes::new()
            .set_accessed(meta.accessed().unwrap())
            .set_modified(meta.modified().unwrap()),
    )
    .unwrap();
    assert_eq!(
        integration::extent_count(&block).unwrap(),
        extents,
        "bitcoind's first writes in place"
    );
    let cleaned = m
        .remove_all_old(&mut no_progress)
        .expect("removing old trees");
    assert_eq!(cleaned.len(), all.len() - 1, "{cleaned:?}");
    assert!(!cleaned.iter().any(|p| p.as_str() == NOCOW_PACKAGE));
    assert_lossless(&root, &shape, &before, "after the old trees went");
    assert!(m.packages().unwrap().is_empty());
}

/// A deferred cut's rest, while an install backup holds it too: removed
/// from the volume, but the record stays until no backup has it, so a
/// restore that brings it back is cleaned again.
#[test]
fn the_rest_is_removed_again_after_a_restore_brings_it_back() {
    let shape = NodeShape::small();
    let Some(fs) = new_box_fs(&shape) else { return };
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root).unwrap();
    node::build(&root, &shape).expect("building the box");
    // A package converted alone: another's NOCOW files would veto it.
    fs::remove_dir_all(root.join(NOCOW_PACKAGE)).unwrap();
    let before: BTreeMap<_, _> = snapshot_of_some(&root, &[DOMINANT]);
    let m = Migrator::open(&root).unwrap();
    let opts = MigrateOptions {
        defer_cut: true,
        remove_old: false,
        method: Method::SnapshotParent,
        ..MigrateOptions::default()
    };
    let d = pkg(DOMINANT);
    let r = m.convert(&d, &opts, &mut no_progress).expect("convert");
    assert_eq!(r.method, Some(Method::SnapshotParent));
    let store = VolumeStore::open(&root).unwrap();
    assert_eq!(store.snapshot(&d).unwrap(), SnapshotOutcome::Snapshot);
    let live_rest = root.join(DOMINANT).join(REST_DIR);
    let record = root.join(format!("{DOMINANT}.migrate-rest"));
    assert!(m.remove_old(&d, &mut no_progress).unwrap());
    assert!(!live_rest.exists(), "removed from the volume");
    assert!(
        fs::symlink_metadata(&record).is_ok(),
        "kept while the backup holds the rest"
    );
    assert!(store.restore(&d).unwrap(), "restored");
    assert!(live_rest.exists(), "the restore brought it back");
    assert!(!store.drop_backup(&d).unwrap(), "the restore consumed it");
    assert!(m.remove_old(&d, &mut no_progress).unwrap());
    assert!(!live_rest.exists(), "removed again");
    assert!(
        fs::symlink_metadata(&record).is_err(),
        "record gone with the last copy of the rest"
    );
    let (digest, flags) = &before[DOMINANT];
    assert_same(
        digest,
        &tree_digest(&root.join(DOMINANT)).unwrap(),
        DOMINANT,
    );
    assert_eq!(flags, &flags_and_blocks(&root.join(DOMINANT)));
    assert!(!m.remove_old(&d, &mut no_progress).unwrap(), "nothing left");
}

/// The steps of a whole run of the CLI (convert every package, then remove
/// the old trees), in the order they happen: the dominant package's cut,
/// then the clones in name order, then the removals.
const RUN_STEPS: &[&str] = &[
    "migrate.parent-snapshot",
    "migrate.carve-held",
    "migrate.carve-set-aside@1",
    "migrate.carve-lifted@1",
    "migrate.rest-recorded",
    "migrate.durable@1",
    "migrate.exchanged@1",
    "migrate.old-renamed@1",
    "migrate.created@1",
    "migrate.chunk@3",
    "migrate.entry@300",
    "migrate.exchanged@3",
    "migrate.copied@7",
    "migrate.old-renamed@8",
    "migrate.rest-removed@5",
    "migrate.remove@1",
    "migrate.remove@400",
];

/// `volume-migrate --root <root> --json`, with `failpoint` armed; returns
/// whether it was SIGKILLed, and its output.
fn cli_run(root: &Path, failpoint: Option<&str>) -> (bool, i32, String) {
    let mut cmd = Command::new(volume_migrate_bin());
    cmd.arg("--root")
        .arg(root)
        .arg("--json")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    if let Some(fp) = failpoint {
        cmd.env(volume::FAILPOINT_ENV, fp);
    }
    let out = cmd.output().expect("running volume-migrate");
    (
        out.status.signal() == Some(libc::SIGKILL),
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// SIGKILL at every step of a run of the whole box, then a rerun: every
/// package ends up its subvolume, exactly as it was, with nothing left
/// over, and every package converted before the kill is the same subvolume
/// after the rerun (not converted again).
#[test]
fn a_run_killed_at_every_step_loses_nothing_and_redoes_nothing() {
    let shape = NodeShape::small();
    let Some(fs) = new_box_fs(&NodeShape {
        // Room for the template and one case at a time.
        monerod_bytes: shape.monerod_bytes * 3,
        ..shape
    }) else {
        return;
    };
    // The template lives in a subvolume of its own, out of every case's
    // parent; each case gets a lossless reflink copy in a fresh subvolume,
    // the parent of its volumes root.
    let template = fs.path("template");
    subvolume_create(&template);
    node::build(&template, &shape).expect("building the box");
    for (i, fp) in RUN_STEPS.iter().enumerate() {
        let case = fs.path(format!("case{i}"));
        subvolume_create(&case);
        let root = case.join("package-data/volumes");
        fs::create_dir_all(&root).unwrap();
        let root_dir = fs::File::open(&root).unwrap();
        for p in shape.packages() {
            let src = fs::File::open(template.join(p)).unwrap();
            volume::copy::reflink_tree(src.as_fd(), root_dir.as_fd(), p.as_ref())
                .unwrap_or_else(|e| panic!("copying {p}: {e}"));
        }
        let before = snapshot_of(&root, &shape);
        let when = format!("killed at `{fp}`");

        let (killed, code, out) = cli_run(&root, Some(fp));
        assert!(
            killed,
            "{when}: not killed (exit {code}); failpoints compiled in?\n{out}"
        );
        let finished: Vec<(String, [u8; 16])> = shape
            .packages()
            .iter()
            .filter(|p| is_subvolume(&root.join(p)))
            .map(|p| (p.to_string(), uuid_of(&root.join(p))))
            .collect();
        let (killed, code, out) = cli_run(&root, None);
        assert!(
            !killed && code == 0,
            "{when}: the rerun failed ({code}):\n{out}"
        );
        assert_lossless(&root, &shape, &before, &when);
        for (p, uuid) in &finished {
            assert_eq!(
                &uuid_of(&root.join(p)),
                uuid,
                "{when}: {p} was converted again"
            );
        }
        let (_, code, out) = cli_run(&root, None);
        assert!(
            code == 0 && out.contains("\"converted\":0"),
            "{when}: a third run has nothing to do:\n{out}"
        );
        // Frees the case's space for the next.
        volume::delete_tree(&case).unwrap_or_else(|e| panic!("{when}: deleting the case: {e}"));
    }
}

/// Counts paused at a round's budget go on where they stood: with two
/// packages over the first round's budget, one of them paused in the middle
/// of a fragmented file's extents (a directory is read in creation order,
/// so the file created last is reached after the small files), the
/// schedule's counts equal a whole count of each, entry for entry and
/// extent for extent.
#[test]
fn counts_paused_between_rounds_lose_and_repeat_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(2 << 30));
    let root = fs.path("volumes");
    let small = |dir: &Path, n: u32| {
        fs::create_dir_all(dir).unwrap();
        for i in 0..n {
            fs::write(dir.join(format!("f{i:05}")), [i as u8; 100]).unwrap();
        }
    };
    // 5,500 small files (an entry and an inline extent each) come to just
    // under the first round's budget: the file after them crosses it.
    let a = root.join("alpha/data");
    small(&a, 5_500);
    let extents = integration::make_fragmented_file(&a.join("zz.db"), 20_000 * 8192, 20_000, 9)
        .expect("fragmenting");
    assert!(extents >= 18_000, "{extents}");
    small(&root.join("bravo/data"), 10_000);
    let m = Migrator::open(&root).unwrap();
    let all = [pkg("alpha"), pkg("bravo")];
    let plan = m.schedule(&all, &MigrateOptions::default()).unwrap();
    let whole = m.plan().unwrap();
    for p in ["alpha", "bravo"] {
        let counted = planned_of(&plan, p).clone.expect("counted");
        let est = planned_of(&whole, p).estimate.expect("scanned");
        assert!(!counted.at_least, "{p}: counted whole in the second round");
        assert_eq!(
            (counted.entries, counted.extents),
            (est.entries, est.extents),
            "{p}: the paused count against a whole one"
        );
    }
    // And the rule: neither package's cut is within half its clone here.
    assert!(
        plan.iter()
            .all(|p| p.decision == Some(Decision::Clone(CloneReason::CutCostsMore))),
        "{plan:?}"
    );
}
