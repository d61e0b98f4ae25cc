//! Converting many packages at once within the descriptors the process
//! may open: a 150-package box (5 heavy, 145 light, each light one ten
//! directories deep, so that every walk holds its whole descriptor budget)
//! converted as start-core's boot converts it (`Migrator::convert_each`,
//! the schedule's weighing before it), in a child process under a low soft
//! RLIMIT_NOFILE, its descriptors and threads sampled throughout. With 24
//! conversions at once whatever the limit, packages failed with "Too many
//! open files" at a soft limit of 200 or less (a hostile review's probe);
//! `volume_migrate::DESCRIPTORS_EACH` now caps how many run at once.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::boot_opts;
use common::cli::{limit_nofile, text};
use integration::{LoopFs, fs_or_skip};
use volume_migrate::{Migrator, Progress};

const CHILD_ROOT_ENV: &str = "POOL_DESCRIPTORS_ROOT";

fn count(dir: &str) -> usize {
    fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// Child mode: the boot's schedule and `convert_each`, with the process's
/// descriptors and threads sampled every 200 us; prints the peaks and
/// every failed package.
#[test]
fn descriptors_child() {
    let Some(root) = std::env::var_os(CHILD_ROOT_ENV) else {
        return;
    };
    let stop = AtomicBool::new(false);
    let (fds, tasks) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                fds.fetch_max(count("/proc/self/fd"), Ordering::Relaxed);
                tasks.fetch_max(count("/proc/self/task"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let base = count("/proc/self/fd");
        let m = Migrator::open(Path::new(&root)).unwrap();
        let opts = boot_opts();
        let planned: Vec<_> = m
            .schedule(&m.packages().unwrap(), &opts)
            .unwrap()
            .into_iter()
            .filter(|p| p.decision.is_some())
            .collect();
        let outs = m.convert_each(&planned, &opts, &mut |_: &Progress| {}, &|_, _| {});
        stop.store(true, Ordering::Relaxed);
        let failed: Vec<String> = planned
            .iter()
            .zip(outs)
            .filter_map(|(p, r)| r.err().map(|e| format!("{}: {e}", p.package)))
            .collect();
        println!(
            "PEAKS base {base} fds {} tasks {} planned {} commit starts asked again {} forced {}",
            fds.load(Ordering::Relaxed),
            tasks.load(Ordering::Relaxed),
            planned.len(),
            volume::sys::nudged_commit_starts(),
            volume::sys::forced_commit_starts()
        );
        println!("CHILD-FAILED {failed:?}");
    });
}

fn build(root: &Path) {
    let make = |name: String, files: usize, per_dir: usize| {
        for f in 0..files {
            let d = root
                .join(&name)
                .join("data")
                .join(format!("{:03}", f / per_dir));
            if f % per_dir == 0 {
                fs::create_dir_all(&d).unwrap();
            }
            fs::write(d.join(format!("{f:05}")), format!("{name} {f}")).unwrap();
        }
    };
    for i in 0..5 {
        make(format!("heavy{i}"), 3000, 1000);
    }
    // A light package's 40 files down a chain of 10 directories, so
    // that each walk holds as many descriptors as its budget allows.
    for i in 5..150 {
        let mut d = root.join(format!("small{i:03}")).join("data");
        for level in 0..10 {
            d = d.join(format!("d{level}"));
            fs::create_dir_all(&d).unwrap();
            for f in 0..4 {
                fs::write(d.join(format!("f{f}")), format!("{i} {level} {f}")).unwrap();
            }
        }
    }
}

fn run_child(root: &Path, nofile: u64) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "descriptors_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ROOT_ENV, root)
    .env_remove("RUST_LOG")
    .env_remove(volume::FAILPOINT_ENV);
    limit_nofile(&mut cmd, nofile);
    let out = cmd.output().unwrap();
    text(&out.stdout) + &text(&out.stderr)
}

/// The boot's conversion of 150 packages under a soft RLIMIT_NOFILE of
/// 160, where 24 at once would need more: every package converted (fewer
/// at once), the peaks printed.
#[test]
fn a_150_package_boot_fits_a_low_descriptor_limit() {
    let nofile = 160;
    let fs = fs_or_skip!(LoopFs::btrfs(2 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root);
    let out = run_child(&root, nofile);
    let peaks = out.lines().find(|l| l.contains("PEAKS")).unwrap_or("");
    eprintln!("nofile {nofile}: {peaks}");
    assert!(
        out.contains("CHILD-FAILED []"),
        "nofile {nofile}: {peaks}\n{}",
        out.lines()
            .filter(|l| l.contains("CHILD-FAILED") || l.contains("rror"))
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
}
