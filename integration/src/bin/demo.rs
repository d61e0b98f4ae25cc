//! `make demo`: an update of a Monero node's volume, upstream's way and ours,
//! on a scratch loop-mounted btrfs, in well under a minute.
//!
//! Builds a package volume `monerod` (a subvolume) whose volume `main` holds
//! one LMDB-like file fragmented into ~200k extents, then walks through an
//! update: the backup before the install, a failed install rolled back (and
//! checked byte for byte with sha256), and a successful install whose backup
//! is dropped. Each step is timed against upstream's commands on the same
//! volume, both from a settled filesystem with the file out of the page
//! cache; one more restore is timed with the file cached. Needs root; exits 1
//! with one line on stderr on any error.

mod common;

use std::fs::File;
use std::process::ExitCode;
use std::time::Duration;

use integration::{make_fragmented_file, sha256_file};

use crate::common::{
    Result, Scratch, fmt_bytes, fmt_count, fmt_duration, fmt_ratio, scribble, timed,
};

const FILE_BYTES: u64 = 1 << 30;
const IMAGE_BYTES: u64 = 4 << 30;
const TARGET_EXTENTS: u64 = 200_000;
/// 4 KiB blocks of garbage a failed migration leaves in the file (16 MiB).
const GARBAGE_BLOCKS: u64 = 4096;

/// Times `op` from a settled filesystem with the database file out of the
/// page cache: the same starting point for upstream and ours.
fn time(vol: &Scratch, op: impl FnOnce() -> Result<()>) -> Result<Duration> {
    vol.settle()?;
    vol.evict_page_cache()?;
    timed(op).map(|((), took)| took)
}

/// Times `op` from a settled filesystem with the whole database file in the
/// page cache, as the service that just ran would leave it.
fn time_cached(vol: &Scratch, op: impl FnOnce() -> Result<()>) -> Result<Duration> {
    vol.settle()?;
    std::io::copy(&mut File::open(&vol.file)?, &mut std::io::sink())?;
    timed(op).map(|((), took)| took)
}

fn row(step: &str, upstream: Duration, ours: Duration, note: &str) {
    let ratio = upstream.as_secs_f64() / ours.as_secs_f64();
    let line = format!(
        "{step:<32} {:>9} {:>8} {:>9}  {note}",
        fmt_duration(upstream),
        fmt_duration(ours),
        fmt_ratio(ratio)
    );
    println!("{}", line.trim_end());
}

/// Checks that the database file is byte-identical to `original`.
fn check_restored(vol: &Scratch, original: &str) -> Result<()> {
    if sha256_file(&vol.file)? == original {
        Ok(())
    } else {
        Err("after the restore, the file differs from before the update".into())
    }
}

fn run() -> Result<()> {
    let vol = Scratch::new(IMAGE_BYTES)?;
    let (extents, took) = timed(|| -> Result<u64> {
        Ok(make_fragmented_file(
            &vol.file,
            FILE_BYTES,
            TARGET_EXTENTS,
            1,
        )?)
    })?;
    println!(
        "building a fragmented LMDB-like file: {} extents ({}) in {}",
        fmt_count(extents),
        fmt_bytes(FILE_BYTES),
        fmt_duration(took)
    );
    let original = sha256_file(&vol.file)?;
    println!();
    println!(
        "{:<32} {:>9} {:>8} {:>9}",
        "step", "upstream", "ours", "speed-up"
    );

    // Before the install: upstream clones every extent, we snapshot.
    let up_snapshot = time(&vol, || vol.upstream_snapshot())?;
    let up_drop = time(&vol, || vol.upstream_drop())?;
    let snapshot = time(&vol, || vol.snapshot())?;
    row("update: snapshot before install", up_snapshot, snapshot, "");

    // The install fails half-way through migrating the database.
    scribble(&vol.file, GARBAGE_BLOCKS, 2)?;
    if sha256_file(&vol.file)? == original {
        return Err("the garbage did not change the file".into());
    }
    let restore = time(&vol, || vol.restore())?;
    check_restored(&vol, &original)?;
    vol.upstream_backup_for_restore()?;
    scribble(&vol.file, GARBAGE_BLOCKS, 3)?;
    let up_restore = time(&vol, || vol.upstream_restore())?;
    row(
        "failed install: restore",
        up_restore,
        restore,
        "restored, sha256 matches",
    );

    // The same failure with the database in the page cache: deleting the
    // replaced volume evicts its cached pages before the restore returns.
    vol.snapshot()?;
    scribble(&vol.file, GARBAGE_BLOCKS, 4)?;
    let restore_cached = time_cached(&vol, || vol.restore())?;
    check_restored(&vol, &original)?;

    // The next install succeeds: the backup goes.
    vol.snapshot()?;
    let drop = time(&vol, || vol.drop_backup())?;
    row("successful install: drop backup", up_drop, drop, "");

    println!();
    println!(
        "times from a settled filesystem, file not in the page cache; with its {} cached,",
        fmt_bytes(FILE_BYTES)
    );
    println!(
        "our restore took {} (deleting the replaced volume evicts its pages)",
        fmt_duration(restore_cached)
    );
    println!("upstream: cp -a --reflink=always; rm -rf <pkg> + mv (no volume in between); rm -rf");
    println!("ours:     read-only subvolume snapshot; atomic RENAME_EXCHANGE; subvolume delete");
    vol.close()
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}
