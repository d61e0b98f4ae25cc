//! The pace of shedding what a conversion left (a deferred cut's rest, an
//! old tree) while services run: how long it holds the package, and how
//! much metadata space it takes at once.
//!
//! ## The package's lock, one batch at a time
//!
//! A service load (`ensure`), a backup and a restore of a package take its
//! lock; a removal of tens of thousands of entries in the idle I/O class
//! takes seconds, longer under load. So the removal holds the lock for one
//! batch of at most [`BATCH_ENTRIES`] entries or [`BATCH_TIME`], whichever
//! comes first, then sets the package down ([`volume::lock::PackageLock::set_down`]),
//! lets every operation already waiting run to its end, and takes the
//! package up again. One entry is one system call (an unlink, an rmdir,
//! the deletion of a nested subvolume); a regular file of many extents is
//! the one entry whose unlink can take longer than a batch. The commit
//! below and the `migrate.between-batches` failpoint happen while the
//! package is set down.
//!
//! Whatever ran in between may have changed what the removal works on, so
//! before it goes on it looks again: the caller's `still` says whether the
//! garbage is where and what it was (the old tree still the same tree
//! under `<pkg>.migrate-old`; the volume holding the rest still the same
//! subvolume under `<pkg>`, with the same record). If not (a delete took
//! the package and its leftovers, a restore exchanged the volume), the
//! removal stops there with [`Interrupted`], removing nothing more through
//! what it had opened: what is left is garbage under its name or record,
//! which the cleanup looks for again from the start (a restore may have
//! brought back part of a rest), a bounded number of times, else the next
//! cleanup does. A
//! snapshot taken in between changes neither: the removal goes on in the
//! volume, and the record stays while the backup holds a copy of the rest
//! (the `cleanup` module). Each batch removes only entries of the tree it
//! started on, found through descriptors opened under the lock, and every
//! entry below an old tree or a rest is garbage, so no interleaving makes
//! it remove anything else.
//!
//! ## Metadata space
//!
//! Removing an entry from a tree a snapshot shares copies each tree block
//! it changes first, so a removal takes metadata space before it gives any
//! back, and gives it back only when its transaction commits. Left to the
//! kernel's own 30 s commits, a rest holding a whole box's other packages
//! would copy the blocks of tens of thousands of entries at once. So every
//! [`COMMIT_EVERY`] entries the removal commits its metadata (not the
//! services' dirty data: [`sys::commit_metadata`]), freeing what it
//! copied, and reads the free metadata space again: still below the
//! reserve, it stops with [`io::ErrorKind::StorageFull`], and what is left
//! stays garbage for the next cleanup (a rest is removed by its record, an
//! old tree by its name, so a stop anywhere loses nothing). What the
//! cleanup takes at once is thus bounded by the blocks of that many
//! entries (one entry may be a file of millions of extents, removed in one
//! call). A removal starts below the reserve too: removing is what frees
//! space, and the first commit tells whether it did.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use volume::failpoint::failpoint;
use volume::lock::PackageLock;
use volume::sys;

/// Entries removed between two commits: a commit costs 10-30 ms here, and
/// 4,096 removals 0.2 s or more, so this keeps the commits to a few
/// percent of the removal's time.
pub(crate) const COMMIT_EVERY: u64 = 4096;

/// Most entries removed in one hold of the package's lock.
pub(crate) const BATCH_ENTRIES: u64 = 256;

/// Longest one hold of the package's lock lasts before it is set down at
/// the next entry: a hold is this plus the entry that ends it. Over a
/// 20,000-file old tree on a loaded two-core box (debug build) the longest
/// hold was 8-14 ms: these 2 ms and one unlink of a one-byte file that
/// took up to 12 ms, the filesystem's own latency, which a shorter batch
/// would not remove; the per-batch cost (four flock calls and a look at
/// the package) is a few microseconds.
pub(crate) const BATCH_TIME: Duration = Duration::from_millis(2);

/// The removal stopped between two batches because what it removed
/// changed meanwhile (see the module docs): the payload of the `io::Error`
/// [`Shed::removed`] returns. Nothing is wrong; the cleanup starts over
/// from what is left (the `cleanup` module).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Interrupted;

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "another operation changed the package between two batches of the removal; \
             starting over from what is left",
        )
    }
}

impl std::error::Error for Interrupted {}

/// Whether `e` is the [`Interrupted`] stop of a removal.
pub(crate) fn interrupted(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|e| e.is::<Interrupted>())
}

/// The pace of the removals of one package's garbage, holding its lock.
pub(crate) struct Shed<'fd> {
    fd: BorrowedFd<'fd>,
    reserve: u64,
    /// `None` only between a failed take-up and the end of the removal.
    lock: Option<PackageLock>,
    since_commit: u64,
    batch: u64,
    started: Instant,
    /// The longest hold of the lock so far (for the log and the tests).
    longest: Duration,
}

impl<'fd> Shed<'fd> {
    /// Removals on the filesystem of `fd`, holding the package as `lock`,
    /// that must leave `reserve` bytes of metadata free at each commit.
    pub fn start(fd: BorrowedFd<'fd>, reserve: u64, lock: PackageLock) -> Shed<'fd> {
        Shed {
            fd,
            reserve,
            lock: Some(lock),
            since_commit: 0,
            batch: 0,
            started: Instant::now(),
            longest: Duration::ZERO,
        }
    }

    /// After each entry removed: at the end of a batch, sets the package
    /// down, commits if [`COMMIT_EVERY`] entries were removed since the
    /// last commit, takes the package up again and asks `still` whether
    /// the removal may go on ([`Interrupted`] if not). Holds the package
    /// whenever it returns `Ok`.
    pub fn removed(&mut self, still: &mut dyn FnMut() -> io::Result<bool>) -> io::Result<()> {
        self.batch += 1;
        self.since_commit += 1;
        if self.batch < BATCH_ENTRIES && self.started.elapsed() < BATCH_TIME {
            return Ok(());
        }
        let commit = self.since_commit >= COMMIT_EVERY;
        if commit {
            self.since_commit = 0;
        }
        let (fd, reserve) = (self.fd, self.reserve);
        self.pass(still, &mut || match commit {
            true => sys::commit_metadata(fd.as_fd()).and_then(|()| check(fd, reserve)),
            false => Ok(()),
        })
    }

    /// Ends the current batch: sets the package down, runs `meanwhile`
    /// (a commit, which need not keep anyone waiting), takes the package
    /// up again and asks `still` whether the removal may go on
    /// ([`Interrupted`] if not). Holds the package whenever it returns
    /// `Ok`.
    pub fn pass(
        &mut self,
        still: &mut dyn FnMut() -> io::Result<bool>,
        meanwhile: &mut dyn FnMut() -> io::Result<()>,
    ) -> io::Result<()> {
        self.longest = self.longest.max(self.started.elapsed());
        let lock = self
            .lock
            .take()
            .ok_or_else(|| io::Error::other("the package's lock was not taken up again"))?;
        let down = lock.set_down()?;
        meanwhile()?;
        failpoint("migrate.between-batches")?;
        self.lock = Some(down.take_up()?);
        self.batch = 0;
        self.started = Instant::now();
        if !still()? {
            return Err(io::Error::other(Interrupted));
        }
        Ok(())
    }

    /// Lets the package go for good, the removal done: what is left to do
    /// (making it durable) needs no lock.
    pub fn release(&mut self) {
        if self.lock.take().is_some() {
            self.longest = self.longest.max(self.started.elapsed());
        }
    }

    /// The longest the package was held in one batch so far, the current
    /// batch included.
    pub fn longest_hold(&self) -> Duration {
        match self.lock {
            Some(_) => self.longest.max(self.started.elapsed()),
            None => self.longest,
        }
    }
}

/// Fails with [`io::ErrorKind::StorageFull`] if the filesystem of `fd` has
/// less than `reserve` bytes of metadata space free.
fn check(fd: BorrowedFd<'_>, reserve: u64) -> io::Result<()> {
    let free = sys::metadata_space(fd)?.free();
    if free < reserve {
        return Err(io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "only {free} bytes of metadata space free, under the {reserve} kept in \
                 reserve: left for the next cleanup"
            ),
        ));
    }
    Ok(())
}
