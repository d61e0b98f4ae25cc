//! Install finalization as start-core runs it, with the reorder's edits
//! (the fixture's `service/reordered.rs`, driven by its `call-sites`
//! runner on a loop-mounted btrfs, a real container process per service
//! writing into its volumes): the snapshot holds what the stopped
//! container last wrote; an update failing at each phase (the download, a
//! cancel, the stop, the snapshot, the new container's start, its init,
//! the commit) is rolled back to the old data byte for byte, the user told
//! which phase, again and again until one works; a fresh install failing
//! leaves nothing; a reinstall over a soft-uninstalled package's kept data
//! failing keeps it; a failed rollback leaves a dependent running; a
//! rollback before the first boot's cleanup gives the data back whole.
//! Failures are injected through the manifest's `fail` (download, cancel,
//! init) or an errno at a kill point (`arm` with `<point>=eio`), which
//! needs the failpoints features, as `make test` builds the runner.

mod call_sites_common;
mod common;

use call_sites_common::*;
use integration::call_sites::{Box_, Run};
use integration::{LoopFs, fs_or_skip};
use serde_json::{Value, json};

/// A fresh install takes no backup; an update stops the old container,
/// then snapshots: the backup's log ends with the last line the container
/// wrote before its stop, nothing after it (killed once the new version
/// is installed, before its commit, so the backup is still there to read).
/// Then an update runs to its end: the new version runs, the backup is
/// gone.
#[test]
fn an_update_stops_then_snapshots_then_drops_the_backup() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "order");
    let r = run_ok(&b, &[boot(), install("app", "1")]);
    assert_settled(&b, &r, "app", "1", "a fresh install");
    let steps = [boot(), arm("flow.commit.installed"), install("app", "2")];
    let k = killed(&b, &steps, "before the commit");
    let last = last_writes_before_stop(&k, "app")
        .pop()
        .expect("a stop logged");
    let backup = b.volumes().join("app.install-backup/data/main/app.log");
    let held = std::fs::read_to_string(&backup).unwrap_or_else(|e| panic!("{backup:?}: {e}"));
    assert!(last.starts_with("app "), "{last}");
    assert_eq!(
        held.lines().last(),
        Some(last.as_str()),
        "the backup's last write"
    );
    let before = before(&b, "app");
    let r = run_ok(&b, &[boot(), install("app", "3")]);
    assert_settled(&b, &r, "app", "3", "after the update");
    assert!(b.main("app").join("data-1").exists() && b.main("app").join("data-2").exists());
    assert!(log(&b, "app").starts_with(&before.log));
}

/// Where an update fails: the steps of its run after the boot, and what
/// the failure notification must name.
fn phases() -> Vec<(&'static str, Vec<Value>, &'static str)> {
    let at = |fp: &str, v: &str| vec![arm(&format!("{fp}=eio")), install("app", v)];
    vec![
        (
            "download",
            vec![install_failing("app", "2", "download")],
            "download",
        ),
        (
            "cancel",
            vec![install_failing("app", "2", "cancel")],
            "cancelled",
        ),
        ("stop", at("flow.stopping", "2"), "flow.stopping"),
        ("snapshot", at("snapshot.created", "2"), "snapshot"),
        ("start", at("flow.started", "2"), "flow.started"),
        (
            "init",
            vec![install_failing("app", "2", "init")],
            "init of app 2",
        ),
        (
            "commit",
            at("flow.commit.installed", "2"),
            "flow.commit.installed",
        ),
    ]
}

/// Each failure: the update's step failed, the user was told naming the
/// phase, the undo loaded the old version.
#[track_caller]
fn assert_failed(run: &Run, id: &str, names: &str, when: &str) {
    assert!(run.steps[0].is_none(), "{when}: the boot: {:?}", run.steps);
    assert!(
        run.steps.last().is_some_and(Option::is_some),
        "{when}: the update must fail: {:?}",
        run.steps
    );
    let told = run.notifications(id);
    assert!(
        told.iter()
            .any(|n| n.contains("service.install.failed") && n.contains(names)),
        "{when}: the user is told, naming {names:?}: {told:?}"
    );
}

/// Upstream loss path: a failed update retry discarded the backup without
/// rolling back. Here an update fails at each phase in turn, the old
/// version running again between attempts (and writing): each attempt
/// gives back the data the old version had when it was stopped, byte for
/// byte; the attempt that then works updates from that.
#[test]
fn an_update_failing_at_each_phase_rolls_back_identical_data_every_time() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "phases");
    run_ok(&b, &[boot(), install("app", "1")]);
    for (phase, steps, names) in phases() {
        let when = format!("an update failing at the {phase}");
        let before = before(&b, "app");
        let r = run(&b, &[vec![boot()], steps].concat());
        assert_failed(&r, "app", names, &when);
        assert_eq!(
            r.loads("app").last(),
            Some(&("Undo".to_owned(), Ok(true))),
            "{when}: the undo loads the old version\n{}",
            r.stderr
        );
        assert_old(&b, &r, "app", "1", &before, &when);
    }
    let before = before(&b, "app");
    let r = run_ok(&b, &[boot(), install("app", "2")]);
    assert_new(&b, &r, "app", "2", &before, "the update that works");
    assert_eq!(b.names("app"), ["app"]);
}

/// A fresh install (no volume before it) failing at each phase it has: the
/// volume it made holds nothing older, so it goes with the entry; nothing
/// runs, no name is left, the user is told which phase.
#[test]
fn a_failed_fresh_install_leaves_nothing_behind() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "fresh");
    run_ok(&b, &[boot()]);
    for (phase, steps, names) in phases() {
        if matches!(phase, "stop" | "snapshot") {
            continue; // a fresh install has no container to stop, no volume to snapshot
        }
        let when = format!("a fresh install failing at the {phase}");
        let steps: Vec<Value> = steps.into_iter().map(|s| fresh_version(s, "1")).collect();
        let r = run(&b, &[vec![boot()], steps].concat());
        assert_failed(&r, "app", &names.replace("app 2", "app 1"), &when);
        assert!(!r.db.contains_key("app"), "{when}: {:?}", r.db);
        assert!(!r.running.contains_key("app"), "{when}: running");
        assert_eq!(b.names("app"), Vec::<String>::new(), "{when}: names left");
    }
}

/// `step` with its install's version set to `version`.
fn fresh_version(mut step: Value, version: &str) -> Value {
    if let Some(i) = step.get_mut("install") {
        i["version"] = json!(version);
    }
    step
}

/// Upstream loss path: reinstalling over a soft-uninstalled package and
/// failing (a cancel before the snapshot, or later) deleted the kept data.
/// Here every failure leaves it byte for byte, uninstalled, not running;
/// a reinstall that works keeps it under the new version; a hard uninstall
/// then removes every name.
#[test]
fn a_failed_reinstall_over_a_soft_uninstall_keeps_the_data() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "kept");
    run_ok(&b, &[boot(), install("app", "1"), uninstall("app", true)]);
    let kept = content(&b, "app");
    for (phase, steps, names) in phases() {
        if phase == "stop" {
            continue; // nothing runs to stop
        }
        let when = format!("a reinstall failing at the {phase}");
        let r = run(&b, &[vec![boot()], steps].concat());
        assert_failed(&r, "app", names, &when);
        assert!(!r.db.contains_key("app"), "{when}: {:?}", r.db);
        assert!(!r.running.contains_key("app"), "{when}: running");
        assert_eq!(b.names("app"), ["app"], "{when}: names");
        common::assert_same(&kept, &content(&b, "app"), &when);
    }
    let r = run_ok(&b, &[boot(), install("app", "2")]);
    assert_settled(&b, &r, "app", "2", "the reinstall that works");
    assert!(
        b.main("app").join("data-1").exists(),
        "the kept data is there"
    );
    let r = run_ok(&b, &[boot(), uninstall("app", false)]);
    assert!(r.db.is_empty());
    assert_eq!(b.names("app"), Vec::<String>::new());
}

/// A dependent whose container mounts `dep`'s main volume.
fn install_dependent(id: &str, dep: &str) -> Value {
    let mount = json!({"package_id": dep, "volume_id": "main", "subpath": null, "readonly": false});
    json!({"install": {"id": id, "version": "1", "dependencies": [mount]}})
}

/// A rollback under a dependent's mount gives the dependency its data back
/// and leaves the dependent running; a rollback whose restore fails (an
/// I/O error in it) is told, and the dependent still runs.
#[test]
fn a_rollback_and_a_failed_rollback_leave_the_dependent_running() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "dependent");
    run_ok(
        &b,
        &[
            boot(),
            install("dep", "1"),
            install_dependent("user", "dep"),
        ],
    );
    // What the dependent writes through its mount goes on meanwhile.
    let dep_content = || content(&b, "dep").without("data/main/user.log");
    let before = dep_content();
    let r = run(&b, &[boot(), install_failing("dep", "2", "init")]);
    assert_failed(&r, "dep", "init of dep 2", "the rollback");
    assert_running(&r, "dep", "1", "the rollback");
    assert_running(&r, "user", "1", "the rollback");
    common::assert_same(&before, &dep_content(), "dep's data given back");

    let steps = [
        boot(),
        arm("restore.recorded=eio"),
        install_failing("dep", "2", "init"),
    ];
    let r = run(&b, &steps);
    assert!(
        r.notifications("dep")
            .iter()
            .any(|n| n.contains("rollback-failed")),
        "the failed rollback is told: {:?}",
        r.notifications("dep")
    );
    assert_running(&r, "user", "1", "after the failed rollback");
}

/// A failed update after the first boot's conversion, before its cleanup
/// removed what the conversion set aside (the cleanup failing here, with
/// an I/O error): the backup holds that rest, and the restore gives it
/// back with the volume. The next boot's cleanup removes it and its
/// record; the package's own data comes back whole.
#[test]
fn a_rollback_before_the_first_boots_cleanup_gives_the_data_back_whole() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    // A data directory that is a subvolume of its own, little else in it:
    // the conversion snapshots it and cuts the snapshot down to the volume,
    // setting the rest aside.
    let data = fs.path("carved");
    common::subvolume_create(&data);
    let b = Box_ { bin: bin(), data };
    let files = b.main("app").join("files");
    std::fs::create_dir_all(&files).unwrap();
    for i in 0..20u64 {
        std::fs::write(files.join(format!("{i:03}")), common::bytes(i, 3000)).unwrap();
    }
    std::fs::create_dir_all(b.main("neighbour")).unwrap();
    std::fs::write(b.main("neighbour").join("db"), b"its own").unwrap();
    let before = common::digest(&files);
    run_ok(&b, &[json!({"seed": {"id": "app", "version": "1"}})]);
    let steps = [
        // The cleanup fails before it removed the rest.
        arm("migrate.rest-removed=eio"),
        boot(),
        json!({"wait": {"ms": 300}}),
        install_failing("app", "2", "init"),
    ];
    let r = run(&b, &steps);
    assert!(
        r.steps.last().is_some_and(Option::is_some),
        "the update must fail: {:?}",
        r.steps
    );
    assert_running(&r, "app", "1", "after the rollback");
    let rest = b
        .volumes()
        .join("app")
        .join(integration::identity::CARVE_REST);
    let record = b.volumes().join("app.migrate-rest");
    assert!(
        rest.is_dir() && b.names("app").contains(&"app.migrate-rest".to_owned()),
        "the restore gave the rest back, its record kept: {:?}",
        b.names("app")
    );
    let mut r = run_ok(&b, &[boot(), json!({"wait": {"ms": 500}})]);
    for _ in 0..5 {
        if b.names("app") == ["app"] && !rest.exists() {
            break;
        }
        r = run_ok(&b, &[boot(), json!({"wait": {"ms": 1000}})]);
    }
    assert_settled(&b, &r, "app", "1", "after the next boot's cleanup");
    assert!(!rest.exists(), "the rest the restore gave back, removed");
    assert!(std::fs::symlink_metadata(&record).is_err(), "its record");
    common::assert_same(&before, &common::digest(&files), "the package's data");
    assert!(!b.main("app").join("data-2").exists());
}

/// Installs, then updates, of two packages at once (the runner's
/// `parallel` step): the two run over the same span of time, and each
/// package comes out whole, the update over its old data.
#[test]
fn different_packages_install_and_update_in_parallel() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let b = new_box(&fs, "parallel");
    let both = |v: &str| json!({"parallel": {"steps": [install("par-a", v), install("par-b", v)]}});
    let spans = |r: &Run| -> Vec<(f64, f64)> {
        let mut spans: Vec<(u64, f64, f64)> = r
            .events
            .iter()
            .filter_map(|e| e.get("parallel"))
            .map(|p| {
                assert!(p["error"].is_null(), "{p}");
                let f = |k: &str| p[k].as_f64().unwrap();
                (p["index"].as_u64().unwrap(), f("start_ms"), f("end_ms"))
            })
            .collect();
        spans.sort_by_key(|s| s.0);
        spans.into_iter().map(|(_, s, e)| (s, e)).collect()
    };
    let r = run_ok(&b, &[boot(), both("1")]);
    let s = spans(&r);
    assert_eq!(s.len(), 2, "{:?}", r.events);
    eprintln!("installs (ms from the boot's start): {s:?}");
    assert!(
        s[0].0 < s[1].1 && s[1].0 < s[0].1,
        "installs must overlap: {s:?}"
    );
    let before = ["par-a", "par-b"].map(|p| {
        assert_settled(&b, &r, p, "1", p);
        call_sites_common::before(&b, p)
    });
    let r = run_ok(&b, &[boot(), both("2")]);
    let s = spans(&r);
    assert!(
        s[0].0 < s[1].1 && s[1].0 < s[0].1,
        "updates must overlap: {s:?}"
    );
    for (p, before) in ["par-a", "par-b"].iter().zip(&before) {
        assert!(!assert_new(&b, &r, p, "2", before, p), "{p}: backup left");
    }
}
