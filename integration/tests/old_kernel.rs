//! An older kernel gets one line naming the kernel it needs, not whatever
//! errno its missing call returned. This machine runs a new kernel, so the
//! old one's answer is injected at the very call that would give it
//! (`STARTOS_VOLUME_FAULT=K:ERRNO`, K found by tracing the same command):
//! ENOTTY from btrfs's SNAP_DESTROY_V2 (Linux 5.7) and ENOSYS from statx
//! (the mount id every walk compares needs 5.8).

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use common::cli::must_fail;
use common::sweep::bin;
use common::*;
use integration::{LoopFs, fs_or_skip};
use volume::VolumeStore;
use volume::sys::fault;

/// `startos-volume --root ROOT ARGS`, with `fault` as the injected failure
/// spec and its log beside the image.
fn tool(root: &Path, args: &[&str], spec: &str, log: &Path) -> Output {
    Command::new(bin("startos-volume"))
        .arg("--root")
        .arg(root)
        .args(args)
        .env(fault::FAULT_ENV, spec)
        .env(fault::FAULT_LOG_ENV, log)
        .output()
        .expect("running startos-volume")
}

/// The number of the first (or, with `last`, the last) call named `name`
/// in a trace of `args`, run on a state `setup` makes afresh.
fn call_number(root: &Path, setup: &dyn Fn(), args: &[&str], name: &str, last: bool) -> u64 {
    setup();
    let log = root.with_extension("trace");
    let _ = fs::remove_file(&log);
    let out = tool(root, args, "trace", &log);
    assert!(out.status.success(), "{args:?} without a fault: {out:?}");
    let trace = fs::read_to_string(&log).expect("reading the trace");
    let mut hits = trace.lines().filter_map(|l| {
        let (k, call) = l.split_once(' ')?;
        (call == name).then(|| k.parse::<u64>().expect("a call number"))
    });
    let k = if last { hits.next_back() } else { hits.next() };
    k.unwrap_or_else(|| panic!("{args:?} makes no {name} call: {trace}"))
}

#[test]
fn a_kernel_without_snap_destroy_v2_is_named_in_one_line() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);
    let setup = || {
        let store = VolumeStore::open(&root).expect("open");
        let _ = store.delete(&pkg("app"));
        store.create(&pkg("app"), &[vol("main")]).expect("create");
        store.snapshot(&pkg("app")).expect("snapshot");
    };
    // The drop's last volume ioctl is the backup's destroy: in its purge,
    // once the backup is off the package (in the trash), after the lock.
    let k = call_number(&root, &setup, &["drop", "app"], "btrfs volume ioctl", true);
    setup();
    let log = root.with_extension("log");
    let out = tool(
        &root,
        &["drop", "app"],
        &format!("{k}:{}", libc::ENOTTY),
        &log,
    );
    // The drop is done; what its purge could not delete is one warning
    // line naming the kernel it needs, and waits in the trash.
    assert!(out.status.success(), "the drop itself is done: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let warned: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("SNAP_DESTROY_V2"))
        .collect();
    assert_eq!(warned.len(), 1, "{err}");
    assert!(warned[0].contains("Linux 5.7"), "{err}");
    assert_eq!(trash_entries(&root), ["app.1"], "{err}");
    // Nothing is lost: the volume stays, and the backup is deleted from
    // the trash once the kernel can.
    let store = VolumeStore::open(&root).expect("open");
    assert!(store.info(&pkg("app")).expect("info").volume.is_some());
    assert!(store.info(&pkg("app")).expect("info").backup.is_none());
    assert_eq!(trash_entries(&root), Vec::<String>::new());
}

#[test]
fn a_kernel_without_statx_mount_ids_is_named_in_one_line() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);
    let setup = || {
        VolumeStore::open(&root)
            .expect("open")
            .ensure(&pkg("app"))
            .expect("ensure");
    };
    // Opening the volumes root asks for its mount id first.
    let k = call_number(&root, &setup, &["list"], "statx", false);
    let log = root.with_extension("log");
    let out = tool(&root, &["list"], &format!("{k}:{}", libc::ENOSYS), &log);
    let err = must_fail(&out, "list on a kernel without statx", "Linux 5.8");
    assert!(err.contains(&root.display().to_string()), "{err}");
}
