//! Recovery: finishing or undoing whatever a crash interrupted, for one
//! package or all of them, from the names and records in the root alone
//! (the states are listed in the [store's docs](super)).
//!
//! What upstream's own code left is resolved first ([`upstream`]): it is
//! older than anything of ours.

use std::ffi::OsStr;
use std::io;
use std::os::fd::AsFd;

use models::{Error, ErrorKind, PackageId, ResultExt};

use super::held::Disposal;
use super::restore::copy_kind;
use super::{Entry, VolumeStore};
use crate::layout::Names;
use crate::lock::PackageLock;
use crate::outcome::{Recovery, VolumeKind};
use crate::record::{self, Identity};
use crate::sys;

mod upstream;

/// How many packages [`VolumeStore::recover_all`] recovers at once, each
/// on a thread of its own ([`crate::at_once`]). With nothing pending, a package's recovery
/// is a lock taken and a dozen lookups, each a synchronous read at boot
/// when the cache is cold: one after another, 150 packages took 23-35 ms
/// of the boot before any conversion could start (the boxes bench's
/// dominant package waits for it), eight at once 16-20 ms (the loop
/// device's reads bound it more than threads do). A package whose lock
/// another holds waits its patience on one thread while the others go on
/// (`integration/tests/recover_all.rs`).
const RECOVER_AT_ONCE: usize = 8;

/// What kind of entry a leftover name of a package is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leftover {
    /// A tree: deleted whole.
    Tree,
    /// A record (a symlink): unlinked.
    Record,
}

impl VolumeStore {
    /// Finishes or undoes whatever a crash interrupted for `pkg`, from the
    /// names and records on disk alone. Idempotent; a no-op costing a few
    /// `fstatat`s when nothing is pending.
    pub fn recover(&self, pkg: &PackageId) -> Result<Recovery, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(Recovery {
                package: pkg.clone(),
                actions: Vec::new(),
                error: None,
                busy: false,
            });
        };
        // A file, symlink or FIFO under the package's name is no volume of
        // ours: refused, as by every other command on the package.
        self.tree(pkg, &names.live)?;
        let recovery = {
            let held = self.hold_for_read(pkg, names)?;
            self.recover_locked(pkg, &held.names)?
        };
        self.purge_after();
        Ok(recovery)
    }

    /// [`VolumeStore::recover`] for a caller that already holds the
    /// package's lock (taking it again here would wait on itself):
    /// volume-migrate, which must not convert a volume a restore is still
    /// exchanging.
    pub fn recover_held(&self, pkg: &PackageId, _lock: &PackageLock) -> Result<Recovery, Error> {
        let names = Names::new(pkg)?;
        self.recover_locked(pkg, &names)
    }

    /// [`VolumeStore::recover`] for every package with anything under the
    /// root, eight at a time, then the trash emptied (unless the caller
    /// does: [`VolumeStore::with_deferred_purge`]). Returns the packages'
    /// recoveries that did something or failed, in the order of the
    /// packages' names.
    ///
    /// One package's failure does not stop the others: it is logged and
    /// returned as a [`Recovery`] with its `error` set, and that package's
    /// own operations keep failing (each recovers first) until it is fixed.
    /// Each package is recovered under its own lock, as by
    /// [`VolumeStore::recover`], so doing several at once changes nothing
    /// a crash leaves: each package is in one of its own states.
    pub fn recover_all(&self) -> Result<Vec<Recovery>, Error> {
        let packages = self.packages()?;
        let recovered = crate::at_once::at_once(
            &packages,
            RECOVER_AT_ONCE,
            "volume-recover",
            &|pkg: &PackageId, _: &mut dyn FnMut(())| self.recover_listed(pkg),
            &mut |()| {},
        );
        // What a crash left in the trash with no package name beside it
        // (each package's recovery above empties it too).
        self.purge_after();
        Ok(recovered.into_iter().flatten().collect())
    }

    /// One package of [`VolumeStore::recover_all`]'s list: its recovery if
    /// it did something or failed (logged).
    fn recover_listed(&self, pkg: &PackageId) -> Option<Recovery> {
        // Not a volume, whatever its name (`list` says so): nothing to
        // recover, and no reason to stop the others.
        if matches!(self.entry(OsStr::new(pkg.as_str())), Ok(Entry::Other(_))) {
            return None;
        }
        match self.recover(pkg) {
            Ok(r) if r.actions.is_empty() => None,
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!(package = %pkg, "recovery failed: {e}");
                Some(Recovery {
                    package: pkg.clone(),
                    actions: Vec::new(),
                    error: Some(e.to_string()),
                    busy: e.kind == ErrorKind::Timeout,
                })
            }
        }
    }

    /// Whether anything under `pkg`'s names may need [`VolumeStore::recover`]
    /// or belong to an operation in flight, read without the lock: `false`
    /// only when none of the names [`VolumeStore::recover_locked`] acts on
    /// exists (nor a conversion's `.migrate`, `.migrate-parent`), the
    /// backup's read-only record has its backup, and a backup is read-only.
    /// Keep in step with `recover_locked`: a name it acts on that this
    /// misses would let an `ensure` skip recovery.
    ///
    /// The garbage the cleanup after a conversion removes while services
    /// run (`.migrate-old`, the rest a `.migrate-rest` record names) is no
    /// pending work: with a volume present, recovery leaves both to the
    /// cleanup. Nor are the trees kept while a mount holds them
    /// (`.held`, reclaimed by the next operation that holds the package),
    /// what is kept for the operator (`.restore-conflict`), or upstream's
    /// install state (`.install-fresh`).
    ///
    /// Each name is read at a different instant, so this is no snapshot of
    /// the package; it is only used where that does not matter (see
    /// [`VolumeStore::ensure`]).
    pub(super) fn may_need_recovery(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx = |_: &io::Error| {
            (
                ErrorKind::Filesystem,
                pkg.context("looking for an interrupted operation"),
            )
        };
        for name in [
            &names.create,
            &names.backup_tmp,
            &names.backup_drop,
            &names.rollback,
            &names.rollback_id,
            &names.replaced,
            &names.delete,
            &names.upstream_backup_tmp,
            &names.restore_old,
            &names.convert_tmp,
            &names.convert_old,
            &names.migrate,
            &names.migrate_parent,
        ] {
            if self.exists_at(name).with_ctx(io_ctx)? {
                return Ok(true);
            }
        }
        match self.entry(&names.backup).with_ctx(io_ctx)? {
            Entry::Absent => self.exists_at(&names.backup_ro).with_ctx(io_ctx),
            Entry::Tree(VolumeKind::Subvolume) => {
                let backup = match sys::open_dir_at(self.root_fd(), &names.backup) {
                    // Moved since the look (a drop, lock-free here): the
                    // lock and recovery decide.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
                    backup => backup.with_ctx(io_ctx)?,
                };
                Ok(!sys::is_read_only(backup.as_fd()).with_ctx(io_ctx)?)
            }
            Entry::Tree(VolumeKind::Directory) => Ok(false),
            Entry::Other(_) => Ok(true),
        }
    }

    pub(super) fn recover_locked(&self, pkg: &PackageId, names: &Names) -> Result<Recovery, Error> {
        let mut actions = Vec::new();
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        // What upstream's own code left comes first: it is older than
        // anything of ours.
        self.recover_upstream(pkg, names, &mut actions)?;
        // A new volume that never got its name is incomplete: discard it.
        if self.tree(pkg, &names.create)?.is_some() {
            self.delete_entry(&names.create)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting an incomplete new volume"))?;
            actions.push("deleted an incomplete new volume".to_owned());
        }
        // A backup that never got its real name is incomplete: discard it.
        if self.tree(pkg, &names.backup_tmp)?.is_some() {
            self.delete_entry(&names.backup_tmp)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting a partial backup"))?;
            actions.push("deleted an incomplete install backup".to_owned());
        }
        if let Some(action) = self.recover_restore(pkg, names)? {
            actions.push(action.to_owned());
        }
        // A drop renamed the backup to `.drop` and died before moving it
        // into the trash (it may be writable by then).
        if self.tree(pkg, &names.backup_drop)?.is_some() {
            self.trash_garbage(pkg, self.root_fd(), &names.backup_drop)
                .with_ctx(io_ctx("moving a dropped backup to the trash"))?;
            actions.push("finished dropping the install backup".to_owned());
        }
        if self.tree(pkg, &names.backup)?.is_none() && self.tree(pkg, &names.backup_ro)?.is_some() {
            self.delete_entry(&names.backup_ro)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("removing the read-only record of a dropped backup"))?;
            actions.push("removed the read-only record of a dropped backup".to_owned());
        }
        match self.purge_locked(pkg, names)? {
            Some(Disposal::Deleted) => {
                actions.push("deleted the volume a restore replaced".to_owned())
            }
            Some(Disposal::Held(h)) => actions.push(format!(
                "kept the volume a restore replaced as {}, still mounted",
                h.path.display()
            )),
            None => {}
        }
        if self.tree(pkg, &names.delete)?.is_some() {
            let (_, held) = self.finish_delete(pkg, names)?;
            actions.push(match held {
                None => "finished deleting the volume and its backup".to_owned(),
                Some(h) => format!(
                    "finished deleting the volume and its backup; the volume, still mounted, \
                     is kept as {}",
                    h.path.display()
                ),
            });
        }
        // Trees kept while mounted go once nothing holds them; never an
        // error of the package's while one is still mounted.
        self.reclaim_held(pkg, names, &mut actions)?;
        // A conversion's replaced directory only ever holds data the
        // converted volume holds too: with no volume left (an uninstall of
        // an earlier version kept it), it is garbage.
        if self.tree(pkg, &names.live)?.is_none() && self.tree(pkg, &names.migrate_old)?.is_some() {
            self.delete_entry(&names.migrate_old)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting the old directory of a conversion"))?;
            actions
                .push("deleted the old directory of a conversion whose volume is gone".to_owned());
        }
        for a in &actions {
            tracing::warn!(package = %pkg, "recovery: {a}");
        }
        Ok(Recovery {
            package: pkg.clone(),
            actions,
            error: None,
            busy: false,
        })
    }

    /// Finishes or undoes an interrupted restore, from the rollback record
    /// and the identities of the trees; returns what it did, if anything.
    fn recover_restore(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<Option<&'static str>, Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let text = record::read(self.root_fd(), &names.rollback_id)
            .with_ctx(io_ctx("reading the rollback record"))?;
        let Some(text) = text else {
            // No record: the copy was never complete, so the exchange never
            // happened. The backup stays.
            if self.tree(pkg, &names.rollback)?.is_none() {
                return Ok(None);
            }
            if self.tree(pkg, &names.backup)?.is_none() {
                // Never this crate's own state (a copy is made from a
                // backup that stays until the record is gone); an earlier
                // version's reflink restore moved its backup here, and this
                // may be the only copy of it. Never deleted.
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::Incoherent,
                    format!(
                        "{} has no rollback record and there is no backup: it may be the only \
                         copy of the data an interrupted restore was putting back; keep whichever \
                         of it and {} holds the data to keep as {}, move the other away",
                        self.root.path().join(&names.rollback).display(),
                        self.volume_path(pkg).display(),
                        self.volume_path(pkg).display()
                    ),
                ));
            }
            self.delete_entry(&names.rollback)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting an incomplete rollback copy"))?;
            return Ok(Some(
                "undid an interrupted restore (incomplete copy deleted, backup kept)",
            ));
        };
        let recorded = Identity::decode(&text).ok_or_else(|| {
            Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "unreadable rollback record {} ({text:?}); check which of {} and {} is \
                     the right volume, then remove the record",
                    self.root.path().join(&names.rollback_id).display(),
                    self.volume_path(pkg).display(),
                    self.root.path().join(&names.rollback).display()
                ),
            )
        })?;
        let identity = |name: &OsStr| {
            Identity::of_entry(self.root_fd(), name)
                .with_ctx(io_ctx("reading the identity of a tree"))
        };
        if identity(&names.live)? == Some(recorded) {
            self.finish_restore(pkg, names)?;
            return Ok(Some("finished an interrupted restore"));
        }
        if identity(&names.rollback)? == Some(recorded) {
            // The exchange never happened: `<pkg>` is still the volume the
            // restore would have replaced, and may hold what was written
            // since (a restore that failed returned its error, and the
            // service went on). Only the restore itself exchanges; here it
            // is undone, the backup kept for a restore to come.
            self.undo_rollback(names, copy_kind(&recorded))
                .with_ctx(io_ctx("undoing an interrupted restore"))?;
            return Ok(Some(
                "undid an interrupted restore (it never exchanged; the volume and its backup \
                 are as they were)",
            ));
        }
        if identity(&names.backup)? == Some(recorded) && self.tree(pkg, &names.rollback)?.is_none()
        {
            // A reflink backup recorded but not yet moved: nothing changed.
            record::remove(self.root_fd(), &names.rollback_id)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("removing the rollback record"))?;
            return Ok(Some("undid an interrupted restore (backup kept)"));
        }
        Err(Error::for_package(
            pkg,
            ErrorKind::Incoherent,
            format!(
                "the rollback record {} names a tree that is none of {}, {} and {}, so which \
                 holds the data to keep cannot be told: keep that one as the volume, move the \
                 others away, then remove the record",
                self.root.path().join(&names.rollback_id).display(),
                self.volume_path(pkg).display(),
                self.root.path().join(&names.rollback).display(),
                self.backup_path(pkg).display()
            ),
        ))
    }

    /// The names of `pkg` an uninstall removes beside its volume, backup and
    /// `<pkg>.delete` (which the delete itself takes care of), each with its
    /// kind; an error naming the first one that is not of its kind (a file
    /// under a tree's name, say: no state of ours, left alone).
    pub(super) fn leftovers<'n>(
        &self,
        pkg: &PackageId,
        names: &'n Names,
    ) -> Result<Vec<(&'n OsStr, Leftover)>, Error> {
        let mut out = Vec::new();
        for name in [
            &names.restore_conflict,
            &names.migrate,
            &names.migrate_parent,
            &names.migrate_old,
        ] {
            if self.tree(pkg, name)?.is_some() {
                out.push((name.as_os_str(), Leftover::Tree));
            }
        }
        let rest = record::read(self.root_fd(), &names.migrate_rest).map_err(|e| {
            Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{}: {e}",
                    self.root.path().join(&names.migrate_rest).display()
                ),
            )
        })?;
        if rest.is_some() {
            out.push((names.migrate_rest.as_os_str(), Leftover::Record));
        }
        Ok(out)
    }
}
