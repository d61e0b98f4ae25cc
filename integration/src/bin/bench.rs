//! `make bench`: upstream's install backup (`cp -a --reflink=always`, then
//! `rm -rf` or `rm -rf` + `mv`) against subvolume snapshots from the `volume`
//! crate, on a loop-mounted btrfs, for database files of increasing
//! fragmentation.
//!
//! For each extent count: a fresh btrfs image, one package volume created with
//! [`volume::VolumeStore::create`] (a subvolume) holding one file fragmented
//! like a random-write database, then `--runs` rounds (after one untimed
//! warm-up round) in which every operation, upstream's and ours, runs once.
//! Before each timed operation all dirty data and metadata is committed, the
//! btrfs cleaner is idle and the file's pages are out of the page cache, so
//! every operation starts from the same state; the time that flush took after
//! an operation is reported separately as its background work. (Deleting a
//! volume evicts its cached pages synchronously: see the `demo` for a restore
//! with the database cached.)
//!
//! Upstream's commands run against the subvolume layout: `cp -a
//! --reflink=always` of the package directory still clones every extent one
//! by one, and `rm -rf` still unlinks file by file, which is exactly
//! upstream's cost on its plain directories.
//!
//! Two more sections share one fixture (a subvolume of about 100k small
//! files and one of a file fragmented to about 500k extents, on one more
//! btrfs image): `usage` times our space accounting against compsize and
//! `btrfs filesystem du` ([`usage`]), `migrate` times converting plain
//! directories into subvolumes against `cp -a --reflink=always` ([`migrate`]).
//! One more, `finalize`, times a whole update of a running service whose
//! volume holds the fragmented file, our finalization against upstream's
//! order, at the same extent counts as the snapshot section ([`finalize`]).
//! `commits` times starting a btrfs commit, the bare ioctl against ours
//! ([`commits`]).
//! `boot` times the first boot of a box shaped like the field reports'
//! ([`boot`]), and beside its event times the readiness a service sees
//! through start-core's own call sites, its `Service::load` volume calls
//! timed ([`boot_loads`]; `loads` runs those rows alone, and
//! `--boot-small` runs both on the test suite's box, `loads` in about half
//! a minute).
//! `purge` times a restore and a delete of a volume of 100k and 1M cached
//! small files: the call a user waits on, and the purge after it
//! ([`purge`]).
//! `lmdb` runs the snapshot and usage sections' rows on the seed's database
//! for real, an LMDB environment written by LMDB, every key checked after
//! each restore ([`lmdb`]).
//! `--only` picks sections; each prints its own table and target lines.
//!
//! The benchmark reports; it does not assert. It exits 0 whatever the figures,
//! and 1 with one line on stderr if something failed.

#[path = "bench/boot.rs"]
mod boot;
#[path = "bench/boot_loads.rs"]
mod boot_loads;
#[path = "bench/boxes.rs"]
mod boxes;
#[path = "bench/commits.rs"]
mod commits;
mod common;
#[path = "bench/finalize.rs"]
mod finalize;
#[path = "bench/fixture.rs"]
mod fixture;
#[path = "bench/lmdb.rs"]
mod lmdb;
#[path = "bench/memory.rs"]
mod memory;
#[path = "bench/migrate.rs"]
mod migrate;
#[path = "bench/purge.rs"]
mod purge;
#[path = "bench/usage.rs"]
mod usage;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use serde::Serialize;

use crate::common::{
    Result, Scratch, fmt_bytes, fmt_count, fmt_duration, fmt_ratio, scribble, timed,
};
use crate::fixture::Fixture;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// Blocks changed in the live file before each restore.
const SCRIBBLE_BLOCKS: u64 = 16;
/// Our operations must stay below this median at every extent count.
const OURS_TARGET: Duration = Duration::from_millis(20);
/// At or above this many extents our snapshot must be this much faster.
const SPEEDUP_EXTENTS: u64 = 500_000;
const SPEEDUP_TARGET: f64 = 200.0;

/// Default timed rounds of the `snapshot` and `usage` sections.
const DEFAULT_RUNS: u32 = 5;
/// Default timed rounds of the `migrate` section, whose rounds take longest.
const DEFAULT_MIGRATE_RUNS: u32 = 3;

/// A part of the benchmark.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Section {
    /// Install backups: cp --reflink / rm -rf against snapshots.
    Snapshot,
    /// Space accounting: ours against compsize and btrfs filesystem du.
    Usage,
    /// Converting plain directories: ours against cp --reflink.
    Migrate,
    /// A whole update of a running service: ours against upstream's order.
    Finalize,
    /// The first boot of a box shaped like the field reports': upstream's
    /// boot conversion, cp --reflink and ours.
    Boot,
    /// The per-entry and per-extent costs the conversion's rule uses,
    /// measured again.
    Costs,
    /// Starting a btrfs commit: the bare ioctl's stalls against ours.
    Commits,
    /// The boot section's rows through start-core's call sites alone: each
    /// package's `Service::load` volume calls timed, in the readiness step
    /// and in upstream's order (the boot section runs them too).
    Loads,
    /// Restore and delete of a volume of many cached files: the call, and
    /// the purge after it.
    Purge,
    /// The snapshot and usage rows on a real LMDB environment, every key
    /// checked after each restore.
    Lmdb,
    /// The first boot at 8, 30 and 150 packages: readiness and the whole
    /// work, ours against upstream's boot conversion.
    Boxes,
}

#[derive(Parser)]
#[command(
    name = "bench",
    about = "Install backups (upstream cp --reflink / rm -rf against subvolume snapshots), \
             usage accounting, volume conversion and update finalization"
)]
struct Args {
    /// Sections to run, comma-separated. Default: all.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Extent counts to fragment the database file to, comma-separated
    /// (the snapshot and finalize sections).
    #[arg(long, value_delimiter = ',', default_value = "20,100000,500000")]
    extents: Vec<u64>,
    /// Size of the database file, in bytes or with a K/M/G suffix (3G, 3072M).
    /// Default: 3 GiB, or 6 KiB per extent if that is more.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Timed rounds per measurement; medians are reported. Default: 5 for
    /// snapshot (per extent count, after one untimed warm-up) and usage, 3 for
    /// migrate, 5 for finalize (3 at 500k extents or more; after a warm-up).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    runs: Option<u32>,
    /// Size of the sparse btrfs image. Default: twice the file plus 2 GiB.
    #[arg(long, value_parser = parse_size)]
    image_size: Option<u64>,
    /// Seed for the file's content and fragmentation pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Small files in the usage and migrate sections' tree.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    files: u64,
    /// Extents of the usage and migrate sections' database file (its size is
    /// 3 GiB, or 6 KiB per extent if that is more).
    #[arg(long, default_value_t = 500_000)]
    db_extents: u64,
    /// Extent counts of the boot section's monerod database,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "500000,2000000")]
    boot_extents: Vec<u64>,
    /// The boot and loads sections on the test suite's box (monerod at
    /// 20,000 extents, `NodeShape::small`) instead: about half a minute for
    /// `loads`, not minutes.
    #[arg(long)]
    boot_small: bool,
    /// File counts of the purge section's volume, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    purge_files: Vec<u64>,
    /// Size of the lmdb section's environment (its data.mdb).
    #[arg(long, value_parser = parse_size, default_value = "1331M")]
    lmdb_size: u64,
    /// Build the lmdb section's environment again, replacing the cached one
    /// in target/bench-cache.
    #[arg(long)]
    lmdb_fresh: bool,
    /// Print the results as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    json: bool,
}

/// `3221225472`, `3072M`, `3G`, `3GiB`, `512k`.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 10),
        Some((i, 'm' | 'M')) => (&t[..i], 20),
        Some((i, 'g' | 'G')) => (&t[..i], 30),
        Some((i, 't' | 'T')) => (&t[..i], 40),
        _ => (t, 0),
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{s}` is not a size (bytes, or with a K/M/G/T suffix)"))
}

/// The three operations of an install backup.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Op {
    /// Before the install: upstream `cp -a --reflink=always`, ours a snapshot.
    Snapshot,
    /// After a successful install: upstream `rm -rf`, ours a subvolume delete.
    Drop,
    /// After a failed install: upstream `rm -rf <pkg>` then `mv <backup> <pkg>`
    /// (no volume at all in between), ours a RENAME_EXCHANGE.
    Restore,
}

impl Op {
    const ALL: [Op; 3] = [Op::Snapshot, Op::Drop, Op::Restore];

    fn name(self) -> &'static str {
        match self {
            Op::Snapshot => "snapshot",
            Op::Drop => "drop",
            Op::Restore => "restore",
        }
    }
}

/// Minimum, median and maximum of one series, in seconds.
#[derive(Serialize)]
struct Stats {
    min: f64,
    median: f64,
    max: f64,
    /// Every timed run, in order.
    runs: Vec<f64>,
}

impl Stats {
    fn of(samples: &[Duration]) -> Stats {
        let runs: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
        let mut sorted = runs.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => sorted[n / 2],
            _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        };
        Stats {
            min: sorted.first().copied().unwrap_or(f64::NAN),
            median,
            max: sorted.last().copied().unwrap_or(f64::NAN),
            runs,
        }
    }

    fn median(&self) -> Duration {
        Duration::from_secs_f64(self.median)
    }
}

/// Raw timings of one operation (shared with the migrate section).
#[derive(Default)]
struct Samples {
    upstream: Vec<Duration>,
    ours: Vec<Duration>,
    upstream_background: Vec<Duration>,
    ours_background: Vec<Duration>,
}

/// One line of the table: one operation at one extent count.
#[derive(Serialize)]
struct Row {
    op: Op,
    upstream: Stats,
    ours: Stats,
    /// Upstream median over ours.
    speedup: f64,
    /// Committing what the operation left dirty and waiting for the btrfs
    /// cleaner afterwards: not part of the timings above.
    upstream_background: Stats,
    ours_background: Stats,
}

impl Row {
    fn new(op: Op, s: &Samples) -> Row {
        let upstream = Stats::of(&s.upstream);
        let ours = Stats::of(&s.ours);
        Row {
            op,
            speedup: upstream.median / ours.median,
            upstream,
            ours,
            upstream_background: Stats::of(&s.upstream_background),
            ours_background: Stats::of(&s.ours_background),
        }
    }
}

/// Everything measured at one extent count.
#[derive(Serialize)]
struct Case {
    target_extents: u64,
    /// What FIEMAP reports for the file.
    extents: u64,
    file_bytes: u64,
    image_bytes: u64,
    build_seconds: f64,
    rows: Vec<Row>,
}

impl Case {
    fn row(&self, op: Op) -> &Row {
        &self.rows[op as usize]
    }
}

/// One of the targets.
#[derive(Serialize)]
struct Verdict {
    target: String,
    /// `pass`, `fail`, or `not-measured`.
    result: &'static str,
    detail: String,
}

impl Verdict {
    /// A measured target.
    fn new(target: String, pass: bool, detail: String) -> Verdict {
        Verdict {
            target,
            result: if pass { "pass" } else { "fail" },
            detail,
        }
    }

    /// `PASS  <target>: <detail>`.
    fn print(&self) {
        let result = match self.result {
            "pass" => "PASS",
            "fail" => "FAIL",
            _ => "----",
        };
        println!("{result}  {}: {}", self.target, self.detail);
    }
}

/// The results of the snapshot section.
#[derive(Serialize)]
struct SnapshotReport {
    runs: u32,
    seed: u64,
    cases: Vec<Case>,
    targets: Vec<Verdict>,
    total_seconds: f64,
}

/// One round: every operation once, upstream's and ours alternating, each
/// from a settled filesystem with the database file out of the page cache.
fn round(vol: &Scratch, round: u64, s: &mut [Samples; 3]) -> Result<()> {
    let mut write = |i: u64| scribble(&vol.file, SCRIBBLE_BLOCKS, 2 * round + i).map(drop);
    round_with(vol, s, &mut write, &mut |_| Ok(()))
}

/// A round of [`round`]'s operations on any volume: `write(0)` and
/// `write(1)` change it after the backup our restore and upstream's roll
/// back, and `check` ("our", "upstream's") looks at it after each restore.
pub(crate) fn round_with(
    vol: &Scratch,
    s: &mut [Samples; 3],
    write: &mut dyn FnMut(u64) -> Result<()>,
    check: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    let measure = |op: &dyn Fn() -> Result<()>,
                   timings: &mut Vec<Duration>,
                   background: &mut Vec<Duration>|
     -> Result<()> {
        vol.settle()?;
        vol.evict_page_cache()?;
        let ((), took) = timed(op)?;
        timings.push(took);
        background.push(vol.settle()?);
        Ok(())
    };
    let [snap, drop, restore] = s;
    measure(
        &|| vol.upstream_snapshot(),
        &mut snap.upstream,
        &mut snap.upstream_background,
    )?;
    measure(
        &|| vol.upstream_drop(),
        &mut drop.upstream,
        &mut drop.upstream_background,
    )?;
    measure(
        &|| vol.snapshot(),
        &mut snap.ours,
        &mut snap.ours_background,
    )?;
    measure(
        &|| vol.drop_backup(),
        &mut drop.ours,
        &mut drop.ours_background,
    )?;

    vol.snapshot()?;
    write(0)?;
    measure(
        &|| vol.restore(),
        &mut restore.ours,
        &mut restore.ours_background,
    )?;
    check("our")?;

    vol.upstream_backup_for_restore()?;
    write(1)?;
    measure(
        &|| vol.upstream_restore(),
        &mut restore.upstream,
        &mut restore.upstream_background,
    )?;
    check("upstream's")
}

/// The file size for `extents`: 3 GiB, or 6 KiB per extent if that is more
/// (the fragmenting rewrites add at most one extent per 4 KiB block).
fn default_size(extents: u64) -> u64 {
    let needed = extents.saturating_mul(6 << 10).div_ceil(64 * MIB) * 64 * MIB;
    needed.max(3 * GIB)
}

fn run_case(args: &Args, target: u64) -> Result<Case> {
    let file_bytes = args.size.unwrap_or_else(|| default_size(target));
    let image_bytes = args.image_size.unwrap_or(2 * file_bytes + 2 * GIB);
    let vol = Scratch::new(image_bytes)?;

    eprintln!(
        "{} extents: building a {} fragmented file on a {} btrfs image ...",
        fmt_count(target),
        fmt_bytes(file_bytes),
        fmt_bytes(image_bytes),
    );
    let (extents, build) = timed(|| -> Result<u64> {
        Ok(integration::make_fragmented_file(
            &vol.file, file_bytes, target, args.seed,
        )?)
    })?;
    eprintln!(
        "{} extents: built in {}, {} rounds after a warm-up ...",
        fmt_count(extents),
        fmt_duration(build),
        args.runs.unwrap_or(DEFAULT_RUNS)
    );

    let mut warmup: [Samples; 3] = Default::default();
    round(&vol, 0, &mut warmup)?;
    let mut samples: [Samples; 3] = Default::default();
    for i in 1..=u64::from(args.runs.unwrap_or(DEFAULT_RUNS)) {
        round(&vol, i, &mut samples)?;
    }
    let after = integration::extent_count(&vol.file)?;
    if after != extents {
        eprintln!(
            "note: the file has {} extents after the rounds ({} before)",
            fmt_count(after),
            fmt_count(extents)
        );
    }
    vol.close()?;

    Ok(Case {
        target_extents: target,
        extents,
        file_bytes,
        image_bytes,
        build_seconds: build.as_secs_f64(),
        rows: Op::ALL
            .iter()
            .zip(&samples)
            .map(|(&op, s)| Row::new(op, s))
            .collect(),
    })
}

fn verdicts(cases: &[Case]) -> Vec<Verdict> {
    let mut out = Vec::new();
    let big: Vec<&Case> = cases
        .iter()
        .filter(|c| c.target_extents >= SPEEDUP_EXTENTS)
        .collect();
    let target = format!(
        "snapshot at {}k extents >= {SPEEDUP_TARGET:.0}x faster than upstream",
        SPEEDUP_EXTENTS / 1000
    );
    if big.is_empty() {
        out.push(Verdict {
            target,
            result: "not-measured",
            detail: format!("no run at {} extents or more", fmt_count(SPEEDUP_EXTENTS)),
        });
    } else {
        let worst = big
            .iter()
            .map(|c| (c, c.row(Op::Snapshot).speedup))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((case, speedup)) = worst {
            out.push(Verdict {
                target,
                result: if speedup >= SPEEDUP_TARGET {
                    "pass"
                } else {
                    "fail"
                },
                detail: format!(
                    "{} at {} extents",
                    fmt_ratio(speedup),
                    fmt_count(case.extents)
                ),
            });
        }
    }
    for op in Op::ALL {
        let worst = cases
            .iter()
            .map(|c| (c, c.row(op).ours.median()))
            .max_by_key(|&(_, d)| d);
        if let Some((case, median)) = worst {
            out.push(Verdict {
                target: format!(
                    "our {} < {} median at every extent count",
                    op.name(),
                    fmt_duration(OURS_TARGET)
                ),
                result: if median < OURS_TARGET { "pass" } else { "fail" },
                detail: format!(
                    "worst {} at {} extents",
                    fmt_duration(median),
                    fmt_count(case.extents)
                ),
            });
        }
    }
    out
}

fn print_snapshot(report: &SnapshotReport) {
    println!(
        "{:>9}  {:<9} {:>17} {:>9} {:>9}",
        "extents", "op", "upstream (cp/rm)", "ours", "speed-up"
    );
    for case in &report.cases {
        for row in &case.rows {
            let mark = if matches!(row.op, Op::Restore) {
                "*"
            } else {
                " "
            };
            println!(
                "{:>9}  {:<9} {:>16}{mark} {:>9} {:>9}",
                fmt_count(case.extents),
                row.op.name(),
                fmt_duration(row.upstream.median()),
                fmt_duration(row.ours.median()),
                fmt_ratio(row.speedup),
            );
        }
    }
    println!(
        "medians of {} runs, each from a settled filesystem (all committed, btrfs cleaner idle,\n\
         \x20 file not in the page cache)\n\
         * upstream restore is `rm -rf <pkg>; mv <pkg>.install-backup <pkg>`: no volume at all\n\
         \x20 in between; ours is one atomic RENAME_EXCHANGE",
        report.runs
    );
    println!(
        "settling after the drop (commit + cleaner; untimed; includes 3 `btrfs` command starts):"
    );
    for case in &report.cases {
        let row = case.row(Op::Drop);
        println!(
            "{:>9}  upstream {}, ours {}",
            fmt_count(case.extents),
            fmt_duration(row.upstream_background.median()),
            fmt_duration(row.ours_background.median()),
        );
    }
    println!();
    for v in &report.targets {
        v.print();
    }
}

fn run_snapshot(args: &Args) -> Result<SnapshotReport> {
    let start = Instant::now();
    if args.extents.is_empty() {
        return Err("--extents is empty".into());
    }
    let mut cases = Vec::new();
    for &target in &args.extents {
        cases.push(run_case(args, target)?);
    }
    Ok(SnapshotReport {
        runs: args.runs.unwrap_or(DEFAULT_RUNS),
        seed: args.seed,
        targets: verdicts(&cases),
        cases,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

/// The binary `name` of this workspace, next to this one (`cargo build
/// --release <package>` puts it there; `make bench` does).
fn sibling_binary(name: &str, package: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| format!("locating the bench binary: {e}"))?;
    let path = exe.with_file_name(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found: build it first (cargo build --release {package})",
            path.display()
        )
        .into())
    }
}

/// `sync; echo 3 > /proc/sys/vm/drop_caches`: nothing cached afterwards,
/// neither file data nor filesystem metadata nor binaries.
fn drop_caches() -> Result<()> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("dropping caches (/proc/sys/vm/drop_caches): {e}"))?;
    Ok(())
}

/// Every section that ran.
#[derive(Serialize)]
struct Report {
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<SnapshotReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<usage::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    migrate: Option<migrate::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    finalize: Option<finalize::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    boot: Option<boot::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    costs: Option<boot::CostReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    commits: Option<commits::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    loads: Option<Vec<(u64, boot_loads::Fixture)>>,
    purge: Option<purge::Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lmdb: Option<lmdb::Report>,
    boxes: Option<(Vec<boxes::BoxCase>, Vec<Verdict>)>,
    total_seconds: f64,
}

fn run(args: &Args) -> Result<Report> {
    let start = Instant::now();
    let wants = |s: Section| args.only.is_empty() || args.only.contains(&s);
    let snapshot = wants(Section::Snapshot)
        .then(|| run_snapshot(args))
        .transpose()?;
    let (mut usage, mut migrate) = (None, None);
    if wants(Section::Usage) || wants(Section::Migrate) {
        let fx = Fixture::build(&fixture::Spec {
            files: args.files,
            extents: args.db_extents,
            db_bytes: args.size.unwrap_or_else(|| default_size(args.db_extents)),
            seed: args.seed,
        })?;
        // Usage first: migrate's copies would share the extents it counts.
        if wants(Section::Usage) {
            usage = Some(usage::run(&fx, args.runs.unwrap_or(DEFAULT_RUNS))?);
        }
        if wants(Section::Migrate) {
            migrate = Some(migrate::run(
                &fx,
                args.runs.unwrap_or(DEFAULT_MIGRATE_RUNS),
            )?);
        }
        fx.close()?;
    }
    let finalize = wants(Section::Finalize)
        .then(|| finalize::run(args))
        .transpose()?;
    let costs = wants(Section::Costs).then(boot::run_costs).transpose()?;
    let commits = wants(Section::Commits)
        .then(|| commits::run(commits::ROUNDS))
        .transpose()?;
    let shapes: Vec<integration::node::NodeShape> = if args.boot_small {
        vec![integration::node::NodeShape::small()]
    } else {
        args.boot_extents
            .iter()
            .map(|&x| integration::node::NodeShape::field(x))
            .collect()
    };
    let purge = wants(Section::Purge)
        .then(|| purge::run(&args.purge_files))
        .transpose()?;
    let lmdb = wants(Section::Lmdb).then(|| lmdb::run(args)).transpose()?;
    let boot = wants(Section::Boot)
        .then(|| boot::run(&shapes))
        .transpose()?;
    // The boot section runs the loads' rows itself.
    let loads = (boot.is_none() && wants(Section::Loads))
        .then(|| boot_loads::run_section(&shapes))
        .transpose()?;
    let boxes = wants(Section::Boxes)
        .then(|| boxes::run(shapes[0]))
        .transpose()?;
    Ok(Report {
        boxes,
        snapshot,
        usage,
        migrate,
        finalize,
        boot,
        costs,
        commits,
        loads,
        purge,
        lmdb,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

fn print_text(report: &Report) {
    let mut first = true;
    let mut gap = || {
        if !std::mem::take(&mut first) {
            println!();
        }
    };
    if let Some(r) = &report.snapshot {
        gap();
        print_snapshot(r);
    }
    if let Some(r) = &report.usage {
        gap();
        usage::print(r);
    }
    if let Some(r) = &report.migrate {
        gap();
        migrate::print(r);
    }
    if let Some(r) = &report.finalize {
        gap();
        finalize::print(r);
    }
    if let Some(r) = &report.costs {
        gap();
        boot::print_costs(r);
    }
    if let Some(r) = &report.commits {
        gap();
        commits::print(r);
    }
    if let Some(r) = &report.purge {
        gap();
        purge::print(r);
    }
    if let Some(r) = &report.lmdb {
        gap();
        lmdb::print(r);
    }
    if let Some(r) = &report.boot {
        gap();
        boot::print(r);
    }
    if let Some(r) = &report.loads {
        gap();
        boot_loads::print_section(r);
    }
    if let Some((cases, verdicts)) = &report.boxes {
        gap();
        boxes::print(cases, verdicts);
    }
    println!(
        "total {}",
        fmt_duration(Duration::from_secs_f64(report.total_seconds))
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    let report = match run(&args) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("bench: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("bench: error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print_text(&report);
    }
    ExitCode::SUCCESS
}
