//! `boxes`: the first boot at 8, 10, 30 and 150 packages (issue 31): the
//! default conversion's readiness and its whole work against upstream's
//! boot conversion of the same box, in the same run. The boxes:
//!
//! - 8: the field's node box ([`integration::node`], monerod's database at
//!   the first `--boot-extents` count, or the test suite's with
//!   `--boot-small`), monerod the dominant package;
//! - 10: ten packages of 2,000 files each (a small node's services, each
//!   past the weighing's cap), the first the dominant one: below
//!   `SPLIT_MIN`, where every heavy package is a snapshot of the parent;
//! - 30 and 150: mostly small packages (40 files each), a few of 10,000
//!   files (3 and 5), the first of those the dominant one.
//!
//! Each way on its own fresh filesystem with the same box, settled and out
//! of the page cache:
//!
//! - upstream's boot conversion ([`integration::upstream`]): clone each
//!   root into a subvolume, swap, remove the old tree inline; every
//!   service waits for all of it, so each `Service::load` returns after it:
//!   when, is that maintenance's time plus the package's load in
//!   upstream's order (`cleanup_and_initialize`, start-core's call sites)
//!   on the box it converted, from the first load's start (the boot's own
//!   volume maintenance, nothing left to convert, is not counted);
//! - ours, [`startos_core::volume::boot_volume_maintenance_at`]: each
//!   package's readiness event, then the background cleanup to its end.
//!   Its whole work (every share's cut, every snapshot, the rests and the
//!   old trees) is timed from the start to the cleanup's end, against
//!   upstream's whole maintenance (its inline clones and removals); and
//!   this process's CPU time over each (every thread's user and system
//!   time: two threads removing at once shorten the wall time, not the
//!   CPU time), reported beside it;
//! - ours through start-core's call sites (the readiness step,
//!   [`crate::boot_loads`]): each package's `Service::load` volume calls
//!   timed from the boot's start.
//!
//! How the schedule converts each package (a snapshot of the parent, of a
//! share, or a clone and why) comes from a dry run's schedule of the same
//! box, before upstream's way runs on it.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use integration::LoopFs;
use integration::call_sites::boot_loads::{self as call_sites, Order};
use integration::compare::{Progress, block_on};
use integration::identity::{Kept, identities};
use integration::node::{self, NodeShape};
use models::PackageId;
use serde::Serialize;
use volume_migrate::{Decision, MigrateOptions, Migrator};

use crate::Verdict;
use crate::common::{Result, fmt_count, fmt_duration, settle};

/// The dominant package's volume ready within this of the start, seconds.
const DOMINANT_READY_AT_MOST: f64 = 0.05;
/// Every other package's load within this fraction of upstream's way.
const OTHERS_AT_MOST: f64 = 0.2;
/// Our whole work at most this many times upstream's.
const WORK_AT_MOST: f64 = 2.0;
/// Files of a heavy package of the 30- and 150-package boxes.
const HEAVY_FILES: u32 = 10_000;
/// Files of each package of the box of ten heavy packages: past the
/// weighing's cap below 16 packages (about 86 entries) and its full one
/// (about 860), a service's database or index of a small node.
const TEN_HEAVY_FILES: u32 = 2_000;
/// Files of a small one.
const SMALL_FILES: u32 = 40;

/// One box.
#[derive(Clone, Copy)]
pub enum Shape {
    /// The field's node box.
    Node(NodeShape),
    /// `packages` packages, `heavy` of them of `heavy_files` files, the
    /// others of [`SMALL_FILES`].
    Many {
        packages: usize,
        heavy: usize,
        heavy_files: u32,
    },
}

impl Shape {
    fn packages(&self) -> Vec<String> {
        match self {
            Shape::Node(s) => s.packages().iter().map(|p| p.to_string()).collect(),
            Shape::Many {
                packages, heavy, ..
            } => (0..*packages)
                .map(|i| match i < *heavy {
                    true => format!("heavy{i}"),
                    false => format!("small{i:03}"),
                })
                .collect(),
        }
    }

    fn dominant(&self) -> String {
        match self {
            Shape::Node(_) => node::DOMINANT.to_owned(),
            Shape::Many { .. } => "heavy0".to_owned(),
        }
    }

    fn image_bytes(&self) -> u64 {
        match self {
            Shape::Node(s) => s.image_bytes(),
            Shape::Many { .. } => 4 << 30,
        }
    }

    /// Builds the box under `root`; returns its entries (below the
    /// packages' tops).
    fn build(&self, root: &Path) -> Result<u64> {
        let (heavy, heavy_files) = match self {
            Shape::Node(s) => {
                node::build(root, s)?;
                return Ok(self
                    .packages()
                    .iter()
                    .map(|p| identities(&root.join(p)).map(|m| m.len() as u64))
                    .sum::<std::io::Result<u64>>()?);
            }
            Shape::Many {
                heavy, heavy_files, ..
            } => (*heavy, *heavy_files),
        };
        let mut entries = 0u64;
        for (i, p) in self.packages().iter().enumerate() {
            let files = if i < heavy { heavy_files } else { SMALL_FILES };
            let per_dir = if i < heavy { 1000 } else { 20 };
            for f in 0..files {
                let dir = root
                    .join(p)
                    .join("data")
                    .join(format!("{:03}", f / per_dir));
                if f % per_dir == 0 {
                    fs::create_dir_all(&dir)?;
                    entries += 1 + u64::from(f == 0);
                }
                let len = 512 + (f as usize * 37) % 3500;
                fs::write(dir.join(format!("{f:05}")), vec![(f % 251) as u8; len])?;
                entries += 1;
            }
        }
        Ok(entries)
    }
}

/// One box's rows.
#[derive(Serialize)]
pub struct BoxCase {
    /// Packages.
    pub packages: usize,
    /// Entries below the packages' tops.
    pub entries: u64,
    /// Upstream's whole maintenance (its services' loads come after it).
    pub upstream: f64,
    /// Of which its inline removals of the old trees.
    pub upstream_removal: f64,
    /// Upstream's way through the call sites: each package's
    /// `Service::load` volume calls returned, from the boot's start (its
    /// maintenance, then its load in upstream's order).
    pub upstream_loads: Vec<(String, f64)>,
    /// Ours: the dominant package's readiness event.
    pub dominant_ready: f64,
    /// Ours: the last readiness event.
    pub last_ready: f64,
    /// Ours through the call sites: the latest load's volume calls
    /// returned (the dominant's excluded), and whose.
    pub last_load: (String, f64),
    /// Ours through the call sites against upstream's way, package by
    /// package (the dominant's excluded): the largest ratio, whose, and
    /// both times.
    pub load_ratio: (String, f64, f64, f64),
    /// Ours: from the start to the end of the background cleanup.
    pub ours_total: f64,
    /// This process's CPU time (user and system, every thread) over
    /// upstream's maintenance and over ours to the cleanup's end, seconds:
    /// beside the wall times, which a second core shortens for ours.
    pub cpu: (f64, f64),
    /// Ours: packages whose every entry kept its inode number and birth
    /// time, of all.
    pub identity_kept: (usize, usize),
    /// How the schedule converts them: (how, packages).
    pub decisions: Vec<(String, usize)>,
    /// Shares the schedule makes.
    pub shares: usize,
    /// Ours through the call sites: the latest load of a package the
    /// schedule clones, and of one it snapshots (the dominant's
    /// excluded), each with whose.
    pub last_loads: [(String, f64); 2],
}

/// A fresh filesystem with the box, settled and out of the page cache.
fn fresh(shape: &Shape) -> Result<(LoopFs, std::path::PathBuf, u64)> {
    let fs = LoopFs::btrfs(shape.image_bytes())?;
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root)?;
    let entries = shape.build(&root)?;
    settle(fs.mount_point())?;
    crate::drop_caches()?;
    Ok((fs, root, entries))
}

fn ids(shape: &Shape) -> Result<BTreeSet<PackageId>> {
    shape
        .packages()
        .iter()
        .map(|p| Ok(p.parse::<PackageId>().map_err(|e| format!("{p}: {e}"))?))
        .collect()
}

/// The schedule's decisions for the box under `root` (a dry run's), and
/// how many shares it makes.
fn decisions(root: &Path, ids: &BTreeSet<PackageId>) -> Result<Decisions> {
    let m = Migrator::open(root).map_err(|e| e.to_string())?;
    let all: Vec<PackageId> = ids.iter().cloned().collect();
    let opts = MigrateOptions {
        dry_run: true,
        defer_cut: true,
        ..MigrateOptions::default()
    };
    let plan = m.schedule(&all, &opts).map_err(|e| e.to_string())?;
    let mut out: Vec<(String, usize)> = Vec::new();
    let mut shares = BTreeSet::new();
    let mut cloned = BTreeSet::new();
    for p in &plan {
        if matches!(p.decision, Some(Decision::Clone(_))) {
            cloned.insert(p.package.to_string());
        }
        let how = match (&p.decision, p.shares.last()) {
            (Some(Decision::SnapshotParent), None) => "a snapshot of the parent".to_owned(),
            (Some(Decision::SnapshotParent), Some(_)) => "a snapshot of a share".to_owned(),
            (Some(Decision::Clone(why)), _) => format!("cloned: {why}"),
            (None, _) => "leftovers".to_owned(),
        };
        shares.extend(p.shares.iter().map(|s| s.id.clone()));
        match out.iter_mut().find(|(h, _)| *h == how) {
            Some((_, n)) => *n += 1,
            None => out.push((how, 1)),
        }
    }
    Ok((out, shares.len(), cloned))
}

/// How the schedule converts the box: (how, packages), the shares it
/// makes, the packages it clones.
type Decisions = (Vec<(String, usize)>, usize, BTreeSet<String>);

/// What upstream's way measured, with the box's entries and the
/// schedule's decisions (a dry run's, on its box before it ran).
struct UpstreamRun {
    entries: u64,
    took: f64,
    /// This process's CPU time over the maintenance.
    cpu: f64,
    removal: f64,
    loads: Vec<(String, f64)>,
    decisions: Vec<(String, usize)>,
    shares: usize,
    cloned: BTreeSet<String>,
}

/// Upstream's way: its whole maintenance, and its inline removals.
fn upstream(shape: &Shape) -> Result<UpstreamRun> {
    let (fs, root, entries) = fresh(shape)?;
    let ids = ids(shape)?;
    let (decisions, shares, cloned) = decisions(&root, &ids)?;
    crate::drop_caches()?;
    let mut progress = Progress::new();
    let cpu = crate::usage::cpu(libc::RUSAGE_SELF);
    let started = Instant::now();
    let report = integration::upstream::boot_volume_maintenance(&root, &ids, &ids, &mut progress)
        .map_err(|e| format!("upstream's boot: {e}"))?;
    let took = started.elapsed().as_secs_f64();
    let cpu = (crate::usage::cpu(libc::RUSAGE_SELF) - cpu).as_secs_f64();
    if let Some(c) = report.conversions.iter().find(|c| c.error.is_some()) {
        return Err(format!("upstream's boot: {}: {:?}", c.package, c.error).into());
    }
    let removal = report
        .conversions
        .iter()
        .map(|c| c.removal_time.as_secs_f64())
        .sum();
    let loads = loads_after(shape, &fs, took)?;
    fs.close()?;
    Ok(UpstreamRun {
        entries,
        took,
        cpu,
        removal,
        loads,
        decisions,
        shares,
        cloned,
    })
}

/// Upstream's way through the call sites, on the box its maintenance
/// converted (`took` seconds): each package's load in upstream's order,
/// every load after the maintenance, timed from the first load's start and
/// put after `took`.
fn loads_after(shape: &Shape, fs: &LoopFs, took: f64) -> Result<Vec<(String, f64)>> {
    upstream_times(&first_boot_on(shape, fs, Order::Upstream)?, took)
}

/// The call sites' first boot of `shape`'s packages on `fs`, in `order`:
/// the state store seeded with them, the filesystem settled and out of
/// the page cache first.
fn first_boot_on(shape: &Shape, fs: &LoopFs, order: Order) -> Result<call_sites::BootLoads> {
    let bin = call_sites_bin()?;
    let packages = shape.packages();
    let names: Vec<&str> = packages.iter().map(String::as_str).collect();
    call_sites::seed(&bin, fs.mount_point(), &names)?;
    settle(fs.mount_point())?;
    crate::drop_caches()?;
    Ok(call_sites::first_boot(&bin, fs.mount_point(), order)?)
}

/// Each package's time in upstream's way from `boot` (its loads in
/// upstream's order): its load's volume calls returned, from the first
/// load's start, put after `took`. An error for a package that did not
/// load, or with no load seen starting: nothing to time from (each time
/// would be minus infinity, and every ratio to it pass).
fn upstream_times(boot: &call_sites::BootLoads, took: f64) -> Result<Vec<(String, f64)>> {
    let first = boot
        .packages
        .iter()
        .filter_map(|p| p.load_started)
        .fold(f64::INFINITY, f64::min);
    if !first.is_finite() {
        return Err("upstream's order: no load seen starting, nothing to time from".into());
    }
    boot.packages
        .iter()
        .map(|p| match (&p.loaded, p.volumes_ready) {
            (Ok(true), Some(t)) => Ok((p.package.clone(), took + (t - first) / 1000.0)),
            _ => Err(format!("{}'s load in upstream's order: {:?}", p.package, p.loaded).into()),
        })
        .collect()
}

fn call_sites_bin() -> Result<std::path::PathBuf> {
    Ok(integration::workspace_bin("call-sites").map_err(|e| {
        format!(
            "{e}: build it first (cargo build --release -p upstream-call-sites --bin call-sites)"
        )
    })?)
}

/// What our way measured.
struct OursRun {
    /// Each package's readiness event.
    ready: Vec<(String, Duration)>,
    /// From the start to the cleanup's end.
    total: f64,
    /// This process's CPU time over the same.
    cpu: f64,
    /// Packages that kept every identity, of all.
    kept: (usize, usize),
}

/// Ours: readiness events, the whole work, identities kept.
fn ours(shape: &Shape) -> Result<OursRun> {
    let (fs, root, _) = fresh(shape)?;
    let ids = ids(shape)?;
    let before: Vec<_> = shape
        .packages()
        .iter()
        .map(|p| Ok((p.clone(), identities(&root.join(p))?)))
        .collect::<Result<_>>()?;
    crate::drop_caches()?;
    let mut progress = Progress::new();
    let forced = volume::sys::forced_commit_starts();
    let nudged = volume::sys::nudged_commit_starts();
    let cpu = crate::usage::cpu(libc::RUSAGE_SELF);
    let started = Instant::now();
    let total = block_on(async {
        let mut b =
            startos_core::volume::boot_volume_maintenance_at(&root, &ids, &ids, &mut progress)
                .await
                .map_err(|e| format!("our boot: {e}"))?;
        if let Some((p, e)) = b.failed.first() {
            return Err(format!("our boot: {p}: {e}"));
        }
        if let Some(c) = b.cleanup.take() {
            c.await
                .map_err(|e| format!("cleanup task: {e}"))?
                .map_err(|e| format!("cleanup: {e}"))?;
        }
        Ok::<_, String>(started.elapsed().as_secs_f64())
    })?;
    let cpu = (crate::usage::cpu(libc::RUSAGE_SELF) - cpu).as_secs_f64();
    // A commit start this kernel left waiting past its patience, forced
    // (`volume::sys::COMMIT_START_PATIENCE`): seconds of a run's time.
    let forced = volume::sys::forced_commit_starts() - forced;
    let nudged = volume::sys::nudged_commit_starts() - nudged;
    if nudged > 0 {
        eprintln!(
            "boxes: {} packages: {nudged} commit starts asked for again after waiting {:?} or more",
            shape.packages().len(),
            volume::sys::COMMIT_START_NUDGE
        );
    }
    if forced > 0 {
        eprintln!(
            "boxes: {} packages: {forced} commit starts forced after waiting {:?}",
            shape.packages().len(),
            volume::sys::COMMIT_START_PATIENCE
        );
    }
    let mut kept = 0;
    for (p, ids) in &before {
        if Kept::of(ids, &identities(&root.join(p))?).shares().0 == 1.0 {
            kept += 1;
        }
    }
    fs.close()?;
    Ok(OursRun {
        ready: progress.ready,
        total,
        cpu,
        kept: (kept, before.len()),
    })
}

/// Ours through the call sites' readiness step: each package's load's
/// volume calls returned, from the boot's start.
fn loads(shape: &Shape) -> Result<Vec<(String, f64)>> {
    let (fs, _, _) = fresh(shape)?;
    let loads = first_boot_on(shape, &fs, Order::Readiness)?;
    fs.close()?;
    loads
        .packages
        .iter()
        .map(|p| match (&p.loaded, p.volumes_ready) {
            (Ok(true), Some(t)) => Ok((p.package.clone(), t / 1000.0)),
            _ => Err(format!("{}'s load: {:?}", p.package, p.loaded).into()),
        })
        .collect()
}

/// One box, every way.
fn case(shape: &Shape) -> Result<BoxCase> {
    let n = shape.packages().len();
    eprintln!("boxes: {n} packages: upstream's boot conversion");
    let up = upstream(shape)?;
    eprintln!("boxes: {n} packages: ours");
    let OursRun {
        ready,
        total: ours_total,
        cpu: ours_cpu,
        kept: identity_kept,
    } = ours(shape)?;
    eprintln!("boxes: {n} packages: ours through the call sites");
    let loads = loads(shape)?;
    let dominant = shape.dominant();
    let at = |p: &str| {
        ready
            .iter()
            .find(|(q, _)| q == p)
            .map(|(_, t)| t.as_secs_f64())
    };
    // The latest load but the dominant's, of the packages `keep` keeps.
    let latest = |keep: &dyn Fn(&String) -> bool| {
        loads
            .iter()
            .filter(|(p, _)| *p != dominant && keep(p))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .cloned()
            .unwrap_or_default()
    };
    let last_load = latest(&|_| true);
    let last_loads = [true, false].map(|cloned| latest(&|p| up.cloned.contains(p) == cloned));
    let load_ratio = loads
        .iter()
        .filter(|(p, _)| *p != dominant)
        .map(|(p, t)| {
            let theirs = up
                .loads
                .iter()
                .find(|(q, _)| q == p)
                .map_or(f64::NAN, |(_, u)| *u);
            (p.clone(), t / theirs, *t, theirs)
        })
        // A package upstream's boot did not load fails the row (NaN).
        .max_by(|a, b| match (a.1.is_nan(), b.1.is_nan()) {
            (true, _) | (_, true) => a.1.is_nan().cmp(&b.1.is_nan()),
            _ => a.1.total_cmp(&b.1),
        })
        .unwrap_or_default();
    Ok(BoxCase {
        packages: n,
        entries: up.entries,
        upstream: up.took,
        upstream_removal: up.removal,
        upstream_loads: up.loads,
        dominant_ready: at(&dominant).unwrap_or(f64::INFINITY),
        last_ready: ready
            .iter()
            .map(|(_, t)| t.as_secs_f64())
            .fold(0.0, f64::max),
        last_load,
        load_ratio,
        ours_total,
        cpu: (up.cpu, ours_cpu),
        identity_kept,
        last_loads,
        decisions: up.decisions,
        shares: up.shares,
    })
}

/// The `boxes` section: the node box `node`, ten heavy packages, then 30
/// and 150 packages.
pub fn run(node: NodeShape) -> Result<(Vec<BoxCase>, Vec<Verdict>)> {
    let shapes = [
        Shape::Many {
            packages: 30,
            heavy: 3,
            heavy_files: HEAVY_FILES,
        },
        Shape::Many {
            packages: 150,
            heavy: 5,
            heavy_files: HEAVY_FILES,
        },
        Shape::Many {
            packages: 10,
            heavy: 10,
            heavy_files: TEN_HEAVY_FILES,
        },
        Shape::Node(node),
    ];
    let mut cases = Vec::new();
    for s in &shapes {
        // A box that cannot be measured (no room for the node box, say)
        // leaves the others' rows.
        match case(s) {
            Ok(c) => {
                eprintln!(
                    "boxes: {} packages: upstream {:.2} s, ours dominant {:.3} s, last ready {:.2} s, last load {:.2} s ({}), all work {:.2} s, identity {}/{}",
                    c.packages,
                    c.upstream,
                    c.dominant_ready,
                    c.last_ready,
                    c.last_load.1,
                    c.last_load.0,
                    c.ours_total,
                    c.identity_kept.0,
                    c.identity_kept.1
                );
                cases.push(c);
            }
            Err(e) => eprintln!("boxes: {} packages: not measured: {e}", s.packages().len()),
        }
    }
    cases.sort_by_key(|c| c.packages);
    let verdicts = verdicts(&cases);
    Ok((cases, verdicts))
}

fn secs(s: f64) -> String {
    fmt_duration(Duration::from_secs_f64(s.max(0.0)))
}

fn verdicts(cases: &[BoxCase]) -> Vec<Verdict> {
    let all = |f: &dyn Fn(&BoxCase) -> (bool, String)| {
        let r: Vec<_> = cases.iter().map(f).collect();
        (
            r.iter().all(|(ok, _)| *ok),
            r.into_iter().map(|(_, s)| s).collect::<Vec<_>>().join(", "),
        )
    };
    let (ok, d) = all(&|c| {
        (
            c.dominant_ready <= DOMINANT_READY_AT_MOST,
            format!("{}: {}", c.packages, secs(c.dominant_ready)),
        )
    });
    let mut v = vec![Verdict::new(
        format!(
            "boxes: the dominant package's volume ready within {} of the start (ours)",
            secs(DOMINANT_READY_AT_MOST)
        ),
        ok,
        d,
    )];
    let (ok, d) = all(&|c| {
        let (p, r, ours, theirs) = &c.load_ratio;
        (
            *r <= OTHERS_AT_MOST,
            format!(
                "{}: {p} {} vs {}: {r:.2}x (the last load {} of {})",
                c.packages,
                secs(*ours),
                secs(*theirs),
                secs(c.last_load.1),
                c.last_load.0,
            ),
        )
    });
    v.push(Verdict::new(
        format!(
            "boxes: every other package's Service::load within {OTHERS_AT_MOST} x its load in upstream's way (call sites both; the worst)"
        ),
        ok,
        d,
    ));
    let (ok, d) = all(&|c| {
        // The clause: a package the bounds cannot serve by a
        // snapshot is cloned and named in the report with why.
        let named: usize = c
            .decisions
            .iter()
            .filter(|(how, _)| how.starts_with("cloned: "))
            .map(|(_, n)| n)
            .sum();
        (
            c.identity_kept.0 + named == c.identity_kept.1,
            format!(
                "{}: {} of {} kept, {named} cloned and named",
                c.packages, c.identity_kept.0, c.identity_kept.1
            ),
        )
    });
    v.push(Verdict::new(
        "boxes: every entry of every package keeps its inode number and birth time, or the package is cloned and named in the report with why (ours)"
            .to_owned(),
        ok,
        d,
    ));
    let (ok, d) = all(&|c| {
        let r = c.ours_total / c.upstream;
        (
            r <= WORK_AT_MOST,
            format!(
                "{}: {} vs {}: {:.2}x",
                c.packages,
                secs(c.ours_total),
                secs(c.upstream),
                r
            ),
        )
    });
    v.push(Verdict::new(
        format!(
            "boxes: all our work (cuts, rests, old trees; wall time from the start to the cleanup's end; the CPU time is each box's cpu line) <= {WORK_AT_MOST} x upstream's inline clone and removal"
        ),
        ok,
        d,
    ));
    v
}

/// Prints the `boxes` section.
pub fn print(cases: &[BoxCase], verdicts: &[Verdict]) {
    println!(
        "boxes: the first boot at 8 (the node box), 10 (each of 2,000 files), 30 and 150 packages (mostly 40 files, 3 and 5 of 10,000): ours against upstream's boot conversion, each on a fresh box"
    );
    println!(
        "{:>8}  {:>8}  {:>20}  {:>14}  {:>14}  {:>12}  {:>12}  {:>22}  {:>16}  {:>7}  {:>9}",
        "packages",
        "entries",
        "upstream (removal)",
        "its last load",
        "dominant ready",
        "last ready",
        "last load",
        "worst load vs theirs",
        "ours, all work",
        "ratio",
        "identity"
    );
    for c in cases {
        let upstream_last = c.upstream_loads.iter().map(|(_, t)| *t).fold(0.0, f64::max);
        println!(
            "{:>8}  {:>8}  {:>20}  {:>14}  {:>14}  {:>12}  {:>12}  {:>22}  {:>16}  {:>6.2}x  {:>9}",
            c.packages,
            fmt_count(c.entries),
            format!("{} ({})", secs(c.upstream), secs(c.upstream_removal)),
            secs(upstream_last),
            secs(c.dominant_ready),
            secs(c.last_ready),
            secs(c.last_load.1),
            format!("{} {:.2}x", c.load_ratio.0, c.load_ratio.1),
            secs(c.ours_total),
            c.ours_total / c.upstream,
            format!("{} of {}", c.identity_kept.0, c.identity_kept.1),
        );
        println!(
            "          schedule: {}; {} shares",
            c.decisions
                .iter()
                .map(|(how, n)| format!("{n} {how}"))
                .collect::<Vec<_>>()
                .join(", "),
            c.shares
        );
        println!(
            "          last loads (call sites): of a cloned package {} ({}), of a snapshotted one {} ({})",
            secs(c.last_loads[0].1),
            c.last_loads[0].0,
            secs(c.last_loads[1].1),
            c.last_loads[1].0
        );
        println!(
            "          cpu (this process, user + system, kernel threads not counted): upstream's {}, ours {}: {:.2}x",
            secs(c.cpu.0),
            secs(c.cpu.1),
            c.cpu.1 / c.cpu.0
        );
    }
    for v in verdicts {
        v.print();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use integration::call_sites::boot_loads::{BootLoads, PackageLoad};

    fn load(package: &str, started: Option<f64>, ready: f64) -> PackageLoad {
        PackageLoad {
            package: package.to_owned(),
            exchanged: None,
            exchanged_seen: None,
            load_started: started,
            volumes_ready: Some(ready),
            loaded: Ok(true),
            lock_waits: Vec::new(),
            held_after_exchange: None,
        }
    }

    /// Times from the first load's start, after the maintenance; and none
    /// at all when no load was seen starting (each would be minus
    /// infinity, and ours within any bound of it).
    #[test]
    fn upstream_times_count_from_the_first_load_or_fail() {
        let boot = |packages| BootLoads {
            order: Order::Upstream,
            packages,
        };
        let timed = upstream_times(
            &boot(vec![
                load("a", Some(100.0), 300.0),
                load("b", Some(150.0), 600.0),
            ]),
            2.0,
        )
        .expect("timed");
        assert_eq!(timed, [("a".to_owned(), 2.2), ("b".to_owned(), 2.5)]);
        let unseen = upstream_times(&boot(vec![load("a", None, 300.0)]), 2.0);
        assert!(unseen.is_err(), "{unseen:?}");
    }
}
