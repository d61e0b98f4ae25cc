//! `startos-volume`: package volumes by hand, for operators and tests.
//!
//! Exit 0 on success. On any error, one line on stderr naming the package,
//! path and cause, exit 1, and nothing changed on disk beyond what recovery of
//! an earlier crash had to finish; with `--json`, that error is also an
//! object on stdout unless the command printed its result first. Bad usage
//! (an unknown flag, a missing argument): one line on stderr, exit 2.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "startos-volume",
    version,
    about = "StartOS package volumes on btrfs subvolumes"
)]
struct Cli {
    /// The package volumes directory.
    #[arg(long, global = true, default_value_os_t = volume::default_root())]
    root: PathBuf,
    /// Print machine-readable JSON on stdout.
    #[arg(long, global = true)]
    json: bool,
    /// How long `list`, `usage` and `recover` wait for a package another
    /// process is working on before reporting it busy, in seconds.
    #[arg(long, global = true, default_value_t = 5.0, value_name = "SECONDS")]
    lock_wait: f64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create PKG's volume (a subvolume on btrfs) with the given volume dirs
    /// (one that exists is kept, given the dirs it lacks).
    Create {
        /// Package id.
        pkg: String,
        /// Volume ids to create under data/.
        volumes: Vec<String>,
    },
    /// Take PKG's install backup (a read-only snapshot).
    Snapshot {
        /// Package id.
        pkg: String,
    },
    /// Roll PKG back to its install backup, atomically.
    Restore {
        /// Package id.
        pkg: String,
    },
    /// Drop PKG's install backup.
    Drop {
        /// Package id.
        pkg: String,
    },
    /// Delete PKG's volume and backup (uninstall).
    Delete {
        /// Package id.
        pkg: String,
    },
    /// List package volumes and backups, with the disk space each volume uses.
    List,
    /// Real space use of PKG's volume and backup (compsize's figures, no qgroups).
    Usage {
        /// Package id.
        pkg: String,
    },
    /// Finish or undo operations interrupted by a crash (all packages, or PKG).
    Recover {
        /// Package id.
        pkg: Option<String>,
    },
}

#[cfg(target_os = "linux")]
mod run {
    use serde_json::json;
    use volume::usage::Usage;
    use volume::{
        Error, PackageId, SnapshotOutcome, VolumeId, VolumeInfo, VolumeKind, VolumeStore,
        VolumeUsage, human_bytes,
    };

    use super::*;

    fn pkg(s: &str) -> Result<PackageId, Error> {
        let p = s.parse::<PackageId>()?;
        volume::layout::check_id_len(&p)?;
        Ok(p)
    }

    fn kind(k: Option<VolumeKind>) -> &'static str {
        match k {
            Some(VolumeKind::Subvolume) => "subvolume",
            Some(VolumeKind::Directory) => "directory",
            None => "-",
        }
    }

    fn print_table(title: &str, u: &Usage) {
        println!(
            "{title}: {} files, {} regular extents ({} refs), {} inline",
            u.files, u.extents, u.refs, u.inline
        );
        println!(
            "  {:<10} {:>5} {:>12} {:>12} {:>12}",
            "Type", "Perc", "Disk Usage", "Uncompressed", "Referenced"
        );
        let row = |name: &str, b: &volume::usage::Bytes| {
            let perc = (b.disk * 100).checked_div(b.uncompressed).unwrap_or(0);
            println!(
                "  {:<10} {:>4}% {:>12} {:>12} {:>12}",
                name,
                perc,
                human_bytes(b.disk),
                human_bytes(b.uncompressed),
                human_bytes(b.referenced)
            );
        };
        row("TOTAL", &u.total);
        for (name, b) in &u.by_type {
            row(name, b);
        }
    }

    fn print_usage(u: &VolumeUsage) {
        match &u.volume {
            Some(v) => print_table("volume", v),
            None => println!("volume: none"),
        }
        if let Some(b) = &u.backup {
            print_table("install backup", b);
        }
        if let Some(s) = &u.split {
            println!(
                "disk bytes: {} in the backup, not the volume (at most what dropping it frees), {} in the volume, not the backup, {} in both",
                human_bytes(s.backup_only),
                human_bytes(s.live_only),
                human_bytes(s.shared)
            );
        }
    }

    /// Whether the command printed its result; a failure after it adds no
    /// error object to stdout (see `main`).
    pub(super) static EMITTED: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    fn emit(json: bool, value: serde_json::Value, human: String) {
        EMITTED.store(true, std::sync::atomic::Ordering::Relaxed);
        if json {
            println!("{value}");
        } else {
            println!("{human}");
        }
    }

    /// A command whose arguments have all been validated.
    enum Op {
        Create(PackageId, Vec<VolumeId>),
        Snapshot(PackageId),
        Restore(PackageId),
        Drop(PackageId),
        Delete(PackageId),
        List,
        Usage(PackageId),
        Recover(Option<PackageId>),
    }

    /// Checks every argument before anything touches the disk.
    fn validate(command: Command) -> Result<Op, Error> {
        Ok(match command {
            Command::Create { pkg: p, volumes } => Op::Create(
                pkg(&p)?,
                volumes
                    .iter()
                    .map(|v| v.parse::<VolumeId>())
                    .collect::<Result<_, _>>()?,
            ),
            Command::Snapshot { pkg: p } => Op::Snapshot(pkg(&p)?),
            Command::Restore { pkg: p } => Op::Restore(pkg(&p)?),
            Command::Drop { pkg: p } => Op::Drop(pkg(&p)?),
            Command::Delete { pkg: p } => Op::Delete(pkg(&p)?),
            Command::List => Op::List,
            Command::Usage { pkg: p } => Op::Usage(pkg(&p)?),
            Command::Recover { pkg: p } => Op::Recover(p.as_deref().map(pkg).transpose()?),
        })
    }

    /// Fails with `NotFound` ("no volume for PKG") if the package has
    /// nothing under the root: the library answers such a call with
    /// `false`, as upstream, but an operator who named a package that is
    /// not there typed it wrong.
    fn existing(store: &VolumeStore, p: &PackageId) -> Result<(), Error> {
        if store.exists(p)? {
            Ok(())
        } else {
            Err(Error::new(
                color_eyre::eyre::eyre!("no volume for {p} under {}", store.root().display()),
                volume::ErrorKind::NotFound,
            ))
        }
    }

    /// The table of `list`: columns as wide as their longest cell.
    fn print_list(rows: &[(VolumeInfo, Result<Option<VolumeUsage>, volume::ErrorKind>)]) {
        let cells: Vec<[String; 6]> = rows
            .iter()
            .map(|(v, u)| {
                let (disk, backup_only) = match u {
                    Ok(u) => (
                        u.as_ref()
                            .and_then(|u| u.volume.as_ref())
                            .map_or("-".to_owned(), |u| human_bytes(u.total.disk)),
                        u.as_ref()
                            .and_then(|u| u.split)
                            .map_or("-".to_owned(), |s| human_bytes(s.backup_only)),
                    ),
                    Err(volume::ErrorKind::Timeout) => ("busy".to_owned(), "busy".to_owned()),
                    Err(_) => ("?".to_owned(), "?".to_owned()),
                };
                let other = match v.leftovers.is_empty() {
                    true => "-".to_owned(),
                    false => v.leftovers.join(","),
                };
                [
                    v.package.as_str().to_owned(),
                    kind(v.volume).to_owned(),
                    kind(v.backup).to_owned(),
                    disk,
                    backup_only,
                    other,
                ]
            })
            .collect();
        let header = [
            "PACKAGE",
            "VOLUME",
            "BACKUP",
            "USAGE",
            "BACKUP-ONLY",
            "OTHER",
        ]
        .map(String::from);
        let mut width = header.clone().map(|h| h.len());
        for row in &cells {
            for (w, c) in width.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        for row in std::iter::once(&header).chain(&cells) {
            println!(
                "{:<w0$} {:<w1$} {:<w2$} {:>w3$} {:>w4$} {}",
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                row[5],
                w0 = width[0],
                w1 = width[1],
                w2 = width[2],
                w3 = width[3],
                w4 = width[4],
            );
        }
    }

    pub fn run(cli: Cli) -> Result<(), Error> {
        let op = validate(cli.command)?;
        let json = cli.json;
        // Only `list` (and a full `recover`, through recover_all below) waits
        // on every package's lock; an operation on one package recovers just
        // that package. `recover` must not recover while opening, or it would
        // have nothing left to report.
        let wait = std::time::Duration::try_from_secs_f64(cli.lock_wait).map_err(|_| {
            Error::new(
                color_eyre::eyre::eyre!("--lock-wait {}: not a number of seconds", cli.lock_wait),
                volume::ErrorKind::InvalidRequest,
            )
        })?;
        let store = VolumeStore::open_without_recovery(&cli.root)?
            .with_lock_wait(volume::lock::LockWait::Within(wait));
        match op {
            Op::Create(p, volumes) => create(&store, json, p, &volumes),
            Op::Snapshot(p) => snapshot(&store, json, p),
            Op::Restore(p) => restore(&store, json, p),
            Op::Drop(p) => drop_backup(&store, json, p),
            Op::Delete(p) => delete(&store, json, p),
            Op::List => list(&store, json),
            Op::Usage(p) => usage(&store, json, p),
            Op::Recover(target) => recover(&store, json, target),
        }
    }

    fn create(
        store: &VolumeStore,
        json: bool,
        p: PackageId,
        volumes: &[VolumeId],
    ) -> Result<(), Error> {
        let done = store.create_outcome(&p, volumes)?;
        let k = done.kind;
        let path = store.volume_path(&p);
        let why = (k == VolumeKind::Directory).then(|| why_directory(store));
        let mut value = json!({"package": p, "volume": k, "path": path, "existed": done.existed});
        if let Some(why) = &why {
            value["why"] = json!(why);
        }
        let how = match &why {
            Some(why) => format!("{}: {why}", kind(Some(k))),
            None => kind(Some(k)).to_owned(),
        };
        let human = match done.existed {
            true => format!("already existed: {} ({how})", path.display()),
            false => format!("created {} ({how})", path.display()),
        };
        emit(json, value, human);
        Ok(())
    }

    /// Why a volume is a plain directory, not a subvolume: the root is not
    /// on btrfs (naming its filesystem), or the volume was made before it
    /// was converted.
    fn why_directory(store: &VolumeStore) -> String {
        store.why_not_btrfs().unwrap_or_else(|| {
            "the volume is a plain directory, not yet converted to a subvolume \
             (volume-migrate converts it)"
                .to_owned()
        })
    }

    fn snapshot(store: &VolumeStore, json: bool, p: PackageId) -> Result<(), Error> {
        existing(store, &p)?;
        let outcome = store.snapshot(&p)?;
        let human = match &outcome {
            SnapshotOutcome::Snapshot => {
                format!("snapshot {}", store.backup_path(&p).display())
            }
            SnapshotOutcome::ReflinkCopy { extents } => format!(
                "reflink copy {} ({extents} extents), not a snapshot: {}",
                store.backup_path(&p).display(),
                why_directory(store)
            ),
            SnapshotOutcome::Skipped { reason } => format!("no backup for {p}: {reason}"),
            SnapshotOutcome::NoVolume => format!("no volume for {p}: nothing to back up"),
        };
        let mut value = json!({"package": p, "backup": outcome, "created": outcome.created()});
        // Why it fell back from a snapshot, beside what it did instead.
        match &outcome {
            SnapshotOutcome::ReflinkCopy { .. } => value["why"] = json!(why_directory(store)),
            SnapshotOutcome::Skipped { reason } => value["why"] = json!(reason),
            SnapshotOutcome::Snapshot | SnapshotOutcome::NoVolume => {}
        }
        emit(json, value, human);
        Ok(())
    }

    fn restore(store: &VolumeStore, json: bool, p: PackageId) -> Result<(), Error> {
        existing(store, &p)?;
        let outcome = store.restore_outcome(&p)?;
        // Restored, but not all done: a failure for the command line, whose
        // next command (its recovery) finishes the rest.
        if let Some(why) = outcome.unfinished {
            return Err(Error::new(
                color_eyre::eyre::eyre!(why),
                volume::ErrorKind::DiskManagement,
            ));
        }
        let human = if outcome.restored {
            format!(
                "restored {} from its install backup{}",
                store.volume_path(&p).display(),
                kept(outcome.held.as_ref(), "the replaced volume")
            )
        } else {
            format!("no install backup for {p}: nothing restored")
        };
        emit(
            json,
            json!({"package": p, "restored": outcome.restored, "held": outcome.held}),
            human,
        );
        Ok(())
    }

    fn drop_backup(store: &VolumeStore, json: bool, p: PackageId) -> Result<(), Error> {
        existing(store, &p)?;
        let dropped = store.drop_backup(&p)?;
        let human = if dropped {
            format!("dropped the install backup of {p}")
        } else {
            format!("no install backup for {p}")
        };
        emit(json, json!({"package": p, "dropped": dropped}), human);
        Ok(())
    }

    fn delete(store: &VolumeStore, json: bool, p: PackageId) -> Result<(), Error> {
        existing(store, &p)?;
        let outcome = store.delete_outcome(&p)?;
        let human = if outcome.deleted {
            format!(
                "deleted the volume of {p}{}",
                kept(outcome.held.as_ref(), "the volume")
            )
        } else {
            format!("no volume for {p}")
        };
        emit(
            json,
            json!({"package": p, "deleted": outcome.deleted, "held": outcome.held}),
            human,
        );
        Ok(())
    }

    /// `; <what> is kept as <path> while pid <pid> holds a mount of it at
    /// <mount point>, ...`, or nothing: what a restore or a delete kept.
    fn kept(held: Option<&volume::HeldTree>, what: &str) -> String {
        let Some(h) = held else {
            return String::new();
        };
        let holders: Vec<String> = h
            .holders
            .iter()
            .map(|u| {
                format!(
                    "pid {} ({}) at {}",
                    u.pid,
                    u.command,
                    u.mount_point.display()
                )
            })
            .collect();
        format!(
            "; {what} is kept as {} while mounted: {}",
            h.path.display(),
            holders.join(", ")
        )
    }

    fn list(store: &VolumeStore, json: bool) -> Result<(), Error> {
        // The list's recovery first; a package it could not recover (busy,
        // say: the library logged why) is listed without its usage.
        let unrecovered: Vec<(PackageId, bool)> = store
            .recover_all()?
            .into_iter()
            .filter(|r| r.error.is_some())
            .map(|r| (r.package, r.busy))
            .collect();
        let list = store.list()?;
        let mut rows = Vec::with_capacity(list.len());
        for v in list {
            // One package's usage that cannot be had is said, and
            // the listing goes on.
            let failed = unrecovered.iter().find(|(p, _)| *p == v.package);
            let usage = match store.is_btrfs() && v.volume.or(v.backup).is_some() {
                _ if failed.is_some() => Err(match failed {
                    Some((_, true)) => volume::ErrorKind::Timeout,
                    _ => volume::ErrorKind::Incoherent,
                }),
                true => match store.usage(&v.package) {
                    Ok(u) => Ok(Some(u)),
                    Err(e) => {
                        eprintln!("startos-volume: {e}");
                        Err(e.kind)
                    }
                },
                false => Ok(None),
            };
            rows.push((v, usage));
        }
        if json {
            let out: Vec<_> = rows
                .iter()
                .map(|(v, u)| {
                    json!({
                        "package": v.package,
                        "volume": v.volume,
                        "backup": v.backup,
                        "leftovers": v.leftovers,
                        "usage": u.as_ref().ok(),
                        "busy": u.as_ref().err() == Some(&volume::ErrorKind::Timeout),
                    })
                })
                .collect();
            EMITTED.store(true, std::sync::atomic::Ordering::Relaxed);
            println!("{}", json!(out));
        } else {
            print_list(&rows);
        }
        Ok(())
    }

    fn usage(store: &VolumeStore, json: bool, p: PackageId) -> Result<(), Error> {
        existing(store, &p)?;
        let u = store.usage(&p)?;
        if json {
            println!("{}", json!(u));
        } else {
            print_usage(&u);
        }
        Ok(())
    }

    fn recover(store: &VolumeStore, json: bool, target: Option<PackageId>) -> Result<(), Error> {
        let done = match &target {
            Some(p) => {
                existing(store, p)?;
                vec![store.recover(p)?]
            }
            None => store.recover_all()?,
        };

        if json {
            // Each package's entry says whether it failed or was busy: no
            // error object after it (see `main`).
            EMITTED.store(true, std::sync::atomic::Ordering::Relaxed);
            println!("{}", json!(done));
        } else {
            for r in &done {
                for a in &r.actions {
                    println!("{}: {a}", r.package);
                }
            }
        }
        recover_failed(&done)
    }

    /// The error a full `recover` ends with, if a package's recovery failed
    /// or was not done because another process held its lock (busy: a
    /// `Timeout` naming those packages, nothing wrong with them; any other
    /// failure: `Incoherent`, naming the busy ones too).
    fn recover_failed(done: &[volume::Recovery]) -> Result<(), Error> {
        let names = |busy: bool| -> Vec<&str> {
            done.iter()
                .filter(|r| r.error.is_some() && r.busy == busy)
                .map(|r| r.package.as_str())
                .collect()
        };
        let (failed, busy) = (names(false), names(true));
        let busy_line = |busy: &[&str]| match busy {
            [one] => format!(
                "package {one} is busy: another process holds its lock (an operation on it \
                 is under way); not recovered, try again once it is done"
            ),
            _ => format!(
                "packages {} are busy: other processes hold their locks (operations on them \
                 are under way); not recovered, try again once they are done",
                busy.join(", ")
            ),
        };
        let (why, kind) = match (failed.is_empty(), busy.is_empty()) {
            (true, true) => return Ok(()),
            (true, false) => (busy_line(&busy), volume::ErrorKind::Timeout),
            (false, true) => (
                format!(
                    "recovery failed for {}; see the log above",
                    failed.join(", ")
                ),
                volume::ErrorKind::Incoherent,
            ),
            (false, false) => (
                format!(
                    "recovery failed for {}; see the log above; {}",
                    failed.join(", "),
                    busy_line(&busy)
                ),
                volume::ErrorKind::Incoherent,
            ),
        };
        Err(Error::new(color_eyre::eyre::eyre!(why), kind))
    }
}

fn main() -> ExitCode {
    volume::init_command_line_log();
    let cli = match volume::cli::parse_args::<Cli>("startos-volume") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    #[cfg(target_os = "linux")]
    {
        let json = cli.json;
        match run::run(cli) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // With --json, a failure is an object on stdout too, so a
                // caller reading it never gets nothing; the line on stderr
                // stays the one line a person reads.
                if json && !run::EMITTED.load(std::sync::atomic::Ordering::Relaxed) {
                    println!("{}", volume::cli::error_json(&e));
                }
                eprintln!("startos-volume: {e}");
                ExitCode::FAILURE
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cli;
        eprintln!("startos-volume: package volumes are only supported on Linux");
        ExitCode::FAILURE
    }
}
