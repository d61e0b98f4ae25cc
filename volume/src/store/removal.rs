//! Removing what a package has: its backup ([`VolumeStore::drop_backup`]),
//! its volume with everything else of it ([`VolumeStore::delete`]), or its
//! live volume alone ([`VolumeStore::discard_volume`]), and deleting any
//! tree ([`delete_tree`], [`delete_tree_in`], [`delete_tree_at`]): only a
//! direct child of the volumes root is a package's volume.
//!
//! A tree is renamed aside to a transient name first, so a crash never
//! leaves a half-deleted tree under a name that says "complete"; where the
//! rename finds no metadata space, a subvolume with none nested in it is
//! deleted in one atomic step instead. A volume that a mount, in any mount
//! namespace, still holds leaves the package's name all the same, and is
//! kept under `<pkg>.held` until no mount holds it ([`super::held`]).

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt};

use super::VolumeStore;
use super::held::Disposal;
use super::recovery::Leftover;
use crate::errors::is_enospc;
use crate::failpoint::failpoint;
use crate::layout::{self, Names};
use crate::outcome::{DeleteOutcome, HeldTree};
use crate::record;
use crate::sys;

impl VolumeStore {
    /// Drops the install backup after a successful install: O(1), whatever
    /// the backup holds (a reflink copy of a plain directory, subvolumes
    /// nested in a snapshot), but for a filesystem out of metadata space,
    /// where it is deleted in place. Returns `false` if there was none.
    ///
    /// Under the package's lock the backup is only renamed to
    /// `<pkg>.install-backup.drop`, made writable (which commits) and
    /// moved into the trash, then committed: a crash leaves the backup
    /// whole under its name, or garbage (`.drop`, which recovery moves on,
    /// or in the trash). It is deleted after the lock is released, by this
    /// call or, with [`VolumeStore::with_deferred_purge`], by the caller
    /// (see [`crate::layout::TRASH_DIR`]).
    pub fn drop_backup(&self, pkg: &PackageId) -> Result<bool, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(false);
        };
        self.tree(pkg, &names.live)?;
        let dropped = {
            let held = self.hold_recovered(pkg, names)?;
            self.drop_locked(pkg, &held.names)?
        };
        self.purge_after();
        Ok(dropped)
    }

    /// [`VolumeStore::drop_backup`] under the caller's hold: the backup
    /// into the trash, then its read-only record removed. The caller
    /// empties the trash once it releases the lock
    /// ([`VolumeStore::purge_after`]).
    pub(super) fn drop_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        // Out of space or at a qgroup limit, the error says so and what to
        // do, as every other operation's does.
        let io_ctx = |what: &'static str| move |e: io::Error| self.failed(pkg, what, e);
        let existed = self.tree(pkg, &names.backup)?.is_some();
        // Looked at first: a stray under the record's name stops the drop
        // before anything changed.
        let record = self.tree(pkg, &names.backup_ro)?.is_some();
        if existed {
            // Renamed in place first: a read-only backup cannot change its
            // parent until it is made writable, and under its own name a
            // backup stays read-only, as the frozen copy every other
            // operation takes it for. Then into the trash: deleting it
            // here, under the lock, held the install that start-core
            // finishes for 1.6 s for a reflink backup of 100k empty files
            // (5.9 s for 100k small ones, `bench --only purge`), and a
            // commit per subvolume nested in a snapshot.
            match sys::rename_noreplace(self.root_fd(), &names.backup, &names.backup_drop) {
                Ok(()) => {
                    failpoint("drop.renamed")
                        .and_then(|()| self.trash_garbage(pkg, self.root_fd(), &names.backup_drop))
                        .map_err(io_ctx("dropping the backup"))?;
                }
                Err(e) if is_enospc(&e) => {
                    if !self
                        .one_step_delete(&names.backup)
                        .map_err(io_ctx("deleting the backup"))?
                    {
                        return Err(self.failed(pkg, "dropping the backup", e));
                    }
                }
                Err(e) => {
                    return Err(io_ctx("moving the backup aside")(e));
                }
            }
            tracing::info!(package = %pkg, "install backup dropped");
        }
        if record {
            self.delete_entry(&names.backup_ro)
                .and_then(|()| self.fsync_root())
                .map_err(io_ctx("removing the backup's read-only record"))?;
        }
        Ok(existed)
    }

    /// Deletes the package's volume and its backup, on uninstall: O(1) per
    /// subvolume, nested subvolumes included; the volume is moved to the
    /// trash under the package's lock and deleted after it is released
    /// ([`TRASH_DIR`](crate::layout::TRASH_DIR): before this returns, or by the caller with
    /// [`VolumeStore::with_deferred_purge`]). Returns `false` if there was
    /// nothing to delete. Refuses an entry under the package's name that is
    /// no directory.
    ///
    /// `<pkg>` is renamed to `<pkg>.delete` first, the commit point: after a
    /// crash the package either still has its whole volume and backup, or
    /// the delete goes on until nothing of it is left (the backup is
    /// dropped, then `.delete` deleted last). A mount of the volume, in any
    /// namespace, never makes it fail: the volume still leaves `<pkg>` (a
    /// reinstall gets a fresh one), and is kept under `<pkg>.held` until no
    /// mount holds it, with a warning naming the holders (see
    /// [`VolumeStore::delete_outcome`]); then the next recovery deletes it,
    /// the last of the package's names. Only with no metadata space left,
    /// where nothing can be renamed, does a mounted volume make it fail.
    pub fn delete(&self, pkg: &PackageId) -> Result<bool, Error> {
        self.delete_outcome(pkg).map(|o| o.deleted)
    }

    /// [`VolumeStore::delete`], with the volume if a mount held it.
    pub fn delete_outcome(&self, pkg: &PackageId) -> Result<DeleteOutcome, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(DeleteOutcome {
                deleted: false,
                held: None,
            });
        };
        let outcome = {
            let guard = self.hold_recovered(pkg, names)?;
            self.delete_locked(pkg, &guard.names)?
        };
        // The volume is in the trash: deleted off the lock.
        self.purge_after();
        Ok(outcome)
    }

    fn delete_locked(&self, pkg: &PackageId, names: &Names) -> Result<DeleteOutcome, Error> {
        // Out of space or at a qgroup limit, the error says so and what to
        // do, as every other operation's does.
        let io_ctx = |what: &'static str| move |e: io::Error| self.failed(pkg, what, e);
        let mut deleted = false;
        if self.tree(pkg, &names.live)?.is_some() {
            // A stray under one of its names stops the delete before it
            // starts, not half-way.
            self.leftovers(pkg, names)?;
            match sys::rename_noreplace(self.root_fd(), &names.live, &names.delete) {
                Ok(()) => {
                    self.commit_root()
                        .and_then(|()| failpoint("delete.renamed"))
                        .map_err(io_ctx("deleting the volume"))?;
                }
                Err(e) if is_enospc(&e) => {
                    // No room to rename: the backup, then the volume, each
                    // in one atomic step. A crash in between leaves the
                    // package with its volume and no backup, which the next
                    // delete finishes.
                    // Nor room to keep a mounted volume aside: it stays.
                    if !self
                        .can_delete_in_one_step(&names.live)
                        .map_err(io_ctx("inspecting the volume"))?
                        || !self.mount_uses(pkg)?.is_empty()
                    {
                        return Err(self.failed(pkg, "deleting the volume", e));
                    }
                    self.drop_locked(pkg, names)?;
                    if !self
                        .one_step_delete(&names.live)
                        .map_err(io_ctx("deleting the volume"))?
                    {
                        return Err(self.failed(pkg, "deleting the volume", e));
                    }
                    tracing::info!(package = %pkg, "volume deleted");
                    return Ok(DeleteOutcome {
                        deleted: true,
                        held: None,
                    });
                }
                Err(e) => return Err(io_ctx("moving the volume aside")(e)),
            }
            deleted = true;
        }
        let (finished, held) = self.finish_delete(pkg, names)?;
        deleted |= finished;
        if deleted {
            tracing::info!(package = %pkg, "volume deleted");
        }
        Ok(DeleteOutcome { deleted, held })
    }

    /// The rest of a delete once `<pkg>` is `<pkg>.delete` (or gone): the
    /// backup, the package's other names, then `.delete` itself, kept under
    /// `<pkg>.held` instead if a mount holds it. Returns whether anything
    /// was there, and the tree kept.
    pub(super) fn finish_delete(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<(bool, Option<HeldTree>), Error> {
        let dropped = self.drop_locked(pkg, names)?;
        let io_ctx = |e: io::Error| self.failed(pkg, "deleting the volume", e);
        failpoint("delete.backup-dropped").map_err(io_ctx)?;
        // Every other name of the package goes with it: what an interrupted
        // restore of upstream's kept for the operator, a conversion's old
        // trees kept with `--keep-old` or left by a crash, upstream's
        // marker of a fresh install.
        let mut removed = false;
        for (name, kind) in self.leftovers(pkg, names)? {
            match kind {
                Leftover::Tree => self.delete_entry(name),
                Leftover::Record => record::remove(self.root_fd(), name),
            }
            .map_err(io_ctx)?;
            removed = true;
        }
        if removed {
            self.fsync_root().map_err(io_ctx)?;
        }
        self.mark_fresh_locked(pkg, &names.fresh, false)?;
        let last = self.discard_tree(pkg, names, &names.delete)?;
        let pending = last.is_some();
        Ok((dropped || removed || pending, last.and_then(Disposal::held)))
    }
}

/// Removes the entry `name` of the directory open as `dir` and everything
/// below it, whatever it is: a subvolume tree in O(1) per subvolume
/// (read-only ones made writable first), a plain directory entry by entry
/// (nested subvolumes whole, immutable and append-only flags cleared), a
/// file or special file by unlink; absent is fine. Never follows a symlink.
/// Not atomic for a tree of several subvolumes or a plain directory: a
/// crash leaves part of it.
pub fn delete_tree_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match sys::stat_at(dir, name)? {
        None => Ok(()),
        Some(st) if st.is_dir() => {
            let fd = sys::open_dir_at(dir, name)?;
            if sys::mount_id(fd.as_fd())? != sys::mount_id(dir)? {
                return Err(crate::walk::crosses_mount(PathBuf::from(name)));
            }
            if sys::is_subvolume(fd.as_fd())? && sys::stat(dir)?.dev != st.dev {
                sys::make_tree_writable(fd.as_fd())?;
                drop(fd);
                failpoint("delete-entry.writable")?;
                sys::delete_subvolume(dir, name, true)
            } else {
                drop(fd);
                // Never follows a symlink; deletes nested subvolumes whole
                // (a package may have made one read-only) and clears
                // immutable and append-only flags (which a reflink copy
                // keeps): anything less would leave a transient name, and
                // every later recovery of the package, stuck.
                crate::copy::remove_tree_at(dir, name, &mut |_| Ok(()))
            }
        }
        Some(_) => sys::unlink_if_exists(dir, name),
    }
}

/// Deletes whatever is at `path`, as upstream's `util::btrfs::delete_tree`
/// (which its uninstall cleanup calls on a package's volume root):
/// [`delete_tree_in`] with the volumes root of a StartOS server
/// ([`crate::default_root`]).
pub fn delete_tree(path: &Path) -> Result<(), Error> {
    delete_tree_in(&crate::default_root(), path)
}

/// Deletes whatever is at `path`, as upstream's `util::btrfs::delete_tree`:
/// its parent is resolved as given (a trusted path), its last component
/// never followed; absent is fine.
///
/// A package's volume, a direct child of `volumes_root` named as a package
/// (the one place upstream calls it, a hard uninstall), goes with every
/// other name of the package, its backup included
/// ([`VolumeStore::delete`]): renamed aside first, so a crash leaves the
/// whole package or a delete that recovery finishes. Anything else, the
/// same name elsewhere included, is no volume: deleted in place
/// ([`delete_tree_at`]: subvolumes in O(1), no symlink followed, no mount
/// crossed), with no package lock and nothing done to its siblings.
pub fn delete_tree_in(volumes_root: &Path, path: &Path) -> Result<(), Error> {
    delete_tree_with(volumes_root, path, false)
}

/// [`delete_tree_in`], but a package's volume is left in the trash for the
/// caller to delete ([`VolumeStore::with_deferred_purge`]): returns once it
/// is off the package's names, durably, in milliseconds, and the caller
/// empties the trash of `volumes_root` ([`crate::purge::in_background`]).
pub fn delete_tree_in_deferring_purge(volumes_root: &Path, path: &Path) -> Result<(), Error> {
    delete_tree_with(volumes_root, path, true)
}

fn delete_tree_with(volumes_root: &Path, path: &Path, deferred: bool) -> Result<(), Error> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(Error::new(
            eyre!("cannot delete {}: no parent directory", path.display()),
            ErrorKind::InvalidRequest,
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let dir = match sys::open_dir_path(parent) {
        Ok(dir) => dir,
        // No parent, nothing at `path` (a package's volume on a box that
        // has no volumes root yet): absent, as upstream's.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(e).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    format!("opening {}", parent.display()),
                )
            });
        }
    };
    if let Some(pkg) = volume_of(volumes_root, dir.as_fd(), name)? {
        let store = VolumeStore::open_without_recovery(volumes_root)?;
        let store = match deferred {
            true => store.with_deferred_purge(),
            false => store,
        };
        return store.delete(&pkg).map(drop);
    }
    delete_tree_at(dir.as_fd(), name).with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            format!("deleting {}", path.display()),
        )
    })
}

/// The package whose volume the entry `name` of the directory open as
/// `dir` is: `None` unless `dir` is `volumes_root` itself (the same inode,
/// however either path is spelt) and `name` a package id. A volumes root
/// that does not exist has no volume.
fn volume_of(
    volumes_root: &Path,
    dir: BorrowedFd<'_>,
    name: &OsStr,
) -> Result<Option<PackageId>, Error> {
    let pkg = name.to_str().and_then(|n| n.parse::<PackageId>().ok());
    let Some(pkg) = pkg.filter(|p| layout::check_id_len(p).is_ok()) else {
        return Ok(None);
    };
    let ctx = |_: &io::Error| {
        (
            ErrorKind::Filesystem,
            format!("looking at the volumes root {}", volumes_root.display()),
        )
    };
    let root = match sys::open_dir_path(volumes_root) {
        Ok(fd) => fd,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
            return Ok(None);
        }
        Err(e) => return Err(e).with_ctx(ctx),
    };
    let (root, dir) = (
        sys::stat(root.as_fd()).with_ctx(ctx)?,
        sys::stat(dir).with_ctx(ctx)?,
    );
    Ok((root.dev == dir.dev && root.ino == dir.ino).then_some(pkg))
}
