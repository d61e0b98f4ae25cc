//! Durability by commit, by name: every rename of a subvolume in the
//! volumes root (the restore's exchange, the moves aside of a drop, a
//! delete, a purge) is followed by a metadata commit (START_SYNC, then
//! WAIT_SYNC), not by an fsync of the root that commits only because
//! btrfs's log tree cannot record a subvolume's rename. And a backup of a
//! volume with nothing nested is made read-only by the snapshot ioctl
//! itself: no SUBVOL_SETFLAGS, whose own commit it saves.
//!
//! Read from the trace of every call through `volume::sys`
//! (`STARTOS_VOLUME_FAULT=trace`), as the I/O-error sweep reads it.

mod common;

use common::sweep::trace;
use common::*;
use integration::{LoopFs, fs_or_skip};
use volume::VolumeStore;

/// Asserts that after each rename in `calls`, the first call that makes
/// anything durable is a commit.
#[track_caller]
fn renames_committed(calls: &[String], what: &str) -> usize {
    let mut renames = 0;
    for (i, call) in calls.iter().enumerate() {
        if call != "renameat_with" {
            continue;
        }
        renames += 1;
        let next = calls[i + 1..]
            .iter()
            .find(|c| *c == "fsync" || *c == "ioctl START_SYNC");
        assert_eq!(
            next.map(String::as_str),
            Some("ioctl START_SYNC"),
            "{what}: rename #{renames} made durable by {next:?}: {calls:?}"
        );
    }
    renames
}

#[test]
fn renames_of_subvolumes_are_made_durable_by_a_commit() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open");
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    populate_volume(&root.join("app"), false);
    store.snapshot(&pkg("app")).expect("snapshot");
    modify_volume(&root.join("app"), false);

    let restore = trace("startos-volume", &root, &["restore", "app"]);
    assert!(renames_committed(&restore, "restore") >= 2, "{restore:?}");
    store.snapshot(&pkg("app")).expect("snapshot");
    let drop = trace("startos-volume", &root, &["drop", "app"]);
    assert!(renames_committed(&drop, "drop") >= 1, "{drop:?}");
    let delete = trace("startos-volume", &root, &["delete", "app"]);
    assert!(renames_committed(&delete, "delete") >= 1, "{delete:?}");
}

#[test]
fn a_backup_with_nothing_nested_is_read_only_in_one_step() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open");
    for (name, nested) in [("flat", false), ("deep", true)] {
        store.create(&pkg(name), &[vol("main")]).expect("create");
        populate_volume(&root.join(name), nested);
        let calls = trace("startos-volume", &root, &["snapshot", name]);
        let frozen = calls.iter().any(|c| c == "ioctl SUBVOL_SETFLAGS");
        assert_eq!(
            frozen, nested,
            "{name}: frozen afterwards only with something nested: {calls:?}"
        );
        let backup = root.join(format!("{name}.install-backup"));
        assert!(is_read_only(&backup), "{name}: the backup is read-only");
    }
}

/// A cut makes no commit of its own before its
/// exchange (only a clone does), which is sound only while nothing between
/// its snapshot and its exchange writes file data (data written without a
/// commit is not durable with the exchange's metadata commit). The CLI's
/// run (Auto, a deferred cut, the rest's record) of packages that sort
/// apart by weight and by name, one holding an immutable file and one
/// dirty in the page cache when the run starts: between each snapshot and
/// the exchange after it, no call writes file data or commits.
#[test]
fn a_cut_writes_no_file_data_between_its_snapshot_and_its_exchange() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    for (name, files) in [("alpha", 1), ("heavy", 1500), ("light", 2)] {
        let main = root.join(name).join("data/main");
        std::fs::create_dir_all(&main).expect("mkdir");
        for i in 0..files {
            std::fs::write(main.join(format!("f{i}")), i.to_string()).expect("write");
        }
    }
    rustix::fs::sync();
    std::fs::write(root.join("light/data/main/late"), vec![7u8; 3 << 20]).expect("late");
    let calls = trace("volume-migrate", &root, &["--json", "--keep-old"]);
    let snapshot = |c: &str| c.starts_with("btrfs volume ioctl");
    let data = ["write", "ftruncate", "ioctl FICLONERANGE", "ioctl_ficlone"];
    let commits = ["ioctl SYNC", "ioctl START_SYNC", "syncfs", "fsync"];
    let mut cuts = 0;
    let mut i = 0;
    while let Some(at) = calls[i..].iter().position(|c| snapshot(c)) {
        let from = i + at;
        let to = from
            + calls[from..]
                .iter()
                .position(|c| c == "renameat_with")
                .expect("an exchange after each snapshot");
        let between = &calls[from + 1..to];
        cuts += 1;
        assert!(
            !between.iter().any(|c| data.contains(&c.as_str())),
            "cut #{cuts}: file data written before the exchange: {between:?}"
        );
        assert!(
            !between.iter().any(|c| commits.contains(&c.as_str())),
            "cut #{cuts}: a commit or fsync before the exchange: {between:?}"
        );
        i = to + 1;
    }
    assert_eq!(cuts, 3, "three cuts: {calls:?}");
}

/// A clone writes no file data and commits nothing before its exchange
/// either: it only shares extents (FICLONE writes out the source's range
/// itself, a file dirty in the page cache when the run starts included)
/// and sets metadata, all ordered before the exchange by btrfs's
/// transactions; the exchange is then committed by name.
#[test]
fn a_clone_writes_no_file_data_and_commits_nothing_before_its_exchange() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    for (name, files) in [("alpha", 3), ("beta", 40)] {
        let main = root.join(name).join("data/main");
        std::fs::create_dir_all(&main).expect("mkdir");
        for i in 0..files {
            std::fs::write(main.join(format!("f{i}")), i.to_string()).expect("write");
        }
    }
    rustix::fs::sync();
    let dirty = root.join("beta/data/main/late");
    std::fs::write(&dirty, vec![7u8; 3 << 20]).expect("late");
    let calls = trace(
        "volume-migrate",
        &root,
        &["--json", "--keep-old", "--method", "clone"],
    );
    let data = ["write", "pwrite", "ftruncate"];
    let commits = ["ioctl SYNC", "ioctl START_SYNC", "syncfs", "fsync"];
    let mut clones = 0;
    let mut i = 0;
    while let Some(at) = calls[i..].iter().position(|c| c == "ioctl FICLONERANGE") {
        let from = i + at;
        let to = from
            + calls[from..]
                .iter()
                .position(|c| c == "renameat_with")
                .expect("an exchange after each clone");
        let between = &calls[from..to];
        let after = calls[to + 1..]
            .iter()
            .find(|c| commits.contains(&c.as_str()));
        assert_eq!(
            after.map(String::as_str),
            Some("ioctl START_SYNC"),
            "the exchange committed by name"
        );
        clones += 1;
        assert!(
            !between.iter().any(|c| data.contains(&c.as_str())),
            "clone #{clones}: file data written before the exchange: {between:?}"
        );
        assert!(
            !between.iter().any(|c| commits.contains(&c.as_str())),
            "clone #{clones}: a commit or fsync before the exchange: {between:?}"
        );
        i = to + 1;
    }
    assert_eq!(clones, 2, "two clones: {calls:?}");
    assert_eq!(
        std::fs::read(&dirty).expect("the dirty file, cloned"),
        vec![7u8; 3 << 20]
    );
}
