//! The first boot of a real node (issue 12), in miniature: a box of eight
//! plain package directories on one subvolume, one dominant database among
//! them ([`integration::node`]). It converts losslessly: the heavy packages
//! and the heaviest light ones, four in all, by a snapshot of the parent,
//! every file keeping its identity, the other light ones cloned and named
//! with why (issue 31: each snapshot of the parent sheds the whole box); a
//! run killed
//! at any step, the removal of the rests included, then run again, loses
//! nothing and redoes no finished package.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::cli::{cli_run, cli_run_with};
use common::rich::{expected_after, flags_and_blocks, setflags};
use common::*;
use integration::node::{self, DOMINANT, NOCOW_PACKAGE, NodeShape, SMALL_PACKAGES};
use integration::{LoopFs, TreeDigest, fs_or_skip, tree_digest};
use volume::{SnapshotOutcome, VolumeStore};
use volume_migrate::cost::CUT_ENTRY_US;
use volume_migrate::{
    CloneReason, Decision, Method, MigrateOptions, Migrator, Outcome, PARENT_SNAPSHOTS_MAX,
    Planned, Progress,
};

fn no_progress(_: &Progress) {}

/// Each package's digest (its top as a subvolume's), and its inode flags
/// and allocated blocks, by name.
type Packages = BTreeMap<String, (TreeDigest, Vec<(PathBuf, String, u64)>)>;

/// The deferred cut's directory at the top of each converted volume.
const REST_DIR: &str = integration::identity::CARVE_REST;

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

/// The packages `plan` clones as light ones (`CloneReason::Light`).
fn light_cloned(plan: &[Planned]) -> Vec<String> {
    plan.iter()
        .filter(|p| matches!(p.decision, Some(Decision::Clone(CloneReason::Light { .. }))))
        .map(|p| p.package.to_string())
        .collect()
}

fn planned_of<'a>(plan: &'a [Planned], p: &str) -> &'a Planned {
    plan.iter()
        .find(|e| e.package.as_str() == p)
        .unwrap_or_else(|| panic!("{p} not planned: {plan:?}"))
}

/// Every entry below the top of `dir`, a deferred cut's rest left out: its
/// inode number and birth time.
fn identities(dir: &Path) -> BTreeMap<PathBuf, (u64, (i64, u32))> {
    integration::identity::identities(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .into_iter()
        .map(|(path, id)| (path, (id.ino, id.birth)))
        .collect()
}

/// The box converts losslessly, the heavy packages by snapshotting the
/// parent, so that every file of theirs keeps its inode number and birth
/// time, the light ones cloned, each named with why (the `split` module's
/// bound on the snapshots of the parent); NOCOW files of packages
/// converted in the same run do not veto the
/// snapshot, those of anything else do; a rest outside the packages too
/// large for every package to shed makes them all clone.
#[test]
fn every_package_of_the_box_keeps_every_files_identity() {
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
    let ids: BTreeMap<&str, _> = shape
        .packages()
        .into_iter()
        .map(|p| (p, identities(&root.join(p))))
        .collect();
    let m = Migrator::open(&root).unwrap();
    let all: Vec<_> = shape.packages().iter().map(|p| pkg(p)).collect();
    let auto = MigrateOptions::default();

    let plan = m.schedule(&all, &auto).expect("schedule");
    assert_eq!(plan.len(), all.len(), "{plan:?}");
    let cloned = light_cloned(&plan);
    let is_cloned = |p: &str| cloned.iter().any(|c| c == p);
    assert_eq!(cloned.len(), all.len() - PARENT_SNAPSHOTS_MAX, "{plan:?}");
    for p in &plan {
        match &p.decision {
            Some(Decision::SnapshotParent) => {}
            Some(Decision::Clone(CloneReason::Light { heavy, .. })) => assert!(
                SMALL_PACKAGES.contains(&p.package.as_str()) && *heavy >= 2,
                "{p:?}"
            ),
            _ => panic!("{p:?}"),
        }
    }
    let mut names: Vec<&str> = plan.iter().map(|p| p.package.as_str()).collect();
    assert_eq!(names[0], DOMINANT, "the heaviest first: {names:?}");
    assert!(
        names[PARENT_SNAPSHOTS_MAX..].iter().all(|p| is_cloned(p)),
        "the snapshots first, then the light clones: {names:?}"
    );
    names.sort_unstable();
    assert_eq!(names, shape.packages(), "every package once");

    // bitcoind's NOCOW files count as the rest's when bitcoind is not
    // converted in the same run; a NOCOW file outside every package always.
    let without_bitcoind: Vec<_> = all
        .iter()
        .filter(|p| p.as_str() != NOCOW_PACKAGE)
        .cloned()
        .collect();
    let plan = m.schedule(&without_bitcoind, &auto).unwrap();
    let nocow_files = u64::from(shape.block_files + shape.leveldb_files);
    assert!(
        plan.iter().all(|p| p.decision
            == Some(Decision::Clone(CloneReason::InPlaceFiles {
                files: nocow_files
            }))),
        "{plan:?}"
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
    // Every package sheds the rest outside the packages: past the bound,
    // added up over the eight, none is snapshotted.
    let crowd = fs.path("crowd");
    fs::create_dir(&crowd).unwrap();
    let over = volume_migrate::REST_MAX_US / CUT_ENTRY_US / all.len() as u64 + 1;
    for i in 0..over {
        fs::write(crowd.join(i.to_string()), b"").unwrap();
    }
    let plan = m.schedule(&all, &auto).unwrap();
    assert!(
        plan.iter().all(|p| matches!(
            p.decision,
            Some(Decision::Clone(CloneReason::RestTooLarge { .. }))
        )),
        "{plan:?}"
    );
    // An old tree an interrupted run left, as large and with a NOCOW file:
    // garbage on its way out, neither weighed nor a veto.
    fs::rename(&crowd, root.join("ghost.migrate-old")).unwrap();
    let nocow = root.join("ghost.migrate-old/nocow");
    fs::File::create(&nocow).unwrap();
    setflags(&nocow, rustix::fs::IFlags::NOCOW);
    fs::write(&nocow, vec![1u8; 1 << 16]).unwrap();
    let first_plan = plan;
    let plan = m.schedule(&all, &auto).unwrap();
    let decisions = |plan: &[Planned]| -> Vec<(String, Option<Method>)> {
        let mut d: Vec<_> = plan
            .iter()
            .filter(|p| p.package.as_str() != "ghost")
            .map(|p| (p.package.to_string(), p.method()))
            .collect();
        d.sort_by(|a, b| a.0.cmp(&b.0));
        d
    };
    let snapshot_parent = |plan: &[Planned]| -> Vec<(String, Option<Method>)> {
        let mut d = decisions(plan);
        for (p, m) in d.iter_mut() {
            if !is_cloned(p) {
                *m = Some(Method::SnapshotParent);
            } else {
                *m = Some(Method::Clone);
            }
        }
        d
    };
    assert_eq!(decisions(&plan), snapshot_parent(&first_plan), "{plan:?}");
    fs::remove_dir_all(root.join("ghost.migrate-old")).unwrap();
    let before_plan = m.plan().unwrap();
    assert_eq!(
        decisions(&before_plan),
        snapshot_parent(&first_plan),
        "the dry run gives the same: {before_plan:?}"
    );
    assert!(before_plan.iter().all(|p| p.estimate.is_some()));

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
    for r in &reports {
        let p = r.package.as_str();
        assert_eq!(
            r.decision,
            planned_of(&before_plan, p).decision,
            "{p}: the dry run and the run agree"
        );
        assert_eq!(r.fallback, None, "{p}");
    }
    for (p, method, outcome) in &order {
        let method_of = match is_cloned(p) {
            true => Method::Clone,
            false => Method::SnapshotParent,
        };
        assert_eq!(
            (*method, *outcome),
            (Some(method_of), Outcome::Converted),
            "{p}"
        );
    }
    // Every volume is in place before any old tree goes, the snapshots each
    // holding the rest of the parent set aside, root's and closed, and every
    // file the very same inode.
    for (p, (digest, _)) in &before {
        if is_cloned(p) {
            let now = tree_digest(&root.join(p)).unwrap();
            assert_same(digest, &now, &format!("{p}, cloned"));
            continue;
        }
        let rest = root.join(p).join(REST_DIR);
        let meta = fs::symlink_metadata(&rest).expect("the rest, set aside");
        assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (0, 0o700));
        assert!(
            fs::symlink_metadata(root.join(format!("{p}.migrate-rest"))).is_ok(),
            "{p}: the cut's record"
        );
        let now = tree_digest(&root.join(p)).unwrap().without(REST_DIR);
        assert_same(digest, &now, &format!("{p} before the old trees go"));
        assert_eq!(
            identities(&root.join(p)),
            ids[p.as_str()],
            "{p}: inode numbers and birth times"
        );
    }
    let cleaned = m
        .remove_all_old(&mut no_progress)
        .expect("removing old trees");
    assert_eq!(cleaned.len(), all.len(), "{cleaned:?}");
    assert_lossless(&root, &shape, &before, "after the old trees went");
    for p in shape.packages() {
        if !is_cloned(p) {
            assert_eq!(identities(&root.join(p)), ids[p], "{p}, after the cleanup");
        }
    }
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
/// the old trees), in the order they happen: four cuts, heaviest first, the
/// four light packages' clones, then the removals (each rest, then each old
/// tree).
const RUN_STEPS: &[&str] = &[
    "migrate.parent-snapshot",
    "migrate.carve-held",
    "migrate.carve-set-aside@1",
    "migrate.carve-lifted@1",
    "migrate.rest-recorded",
    "migrate.durable@1",
    "migrate.exchanged@1",
    "migrate.old-renamed@1",
    "migrate.parent-snapshot@3",
    "migrate.rest-recorded@3",
    // The light packages, cloned after the four snapshots.
    "migrate.entry@20",
    "migrate.copied@2",
    "migrate.durable@5",
    "migrate.exchanged@8",
    "migrate.old-renamed@8",
    "migrate.rest-removed@1",
    "migrate.rest-removed@500",
    "migrate.rest-rmdir@3",
    "migrate.rest-removed@1000",
    "migrate.remove@1",
    "migrate.remove@400",
];

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

/// One package whose rest cannot be removed stops no other's cleanup: with
/// the first entry of the first rest failing to go (EIO), the run exits 1,
/// every other package's rest and old tree are gone, and that package's
/// rest and record stay for the next cleanup, which removes them; nothing
/// of any package is lost on the way.
#[test]
fn a_cleanup_that_fails_for_one_package_cleans_the_others() {
    let shape = NodeShape::small();
    let Some(fs) = new_box_fs(&shape) else { return };
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root).unwrap();
    node::build(&root, &shape).expect("building the box");
    let before = snapshot_of(&root, &shape);
    let m = Migrator::open(&root).unwrap();
    let cloned = light_cloned(
        &m.schedule(&m.packages().unwrap(), &MigrateOptions::default())
            .unwrap(),
    );
    let (killed, code, out) = cli_run_with(&root, &["--keep-old"], None);
    assert!(!killed && code == 0, "the conversion ({code}):\n{out}");
    let with_rest = |root: &Path| -> Vec<&str> {
        shape
            .packages()
            .into_iter()
            .filter(|p| root.join(p).join(REST_DIR).exists())
            .collect()
    };
    let snapshotted: Vec<&str> = shape
        .packages()
        .into_iter()
        .filter(|p| !cloned.iter().any(|c| c == p))
        .collect();
    assert_eq!(with_rest(&root), snapshotted, "every rest set aside");

    let (killed, code, out) = cli_run(&root, Some("migrate.rest-removed@1=eio"));
    assert!(!killed && code == 1, "the failing cleanup ({code}):\n{out}");
    let first = shape.packages()[0];
    assert_eq!(
        with_rest(&root),
        [first],
        "only the failing package's rest is left"
    );
    assert!(
        fs::symlink_metadata(root.join(format!("{first}.migrate-rest"))).is_ok(),
        "its record, kept"
    );
    let left = leftovers(&root, &shape);
    assert!(
        left.iter().all(|n| n.starts_with(first)),
        "every other package cleaned: {left:?}"
    );
    let (killed, code, out) = cli_run(&root, None);
    assert!(!killed && code == 0, "the next cleanup ({code}):\n{out}");
    assert!(with_rest(&root).is_empty());
    assert_lossless(&root, &shape, &before, "after both cleanups");
}
