//! The `finalize` section (issues 5 and 30): a whole update of a running
//! service whose volume holds one fragmented database file, through
//! start-core's own `ServiceMap::install` (the `call-sites` runner of
//! `fixtures/upstream-call-sites`), its reordered call sites against
//! upstream's unedited ones, on the same volume in the same run.
//!
//! For each extent count: a fresh btrfs image holding the runner's data
//! directory (a box), package `monerod` installed through the runner, the
//! file made in its `main` volume. Then one untimed warm-up round and `runs`
//! timed rounds; each round updates once through upstream's call sites and
//! once through the reordered ones (the version one update installed is the
//! old version of the next), each from a settled filesystem with the file
//! out of the page cache. Each update is one run of the runner (one boot of
//! the box): the boot, which loads the old version (its container appending
//! to a log in the volume until stopped), a moment of it running, then the
//! install task between two `mark` steps.
//!
//! Both orders call the same drop-in (`startos_core::volume`): the backup is
//! a subvolume snapshot either way. What differs is the order around it:
//! upstream's `begin` before the state check, the snapshot while the old
//! container runs, then its stop; the reorder's state check first, the stop
//! before the snapshot, the snapshot's outcome checked
//! (`fixtures/upstream-call-sites/src/service/reordered.rs`). The section
//! shows what that order costs the user: the install task, and when the new
//! version's volume calls returned (its container about to start).

use std::path::Path;
use std::time::{Duration, Instant};

use integration::LoopFs;
use integration::call_sites::{Box_, Order, Run, boot, install, mark};
use serde::Serialize;
use serde_json::json;

use crate::common::{Result, fmt_count, fmt_duration, fmt_ratio, settle};
use crate::{Args, GIB, Stats, Verdict, default_size};

/// The reorder may cost the install task at most this much over upstream's
/// order (median) at every extent count.
const REORDER_COST_TARGET: Duration = Duration::from_millis(50);
/// Default timed rounds below, and at or above, this many extents.
const MANY_EXTENTS: u64 = 500_000;
const DEFAULT_RUNS: u32 = 5;
const DEFAULT_RUNS_MANY: u32 = 3;
/// How long the old version runs in each update's boot before the update.
const RUNNING_MS: u64 = 200;
/// The package updated.
const PKG: &str = "monerod";

/// The figures of one update.
#[derive(Default, Clone, Copy)]
struct Sample {
    /// The install task, as the user waits for it.
    install: Duration,
    /// From the install task's start to the new version's volume calls
    /// returning (`Service::new` entered).
    ready: Duration,
}

/// One line of a table.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Figure {
    /// The install task (`ServiceMap::install` and its undo), whole.
    InstallTask,
    /// Install task start -> the new version's volume ready.
    VolumeReady,
}

impl Figure {
    const ALL: [Figure; 2] = [Figure::InstallTask, Figure::VolumeReady];

    fn name(self) -> &'static str {
        match self {
            Figure::InstallTask => "install task (the update)",
            Figure::VolumeReady => "new version's volume ready",
        }
    }

    fn of(self, s: &Sample) -> Duration {
        match self {
            Figure::InstallTask => s.install,
            Figure::VolumeReady => s.ready,
        }
    }
}

/// One figure at one extent count.
#[derive(Serialize)]
pub struct Row {
    figure: Figure,
    upstream: Stats,
    ours: Stats,
    /// Upstream median over ours.
    ratio: f64,
}

/// Everything measured at one extent count.
#[derive(Serialize)]
pub struct Case {
    target_extents: u64,
    /// What FIEMAP reports for the file.
    extents: u64,
    file_bytes: u64,
    runs: u32,
    build_seconds: f64,
    rows: Vec<Row>,
}

impl Case {
    fn row(&self, f: Figure) -> &Row {
        &self.rows[f as usize]
    }
}

/// The results of the finalize section.
#[derive(Serialize)]
pub struct Report {
    cases: Vec<Case>,
    targets: Vec<Verdict>,
    total_seconds: f64,
}

/// The scratch filesystem and the box on it.
struct Bed {
    fs: LoopFs,
    b: Box_,
    /// The version installed now.
    version: u32,
}

fn version(n: u32) -> String {
    format!("1.0.{n}")
}

/// The `mark` event `name`'s time in the run, in milliseconds.
fn mark_ms(run: &Run, name: &str) -> Result<f64> {
    run.first_ms("mark")
        .get(name)
        .copied()
        .ok_or_else(|| format!("no mark {name} in the run: {:?}", run.events).into())
}

impl Bed {
    /// Settles the filesystem and drops the database file's cached pages.
    fn settle(&self) -> Result<()> {
        settle(self.fs.mount_point())?;
        let file = std::fs::File::open(self.b.main(PKG).join("data.mdb"))?;
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)?;
        Ok(())
    }

    /// One update to the next version through `order`'s call sites.
    fn update(&mut self, order: Order) -> Result<Sample> {
        let to = version(self.version + 1);
        let run = self.b.completed(&[
            order.step(),
            boot(),
            json!({"wait": {"ms": RUNNING_MS}}),
            mark("update"),
            install(PKG, &to, None),
            mark("done"),
        ])?;
        if !run.ok() || run.installed(PKG).as_deref() != Some(to.as_str()) {
            return Err(format!(
                "{order:?} update to {to}: {:?}, {:?}\n{}",
                run.steps, run.db, run.stderr
            )
            .into());
        }
        let (start, done) = (mark_ms(&run, "update")?, mark_ms(&run, "done")?);
        let ready = run
            .events
            .iter()
            .filter_map(|e| e.get("volumes_ready"))
            .filter(|e| e["id"] == PKG)
            .filter_map(|e| e["ms"].as_f64())
            .find(|&ms| ms >= start)
            .ok_or_else(|| format!("{order:?}: no load of {to} after the mark"))?;
        self.version += 1;
        let d = |ms: f64| Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        Ok(Sample {
            install: d(done - start),
            ready: d(ready - start),
        })
    }

    /// One round: upstream's update, then ours, each from a settled
    /// filesystem.
    fn round(&mut self, up: &mut Vec<Sample>, ours: &mut Vec<Sample>) -> Result<()> {
        self.settle()?;
        up.push(self.update(Order::Upstream)?);
        self.settle()?;
        ours.push(self.update(Order::Reordered)?);
        Ok(())
    }
}

fn run_case(args: &Args, bin: &Path, target: u64) -> Result<Case> {
    let file_bytes = args.size.unwrap_or_else(|| default_size(target));
    let image_bytes = args.image_size.unwrap_or(2 * file_bytes + 2 * GIB);
    let fs = LoopFs::btrfs(image_bytes)?;
    let b = Box_ {
        bin: bin.to_owned(),
        data: fs.path("data"),
    };
    std::fs::create_dir(&b.data)?;
    // The old version installed, then the file made in its volume.
    let run = b.completed(&[
        Order::Reordered.step(),
        boot(),
        install(PKG, &version(0), None),
    ])?;
    if !run.ok() {
        return Err(format!("installing {PKG}: {:?}\n{}", run.steps, run.stderr).into());
    }
    eprintln!(
        "finalize, {} extents: building the database file ...",
        fmt_count(target)
    );
    let start = Instant::now();
    let file = b.main(PKG).join("data.mdb");
    let extents = integration::make_fragmented_file(&file, file_bytes, target, args.seed)?;
    let build = start.elapsed();
    let mut bed = Bed { fs, b, version: 0 };

    let runs = args.runs.unwrap_or(if target >= MANY_EXTENTS {
        DEFAULT_RUNS_MANY
    } else {
        DEFAULT_RUNS
    });
    eprintln!(
        "finalize, {} extents: built in {}, {runs} rounds after a warm-up ...",
        fmt_count(extents),
        fmt_duration(build),
    );
    let (mut up, mut ours) = (Vec::new(), Vec::new());
    bed.round(&mut Vec::new(), &mut Vec::new())?;
    for _ in 0..runs {
        bed.round(&mut up, &mut ours)?;
    }
    bed.fs.close()?;

    let rows = Figure::ALL
        .iter()
        .map(|&figure| {
            let series =
                |s: &[Sample]| -> Vec<Duration> { s.iter().map(|x| figure.of(x)).collect() };
            let upstream = Stats::of(&series(&up));
            let ours = Stats::of(&series(&ours));
            Row {
                figure,
                ratio: upstream.median / ours.median,
                upstream,
                ours,
            }
        })
        .collect();
    Ok(Case {
        target_extents: target,
        extents,
        file_bytes,
        runs,
        build_seconds: build.as_secs_f64(),
        rows,
    })
}

fn verdicts(cases: &[Case]) -> Vec<Verdict> {
    let cost = |c: &Case| {
        let r = c.row(Figure::InstallTask);
        r.ours.median().saturating_sub(r.upstream.median())
    };
    let worst = cases.iter().max_by_key(|c| cost(c));
    worst
        .map(|case| {
            let r = case.row(Figure::InstallTask);
            Verdict::new(
                format!(
                    "the reorder costs the install task < {} over upstream's order (medians) at every extent count",
                    fmt_duration(REORDER_COST_TARGET)
                ),
                cost(case) < REORDER_COST_TARGET,
                format!(
                    "worst at {} extents: ours {}, upstream's {}",
                    fmt_count(case.extents),
                    fmt_duration(r.ours.median()),
                    fmt_duration(r.upstream.median()),
                ),
            )
        })
        .into_iter()
        .collect()
}

/// Runs the section.
pub fn run(args: &Args) -> Result<Report> {
    let start = Instant::now();
    if args.extents.is_empty() {
        return Err("--extents is empty".into());
    }
    let bin = integration::workspace_bin("call-sites").map_err(|e| {
        format!(
            "{e}: build it first (cargo build --release -p upstream-call-sites --bin call-sites)"
        )
    })?;
    let mut cases = Vec::new();
    for &target in &args.extents {
        cases.push(run_case(args, &bin, target)?);
    }
    Ok(Report {
        targets: verdicts(&cases),
        cases,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Prints one table per extent count and the target line.
pub fn print(report: &Report) {
    println!(
        "finalize: update of a running service through start-core's call sites, upstream's order against ours"
    );
    for case in &report.cases {
        println!();
        let title = format!("{} extents ({} runs)", fmt_count(case.extents), case.runs);
        println!(
            "{title:<36} {:>11}  {:>8}   {:>7}",
            "upstream", "ours", "ratio"
        );
        for row in &case.rows {
            println!(
                "  {:<34} {:>11}  {:>8}   {:>7}",
                row.figure.name(),
                fmt_duration(row.upstream.median()),
                fmt_duration(row.ours.median()),
                fmt_ratio(row.ratio),
            );
        }
    }
    println!();
    println!(
        "medians, each update one run of the call-sites runner from a settled filesystem (file not\n\
         \x20 in the page cache), the old version's container appending to a log in the volume until\n\
         \x20 stopped; both orders on the drop-in (a subvolume snapshot either way)\n\
         upstream: begin; updating state; download; snapshot while the old container runs; stop;\n\
         \x20 install, init, start; installed state; backup removed\n\
         ours (the reorder): state check; begin; updating state; download; stop; snapshot, its\n\
         \x20 outcome checked; install, init, start; installed state; backup removed"
    );
    println!();
    for v in &report.targets {
        v.print();
    }
}
