//! Boot-time reconcile: finish or undo what a crash left, from the state and
//! the names on disk.

use std::path::{Path, PathBuf};

use models::{Error, PackageId};
use tracing::instrument;
use volume::{Recovery, VolumeStore};

use crate::blocking::blocking;
use crate::db::{Db, PackageDataEntry, StateInfo};
use crate::finalize::finish_removal;
use volume::failpoint::failpoint;

/// What [`reconcile`] found and did.
#[derive(Debug, Default)]
pub struct ReconcileReport {
    /// Volume operations the store's own recovery finished or undid.
    pub volume_recoveries: Vec<Recovery>,
    /// One line per package-level action, in order.
    pub actions: Vec<(PackageId, String)>,
    /// Packages left alone because nothing on record says which copy is good;
    /// nothing was deleted. A person must decide.
    pub needs_attention: Vec<(PackageId, String)>,
    /// Packages installed after reconcile, with their version: the services
    /// to start.
    pub installed: Vec<(PackageId, String)>,
}

impl ReconcileReport {
    /// Whether reconcile changed anything (a second run changes nothing).
    pub fn is_noop(&self) -> bool {
        self.volume_recoveries.is_empty() && self.actions.is_empty()
    }
}

/// Finishes or undoes, for every package entry and every backup on disk,
/// whatever a crash interrupted. Runs at boot, before any service starts
/// (nothing may have the volumes mounted).
///
/// First [`VolumeStore::open`], which finishes or undoes half-done volume
/// operations (a partial snapshot is discarded, a marked rollback copy is
/// swapped in, ...). Then, per entry:
/// - `installing`/`updating`: restore the backup if there is one (the live
///   volume may be half-migrated); without one, a fresh install that had no
///   volume before gets its volume deleted, anything else keeps its live
///   volume (untouched if the crash came before the snapshot, or already
///   restored). Then back to `installed` at the old version, or the entry is
///   removed if there was none.
/// - `installed` with a leftover backup: drop it (the install completed, the
///   live volume is known good); restore it instead if the live volume is
///   missing.
/// - `removing {soft}`: finish the removal as recorded: soft keeps the
///   volume, hard deletes it; then remove the entry.
/// - `restoring` (a restore from a backup target that never finished): the
///   data is partial and its source is still on the backup target: delete
///   it and remove the entry, as upstream does.
///
/// Then every backup with no entry: with no live volume, restore it (it is the
/// only copy); with one, leave both and report it in
/// [`ReconcileReport::needs_attention`]. A backup is only ever deleted when
/// the live volume is known good.
///
/// Idempotent, and a crash in the middle is fine: each step either leaves
/// the state as it was (so the next run redoes it) or is the last one.
#[instrument(skip_all)]
pub async fn reconcile<D: Db>(db: &D, volumes_root: &Path) -> Result<ReconcileReport, Error> {
    let root: PathBuf = volumes_root.to_owned();
    let (store, volume_recoveries) = blocking(move || {
        let store = VolumeStore::open_without_recovery(&root)?;
        let r = store.recover_all()?;
        Ok((store, r))
    })
    .await?;
    let store = std::sync::Arc::new(store);
    let mut report = ReconcileReport {
        volume_recoveries,
        ..Default::default()
    };
    let entries = db.peek().await;
    // One package that cannot be reconciled must not keep the others
    // half-done: report it and go on.
    for (pkg, entry) in entries.iter() {
        if let Err(e) = reconcile_entry(db, &store, pkg, entry, &mut report).await {
            tracing::error!(package = %pkg, "reconcile failed: {e}");
            report
                .needs_attention
                .push((pkg.clone(), format!("reconcile failed: {e}")));
        }
    }
    // Backups nobody's state explains.
    let entries = db.peek().await;
    let s = store.clone();
    let list = blocking(move || s.list()).await?;
    for info in list {
        if entries.contains_key(&info.package) || info.backup.is_none() {
            continue;
        }
        let pkg = info.package.clone();
        if info.volume.is_none() {
            let (s, p) = (store.clone(), pkg.clone());
            match blocking(move || s.restore(&p)).await {
                Ok(_) => report.actions.push((
                    pkg,
                    "restored an install backup that had no entry and no live volume".into(),
                )),
                Err(e) => report
                    .needs_attention
                    .push((pkg, format!("restoring an orphaned backup failed: {e}"))),
            }
        } else {
            report.needs_attention.push((
                pkg,
                "an install backup with no entry beside a live volume: both kept".into(),
            ));
        }
    }
    for (pkg, entry) in db.peek().await.iter() {
        if let (StateInfo::Installed, Some(v)) = (&entry.state_info, &entry.version) {
            report.installed.push((pkg.clone(), v.clone()));
        }
    }
    for (p, a) in &report.actions {
        tracing::warn!(package = %p, "reconcile: {a}");
    }
    Ok(report)
}

#[instrument(skip_all, fields(package = %pkg))]
async fn reconcile_entry<D: Db>(
    db: &D,
    store: &std::sync::Arc<VolumeStore>,
    pkg: &PackageId,
    entry: &PackageDataEntry,
    report: &mut ReconcileReport,
) -> Result<(), Error> {
    let s = store.clone();
    let p = pkg.clone();
    let (live, backup) =
        blocking(move || Ok((s.volume_path(&p).exists(), s.backup_path(&p).exists()))).await?;
    let mut act = |a: String| report.actions.push((pkg.clone(), a));
    match &entry.state_info {
        StateInfo::Installing { installing_info } | StateInfo::Updating { installing_info } => {
            let (s, p, had) = (store.clone(), pkg.clone(), installing_info.had_volume);
            let taken = installing_info.backup_taken;
            let did = blocking(move || {
                if s.restore(&p)? {
                    Ok("restored the install backup")
                } else if !had && s.delete(&p)? {
                    Ok("deleted the volume a failed fresh install created")
                } else if taken {
                    // backup_taken and no backup: only a restore removes it
                    // before the state says installed.
                    Ok("kept the live volume (the rollback had completed)")
                } else {
                    Ok("kept the live volume (no backup was taken before the crash)")
                }
            })
            .await?;
            failpoint("reconcile.restored")?;
            let (p, old) = (pkg.clone(), entry.version.clone());
            db.mutate(move |db| {
                match old {
                    Some(_) => {
                        if let Some(e) = db.get_mut(&p) {
                            e.state_info = StateInfo::Installed;
                        }
                    }
                    None => {
                        db.remove(&p);
                    }
                }
                Ok(())
            })
            .await?;
            act(format!(
                "interrupted {} to {}: {did}; back to {}",
                entry.state_info.name(),
                installing_info.new_version,
                entry
                    .version
                    .as_deref()
                    .map_or("not installed".to_owned(), |v| format!("version {v}")),
            ));
        }
        StateInfo::Installed if backup => {
            let (s, p) = (store.clone(), pkg.clone());
            if live {
                blocking(move || s.drop_backup(&p)).await?;
                act("dropped the backup a finished install left".into());
            } else {
                blocking(move || s.restore(&p)).await?;
                act("installed but no live volume: restored the backup".into());
            }
        }
        StateInfo::Installed => {}
        StateInfo::Removing { soft } => {
            let (s, p, soft) = (store.clone(), pkg.clone(), *soft);
            blocking(move || finish_removal(&s, &p, soft)).await?;
            let p = pkg.clone();
            db.mutate(move |db| {
                db.remove(&p);
                Ok(())
            })
            .await?;
            act(format!(
                "finished an interrupted {} uninstall",
                if soft { "soft (volume kept)" } else { "hard" }
            ));
        }
        StateInfo::Restoring => {
            let (s, p) = (store.clone(), pkg.clone());
            blocking(move || s.delete(&p)).await?;
            let p = pkg.clone();
            db.mutate(move |db| {
                db.remove(&p);
                Ok(())
            })
            .await?;
            act("deleted the partial data of an interrupted restore from backup".into());
        }
    }
    Ok(())
}
