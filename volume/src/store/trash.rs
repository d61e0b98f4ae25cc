//! The trash ([`crate::layout::TRASH_DIR`]): where a restore or a delete
//! puts the tree it no longer uses, so that deleting it happens after the
//! call, off the package's lock.
//!
//! Why: deleting a subvolume (`BTRFS_IOC_SNAP_DESTROY_V2`) evicts every
//! inode of it still cached, in the calling thread, before the ioctl
//! returns: 0.55 s for 100k cached files, 4.5 s for a million. Done under
//! the package's lock, as it was, that held the caller (the restore that
//! start-core waits on to restart the service), every other operation of
//! the package, and a `Service::load`'s `ensure_volume_root`, for seconds.
//!
//! So, under the lock, the tree is only moved: mounts are checked first (a
//! tree a mount still holds is kept in `<pkg>.held` instead, as before),
//! then one rename into the trash, under `<pkg>.<n>`, and one commit. The
//! package is then in its new state and that state is durable: the call
//! can return. The trash is emptied after the lock is released
//! ([`VolumeStore::empty_trash`]): by the same call before it returns
//! (the default, for the short-lived command-line tools), or, with
//! [`VolumeStore::with_deferred_purge`], by whoever the caller chooses
//! (start-core hands it to [`crate::purge`]'s background thread).
//!
//! The calls that empty it in the inline way are those that fill it in
//! their own right (restore, delete, purge) and recovery
//! (`recover`, `recover_all`); another operation whose recovery moves a
//! crash's leftover there (a create after a crashed delete, say) leaves it
//! for the next of those, the boot's included: garbage either way.
//! What stays deleted under the lock, as before: a dropped backup (its
//! inodes are rarely cached: nothing runs on it) and a held tree once
//! unmounted.
//!
//! No lock guards the trash: only a package's own operations, under that
//! package's lock, put entries in (named after the package, numbered above
//! its highest entry there, so two packages never pick one name), and
//! emptying only removes. Two purges racing on one entry are harmless: the
//! second finds it gone. The directory is removed once empty; a move that
//! finds it just removed makes it again.
//!
//! Crash safety: everything in the trash is garbage at every instant (the
//! move in is one rename of a tree no package name refers to any more), so
//! a crash leaves at worst a tree there, whole or part-deleted, that the
//! next [`VolumeStore::recover_all`] (the boot's) or the next emptying
//! deletes. Nothing in it decides any recovery.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use models::{Error, ErrorKind, PackageId, ResultExt};

use super::{VolumeStore, delete_tree_at};
use crate::failpoint::failpoint;
use crate::layout::TRASH_DIR;
use crate::sys;

/// When the trash is emptied after an operation that filled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purge {
    /// By the operation itself, after it released the package's lock.
    Inline,
    /// By the caller ([`VolumeStore::empty_trash`], [`crate::purge`]).
    Deferred,
}

/// Deletes everything in the trash of the volumes root open as `root`
/// (whose path, for messages, is `path`), then the trash itself if it is
/// empty. Takes no lock: see [`TRASH_DIR`]. Returns how many
/// trees it deleted. A tree it cannot delete is left for the next
/// emptying, with a warning; the first such error is returned once the
/// others were tried.
pub fn empty_trash_at(root: BorrowedFd<'_>, path: &Path) -> Result<usize, Error> {
    let trash = path.join(TRASH_DIR);
    let ctx = |what: String| move |_: &io::Error| (ErrorKind::DiskManagement, what);
    let dir = match sys::open_dir_at(root, OsStr::new(TRASH_DIR)) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_ctx(ctx(format!("opening {}", trash.display()))),
    };
    let names =
        sys::read_dir_names(dir.as_fd()).with_ctx(ctx(format!("reading {}", trash.display())))?;
    let mut deleted = 0;
    let mut first_error = None;
    for (name, _, _) in &names {
        let done = failpoint("trash.deleting")
            .and_then(|()| delete_tree_at(dir.as_fd(), name))
            .and_then(|()| sys::fsync(dir.as_fd()));
        match done {
            Ok(()) => deleted += 1,
            // Another purge deleted it first.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(
                    "could not delete {}: {e}; the next purge tries again",
                    trash.join(name).display()
                );
                first_error.get_or_insert_with(|| {
                    Err::<(), _>(e)
                        .with_ctx(ctx(format!("deleting {}", trash.join(name).display())))
                        .unwrap_err()
                });
            }
        }
    }
    // Not empty (a move in since the listing, or a tree left): kept.
    match sys::rmdir_at(root, OsStr::new(TRASH_DIR)).and_then(|()| sys::fsync(root)) {
        Ok(()) => {}
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::ENOENT)) => {}
        Err(e) => tracing::warn!("could not remove {}: {e}", trash.display()),
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

impl VolumeStore {
    /// Leaves the trash for the caller to empty: a restore, a delete or a
    /// purge then returns once the tree it no longer uses is in the trash
    /// (milliseconds, whatever the tree holds), and the caller empties it
    /// with [`VolumeStore::empty_trash`], or hands it to
    /// [`crate::purge::in_background`]. Without this, each such call
    /// empties the trash itself, after releasing the package's lock.
    pub fn with_deferred_purge(mut self) -> Self {
        self.purge = Purge::Deferred;
        self
    }

    /// Deletes everything in the trash, every package's, then the trash
    /// itself: what restores and deletes left there (see the
    /// [`trash` docs](crate::layout::TRASH_DIR)). Takes no package's lock,
    /// so nothing waits on it but its caller. Returns how many trees it
    /// deleted. A crash part-way leaves less of the same garbage.
    pub fn empty_trash(&self) -> Result<usize, Error> {
        empty_trash_at(self.root_fd(), self.root.path())
    }

    /// After an operation released its lock: empties the trash unless the
    /// caller does. A failure is a warning: the operation succeeded, and
    /// what is left is garbage the next emptying deletes.
    pub(super) fn purge_after(&self) {
        if self.purge == Purge::Inline
            && let Err(e) = self.empty_trash()
        {
            tracing::warn!("{e}");
        }
    }

    /// Moves the tree `name` of the root, which no mount holds, into the
    /// trash, durably (one rename, one commit): for `pkg`, whose lock the
    /// caller holds. A crash leaves it under `name` or in the trash.
    pub(super) fn trash(&self, pkg: &PackageId, name: &OsStr) -> Result<(), Error> {
        let moved = || -> io::Result<()> {
            // The trash may be removed by an emptying between its opening
            // and the rename: made again, a few times at most.
            let mut tries = 0;
            loop {
                // Only `pkg`'s operations, under its lock, make its names.
                let dir = super::dir_made(self.root_fd(), OsStr::new(TRASH_DIR))?;
                let to = super::next_numbered(dir.as_fd(), &format!("{pkg}."))?;
                match sys::rename_at(self.root_fd(), name, dir.as_fd(), &to) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => tries += 1,
                    r => return r,
                }
            }
        };
        moved()
            .and_then(|()| failpoint("trash.moved"))
            .and_then(|()| self.commit_root())
            .with_ctx(|_| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context(format!(
                        "moving {} to {}",
                        self.root.path().join(name).display(),
                        self.root.path().join(TRASH_DIR).display()
                    )),
                )
            })
    }
}
