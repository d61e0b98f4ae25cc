//! A volume written partly under a `nodatasum` mount. btrfs refuses a
//! reflink between a file with data checksums and one without (EINVAL),
//! and a new file takes whatever the mount says now: so a clone, or the
//! reflink backup of a plain directory, made under either mount meets
//! files of the other kind. Each copy makes its new file's checksums the
//! source's before cloning, and a clone that still cannot go on discards
//! its partial copy rather than leave it for every later run to resume
//! and fail on (issue 29).

mod common;

use std::fs;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::cli::{must_succeed, text};
use common::*;
use integration::{LoopFs, TreeDigest, fs_or_skip, run};
use volume::SnapshotOutcome;
use volume::VolumeStore;
use volume_migrate::{Method, MigrateOptions, Migrator, Outcome, Progress};

/// `mount -o remount,<option>`: `nodatasum` or `datasum`, for the files
/// created from now on.
fn remount(fs: &LoopFs, option: &str) {
    run(Command::new("mount")
        .arg("-o")
        .arg(format!("remount,{option}"))
        .arg(fs.mount_point()))
    .unwrap_or_else(|e| panic!("remount,{option}: {e}"));
}

/// Whether the file at `path` has no data checksums, by its inode item.
fn nodatasum(path: &Path) -> bool {
    let f = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    volume::sys::commit(f.as_fd()).expect("commit");
    volume::sys::inode_item(f.as_fd())
        .expect("the inode item")
        .unwrap_or_else(|| panic!("{}: no inode item", path.display()))
        .nodatasum()
}

/// The file of [`mixed_package`] written under `nodatasum`.
const UNSUMMED: &str = "data/main/unsummed";
/// One of its files written with checksums.
const SUMMED: &str = "data/main/db/data.mdb";

/// A plain package directory `<root>/<name>` (the filesystem mounted with
/// checksums) holding files with checksums and one written under
/// `nodatasum`, which is still copied on write.
fn mixed_package(fs: &LoopFs, root: &Path, name: &str) {
    let vol = root.join(name);
    fs::create_dir_all(vol.join("data/main")).unwrap();
    populate_volume(&vol, false);
    remount(fs, "nodatasum");
    fs::write(vol.join(UNSUMMED), bytes(9, 200_000)).unwrap();
    remount(fs, "datasum");
    assert!(nodatasum(&vol.join(UNSUMMED)) && !nodatasum(&vol.join(SUMMED)));
}

fn no_progress(_: &Progress) {}

/// `d`, the digest of a plain directory, as its conversion should look:
/// the same but for its top, now a subvolume.
fn converted(mut d: TreeDigest) -> TreeDigest {
    if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = integration::Subvolume::Root;
    }
    d
}

/// Clones `<root>/<name>` into a subvolume (`chunk`: bytes per clone
/// range), checked converted with every entry as it was, each file's
/// checksums its source's, and `nocow` files made NOCOW for it.
#[track_caller]
fn clone_converts(root: &Path, name: &str, chunk: u64, nocow: u64, when: &str) {
    let before = converted(digest(&root.join(name)));
    let opts = MigrateOptions {
        method: Method::Clone,
        chunk_bytes: chunk,
        ..MigrateOptions::default()
    };
    let m = Migrator::open(root).unwrap();
    let report = m
        .convert(&pkg(name), &opts, &mut no_progress)
        .unwrap_or_else(|e| panic!("{when}: {e}"));
    assert_eq!(report.outcome, Outcome::Converted, "{when}: {report:?}");
    assert_eq!(report.nocow_files, nocow, "{when}: {report:?}");
    let vol = root.join(name);
    assert_same(&before, &digest(&vol), when);
    assert!(nodatasum(&vol.join(UNSUMMED)), "{when}");
    assert!(!nodatasum(&vol.join(SUMMED)), "{when}: checksums kept");
    assert_no_transient_names(root, when);
}

/// A clone under a mount that checksums new files copies the file written
/// under `nodatasum` (as a NOCOW file, the only state btrfs shares its
/// extents with there); a clone under `nodatasum` keeps every checksummed
/// file's checksums. Today's main fails both with EINVAL and keeps the
/// partial copy.
#[test]
fn clone_conversion_under_either_mount_copies_both_kinds_of_file() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    mixed_package(&fs, &root, "p1");
    mixed_package(&fs, &root, "p2");
    // The unsummed file, made NOCOW.
    clone_converts(&root, "p1", 8 << 20, 1, "with checksums");
    remount(&fs, "nodatasum");
    clone_converts(
        &root,
        "p2",
        64 << 10,
        0,
        "under nodatasum, in 64 KiB ranges",
    );
}

/// The reflink backup of a plain directory, under either mount, of a
/// volume holding both kinds of file: complete, and as the volume.
#[test]
fn plain_directory_backup_under_either_mount() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    mixed_package(&fs, &root, "app");
    let store = VolumeStore::open(&root).unwrap();
    let live = digest(&root.join("app"));
    for option in ["datasum", "nodatasum"] {
        remount(&fs, option);
        let taken = store.snapshot(&pkg("app"));
        assert!(
            matches!(taken, Ok(SnapshotOutcome::ReflinkCopy { .. })),
            "{option}: {taken:?}"
        );
        let backup = root.join("app.install-backup");
        assert_same(&live, &digest(&backup), option);
        assert!(!nodatasum(&backup.join(SUMMED)), "{option}");
        assert!(store.drop_backup(&pkg("app")).unwrap(), "{option}");
        assert_no_transient_names(&root, option);
    }
}

/// `volume-migrate` on `root` with `args`, a failpoint set if `failpoint`.
fn migrate(root: &Path, args: &[&str], failpoint: Option<&str>) -> Output {
    let mut cmd = Command::new(volume_migrate_bin());
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    if let Some(fp) = failpoint {
        cmd.env(volume::FAILPOINT_ENV, fp);
    }
    cmd.output().expect("running volume-migrate")
}

/// A clone whose new file's checksums cannot be made its source's (the
/// flag change failed by a failpoint) fails once, naming the file, and
/// leaves nothing half-done: no partial copy for the next run to resume,
/// which converts. Today's main fails with EINVAL and keeps the partial
/// copy, which every later run resumes and fails on.
#[test]
fn a_clone_that_cannot_go_on_leaves_no_partial_copy() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let vol = root.join("p");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    populate_volume(&vol, false);
    let before = digest(&vol);
    remount(&fs, "nodatasum");
    let out = migrate(&root, &["--method", "clone"], Some("copy.checksums=eperm"));
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("cannot be reflinked"), "{said}");
    assert!(said.contains("partial subvolume was removed"), "{said}");
    assert_no_transient_names(&root, "after the failed clone");
    assert!(!root.join("p.migrate").exists(), "{said}");
    assert_same(&before, &digest(&vol), "untouched");

    remount(&fs, "datasum");
    let out = migrate(&root, &[], None);
    must_succeed(&out, "the next run");
    assert_same(&converted(before), &digest(&vol), "converted");
    assert_eq!(package_subvolumes(&fs, "p").len(), 1);
}

/// Auto resuming a partial clone that turns out unclonable discards it
/// and converts as a fresh run would: by a snapshot of the parent, every
/// file keeping its inode number. Today's main resumes under `nodatasum`
/// and fails with EINVAL, for good.
#[test]
fn auto_snapshots_the_parent_when_the_clone_it_resumes_cannot_go_on() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let vol = root.join("p");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    populate_volume(&vol, false);
    let before = digest(&vol);
    let out = migrate(&root, &["--method", "clone"], Some("migrate.entry@2=eio"));
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(root.join("p.migrate").is_dir(), "a partial clone is kept");
    let inodes = integration::identity::identities(&vol).unwrap();

    remount(&fs, "nodatasum");
    let out = migrate(&root, &[], Some("copy.checksums=eperm"));
    must_succeed(&out, "auto, resuming");
    assert_same(&converted(before), &digest(&vol), "converted");
    assert_eq!(package_subvolumes(&fs, "p").len(), 1);
    let after = integration::identity::identities(&vol).unwrap();
    for (path, id) in &inodes {
        assert_eq!(
            after.get(path).map(|a| a.ino),
            Some(id.ino),
            "{}: snapshotted, not cloned",
            path.display()
        );
    }
    assert!(!root.join("p.migrate").exists());
}
