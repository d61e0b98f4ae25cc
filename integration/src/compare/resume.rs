//! (d) A conversion killed at 90% and run again: how much of the work is
//! done again.
//!
//! The plain-directory volume holds [`super::Scale::resume_files`] equal
//! files, each fragmented like a database. Each side's conversion is killed
//! once 90% of the bytes are cloned: upstream's boot maintenance after its
//! ninth file of ten (its clone goes file by file, 1 GiB chunks), ours
//! (volume-migrate with the clone method forced, so that there is a clone
//! to interrupt whatever boot's `Auto` would pick) after 36 of its 40
//! chunks. Then the conversion runs again: bytes cloned on the rerun
//! against the total, the rerun's time, and whether the result is
//! lossless.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use models::PackageId;

use super::{
    ChildOp, Context, Launcher, Progress, Report, Result, Row, Side, clone_options, digest, kill_at,
};
use crate::{Subvolume, upstream};

/// One side's killed and rerun conversion.
#[derive(Clone, Debug)]
pub struct ResumeOutcome {
    /// Bytes of file data in the volume.
    pub total_bytes: u64,
    /// Bytes cloned when the first run was killed.
    pub killed_after: u64,
    /// Bytes the rerun cloned.
    pub rerun_cloned: u64,
    /// Whether the rerun said it resumed a partial copy.
    pub resumed: bool,
    /// The rerun, until the volume was a subvolume (the old tree's removal
    /// excluded for ours, which does it after services start; included for
    /// upstream, which does it inline).
    pub rerun_time: Duration,
    /// Whether the volume is then a subvolume with every entry as before.
    pub lossless: bool,
}

impl ResumeOutcome {
    /// The share of the total that the rerun cloned again.
    pub fn redone(&self) -> f64 {
        if self.total_bytes == 0 {
            0.0
        } else {
            self.rerun_cloned as f64 / self.total_bytes as f64
        }
    }
}

/// Both sides' runs.
#[derive(Clone, Debug)]
pub struct ResumeComparison {
    /// Upstream's baseline.
    pub upstream: ResumeOutcome,
    /// Ours.
    pub ours: ResumeOutcome,
}

/// Runs the scenario, each side on its own filesystem.
pub fn run(launcher: &Launcher, scale: &super::Scale) -> Result<ResumeComparison> {
    Ok(ResumeComparison {
        upstream: side_run(launcher, scale, Side::Upstream).ctx("upstream's resumed conversion")?,
        ours: side_run(launcher, scale, Side::Ours).ctx("our resumed conversion")?,
    })
}

fn build(vol: &Path, scale: &super::Scale) -> Result<()> {
    let m = vol.join("data/main");
    fs::create_dir_all(&m).ctx("mkdir data/main")?;
    for i in 0..scale.resume_files {
        let path = m.join(format!("shard{i:02}.mdb"));
        crate::make_fragmented_file(
            &path,
            scale.resume_file_bytes,
            scale.resume_file_extents,
            u64::from(i),
        )
        .ctx(format!("fragmenting {}", path.display()))?;
    }
    Ok(())
}

fn side_run(launcher: &Launcher, scale: &super::Scale, side: Side) -> Result<ResumeOutcome> {
    let (fs, root) = super::scratch(scale)?;
    let pkg = "monerod";
    let live = root.join(pkg);
    build(&live, scale)?;
    let mut expected = digest(&live)?;
    if let Some(top) = expected.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = Subvolume::Root;
    }
    let total_bytes = u64::from(scale.resume_files) * scale.resume_file_bytes;
    let id: PackageId = pkg.parse().ctx("package id")?;
    let one = BTreeSet::from([id.clone()]);
    // Ours: four chunks a file, killed after 90% of them.
    let chunk = scale.resume_file_bytes / 4;
    let (killed_after, rerun_cloned, resumed, rerun_time) = match side {
        Side::Upstream => {
            let files = (scale.resume_files * 9 / 10).max(1);
            kill_at(
                launcher,
                ChildOp::UpstreamBoot,
                &root,
                pkg,
                &format!("upstream.convert.file@{files}"),
                None,
            )?;
            super::settle(fs.mount_point())?;
            let started = Instant::now();
            let report =
                upstream::boot_volume_maintenance(&root, &one, &one, &mut Progress::new())?;
            let took = started.elapsed();
            let c = report
                .conversions
                .first()
                .ok_or("the rerun converted nothing")?;
            if let Some(e) = &c.error {
                return Err(format!("the rerun failed: {e}").into());
            }
            (
                u64::from(files) * scale.resume_file_bytes,
                c.cloned,
                false,
                took,
            )
        }
        Side::Ours => {
            let chunks = u64::from(scale.resume_files) * 4 * 9 / 10;
            kill_at(
                launcher,
                ChildOp::OursConvertClone,
                &root,
                pkg,
                &format!("migrate.chunk@{chunks}"),
                Some(chunk),
            )?;
            super::settle(fs.mount_point())?;
            let m = volume_migrate::Migrator::open(&root).map_err(super::ours_err)?;
            let started = Instant::now();
            let r = m
                .convert(
                    &id,
                    &clone_options(chunk),
                    &mut |_: &volume_migrate::Progress| {},
                )
                .map_err(super::ours_err)?;
            let took = started.elapsed();
            m.remove_old(&id, &mut |_: &volume_migrate::Progress| {})
                .map_err(super::ours_err)?;
            (chunks * chunk, r.bytes_cloned, r.resumed, took)
        }
    };
    let lossless = crate::tree_digest(&live).is_ok_and(|d| d == expected);
    Ok(ResumeOutcome {
        total_bytes,
        killed_after,
        rerun_cloned,
        resumed,
        rerun_time,
        lossless,
    })
}

fn cell(o: &ResumeOutcome) -> String {
    format!(
        "rerun cloned {} of {} ({:.0}%){}{}",
        super::table::fmt_bytes(o.rerun_cloned),
        super::table::fmt_bytes(o.total_bytes),
        o.redone() * 100.0,
        if o.resumed {
            ", resumed"
        } else {
            ", from zero"
        },
        if o.lossless { "" } else { "; NOT lossless" },
    )
}

impl Report for ResumeComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new("d. conversion killed at 90%", cell(u), cell(o))
                .timed(u.rerun_time, o.rerun_time),
        ]
    }
}
