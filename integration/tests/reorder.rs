//! The reorder's edits to start-core's own `ServiceMap::install` and
//! `Service::load` (`fixtures/upstream-call-sites/src/service/reordered.rs`),
//! each crash window they close shown on the fixture's runner, beside the
//! same kills on upstream's unedited call sites: an update, and an update
//! rolled back, SIGKILLed at every store failpoint inside their volume
//! calls and every kill point between them (each state commit, the
//! download, the container stopped and started, the init), then rebooted
//! through boot maintenance and the loads.

use std::time::Duration;

use integration::call_sites::sweep::{Flow, Outcome, Swept, kill_points, sweep};
use integration::call_sites::{Box_, Ended, Order, Run, arm, boot, install};
use integration::{LoopFs, fs_or_skip};
use serde_json::{Value, json};

const SIZE: u64 = 512 << 20;

fn bin() -> std::path::PathBuf {
    integration::workspace_bin("call-sites").unwrap_or_else(|e| {
        panic!("{e} (build it first: cargo build --workspace --bins --features ...)")
    })
}

/// A box a name, each a data directory of `fs`.
fn boxes(fs: &LoopFs) -> impl Fn(&str) -> Result<Box_, String> + '_ {
    move |name| {
        let data = fs.path(name);
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        Ok(Box_ { bin: bin(), data })
    }
}

fn swept(order: Order, flow: Flow) -> Option<Swept> {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE), None);
    let points = kill_points(&bin()).unwrap();
    let s = sweep(&boxes(&fs), order, flow, &points).unwrap();
    eprintln!(
        "{order:?} {flow:?}: {} kill points reached",
        s.outcomes.len()
    );
    for (fp, o) in &s.outcomes {
        eprintln!("  {fp}: {o:?}");
    }
    assert!(s.outcomes.len() >= 10, "too few reached: {:?}", s.outcomes);
    Some(s)
}

fn assert_never_a_mix(s: &Swept) {
    assert!(
        s.mixes().is_empty(),
        "{:?} {:?}: a mix at {:?}",
        s.order,
        s.flow,
        s.mixes()
    );
}

#[test]
fn reordered_update_killed_at_every_step_comes_back_whole() {
    let Some(s) = swept(Order::Reordered, Flow::Update) else {
        return;
    };
    assert_never_a_mix(&s);
}

#[test]
fn reordered_rollback_killed_at_every_step_comes_back_whole() {
    let Some(s) = swept(Order::Reordered, Flow::Rollback) else {
        return;
    };
    assert_never_a_mix(&s);
    assert!(s.outcomes.iter().all(|(_, o)| *o == Outcome::Old));
}

/// Upstream's update: a crash after `Updating` is committed and before
/// the download completed leaves the package `Updating` with no service
/// (its Retry's open of the missing s9pk aborts the load; edit 5).
#[test]
fn upstream_update_leaves_this_window_open() {
    let Some(s) = swept(Order::Upstream, Flow::Update) else {
        return;
    };
    let open: Vec<&str> = s.mixes().into_iter().map(|(fp, _)| fp).collect();
    assert_eq!(open, ["flow.committed.updating"], "{:?}", s.mixes());
}

/// Upstream's order leaves these windows open (what the reorder's edits 2
/// and 5 close): asserted as they are, so a change shows.
#[test]
fn upstream_rollback_leaves_these_windows_open() {
    let Some(s) = swept(Order::Upstream, Flow::Rollback) else {
        return;
    };
    let open: Vec<&str> = s.mixes().into_iter().map(|(fp, _)| fp).collect();
    assert_eq!(open, UPSTREAM_OPEN, "{:?}", s.mixes());
}

/// Upstream's rollback: the kill points after which the package comes
/// back mixed, and why.
/// - After `Updating` is committed and before the snapshot completed (the
///   download, the snapshot's own steps): no backup; the boot's Retry runs
///   the failing init again, its writes stay on the old version (edit 5).
///   Before the download completed, the Retry cannot open the new s9pk and
///   the load aborts: `Updating`, no service (edit 5).
/// - After the rollback committed `Installed` and before its restore's
///   exchange: the old version boots on the failed init's data, the backup
///   beside it (edit 2).
const UPSTREAM_OPEN: [&str; 7] = [
    "restore.copied",
    "restore.recorded",
    "snapshot.created",
    "snapshot.frozen",
    "flow.committed.updating",
    "flow.downloaded",
    "flow.committed.installed",
];

/// A box of its own on a fresh filesystem, `v1` of the package installed.
fn box_with_v1(fs: &LoopFs, name: &str, order: Order) -> Box_ {
    let b = boxes(fs)(name).unwrap();
    let run = b
        .completed(&[order.step(), boot(), install("app", "1", None)])
        .unwrap();
    assert!(run.ok(), "{:?}\n{}", run.steps, run.stderr);
    b
}

/// The last line the old container wrote before it was stopped, as the
/// run logged it.
fn last_write_before_stop(run: &Run) -> String {
    let line = run
        .stderr
        .lines()
        .find_map(|l| l.split_once("container of app stopped; last write: "))
        .map(|(_, w)| w.trim().trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("no stop logged:\n{}", run.stderr));
    assert!(line.starts_with("app "), "{line}");
    line
}

/// Edit 1: the runner paused (SIGSTOP) just before the old container is
/// stopped, the container writing on meanwhile, then an update whose init
/// fails, rolled back. Upstream snapshots the running container, so the
/// rollback loses what it wrote between the snapshot and the stop; the
/// reordered install stops it first and loses nothing.
#[test]
fn a_rollback_keeps_every_write_the_old_container_made() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    for order in [Order::Upstream, Order::Reordered] {
        let b = box_with_v1(&fs, &format!("{order:?}"), order);
        let steps = [order.step(), boot(), install("app", "2", Some("init"))];
        let pause = Some(("flow.stopping", Duration::from_millis(300)));
        let Ended::Completed(run) = b.run_paused(&steps, pause).unwrap() else {
            panic!("{order:?}: killed");
        };
        assert_eq!(run.installed("app").as_deref(), Some("1"), "{order:?}");
        let last = last_write_before_stop(&run);
        let log = std::fs::read_to_string(b.main("app").join("app.log")).unwrap();
        let kept = log.lines().any(|l| l == last);
        match order {
            Order::Upstream => assert!(!kept, "upstream's rollback kept {last:?}"),
            Order::Reordered => assert!(kept, "the rollback lost {last:?}"),
        }
    }
}

/// Edit 3 (with 2): a rollback whose restore failed keeps its backup, the
/// only copy of the old data. The next install (its download failing)
/// must not drop it: upstream's `begin` does, before anything else, and
/// the package is left on the failed version's writes for good; the
/// reordered install is refused while the package is not `Installed`, and
/// its undo finishes the rollback.
#[test]
fn a_failed_restore_keeps_its_backup_through_the_next_install() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    for order in [Order::Upstream, Order::Reordered] {
        let b = box_with_v1(&fs, &format!("{order:?}"), order);
        let run = b
            .completed(&[
                order.step(),
                boot(),
                arm("restore.recorded=eio"),
                install("app", "2", Some("init")),
            ])
            .unwrap();
        assert!(
            run.notifications("app")
                .iter()
                .any(|n| n.contains("rollback-failed")),
            "{order:?}: {:?}",
            run.notifications("app")
        );
        // No boot: the install right after, as the user retries.
        b.completed(&[order.step(), install("app", "3", Some("download"))])
            .unwrap();
        let run = b.completed(&[order.step(), boot()]).unwrap();
        let outcome = integration::call_sites::sweep::classify(&b, &run, Flow::Rollback);
        match order {
            Order::Upstream => assert!(matches!(outcome, Outcome::Mix(_)), "{outcome:?}"),
            Order::Reordered => assert_eq!(outcome, Outcome::Old),
        }
        assert!(
            !b.names("app").contains(&"app.install-backup".to_owned()) || order == Order::Reordered
        );
    }
}

fn update_without(id: &str, version: &str, fail: Option<&str>, chosen: bool) -> Value {
    json!({"install": {"id": id, "version": version, "fail": fail, "without_rollback": chosen}})
}

/// Edit 4: on a filesystem with no snapshots (ext4), `snapshot()` says
/// `false`. Upstream updates on regardless, silently, and a failed init
/// is left on the old version with nothing to restore; the reordered
/// install stops the update and tells the user, or, when the user chose
/// to go on without a rollback point, goes on and tells them so.
#[test]
fn an_update_with_no_rollback_point_stops_unless_chosen_and_the_user_is_told() {
    let fs = fs_or_skip!(LoopFs::ext4(SIZE));
    for order in [Order::Upstream, Order::Reordered] {
        let b = box_with_v1(&fs, &format!("{order:?}"), order);
        let run = b
            .completed(&[
                order.step(),
                boot(),
                update_without("app", "2", Some("init"), false),
            ])
            .unwrap();
        let told = |run: &Run| {
            run.notifications("app")
                .iter()
                .any(|n| n.contains("no-backup"))
        };
        let outcome = integration::call_sites::sweep::classify(&b, &run, Flow::Rollback);
        match order {
            Order::Upstream => {
                assert!(!told(&run), "{:?}", run.notifications("app"));
                assert!(matches!(outcome, Outcome::Mix(_)), "{outcome:?}");
                // Upstream's undo goes on; the drop-in says it restored nothing.
                assert!(
                    run.stderr.contains("the volume was not rolled back"),
                    "{}",
                    run.stderr
                );
            }
            Order::Reordered => {
                assert!(told(&run), "{:?}", run.notifications("app"));
                assert_eq!(outcome, Outcome::Old, "{}", run.stderr);
                let run = b
                    .completed(&[order.step(), boot(), update_without("app", "3", None, true)])
                    .unwrap();
                assert!(run.ok(), "{:?}", run.steps);
                assert!(
                    run.notifications("app")
                        .iter()
                        .any(|n| n.contains("no-backup go_on=true")),
                    "{:?}",
                    run.notifications("app")
                );
                assert_eq!(run.installed("app").as_deref(), Some("3"));
            }
        }
    }
}
