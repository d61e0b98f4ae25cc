//! A conversion's memory does not grow with a directory's size (issue 31):
//! the walk reads a directory a bounded batch at a time, and the scan keeps
//! nothing per file but for hardlinked ones and a bounded number of
//! fragmented ones. Held to by the peak resident set of a `volume-migrate
//! --dry-run` over one directory of many plain files: it walks and counts
//! every one (twice: for its byte total, and for its estimate).

mod common;

use std::fs;
use std::process::Command;

use common::{MIB, volume_migrate_bin, volumes_root};
use integration::rss::run_measured;
use integration::{LoopFs, fs_or_skip};

/// Entries of the one directory.
const ENTRIES: usize = 200_000;

/// The bound on the dry run's peak resident set. Measured on the debug
/// build: 7.3 MiB whatever the directory's size; before, the whole
/// directory's names and an entry per file made it 35.6 MiB at 200,000
/// entries (54 MiB at 300,000).
const BOUND: u64 = 20 * MIB;

#[test]
fn a_dry_run_over_a_wide_directory_stays_within_a_bound() {
    let fs = fs_or_skip!(LoopFs::btrfs(1024 * MIB));
    let root = volumes_root(&fs);
    let wide = root.join("wide");
    fs::create_dir(&wide).unwrap();
    for i in 0..ENTRIES {
        fs::File::create(wide.join(format!("file-{i:07}"))).unwrap();
    }
    let run = run_measured(
        Command::new(volume_migrate_bin())
            .arg("--root")
            .arg(&root)
            .args(["--method", "clone", "--dry-run"]),
    )
    .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}\n{}",
        stdout,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains(&format!("{ENTRIES} entries")),
        "the dry run counted every entry: {stdout}"
    );
    eprintln!("peak resident set: {} KiB", run.peak_rss / 1024);
    assert!(
        run.peak_rss <= BOUND,
        "peak resident set {:.1} MiB over {ENTRIES} entries, more than {} MiB",
        run.peak_rss as f64 / MIB as f64,
        BOUND / MIB
    );
}
