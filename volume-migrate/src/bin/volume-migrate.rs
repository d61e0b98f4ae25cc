//! `volume-migrate`: converts the plain package volume directories under a
//! volumes root into btrfs subvolumes, once, resumably.
//!
//! Exit 0 when every package converted or there was nothing to do (off
//! btrfs too); 1 when any package failed (each failure one line on stderr,
//! beside progress lines that start `volume-migrate: progress:`, the others
//! still converted); 2 on bad input (one line on stderr).
//! Progress goes to stderr: a bar (indicatif) on a terminal, plain lines at a
//! bounded rate elsewhere; with `--json` every event is one JSON object per
//! line on stdout, a failure that ends the run included (an `error` event
//! with the error's kind and code), and each entry of the root the run
//! passes over (a `skipped` event, else a warning on stderr).

#[cfg(target_os = "linux")]
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "volume-migrate",
    version,
    about = "Convert plain package volume directories into btrfs subvolumes"
)]
struct Cli {
    /// The package volumes directory.
    #[arg(long, default_value_os_t = volume::default_root())]
    root: PathBuf,
    /// Only list what would be converted, with the estimated work.
    #[arg(long)]
    dry_run: bool,
    /// JSON lines on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Leave the replaced directories as `<pkg>.migrate-old`, and the rest
    /// of a parent's snapshot set aside in the converted volume (remove them
    /// later with a run without this flag).
    #[arg(long)]
    keep_old: bool,
    /// How to convert: `auto` snapshots the parent for every package it
    /// can, keeping every file's identity, and clones the others (the dry
    /// run says why).
    #[arg(long, value_enum, default_value = "auto")]
    method: CliMethod,
}

/// `--method`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum CliMethod {
    /// Snapshot the parent for every package a snapshot can serve; clone
    /// the others.
    Auto,
    /// Clone every package.
    Clone,
    /// Snapshot the parent for every package (refused where it cannot
    /// apply).
    SnapshotParent,
}

fn main() -> ExitCode {
    // What the library warns of (an entry it passed over, say) goes to
    // stderr, one line each, as startos-volume's.
    volume::init_command_line_log();
    let cli = match volume::cli::parse_args::<Cli>("volume-migrate") {
        Ok(c) => c,
        Err(code) => return code,
    };
    #[cfg(target_os = "linux")]
    {
        run(cli)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cli;
        eprintln!("volume-migrate: only Linux has btrfs subvolumes; nothing to do");
        ExitCode::SUCCESS
    }
}

#[cfg(target_os = "linux")]
fn json_line(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

/// A failure that ends the run: its one line on stderr, and with `--json`
/// an `error` event on stdout too (startos-volume's error object, as an
/// event), so that a caller reading stdout learns the run failed and why;
/// then `code`.
#[cfg(target_os = "linux")]
fn fail(json: bool, e: &models::Error, code: u8) -> ExitCode {
    if json {
        let mut event = volume::cli::error_json(e);
        event["event"] = "error".into();
        json_line(event);
    }
    eprintln!("volume-migrate: {e}");
    ExitCode::from(code)
}

/// The entries under the root no run touches, each said once: a warning
/// on stderr, or with `--json` a `skipped` event on stdout.
#[cfg(target_os = "linux")]
fn report_skipped(migrator: &volume_migrate::Migrator, json: bool) -> Result<(), models::Error> {
    for s in migrator.skipped()? {
        if json {
            // A name need not be UTF-8: serde refuses such a path (and
            // `json!` would panic), so it goes as lossy text.
            json_line(serde_json::json!({
                "event": "skipped",
                "package": s.name,
                "path": s.path.to_string_lossy(),
                "why": s.why,
            }));
        } else {
            tracing::warn!("skipped {}: {}", volume::walk::printable(&s.path), s.why);
        }
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn run(cli: Cli) -> ExitCode {
    use volume_migrate::{Method, Migrator};

    let method = match cli.method {
        CliMethod::Auto => Method::Auto,
        CliMethod::Clone => Method::Clone,
        CliMethod::SnapshotParent => Method::SnapshotParent,
    };

    // Each walk holds a bounded number of descriptors at any depth, but the
    // counts of a run's packages go on at once, each with its own walk.
    match rlimit_nofile() {
        Ok((soft, hard)) if soft < hard => {
            let _ = set_rlimit_nofile(hard);
        }
        _ => {}
    }

    let migrator = match Migrator::open(&cli.root) {
        Ok(m) => m,
        Err(e) => return fail(cli.json, &e, 2),
    };
    if let Some(why) = migrator.why_not_btrfs() {
        let msg = format!("nothing to convert: {why}");
        if cli.json {
            json_line(serde_json::json!({
                "event": "not-btrfs",
                "root": migrator.root().to_string_lossy(),
                "message": msg,
                "why": why,
            }));
        } else {
            println!("{msg}");
        }
        return ExitCode::SUCCESS;
    }
    if let Err(e) = report_skipped(&migrator, cli.json) {
        return fail(cli.json, &e, 1);
    }
    if cli.dry_run {
        dry_run::run(&migrator, method, cli.keep_old, cli.json)
    } else {
        convert::run(&migrator, method, cli.keep_old, cli.json)
    }
}

/// `--dry-run`: the plan, one line (or JSON object) per package, and the
/// metadata space it needs against what is free. Changes nothing.
#[cfg(target_os = "linux")]
mod dry_run {
    use std::process::ExitCode;

    use serde_json::json;
    use volume::human_bytes;
    use volume_migrate::cost::Cost;
    use volume_migrate::{Decision, Method, MigrateOptions, Migrator, Planned};

    use super::{fail, json_line};

    pub(super) fn run(migrator: &Migrator, method: Method, keep_old: bool, json: bool) -> ExitCode {
        let plan = match migrator.plan_with(&MigrateOptions {
            method,
            remove_old: !keep_old,
            ..MigrateOptions::default()
        }) {
            Ok(p) => p,
            Err(e) => return fail(json, &e, 1),
        };
        for entry in &plan {
            if json {
                json_line(entry_json(entry));
            } else {
                print_entry(entry);
            }
        }
        // Packages convert one after another, so together they need the
        // sum; each is checked against what is free when its turn comes.
        let needed: u64 = plan
            .iter()
            .filter_map(|e| e.estimate)
            .map(|e| e.metadata_bytes())
            .sum();
        let room = match migrator.metadata_room(&MigrateOptions::default()) {
            Ok(room) => room,
            Err(e) => return fail(json, &e, 1),
        };
        let (free, reserve) = (room.map(|r| r.free), room.map_or(0, |r| r.reserve));
        let short = free.is_some_and(|f| f < needed.saturating_add(reserve));
        if plan.is_empty() && !json {
            println!("nothing to convert");
        }
        if !json
            && needed > 0
            && let Some(free) = free
        {
            println!(
                "metadata space: {} free, about {} needed, plus {} kept in reserve{}",
                human_bytes(free),
                human_bytes(needed),
                human_bytes(reserve),
                if short {
                    ": not enough, some conversions would be refused"
                } else {
                    ""
                }
            );
        }
        if json {
            json_line(json!({
                "event": "summary",
                "dry_run": true,
                "packages": plan.len(),
                "metadata_free": free,
                "metadata_needed": needed,
                "metadata_reserve": reserve,
                "enough_space": !short,
            }));
        }
        ExitCode::SUCCESS
    }

    fn cost(c: Option<Cost>) -> String {
        c.map_or_else(|| "not counted".to_owned(), |c| c.to_string())
    }

    /// One package of the plan as a JSON object.
    fn entry_json(entry: &Planned) -> serde_json::Value {
        // A clone's duration; snapshotting the parent takes milliseconds.
        let est_secs = entry
            .estimate
            .filter(|_| entry.method() != Some(Method::SnapshotParent))
            .map(|e| e.duration().as_secs_f64());
        json!({
            "event": "plan",
            "package": entry.package,
            "estimate": entry.estimate,
            "method": entry.method(),
            "decision": entry.decision,
            "clone_cost": entry.clone,
            "cut_cost": entry.cut,
            "shares": entry.shares.iter().map(|s| &s.id).collect::<Vec<_>>(),
            "estimated_seconds": est_secs,
            "metadata_bytes": entry.estimate.map(|e| e.metadata_bytes()),
            "resume": entry.resume,
            "old_pending": entry.old_pending,
            "refused": entry.refused,
        })
    }

    /// One package of the plan as a line.
    fn print_entry(entry: &Planned) {
        if let Some(why) = &entry.refused {
            println!("would refuse {}: {why}", entry.package);
            return;
        }
        match (&entry.decision, entry.estimate) {
            (Some(Decision::SnapshotParent), _) => println!(
                "would convert {}: snapshot its parent subvolume and cut the snapshot down \
                 to it, every file keeping its identity: the cut {} in the background, \
                 against a clone {}",
                entry.package,
                cost(entry.cut),
                cost(entry.clone)
            ),
            (Some(Decision::Clone(reason)), Some(e)) => println!(
                "would convert {}: clone, {} entries, {} files, {}, {} extents{}, about \
                 {:.1} s{}; not by snapshotting the parent: {reason} (a cut {})",
                entry.package,
                e.entries,
                e.files,
                human_bytes(e.bytes),
                e.extents,
                if e.nested_subvolumes > 0 {
                    format!(", {} nested subvolumes", e.nested_subvolumes)
                } else {
                    String::new()
                },
                e.duration().as_secs_f64(),
                if entry.resume {
                    " (resuming an interrupted run)"
                } else {
                    ""
                },
                cost(entry.cut),
            ),
            _ => println!(
                "would finish {}: an interrupted run's leftovers{}",
                entry.package,
                if entry.old_pending {
                    ", old trees to remove"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The conversion: progress while it goes, a line (or JSON object) per
/// package as soon as it is done, then a summary; exit 1 if any failed.
#[cfg(target_os = "linux")]
mod convert {
    use std::collections::BTreeMap;
    use std::io::IsTerminal;
    use std::process::ExitCode;
    use std::time::{Duration, Instant};

    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    use models::PackageId;
    use serde_json::json;
    use volume::human_bytes;
    use volume_migrate::{
        Method, MigrateOptions, Migrator, Outcome, PackageReport, Phase, Progress,
    };

    use super::{fail, json_line};

    pub(super) fn run(migrator: &Migrator, method: Method, keep_old: bool, json: bool) -> ExitCode {
        let mut progress = ProgressOut::new(json);
        let mut done = DoneOut {
            json,
            bar: progress.bar(),
            printed_failures: Vec::new(),
        };
        let opts = MigrateOptions {
            remove_old: !keep_old,
            method,
            // Every package is ready before any old tree is removed.
            defer_cut: true,
            ..MigrateOptions::default()
        };
        let result = migrator.run(
            &opts,
            &mut |p: &Progress| progress.show(p),
            &mut |r: &PackageReport| done.show(r),
        );
        if let Some(bar) = progress.bar() {
            bar.finish_and_clear();
        }
        match result {
            Ok(reports) => summary(&reports, json, &done.printed_failures),
            Err(e) => fail(json, &e, 1),
        }
    }

    /// Progress on stderr. On a terminal, one bar for the whole run (its
    /// work, extents plus entries, against the work known so far, with the
    /// ETA; the bytes in place and their rate) and the package being
    /// converted; elsewhere plain lines starting
    /// `volume-migrate: progress:`, none in a run's first second, then at
    /// most one a second unless a package changes phase (at most ten a
    /// second then);
    /// with `--json`, every phase change and at most two clone reports a
    /// second, on stdout.
    enum ProgressOut {
        Json {
            last: Instant,
            phase: Option<(PackageId, Phase)>,
        },
        Bar {
            bar: ProgressBar,
            started: Instant,
            /// Each package's part, by the highest figures it reported.
            packages: BTreeMap<PackageId, Tally>,
        },
        Lines {
            started: Instant,
            last: Instant,
            phase: Option<(PackageId, Phase)>,
        },
    }

    impl ProgressOut {
        fn new(json: bool) -> ProgressOut {
            let long_ago = Instant::now() - Duration::from_secs(10);
            if json {
                return ProgressOut::Json {
                    last: long_ago,
                    phase: None,
                };
            }
            if !std::io::stderr().is_terminal() {
                return ProgressOut::Lines {
                    started: Instant::now(),
                    last: long_ago,
                    phase: None,
                };
            }
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} [{bar:24}] {percent:>3}% ETA {eta:>3} {wide_msg}",
            )
            .map(|s| s.progress_chars("=> "));
            if let Ok(style) = style {
                bar.set_style(style);
            }
            ProgressOut::Bar {
                bar,
                started: Instant::now(),
                packages: BTreeMap::new(),
            }
        }

        /// The bar, where there is one: what else prints goes above it.
        fn bar(&self) -> Option<ProgressBar> {
            match self {
                ProgressOut::Bar { bar, .. } => Some(bar.clone()),
                _ => None,
            }
        }

        fn show(&mut self, p: &Progress) {
            let now = (p.package.clone(), p.phase);
            match self {
                ProgressOut::Json { last, phase } => {
                    if phase.as_ref() != Some(&now) || last.elapsed() >= Duration::from_millis(500)
                    {
                        *last = Instant::now();
                        *phase = Some(now);
                        json_line(json!({"event": "progress", "progress": p}));
                    }
                }
                ProgressOut::Bar {
                    bar,
                    started,
                    packages,
                } => {
                    packages.entry(p.package.clone()).or_default().add(p);
                    let sum = |f: fn(&Tally) -> u64| packages.values().map(f).sum::<u64>();
                    bar.set_length(sum(Tally::work_total));
                    bar.set_position(sum(Tally::work_done));
                    let bytes = sum(|t| t.bytes.0);
                    let rate = bytes as f64 / started.elapsed().as_secs_f64().max(0.001);
                    bar.set_message(format!(
                        "{}/{} at {}/s; {}",
                        human_bytes(bytes),
                        human_bytes(sum(|t| t.bytes.1)),
                        human_bytes(rate as u64),
                        counts(p)
                    ));
                }
                ProgressOut::Lines {
                    started,
                    last,
                    phase,
                } => {
                    let changed = phase.as_ref() != Some(&now);
                    let gap = last.elapsed();
                    // A run of under a second (most: a snapshot takes
                    // milliseconds) prints only its results.
                    if started.elapsed() >= Duration::from_secs(1)
                        && ((changed && gap >= Duration::from_millis(100))
                            || gap >= Duration::from_secs(1))
                    {
                        *last = Instant::now();
                        *phase = Some(now);
                        let eta = p
                            .eta
                            .map(|d| format!(", ETA {}s", d.as_secs()))
                            .unwrap_or_default();
                        eprintln!(
                            "volume-migrate: progress: {}, {}/{} bytes{eta}",
                            counts(p),
                            human_bytes(p.bytes_done),
                            known(p, human_bytes(p.bytes_total)),
                        );
                    }
                }
            }
        }
    }

    /// One package's part of the bar, as (done, total as far as known):
    /// its conversion's work (extents plus entries, the units the ETA is
    /// right in) and bytes, which every phase reports cumulatively, and
    /// the removal of its old tree, entry by entry.
    #[derive(Default)]
    struct Tally {
        work: (u64, u64),
        bytes: (u64, u64),
        removed: (u64, u64),
    }

    impl Tally {
        fn add(&mut self, p: &Progress) {
            // Totals arrive when the scan beside the clone finishes; until
            // then what is done is all that is known.
            let high = |(d, t): (u64, u64), done: u64, total: u64| {
                let d = d.max(done);
                (d, t.max(if p.totals_known { total } else { 0 }).max(d))
            };
            if p.phase == Phase::RemoveOld {
                self.removed = high(self.removed, p.entries_done, p.entries_total);
            } else {
                self.work = high(self.work, p.work_done(), p.work_total());
                self.bytes = high(self.bytes, p.bytes_done, p.bytes_total);
                self.removed.1 = self.removed.1.max(p.entries_total);
            }
        }

        fn work_done(&self) -> u64 {
            self.work.0 + self.removed.0
        }

        fn work_total(&self) -> u64 {
            self.work.1 + self.removed.1.max(self.removed.0)
        }
    }

    /// A total as far as it is known.
    fn known(p: &Progress, n: String) -> String {
        if p.totals_known { n } else { "?".to_owned() }
    }

    /// The package, its phase and its counts, for the bar and the lines.
    fn counts(p: &Progress) -> String {
        format!(
            "{} {:?}: {}/{} extents, {}/{} entries",
            p.package,
            p.phase,
            p.extents_done,
            known(p, p.extents_total.to_string()),
            p.entries_done,
            known(p, p.entries_total.to_string()),
        )
    }

    /// Each package as soon as it is done: a line on stdout, a failure on
    /// stderr (remembered, so the summary does not repeat it), or with
    /// `--json` its report.
    struct DoneOut {
        json: bool,
        /// The progress bar, which the lines go above.
        bar: Option<ProgressBar>,
        printed_failures: Vec<PackageId>,
    }

    impl DoneOut {
        fn show(&mut self, r: &PackageReport) {
            match self.bar.clone() {
                Some(bar) => bar.suspend(|| self.print(r)),
                None => self.print(r),
            }
        }

        fn print(&mut self, r: &PackageReport) {
            if self.json {
                json_line(json!({"event": "package", "report": r}));
                return;
            }
            match (&r.outcome, &r.error) {
                (Outcome::Failed, Some(e)) => {
                    eprintln!("volume-migrate: {}", e.message);
                    self.printed_failures.push(r.package.clone());
                }
                (Outcome::Converted, _) => println!(
                    "converted {}: {} in {:.1} s{}",
                    r.package,
                    match (r.method, r.estimate) {
                        (Some(Method::SnapshotParent), _) =>
                            "a snapshot of its parent subvolume, cut down to it".to_owned(),
                        (_, Some(e)) => format!(
                            "{} entries, {}, {} extents",
                            e.entries,
                            human_bytes(e.bytes),
                            e.extents
                        ),
                        _ => String::new(),
                    },
                    r.elapsed.as_secs_f64(),
                    if r.resumed {
                        format!(" (resumed; {} cloned now)", human_bytes(r.bytes_cloned))
                    } else {
                        String::new()
                    }
                ),
                (Outcome::Finished, _) => {
                    println!("finished {}: interrupted run completed", r.package)
                }
                _ => {}
            }
            // What the dry run said differs: shown, whatever the outcome.
            if let Some(why) = &r.fallback {
                println!(
                    "{}: cloned, not snapshotted as planned (every inode number changed): {why}",
                    r.package
                );
            }
        }
    }

    /// The end of a run: the summary, the failures not printed yet, and
    /// the exit code.
    fn summary(reports: &[PackageReport], json: bool, printed: &[PackageId]) -> ExitCode {
        let failed = reports
            .iter()
            .filter(|r| r.outcome == Outcome::Failed)
            .count();
        let converted = reports
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Converted | Outcome::Finished))
            .count();
        // Removed after every package was reported done.
        for r in reports.iter().filter(|r| r.old_removed) {
            if json {
                json_line(json!({"event": "old-removed", "package": r.package}));
            } else {
                println!("removed the old trees of {}", r.package);
            }
        }
        if json {
            json_line(json!({
                "event": "summary",
                "dry_run": false,
                "converted": converted,
                "failed": failed,
                "old_removed": reports.iter().filter(|r| r.old_removed).count(),
            }));
        } else if reports
            .iter()
            .all(|r| r.outcome == Outcome::AlreadySubvolume && !r.old_removed)
        {
            println!("nothing to convert");
        } else {
            // Failures to remove an old directory come after `on_done`.
            for r in reports {
                match (&r.outcome, &r.error) {
                    (Outcome::Failed, Some(e)) if !printed.contains(&r.package) => {
                        eprintln!("volume-migrate: {}", e.message);
                    }
                    _ => {}
                }
            }
        }
        if failed > 0 {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        }
    }
}

#[cfg(target_os = "linux")]
fn rlimit_nofile() -> std::io::Result<(u64, u64)> {
    Ok(volume::sys::nofile_limit())
}

#[cfg(target_os = "linux")]
fn set_rlimit_nofile(n: u64) -> std::io::Result<()> {
    volume::sys::set_nofile_limit(n)
}
