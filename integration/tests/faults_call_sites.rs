//! The I/O-error sweep of start-core's two flows over the volume crates (see
//! `faults.rs` for the sweep and its invariant): the boot maintenance
//! (recovery, then the conversion of every installed package's plain
//! directory), through the drop-in's `boot_volume_maintenance_at`, and an
//! update through start-core's own call sites with the reorder's edits
//! (the fixture's `call-sites` runner: begin, the download, the stop, the
//! snapshot, the install, then the backup's removal, or the undo's restore
//! on failure). Each runs in a process of its own with its k-th system
//! call through `volume::sys` failing; then the next boot runs without a
//! fault, and:
//!
//! - boot maintenance: every package is its plain directory as before or
//!   converted with the same contents, what was written into it after the
//!   failure is still there after the next boot, which converts what is
//!   left, and no name but the volumes is left;
//! - the update: the package is installed at the old version, its data
//!   byte for byte as at the stop (its log going on from there) and nothing
//!   of the new version's init in it, or at the new version over the old
//!   data; no transient name is left, nor a backup once the next update is
//!   over; each failure the update reported is told to the user, in a
//!   notification for the package.

mod call_sites_common;
mod common;

use std::fs;
use std::path::{Path, PathBuf};

use call_sites_common::*;
use common::sweep::*;
use common::*;
use integration::call_sites::{Box_, Ended, Run};
use integration::{LoopFs, fs_or_skip};
use volume::sys::fault;

/// Not a test on its own: the body of a child run of the boot maintenance.
/// Exits 1 with a line on stderr for each failure it reported.
#[test]
fn fault_child() {
    let Ok(op) = std::env::var(CHILD_ENV) else {
        return;
    };
    assert_eq!(op, "boot", "unknown child op {op}");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let failures: Vec<String> = rt.block_on(boot_child());
    for f in &failures {
        eprintln!("{f}");
    }
    std::process::exit(i32::from(!failures.is_empty()));
}

/// start-core's boot maintenance of the packages `app` and `aux`, and its
/// background cleanup.
async fn boot_child() -> Vec<String> {
    let root = PathBuf::from(std::env::var_os(CHILD_ROOT_ENV).expect("root"));
    let ids = ["app".to_owned(), "aux".to_owned()];
    let mut progress = integration::compare::Progress::new();
    let boot =
        startos_core::volume::boot_volume_maintenance_at(&root, &ids, &ids, &mut progress).await;
    let mut boot = match boot {
        Ok(b) => b,
        Err(e) => return vec![format!("boot maintenance of {}: {e}", root.display())],
    };
    let mut failures: Vec<String> = boot
        .failed
        .iter()
        .map(|(p, e)| format!("boot maintenance of package {p}: {e}"))
        .collect();
    if let Some(cleanup) = boot.cleanup.take() {
        match cleanup.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => failures.push(format!("cleanup in {}: {e}", root.display())),
            Err(e) => failures.push(format!("cleanup task in {}: {e}", root.display())),
        }
    }
    failures
}

/// Two plain-directory packages of a box that has not booted since its
/// conversion to btrfs.
fn plain_packages(root: &Path) {
    for (p, seed) in [("app", 1), ("aux", 2)] {
        fs::create_dir_all(root.join(p).join("data/main")).expect("mkdir");
        populate_volume(&root.join(p), false);
        fs::write(root.join(p).join("data/main/own"), bytes(seed, 5000)).expect("write");
    }
}

#[test]
fn boot_maintenance() {
    sweep(
        &Case {
            name: "boot maintenance",
            tool: Tool::Boot,
            packages: &["app", "aux"],
            args: &[],
            setup: plain_packages,
            after: |b| b.clone(),
            ignore_mtimes: false,
        },
        6,
    );
}

/// The update of `p` to 2, its service stopped (no boot before it: the
/// calls counted are the update's), with `spec` failing (or traced).
fn update(b: &Box_, p: &str, spec: &str, log: &Path) -> Run {
    let env = [
        (fault::FAULT_ENV, std::ffi::OsStr::new(spec)),
        (fault::FAULT_LOG_ENV, log.as_os_str()),
    ];
    match b.run_env(&ordered(&[install(p, "2")]), &env) {
        Ok(Ended::Completed(run)) => run,
        Ok(Ended::Killed(run)) => panic!("{p} with {spec}: killed\n{}", run.stderr),
        Err(e) => panic!("{p} with {spec}: {e}"),
    }
}

/// The specs of the sweep: each errno, once and from there on, every
/// quarter of the update's `calls` (every k with `FAULTS_FULL`).
fn specs(calls: u64) -> Vec<String> {
    if let Some(only) = only_specs() {
        return only;
    }
    let mut specs = Vec::new();
    for (e, errno) in ERRNOS.iter().enumerate() {
        for sticky in [false, true] {
            let step = if full() { 1 } else { (calls / 4).max(1) };
            let shift = (e as u64 * 2 + u64::from(sticky)) % step;
            let plus = if sticky { "+" } else { "" };
            specs.extend(
                (0..)
                    .map(|i| 1 + shift + i * step)
                    .take_while(|&k| k <= calls)
                    .map(|k| format!("{k}{plus}:{errno}")),
            );
        }
    }
    specs
}

#[test]
fn finalization() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "box");
    let log = fs.path("fault.log");
    run_ok(&b, &[boot(), install("cal", "1")]);
    let _ = fs::remove_file(&log);
    let traced = update(&b, "cal", "trace", &log);
    assert!(traced.ok(), "the update fails without a fault: {traced:?}");
    let calls = fs::read_to_string(&log).map_or(0, |t| t.lines().count() as u64);
    assert!(calls > 0, "the update made no call through volume::sys");
    let (mut runs, mut absorbed, mut old, mut new) = (0u64, 0u64, 0u64, 0u64);
    let mut last = "cal".to_owned();
    for (i, spec) in specs(calls).iter().enumerate() {
        let p = format!("u{i}");
        // The previous package gone (a hard uninstall), this one installed.
        run_ok(&b, &[boot(), uninstall(&last, false), install(&p, "1")]);
        assert_eq!(b.names(&last), Vec::<String>::new(), "{last} uninstalled");
        last = p.clone();
        let before = before(&b, &p);
        let _ = fs::remove_file(&log);
        let out = update(&b, &p, spec, &log);
        let Ok(fired) = fs::read_to_string(&log) else {
            continue;
        };
        runs += 1;
        let when = format!(
            "update of {p} with call {spec} failing ({}); it said {:?}",
            fired.trim(),
            out.steps
        );
        if out.ok() {
            absorbed += 1;
        } else {
            // The user is told, on the package, that it failed (the step's
            // error is the undo's when that failed too).
            let told = out.notifications(&p);
            assert!(
                told.iter().any(|n| n.contains("service.install.failed")),
                "{when}: the failure is told for the package: {told:?}"
            );
        }
        // Every error the system call's failure surfaced as names the
        // package it happened to; but for the background purge's work on
        // the shared trash (opening the root, removing the directory),
        // which is no package's (its entries, `<pkg>.<n>`, name theirs).
        let shared_trash = |l: &str| {
            (l.contains("could not remove ") && l.contains("/.trash: "))
                || (l.contains("volume::purge") && l.contains("emptying the trash of "))
        };
        for line in out
            .stderr
            .lines()
            .filter(|l| l.contains("(os error") && !shared_trash(l))
        {
            assert!(
                line.contains(p.as_str()),
                "{when}: an error not naming {p}: {line}"
            );
        }
        let run = run(&b, &[boot()]);
        match run.installed(&p).as_deref() {
            Some("1") => {
                old += 1;
                assert_old(&b, &run, &p, "1", &before, &when);
            }
            Some("2") => {
                new += 1;
                if assert_new(&b, &run, &p, "2", &before, &when) {
                    // Kept until the next `begin`: the next update is over
                    // with no name left but the volume.
                    let run = run_ok(&b, &[boot(), install(&p, "3")]);
                    assert_settled(&b, &run, &p, "3", &format!("{when}, then updated"));
                }
            }
            v => panic!("{when}: installed at {v:?} ({:?})\n{}", run.db, run.stderr),
        }
    }
    println!(
        "fault sweep: finalization (update, reordered call sites): {calls} calls; {runs} \
         injected failures ({absorbed} absorbed by design; then {old} at the old version, \
         {new} at the new), all passing"
    );
    assert!(runs >= 10, "too few injected failures: {runs}");
}
