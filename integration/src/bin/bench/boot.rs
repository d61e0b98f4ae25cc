//! `boot`: the first boot of a box shaped like the field reports'
//! ([`integration::node`]: monerod's fragmented LMDB, bitcoind's NOCOW data
//! directory, electrs's 20,000 small files, five small packages, all plain
//! directories on the top-level subvolume), at each of `--boot-extents`
//! extents of monerod's database. Four ways, each on a fresh filesystem
//! with the same box, settled and out of the page cache:
//!
//! - upstream's boot conversion ([`integration::upstream`]): clone each
//!   root into a subvolume, swap, remove the old tree inline; every service
//!   waits for all of it;
//! - `cp -a --reflink=always` of every package, the copy upstream's update
//!   backups made before subvolumes (bitcoind's into a NOCOW directory, or
//!   cp refuses its files);
//! - ours, [`startos_core::volume::boot_volume_maintenance_at`]: each
//!   service may start when its own volume is ready; the old trees go in a
//!   background task, timed separately. Ours runs [`OURS_RUNS`] times, each
//!   on a fresh box, and the median run is reported;
//! - through start-core's own call sites ([`crate::boot_loads`]), ours in
//!   the readiness step and in upstream's order, each package's
//!   `Service::load` volume calls timed beside its volume's exchange.
//!
//! After upstream's and our conversions, the first writes to bitcoind's
//! NOCOW block files: whether either way left them copying on write.
//!
//! `costs`: the per-entry and per-extent costs [`volume_migrate::cost`]
//! states, measured again: each way of converting on trees that isolate
//! one unit; and what a NOCOW file's first writes cost once its subvolume
//! has been snapshotted, which is why such files outside the packages still
//! veto the snapshot.

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use integration::LoopFs;
use integration::compare::{Progress, block_on};
use integration::identity::{Identity, Kept, identities};
use integration::node::{self, NodeShape};
use models::PackageId;
use serde::Serialize;
use volume_migrate::cost;
use volume_migrate::{Method, MigrateOptions, Migrator};

use crate::common::{Result, fmt_count, fmt_duration, settle, timed};
use crate::{Verdict, drop_caches};

/// The box's extent counts at which ours must take at most this fraction
/// of upstream's time until every service may start.
const TARGETS: [(u64, f64); 2] = [(500_000, 0.3), (2_000_000, 0.1)];
/// Ours at the largest count within this much of ours at the smallest.
const FLAT_WITHIN: f64 = 0.2;
/// The longest a package may wait for its volume after the one before it
/// (issue 20): 50 ms.
const READY_STEP_AT_MOST: f64 = 0.05;
/// Our background work (the rests and the old trees) against upstream's
/// whole inline work (issue 20).
const BACKGROUND_AT_MOST: f64 = 1.5;
/// The extent count of the field report (PR #3533): 47 million.
const FIELD_EXTENTS: u64 = 47_000_000;
/// 4 KiB blocks of bitcoind's block files rewritten after the conversion.
const FIRST_WRITES: u64 = 4096;
/// Our way runs this many times at each count, each on a fresh box, and
/// the run with the median time until every service may start is the one
/// reported: a run of ours lasts about two seconds, and one run's clone of
/// electrs's 20,000 files took 0.78-1.39 s in four runs today, whatever
/// monerod held, which one run per count let decide the flatness target.
/// Upstream's and cp's runs, of 5-36 s, run once.
const OURS_RUNS: usize = 3;

/// One way's boot.
#[derive(Serialize, Clone)]
pub struct Way {
    /// Until every service may start (upstream: until its maintenance
    /// returned; cp: until the last copy finished).
    pub all_ready: f64,
    /// When the first service may start.
    pub first_ready: f64,
    /// From then, until the old trees were removed (ours).
    pub old_trees_after: Option<f64>,
    /// Of `all_ready`, the inline removal of the old trees (upstream's).
    pub old_trees_inline: Option<f64>,
    /// How each package was converted, where the way says.
    pub methods: Vec<(String, String)>,
    /// The longest any package waited for its volume after the one before
    /// it was ready (the first: after the start), seconds: what each
    /// package adds to its service's wait.
    pub longest_ready_step: f64,
    /// The most any package's wait for its volume came to per package
    /// ready by then (the k-th ready after t: t / k), seconds: the other
    /// reading of "at most 50 ms per package", where the first package may
    /// carry the boot's own start.
    pub ready_per_package: f64,
    /// Per package, the share of its entries (below its top) that kept
    /// their inode number and birth time through the conversion.
    pub identity_kept: Vec<(String, f64)>,
    /// Metadata bytes used before the conversion, and the most seen while
    /// the old trees went (ours: sampled every 20 ms through the cleanup;
    /// upstream: through its whole boot).
    pub metadata: Option<(u64, u64)>,
    /// What went wrong, if anything did.
    pub error: Option<String>,
}

/// The first writes to bitcoind's block files after a conversion.
#[derive(Serialize, Clone)]
pub struct FirstWrites {
    /// Their time, fdatasync included.
    pub seconds: f64,
    /// Extents the rewritten files gained: 0 when written in place.
    pub new_extents: i64,
    /// The 99th percentile of one write's latency (each 256th with its
    /// fdatasync), seconds.
    pub p99: f64,
    /// The longest one.
    pub max: f64,
}

/// Everything at one extent count.
#[derive(Serialize)]
pub struct BootCase {
    /// What monerod's database was fragmented to.
    pub target_extents: u64,
    /// What FIEMAP reports.
    pub extents: u64,
    /// The box's build time, per way.
    pub build_seconds: f64,
    /// Upstream's boot conversion.
    pub upstream: Way,
    /// `cp -a --reflink=always` of every package.
    pub cp: Way,
    /// Ours: the median of [`OURS_RUNS`] runs.
    pub ours: Way,
    /// Every run of ours, until every service may start, in seconds, in
    /// the order they ran.
    pub ours_runs: Vec<f64>,
    /// bitcoind's first writes after upstream's conversion, then ours
    /// (after our cleanup, to other blocks than the next).
    pub first_writes: (FirstWrites, FirstWrites),
    /// bitcoind's first writes after ours, as soon as every service may
    /// start, while the cleanup runs: what a node writes in that window.
    pub first_writes_during_cleanup: FirstWrites,
    /// Whether every timed run of ours kept monerod's database as the very
    /// same inode (same number and birth time): a cut keeps it, a clone
    /// makes a new one. The decisions printed are a dry run's; this is the
    /// runs'.
    pub dominant_cut_in_run: bool,
    /// Our schedule alone (deciding how to convert each package), timed
    /// from a cold cache on the box `cp` then copies: part of ours'
    /// `first_ready`.
    pub deciding_seconds: f64,
    /// What it decided, per package, in its order.
    pub decisions: Vec<(String, String)>,
    /// The same box's first boot through start-core's call sites, each
    /// package's `Service::load` volume calls timed, in the readiness step
    /// and in upstream's order.
    pub call_sites: crate::boot_loads::Fixture,
}

/// The `boot` section's results.
#[derive(Serialize)]
pub struct Report {
    /// One per extent count.
    pub cases: Vec<BootCase>,
    /// Upstream's and our seconds per monerod extent, fitted between the
    /// smallest and the largest count, and what they give for the field's
    /// 47 million extents.
    pub per_extent: Option<Extrapolation>,
    /// The targets.
    pub targets: Vec<Verdict>,
}

/// The time until every service may start, extrapolated.
#[derive(Serialize)]
pub struct Extrapolation {
    /// Upstream's seconds per extent.
    pub upstream_per_extent: f64,
    /// Ours.
    pub ours_per_extent: f64,
    /// Upstream at 47M extents, seconds.
    pub upstream_at_field: f64,
    /// Ours at 47M extents, seconds.
    pub ours_at_field: f64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Upstream,
    Cp,
    Ours,
}

/// A fresh filesystem with the box under `<mnt>/package-data/volumes`,
/// settled and out of the page cache.
fn fresh_box(shape: &NodeShape) -> Result<(LoopFs, std::path::PathBuf, u64, Duration)> {
    let fs = LoopFs::btrfs(shape.image_bytes())?;
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root)?;
    let ((_, extents), took) = timed(|| node::build(&root, shape))?;
    settle(fs.mount_point())?;
    drop_caches()?;
    Ok((fs, root, extents, took))
}

fn ids(shape: &NodeShape) -> Result<BTreeSet<PackageId>> {
    shape
        .packages()
        .iter()
        .map(|p| {
            p.parse::<PackageId>()
                .map_err(|e| format!("package id {p}: {e}").into())
        })
        .collect()
}

/// What one way measured on its box.
struct WayRun {
    way: Way,
    extents: u64,
    build: Duration,
    first_writes: Option<FirstWrites>,
    /// Ours only: first writes while the cleanup runs.
    first_writes_during_cleanup: Option<FirstWrites>,
    /// Ours only: whether monerod's database kept its inode.
    dominant_cut: Option<bool>,
    /// cp's box only: our schedule, timed cold before cp ran, and what it
    /// decided.
    schedule: Option<(Duration, Vec<(String, String)>)>,
}

/// Our schedule of the box under `root`, from a cold cache: its time and
/// decisions.
fn schedule_cold(
    root: &Path,
    ids: &BTreeSet<PackageId>,
) -> Result<(Duration, Vec<(String, String)>)> {
    drop_caches()?;
    let m = Migrator::open(root).map_err(|e| e.to_string())?;
    let all: Vec<PackageId> = ids.iter().cloned().collect();
    let opts = MigrateOptions {
        defer_cut: true,
        ..MigrateOptions::default()
    };
    let (plan, took) = timed(|| m.schedule(&all, &opts).map_err(|e| e.to_string()))?;
    drop_caches()?;
    let decisions = plan
        .iter()
        .map(|p| {
            let how = match &p.decision {
                Some(volume_migrate::Decision::SnapshotParent) => format!(
                    "snapshot the parent (cut {}, clone {})",
                    p.cut
                        .map_or("-".to_owned(), |c| secs(c.duration().as_secs_f64())),
                    p.clone.map_or("-".to_owned(), |c| format!(
                        "{}{}",
                        if c.at_least { ">= " } else { "" },
                        secs(c.duration().as_secs_f64())
                    )),
                ),
                Some(volume_migrate::Decision::Clone(why)) => format!("clone ({why})"),
                None => "leftovers".to_owned(),
            };
            (p.package.to_string(), how)
        })
        .collect();
    Ok((took, decisions))
}

/// One way, on its own fresh box.
fn run_way(shape: &NodeShape, kind: Kind) -> Result<WayRun> {
    let (fs, root, extents, build) = fresh_box(shape)?;
    let ids = ids(shape)?;
    let schedule = match kind {
        Kind::Cp => Some(schedule_cold(&root, &ids)?),
        Kind::Upstream | Kind::Ours => None,
    };
    let mut way = Way {
        all_ready: 0.0,
        first_ready: 0.0,
        old_trees_after: None,
        old_trees_inline: None,
        methods: Vec::new(),
        longest_ready_step: 0.0,
        ready_per_package: 0.0,
        identity_kept: Vec::new(),
        metadata: None,
        error: None,
    };
    let identities_before: Vec<(String, Identities)> = shape
        .packages()
        .iter()
        .map(|p| Ok((p.to_string(), identities(&root.join(p))?)))
        .collect::<Result<_>>()?;

    let meta_fd = fs::File::open(fs.mount_point())?;
    let metadata_before = volume::sys::metadata_space(meta_fd.as_fd())?.used;
    let mut first_during = None;
    let mut dominant_cut = None;
    let db = root.join(node::DOMINANT).join("data/main/lmdb/data.mdb");
    let identity = |m: fs::Metadata| m.created().map(|born| (m.ino(), born));
    let db_before = identity(fs::metadata(&db)?)?;
    let started = Instant::now();
    match kind {
        Kind::Upstream => {
            let mut progress = Progress::new();
            let sampler = MetadataPeak::start(fs.mount_point())?;
            let report =
                integration::upstream::boot_volume_maintenance(&root, &ids, &ids, &mut progress)
                    .map_err(|e| format!("upstream's boot: {e}"))?;
            way.metadata = Some((metadata_before, sampler.stop()?));
            way.all_ready = started.elapsed().as_secs_f64();
            way.first_ready = way.all_ready;
            way.error = report
                .conversions
                .iter()
                .find_map(|c| c.error.as_ref().map(|e| format!("{}: {e:?}", c.package)));
            way.old_trees_inline = Some(
                report
                    .conversions
                    .iter()
                    .map(|c| c.removal_time.as_secs_f64())
                    .sum(),
            );
            way.methods = report
                .conversions
                .iter()
                .map(|c| (c.package.to_string(), "clone".to_owned()))
                .collect();
        }
        Kind::Cp => {
            for p in shape.packages() {
                let dst = root.join(format!("{p}.cp"));
                if p == node::NOCOW_PACKAGE {
                    // cp cannot clone a NOCOW file into a COW one: the data
                    // directory is made first, NOCOW, for cp to copy into.
                    let data = dst.join("data/main/bitcoin");
                    fs::create_dir_all(&data)?;
                    let dir = fs::File::open(&data)?;
                    let flags = rustix::fs::ioctl_getflags(&dir)?;
                    rustix::fs::ioctl_setflags(&dir, flags | rustix::fs::IFlags::NOCOW)?;
                    integration::run(
                        std::process::Command::new("cp")
                            .args(["-a", "--reflink=always", "-T"])
                            .arg(root.join(p))
                            .arg(&dst),
                    )?;
                } else {
                    crate::common::cp_reflink(&root.join(p), &dst)?;
                }
            }
            way.all_ready = started.elapsed().as_secs_f64();
            way.first_ready = way.all_ready;
        }
        Kind::Ours => {
            let mut progress = Progress::new();
            let (returned, cleanup_done, during, kept) = block_on(async {
                let mut b = startos_core::volume::boot_volume_maintenance_at(
                    &root,
                    &ids,
                    &ids,
                    &mut progress,
                )
                .await
                .map_err(|e| format!("our boot: {e}"))?;
                let returned = started.elapsed();
                if let Some((p, e)) = b.failed.first() {
                    return Err(format!("our boot: {p}: {e}"));
                }
                let kept = fs::metadata(&db)
                    .and_then(identity)
                    .map_err(|e| format!("monerod's database: {e}"))?
                    == db_before;
                // bitcoind writes as soon as it may start, the cleanup
                // running beside it (on the blocking pool).
                let sampler = MetadataPeak::start(fs.mount_point()).map_err(|e| e.to_string())?;
                let during = first_writes(&root, 0).map_err(|e| format!("first writes: {e}"))?;
                if let Some(c) = b.cleanup.take() {
                    c.await
                        .map_err(|e| format!("cleanup task: {e}"))?
                        .map_err(|e| format!("cleanup: {e}"))?;
                }
                let done = started.elapsed();
                let peak = sampler.stop().map_err(|e| e.to_string())?;
                Ok::<_, String>((returned, done, during, (kept, peak)))
            })?;
            let (kept, peak) = kept;
            way.metadata = Some((metadata_before, peak));
            first_during = Some(during);
            dominant_cut = Some(kept);
            let readies: Vec<Duration> = progress.ready.iter().map(|(_, t)| *t).collect();
            let all = readies.iter().max().copied().unwrap_or(returned);
            way.all_ready = all.as_secs_f64();
            way.first_ready = readies.iter().min().copied().unwrap_or(all).as_secs_f64();
            let mut sorted = readies.clone();
            sorted.sort();
            way.longest_ready_step = sorted
                .iter()
                .scan(Duration::ZERO, |prev, &t| {
                    let step = t.saturating_sub(*prev);
                    *prev = t;
                    Some(step)
                })
                .max()
                .unwrap_or(all)
                .as_secs_f64();
            way.ready_per_package = sorted
                .iter()
                .zip(1u32..)
                .map(|(t, k)| t.as_secs_f64() / f64::from(k))
                .fold(0.0, f64::max);
            way.old_trees_after = Some((cleanup_done - all).as_secs_f64());
            // How each was converted, from the plan a dry run of the same
            // box gives (the conversion itself reports to the boot only
            // readiness).
            way.methods = ready_order(&progress);
        }
    }
    if kind == Kind::Upstream {
        way.longest_ready_step = way.all_ready;
        way.ready_per_package = way.all_ready;
    }
    way.identity_kept = identities_before
        .iter()
        .map(|(p, before)| {
            let dir = match kind {
                Kind::Cp => root.join(format!("{p}.cp")),
                Kind::Upstream | Kind::Ours => root.join(p),
            };
            Ok((p.clone(), Kept::of(before, &identities(&dir)?).shares().0))
        })
        .collect::<Result<_>>()?;
    let first = match kind {
        Kind::Cp => None,
        Kind::Upstream | Kind::Ours => {
            settle(fs.mount_point())?;
            // Other blocks than those written during the cleanup.
            Some(first_writes(&root, FIRST_WRITES)?)
        }
    };
    fs.close()?;
    Ok(WayRun {
        way,
        extents,
        build,
        first_writes: first,
        first_writes_during_cleanup: first_during,
        dominant_cut,
        schedule,
    })
}

/// Packages in the order they were reported ready, with when.
fn ready_order(p: &Progress) -> Vec<(String, String)> {
    p.ready
        .iter()
        .map(|(pkg, t)| (pkg.clone(), format!("ready at {}", fmt_duration(*t))))
        .collect()
}

/// Rewrites [`FIRST_WRITES`] scattered 4 KiB blocks of bitcoind's first
/// block files, with an fdatasync each 256, and counts the extents they
/// gained. `skip`: how many of the sequence's blocks to pass over first,
/// so that a second call writes other blocks.
fn first_writes(root: &Path, skip: u64) -> Result<FirstWrites> {
    let files: Vec<_> = (0..8).map(|i| node::block_file(root, i)).collect();
    let before: u64 = files
        .iter()
        .map(|f| integration::extent_count(f))
        .sum::<std::io::Result<u64>>()?;
    let open: Vec<fs::File> = files
        .iter()
        .map(|f| fs::OpenOptions::new().write(true).open(f))
        .collect::<std::io::Result<_>>()?;
    let block = vec![0x5au8; 4096];
    let mut latencies = Vec::with_capacity(FIRST_WRITES as usize);
    let ((), took) = timed(|| -> Result<()> {
        for i in skip..skip + FIRST_WRITES {
            let f = &open[(i % 8) as usize];
            let blocks = f.metadata()?.len() / 4096;
            let at = (i.wrapping_mul(2_654_435_761) % blocks.max(1)) * 4096;
            let one = Instant::now();
            f.write_all_at(&block, at)?;
            if i % 256 == 255 {
                f.sync_data()?;
            }
            latencies.push(one.elapsed().as_secs_f64());
        }
        for f in &open {
            f.sync_data()?;
        }
        Ok(())
    })?;
    let after: u64 = files
        .iter()
        .map(|f| integration::extent_count(f))
        .sum::<std::io::Result<u64>>()?;
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Ok(FirstWrites {
        seconds: took.as_secs_f64(),
        new_extents: after as i64 - before as i64,
        p99: at(0.99),
        max: latencies.last().copied().unwrap_or(0.0),
    })
}

/// Every entry below a package's top, by path.
type Identities = std::collections::BTreeMap<PathBuf, Identity>;

/// The most metadata bytes used, sampled every 20 ms on a thread of its
/// own until [`MetadataPeak::stop`].
struct MetadataPeak {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<std::io::Result<u64>>,
}

impl MetadataPeak {
    fn start(mount: &Path) -> Result<MetadataPeak> {
        let fd = fs::File::open(mount)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            loop {
                peak = peak.max(volume::sys::metadata_space(fd.as_fd())?.used);
                if flag.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(peak);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Ok(MetadataPeak { stop, thread })
    }

    fn stop(self) -> Result<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(self
            .thread
            .join()
            .map_err(|_| "the metadata sampler panicked")??)
    }
}

/// The `boot` section, one case per box.
pub fn run(shapes: &[NodeShape]) -> Result<Report> {
    let mut cases = Vec::new();
    for shape in shapes {
        let (shape, target) = (*shape, shape.monerod_extents);
        eprintln!(
            "boot: the box with monerod at {} extents: upstream's conversion",
            fmt_count(target)
        );
        let up = run_way(&shape, Kind::Upstream)?;
        eprintln!("boot: cp -a --reflink=always of every package (our schedule first, alone)");
        let cp = run_way(&shape, Kind::Cp)?;
        let mut runs = Vec::new();
        for i in 0..OURS_RUNS {
            eprintln!("boot: ours, run {} of {OURS_RUNS}", i + 1);
            runs.push(run_way(&shape, Kind::Ours)?);
        }
        let ours_runs: Vec<f64> = runs.iter().map(|r| r.way.all_ready).collect();
        let every_run_cut = runs.iter().all(|r| r.dominant_cut == Some(true));
        runs.sort_by(|a, b| a.way.all_ready.total_cmp(&b.way.all_ready));
        let ours = runs.swap_remove(runs.len() / 2);
        let call_sites = crate::boot_loads::run(&shape)?;
        let missing = || "first writes not measured".to_owned();
        let (deciding, decisions) = cp.schedule.ok_or("the schedule was not timed")?;
        cases.push(BootCase {
            target_extents: target,
            extents: up.extents,
            build_seconds: up.build.as_secs_f64(),
            upstream: up.way,
            cp: cp.way,
            ours: ours.way,
            ours_runs,
            first_writes: (
                up.first_writes.ok_or_else(missing)?,
                ours.first_writes.ok_or_else(missing)?,
            ),
            first_writes_during_cleanup: ours.first_writes_during_cleanup.ok_or_else(missing)?,
            dominant_cut_in_run: ours.dominant_cut.ok_or_else(missing)? && every_run_cut,
            deciding_seconds: deciding.as_secs_f64(),
            decisions,
            call_sites,
        });
    }
    let per_extent = match (cases.first(), cases.last()) {
        (Some(a), Some(b)) if b.extents > a.extents => {
            let span = (b.extents - a.extents) as f64;
            let up = (b.upstream.all_ready - a.upstream.all_ready) / span;
            let ours = (b.ours.all_ready - a.ours.all_ready) / span;
            let left = FIELD_EXTENTS.saturating_sub(b.extents) as f64;
            Some(Extrapolation {
                upstream_per_extent: up,
                ours_per_extent: ours,
                upstream_at_field: b.upstream.all_ready + up * left,
                ours_at_field: b.ours.all_ready + ours.max(0.0) * left,
            })
        }
        _ => None,
    };
    let mut targets = Vec::new();
    for (at, fraction) in TARGETS {
        if let Some(c) = cases.iter().find(|c| c.target_extents == at) {
            let ratio = c.ours.all_ready / c.upstream.all_ready;
            targets.push(Verdict::new(
                format!(
                    "boot: every service may start, ours <= {fraction} x upstream's at {} extents",
                    fmt_count(at)
                ),
                ratio <= fraction,
                format!(
                    "{} vs {}: {}",
                    secs(c.ours.all_ready),
                    secs(c.upstream.all_ready),
                    fmt_ratio(ratio)
                ),
            ));
        }
    }
    targets.push(Verdict::new(
        "boot: monerod converted in O(1) (its database kept as the same inode) in every timed run"
            .to_owned(),
        cases.iter().all(|c| c.dominant_cut_in_run),
        cases
            .iter()
            .map(|c| {
                format!(
                    "{} extents: {}",
                    fmt_count(c.target_extents),
                    if c.dominant_cut_in_run {
                        "cut"
                    } else {
                        "cloned"
                    }
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
    ));
    let each = |f: &dyn Fn(&BootCase) -> (bool, String)| {
        let all: Vec<(bool, String)> = cases.iter().map(f).collect();
        (
            all.iter().all(|(ok, _)| *ok),
            all.into_iter()
                .map(|(_, s)| s)
                .collect::<Vec<_>>()
                .join(", "),
        )
    };
    // Both readings of "at most 50 ms per package", each a figure of ours.
    let ready_within = |title: String, of: fn(&Way) -> f64| {
        let (ok, detail) = each(&|c| {
            let t = of(&c.ours);
            (
                t <= READY_STEP_AT_MOST,
                format!("{} extents: {}", fmt_count(c.target_extents), secs(t)),
            )
        });
        Verdict::new(title, ok, detail)
    };
    let step = secs(READY_STEP_AT_MOST);
    targets.push(ready_within(
        format!("boot: each package's volume ready within {step} of the one before it (ours)"),
        |w| w.longest_ready_step,
    ));
    targets.push(ready_within(
        format!("boot: the k-th package's volume ready within k x {step} (ours)"),
        |w| w.ready_per_package,
    ));
    let (ok, detail) = each(&|c| {
        let kept = c.ours.identity_kept.iter().all(|(_, share)| *share == 1.0);
        let up = c.upstream.identity_kept.iter().map(|(_, s)| s).sum::<f64>()
            / c.upstream.identity_kept.len().max(1) as f64;
        (
            kept,
            format!(
                "{} extents: ours {} of {} packages, upstream {:.0}% of entries",
                fmt_count(c.target_extents),
                c.ours
                    .identity_kept
                    .iter()
                    .filter(|(_, s)| *s == 1.0)
                    .count(),
                c.ours.identity_kept.len(),
                up * 100.0
            ),
        )
    });
    targets.push(Verdict::new(
        "boot: every entry of every package keeps its inode number and birth time (ours)"
            .to_owned(),
        ok,
        detail,
    ));
    let (ok, detail) = each(&|c| {
        let ours = c.ours.old_trees_after.unwrap_or(f64::INFINITY);
        let ratio = ours / c.upstream.all_ready;
        (
            ratio <= BACKGROUND_AT_MOST,
            format!(
                "{} extents: {} vs {}: {}",
                fmt_count(c.target_extents),
                secs(ours),
                secs(c.upstream.all_ready),
                fmt_ratio(ratio)
            ),
        )
    });
    targets.push(Verdict::new(
        format!(
            "boot: our background work <= {BACKGROUND_AT_MOST} x upstream's inline clone and removal"
        ),
        ok,
        detail,
    ));
    if let (Some(a), Some(b)) = (cases.first(), cases.last())
        && cases.len() > 1
    {
        let change = b.ours.all_ready / a.ours.all_ready - 1.0;
        targets.push(Verdict::new(
            format!(
                "boot: ours the same within {:.0}% at {} and {} extents",
                FLAT_WITHIN * 100.0,
                fmt_count(a.target_extents),
                fmt_count(b.target_extents)
            ),
            change.abs() <= FLAT_WITHIN,
            format!(
                "{} vs {} ({:+.0}%)",
                secs(a.ours.all_ready),
                secs(b.ours.all_ready),
                change * 100.0
            ),
        ));
    }
    let fixtures: Vec<(u64, &crate::boot_loads::Fixture)> = cases
        .iter()
        .map(|c| (c.target_extents, &c.call_sites))
        .collect();
    targets.extend(crate::boot_loads::verdicts(&fixtures));
    Ok(Report {
        cases,
        per_extent,
        targets,
    })
}

/// `0.07x`: two decimals, since these ratios are fractions.
fn fmt_ratio(r: f64) -> String {
    format!("{r:.2}x")
}

fn secs(s: f64) -> String {
    fmt_duration(Duration::from_secs_f64(s.max(0.0)))
}

/// Prints the `boot` section.
pub fn print(r: &Report) {
    println!(
        "boot: a box shaped like the field reports' (monerod LMDB, bitcoind +C, electrs 20,000 files, 5 small packages), all plain directories"
    );
    println!(
        "{:>11}  {:>26}  {:>14}  {:>26}  {:>9}  {:>9}",
        "db extents",
        "upstream's boot conversion",
        "cp -a --reflink",
        "ours: every service may start",
        "ours/up",
        "ours/cp"
    );
    for c in &r.cases {
        println!(
            "{:>11}  {:>26}  {:>14}  {:>26}  {:>9}  {:>9}",
            fmt_count(c.extents),
            secs(c.upstream.all_ready),
            secs(c.cp.all_ready),
            format!(
                "{} (first {})",
                secs(c.ours.all_ready),
                secs(c.ours.first_ready)
            ),
            fmt_ratio(c.ours.all_ready / c.upstream.all_ready),
            fmt_ratio(c.ours.all_ready / c.cp.all_ready),
        );
    }
    println!(
        "  ours: the median of {OURS_RUNS} runs, each on a fresh box, in the order they ran: {}",
        r.cases
            .iter()
            .map(|c| format!(
                "{} extents {}",
                fmt_count(c.extents),
                c.ours_runs
                    .iter()
                    .map(|t| secs(*t))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
    println!(
        "  old trees: upstream removes them inline (inside its time above); ours after every service may start:"
    );
    for c in &r.cases {
        println!(
            "    {:>11} extents: upstream's inline removal took {}; ours removed them {} later, in the background; ready: {}",
            fmt_count(c.extents),
            c.upstream.old_trees_inline.map_or("-".to_owned(), secs),
            c.ours.old_trees_after.map_or("-".to_owned(), secs),
            c.ours
                .methods
                .iter()
                .map(|(p, how)| format!("{p} {how}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        // Packages with the same decision on one line.
        let mut grouped: Vec<(String, Vec<&str>)> = Vec::new();
        for (p, how) in &c.decisions {
            match grouped.iter_mut().find(|(h, _)| h == how) {
                Some((_, ps)) => ps.push(p),
                None => grouped.push((how.clone(), vec![p])),
            }
        }
        println!(
            "    {:>11} extents: our schedule alone, once more from a cold cache (on cp's box): {}",
            fmt_count(c.extents),
            secs(c.deciding_seconds),
        );
        for (how, ps) in grouped {
            println!("        {}: {how}", ps.join(", "));
        }
        if let Some(e) = &c.upstream.error {
            println!("    upstream failed: {e}");
        }
        let (u, o) = &c.first_writes;
        println!(
            "    bitcoind's first {} writes (NOCOW block files): after upstream's conversion {} ({:+} extents), after ours {} ({:+} extents)",
            FIRST_WRITES,
            secs(u.seconds),
            u.new_extents,
            secs(o.seconds),
            o.new_extents
        );
        println!(
            "      monerod in our timed run: {}",
            if c.dominant_cut_in_run {
                "its database the same inode (cut from the parent's snapshot)"
            } else {
                "its database a new inode (cloned)"
            }
        );
        let d = &c.first_writes_during_cleanup;
        println!(
            "      ours as soon as every service may start, the cleanup running: {} ({:+} extents)",
            secs(d.seconds),
            d.new_extents
        );
        println!(
            "      one write's latency (4 KiB, each 256th with fdatasync), p99 / max: ours during the cleanup {} / {}, after it {} / {}; after upstream's boot {} / {} (its services do not run during its work)",
            secs(d.p99),
            secs(d.max),
            secs(o.p99),
            secs(o.max),
            secs(u.p99),
            secs(u.max)
        );
        println!(
            "      each package's wait after the one before: ours at most {}; upstream {} (every service waits for all)",
            secs(c.ours.longest_ready_step),
            secs(c.upstream.longest_ready_step)
        );
        let mib = |b: u64| format!("{:.0} MiB", b as f64 / f64::from(1u32 << 20));
        for (who, w) in [("upstream", &c.upstream), ("ours", &c.ours)] {
            if let Some((before, peak)) = w.metadata {
                println!(
                    "      metadata used: {who} {} before, at most {} while the old trees went (+{})",
                    mib(before),
                    mib(peak),
                    mib(peak.saturating_sub(before))
                );
            }
        }
        let share = |w: &Way| {
            w.identity_kept
                .iter()
                .map(|(p, s)| format!("{p} {:.0}%", s * 100.0))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "      entries keeping inode number and birth time: upstream {}; ours {}",
            share(&c.upstream),
            share(&c.ours)
        );
        crate::boot_loads::print(c.extents, &c.call_sites, c.ours.all_ready);
    }
    if let Some(x) = &r.per_extent {
        println!(
            "  per monerod extent, fitted between the counts: upstream {:.2} us, ours {:.3} us; at the field's {} extents: upstream {}, ours {}",
            x.upstream_per_extent * 1e6,
            x.ours_per_extent * 1e6,
            fmt_count(FIELD_EXTENTS),
            secs(x.upstream_at_field),
            secs(x.ours_at_field)
        );
    }
    for v in &r.targets {
        v.print();
    }
}

// ------------------------------------------------------------------ costs

/// Small files of the per-entry trees.
const COST_FILES: usize = 20_000;
/// Extents of the per-extent file.
const COST_EXTENTS: u64 = 200_000;

/// One unit's cost, measured against what `cost.rs` states.
#[derive(Serialize)]
pub struct UnitCost {
    /// What is measured.
    pub what: String,
    /// Microseconds per unit, measured now.
    pub measured_us: f64,
    /// What `volume_migrate::cost` states.
    pub stated_us: u64,
}

/// The `costs` section's results.
#[derive(Serialize)]
pub struct CostReport {
    /// Per entry and per extent, each way.
    pub units: Vec<UnitCost>,
    /// A NOCOW file's first writes in a never-snapshotted subvolume, then
    /// in one whose snapshot was taken and deleted: seconds and extents
    /// gained.
    pub nocow_first_writes: [(f64, i64); 2],
}

fn small_files(dir: &Path, n: usize) -> Result<()> {
    let data = vec![7u8; 8192];
    for i in 0..n {
        let sub = dir.join(format!("d{}", i / 1000));
        if i % 1000 == 0 {
            fs::create_dir_all(&sub)?;
        }
        fs::write(sub.join(format!("f{i}")), &data)?;
    }
    Ok(())
}

/// Converts `pkg` under `root` by `method` (the cut not deferred), from a
/// settled filesystem out of the page cache; returns its time.
fn convert(fs: &LoopFs, root: &Path, pkg: &str, method: Method) -> Result<Duration> {
    settle(fs.mount_point())?;
    drop_caches()?;
    let m = Migrator::open(root).map_err(|e| e.to_string())?;
    let opts = MigrateOptions {
        method,
        remove_old: false,
        ..MigrateOptions::default()
    };
    let id: PackageId = pkg.parse().map_err(|e| format!("{e}"))?;
    let (r, took) = timed(|| {
        m.convert(&id, &opts, &mut |_: &volume_migrate::Progress| {})
            .map_err(|e| e.to_string())
    })?;
    if r.method != Some(method) {
        return Err(format!("{pkg}: converted by {:?}, not {method:?}", r.method).into());
    }
    Ok(took)
}

/// A filesystem with `<root>/a` and `<root>/b` built by `build`.
fn pair(build: impl FnOnce(&Path) -> Result<u64>) -> Result<(LoopFs, std::path::PathBuf, u64)> {
    let fs = LoopFs::btrfs(8 << 30)?;
    let root = fs.path("volumes");
    fs::create_dir_all(&root)?;
    let n = build(&root)?;
    Ok((fs, root, n))
}

/// The `costs` section.
pub fn run_costs() -> Result<CostReport> {
    let frag = |dir: &Path| -> Result<u64> {
        fs::create_dir_all(dir)?;
        Ok(integration::make_fragmented_file(
            &dir.join("db"),
            COST_EXTENTS * 5 * 1024,
            COST_EXTENTS,
            1,
        )?)
    };
    eprintln!(
        "costs: cloning {} files, then {} extents",
        fmt_count(COST_FILES as u64),
        fmt_count(COST_EXTENTS)
    );
    let (fs, root, extents) = pair(|root| {
        small_files(&root.join("files/data"), COST_FILES)?;
        frag(&root.join("frag/data"))
    })?;
    let clone_files = convert(&fs, &root, "files", Method::Clone)?;
    let clone_frag = convert(&fs, &root, "frag", Method::Clone)?;
    fs.close()?;
    eprintln!("costs: cutting them out of a parent's snapshot");
    // The package converted is small; what the cut removes is the other.
    let (fs, root, _) = pair(|root| {
        small_files(&root.join("rest/data"), COST_FILES)?;
        fs::create_dir_all(root.join("kept/data"))?;
        fs::write(root.join("kept/data/f"), b"kept")?;
        Ok(0)
    })?;
    let cut_files = convert(&fs, &root, "kept", Method::SnapshotParent)?;
    fs.close()?;
    let (fs, root, cut_extents) = pair(|root| {
        fs::create_dir_all(root.join("kept/data"))?;
        fs::write(root.join("kept/data/f"), b"kept")?;
        frag(&root.join("rest/data"))
    })?;
    let cut_frag = convert(&fs, &root, "kept", Method::SnapshotParent)?;
    fs.close()?;

    let per = |d: Duration, n: u64| d.as_secs_f64() * 1e6 / n as f64;
    let (cf, cx) = (
        per(clone_files, COST_FILES as u64),
        per(clone_frag, extents),
    );
    let (kf, kx) = (
        per(cut_files, COST_FILES as u64),
        per(cut_frag, cut_extents),
    );
    // Each small file is one entry and one extent.
    let units = vec![
        UnitCost {
            what: "clone, per entry".into(),
            measured_us: cf - cx,
            stated_us: cost::CLONE_ENTRY_US,
        },
        UnitCost {
            what: "clone, per extent".into(),
            measured_us: cx,
            stated_us: cost::CLONE_EXTENT_US,
        },
        UnitCost {
            what: "cut, per entry".into(),
            measured_us: kf - kx,
            stated_us: cost::CUT_ENTRY_US,
        },
        UnitCost {
            what: "cut, per extent".into(),
            measured_us: kx,
            stated_us: cost::CUT_EXTENT_US,
        },
    ];

    eprintln!("costs: a NOCOW file's first writes, before and after a snapshot");
    let fs = LoopFs::btrfs(2 << 30)?;
    let mut nocow = [(0.0, 0); 2];
    for (i, snapshotted) in [false, true].into_iter().enumerate() {
        let sub = fs.path(format!("sub{i}"));
        integration::run(
            std::process::Command::new("btrfs")
                .args(["subvolume", "create"])
                .arg(&sub),
        )?;
        let file = sub.join("nocow.img");
        let f = fs::File::create(&file)?;
        let flags = rustix::fs::ioctl_getflags(&f)?;
        rustix::fs::ioctl_setflags(&f, flags | rustix::fs::IFlags::NOCOW)?;
        f.write_all_at(&vec![1u8; 64 << 20], 0)?;
        f.sync_all()?;
        drop(f);
        if snapshotted {
            let snap = fs.path(format!("sub{i}-snap"));
            integration::run(
                std::process::Command::new("btrfs")
                    .args(["subvolume", "snapshot"])
                    .arg(&sub)
                    .arg(&snap),
            )?;
            integration::run(
                std::process::Command::new("btrfs")
                    .args(["subvolume", "delete"])
                    .arg(&snap),
            )?;
        }
        settle(fs.mount_point())?;
        let before = integration::extent_count(&file)?;
        let f = fs::OpenOptions::new().write(true).open(&file)?;
        let block = vec![0x5au8; 4096];
        let ((), took) = timed(|| -> Result<()> {
            for j in 0..FIRST_WRITES {
                f.write_all_at(&block, (j.wrapping_mul(2_654_435_761) % (16 << 10)) * 4096)?;
                if j % 256 == 255 {
                    f.sync_data()?;
                }
            }
            f.sync_data()?;
            Ok(())
        })?;
        nocow[i] = (
            took.as_secs_f64(),
            integration::extent_count(&file)? as i64 - before as i64,
        );
    }
    fs.close()?;
    Ok(CostReport {
        units,
        nocow_first_writes: nocow,
    })
}

/// Prints the `costs` section.
pub fn print_costs(r: &CostReport) {
    println!(
        "costs: what volume_migrate::cost states, measured again ({} files of 8 KiB; one file of {} extents)",
        fmt_count(COST_FILES as u64),
        fmt_count(COST_EXTENTS)
    );
    println!(
        "{:>20}  {:>10}  {:>8}  {:>9}",
        "", "measured", "stated", "stated/measured"
    );
    for u in &r.units {
        println!(
            "{:>20}  {:>8.2}us  {:>6}us  {:>9}",
            u.what,
            u.measured_us,
            u.stated_us,
            fmt_ratio(u.stated_us as f64 / u.measured_us)
        );
    }
    let [(a, ae), (b, be)] = r.nocow_first_writes;
    println!(
        "  a NOCOW file's first {} writes: never snapshotted {} ({:+} extents); after a snapshot, deleted since, {} ({:+} extents)",
        FIRST_WRITES,
        secs(a),
        ae,
        secs(b),
        be
    );
}
