//! Crash safety of start-core's own install finalization and uninstall,
//! with the reorder's edits (the fixture's `service/reordered.rs`, driven
//! by its `call-sites` runner): the runner (one boot of the box) is
//! SIGKILLed at each kill point it reaches, every store failpoint inside
//! the volume calls and every kill point of the fixture's stand-ins between
//! them (`integration::call_sites::sweep::kill_points`), then the box boots
//! again (boot maintenance, then the loads) and the package must be back on
//! its old version with its old data byte for byte, or on its new version
//! with the old data under the new, running, with no backup and no
//! transient name left. `reorder.rs` sweeps the same kills to set both
//! orders side by side; these check the data itself, and the crashes
//! within crashes.
//!
//! The kills need the failpoints features (as `make test` builds the
//! runner); without them no kill fires and each test fails saying so.

mod call_sites_common;
mod common;

use call_sites_common::*;
use integration::call_sites::Ended;
use integration::call_sites::sweep::kill_points;
use integration::{LoopFs, fs_or_skip};
use serde_json::Value;

/// Every kill point of the flows, store failpoints first.
fn points() -> Vec<String> {
    kill_points(&bin()).unwrap_or_else(|e| panic!("{e}"))
}

/// A box `name` on `fs` with `app` 1 installed; its data then.
fn app_v1(fs: &LoopFs, name: &str) -> (integration::call_sites::Box_, Before) {
    let b = new_box(fs, name);
    run_ok(&b, &[boot(), install("app", "1")]);
    let before = before(&b, "app");
    (b, before)
}

/// Kills `op` at each kill point it reaches (a box each), reboots, and
/// hands what came back to `check`; returns the kill points reached.
fn each_kill(
    fs: &LoopFs,
    label: &str,
    op: &Value,
    check: impl Fn(&integration::call_sites::Box_, &integration::call_sites::Run, &Before, &str),
) -> Vec<String> {
    let mut reached = Vec::new();
    for (i, fp) in points().iter().enumerate() {
        let (b, before) = app_v1(fs, &format!("{label}-{i}"));
        let Ended::Killed(_) = run_any(&b, &[boot(), arm(fp), op.clone()]) else {
            continue;
        };
        let run = run(&b, &[boot()]);
        check(&b, &run, &before, &format!("{label} killed at {fp}"));
        reached.push(fp.clone());
    }
    eprintln!(
        "{label}: {} kill points reached: {reached:?}",
        reached.len()
    );
    assert!(reached.len() >= 10, "{label}: too few reached: {reached:?}");
    reached
}

#[test]
fn an_update_killed_at_each_step_comes_back_whole() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let reached = each_kill(
        &fs,
        "update",
        &install("app", "2"),
        |b, run, before, when| match run.installed("app").as_deref() {
            Some("1") => assert_old(b, run, "app", "1", before, when),
            _ => {
                if assert_new(b, run, "app", "2", before, when) {
                    next_update_drops_the_backup(b, when);
                }
            }
        },
    );
    // Every kill point of the stand-ins an update passes (each state
    // commit on both sides, the download, the old container's stop, the
    // new one's start, a half-written init) and the snapshot's own steps.
    for fp in [
        "flow.commit.updating",
        "flow.committed.updating",
        "flow.downloaded",
        "flow.stopping",
        "flow.stopped",
        "snapshot.created",
        "snapshot.frozen",
        "flow.started",
        "flow.init.partial",
        "flow.commit.installed",
        "flow.committed.installed",
    ] {
        assert!(reached.iter().any(|r| r == fp), "{fp} not reached");
    }
}

/// A backup left beside an installed package (a kill between the commit
/// of `Installed` and the backup's `remove`) is gone once the next update
/// is over, which leaves no name but the volume.
fn next_update_drops_the_backup(b: &integration::call_sites::Box_, when: &str) {
    let r = run_ok(b, &[boot(), install("app", "3")]);
    assert_settled(b, &r, "app", "3", &format!("{when}, then updated to 3"));
}

/// Past the commit of `Installed`, the new version stays: killed after it,
/// the box comes back on 2 with the old data under the new; the backup
/// upstream's protocol keeps until the next `begin` holds the old data
/// whole, and the next update leaves no name but the volume.
#[test]
fn an_update_killed_after_its_commit_stays_on_the_new_version() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let (b, before) = app_v1(&fs, "committed");
    killed(
        &b,
        &[boot(), arm("flow.committed.installed"), install("app", "2")],
        "after the commit",
    );
    let run = run(&b, &[boot()]);
    let when = "killed after the commit";
    assert!(
        assert_new(&b, &run, "app", "2", &before, when),
        "{when}: the backup was dropped"
    );
    next_update_drops_the_backup(&b, when);
}

/// Upstream loss paths: an interrupted restore orphaned the backup; the
/// restore's purge of the replaced volume. Every kill of a rolled-back
/// update, the restore's steps and its purge included, comes back on the
/// old version with every write it made.
#[test]
fn a_rollback_killed_at_each_step_comes_back_identical() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let op = install_failing("app", "2", "init");
    let reached = each_kill(&fs, "rollback", &op, |b, run, before, when| {
        assert_old(b, run, "app", "1", before, when)
    });
    for fp in [
        "restore.copied",
        "restore.recorded",
        "restore.exchanged",
        "restore.replaced-moved",
        "restore.replaced-deleted",
        "restore.backup-dropped",
        "drop.renamed",
        "trash.moved",
        "trash.deleting",
        "flow.commit.installed",
        "flow.committed.installed",
    ] {
        assert!(reached.iter().any(|r| r == fp), "{fp} not reached");
    }
}

/// Upstream loss path: a crash during the snapshot left a partial backup
/// that a later failed retry swapped in. Killed inside the snapshot of an
/// update whose init fails, the next boot's retry takes a whole snapshot,
/// fails again and gives the old data back; the user's retry after that
/// fails too, and the data is still the old. Killed inside the snapshot of
/// an update that works, the boot finishes it; a failed update after that
/// gives back the data the update left.
#[test]
fn a_crash_during_the_snapshot_then_a_failed_retry_loses_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    for fp in ["snapshot.created", "snapshot.frozen"] {
        let (b, before) = app_v1(&fs, &format!("failing-{fp}"));
        let op = install_failing("app", "2", "init");
        killed(&b, &[boot(), arm(fp), op.clone()], fp);
        let when = format!("killed at {fp}, rebooted");
        let r = run(&b, &[boot()]);
        assert_old(&b, &r, "app", "1", &before, &when);
        let r = run_any_ok(&b, &[boot(), op]);
        assert_old(&b, &r, "app", "1", &before, &format!("{when}, retried"));

        let (b, before) = app_v1(&fs, &format!("working-{fp}"));
        killed(&b, &[boot(), arm(fp), install("app", "2")], fp);
        let r = run(&b, &[boot()]);
        assert!(
            !assert_new(&b, &r, "app", "2", &before, &when),
            "{when}: backup left"
        );
        let at_2 = call_sites_common::before(&b, "app");
        let r = run_any_ok(&b, &[boot(), install_failing("app", "3", "init")]);
        let when = format!("{when}, then a failed update to 3");
        assert_old(&b, &r, "app", "2", &at_2, &when);
    }
}

/// A run whose update step fails (as it must), the boot before it working.
#[track_caller]
fn run_any_ok(b: &integration::call_sites::Box_, steps: &[Value]) -> integration::call_sites::Run {
    let run = run(b, steps);
    assert!(run.steps[1].is_none(), "the boot: {:?}", run.steps);
    assert!(
        run.steps[2].is_some(),
        "the update must fail: {:?}",
        run.steps
    );
    run
}

/// The next boot's rollback (its load's retry fails the init again, then
/// restores) is itself killed at each step it reaches; the boot after it
/// finishes the rollback from what is on disk.
#[test]
fn a_crash_of_the_boots_rollback_is_finished_by_the_next_boot() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let mut reached = Vec::new();
    for (i, fp) in points().iter().enumerate() {
        let (b, before) = app_v1(&fs, &format!("twice-{i}"));
        let op = install_failing("app", "2", "init");
        killed(&b, &[boot(), arm("flow.init.partial"), op], "the update");
        let Ended::Killed(_) = run_any(&b, &[arm(fp), boot()]) else {
            continue;
        };
        reached.push(fp.clone());
        let run = run(&b, &[boot()]);
        let when = format!("the boot's rollback killed at {fp}");
        assert_old(&b, &run, "app", "1", &before, &when);
    }
    eprintln!(
        "{} kill points of the boot's rollback: {reached:?}",
        reached.len()
    );
    for fp in ["restore.exchanged", "flow.committed.installed"] {
        assert!(reached.iter().any(|r| r == fp), "{fp} not reached");
    }
}

/// Upstream loss path: after a reboot, an interrupted uninstall was always
/// a hard delete, even a soft one. Killed at each step, a soft uninstall
/// comes back either still installed (killed before the entry's removal),
/// or uninstalled, the volume kept byte for byte; a hard one either still
/// installed, whole, or gone with every name of it.
#[test]
fn an_uninstall_killed_at_each_step_is_finished_or_undone() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    for soft in [true, false] {
        let label = if soft { "soft" } else { "hard" };
        let mut reached = Vec::new();
        for (i, fp) in points().iter().enumerate() {
            let (b, before) = app_v1(&fs, &format!("{label}-{i}"));
            let Ended::Killed(_) = run_any(&b, &[boot(), arm(fp), uninstall("app", soft)]) else {
                continue;
            };
            reached.push(fp.clone());
            let run = run(&b, &[boot()]);
            let when = format!("{label} uninstall killed at {fp}");
            if run.db.contains_key("app") {
                assert_old(&b, &run, "app", "1", &before, &when);
                continue;
            }
            assert!(!run.running.contains_key("app"), "{when}: running");
            if soft {
                assert_eq!(b.names("app"), ["app"], "{when}");
                common::assert_same(&before.content, &content(&b, "app"), &when);
            } else {
                assert_eq!(b.names("app"), Vec::<String>::new(), "{when}");
            }
        }
        eprintln!("{label} uninstall: kill points reached: {reached:?}");
        // Every step either uninstall passes: the container's stop on
        // both sides, and for a hard one each step of the volume's
        // removal (its backup dropped, the rename, the trash).
        let mut expected = vec!["flow.stopping", "flow.stopped"];
        if !soft {
            expected.extend([
                "delete.backup-dropped",
                "delete.renamed",
                "trash.moved",
                "trash.deleting",
            ]);
        }
        for fp in expected {
            assert!(
                reached.iter().any(|r| r == fp),
                "{label}: {fp} not reached: {reached:?}"
            );
        }
    }
}
