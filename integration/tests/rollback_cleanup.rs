//! A rollback's restore whose exchange has committed is a rollback done,
//! whatever fails after it, through start-core's own call sites (both
//! orders): the failed update's cleanup (the replaced volume's move to the
//! trash, the backup's removal) failing must not make start-core report a
//! failed rollback and fail the load, and a retry of the update in the same
//! boot (a rebuild, no reboot, so no boot recovery first) must not run the
//! new version over the rolled-back data without a backup of it.

mod call_sites_common;
mod common;

use call_sites_common::*;
use integration::call_sites::{Ended, Order};
use integration::{LoopFs, fs_or_skip};
use serde_json::{Value, json};

/// `ServiceMap::load` of `id` with `LoadDisposition::Retry`.
fn load(id: &str) -> Value {
    json!({"load": {"id": id}})
}

/// Each site after the restore's commit point failing with EIO, in each
/// order: the update's rollback still rolls back, its load goes on, nobody
/// is told it failed, and the next operation finishes the cleanup.
#[test]
fn a_failure_after_the_restores_exchange_is_no_failed_rollback() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let sites = ["restore.exchanged=eio", "restore.replaced-deleted=eio"];
    for (i, (order, site)) in [Order::Upstream, Order::Reordered]
        .into_iter()
        .flat_map(|o| sites.map(|s| (o, s)))
        .enumerate()
    {
        let when = format!("{order:?}, {site}");
        let b = new_box(&fs, &format!("box{i}"));
        let run = b
            .completed(&[order.step(), boot(), install("app", "1")])
            .unwrap_or_else(|e| panic!("{when}: {e}"));
        assert!(run.ok(), "{when}: {:?}\n{}", run.steps, run.stderr);
        let before = before(&b, "app");
        let run = b
            .completed(&[
                order.step(),
                boot(),
                arm(site),
                install_failing("app", "2", "init"),
            ])
            .unwrap_or_else(|e| panic!("{when}: {e}"));
        let told = run.notifications("app");
        assert!(
            !told.iter().any(|n| n.contains("rollback-failed")),
            "{when}: a rollback whose exchange committed is told as failed: {told:?}\n{}",
            run.stderr
        );
        assert_eq!(run.installed("app").as_deref(), Some("1"), "{when}");
        assert_eq!(
            run.running.get("app").map(String::as_str),
            Some("1"),
            "{when}: the old version runs\n{}",
            run.stderr
        );
        assert!(!run.loads_failed("app"), "{when}: {:?}", run.loads("app"));
        // The next boot (its recovery) finishes the cleanup.
        let run = b.completed(&[order.step(), boot()]);
        let run = run.unwrap_or_else(|e| panic!("{when}: {e}"));
        assert_old(&b, &run, "app", "1", &before, &when);
    }
}

/// A rollback's restore killed right after its exchange, then the update
/// retried in the same boot (a rebuild: no boot recovery before it) and
/// failing again: the retry takes a backup of the rolled-back data before
/// it starts (the backup the killed restore left is spent), so its own
/// rollback brings back the old data, not the failed install's.
#[test]
fn a_retry_after_a_restore_killed_past_its_exchange_has_a_backup_of_the_old_data() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "box");
    run_ok(&b, &[boot(), install("app", "1")]);
    let before = before(&b, "app");
    let killed = run_any(
        &b,
        &[
            boot(),
            arm("restore.exchanged"),
            install_failing("app", "2", "init"),
        ],
    );
    assert!(
        matches!(killed, Ended::Killed(_)),
        "restore.exchanged not reached: {killed:?}"
    );
    let run = run(&b, &[load("app")]);
    assert_eq!(
        run.installed("app").as_deref(),
        Some("1"),
        "{:?}\n{}",
        run.db.get("app"),
        run.stderr
    );
    assert!(
        !b.main("app").join("data-2").exists(),
        "the failed retry's data is in the rolled-back volume\n{}",
        run.stderr
    );
    let run = run_ok(&b, &[boot()]);
    assert_old(&b, &run, "app", "1", &before, "after the retry and a boot");
}

/// The call number, in a traced update's log (`N name` lines), of the
/// commit of the rollback's exchange: the update's one record (the rollback
/// copy's identity, a symlink), then the exchange, then its commit.
fn exchange_commit(log: &str) -> u64 {
    let mut calls: Vec<(u64, &str)> = log
        .lines()
        .map(|l| {
            l.split_once(' ')
                .and_then(|(n, c)| Some((n.parse().ok()?, c)))
                .unwrap_or_else(|| panic!("not an `N name` line of the trace: {l:?}"))
        })
        .collect();
    // A thread working beside (the failed update's background cleanup)
    // takes its number before it writes its line.
    calls.sort_unstable_by_key(|&(n, _)| n);
    let after = |from: usize, name: &str| {
        from + calls[from..]
            .iter()
            .position(|(_, c)| *c == name)
            .unwrap_or_else(|| panic!("no {name} after call {from} of the traced rollback"))
    };
    let record = after(0, "symlinkat");
    let exchange = after(record, "renameat_with");
    calls[after(exchange, "ioctl WAIT_SYNC")].0
}

/// The commit of the rollback's exchange failing is no rollback done: a
/// crash before the next commit would lose the exchange, and recovery would
/// then undo it. The rollback is reported failed (the database stays
/// `Updating` in the reordered order), and the next boot finishes it.
#[test]
fn a_failed_commit_of_the_restores_exchange_is_a_failed_rollback() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let log = fs.path("fault.log");
    let update = |b: &integration::call_sites::Box_, spec: &str| {
        let env = [
            (volume::sys::fault::FAULT_ENV, std::ffi::OsStr::new(spec)),
            (volume::sys::fault::FAULT_LOG_ENV, log.as_os_str()),
        ];
        match b.run_env(&ordered(&[install_failing("app", "2", "init")]), &env) {
            Ok(Ended::Completed(run)) => run,
            other => panic!("the update with {spec}: {other:?}"),
        }
    };
    let traced = new_box(&fs, "traced");
    run_ok(&traced, &[boot(), install("app", "1")]);
    let _ = std::fs::remove_file(&log);
    update(&traced, "trace");
    let k = exchange_commit(&std::fs::read_to_string(&log).expect("the trace"));
    let b = new_box(&fs, "box");
    run_ok(&b, &[boot(), install("app", "1")]);
    let before = before(&b, "app");
    let run = update(&b, &format!("{k}:eio"));
    let fired = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        fired.contains("ioctl WAIT_SYNC"),
        "call {k} failed: {fired}"
    );
    assert!(
        run.notifications("app")
            .iter()
            .any(|n| n.contains("rollback-failed")),
        "a rollback whose exchange was not committed is told as failed: {:?}\n{}",
        run.notifications("app"),
        run.stderr
    );
    let run = run_ok(&b, &[boot()]);
    assert_old(&b, &run, "app", "1", &before, "after the next boot");
}
