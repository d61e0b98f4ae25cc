//! (c) Converting a plain-directory volume that holds every kind of entry
//! and attribute ([`super::trees::attr_volume`]): immutable and
//! append-only files, sockets, device nodes, a file capability, NOCOW
//! files, owners above 65535, nested subvolumes (one read-only), and more.
//!
//! Each side's boot maintenance converts it; then every entry is compared
//! with what it was ([`crate::TreeDigest::diff`]: kind, content, mode,
//! owner, mtime, links, xattrs, subvolume boundaries), and so are the inode
//! flags (FS_IOC_GETFLAGS), the read-only flags of nested subvolumes and
//! the ctimes, which tree digests do not record. What is left under the
//! root afterwards shows whether the old tree could be removed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use models::PackageId;

use super::trees;
use super::{Context, Progress, Report, Result, Row, Side, block_on, digest, leftovers};
use crate::{Subvolume, upstream};

/// One side's conversion.
#[derive(Clone, Debug)]
pub struct AttrsOutcome {
    /// Whether the volume is a subvolume afterwards.
    pub converted: bool,
    /// How the converted volume differs from the original, beyond its top
    /// becoming a subvolume ([`crate::TreeDigest::diff`] lines).
    pub differences: Vec<String>,
    /// Inode flags and read-only flags that differ, `path: before ->
    /// after`.
    pub flag_differences: Vec<String>,
    /// Entries whose ctime is what it was.
    pub ctimes_kept: usize,
    /// Entries in all.
    pub entries: usize,
    /// Names left under the root beside the volume (an old tree that
    /// could not be removed, say).
    pub leftovers: Vec<String>,
    /// What the side logged or reported as failed.
    pub log: Vec<String>,
    /// Boot maintenance, the old tree's removal included.
    pub time: Duration,
}

impl AttrsOutcome {
    /// Whether every entry and attribute is as it was.
    pub fn lossless(&self) -> bool {
        self.converted && self.differences.is_empty() && self.flag_differences.is_empty()
    }
}

/// Both sides' conversions.
#[derive(Clone, Debug)]
pub struct AttrsComparison {
    /// Upstream's baseline.
    pub upstream: AttrsOutcome,
    /// Ours.
    pub ours: AttrsOutcome,
}

/// Runs the scenario on one filesystem, each side under its own root.
pub fn run(scale: &super::Scale) -> Result<AttrsComparison> {
    let (fs, _) = super::scratch(scale)?;
    let run_side = |side: Side| -> Result<AttrsOutcome> {
        let root = fs.path(side.to_string());
        fs::create_dir(&root).ctx("creating a volumes root")?;
        side_run(side, &root).ctx(format!("{side}'s conversion"))
    };
    Ok(AttrsComparison {
        upstream: run_side(Side::Upstream)?,
        ours: run_side(Side::Ours)?,
    })
}

fn side_run(side: Side, root: &Path) -> Result<AttrsOutcome> {
    let pkg = "electrs";
    let live = root.join(pkg);
    fs::create_dir(&live).ctx("creating the plain volume")?;
    trees::attr_volume(&live)?;
    let mut expected = digest(&live)?;
    if let Some(top) = expected.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = Subvolume::Root;
    }
    let flags_before = trees::flags_of(&live)?;
    let ctimes_before: BTreeMap<String, (i64, i64)> =
        trees::ctimes_of(&live)?.into_iter().collect();

    let id: PackageId = pkg.parse().ctx("package id")?;
    let one = BTreeSet::from([id]);
    let started = Instant::now();
    let log = match side {
        Side::Upstream => {
            upstream::boot_volume_maintenance(root, &one, &one, &mut Progress::new())?.log
        }
        Side::Ours => block_on(async {
            let mut b = startos_core::volume::boot_volume_maintenance_at(
                root,
                &one,
                &one,
                &mut Progress::new(),
            )
            .await
            .ctx("boot maintenance")?;
            let mut log: Vec<String> = b
                .failed
                .iter()
                .map(|(p, e)| format!("failed: {p}: {e}"))
                .collect();
            if let Some(c) = b.cleanup.take()
                && let Err(e) = c.await.ctx("cleanup task")?
            {
                log.push(format!("cleanup failed: {e}"));
            }
            Ok::<_, super::Failure>(log)
        })?,
    };
    let time = started.elapsed();

    let after = digest(&live)?;
    let flags_after: BTreeMap<String, String> = trees::flags_of(&live)?.into_iter().collect();
    let mut flag_differences = Vec::new();
    for (path, before) in &flags_before {
        match flags_after.get(path) {
            Some(now) if now == before => {}
            Some(now) => flag_differences.push(format!("{path}: {before} -> {now}")),
            None => flag_differences.push(format!("{path}: {before} -> missing")),
        }
    }
    let ctimes_after: BTreeMap<String, (i64, i64)> = trees::ctimes_of(&live)?.into_iter().collect();
    let ctimes_kept = ctimes_before
        .iter()
        .filter(|(p, t)| ctimes_after.get(*p) == Some(t))
        .count();
    Ok(AttrsOutcome {
        converted: trees::is_subvolume(&live),
        differences: expected.diff(&after),
        flag_differences,
        ctimes_kept,
        entries: ctimes_before.len(),
        leftovers: leftovers(root, &[pkg])?,
        log,
        time,
    })
}

/// The differences, grouped: entries missing, xattrs lost, subvolume
/// boundaries lost, read-only flags lost, inode flags lost, and the rest.
fn summary(o: &AttrsOutcome) -> String {
    if !o.converted {
        return "not converted".into();
    }
    let mut missing = Vec::new();
    let mut xattrs = BTreeSet::new();
    let mut boundaries = 0;
    let mut other = 0;
    for d in &o.differences {
        let Some((path, what)) = d.split_once(": ") else {
            other += 1;
            continue;
        };
        if what.starts_with("only in left") {
            missing.push(path.rsplit('/').next().unwrap_or(path).to_owned());
        } else if let Some(rest) = what.strip_prefix("xattr ") {
            xattrs.insert(rest.split(' ').next().unwrap_or(rest).to_owned());
        } else if what.starts_with("subvolume Root") {
            boundaries += 1;
        } else {
            other += 1;
        }
    }
    let mut read_only = 0;
    let mut flags: BTreeMap<&str, usize> = BTreeMap::new();
    for d in &o.flag_differences {
        let Some((_, change)) = d.split_once(": ") else {
            continue;
        };
        let (before, after) = change.split_once(" -> ").unwrap_or((change, ""));
        if before.contains("read-only") && !after.contains("read-only") {
            read_only += 1;
        }
        for flag in ["IMMUTABLE", "APPEND", "NOCOW", "NOATIME", "NODUMP", "SYNC"] {
            if before.contains(flag) && !after.contains(flag) {
                *flags.entry(flag).or_default() += 1;
            }
        }
    }
    let mut lost = Vec::new();
    if !missing.is_empty() {
        lost.push(format!(
            "{} special files ({})",
            missing.len(),
            missing.join(", ")
        ));
    }
    for x in &xattrs {
        lost.push(x.trim_start_matches("security.").to_owned());
    }
    if boundaries > 0 {
        lost.push(format!("{boundaries} subvolume boundaries"));
    }
    if read_only > 0 {
        lost.push("ro flag".into());
    }
    if !flags.is_empty() {
        let each: Vec<String> = flags
            .iter()
            .map(|(flag, n)| format!("{} {n}", flag.to_lowercase()))
            .collect();
        lost.push(format!("inode flags ({})", each.join(", ")));
    }
    if other > 0 {
        lost.push(format!("{other} other"));
    }
    if lost.is_empty() {
        "every entry and attribute kept".into()
    } else {
        format!("lost: {}", lost.join(", "))
    }
}

fn after_cell(o: &AttrsOutcome) -> String {
    let mut s = format!("ctime kept: {} of {}", o.ctimes_kept, o.entries);
    if o.leftovers.is_empty() {
        s.push_str("; old tree removed");
    } else {
        let errors = o.log.iter().filter(|l| l.starts_with("error")).count();
        s.push_str(&format!(
            "; left: {}{}",
            o.leftovers.join(", "),
            if errors > 0 {
                " (its removal failed, only logged)"
            } else {
                ""
            }
        ));
    }
    s
}

impl Report for AttrsComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new("c. convert a rich tree", summary(u), summary(o)).timed(u.time, o.time),
            Row::new("  afterwards", after_cell(u), after_cell(o)),
        ]
    }
}
