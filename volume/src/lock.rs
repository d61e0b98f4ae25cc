//! Per-package mutual exclusion across threads and processes.
//!
//! The locks live in [`LOCK_DIR`] (`/run`, a tmpfs), not beside the volumes:
//! - taking a lock must work when the data filesystem is full, or the very
//!   commands that free space (`drop`, `delete`) could not run;
//! - a lock file cannot be removed while another process may be waiting on
//!   its inode, so each one stays; on the data filesystem they would pile up
//!   beside the operator's files, in `/run` they are gone at the next boot,
//!   when no lock can be held anyway.
//!
//! Each volumes root has its own directory there, named after the root's
//! device and inode numbers, which every process sees alike for as long as
//! the filesystem stays mounted.
//!
//! An operation that changes a package waits for its lock as long as it
//! takes: the other holder is finishing its own change. A command that only
//! reads (a listing, a usage figure, a recovery pass over every package)
//! must never hang behind one package: it waits [`LockWait::Within`] a
//! bounded time, then reports the package busy, naming the holder's pid
//! from `/proc/locks` ([`Busy`]), and goes on with the others.
//!
//! ## Background work gives way
//!
//! The cleanup after a conversion removes trees of tens of thousands of
//! entries under a package's lock, in the idle I/O class: seconds. A
//! service load (`ensure`), a backup or a restore of that package must not
//! wait for all of it. So the cleanup holds the lock one bounded batch at a
//! time and, between two batches, lets everyone already waiting go first
//! ([`PackageLock::set_down`], [`SetDown::take_up`]).
//!
//! flock is not fair: a holder that unlocks and locks again at once wins
//! against the waiters the kernel has only just woken, so releasing alone
//! would not let them in. Each waiter therefore announces itself: before
//! it waits for the package's lock it takes a shared lock on a second
//! file, `<pkg>.wait` (package ids have no dot, so no package's lock file
//! is ever named so), and drops it as soon as it holds the package. The
//! cleanup, having set the package down, takes that second file
//! exclusively before it takes the package again: it gets it only once
//! every waiter announced at that moment holds the package (or gave up),
//! and then queues behind them for the package. Nothing ever waits for the
//! announcement file while holding a package lock, so no cycle: a waiter
//! holds `.wait` and waits for the package; the cleanup, holding nothing,
//! waits for `.wait`.

use std::ffi::OsStr;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use models::PackageId;

use crate::sys;

/// Where every volumes root's lock directory is made.
pub const LOCK_DIR: &str = "/run/startos-volume";

/// The lock directory of one volumes root.
pub struct LockDir {
    path: PathBuf,
    dir: OwnedFd,
}

impl LockDir {
    /// The lock directory of the volumes root open as `root`, created if
    /// missing (with [`LOCK_DIR`]).
    pub fn for_root(root: BorrowedFd<'_>) -> io::Result<Self> {
        let st = sys::stat(root)?;
        let (major, minor) = sys::major_minor(st.dev);
        let path = Path::new(LOCK_DIR).join(format!("{major}:{minor}-{}", st.ino));
        sys::mkdir_path_if_missing(Path::new(LOCK_DIR), 0o700)?;
        sys::mkdir_path_if_missing(&path, 0o700)?;
        let dir = sys::open_dir_path(&path)?;
        Ok(LockDir { path, dir })
    }

    /// The directory's path, for error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Blocks until `pkg` is free, then holds its lock. Different packages
    /// never wait on each other.
    pub fn lock(&self, pkg: &PackageId) -> io::Result<PackageLock> {
        self.lock_with(pkg, LockWait::Forever)
    }

    /// Takes `pkg`'s lock, waiting as `wait` says: past its patience, a
    /// [`Busy`] error naming the holder.
    ///
    /// While it waits, it is announced on `<pkg>.wait` (see the module
    /// docs), so a background holder that sets the package down between
    /// two batches lets it in before it takes the package again.
    pub fn lock_with(&self, pkg: &PackageId, wait: LockWait) -> io::Result<PackageLock> {
        let file = sys::create_file_at(self.dir.as_fd(), OsStr::new(pkg.as_str()), 0o600)?;
        let waiting = sys::create_file_at(
            self.dir.as_fd(),
            OsStr::new(&format!("{pkg}{WAIT_SUFFIX}")),
            0o600,
        )?;
        // Held exclusively only for the instant between a background
        // holder's two flock calls: a short wait, whatever `wait` says.
        sys::lock_shared(waiting.as_fd())?;
        let taken = self.take(&file, wait);
        sys::unlock(waiting.as_fd())?;
        taken?;
        Ok(PackageLock { file, waiting })
    }

    /// Takes `file` exclusively, waiting as `wait` says.
    fn take(&self, file: &OwnedFd, wait: LockWait) -> io::Result<()> {
        let patience = match wait {
            LockWait::Forever => return sys::lock_exclusive(file.as_fd()),
            LockWait::Within(patience) => patience,
        };
        let start = Instant::now();
        loop {
            if sys::try_lock_exclusive(file.as_fd())? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= patience {
                let holders = sys::flock_holders(file.as_fd())?;
                return Err(io::Error::other(Busy {
                    pid: holders.first().copied(),
                    waited,
                }));
            }
            std::thread::sleep((patience - waited).min(Duration::from_millis(20)));
        }
    }
}

/// How long an operation waits for a package's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// As long as it takes: for what changes a package.
    Forever,
    /// At most this long, then [`Busy`]: for what only reads.
    Within(Duration),
}

/// Another process holds a package's lock: the payload of the `io::Error`
/// [`LockDir::lock_with`] returns once its patience ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    /// The process that took the lock, if `/proc/locks` says.
    pub pid: Option<u32>,
    /// How long this one waited.
    pub waited: Duration,
}

impl fmt::Display for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "busy: process {pid} holds its lock"),
            None => f.write_str("busy: another process holds its lock"),
        }?;
        write!(
            f,
            " (waited {:.1} s); an operation on it is under way, try again once it is done",
            self.waited.as_secs_f64()
        )
    }
}

impl std::error::Error for Busy {}

/// The [`Busy`] in `e`, if that is what it is.
pub fn busy(e: &io::Error) -> Option<Busy> {
    e.get_ref()?.downcast_ref::<Busy>().copied()
}

/// Suffix of the file a waiter for a package's lock holds shared while it
/// waits (see the module docs).
const WAIT_SUFFIX: &str = ".wait";

/// Held while one operation runs on one package; released on drop (or when
/// the process dies, so a crash never leaves a package locked).
pub struct PackageLock {
    file: OwnedFd,
    /// The package's announcement file (`<pkg>.wait`), open, not held.
    waiting: OwnedFd,
}

/// A package whose lock a background holder has set down between two
/// batches of its work ([`PackageLock::set_down`]): held by nobody on its
/// behalf until [`SetDown::take_up`]. Whatever the holder knew of the
/// package may have changed meanwhile; it must look again.
pub struct SetDown {
    file: OwnedFd,
    waiting: OwnedFd,
}

impl SetDown {
    /// Takes the package's lock again, after every operation that was
    /// waiting for it when this is called has had it (see the module
    /// docs): waits for them to take it, then for the last of them to let
    /// it go. Operations that start waiting later may come first too.
    pub fn take_up(self) -> io::Result<PackageLock> {
        sys::lock_exclusive(self.waiting.as_fd())?;
        sys::unlock(self.waiting.as_fd())?;
        sys::lock_exclusive(self.file.as_fd())?;
        Ok(PackageLock {
            file: self.file,
            waiting: self.waiting,
        })
    }
}

impl PackageLock {
    /// Lets the package go for a while, for a holder working in bounded
    /// batches (the cleanup after a conversion): anyone waiting, or
    /// starting to wait, gets it, until [`SetDown::take_up`].
    pub fn set_down(self) -> io::Result<SetDown> {
        sys::unlock(self.file.as_fd())?;
        Ok(SetDown {
            file: self.file,
            waiting: self.waiting,
        })
    }

    /// Takes the lock of `pkg` for the volumes root open as `root`, the
    /// same lock every [`crate::VolumeStore`] operation on `pkg` takes, so
    /// other tools (the one-time conversion) never interleave with a volume
    /// operation. Blocks until free; released on drop or when the process
    /// dies.
    pub fn for_package(root: BorrowedFd<'_>, pkg: &PackageId) -> io::Result<Self> {
        LockDir::for_root(root)?.lock(pkg)
    }
}
