//! (f) A volume of NOCOW files (bitcoind's package sets `+C` on its data
//! directory) whose root is still a plain directory (a box converted from
//! ext4 whose boot conversion has not run or failed): is a backup taken
//! before the update, and is a missing one reported?
//!
//! Each side runs `begin()` and `snapshot()`, the update changes the
//! volume, the update fails and each side runs `restore()`. Upstream's
//! caller ignores what `snapshot()` returns, so its only report of a
//! missing backup is a log line; a restore with no backup is a no-op.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{Context, Report, Result, Row, Side, block_on, digest};
use crate::upstream;

/// One side's run.
#[derive(Clone, Debug)]
pub struct NocowOutcome {
    /// What `snapshot()` returned (upstream's caller ignores it).
    pub backup_taken: bool,
    /// What kind of backup, or why none, as the side reports it.
    pub reported: String,
    /// Whether the backup holds the volume as it was, NOCOW flags
    /// included.
    pub backup_complete: bool,
    /// Whether the failed update's restore brought the volume back to what
    /// it was before the update.
    pub rolled_back: bool,
    /// `begin()` and `snapshot()`.
    pub snapshot_time: Duration,
    /// `restore()`.
    pub restore_time: Duration,
}

/// Both sides' runs.
#[derive(Clone, Debug)]
pub struct NocowComparison {
    /// Upstream's baseline.
    pub upstream: NocowOutcome,
    /// Ours.
    pub ours: NocowOutcome,
}

/// Runs the scenario on one filesystem, each side under its own root.
pub fn run(scale: &super::Scale) -> Result<NocowComparison> {
    let (fs, _) = super::scratch(scale)?;
    let run_side = |side: Side| -> Result<NocowOutcome> {
        let root = fs.path(side.to_string());
        fs::create_dir(&root).ctx("creating a volumes root")?;
        side_run(side, &root).ctx(format!("{side}'s NOCOW backup"))
    };
    Ok(NocowComparison {
        upstream: run_side(Side::Upstream)?,
        ours: run_side(Side::Ours)?,
    })
}

fn side_run(side: Side, root: &Path) -> Result<NocowOutcome> {
    let pkg = "bitcoind";
    let live = root.join(pkg);
    let backup = root.join(format!("{pkg}{}", upstream::INSTALL_BACKUP_SUFFIX));
    fs::create_dir(&live).ctx("creating the plain volume")?;
    super::trees::nocow_volume(&live)?;
    let before = digest(&live)?;
    let flags_before = super::trees::flags_of(&live)?;
    let theirs = upstream::InstallBackup::new(root, pkg);
    let ours = startos_core::volume::InstallBackup::at(root, pkg);

    let started = Instant::now();
    let (backup_taken, reported) = match side {
        Side::Upstream => {
            theirs.begin()?;
            let taken = theirs.snapshot()?;
            let log = theirs.log().lines();
            let said = log
                .iter()
                .find(|l| l.starts_with("warn"))
                .cloned()
                .unwrap_or_else(|| "nothing logged".into());
            (taken, said)
        }
        Side::Ours => {
            let outcome = block_on(async {
                ours.begin().await?;
                ours.snapshot_outcome().await
            })
            .ctx("begin and snapshot")?;
            let said = match &outcome {
                volume::SnapshotOutcome::Snapshot => "a read-only snapshot".to_owned(),
                volume::SnapshotOutcome::ReflinkCopy { extents } => {
                    format!("a reflink copy ({extents} extents)")
                }
                volume::SnapshotOutcome::Skipped { reason } => format!("skipped: {reason}"),
                volume::SnapshotOutcome::NoVolume => "no volume".to_owned(),
            };
            (outcome.created(), said)
        }
    };
    let snapshot_time = started.elapsed();
    let backup_complete = backup_taken
        && crate::tree_digest(&backup).is_ok_and(|d| {
            let mut d = d;
            // The backup is a copy under another name: its top may be a
            // fresh directory, its contents must be the same.
            if let (Some(top), Some(orig)) = (d.entries_mut().get_mut(&Vec::new()), before.get(""))
            {
                *top = orig.clone();
            }
            d == before
        })
        && super::trees::flags_of(&backup).is_ok_and(|f| f == flags_before);

    // The update rewrites block files and the chainstate, then fails.
    fs::write(live.join("data/main/blocks/blk00000.dat"), b"reindexed").ctx("update")?;
    fs::write(live.join("data/main/chainstate/000000.ldb"), b"new format").ctx("update")?;

    let started = Instant::now();
    match side {
        Side::Upstream => theirs.restore()?,
        Side::Ours => block_on(ours.restore()).ctx("restore")?,
    }
    let restore_time = started.elapsed();
    let rolled_back = crate::tree_digest(&live).is_ok_and(|d| d == before);
    Ok(NocowOutcome {
        backup_taken,
        reported,
        backup_complete,
        rolled_back,
        snapshot_time,
        restore_time,
    })
}

fn backup_cell(o: &NocowOutcome, side: Side) -> String {
    match (o.backup_taken, side) {
        (false, Side::Upstream) => format!(
            "none: snapshot() = false, which its caller ignores; only a log line: \"{}\"",
            o.reported.rsplit(": ").next().unwrap_or(&o.reported)
        ),
        (false, Side::Ours) => format!("none, reported: {}", o.reported),
        (true, _) => format!(
            "{}{}",
            o.reported,
            if o.backup_complete {
                ", complete, NOCOW kept"
            } else {
                ", INCOMPLETE"
            }
        ),
    }
}

fn rollback_cell(o: &NocowOutcome) -> String {
    if o.rolled_back {
        "yes: the volume is as before the update".into()
    } else {
        "no: restore() had no backup, the new version's data stays".into()
    }
}

impl Report for NocowComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new(
                "f. NOCOW files, plain-dir root",
                backup_cell(u, Side::Upstream),
                backup_cell(o, Side::Ours),
            )
            .timed(u.snapshot_time, o.snapshot_time),
            Row::new(
                "  failed update rolled back",
                rollback_cell(u),
                rollback_cell(o),
            )
            .timed(u.restore_time, o.restore_time),
        ]
    }
}
