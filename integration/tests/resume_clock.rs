//! A resumed conversion decides what changed since its partial copy from
//! the filesystem's own order of changes, never from the clock: a box with
//! no real-time clock (a Raspberry Pi) boots with its clock behind, so a
//! file the service changed between two runs can carry a ctime older than
//! the partial copy's birth.
//!
//! The system clock is set back for the few milliseconds of one write:
//! this file holds this one test, so no other test of its binary runs
//! meanwhile.

mod common;

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::rich::expected_after;
use common::*;
use integration::{FsKind, LoopFs, fs_or_skip};
use volume_migrate::{Method, MigrateOptions, Migrator, Progress};

/// Sets the system clock to `t`.
#[allow(unsafe_code)]
fn set_clock(t: SystemTime) {
    let d = t.duration_since(UNIX_EPOCH).expect("after the epoch");
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    };
    // SAFETY: clock_settime reads one valid timespec.
    let r = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
    assert_eq!(r, 0, "clock_settime: {}", std::io::Error::last_os_error());
}

/// Runs `f` with the clock an hour behind, then puts it back where it
/// would have been (the monotonic clock measures the time spent).
fn an_hour_behind(f: impl FnOnce()) {
    let (wall, mono) = (SystemTime::now(), Instant::now());
    set_clock(wall - Duration::from_secs(3600));
    f();
    set_clock(wall + mono.elapsed());
}

#[test]
fn a_file_changed_with_the_clock_set_back_is_copied_again() {
    // noatime: the test's own reads (the digests) would otherwise mark
    // what they read as changed, and the resume would start over, rightly
    // but untestably.
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        512 << 20,
        "noatime"
    ));
    let root = volumes_root(&fs);
    let vol = root.join("clk");
    let main = vol.join("data/main");
    fs::create_dir_all(&main).expect("mkdir");
    fs::write(main.join("a"), bytes(1, 1 << 20)).expect("write a");
    fs::write(main.join("z"), bytes(2, 1 << 20)).expect("write z");

    // The first run, interrupted after it copied `a` whole: the partial
    // copy `<pkg>.migrate` it leaves, as a crash there leaves it.
    // Written long before the first run, as a box's data is: written back
    // and committed (writeback updates an inode item in whatever
    // transaction runs when it completes).
    integration::run(&mut std::process::Command::new("sync")).expect("sync");
    subvolume_create(&root.join("clk.migrate"));
    // As the clone does: the transaction that created the copy is
    // committed before the copy reads the source.
    let root_dir = fs::File::open(&root).expect("open the root");
    volume::sys::commit_metadata(root_dir.as_fd()).expect("commit");
    // Opened as the clone opens it, without touching access times.
    let src = volume::sys::open_dir_path(&vol).expect("open the volume");
    let dst = fs::File::open(root.join("clk.migrate")).expect("open the copy");
    let opts = volume::copy::CopyOptions {
        nested_subvolumes: true,
        ..Default::default()
    };
    let stopped = volume::copy::reflink_into(src.as_fd(), dst.as_fd(), &opts, &mut |ev| match ev {
        volume::copy::CopyEvent::Entry { rel } if rel.ends_with("a") => {
            Err(std::io::Error::other("the first run stops here"))
        }
        _ => Ok(()),
    });
    assert!(stopped.is_err(), "the first run was to stop after `a`");
    assert_eq!(
        fs::read(root.join("clk.migrate/data/main/a")).expect("a's copy"),
        bytes(1, 1 << 20),
        "the partial copy holds `a` whole"
    );
    drop((src, dst));
    std::thread::sleep(Duration::from_millis(20));

    // The service changes `a` while the clock is behind: its ctime is now
    // older than the partial copy's birth.
    an_hour_behind(|| {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(main.join("a"))
            .expect("open a");
        f.write_all_at(b"written while the clock was behind", 4096)
            .expect("write");
    });
    let before = tree_digest_of(&vol);

    let m = Migrator::open(&root).expect("open");
    let opts = MigrateOptions {
        method: Method::Clone,
        ..MigrateOptions::default()
    };
    let r = m
        .convert(&pkg("clk"), &opts, &mut |_: &Progress| {})
        .expect("the resumed conversion");
    assert!(r.resumed, "the partial copy was resumed");
    assert_same(
        &expected_after(&before),
        &tree_digest_of(&vol),
        "the converted volume holds what the service wrote, clock or no clock",
    );
}

fn tree_digest_of(path: &std::path::Path) -> integration::TreeDigest {
    integration::tree_digest(path).unwrap_or_else(|e| panic!("digest of {}: {e}", path.display()))
}
