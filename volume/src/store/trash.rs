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
//! their own right (restore, delete, purge, a backup's drop: `drop_backup`,
//! `begin_install`, `snapshot_replacing`) and recovery (`recover`,
//! `recover_all`); another operation whose recovery moves a crash's
//! leftover or a held tree no longer mounted there (a create after a
//! crashed delete, say) leaves it for the next of those, the boot's
//! included: garbage either way. A dropped backup and a held tree once
//! unmounted come here too: deleted under the lock, as they were, a
//! reflink backup of 100k files held the install that start-core finishes
//! for 1.6 s (a snapshot backup, a commit per nested subvolume), and a held
//! tree of 200k cached files its package's next operation for 0.5 s.
//!
//! No package's lock guards the trash: only a package's own operations,
//! under that package's lock, put entries in (named after the package,
//! numbered above its highest entry there, so two packages never pick one
//! name), and emptying only removes. Two purges racing on one entry are
//! harmless: the second finds it gone. The directory is removed once empty,
//! but only under an exclusive flock of it that the emptying does not wait
//! for, while each move in holds it shared from its making to the rename
//! (`trash_held`): a move never finds it gone under it. Without that, the
//! boot's recovery of several packages at once, each emptying the trash
//! after its own move, made a move fail about one run in four of a test
//! recovering two (`volume_ops::recovery_finishes_what_names_on_disk_say`:
//! "moving gone.delete to .trash: No such file or directory").
//!
//! Crash safety: everything in the trash is garbage at every instant (the
//! move in is one rename of a tree no package name refers to any more), so
//! a crash leaves at worst a tree there, whole or part-deleted, that the
//! next [`VolumeStore::recover_all`] (the boot's) or the next emptying
//! deletes. Nothing in it decides any recovery.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use models::{Error, ErrorKind, PackageId, ResultExt};

use super::{VolumeStore, delete_tree_at};
use crate::errors::is_enospc;
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
/// emptying: the first such error is returned once the others were tried,
/// each other one a warning.
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
            // The first is returned, for the caller to tell; each other
            // one is a warning here, so each failure is told once.
            Err(e) if first_error.is_some() => tracing::warn!(
                "could not delete {}: {e}; the next purge tries again",
                trash.join(name).display()
            ),
            Err(e) => {
                first_error = Some(
                    Err::<(), _>(e)
                        .with_ctx(ctx(format!("deleting {}", trash.join(name).display())))
                        .unwrap_err(),
                );
            }
        }
    }
    // Not empty (a move in since the listing, or a tree left), or a move in
    // under way (it holds the trash shared, `trash_held`), or no longer the
    // trash we emptied (another emptying removed it, a move made it again):
    // kept.
    let ours = || -> io::Result<bool> {
        let here = sys::stat_at(root, OsStr::new(TRASH_DIR))?;
        let emptied = sys::stat(dir.as_fd())?;
        Ok(
            here.is_some_and(|h| (h.dev, h.ino) == (emptied.dev, emptied.ino))
                && sys::try_lock_exclusive(dir.as_fd())?,
        )
    };
    let removed = ours().and_then(|ours| match ours {
        true => sys::rmdir_at(root, OsStr::new(TRASH_DIR)).and_then(|()| sys::fsync(root)),
        false => Ok(()),
    });
    match removed {
        Ok(()) => {}
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::ENOENT)) => {}
        Err(e) => tracing::warn!("could not remove {}: {e}", trash.display()),
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

/// Moves into the trash give up after this many of its removals in a row
/// (each between a making of it and the hold on it): emptyings that race a
/// move, never a failure of the move itself.
const TRASH_TRIES: usize = 16;

/// The trash directory of the root open as `root`, made if absent, open and
/// held shared (flock) by the returned descriptor: an emptying removes the
/// trash only under an exclusive hold it does not wait for, so a move into
/// it finds it in place until the descriptor is dropped. Moves into it from
/// several threads or processes at once each hold their own descriptor,
/// each a shared hold. A trash removed between its making and the hold
/// (its link count then 0) is made again.
fn trash_held(root: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    for _ in 0..TRASH_TRIES {
        match sys::mkdir_at(root, OsStr::new(TRASH_DIR), 0o700) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        let dir = match sys::open_dir_at(root, OsStr::new(TRASH_DIR)) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        sys::lock_shared(dir.as_fd())?;
        if sys::stat(dir.as_fd())?.nlink == 0 {
            continue;
        }
        // Its making is not synced here: the move into it commits (off
        // btrfs, syncs the root) once it renamed, which makes both durable
        // at once; a crash before leaves an empty trash or none, garbage
        // either way.
        return Ok(dir);
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("{TRASH_DIR} was removed {TRASH_TRIES} times while a move into it began"),
    ))
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
            tracing::warn!("{e}; the next purge, or the boot's recovery, tries again");
        }
    }

    /// Moves the tree `name` of the root, which no mount holds, into the
    /// trash, durably (one rename, one commit): for `pkg`, whose lock the
    /// caller holds. A crash leaves it under `name` or in the trash.
    pub(super) fn trash(&self, pkg: &PackageId, name: &OsStr) -> Result<(), Error> {
        let moved = match self.move_into_trash(pkg, self.root_fd(), name) {
            // Out of metadata space, the trash cannot be made nor the tree
            // moved; deleting the tree is what frees space, and a subvolume
            // with nothing nested goes in one step, under its own name.
            // Anything else stays an error.
            Err(e) if is_enospc(&e) => match self.one_step_delete(name) {
                Ok(true) => return Ok(()),
                Ok(false) => Err(e),
                Err(other) => Err(other),
            },
            r => r.and_then(|()| self.commit_trash()),
        };
        moved.with_ctx(|_| {
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

    /// Moves the entry `name` of `from` (the root, or `<pkg>.held`), under
    /// a name that says it is garbage (`.install-backup.drop`, a held tree
    /// no longer mounted), into the trash, durably. Out of metadata space,
    /// where it cannot be moved, deletes it in place: a crash part-way
    /// leaves less of the same garbage, under the same name. A failure
    /// once it moved (its commit) is returned as it is.
    pub(super) fn trash_garbage(
        &self,
        pkg: &PackageId,
        from: BorrowedFd<'_>,
        name: &OsStr,
    ) -> io::Result<()> {
        match self.move_into_trash(pkg, from, name) {
            Err(e) if is_enospc(&e) => delete_tree_at(from, name).and_then(|()| sys::fsync(from)),
            r => r.and_then(|()| self.commit_trash()),
        }
    }

    /// Renames the entry `name` of `from` (the root, or a directory of the
    /// store's own under it) into the trash under `pkg`'s next number
    /// there; the caller holds `pkg`'s lock, and commits after
    /// ([`VolumeStore::commit_trash`]). `name` is garbage, so a read-only
    /// subvolume there (a dropped backup) is made writable first: moving a
    /// directory to another parent rewrites its `..`, which a read-only
    /// subvolume refuses (EROFS). An entry that is no directory (a stray
    /// in `<pkg>.held`) moves as it is. A crash leaves it under `name`
    /// (writable or not) or in the trash, whole either way.
    fn move_into_trash(
        &self,
        pkg: &PackageId,
        from: BorrowedFd<'_>,
        name: &OsStr,
    ) -> io::Result<()> {
        match sys::open_dir_at(from, name) {
            Ok(top) => {
                if sys::is_subvolume(top.as_fd())? && sys::is_read_only(top.as_fd())? {
                    sys::set_read_only(top.as_fd(), false)?;
                    failpoint("trash.writable")?;
                }
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {}
            Err(e) => return Err(e),
        }
        // Held shared until the rename is done: no emptying removes it
        // meanwhile (see `trash_held`).
        let dir = trash_held(self.root_fd())?;
        // Only `pkg`'s operations, under its lock, make its names.
        let to = super::next_numbered(dir.as_fd(), &format!("{pkg}."))?;
        sys::rename_at(from, name, dir.as_fd(), &to)
    }

    /// Makes a move into the trash durable, and the trash's making with
    /// it: the root's commit ([`VolumeStore::commit_root`]).
    fn commit_trash(&self) -> io::Result<()> {
        failpoint("trash.moved")?;
        self.commit_root()
    }
}
