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
