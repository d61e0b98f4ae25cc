//! volume-migrate on real loop-mounted btrfs: lossless conversion of plain
//! volume directories into subvolumes, refusals, resume, and crash safety
//! (SIGKILL at every step, as in `volume_crash.rs`: the test binary re-executes
//! itself to run only [`migrate_child`], with `STARTOS_VOLUME_FAILPOINT`
//! naming the step; needs `--features volume-migrate/failpoints`).

mod common;

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::rich::{build_rich_tree, expected_after, flags_and_blocks};
use common::*;
use integration::{LoopFs, Subvolume, TreeDigest, fs_or_skip, tree_digest};
use volume::{ErrorKind, SnapshotOutcome, VolumeKind, VolumeStore};
use volume_migrate::{MigrateOptions, Migrator, Outcome, Phase, Progress};

const CHILD_ROOT_ENV: &str = "MIGRATE_CHILD_ROOT";
const CHILD_PKG_ENV: &str = "MIGRATE_CHILD_PKG";
const CHILD_CHUNK_ENV: &str = "MIGRATE_CHILD_CHUNK";

fn new_fs() -> Option<(LoopFs, PathBuf)> {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE), None);
    let root = volumes_root(&fs);
    Some((fs, root))
}

fn raw(path: &Path) -> TreeDigest {
    tree_digest(path).unwrap_or_else(|e| panic!("digest of {}: {e}", path.display()))
}

fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

fn no_progress(_: &Progress) {}

fn opts(chunk: u64) -> MigrateOptions {
    MigrateOptions {
        chunk_bytes: chunk,
        ..MigrateOptions::default()
    }
}

/// The names volume-migrate uses, left under the root.
fn migrate_names(root: &Path) -> Vec<String> {
    root_names(root)
        .into_iter()
        .filter(|n| n.ends_with(".migrate") || n.ends_with(".migrate-old"))
        .collect()
}

#[track_caller]
fn assert_converted(
    root: &Path,
    package: &str,
    before: &TreeDigest,
    flags: &[(PathBuf, String, u64)],
) {
    let live = root.join(package);
    assert!(is_subvolume(&live), "{package} must now be a subvolume");
    assert_same(
        &expected_after(before),
        &raw(&live),
        &format!("{package} after conversion"),
    );
    assert_eq!(
        flags,
        flags_and_blocks(&live).as_slice(),
        "{package}: inode flags or holes differ"
    );
    assert!(
        is_read_only(&live.join("data/main/ro-nested")),
        "read-only nested subvolume kept read-only"
    );
    assert!(!is_read_only(&live), "the converted volume is writable");
}

#[test]
fn converts_every_kind_of_entry_losslessly() {
    let Some((fs, root)) = new_fs() else { return };
    let vol = root.join("lnd");
    build_rich_tree(&vol, 3 << 20);
    let before = raw(&vol);
    let flags = flags_and_blocks(&vol);
    assert_eq!(
        before.get("data/main/nested").map(|e| e.subvolume),
        Some(Subvolume::Root)
    );

    let m = Migrator::open(&root).expect("open");
    let plan = m.plan().expect("plan");
    assert_eq!(plan.len(), 1);
    let est = plan[0].estimate.expect("estimate");
    assert!(est.extents >= 5 && est.nested_subvolumes == 3, "{est:?}");
    assert_same(&before, &raw(&vol), "a plan changes nothing");

    let mut phases = Vec::new();
    let mut last = None;
    let mut sink = |p: &Progress| {
        if phases.last() != Some(&p.phase) {
            phases.push(p.phase);
        }
        last = Some(p.clone());
    };
    let opts = MigrateOptions {
        chunk_bytes: 1 << 20,
        ..MigrateOptions::default()
    };
    let report = m.convert(&pkg("lnd"), &opts, &mut sink).expect("convert");
    assert_eq!(report.outcome, Outcome::Converted);
    assert!(!report.resumed);
    assert_eq!(
        phases,
        [
            Phase::Scan,
            Phase::Clone,
            Phase::Sync,
            Phase::Exchange,
            Phase::Done
        ]
    );
    let last = last.expect("progress");
    assert_eq!(last.bytes_done, last.bytes_total);
    assert_eq!(last.extents_done, last.extents_total);
    assert_eq!(
        last.entries_done,
        last.entries_total + 1,
        "every entry and the top"
    );
    assert_eq!(root_names(&root), ["lnd", "lnd.lock", "lnd.migrate-old"]);
    // The old directory is still the original until removed.
    assert_same(
        &before,
        &raw(&root.join("lnd.migrate-old")),
        "old directory",
    );
    assert_converted(&root, "lnd", &before, &flags);

    // Volume operations work on the converted package, with the old
    // directory still waiting: the store's recovery leaves it alone.
    let store = VolumeStore::open(&root).expect("store open");
    assert_eq!(store.list().unwrap()[0].volume, Some(VolumeKind::Subvolume));
    assert_eq!(
        store.snapshot(&pkg("lnd")).unwrap(),
        SnapshotOutcome::Snapshot
    );
    assert!(store.drop_backup(&pkg("lnd")).unwrap());

    assert!(
        m.remove_old(&pkg("lnd"), &mut no_progress)
            .expect("remove old")
    );
    assert_eq!(root_names(&root), ["lnd", "lnd.lock"]);
    assert_eq!(
        package_subvolumes(&fs, "lnd").len(),
        4,
        "the volume and its 3 nested"
    );
    assert_converted(&root, "lnd", &before, &flags);
    // Nothing left to do.
    assert!(m.packages().unwrap().is_empty());
    let again = m.convert(&pkg("lnd"), &opts, &mut no_progress).unwrap();
    assert_eq!(again.outcome, Outcome::AlreadySubvolume);
}

#[test]
fn run_converts_packages_independently_and_refuses_busy_ones() {
    let Some((_fs, root)) = new_fs() else { return };
    for p in ["alpha", "busy", "gamma"] {
        fs::create_dir_all(root.join(p).join("data/main")).unwrap();
        populate_volume(&root.join(p), false);
    }
    // Already a subvolume: untouched and not reported.
    subvolume_create(&root.join("done"));
    let mount = MountGuard::tmpfs(&root.join("busy/data/main/tmp"));
    let before: Vec<TreeDigest> = ["alpha", "busy", "gamma"]
        .iter()
        .map(|p| raw(&root.join(p)).without("data/main/tmp"))
        .collect();
    let m = Migrator::open(&root).unwrap();
    let mut order = Vec::new();
    let reports = m
        .run(&MigrateOptions::default(), &mut no_progress, &mut |r| {
            order.push(r.package.to_string())
        })
        .expect("run");
    assert_eq!(order, ["alpha", "busy", "gamma"]);
    let busy = &reports[1];
    assert_eq!(busy.outcome, Outcome::Failed);
    let err = busy.error.as_ref().unwrap();
    assert_eq!(err.code, ErrorKind::InvalidRequest.code());
    assert!(
        err.message.contains("package busy") && err.message.contains("mounted at"),
        "{}",
        err.message
    );
    assert!(!is_subvolume(&root.join("busy")));
    mount.unmount();
    // Mount gone: the busy one's digest (minus the mount point dir) is as before.
    assert_same(
        &before[1],
        &raw(&root.join("busy")).without("data/main/tmp"),
        "busy, untouched",
    );
    for (i, p) in ["alpha", "gamma"].iter().enumerate() {
        assert!(reports[i * 2].old_removed);
        assert!(is_subvolume(&root.join(p)));
        assert_same(&expected_after(&before[i * 2]), &raw(&root.join(p)), p);
    }
    assert!(migrate_names(&root).is_empty());
}

#[test]
fn refuses_a_volume_that_is_another_filesystem() {
    let Some((_fs, root)) = new_fs() else { return };
    let guard = MountGuard::tmpfs(&root.join("other"));
    fs::write(root.join("other/file"), b"x").unwrap();
    let m = Migrator::open(&root).unwrap();
    let e = m
        .convert(&pkg("other"), &MigrateOptions::default(), &mut no_progress)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert!(e.to_string().contains("package other"), "{e}");
    assert!(migrate_names(&root).is_empty());
    drop(guard);
}

#[test]
fn refuses_without_enough_free_space_and_changes_nothing() {
    let Some((_fs, root)) = new_fs() else { return };
    fs::create_dir_all(root.join("full/data/main")).unwrap();
    populate_volume(&root.join("full"), false);
    let before = raw(&root.join("full"));
    // Committed first, as convert does, so the figure is the one it reads.
    rustix::fs::sync();
    let free = {
        let dir = fs::File::open(&root).unwrap();
        volume::sys::metadata_space(dir.as_fd()).unwrap().free()
    };
    let m = Migrator::open(&root).unwrap();
    let opts = MigrateOptions {
        reserve_bytes: free + 1,
        ..MigrateOptions::default()
    };
    let e = m
        .convert(&pkg("full"), &opts, &mut no_progress)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::MigrationFailed);
    assert!(
        e.to_string().contains("package full") && e.to_string().contains("free metadata space"),
        "{e}"
    );
    assert_same(&before, &raw(&root.join("full")), "untouched");
    assert!(migrate_names(&root).is_empty());
}

#[test]
fn does_nothing_off_btrfs() {
    let fs = fs_or_skip!(LoopFs::ext4(64 * MIB));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("lnd/data/main")).unwrap();
    let m = Migrator::open(&root).unwrap();
    assert!(!m.is_btrfs());
    assert!(m.packages().unwrap().is_empty());
    let reports = m
        .run(&MigrateOptions::default(), &mut no_progress, &mut |_| {})
        .unwrap();
    assert!(reports.is_empty());
    assert!(!root.join("lnd.migrate").exists());
}

#[test]
fn missing_root_is_not_found() {
    let e = Migrator::open("/nonexistent/volumes/root")
        .err()
        .expect("must fail");
    assert_eq!(e.kind, ErrorKind::NotFound);
}

// ---- crash safety ----

/// Not a test on its own: the child process body. Converts one package
/// and removes its old directory, unless a failpoint kills it first.
#[test]
fn migrate_child() {
    let Some(root) = std::env::var_os(CHILD_ROOT_ENV) else {
        return;
    };
    let p = pkg(&std::env::var(CHILD_PKG_ENV).expect("child: package"));
    let chunk = std::env::var(CHILD_CHUNK_ENV)
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1 << 20);
    let m = Migrator::open(&root).expect("child: open");
    let r = m
        .convert(&p, &opts(chunk), &mut no_progress)
        .and_then(|r| m.remove_old(&p, &mut no_progress).map(|_| r));
    match r {
        Ok(r) => println!("CHILD-RESULT ok {:?}", r.outcome),
        Err(e) => println!("CHILD-RESULT err {} {e}", e.kind.code()),
    }
}

/// Runs the child on `package` with `failpoint`; returns its stdout and
/// whether it was SIGKILLed.
fn child(root: &Path, package: &str, failpoint: &str, chunk: u64) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "migrate_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_PKG_ENV, package)
        .env(CHILD_CHUNK_ENV, chunk.to_string())
        .env(volume::FAILPOINT_ENV, failpoint)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("spawning the child");
    (
        out.status.signal() == Some(libc::SIGKILL),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[track_caller]
fn crash(root: &Path, package: &str, failpoint: &str, chunk: u64) {
    let (killed, out) = child(root, package, failpoint, chunk);
    assert!(
        killed,
        "not killed at `{failpoint}`: are failpoints compiled in \
         (`--features volume-migrate/failpoints`)?\n{out}"
    );
}

#[test]
fn survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    // Where it dies, and whether `<pkg>` is then the new subvolume.
    let cases: &[(&str, bool)] = &[
        ("migrate.created", false),
        ("migrate.chunk@2", false),
        ("migrate.entry@1", false),
        ("migrate.entry@40", false),
        ("migrate.copied", false),
        ("migrate.durable", false),
        ("migrate.exchanged", true),
        ("migrate.old-renamed", true),
        ("migrate.remove@1", true),
        ("migrate.remove@50", true),
    ];
    for (i, (fp, swapped)) in cases.iter().enumerate() {
        let package = format!("p{i}");
        let vol = root.join(&package);
        build_rich_tree(&vol, 3 << 20);
        let before = raw(&vol);
        let flags = flags_and_blocks(&vol);
        crash(&root, &package, fp, 1 << 20);
        let when = format!("killed at `{fp}`");
        // At this instant `<pkg>` is one complete tree or the other.
        if *swapped {
            assert!(is_subvolume(&vol), "{when}: must be the new subvolume");
            assert_same(&expected_after(&before), &raw(&vol), &when);
        } else {
            assert!(
                !is_subvolume(&vol),
                "{when}: must still be the plain directory"
            );
            assert_same(&before, &raw(&vol), &when);
        }
        // The next run finishes from what is on disk.
        let m = Migrator::open(&root).unwrap();
        assert!(
            m.packages().unwrap().contains(&pkg(&package)),
            "{when}: work left"
        );
        let r = m
            .convert(&pkg(&package), &opts(1 << 20), &mut no_progress)
            .unwrap_or_else(|e| panic!("{when}: rerun: {e}"));
        let resumable = fp.starts_with("migrate.chunk")
            || fp.starts_with("migrate.entry")
            || *fp == "migrate.copied"
            || *fp == "migrate.durable"
            || *fp == "migrate.created";
        assert_eq!(r.resumed, resumable, "{when}: {r:?}");
        if *fp == "migrate.copied" || *fp == "migrate.durable" {
            assert_eq!(r.bytes_cloned, 0, "{when}: a complete copy is not redone");
        }
        m.remove_old(&pkg(&package), &mut no_progress).unwrap();
        assert_converted(&root, &package, &before, &flags);
        assert!(
            migrate_names(&root).is_empty(),
            "{when}: {:?}",
            migrate_names(&root)
        );
        assert_eq!(
            package_subvolumes(&fs, &package).len(),
            4,
            "{when}: no stray subvolume"
        );
        assert!(
            m.packages().unwrap().is_empty(),
            "{when}: nothing left to do"
        );
    }
}

/// A big file interrupted at 90% resumes at about 90%, and a source changed
/// between the interrupted run and the next is copied as it now is.
#[test]
fn resumes_large_files_where_it_stopped() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = root.join("db");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    let big = vol.join("data/main/big.mdb");
    let extents = integration::make_fragmented_file(&big, 40 << 20, 2000, 7).expect("fragmenting");
    assert!(extents >= 1000, "{extents}");
    populate_volume(&vol, true);
    let before = raw(&vol);

    // 40 chunks of 1 MiB; die after the 36th.
    crash(&root, "db", "migrate.chunk@36", 1 << 20);
    let partial = root.join("db.migrate/data/main/big.mdb");
    let len = fs::metadata(&partial)
        .expect("partial copy of the big file")
        .len();
    assert!(len >= 35 << 20, "partial copy holds {len} bytes");

    let m = Migrator::open(&root).unwrap();
    let mut first_clone = None;
    let r = m
        .convert(&pkg("db"), &opts(1 << 20), &mut |p: &Progress| {
            if p.phase == Phase::Clone && first_clone.is_none() && p.bytes_done > 0 {
                first_clone = Some(p.clone());
            }
        })
        .expect("resume");
    assert!(r.resumed);
    let total = r.estimate.unwrap().bytes;
    assert!(
        r.bytes_cloned <= total - (35 << 20),
        "resumed run cloned {} of {total} bytes",
        r.bytes_cloned
    );
    assert_same(
        &expected_after(&before),
        &raw(&root.join("db")),
        "resumed conversion",
    );
    m.remove_old(&pkg("db"), &mut no_progress).unwrap();

    // Interrupted, then the service changes the directory, then the rerun.
    let vol = root.join("db2");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    let big = vol.join("data/main/big.mdb");
    integration::make_fragmented_file(&big, 8 << 20, 200, 9).unwrap();
    populate_volume(&vol, false);
    crash(&root, "db2", "migrate.chunk@6", 1 << 20);
    std::thread::sleep(std::time::Duration::from_millis(20));
    modify_volume(&vol, false);
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&big).unwrap();
        f.write_all_at(b"changed after the crash", 4096).unwrap();
    }
    let before = raw(&vol);
    let r = m
        .convert(&pkg("db2"), &opts(1 << 20), &mut no_progress)
        .expect("rerun");
    assert_eq!(r.outcome, Outcome::Converted);
    assert_same(
        &expected_after(&before),
        &raw(&root.join("db2")),
        "changed source, converted",
    );
}

/// ENOSPC mid-copy (injected at the third clone range): the original stays
/// untouched and the partial subvolume is removed.
#[test]
fn enospc_mid_copy_removes_the_partial_subvolume() {
    let Some((fs, root)) = new_fs() else { return };
    let vol = root.join("full");
    build_rich_tree(&vol, 4 << 20);
    let before = raw(&vol);
    let (killed, out) = child(&root, "full", "migrate.chunk@3=enospc", 1 << 20);
    assert!(!killed, "{out}");
    assert!(
        out.contains(&format!(
            "CHILD-RESULT err {}",
            ErrorKind::MigrationFailed.code()
        )) && out.contains("package full")
            && out.contains("partial subvolume was removed"),
        "failpoints compiled in? child output:\n{out}"
    );
    assert!(!is_subvolume(&vol));
    assert_same(&before, &raw(&vol), "original untouched");
    assert!(migrate_names(&root).is_empty());
    assert_eq!(
        package_subvolumes(&fs, "full").len(),
        3,
        "only the original's nested subvolumes"
    );
}
