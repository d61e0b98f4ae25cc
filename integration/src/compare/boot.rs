//! (g) A box of four packages, all plain directories (as after the
//! ext4-to-btrfs conversion), converted at boot: how long until every
//! service may start, and what happens to the old trees.
//!
//! The packages: `alpha`, many small files; `bitcoind`, NOCOW block files
//! and chainstate; `monerod`, one database file fragmented to many extents
//! ([`crate::make_fragmented_file`]); `nextcloud`, some larger files. Each
//! side gets its own filesystem with the same content, settled before the
//! timed boot. Upstream's services start when its boot maintenance
//! returns (its boot runs it before `services.init`); ours may start each
//! package as soon as it is reported ready (`BootProgress::package_ready`);
//! the last of those is when every service may start. The old trees:
//! upstream removes them inline, before returning; ours in the background,
//! timed until that task ends. And, package by package, the share of
//! entries that kept their inode number and birth time (upstream's issue
//! #3858), and their ctime.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use models::PackageId;

use super::trees;
use super::{Context, Progress, Report, Result, Row, Side, block_on, digest, leftovers};
use crate::identity::{Kept, identities};
use crate::{Subvolume, TreeDigest, upstream};

/// The box's packages.
pub const PACKAGES: [&str; 4] = ["alpha", "bitcoind", "monerod", "nextcloud"];

/// One side's boot.
#[derive(Clone, Debug)]
pub struct BootOutcome {
    /// When each package's service may start, from the boot's start.
    pub ready: Vec<(String, Duration)>,
    /// When every service may start.
    pub all_ready: Duration,
    /// When the boot maintenance call returned.
    pub returned: Duration,
    /// When the old trees were all removed (upstream: before it returned).
    pub old_removed: Duration,
    /// Packages converted to subvolumes.
    pub converted: usize,
    /// Packages whose volume is exactly what it was (beyond the top
    /// becoming a subvolume).
    pub lossless: usize,
    /// Names left under the root beside the volumes.
    pub leftovers: Vec<String>,
    /// Per package, how many entries kept their inode number and birth
    /// time, and their ctime.
    pub identity: Vec<(String, Kept)>,
}

/// Both sides' boots.
#[derive(Clone, Debug)]
pub struct BootComparison {
    /// Upstream's baseline.
    pub upstream: BootOutcome,
    /// Ours.
    pub ours: BootOutcome,
    /// The monerod database's extents.
    pub db_extents: u64,
}

/// Fills the four plain-directory volumes under `root`; returns the
/// database file's extent count.
fn build(root: &Path, scale: &super::Scale) -> Result<u64> {
    for p in PACKAGES {
        fs::create_dir(root.join(p)).ctx("creating a plain volume")?;
    }
    let m = root.join("alpha/data/main");
    for i in 0..scale.boot_small_files {
        let dir = m.join(format!("d{:03}", i / 100));
        if i % 100 == 0 {
            fs::create_dir_all(&dir).ctx("mkdir")?;
        }
        let len = 2048 + (i as usize * 37) % 6144;
        fs::write(
            dir.join(format!("f{i:05}")),
            trees::bytes(u64::from(i), len),
        )
        .ctx("writing a small file")?;
    }
    trees::nocow_volume(&root.join("bitcoind"))?;
    let db = root.join("monerod/data/main/lmdb/data.mdb");
    fs::create_dir_all(db.parent().ok_or("no parent")?).ctx("mkdir lmdb")?;
    let extents = crate::make_fragmented_file(&db, scale.boot_db_bytes, scale.boot_db_extents, 42)
        .ctx("fragmenting the database")?;
    let m = root.join("nextcloud/data/main");
    fs::create_dir_all(&m).ctx("mkdir")?;
    for i in 0..8 {
        fs::write(
            m.join(format!("photo{i}.jpg")),
            trees::bytes(100 + i, 1 << 20),
        )
        .ctx("writing a photo")?;
    }
    Ok(extents)
}

/// Runs the scenario, each side on its own filesystem.
pub fn run(scale: &super::Scale) -> Result<BootComparison> {
    let (upstream, db_extents) = side_run(scale, Side::Upstream).ctx("upstream's boot")?;
    let (ours, _) = side_run(scale, Side::Ours).ctx("our boot")?;
    Ok(BootComparison {
        upstream,
        ours,
        db_extents,
    })
}

fn side_run(scale: &super::Scale, side: Side) -> Result<(BootOutcome, u64)> {
    let (fs, root) = super::scratch(scale)?;
    let extents = build(&root, scale)?;
    let mut expected: Vec<TreeDigest> = Vec::new();
    for p in PACKAGES {
        let mut d = digest(&root.join(p))?;
        if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
            top.subvolume = Subvolume::Root;
        }
        expected.push(d);
    }
    let before: Vec<_> = PACKAGES
        .iter()
        .map(|p| identities(&root.join(p)).ctx("reading identities"))
        .collect::<Result<_>>()?;
    let ids: BTreeSet<PackageId> = PACKAGES
        .iter()
        .map(|p| p.parse::<PackageId>().ctx("package id"))
        .collect::<Result<_>>()?;
    super::settle(fs.mount_point())?;
    if scale.cold {
        // The page cache would favour whichever side ran second.
        drop_caches();
    }

    let mut progress = Progress::new();
    let started = Instant::now();
    let outcome = match side {
        Side::Upstream => {
            let report = upstream::boot_volume_maintenance(&root, &ids, &ids, &mut progress)?;
            let returned = started.elapsed();
            if let Some(c) = report.conversions.iter().find(|c| c.error.is_some()) {
                return Err(format!("{}: {:?}", c.package, c.error).into());
            }
            BootOutcome {
                // Upstream's services start once it returns.
                ready: PACKAGES.iter().map(|p| (p.to_string(), returned)).collect(),
                all_ready: returned,
                returned,
                old_removed: returned,
                converted: 0,
                lossless: 0,
                leftovers: Vec::new(),
                identity: Vec::new(),
            }
        }
        Side::Ours => block_on(async {
            let mut b =
                startos_core::volume::boot_volume_maintenance_at(&root, &ids, &ids, &mut progress)
                    .await
                    .ctx("boot maintenance")?;
            let returned = started.elapsed();
            if let Some((p, e)) = b.failed.first() {
                return Err(format!("{p}: {e}").into());
            }
            if let Some(c) = b.cleanup.take() {
                c.await.ctx("cleanup task")?.ctx("cleanup")?;
            }
            let old_removed = started.elapsed();
            let all_ready = progress
                .ready
                .iter()
                .map(|(_, at)| *at)
                .max()
                .unwrap_or(returned);
            Ok::<_, super::Failure>(BootOutcome {
                ready: progress.ready.clone(),
                all_ready,
                returned,
                old_removed,
                converted: 0,
                lossless: 0,
                leftovers: Vec::new(),
                identity: Vec::new(),
            })
        })?,
    };
    let mut outcome = outcome;
    for (p, want) in PACKAGES.iter().zip(&expected) {
        let live = root.join(p);
        outcome.converted += usize::from(trees::is_subvolume(&live));
        outcome.lossless += usize::from(crate::tree_digest(&live).is_ok_and(|d| d == *want));
    }
    outcome.leftovers = leftovers(&root, &PACKAGES)?;
    for (p, before) in PACKAGES.iter().zip(&before) {
        let after = identities(&root.join(p)).ctx("reading identities")?;
        outcome
            .identity
            .push((p.to_string(), Kept::of(before, &after)));
    }
    Ok((outcome, extents))
}

/// Drops clean page-cache pages, best effort (needs root; a failure only
/// makes the timings warmer).
fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", b"1");
}

fn start_cell(o: &BootOutcome, side: Side) -> String {
    let first = o.ready.iter().map(|(_, t)| *t).min().unwrap_or_default();
    match side {
        Side::Upstream => format!(
            "all {} services wait for the whole maintenance",
            o.ready.len()
        ),
        Side::Ours => format!(
            "each starts once its own volume is ready: first after {}, last after {}",
            super::table::fmt_duration(first),
            super::table::fmt_duration(o.all_ready)
        ),
    }
}

fn old_cell(o: &BootOutcome, side: Side) -> String {
    let removed = if o.leftovers.is_empty() {
        String::new()
    } else {
        format!("; left: {}", o.leftovers.join(", "))
    };
    match side {
        Side::Upstream => format!("removed inline, before any service starts{removed}"),
        Side::Ours => format!(
            "removed in the background, done after {}{removed}",
            super::table::fmt_duration(o.old_removed)
        ),
    }
}

fn identity_cell(o: &BootOutcome) -> String {
    o.identity
        .iter()
        .map(|(p, k)| format!("{p} {}", k.describe()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ready_cell(o: &BootOutcome) -> String {
    o.ready
        .iter()
        .map(|(p, t)| format!("{p} {}", super::table::fmt_duration(*t)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Report for BootComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        let n = PACKAGES.len();
        vec![
            Row::new(
                format!("g. boot: {n} plain-dir packages"),
                start_cell(u, Side::Upstream),
                start_cell(o, Side::Ours),
            )
            .timed(u.all_ready, o.all_ready),
            Row::new("  ready, package by package", ready_cell(u), ready_cell(o)),
            Row::new(
                "  entries keeping inode+birth / ctime",
                identity_cell(u),
                identity_cell(o),
            ),
            Row::new(
                "  old trees",
                old_cell(u, Side::Upstream),
                old_cell(o, Side::Ours),
            )
            .timed(u.old_removed, o.old_removed),
            Row::new(
                format!(
                    "  result (db: {} extents)",
                    super::table::fmt_count(self.db_extents)
                ),
                format!("{} of {n} converted, {} lossless", u.converted, u.lossless),
                format!("{} of {n} converted, {} lossless", o.converted, o.lossless),
            ),
        ]
    }
}
