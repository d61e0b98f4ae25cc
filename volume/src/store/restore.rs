//! Rolling a volume back to its install backup ([`VolumeStore::restore`]):
//! the rollback copy, the record of its identity, the one
//! `RENAME_EXCHANGE` that is the commit point, and the cleanup after it.
//!
//! Before the exchange a failure is undone; after it, finished, here or by
//! recovery ([`VolumeStore::recover`]), which tells the two apart from the
//! record and the identities of the trees alone (the *restore* states of
//! the [store's docs](super)). A mount of the volume never stops a restore:
//! the replaced volume, which such a mount goes on showing, is kept under
//! `<pkg>.held` while any mount holds it ([`super::held`]).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt};

use super::held::Disposal;
use super::{VolumeStore, nested_counterparts, with_cleanup};
use crate::failpoint::failpoint;
use crate::layout::Names;
use crate::outcome::{DeleteOutcome, RestoreOutcome, VolumeKind};
use crate::quota::{self, QuotaCarry};
use crate::record::{self, Identity};
use crate::sys;

/// What [`VolumeStore::restore_step`] did.
enum Restored {
    /// Nothing: there was no backup.
    No,
    /// The backup is the volume, the cleanup after the exchange done.
    Yes,
    /// The backup is the volume; the cleanup after the exchange failed
    /// with this, and is left to recovery.
    Unfinished(Error),
}

impl VolumeStore {
    /// Rolls `<pkg>` back to its install backup, atomically, and removes the
    /// backup. Returns `false` (and changes nothing) if there is no backup.
    ///
    /// The package is restored, durably, in milliseconds whatever the
    /// volumes hold: the replaced volume is moved to the trash under the
    /// package's lock and deleted after it is released ([`TRASH_DIR`](crate::layout::TRASH_DIR)),
    /// before this returns, or by the caller with
    /// [`VolumeStore::with_deferred_purge`].
    ///
    /// A writable snapshot of the backup is made under `<pkg>.rollback`
    /// (read-only nested subvolumes made read-only again), its identity is
    /// recorded once it is complete and committed, and one renameat2
    /// RENAME_EXCHANGE swaps it with `<pkg>`; the replaced volume is then
    /// deleted. So `<pkg>` is never missing: before the exchange it is the
    /// current volume, after it the restored one, whatever instant a crash
    /// or power cut hits. Nothing is written inside either volume.
    ///
    /// With quotas on, the copy is created in the volume's qgroup groups
    /// and given its limit before the commit that precedes the exchange
    /// ([`crate::quota`]): the volume under its name always has its limit.
    ///
    /// A mount of the volume, in any mount namespace (a dependent's bind
    /// mount of its `data_dir`), never makes it fail: such a mount goes on
    /// showing the replaced volume, which is then kept under
    /// `<pkg>.held/<n>` instead of deleted, until no mount holds it, with a
    /// warning naming the holders (see [`VolumeStore::restore_outcome`]
    /// for them as data). A failure before the exchange removes the copy
    /// and the record: the disk is as before the call.
    ///
    /// A failure past the exchange, in the cleanup after it, is an error
    /// here, as every other failure: the call did not do all it was asked.
    /// The volume is the restored one all the same, and the next operation
    /// of the package finishes the cleanup (see
    /// [`VolumeStore::restore_outcome`], which returns it as data).
    pub fn restore(&self, pkg: &PackageId) -> Result<bool, Error> {
        let outcome = self.restore_outcome(pkg)?;
        match outcome.unfinished {
            Some(why) => Err(Error::new(eyre!(why), ErrorKind::DiskManagement)),
            None => Ok(outcome.restored),
        }
    }

    /// [`VolumeStore::restore`], with the replaced volume if a mount held
    /// it (kept, and who holds it: the processes to restart so that they
    /// see the restored volume), and, where the exchange committed but the
    /// cleanup after it failed, that failure ([`RestoreOutcome::unfinished`])
    /// instead of an error: the rollback is done, which a caller rolling an
    /// update back must not take for a failed one.
    pub fn restore_outcome(&self, pkg: &PackageId) -> Result<RestoreOutcome, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(RestoreOutcome {
                restored: false,
                held: None,
                unfinished: None,
            });
        };
        let outcome = {
            let guard = self.hold_recovered(pkg, names)?;
            let (restored, mut unfinished) = match self.restore_step(pkg, &guard.names)? {
                Restored::No => (false, None),
                Restored::Yes => (true, None),
                Restored::Unfinished(e) => (true, Some(e)),
            };
            // Past a restore, the replaced volume's removal is part of the
            // cleanup: a failure there is the restore's unfinished part.
            let held = match self.purge_locked(pkg, &guard.names) {
                Ok(done) => done.and_then(Disposal::held),
                Err(e) if restored => {
                    unfinished.get_or_insert(e);
                    None
                }
                Err(e) => return Err(e),
            };
            RestoreOutcome {
                restored,
                held,
                unfinished: unfinished.map(|e| format!("{:#}", e.source)),
            }
        };
        // The replaced volume is in the trash: deleted off the lock. Not
        // after a failure: as after an error, the next operation does it.
        if outcome.unfinished.is_none() {
            self.purge_after();
        }
        Ok(outcome)
    }

    /// [`VolumeStore::restore`] without deleting the replaced volume, which
    /// is left under `<pkg>.replaced` for [`VolumeStore::purge`].
    ///
    /// Deleting a subvolume evicts its cached pages first (about 0.13 s per
    /// cached GiB here), so for a database the service had in memory the
    /// delete can take seconds: a caller restarting the old service should
    /// do that first and purge afterwards. The restore itself is complete
    /// when this returns; `<pkg>.replaced` is garbage that any later
    /// operation's recovery, or `purge`, deletes, and so is the backup it
    /// consumed, left in the trash for the next emptying (`purge`'s).
    pub fn restore_deferring_purge(&self, pkg: &PackageId) -> Result<bool, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(false);
        };
        let held = self.hold_recovered(pkg, names)?;
        self.restore_locked(pkg, &held.names)
    }

    /// Deletes the volume a restore replaced (`<pkg>.replaced`), if any:
    /// moved to the trash under the package's lock, then deleted (O(1) per
    /// subvolume plus the eviction of its cached inodes and pages) after
    /// the lock is released. One a
    /// mount still holds is kept under `<pkg>.held` instead (see
    /// [`VolumeStore::restore`]). Returns whether there was one.
    pub fn purge(&self, pkg: &PackageId) -> Result<bool, Error> {
        self.purge_outcome(pkg).map(|o| o.deleted)
    }

    /// [`VolumeStore::purge`], with the replaced volume if a mount held it.
    pub fn purge_outcome(&self, pkg: &PackageId) -> Result<DeleteOutcome, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(DeleteOutcome {
                deleted: false,
                held: None,
            });
        };
        let done = {
            let guard = self.hold(pkg, names)?;
            self.purge_locked(pkg, &guard.names)?
        };
        self.purge_after();
        Ok(DeleteOutcome {
            deleted: done.is_some(),
            held: done.and_then(Disposal::held),
        })
    }

    /// Deletes `<pkg>.replaced`, or keeps it under `<pkg>.held` while a
    /// mount holds it; `None` if there was none.
    pub(super) fn purge_locked(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<Option<Disposal>, Error> {
        let done = self.discard_tree(pkg, names, &names.replaced)?;
        if done.is_some() {
            failpoint("restore.replaced-deleted").with_ctx(|_| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context("deleting the volume a restore replaced"),
                )
            })?;
        }
        Ok(done)
    }

    /// [`VolumeStore::restore_step`], a failure past the exchange an
    /// error: for the operations that restore on the way to something else.
    pub(super) fn restore_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        match self.restore_step(pkg, names)? {
            Restored::No => Ok(false),
            Restored::Yes => Ok(true),
            Restored::Unfinished(e) => Err(e),
        }
    }

    /// The restore under the lock: `No` without a backup; an error before
    /// the exchange (undone: the disk as before); past it, `Yes`, or
    /// `Unfinished` with what failed in the cleanup that recovery finishes.
    fn restore_step(&self, pkg: &PackageId, names: &Names) -> Result<Restored, Error> {
        // Refuses a non-directory under the package's name first.
        self.tree(pkg, &names.live)?;
        let Some(backup_kind) = self.tree(pkg, &names.backup)? else {
            return Ok(Restored::No);
        };
        let prepared = match backup_kind {
            VolumeKind::Subvolume => self.prepare_rollback_copy(names),
            VolumeKind::Directory => self.prepare_rollback_in_place(names),
        };
        let exchanged = prepared.and_then(|()| {
            failpoint("restore.recorded").map_err(|e| ("exchanging the volume with", e))?;
            self.swap_in_rollback(names)
        });
        if let Err((what, e)) = exchanged {
            let cleanup = self.undo_rollback(names, backup_kind);
            let e = self.failed(
                pkg,
                format!(
                    "{what} {}",
                    self.root.path().join(&names.rollback).display()
                ),
                e,
            );
            return Err(with_cleanup(e, cleanup, "undoing the restore"));
        }
        // The exchange is the commit point once committed: from there on,
        // a failure is finished by recovery, never undone. A mount of the
        // volume now shows the replaced one, which the purge keeps while it
        // does. A failed commit is an error, never a rollback done: a crash
        // before the next commit loses the exchange, and recovery then
        // undoes the restore (the live volume is not the one recorded).
        self.commit_root()
            .map_err(|e| self.failed(pkg, "committing the exchange", e))?;
        let finished = failpoint("restore.exchanged")
            .map_err(|e| self.failed(pkg, "committing the exchange", e))
            .and_then(|()| self.finish_restore(pkg, names));
        if let Err(e) = finished {
            if !self.is_restored(names) {
                return Err(e);
            }
            let kind = e.kind;
            return Ok(Restored::Unfinished(Error::new(
                e.source.wrap_err(format!(
                    "the volume {} was restored, but cleaning up after it failed; the next \
                     operation finishes it",
                    self.volume_path(pkg).display()
                )),
                kind,
            )));
        }
        tracing::info!(package = %pkg, "volume restored from install backup");
        Ok(Restored::Yes)
    }

    /// Makes the rollback copy of a snapshot backup: a writable snapshot,
    /// nested subvolumes included and the read-only ones made read-only
    /// again, with quotas on the volume's qgroup limit and groups
    /// ([`QuotaCarry`]), then its identity recorded and everything
    /// committed.
    fn prepare_rollback_copy(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let backup = sys::open_dir_at(self.root_fd(), &names.backup)
            .map_err(|e| ("opening the backup for", e))?;
        let carry = quota::or_warn(
            format_args!("restoring {}", self.root.path().join(&names.live).display()),
            self.volume_quota(names, backup.as_fd()),
        );
        let inherit = QuotaCarry::inherit_of(carry.as_ref());
        let copy = sys::snapshot_tree_with(
            backup.as_fd(),
            self.root_fd(),
            &names.rollback,
            inherit.as_ref(),
        )
        .map_err(|e| ("snapshotting the backup to", e))?;
        failpoint("restore.copied").map_err(|e| ("snapshotting the backup to", e))?;
        self.restore_read_only_flags(names, backup.as_fd(), copy.as_fd())
            .map_err(|e| ("making read-only again the nested subvolumes of", e))?;
        // Before the commit below, so no committed state shows the volume
        // under its name without its limit.
        if let Some(Err(e)) = carry.as_ref().map(|c| c.apply(copy.as_fd())) {
            tracing::warn!(
                "restoring {}: qgroup limit and groups not carried: {e}",
                self.root.path().join(&names.live).display()
            );
        }
        self.record_rollback(names, copy.as_fd())
    }

    /// What the rollback copy carries of the volume's qgroup: the live
    /// volume's limit and groups (an administrator's change since the
    /// backup stays), or the backup's if the live volume is no subvolume.
    /// `None`, after the one check, when quotas are off.
    fn volume_quota(
        &self,
        names: &Names,
        backup: BorrowedFd<'_>,
    ) -> io::Result<Option<QuotaCarry>> {
        let Some(status) = QuotaCarry::check(self.root_fd())? else {
            return Ok(None);
        };
        let live = match sys::open_dir_at(self.root_fd(), &names.live) {
            Ok(fd) if sys::is_subvolume(fd.as_fd())? => Some(fd),
            Ok(_) => None,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
            Err(e) => return Err(e),
        };
        match &live {
            Some(fd) => QuotaCarry::of(status, fd.as_fd()),
            None => QuotaCarry::of(status, backup),
        }
    }

    /// A reflink backup is already a private copy, used as is: its identity
    /// recorded, then renamed to `<pkg>.rollback`.
    fn prepare_rollback_in_place(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let backup = sys::open_dir_at(self.root_fd(), &names.backup)
            .map_err(|e| ("opening the backup for", e))?;
        self.record_rollback(names, backup.as_fd())?;
        failpoint("restore.copied")
            .and_then(|()| sys::rename_noreplace(self.root_fd(), &names.backup, &names.rollback))
            .and_then(|()| self.fsync_root())
            .map_err(|e| ("moving the backup to", e))
    }

    /// Records the identity of the complete rollback copy open as `copy`
    /// and commits (off btrfs, where only a plain directory is ever used
    /// in place, syncs the root), so the copy, its flags and times, and the
    /// record are durable together before anything is exchanged.
    fn record_rollback(
        &self,
        names: &Names,
        copy: BorrowedFd<'_>,
    ) -> Result<(), (&'static str, io::Error)> {
        let id = Identity::of(copy).map_err(|e| ("reading the identity of", e))?;
        record::write(self.root_fd(), &names.rollback_id, &id.encode())
            .map_err(|e| ("recording the identity of", e))?;
        if self.root.is_btrfs() {
            sys::commit_metadata(self.root_fd())
        } else {
            self.fsync_root()
        }
        .map_err(|e| ("committing", e))
    }

    /// Sets the read-only flag, in the rollback copy open as `copy`, on each
    /// nested subvolume whose counterpart in the backup open as `backup` is
    /// listed in the backup's read-only record.
    fn restore_read_only_flags(
        &self,
        names: &Names,
        backup: BorrowedFd<'_>,
        copy: BorrowedFd<'_>,
    ) -> io::Result<()> {
        let Some(ids) = record::read_set(self.root_fd(), &names.backup_ro)? else {
            return Ok(());
        };
        for (n, counterpart) in nested_counterparts(backup, copy)? {
            if ids.contains(&n.id) {
                sys::set_read_only(sys::open_subvolume(copy, counterpart)?.as_fd(), true)?;
            }
        }
        Ok(())
    }

    /// Whether `<pkg>` is the volume a restore put in, after its exchange:
    /// the rollback record names it, or the record is gone and so is the
    /// backup (the restore finished; undone, the backup would be there). A
    /// failure to read counts as not restored: the message then claims
    /// nothing.
    fn is_restored(&self, names: &Names) -> bool {
        match record::read(self.root_fd(), &names.rollback_id) {
            Ok(Some(text)) => {
                Identity::decode(&text).is_some()
                    && Identity::of_entry(self.root_fd(), &names.live)
                        .ok()
                        .flatten()
                        == Identity::decode(&text)
            }
            Ok(None) => self.exists_at(&names.backup).is_ok_and(|b| !b),
            Err(_) => false,
        }
    }

    /// Puts back what a failed restore made before its exchange: the record
    /// goes, a snapshot copy is deleted, a reflink backup gets its name back.
    ///
    /// The order keeps every instant recoverable: a snapshot copy loses its
    /// record first (without one it is garbage to recovery; with one, half
    /// deleted, it would be swapped in), a reflink backup gets its name back
    /// first (without a record, a plain `.rollback` beside no backup is
    /// refused, never deleted).
    pub(super) fn undo_rollback(&self, names: &Names, backup_kind: VolumeKind) -> io::Result<()> {
        // Only what the restore made is undone: one refused before it made
        // anything (a read-only filesystem refuses even the removal of a
        // name that is not there) has nothing to undo, and says only why
        // it was refused.
        let record = self.exists_at(&names.rollback_id)?;
        let copy = self.exists_at(&names.rollback)?;
        match backup_kind {
            VolumeKind::Subvolume => {
                if record {
                    record::remove(self.root_fd(), &names.rollback_id)?;
                    self.fsync_root()?;
                }
                if copy {
                    self.delete_entry(&names.rollback)?;
                }
            }
            VolumeKind::Directory => {
                if copy && !self.exists_at(&names.backup)? {
                    sys::rename_noreplace(self.root_fd(), &names.rollback, &names.backup)?;
                    self.fsync_root()?;
                }
                if record {
                    record::remove(self.root_fd(), &names.rollback_id)?;
                }
            }
        }
        if record || copy {
            self.fsync_root()?;
        }
        Ok(())
    }

    /// The one step that changes what `<pkg>` is: exchange it with the
    /// complete rollback copy (or just rename the copy in if `<pkg>` is gone).
    fn swap_in_rollback(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let live = self
            .exists_at(&names.live)
            .map_err(|e| ("looking for the volume to exchange with", e))?;
        if live {
            sys::rename_exchange(self.root_fd(), &names.rollback, &names.live)
        } else {
            sys::rename_noreplace(self.root_fd(), &names.rollback, &names.live)
        }
        .map_err(|e| ("exchanging the volume with", e))
    }

    /// After the exchange: move the replaced volume (now `<pkg>.rollback`)
    /// aside to `<pkg>.replaced`, drop the backup, then remove the rollback
    /// record. Each step is idempotent, and the record goes last so recovery
    /// can redo the rest. Nothing here deletes the replaced volume, mounted
    /// or not: the purge after it does, or keeps it while a mount holds it.
    pub(super) fn finish_restore(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        let io_ctx = |_: &io::Error| {
            (
                ErrorKind::DiskManagement,
                pkg.context("moving the replaced volume aside"),
            )
        };
        if self.exists_at(&names.rollback).with_ctx(io_ctx)? {
            // Garbage from an earlier restore nobody purged (kept, if a
            // mount still holds it).
            self.discard_tree(pkg, names, &names.replaced)?;
            sys::rename_noreplace(self.root_fd(), &names.rollback, &names.replaced)
                .and_then(|()| self.commit_root())
                .with_ctx(io_ctx)?;
        }
        failpoint("restore.replaced-moved").with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context("moving the replaced volume aside"),
            )
        })?;
        self.drop_locked(pkg, names)?;
        failpoint("restore.backup-dropped")
            .and_then(|()| record::remove(self.root_fd(), &names.rollback_id))
            .and_then(|()| self.fsync_root())
            .with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("removing the rollback record"),
                )
            })
    }
}

/// How a rollback copy with the recorded identity `id` was made: a
/// subvolume is a snapshot of the backup (which stays until the restore is
/// done), a plain directory the reflink backup itself, moved to
/// `<pkg>.rollback`.
pub(super) fn copy_kind(id: &Identity) -> VolumeKind {
    match id {
        Identity::Subvolume(_) => VolumeKind::Subvolume,
        Identity::Directory { .. } => VolumeKind::Directory,
    }
}
