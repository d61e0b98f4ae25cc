//! The two steps of upstream's install protocol that decide what to do
//! with a backup left by an earlier install: [`VolumeStore::begin_install`]
//! (upstream's `InstallBackup::begin`) and
//! [`VolumeStore::snapshot_replacing`] (its `snapshot`, which replaces a
//! backup it finds).
//!
//! Each looks at the volume and the backup and acts on what it saw under
//! one hold of the package's lock, after recovery: a decision taken on a
//! reading made before the lock could drop a backup that a concurrent
//! operation (a delete, a restore from the command line) had meanwhile
//! made the only copy of the data. The rule is the store's: a backup with
//! no live volume beside it is never dropped.

use models::{Error, PackageId};

use super::VolumeStore;
use crate::layout::Names;
use crate::outcome::SnapshotOutcome;

/// What [`VolumeStore::begin_install`] found, and so did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begun {
    /// The package has a volume: the install will update it. A backup an
    /// earlier install left (`dropped_backup`) was dropped, as upstream's
    /// `begin` deletes it.
    Volume {
        /// Whether there was a backup to drop.
        dropped_backup: bool,
    },
    /// No volume, but a backup: the only copy of the data, put back as
    /// the volume (upstream deletes it).
    PutBack,
    /// Neither: a fresh install, marked (`<pkg>.install-fresh`).
    Fresh,
}

impl VolumeStore {
    /// Before an install, as upstream's `InstallBackup::begin`: finishes or
    /// undoes what a crash left, then, under the same hold of the lock,
    /// drops the previous backup if the package has a volume, puts the
    /// backup back as the volume if it has none (the only copy), and sets
    /// the fresh-install marker exactly when no volume is left.
    ///
    /// A crash part-way leaves one of the store's states: the backup
    /// dropped (in the trash) or not, the restore before
    /// or past its commit point (see [`VolumeStore::restore`]), the marker
    /// set or not; the next call decides again from what is there.
    pub fn begin_install(&self, pkg: &PackageId) -> Result<Begun, Error> {
        let begun = {
            let held = self.hold_recovered(pkg, Names::new(pkg)?)?;
            let names = &held.names;
            let begun = if self.tree(pkg, &names.live)?.is_some() {
                Begun::Volume {
                    dropped_backup: self.drop_locked(pkg, names)?,
                }
            } else if self.restore_locked(pkg, names)? {
                self.purge_locked(pkg, names)?;
                tracing::warn!(package = %pkg, "begin: the install backup was the only copy of the volume; put it back");
                Begun::PutBack
            } else {
                Begun::Fresh
            };
            self.mark_fresh_locked(pkg, &names.fresh, begun == Begun::Fresh)?;
            begun
        };
        // The dropped backup is in the trash: deleted off the lock.
        self.purge_after();
        Ok(begun)
    }

    /// [`VolumeStore::snapshot`], but a backup found beside a live volume
    /// is dropped first, under the same hold, and replaced: upstream's
    /// `snapshot`, which a caller that skipped `begin` (an install restoring
    /// from a backup target) relies on. A backup with no live volume beside
    /// it is the only copy and is kept: the result is then
    /// [`SnapshotOutcome::NoVolume`].
    ///
    /// A crash part-way leaves the old backup or none (in the trash, which is
    /// garbage), and no new one or a complete one.
    pub fn snapshot_replacing(&self, pkg: &PackageId) -> Result<SnapshotOutcome, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(SnapshotOutcome::NoVolume);
        };
        let snapshot = {
            let held = self.hold_recovered(pkg, names)?;
            let names = &held.names;
            if self.tree(pkg, &names.live)?.is_some() && self.tree(pkg, &names.backup)?.is_some() {
                tracing::warn!(package = %pkg, "an install backup was left without `begin`; replacing it");
                self.drop_locked(pkg, names)?;
            }
            self.snapshot_locked(pkg, names)?
        };
        self.purge_after();
        Ok(snapshot)
    }
}
