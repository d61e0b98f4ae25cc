//! The comparison scenarios of `make compare` ([`integration::compare`]),
//! small: each asserts our outcome (nothing lost, the volume path never
//! missing, every attribute kept, little work redone, ...) and only reports
//! upstream's on stderr, since upstream's behaviour is what it is.
//!
//! The scenarios that kill a process re-execute this test binary to run
//! only [`crash_child`]; the kills need the failpoints features, which
//! `make test` turns on.

use integration::compare::{self, Launcher, Report, Scale};

/// Not a test on its own: the body of a scenario's child process. Without
/// the child's environment (a normal test run) it returns at once.
#[test]
fn crash_child() {
    compare::child_main();
}

fn launcher() -> Launcher {
    Launcher::current_exe(&["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .expect("the test binary's path")
}

/// Prints the scenario's rows and both outcomes in full.
fn report(r: &impl Report, full: &dyn std::fmt::Debug) {
    eprintln!("{}", compare::table::render(&[r.rows()]));
    eprintln!("{full:#?}");
}

#[test]
fn a_nested_subvolumes_come_back_whole_and_read_only_stays_read_only() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::nested::run(&Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    assert!(o.backup_taken && o.backup_read_only, "{o:#?}");
    assert_eq!(o.restore_error, None);
    for n in &o.nested {
        assert!(n.in_backup, "{}: the backup must hold it", n.path);
        assert!(n.data_kept, "{}: its data must come back", n.path);
        assert!(
            n.still_subvolume,
            "{}: it must still be a subvolume",
            n.path
        );
        assert!(n.read_only_kept, "{}: read-only exactly if it was", n.path);
        assert_ne!(n.writable, Some(false), "{}: must stay writable", n.path);
    }
}

#[test]
fn b_a_killed_restore_or_conversion_never_leaves_the_path_empty_nor_loses_data() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::crash::run(&launcher(), &Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    use compare::crash::EndState;
    for (pass, kills) in [
        ("restore", &c.ours.restore),
        ("restore, then a write", &c.ours.restore_with_write),
    ] {
        assert_eq!(kills.len(), compare::crash::OURS_RESTORE_SITES.len());
        for k in kills {
            let when = format!("{pass} killed at {}", k.site);
            assert!(!k.path_missing, "{when}: the volume path went missing");
            assert!(
                matches!(k.state, EndState::Before | EndState::After),
                "{when}: {:?} ({:?})",
                k.state,
                k.resolve_error
            );
            assert_eq!(k.resolve_error, None, "{when}");
            assert!(k.leftovers.is_empty(), "{when}: left {:?}", k.leftovers);
            assert!(!compare::crash::write_lost(k), "{when}: the write was lost");
        }
    }
    // A crash before the exchange is undone, one after it finished: only
    // the restore itself ever exchanges.
    for k in &c.ours.restore {
        let exchanged = !["restore.copied", "restore.recorded"].contains(&k.site);
        assert_eq!(
            k.state == EndState::After,
            exchanged,
            "killed at {}: {:?}",
            k.site,
            k.state
        );
    }
    assert_eq!(
        c.ours.convert.len(),
        compare::crash::OURS_CONVERT_SITES.len()
    );
    for k in &c.ours.convert {
        let when = format!("conversion killed at {}", k.site);
        assert!(!k.path_missing, "{when}: the volume path went missing");
        assert!(k.converted, "{when}: not a subvolume after the next boot");
        assert!(k.differences.is_empty(), "{when}: {:#?}", k.differences);
        // A conversion killed after its exchange leaves its old tree,
        // which the next boot removes in the background: nothing is left.
        assert!(k.leftovers.is_empty(), "{when}: left {:?}", k.leftovers);
    }
}

#[test]
fn c_a_conversion_keeps_every_entry_and_attribute() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::attrs::run(&Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    assert!(o.converted, "{o:#?}");
    assert!(o.differences.is_empty(), "{:#?}", o.differences);
    assert!(o.flag_differences.is_empty(), "{:#?}", o.flag_differences);
    assert!(o.leftovers.is_empty(), "{:?}", o.leftovers);
    assert!(o.log.is_empty(), "{:?}", o.log);
}

#[test]
fn d_a_conversion_killed_at_90_percent_redoes_little() {
    if !integration::require_root_and_loop() {
        return;
    }
    let scale = Scale::quick();
    let c = compare::resume::run(&launcher(), &scale).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    assert!(o.resumed && o.lossless, "{o:#?}");
    // What was left, plus at most the chunk in flight when it died.
    let chunk = scale.resume_file_bytes / 4;
    assert!(
        o.rerun_cloned <= o.total_bytes - o.killed_after + chunk,
        "the rerun cloned {} of {} bytes",
        o.rerun_cloned,
        o.total_bytes
    );
}

#[test]
fn e_a_restore_under_a_foreign_bind_mount_keeps_the_replaced_volume_and_no_write_is_lost() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::bind::run(&Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    // A dependent's mount never stops a rollback ...
    assert!(o.restored, "{o:#?}");
    assert_eq!(o.holder_named, Some(true), "{o:#?}");
    // ... and nothing the dependent writes through it is lost: it lands in
    // the replaced volume, kept while mounted, reclaimed after.
    assert!(o.writes_after > 0, "{o:#?}");
    assert_eq!(o.lost_after, 0, "{o:#?}");
    assert_eq!(o.in_held, o.writes_after, "{o:#?}");
    assert_eq!(o.write_errors, 0, "{o:#?}");
    assert_eq!(o.reclaimed_after_stop, Some(true), "{o:#?}");
}

#[test]
fn f_nocow_files_in_a_plain_directory_get_a_complete_backup() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::nocow::run(&Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    assert!(o.backup_taken && o.backup_complete, "{o:#?}");
    assert!(o.rolled_back, "{o:#?}");
}

#[test]
fn g_each_service_may_start_once_its_own_volume_is_converted() {
    if !integration::require_root_and_loop() {
        return;
    }
    let c = compare::boot::run(&Scale::quick()).unwrap_or_else(|e| panic!("{e}"));
    report(&c, &c);
    let o = &c.ours;
    let n = compare::boot::PACKAGES.len();
    assert_eq!(o.converted, n, "{o:#?}");
    assert_eq!(o.lossless, n, "{o:#?}");
    assert!(o.leftovers.is_empty(), "{:?}", o.leftovers);
    assert_eq!(o.ready.len(), n, "every package reported ready: {o:#?}");
    let first = o.ready.iter().map(|(_, t)| *t).min().unwrap_or_default();
    assert!(
        first < o.all_ready,
        "services start one by one, not all at the end: {o:#?}"
    );
    assert!(o.all_ready <= o.returned, "{o:#?}");
    // Every entry of every package the very same inode (ctime changes only
    // for the top entries the cut lifts); upstream's copies keep none.
    for (p, k) in &o.identity {
        assert_eq!(k.inode, k.entries, "{p}: {k:?}");
        assert!(k.ctime < k.entries && k.ctime > 0, "{p}: {k:?}");
    }
    for (p, k) in &c.upstream.identity {
        assert_eq!(k.inode, 0, "upstream's {p}: {k:?}");
    }
}
