//! (b) SIGKILL at each step of a restore and of a boot conversion, then
//! the next call (`resolve_pending`) or the next boot.
//!
//! Restore: the volume has a backup, the update changed it, and the
//! rollback's `restore()` is killed at each of its crash sites in a child
//! process. Then: was the volume path missing after the crash; then the
//! next call, `resolve_pending()`, on each side; is the volume then the
//! complete state before the restore (backup kept, to be restored again)
//! or the complete restored one, or neither (something lost); what is left
//! under the root. A second pass does the same with a write at the volume
//! path between the crash and the next call (the service's data version,
//! `data/.version`, written as upstream's `create_file` does, parent
//! directories made): upstream then refuses with its restore-conflict,
//! which needs a person to clean up.
//!
//! Conversion: a plain-directory volume, boot maintenance killed at each
//! crash site of its conversion, then the next boot: was the path missing,
//! is the volume a subvolume with every entry as before.

use std::fs;
use std::path::Path;

use models::PackageId;

use super::trees;
use super::{
    Backups, ChildOp, Context, Launcher, Progress, Report, Result, Row, Side, block_on, count_of,
    digest, kill_at, leftovers,
};
use crate::{Subvolume, TreeDigest, upstream};

/// Upstream's restore crash sites, in order
/// ([`upstream::InstallBackup::restore`]).
pub const UPSTREAM_RESTORE_SITES: &[&str] = &[
    "upstream.restore.old-cleared",
    "upstream.restore.live-moved",
    "upstream.restore.backup-moved",
    "upstream.restore.old-deleted",
];

/// Our restore's crash sites, in order (`volume::VolumeStore::restore`).
pub const OURS_RESTORE_SITES: &[&str] = &[
    "restore.copied",
    "restore.recorded",
    "restore.exchanged",
    "restore.replaced-moved",
    "restore.backup-dropped",
    "restore.replaced-deleted",
];

/// Upstream's conversion crash sites, in order
/// ([`upstream::boot_volume_maintenance`]).
pub const UPSTREAM_CONVERT_SITES: &[&str] = &[
    "upstream.convert.tmp-created",
    "upstream.convert.file@2",
    "upstream.convert.cloned",
    "upstream.convert.src-moved",
    "upstream.convert.tmp-moved",
    "upstream.convert.old-removed",
];

/// Our conversion's crash sites at boot, in order (volume-migrate's
/// snapshot of the parent, cut down to the package, then the background
/// removal of the rest and of the old tree).
pub const OURS_CONVERT_SITES: &[&str] = &[
    "migrate.parent-snapshot",
    "migrate.carve-held",
    "migrate.carve-set-aside@1",
    "migrate.carve-lifted@1",
    "migrate.rest-recorded",
    "migrate.durable",
    "migrate.exchanged",
    "migrate.old-renamed",
    "migrate.rest-removed@1",
    "migrate.remove@1",
];

/// What the volume was once the next call had run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndState {
    /// The complete volume from before the restore, its backup kept: the
    /// restore can run again.
    Before,
    /// The complete restored volume.
    After,
    /// Upstream's restore-conflict: refused, a person must clean up.
    Conflict,
    /// Neither complete state: something was lost.
    Lost,
}

/// One killed restore, and what the next call made of it.
#[derive(Clone, Debug)]
pub struct RestoreKill {
    /// The crash site.
    pub site: &'static str,
    /// Whether nothing was at the volume path after the crash.
    pub path_missing: bool,
    /// The volume once `resolve_pending` had run.
    pub state: EndState,
    /// With a write between the crash and the next call: which volume was
    /// at the path when it was written (`Before`: the volume the restore
    /// was replacing; `After`: the restored one; `None`: nothing, so the
    /// write made a new skeleton tree).
    pub written_into: Option<EndState>,
    /// With a write: whether the written file is in the volume afterwards.
    pub write_kept: Option<bool>,
    /// What `resolve_pending` failed with, if it did.
    pub resolve_error: Option<String>,
    /// Names other than the volume and its backup left under the root.
    pub leftovers: Vec<String>,
}

/// One killed boot conversion, and what the next boot made of it.
#[derive(Clone, Debug)]
pub struct ConvertKill {
    /// The crash site.
    pub site: &'static str,
    /// Whether nothing was at the volume path after the crash.
    pub path_missing: bool,
    /// Whether, after the next boot, the volume is a subvolume.
    pub converted: bool,
    /// Differences of the volume after the next boot from before, beyond
    /// its top becoming a subvolume (empty: nothing lost).
    pub differences: Vec<String>,
    /// Names other than the volume left under the root.
    pub leftovers: Vec<String>,
}

/// One side's kills.
#[derive(Clone, Debug, Default)]
pub struct CrashOutcome {
    /// A restore killed at each site, then `resolve_pending`.
    pub restore: Vec<RestoreKill>,
    /// The same, with a write at the volume path before `resolve_pending`.
    pub restore_with_write: Vec<RestoreKill>,
    /// A boot conversion killed at each site, then the next boot.
    pub convert: Vec<ConvertKill>,
}

/// Both sides' kills.
#[derive(Clone, Debug)]
pub struct CrashComparison {
    /// Upstream's baseline.
    pub upstream: CrashOutcome,
    /// Ours.
    pub ours: CrashOutcome,
}

/// Runs every kill on one filesystem, each side and operation under its
/// own root.
pub fn run(launcher: &Launcher, scale: &super::Scale) -> Result<CrashComparison> {
    let (fs, _) = super::scratch(scale)?;
    let mut out = Vec::new();
    for side in [Side::Upstream, Side::Ours] {
        let mut o = CrashOutcome::default();
        for write in [false, true] {
            let root = fs.path(format!("{side}-restore-{write}"));
            fs::create_dir(&root).ctx("creating a volumes root")?;
            let sites = match side {
                Side::Upstream => UPSTREAM_RESTORE_SITES,
                Side::Ours => OURS_RESTORE_SITES,
            };
            for (i, site) in sites.iter().enumerate() {
                let kill = restore_kill(launcher, side, &root, &format!("r{i}"), site, write)
                    .ctx(format!("{side}'s restore killed at {site}"))?;
                if write {
                    o.restore_with_write.push(kill);
                } else {
                    o.restore.push(kill);
                }
            }
        }
        let root = fs.path(format!("{side}-convert"));
        fs::create_dir(&root).ctx("creating a volumes root")?;
        let sites = match side {
            Side::Upstream => UPSTREAM_CONVERT_SITES,
            Side::Ours => OURS_CONVERT_SITES,
        };
        for (i, site) in sites.iter().enumerate() {
            o.convert.push(
                convert_kill(launcher, side, &root, &format!("c{i}"), site)
                    .ctx(format!("{side}'s conversion killed at {site}"))?,
            );
        }
        out.push(o);
    }
    let ours = out.pop().ok_or("no outcome")?;
    let upstream = out.pop().ok_or("no outcome")?;
    Ok(CrashComparison { upstream, ours })
}

/// `d` without `data/.version`, and with directory times cleared (the
/// write changed them): what a write at the path leaves to compare.
fn without_write(d: TreeDigest) -> TreeDigest {
    d.without("data/.version").ignore_dir_mtimes()
}

fn restore_kill(
    launcher: &Launcher,
    side: Side,
    root: &Path,
    pkg: &str,
    site: &'static str,
    write: bool,
) -> Result<RestoreKill> {
    let live = root.join(pkg);
    let backups = Backups::new(root, pkg);
    let (theirs, ours) = (&backups.theirs, &backups.ours);
    backups.ensure_volume_root(side, root, pkg)?;
    trees::simple_volume(&live, 7)?;
    let at_backup = digest(&live)?;
    let taken = backups.begin_and_snapshot(side)?;
    if !taken {
        return Err("no backup was taken".into());
    }
    // The update changes the volume before it fails.
    fs::write(live.join("data/main/db.sqlite"), trees::bytes(99, 1000)).ctx("update")?;
    fs::write(live.join("data/main/new-version"), b"2.0").ctx("update")?;
    let current = digest(&live)?;

    let op = match side {
        Side::Upstream => ChildOp::UpstreamRestore,
        Side::Ours => ChildOp::OursRestore,
    };
    kill_at(launcher, op, root, pkg, site, None)?;
    let path_missing = fs::symlink_metadata(&live).is_err();
    let written_into = match crate::tree_digest(&live) {
        Ok(d) if d == current => Some(EndState::Before),
        Ok(d) if d == at_backup => Some(EndState::After),
        _ => None,
    };
    if write {
        use std::io::Write as _;
        upstream::create_file(&live.join("data/.version"))?
            .write_all(b"2.0.0")
            .ctx("writing data/.version")?;
    }
    let resolved = match side {
        Side::Upstream => theirs.resolve_pending().map_err(|e| {
            if upstream::is_restore_conflict(&e) {
                (true, e.to_string())
            } else {
                (false, e.to_string())
            }
        }),
        Side::Ours => block_on(ours.resolve_pending()).map_err(|e| (false, e.to_string())),
    };
    let now = crate::tree_digest(&live).ok();
    let backup_there =
        fs::symlink_metadata(root.join(format!("{pkg}{}", upstream::INSTALL_BACKUP_SUFFIX)))
            .is_ok();
    let write_kept = write.then(|| live.join("data/.version").is_file());
    let norm = |d: &TreeDigest| {
        if write {
            without_write(d.clone())
        } else {
            d.clone()
        }
    };
    let state = match (&resolved, now.as_ref().map(norm)) {
        (Err((true, _)), _) => EndState::Conflict,
        (_, Some(d)) if d == norm(&at_backup) && !backup_there => EndState::After,
        (_, Some(d)) if d == norm(&current) && backup_there => EndState::Before,
        _ => EndState::Lost,
    };
    Ok(RestoreKill {
        site,
        path_missing,
        state,
        written_into: written_into.filter(|_| write),
        write_kept,
        resolve_error: resolved.err().map(|(_, e)| e),
        leftovers: leftovers(root, &[pkg])?,
    })
}

fn convert_kill(
    launcher: &Launcher,
    side: Side,
    root: &Path,
    pkg: &str,
    site: &'static str,
) -> Result<ConvertKill> {
    let live = root.join(pkg);
    fs::create_dir(&live).ctx("creating the plain volume")?;
    trees::simple_volume(&live, 11)?;
    let mut expected = digest(&live)?;
    if let Some(top) = expected.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = Subvolume::Root;
    }
    let op = match side {
        Side::Upstream => ChildOp::UpstreamBoot,
        Side::Ours => ChildOp::OursBoot,
    };
    kill_at(launcher, op, root, pkg, site, None)?;
    let path_missing = fs::symlink_metadata(&live).is_err();
    let id: PackageId = pkg.parse().ctx("package id")?;
    let one = std::collections::BTreeSet::from([id]);
    match side {
        Side::Upstream => {
            upstream::boot_volume_maintenance(root, &one, &one, &mut Progress::new())?;
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
            if let Some((p, e)) = b.failed.first() {
                return Err(format!("{p}: {e}").into());
            }
            if let Some(c) = b.cleanup.take() {
                c.await.ctx("cleanup task")?.ctx("cleanup")?;
            }
            Ok::<_, super::Failure>(())
        })?,
    }
    let differences = match crate::tree_digest(&live) {
        Ok(d) => expected.diff(&d),
        Err(e) => vec![format!("no volume: {e}")],
    };
    Ok(ConvertKill {
        site,
        path_missing,
        converted: trees::is_subvolume(&live),
        differences,
        leftovers: leftovers(root, &[pkg])?,
    })
}

fn restore_cell(kills: &[RestoreKill]) -> String {
    let n = kills.len();
    let count = |s: EndState| kills.iter().filter(|k| k.state == s).count();
    let missing = kills.iter().filter(|k| k.path_missing).count();
    let mut parts = vec![format!("{n} kill points")];
    parts.push(if missing == 0 {
        "path never missing".into()
    } else {
        format!("path missing after {missing}")
    });
    let mut states = Vec::new();
    if count(EndState::After) > 0 {
        states.push(format!("{} restored", count(EndState::After)));
    }
    if count(EndState::Before) > 0 {
        states.push(format!("{} undone (backup kept)", count(EndState::Before)));
    }
    if count(EndState::Conflict) > 0 {
        states.push(format!(
            "{} restore-conflict: manual cleanup",
            count(EndState::Conflict)
        ));
    }
    if count(EndState::Lost) > 0 {
        states.push(format!("{} LOST data", count(EndState::Lost)));
    }
    parts.push(format!("then: {}", states.join(", ")));
    let left = kills.iter().filter(|k| !k.leftovers.is_empty()).count();
    if left > 0 {
        parts.push(format!("leftovers after {left}"));
    }
    parts.join("; ")
}

/// Whether the write went into the volume that was live once the next
/// call had run, yet is gone: lost. A write into a volume the restore then
/// replaced goes with it, as anything written before the restore would.
pub fn write_lost(k: &RestoreKill) -> bool {
    k.write_kept == Some(false)
        && matches!(k.state, EndState::Before | EndState::After)
        && k.written_into == Some(k.state)
}

fn write_cell(kills: &[RestoreKill]) -> String {
    let kept = kills
        .iter()
        .filter(|k| k.write_kept == Some(true) && k.state != EndState::Conflict)
        .count();
    let conflicts = kills
        .iter()
        .filter(|k| k.state == EndState::Conflict)
        .count();
    let lost = kills.iter().filter(|k| write_lost(k)).count();
    let replaced = kills
        .iter()
        .filter(|k| k.write_kept == Some(false) && !write_lost(k) && k.state != EndState::Conflict)
        .count();
    let mut s = format!("write kept: {}", count_of(kept, kills.len()));
    if replaced > 0 {
        s.push_str(&format!(
            "; {replaced} went with the volume the restore replaced"
        ));
    }
    if conflicts > 0 {
        s.push_str(&format!("; {conflicts} restore-conflict: manual cleanup"));
    }
    if lost > 0 {
        s.push_str(&format!("; {lost} LOST"));
    }
    s
}

fn convert_cell(kills: &[ConvertKill]) -> String {
    let n = kills.len();
    let missing = kills.iter().filter(|k| k.path_missing).count();
    let ok = kills
        .iter()
        .filter(|k| k.converted && k.differences.is_empty())
        .count();
    let left = kills.iter().filter(|k| !k.leftovers.is_empty()).count();
    let mut parts = vec![format!("{n} kill points")];
    parts.push(if missing == 0 {
        "path never missing".into()
    } else {
        format!("path missing after {missing}")
    });
    parts.push(format!(
        "next boot: {} converted, lossless",
        count_of(ok, n)
    ));
    if left > 0 {
        parts.push(format!("old tree left after {left}"));
    }
    parts.join("; ")
}

impl Report for CrashComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new(
                "b. SIGKILL in restore, then resolve",
                restore_cell(&u.restore),
                restore_cell(&o.restore),
            ),
            Row::new(
                "  + a write at the path first",
                write_cell(&u.restore_with_write),
                write_cell(&o.restore_with_write),
            ),
            Row::new(
                "  SIGKILL in boot conversion",
                convert_cell(&u.convert),
                convert_cell(&o.convert),
            ),
        ]
    }
}
