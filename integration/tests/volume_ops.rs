//! Library-level tests of `volume::VolumeStore` on real loop-mounted filesystems.
//!
//! Every test builds its own small btrfs (or ext4) image, so they run in parallel
//! without sharing anything; the store's root is `<mount point>/volumes`.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use integration::{Kind, LoopFs, Subvolume, extent_count, fs_or_skip, make_fragmented_file, run};
use rustix::fs::{FlockOperation, IFlags};
use volume::{ErrorKind, SnapshotOutcome, VolumeKind, VolumeStore};

fn open(root: &std::path::Path) -> VolumeStore {
    VolumeStore::open(root).unwrap_or_else(|e| panic!("opening the store at {root:?}: {e}"))
}

#[test]
fn create_makes_a_subvolume_with_volume_dirs_and_is_idempotent() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    assert!(store.is_btrfs());
    let app = pkg("app");

    let kind = store
        .create(&app, &[vol("main"), vol("BACKUP")])
        .expect("create");
    assert_eq!(kind, VolumeKind::Subvolume);
    let d = digest(&store.volume_path(&app));
    assert_eq!(d.get("").map(|e| e.subvolume), Some(Subvolume::Root));
    for dir in ["data", "data/main", "data/BACKUP"] {
        let e = d.get(dir).unwrap_or_else(|| panic!("{dir} missing: {d:?}"));
        assert!(matches!(e.kind, Kind::Dir), "{dir}: {e:?}");
    }
    assert_eq!(
        store.data_dir(&app, &vol("main")),
        root.join("app/data/main")
    );
    assert_eq!(package_subvolumes(&fs, "app"), ["volumes/app"]);

    // Second create, with one more volume: the files stay, the new dir appears.
    populate_volume(&store.volume_path(&app), true);
    let before = digest(&store.volume_path(&app));
    let kind = store
        .create(&app, &[vol("main"), vol("extra")])
        .expect("second create");
    assert_eq!(kind, VolumeKind::Subvolume);
    let after = digest(&store.volume_path(&app));
    assert!(matches!(
        after.get("data/extra").map(|e| &e.kind),
        Some(Kind::Dir)
    ));
    // Adding data/extra is a modification of data/: its mtime alone may change.
    let ignore_data_mtime = |mut d: integration::TreeDigest| {
        d.entries_mut().get_mut(&b"data"[..]).unwrap().mtime = None;
        d
    };
    assert_same(
        &ignore_data_mtime(before),
        &ignore_data_mtime(after.clone().without("data/extra")),
        "a second create must keep the volume",
    );
    // The same create again is an exact no-op.
    store
        .create(&app, &[vol("main"), vol("extra")])
        .expect("third create");
    assert_same(
        &after,
        &digest(&store.volume_path(&app)),
        "a repeated create",
    );
    assert!(store.recover_all().expect("recover_all").is_empty());
}

#[test]
fn create_keeps_an_existing_plain_directory() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    fs::write(root.join("app/data/main/keep"), b"keep").unwrap();
    let store = open(&root);
    let kind = store
        .create(&pkg("app"), &[vol("main"), vol("logs")])
        .expect("create");
    assert_eq!(kind, VolumeKind::Directory);
    assert_eq!(fs::read(root.join("app/data/main/keep")).unwrap(), b"keep");
    assert!(root.join("app/data/logs").is_dir());
    assert!(
        package_subvolumes(&fs, "app").is_empty(),
        "a plain directory must not be turned into a subvolume by create"
    );
    let list = store.list().expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].volume, Some(VolumeKind::Directory));
    assert_eq!(list[0].backup, None);
}

#[test]
fn snapshot_is_a_read_only_copy_with_nested_subvolumes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let at_snapshot = digest(&live);

    assert_eq!(
        store.snapshot(&app).expect("snapshot"),
        SnapshotOutcome::Snapshot
    );
    let backup = store.backup_path(&app);
    assert_eq!(backup, root.join("app.install-backup"));
    assert!(is_read_only(&backup), "the backup must be read-only");
    for nested in ["data/main/nested", "data/main/nested/deeper/inner"] {
        assert!(
            is_read_only(&backup.join(nested)),
            "nested subvolume {nested} of the backup must be read-only too"
        );
    }
    let b = digest(&backup);
    assert_same(&at_snapshot, &b, "backup vs live at snapshot time");
    // Nested subvolumes are real snapshots in the backup, not empty placeholders.
    assert_eq!(
        b.get("data/main/nested/deeper/inner").map(|e| e.subvolume),
        Some(Subvolume::Root)
    );
    assert!(b.get("data/main/nested/deeper/inner/wal").is_some());
    assert_no_transient_names(&root, "after snapshot");
    assert!(
        fs::write(backup.join("data/main/intruder"), b"x").is_err(),
        "writing into a read-only backup must fail"
    );

    // Later writes to the live volume, nested subvolumes included, leave it alone.
    modify_volume(&live, true);
    assert_ne!(digest(&live), at_snapshot, "the live volume did change");
    assert_same(&at_snapshot, &digest(&backup), "backup after live writes");

    let list = store.list().expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].volume, Some(VolumeKind::Subvolume));
    assert_eq!(list[0].backup, Some(VolumeKind::Subvolume));
    let mut subvols = package_subvolumes(&fs, "app");
    subvols.sort();
    assert_eq!(
        subvols,
        [
            "volumes/app",
            "volumes/app.install-backup",
            "volumes/app.install-backup/data/main/nested",
            "volumes/app.install-backup/data/main/nested/deeper/inner",
            "volumes/app/data/main/nested",
            "volumes/app/data/main/nested/deeper/inner",
        ]
    );
}

#[test]
fn snapshot_of_a_missing_volume_is_no_volume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let before = root_names(&root);
    assert_eq!(
        store.snapshot(&pkg("ghost")).expect("snapshot"),
        SnapshotOutcome::NoVolume
    );
    assert!(!SnapshotOutcome::NoVolume.created());
    assert_eq!(
        before,
        root_names(&root),
        "nothing may appear, not even a lock"
    );
    assert!(
        !lock_path(&root, "ghost").exists(),
        "no lock is taken for a package that does not exist"
    );
}

#[test]
fn snapshot_over_an_existing_backup_is_incoherent_and_changes_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    store.snapshot(&app).expect("first snapshot");
    modify_volume(&store.volume_path(&app), true);

    let before = digest(&root);
    let err = store
        .snapshot(&app)
        .expect_err("a second snapshot must be refused");
    assert_eq!(err.kind, ErrorKind::Incoherent, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&store.backup_path(&app).display().to_string()),
        "the error must name the backup: {msg}"
    );
    assert_same(&before, &digest(&root), "after a refused snapshot");
    assert!(is_read_only(&store.backup_path(&app)));
}

/// Holds `pkg`'s lock in the store at `root` while `op` runs on another
/// thread, and while `op` waits for it, `change`s the disk as a concurrent
/// operation holding the lock would; then lets `op` go on and returns what
/// it returned. `op` must decide from the disk as it is once it holds the
/// lock, not as it was when it was called.
fn race<T: Send + 'static>(
    root: &std::path::Path,
    pkg: &volume::PackageId,
    op: impl FnOnce(&VolumeStore) -> T + Send + 'static,
    change: impl FnOnce(),
) -> T {
    let dir = volume::sys::open_dir_path(root).expect("opening the volumes root");
    let locks =
        volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).expect("the lock dir");
    let held = locks.lock(pkg).expect("taking the package lock");
    let (tx, rx) = mpsc::channel();
    let root = root.to_owned();
    let t = thread::spawn(move || {
        let store = VolumeStore::open_without_recovery(&root).expect("opening the store");
        let _ = tx.send(op(&store));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the operation ran without the package lock"
    );
    change();
    drop(held);
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the operation never finished");
    t.join().unwrap();
    r
}

/// The volume deleted in place while the operation waits for the lock
/// (the backup then is the only copy of the data).
fn delete_live(root: &std::path::Path) {
    let dir = volume::sys::open_dir_path(root).unwrap();
    volume::delete_tree_at(std::os::fd::AsFd::as_fd(&dir), std::ffi::OsStr::new("app")).unwrap();
}

/// `begin_install` of a package with a volume and a backup, whose volume
/// another operation deletes while `begin_install` waits for the lock:
/// what it decides on is what it finds under the lock, so the backup, now
/// the only copy, is put back as the volume, never dropped.
#[test]
fn begin_install_puts_back_a_backup_left_alone_while_it_waited() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    store.snapshot(&app).expect("snapshot");
    let backed_up = digest(&store.backup_path(&app));
    modify_volume(&store.volume_path(&app), true);
    let begun = race(
        &root,
        &app,
        |s| s.begin_install(&pkg("app")),
        || delete_live(&root),
    )
    .expect("begin");
    assert_eq!(begun, volume::Begun::PutBack);
    assert!(!store.backup_path(&app).exists());
    assert!(!store.is_fresh(&app).unwrap());
    assert_same(&backed_up, &digest(&store.volume_path(&app)), "put back");
    // And with the volume there, the backup goes and nothing is fresh.
    store.snapshot(&app).expect("snapshot");
    assert_eq!(
        store.begin_install(&app).expect("begin"),
        volume::Begun::Volume {
            dropped_backup: true
        }
    );
    assert!(!store.backup_path(&app).exists());
    // With nothing at all, a fresh install is marked.
    let fresh = pkg("fresh");
    assert_eq!(
        store.begin_install(&fresh).expect("begin"),
        volume::Begun::Fresh
    );
    assert!(store.is_fresh(&fresh).unwrap());
}

/// `snapshot_replacing` (upstream's `snapshot`, which replaces a leftover
/// backup) of a package whose volume another operation deletes while it
/// waits for the lock: the backup is then the only copy, kept, and the
/// result is `NoVolume`, as the store's own rule says.
#[test]
fn snapshot_replacing_keeps_a_backup_left_alone_while_it_waited() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    store.snapshot(&app).expect("snapshot");
    let backed_up = digest(&store.backup_path(&app));
    let outcome = race(
        &root,
        &app,
        |s| s.snapshot_replacing(&pkg("app")),
        || delete_live(&root),
    )
    .expect("snapshot");
    assert_eq!(outcome, SnapshotOutcome::NoVolume);
    assert_same(
        &backed_up,
        &digest(&store.backup_path(&app)),
        "the only copy",
    );
    // With the volume there, the leftover backup is replaced by a new one.
    store.restore(&app).expect("restore");
    store.snapshot(&app).expect("snapshot");
    modify_volume(&store.volume_path(&app), true);
    let now = digest(&store.volume_path(&app));
    assert_eq!(
        store.snapshot_replacing(&app).expect("snapshot"),
        SnapshotOutcome::Snapshot
    );
    assert_same(&now, &digest(&store.backup_path(&app)), "the new backup");
}

#[test]
fn restore_rolls_back_everything_including_nested_subvolumes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let at_snapshot = digest(&live);
    store.snapshot(&app).expect("snapshot");
    modify_volume(&live, true);
    // Also a new nested subvolume and a removed one, which a plain diff of the top
    // subvolume would not see.
    subvolume_create(&live.join("data/main/created-later"));
    fs::write(live.join("data/main/created-later/x"), b"x").unwrap();
    // A read-only snapshot the package took itself, inside the replaced volume.
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(live.join("data/main/nested"))
        .arg(live.join("data/main/own-ro-snapshot")))
    .unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "delete"])
        .arg(live.join("data/main/nested/deeper/inner")))
    .unwrap();
    assert_ne!(digest(&live), at_snapshot);

    assert!(
        store.restore(&app).expect("restore"),
        "restore returns true"
    );
    assert_same(&at_snapshot, &digest(&live), "restored volume vs snapshot");
    let d = digest(&live);
    for nested in ["", "data/main/nested", "data/main/nested/deeper/inner"] {
        assert_eq!(
            d.get(nested).map(|e| e.subvolume),
            Some(Subvolume::Root),
            "{nested:?} must be a subvolume again after the restore"
        );
        assert!(
            !is_read_only(&live.join(nested)),
            "restored subvolume {nested:?} must be writable"
        );
    }
    assert_writable(&live.join("data/main"));
    assert_writable(&live.join("data/main/nested"));
    assert_writable(&live.join("data/main/nested/deeper/inner"));
    assert!(!store.backup_path(&app).exists(), "the backup must be gone");
    assert_no_transient_names(&root, "after restore");
    let mut subvols = package_subvolumes(&fs, "app");
    subvols.sort();
    assert_eq!(
        subvols,
        [
            "volumes/app",
            "volumes/app/data/main/nested",
            "volumes/app/data/main/nested/deeper/inner",
        ],
        "the replaced volume and the backup must be deleted, nested ones included"
    );
    assert!(store.recover_all().expect("recover_all").is_empty());
}

#[test]
fn restore_without_a_backup_returns_false_and_changes_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    // A package with nothing at all.
    let ghost = pkg("ghost");
    assert!(!store.restore(&ghost).expect("restore of nothing"));
    let before = digest(&root);
    for _ in 0..2 {
        assert!(!store.restore(&app).expect("restore"));
        assert!(!store.restore(&ghost).expect("restore of nothing"));
    }
    assert_eq!(root_names(&root), ["app"]);
    assert_same(&before, &digest(&root), "restore without backup");
}

#[test]
fn drop_removes_the_backup_only() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    store.snapshot(&app).expect("snapshot");
    modify_volume(&live, true);
    let live_before = digest(&live);

    assert!(store.drop_backup(&app).expect("drop"), "drop returns true");
    assert!(!store.backup_path(&app).exists());
    assert_same(&live_before, &digest(&live), "live volume after drop");
    assert_no_transient_names(&root, "after drop");
    let mut subvols = package_subvolumes(&fs, "app");
    subvols.sort();
    assert_eq!(
        subvols,
        [
            "volumes/app",
            "volumes/app/data/main/nested",
            "volumes/app/data/main/nested/deeper/inner",
        ],
        "the backup's nested snapshots must go with it"
    );
    assert!(!store.drop_backup(&app).expect("second drop"));
    assert_same(&live_before, &digest(&live), "after a no-op drop");
}

#[test]
fn delete_removes_volume_backup_and_nested_subvolumes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let (app, other) = (pkg("app"), pkg("app-other"));
    for p in [&app, &other] {
        store.create(p, &[vol("main")]).expect("create");
        populate_volume(&store.volume_path(p), true);
        store.snapshot(p).expect("snapshot");
    }
    // A read-only snapshot the package took itself, which cannot simply be unlinked.
    let live = store.volume_path(&app);
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(live.join("data/main/nested"))
        .arg(live.join("data/main/nested/own-ro-snapshot")))
    .unwrap();
    let other_before = digest(&store.volume_path(&other));
    assert_eq!(package_subvolumes(&fs, "app").len(), 7);

    assert!(store.delete(&app).expect("delete"), "delete returns true");
    assert!(!store.volume_path(&app).exists());
    assert!(!store.backup_path(&app).exists());
    assert_no_transient_names(&root, "after delete");
    assert_eq!(
        package_subvolumes(&fs, "app"),
        Vec::<String>::new(),
        "no subvolume of the package may be left"
    );
    assert!(!store.delete(&app).expect("second delete"));
    // A package whose name starts with the other's is not touched.
    assert_same(
        &other_before,
        &digest(&store.volume_path(&other)),
        "the other package",
    );
    assert!(store.backup_path(&other).exists());
    assert_eq!(package_subvolumes(&fs, "app-other").len(), 6);
    let list = store.list().expect("list");
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].package, other);
}

#[test]
fn ext4_falls_back_to_plain_directories() {
    let fs = fs_or_skip!(LoopFs::ext4(128 * MIB));
    let root = volumes_root(&fs);
    let store = open(&root);
    assert!(!store.is_btrfs());
    let app = pkg("app");
    assert_eq!(
        store.create(&app, &[vol("main")]).expect("create"),
        VolumeKind::Directory
    );
    let live = store.volume_path(&app);
    assert!(live.join("data/main").is_dir());
    populate_volume(&live, false);

    let names = root_names(&root);
    match store.snapshot(&app).expect("snapshot") {
        SnapshotOutcome::Skipped { reason } => {
            // Why, naming the root and what it is on.
            let canon = root.canonicalize().unwrap();
            let why = format!("the volumes root {} is on ext4, not btrfs", canon.display());
            assert_eq!(reason, why);
            assert_eq!(store.why_not_btrfs(), Some(why));
        }
        other => panic!("expected Skipped on ext4, got {other:?}"),
    }
    assert_eq!(
        root_names(&root),
        names,
        "a skipped snapshot creates nothing"
    );
    assert!(!store.restore(&app).expect("restore"));
    assert!(!store.drop_backup(&app).expect("drop"));

    // A backup taken the upstream way (cp -a) is restored and dropped.
    let original = digest(&live);
    let cp_backup = || {
        run(Command::new("cp")
            .arg("-a")
            .arg(&live)
            .arg(store.backup_path(&app)))
        .expect("cp -a");
    };
    cp_backup();
    modify_volume(&live, false);
    assert!(store.restore(&app).expect("restore"));
    assert_same(&original, &digest(&live), "restored on ext4");
    assert!(!store.backup_path(&app).exists());
    assert_no_transient_names(&root, "after restore on ext4");
    assert_writable(&live.join("data/main"));

    cp_backup();
    let live_before = digest(&live);
    assert!(store.drop_backup(&app).expect("drop"));
    assert!(!store.backup_path(&app).exists());
    assert_same(&live_before, &digest(&live), "live after drop on ext4");

    cp_backup();
    assert!(store.delete(&app).expect("delete"));
    assert!(!live.exists() && !store.backup_path(&app).exists());
    assert!(!store.delete(&app).expect("second delete"));
    assert_no_transient_names(&root, "after delete on ext4");
    assert_eq!(root_names(&root), Vec::<String>::new());
}

/// A plain-directory volume full of the things `cp -a --reflink` gets wrong or that
/// a careless copy would follow.
fn populate_special(vol: &std::path::Path) {
    let main = vol.join("data/main");
    fs::write(main.join("plain.txt"), b"plain\n").unwrap();
    // NOCOW: the flag can only be set while the file is empty.
    let nocow = main.join("nocow.db");
    File::create(&nocow).unwrap();
    run(Command::new("chattr").arg("+C").arg(&nocow)).expect("chattr +C");
    fs::write(&nocow, bytes(10, 256 * 1024)).unwrap();
    // Sparse: 16 MiB with two small written ranges.
    let sparse = File::create(main.join("sparse")).unwrap();
    sparse.set_len(16 * MIB).unwrap();
    sparse.write_all_at(b"head", 0).unwrap();
    sparse.write_all_at(b"tail", 12 * MIB).unwrap();
    drop(sparse);
    symlink("/etc/passwd", main.join("passwd-link")).unwrap();
    symlink("../../..", main.join("up-link")).unwrap();
    run(Command::new("mkfifo").arg(main.join("fifo"))).expect("mkfifo");
    fs::write(main.join("hard-a"), b"linked\n").unwrap();
    fs::hard_link(main.join("hard-a"), main.join("hard-b")).unwrap();
    fs::write(main.join("xattr-file"), b"x\n").unwrap();
    run(Command::new("setfattr")
        .args(["-n", "user.x", "-v", "hello"])
        .arg(main.join("xattr-file")))
    .expect("setfattr");
    fs::write(main.join("acl-file"), b"acl\n").unwrap();
    run(Command::new("setfacl")
        .args(["-m", "u:1234:rwx"])
        .arg(main.join("acl-file")))
    .expect("setfacl");
    fs::create_dir(main.join("acl-dir")).unwrap();
    run(Command::new("setfacl")
        .args(["-d", "-m", "g:4321:rx"])
        .arg(main.join("acl-dir")))
    .expect("setfacl -d");
    fs::write(main.join("setuid-bin"), b"#!/bin/sh\n").unwrap();
    rustix::fs::chown(
        main.join("setuid-bin"),
        Some(rustix::fs::Uid::from_raw(100_000)),
        Some(rustix::fs::Gid::from_raw(100_000)),
    )
    .unwrap();
    fs::set_permissions(main.join("setuid-bin"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::create_dir(main.join("container-owned")).unwrap();
    fs::write(main.join("container-owned/f"), b"f\n").unwrap();
    run(Command::new("chown")
        .args(["-R", "165534:165534"])
        .arg(main.join("container-owned")))
    .expect("chown -R");
    fs::set_permissions(
        main.join("container-owned"),
        fs::Permissions::from_mode(0o2770),
    )
    .unwrap();
    // Give a directory an old mtime, so a copy that forgets to restore it shows.
    File::open(main.join("acl-dir"))
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000))
        .unwrap();
}

#[test]
fn plain_directory_gets_a_complete_reflink_copy_and_restores_from_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    let store = open(&root);
    let app = pkg("app");
    let live = store.volume_path(&app);
    assert_eq!(
        store.create(&app, &[vol("main")]).expect("create"),
        VolumeKind::Directory
    );
    populate_volume(&live, false);
    populate_special(&live);
    let before = digest(&live);

    let outcome = store.snapshot(&app).expect("snapshot");
    match outcome {
        SnapshotOutcome::ReflinkCopy { extents } => assert!(extents > 0, "{outcome:?}"),
        other => panic!("expected ReflinkCopy for a plain directory, got {other:?}"),
    }
    let backup = store.backup_path(&app);
    // Everything the digest sees, all mtimes included, is the same.
    assert_same(&before, &digest(&backup), "reflink copy vs source");
    assert_same(&before, &digest(&live), "source after the copy");
    assert_no_transient_names(&root, "after the reflink copy");
    assert_eq!(
        store.list().expect("list")[0].backup,
        Some(VolumeKind::Directory)
    );

    let bmain = backup.join("data/main");
    let link = fs::symlink_metadata(bmain.join("passwd-link")).unwrap();
    assert!(
        link.file_type().is_symlink(),
        "the symlink must stay a symlink"
    );
    assert_eq!(
        fs::read_link(bmain.join("passwd-link")).unwrap(),
        std::path::Path::new("/etc/passwd")
    );
    let flags = rustix::fs::ioctl_getflags(File::open(bmain.join("nocow.db")).unwrap()).unwrap();
    assert!(
        flags.contains(IFlags::NOCOW),
        "the copy of a NOCOW file must be NOCOW: {flags:?}"
    );
    let sparse = fs::metadata(bmain.join("sparse")).unwrap();
    assert_eq!(sparse.len(), 16 * MIB);
    assert!(
        sparse.blocks() * 512 < MIB,
        "the copy of a sparse file must stay sparse: {} blocks",
        sparse.blocks()
    );
    let fifo = fs::symlink_metadata(bmain.join("fifo")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
    let setuid = fs::symlink_metadata(bmain.join("setuid-bin")).unwrap();
    assert_eq!(
        (setuid.uid(), setuid.gid(), setuid.mode() & 0o7777),
        (100_000, 100_000, 0o4755)
    );
    let acl = digest(&bmain);
    assert!(
        acl.get("acl-file")
            .unwrap()
            .xattrs
            .contains_key(&b"system.posix_acl_access"[..]),
        "the ACL must be copied: {:?}",
        acl.get("acl-file")
    );

    // Restore from the reflink copy.
    modify_volume(&live, false);
    fs::remove_file(live.join("data/main/hard-b")).unwrap();
    fs::write(live.join("data/main/nocow.db"), b"truncated").unwrap();
    assert!(store.restore(&app).expect("restore"));
    assert_same(&before, &digest(&live), "restored from the reflink copy");
    assert!(!backup.exists(), "the backup must be gone");
    assert_no_transient_names(&root, "after restoring a reflink copy");
    assert_writable(&live.join("data/main"));
    assert!(store.recover_all().expect("recover_all").is_empty());
}

#[test]
fn fragmented_plain_directory_is_skipped_above_the_extent_bound() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    let db = root.join("app/data/main/db.sqlite");
    let made = make_fragmented_file(&db, 48 * MIB, 5000, 7).expect("fragmenting");
    assert!(made >= 5000, "the file has only {made} extents");
    assert_eq!(extent_count(&db).unwrap(), made);
    let store = open(&root).with_reflink_extent_limit(1000);
    let app = pkg("app");
    let names = root_names(&root);
    let live_before = digest(&store.volume_path(&app));

    match store.snapshot(&app).expect("snapshot") {
        SnapshotOutcome::Skipped { reason } => {
            assert!(
                reason.contains("1000"),
                "the reason must name the bound: {reason}"
            );
            assert!(reason.contains("extents"), "reason: {reason}");
        }
        other => panic!("expected Skipped above the extent bound, got {other:?}"),
    }
    assert!(!store.backup_path(&app).exists(), "no backup may exist");
    assert_eq!(root_names(&root), names, "no backup and no tmp left");
    assert_same(
        &live_before,
        &digest(&store.volume_path(&app)),
        "live volume",
    );

    // Under a higher bound the same volume gets its reflink copy.
    let store = open(&root).with_reflink_extent_limit(1_000_000);
    match store.snapshot(&app).expect("snapshot") {
        SnapshotOutcome::ReflinkCopy { extents } => {
            assert!(extents >= made, "counted {extents} < {made} FIEMAP extents")
        }
        other => panic!("expected ReflinkCopy under a high bound, got {other:?}"),
    }
    assert_same(
        &live_before,
        &digest(&store.backup_path(&app)),
        "reflink copy of the fragmented volume",
    );
}

/// `held`, what a restore or a delete kept: `<root>/app.held/<n>`, held by
/// `mount` (this namespace's).
fn assert_held_by(store: &VolumeStore, held: Option<&volume::HeldTree>, n: u32, mount: &Path) {
    let held = held.unwrap_or_else(|| panic!("kept while {} is mounted", mount.display()));
    assert_eq!(held.path, store.root().join(format!("app.held/{n}")));
    assert!(
        held.holders
            .iter()
            .any(|h| h.mount_point == mount && h.own_namespace),
        "{held:?}"
    );
}

#[test]
fn bind_mount_of_the_volume_never_blocks_restore_or_delete() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let original = digest(&live);
    store.snapshot(&app).expect("snapshot");
    modify_volume(&live, true);
    let modified = digest(&live);

    // As a container's rootfs would see it: outside the volumes root. The
    // restore goes on; the mount keeps showing the replaced volume, kept.
    let mount = MountGuard::bind(&live.join("data/main"), &fs.path("lxc/app/rootfs/data"));
    let restored = store.restore_outcome(&app).expect("restore under a mount");
    assert!(restored.restored);
    assert_held_by(&store, restored.held.as_ref(), 1, mount.target());
    assert_same(&original, &digest(&live), "restored");
    let held = root.join("app.held/1");
    assert_same(&modified, &digest(&held), "the replaced volume, kept whole");
    fs::write(mount.target().join("through"), b"kept").unwrap();
    assert_eq!(fs::read(held.join("data/main/through")).unwrap(), b"kept");
    assert!(!live.join("data/main/through").exists());
    // Every operation's recovery keeps it while it is mounted ...
    assert!(store.recover(&app).unwrap().actions.is_empty());
    assert!(held.exists());
    mount.unmount();
    // ... and deletes it, nested subvolumes included, once it is not.
    reclaimed_eventually(&root, "app", || drop(store.recover(&app).unwrap()));
    let left = package_subvolumes(&fs, "app");
    assert!(left.iter().all(|s| !s.contains("held")), "{left:?}");

    // A bind mount of a nested subvolume counts too; a delete keeps the
    // volume, off the package's name, until it is unmounted.
    let before = digest(&live);
    let mount = MountGuard::bind(
        &live.join("data/main/nested"),
        &fs.path("lxc/app/rootfs/nested"),
    );
    let deleted = store.delete_outcome(&app).expect("delete under a mount");
    assert!(deleted.deleted && !live.exists());
    assert_held_by(&store, deleted.held.as_ref(), 1, mount.target());
    assert_same(&before, &digest(&held), "the deleted volume, kept whole");
    mount.unmount();

    // A mount of another package whose id extends this one's does not count.
    let tools = pkg("app-tools");
    store
        .create(&tools, &[vol("main")])
        .expect("create app-tools");
    let other = MountGuard::bind(
        &store.data_dir(&tools, &vol("main")),
        &fs.path("lxc/app-tools/rootfs/data"),
    );
    reclaimed_eventually(&root, "app", || drop(store.recover(&app).unwrap()));
    store.create(&app, &[vol("main")]).expect("create again");
    store.snapshot(&app).expect("snapshot");
    let restored = store.restore_outcome(&app).expect("restore");
    assert!(restored.restored && restored.held.is_none(), "{restored:?}");
    let deleted = store.delete_outcome(&app).expect("delete");
    assert!(deleted.deleted && deleted.held.is_none(), "{deleted:?}");
    assert!(package_subvolumes(&fs, "app").is_empty());
    // ... while app-tools itself is held.
    let deleted = store.delete_outcome(&tools).expect("app-tools is mounted");
    assert!(deleted.held.is_some(), "{deleted:?}");
    other.unmount();
    reclaimed_eventually(&root, "app-tools", || drop(store.recover(&tools).unwrap()));
    assert!(root_names(&root).is_empty());
}

#[test]
fn mount_inside_the_volume_never_blocks_restore_or_delete() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    fs::create_dir(live.join("data/main/cache")).unwrap();
    let original = digest(&live);
    store.snapshot(&app).expect("snapshot");
    modify_volume(&live, true);

    let mount = MountGuard::tmpfs(&live.join("data/main/cache"));
    fs::write(mount.target().join("scratch"), b"tmp").unwrap();
    let restored = store.restore_outcome(&app).expect("restore");
    // Named where it is now, in the kept tree.
    let moved = root.join("app.held/1/data/main/cache");
    assert_held_by(&store, restored.held.as_ref(), 1, &moved);
    assert_same(&original, &digest(&live), "restored");
    // The mount went with the replaced volume, and is never crossed.
    assert_eq!(fs::read(moved.join("scratch")).unwrap(), b"tmp");
    assert!(!live.join("data/main/cache/scratch").exists());
    integration::run(std::process::Command::new("umount").arg(&moved)).unwrap();
    drop(mount);
    reclaimed_eventually(&root, "app", || drop(store.recover(&app).unwrap()));

    assert!(store.delete(&app).expect("delete"));
    assert!(!live.exists());
    assert!(root_names(&root).is_empty());
}

#[test]
fn concurrent_operations_on_one_package_stay_coherent() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let original = digest(&live);

    const ROUNDS: usize = 12;
    // Indexes into `counts`.
    const SNAPSHOT: usize = 0;
    const REFUSED: usize = 1;
    const DROPPED: usize = 2;
    const RESTORED: usize = 3;
    const NOTHING: usize = 4;
    let errors = std::sync::Mutex::new(Vec::<String>::new());
    let counts = std::sync::Mutex::new([0usize; 5]);
    // The dropper and the restorer go on until both snapshotters are done,
    // so that they meet backups whatever the scheduling.
    let snapshotters_left = std::sync::atomic::AtomicUsize::new(2);
    thread::scope(|s| {
        for t in 0..4 {
            let (store, app, errors, counts) = (&store, &app, &errors, &counts);
            let left = &snapshotters_left;
            s.spawn(move || {
                let mut i = 0;
                while i < ROUNDS || (t >= 2 && left.load(std::sync::atomic::Ordering::SeqCst) > 0) {
                    i += 1;
                    // Two snapshotters, one dropper, one restorer.
                    let r = match t {
                        0 | 1 => match store.snapshot(app) {
                            Ok(SnapshotOutcome::Snapshot) => Ok(SNAPSHOT),
                            Err(e) if e.kind == ErrorKind::Incoherent => Ok(REFUSED),
                            Ok(other) => Err(format!("snapshot gave {other:?}")),
                            Err(e) => Err(format!("snapshot: {e}")),
                        },
                        2 => store
                            .drop_backup(app)
                            .map(|d| if d { DROPPED } else { NOTHING })
                            .map_err(|e| format!("drop: {e}")),
                        _ => store
                            .restore(app)
                            .map(|r| if r { RESTORED } else { NOTHING })
                            .map_err(|e| format!("restore: {e}")),
                    };
                    match r {
                        Ok(k) => counts.lock().unwrap()[k] += 1,
                        Err(e) => errors
                            .lock()
                            .unwrap()
                            .push(format!("thread {t} round {i}: {e}")),
                    }
                }
                if t < 2 {
                    left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "unexpected errors: {errors:#?}");
    let [snapshots, refused, drops, restores, _] = counts.into_inner().unwrap();
    eprintln!(
        "{snapshots} snapshots, {refused} refused as Incoherent, {drops} drops, {restores} restores"
    );
    assert!(snapshots > 0, "no snapshot succeeded");
    assert!(
        drops + restores > 0,
        "no backup was ever dropped or restored: the threads did not interleave"
    );

    // Nobody wrote to the volume, so every restore brought back the same content.
    assert_same(&original, &digest(&live), "live volume after the storm");
    assert_no_transient_names(&root, "after concurrent operations");
    let backup = store.backup_path(&app);
    if backup.exists() {
        assert!(is_read_only(&backup));
        assert_same(&original, &digest(&backup), "backup after the storm");
    }
    assert!(store.recover_all().expect("recover_all").is_empty());
    let expected = if backup.exists() { 6 } else { 3 };
    assert_eq!(
        package_subvolumes(&fs, "app").len(),
        expected,
        "{:?}",
        package_subvolumes(&fs, "app")
    );
}

#[test]
fn a_held_package_lock_blocks_only_that_package() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let (a, b) = (pkg("alpha"), pkg("beta"));
    for p in [&a, &b] {
        store.create(p, &[vol("main")]).expect("create");
        populate_volume(&store.volume_path(p), false);
    }

    // Another process (or thread) in the middle of an operation on alpha.
    let lock = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock_path(&root, "alpha"))
        .unwrap();
    rustix::fs::flock(&lock, FlockOperation::LockExclusive).expect("flock alpha's lock");

    thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let (store, a) = (&store, &a);
        s.spawn(move || {
            let _ = tx.send(store.snapshot(a).map_err(|e| e.to_string()));
        });

        let t0 = Instant::now();
        assert_eq!(
            store.snapshot(&b).expect("beta's snapshot"),
            SnapshotOutcome::Snapshot
        );
        let beta_took = t0.elapsed();
        assert!(
            beta_took < Duration::from_secs(10),
            "beta took {beta_took:?} while alpha's lock was held"
        );
        assert!(store.backup_path(&b).exists());

        match rx.recv_timeout(Duration::from_millis(700)) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            other => panic!("alpha's snapshot must block while its lock is held: {other:?}"),
        }
        assert!(!store.backup_path(a).exists(), "alpha ran without its lock");

        drop(lock);
        let t1 = Instant::now();
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("alpha's snapshot must finish once the lock is released");
        assert_eq!(r, Ok(SnapshotOutcome::Snapshot));
        eprintln!(
            "beta: {beta_took:?} with alpha locked; alpha finished {:?} after release",
            t1.elapsed()
        );
    });
    assert!(store.backup_path(&a).exists());
}

#[test]
fn recovery_on_a_clean_store_does_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    assert!(store.recover_all().expect("recover_all").is_empty());
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    store.snapshot(&app).expect("snapshot");
    store.create(&pkg("other"), &[vol("main")]).expect("create");
    let before = digest(&root);
    for round in 0..2 {
        assert_eq!(
            store.recover_all().expect("recover_all"),
            Vec::new(),
            "round {round}"
        );
        let r = store.recover(&app).expect("recover");
        assert!(r.actions.is_empty(), "round {round}: {r:?}");
        // Reopening recovers too.
        drop(open(&root));
    }
    assert_same(&before, &digest(&root), "after recovery on a clean store");
}

#[test]
fn recovery_finishes_what_names_on_disk_say() {
    // Transient names made by hand, as a crash would leave them (the crash tests do
    // it for real): recovery must clean each up, and report it.
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), true);
    let live = digest(&store.volume_path(&app));
    store.snapshot(&app).expect("snapshot");
    let backup = digest(&store.backup_path(&app));
    subvolume_create(&root.join("app.install-backup.tmp"));
    subvolume_create(&root.join("app.install-backup.drop"));
    // No record, beside the backup it would be a copy of: incomplete.
    fs::create_dir(root.join("app.rollback")).unwrap();
    subvolume_create(&root.join("gone.delete"));
    subvolume_create(&root.join("gone.delete/nested"));

    let recovered = store.recover_all().expect("recover_all");
    let actions: Vec<_> = recovered
        .iter()
        .map(|r| (r.package.to_string(), r.actions.len()))
        .collect();
    assert_eq!(
        actions,
        [("app".to_owned(), 3), ("gone".to_owned(), 1)],
        "{recovered:?}"
    );
    assert_no_transient_names(&root, "after recovery");
    assert_same(&live, &digest(&store.volume_path(&app)), "live volume");
    assert_same(&backup, &digest(&store.backup_path(&app)), "backup");
    assert!(package_subvolumes(&fs, "gone").is_empty());
    assert!(store.recover_all().expect("second recover_all").is_empty());
}

#[test]
fn restore_puts_the_backup_back_when_the_volume_is_missing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let original = digest(&live);
    store.snapshot(&app).expect("snapshot");
    // Lost by hand (say, an interrupted upstream uninstall): only the backup is left.
    run(Command::new("btrfs")
        .args(["subvolume", "delete"])
        .arg(live.join("data/main/nested/deeper/inner"))
        .arg(live.join("data/main/nested"))
        .arg(&live))
    .expect("deleting the live volume");
    assert!(!live.exists());
    let list = store.list().expect("list");
    assert_eq!(
        (list[0].volume, list[0].backup),
        (None, Some(VolumeKind::Subvolume))
    );

    assert!(store.restore(&app).expect("restore"));
    assert_same(&original, &digest(&live), "volume rebuilt from the backup");
    assert!(!store.backup_path(&app).exists());
    assert_no_transient_names(&root, "after restore");
    assert_writable(&live.join("data/main/nested"));
}

fn has_flags(path: &std::path::Path, flags: IFlags) -> bool {
    let f = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    rustix::fs::ioctl_getflags(&f)
        .expect("FS_IOC_GETFLAGS")
        .contains(flags)
}

/// `chattr +i` on a file and a directory and `chattr +a` on a file, which forbid
/// unlinking them.
fn make_undeletable(main: &std::path::Path) {
    fs::write(main.join("immutable"), b"frozen\n").unwrap();
    fs::write(main.join("append-only.log"), b"line 1\n").unwrap();
    fs::create_dir(main.join("immutable-dir")).unwrap();
    fs::write(main.join("immutable-dir/inside"), b"x\n").unwrap();
    for (flag, name) in [
        ("+i", "immutable"),
        ("+a", "append-only.log"),
        ("+i", "immutable-dir"),
    ] {
        run(Command::new("chattr").arg(flag).arg(main.join(name))).expect("chattr");
    }
}

#[test]
fn immutable_and_append_only_files_do_not_wedge_a_package() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let (plain, subvol) = (pkg("plain"), pkg("subvol"));
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    for p in [&plain, &subvol] {
        store.create(p, &[vol("main")]).expect("create");
        populate_volume(&store.volume_path(p), false);
        make_undeletable(&store.data_dir(p, &vol("main")));
    }

    for p in [&plain, &subvol] {
        let live = store.volume_path(p);
        let original = digest(&live);
        let outcome = store.snapshot(p).expect("snapshot");
        assert!(outcome.created(), "{p}: {outcome:?}");
        let bmain = store.backup_path(p).join("data/main");
        assert!(
            has_flags(&bmain.join("immutable"), IFlags::IMMUTABLE)
                && has_flags(&bmain.join("append-only.log"), IFlags::APPEND)
                && has_flags(&bmain.join("immutable-dir"), IFlags::IMMUTABLE),
            "{p}: the backup keeps the flags"
        );
        fs::write(live.join("data/main/config.toml"), b"changed").unwrap();

        // The replaced volume holds undeletable files: the restore must still
        // delete it, and leave nothing behind.
        assert!(
            store
                .restore(p)
                .unwrap_or_else(|e| panic!("{p}: restore: {e}"))
        );
        assert_same(&original, &digest(&live), &format!("{p}: restored"));
        assert!(has_flags(
            &live.join("data/main/immutable"),
            IFlags::IMMUTABLE
        ));
        assert_no_transient_names(&root, &format!("{p}: after restore"));

        store.snapshot(p).expect("second snapshot");
        assert!(
            store
                .drop_backup(p)
                .unwrap_or_else(|e| panic!("{p}: drop: {e}"))
        );
        assert!(!store.backup_path(p).exists());
        assert_no_transient_names(&root, &format!("{p}: after drop"));

        store.snapshot(p).expect("third snapshot");
        assert!(
            store
                .delete(p)
                .unwrap_or_else(|e| panic!("{p}: delete: {e}"))
        );
        assert!(!live.exists() && !store.backup_path(p).exists());
        assert_no_transient_names(&root, &format!("{p}: after delete"));
    }
    assert_eq!(root_names(&root), Vec::<String>::new());
}

#[test]
fn the_extent_bound_is_inclusive() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    for i in 0..5u64 {
        fs::write(
            root.join(format!("app/data/main/f{i}")),
            bytes(i, 64 * 1024),
        )
        .unwrap();
    }
    run(&mut Command::new("sync")).unwrap();
    let app = pkg("app");
    let extents = match open(&root).snapshot(&app).expect("snapshot") {
        SnapshotOutcome::ReflinkCopy { extents } => extents,
        other => panic!("expected a reflink copy: {other:?}"),
    };
    assert!(extents >= 5, "five non-empty files: {extents} extents");
    assert!(open(&root).drop_backup(&app).expect("drop"));

    let at_bound = open(&root).with_reflink_extent_limit(extents);
    assert_eq!(
        at_bound.snapshot(&app).expect("snapshot at the bound"),
        SnapshotOutcome::ReflinkCopy { extents }
    );
    assert!(at_bound.drop_backup(&app).expect("drop"));
    let below = open(&root).with_reflink_extent_limit(extents - 1);
    assert!(
        matches!(
            below.snapshot(&app).expect("snapshot below the bound"),
            SnapshotOutcome::Skipped { .. }
        ),
        "one extent over the bound must be skipped"
    );
    assert!(!below.backup_path(&app).exists());
}

/// A restore that defers deleting the replaced volume is complete when it
/// returns; the replaced data waits under `<pkg>.replaced` until `purge`, or
/// until the next operation's recovery deletes it.
#[test]
fn restore_deferring_purge_leaves_only_garbage_behind() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let live = store.volume_path(&app);
    populate_volume(&live, true);
    let snapshotted = digest(&live);
    assert!(store.snapshot(&app).expect("snapshot").created());
    modify_volume(&live, true);
    let modified = digest(&live);

    assert!(store.restore_deferring_purge(&app).expect("restore"));
    assert_same(&snapshotted, &digest(&live), "restored volume");
    // The backup it consumed waits in the trash, as garbage, for the purge.
    assert_eq!(root_names(&root), [".trash", "app", "app.replaced"]);
    assert_eq!(trash_entries(&root), ["app.1"]);
    assert_same(
        &modified,
        &digest(&root.join("app.replaced")),
        "the replaced volume, kept for purge",
    );
    assert!(store.purge(&app).expect("purge"));
    assert!(!store.purge(&app).expect("second purge"));
    assert_no_transient_names(&root, "after purge");
    assert_eq!(root_names(&root), ["app"], "the trash emptied by the purge");

    // Not purged: the next operation on the package deletes it first.
    assert!(store.snapshot(&app).expect("snapshot").created());
    assert!(store.restore_deferring_purge(&app).expect("restore"));
    assert!(root.join("app.replaced").exists());
    let rec = store.recover(&app).expect("recover");
    assert_eq!(rec.actions, ["deleted the volume a restore replaced"]);
    assert_no_transient_names(&root, "after recovery");
    assert_same(&snapshotted, &digest(&live), "volume after recovery");
    assert!(
        package_subvolumes(&fs, "app")
            .iter()
            .all(|p| !p.contains("replaced"))
    );
}

/// A plain-directory volume may hold a nested subvolume its package made
/// read-only: deleting it (uninstall, or a replaced volume after a restore)
/// must still work, or the transient name would block every later recovery.
#[test]
fn plain_volume_with_a_read_only_nested_subvolume_is_deleted() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = root.join("plain/data/main");
    fs::create_dir_all(&main).expect("mkdir");
    fs::write(main.join("f"), b"data").expect("write");
    subvolume_create(&main.join("sub"));
    fs::write(main.join("sub/g"), b"inner").expect("write");
    run(Command::new("btrfs")
        .args(["property", "set", "-ts"])
        .arg(main.join("sub"))
        .args(["ro", "true"]))
    .expect("make the nested subvolume read-only");
    let store = open(&root);
    assert!(store.delete(&pkg("plain")).expect("delete"));
    assert_eq!(root_names(&root), Vec::<String>::new());
    assert!(package_subvolumes(&fs, "plain").is_empty());
}

/// One package whose recovery fails does not keep the others half-done.
#[test]
fn recover_all_goes_on_past_a_package_it_cannot_recover() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    // "aa" has a regular file under one of its names, no state of ours,
    // which its recovery refuses; "zz" sorts after it and has a partial
    // backup to discard.
    fs::create_dir_all(root.join("aa.delete")).expect("mkdir");
    fs::write(root.join("aa.replaced"), b"not ours").expect("a stray");
    fs::create_dir_all(root.join("zz.install-backup.tmp")).expect("mkdir");
    let store = VolumeStore::open_without_recovery(&root).expect("open");
    let done = store.recover_all().expect("recover_all");
    assert_eq!(done.len(), 2, "{done:?}");
    assert_eq!(done[0].package.as_str(), "aa");
    assert!(done[0].error.is_some(), "{done:?}");
    assert_eq!(done[1].package.as_str(), "zz");
    assert_eq!(done[1].actions, ["deleted an incomplete install backup"]);
    assert!(!root.join("zz.install-backup.tmp").exists());
    fs::remove_file(root.join("aa.replaced")).expect("the stray removed");
    let done = store.recover_all().expect("recover_all");
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].error, None);
    assert_no_transient_names(&root, "after the stray is gone");
}

/// The kernel refuses a link to an immutable or append-only inode; the copy
/// must still recreate a hardlinked append-only log as a hardlink, flags
/// kept, instead of giving up the backup.
#[test]
fn hardlinked_append_only_and_immutable_files_are_copied() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = root.join("plain/data/main");
    fs::create_dir_all(&main).expect("mkdir");
    for (name, flag) in [("log", "+a"), ("frozen", "+i")] {
        fs::write(main.join(name), b"records\n").expect("write");
        fs::hard_link(main.join(name), main.join(format!("{name}.link"))).expect("link");
        run(Command::new("chattr").arg(flag).arg(main.join(name))).expect("chattr");
    }
    let before = digest(&root.join("plain"));
    let store = open(&root);
    let outcome = store.snapshot(&pkg("plain")).expect("snapshot");
    assert!(
        matches!(outcome, SnapshotOutcome::ReflinkCopy { .. }),
        "{outcome:?}"
    );
    let bmain = store.backup_path(&pkg("plain")).join("data/main");
    assert_same(
        &before,
        &digest(&store.backup_path(&pkg("plain"))),
        "the copy",
    );
    assert!(has_flags(&bmain.join("log"), IFlags::APPEND));
    assert!(has_flags(&bmain.join("frozen.link"), IFlags::IMMUTABLE));
    assert!(store.drop_backup(&pkg("plain")).expect("drop"));
}

/// An operation that changes a package waits for its lock only as long as
/// the store was told (what start-core's drop-in sets, as its caller cannot
/// see the wait): then it fails with `Timeout` naming the holder, and
/// nothing changed.
#[test]
fn a_bounded_change_wait_fails_naming_the_holder_and_changes_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    populate_volume(&store.volume_path(&app), false);
    let before = digest(&root);

    let dir = volume::sys::open_dir_path(&root).expect("opening the volumes root");
    let locks =
        volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).expect("the lock dir");
    let held = locks.lock(&app).expect("taking the package lock");
    let bounded = VolumeStore::open_without_recovery(&root)
        .expect("open")
        .with_change_wait(volume::lock::LockWait::Within(Duration::from_millis(300)));
    let t0 = Instant::now();
    let e = bounded.snapshot(&app).expect_err("the lock is held");
    let waited = t0.elapsed();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert!(
        e.to_string().contains(&std::process::id().to_string()),
        "the holder is named: {e}"
    );
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    assert_same(&before, &digest(&root), "a snapshot that timed out");
    drop(held);
    assert_eq!(
        bounded.snapshot(&app).expect("once the lock is free"),
        SnapshotOutcome::Snapshot
    );
}

/// What recovery reclaims beyond a crash's names is reclaimed by the boot's
/// `recover_all` too (a check without the lock that passed over packages
/// with no crash's names once lost it): a conversion's old directory whose
/// volume an earlier version uninstalled (beside a package with nothing to
/// do, which stays as it is).
#[test]
fn recover_all_deletes_a_conversions_old_directory_whose_volume_is_gone() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("gone.migrate-old/data/main")).expect("mkdir");
    fs::write(root.join("gone.migrate-old/data/main/db"), b"old").expect("write");
    fs::create_dir_all(root.join("kept/data/main")).expect("mkdir");
    let store = VolumeStore::open_without_recovery(&root).expect("open");
    let done = store.recover_all().expect("recover_all");
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].package.as_str(), "gone");
    assert_eq!(
        done[0].actions,
        ["deleted the old directory of a conversion whose volume is gone"]
    );
    assert_eq!(root_names(&root), ["kept"]);
}

/// `create` over an existing volume where one of the asked volume
/// directories is a file: refused, naming it, and none of the others made
/// (bad input changes nothing), nor anything else under the package.
#[test]
fn create_refuses_a_non_directory_before_making_any() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let a = pkg("a");
    store.create(&a, &[vol("main")]).expect("create");
    let main = store.volume_path(&a).join("data/main");
    fs::remove_dir(&main).unwrap();
    fs::write(&main, "a file where a volume directory goes").unwrap();
    let before = digest(&root);
    let e = store
        .create(&a, &[vol("other"), vol("main")])
        .expect_err("a file where a volume directory goes");
    assert!(
        e.to_string()
            .contains("data/main exists and is not a directory"),
        "{e}"
    );
    assert!(!store.volume_path(&a).join("data/other").exists());
    assert_same(&before, &digest(&root), "after the refused create");
}

/// `info` takes no lock, so a recovery may reclaim `<pkg>.held` (remove the
/// directory) between its look at the name and its read of the entries:
/// that is a package with no held tree, never an error.
#[test]
fn info_never_fails_on_a_held_tree_reclaimed_meanwhile() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (root, stop, app) = (root.clone(), stop.clone(), app.clone());
        thread::spawn(move || {
            let store = VolumeStore::open_without_recovery(&root).expect("open");
            let mut reads = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                store
                    .info(&app)
                    .unwrap_or_else(|e| panic!("info after {reads} reads: {e}"));
                reads += 1;
            }
            reads
        })
    };
    // A tree no mount holds, kept as if one had: the next recovery
    // reclaims it and removes the directory.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut reclaims = 0;
    while Instant::now() < deadline && !reader.is_finished() {
        fs::create_dir_all(root.join("app.held/1")).unwrap();
        store.recover(&app).expect("recover");
        assert!(!root.join("app.held").exists());
        reclaims += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    assert!(
        reclaims > 10 && reads > 100,
        "{reclaims} reclaims, {reads} reads"
    );
}

/// A stray that is no tree in `<pkg>.held` (nothing the store puts there,
/// but a crash or a hand may) goes as a held tree does once unmounted,
/// never keeping the directory, and every recovery's warning, for ever.
#[test]
fn a_stray_file_in_the_held_directory_is_reclaimed() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = open(&root);
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    fs::create_dir_all(root.join("app.held")).unwrap();
    fs::write(root.join("app.held/1"), b"stray").unwrap();
    symlink("/etc", root.join("app.held/2")).unwrap();
    let rec = store.recover(&app).expect("recover");
    assert_eq!(rec.actions.len(), 2, "{:?}", rec.actions);
    assert_eq!(root_names(&root), ["app"]);
    assert!(Path::new("/etc/passwd").exists(), "never followed");
}
