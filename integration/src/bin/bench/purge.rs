//! `purge`: a restore and a delete of a volume of many small files, all
//! cached (as a running service's are), at 100k and 1M files, and the drop
//! of a plain directory's reflink backup of as many (start-core's last
//! step of an install): the call a user waits on, and the purge after it
//! (deleting the tree the operation no longer uses), reported apart.
//!
//! Deleting a subvolume evicts its cached inodes in the calling thread, so
//! the purge grows with the files of the volume. Two ways are timed, on the
//! same filesystem and files:
//! - `inline`: the store's default, the command-line tools' (and, before
//!   the trash, every caller's): the call empties the trash itself before
//!   it returns, so the user waits for the purge too (the package's lock is
//!   already released by then);
//! - `deferred`: start-core's ([`volume::VolumeStore::with_deferred_purge`],
//!   then [`volume::purge`]'s background thread): the call returns once the
//!   old tree is in the trash, and the purge is timed after it.
//!
//! Each count: a fresh btrfs image, the package's volume filled once and
//! kept as a read-only seed; each way then restores a fresh writable
//! snapshot of the seed to its install backup, and deletes the restored
//! volume, each after walking the volume (every inode cached) and settling
//! the filesystem (all committed, the cleaner idle).

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration::run as run_command;
use serde::Serialize;
use volume::VolumeStore;

use crate::common::{Result, Scratch, fmt_count, fmt_duration, settle, timed, volume_err};

/// Files per directory of the volume.
const PER_DIR: u64 = 1000;
/// The call a user waits on, at every count, for the deferred way.
const CALL_TARGET: Duration = Duration::from_millis(100);

/// One timed operation.
#[derive(Serialize)]
pub struct Row {
    /// Files in the volume.
    pub files: u64,
    /// `restore`, `delete`, or `drop` (of a plain directory's reflink
    /// backup).
    pub op: &'static str,
    /// `inline` or `deferred`.
    pub way: &'static str,
    /// The call, seconds.
    pub call: f64,
    /// The purge after it, seconds (0 for inline: inside the call).
    pub purge: f64,
}

/// The `purge` section's results.
#[derive(Serialize)]
pub struct Report {
    pub rows: Vec<Row>,
}

/// `n` small files under `dir`, [`PER_DIR`] a directory.
fn fill(dir: &Path, n: u64) -> Result<()> {
    for i in 0..n {
        let sub = dir.join(format!("d{}", i / PER_DIR));
        if i % PER_DIR == 0 {
            fs::create_dir_all(&sub)?;
        }
        fs::write(sub.join(format!("f{i}")), i.to_string())?;
    }
    Ok(())
}

/// Stats every entry under `dir`: every inode cached.
fn warm(dir: &Path) -> Result<u64> {
    let mut n = 0;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let meta = fs::symlink_metadata(e.path())?;
        n += 1;
        if meta.is_dir() {
            n += warm(&e.path())?;
        }
    }
    Ok(n)
}

/// `btrfs subvolume snapshot [-r] <from> <to>`.
fn snapshot(from: &Path, to: &Path, read_only: bool) -> Result<()> {
    let mut cmd = Command::new("btrfs");
    cmd.args(["subvolume", "snapshot"]);
    if read_only {
        cmd.arg("-r");
    }
    run_command(cmd.arg(from).arg(to))?;
    Ok(())
}

/// One count: both ways, restore then delete.
fn run_count(files: u64, rows: &mut Vec<Row>) -> Result<()> {
    // About 1 KiB of metadata a file, twice (DUP), and room to spare.
    let s = Scratch::new((8 << 30).max(files * 8192))?;
    let root = s.root();
    let pkg = s.package().clone();
    let seed = s.path("seed");
    eprintln!("purge: filling a volume with {} files", fmt_count(files));
    fill(&s.live().join("data/main/files"), files)?;
    snapshot(s.live(), &seed, true)?;
    run_command(
        Command::new("btrfs")
            .args(["subvolume", "delete"])
            .arg(s.live()),
    )?;
    for way in ["inline", "deferred"] {
        let store = VolumeStore::open_without_recovery(&root).map_err(volume_err)?;
        let store = match way {
            "deferred" => store.with_deferred_purge(),
            _ => store,
        };
        snapshot(&seed, s.live(), false)?;
        store.snapshot(&pkg).map_err(volume_err)?;
        for op in ["restore", "delete"] {
            warm(s.live())?;
            settle(&s.path(""))?;
            let (_, call) = timed(|| match op {
                "restore" => store.restore(&pkg).map(drop),
                _ => store.delete(&pkg).map(drop),
            })
            .map_err(volume_err)?;
            let (_, purge) = timed(|| store.empty_trash()).map_err(volume_err)?;
            eprintln!(
                "purge: {} files, {op} {way}: call {}, purge {}",
                fmt_count(files),
                fmt_duration(call),
                fmt_duration(purge)
            );
            rows.push(Row {
                files,
                op,
                way,
                call: call.as_secs_f64(),
                purge: purge.as_secs_f64(),
            });
        }
        settle(&s.path(""))?;
        rows.push(drop_reflink_backup(&s, &store, &seed, files, way)?);
    }
    s.close()
}

/// The drop of a reflink backup (what a plain-directory volume, one not
/// yet converted, gets for an update), the call start-core's install
/// finishes with: the volume a plain directory copied from `seed`, its
/// backup taken by the store (every inode of it cached by the copy), then
/// dropped; the volume deleted after, untimed.
fn drop_reflink_backup(
    s: &Scratch,
    store: &VolumeStore,
    seed: &Path,
    files: u64,
    way: &'static str,
) -> Result<Row> {
    let pkg = s.package();
    fs::create_dir(s.live())?;
    run_command(
        Command::new("cp")
            .args(["-a", "--reflink=always"])
            .arg(seed.join("."))
            .arg(s.live()),
    )?;
    store.snapshot(pkg).map_err(volume_err)?;
    warm(
        &s.root()
            .join(format!("{pkg}{}", volume::layout::INSTALL_BACKUP_SUFFIX)),
    )?;
    settle(&s.path(""))?;
    let (_, call) = timed(|| store.drop_backup(pkg)).map_err(volume_err)?;
    let (_, purge) = timed(|| store.empty_trash()).map_err(volume_err)?;
    eprintln!(
        "purge: {} files, drop of a reflink backup {way}: call {}, purge {}",
        fmt_count(files),
        fmt_duration(call),
        fmt_duration(purge)
    );
    store.delete(pkg).map_err(volume_err)?;
    store.empty_trash().map_err(volume_err)?;
    settle(&s.path(""))?;
    Ok(Row {
        files,
        op: "drop",
        way,
        call: call.as_secs_f64(),
        purge: purge.as_secs_f64(),
    })
}

/// Runs the section at each file count of `counts`.
pub fn run(counts: &[u64]) -> Result<Report> {
    let mut rows = Vec::new();
    for &files in counts {
        run_count(files, &mut rows)?;
    }
    Ok(Report { rows })
}

/// Prints the table and the target line.
pub fn print(r: &Report) {
    println!(
        "restore and delete of a volume of small files, and drop of a reflink backup of them, \
         every inode cached (one run each):"
    );
    println!(
        "{:>10}  {:<8} {:<9} {:>12} {:>14}",
        "files", "op", "purge", "call (waited)", "purge after"
    );
    for row in &r.rows {
        let purge = match row.way {
            "inline" => "(in the call)".to_owned(),
            _ => fmt_duration(Duration::from_secs_f64(row.purge)),
        };
        println!(
            "{:>10}  {:<8} {:<9} {:>12} {:>14}",
            fmt_count(row.files),
            row.op,
            row.way,
            fmt_duration(Duration::from_secs_f64(row.call)),
            purge
        );
    }
    for deferred in r
        .rows
        .iter()
        .filter(|x| x.op == "drop" && x.way == "deferred")
    {
        let inline = r
            .rows
            .iter()
            .find(|x| x.op == "drop" && x.way == "inline" && x.files == deferred.files);
        if let Some(inline) = inline {
            println!(
                "drop of a reflink backup of {} files: the call {} deferred against {} inline \
                 (the delete waited on in the call, as every caller's drop did before): {:.3}x",
                fmt_count(deferred.files),
                fmt_duration(Duration::from_secs_f64(deferred.call)),
                fmt_duration(Duration::from_secs_f64(inline.call)),
                deferred.call / inline.call
            );
        }
    }
    let worst = r
        .rows
        .iter()
        .filter(|row| row.way == "deferred")
        .map(|row| row.call)
        .fold(0.0, f64::max);
    println!(
        "target: the call start-core waits on (deferred) under {} at every count: {} (worst {})",
        fmt_duration(CALL_TARGET),
        if Duration::from_secs_f64(worst) < CALL_TARGET {
            "met"
        } else {
            "MISSED"
        },
        fmt_duration(Duration::from_secs_f64(worst))
    );
}
