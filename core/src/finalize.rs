//! Install finalization: stop, snapshot, install, then drop or restore.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt};
use tracing::instrument;
use volume::{SnapshotOutcome, VolumeStore};

use crate::blocking::blocking;
use crate::db::{Db, InstallingInfo, PackageDataEntry, Phase, StateInfo};
use crate::notify::{Cancel, Event, Notification, Notifier};
use crate::service::Services;
use volume::failpoint::failpoint;

mod rollback;

/// What to install.
#[derive(Debug, Clone)]
pub struct InstallRequest {
    /// The package.
    pub package: PackageId,
    /// The version being installed.
    pub version: String,
    /// Its archive.
    pub s9pk: String,
}

/// Where the time of a successful finalization went.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    /// Stopping the old service (zero for a fresh install).
    pub stop: Duration,
    /// Taking the install backup.
    pub snapshot: Duration,
    /// uninit + install + init + start: the service's own work.
    pub service: Duration,
    /// State database writes.
    pub state_writes: Duration,
    /// From the new version's start returning to the success notification
    /// being sent (the state write that marks it installed, and nothing else:
    /// the backup is dropped afterwards).
    pub install_done_to_notify: Duration,
    /// From the call to the notification.
    pub total: Duration,
}

impl Timings {
    /// What finalization adds beyond stopping the old service and the
    /// service's own install work: snapshot, state writes, bookkeeping.
    pub fn overhead(&self) -> Duration {
        self.total.saturating_sub(self.stop + self.service)
    }
}

/// A successful finalization.
#[derive(Debug)]
pub struct Finalized {
    /// What the snapshot did (`NoVolume` for a fresh install).
    pub snapshot: SnapshotOutcome,
    /// Where the time went.
    pub timings: Timings,
    /// The backup drop, running after the notification; resolves to whether
    /// a backup was dropped. Holds the package's lock, so the next install
    /// of the same package waits for it.
    pub backup_drop: tokio::task::JoinHandle<Result<bool, Error>>,
}

/// Runs installs and uninstalls: those of different packages in parallel,
/// those of one package one after the other.
///
/// Crash safety: every step that changes the disk is preceded by a state
/// write saying what is in flight ([`StateInfo::Installing`] /
/// [`StateInfo::Updating`] with [`InstallingInfo`], or
/// [`StateInfo::Removing`]), so [`crate::reconcile`] can tell from the state
/// and the names on disk what to finish or undo.
pub struct Finalizer<D, S, N> {
    db: Arc<D>,
    services: Arc<S>,
    notifier: Arc<N>,
    volumes_root: PathBuf,
    locks: Mutex<HashMap<PackageId, Arc<tokio::sync::Mutex<()>>>>,
}

fn cancelled(pkg: &PackageId, phase: Phase) -> Error {
    Error::for_package(
        pkg,
        ErrorKind::Cancelled,
        format!("cancelled before {phase} finished"),
    )
}

/// Runs one service phase unless cancelled first; a cancel during the phase
/// drops it (the rollback that follows stops whatever it started).
async fn step(
    pkg: &PackageId,
    phase: Phase,
    cancel: &Cancel,
    f: impl Future<Output = Result<(), Error>>,
) -> Result<(), Error> {
    if cancel.is_cancelled() {
        return Err(cancelled(pkg, phase));
    }
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(cancelled(pkg, phase)),
        r = f => r,
    }
}

/// The version and archive `pkg` is installed at, from its state `entry`
/// (`None` for no entry: a fresh install). Anything but `installed` or no
/// entry is an unfinished operation, which the install refuses
/// (`InvalidRequest`) until reconcile has finished or undone it.
fn installed_version(
    pkg: &PackageId,
    entry: Option<PackageDataEntry>,
) -> Result<Option<(String, String)>, Error> {
    match entry {
        None => Ok(None),
        Some(e) if e.state_info == StateInfo::Installed => {
            let v = e.version.clone().ok_or_else(|| {
                Error::for_package(pkg, ErrorKind::Incoherent, "installed without a version")
            })?;
            Ok(Some((v, e.s9pk)))
        }
        Some(e) => Err(Error::for_package(
            pkg,
            ErrorKind::InvalidRequest,
            format!(
                "is {}; an unfinished operation must be reconciled first",
                e.state_info.name()
            ),
        )),
    }
}

/// The state entry that records an install's intent before anything
/// changes: `updating` over the `old` version and archive, or `installing`
/// with the new archive, in phase [`Phase::Stop`] with no backup taken yet.
fn intent_entry(
    req: &InstallRequest,
    old: Option<&(String, String)>,
    had_volume: bool,
) -> PackageDataEntry {
    let info = InstallingInfo {
        new_version: req.version.clone(),
        phase: Phase::Stop,
        had_volume,
        backup_taken: false,
    };
    match old {
        Some((v, s9pk)) => PackageDataEntry {
            state_info: StateInfo::Updating {
                installing_info: info,
            },
            version: Some(v.clone()),
            s9pk: s9pk.clone(),
        },
        None => PackageDataEntry {
            state_info: StateInfo::Installing {
                installing_info: info,
            },
            version: None,
            s9pk: req.s9pk.clone(),
        },
    }
}

/// How far an install got, for the rollback.
struct Progress {
    phase: Phase,
    backup_taken: bool,
    snapshot: SnapshotOutcome,
    timings: Timings,
}

impl<D: Db, S: Services, N: Notifier> Finalizer<D, S, N> {
    /// A finalizer over the state `db`, the `services` and the volumes under
    /// `volumes_root` (a [`VolumeStore`] root), notifying `notifier`.
    ///
    /// Run [`crate::reconcile`] first at boot: installs refuse packages whose
    /// state shows an unfinished operation.
    pub fn new(
        db: Arc<D>,
        services: Arc<S>,
        notifier: Arc<N>,
        volumes_root: impl Into<PathBuf>,
    ) -> Self {
        Finalizer {
            db,
            services,
            notifier,
            volumes_root: volumes_root.into(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// The state database.
    pub fn db(&self) -> &Arc<D> {
        &self.db
    }

    /// The services.
    pub fn services(&self) -> &Arc<S> {
        &self.services
    }

    /// The volumes root.
    pub fn volumes_root(&self) -> &Path {
        &self.volumes_root
    }

    fn store(&self) -> Result<VolumeStore, Error> {
        // Each volume operation recovers its own package under its lock; the
        // all-package pass belongs to reconcile at boot.
        VolumeStore::open_without_recovery(&self.volumes_root)
    }

    async fn lock(&self, pkg: &PackageId) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self
            .locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(pkg.clone())
            .or_default()
            .clone();
        m.lock_owned().await
    }

    async fn write_state<T: Send + 'static>(
        &self,
        timings: &mut Timings,
        f: impl FnOnce(&mut crate::PackageDataMap) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let t = Instant::now();
        let r = self.db.mutate(f).await.map(|m| m.result);
        timings.state_writes += t.elapsed();
        r
    }

    fn notify(&self, pkg: &PackageId, event: Event) -> Instant {
        let at = Instant::now();
        self.notifier.notify(Notification {
            package: pkg.clone(),
            at,
            event,
        });
        at
    }

    /// Installs or updates `req.package` to `req.version`.
    ///
    /// Order: record the intent in the state; stop the old service (so
    /// nothing writes any more); snapshot its volume (fresh installs with no
    /// volume take none; a reinstall over a soft uninstall does); record that
    /// the backup exists; uninit the old version towards the new one; install
    /// and init the new one; commit what they wrote to the volume (so a power
    /// cut never keeps the `installed` record without the migration it
    /// vouches for); start it. Then: state `installed` at the new version,
    /// the success notification, and only after it the O(1) backup drop
    /// ([`Finalized::backup_drop`]).
    ///
    /// On failure or cancel in any phase: stop the new service, restore the
    /// backup atomically (or, for a fresh install with no earlier volume,
    /// delete the volume it created), state `installed` at the old version
    /// and start it (or, with no old version, remove the entry), then a
    /// failure notification naming the phase; returns the error
    /// (`UpdateFailed`, `InstallFailed` or `Cancelled`). If the rollback
    /// itself fails, the state stays `updating`/`installing` for
    /// [`crate::reconcile`], and the error is `Incoherent`.
    ///
    /// A crash at any point leaves a state entry and names on disk from
    /// which reconcile restores the old version, or (after the state says
    /// `installed`) drops the leftover backup.
    #[instrument(skip_all, fields(package = %req.package, version = %req.version))]
    pub async fn install(&self, req: &InstallRequest, cancel: &Cancel) -> Result<Finalized, Error> {
        let t0 = Instant::now();
        let guard = self.lock(&req.package).await;
        let pkg = &req.package;
        let entry = self.db.peek().await.get(pkg).cloned();
        let old = installed_version(pkg, entry)?;
        let failed_kind = if old.is_some() {
            ErrorKind::UpdateFailed
        } else {
            ErrorKind::InstallFailed
        };
        let had_volume = self.volume_before(pkg, old.is_some()).await?;
        let mut progress = Progress {
            phase: Phase::Stop,
            backup_taken: false,
            snapshot: SnapshotOutcome::NoVolume,
            timings: Timings::default(),
        };
        let new_entry = intent_entry(req, old.as_ref(), had_volume);
        let p = pkg.clone();
        self.write_state(&mut progress.timings, move |db| {
            db.insert(p, new_entry);
            Ok(())
        })
        .await?;
        failpoint("finalize.recorded")?;

        let run = self
            .run_phases(
                req,
                old.as_ref().map(|(v, _)| v.as_str()),
                cancel,
                &mut progress,
            )
            .await;
        if let Err(e) = run {
            return Err(self
                .roll_back(req, old, had_volume, failed_kind, &mut progress, e)
                .await);
        }

        let install_done = Instant::now();
        if let Err(e) = self.record_installed(req, &mut progress.timings).await {
            return Err(self
                .roll_back(req, old, had_volume, failed_kind, &mut progress, e)
                .await);
        }
        failpoint("finalize.committed")?;
        Ok(self.announce(req, guard, t0, install_done, progress))
    }

    /// Whether `pkg` had a live volume before this install, once a leftover
    /// backup is out of the way: over an installed version the live volume
    /// is known good, so a backup beside it is a leftover of an earlier
    /// update whose drop did not happen, and is dropped (a crash during
    /// the drop leaves it for the next install or reconcile); with nothing
    /// installed a backup is the only copy of something, and the install
    /// refuses to start (`Incoherent`) until reconcile has dealt with it.
    async fn volume_before(&self, pkg: &PackageId, installed: bool) -> Result<bool, Error> {
        let (had_volume, had_backup) = {
            let (store, p) = (self.store()?, pkg.clone());
            blocking(move || {
                Ok((
                    store.volume_path(&p).exists(),
                    store.backup_path(&p).exists(),
                ))
            })
            .await?
        };
        if had_backup {
            if installed {
                let (store, p) = (self.store()?, pkg.clone());
                blocking(move || store.drop_backup(&p)).await?;
            } else {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::Incoherent,
                    "not installed, yet it has an install backup: run reconcile first",
                ));
            }
        }
        Ok(had_volume)
    }

    /// The state write that marks the install done: `installed` at the new
    /// version. It is what lets the backup go, at once or (after a crash
    /// right after it) by reconcile; a crash before it leaves the in-flight
    /// state, from which reconcile restores the old version.
    async fn record_installed(
        &self,
        req: &InstallRequest,
        timings: &mut Timings,
    ) -> Result<(), Error> {
        let (p, v, s9pk) = (req.package.clone(), req.version.clone(), req.s9pk.clone());
        self.write_state(timings, move |db| {
            db.insert(
                p,
                PackageDataEntry {
                    state_info: StateInfo::Installed,
                    version: Some(v),
                    s9pk,
                },
            );
            Ok(())
        })
        .await
    }

    /// The success notification, the timings up to it, and only then the
    /// backup drop, spawned holding the package's lock (`guard`). Changes
    /// nothing on disk itself: the state already says `installed`, so a
    /// crash before or during the drop leaves a backup that reconcile (or
    /// the next install) drops.
    fn announce(
        &self,
        req: &InstallRequest,
        guard: tokio::sync::OwnedMutexGuard<()>,
        t0: Instant,
        install_done: Instant,
        progress: Progress,
    ) -> Finalized {
        let pkg = &req.package;
        let at = self.notify(
            pkg,
            Event::Installed {
                version: req.version.clone(),
            },
        );
        let mut timings = progress.timings;
        timings.install_done_to_notify = at.duration_since(install_done);
        timings.total = at.duration_since(t0);
        // After the notification, never before: the drop is O(1) on btrfs but
        // a reflink backup on a plain directory is O(extents).
        let (store, p) = (self.store(), pkg.clone());
        let backup_drop = tokio::spawn(async move {
            let _guard = guard;
            let store = store?;
            blocking(move || store.drop_backup(&p)).await
        });
        tracing::info!(total = ?timings.total, overhead = ?timings.overhead(), "installed");
        Finalized {
            snapshot: progress.snapshot,
            timings,
            backup_drop,
        }
    }

    #[instrument(skip_all)]
    async fn run_phases(
        &self,
        req: &InstallRequest,
        old: Option<&str>,
        cancel: &Cancel,
        progress: &mut Progress,
    ) -> Result<(), Error> {
        let pkg = &req.package;
        let svc = &*self.services;
        if old.is_some() {
            if cancel.is_cancelled() {
                return Err(cancelled(pkg, Phase::Stop));
            }
            // Never raced against cancel: a half-awaited stop could leave the
            // old service writing while the snapshot runs.
            let t = Instant::now();
            svc.stop(pkg).await?;
            progress.timings.stop = t.elapsed();
        }
        failpoint("finalize.stopped")?;

        progress.phase = Phase::Snapshot;
        if cancel.is_cancelled() {
            return Err(cancelled(pkg, Phase::Snapshot));
        }
        let t = Instant::now();
        let (store, p) = (self.store()?, pkg.clone());
        progress.snapshot = blocking(move || store.snapshot(&p)).await?;
        progress.timings.snapshot = t.elapsed();
        progress.backup_taken = progress.snapshot.created();
        failpoint("finalize.snapshotted")?;
        if progress.backup_taken {
            let (p, taken) = (pkg.clone(), progress.backup_taken);
            self.write_state(&mut progress.timings, move |db| {
                if let Some(PackageDataEntry {
                    state_info:
                        StateInfo::Installing { installing_info }
                        | StateInfo::Updating { installing_info },
                    ..
                }) = db.get_mut(&p)
                {
                    installing_info.phase = Phase::Uninit;
                    installing_info.backup_taken = taken;
                }
                Ok(())
            })
            .await?;
        }

        let t = Instant::now();
        if let Some(old) = old {
            progress.phase = Phase::Uninit;
            step(
                pkg,
                Phase::Uninit,
                cancel,
                svc.uninit(pkg, old, Some(&req.version)),
            )
            .await?;
            failpoint("finalize.uninit")?;
        }
        progress.phase = Phase::Install;
        step(
            pkg,
            Phase::Install,
            cancel,
            svc.install(pkg, &req.version, &req.s9pk),
        )
        .await?;
        failpoint("finalize.install")?;
        progress.phase = Phase::Init;
        step(pkg, Phase::Init, cancel, svc.init(pkg, &req.version, old)).await?;
        // What uninit, install and init wrote (a migration) is durable before
        // anything can record the install as done: the `installed` state is
        // what lets the backup go, at once or by reconcile after a crash, and
        // a power cut must not keep that record while losing the migration's
        // last writes. The new service is not running yet, so this commits
        // the migration only.
        let (store, p) = (self.store()?, pkg.clone());
        blocking(move || store.sync_volume(&p)).await?;
        failpoint("finalize.init")?;
        progress.phase = Phase::Start;
        step(pkg, Phase::Start, cancel, svc.start(pkg, &req.version)).await?;
        failpoint("finalize.start")?;
        progress.timings.service = t.elapsed();
        Ok(())
    }

    /// Uninstalls `pkg`: soft keeps its volume for a later reinstall, hard
    /// deletes it (and any backup).
    ///
    /// Order: state `removing {soft}`; stop; uninit towards no version; then
    /// delete the volume (hard) or drop a leftover backup (soft: the live
    /// volume is the installed one, known good); remove the entry; notify. A
    /// crash anywhere leaves `removing {soft}`, which reconcile finishes the
    /// same way, soft or hard as recorded.
    #[instrument(skip_all, fields(package = %pkg, soft))]
    pub async fn uninstall(&self, pkg: &PackageId, soft: bool) -> Result<(), Error> {
        let _guard = self.lock(pkg).await;
        let entry = self
            .db
            .peek()
            .await
            .get(pkg)
            .cloned()
            .ok_or_else(|| Error::for_package(pkg, ErrorKind::NotFound, "is not installed"))?;
        match entry.state_info {
            StateInfo::Installed | StateInfo::Removing { .. } => {}
            other => {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    format!("is {}; cannot uninstall now", other.name()),
                ));
            }
        }
        let p = pkg.clone();
        self.db
            .mutate(move |db| {
                if let Some(e) = db.get_mut(&p) {
                    e.state_info = StateInfo::Removing { soft };
                }
                Ok(())
            })
            .await?;
        failpoint("uninstall.recorded")?;
        self.services.stop(pkg).await?;
        failpoint("uninstall.stopped")?;
        if let Some(v) = &entry.version {
            self.services.uninit(pkg, v, None).await?;
        }
        failpoint("uninstall.uninit")?;
        let (store, p) = (self.store()?, pkg.clone());
        blocking(move || finish_removal(&store, &p, soft)).await?;
        failpoint("uninstall.volume")?;
        let p = pkg.clone();
        self.db
            .mutate(move |db| {
                db.remove(&p);
                Ok(())
            })
            .await?;
        self.notify(pkg, Event::Removed { soft });
        Ok(())
    }
}

/// The volume side of a removal: hard deletes the volume and any backup;
/// soft keeps the volume and drops a backup only if the volume is there.
pub(crate) fn finish_removal(
    store: &VolumeStore,
    pkg: &PackageId,
    soft: bool,
) -> Result<(), Error> {
    if !soft {
        store.delete(pkg)?;
    } else if store.volume_path(pkg).exists() {
        store.drop_backup(pkg)?;
    } else {
        // No live volume: the backup is the only copy of the data.
        store.restore(pkg)?;
    }
    Ok(())
}

/// For the bench: installs `version` over the installed (and running)
/// package with a fresh [`Cancel`], waits for the backup drop, and returns
/// the timings of the finalization (see [`Timings::install_done_to_notify`]
/// and [`Timings::overhead`]) and how long the drop took after the
/// notification.
#[instrument(skip_all)]
pub async fn finalize_update<D: Db, S: Services, N: Notifier>(
    finalizer: &Finalizer<D, S, N>,
    req: &InstallRequest,
) -> Result<(Timings, Duration), Error> {
    let f = finalizer.install(req, &Cancel::new()).await?;
    let t = Instant::now();
    f.backup_drop
        .await
        .map_err(|e| Error::new(eyre!("backup drop task: {e}"), ErrorKind::Unknown))?
        .with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                req.package.context("dropping the backup"),
            )
        })?;
    Ok((f.timings, t.elapsed()))
}
