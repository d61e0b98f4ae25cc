//! Quota-managed boxes, on real loop-mounted btrfs with both kinds of
//! quotas (full qgroups, `btrfs quota enable`; simple quotas, enabled
//! with BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA through `volume::sys`, which
//! this machine's btrfs-progs 6.2 cannot do): a restore and a conversion
//! (both methods) keep the volume's qgroup limit and its groups, every
//! snapshot joins its source's groups so full qgroups stay consistent
//! (read from the status item the kernel writes), a restored volume still
//! refuses writes past its limit, and a filesystem without quotas pays one
//! search of the quota tree per operation and nothing more (read from the
//! trace of every call through `volume::sys`).
//!
//! The `sys::qgroup` constants are checked first against what the kernel
//! and btrfs-progs write and read.

mod common;

use std::fs::{self, File};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::sweep::{bin, trace};
use common::*;
use integration::{LoopFs, fs_or_skip, run, skip_or_fail};
use volume::VolumeStore;
use volume::sys::{self, QgroupInherit, QgroupLimit, QuotaMode, fault};
use volume_migrate::{Method, MigrateOptions, Migrator};

/// Level-1 qgroup `1/n`.
fn group(n: u64) -> u64 {
    1 << sys::QGROUP_LEVEL_SHIFT | n
}

fn open(path: &Path) -> OwnedFd {
    rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
        rustix::fs::Mode::empty(),
    )
    .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// The id of the subvolume holding `path`, which is its qgroup's.
fn qgroup_of(path: &Path) -> u64 {
    sys::subvolume_info(open(path).as_fd())
        .expect("subvolume info")
        .id
}

fn btrfs(args: &[&str], path: &Path) -> String {
    let out = run(Command::new("btrfs").args(args).arg(path))
        .unwrap_or_else(|e| panic!("btrfs {args:?} {}: {e}", path.display()));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn limit_of(path: &Path) -> QgroupLimit {
    sys::qgroup_limit(open(path).as_fd(), qgroup_of(path))
        .expect("reading the limit")
        .unwrap_or_default()
}

fn parents_of(path: &Path) -> Vec<u64> {
    sys::qgroup_parents(open(path).as_fd(), qgroup_of(path)).expect("reading the groups")
}

/// The quota status item as the next commit writes it.
fn committed_status(mnt: &Path) -> sys::QuotaStatus {
    let fd = open(mnt);
    sys::commit(fd.as_fd()).expect("commit");
    sys::quota_status(fd.as_fd())
        .expect("status")
        .expect("quotas on")
}

/// `/sys/fs/btrfs/<fsid>/qgroups/NAME`, the kernel's own view.
fn sysfs_qgroups(mnt: &Path, name: &str) -> String {
    let show = btrfs(&["filesystem", "show"], mnt);
    let uuid = show
        .split("uuid: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("the filesystem's uuid");
    fs::read_to_string(format!("/sys/fs/btrfs/{uuid}/qgroups/{name}"))
        .expect("sysfs qgroups")
        .trim()
        .to_owned()
}

/// A btrfs filesystem with quotas of `mode` on, a level-1 qgroup `1/100`,
/// and its volumes root. `None` (skipped, or failed under CI) where the
/// kernel has no simple quotas (before 6.7).
fn quota_box(mode: QuotaMode) -> Option<(LoopFs, PathBuf)> {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE), None);
    let mnt = fs.mount_point().to_path_buf();
    match mode {
        QuotaMode::Full => {
            btrfs(&["quota", "enable"], &mnt);
        }
        QuotaMode::Simple => {
            if let Err(e) = sys::enable_quotas(open(&mnt).as_fd(), QuotaMode::Simple) {
                skip_or_fail(&format!("simple quotas (Linux 6.7+): {e}"));
                return None;
            }
        }
    }
    btrfs(&["qgroup", "create", "1/100"], &mnt);
    let root = volumes_root(&fs);
    Some((fs, root))
}

/// Starts full qgroups' numbers from a rescan, so that a later
/// inconsistency is the operation's.
fn rescanned(mnt: &Path, mode: QuotaMode) {
    if mode == QuotaMode::Full {
        btrfs(&["quota", "rescan", "-w"], mnt);
        assert!(
            !committed_status(mnt).inconsistent,
            "consistent after a rescan"
        );
    }
}

/// Writes `bytes` of data into `path` in 1 MiB writes until one fails:
/// how much went in, and the error.
fn write_until_refused(path: &Path, bytes: u64) -> (u64, Option<std::io::Error>) {
    let mut f = File::create(path).expect("create");
    let chunk = vec![0x5au8; MIB as usize];
    let mut done = 0;
    while done < bytes {
        if let Err(e) = f.write_all(&chunk).and_then(|()| f.sync_data()) {
            return (done, Some(e));
        }
        done += MIB;
    }
    (done, None)
}

#[test]
fn qgroup_constants_match_the_kernel_and_btrfs_progs() {
    let Some((fs, _)) = quota_box(QuotaMode::Full) else {
        return;
    };
    let mnt = fs.mount_point().to_path_buf();
    rescanned(&mnt, QuotaMode::Full);
    let status = committed_status(&mnt);
    assert_eq!(status.mode, QuotaMode::Full);
    assert_eq!(sysfs_qgroups(&mnt, "mode"), "qgroup");
    assert_eq!(sysfs_qgroups(&mnt, "inconsistent"), "0");

    // Written by btrfs-progs, read by us.
    let v = mnt.join("v");
    subvolume_create(&v);
    btrfs(&["qgroup", "limit", "-e", "100M"], &v);
    btrfs(&["qgroup", "limit", "200M"], &v);
    let id = qgroup_of(&v);
    btrfs(&["qgroup", "assign", &format!("0/{id}"), "1/100"], &mnt);
    assert_eq!(
        limit_of(&v),
        QgroupLimit {
            flags: sys::LIMIT_MAX_RFER | sys::LIMIT_MAX_EXCL,
            max_rfer: 200 * MIB,
            max_excl: 100 * MIB,
            ..QgroupLimit::default()
        }
    );
    assert_eq!(parents_of(&v), [group(100)]);
    assert!(
        sys::qgroup_parents(open(&mnt).as_fd(), group(100))
            .unwrap()
            .is_empty()
    );

    // Written by us, read by btrfs-progs.
    let fd = open(&mnt);
    let limit = QgroupLimit {
        flags: sys::LIMIT_MAX_EXCL,
        max_excl: 300 * MIB,
        ..QgroupLimit::default()
    };
    sys::set_qgroup_limit(fd.as_fd(), id, &limit).expect("set limit");
    btrfs(&["qgroup", "create", "1/200"], &mnt);
    sys::assign_qgroup(fd.as_fd(), id, group(200), true).expect("assign");
    fs::write(v.join("f"), vec![1u8; 1 << 20]).expect("write");
    let shown = btrfs(&["qgroup", "show", "-rep", "--raw", "--sync"], &mnt);
    let row: Vec<&str> = shown
        .lines()
        .find(|l| l.starts_with(&format!("0/{id} ")))
        .expect("the volume's row")
        .split_whitespace()
        .collect();
    // qgroupid rfer excl max_rfer max_excl parent
    assert_eq!(&row[3..6], ["none", "314572800", "1/100,1/200"], "{shown}");
    let usage = sys::qgroup_usage(fd.as_fd(), id).unwrap().unwrap();
    assert_eq!(usage.rfer.to_string(), row[1], "{shown}");
    assert_eq!(usage.excl.to_string(), row[2], "{shown}");

    // A snapshot made with our inherit joins the groups named.
    let inherit = QgroupInherit {
        groups: vec![group(100), group(200)],
    };
    sys::create_snapshot_with(open(&v).as_fd(), fd.as_fd(), "s".as_ref(), true, &inherit)
        .expect("snapshot with inherit");
    let s_id = qgroup_of(&mnt.join("s"));
    let shown = btrfs(&["qgroup", "show", "-p", "--raw"], &mnt);
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with(&format!("0/{s_id} ")) && l.contains("1/100,1/200")),
        "{shown}"
    );

    // One made without, of a group member: the kernel's inconsistent flag,
    // as we read it from the status item and sysfs shows it.
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot"])
        .arg(&v)
        .arg(mnt.join("plain")))
    .expect("plain snapshot");
    assert!(committed_status(&mnt).inconsistent);
    assert_eq!(sysfs_qgroups(&mnt, "inconsistent"), "1");

    // Simple quotas, and none.
    let simple = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let smnt = simple.mount_point().to_path_buf();
    assert_eq!(sys::quota_status(open(&smnt).as_fd()).unwrap(), None);
    if let Err(e) = sys::enable_quotas(open(&smnt).as_fd(), QuotaMode::Simple) {
        return skip_or_fail(&format!("simple quotas (Linux 6.7+): {e}"));
    }
    assert_eq!(committed_status(&smnt).mode, QuotaMode::Simple);
    assert_eq!(sysfs_qgroups(&smnt, "mode"), "squota");
}

/// A restore keeps the volume's limit and groups; the backup and the
/// replacement join the volume's groups, so full qgroups stay consistent;
/// the restored volume refuses writes past its 200 MiB limit.
fn restore_keeps_limit_and_groups(mode: QuotaMode) {
    let Some((fs, root)) = quota_box(mode) else {
        return;
    };
    let mnt = fs.mount_point().to_path_buf();
    let store = VolumeStore::open(&root).expect("open");
    let app = root.join("app");
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    btrfs(&["qgroup", "limit", "200M"], &app);
    let old = qgroup_of(&app);
    btrfs(&["qgroup", "assign", &format!("0/{old}"), "1/100"], &mnt);
    fs::write(app.join("data/main/before"), vec![3u8; 4 << 20]).expect("write");
    rescanned(&mnt, mode);
    let limit = limit_of(&app);
    assert_eq!(limit.max_rfer, 200 * MIB);

    store.snapshot(&pkg("app")).expect("snapshot");
    let backup = root.join("app.install-backup");
    assert_eq!(
        parents_of(&backup),
        [group(100)],
        "{mode:?}: the backup's groups"
    );
    if mode == QuotaMode::Full {
        assert!(
            !committed_status(&mnt).inconsistent,
            "full qgroups consistent after the backup"
        );
    }
    fs::write(app.join("data/main/after"), vec![4u8; 4 << 20]).expect("write");
    assert!(store.restore(&pkg("app")).expect("restore"));

    assert_ne!(qgroup_of(&app), old, "a new subvolume");
    assert!(app.join("data/main/before").exists() && !app.join("data/main/after").exists());
    assert_eq!(
        limit_of(&app),
        limit,
        "{mode:?}: the restored volume's limit"
    );
    assert_eq!(parents_of(&app), [group(100)], "{mode:?}: its groups");
    if mode == QuotaMode::Full {
        assert!(
            !committed_status(&mnt).inconsistent,
            "full qgroups consistent after the restore"
        );
    }
    let (written, err) = write_until_refused(&app.join("data/main/big"), 400 * MIB);
    let err = err.unwrap_or_else(|| panic!("{mode:?}: 400 MiB written past a 200 MiB limit"));
    assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{mode:?}: {err}");
    assert!(written <= 200 * MIB, "{mode:?}: {written} bytes written");
}

#[test]
fn restore_keeps_limit_and_groups_with_full_qgroups() {
    restore_keeps_limit_and_groups(QuotaMode::Full);
}

#[test]
fn restore_keeps_limit_and_groups_with_simple_quotas() {
    restore_keeps_limit_and_groups(QuotaMode::Simple);
}

/// A conversion by either method gives the new subvolume the limit and
/// groups of the subvolume the plain directory sat in (the top level
/// here, limited to 1 GiB and a member of `1/100`), and with full qgroups
/// leaves them consistent.
fn conversion_keeps_limit_and_groups(mode: QuotaMode) {
    let Some((fs, root)) = quota_box(mode) else {
        return;
    };
    let mnt = fs.mount_point().to_path_buf();
    btrfs(&["qgroup", "limit", "1G"], &mnt);
    btrfs(&["qgroup", "assign", "0/5", "1/100"], &mnt);
    let parent_limit = limit_of(&mnt);
    assert_eq!(parent_limit.max_rfer, 1 << 30);
    let m = Migrator::open(&root).expect("open");
    for (name, method) in [
        ("cloned", Method::Clone),
        ("carved", Method::SnapshotParent),
    ] {
        let vol = root.join(name);
        fs::create_dir_all(vol.join("data/main")).expect("mkdir");
        fs::write(vol.join("data/main/db"), vec![7u8; 2 << 20]).expect("write");
        rescanned(&mnt, mode);
        let opts = MigrateOptions {
            method,
            ..MigrateOptions::default()
        };
        m.convert(&pkg(name), &opts, &mut |_: &volume_migrate::Progress| {})
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert_ne!(qgroup_of(&vol), 5, "{name}: a subvolume of its own");
        assert_eq!(limit_of(&vol), parent_limit, "{mode:?} {name}: the limit");
        assert_eq!(
            parents_of(&vol),
            [group(100)],
            "{mode:?} {name}: the groups"
        );
        if mode == QuotaMode::Full {
            assert!(
                !committed_status(&mnt).inconsistent,
                "{name}: full qgroups consistent after the conversion"
            );
        }
    }
}

#[test]
fn conversion_keeps_limit_and_groups_with_full_qgroups() {
    conversion_keeps_limit_and_groups(QuotaMode::Full);
}

#[test]
fn conversion_keeps_limit_and_groups_with_simple_quotas() {
    conversion_keeps_limit_and_groups(QuotaMode::Simple);
}

/// The quota calls of a trace: the check, and everything else.
fn quota_calls(calls: &[String]) -> (usize, Vec<&String>) {
    let checks = calls
        .iter()
        .filter(|c| *c == "ioctl TREE_SEARCH_V2 quota tree")
        .count();
    let others = calls
        .iter()
        .filter(|c| c.contains("QGROUP") || c.contains("qgroup"))
        .collect();
    (checks, others)
}

/// Snapshot, restore and a conversion by each method on `root`: each
/// one's calls.
fn operations(root: &Path) -> Vec<(&'static str, Vec<String>)> {
    let store = VolumeStore::open(root).expect("open");
    let _ = store.delete(&pkg("app"));
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    let mut out = vec![(
        "snapshot",
        trace("startos-volume", root, &["snapshot", "app"]),
    )];
    out.push((
        "restore",
        trace("startos-volume", root, &["restore", "app"]),
    ));
    for (name, method) in [("cloned", "clone"), ("carved", "snapshot-parent")] {
        let _ = store.delete(&pkg(name));
        fs::create_dir_all(root.join(name).join("data/main")).expect("mkdir");
        fs::write(root.join(name).join("data/main/f"), b"data").expect("write");
        let calls = trace("volume-migrate", root, &["--method", method]);
        out.push((name, calls));
    }
    out
}

#[test]
fn without_quotas_each_operation_pays_one_search() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let mnt = fs.mount_point().to_path_buf();
    let root = volumes_root(&fs);
    for (what, calls) in operations(&root) {
        let (checks, others) = quota_calls(&calls);
        assert_eq!(checks, 1, "{what}: one check of the quota tree: {calls:?}");
        assert!(
            others.is_empty(),
            "{what}: no other qgroup call: {others:?}"
        );
    }
    // What that search costs, answered ENOENT.
    let fd = open(&mnt);
    let n = 2000;
    let started = std::time::Instant::now();
    for _ in 0..n {
        assert_eq!(sys::quota_status(fd.as_fd()).expect("status"), None);
    }
    eprintln!(
        "the quota check without quotas: {:.1} us",
        started.elapsed().as_secs_f64() * 1e6 / f64::from(n)
    );
    // With quotas on, the same trace shows the qgroup work: the count
    // above sees what it counts.
    btrfs(&["quota", "enable"], &mnt);
    for (what, calls) in operations(&root) {
        let (checks, others) = quota_calls(&calls);
        assert!(checks > 1, "{what}: {calls:?}");
        assert!(
            what == "restore" || others.iter().any(|c| c.contains("qgroup inherit")),
            "{what}: a snapshot or subvolume made with an inherit: {others:?}"
        );
    }
}

/// What the kernel (`btrfs_qgroup_inherit`, `qgroup_snapshot_quick_inherit`)
/// keeps consistent with full qgroups when a snapshot joins its source's
/// groups: a source in one group, itself in a group above, stays
/// consistent, its numbers those of a rescan (the kernel carries the
/// snapshot's node up every level); a source in two groups is marked
/// inconsistent whatever the inherit names, as the kernel cannot tell
/// where the shared bytes fall.
#[test]
fn full_qgroups_stay_consistent_where_the_kernel_can_tell() {
    let Some((fs, root)) = quota_box(QuotaMode::Full) else {
        return;
    };
    let mnt = fs.mount_point().to_path_buf();
    btrfs(&["qgroup", "create", "1/200"], &mnt);
    btrfs(&["qgroup", "create", "2/1"], &mnt);
    btrfs(&["qgroup", "assign", "1/100", "2/1"], &mnt);
    let store = VolumeStore::open(&root).expect("open");
    for name in ["one", "two"] {
        store.create(&pkg(name), &[vol("main")]).expect("create");
        let id = qgroup_of(&root.join(name));
        btrfs(&["qgroup", "assign", &format!("0/{id}"), "1/100"], &mnt);
        fs::write(root.join(name).join("data/main/f"), vec![9u8; 4 << 20]).expect("write");
    }
    let two = qgroup_of(&root.join("two"));
    btrfs(&["qgroup", "assign", &format!("0/{two}"), "1/200"], &mnt);
    rescanned(&mnt, QuotaMode::Full);

    store.snapshot(&pkg("one")).expect("snapshot");
    assert!(!committed_status(&mnt).inconsistent, "one group, one above");
    let fd = open(&mnt);
    let usage = |g| sys::qgroup_usage(fd.as_fd(), g).unwrap().unwrap();
    let (mid, top) = (usage(group(100)), usage(2 << sys::QGROUP_LEVEL_SHIFT | 1));
    btrfs(&["quota", "rescan", "-w"], &mnt);
    assert_eq!(usage(group(100)), mid, "1/100 as a rescan counts it");
    assert_eq!(usage(2 << sys::QGROUP_LEVEL_SHIFT | 1), top, "2/1 too");

    store.snapshot(&pkg("two")).expect("snapshot");
    let backup = root.join("two.install-backup");
    assert_eq!(parents_of(&backup), [group(100), group(200)]);
    assert!(
        committed_status(&mnt).inconsistent,
        "two groups: the kernel asks for a rescan"
    );
}

/// `tool --root ROOT ARGS` with the K-th call through `volume::sys`
/// failing with EIO: its exit status, its stderr, and the call that
/// failed (threads can reorder calls between runs, so the K-th is not
/// always the traced one).
fn run_failing(tool: &str, root: &Path, args: &[&str], k: usize) -> (bool, String, String) {
    let log = root.with_extension(format!("fault-{tool}-{k}"));
    let _ = fs::remove_file(&log);
    let out = Command::new(bin(tool))
        .arg("--root")
        .arg(root)
        .args(args)
        .env(fault::FAULT_ENV, format!("{k}:eio"))
        .env(fault::FAULT_LOG_ENV, &log)
        .output()
        .expect("running the tool");
    let failed = fs::read_to_string(&log).unwrap_or_default();
    let _ = fs::remove_file(&log);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        failed.trim().to_owned(),
    )
}

/// Whether the call `name` reads or sets qgroups (not the snapshot or
/// subvolume creation that passes an inherit: that is the operation
/// itself).
fn is_quota_call(name: &str) -> bool {
    name.contains("quota tree") || name.contains("QGROUP")
}

/// The numbers of the calls of `calls` that read or set qgroups.
fn quota_call_numbers(calls: &[String]) -> Vec<usize> {
    calls
        .iter()
        .enumerate()
        .filter(|(_, c)| is_quota_call(c))
        .map(|(i, _)| i + 1)
        .collect()
}

/// Quotas are secondary to the data they count: each call a backup and
/// a restore make to read or carry qgroups, failed in turn with EIO,
/// leaves the operation done (the backup taken; the volume restored,
/// every byte) and says in a warning that the limit and groups were not
/// carried. On the commit before this, each of those failures failed
/// the backup or the restore, and with it start-core's update or
/// rollback.
#[test]
fn a_failing_qgroup_call_never_fails_a_backup_or_a_restore() {
    let Some((_fs, root)) = quota_box(QuotaMode::Full) else {
        return;
    };
    let store = VolumeStore::open(&root).expect("open");
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let file = root.join("app/data/main/f");
    let backup = root.join("app.install-backup");
    let prepare = |op: &str| {
        let _ = store.drop_backup(&app);
        fs::write(&file, b"before").expect("write");
        if op == "restore" {
            store.snapshot(&app).expect("snapshot");
            fs::write(&file, b"after").expect("write");
        }
    };
    for op in ["snapshot", "restore"] {
        prepare(op);
        let points = quota_call_numbers(&trace("startos-volume", &root, &[op, "app"]));
        assert!(!points.is_empty(), "{op}: no quota call traced");
        let mut hit = 0;
        for k in points {
            prepare(op);
            let (ok, stderr, failed) = run_failing("startos-volume", &root, &[op, "app"], k);
            if !is_quota_call(&failed) {
                continue;
            }
            hit += 1;
            assert!(ok, "{op} with call {failed} failing: {stderr}");
            assert!(stderr.contains("not carried"), "{op}, call {k}: {stderr}");
            match op {
                "snapshot" => assert!(backup.exists(), "{op}, call {k}: no backup"),
                _ => assert_eq!(fs::read(&file).expect("read"), b"before", "call {k}"),
            }
        }
        assert!(hit > 0, "{op}: no qgroup call failed");
    }
}

/// The same for a conversion, by each method: each qgroup call failed in
/// turn, every package still converted with its data.
#[test]
fn a_failing_qgroup_call_never_fails_a_conversion() {
    let Some((_fs, root)) = quota_box(QuotaMode::Full) else {
        return;
    };
    let store = VolumeStore::open(&root).expect("open");
    let prepare = || {
        let _ = store.delete(&pkg("app"));
        fs::create_dir_all(root.join("app/data/main")).expect("mkdir");
        fs::write(root.join("app/data/main/f"), b"data").expect("write");
    };
    for method in ["clone", "snapshot-parent"] {
        prepare();
        let args = ["--method", method];
        let points = quota_call_numbers(&trace("volume-migrate", &root, &args));
        assert!(!points.is_empty(), "{method}: no quota call traced");
        let mut hit = 0;
        for k in points {
            prepare();
            let (ok, stderr, failed) = run_failing("volume-migrate", &root, &args, k);
            if !is_quota_call(&failed) {
                continue;
            }
            hit += 1;
            assert!(ok, "{method} with call {failed} failing: {stderr}");
            assert!(
                stderr.contains("not carried"),
                "{method}, call {k}: {stderr}"
            );
            assert!(sys::is_subvolume(open(&root.join("app")).as_fd()).expect("stat"));
            assert_eq!(
                fs::read(root.join("app/data/main/f")).expect("read"),
                b"data",
                "{method}, call {k}"
            );
        }
        assert!(hit > 0, "{method}: no qgroup call failed");
    }
}
