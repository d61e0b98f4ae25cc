//! (a) Nested subvolumes, writable and read-only, through a snapshot and a
//! restore.
//!
//! A package's process can create subvolumes inside its volume (any user
//! with write access can). The volume gets `data/main/nested` (writable),
//! `data/main/nested/deeper/inner` (writable, two levels down) and
//! `data/main/frozen` (read-only), each with data. Both sides take the
//! install backup, the update then changes the volume (the nested data
//! included), and the update fails: both restore. Then, for each nested
//! subvolume: is its data what it was at the backup, is it still a
//! subvolume, did it keep its read-only flag, can the service still write
//! in the writable ones.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::trees::{self, NESTED};
use super::{Backups, Context, Report, Result, Row, Side, block_on, count_of, digest};
use crate::upstream;

/// What became of one nested subvolume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NestedCheck {
    /// Its path in the volume.
    pub path: &'static str,
    /// Whether it was read-only.
    pub read_only_before: bool,
    /// Whether the backup holds its data as it was.
    pub in_backup: bool,
    /// Whether, after the restore, its data is what it was at the backup.
    pub data_kept: bool,
    /// Whether, after the restore, it is still a subvolume.
    pub still_subvolume: bool,
    /// Whether, after the restore, it is read-only exactly if it was.
    pub read_only_kept: bool,
    /// Whether, after the restore, a file can be created in it (the
    /// writable ones only; `None` for the read-only one).
    pub writable: Option<bool>,
}

/// One side's run.
#[derive(Clone, Debug)]
pub struct NestedOutcome {
    /// What `snapshot()` returned.
    pub backup_taken: bool,
    /// Whether the backup is read-only.
    pub backup_read_only: bool,
    /// One check per nested subvolume, in [`super::trees::NESTED`] order.
    pub nested: Vec<NestedCheck>,
    /// The snapshot call.
    pub snapshot_time: Duration,
    /// The restore call.
    pub restore_time: Duration,
    /// Why the restore failed, if it did.
    pub restore_error: Option<String>,
}

impl NestedOutcome {
    /// Nested subvolumes whose data survived the round trip.
    pub fn data_kept(&self) -> usize {
        self.nested.iter().filter(|n| n.data_kept).count()
    }
}

/// Both sides' runs.
#[derive(Clone, Debug)]
pub struct NestedComparison {
    /// Upstream's baseline.
    pub upstream: NestedOutcome,
    /// Ours.
    pub ours: NestedOutcome,
}

/// Runs the scenario on one filesystem, each side under its own root.
pub fn run(scale: &super::Scale) -> Result<NestedComparison> {
    let (fs, _) = super::scratch(scale)?;
    let run_side = |side: Side| -> Result<NestedOutcome> {
        let root = fs.path(side.to_string());
        fs::create_dir(&root).ctx("creating a volumes root")?;
        side_run(side, &root).ctx(format!("{side}'s nested-subvolume run"))
    };
    Ok(NestedComparison {
        upstream: run_side(Side::Upstream)?,
        ours: run_side(Side::Ours)?,
    })
}

fn side_run(side: Side, root: &Path) -> Result<NestedOutcome> {
    let pkg = "app";
    let live = root.join(pkg);
    let backup = root.join(format!("{pkg}{}", upstream::INSTALL_BACKUP_SUFFIX));
    let backups = Backups::new(root, pkg);
    let (theirs, ours) = (&backups.theirs, &backups.ours);
    backups.ensure_volume_root(side, root, pkg)?;
    trees::nested_volume(&live)?;
    let mut at_backup = BTreeMap::new();
    for path in NESTED {
        at_backup.insert(path, digest(&live.join(path))?);
    }

    let started = Instant::now();
    let backup_taken = backups.begin_and_snapshot(side)?;
    let snapshot_time = started.elapsed();
    let mut in_backup = BTreeMap::new();
    for path in NESTED {
        let d = crate::tree_digest(&backup.join(path)).ok();
        in_backup.insert(path, d.as_ref() == at_backup.get(path));
    }
    let backup_read_only = trees::is_read_only(&backup);

    // The new version changes the database and the nested data.
    fs::write(live.join("data/main/db.sqlite"), b"new schema").ctx("updating the volume")?;
    fs::write(live.join("data/main/nested/blob"), b"rewritten").ctx("updating nested")?;
    fs::write(live.join("data/main/nested/deeper/inner/wal"), b"rewritten")
        .ctx("updating inner")?;

    let started = Instant::now();
    let restored = match side {
        Side::Upstream => theirs.restore().map_err(|e| e.to_string()),
        Side::Ours => block_on(ours.restore()).map_err(|e| e.to_string()),
    };
    let restore_time = started.elapsed();

    // Every digest before any probe: a probe changes its directory's mtime.
    let mut nested = Vec::new();
    for path in NESTED {
        let p = live.join(path);
        let read_only_before = path.ends_with("frozen");
        nested.push(NestedCheck {
            path,
            read_only_before,
            in_backup: in_backup[path],
            data_kept: crate::tree_digest(&p).ok().as_ref() == at_backup.get(path),
            still_subvolume: trees::is_subvolume(&p),
            read_only_kept: trees::is_read_only(&p) == read_only_before,
            writable: None,
        });
    }
    for check in nested.iter_mut().filter(|c| !c.read_only_before) {
        let probe = live.join(check.path).join(".probe");
        check.writable = Some(fs::write(&probe, b"x").is_ok());
        let _ = fs::remove_file(&probe);
    }
    Ok(NestedOutcome {
        backup_taken,
        backup_read_only,
        nested,
        snapshot_time,
        restore_time,
        restore_error: restored.err(),
    })
}

fn backup_cell(o: &NestedOutcome) -> String {
    if !o.backup_taken {
        return "no backup".into();
    }
    let held = o.nested.iter().filter(|n| n.in_backup).count();
    let kind = if o.backup_read_only {
        "read-only"
    } else {
        "writable"
    };
    format!(
        "{kind}; nested data in it: {}",
        count_of(held, o.nested.len())
    )
}

fn data_cell(o: &NestedOutcome) -> String {
    if let Some(e) = &o.restore_error {
        return format!("restore failed: {e}");
    }
    let n = o.nested.len();
    let kept = o.data_kept();
    if kept == n {
        format!("kept: all {n}")
    } else {
        format!("lost: {} (emptied)", count_of(n - kept, n))
    }
}

fn subvolume_cell(o: &NestedOutcome) -> String {
    let n = o.nested.iter().filter(|c| c.still_subvolume).count();
    let writable: Vec<&NestedCheck> = o.nested.iter().filter(|c| c.writable.is_some()).collect();
    let unwritable = writable
        .iter()
        .filter(|c| c.writable == Some(false))
        .count();
    let mut s = count_of(n, o.nested.len());
    if unwritable > 0 {
        s.push_str(&format!(
            "; {} of {} unwritable (EPERM)",
            unwritable,
            writable.len()
        ));
    }
    s
}

fn read_only_cell(o: &NestedOutcome) -> String {
    let ro: Vec<&NestedCheck> = o.nested.iter().filter(|c| c.read_only_before).collect();
    if ro.iter().all(|c| c.read_only_kept && c.still_subvolume) {
        "kept".into()
    } else {
        "lost".into()
    }
}

impl Report for NestedComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new(
                "a. nested subvols (2 rw, 1 ro)",
                backup_cell(u),
                backup_cell(o),
            )
            .timed(u.snapshot_time, o.snapshot_time),
            Row::new("  restore: data", data_cell(u), data_cell(o))
                .timed(u.restore_time, o.restore_time),
            Row::new("  still subvolumes", subvolume_cell(u), subvolume_cell(o)),
            Row::new("  read-only flag", read_only_cell(u), read_only_cell(o)),
        ]
    }
}
