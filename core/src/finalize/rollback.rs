//! Rollback of a failed install: stop the new service, put the backup back
//! (or delete a fresh install's volume), state `installed` at the old version,
//! start it again, and the failure notification saying what happened.
//!
//! Every step here changes the disk only while the state still says the
//! install is in flight, so a crash in the middle of a rollback leaves what
//! [`crate::reconcile`] finishes at the next boot.

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt};
use tracing::instrument;
use volume::SnapshotOutcome;
use volume::failpoint::failpoint;

use super::{Finalizer, InstallRequest, Progress};
use crate::blocking::blocking;
use crate::db::{Db, PackageDataEntry, Phase, StateInfo};
use crate::notify::{Event, Notifier};
use crate::service::Services;

/// What a rollback did once the volume and the state were back.
struct RolledBack {
    /// Starting the old version again (Ok where there is none).
    restart: Result<(), Error>,
    /// The services stopped because they held a mount of the volume, each
    /// with how starting it again went.
    holders: Vec<(PackageId, Result<(), Error>)>,
    /// The backup the update took was gone when the rollback came to
    /// restore it (another command dropped or restored it meanwhile):
    /// nothing was restored, and the volume keeps what the failed update
    /// wrote. Its own outcome, never told as a rollback of the data.
    backup_gone: bool,
}

impl RolledBack {
    /// `message` with what restarting after the restore went like: the old
    /// version not starting again, and the services stopped because they
    /// held a mount of the volume, each that did not start again named.
    fn told(&self, message: String) -> String {
        let mut message = message;
        if self.backup_gone {
            message.push_str(
                "; the install backup taken before the update was gone when the rollback \
                 ran (dropped or restored by another command meanwhile), so the data was not \
                 rolled back: the volume keeps what the failed update wrote",
            );
        }
        let mut message = match &self.restart {
            Ok(()) => message,
            Err(e) => format!("{message}; the old version did not start again: {e}"),
        };
        if !self.holders.is_empty() {
            let names: Vec<&str> = self.holders.iter().map(|(h, _)| h.as_str()).collect();
            message.push_str(&format!(
                "; stopped {} for the restore (holding a mount of its volume) and \
                 started {} again",
                names.join(", "),
                if names.len() == 1 { "it" } else { "them" }
            ));
            for (h, r) in &self.holders {
                if let Err(e) = r {
                    message.push_str(&format!("; {h} did not start again: {e}"));
                }
            }
        }
        message
    }
}

/// `message` with, for an update that got past the snapshot without a
/// backup, why there was none and that the volume keeps what the failed
/// `what` wrote.
///
/// Without a backup (not btrfs, or a plain directory too fragmented to
/// copy: upstream's fallbacks) nothing can be rolled back once the old
/// version's uninit or the new one's install has run: say so rather than
/// claim the old data is back.
fn without_backup(
    message: String,
    what: &str,
    update: bool,
    had_volume: bool,
    progress: &Progress,
) -> String {
    let unprotected =
        update && had_volume && !progress.backup_taken && progress.phase > Phase::Snapshot;
    if unprotected {
        let why = match &progress.snapshot {
            SnapshotOutcome::Skipped { reason } => reason.clone(),
            _ => "no backup was taken".to_owned(),
        };
        format!(
            "{message}; there was no install backup ({why}), so the volume keeps what the failed {what} wrote"
        )
    } else {
        message
    }
}

impl<D: Db, S: Services, N: Notifier> Finalizer<D, S, N> {
    /// Undoes a failed install: see [`Finalizer::install`]. Returns the
    /// error to hand back.
    #[instrument(skip_all)]
    pub(super) async fn roll_back(
        &self,
        req: &InstallRequest,
        old: Option<(String, String)>,
        had_volume: bool,
        failed_kind: ErrorKind,
        progress: &mut Progress,
        cause: Error,
    ) -> Error {
        let pkg = &req.package;
        let phase = progress.phase;
        let kind = if cause.kind == ErrorKind::Cancelled {
            ErrorKind::Cancelled
        } else {
            failed_kind
        };
        let what = if old.is_some() { "update" } else { "install" };
        let message = pkg.context(format!(
            "{what} to {} failed in {phase}: {cause}",
            req.version
        ));
        tracing::warn!("{message}; rolling back");
        let message = without_backup(message, what, old.is_some(), had_volume, progress);
        let taken = progress.backup_taken;
        match self.restore_old(pkg, old.as_ref(), had_volume, taken).await {
            Ok(back) => {
                let rolled_back_to = old.map(|(v, _)| v);
                let message = back.told(message);
                self.notify(
                    pkg,
                    Event::Failed {
                        phase,
                        kind,
                        message: message.clone(),
                        rolled_back_to,
                    },
                );
                // Only now: see `purge_replaced`.
                self.purge_replaced(pkg).await;
                Error::new(eyre!("{message}"), kind)
            }
            Err(e) => {
                let message =
                    format!("{message}; rolling back failed too, the next boot finishes it: {e}");
                self.notify(
                    pkg,
                    Event::Failed {
                        phase,
                        kind: ErrorKind::Incoherent,
                        message: message.clone(),
                        rolled_back_to: None,
                    },
                );
                Error::new(eyre!("{message}"), ErrorKind::Incoherent)
            }
        }
    }

    /// Deletes the volume a restore replaced, after the failure
    /// notification: that evicts its cached pages (seconds for a database
    /// the service had in memory), which neither the old service nor the
    /// notification should wait for. Garbage if it fails (or a crash
    /// interrupts it): the next volume operation's recovery deletes it.
    async fn purge_replaced(&self, pkg: &PackageId) {
        if let Some(store) = self.store().log_err() {
            let p = pkg.clone();
            let root = store.root().to_owned();
            blocking(move || store.purge(&p)).await.log_err();
            // A backup taken before the first boot's cleanup holds
            // the rest its conversion set aside: removed again, so
            // that it pins no space past the backup.
            let p = pkg.clone();
            blocking(move || crate::volume::release_rest(&root, &p))
                .await
                .log_err();
        }
    }

    /// Stop, restore, state, start. An error means the volume or the state
    /// could not be put back (the state still says in flight); what
    /// restarting went like is in [`RolledBack`].
    ///
    /// Services holding a mount of the volume in a mount namespace of their
    /// own (a dependent's container) are stopped before the restore, which
    /// would refuse to swap the volume from under them, and started again
    /// after it.
    #[instrument(skip_all)]
    async fn restore_old(
        &self,
        pkg: &PackageId,
        old: Option<&(String, String)>,
        had_volume: bool,
        backup_taken: bool,
    ) -> Result<RolledBack, Error> {
        self.services.stop(pkg).await?;
        failpoint("rollback.stopped")?;
        // Whatever happens from here, every holder stopped is started again.
        let mut stopped = Vec::new();
        let back = self
            .put_back(pkg, old, (had_volume, backup_taken), &mut stopped)
            .await;
        let restart = match (&back, old) {
            (Ok(_), Some((v, _))) => self.services.start(pkg, v).await,
            _ => Ok(()),
        };
        let holders = self.start_again(stopped).await;
        match back {
            Ok(backup_gone) => Ok(RolledBack {
                restart,
                holders,
                backup_gone,
            }),
            Err(e) => {
                for (h, r) in holders {
                    match r {
                        Ok(()) => {
                            tracing::info!(package = %pkg, holder = %h, "started again after a failed restore")
                        }
                        Err(e) => {
                            tracing::error!(package = %pkg, holder = %h, "did not start again after a failed restore: {e}")
                        }
                    }
                }
                Err(e)
            }
        }
    }

    /// The volume and the state put back: holders of mounts of the volume
    /// stopped (each added to `stopped` as it is), the backup restored (or
    /// a fresh install's volume deleted), the state back to the old version.
    /// `(had_volume, backup_taken)` say what the install found and made.
    /// Returns whether the backup it took was gone, so nothing was restored
    /// (logged as an error here).
    async fn put_back(
        &self,
        pkg: &PackageId,
        old: Option<&(String, String)>,
        (had_volume, backup_taken): (bool, bool),
        stopped: &mut Vec<(PackageId, Option<String>)>,
    ) -> Result<bool, Error> {
        self.stop_mount_holders(pkg, stopped).await?;
        let (store, p) = (self.store()?, pkg.clone());
        let restored = blocking(move || {
            let restored = store.restore_deferring_purge(&p)?;
            if !restored && !had_volume {
                // A fresh install with nothing before it: the volume holds
                // only what the failed install wrote.
                store.delete(&p)?;
            }
            Ok(restored)
        })
        .await?;
        let backup_gone = had_volume && backup_taken && !restored;
        if backup_gone {
            tracing::error!(package = %pkg, "the install backup was gone at the rollback: nothing restored, the volume keeps what the failed install wrote");
        }
        failpoint("rollback.restored")?;
        let p = pkg.clone();
        let back = old.cloned();
        self.db
            .mutate(move |db| {
                match back {
                    Some((v, s9pk)) => {
                        db.insert(
                            p,
                            PackageDataEntry {
                                state_info: StateInfo::Installed,
                                version: Some(v),
                                s9pk,
                            },
                        );
                    }
                    None => {
                        db.remove(&p);
                    }
                }
                Ok(())
            })
            .await?;
        failpoint("rollback.recorded")?;
        Ok(backup_gone)
    }

    /// Stops every service that holds a mount of `pkg`'s volume in a mount
    /// namespace of its own, as [`Services::service_of`] names them, adding
    /// each, with the version to start again, to `stopped` (mounts in this
    /// process's own namespace belong to no one service).
    async fn stop_mount_holders(
        &self,
        pkg: &PackageId,
        stopped: &mut Vec<(PackageId, Option<String>)>,
    ) -> Result<(), Error> {
        let (store, p) = (self.store()?, pkg.clone());
        let uses = blocking(move || store.mount_uses(&p)).await?;
        let mut holders: Vec<PackageId> = Vec::new();
        for u in uses.iter().filter(|u| !u.own_namespace) {
            let holder = u.pids.iter().find_map(|pid| self.services.service_of(*pid));
            if let Some(h) = holder.filter(|h| h != pkg && !holders.contains(h)) {
                holders.push(h);
            }
        }
        let db = self.db.peek().await;
        for h in holders {
            tracing::warn!(package = %pkg, holder = %h, "stopping a service that holds a mount of the volume, for the restore");
            let version = db.get(&h).and_then(|e| e.version.clone());
            // Listed before the stop: a stop that fails half-way still gets
            // a start (which does nothing for a service still running).
            stopped.push((h.clone(), version));
            self.services.stop(&h).await?;
        }
        Ok(())
    }

    /// Starts again the services [`Finalizer::stop_mount_holders`] stopped.
    async fn start_again(
        &self,
        holders: Vec<(PackageId, Option<String>)>,
    ) -> Vec<(PackageId, Result<(), Error>)> {
        let mut out = Vec::with_capacity(holders.len());
        for (h, version) in holders {
            let r = match &version {
                Some(v) => self.services.start(&h, v).await,
                None => Err(Error::for_package(
                    &h,
                    ErrorKind::Incoherent,
                    "has no installed version to start",
                )),
            };
            out.push((h, r));
        }
        out
    }
}
