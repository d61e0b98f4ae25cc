//! `volume-migrate`: converts the plain package volume directories under a
//! volumes root into btrfs subvolumes, once, resumably.
//!
//! Exit 0 when every package converted or there was nothing to do (off
//! btrfs too); 1 when any package failed (each failure one line on stderr,
//! the others still converted); 2 on bad input (one line on stderr).
//! Progress goes to stderr as one updating line on a terminal; with `--json`
//! every event is one JSON object per line on stdout.

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
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.to_string();
            eprintln!(
                "{}",
                text.lines()
                    .next()
                    .unwrap_or("volume-migrate: bad arguments")
            );
            return ExitCode::from(2);
        }
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

/// Binary units, one decimal: the one way the workspace prints sizes.
#[cfg(target_os = "linux")]
fn human_bytes(b: u64) -> String {
    bytesize::ByteSize::b(b).display().iec().to_string()
}

#[cfg(target_os = "linux")]
fn json_line(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
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
        Err(e) => {
            eprintln!("volume-migrate: {e}");
            return ExitCode::from(2);
        }
    };
    if !migrator.is_btrfs() {
        let msg = format!(
            "{} is not on btrfs: nothing to convert",
            migrator.root().display()
        );
        if cli.json {
            json_line(
                serde_json::json!({"event": "not-btrfs", "root": migrator.root(), "message": msg}),
            );
        } else {
            println!("{msg}");
        }
        return ExitCode::SUCCESS;
    }
    if cli.dry_run {
        dry_run::run(&migrator, method, cli.json)
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
    use volume_migrate::cost::Cost;
    use volume_migrate::{Decision, Method, MigrateOptions, Migrator, Planned};

    use super::{human_bytes, json_line};

    pub(super) fn run(migrator: &Migrator, method: Method, json: bool) -> ExitCode {
        let plan = match migrator.plan_with(&MigrateOptions {
            method,
            ..MigrateOptions::default()
        }) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("volume-migrate: {e}");
                return ExitCode::from(1);
            }
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
            Err(e) => {
                eprintln!("volume-migrate: {e}");
                return ExitCode::from(1);
            }
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
    use std::io::{IsTerminal, Write};
    use std::process::ExitCode;
    use std::time::{Duration, Instant};

    use models::PackageId;
    use serde_json::json;
    use volume_migrate::{
        Method, MigrateOptions, Migrator, Outcome, PackageReport, Phase, Progress,
    };

    use super::{human_bytes, json_line};

    pub(super) fn run(migrator: &Migrator, method: Method, keep_old: bool, json: bool) -> ExitCode {
        let tty = !json && std::io::stderr().is_terminal();
        let mut progress = ProgressOut {
            json,
            tty,
            last_line: Instant::now() - Duration::from_secs(1),
            last_json: Instant::now() - Duration::from_secs(1),
            last_phase: None,
        };
        let mut done = DoneOut {
            json,
            tty,
            printed_failures: Vec::new(),
        };
        let opts = MigrateOptions {
            remove_old: !keep_old,
            method,
            // Every package is ready before any old tree is removed.
            defer_cut: true,
            ..MigrateOptions::default()
        };
        let reports = match migrator.run(
            &opts,
            &mut |p: &Progress| progress.show(p),
            &mut |r: &PackageReport| done.show(r),
        ) {
            Ok(r) => r,
            Err(e) => {
                if tty {
                    eprint!("\r\x1b[2K");
                }
                eprintln!("volume-migrate: {e}");
                return ExitCode::from(1);
            }
        };
        if tty {
            eprint!("\r\x1b[2K");
        }
        summary(&reports, json, &done.printed_failures)
    }

    /// Progress: on a terminal one updating line on stderr, at most ten a
    /// second; with `--json`, every phase change and at most two clone
    /// reports a second.
    struct ProgressOut {
        json: bool,
        tty: bool,
        last_line: Instant,
        last_json: Instant,
        last_phase: Option<(PackageId, Phase)>,
    }

    impl ProgressOut {
        fn show(&mut self, p: &Progress) {
            if self.json {
                let changed = self.last_phase != Some((p.package.clone(), p.phase));
                if changed || self.last_json.elapsed() >= Duration::from_millis(500) {
                    self.last_json = Instant::now();
                    self.last_phase = Some((p.package.clone(), p.phase));
                    json_line(json!({"event": "progress", "progress": p}));
                }
            } else if self.tty && self.last_line.elapsed() >= Duration::from_millis(100) {
                self.last_line = Instant::now();
                let eta = p
                    .eta
                    .map(|d| format!("ETA {}s", d.as_secs()))
                    .unwrap_or_else(|| "ETA ?".to_owned());
                // Totals arrive when the scan beside the clone finishes.
                let total = |n: String| if p.totals_known { n } else { "?".to_owned() };
                let line = format!(
                    "{} {:?}: {}/{} {}/{} extents {}/{} entries {eta}",
                    p.package,
                    p.phase,
                    human_bytes(p.bytes_done),
                    total(human_bytes(p.bytes_total)),
                    p.extents_done,
                    total(p.extents_total.to_string()),
                    p.entries_done,
                    total(p.entries_total.to_string()),
                );
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{line}");
                let _ = err.flush();
            }
        }
    }

    /// Each package as soon as it is done: a line on stdout, a failure on
    /// stderr (remembered, so the summary does not repeat it), or with
    /// `--json` its report.
    struct DoneOut {
        json: bool,
        tty: bool,
        printed_failures: Vec<PackageId>,
    }

    impl DoneOut {
        fn show(&mut self, r: &PackageReport) {
            if self.tty {
                eprint!("\r\x1b[2K");
            }
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
        if json {
            json_line(json!({
                "event": "summary",
                "dry_run": false,
                "converted": converted,
                "failed": failed,
                "old_removed": reports.iter().filter(|r| r.old_removed).count(),
            }));
        } else if reports.is_empty() {
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
