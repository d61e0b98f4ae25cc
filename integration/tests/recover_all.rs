//! `VolumeStore::recover_all` at boot, over many packages: each package is
//! recovered under its own lock, several at once, so one package another
//! operation holds (a service load taking its time, a CLI run) holds up
//! its own recovery only.

mod common;

use std::fs;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use integration::{LoopFs, fs_or_skip};
use volume::VolumeStore;
use volume::lock::LockWait;

/// `name`'s lock under `root`, taken as every operation takes it.
fn hold(root: &Path, name: &str) -> volume::lock::PackageLock {
    let dir = volume::sys::open_dir_path(root).expect("opening the root");
    volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir))
        .expect("the lock dir")
        .lock(&pkg(name))
        .expect("the package's lock")
}

// Today: one package after another in name order, so beta's leftover waits for alpha's lock: "beta.create still there after 10s".
/// alpha is held by another operation for longer than beta's recovery
/// takes; beta's leftover of an interrupted create is removed meanwhile,
/// and alpha is recovered (nothing to do) once let go, within its
/// patience, with no error.
#[test]
fn a_held_package_holds_up_only_its_own_recovery() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["alpha", "beta"] {
        fs::create_dir_all(root.join(p).join("data")).unwrap();
        fs::write(root.join(p).join("data/f"), p).unwrap();
    }
    // What a crash in beta's create leaves: garbage under `.create`.
    fs::create_dir_all(root.join("beta.create/data")).unwrap();
    let held = hold(&root, "alpha");
    let recovery = {
        let root = root.clone();
        thread::spawn(move || {
            VolumeStore::open_without_recovery(&root)
                .map(|s| s.with_lock_wait(LockWait::Within(Duration::from_secs(60))))
                .and_then(|s| s.recover_all())
                .map_err(|e| e.to_string())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while fs::symlink_metadata(root.join("beta.create")).is_ok() {
        assert!(
            Instant::now() < deadline,
            "beta.create still there after 10s, alpha held: {:?}",
            root_names(&root)
        );
        thread::sleep(Duration::from_millis(10));
    }
    assert!(!recovery.is_finished(), "recover_all waits for alpha");
    drop(held);
    let recovered = recovery
        .join()
        .expect("the recovery thread")
        .expect("recover_all");
    assert!(recovered.iter().all(|r| r.error.is_none()), "{recovered:?}");
    assert!(
        recovered.iter().any(|r| r.package.as_str() == "beta"),
        "{recovered:?}"
    );
    for p in ["alpha", "beta"] {
        assert_eq!(fs::read(root.join(p).join("data/f")).unwrap(), p.as_bytes());
    }
}
