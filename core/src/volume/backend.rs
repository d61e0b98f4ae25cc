//! The volume store and volume-migrate, on Linux: what each of the
//! drop-in's calls runs on tokio's blocking pool.

use std::collections::BTreeSet;
use std::path::Path;

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId};
use volume::VolumeStore;

/// The store as the drop-in's calls use it: every wait for a package's
/// lock bounded by [`super::LOCK_PATIENCE`]; its trash (a restore's
/// replaced volume, a deleted one, a dropped backup, a held tree no longer
/// mounted, what recovery moved there) emptied once it is dropped, in
/// `volume::purge`'s thread: no call waits for it (seconds for a million
/// cached files), nor does any other operation of the package.
struct Store(VolumeStore);

impl std::ops::Deref for Store {
    type Target = VolumeStore;
    fn deref(&self) -> &VolumeStore {
        &self.0
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        volume::purge::in_background(self.0.root());
    }
}

fn store(root: &Path) -> Result<Store, Error> {
    let wait = volume::lock::LockWait::Within(super::LOCK_PATIENCE);
    let store = VolumeStore::open_without_recovery(root)?;
    Ok(Store(
        store
            .with_deferred_purge()
            .with_lock_wait(wait)
            .with_change_wait(wait),
    ))
}

/// [`store`], or `None` with no volumes root: nothing to see or drop.
fn store_if_root(root: &Path) -> Result<Option<Store>, Error> {
    match store(root) {
        Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
        store => store.map(Some),
    }
}

/// After recovery, as every call: a backup a restore killed past its
/// exchange left is spent, not one to retry an update on.
pub(super) fn exists(root: &Path, pkg: &PackageId) -> Result<bool, Error> {
    let Some(store) = store_if_root(root)? else {
        return Ok(false);
    };
    store.recover(pkg)?;
    Ok(store.info(pkg)?.backup.is_some())
}

/// Creates a missing volumes root, as upstream's makes the marker's.
pub(super) fn begin(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    volume::Root::create(root)?;
    store(root)?.begin_install(pkg).map(drop)
}

/// Recovery first as every call, but the marker is read even where it
/// fails: a failed first install's volume is then deleted as upstream's
/// would be, not kept as if its data predated the install.
pub(super) fn is_fresh(root: &Path, pkg: &PackageId) -> Result<bool, Error> {
    let Some(store) = store_if_root(root)? else {
        return Ok(false);
    };
    if let Err(e) = store.recover(pkg) {
        tracing::warn!(package = %pkg, "recovery before reading the fresh-install marker failed: {e}");
    }
    store.is_fresh(pkg)
}

pub(super) fn snapshot(root: &Path, pkg: &PackageId) -> Result<volume::SnapshotOutcome, Error> {
    let none = Ok(volume::SnapshotOutcome::NoVolume);
    store_if_root(root)?.map_or(none, |s| s.snapshot_replacing(pkg))
}

pub(super) fn restore(root: &Path, pkg: &PackageId) -> Result<volume::RestoreOutcome, Error> {
    let Some(store) = store_if_root(root)? else {
        return Ok(volume::RestoreOutcome {
            restored: false,
            held: None,
            unfinished: None,
        });
    };
    let outcome = store.restore_outcome(pkg)?;
    // Rolled back all the same: what is left, the next call finishes.
    if let Some(why) = &outcome.unfinished {
        tracing::warn!(package = %pkg, "the volume was rolled back; cleaning up after it failed: {why}");
    }
    // Upstream's rollback goes on either way; a volume left as the
    // failed install wrote it must not pass for a rolled-back one.
    // Only a warning: a failure to look must not turn the restore's
    // outcome into an error.
    let has_volume = store.info(pkg).is_ok_and(|i| i.volume.is_some());
    if !outcome.restored && has_volume && !store.is_fresh(pkg).unwrap_or(true) {
        tracing::warn!(package = %pkg, "no install backup to restore: the volume was not rolled back, it is as the failed install left it");
    }
    Ok(outcome)
}

pub(super) fn resolve_pending(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    store_if_root(root)?.map_or(Ok(()), |s| s.recover(pkg).map(drop))
}

pub(super) fn remove(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    store_if_root(root)?.map_or(Ok(()), |store| {
        store.mark_fresh(pkg, false)?;
        store.drop_backup(pkg).map(drop)
    })
}

pub(super) fn sync(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    store_if_root(root)?.map_or(Ok(()), |s| s.sync_volume(pkg))
}

pub(super) fn ensure(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    volume::Root::create(root)?;
    store(root)?.ensure(pkg).map(drop)
}

pub(super) fn delete_tree(root: &Path, path: &Path) -> Result<(), Error> {
    let done = volume::delete_tree_in_deferring_purge(root, path);
    volume::purge::in_background(root);
    done
}

/// The old tree's removal is only logged, as upstream's: the volume is
/// converted, and the migration must go on to install it.
pub(super) fn convert(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    let migrator = match volume_migrate::Migrator::open(root) {
        Err(e) if e.kind == ErrorKind::NotFound => return Ok(()),
        migrator => migrator?,
    };
    let opts = volume_migrate::MigrateOptions {
        remove_old: false,
        ..Default::default()
    };
    migrator.convert(pkg, &opts, &mut |_: &volume_migrate::Progress| {})?;
    if let Err(e) = migrator.remove_old(pkg, &mut |_: &volume_migrate::Progress| {}) {
        tracing::warn!(package = %pkg, step = "cleanup", "the volume was converted, but removing the old directory failed (the next boot's cleanup removes it): {e}");
    }
    Ok(())
}

/// Each package's failure is logged where it happens (by
/// `remove_all_old`); what stops the whole cleanup is logged here, as
/// nobody may await the task (upstream's call site does not).
pub(super) fn cleanup(root: &Path) -> Result<Vec<PackageId>, Error> {
    volume_migrate::Migrator::open(root)
        .inspect_err(|e| {
            tracing::error!(
                step = "cleanup",
                "opening {} for the cleanup failed: {e}",
                root.display()
            )
        })?
        .remove_all_old(&mut |_: &volume_migrate::Progress| {})
}

/// The blocking part of boot maintenance; sends progress on `tx`. Returns
/// the recoveries, the failures, and whether anything was converted.
#[allow(clippy::type_complexity)]
pub(super) fn boot(
    root: &Path,
    installed: &BTreeSet<String>,
    all: &BTreeSet<String>,
    tx: &tokio::sync::mpsc::UnboundedSender<super::BootEvent>,
) -> Result<(Vec<volume::Recovery>, Vec<(PackageId, Error)>, bool), Error> {
    let store = store(root)?;
    let mut failed = Vec::new();
    let mut recovered = Vec::new();
    for r in store.recover_all()? {
        match &r.error {
            Some(e) => failed.push((
                r.package.clone(),
                Error::new(eyre!("{e}"), ErrorKind::Incoherent),
            )),
            None => recovered.push(r),
        }
    }
    sweep(&store, installed, all, &mut failed)?;
    // What recovery and the sweep moved to the trash (a dropped backup, a
    // reflink copy's every file) frees its space while the conversions
    // run, whose room checks count what is free: not after them, when the
    // store is dropped.
    volume::purge::in_background(root);
    let migrator = volume_migrate::Migrator::open(root)?;
    let listed = migrator.packages()?;
    let installed_listed: Vec<PackageId> = listed
        .iter()
        .filter(|p| installed.contains(p.as_str()))
        .cloned()
        .collect();
    // The services wait for this: the deferred cut leaves the removal of
    // the parent's rest, as of every old tree, to the cleanup.
    let opts = volume_migrate::MigrateOptions {
        remove_old: false,
        defer_cut: true,
        ..Default::default()
    };
    let planned = migrator.schedule(&installed_listed, &opts)?;
    // A refused package is a failed conversion (volume-migrate's own
    // run fails it the same way): it keeps its plain directory, and it
    // is reported, never passed over as ready.
    for p in &planned {
        if let Some(why) = &p.refused {
            tracing::error!(package = %p.package, step = "conversion", "converting the volume failed: {why}");
            failed.push((
                p.package.clone(),
                Error::new(eyre!("{why}"), ErrorKind::MigrationFailed),
            ));
        }
    }
    let to_convert: BTreeSet<PackageId> = planned
        .iter()
        .filter(|p| p.decision.is_some())
        .map(|p| p.package.clone())
        .collect();
    let total: u64 = planned
        .iter()
        .filter(|p| p.decision.is_some())
        .map(|p| p.bytes)
        .sum();
    let _ = tx.send(super::BootEvent::Total(total));
    // Everything installed that needs no conversion is ready now.
    for id in installed {
        let Ok(pkg) = id.parse::<PackageId>() else {
            continue;
        };
        if !to_convert.contains(&pkg) && !failed.iter().any(|(p, _)| *p == pkg) {
            let _ = tx.send(super::BootEvent::Ready(pkg));
        }
    }
    convert_all(&migrator, &planned, &opts, tx, &mut failed);
    // Old trees to remove: this boot's, and any an interrupted run left
    // (the packages listed that were not converted now have leftovers,
    // or are plain directories of packages no longer installed, which
    // the cleanup leaves alone).
    let cleanup = !to_convert.is_empty()
        || planned.iter().any(|p| p.old_pending)
        || listed.len() > installed_listed.len();
    Ok((recovered, failed, cleanup))
}

/// Converts every package of `planned` that has a decision, in the
/// schedule's order (the packages converted by snapshotting the parent
/// first, several at once, each ready in milliseconds, then the
/// clones), reporting each ready on `tx` as soon as it is done; the
/// failures go to `failed`.
fn convert_all(
    migrator: &volume_migrate::Migrator,
    planned: &[volume_migrate::Planned],
    opts: &volume_migrate::MigrateOptions,
    tx: &tokio::sync::mpsc::UnboundedSender<super::BootEvent>,
    failed: &mut Vec<(PackageId, Error)>,
) {
    let to_run: Vec<volume_migrate::Planned> = planned
        .iter()
        .filter(|p| p.decision.is_some())
        .cloned()
        .collect();
    let base = std::sync::atomic::AtomicU64::new(0);
    let bytes: std::collections::HashMap<&PackageId, u64> =
        to_run.iter().map(|p| (&p.package, p.bytes)).collect();
    let mut sink = |pr: &volume_migrate::Progress| {
        let done = base.load(std::sync::atomic::Ordering::Relaxed);
        let of = bytes.get(&pr.package).copied().unwrap_or_default();
        let _ = tx.send(super::BootEvent::Done(done + pr.bytes_done.min(of)));
    };
    let on_done = |p: &volume_migrate::Planned, r: &volume_migrate::Converted| match r {
        Ok(_) => {
            let done = base.fetch_add(p.bytes, std::sync::atomic::Ordering::Relaxed) + p.bytes;
            let _ = tx.send(super::BootEvent::Done(done));
            let _ = tx.send(super::BootEvent::Ready(p.package.clone()));
        }
        Err(e) => {
            tracing::error!(package = %p.package, step = "conversion", "converting the volume failed: {e}");
        }
    };
    let outcomes = migrator.convert_each(&to_run, opts, &mut sink, &on_done);
    for (p, r) in to_run.iter().zip(outcomes) {
        if let Err(e) = r {
            failed.push((p.package.clone(), e));
        }
    }
}

/// Upstream's sweep: the backup of a package no longer in the database
/// is dropped (upstream reaps it), its live volume there or not, so a
/// package uninstalled stays uninstalled and its reinstall starts
/// empty; the sweep never makes a volume. A fresh marker of a package
/// that is installed, or no longer known, is removed.
fn sweep(
    store: &volume::VolumeStore,
    installed: &BTreeSet<String>,
    all: &BTreeSet<String>,
    failed: &mut Vec<(PackageId, Error)>,
) -> Result<(), Error> {
    let stale = |p: &PackageId| installed.contains(p.as_str()) || !all.contains(p.as_str());
    for pkg in store.fresh_packages()?.into_iter().filter(stale) {
        if let Err(e) = store.mark_fresh(&pkg, false) {
            tracing::error!(package = %pkg, step = "sweep", "dropping the fresh-install marker failed: {e}");
            failed.push((pkg, e));
        }
    }
    for info in store.list()? {
        let pkg = &info.package;
        if all.contains(pkg.as_str()) || info.backup.is_none() {
            continue;
        }
        match store.drop_backup(pkg) {
            Ok(_) => {
                tracing::info!(package = %pkg, step = "sweep", "dropped the install backup of a package no longer installed")
            }
            Err(e) => {
                tracing::error!(package = %pkg, step = "sweep", "dropping the backup of a package no longer installed failed: {e}");
                failed.push((pkg.clone(), e));
            }
        }
    }
    Ok(())
}
