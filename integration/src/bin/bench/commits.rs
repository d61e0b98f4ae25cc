//! `commits`: starting a btrfs commit, the bare BTRFS_IOC_START_SYNC (as
//! libbtrfsutil's `btrfs_util_start_sync` and any direct caller issue it)
//! against [`volume::sys::start_commit`], which bounds the wait
//! ([`volume::sys::COMMIT_START_PATIENCE`]).
//!
//! The ioctl asks btrfs's transaction thread to commit and waits for the
//! commit to start; now and then that thread sleeps out its commit
//! interval (30 s) instead. Each round dirties the filesystem with one
//! small write, lets 20 ms pass, and starts a commit each way, in turns
//! (who goes first alternates), on one fresh filesystem. The stall is rare
//! (a few in a thousand), so the section takes many rounds and reports the
//! tail: the median, the 99th percentile, the worst, and how many waits
//! passed five seconds. A bare wait is cut off at 30 s by a commit of the
//! section's own (otherwise nothing would end it).

use std::fs;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use integration::LoopFs;
use serde::Serialize;

use crate::Verdict;
use crate::common::{Result, fmt_count, fmt_duration};

/// Rounds: each way starts this many commits.
pub const ROUNDS: u32 = 1500;
/// Between a round's write and its commit start.
const DIRTY_FOR: Duration = Duration::from_millis(20);
/// A wait longer than this counts as a stall.
/// (Ours waits at most two seconds, then for a commit started on another
/// thread; the bare stalls last 30 s and more.)
const STALL: Duration = Duration::from_secs(5);
/// When a stalled bare ioctl is released: the commit interval, about when
/// a busy filesystem's next periodic commit would release it.
const RELEASE_AFTER: Duration = Duration::from_secs(30);

/// One way's waits.
#[derive(Serialize)]
pub struct Tail {
    /// Median wait, seconds.
    pub median: f64,
    /// 99th percentile, seconds.
    pub p99: f64,
    /// Longest wait, seconds.
    pub worst: f64,
    /// Waits over [`STALL`].
    pub stalls: usize,
    /// Waits ended by a commit from another thread: ours after
    /// [`volume::sys::COMMIT_START_PATIENCE`], the bare ones after
    /// [`RELEASE_AFTER`].
    pub released: u64,
}

impl Tail {
    fn of(mut waits: Vec<Duration>, released: u64) -> Tail {
        waits.sort_unstable();
        let at = |q: f64| {
            waits
                .get(((waits.len() as f64 - 1.0) * q).round() as usize)
                .map_or(0.0, Duration::as_secs_f64)
        };
        Tail {
            median: at(0.5),
            p99: at(0.99),
            worst: at(1.0),
            stalls: waits.iter().filter(|w| **w > STALL).count(),
            released,
        }
    }
}

/// The `commits` section's results.
#[derive(Serialize)]
pub struct Report {
    /// Commits started each way.
    pub rounds: u32,
    /// The bare ioctl.
    pub bare: Tail,
    /// Ours.
    pub ours: Tail,
    /// The section's target.
    pub targets: Vec<Verdict>,
}

/// BTRFS_IOC_START_SYNC, nothing else: the bare ioctl this section
/// compares against. A stalled one is released after [`RELEASE_AFTER`]
/// by a commit from another thread, or it may wait for ever: here nothing
/// else commits, and one waited 100 s before a `btrfs filesystem sync`
/// released it.
#[allow(unsafe_code)] // BTRFS_IOC_START_SYNC
fn bare_start_sync(dir: &fs::File, released: &mut u64) -> std::io::Result<()> {
    use rustix::ioctl::{Getter, opcode};
    use std::sync::{Condvar, Mutex, PoisonError};
    const START_SYNC: rustix::ioctl::Opcode = opcode::read::<u64>(0x94, 24);
    let returned = Mutex::new(false);
    let wake = Condvar::new();
    std::thread::scope(|s| {
        let release = s.spawn(|| {
            let done = returned.lock().unwrap_or_else(PoisonError::into_inner);
            let (_done, waited) = wake
                .wait_timeout_while(done, RELEASE_AFTER, |done| !*done)
                .unwrap_or_else(PoisonError::into_inner);
            waited.timed_out().then(|| volume::sys::commit(dir.as_fd()))
        });
        // SAFETY: START_SYNC is _IOR(0x94, 24, __u64) and writes the transid.
        let r = unsafe { rustix::ioctl::ioctl(dir.as_fd(), Getter::<START_SYNC, u64>::new()) };
        *returned.lock().unwrap_or_else(PoisonError::into_inner) = true;
        wake.notify_all();
        if let Ok(Some(_)) = release.join() {
            *released += 1;
        }
        r.map(drop).map_err(Into::into)
    })
}

/// The `commits` section.
pub fn run(rounds: u32) -> Result<Report> {
    let fs = LoopFs::btrfs(1 << 30)?;
    let dir = fs::File::open(fs.mount_point())?;
    let (mut bare, mut ours) = (Vec::new(), Vec::new());
    let mut bare_released = 0;
    let forced_before = volume::sys::forced_commit_starts();
    let nudged_before = volume::sys::nudged_commit_starts();
    let started = Instant::now();
    for i in 0..rounds {
        for turn in 0..2 {
            let is_ours = (i + turn) % 2 == 0;
            fs::write(fs.path(format!("f{}", i % 100)), i.to_le_bytes())?;
            std::thread::sleep(DIRTY_FOR);
            let t = Instant::now();
            if is_ours {
                volume::sys::start_commit(dir.as_fd())?;
                ours.push(t.elapsed());
            } else {
                bare_start_sync(&dir, &mut bare_released)?;
                bare.push(t.elapsed());
            }
        }
        if i % 250 == 249 {
            eprintln!(
                "commits: {} rounds in {}",
                fmt_count(u64::from(i + 1)),
                fmt_duration(started.elapsed())
            );
        }
    }
    drop(dir);
    fs.close()?;
    let forced = volume::sys::forced_commit_starts() - forced_before;
    let nudged = volume::sys::nudged_commit_starts() - nudged_before;
    let (bare, ours) = (Tail::of(bare, bare_released), Tail::of(ours, forced));
    let targets = vec![Verdict::new(
        format!(
            "commits: ours never waits over {} for a commit to start ({} starts)",
            fmt_duration(STALL),
            fmt_count(u64::from(rounds))
        ),
        ours.stalls == 0,
        format!(
            "ours worst {}, {} stalls, {} starts asked for again, {} forced; the bare ioctl worst {}, {} stalls",
            fmt_duration(Duration::from_secs_f64(ours.worst)),
            ours.stalls,
            nudged,
            ours.released,
            fmt_duration(Duration::from_secs_f64(bare.worst)),
            bare.stalls
        ),
    )];
    Ok(Report {
        rounds,
        bare,
        ours,
        targets,
    })
}

/// Prints the section's table and target.
pub fn print(r: &Report) {
    println!(
        "commits: starting a btrfs commit, {} times each way (a small write, 20 ms, then the start)",
        fmt_count(u64::from(r.rounds))
    );
    println!(
        "{:>28}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}",
        "", "median", "p99", "worst", "over 5 s", "released"
    );
    for (name, t) in [
        ("BTRFS_IOC_START_SYNC", &r.bare),
        ("volume::sys::start_commit", &r.ours),
    ] {
        let d = |s: f64| fmt_duration(Duration::from_secs_f64(s));
        println!(
            "{name:>28}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}",
            d(t.median),
            d(t.p99),
            d(t.worst),
            t.stalls,
            t.released
        );
    }
    for v in &r.targets {
        v.print();
    }
}
