//! Crash safety of install finalization and uninstall: the whole process is
//! SIGKILLed at each named step (core's failpoints and volume's, through
//! `STARTOS_VOLUME_FAILPOINT`), then boot reconcile runs and the package must
//! be back at the old version with byte-identical data (or, past the commit,
//! at the new one), with no backup, transient name or state left in flight.
//!
//! The operation runs in a child process: this test binary re-executed to run
//! only [`crash_child`]. It needs `--features startos-core/failpoints` (as
//! `make test` runs it); without it the child finishes and the test fails
//! saying so. The service processes the child started notice their parent's
//! death and exit; the parent makes sure of it, as a reboot would.

mod common;
mod core_common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::{assert_no_transient_names, assert_same, digest, package_subvolumes, pkg};
use core_common::*;
use integration::TreeDigest;
use integration::services::ProcessServices;
use startos_core::{Cancel, FileDb, Finalizer, Phase};

const OP_ENV: &str = "CORE_CRASH_OP";
const FS_ENV: &str = "CORE_CRASH_FS";
const PKG_ENV: &str = "CORE_CRASH_PKG";

/// Not a test on its own: the body of the child process.
#[test]
fn crash_child() {
    let Ok(op) = std::env::var(OP_ENV) else {
        return;
    };
    let fs = std::path::PathBuf::from(std::env::var_os(FS_ENV).expect("CORE_CRASH_FS"));
    let p = pkg(&std::env::var(PKG_ENV).expect("CORE_CRASH_PKG"));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let root = fs.join("volumes");
        let db = FileDb::open(fs.join("state.json")).expect("db");
        let program = ProcessServices::locate_program().expect("service binary");
        let svc = ProcessServices::new(&root, fs.join("run"), program).expect("services");
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let fin = Finalizer::new(db, Arc::new(svc), Arc::new(tx), &root);
        let r = match op.as_str() {
            "update" => fin
                .install(&req(p.as_str(), "2.0"), &Cancel::new())
                .await
                .map(|f| format!("{:?}", f.timings)),
            "update-failing" => {
                fin.services().fail_at(&p, Phase::Init);
                fin.install(&req(p.as_str(), "2.0"), &Cancel::new())
                    .await
                    .map(|_| "installed?!".to_owned())
            }
            "uninstall-soft" => fin.uninstall(&p, true).await.map(|()| "done".into()),
            "uninstall-hard" => fin.uninstall(&p, false).await.map(|()| "done".into()),
            "reconcile" => startos_core::reconcile(&**fin.db(), &root)
                .await
                .map(|r| format!("{r:?}")),
            other => panic!("unknown op {other}"),
        };
        println!("crash child: {op} of {p} ran to the end: {r:?}");
    });
}

fn crash_at(env: &Env, package: &str, op: &str, failpoint: &str) {
    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(exe)
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(OP_ENV, op)
        .env(FS_ENV, env.fs.mount_point())
        .env(PKG_ENV, package)
        .env(startos_core::FAILPOINT_ENV, failpoint)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("spawning the crash child");
    // What a reboot does to the services the dead process started.
    reap_orphan(&env.run.join(format!("{package}.pid")));
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "`{op}` of {package} was not killed at `{failpoint}` ({}): run the tests with \
         `--features startos-core/failpoints` (as `make test` does), or the failpoint \
         is not on the path.\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
}

async fn check_old(env: &Env, fin: &Fin, name: &str, before: &TreeDigest, when: &str) {
    let p = pkg(name);
    assert_installed(entry(fin, name).await, "1.0", when);
    assert_same(before, &digest(&env.volume(&p)), when);
    assert!(!env.backup(&p).exists(), "{when}: backup left");
    assert_no_transient_names(&env.root, when);
}

fn name_for(op: &str, fp: &str) -> String {
    format!("{op}-{}", fp.replace(['.', '_'], "-"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_killed_at_each_step_comes_back_identical() {
    let Some(env) = env() else { return };
    for fp in [
        "finalize.recorded",
        "finalize.stopped",
        // Upstream loss path: a crash during the snapshot (here inside the
        // volume store, before and after the snapshot is frozen).
        "snapshot.created",
        "snapshot.frozen",
        "finalize.snapshotted",
        "finalize.uninit",
        "finalize.install",
        "finalize.init",
        "finalize.start",
    ] {
        let name = name_for("update", fp);
        let before = installed_and_stopped(&env, &name).await;
        crash_at(&env, &name, "update", fp);
        let fin = boot(&env).await;
        check_old(
            &env,
            &fin,
            &name,
            &before,
            &format!("update killed at {fp}"),
        )
        .await;
    }
    // Killed after the commit: the new version stays, the backup goes.
    let name = name_for("update", "finalize.committed");
    installed_and_stopped(&env, &name).await;
    crash_at(&env, &name, "update", "finalize.committed");
    let fin = boot(&env).await;
    assert_installed(entry(&fin, &name).await, "2.0", "killed after the commit");
    assert!(!env.backup(&pkg(&name)).exists());
    assert!(
        env.volume(&pkg(&name))
            .join("data/main/init-2.0-from-1.0")
            .exists()
    );
    assert_no_transient_names(&env.root, "killed after the commit");
}

/// Upstream loss paths: an interrupted restore orphaned the backup; a crash
/// during the snapshot left a partial backup a later failed retry swapped in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_killed_at_each_step_comes_back_identical() {
    let Some(env) = env() else { return };
    for fp in [
        "rollback.stopped",
        "restore.copied",
        "restore.recorded",
        "restore.exchanged",
        "restore.replaced-moved",
        "drop.renamed",
        "restore.backup-dropped",
        "rollback.restored",
        "rollback.recorded",
    ] {
        let name = name_for("rollback", fp);
        let before = installed_and_stopped(&env, &name).await;
        crash_at(&env, &name, "update-failing", fp);
        let fin = boot(&env).await;
        check_old(
            &env,
            &fin,
            &name,
            &before,
            &format!("rollback killed at {fp}"),
        )
        .await;
    }
}

/// The replaced volume is purged after the old version is back and the
/// failure notified: a kill there finds the rollback complete, and the
/// restarted old service has gone on from the restored data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_killed_while_purging_is_complete() {
    let Some(env) = env() else { return };
    let fp = "restore.replaced-deleted";
    let name = name_for("rollback", fp);
    let when = format!("rollback killed at {fp}");
    installed_and_stopped(&env, &name).await;
    let log = env.volume(&pkg(&name)).join("data/main/seq.log");
    let before = std::fs::read(&log).expect("seq.log before");
    crash_at(&env, &name, "update-failing", fp);
    let fin = boot(&env).await;
    assert_installed(entry(&fin, &name).await, "1.0", &when);
    assert!(!env.backup(&pkg(&name)).exists(), "{when}: backup left");
    assert_no_transient_names(&env.root, &when);
    let after = std::fs::read(&log).expect("seq.log after");
    assert!(
        after.starts_with(&before),
        "{when}: the old service must continue the restored log ({} bytes before, {} after)",
        before.len(),
        after.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_snapshot_then_a_failed_retry_loses_nothing() {
    let Some(env) = env() else { return };
    let name = "snap-retry";
    let before = installed_and_stopped(&env, name).await;
    crash_at(&env, name, "update", "snapshot.created");
    let fin = boot(&env).await;
    check_old(&env, &fin, name, &before, "after the crash").await;
    // The retry fails; under upstream it would have swapped in the partial copy.
    fin.services().inner.fail_at(&pkg(name), Phase::Init);
    let e = fin
        .install(&req(name, "2.0"), &Cancel::new())
        .await
        .unwrap_err();
    assert_eq!(e.kind, volume::ErrorKind::UpdateFailed);
    let back = fin.services().before_start.lock().unwrap()[&(pkg(name), "1.0".into())].clone();
    assert_same(&before, &back, "after the failed retry");
    use startos_core::Services;
    fin.services().stop(&pkg(name)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_reconcile_itself_is_finished_by_the_next_one() {
    let Some(env) = env() else { return };
    let name = "reconcile-crash";
    let before = installed_and_stopped(&env, name).await;
    crash_at(&env, name, "update", "finalize.init");
    // Reconcile dies after restoring, before writing the state.
    crash_at(&env, name, "reconcile", "reconcile.restored");
    let fin = boot(&env).await;
    check_old(&env, &fin, name, &before, "after a crashed reconcile").await;
}

/// Upstream loss path: after a reboot, Removing was always a hard delete, even
/// for a soft uninstall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uninstall_killed_at_each_step_is_finished_as_recorded() {
    let Some(env) = env() else { return };
    for fp in [
        "uninstall.recorded",
        "uninstall.stopped",
        "uninstall.uninit",
        "uninstall.volume",
    ] {
        let name = name_for("soft", fp);
        let before = installed_and_stopped(&env, &name).await;
        let seq = std::fs::read(env.volume(&pkg(&name)).join("data/main/seq.log")).unwrap();
        crash_at(&env, &name, "uninstall-soft", fp);
        let fin = boot(&env).await;
        let when = format!("soft uninstall killed at {fp}");
        assert!(entry(&fin, &name).await.is_none(), "{when}: entry left");
        let live = env.volume(&pkg(&name));
        if fp == "uninstall.recorded" || fp == "uninstall.stopped" {
            assert_same(&before, &digest(&live), &when);
        } else {
            // uninit ran: it may write, but the service's data is all there.
            assert_eq!(
                std::fs::read(live.join("data/main/seq.log")).unwrap(),
                seq,
                "{when}"
            );
        }
        assert_no_transient_names(&env.root, &when);

        let name = name_for("hard", fp);
        installed_and_stopped(&env, &name).await;
        crash_at(&env, &name, "uninstall-hard", fp);
        let fin = boot(&env).await;
        let when = format!("hard uninstall killed at {fp}");
        assert!(entry(&fin, &name).await.is_none(), "{when}: entry left");
        assert!(!env.volume(&pkg(&name)).exists(), "{when}: volume left");
        assert_eq!(package_subvolumes(&env.fs, &name), Vec::<String>::new());
    }
    // The hard delete's own crash point inside the volume store.
    let name = "hard-delete-renamed";
    installed_and_stopped(&env, name).await;
    crash_at(&env, name, "uninstall-hard", "delete.renamed");
    let fin = boot(&env).await;
    assert!(entry(&fin, name).await.is_none());
    assert_eq!(package_subvolumes(&env.fs, name), Vec::<String>::new());
}
