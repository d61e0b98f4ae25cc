//! The I/O-error sweep of start-core's two flows over the volume crates (see
//! `faults.rs` for the sweep and its invariant): the boot maintenance
//! (recovery, then the conversion of every installed package's plain
//! directory) and an update's finalization (stop, snapshot, install, then
//! drop, or restore on failure). Each runs in a child process, this test
//! binary run again, with its k-th system call through `volume::sys`
//! failing; then the next boot runs without a fault, and:
//!
//! - boot maintenance: every package is its plain directory as before or
//!   converted with the same contents, what was written into it after the
//!   failure is still there after the next boot, which converts what is
//!   left, and no name but the volumes is left;
//! - finalization: the package is installed at the old version, its data as
//!   at the stop (the old service's writes go on from there) and nothing of
//!   the new version's migration in it, or at the new version with that
//!   migration; no backup and no transient name is left.

mod common;
mod core_common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::sweep::*;
use common::*;
use core_common::*;
use integration::services::ProcessServices;
use startos_core::Cancel;
use volume::sys::fault;

const FS_ENV: &str = "FAULTS_CHILD_FS";
const PKG_ENV: &str = "FAULTS_CHILD_PKG";

/// Not a test on its own: the body of a child run. Exits 1 with a line on
/// stderr for each failure the operation reported.
#[test]
fn fault_child() {
    let Ok(op) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let failures: Vec<String> = rt.block_on(async move {
        match op.as_str() {
            "boot" => boot_child().await,
            "update" => update_child().await,
            other => panic!("unknown child op {other}"),
        }
    });
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

/// An update of the package to 2.0 through start-core's finalization.
async fn update_child() -> Vec<String> {
    use std::sync::Arc;
    let fs = PathBuf::from(std::env::var_os(FS_ENV).expect("fs"));
    let p = std::env::var(PKG_ENV).expect("pkg");
    let root = fs.join("volumes");
    let db = startos_core::FileDb::open(fs.join("state.json")).expect("db");
    let program = ProcessServices::locate_program().expect("service binary");
    let svc = ProcessServices::new(&root, fs.join("run"), program).expect("services");
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let fin = startos_core::Finalizer::new(db, Arc::new(svc), Arc::new(tx), &root);
    match fin.install(&req(&p, "2.0"), &Cancel::new()).await {
        Ok(f) => match f.backup_drop.await {
            Ok(Ok(_)) => Vec::new(),
            Ok(Err(e)) => vec![format!("package {p}: dropping the backup: {e}")],
            Err(e) => vec![format!("package {p}: the drop task: {e}")],
        },
        Err(e) => vec![format!("package {p}: {e}")],
    }
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

/// The child running an update of `p` with `spec` failing (or traced).
fn update(env: &Env, p: &str, spec: &str, log: &Path) -> std::process::Output {
    let out = Command::new(std::env::current_exe().expect("current_exe"))
        .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "update")
        .env(FS_ENV, env.fs.mount_point())
        .env(PKG_ENV, p)
        .env(fault::FAULT_ENV, spec)
        .env(fault::FAULT_LOG_ENV, log)
        .env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV)
        .stdin(Stdio::null())
        .output()
        .expect("running the update");
    // What a reboot does to the services the child started.
    reap_orphan(&env.run.join(format!("{p}.pid")));
    out
}

/// The last sequence number the service wrote into `p`'s volume.
fn last_seq(env: &Env, p: &str) -> Option<u64> {
    integration::services::last_sequence(
        &env.volume(p)
            .join("data/main")
            .join(integration::services::SEQ_FILE),
    )
    .expect("reading the sequence log")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalization() {
    let Some(env) = env() else { return };
    let log = env.fs.path("fault.log");
    installed_and_stopped(&env, "cal").await;
    let _ = fs::remove_file(&log);
    let out = update(&env, "cal", "trace", &log);
    assert!(
        out.status.success(),
        "the update fails without a fault: {out:?}"
    );
    let calls = fs::read_to_string(&log).map_or(0, |t| t.lines().count() as u64);
    assert!(calls > 0, "the update made no call through volume::sys");
    let (mut runs, mut absorbed, mut old, mut new) = (0u64, 0u64, 0u64, 0u64);
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
    if let Some(only) = only_specs() {
        specs = only;
    }
    for (i, spec) in specs.iter().enumerate() {
        let p = format!("u{i}");
        installed_and_stopped(&env, &p).await;
        let at_stop = last_seq(&env, &p);
        let _ = fs::remove_file(&log);
        let out = update(&env, &p, spec, &log);
        let Ok(fired) = fs::read_to_string(&log) else {
            continue;
        };
        runs += 1;
        let when = format!(
            "update of {p} with call {spec} failing ({}); it said {:?}",
            fired.trim(),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() {
            absorbed += 1;
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.lines().all(|l| l.contains(&format!("package {p}"))),
                "{when}: each line on stderr names the package: {err}"
            );
        }
        let fin = boot(&env).await;
        let e = entry(&fin, &p)
            .await
            .unwrap_or_else(|| panic!("{when}: no state entry"));
        assert_eq!(e.state_info, startos_core::StateInfo::Installed, "{when}");
        let migrated = env.volume(&p).join("data/main/init-2.0-from-1.0").exists();
        match e.version.as_deref() {
            Some("1.0") => {
                old += 1;
                assert!(
                    !migrated,
                    "{when}: back at 1.0 with 2.0's migration in its data"
                );
                assert!(
                    last_seq(&env, &p) >= at_stop,
                    "{when}: back at 1.0 with data older than at the stop"
                );
            }
            Some("2.0") => {
                new += 1;
                assert!(migrated, "{when}: at 2.0 without its migration");
            }
            v => panic!("{when}: installed at {v:?}"),
        }
        assert!(!env.backup(&p).exists(), "{when}: backup left");
        let left: Vec<String> = package_names(&env.root, &p)
            .into_iter()
            .filter(|n| *n != p)
            .collect();
        assert!(left.is_empty(), "{when}: left {left:?}");
        // Gone before the next run, so that a sweep of every k fits the
        // filesystem: each package's service writes megabytes.
        fin.uninstall(&pkg(&p), false)
            .await
            .unwrap_or_else(|e| panic!("{when}: uninstalling it afterwards: {e}"));
    }
    println!(
        "fault sweep: finalization (update): {calls} calls; {runs} injected failures ({absorbed} \
         absorbed by design; then {old} at the old version, {new} at the new), all passing"
    );
}
