//! The pace of shedding what a conversion left (a deferred cut's rest, an
//! old tree) while services run.
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

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use volume::sys;

/// Entries removed between two commits: a commit costs 10-30 ms here, and
/// 4,096 removals 0.2 s or more, so this keeps the commits to a few
/// percent of the removal's time.
pub(crate) const COMMIT_EVERY: u64 = 4096;

/// The pace of one removal on the filesystem of `fd`.
pub(crate) struct Pace<'fd> {
    fd: BorrowedFd<'fd>,
    reserve: u64,
}

impl<'fd> Pace<'fd> {
    /// A removal on the filesystem of `fd` that must leave `reserve` bytes
    /// of metadata free at each of its commits.
    pub fn start(fd: BorrowedFd<'fd>, reserve: u64) -> Pace<'fd> {
        Pace { fd, reserve }
    }

    /// After the `removed`-th entry: every [`COMMIT_EVERY`], a commit and
    /// the space checked again.
    pub fn step(&self, removed: u64) -> io::Result<()> {
        if removed == 0 || !removed.is_multiple_of(COMMIT_EVERY) {
            return Ok(());
        }
        sys::commit_metadata(self.fd.as_fd())?;
        self.check()
    }

    fn check(&self) -> io::Result<()> {
        let free = sys::metadata_space(self.fd.as_fd())?.free();
        if free < self.reserve {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "only {free} bytes of metadata space free, under the {} kept in reserve: \
                     left for the next cleanup",
                    self.reserve
                ),
            ));
        }
        Ok(())
    }
}
