//! The I/O-error sweep, as SQLite tests its I/O layer: every operation is run
//! again and again with the k-th system call through `volume::sys` failing
//! (`STARTOS_VOLUME_FAULT=k:errno`, or `k+:errno` for that call and every
//! later one, as on a filesystem gone read-only), for every k of the
//! operation, each errno in [`ERRNOS`]; after each injected failure one
//! invariant is checked ([`Sweep::run_one`]):
//!
//! 1. the call reports the failure: it exits non-zero with one error line on
//!    stderr (after any warnings it logged on its way), or, if it exits 0 (a failure it was built to absorb, such as an
//!    ENOSPC rename it replaces by a one-step delete), its result is exactly
//!    the complete after-state;
//! 2. the package's volume is then exactly its state before the call or after
//!    it (each tree compared in full: content, types, modes, owners, xattrs,
//!    hardlinks, subvolumes, times);
//! 3. data written into the live volume after the failure survives the next
//!    command, whichever it is (recover, list, snapshot, restore, drop; for a
//!    conversion, the next boot's): a restore is the only one that may replace
//!    it, and only with the backup;
//! 4. after `recover` (or the next boot), no name of the package is left but
//!    its volume and backup, and what the package holds is before or after.
//!
//! `make test` runs a sample covering every operation, errno and mode;
//! `make faults` (FAULTS_FULL=1) runs every k. Each test prints its counts.

mod common;

use std::fs;
use std::path::Path;

use common::sweep::*;
use common::*;
use integration::LoopFs;
use volume::VolumeStore;

// ------------------------------------------------------------------ setups

fn store(root: &Path) -> VolumeStore {
    VolumeStore::open(root).expect("opening the store")
}

/// `app`, a subvolume volume with nested subvolumes (one read-only), files,
/// a hardlink and a symlink.
fn subvolume_volume(root: &Path) {
    let s = store(root);
    s.create(&pkg("app"), &[vol("main")]).expect("create");
    populate_volume(&root.join("app"), true);
    volume::sys::set_read_only(
        std::os::fd::AsFd::as_fd(
            &volume::sys::open_dir_path(&root.join("app/data/main/nested/deeper/inner"))
                .expect("open"),
        ),
        true,
    )
    .expect("read-only");
}

/// `app`, a plain directory with files and one nested subvolume.
fn plain_volume(root: &Path) {
    fs::create_dir_all(root.join("app/data/main")).expect("mkdir");
    populate_volume(&root.join("app"), false);
    subvolume_create(&root.join("app/data/main/nested"));
    fs::write(root.join("app/data/main/nested/blob"), bytes(9, 40_000)).expect("write");
}

fn with_backup(root: &Path, make: fn(&Path)) {
    make(root);
    store(root).snapshot(&pkg("app")).expect("snapshot");
    modify_volume(&root.join("app"), false);
}

fn subvolume_with_backup(root: &Path) {
    with_backup(root, subvolume_volume);
}

fn plain_with_backup(root: &Path) {
    with_backup(root, plain_volume);
}

/// A restore killed right after its exchange: recovery has it to finish.
fn interrupted_restore(root: &Path) {
    subvolume_with_backup(root);
    let out = tool_command(Tool::Volume, root, &["restore", "app"])
        .env(volume::FAILPOINT_ENV, "restore.exchanged")
        .output()
        .expect("restore");
    assert!(
        !out.status.success(),
        "the restore must die at its exchange"
    );
}

/// A delete killed after its rename: recovery has it to finish.
fn interrupted_delete(root: &Path) {
    subvolume_with_backup(root);
    let out = tool_command(Tool::Volume, root, &["delete", "app"])
        .env(volume::FAILPOINT_ENV, "delete.renamed")
        .output()
        .expect("delete");
    assert!(
        !out.status.success(),
        "the delete must die after its rename"
    );
}

/// Two plain-directory packages for a conversion, `app` and `aux`, with no
/// nested subvolume (which a snapshot of their parent cannot take).
fn plain_packages(root: &Path) {
    fs::create_dir_all(root.join("app/data/main")).expect("mkdir");
    populate_volume(&root.join("app"), false);
    fs::create_dir_all(root.join("aux/data/main")).expect("mkdir");
    fs::write(root.join("aux/data/main/small"), b"aux's data").expect("write");
}

// --------------------------------------------------------- after-states

fn same(b: &Pair) -> Pair {
    b.clone()
}

fn snapshotted(b: &Pair) -> Pair {
    Pair {
        live: b.live.clone(),
        backup: b.live.clone(),
    }
}

fn restored(b: &Pair) -> Pair {
    Pair {
        live: b.backup.clone(),
        backup: None,
    }
}

fn dropped(b: &Pair) -> Pair {
    Pair {
        live: b.live.clone(),
        backup: None,
    }
}

fn deleted(_: &Pair) -> Pair {
    Pair {
        live: None,
        backup: None,
    }
}

/// A created volume: `data/main` and `data/db`, empty (made once, on a
/// scratch filesystem of its own).
fn created(_: &Pair) -> Pair {
    static CREATED: std::sync::OnceLock<Pair> = std::sync::OnceLock::new();
    CREATED
        .get_or_init(|| {
            let fs = LoopFs::btrfs(BTRFS_SIZE).expect("a scratch filesystem");
            let root = volumes_root(&fs);
            store(&root)
                .create(&pkg("app"), &[vol("main"), vol("db")])
                .expect("create");
            Pair::of(&root, "app")
        })
        .clone()
}

// ------------------------------------------------------------------ cases

const SAMPLE: u64 = 6;

macro_rules! sweep_test {
    ($test:ident, $case:expr) => {
        #[test]
        fn $test() {
            sweep(&$case, SAMPLE);
        }
    };
}

sweep_test!(
    create,
    Case {
        name: "create",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["create", "app", "main", "db"],
        setup: |_| {},
        after: created,
        ignore_mtimes: true,
    }
);

sweep_test!(
    snapshot_of_a_subvolume,
    Case {
        name: "snapshot (subvolume)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["snapshot", "app"],
        setup: subvolume_volume,
        after: snapshotted,
        ignore_mtimes: false,
    }
);

sweep_test!(
    snapshot_of_a_plain_directory,
    Case {
        name: "snapshot (plain directory)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["snapshot", "app"],
        setup: plain_volume,
        after: snapshotted,
        ignore_mtimes: false,
    }
);

sweep_test!(
    restore_of_a_snapshot,
    Case {
        name: "restore (snapshot)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["restore", "app"],
        setup: subvolume_with_backup,
        after: restored,
        ignore_mtimes: false,
    }
);

sweep_test!(
    restore_of_a_reflink_copy,
    Case {
        name: "restore (reflink copy)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["restore", "app"],
        setup: plain_with_backup,
        after: restored,
        ignore_mtimes: false,
    }
);

sweep_test!(
    drop,
    Case {
        name: "drop",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["drop", "app"],
        setup: subvolume_with_backup,
        after: dropped,
        ignore_mtimes: false,
    }
);

sweep_test!(
    delete,
    Case {
        name: "delete",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["delete", "app"],
        setup: subvolume_with_backup,
        after: deleted,
        ignore_mtimes: false,
    }
);

sweep_test!(
    recover_a_restore,
    Case {
        name: "recover (a restore past its exchange)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["recover", "app"],
        setup: interrupted_restore,
        after: dropped,
        ignore_mtimes: false,
    }
);

sweep_test!(
    recover_a_delete,
    Case {
        name: "recover (a delete past its rename)",
        tool: Tool::Volume,
        packages: &["app"],
        args: &["recover", "app"],
        setup: interrupted_delete,
        after: deleted,
        ignore_mtimes: false,
    }
);

sweep_test!(
    convert_by_clone,
    Case {
        name: "convert (clone)",
        tool: Tool::Migrate,
        packages: &["app", "aux"],
        args: &["--method", "clone"],
        setup: plain_packages,
        after: same,
        ignore_mtimes: false,
    }
);

sweep_test!(
    convert_by_snapshotting_the_parent,
    Case {
        name: "convert (snapshot-parent)",
        tool: Tool::Migrate,
        packages: &["app", "aux"],
        args: &["--method", "snapshot-parent"],
        setup: plain_packages,
        after: same,
        ignore_mtimes: false,
    }
);

sweep_test!(
    convert_auto,
    Case {
        name: "convert (auto)",
        tool: Tool::Migrate,
        packages: &["app", "aux"],
        args: &[],
        setup: plain_packages,
        after: same,
        ignore_mtimes: false,
    }
);
