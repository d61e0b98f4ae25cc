//! The cleanup after a conversion (the old tree `<pkg>.migrate-old`, a
//! deferred cut's rest) holds the package's lock one bounded batch at a
//! time, so what a service load, an update or a rollback of that package
//! needs (`ensure`, a backup, a restore) gets in between two batches, and
//! the cleanup, continued, looks again at the package before it goes on.
//!
//! The cleanup runs as the `volume-migrate` binary, stopped between two
//! batches by the `migrate.between-batches=stop` failpoint (SIGSTOP there,
//! where it holds no lock). Each test's first comment line says how it
//! fails on the code before this change: there, the failpoint does not
//! exist, and the same spec's second site (`migrate.remove` or
//! `migrate.rest-removed`, once per entry, under the lock) stops it instead,
//! holding the lock; every wait here is bounded, so that fails instead of
//! hanging.

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::cli::*;
use common::*;
use integration::{LoopFs, fs_or_skip};
use startos_core::volume::{InstallBackup, ensure_volume_root_at};
use volume::VolumeKind;
use volume::VolumeStore;

/// How long an operation may wait for the package before the test fails:
/// far more than a batch, far less than a stopped cleanup.
const PROMPT: Duration = Duration::from_secs(10);
/// How long a cleanup may take to stop or to finish.
const TIMEOUT: Duration = Duration::from_secs(120);
/// Files in the trees removed: a few dozen batches.
const FILES: usize = 3000;

/// `volume-migrate --root <root> <args>`, run to its end.
fn migrate(root: &Path, args: &[&str]) -> Output {
    Command::new(volume_migrate_bin())
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove(volume::FAILPOINT_ENV)
        .output()
        .expect("running volume-migrate")
}

/// A cleanup run of `volume-migrate` (no flag: it removes what earlier
/// runs kept), killed unless it finished.
struct Cleanup {
    child: Option<Child>,
}

impl Cleanup {
    /// Starts the cleanup of `root` with the failpoints `spec`.
    fn start(root: &Path, spec: &str) -> Cleanup {
        let child = Command::new(volume_migrate_bin())
            .arg("--root")
            .arg(root)
            .env(volume::FAILPOINT_ENV, spec)
            // For the longest hold of the lock it logs.
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting volume-migrate");
        Cleanup { child: Some(child) }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running cleanup").id()
    }

    /// The state letter of the process (field 3 of /proc/<pid>/stat).
    fn state(&self) -> Option<char> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        let (_, rest) = stat.rsplit_once(')')?;
        rest.trim_start().chars().next()
    }

    /// Waits for the cleanup to stop at a failpoint; panics if it exits
    /// first.
    fn stopped(&mut self) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match self.state() {
                Some('T') => return,
                Some('Z') | Some('X') | None => {
                    let out = self.finish();
                    panic!(
                        "the cleanup never stopped: it exited ({}), stderr {:?}",
                        out.status,
                        text(&out.stderr)
                    );
                }
                _ if Instant::now() >= deadline => panic!("the cleanup never stopped"),
                _ => thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Lets the cleanup go on, past any later stop too, to its end.
    fn finish(&mut self) -> Output {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match self.state() {
                Some('Z') | Some('X') | None => break,
                Some('T') => {
                    let pid = rustix::process::Pid::from_raw(self.pid() as i32).expect("a pid");
                    rustix::process::kill_process(pid, rustix::process::Signal::CONT)
                        .expect("SIGCONT");
                }
                _ if Instant::now() >= deadline => panic!("the cleanup never finished"),
                _ => thread::sleep(Duration::from_millis(5)),
            }
        }
        self.child
            .take()
            .expect("a running cleanup")
            .wait_with_output()
            .expect("waiting for the cleanup")
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `op` on another thread and returns what it returned, failing the
/// test if it takes longer than [`PROMPT`] (it waits on the cleanup).
#[track_caller]
fn promptly<T: Send + 'static>(what: &str, op: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    thread::spawn(move || {
        let _ = tx.send(op());
    });
    let out = rx.recv_timeout(PROMPT).unwrap_or_else(|_| {
        panic!("{what} still waiting after {PROMPT:?}: it waits for the cleanup to finish")
    });
    eprintln!("{what}: {:?}", start.elapsed());
    out
}

/// Runs the future `f` makes on a runtime of its own (start-core's calls
/// are async).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(f)
}

/// `<root>/app`, a plain package directory of [`FILES`] small files in
/// `data/main`, spread over directories of 100.
fn plain_app(root: &Path) -> PathBuf {
    let main = root.join("app/data/main");
    for i in 0..FILES {
        let dir = main.join(format!("d{}", i / 100));
        if i % 100 == 0 {
            fs::create_dir_all(&dir).unwrap();
        }
        fs::write(dir.join(format!("f{i}")), bytes(i as u64, 64)).unwrap();
    }
    root.join("app")
}

/// The filler beside the volumes root that a parent snapshot's rest
/// holds: [`FILES`] files.
fn filler(fs: &LoopFs) {
    let dir = fs.path("elsewhere");
    for i in 0..FILES {
        let sub = dir.join(format!("d{}", i / 100));
        if i % 100 == 0 {
            fs::create_dir_all(&sub).unwrap();
        }
        fs::write(sub.join(format!("f{i}")), bytes(i as u64, 64)).unwrap();
    }
}

fn is_subvolume(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// The store's and start-core's entry points, each on `app` under `root`
/// while its cleanup is stopped: each returns at once. The backup is taken
/// and then restored, with a file written in between, so the volume is
/// what it was.
fn every_entry_point_gets_in(root: &Path) {
    let r = root.to_owned();
    let kind = promptly("VolumeStore::ensure", move || {
        VolumeStore::open_without_recovery(&r)
            .and_then(|s| s.ensure(&pkg("app")))
            .expect("ensure")
    });
    assert_eq!(kind, VolumeKind::Subvolume);
    let r = root.to_owned();
    promptly("ensure_volume_root_at", move || {
        block_on(ensure_volume_root_at(&r, "app")).expect("ensure_volume_root_at")
    });
    let r = root.to_owned();
    let taken = promptly("InstallBackup::snapshot", move || {
        block_on(InstallBackup::at(&r, "app").snapshot()).expect("snapshot")
    });
    assert!(taken, "a backup taken");
    fs::write(
        root.join("app/data/main/later"),
        b"written after the backup",
    )
    .unwrap();
    let r = root.to_owned();
    promptly("InstallBackup::restore", move || {
        block_on(InstallBackup::at(&r, "app").restore()).expect("restore")
    });
    assert!(!exists(&root.join("app/data/main/later")), "restored");
}

// Today: the cleanup stops at `migrate.remove@1500` holding app's lock, and "VolumeStore::ensure still waiting after 10s".
#[test]
fn ensure_backup_and_restore_get_in_while_the_old_tree_goes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    plain_app(&root);
    must_succeed(
        &migrate(&root, &["--method", "clone", "--keep-old"]),
        "the conversion, keeping the old tree",
    );
    assert!(is_subvolume(&root.join("app")));
    assert!(root.join("app.migrate-old").is_dir());
    let before = digest(&root.join("app"));

    let mut cleanup = Cleanup::start(
        &root,
        "migrate.between-batches@2=stop,migrate.remove@1500=stop",
    );
    cleanup.stopped();
    assert!(
        root.join("app.migrate-old").is_dir(),
        "stopped part-way through the old tree"
    );
    every_entry_point_gets_in(&root);
    let out = cleanup.finish();
    must_succeed(&out, "the continued cleanup");
    assert!(
        !exists(&root.join("app.migrate-old")),
        "{:?}",
        root_names(&root)
    );
    assert_eq!(
        package_names(&root, "app"),
        ["app"],
        "nothing else of app left"
    );
    assert_same(
        &before,
        &digest(&root.join("app")),
        "the volume after the cleanup",
    );
}

// Today: the cleanup stops at `migrate.remove@1500` holding app's lock, and "VolumeStore::delete still waiting after 10s".
#[test]
fn a_delete_between_batches_of_the_old_tree_takes_it_and_the_cleanup_stops() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    plain_app(&root);
    must_succeed(
        &migrate(&root, &["--method", "clone", "--keep-old"]),
        "the conversion, keeping the old tree",
    );
    let mut cleanup = Cleanup::start(
        &root,
        "migrate.between-batches@2=stop,migrate.remove@1500=stop",
    );
    cleanup.stopped();
    assert!(root.join("app.migrate-old").is_dir(), "stopped part-way");
    let r = root.clone();
    let deleted = promptly("VolumeStore::delete", move || {
        VolumeStore::open_without_recovery(&r)
            .and_then(|s| s.delete(&pkg("app")))
            .expect("delete")
    });
    assert!(deleted, "app deleted");
    assert!(
        package_names(&root, "app").is_empty(),
        "{:?}",
        root_names(&root)
    );
    must_succeed(&cleanup.finish(), "the continued cleanup");
    assert!(
        package_names(&root, "app").is_empty(),
        "{:?}",
        root_names(&root)
    );
}

/// Converts `app` by a parent snapshot with its cut deferred, the
/// filler's [`FILES`] files in its rest; returns the digest of its data.
fn app_with_a_rest(fs: &LoopFs, root: &Path) -> integration::TreeDigest {
    filler(fs);
    plain_app(root);
    must_succeed(
        &migrate(root, &["--method", "snapshot-parent", "--keep-old"]),
        "the conversion by a parent snapshot, keeping its rest",
    );
    assert!(exists(&root.join("app.migrate-rest")), "a deferred cut");
    assert!(
        root.join("app")
            .join(integration::identity::CARVE_REST)
            .is_dir()
    );
    digest(&root.join("app/data"))
}

// Today: the cleanup stops at `migrate.rest-removed@1500` holding app's lock, and "InstallBackup::snapshot still waiting after 10s".
#[test]
fn a_backup_taken_between_batches_of_the_rest_keeps_it_and_its_record() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let before = app_with_a_rest(&fs, &root);
    let rest = root.join("app").join(integration::identity::CARVE_REST);

    let mut cleanup = Cleanup::start(
        &root,
        "migrate.between-batches@2=stop,migrate.rest-removed@1500=stop",
    );
    cleanup.stopped();
    assert!(rest.is_dir(), "stopped part-way through the rest");
    let r = root.clone();
    let taken = promptly("InstallBackup::snapshot", move || {
        block_on(InstallBackup::at(&r, "app").snapshot()).expect("snapshot")
    });
    assert!(taken, "a backup taken");
    let backup = digest(&root.join("app.install-backup"));
    must_succeed(&cleanup.finish(), "the continued cleanup");

    assert!(!exists(&rest), "the rest gone from the volume");
    assert!(!exists(&root.join("app.migrate-old")));
    assert_same(&before, &digest(&root.join("app/data")), "the volume");
    assert_same(
        &backup,
        &digest(&root.join("app.install-backup")),
        "the backup taken between two batches",
    );
    assert!(
        exists(&root.join("app.migrate-rest")),
        "the record stays while the backup holds part of the rest"
    );

    // The backup brings that part back; the next cleanup removes it.
    block_on(InstallBackup::at(&root, "app").restore()).expect("restore");
    assert!(rest.is_dir(), "the restore brought the rest back");
    must_succeed(&migrate(&root, &[]), "the next cleanup");
    assert!(!exists(&rest));
    assert!(
        !exists(&root.join("app.migrate-rest")),
        "the record gone with the last copy"
    );
    assert_eq!(
        package_names(&root, "app"),
        ["app"],
        "nothing else of app left"
    );
    assert_same(
        &before,
        &digest(&root.join("app/data")),
        "the volume after all",
    );
}

// Today: the cleanup stops at `migrate.rest-removed@1500` holding app's lock, and "VolumeStore::ensure still waiting after 10s".
#[test]
fn a_restore_between_batches_of_the_rest_stops_that_removal_and_the_cleanup_starts_over() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let before = app_with_a_rest(&fs, &root);
    let rest = root.join("app").join(integration::identity::CARVE_REST);

    let mut cleanup = Cleanup::start(
        &root,
        "migrate.between-batches@2=stop,migrate.rest-removed@1500=stop",
    );
    cleanup.stopped();
    assert!(rest.is_dir(), "stopped part-way through the rest");
    // A backup holding part of the rest, restored: the volume the
    // cleanup was removing the rest from is exchanged for another.
    every_entry_point_gets_in(&root);
    assert!(rest.is_dir(), "the restored volume holds part of the rest");
    let out = cleanup.finish();
    eprintln!("{}\n{}", text(&out.stdout), text(&out.stderr));
    must_succeed(&out, "the continued cleanup");

    assert!(!exists(&rest), "the rest gone from the restored volume");
    assert_eq!(
        package_names(&root, "app"),
        ["app"],
        "nothing else of app left"
    );
    assert_same(&before, &digest(&root.join("app/data")), "the volume");
}

/// Files in the old tree whose cleanup is measured.
const MEASURED_FILES: usize = 20_000;
/// The longest any wait for the package may be while its cleanup runs: a
/// batch is a few milliseconds, the whole removal seconds; the margin is
/// for a debug build on a loaded machine.
const LONGEST_WAIT: Duration = Duration::from_millis(250);

// Today: the cleanup holds app's lock for the whole removal of the 20,000 files, and "the longest wait for app's lock: 2.1s" or so.
#[test]
fn the_lock_is_held_a_few_milliseconds_at_a_time_over_a_20k_file_tree() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = root.join("app/data/main");
    for i in 0..MEASURED_FILES {
        let dir = main.join(format!("d{}", i / 500));
        if i % 500 == 0 {
            fs::create_dir_all(&dir).unwrap();
        }
        fs::write(dir.join(format!("f{i}")), b"x").unwrap();
    }
    must_succeed(
        &migrate(&root, &["--method", "clone", "--keep-old"]),
        "the conversion, keeping the old tree",
    );
    let before = digest(&root.join("app"));
    let locks = {
        let dir = volume::sys::open_dir_path(&root).expect("opening the root");
        volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).expect("the lock dir")
    };

    let started = Instant::now();
    let mut cleanup = Cleanup::start(&root, "");
    let (mut waits, mut longest) = (0u32, Duration::ZERO);
    while matches!(cleanup.state(), Some(s) if s != 'Z' && s != 'X') {
        let t = Instant::now();
        let lock = locks.lock(&pkg("app")).expect("app's lock");
        longest = longest.max(t.elapsed());
        waits += 1;
        drop(lock);
        thread::sleep(Duration::from_millis(2));
    }
    let out = cleanup.finish();
    let took = started.elapsed();
    must_succeed(&out, "the cleanup");
    let said = text(&out.stderr);
    let held = said
        .split("longest_hold_us=")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|us| us.parse::<u64>().ok());
    eprintln!(
        "cleanup of {MEASURED_FILES} files: {took:?}; {waits} takes of the lock meanwhile, the \
         longest wait {longest:?}; longest hold the cleanup reports: {held:?} us"
    );
    assert!(!exists(&root.join("app.migrate-old")));
    assert_same(&before, &digest(&root.join("app")), "the volume");
    assert!(
        longest < LONGEST_WAIT,
        "the longest wait for app's lock: {longest:?} (over {waits} takes during {took:?})"
    );
}

/// `app`'s lock under `root`, taken as every operation takes it.
fn hold_app(root: &Path) -> volume::lock::PackageLock {
    let dir = volume::sys::open_dir_path(root).expect("opening the root");
    volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir))
        .expect("the lock dir")
        .lock(&pkg("app"))
        .expect("app's lock")
}

// Today: `ensure` always takes the lock first: "VolumeStore::ensure of a settled volume still waiting after 10s".
#[test]
fn ensure_of_a_settled_volume_takes_no_lock_and_of_a_pending_one_recovers() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open");
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    // The cleanup's garbage is no pending work.
    fs::create_dir_all(root.join("app.migrate-old/data/main")).unwrap();
    let held = hold_app(&root);
    let r = root.clone();
    let kind = promptly("VolumeStore::ensure of a settled volume", move || {
        VolumeStore::open_without_recovery(&r)
            .and_then(|s| s.ensure(&pkg("app")))
            .expect("ensure")
    });
    assert_eq!(kind, VolumeKind::Subvolume);

    drop(held);

    // A name an operation in flight makes, or a crash left (each one that
    // recovery deletes): ensure waits its turn, then recovers.
    for suffix in [
        ".create",
        ".install-backup.tmp",
        ".install-backup.drop",
        ".replaced",
        ".install-backup-tmp",
        ".convert-tmp",
    ] {
        let name = root.join(format!("app{suffix}"));
        fs::create_dir(&name).unwrap();
        let held = hold_app(&root);
        let (tx, rx) = mpsc::channel();
        let r = root.clone();
        thread::spawn(move || {
            let _ =
                tx.send(VolumeStore::open_without_recovery(&r).and_then(|s| s.ensure(&pkg("app"))));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "ensure with app{suffix} present must wait for the lock"
        );
        drop(held);
        let kind = rx
            .recv_timeout(PROMPT)
            .expect("ensure once the lock is free");
        assert_eq!(kind.expect("ensure"), VolumeKind::Subvolume);
        assert!(!exists(&name), "app{suffix} recovered");
    }
    assert!(
        root.join("app.migrate-old").is_dir(),
        "the garbage left to the cleanup"
    );
}

// Today: `PackageLock::set_down` does not exist (and a holder that unlocks and locks again at once wins against the waiter the kernel has only just woken).
#[test]
fn a_holder_that_sets_the_package_down_lets_every_waiter_in_first() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let mut lock = hold_app(&root);
    for round in 0..10 {
        let (tx, rx) = mpsc::channel();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let (r, tx) = (root.clone(), tx.clone());
                thread::spawn(move || {
                    let held = hold_app(&r);
                    tx.send(()).expect("the test waits");
                    drop(held);
                })
            })
            .collect();
        // Both blocked on the lock (announced) by then.
        thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "round {round}: the lock is held");
        lock = lock
            .set_down()
            .expect("set down")
            .take_up()
            .expect("take up");
        assert_eq!(
            rx.try_iter().count(),
            2,
            "round {round}: both waiters had the package before it was taken up again"
        );
        for w in waiters {
            w.join().expect("a waiter");
        }
    }
}
