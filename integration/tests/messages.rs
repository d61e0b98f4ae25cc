//! What the CLI says when the filesystem refuses: the cause in one line,
//! the hint that fits it, and nothing about a step that never ran.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::cli::must_fail;
use common::sweep::bin;
use common::*;
use integration::{LoopFs, fs_or_skip, run};
use volume::VolumeStore;

fn tool(root: &Path, args: &[&str]) -> Output {
    Command::new(bin("startos-volume"))
        .arg("--root")
        .arg(root)
        .args(args)
        .output()
        .expect("running startos-volume")
}

/// `app` with a volume and a backup that differ.
fn app_with_backup(root: &Path) {
    let store = VolumeStore::open(root).expect("open");
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    populate_volume(&root.join("app"), false);
    store.snapshot(&pkg("app")).expect("snapshot");
    modify_volume(&root.join("app"), false);
}

#[test]
fn a_restore_refused_by_a_read_only_filesystem_says_only_that() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);
    app_with_backup(&root);
    let (live, backup) = (
        digest(&root.join("app")),
        digest(&root.join("app.install-backup")),
    );
    run(Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(fs.mount_point()))
    .expect("remount read-only");
    let out = tool(&root, &["restore", "app"]);
    run(Command::new("mount")
        .args(["-o", "remount,rw"])
        .arg(fs.mount_point()))
    .expect("remount read-write");
    let err = must_fail(
        &out,
        "restore on a read-only filesystem",
        "Read-only file system",
    );
    assert!(
        !err.contains("failed too"),
        "nothing was made, so nothing was undone: {err}"
    );
    assert_same(&live, &digest(&root.join("app")), "the volume");
    assert_same(
        &backup,
        &digest(&root.join("app.install-backup")),
        "the backup",
    );
}

/// Enables quotas on the filesystem at `mnt` and limits the qgroup of the
/// subvolume at `subvol` to what it already holds: every later change in
/// it (a rename included) exceeds the limit.
fn limit_reached(mnt: &Path, subvol: &Path) {
    run(Command::new("btrfs").args(["quota", "enable"]).arg(mnt)).expect("quota enable");
    run(Command::new("btrfs")
        .args(["quota", "rescan", "-w"])
        .arg(mnt))
    .expect("rescan");
    run(Command::new("btrfs")
        .args(["qgroup", "limit", "16k"])
        .arg(subvol))
    .expect("limit");
}

#[test]
fn drop_and_delete_at_a_qgroup_limit_say_it_is_the_quota() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let mnt = fs.mount_point().to_path_buf();
    let parent = mnt.join("package-data");
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(&parent))
    .expect("subvolume create");
    let root = parent.join("volumes");
    std::fs::create_dir(&root).expect("mkdir volumes");
    app_with_backup(&root);
    let (live, backup) = (
        digest(&root.join("app")),
        digest(&root.join("app.install-backup")),
    );
    run(&mut Command::new("sync")).expect("sync");
    limit_reached(&mnt, &parent);
    for args in [["drop", "app"], ["delete", "app"]] {
        let out = tool(&root, &args);
        let err = must_fail(&out, &args.join(" "), "Disk quota exceeded");
        assert!(
            err.contains("a quota (qgroup limit)"),
            "`{}` at a qgroup limit names the quota: {err}",
            args.join(" ")
        );
    }
    assert_same(&live, &digest(&root.join("app")), "the volume");
    assert_same(
        &backup,
        &digest(&root.join("app.install-backup")),
        "the backup",
    );
    // Lifting a limit is itself refused at the limit: quotas go instead.
    run(Command::new("btrfs").args(["quota", "disable"]).arg(&mnt)).expect("quota disable");
    let out = tool(&root, &["drop", "app"]);
    assert!(out.status.success(), "drop once the limit is gone: {out:?}");
}
