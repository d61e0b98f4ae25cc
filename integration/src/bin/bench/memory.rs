//! The `migrate` section's memory rows (issue 31): the peak resident set of
//! `volume-migrate --method clone`, of its `--dry-run`, and of upstream's
//! `cp -a --reflink=always`, over plain package directories of 100,000 and
//! 1,000,000 small files (a thousand to a directory, no hardlinks) and
//! over one directory of 300,000. A conversion's memory must not grow with
//! its files: what it keeps is the walk's bounded batches and the
//! hardlinked inodes, at most [`RSS_TARGET`] at a million files.
//!
//! Each tree is written once into a loop btrfs of its own; cp copies it to
//! `<mnt>/volumes-<tree>/<pkg>`, which the dry run counts and the clone
//! then converts. Peaks are the kernel's `ru_maxrss`, as GNU time reports
//! it ([`integration::rss`]); each is one run, with its wall time beside it
//! for scale.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use integration::LoopFs;
use integration::rss::{Measured, run_measured};
use serde::Serialize;

use crate::common::{Result, fmt_count, fmt_duration, settle};
use crate::{Verdict, sibling_binary};

/// A conversion's peak resident set may be at most this.
const RSS_TARGET: u64 = 32 << 20;

/// The trees: name, directories, files in each.
const TREES: [(&str, u64, u64); 3] = [
    ("100k", 100, 1000),
    ("1M", 1000, 1000),
    ("flat-300k", 1, 300_000),
];

/// Bytes of each file: an inline extent, as a small config file has.
const FILE_BYTES: usize = 100;

/// One tree's peaks.
#[derive(Serialize)]
pub struct Row {
    tree: &'static str,
    entries: u64,
    cp: Peak,
    dry_run: Peak,
    clone: Peak,
}

/// One command's peak resident set (bytes) and wall time.
#[derive(Serialize, Clone, Copy)]
pub struct Peak {
    rss: u64,
    seconds: f64,
}

/// The memory rows.
#[derive(Serialize)]
pub struct Report {
    rows: Vec<Row>,
}

/// Runs `cmd`, failing on a failed exit; its peak and wall time.
fn measured(what: &str, cmd: &mut Command) -> Result<Peak> {
    let start = Instant::now();
    let m: Measured = run_measured(cmd).map_err(|e| format!("{what}: {e}"))?;
    let seconds = start.elapsed().as_secs_f64();
    if !m.status.success() {
        let last = |b: &[u8]| {
            String::from_utf8_lossy(b)
                .lines()
                .last()
                .unwrap_or("")
                .to_owned()
        };
        return Err(format!(
            "{what}: {}: {} {}",
            m.status,
            last(&m.stdout),
            last(&m.stderr)
        )
        .into());
    }
    Ok(Peak {
        rss: m.peak_rss,
        seconds,
    })
}

/// Writes `dirs` directories of `files` files each under `top` (`top`
/// itself holds them when `dirs` is 1).
fn write_tree(top: &Path, dirs: u64, files: u64) -> Result<()> {
    let data = [b'x'; FILE_BYTES];
    for d in 0..dirs {
        let dir = if dirs == 1 {
            top.to_path_buf()
        } else {
            top.join(format!("d{d:04}"))
        };
        std::fs::create_dir_all(&dir)?;
        for f in 0..files {
            std::fs::write(dir.join(format!("file-{f:07}")), data)?;
        }
    }
    Ok(())
}

/// Measures every tree.
pub fn run() -> Result<Report> {
    let binary = sibling_binary("volume-migrate", "-p volume-migrate --bin volume-migrate")?;
    let fs = LoopFs::btrfs(16 << 30)?;
    let mut rows = Vec::new();
    for (tree, dirs, files) in TREES {
        eprintln!("migrate: memory over {tree} files ...");
        let seed = fs.path(format!("seed-{tree}"));
        write_tree(&seed, dirs, files)?;
        let root = fs.path(format!("volumes-{tree}"));
        std::fs::create_dir(&root)?;
        settle(fs.mount_point())?;
        let cp = measured(
            "cp -a --reflink=always",
            Command::new("cp")
                .args(["-a", "--reflink=always"])
                .arg(&seed)
                .arg(root.join("pkg")),
        )?;
        settle(fs.mount_point())?;
        let ours = |extra: &[&str]| {
            measured(
                "volume-migrate",
                Command::new(&binary)
                    .arg("--root")
                    .arg(&root)
                    .args(["--method", "clone", "--json"])
                    .args(extra),
            )
        };
        let dry_run = ours(&["--dry-run"])?;
        let clone = ours(&[])?;
        rows.push(Row {
            tree,
            entries: dirs * files + if dirs > 1 { dirs } else { 0 },
            cp,
            dry_run,
            clone,
        });
    }
    fs.close()?;
    Ok(Report { rows })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// The rows, one a tree.
pub fn print(report: &Report) {
    println!(
        "{:<22} {:>10} {:>20} {:>20} {:>20}",
        "peak memory", "entries", "cp -a --reflink", "ours --dry-run", "ours --method clone"
    );
    let cell = |p: Peak| {
        format!(
            "{} ({})",
            mib(p.rss),
            fmt_duration(Duration::from_secs_f64(p.seconds))
        )
    };
    for r in &report.rows {
        println!(
            "{:<22} {:>10} {:>20} {:>20} {:>20}",
            r.tree,
            fmt_count(r.entries),
            cell(r.cp),
            cell(r.dry_run),
            cell(r.clone)
        );
    }
    println!(
        "peak resident set (ru_maxrss, by GNU time) and wall time of one run each; files of {FILE_BYTES} \
         bytes, a thousand to a directory\n\x20 (flat-300k: all in one), no hardlinks; the dry run \
         and the clone are the volume-migrate process"
    );
}

/// Whether every conversion stayed within [`RSS_TARGET`].
pub fn verdict(report: &Report) -> Verdict {
    let worst = report
        .rows
        .iter()
        .map(|r| r.dry_run.rss.max(r.clone.rss))
        .max()
        .unwrap_or(u64::MAX);
    Verdict::new(
        format!(
            "migrate: peak memory of a conversion <= {} whatever its files (clone and dry run)",
            mib(RSS_TARGET)
        ),
        !report.rows.is_empty() && worst <= RSS_TARGET,
        report
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{}: clone {}, dry run {} (cp {})",
                    r.tree,
                    mib(r.clone.rss),
                    mib(r.dry_run.rss),
                    mib(r.cp.rss)
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    )
}
