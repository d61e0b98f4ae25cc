//! Removing what a conversion leaves behind: the old plain directories
//! (`<pkg>.migrate-old`) and the rests deferred cuts set aside in the new
//! volumes (the `rest` module), in the background after services start.
//!
//! Both only ever hold data that lives elsewhere, so a crash part-way is
//! harmless: the next removal takes up what is left.
//!
//! A removal holds the package's lock one bounded batch at a time (the
//! `shed` module): a service load, a backup, a restore or a delete of the
//! package waits a few milliseconds, not for the whole removal. After each
//! batch it looks again: the old tree still the same tree under its name,
//! the volume holding the rest still the same subvolume with the same
//! record. If another operation changed that (a delete, a restore), the
//! removal starts over from what is there now, the package still held, at
//! most `ATTEMPTS` times before it leaves the rest for the next cleanup.

use std::io;
use std::os::fd::AsFd;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::copy;
use volume::failpoint::failpoint;
use volume::layout::Names;
use volume::record::Identity;
use volume::sys;

use crate::carve;
use crate::errors::step;
use crate::migrate::Migrator;
use crate::options::default_reserve;
use crate::rest::RestRecord;
use crate::shed::{self, Shed};
use crate::state::{Kind, settle_exchanged};
use crate::track::Tracker;
use crate::{Estimate, Phase, ProgressSink};

/// How many times one package's cleanup starts over after another
/// operation changed the package between two of its batches.
const ATTEMPTS: usize = 3;

impl Migrator {
    /// Removes every old tree left under the root ([`Migrator::remove_old`]
    /// for each package); the second phase, fine to run while services run.
    /// Returns the packages cleaned.
    ///
    /// The order matters to the services already running: a deferred cut's
    /// rest holds a copy of every other package's old tree, and until both
    /// it and a package's own old tree are gone, the NOCOW files cloned into
    /// that package share their extents, so each of its first writes there
    /// is a copy (a new extent) instead of an overwrite. The rests go first,
    /// then the cloned packages' old trees, and last the old trees of the
    /// packages converted by a cut (whose extents only their own volumes
    /// share, so a NOCOW first write there copies once either way).
    ///
    /// One package that cannot be cleaned (an unreadable record, an I/O
    /// error, too little metadata space) stops none of the others: each is
    /// tried, and the first error is returned once all were.
    ///
    /// The calling thread does it in the idle I/O class
    /// ([`sys::IdleIo`]), back at its own priority on return: the services
    /// that started meanwhile come first.
    pub fn remove_all_old(&self, sink: &mut dyn ProgressSink) -> Result<Vec<PackageId>, Error> {
        let _idle = sys::IdleIo::enter()
            .inspect_err(|e| tracing::warn!(error = %e, "entering the idle I/O class"))
            .ok();
        // Shares a run left (one cut short, or whose last member failed):
        // scratch, deleted in O(1) each.
        if let Err(e) = crate::split::wipe(self.root_fd()) {
            tracing::warn!(error = %e, "deleting the shared cuts left");
        }
        let (cut, cloned): (Vec<PackageId>, Vec<PackageId>) =
            self.listing()?.0.into_iter().partition(|pkg| {
                // A record that cannot be read is for remove_old to report.
                Names::new(pkg).is_ok_and(|names| {
                    !matches!(
                        RestRecord::read(self.root_fd(), &names.migrate_rest),
                        Ok(None)
                    )
                })
            });
        let mut done = Vec::new();
        let mut failed: Vec<(PackageId, Error)> = Vec::new();
        for pkg in &cut {
            match self.remove_parts(pkg, false, sink) {
                Ok(true) => done.push(pkg.clone()),
                Ok(false) => {}
                Err(e) => failed.push((pkg.clone(), e)),
            }
        }
        // A package whose rest failed is left whole for the next cleanup:
        // its old tree would meet the same wall, and be reported twice.
        for pkg in cloned.iter().chain(&cut) {
            if failed.iter().any(|(p, _)| p == pkg) {
                continue;
            }
            match self.remove_old(pkg, sink) {
                Ok(true) if !done.contains(pkg) => done.push(pkg.clone()),
                Ok(_) => {}
                Err(e) => failed.push((pkg.clone(), e)),
            }
        }
        for (pkg, e) in &failed {
            tracing::error!(package = %pkg, error = %e, "removing what the conversion left");
        }
        let first_error = failed.into_iter().next().map(|(_, e)| e);
        match first_error {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Removes the old trees a conversion of `pkg` left: the rest a
    /// deferred cut set aside in the new `<pkg>` ([`crate::MigrateOptions::defer_cut`]),
    /// then `<pkg>.migrate-old`, the plain directory it replaced: O(their
    /// extents), entry by entry (nested subvolumes in O(1)). Returns whether
    /// there was anything. Both only ever hold data that lives elsewhere
    /// (the converted `<pkg>`, or the rest of the parent), so a crash
    /// part-way is harmless: the rest is removed by the next call. (An
    /// immutable or append-only file also linked from outside them keeps
    /// its flags, cleared for the unlink and put back; a crash in between
    /// leaves them off that other name.) Also finishes an exchange whose
    /// rename aside was interrupted.
    pub fn remove_old(&self, pkg: &PackageId, sink: &mut dyn ProgressSink) -> Result<bool, Error> {
        self.remove_parts(pkg, true, sink)
    }

    /// [`Migrator::remove_old`], or with `old` false only the rest of a
    /// deferred cut (`<pkg>.migrate-old` left for a later call).
    pub(crate) fn remove_parts(
        &self,
        pkg: &PackageId,
        old: bool,
        sink: &mut dyn ProgressSink,
    ) -> Result<bool, Error> {
        if !self.root.is_btrfs() {
            return Ok(false);
        }
        let names = Names::new(pkg)?;
        let lock = self.lock(pkg)?;
        settle_exchanged(&self.root, pkg, &names)?;
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        let reserve = default_reserve(&self.metadata_space(pkg)?);
        let mut shed = Shed::start(self.root_fd(), reserve, lock);
        // Interrupted, the removal still holds the package: it starts over
        // from what is there now (a restore may have brought back part of
        // the rest). Bounded, so that a package changed again and again is
        // left to the next cleanup instead.
        for _ in 0..ATTEMPTS {
            if let Some(found) = self.shed_parts(pkg, &names, old, &mut tracker, &mut shed)? {
                return Ok(found);
            }
        }
        Ok(false)
    }

    /// [`Migrator::remove_parts`] holding the package in `shed`; `None` if
    /// another operation changed the package between two batches (an old
    /// tree found gone then is removed, not changed: whatever took its
    /// last entries, nothing of it is left).
    fn shed_parts(
        &self,
        pkg: &PackageId,
        names: &Names,
        old: bool,
        tracker: &mut Tracker<'_>,
        shed: &mut Shed<'_>,
    ) -> Result<Option<bool>, Error> {
        let rest = match self.remove_rest(pkg, names, tracker, shed)? {
            Some(rest) => rest,
            None => return Ok(None),
        };
        if !old
            || Kind::of(&self.root, &names.migrate_old)
                .with_ctx(step(pkg, "inspecting the old directory"))?
                == Kind::Absent
        {
            if rest {
                tracker.phase(Phase::Done);
            }
            return Ok(Some(rest));
        }
        tracker.phase(Phase::RemoveOld);
        let root = self.root_fd();
        let tree = Identity::of_entry(root, &names.migrate_old)
            .with_ctx(step(pkg, "inspecting the old directory"))?;
        // The same tree under the same name: nothing else ever renames a
        // tree to `.migrate-old` but a conversion, done with this package.
        let mut still = || Ok(Identity::of_entry(root, &names.migrate_old)? == tree);
        let removed = copy::remove_tree_at(root, &names.migrate_old, &mut |n| {
            tracker.entries(n);
            self.count_removed();
            failpoint("migrate.remove")?;
            shed.removed(&mut still)
        });
        // The last entry removed is the tree's own top: a batch that ends
        // there (a slow last rmdir, a loaded box) finds nothing under the
        // name, by this removal's doing, not another operation's. Nothing
        // is left of the tree to start over on, whoever removed the last of
        // it (a delete between two batches takes the rest): it is gone.
        let removed = match removed {
            Err(e)
                if shed::interrupted(&e)
                    && Kind::of(&self.root, &names.migrate_old)
                        .with_ctx(step(pkg, "inspecting the old directory"))?
                        == Kind::Absent =>
            {
                Ok(())
            }
            other => other,
        };
        if stopped(pkg, &removed, shed) {
            return Ok(None);
        }
        // Gone, durable or not: a crash before the sync leaves part of it
        // under its name again, garbage as before. No one need wait for it.
        shed.release();
        removed
            .and_then(|()| sys::fsync(root))
            .with_ctx(step(pkg, "removing the old directory"))?;
        tracker.phase(Phase::Done);
        tracing::info!(
            package = %pkg,
            longest_hold_us = shed.longest_hold().as_micros() as u64,
            "old plain volume directory removed"
        );
        Ok(Some(true))
    }

    /// Removes what a deferred cut set aside in `<pkg>`, by its record (see
    /// the `rest` module); returns whether there was a record, `None` if
    /// another operation changed the volume or the record between two
    /// batches (the `shed` module), for [`Migrator::remove_parts`] to start
    /// over.
    fn remove_rest(
        &self,
        pkg: &PackageId,
        names: &Names,
        tracker: &mut Tracker<'_>,
        shed: &mut Shed<'_>,
    ) -> Result<Option<bool>, Error> {
        let root = self.root_fd();
        let Some(record) = RestRecord::read(root, &names.migrate_rest).with_ctx(|e| {
            (
                ErrorKind::Incoherent,
                pkg.context(format!("reading the deferred cut's record: {e}")),
            )
        })?
        else {
            return Ok(Some(false));
        };
        if Kind::of(&self.root, &names.live).with_ctx(step(pkg, "inspecting the volume"))?
            == Kind::Subvolume
        {
            let live =
                sys::open_dir_at(root, &names.live).with_ctx(step(pkg, "opening the volume"))?;
            if record
                .is_in(live.as_fd())
                .with_ctx(step(pkg, "looking for the cut's rest"))?
            {
                tracker.phase(Phase::RemoveOld);
                let volume =
                    Identity::of(live.as_fd()).with_ctx(step(pkg, "opening the volume"))?;
                // A restore exchanges the volume, a delete takes it and the
                // record: either stops the removal. A snapshot changes
                // neither (the record stays while its backup holds the
                // rest, below).
                let mut still = || {
                    Ok(Identity::of_entry(root, &names.live)? == Some(volume)
                        && RestRecord::read(root, &names.migrate_rest)?.as_ref() == Some(&record))
                };
                let removed =
                    carve::remove_rest(live.as_fd(), &record.name, record.root_stuck, &mut |n| {
                        tracker.entries(n);
                        self.count_removed();
                        failpoint("migrate.rest-removed")?;
                        shed.removed(&mut still)
                    })
                    // Durable before the record goes: the commit, which
                    // writes out the services' data too, with the package
                    // set down.
                    .and_then(|()| shed.pass(&mut still, &mut || sys::commit(live.as_fd())));
                if stopped(pkg, &removed, shed) {
                    return Ok(None);
                }
                removed.with_ctx(step(pkg, "removing the rest of the parent's snapshot"))?;
                tracing::info!(package = %pkg, "the rest of the parent's snapshot removed");
            } else {
                // Removed before a crash that came before the record's
                // removal: the root's flags may still be lifted.
                carve::put_back_root_flags(live.as_fd(), record.root_stuck)
                    .with_ctx(step(pkg, "putting back the volume root's flags"))?;
            }
        }
        // A backup taken before the removal holds the rest too; a restore of
        // it would bring it back, so the record stays while it exists. So
        // does every copy an interrupted backup or restore may yet turn
        // into the volume (ours or upstream's), named here.
        let mut in_backup = false;
        for copy in [
            &names.backup,
            &names.backup_tmp,
            &names.rollback,
            &names.replaced,
            &names.upstream_backup_tmp,
            &names.restore_old,
            &names.restore_conflict,
        ] {
            let holds = match sys::stat_at(root, copy)
                .with_ctx(step(pkg, "inspecting a copy of the volume"))?
            {
                Some(st) if st.is_dir() => {
                    let dir = sys::open_dir_at(root, copy)
                        .with_ctx(step(pkg, "opening a copy of the volume"))?;
                    record
                        .is_in(dir.as_fd())
                        .with_ctx(step(pkg, "looking for the cut's rest in a copy"))?
                }
                _ => false,
            };
            in_backup |= holds;
        }
        if !in_backup {
            // A crash before the sync brings back a record whose rest is
            // gone, which the next cleanup removes: the sync need not keep
            // anyone waiting, and what follows looks at the package anew.
            volume::record::remove(root, &names.migrate_rest)
                .and_then(|()| shed.pass(&mut || Ok(true), &mut || sys::fsync(root)))
                .with_ctx(step(pkg, "removing the deferred cut's record"))?;
        }
        Ok(Some(true))
    }
}

/// Whether `removed` is a removal stopped between two batches because
/// another operation changed the package ([`shed::interrupted`]): logged,
/// and no error; [`Migrator::remove_parts`] starts over from what is left.
fn stopped(pkg: &PackageId, removed: &io::Result<()>, shed: &Shed<'_>) -> bool {
    let Err(e) = removed else {
        return false;
    };
    if !shed::interrupted(e) {
        return false;
    }
    tracing::info!(
        package = %pkg,
        longest_hold_us = shed.longest_hold().as_micros() as u64,
        "{e}"
    );
    true
}
