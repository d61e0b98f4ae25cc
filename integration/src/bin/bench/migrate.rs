//! The `migrate` section (issue 4): converting a plain package directory
//! into a subvolume with [`Migrator::convert`] (the library call, in this
//! process) beside upstream's `cp -a --reflink=always` of the same directory,
//! for the fixture's two trees; then removing the replaced directory with
//! [`Migrator::remove_old`] beside `rm -rf` of the copy; then a rerun with
//! nothing to convert over 100 packages.
//!
//! Each round starts from a fresh plain directory `<root>/<pkg>`, a
//! `cp -a --reflink=always` of the fixture's subvolume (untimed). Then, each
//! from a settled filesystem (all committed, btrfs cleaner idle): `cp -a
//! --reflink=always <root>/<pkg> <mnt>/cp-copy` (a fresh target every time),
//! `rm -rf <mnt>/cp-copy`, `convert(<pkg>)`, `remove_old(<pkg>)`; the time
//! the filesystem takes to settle after each is reported as its background
//! work. Finally the converted volume is deleted (untimed). Reflink copies
//! read no file data, so the page cache does not enter into it; the
//! directory's metadata is cached for both (the fresh copy just wrote it).
//!
//! The conversion includes its own btrfs commit (the new subvolume must be
//! durable before it takes the package's name); cp leaves that commit to the
//! background, where it shows in the background column.
//!
//! `convert` is the default, [`Method::Auto`]: here, with little else in
//! the filesystem's top-level subvolume, it snapshots that subvolume and
//! cuts the snapshot down to the package. Each round also converts a fresh
//! copy with [`Method::Clone`] forced, timed against the same cp runs, so
//! the method every package with much beside it gets is measured too.
//!
//! No warm-up round: each round's untimed copy brings everything in.
//!
//! Last, the peak memory of a conversion beside cp's, at 100,000 and
//! 1,000,000 files ([`crate::memory`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use volume::{PackageId, VolumeId, VolumeStore};
use volume_migrate::{
    Estimate, Method, MigrateOptions, Migrator, Outcome, Phase, Progress, ProgressSink,
};

use crate::common::{Result, cp_reflink, fmt_count, fmt_duration, rm_rf, settle, timed};
use crate::fixture::{Fixture, Tree, TreeKind};
use crate::memory;
use crate::{Samples, Stats, Verdict, sibling_binary};

/// Ours over cp may be at most this: no slower than upstream's copy.
const CONVERT_TARGET: f64 = 1.0;
/// A rerun with nothing to convert must take less than this.
const NOOP_TARGET: Duration = Duration::from_millis(10);
/// Packages (all subvolumes already) in the no-op rerun.
const NOOP_PACKAGES: u32 = 100;
/// Timed no-op reruns: they are cheap, so at least this many.
const NOOP_MIN_RUNS: u32 = 10;

/// The timed operations.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    /// Upstream `cp -a --reflink=always`, ours [`Migrator::convert`].
    Convert,
    /// The same cp runs, ours [`Migrator::convert`] with [`Method::Clone`].
    ConvertClone,
    /// Upstream `rm -rf` of the copy, ours [`Migrator::remove_old`] after
    /// the default conversion.
    RemoveOld,
}

impl Op {
    const ALL: [Op; 3] = [Op::Convert, Op::ConvertClone, Op::RemoveOld];

    fn name(self) -> &'static str {
        match self {
            Op::Convert => "cp -a --reflink / convert",
            Op::ConvertClone => "cp -a --reflink / clone",
            Op::RemoveOld => "rm -rf / remove_old",
        }
    }
}

/// The steps of [`Migrator::convert`], timed from its progress reports
/// (the third is [`Phase::Clone`] or [`Phase::Carve`]).
const STEPS: [&str; 5] = ["checks", "scan", "clone/carve", "sync", "exchange"];

/// A progress sink that notes when each phase starts.
struct PhaseClock {
    start: Instant,
    marks: Vec<(Phase, Instant)>,
}

impl PhaseClock {
    fn new() -> PhaseClock {
        PhaseClock {
            start: Instant::now(),
            marks: Vec::new(),
        }
    }

    /// Starts timing a conversion.
    fn reset(&mut self) {
        self.marks.clear();
        self.start = Instant::now();
    }

    /// How long each of [`STEPS`] took: from the call to the first report,
    /// then from each phase's first report to the next phase's.
    fn steps(&self) -> Result<[Duration; 5]> {
        let at_any = |phases: &[Phase]| {
            self.marks
                .iter()
                .find(|(p, _)| phases.contains(p))
                .map(|&(_, t)| t)
                .ok_or_else(|| format!("the conversion reported no {phases:?} phase"))
        };
        let at = |phase: Phase| at_any(&[phase]);
        let bounds = [
            self.start,
            at(Phase::Scan)?,
            at_any(&[Phase::Clone, Phase::Carve])?,
            at(Phase::Sync)?,
            at(Phase::Exchange)?,
            at(Phase::Done)?,
        ];
        Ok(std::array::from_fn(|i| bounds[i + 1] - bounds[i]))
    }
}

impl ProgressSink for PhaseClock {
    fn progress(&mut self, p: &Progress) {
        if self.marks.last().is_none_or(|&(last, _)| last != p.phase) {
            self.marks.push((p.phase, Instant::now()));
        }
    }
}

/// One operation on one tree.
#[derive(Serialize)]
pub struct Row {
    op: Op,
    upstream: Stats,
    ours: Stats,
    /// Our median over upstream's: below 1 is faster.
    ours_over_upstream: f64,
    /// Settling the filesystem afterwards (commit, cleaner): untimed above.
    upstream_background: Stats,
    ours_background: Stats,
    /// Each run's time plus the settling after it.
    upstream_with_background: Stats,
    ours_with_background: Stats,
    /// [`Row::ours_with_background`] over [`Row::upstream_with_background`].
    ours_over_upstream_with_background: f64,
}

impl Row {
    fn new(op: Op, s: &Samples) -> Row {
        let sum = |a: &[Duration], b: &[Duration]| -> Vec<Duration> {
            a.iter().zip(b).map(|(x, y)| *x + *y).collect()
        };
        let upstream = Stats::of(&s.upstream);
        let ours = Stats::of(&s.ours);
        let upstream_with_background = Stats::of(&sum(&s.upstream, &s.upstream_background));
        let ours_with_background = Stats::of(&sum(&s.ours, &s.ours_background));
        Row {
            op,
            ours_over_upstream: ours.median / upstream.median,
            ours_over_upstream_with_background: ours_with_background.median
                / upstream_with_background.median,
            upstream,
            ours,
            upstream_background: Stats::of(&s.upstream_background),
            ours_background: Stats::of(&s.ours_background),
            upstream_with_background,
            ours_with_background,
        }
    }
}

/// Everything measured on one tree.
#[derive(Serialize)]
pub struct Case {
    tree: String,
    /// The method the default conversion chose.
    method: Method,
    /// The clone method's own scan of the plain directory.
    estimate: Estimate,
    rows: Vec<Row>,
    /// Where the default conversion's time goes, step by step.
    convert_steps: Vec<Step>,
    /// The same for the clone method.
    clone_steps: Vec<Step>,
}

/// One step of the conversion.
#[derive(Serialize)]
pub struct Step {
    step: &'static str,
    time: Stats,
}

/// The rerun with nothing to convert.
#[derive(Serialize)]
pub struct Noop {
    packages: u32,
    /// `Migrator::open(root)` and `Migrator::run`, in this process.
    library: Stats,
    /// `volume-migrate --root R --json` as a process.
    process: Stats,
}

/// The section's results.
#[derive(Serialize)]
pub struct Report {
    runs: u32,
    cases: Vec<Case>,
    noop: Noop,
    /// Peak memory against cp's (issue 31).
    memory: memory::Report,
    targets: Vec<Verdict>,
    total_seconds: f64,
}

/// Times `op` from a settled filesystem and records the settling it left.
fn measure<T>(
    mnt: &Path,
    op: impl FnOnce() -> Result<T>,
    timings: &mut Vec<Duration>,
    background: &mut Vec<Duration>,
) -> Result<T> {
    settle(mnt)?;
    let (value, took) = timed(op)?;
    timings.push(took);
    background.push(settle(mnt)?);
    Ok(value)
}

fn one_line(e: impl std::fmt::Display) -> Box<dyn std::error::Error> {
    e.to_string().into()
}

/// `runs` rounds on `tree`, converting it as package `pkg`.
fn measure_tree(fx: &Fixture, tree: &Tree, runs: u32) -> Result<Case> {
    let mnt = fx.mount_point();
    let pkg: PackageId = match tree.kind {
        TreeKind::SmallFiles => "migrate-files",
        TreeKind::Fragmented => "migrate-db",
    }
    .parse()?;
    let live = fx.root.join(pkg.as_str());
    let copy: PathBuf = mnt.join("cp-copy");
    let migrator = Migrator::open(&fx.root).map_err(one_line)?;
    let opts = MigrateOptions {
        remove_old: false,
        ..MigrateOptions::default()
    };
    let clone_opts = MigrateOptions {
        method: Method::Clone,
        ..opts
    };
    let mut sink = |_: &Progress| {};
    let mut clock = PhaseClock::new();
    let mut steps: [Vec<Duration>; 5] = Default::default();
    let mut clone_steps: [Vec<Duration>; 5] = Default::default();
    let mut samples: [Samples; 3] = Default::default();
    let [convert, clone, remove] = &mut samples;
    let mut estimate = None;
    let mut method = None;
    for round in 1..=runs {
        eprintln!("migrate: {}: round {round} of {runs} ...", tree.label);
        cp_reflink(&tree.path, &live)?;

        measure(
            mnt,
            || cp_reflink(&live, &copy),
            &mut convert.upstream,
            &mut convert.upstream_background,
        )?;
        measure(
            mnt,
            || rm_rf(&copy),
            &mut remove.upstream,
            &mut remove.upstream_background,
        )?;

        let report = measure(
            mnt,
            || {
                clock.reset();
                migrator.convert(&pkg, &opts, &mut clock).map_err(one_line)
            },
            &mut convert.ours,
            &mut convert.ours_background,
        )?;
        if report.outcome != Outcome::Converted {
            return Err(format!(
                "converting {}: outcome {:?}, expected converted",
                live.display(),
                report.outcome
            )
            .into());
        }
        method = report.method;
        for (series, took) in steps.iter_mut().zip(clock.steps()?) {
            series.push(took);
        }
        let removed = measure(
            mnt,
            || migrator.remove_old(&pkg, &mut sink).map_err(one_line),
            &mut remove.ours,
            &mut remove.ours_background,
        )?;
        if !removed {
            return Err(format!("remove_old found no old directory for {pkg}").into());
        }

        fx.store.delete(&pkg).map_err(one_line)?;

        // The clone method on a fresh copy, against the same cp runs.
        cp_reflink(&tree.path, &live)?;
        let report = measure(
            mnt,
            || {
                clock.reset();
                migrator
                    .convert(&pkg, &clone_opts, &mut clock)
                    .map_err(one_line)
            },
            &mut clone.ours,
            &mut clone.ours_background,
        )?;
        if (report.outcome, report.method) != (Outcome::Converted, Some(Method::Clone)) {
            return Err(format!(
                "converting {} by cloning: {:?} by {:?}",
                live.display(),
                report.outcome,
                report.method
            )
            .into());
        }
        estimate = report.estimate;
        for (series, took) in clone_steps.iter_mut().zip(clock.steps()?) {
            series.push(took);
        }
        migrator.remove_old(&pkg, &mut sink).map_err(one_line)?;
        fx.store.delete(&pkg).map_err(one_line)?;
        settle(mnt)?;
    }
    clone.upstream = convert.upstream.clone();
    clone.upstream_background = convert.upstream_background.clone();
    let estimate = estimate.ok_or("the conversion reported no scan")?;
    let method = method.ok_or("the conversion reported no method")?;
    if estimate.files != tree.files {
        return Err(format!(
            "the conversion scanned {} files in {}, expected {}",
            estimate.files,
            live.display(),
            tree.files
        )
        .into());
    }
    let step_stats = |steps: &[Vec<Duration>; 5]| -> Vec<Step> {
        STEPS
            .iter()
            .zip(steps)
            .map(|(&step, series)| Step {
                step,
                time: Stats::of(series),
            })
            .collect()
    };
    Ok(Case {
        tree: tree.label.clone(),
        method,
        estimate,
        rows: Op::ALL
            .iter()
            .zip(&samples)
            .map(|(&op, s)| Row::new(op, s))
            .collect(),
        convert_steps: step_stats(&steps),
        clone_steps: step_stats(&clone_steps),
    })
}

/// A rerun over [`NOOP_PACKAGES`] packages that are all subvolumes already,
/// under their own volumes root `<mnt>/noop-volumes`.
fn measure_noop(fx: &Fixture, runs: u32) -> Result<Noop> {
    let root = fx.mount_point().join("noop-volumes");
    std::fs::create_dir(&root).map_err(|e| format!("creating {}: {e}", root.display()))?;
    let store = VolumeStore::open(&root).map_err(one_line)?;
    let main: VolumeId = "main".parse()?;
    for i in 0..NOOP_PACKAGES {
        let pkg: PackageId = format!("noop-{i}").parse()?;
        store
            .create(&pkg, std::slice::from_ref(&main))
            .map_err(one_line)?;
    }
    drop(store);
    settle(fx.mount_point())?;

    let library = || -> Result<()> {
        let migrator = Migrator::open(&root).map_err(one_line)?;
        let reports = migrator
            .run(
                &MigrateOptions::default(),
                &mut |_: &Progress| {},
                &mut |_| {},
            )
            .map_err(one_line)?;
        if !reports.is_empty() {
            return Err(format!(
                "the no-op rerun did something to {} packages",
                reports.len()
            )
            .into());
        }
        Ok(())
    };
    let binary = sibling_binary("volume-migrate", "-p volume-migrate --bin volume-migrate")?;
    let process = || -> Result<()> {
        integration::run(Command::new(&binary).arg("--root").arg(&root).arg("--json"))?;
        Ok(())
    };
    let runs = runs.max(NOOP_MIN_RUNS);
    let series = |f: &dyn Fn() -> Result<()>| -> Result<Stats> {
        f()?;
        let mut took = Vec::new();
        for _ in 0..runs {
            took.push(timed(f)?.1);
        }
        Ok(Stats::of(&took))
    };
    Ok(Noop {
        packages: NOOP_PACKAGES,
        library: series(&library)?,
        process: series(&process)?,
    })
}

/// Runs the section on the fixture's trees.
pub fn run(fx: &Fixture, runs: u32) -> Result<Report> {
    let start = Instant::now();
    let mut cases = Vec::new();
    for tree in &fx.trees {
        cases.push(measure_tree(fx, tree, runs)?);
    }
    eprintln!("migrate: no-op rerun over {NOOP_PACKAGES} packages ...");
    let noop = measure_noop(fx, runs)?;
    let memory = memory::run()?;
    let mut targets = verdicts(&cases, &noop);
    targets.push(memory::verdict(&memory));
    Ok(Report {
        runs,
        targets,
        memory,
        cases,
        noop,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

fn verdicts(cases: &[Case], noop: &Noop) -> Vec<Verdict> {
    let ratios: Vec<(&str, f64)> = cases
        .iter()
        .map(|c| {
            (
                c.tree.as_str(),
                c.rows[Op::Convert as usize].ours_over_upstream,
            )
        })
        .collect();
    let worst = ratios.iter().map(|r| r.1).fold(f64::NEG_INFINITY, f64::max);
    let clone_ratios: Vec<String> = cases
        .iter()
        .map(|c| {
            format!(
                "{} {:.2}",
                c.tree,
                c.rows[Op::ConvertClone as usize].ours_over_upstream
            )
        })
        .collect();
    vec![
        Verdict::new(
            format!(
                "migrate: conversion no slower than cp -a --reflink=always \
                 (ours/cp <= {CONVERT_TARGET:.1})"
            ),
            !ratios.is_empty() && worst <= CONVERT_TARGET,
            format!(
                "{} (the clone method alone: {})",
                ratios
                    .iter()
                    .map(|(tree, r)| format!("{tree} {r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                clone_ratios.join(", ")
            ),
        ),
        Verdict::new(
            format!(
                "migrate: no-op rerun over {} packages < {} (Migrator::open + run, in process)",
                noop.packages,
                fmt_duration(NOOP_TARGET)
            ),
            noop.library.median() < NOOP_TARGET,
            format!(
                "{} (as a process, volume-migrate --json: {})",
                fmt_duration(noop.library.median()),
                fmt_duration(noop.process.median())
            ),
        ),
    ]
}

/// The section's table, notes and target lines.
pub fn print(report: &Report) {
    println!(
        "{:<22} {:<26} {:>9} {:>9} {:>8} {:>15}",
        "convert a plain dir", "upstream / ours", "upstream", "ours", "ours/up", "incl. settling"
    );
    for case in &report.cases {
        for (i, row) in case.rows.iter().enumerate() {
            println!(
                "{:<22} {:<26} {:>9} {:>9} {:>8.2} {:>15.2}",
                if i == 0 { case.tree.as_str() } else { "" },
                row.op.name(),
                fmt_duration(row.upstream.median()),
                fmt_duration(row.ours.median()),
                row.ours_over_upstream,
                row.ours_over_upstream_with_background,
            );
        }
    }
    println!(
        "medians of {} runs, each from a settled filesystem (all committed, btrfs cleaner idle);\n\
         \x20 cp copies <root>/<pkg> to a fresh directory; ours is Migrator::convert in process,\n\
         \x20 <root>/<pkg> into a subvolume, its commit included (convert: the default method,\n\
         \x20 which here snapshots the top-level subvolume and cuts it down to <pkg>; clone: the\n\
         \x20 method forced to reflink every entry, against the same cp runs); remove_old is a\n\
         \x20 separate phase (after services start). incl. settling: ours/up with the time each\n\
         \x20 run left for the commit and cleaner afterwards added to it",
        report.runs
    );
    println!("settling afterwards (commit + cleaner; untimed; includes 3 `btrfs` command starts):");
    for case in &report.cases {
        for row in &case.rows {
            println!(
                "{:<22} {:<26} upstream {}, ours {}",
                case.tree,
                row.op.name(),
                fmt_duration(row.upstream_background.median()),
                fmt_duration(row.ours_background.median()),
            );
        }
    }
    println!("where the conversion's time goes (medians):");
    let steps = |steps: &[Step]| -> String {
        steps
            .iter()
            .map(|s| format!("{} {}", s.step, fmt_duration(s.time.median())))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for case in &report.cases {
        let e = &case.estimate;
        println!(
            "{:<22} {} entries, {} extent items",
            case.tree,
            fmt_count(e.entries),
            fmt_count(e.extents)
        );
        println!(
            "{:<22} convert ({:?}): {}",
            "",
            case.method,
            steps(&case.convert_steps)
        );
        println!("{:<22} clone: {}", "", steps(&case.clone_steps));
    }
    println!(
        "no-op rerun, {} packages already subvolumes: Migrator::open + run {}, \
         volume-migrate --json process {} (medians of {})",
        report.noop.packages,
        fmt_duration(report.noop.library.median()),
        fmt_duration(report.noop.process.median()),
        report.noop.library.runs.len(),
    );
    memory::print(&report.memory);
    println!();
    for v in &report.targets {
        v.print();
    }
}
