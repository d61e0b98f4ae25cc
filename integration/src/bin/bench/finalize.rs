//! The `finalize` section (issue 5): a whole update of a running service
//! whose volume holds one fragmented database file, through our finalization
//! ([`startos_core::finalize_update`]) and through upstream's order, on the
//! same volume in the same run.
//!
//! For each extent count: a fresh btrfs image, package `monerod` (a subvolume
//! made by [`volume::VolumeStore::create`]) holding the file, a state
//! database ([`FileDb`]) beside the volumes root, and the old version running
//! as a [`ProcessServices`] child that keeps writing random 4 KiB blocks into
//! the volume until stopped. Then one untimed warm-up round and `runs` timed
//! rounds; each round updates once upstream's way and once ours (the version
//! that one update started is the old version of the next), each from a
//! settled filesystem with the database file out of the page cache.
//!
//! Upstream's order (start-os 727e4d48a, `ServiceMap::install`), reproduced
//! here with the same services and state database:
//! the `updating` state write (upstream's install makes it before the
//! download; counted here so both sides pay it), `cp -a --reflink=always
//! <root>/<pkg> <root>/<pkg>.install-backup` while the old service still runs
//! (`service_map.rs:309`), then `service.uninstall` = stop and uninit (:349),
//! install, init, start and the `installed` state write (`Service::install`),
//! then `rm -rf` of the backup (`remove_install_backup`, :380), and only then
//! does the install future complete: what the user waits on, and what we
//! count as its notification. Upstream sends no success notification of its
//! own; its failure notification comes after the same `cp`.
//!
//! Ours: stop, snapshot, uninit, install, init, start, state `installed`,
//! notification, then the backup drop in the background (timed separately:
//! [`startos_core::finalize_update`] waits for it after the notification).
//!
//! Overhead is total minus stop minus the service phases (uninit, install,
//! init, start): what finalization adds to the service's own work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use integration::services::ProcessServices;
use serde::Serialize;
use startos_core::{
    Db, Event, FileDb, Finalizer, InstallRequest, InstallingInfo, Notification, Notifier,
    PackageDataEntry, Phase, Services, StateInfo, Timings, finalize_update,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::common::{
    Result, Scratch, cp_reflink, fmt_count, fmt_duration, fmt_ratio, install_and_drop, rm_rf,
    volume_err,
};
use crate::{Args, GIB, Stats, Verdict, default_size};

/// Our finalization overhead must stay below this median at every extent count.
const OVERHEAD_TARGET: Duration = Duration::from_millis(50);
/// Default timed rounds below, and at or above, this many extents.
const MANY_EXTENTS: u64 = 500_000;
const DEFAULT_RUNS: u32 = 5;
const DEFAULT_RUNS_MANY: u32 = 3;
/// How long the old service writes before each round's first update.
const RUNNING: Duration = Duration::from_millis(200);

type Fin = Finalizer<FileDb, ProcessServices, UnboundedSender<Notification>>;

/// The figures of one update.
#[derive(Default, Clone, Copy)]
struct Sample {
    /// From the new version's start returning to the notification.
    notify: Duration,
    /// `total - stop - service`.
    overhead: Duration,
    /// Taking the backup.
    snapshot: Duration,
    /// Dropping the backup: upstream's `rm -rf` on the install's path, our
    /// subvolume delete after the notification.
    drop: Duration,
    stop: Duration,
    service: Duration,
    state_writes: Duration,
    /// From the start of finalization to the notification.
    total: Duration,
}

impl Sample {
    fn ours(t: &Timings, drop: Duration) -> Sample {
        Sample {
            notify: t.install_done_to_notify,
            overhead: t.overhead(),
            snapshot: t.snapshot,
            drop,
            stop: t.stop,
            service: t.service,
            state_writes: t.state_writes,
            total: t.total,
        }
    }
}

/// One line of a table.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Figure {
    /// New version started -> notification.
    InstallDoneToNotify,
    /// Total minus stop minus the service phases.
    Overhead,
    /// The install backup.
    Snapshot,
    /// Dropping the backup (upstream: before the notification; ours: after).
    Drop,
    /// Stopping the old service.
    Stop,
    /// uninit + install + init + start.
    Service,
    /// State database writes.
    StateWrites,
    /// Finalization start -> notification.
    Total,
}

impl Figure {
    const ALL: [Figure; 8] = [
        Figure::InstallDoneToNotify,
        Figure::Overhead,
        Figure::Snapshot,
        Figure::Drop,
        Figure::Stop,
        Figure::Service,
        Figure::StateWrites,
        Figure::Total,
    ];

    fn name(self) -> &'static str {
        match self {
            Figure::InstallDoneToNotify => "install done -> notification",
            Figure::Overhead => "overhead (total - stop - service)",
            Figure::Snapshot => "backup snapshot",
            Figure::Drop => "backup drop",
            Figure::Stop => "stop old service",
            Figure::Service => "uninit+install+init+start",
            Figure::StateWrites => "state writes",
            Figure::Total => "total to notification",
        }
    }

    fn of(self, s: &Sample) -> Duration {
        match self {
            Figure::InstallDoneToNotify => s.notify,
            Figure::Overhead => s.overhead,
            Figure::Snapshot => s.snapshot,
            Figure::Drop => s.drop,
            Figure::Stop => s.stop,
            Figure::Service => s.service,
            Figure::StateWrites => s.state_writes,
            Figure::Total => s.total,
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

/// The scratch filesystem, the finalizer over it, and its notifications.
struct Bed {
    vol: Scratch,
    fin: Fin,
    tx: UnboundedSender<Notification>,
    rx: UnboundedReceiver<Notification>,
    /// The version running now.
    version: u32,
}

fn version(n: u32) -> String {
    format!("1.0.{n}")
}

fn request(bed: &Bed, v: &str) -> InstallRequest {
    InstallRequest {
        package: bed.vol.package().clone(),
        version: v.to_owned(),
        s9pk: format!("/media/startos/data/package-data/archive/monerod-{v}.s9pk"),
    }
}

impl Bed {
    /// Takes the one notification the last update sent and checks it says
    /// `version` is installed.
    fn expect_installed(&mut self, v: &str) -> Result<()> {
        match self.rx.try_recv() {
            Ok(Notification {
                event: Event::Installed { version },
                ..
            }) if version == v => Ok(()),
            Ok(other) => Err(format!("unexpected notification {other:?}").into()),
            Err(e) => Err(format!("no notification after installing {v}: {e}").into()),
        }
    }

    /// Settles the filesystem and drops the database file's cached pages,
    /// then lets the running service write for a moment, as it would.
    async fn settle(&self) -> Result<()> {
        self.vol.settle()?;
        self.vol.evict_page_cache()?;
        tokio::time::sleep(RUNNING).await;
        Ok(())
    }

    /// Ours: [`finalize_update`] to the next version.
    async fn ours(&mut self) -> Result<Sample> {
        let to = version(self.version + 1);
        let (t, drop) = finalize_update(&self.fin, &request(self, &to))
            .await
            .map_err(volume_err)?;
        self.expect_installed(&to)?;
        self.version += 1;
        Ok(Sample::ours(&t, drop))
    }

    /// Upstream's order, with the same services and state database: see the
    /// module documentation.
    async fn upstream(&mut self) -> Result<Sample> {
        let (from, to) = (version(self.version), version(self.version + 1));
        let pkg = self.vol.package().clone();
        let db = self.fin.db().clone();
        let svc = self.fin.services().clone();
        let mut s = Sample::default();
        let t0 = Instant::now();

        let t = Instant::now();
        let (p, v) = (pkg.clone(), to.clone());
        db.mutate(move |m| {
            if let Some(e) = m.get_mut(&p) {
                e.state_info = StateInfo::Updating {
                    installing_info: InstallingInfo {
                        new_version: v,
                        phase: Phase::Stop,
                        had_volume: true,
                        backup_taken: false,
                    },
                };
            }
            Ok(())
        })
        .await
        .map_err(volume_err)?;
        s.state_writes += t.elapsed();

        // service_map.rs:309, the old service still running.
        let (live, backup) = (self.vol.live().to_owned(), self.vol.backup().to_owned());
        let t = Instant::now();
        blocking(move || cp_reflink(&live, &backup)).await?;
        s.snapshot = t.elapsed();

        // :349, service.uninstall: stop, then uninit towards the new version.
        let t = Instant::now();
        svc.stop(&pkg).await.map_err(volume_err)?;
        s.stop = t.elapsed();
        let t = Instant::now();
        svc.uninit(&pkg, &from, Some(&to))
            .await
            .map_err(volume_err)?;
        let req = request(self, &to);
        svc.install(&pkg, &to, &req.s9pk)
            .await
            .map_err(volume_err)?;
        svc.init(&pkg, &to, Some(&from)).await.map_err(volume_err)?;
        svc.start(&pkg, &to).await.map_err(volume_err)?;
        s.service = t.elapsed();
        let install_done = Instant::now();

        let t = Instant::now();
        let (p, v) = (pkg.clone(), to.clone());
        db.mutate(move |m| {
            m.insert(
                p,
                PackageDataEntry {
                    state_info: StateInfo::Installed,
                    version: Some(v),
                    s9pk: req.s9pk,
                },
            );
            Ok(())
        })
        .await
        .map_err(volume_err)?;
        s.state_writes += t.elapsed();

        // :380, remove_install_backup, before the install future completes.
        let backup = self.vol.backup().to_owned();
        let t = Instant::now();
        blocking(move || rm_rf(&backup)).await?;
        s.drop = t.elapsed();

        let at = Instant::now();
        self.tx.notify(Notification {
            package: pkg,
            at,
            event: Event::Installed {
                version: to.clone(),
            },
        });
        s.notify = at.duration_since(install_done);
        s.total = at.duration_since(t0);
        s.overhead = s.total.saturating_sub(s.stop + s.service);
        self.expect_installed(&to)?;
        self.version += 1;
        Ok(s)
    }

    /// One round: upstream's update, then ours, each from a settled
    /// filesystem.
    async fn round(&mut self, up: &mut Vec<Sample>, ours: &mut Vec<Sample>) -> Result<()> {
        self.settle().await?;
        up.push(self.upstream().await?);
        self.settle().await?;
        ours.push(self.ours().await?);
        Ok(())
    }
}

/// Runs a blocking step off the runtime.
async fn blocking(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    tokio::task::spawn_blocking(move || f().map_err(|e| e.to_string()))
        .await
        .map_err(|e| format!("blocking task: {e}"))?
        .map_err(Into::into)
}

async fn run_case(args: &Args, target: u64) -> Result<Case> {
    let file_bytes = args.size.unwrap_or_else(|| default_size(target));
    let image_bytes = args.image_size.unwrap_or(2 * file_bytes + 2 * GIB);
    let vol = Scratch::new(image_bytes)?;
    eprintln!(
        "finalize, {} extents: building the database file ...",
        fmt_count(target)
    );
    let start = Instant::now();
    let extents = integration::make_fragmented_file(&vol.file, file_bytes, target, args.seed)?;
    let build = start.elapsed();

    let run_dir = vol.path("run");
    let program = ProcessServices::locate_program().map_err(volume_err)?;
    let services = ProcessServices::new(vol.root(), &run_dir, program).map_err(volume_err)?;
    let db = FileDb::open(vol.path("state.json")).map_err(volume_err)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let fin = Finalizer::new(db, Arc::new(services), Arc::new(tx.clone()), vol.root());
    let mut bed = Bed {
        vol,
        fin,
        tx,
        rx,
        version: 0,
    };
    // The old version: installed over the existing volume, and running.
    let v0 = version(0);
    install_and_drop(&bed.fin, &request(&bed, &v0)).await?;
    bed.expect_installed(&v0)?;

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
    bed.round(&mut Vec::new(), &mut Vec::new()).await?;
    for _ in 0..runs {
        bed.round(&mut up, &mut ours).await?;
    }
    let pkg = bed.vol.package().clone();
    bed.fin.services().stop(&pkg).await.map_err(volume_err)?;
    let Bed { vol, fin, .. } = bed;
    drop(fin);
    vol.close()?;

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
    let worst = cases
        .iter()
        .map(|c| (c, c.row(Figure::Overhead).ours.median()))
        .max_by_key(|&(_, d)| d);
    worst
        .map(|(case, median)| {
            Verdict::new(
                format!(
                    "our finalization overhead < {} median at every extent count",
                    fmt_duration(OVERHEAD_TARGET)
                ),
                median < OVERHEAD_TARGET,
                format!(
                    "worst {} at {} extents (upstream {})",
                    fmt_duration(median),
                    fmt_count(case.extents),
                    fmt_duration(case.row(Figure::Overhead).upstream.median()),
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut cases = Vec::new();
    for &target in &args.extents {
        cases.push(rt.block_on(run_case(args, target))?);
    }
    Ok(Report {
        targets: verdicts(&cases),
        cases,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Prints one table per extent count and the target line.
pub fn print(report: &Report) {
    println!("finalize: update of a running service, upstream's order against ours");
    for case in &report.cases {
        println!();
        let title = format!("{} extents ({} runs)", fmt_count(case.extents), case.runs);
        println!(
            "{title:<36} {:>11}  {:>8}   {:>7}",
            "upstream", "ours", "ratio"
        );
        for row in &case.rows {
            let mark = match row.figure {
                Figure::Drop => ("*", "**"),
                _ => ("", ""),
            };
            println!(
                "  {:<34} {:>11}{:<1} {:>8}{:<2} {:>7}",
                row.figure.name(),
                fmt_duration(row.upstream.median()),
                mark.0,
                fmt_duration(row.ours.median()),
                mark.1,
                fmt_ratio(row.ratio),
            );
        }
    }
    println!();
    println!(
        "medians, each update from a settled filesystem (file not in the page cache), the old\n\
         \x20 service writing random 4 KiB blocks into the volume until stopped\n\
         upstream: updating state; cp -a --reflink=always while the old service runs; stop;\n\
         \x20 uninit, install, init, start; installed state; rm -rf of the backup; notification\n\
         \x20 (the install future completing)\n\
         ours: updating state; stop; subvolume snapshot; backup state; uninit, install, init,\n\
         \x20 start; installed state; notification; backup dropped in the background\n\
         * on the path to the notification   ** after the notification, in the background"
    );
    println!();
    for v in &report.targets {
        v.print();
    }
}
