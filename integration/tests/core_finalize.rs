//! Install finalization on loop-mounted btrfs with process-based services that
//! keep writing into their volumes: order (stop before snapshot), success
//! (notify, then drop), rollback on failure or cancel at every phase, fresh
//! installs, parallelism, uninstall, and upstream's non-crash loss paths.

mod common;
mod core_common;

use std::time::{Duration, Instant};

use common::{assert_no_transient_names, assert_same, digest, pkg};
use core_common::*;
use startos_core::{Cancel, Event, Phase, Services, StateInfo};
use volume::{ErrorKind, SnapshotOutcome};

const RUN: Duration = Duration::from_millis(150);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_stops_then_snapshots_then_notifies_then_drops() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let p = pkg("app");
    // Fresh install with no volume: no snapshot at all.
    let f = fin
        .install(&req("app", "1.0"), &Cancel::new())
        .await
        .unwrap();
    assert_eq!(f.snapshot, SnapshotOutcome::NoVolume);
    assert!(!f.backup_drop.await.unwrap().unwrap());
    assert!(matches!(
        rx.recv().await.unwrap().event,
        Event::Installed { .. }
    ));
    tokio::time::sleep(RUN).await;

    let f = fin
        .install(&req("app", "2.0"), &Cancel::new())
        .await
        .unwrap();
    let notified = rx.recv().await.unwrap();
    assert_eq!(
        notified.event,
        Event::Installed {
            version: "2.0".into()
        }
    );
    assert_eq!(f.snapshot, SnapshotOutcome::Snapshot);
    // The snapshot holds exactly what the stopped service last wrote: its final
    // report is the last record of the backup's log, and nothing came after.
    let reported = fin.services().inner.last_report(&p).expect("final report");
    assert!(reported > 0);
    assert_eq!(
        fin.services().backup_seq_at_uninit.lock().unwrap()[&p],
        Some(reported),
        "the backup's last sequence number must be the stopped service's last write"
    );
    // State says installed before the notification went out; the drop comes after.
    assert_installed(entry(&fin, "app").await, "2.0", "after update");
    assert!(
        f.backup_drop.await.unwrap().unwrap(),
        "a backup was dropped"
    );
    let dropped = Instant::now();
    assert!(notified.at <= dropped);
    assert!(!env.backup(&p).exists());
    assert!(fin.services().inner.is_running(&p));
    let t = &f.timings;
    assert!(t.total >= t.stop + t.snapshot + t.service, "{t:?}");
    assert!(t.install_done_to_notify < t.total, "{t:?}");
    eprintln!(
        "update timings: {t:?}; overhead {:?}; install done -> notify {:?}",
        t.overhead(),
        t.install_done_to_notify
    );
    assert_no_transient_names(&env.root, "after update");
    fin.services().stop(&p).await.unwrap();
}

/// Fails (or cancels) an update of a running package at `phase` and checks the
/// volume the old version comes back to is byte-identical to what it left.
async fn rollback_case(
    fin: &Fin,
    rx: &mut ReceiverOf,
    env: &Env,
    name: &str,
    phase: Phase,
    cancel: bool,
) {
    let p = pkg(name);
    install_running(fin, name, "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services().after_stop.lock().unwrap().clear();
    let c = Cancel::new();
    if cancel {
        fin.services().cancel_at(&p, phase, c.clone());
    } else {
        fin.services().inner.fail_at(&p, phase);
    }
    let e = fin
        .install(&req(name, "2.0"), &c)
        .await
        .expect_err("the update must fail");
    let when = format!(
        "{name}: {} at {phase}",
        if cancel { "cancel" } else { "failure" }
    );
    let kind = if cancel {
        ErrorKind::Cancelled
    } else {
        ErrorKind::UpdateFailed
    };
    assert_eq!(e.kind, kind, "{when}: {e}");
    match rx.recv().await.unwrap().event {
        Event::Failed {
            phase: ph,
            kind: k,
            rolled_back_to,
            message,
        } => {
            assert_eq!((ph, k), (phase, kind), "{when}: {message}");
            assert!(message.contains(phase.as_str()), "{when}: {message}");
            assert_eq!(rolled_back_to.as_deref(), Some("1.0"));
        }
        other => panic!("{when}: {other:?}"),
    }
    let stopped = fin.services().take_first_stop(&p);
    let restarted =
        fin.services().before_start.lock().unwrap()[&(p.clone(), "1.0".to_owned())].clone();
    assert_same(
        &stopped,
        &restarted,
        &format!("{when}: volume given back to 1.0"),
    );
    assert_installed(entry(fin, name).await, "1.0", &when);
    assert!(!env.backup(&p).exists(), "{when}: backup left");
    assert!(
        fin.services().inner.is_running(&p),
        "{when}: 1.0 runs again"
    );
    assert_no_transient_names(&env.root, &when);
    fin.services().stop(&p).await.unwrap();
}

type ReceiverOf = tokio::sync::mpsc::UnboundedReceiver<startos_core::Notification>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_at_each_phase_restores_identical_data() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    for phase in [Phase::Uninit, Phase::Install, Phase::Init, Phase::Start] {
        let name = format!("fail-{phase}");
        rollback_case(&fin, &mut rx, &env, &name, phase, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_at_each_phase_restores_identical_data() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    for phase in [
        Phase::Snapshot,
        Phase::Uninit,
        Phase::Install,
        Phase::Init,
        Phase::Start,
    ] {
        let name = format!("cancel-{phase}");
        rollback_case(&fin, &mut rx, &env, &name, phase, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_packages_run_in_parallel_and_one_package_serially() {
    let Some(env) = env() else { return };
    let (fin, _rx) = env.finalizer();
    fin.services()
        .inner
        .delay(Phase::Install, Duration::from_millis(300));
    let c = Cancel::new();
    let (ra, rb) = (req("par-a", "1.0"), req("par-b", "1.0"));
    let (a, b) = tokio::join!(fin.install(&ra, &c), fin.install(&rb, &c));
    let (a, b) = (a.unwrap(), b.unwrap());
    a.backup_drop.await.unwrap().unwrap();
    b.backup_drop.await.unwrap().unwrap();
    let (rx2, rx3) = (req("par-a", "2.0"), req("par-a", "3.0"));
    let (x, y) = tokio::join!(fin.install(&rx2, &c), fin.install(&rx3, &c));
    x.unwrap().backup_drop.await.unwrap().unwrap();
    y.unwrap().backup_drop.await.unwrap().unwrap();
    let installs = fin.services().calls("install");
    let span = |p: &str, v: &str| {
        installs
            .iter()
            .find(|c| c.package.as_str() == p && c.version == v)
            .map(|c| (c.start, c.end))
            .unwrap()
    };
    let ((a0, a1), (b0, b1)) = (span("par-a", "1.0"), span("par-b", "1.0"));
    assert!(a0 < b1 && b0 < a1, "installs of two packages must overlap");
    let ((x0, x1), (y0, y1)) = (span("par-a", "2.0"), span("par-a", "3.0"));
    assert!(
        x1 <= y0 || y1 <= x0,
        "installs of one package must not overlap"
    );
    // Whichever ran second updated from the first one's version.
    let v = entry(&fin, "par-a").await.unwrap().version.unwrap();
    assert!(v == "2.0" || v == "3.0");
    for p in ["par-a", "par-b"] {
        fin.services().stop(&pkg(p)).await.unwrap();
    }
}

/// Upstream loss path: reinstalling over a soft-uninstalled package and
/// cancelling (before the snapshot, or later) deleted the kept data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinstall_over_a_soft_uninstall_then_cancel_keeps_the_data() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let p = pkg("kept");
    install_running(&fin, "kept", "1.0", RUN).await;
    fin.uninstall(&p, true).await.unwrap();
    assert!(entry(&fin, "kept").await.is_none());
    let kept = digest(&env.volume(&p));
    while let Ok(n) = rx.try_recv() {
        drop(n);
    }
    for phase in [Phase::Snapshot, Phase::Install, Phase::Init, Phase::Start] {
        let c = Cancel::new();
        if phase == Phase::Snapshot {
            // Cancelled before anything ran: upstream deleted the volume here.
            c.cancel();
        } else {
            fin.services().cancel_at(&p, phase, c.clone());
        }
        let e = fin.install(&req("kept", "2.0"), &c).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Cancelled, "{phase}: {e}");
        let when = format!("reinstall cancelled at {phase}");
        assert_same(&kept, &digest(&env.volume(&p)), &when);
        assert!(
            entry(&fin, "kept").await.is_none(),
            "{when}: still uninstalled"
        );
        assert!(!env.backup(&p).exists(), "{when}");
        assert!(!fin.services().inner.is_running(&p), "{when}");
        assert_no_transient_names(&env.root, &when);
    }
    // And a reinstall that succeeds keeps the old data underneath.
    let f = fin
        .install(&req("kept", "2.0"), &Cancel::new())
        .await
        .unwrap();
    assert_eq!(f.snapshot, SnapshotOutcome::Snapshot);
    f.backup_drop.await.unwrap().unwrap();
    fin.services().stop(&p).await.unwrap();
    assert!(env.volume(&p).join("data/main/seq.log").exists());
    // A hard uninstall deletes everything.
    fin.uninstall(&p, false).await.unwrap();
    assert!(!env.volume(&p).exists() && !env.backup(&p).exists());
}

/// Upstream loss path: a failed update retry discarded the backup without
/// rolling back. Here every failed attempt rolls back to the same data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_update_retried_and_failing_again_keeps_the_old_data() {
    let Some(env) = env() else { return };
    let (fin, _rx) = env.finalizer();
    let p = pkg("retry");
    install_running(&fin, "retry", "1.0", RUN).await;
    fin.services().stop(&p).await.unwrap();
    for phase in [Phase::Init, Phase::Install, Phase::Uninit, Phase::Start] {
        // The old version is stopped: this is the data every attempt must
        // give back.
        let before = digest(&env.volume(&p));
        fin.services().inner.fail_at(&p, phase);
        let e = fin
            .install(&req("retry", "2.0"), &Cancel::new())
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::UpdateFailed);
        let back = fin.services().before_start.lock().unwrap()[&(p.clone(), "1.0".into())].clone();
        assert_same(&before, &back, &format!("retry failing at {phase}"));
        assert!(!env.backup(&p).exists());
        // 1.0 runs again and writes; the next attempt starts from that.
        fin.services().stop(&p).await.unwrap();
    }
    assert_installed(entry(&fin, "retry").await, "1.0", "after failed retries");
    let f = fin
        .install(&req("retry", "2.0"), &Cancel::new())
        .await
        .unwrap();
    f.backup_drop.await.unwrap().unwrap();
    assert_installed(
        entry(&fin, "retry").await,
        "2.0",
        "after the retry that worked",
    );
    fin.services().stop(&p).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_keeps_every_backup_unless_the_live_volume_is_good() {
    let Some(env) = env() else { return };
    let (fin, _rx) = env.finalizer();
    let store = volume::VolumeStore::open(&env.root).unwrap();
    let main = common::vol("main");
    // An orphan backup with no entry and no live volume: the only copy.
    let orphan = pkg("orphan");
    store.create(&orphan, std::slice::from_ref(&main)).unwrap();
    std::fs::write(env.volume(&orphan).join("data/main/x"), b"precious").unwrap();
    let d = digest(&env.volume(&orphan));
    store.snapshot(&orphan).unwrap();
    integration::run(
        std::process::Command::new("btrfs")
            .args(["subvolume", "delete"])
            .arg(env.volume(&orphan)),
    )
    .unwrap();
    // An installed package with a leftover backup: dropped.
    install_running(&fin, "done", "1.0", Duration::ZERO).await;
    fin.services().stop(&pkg("done")).await.unwrap();
    store.snapshot(&pkg("done")).unwrap();
    // A backup with no entry beside a live volume: nobody knows which is good.
    let unsure = pkg("unsure");
    store.create(&unsure, &[main]).unwrap();
    store.snapshot(&unsure).unwrap();

    let r = startos_core::reconcile(&**fin.db(), &env.root)
        .await
        .unwrap();
    assert_same(&d, &digest(&env.volume(&orphan)), "orphan backup restored");
    assert!(!env.backup(&orphan).exists());
    assert!(!env.backup(&pkg("done")).exists());
    assert!(env.volume(&pkg("done")).exists());
    assert!(env.backup(&unsure).exists() && env.volume(&unsure).exists());
    assert_eq!(r.needs_attention.len(), 1, "{r:?}");
    assert_eq!(r.installed, vec![(pkg("done"), "1.0".to_owned())]);
    let again = startos_core::reconcile(&**fin.db(), &env.root)
        .await
        .unwrap();
    assert!(again.is_noop(), "{again:?}");
    assert!(matches!(
        entry(&fin, "done").await.unwrap().state_info,
        StateInfo::Installed
    ));
}

/// A fresh install with no earlier volume that fails: the volume it created
/// holds nothing older, so it goes, with the entry; nothing else is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fresh_install_leaves_nothing_behind() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let p = pkg("fresh");
    for phase in [Phase::Install, Phase::Init, Phase::Start] {
        fin.services().inner.fail_at(&p, phase);
        let e = fin
            .install(&req("fresh", "1.0"), &Cancel::new())
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InstallFailed, "{phase}: {e}");
        match rx.recv().await.unwrap().event {
            Event::Failed {
                phase: ph,
                rolled_back_to,
                ..
            } => assert_eq!((ph, rolled_back_to), (phase, None)),
            other => panic!("{other:?}"),
        }
        assert!(entry(&fin, "fresh").await.is_none(), "{phase}");
        assert!(!env.volume(&p).exists(), "{phase}: volume left");
        assert!(!fin.services().inner.is_running(&p), "{phase}");
        assert_eq!(
            common::package_subvolumes(&env.fs, "fresh"),
            Vec::<String>::new()
        );
    }
}

/// Where no backup can be taken (ext4 here, as upstream allows), a failed
/// update cannot give the old data back: the failure notification says so
/// instead of claiming a rollback of the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_update_without_a_backup_says_the_data_was_not_rolled_back() {
    let Some(env) = env_ext4() else { return };
    let (fin, mut rx) = env.finalizer();
    let p = pkg("plain");
    install_running(&fin, "plain", "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services().inner.fail_at(&p, Phase::Install);
    let e = fin
        .install(&req("plain", "2.0"), &Cancel::new())
        .await
        .expect_err("the update must fail");
    assert_eq!(e.kind, ErrorKind::UpdateFailed, "{e}");
    match rx.recv().await.unwrap().event {
        Event::Failed { message, .. } => {
            assert!(message.contains("there was no install backup"), "{message}");
            assert!(message.contains("not on btrfs"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_installed(entry(&fin, "plain").await, "1.0", "after the failed update");
    fin.services().stop(&p).await.unwrap();
}

/// The backup an update took is gone when its rollback runs (dropped from
/// the command line meanwhile): the restore finds nothing to restore, and
/// the user is told that the volume keeps what the failed update wrote,
/// never that the data was rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_whose_backup_vanished_says_the_data_was_not_rolled_back() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let p = pkg("vanished");
    install_running(&fin, "vanished", "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services()
        .drop_backup_at
        .lock()
        .unwrap()
        .insert(p.clone(), Phase::Init);
    fin.services().inner.fail_at(&p, Phase::Init);
    let e = fin
        .install(&req("vanished", "2.0"), &Cancel::new())
        .await
        .expect_err("the update must fail");
    let told = "was gone when the rollback ran";
    assert!(e.to_string().contains(told), "{e}");
    match rx.recv().await.unwrap().event {
        Event::Failed { message, .. } => {
            assert!(message.contains(told), "{message}");
            assert!(
                message.contains("the data was not rolled back"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // What the failed update's init wrote is still there: nothing restored.
    let main = env.volume(&p).join("data/main");
    assert!(
        main.join("init-2.0-from-1.0").exists(),
        "{}",
        main.display()
    );
    assert!(!env.backup(&p).exists());
    assert_installed(entry(&fin, "vanished").await, "1.0", "after the rollback");
    assert_no_transient_names(&env.root, "after the rollback");
    fin.services().stop(&p).await.unwrap();
}

/// A dependent's service holds a bind mount of a dependency's volume in a
/// mount namespace of its own, as a container does. A failed update of the
/// dependency must still roll back: the dependent is stopped (the volume
/// store would refuse to swap the volume from under its mount), the volume
/// restored, both started again, and the notification names the dependent.
/// Its new namespace then sees the restored volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_stops_and_restarts_a_service_holding_a_mount_of_the_volume() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let (dep, user) = (pkg("dep"), pkg("user"));
    install_running(&fin, "dep", "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services().inner.mount_dependency(&user, &dep);
    install_running(&fin, "user", "1.0", RUN).await;
    rx.recv().await.unwrap();
    let pid_of = |p: &volume::PackageId| -> u32 {
        std::fs::read_to_string(fin.services().inner.pid_path(p))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let holder = pid_of(&user);
    let store = volume::VolumeStore::open_without_recovery(&env.root).unwrap();
    let target = fin.services().inner.dependency_mount(&user, &dep);
    let uses = store.mount_uses(&dep).unwrap();
    assert!(
        uses.iter()
            .any(|u| !u.own_namespace && u.pids.contains(&holder) && u.mount_point == target),
        "user's service must hold dep's volume in its own namespace: {uses:?}"
    );

    fin.services().after_stop.lock().unwrap().clear();
    fin.services().inner.fail_at(&dep, Phase::Init);
    let e = fin
        .install(&req("dep", "2.0"), &Cancel::new())
        .await
        .expect_err("the update must fail");
    assert_eq!(e.kind, ErrorKind::UpdateFailed, "{e}");
    match rx.recv().await.unwrap().event {
        Event::Failed {
            rolled_back_to,
            message,
            ..
        } => {
            assert_eq!(rolled_back_to.as_deref(), Some("1.0"), "{message}");
            assert!(
                message.contains("stopped user for the restore"),
                "the notification must name the service it stopped: {message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let stopped = fin.services().take_first_stop(&dep);
    let restarted =
        fin.services().before_start.lock().unwrap()[&(dep.clone(), "1.0".to_owned())].clone();
    assert_same(&stopped, &restarted, "dep's volume given back to 1.0");
    assert_installed(entry(&fin, "dep").await, "1.0", "dep");
    assert!(!env.backup(&dep).exists());
    assert!(fin.services().inner.is_running(&dep), "dep 1.0 runs again");
    assert!(fin.services().inner.is_running(&user), "user runs again");
    let again = pid_of(&user);
    assert_ne!(again, holder, "user was restarted");
    // What user's new namespace sees through its mount is the restored volume.
    let seen = std::path::PathBuf::from(format!("/proc/{again}/root"))
        .join(target.strip_prefix("/").unwrap());
    assert!(
        seen.join(integration::services::DB_FILE).exists(),
        "{}",
        seen.display()
    );
    assert!(
        !seen.join("init-2.0-from-1.0").exists(),
        "user must see the restored volume, not the failed update's"
    );
    assert_no_transient_names(&env.root, "after the rollback");
    fin.services().stop(&user).await.unwrap();
    fin.services().stop(&dep).await.unwrap();
}

/// The same, but the restore itself fails (a regular file planted under
/// one of the package's names once its backup is taken: no state of ours,
/// which every operation on the package refuses; a mount no longer makes a
/// restore fail): the rollback fails, and the dependent it stopped is
/// started again all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rollback_still_restarts_the_services_it_stopped() {
    let Some(env) = env() else { return };
    let (fin, mut rx) = env.finalizer();
    let (dep, user) = (pkg("dep"), pkg("user"));
    install_running(&fin, "dep", "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services().inner.mount_dependency(&user, &dep);
    install_running(&fin, "user", "1.0", RUN).await;
    rx.recv().await.unwrap();
    fin.services().inner.fail_at(&dep, Phase::Init);
    fin.services()
        .inner
        .delay(Phase::Init, Duration::from_millis(500));
    let stray = env.root.join("dep.replaced");
    let plant = async {
        while !env.root.join("dep.install-backup").exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        std::fs::write(&stray, b"no state of ours").unwrap();
    };
    let (cancel, update) = (Cancel::new(), req("dep", "2.0"));
    let (e, ()) = tokio::join!(fin.install(&update, &cancel), plant);
    let e = e.expect_err("the update must fail");
    assert_eq!(e.kind, ErrorKind::Incoherent, "the rollback must fail: {e}");
    assert!(e.to_string().contains("dep.replaced"), "{e}");
    rx.recv().await.unwrap();
    assert!(
        fin.services().inner.is_running(&user),
        "the dependent stopped for the restore must run again"
    );
    std::fs::remove_file(&stray).unwrap();
    fin.services().stop(&user).await.unwrap();
    fin.services().stop(&dep).await.unwrap();
}

/// A failed update after the first boot's conversion, before its cleanup:
/// the backup holds the rest the conversion set aside at the top of the
/// volume, and the restore gives that back with the volume. The rollback
/// removes it again, and its record, once the backup is gone, so that it
/// pins no space past the backup; the package's own data comes back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_before_the_first_boots_cleanup_removes_the_rest_again() {
    use volume_migrate::{Method, MigrateOptions, Migrator};
    let Some(env) = env() else { return };
    let (fin, _rx) = env.finalizer();
    let p = pkg("carved");
    install_running(&fin, "carved", "1.0", RUN).await;
    fin.services().stop(&p).await.unwrap();
    // The volume as a box from before subvolumes has it: a plain directory,
    // beside another package's.
    let vol = env.volume(&p);
    let plain = env.root.join("carved-plain");
    integration::run(
        std::process::Command::new("cp")
            .args(["-a", "--reflink=always", "-T"])
            .arg(&vol)
            .arg(&plain),
    )
    .unwrap();
    volume::delete_tree(&vol).unwrap();
    std::fs::rename(&plain, &vol).unwrap();
    std::fs::create_dir_all(env.root.join("neighbour/data/main")).unwrap();
    std::fs::write(env.root.join("neighbour/data/main/db"), b"its own").unwrap();
    let before = digest(&vol);
    let r = Migrator::open(&env.root)
        .unwrap()
        .convert(
            &p,
            &MigrateOptions {
                method: Method::SnapshotParent,
                defer_cut: true,
                remove_old: false,
                ..MigrateOptions::default()
            },
            &mut |_: &volume_migrate::Progress| {},
        )
        .unwrap();
    assert_eq!(r.method, Some(Method::SnapshotParent));
    let rest = vol.join(integration::identity::CARVE_REST);
    let record = env.root.join("carved.migrate-rest");
    assert!(rest.is_dir(), "the rest, set aside until the cleanup");

    fin.services().inner.fail_at(&p, Phase::Install);
    let e = fin
        .install(&req("carved", "2.0"), &Cancel::new())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::UpdateFailed, "{e}");
    assert_installed(entry(&fin, "carved").await, "1.0", "after the rollback");
    assert!(!env.backup(&p).exists());
    assert!(
        !rest.exists(),
        "the rest the restore gave back, removed again"
    );
    assert!(
        std::fs::symlink_metadata(&record).is_err(),
        "its record, gone with the last copy"
    );
    let back = fin.services().before_start.lock().unwrap()[&(p.clone(), "1.0".into())].clone();
    let mut want = before;
    if let Some(top) = want.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = integration::Subvolume::Root;
    }
    // 1.0 started again before the rest was removed.
    let back = back.without(integration::identity::CARVE_REST);
    assert_same(&want, &back, "the package's data, given back");
    fin.services().stop(&p).await.unwrap();
}
