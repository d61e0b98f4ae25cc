//! `make compare`: every scenario of [`integration::compare`] run against
//! upstream's baseline ([`integration::upstream`]) and against ours, on
//! loop-mounted btrfs images, printed as one table: the scenario,
//! upstream's outcome, ours, and the times.
//!
//! Needs root, and the failpoints features for the scenarios that kill a
//! process (`make compare` builds with them). The scenarios that kill
//! re-execute this binary, which then runs only the child's operation
//! ([`integration::compare::child_main`]).
//!
//! Reports; does not judge. Exits 0 if every scenario ran (whatever it
//! found), 1 if one could not run, with its error in the table.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use integration::compare::{self, Launcher, Report, Row, Scale, table};

/// A scenario of the issue.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// a. nested subvolumes through snapshot and restore.
    Nested,
    /// b. SIGKILL at each step of restore and conversion.
    Crash,
    /// c. converting a tree with every kind of entry and attribute.
    Attrs,
    /// d. a conversion killed at 90% and run again.
    Resume,
    /// e. restore under another namespace's writing bind mount.
    Bind,
    /// f. NOCOW files in a plain-directory volume.
    Nocow,
    /// g. a box of plain-directory packages converted at boot.
    Boot,
    Reorder,
}

impl Scenario {
    const ALL: [Scenario; 8] = [
        Scenario::Nested,
        Scenario::Crash,
        Scenario::Attrs,
        Scenario::Resume,
        Scenario::Bind,
        Scenario::Nocow,
        Scenario::Boot,
        Scenario::Reorder,
    ];

    fn title(self) -> &'static str {
        match self {
            Scenario::Nested => "a. nested subvolumes",
            Scenario::Crash => "b. SIGKILL in restore/conversion",
            Scenario::Attrs => "c. convert a rich tree",
            Scenario::Resume => "d. conversion killed at 90%",
            Scenario::Bind => "e. restore under a bind mount",
            Scenario::Nocow => "f. NOCOW, plain-dir root",
            Scenario::Boot => "g. boot conversion of a box",
            Scenario::Reorder => "h. call sites killed, both orders",
        }
    }

    fn run(self, launcher: &Launcher, scale: &Scale) -> compare::Result<Vec<Row>> {
        Ok(match self {
            Scenario::Nested => compare::nested::run(scale)?.rows(),
            Scenario::Crash => compare::crash::run(launcher, scale)?.rows(),
            Scenario::Attrs => compare::attrs::run(scale)?.rows(),
            Scenario::Resume => compare::resume::run(launcher, scale)?.rows(),
            Scenario::Bind => compare::bind::run(scale)?.rows(),
            Scenario::Nocow => compare::nocow::run(scale)?.rows(),
            Scenario::Boot => compare::boot::run(scale)?.rows(),
            Scenario::Reorder => compare::reorder::run(scale)?.rows(),
        })
    }
}

/// Upstream's volume code against ours, scenario by scenario.
#[derive(Parser)]
struct Args {
    /// Only these scenarios (repeatable); all by default.
    #[arg(long, value_enum)]
    only: Vec<Scenario>,
    /// The small trees of the test suite (seconds) instead of the full ones.
    #[arg(long)]
    quick: bool,
}

fn main() -> ExitCode {
    if compare::child_main() {
        return ExitCode::SUCCESS;
    }
    let args = Args::parse();
    if let Err(reason) = integration::check_support(integration::FsKind::Btrfs) {
        eprintln!("compare: cannot run here: {reason}");
        return ExitCode::FAILURE;
    }
    let launcher = match Launcher::current_exe(&[]) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("compare: {e}");
            return ExitCode::FAILURE;
        }
    };
    let scale = if args.quick {
        Scale::quick()
    } else {
        Scale::full()
    };
    let chosen: Vec<Scenario> = Scenario::ALL
        .into_iter()
        .filter(|s| args.only.is_empty() || args.only.contains(s))
        .collect();
    let mut groups = Vec::new();
    let mut failed = false;
    for s in chosen {
        eprint!("{} ... ", s.title());
        let started = Instant::now();
        match s.run(&launcher, &scale) {
            Ok(rows) => {
                eprintln!("done in {}", table::fmt_duration(started.elapsed()));
                groups.push(rows);
            }
            Err(e) => {
                eprintln!("failed: {e}");
                failed = true;
                groups.push(vec![Row::new(s.title(), format!("could not run: {e}"), "")]);
            }
        }
    }
    println!();
    print!("{}", table::render(&groups));
    println!(
        "upstream: integration::upstream, after start-core's volume.rs at {}\n          \
         and util/btrfs.rs, util/clone.rs at {}",
        &integration::upstream::VOLUME_RS_COMMIT[..8],
        &integration::upstream::UTIL_COMMIT[..8]
    );
    println!("ours:     startos_core::volume, on volume::VolumeStore and volume_migrate");
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
