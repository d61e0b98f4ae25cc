//! What changed in a copy's source since an interrupted copy of it began,
//! as the filesystem orders its changes.
//!
//! A resumed copy keeps what the earlier run left only for source entries
//! that have not changed since that run began. Times cannot tell: a box
//! with no real-time clock boots with its clock behind, so a file changed
//! between the two runs can carry a ctime older than the copy's birth (or
//! the same ctime as before: a clock behind moves no time), and its stale
//! prefix would be kept. btrfs records in each inode item the transaction
//! that last wrote it, and transactions only go forward. The copy reads
//! the source once the transaction that created it began, perhaps while
//! it is still open, so an entry whose item was written in that
//! transaction or a later one may have changed since the copy began (one
//! changed in it before the copy read it is copied again: time, never
//! data), and every other one is as the copy found it; no commit is
//! needed between the copy's creation and its first read. An access time written by a read
//! counts as a change too: the copy reads with O_NOATIME, so only another
//! reader's makes it copy an entry again, which costs time, never data.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Mutex, PoisonError};

use crate::sys::{self, Stat};

/// The inodes of a copy's source changed after a transaction (see the
/// module docs), per subvolume: the source's own, read at once, and each
/// nested one as the copy reaches it. An entry of any other device is
/// counted as changed, copied again rather than trusted.
#[derive(Debug)]
pub struct SourceChanges {
    created: u64,
    /// Device number of each subvolume read: the inode numbers it changed.
    by_dev: Mutex<HashMap<u64, HashSet<u64>>>,
}

impl SourceChanges {
    /// What changed in the subvolume holding `src` (a directory on btrfs)
    /// in transaction `created`, the one that created the copy being
    /// resumed, or after it (the module docs).
    ///
    /// Commits the filesystem first, its dirty file data included
    /// ([`sys::commit`]): a write's inode item is updated when its data is
    /// written back, and its times may not move at all (a clock set back
    /// leaves them as they were), so only data on disk and the inode items
    /// its writeback updated tell every change made before the call. Costs
    /// that commit (once per resumed package, and only with a partial copy
    /// to resume) and a search of what changed, not of the whole tree.
    /// Reads only: a crash leaves nothing.
    pub fn since(src: BorrowedFd<'_>, created: u64) -> io::Result<SourceChanges> {
        sys::commit(src)?;
        let dev = sys::stat(src)?.dev;
        let inodes = sys::inodes_written_since(src, created)?;
        Ok(SourceChanges {
            created,
            by_dev: Mutex::new(HashMap::from([(dev, inodes)])),
        })
    }

    /// Whether the source entry `name` of the directory open as `dir`,
    /// whose stat is `st`, may have changed since. A nested subvolume's
    /// root, met first, has what changed in it read then (the walk reaches
    /// a subvolume's root before anything inside it).
    pub(crate) fn changed(&self, dir: BorrowedFd<'_>, name: &OsStr, st: &Stat) -> io::Result<bool> {
        let mut by_dev = self.by_dev.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(inodes) = by_dev.get(&st.dev) {
            return Ok(inodes.contains(&st.ino));
        }
        if !(st.is_dir() && st.ino == sys::SUBVOLUME_ROOT_INO) {
            return Ok(true);
        }
        let nested = sys::open_dir_at(dir, name)?;
        let inodes = sys::inodes_written_since(nested.as_fd(), self.created)?;
        let changed = inodes.contains(&st.ino);
        by_dev.insert(st.dev, inodes);
        Ok(changed)
    }

    /// Whether the top of the source, `st`, changed since: then nothing of
    /// the earlier copy is worth keeping.
    pub fn top_changed(&self, st: &Stat) -> bool {
        let by_dev = self.by_dev.lock().unwrap_or_else(PoisonError::into_inner);
        by_dev
            .get(&st.dev)
            .is_none_or(|inodes| inodes.contains(&st.ino))
    }
}
