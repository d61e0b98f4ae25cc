//! `startos_core::volume`, the drop-in for start-core's own volume module,
//! on loop-mounted btrfs: the behaviours upstream's own tests check of its
//! `InstallBackup`, restated against ours (where ours is stronger the test
//! says so and checks the stronger outcome), every state upstream's own
//! code can leave on disk resolved with nothing lost, and boot
//! maintenance.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use integration::{LoopFs, fs_or_skip, run};
use startos_core::volume::{
    self, BootProgress, InstallBackup, boot_volume_maintenance_at, delete_tree_at,
    ensure_volume_root_at,
};

/// One btrfs with a volumes root, and `app`'s install backup in it.
struct Case {
    fs: LoopFs,
    root: PathBuf,
    ib: InstallBackup,
}

impl Case {
    fn new() -> Option<Case> {
        let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE), None);
        let root = volumes_root(&fs);
        let ib = InstallBackup::at(&root, "app");
        Some(Case { fs, root, ib })
    }

    fn path(&self, suffix: &str) -> PathBuf {
        self.root.join(format!("app{suffix}"))
    }

    fn live(&self) -> PathBuf {
        self.path("")
    }

    fn backup(&self) -> PathBuf {
        self.path(".install-backup")
    }
}

/// `data/main/marker` holding `text`, as a service's database would hold
/// its data; the directories made as needed.
fn seed(tree: &Path, text: &str) {
    fs::create_dir_all(tree.join("data/main")).unwrap();
    fs::write(tree.join("data/main/marker"), text).unwrap();
}

/// A subvolume at `path` holding `text`.
fn seed_subvolume(path: &Path, text: &str) {
    subvolume_create(path);
    seed(path, text);
}

fn marker(tree: &Path) -> Option<String> {
    fs::read_to_string(tree.join("data/main/marker")).ok()
}

fn gone(p: &Path) -> bool {
    fs::symlink_metadata(p).is_err()
}

/// `chattr +i` (or `-i`) on `path`: nothing can be created, renamed or
/// removed in it, as upstream's tests make a directory read-only to make a
/// step fail.
fn immutable(path: &Path, on: bool) {
    run(Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(path))
    .unwrap_or_else(|e| panic!("chattr {}: {e}", path.display()));
}

// ------------------------------------------------- upstream's own tests, restated

#[tokio::test]
async fn begin_replaces_a_stale_backup_with_the_current_snapshot() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "current");
    seed_subvolume(&c.backup(), "stale");
    c.ib.begin().await.unwrap();
    assert!(!c.ib.exists().await);
    assert!(c.ib.snapshot().await.unwrap());
    assert_eq!(marker(&c.backup()).as_deref(), Some("current"));
    seed(&c.live(), "updated");
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("current"));
    assert!(!c.ib.exists().await);
    assert_no_transient_names(&c.root, "after the restore");
}

#[tokio::test]
async fn a_failed_snapshot_cannot_restore_a_stale_backup() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "current");
    seed_subvolume(&c.backup(), "stale");
    c.ib.begin().await.unwrap();
    immutable(&c.root, true);
    let snapshot = c.ib.snapshot().await;
    immutable(&c.root, false);
    // Ours says the snapshot failed (upstream turns it into `false`); either
    // way there is no backup to restore.
    assert!(!matches!(snapshot, Ok(true)), "{snapshot:?}");
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("current"));
    assert!(!c.ib.exists().await);
    assert_no_transient_names(&c.root, "after the failed snapshot");
}

/// A backup left beside the volume when `snapshot` is called (an install
/// that skipped `begin`), and, while `snapshot` waits for the package's
/// lock, another operation deletes the volume: the backup is now the only
/// copy of the data. `snapshot` decides under the lock, from what is there
/// then: it keeps the backup and takes none (`false`), where deciding from
/// a look taken before the lock dropped the only copy.
#[tokio::test]
async fn snapshot_decides_under_the_lock_and_keeps_the_only_copy() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "current");
    seed_subvolume(&c.backup(), "only copy");
    let dir = ::volume::sys::open_dir_path(&c.root).unwrap();
    let locks = ::volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).unwrap();
    let held = locks.lock(&"app".parse().unwrap()).unwrap();
    let root = c.root.clone();
    let snapshot = tokio::spawn(async move { InstallBackup::at(&root, "app").snapshot().await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!snapshot.is_finished(), "the snapshot ran without the lock");
    // The concurrent operation, holding the lock: the volume goes.
    ::volume::delete_tree_at(std::os::fd::AsFd::as_fd(&dir), std::ffi::OsStr::new("app")).unwrap();
    drop(held);
    let taken = snapshot.await.unwrap().unwrap();
    assert!(!taken, "no volume, so no backup taken");
    assert_eq!(marker(&c.backup()).as_deref(), Some("only copy"));
    assert_no_transient_names(&c.root, "after the snapshot");
}

#[tokio::test]
async fn begin_aborts_when_the_stale_backup_cannot_be_deleted() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "current");
    seed_subvolume(&c.backup(), "stale");
    fs::write(c.path(".install-fresh"), "unchanged").unwrap();
    immutable(&c.root, true);
    let begin = c.ib.begin().await;
    immutable(&c.root, false);
    assert!(begin.is_err());
    assert_eq!(marker(&c.live()).as_deref(), Some("current"));
    assert_eq!(marker(&c.backup()).as_deref(), Some("stale"));
    assert_eq!(
        fs::read_to_string(c.path(".install-fresh")).unwrap(),
        "unchanged"
    );
}

#[tokio::test]
async fn restore_puts_the_backup_in_place_and_leaves_no_debris() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "new");
    seed_subvolume(&c.backup(), "pre-update");
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(!c.ib.exists().await);
    assert!(root_names(&c.root) == ["app"], "{:?}", root_names(&c.root));
}

/// Upstream takes no backup of a plain directory. Ours takes a reflink copy
/// (within the extent bound) and leaves the volume intact.
#[tokio::test]
async fn snapshot_of_a_plain_directory_takes_a_reflink_backup_and_leaves_it_intact() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "live");
    let before = digest(&c.live());
    assert!(c.ib.snapshot().await.unwrap(), "a reflink backup");
    assert_same(&before, &digest(&c.live()), "the volume");
    assert_same(&before, &digest(&c.backup()), "the backup");
}

#[tokio::test]
async fn begin_invalidates_a_stale_backup_before_a_snapshot() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "current");
    seed(&c.backup(), "stale");
    c.ib.begin().await.unwrap();
    assert!(!c.ib.exists().await);
    assert!(!c.ib.is_fresh().await);
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("current"));
}

/// Upstream's `begin` deletes a backup with no live volume beside it: the
/// only copy of the data. Ours puts it back as the volume.
#[tokio::test]
async fn begin_puts_back_a_backup_that_is_the_only_copy() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.backup(), "only copy");
    c.ib.begin().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("only copy"));
    assert!(!c.ib.exists().await);
    assert!(!c.ib.is_fresh().await, "the package has a volume now");
    c.ib.remove().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("only copy"));
}

/// A package whose volume is gone but whose install backup is there (the
/// only copy of its data) gets that copy back at its load, not an empty
/// volume beside it that the next install's `begin` would drop it for.
/// Upstream's `ensure_volume_root` makes it empty.
#[tokio::test]
async fn ensure_puts_back_a_backup_that_is_the_only_copy() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.backup(), "only copy");
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("only copy"));
    assert!(!c.ib.exists().await);
    c.ib.begin().await.unwrap();
    c.ib.remove().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("only copy"));
}

#[tokio::test]
async fn begin_resolves_a_pending_restore_before_invalidating_the_backup() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "discarded");
    seed_subvolume(&c.backup(), "recovered");
    fs::create_dir_all(c.live().join("data/main")).unwrap();
    c.ib.begin().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("recovered"));
    assert!(!c.ib.exists().await);
    assert!(!c.ib.is_fresh().await);
    assert!(gone(&c.path(".restore-old")));
    assert_no_transient_names(&c.root, "after begin");
}

#[tokio::test]
async fn begin_marks_a_rootless_install_until_it_is_removed() {
    let Some(c) = Case::new() else { return };
    c.ib.begin().await.unwrap();
    assert!(c.ib.is_fresh().await);
    c.ib.remove().await.unwrap();
    assert!(!c.ib.is_fresh().await);
}

#[tokio::test]
async fn begin_clears_a_stale_marker_beside_existing_data() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "kept");
    fs::write(c.path(".install-fresh"), "").unwrap();
    c.ib.begin().await.unwrap();
    assert!(!c.ib.is_fresh().await);
    assert_eq!(marker(&c.live()).as_deref(), Some("kept"));
}

#[tokio::test]
async fn begin_settles_a_pending_restore_before_judging_the_root() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "only-copy");
    c.ib.begin().await.unwrap();
    assert!(!c.ib.is_fresh().await);
    assert_eq!(marker(&c.live()).as_deref(), Some("only-copy"));
}

/// No volumes root (a new box; a backup restored onto one, whose install
/// skips `begin`): every call that looks at or drops a package's names
/// finds nothing and goes on, creating nothing (upstream's `snapshot` is
/// `false`, its `delete_tree` of an absent path a no-op); `begin` creates
/// the root, as upstream's does making its fresh marker.
#[tokio::test]
async fn a_missing_volumes_root_is_no_volume_until_begin_creates_it() {
    let Some(c) = Case::new() else { return };
    let root = c.fs.path("new/package-data/volumes");
    let ib = InstallBackup::at(&root, "app");
    assert!(!ib.snapshot().await.unwrap(), "no volume, no backup");
    assert!(matches!(
        ib.snapshot_outcome().await.unwrap(),
        ::volume::SnapshotOutcome::NoVolume
    ));
    ib.resolve_pending().await.unwrap();
    ib.remove().await.unwrap();
    assert!(!ib.exists().await);
    volume::sync_volume_root_at(&root, "app").await.unwrap();
    delete_tree_at(&root, root.join("app")).await.unwrap();
    volume::convert_package_to_subvolume_at(&root, "app")
        .await
        .unwrap();
    assert!(gone(&c.fs.path("new")), "nothing created");
    ib.begin().await.unwrap();
    assert!(ib.is_fresh().await, "the first install's marker");
    ensure_volume_root_at(&root, "app").await.unwrap();
    assert_eq!(root_names(&root), ["app", "app.install-fresh"]);
}

#[tokio::test]
async fn restore_is_a_noop_without_a_backup() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "live");
    let before = digest(&c.root);
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("live"));
    assert_same(&before, &digest(&c.root), "a restore without a backup");
}

/// Interrupted between upstream's two renames, the live root since
/// recreated as an empty skeleton.
#[tokio::test]
async fn resolve_finishes_a_restore_interrupted_between_the_renames() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "new");
    seed_subvolume(&c.backup(), "pre-update");
    fs::create_dir_all(c.live().join("data/main")).unwrap();
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(!c.ib.exists().await);
    assert!(gone(&c.path(".restore-old")));
    assert_eq!(root_names(&c.root), ["app"]);
}

#[tokio::test]
async fn resolve_drops_the_aside_tree_once_the_backup_landed() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "pre-update");
    seed(&c.path(".restore-old"), "new");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert_eq!(root_names(&c.root), ["app"]);
}

#[tokio::test]
async fn resolve_recovers_the_aside_tree_when_nothing_else_survives() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "pre-update");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert_eq!(root_names(&c.root), ["app"]);
}

/// Upstream refuses ("restore-conflict") and leaves the three trees for
/// manual cleanup, so the package cannot start. Ours finishes the restore
/// the crash interrupted and keeps what was written into the recreated
/// root as `<pkg>.restore-conflict`: nothing is lost.
#[tokio::test]
async fn resolve_finishes_a_conflicting_restore_and_keeps_what_was_written() {
    let Some(c) = Case::new() else { return };
    seed(&c.live(), "written-since");
    seed(&c.path(".restore-old"), "new");
    seed_subvolume(&c.backup(), "pre-update");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert_eq!(
        marker(&c.path(".restore-conflict")).as_deref(),
        Some("written-since")
    );
    assert!(!c.ib.exists().await);
    assert_eq!(root_names(&c.root), ["app", "app.restore-conflict"]);
    // Resolved for good: a second call changes nothing.
    let before = digest(&c.root);
    c.ib.resolve_pending().await.unwrap();
    assert_same(&before, &digest(&c.root), "a second resolve");
}

#[tokio::test]
async fn resolve_is_a_noop_with_no_pending_restore() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "live");
    seed_subvolume(&c.backup(), "rollback-point");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("live"));
    assert_eq!(marker(&c.backup()).as_deref(), Some("rollback-point"));
}

struct NoProgress;
impl BootProgress for NoProgress {
    fn set_total(&mut self, _: u64) {}
    fn set_done(&mut self, _: u64) {}
}

async fn sweep(c: &Case, installed: &[&str], all: &[&str]) -> volume::BootMaintenance {
    let installed: BTreeSet<String> = installed.iter().map(|s| s.to_string()).collect();
    let all: BTreeSet<String> = all.iter().map(|s| s.to_string()).collect();
    boot_volume_maintenance_at(&c.root, &installed, &all, &mut NoProgress)
        .await
        .unwrap()
}

#[tokio::test]
async fn sweep_drops_a_finished_installs_marker_and_keeps_its_data() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "kept");
    fs::write(c.path(".install-fresh"), "").unwrap();
    sweep(&c, &[], &[]).await;
    assert!(!c.ib.is_fresh().await);
    assert_eq!(marker(&c.live()).as_deref(), Some("kept"));
}

#[tokio::test]
async fn sweep_leaves_the_marker_of_an_install_in_flight() {
    let Some(c) = Case::new() else { return };
    fs::write(c.path(".install-fresh"), "").unwrap();
    sweep(&c, &[], &["app"]).await;
    assert!(c.ib.is_fresh().await);
}

#[tokio::test]
async fn sweep_completes_a_stranded_restore_rather_than_stranding_it() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "new");
    seed_subvolume(&c.backup(), "pre-update");
    fs::create_dir_all(c.live().join("data/main")).unwrap();
    sweep(&c, &["app"], &["app"]).await;
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(gone(&c.path(".restore-old")));
}

#[tokio::test]
async fn sweep_resolves_before_reaping_an_orphaned_backup() {
    let Some(c) = Case::new() else { return };
    seed(&c.path(".restore-old"), "new");
    seed_subvolume(&c.backup(), "pre-update");
    fs::create_dir_all(c.live().join("data/main")).unwrap();
    // On disk, but not in the database: the orphan-reaping case.
    sweep(&c, &[], &[]).await;
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(gone(&c.path(".restore-old")));
}

#[tokio::test]
async fn sweep_clears_a_half_written_snapshot() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "live");
    seed_subvolume(&c.path(".install-backup-tmp"), "partial");
    sweep(&c, &["app"], &["app"]).await;
    assert!(gone(&c.path(".install-backup-tmp")));
    assert_eq!(marker(&c.live()).as_deref(), Some("live"));
}

/// An orphaned backup (its package gone from the database) is reaped, as
/// upstream's sweep reaps it, beside its live volume or not: the sweep
/// never makes a volume for a package the database does not list.
#[tokio::test]
async fn sweep_drops_an_orphaned_backup_and_never_makes_a_volume_of_it() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "live");
    seed_subvolume(&c.backup(), "orphan");
    let other = c.root.join("other.install-backup");
    seed_subvolume(&other, "uninstalled");
    let m = sweep(&c, &[], &[]).await;
    assert!(m.failed.is_empty(), "{:?}", m.failed);
    assert!(!c.ib.exists().await);
    assert_eq!(marker(&c.live()).as_deref(), Some("live"));
    assert!(gone(&other));
    assert!(
        gone(&c.root.join("other")),
        "the sweep made a volume for a package the database does not list"
    );
}

// ------------------------------------------------- upstream's leftovers, each state

/// Upstream's conversion, interrupted at each of its states: the copy being
/// made, the directory moved aside with or without the copy renamed in.
#[tokio::test]
async fn upstream_conversion_leftovers_are_resolved_with_nothing_lost() {
    let Some(c) = Case::new() else { return };
    // Died cloning: the plain directory is intact, the partial copy goes.
    seed(&c.live(), "plain");
    seed_subvolume(&c.path(".convert-tmp"), "partial");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("plain"));
    assert_eq!(root_names(&c.root), ["app"]);

    // Died between its two renames: the directory is put back.
    fs::rename(c.live(), c.path(".convert-old")).unwrap();
    seed_subvolume(&c.path(".convert-tmp"), "complete copy");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("plain"));
    assert_eq!(root_names(&c.root), ["app"]);

    // Died before removing the old directory: it is garbage, removed after
    // services start, as volume-migrate's own.
    fs::rename(c.live(), c.path(".convert-old")).unwrap();
    seed_subvolume(&c.live(), "converted");
    c.ib.resolve_pending().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("converted"));
    assert_eq!(root_names(&c.root), ["app", "app.migrate-old"]);
    let report = sweep(&c, &["app"], &["app"]).await;
    assert_eq!(report.ready, [pkg("app")]);
    if let Some(cleanup) = report.cleanup {
        cleanup.await.unwrap().unwrap();
    }
    volume_migrate::Migrator::open(&c.root)
        .unwrap()
        .remove_all_old(&mut |_: &volume_migrate::Progress| {})
        .unwrap();
    assert_eq!(root_names(&c.root), ["app"]);
}

/// Upstream's snapshots are writable: one found as the backup is frozen, so
/// nothing changes it before a restore, and the restore gives it back
/// writable.
#[tokio::test]
async fn a_writable_backup_of_upstreams_is_frozen_then_restored_writable() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "new");
    seed_subvolume(&c.backup(), "pre-update");
    assert!(!is_read_only(&c.backup()));
    c.ib.resolve_pending().await.unwrap();
    assert!(is_read_only(&c.backup()), "the backup must be frozen");
    assert_eq!(marker(&c.backup()).as_deref(), Some("pre-update"));
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(!is_read_only(&c.live()));
    assert_writable(&c.live().join("data/main"));
}

/// Every state, seeded at once for different packages, resolved by one
/// boot: each package ends with exactly one complete volume.
#[tokio::test]
async fn one_boot_resolves_every_leftover_state_of_upstreams() {
    let Some(c) = Case::new() else { return };
    let r = &c.root;
    let t = |p: &str, s: &str| r.join(format!("{p}{s}"));
    // restore-old, backup, no live
    seed(&t("a", ".restore-old"), "a-new");
    seed_subvolume(&t("a", ".install-backup"), "a-old");
    // restore-old, no backup, live: landed
    seed_subvolume(&t("b", ""), "b-old");
    seed(&t("b", ".restore-old"), "b-new");
    // restore-old, no backup, no live: the only copy
    seed(&t("c", ".restore-old"), "c-only");
    // conflict
    seed(&t("d", ""), "d-since");
    seed(&t("d", ".restore-old"), "d-new");
    seed_subvolume(&t("d", ".install-backup"), "d-old");
    // a half-made snapshot and a half-made conversion
    seed_subvolume(&t("e", ""), "e-live");
    seed_subvolume(&t("e", ".install-backup-tmp"), "e-partial");
    seed(&t("f", ".convert-old"), "f-plain");
    // a fresh-install marker of an installed package
    seed_subvolume(&t("g", ""), "g-live");
    fs::write(t("g", ".install-fresh"), "").unwrap();
    let all = ["a", "b", "c", "d", "e", "f", "g"];
    let report = sweep(&c, &all, &all).await;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    for (p, want) in [
        ("a", "a-old"),
        ("b", "b-old"),
        ("c", "c-only"),
        ("d", "d-old"),
        ("e", "e-live"),
        ("f", "f-plain"),
        ("g", "g-live"),
    ] {
        assert_eq!(marker(&t(p, "")).as_deref(), Some(want), "{p}");
    }
    assert_eq!(
        marker(&t("d", ".restore-conflict")).as_deref(),
        Some("d-since")
    );
    if let Some(cleanup) = report.cleanup {
        cleanup.await.unwrap().unwrap();
    }
    assert_eq!(
        root_names(r),
        ["a", "b", "c", "d", "d.restore-conflict", "e", "f", "g"],
        "every leftover resolved"
    );
    for p in all {
        assert!(
            integration::tree_digest(&t(p, ""))
                .unwrap()
                .get("")
                .is_some_and(|e| e.subvolume == integration::Subvolume::Root),
            "{p}: converted at boot"
        );
    }
    let _ = &c.fs;
}

// ------------------------------------------------- paths, ids, roots

#[test]
fn paths_are_upstreams_and_invalid_ids_stay_inside_the_root() {
    assert_eq!(
        volume::data_dir("/media/startos/data", "lnd", "main"),
        Path::new("/media/startos/data/package-data/volumes/lnd/data/main")
    );
    assert_eq!(
        volume::asset_dir("/d", "lnd", "0.18.0:1"),
        Path::new("/d/package-data/volumes/lnd/assets/0.18.0:1")
    );
    assert_eq!(
        volume::backup_dir("lnd"),
        Path::new("/media/startos/backups/lnd/data")
    );
    for bad in ["..", "../etc", "a/b", "A", ""] {
        let p = volume::data_dir("/d", bad, "main");
        assert!(p.starts_with("/d/package-data/volumes"), "{p:?}");
        assert_eq!(
            p.components().count(),
            7,
            "one component for {bad:?}: {p:?}"
        );
        let p = volume::data_dir("/d", "lnd", bad);
        assert_eq!(p.components().count(), 7, "{p:?}");
        let p = volume::asset_dir("/d", "lnd", bad);
        assert_eq!(p.components().count(), 7, "{p:?}");
    }
}

#[tokio::test]
async fn an_invalid_id_is_an_invalid_id_error_and_touches_nothing() {
    let Some(c) = Case::new() else { return };
    let before = root_names(&c.root);
    for bad in ["../app", "App", "a.b", ""] {
        let ib = InstallBackup::at(&c.root, bad);
        assert!(!ib.exists().await);
        assert!(!ib.is_fresh().await);
        for r in [
            ib.begin().await,
            ib.snapshot().await.map(drop),
            ib.restore().await,
            ib.resolve_pending().await,
            ib.remove().await,
            ensure_volume_root_at(&c.root, bad).await,
        ] {
            let e = r.expect_err(bad);
            assert_eq!(e.kind, models::ErrorKind::InvalidId, "{bad:?}: {e}");
        }
    }
    assert_eq!(root_names(&c.root), before);
}

#[tokio::test]
async fn ensure_volume_root_makes_an_empty_subvolume_and_keeps_an_existing_volume() {
    let Some(c) = Case::new() else { return };
    let root = c.root.join("nested/volumes");
    ensure_volume_root_at(&root, "app").await.unwrap();
    let d = digest(&root.join("app"));
    assert_eq!(d.len(), 1, "empty: {d:?}");
    assert_eq!(
        d.get("").map(|e| e.subvolume),
        Some(integration::Subvolume::Root)
    );
    seed(&root.join("app"), "kept");
    ensure_volume_root_at(&root, "app").await.unwrap();
    assert_eq!(marker(&root.join("app")).as_deref(), Some("kept"));
}

/// A hard uninstall (upstream's `cleanup`, `delete_tree` of the volume
/// root) of a package with a backup, nested subvolumes and leftovers:
/// every name of it goes, so the boot sweep after it (the package no
/// longer listed) has nothing to bring back, and a reinstall starts empty.
#[tokio::test]
async fn a_hard_uninstall_removes_every_name_and_a_reinstall_starts_empty() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "live");
    subvolume_create(&c.live().join("data/main/nested"));
    seed_subvolume(&c.backup(), "backup");
    seed(&c.path(".restore-conflict"), "kept by upstream");
    let neighbour = c.root.join("neighbour");
    seed_subvolume(&neighbour, "its own");
    // The path as upstream's cleanup joins it, but spelt another way: it
    // is the same directory, so the same volume.
    let spelt = c.root.join("../volumes/app");
    delete_tree_at(&c.root, &spelt).await.unwrap();
    assert_eq!(
        root_names(&c.root),
        ["neighbour"],
        "every name of app must go"
    );
    assert_eq!(package_subvolumes(&c.fs, "app"), Vec::<String>::new());
    assert_eq!(marker(&neighbour).as_deref(), Some("its own"));
    // The reboot: the package is in no list.
    let m = sweep(&c, &["neighbour"], &["neighbour"]).await;
    assert!(m.failed.is_empty(), "{:?}", m.failed);
    assert!(
        gone(&c.live()),
        "the boot brought the uninstalled volume back"
    );
    // The reinstall.
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    let d = digest(&c.live());
    assert_eq!(d.len(), 1, "the reinstall must start empty: {d:?}");
    assert!(!c.ib.exists().await);
    // Absent is fine.
    delete_tree_at(&c.root, c.root.join("ghost")).await.unwrap();
}

/// `Service::load`'s Installing arm on undo, as upstream writes it:
/// `resolve_pending`, then `cleanup` with `keep_volumes = !is_fresh()`
/// (a hard one, `delete_tree` of the volume root, only for a fresh
/// install), then `restore` and `remove`. A fresh install had no backup
/// (`begin` found nothing to back up), so the hard cleanup loses nothing
/// and leaves no name; an install over data keeps its volume and gets the
/// backup back.
#[tokio::test]
async fn the_installing_arms_undo_leaves_nothing_of_a_fresh_install_and_restores_the_rest() {
    let Some(c) = Case::new() else { return };
    async fn undo(c: &Case) {
        c.ib.resolve_pending().await.unwrap();
        if c.ib.is_fresh().await {
            delete_tree_at(&c.root, c.live()).await.unwrap();
        }
        c.ib.restore().await.unwrap();
        c.ib.remove().await.unwrap();
    }
    // A fresh install: begin, snapshot (nothing), the install's writes.
    c.ib.begin().await.unwrap();
    assert!(!c.ib.snapshot().await.unwrap());
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    seed(&c.live(), "the failed install's");
    undo(&c).await;
    assert_eq!(root_names(&c.root), Vec::<String>::new());
    // Over data: the backup comes back, the volume stays.
    seed_subvolume(&c.live(), "before");
    c.ib.begin().await.unwrap();
    assert!(c.ib.snapshot().await.unwrap());
    seed(&c.live(), "the failed install's");
    undo(&c).await;
    assert_eq!(marker(&c.live()).as_deref(), Some("before"));
    assert_eq!(root_names(&c.root), ["app"]);
}

/// `delete_tree` of a tree named as a package but not in the volumes root
/// (`<fs>/x/app`) is no volume: deleted in place, as upstream's, with its
/// siblings (names a volume store would recover: `app.delete`,
/// `app.rollback`, `app.install-backup`) untouched and no package lock
/// taken, not even the lock directory made.
#[tokio::test]
async fn delete_tree_outside_the_volumes_root_is_a_plain_delete() {
    use std::os::unix::fs::MetadataExt;
    let Some(c) = Case::new() else { return };
    let x = c.fs.path("x");
    fs::create_dir_all(&x).unwrap();
    let app = x.join("app");
    let siblings = ["app.delete", "app.rollback", "app.install-backup"];
    let make = || {
        seed_subvolume(&app, "tree");
        subvolume_create(&app.join("data/main/nested"));
        for s in siblings {
            if !x.join(s).exists() {
                seed(&x.join(s), s);
            }
        }
    };
    make();
    let st = fs::metadata(&x).unwrap();
    let lock_dir = Path::new(::volume::lock::LOCK_DIR).join(format!(
        "{}:{}-{}",
        rustix::fs::major(st.dev()),
        rustix::fs::minor(st.dev()),
        st.ino()
    ));
    // A lock directory of an earlier run whose loop device and directory
    // had the same numbers (this test makes one below) is not this one's.
    let _ = fs::remove_dir_all(&lock_dir);
    for with_root in [true, false] {
        if with_root {
            delete_tree_at(&c.root, &app).await.unwrap();
        } else {
            volume::delete_tree(&app).await.unwrap();
        }
        assert!(gone(&app), "{with_root}");
        for s in siblings {
            assert_eq!(marker(&x.join(s)).as_deref(), Some(s), "{s} ({with_root})");
        }
        assert!(!lock_dir.exists(), "a lock directory for {}", x.display());
        make();
    }
    // Not even a holder of a package lock there stops it: there is none.
    let dir = ::volume::sys::open_dir_path(&x).unwrap();
    let locks = ::volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).unwrap();
    let _held = locks.lock(&"app".parse().unwrap()).unwrap();
    let done = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        delete_tree_at(&c.root, &app),
    )
    .await;
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
    assert!(gone(&app));
    drop(_held);
    let _ = fs::remove_dir_all(&lock_dir);
}

/// Upstream's `ServiceMap::install`, its volume calls in its order:
/// `begin`, then `snapshot` once the old service is quiesced, `?` on each.
/// Returns how far it got.
async fn install_shaped(ib: &InstallBackup, uninit: &mut bool) -> Result<(), models::Error> {
    ib.begin().await?;
    ib.snapshot().await?;
    // `service.uninstall()`: the old version's uninit, writing its
    // down-migration into the volume.
    *uninit = true;
    ib.remove().await
}

/// A snapshot that fails is an `Err` (upstream's is `Ok(false)`, so its
/// update goes on with no rollback point): the install's `?` stops it
/// before the old version's uninit touches the volume, and the error the
/// user gets names the package, the volume and what failed. Nothing of a
/// partial backup is left, and the next try goes through.
#[tokio::test]
async fn a_failed_snapshot_stops_the_install_and_tells_the_user_why() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "current");
    // `begin` passes, then the snapshot cannot put its copy in the root.
    let mut uninit = false;
    c.ib.begin().await.unwrap();
    immutable(&c.root, true);
    let snapshot = c.ib.snapshot().await;
    immutable(&c.root, false);
    let e = snapshot.expect_err("the snapshot must fail, not return false");
    let told = format!("{e:#}");
    assert!(told.contains("app"), "{told}");
    assert!(told.contains(&c.live().display().to_string()), "{told}");
    assert!(told.contains("snapshot"), "{told}");
    // The same, through the install's sequence of calls.
    immutable(&c.root, true);
    let r = install_shaped(&c.ib, &mut uninit).await;
    immutable(&c.root, false);
    assert!(r.is_err(), "the install must stop at the snapshot");
    assert!(
        !uninit,
        "the old version's uninit ran without a rollback point"
    );
    assert_eq!(marker(&c.live()).as_deref(), Some("current"));
    assert!(!c.ib.exists().await);
    assert_no_transient_names(&c.root, "after the failed snapshot");
    install_shaped(&c.ib, &mut uninit).await.unwrap();
    assert!(uninit);
}

// ------------------------------------------- the purge after a restore or a delete

/// `dir` with `n` small files, each read once: cached, as a running
/// service's files are.
fn cached_files(dir: &Path, n: usize) {
    fs::create_dir_all(dir).unwrap();
    for i in 0..n {
        fs::write(dir.join(format!("f{i}")), i.to_string()).unwrap();
    }
    for i in 0..n {
        fs::read(dir.join(format!("f{i}"))).unwrap();
    }
}

// Today: the restore deletes the replaced volume before it returns (its cached inodes evicted in the caller's task): "the replaced volume, left to the background purge: []".
/// Start-core waits on the restore to restart the service: it returns
/// with the restored volume in place and the replaced one still whole in
/// the trash, deleted by the background purge (held off here, so the test
/// sees the state whatever the machine's speed), which holds no lock of
/// the package: the service's `ensure_volume_root` runs meanwhile.
#[tokio::test]
async fn restore_returns_before_the_replaced_volume_is_deleted() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "pre-update");
    assert!(c.ib.snapshot().await.unwrap());
    seed(&c.live(), "updated");
    cached_files(&c.live().join("data/main/db"), 2000);
    let paused = ::volume::purge::pause();
    c.ib.restore().await.unwrap();
    assert_eq!(marker(&c.live()).as_deref(), Some("pre-update"));
    assert!(!c.ib.exists().await);
    // The backup it consumed (dropped first), then the replaced volume.
    assert_eq!(
        trash_entries(&c.root),
        ["app.1", "app.2"],
        "the backup and the replaced volume, left to the background purge: {:?}",
        trash_entries(&c.root)
    );
    let replaced = c.root.join(::volume::layout::TRASH_DIR).join("app.2");
    assert_eq!(marker(&replaced).as_deref(), Some("updated"));
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    drop(paused);
    ::volume::purge::wait_purged();
    assert_eq!(trash_entries(&c.root), Vec::<String>::new());
    assert_eq!(root_names(&c.root), ["app"]);
}

// Today: the backup is deleted before `remove` returns, under the package's lock: "the backup, left to the background purge: []".
/// Start-core's last step of a successful install, `remove`, drops the
/// backup: the install is done when the backup is off the package's names,
/// whatever it holds (a plain directory's reflink copy is deleted entry by
/// entry: 1.6 s for 100k files), and the background purge deletes it with
/// no lock of the package held: the service's `ensure_volume_root` runs
/// meanwhile.
#[tokio::test]
async fn remove_returns_before_the_backup_is_deleted() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "pre-update");
    cached_files(&c.live().join("data/main/db"), 2000);
    assert!(c.ib.snapshot().await.unwrap());
    seed(&c.live(), "updated");
    let paused = ::volume::purge::pause();
    c.ib.remove().await.unwrap();
    assert!(!c.ib.exists().await);
    assert_eq!(marker(&c.live()).as_deref(), Some("updated"));
    assert_eq!(
        trash_entries(&c.root),
        ["app.1"],
        "the backup, left to the background purge: {:?}",
        trash_entries(&c.root)
    );
    let backup = c.root.join(::volume::layout::TRASH_DIR).join("app.1");
    assert_eq!(marker(&backup).as_deref(), Some("pre-update"));
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    drop(paused);
    ::volume::purge::wait_purged();
    assert_eq!(trash_entries(&c.root), Vec::<String>::new());
    assert_eq!(root_names(&c.root), ["app"]);
}

// Today: the delete deletes the volume before it returns: "the deleted volume, left to the background purge: []".
/// The same for an uninstall's `delete_tree`: the volume leaves the
/// package's names at once, and is deleted after, in the background.
#[tokio::test]
async fn delete_tree_returns_before_the_volume_is_deleted() {
    let Some(c) = Case::new() else { return };
    seed_subvolume(&c.live(), "installed");
    cached_files(&c.live().join("data/main/db"), 2000);
    let paused = ::volume::purge::pause();
    delete_tree_at(&c.root, c.live()).await.unwrap();
    assert!(gone(&c.live()));
    assert_eq!(
        trash_entries(&c.root),
        ["app.1"],
        "the deleted volume, left to the background purge: {:?}",
        trash_entries(&c.root)
    );
    // A reinstall's first step runs meanwhile.
    ensure_volume_root_at(&c.root, "app").await.unwrap();
    drop(paused);
    ::volume::purge::wait_purged();
    assert_eq!(root_names(&c.root), ["app"]);
}
