//! Crash safety of `volume::VolumeStore`: every operation is killed with SIGKILL at
//! each of its named steps, then recovery runs and the package must be in the
//! complete before-state or the complete after-state, never anything in between.
//!
//! The operation runs in a child process: this same test binary, re-executed to run
//! only [`crash_child`], with `STARTOS_VOLUME_FAILPOINT` naming the step at which
//! the store kills its own process. That needs the `volume/failpoints` feature
//! (`cargo test --workspace --features volume/failpoints`, as the Makefile runs
//! it); without it the child finishes normally and the test fails saying so.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use integration::{LoopFs, TreeDigest, fs_or_skip};
use volume::{SnapshotOutcome, VolumeKind, VolumeStore};

const CHILD_OP_ENV: &str = "VOLUME_CRASH_CHILD_OP";
const CHILD_ROOT_ENV: &str = "VOLUME_CRASH_ROOT";
const CHILD_PKG_ENV: &str = "VOLUME_CRASH_PKG";

/// Not a test on its own: the body of the child process. Without
/// `VOLUME_CRASH_CHILD_OP` (a normal test run) it returns at once.
#[test]
fn crash_child() {
    let Ok(op) = std::env::var(CHILD_OP_ENV) else {
        return;
    };
    let root = std::env::var_os(CHILD_ROOT_ENV).expect("crash child: VOLUME_CRASH_ROOT unset");
    let p = pkg(&std::env::var(CHILD_PKG_ENV).expect("crash child: VOLUME_CRASH_PKG unset"));
    // Only the operation's own recovery of its package runs in the child: the parent
    // recovered everything before.
    let store = VolumeStore::open_without_recovery(&root).expect("crash child: opening the store");
    let result = match op.as_str() {
        "snapshot" => store.snapshot(&p).map(|o| format!("{o:?}")),
        "restore" => store.restore(&p).map(|r| format!("restored: {r}")),
        "drop" => store.drop_backup(&p).map(|r| format!("dropped: {r}")),
        "delete" => store.delete(&p).map(|r| format!("deleted: {r}")),
        "recover" => store.recover(&p).map(|r| format!("{r:?}")),
        other => panic!("crash child: unknown operation {other:?}"),
    };
    println!("crash child: {op} of {p} ran to the end: {result:?}");
}

/// Runs `op` on `package` in a child process that must be SIGKILLed at `failpoint`.
fn crash_at(root: &Path, package: &str, op: &str, failpoint: &str) {
    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(exe)
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_OP_ENV, op)
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_PKG_ENV, package)
        .env(volume::FAILPOINT_ENV, failpoint)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("spawning the crash child");
    if out.status.signal() != Some(libc::SIGKILL) {
        panic!(
            "`{op}` of {package} was not killed at failpoint `{failpoint}` ({}).\n\
             Either the failpoints are not compiled in: run the tests with \
             `cargo test --workspace --features volume/failpoints` (as `make test` does); \
             or `{failpoint}` is not on the path of `{op}`.\n\
             --- child stdout ---\n{}\n--- child stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }
}

/// What a package looks like: its live volume and its backup, each absent or with
/// this digest.
#[derive(Clone)]
struct State {
    live: Option<TreeDigest>,
    backup: Option<TreeDigest>,
}

/// One crash: the operation, where it dies, and which state recovery must reach.
struct Case {
    failpoint: &'static str,
    expect: Expect,
    /// Why that state, for the assertion message.
    why: &'static str,
}

#[derive(Clone, Copy, Debug)]
enum Expect {
    /// The complete state before the operation.
    Before,
    /// The complete state after it.
    After,
}

/// How the package's backup is stored: a read-only snapshot, or a reflink copy of a
/// plain directory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backup {
    Snapshot,
    Reflink,
}

struct Scenario<'a> {
    root: &'a Path,
    fs: &'a LoopFs,
    op: &'static str,
    backup: Backup,
    /// Makes the package and returns its state before and after `op`.
    setup: &'a dyn Fn(&VolumeStore, &str) -> (State, State),
    /// Runs `op` to completion after recovery; gets whether a backup is there.
    rerun: &'a dyn Fn(&VolumeStore, &str, bool),
}

fn package_name(op: &str, failpoint: &str) -> String {
    format!("{op}-{}", failpoint.replace('.', "-"))
}

/// The checks after recovery, against `expected`.
#[track_caller]
fn check_state(
    scn: &Scenario<'_>,
    store: &VolumeStore,
    package: &str,
    expected: &State,
    when: &str,
) {
    let p = pkg(package);
    let live = store.volume_path(&p);
    match &expected.live {
        Some(d) => {
            assert!(
                live.is_dir(),
                "{when}: the volume {} must exist",
                live.display()
            );
            assert_same(d, &digest(&live), &format!("{when}: live volume"));
            if scn.backup == Backup::Snapshot {
                assert!(
                    !is_read_only(&live),
                    "{when}: the live volume must be writable"
                );
            }
            if live.join(FROZEN).is_dir() {
                assert!(
                    is_read_only(&live.join(FROZEN)),
                    "{when}: the read-only nested subvolume must stay read-only"
                );
            }
        }
        None => assert!(
            !live.exists(),
            "{when}: the volume {} must be gone",
            live.display()
        ),
    }
    let backup = store.backup_path(&p);
    match &expected.backup {
        Some(d) => {
            assert!(
                backup.is_dir(),
                "{when}: the backup {} must exist",
                backup.display()
            );
            assert_same(d, &digest(&backup), &format!("{when}: backup"));
            if scn.backup == Backup::Snapshot {
                assert!(
                    is_read_only(&backup),
                    "{when}: the backup must be read-only"
                );
                for nested in ["data/main/nested", "data/main/nested/deeper/inner"] {
                    assert!(
                        is_read_only(&backup.join(nested)),
                        "{when}: the backup's nested {nested} must be read-only"
                    );
                }
            }
        }
        None => {
            assert!(
                !backup.exists(),
                "{when}: the backup {} must be gone",
                backup.display()
            );
            let record = scn.root.join(format!("{package}.install-backup.ro"));
            assert!(
                std::fs::symlink_metadata(&record).is_err(),
                "{when}: the read-only record {} outlived its backup",
                record.display()
            );
        }
    }
    assert_no_transient_names(scn.root, when);
    if expected.live.is_none() && expected.backup.is_none() {
        assert_eq!(
            package_subvolumes(scn.fs, package),
            Vec::<String>::new(),
            "{when}: no subvolume of the package may be left"
        );
    }
}

fn run_scenario(scn: &Scenario<'_>, cases: &[Case]) {
    for case in cases {
        let package = package_name(scn.op, case.failpoint);
        let (before, after) = {
            let store = VolumeStore::open(scn.root).expect("opening the store");
            (scn.setup)(&store, &package)
        };
        let expected = match case.expect {
            Expect::Before => before.clone(),
            Expect::After => after.clone(),
        };
        let when = format!(
            "`{}` of {package} killed at `{}`: expected the {:?} state because {}",
            scn.op, case.failpoint, case.expect, case.why
        );

        crash_at(scn.root, &package, scn.op, case.failpoint);

        // The crash left work for recovery: some transient name or record,
        // or garbage in the trash.
        assert!(
            !transient_names(scn.root).is_empty() || !trash_entries(scn.root).is_empty(),
            "{when}: the crash should have interrupted the operation mid-way"
        );

        let store = VolumeStore::open(scn.root)
            .unwrap_or_else(|e| panic!("{when}: recovery (open) failed: {e}"));
        check_state(scn, &store, &package, &expected, &when);
        assert!(
            store.recover_all().expect("recover_all").is_empty(),
            "{when}: a second recovery must find nothing to do"
        );

        // Now the same operation again, to completion.
        (scn.rerun)(&store, &package, expected.backup.is_some());
        check_state(
            scn,
            &store,
            &package,
            &after,
            &format!("{when}; then `{}` ran again", scn.op),
        );
        assert!(store.recover_all().expect("recover_all").is_empty());
        // Last, as it touches directory mtimes: whatever volume is left (restored
        // ones included) can be written, nested subvolumes too.
        let live = store.volume_path(&pkg(&package));
        for dir in [
            "data/main",
            "data/main/nested",
            "data/main/nested/deeper/inner",
        ] {
            if live.join(dir).is_dir() {
                assert_writable(&live.join(dir));
            }
        }
    }
}

fn new_fs() -> Option<(LoopFs, PathBuf)> {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE), None);
    let root = volumes_root(&fs);
    Some((fs, root))
}

fn state(store: &VolumeStore, package: &str) -> State {
    let p = pkg(package);
    let (live, backup) = (store.volume_path(&p), store.backup_path(&p));
    State {
        live: live.exists().then(|| digest(&live)),
        backup: backup.exists().then(|| digest(&backup)),
    }
}

/// A read-only nested subvolume, `data/main/frozen`, as a package may keep
/// an archive: the snapshot records it, and it must come back read-only.
fn add_frozen(vol: &Path) {
    let frozen = vol.join(FROZEN);
    subvolume_create(&frozen);
    std::fs::write(frozen.join("archive"), bytes(11, 20_000)).expect("writing the archive");
    integration::run(
        Command::new("btrfs")
            .args(["property", "set", "-ts"])
            .arg(&frozen)
            .args(["ro", "true"]),
    )
    .expect("making frozen read-only");
}

const FROZEN: &str = "data/main/frozen";

/// A subvolume volume with nested subvolumes, a backup of it, then changes:
/// live holds "current" data B, the backup the older data A.
fn volume_with_backup(store: &VolumeStore, package: &str) -> State {
    let p = pkg(package);
    store.create(&p, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&p), true);
    add_frozen(&store.volume_path(&p));
    assert_eq!(
        store.snapshot(&p).expect("snapshot"),
        SnapshotOutcome::Snapshot
    );
    modify_volume(&store.volume_path(&p), true);
    let s = state(store, package);
    assert_ne!(s.live, s.backup, "setup: live and backup must differ");
    s
}

#[test]
fn snapshot_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let p = pkg(package);
        store.create(&p, &[vol("main")]).expect("create");
        populate_volume(&store.volume_path(&p), true);
        add_frozen(&store.volume_path(&p));
        let before = state(store, package);
        let after = State {
            live: before.live.clone(),
            backup: before.live.clone(),
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        assert!(!has_backup);
        assert_eq!(
            store
                .snapshot(&pkg(package))
                .expect("snapshot after recovery"),
            SnapshotOutcome::Snapshot
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "snapshot",
        backup: Backup::Snapshot,
        setup: &setup,
        rerun: &rerun,
    };
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "snapshot.created",
                expect: Expect::Before,
                why: "the snapshot still has its .tmp name, so recovery discards it",
            },
            Case {
                failpoint: "snapshot.frozen",
                expect: Expect::Before,
                why: "the frozen snapshot still has its .tmp name, so recovery discards it",
            },
        ],
    );
}

#[test]
fn restore_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let before = volume_with_backup(store, package);
        let after = State {
            live: before.backup.clone(),
            backup: None,
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        let p = pkg(package);
        assert_eq!(
            store.restore(&p).expect("restore after recovery"),
            has_backup,
            "restore returns whether there was a backup"
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "restore",
        backup: Backup::Snapshot,
        setup: &setup,
        rerun: &rerun,
    };
    let after_exchange = "the exchange happened, so recovery finishes the restore";
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "restore.copied",
                expect: Expect::Before,
                why: "the rollback copy has no record yet, so recovery deletes it and \
                      keeps the current data and the backup",
            },
            Case {
                failpoint: "restore.recorded",
                expect: Expect::Before,
                why: "the rollback copy is complete and recorded, but the exchange never \
                      happened: only the restore exchanges, so recovery undoes it and keeps \
                      the current data (and whatever was written since) and the backup",
            },
            Case {
                failpoint: "restore.exchanged",
                expect: Expect::After,
                why: after_exchange,
            },
            Case {
                failpoint: "delete-entry.writable",
                expect: Expect::After,
                why: "it died deleting the dropped backup after the exchange",
            },
            Case {
                failpoint: "restore.replaced-moved",
                expect: Expect::After,
                why: after_exchange,
            },
            Case {
                failpoint: "drop.renamed",
                expect: Expect::After,
                why: "it died dropping the backup after the exchange",
            },
            Case {
                failpoint: "restore.backup-dropped",
                expect: Expect::After,
                why: "only the rollback record was left to remove",
            },
        ],
    );
}

#[test]
fn drop_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let before = volume_with_backup(store, package);
        let after = State {
            live: before.live.clone(),
            backup: None,
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        assert_eq!(
            store
                .drop_backup(&pkg(package))
                .expect("drop after recovery"),
            has_backup
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "drop",
        backup: Backup::Snapshot,
        setup: &setup,
        rerun: &rerun,
    };
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "drop.renamed",
                expect: Expect::After,
                why: "the backup was renamed to .drop, read-only, which recovery moves to the trash",
            },
            Case {
                failpoint: "trash.writable",
                expect: Expect::After,
                why: "the backup was .drop, made writable, which recovery moves to the trash",
            },
            Case {
                failpoint: "trash.moved",
                expect: Expect::After,
                why: "the backup was in the trash, not yet committed, which recovery empties",
            },
            Case {
                failpoint: "delete-entry.writable",
                expect: Expect::After,
                why: "it died deleting the dropped backup in the trash, which recovery empties",
            },
        ],
    );
}

#[test]
fn delete_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let before = volume_with_backup(store, package);
        let after = State {
            live: None,
            backup: None,
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        assert_eq!(
            store.delete(&pkg(package)).expect("delete after recovery"),
            has_backup,
            "delete returns whether anything was left to delete"
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "delete",
        backup: Backup::Snapshot,
        setup: &setup,
        rerun: &rerun,
    };
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "delete.renamed",
                expect: Expect::After,
                why: "the volume was renamed to .delete, the delete's commit point, so \
                      recovery drops the backup and deletes the volume",
            },
            Case {
                failpoint: "drop.renamed",
                expect: Expect::After,
                why: "the volume was .delete and the backup in the trash",
            },
            Case {
                failpoint: "delete-entry.writable",
                expect: Expect::After,
                why: "it died emptying the trash of the volume and its backup",
            },
            Case {
                failpoint: "delete.backup-dropped",
                expect: Expect::After,
                why: "only .delete was left to delete",
            },
        ],
    );
}

/// A plain-directory volume (not converted yet) on btrfs: its backup is a reflink
/// copy.
fn plain_volume(store: &VolumeStore, package: &str) {
    let p = pkg(package);
    std::fs::create_dir_all(store.volume_path(&p).join("data/main")).expect("mkdir");
    assert_eq!(
        store.create(&p, &[vol("main")]).expect("create"),
        VolumeKind::Directory
    );
    populate_volume(&store.volume_path(&p), false);
    let nocow = store.volume_path(&p).join("data/main/nocow.db");
    std::fs::File::create(&nocow).expect("creating nocow.db");
    integration::run(Command::new("chattr").arg("+C").arg(&nocow)).expect("chattr +C");
    std::fs::write(&nocow, bytes(9, 100_000)).expect("writing nocow.db");
}

/// [`plain_volume`], its reflink backup, then changes.
fn plain_volume_with_backup(store: &VolumeStore, package: &str) -> State {
    plain_volume(store, package);
    let p = pkg(package);
    let outcome = store.snapshot(&p).expect("snapshot");
    assert!(
        matches!(outcome, SnapshotOutcome::ReflinkCopy { .. }),
        "{outcome:?}"
    );
    modify_volume(&store.volume_path(&p), false);
    state(store, package)
}

#[test]
fn reflink_snapshot_of_a_plain_directory_survives_a_crash() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        plain_volume(store, package);
        let before = state(store, package);
        let after = State {
            live: before.live.clone(),
            backup: before.live.clone(),
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        assert!(!has_backup);
        let outcome = store
            .snapshot(&pkg(package))
            .expect("snapshot after recovery");
        assert!(
            matches!(outcome, SnapshotOutcome::ReflinkCopy { .. }),
            "{outcome:?}"
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "snapshot",
        backup: Backup::Reflink,
        setup: &setup,
        rerun: &rerun,
    };
    run_scenario(
        &scn,
        &[Case {
            failpoint: "snapshot.created",
            expect: Expect::Before,
            why: "the complete copy still has its .tmp name, so recovery discards it",
        }],
    );
}

#[test]
fn restore_from_a_reflink_copy_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let before = plain_volume_with_backup(store, package);
        assert_ne!(before.live, before.backup);
        let after = State {
            live: before.backup.clone(),
            backup: None,
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, has_backup: bool| {
        let p = pkg(package);
        assert_eq!(
            store.restore(&p).expect("restore after recovery"),
            has_backup
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "restore",
        backup: Backup::Reflink,
        setup: &setup,
        rerun: &rerun,
    };
    let after_exchange = "the exchange happened, so recovery finishes the restore";
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "restore.copied",
                expect: Expect::Before,
                why: "the backup's identity is recorded but it is not yet moved to \
                      .rollback, so recovery removes the record and keeps the backup",
            },
            Case {
                failpoint: "restore.recorded",
                expect: Expect::Before,
                why: "the recorded backup was moved to .rollback but never exchanged, so \
                      recovery moves it back: the current data and the backup are kept",
            },
            Case {
                failpoint: "restore.exchanged",
                expect: Expect::After,
                why: after_exchange,
            },
            Case {
                failpoint: "restore.replaced-moved",
                expect: Expect::After,
                why: after_exchange,
            },
            Case {
                failpoint: "restore.backup-dropped",
                expect: Expect::After,
                why: "only the rollback record was left to remove",
            },
        ],
    );
}

/// A plain-directory volume with its reflink backup, deleted: a kill at any
/// step after the rename to `.delete` (the commit point; removing the
/// directory file by file comes last) ends with nothing of the package left
/// (recovery used to finish deleting the volume and keep the backup, a full
/// copy of the uninstalled data).
#[test]
fn delete_of_a_plain_directory_with_a_backup_survives_a_crash() {
    let Some((fs, root)) = new_fs() else { return };
    let setup = |store: &VolumeStore, package: &str| {
        let before = plain_volume_with_backup(store, package);
        let after = State {
            live: None,
            backup: None,
        };
        (before, after)
    };
    let rerun = |store: &VolumeStore, package: &str, _: bool| {
        assert!(
            !store.delete(&pkg(package)).expect("delete after recovery"),
            "recovery already deleted everything"
        );
    };
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "delete",
        backup: Backup::Reflink,
        setup: &setup,
        rerun: &rerun,
    };
    run_scenario(
        &scn,
        &[
            Case {
                failpoint: "delete.renamed",
                expect: Expect::After,
                why: "the volume was renamed to .delete, so recovery drops the backup and \
                      deletes the volume",
            },
            Case {
                failpoint: "drop.renamed",
                expect: Expect::After,
                why: "the backup was in the trash with the volume still .delete",
            },
            Case {
                failpoint: "delete.backup-dropped",
                expect: Expect::After,
                why: "only .delete was left to delete",
            },
        ],
    );
}

/// A crash, then crashes of the recovery itself at each of its steps: recovery
/// must be restartable from wherever it died.
#[test]
fn recovery_survives_crashes_of_its_own() {
    let Some((fs, root)) = new_fs() else { return };
    let package = "recovered";
    let after = {
        let store = VolumeStore::open(&root).expect("open");
        State {
            live: volume_with_backup(&store, package).backup,
            backup: None,
        }
    };
    crash_at(&root, package, "restore", "restore.exchanged");
    // Past the exchange, recovery moves the replaced volume aside
    // (restore.replaced-moved), drops the backup into the trash
    // (drop.renamed), removes the record (after restore.backup-dropped),
    // moves the replaced volume to the trash too (restore.replaced-deleted),
    // then empties the trash. Each rerun passes
    // the earlier points again, so each kill lands one step further.
    for fp in [
        "restore.replaced-moved",
        "drop.renamed",
        "restore.backup-dropped",
        "restore.replaced-deleted",
    ] {
        crash_at(&root, package, "recover", fp);
    }
    let store = VolumeStore::open(&root).expect("final recovery");
    let scn = Scenario {
        root: &root,
        fs: &fs,
        op: "recover",
        backup: Backup::Snapshot,
        setup: &|_, _| unreachable!(),
        rerun: &|_, _, _| unreachable!(),
    };
    check_state(
        &scn,
        &store,
        package,
        &after,
        "restore killed at restore.exchanged, then its recovery killed four times",
    );
    assert!(store.recover_all().expect("recover_all").is_empty());
    assert!(!store.restore(&pkg(package)).expect("restore"));
}
