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

use common::rich::{build_carve_tree, build_rich_tree, expected_after, flags_and_blocks, setflags};
use common::*;
use integration::{LoopFs, Subvolume, TreeDigest, fs_or_skip, tree_digest};
use volume::{ErrorKind, SnapshotOutcome, VolumeKind, VolumeStore};
use volume_migrate::{Decision, Method, MigrateOptions, Migrator, Outcome, Phase, Progress};

const CHILD_ROOT_ENV: &str = "MIGRATE_CHILD_ROOT";
const CHILD_PKG_ENV: &str = "MIGRATE_CHILD_PKG";
const CHILD_CHUNK_ENV: &str = "MIGRATE_CHILD_CHUNK";
const CHILD_METHOD_ENV: &str = "MIGRATE_CHILD_METHOD";
/// Set: the child defers the cut's removal ([`MigrateOptions::defer_cut`]).
const CHILD_DEFER_ENV: &str = "MIGRATE_CHILD_DEFER";
/// Set: the child runs only `remove_all_old` (the boot's cleanup).
const CHILD_CLEANUP_ENV: &str = "MIGRATE_CHILD_CLEANUP";

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
        .filter(|n| {
            [".migrate", ".migrate-parent", ".migrate-old"]
                .iter()
                .any(|s| n.ends_with(s))
        })
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

/// After a kill, `<pkg>` at `vol` is one complete tree or the other: the
/// new subvolume once `swapped`, else the original directory.
#[track_caller]
fn assert_whole(vol: &Path, before: &TreeDigest, swapped: bool, when: &str) {
    if swapped {
        assert!(is_subvolume(vol), "{when}: must be the new subvolume");
        assert_same(&expected_after(before), &raw(vol), when);
    } else {
        assert!(
            !is_subvolume(vol),
            "{when}: must still be the plain directory"
        );
        assert_same(before, &raw(vol), when);
    }
}

/// Each of `paths` still has the digest it had before.
#[track_caller]
fn assert_untouched(paths: &[PathBuf], before: &[TreeDigest], when: &str) {
    for (path, d) in paths.iter().zip(before) {
        assert_same(
            d,
            &raw(path),
            &format!("{when}: {} untouched", path.display()),
        );
    }
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
        last.entries_done, last.entries_total,
        "every entry, the top not among them (as in the total), never past the total"
    );
    assert_eq!(root_names(&root), ["lnd", "lnd.migrate-old"]);
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
    assert_eq!(root_names(&root), ["lnd"]);
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
    // Committed first, as convert's schedule does, so the figure is the one it reads.
    rustix::fs::sync();
    let free = {
        let dir = fs::File::open(&root).unwrap();
        volume::sys::metadata_space(dir.as_fd()).unwrap().free()
    };
    let m = Migrator::open(&root).unwrap();
    let opts = MigrateOptions {
        reserve_bytes: Some(free + 1),
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
    // The refusal counts the package: its real figures, not zeros.
    let plan = m.plan().unwrap();
    let est = plan[0].estimate.expect("the dry run's estimate");
    assert!(est.entries > 0, "{est:?}");
    assert!(
        e.to_string().contains(&format!(
            "({} extents, {} entries",
            est.extents, est.entries
        )),
        "the refusal must give the dry run's figures {est:?}: {e}"
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
    let method = match std::env::var(CHILD_METHOD_ENV).as_deref() {
        Ok("clone") => Method::Clone,
        Ok("snapshot-parent") => Method::SnapshotParent,
        _ => Method::Auto,
    };
    let m = Migrator::open(&root).expect("child: open");
    if std::env::var_os(CHILD_CLEANUP_ENV).is_some() {
        match m.remove_all_old(&mut no_progress) {
            Ok(done) => println!("CHILD-RESULT ok cleaned {done:?}"),
            Err(e) => println!("CHILD-RESULT err {} {e}", e.kind.code()),
        }
        return;
    }
    let r = m
        .convert(
            &p,
            &MigrateOptions {
                method,
                defer_cut: std::env::var_os(CHILD_DEFER_ENV).is_some(),
                ..opts(chunk)
            },
            &mut no_progress,
        )
        .and_then(|r| m.remove_old(&p, &mut no_progress).map(|_| r));
    match r {
        Ok(r) => println!("CHILD-RESULT ok {:?}", r.outcome),
        Err(e) => println!("CHILD-RESULT err {} {e}", e.kind.code()),
    }
}

/// Runs the child on `package` with `failpoint`; returns its stdout and
/// whether it was SIGKILLed.
fn child(root: &Path, package: &str, failpoint: &str, chunk: u64) -> (bool, String) {
    child_with(root, package, failpoint, chunk, "auto")
}

/// [`child`] with a method: `auto`, `clone` or `snapshot-parent`.
fn child_with(
    root: &Path,
    package: &str,
    failpoint: &str,
    chunk: u64,
    method: &str,
) -> (bool, String) {
    child_run(
        root,
        package,
        failpoint,
        &[
            (CHILD_CHUNK_ENV, &chunk.to_string()),
            (CHILD_METHOD_ENV, method),
        ],
    )
}

/// Runs the child on `package` with `failpoint` and the child settings
/// `env`; returns whether it was SIGKILLed, and its stdout and stderr.
fn child_run(root: &Path, package: &str, failpoint: &str, env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "migrate_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_PKG_ENV, package)
        .envs(env.iter().copied())
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
/// Whether the child's output says its conversion failed with `kind`.
fn failed_with(out: &str, kind: ErrorKind) -> bool {
    out.contains(&format!("CHILD-RESULT err {}", kind.code()))
}

/// Kills a clone of `package` at `failpoint` (the clone's steps: Auto
/// would snapshot the parent for most packages).
fn crash(root: &Path, package: &str, failpoint: &str, chunk: u64) {
    let (killed, out) = child_with(root, package, failpoint, chunk, "clone");
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
        assert_whole(&vol, &before, *swapped, &when);
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
        failed_with(&out, ErrorKind::MigrationFailed)
            && out.contains("package full")
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

// ---- the parent-snapshot method ----

fn method_opts(method: Method) -> MigrateOptions {
    MigrateOptions {
        method,
        ..opts(1 << 20)
    }
}

/// Fills the rest of the filesystem beside the volumes: at the top, a
/// directory with a plain file, an immutable one, an append-only directory
/// and a nested subvolume; in the volumes root, another package's plain
/// directory and a converted package; an xattr and a mode on the top
/// directory itself. Returns the trees to check untouched afterwards.
fn build_rest(fs: &LoopFs, root: &Path) -> Vec<PathBuf> {
    let elsewhere = fs.path("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    fs::write(elsewhere.join("a"), b"a").unwrap();
    fs::write(elsewhere.join("frozen"), b"f").unwrap();
    fs::create_dir(elsewhere.join("append-only")).unwrap();
    fs::write(elsewhere.join("append-only/child"), b"c").unwrap();
    subvolume_create(&elsewhere.join("sub"));
    fs::write(elsewhere.join("sub/file"), b"in a subvolume").unwrap();
    setflags(&elsewhere.join("frozen"), rustix::fs::IFlags::IMMUTABLE);
    setflags(&elsewhere.join("append-only"), rustix::fs::IFlags::APPEND);
    fs::create_dir(root.join("other")).unwrap();
    fs::write(root.join("other/data"), b"other package").unwrap();
    subvolume_create(&root.join("conv"));
    fs::write(root.join("conv/data"), b"converted package").unwrap();
    rustix::fs::setxattr(
        fs.mount_point(),
        "user.top-of-fs",
        b"not the volume's",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    vec![elsewhere, root.join("other"), root.join("conv")]
}

/// Every subvolume on the filesystem, by path from the mount point.
fn all_subvolumes(fs: &LoopFs) -> Vec<String> {
    let out = integration::run(
        Command::new("btrfs")
            .args(["subvolume", "list"])
            .arg(fs.mount_point()),
    )
    .expect("btrfs subvolume list");
    let mut paths: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once(" path ").map(|(_, p)| p.to_owned()))
        .collect();
    paths.sort();
    paths
}

/// The converted digest of a carve tree whose `data.mdb` also has a link
/// outside the volume, which the volume no longer counts.
fn expected_without_outside_link(before: &TreeDigest) -> TreeDigest {
    let mut expected = expected_after(before);
    for name in [
        "data/main/db/data.mdb",
        "data/main/db/data.link",
        "data/main/elsewhere/third-name",
        "data/main/linked-frozen",
    ] {
        let entry = expected
            .entries_mut()
            .get_mut(name.as_bytes())
            .unwrap_or_else(|| panic!("{name} in the digest"));
        entry.nlink -= 1;
        if entry.nlink == 1 {
            entry.hardlink_group = None;
        }
    }
    expected
}

#[test]
fn snapshot_parent_converts_losslessly_and_leaves_the_rest_alone() {
    let Some((fs, root)) = new_fs() else { return };
    let vol = root.join("lnd");
    build_carve_tree(&vol, 3 << 20);
    let rest = build_rest(&fs, &root);
    fs::hard_link(
        vol.join("data/main/db/data.mdb"),
        fs.path("elsewhere/outside-link"),
    )
    .unwrap();
    // An immutable file with a name outside the volume too: removing that
    // name from the snapshot must not take the flag off the kept inode.
    fs::write(vol.join("data/main/linked-frozen"), b"linked").unwrap();
    fs::hard_link(
        vol.join("data/main/linked-frozen"),
        fs.path("elsewhere/frozen-link"),
    )
    .unwrap();
    setflags(
        &vol.join("data/main/linked-frozen"),
        rustix::fs::IFlags::IMMUTABLE,
    );
    let before = raw(&vol);
    let flags = flags_and_blocks(&vol);
    let rest_before: Vec<TreeDigest> = rest.iter().map(|p| raw(p)).collect();
    let subvolumes_before = all_subvolumes(&fs);

    let m = Migrator::open(&root).unwrap();
    let mut phases = Vec::new();
    let mut sink = |p: &Progress| {
        if phases.last() != Some(&p.phase) {
            phases.push(p.phase);
        }
    };
    let r = m
        .convert(&pkg("lnd"), &method_opts(Method::SnapshotParent), &mut sink)
        .expect("convert");
    assert_eq!(r.outcome, Outcome::Converted);
    assert_eq!(r.method, Some(Method::SnapshotParent));
    assert_eq!(
        phases,
        [
            Phase::Scan,
            Phase::Carve,
            Phase::Sync,
            Phase::Exchange,
            Phase::Done
        ]
    );
    assert!(is_subvolume(&vol));
    let expected = expected_without_outside_link(&before);
    assert_same(
        &expected,
        &raw(&vol),
        "converted by snapshotting the parent",
    );
    assert_eq!(flags, flags_and_blocks(&vol), "inode flags or holes differ");
    assert_eq!(
        root_names(&root),
        ["conv", "lnd", "lnd.migrate-old", "other"]
    );
    assert_same(
        &before,
        &raw(&root.join("lnd.migrate-old")),
        "old directory",
    );
    assert_untouched(&rest, &rest_before, "converted");
    let mut subvolumes_after = subvolumes_before.clone();
    subvolumes_after.push("volumes/lnd".to_owned());
    subvolumes_after.sort();
    assert_eq!(all_subvolumes(&fs), subvolumes_after, "no stray subvolume");

    assert!(m.remove_old(&pkg("lnd"), &mut no_progress).unwrap());
    assert_eq!(root_names(&root), ["conv", "lnd", "other"]);
    assert_same(&expected, &raw(&vol), "after removing the old directory");
    // The outside links now count one name fewer: the old directory's.
    for (path, d) in rest.iter().zip(&rest_before) {
        assert_same(
            &d.clone().without("outside-link").without("frozen-link"),
            &raw(path).without("outside-link").without("frozen-link"),
            &format!("{} untouched", path.display()),
        );
    }
    let link = fs::File::open(fs.path("elsewhere/frozen-link")).unwrap();
    assert!(
        rustix::fs::ioctl_getflags(&link)
            .unwrap()
            .contains(rustix::fs::IFlags::IMMUTABLE),
        "removing the old directory kept the outside link's flag"
    );
    let store = VolumeStore::open(&root).unwrap();
    assert_eq!(
        store.snapshot(&pkg("lnd")).unwrap(),
        SnapshotOutcome::Snapshot
    );
    assert!(store.drop_backup(&pkg("lnd")).unwrap());
}

/// Auto snapshots the parent for every package, small or large, also
/// where the volumes root is itself a subvolume's root and for a flat
/// volume (its top entries are lifted before the exchange), and clones
/// once the rest outside the packages is more than every package's
/// snapshot may shed.
#[test]
fn auto_snapshots_the_parent_wherever_a_snapshot_serves() {
    let Some((fs, root)) = new_fs() else { return };
    let auto = method_opts(Method::Auto);
    let m = Migrator::open(&root).unwrap();
    let fragmented = |vol: &Path, extents: u64, seed: u64| {
        fs::create_dir_all(vol.join("data/main")).unwrap();
        let got = integration::make_fragmented_file(
            &vol.join("data/main/db.mdb"),
            extents * 8192,
            extents,
            seed,
        )
        .expect("fragmenting");
        assert!(got >= extents * 9 / 10, "{got} extents");
        populate_volume(vol, false);
    };
    let convert = |m: &Migrator, root: &Path, name: &str| -> Method {
        let vol = root.join(name);
        let before = raw(&vol);
        let r = m
            .convert(&pkg(name), &auto, &mut no_progress)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.outcome, Outcome::Converted, "{name}");
        assert_eq!(r.fallback, None, "{name}: converted as planned");
        assert_same(&expected_after(&before), &raw(&vol), name);
        r.method.expect("a method")
    };

    fs::create_dir_all(root.join("small/data/main")).unwrap();
    populate_volume(&root.join("small"), false);
    fragmented(&root.join("big"), 8000, 1);
    let planned: Vec<_> = m
        .plan()
        .unwrap()
        .into_iter()
        .map(|e| (e.package.to_string(), e.method()))
        .collect();
    assert_eq!(
        planned,
        [
            ("big".to_owned(), Some(Method::SnapshotParent)),
            ("small".to_owned(), Some(Method::SnapshotParent))
        ],
        "the dry run tells the method"
    );
    assert_eq!(convert(&m, &root, "small"), Method::SnapshotParent);
    assert_eq!(convert(&m, &root, "big"), Method::SnapshotParent);

    // The volumes root as the root of its own subvolume.
    let own = fs.path("own-volumes");
    subvolume_create(&own);
    fragmented(&own.join("solo"), 8000, 2);
    let own_m = Migrator::open(&own).unwrap();
    assert_eq!(convert(&own_m, &own, "solo"), Method::SnapshotParent);
    assert_eq!(root_names(&own), ["solo", "solo.migrate-old"]);

    // Nothing beside it, but every entry at its top, each lifted.
    let flat_root = fs.path("flat-volumes");
    subvolume_create(&flat_root);
    fs::create_dir(flat_root.join("flat")).unwrap();
    for i in 0..5000 {
        fs::File::create(flat_root.join(format!("flat/f{i}"))).unwrap();
    }
    let flat_m = Migrator::open(&flat_root).unwrap();
    assert_eq!(
        flat_m.plan().unwrap()[0].method(),
        Some(Method::SnapshotParent)
    );
    assert_eq!(convert(&flat_m, &flat_root, "flat"), Method::SnapshotParent);

    // More beside the packages than their snapshots may shed: a clone.
    fragmented(&root.join("big2"), 8000, 3);
    fs::create_dir(fs.path("ballast")).unwrap();
    let over = volume_migrate::REST_MAX_US / volume_migrate::cost::CUT_ENTRY_US + 1;
    for i in 0..over {
        fs::File::create(fs.path(format!("ballast/{i}"))).unwrap();
    }
    assert_eq!(convert(&m, &root, "big2"), Method::Clone);
    assert!(
        migrate_names(&root)
            .iter()
            .all(|n| n.ends_with(".migrate-old"))
    );
}

/// A run's schedule reads the mount tables once, before any package
/// converts; each package is checked again just before its own conversion.
/// A mount made in between (a service started since) is refused there, and
/// data written after the schedule's commit, never flushed, is in the cut:
/// the snapshot writes out what it is taken of.
#[test]
fn a_package_is_checked_and_flushed_when_it_converts_not_only_when_planned() {
    let Some((fs, root)) = new_fs() else { return };
    let opts = method_opts(Method::Auto);
    for name in ["busy", "late"] {
        fs::create_dir_all(root.join(name).join("data/main")).unwrap();
        populate_volume(&root.join(name), false);
    }
    let m = Migrator::open(&root).unwrap();
    let plan = m.schedule(&[pkg("busy"), pkg("late")], &opts).unwrap();
    assert!(
        plan.iter()
            .all(|p| p.decision == Some(Decision::SnapshotParent) && p.refused.is_none()),
        "{plan:?}"
    );

    let busy_before = raw(&root.join("busy"));
    let bind = MountGuard::bind(&root.join("busy/data/main"), &fs.path("bindmnt"));
    let err = m
        .convert_planned(&plan[0], &opts, &mut no_progress)
        .expect_err("a mount made after the schedule must be refused");
    assert_eq!(err.kind, ErrorKind::InvalidRequest, "{err}");
    assert!(err.to_string().contains("mounted at"), "{err}");
    assert_same(
        &busy_before,
        &raw(&root.join("busy")),
        "busy after the refusal",
    );
    assert!(!is_subvolume(&root.join("busy")));
    assert!(
        migrate_names(&root).is_empty(),
        "{:?}",
        migrate_names(&root)
    );
    bind.unmount();

    // Written after the schedule's commit, still in the page cache.
    let late = bytes(7, 3 << 20);
    fs::write(root.join("late/data/main/late.bin"), &late).unwrap();
    let before = raw(&root.join("late"));
    let r = m
        .convert_planned(&plan[1], &opts, &mut no_progress)
        .expect("convert late");
    assert_eq!(r.method, Some(Method::SnapshotParent));
    assert_same(&expected_after(&before), &raw(&root.join("late")), "late");
    assert_eq!(
        fs::read(root.join("late/data/main/late.bin")).unwrap(),
        late
    );
}

/// The forced method is refused, with nothing changed, for a volume holding
/// a nested subvolume; while the rest of the parent holds a NOCOW or a
/// preallocated file (which a snapshot would make copy on their next
/// write), or a mount hiding part of it; and where the parent's root is out
/// of reach (a bind mount of a subdirectory). Auto clones there instead.
#[test]
fn snapshot_parent_is_refused_where_it_cannot_apply() {
    let Some((fs, root)) = new_fs() else { return };
    let vol = root.join("nested");
    build_rich_tree(&vol, 0);
    let before = raw(&vol);
    let m = Migrator::open(&root).unwrap();
    let e = m
        .convert(
            &pkg("nested"),
            &method_opts(Method::SnapshotParent),
            &mut no_progress,
        )
        .expect_err("nested subvolumes");
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert!(e.to_string().contains("nested subvolumes"), "{e}");
    assert_same(&before, &raw(&vol), "refused: untouched");
    assert_eq!(root_names(&root), ["nested"]);
    let r = m
        .convert(&pkg("nested"), &method_opts(Method::Auto), &mut no_progress)
        .unwrap();
    assert_eq!(r.method, Some(Method::Clone));
    assert_same(&expected_after(&before), &raw(&vol), "cloned instead");
    // Its NOCOW files would keep the next one from snapshotting the parent.
    m.remove_old(&pkg("nested"), &mut no_progress).unwrap();

    let plain = root.join("plain");
    fs::create_dir_all(plain.join("data/main")).unwrap();
    populate_volume(&plain, false);
    let plain_before = raw(&plain);
    let refused = |why: &str| {
        let e = m
            .convert(
                &pkg("plain"),
                &method_opts(Method::SnapshotParent),
                &mut no_progress,
            )
            .expect_err(why);
        assert_eq!(e.kind, ErrorKind::InvalidRequest, "{why}: {e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert_same(&plain_before, &raw(&plain), why);
        assert!(migrate_names(&root).is_empty(), "{why}");
    };
    let nocow = fs.path("nocow.db");
    fs::File::create(&nocow).unwrap();
    setflags(&nocow, rustix::fs::IFlags::NOCOW);
    fs::write(&nocow, bytes(8, 100_000)).unwrap();
    refused("NOCOW or preallocated");
    fs::remove_file(&nocow).unwrap();
    let prealloc = fs::File::create(fs.path("prealloc.log")).unwrap();
    rustix::fs::fallocate(&prealloc, rustix::fs::FallocateFlags::empty(), 0, 1 << 20).unwrap();
    drop(prealloc);
    refused("NOCOW or preallocated");
    fs::remove_file(fs.path("prealloc.log")).unwrap();
    let hiding = MountGuard::tmpfs(&fs.path("hidden"));
    refused("is mounted inside");
    hiding.unmount();

    // Bind-mount a subdirectory: `..` from the volumes root leaves the mount.
    let inner = fs.path("deep/volumes");
    fs::create_dir_all(inner.join("db/data/main")).unwrap();
    populate_volume(&inner.join("db"), false);
    let mount = MountGuard::bind(&inner, &fs.path("bound"));
    let bound = Migrator::open(mount.target()).unwrap();
    let e = bound
        .convert(
            &pkg("db"),
            &method_opts(Method::SnapshotParent),
            &mut no_progress,
        )
        .expect_err("unreachable parent root");
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert!(e.to_string().contains("not reachable"), "{e}");
    let r = bound
        .convert(&pkg("db"), &method_opts(Method::Auto), &mut no_progress)
        .unwrap();
    assert_eq!(r.method, Some(Method::Clone));
    drop(bound);
    mount.unmount();
    let r = m
        .convert(
            &pkg("plain"),
            &method_opts(Method::SnapshotParent),
            &mut no_progress,
        )
        .expect("nothing in the way any more");
    assert_eq!(r.method, Some(Method::SnapshotParent));
    assert_same(&expected_after(&plain_before), &raw(&plain), "plain");
}

#[test]
fn snapshot_parent_survives_a_crash_at_every_step() {
    let Some((fs, root)) = new_fs() else { return };
    let rest = build_rest(&fs, &root);
    // Where it dies, and whether `<pkg>` is then the new subvolume.
    let cases: &[(&str, bool)] = &[
        ("migrate.parent-snapshot", false),
        ("migrate.carve-held", false),
        ("migrate.carve-removed@1", false),
        ("migrate.carve-removed@2", false),
        ("migrate.carve-lifted@1", false),
        ("migrate.carve-lifted@3", false),
        ("migrate.durable", false),
        ("migrate.exchanged", true),
        ("migrate.old-renamed", true),
    ];
    for (i, (fp, swapped)) in cases.iter().enumerate() {
        let package = format!("p{i}");
        let vol = root.join(&package);
        build_carve_tree(&vol, 1 << 20);
        let before = raw(&vol);
        let flags = flags_and_blocks(&vol);
        let rest_before: Vec<TreeDigest> = rest.iter().map(|p| raw(p)).collect();
        let subvolumes_before = all_subvolumes(&fs);
        let (killed, out) = child_with(&root, &package, fp, 1 << 20, "snapshot-parent");
        assert!(
            killed,
            "not killed at `{fp}`: failpoints compiled in?\n{out}"
        );
        let when = format!("killed at `{fp}`");
        assert_whole(&vol, &before, *swapped, &when);
        assert_untouched(&rest, &rest_before, &when);
        // The next run finishes from what is on disk, whatever the method.
        let m = Migrator::open(&root).unwrap();
        let r = m
            .convert(&pkg(&package), &method_opts(Method::Auto), &mut no_progress)
            .unwrap_or_else(|e| panic!("{when}: rerun: {e}"));
        let outcome = if *fp == "migrate.old-renamed" {
            Outcome::AlreadySubvolume
        } else if *swapped {
            Outcome::Finished
        } else {
            Outcome::Converted
        };
        assert_eq!(r.outcome, outcome, "{when}: {r:?}");
        m.remove_old(&pkg(&package), &mut no_progress).unwrap();
        assert!(is_subvolume(&vol), "{when}");
        assert_same(&expected_after(&before), &raw(&vol), &when);
        assert_eq!(flags, flags_and_blocks(&vol), "{when}: flags or holes");
        assert!(
            migrate_names(&root).is_empty(),
            "{when}: {:?}",
            migrate_names(&root)
        );
        let mut expected = subvolumes_before;
        expected.push(format!("volumes/{package}"));
        expected.sort();
        assert_eq!(all_subvolumes(&fs), expected, "{when}: no stray subvolume");
        assert_untouched(&rest, &rest_before, &when);
    }
}

/// A failing cut (injected after the first removal, or for Auto's deferred
/// cut after the first entry set aside) deletes the snapshot and leaves
/// `<pkg>` untouched: the forced method reports it, Auto clones instead,
/// except when space ran out.
#[test]
fn a_failed_cut_deletes_the_snapshot() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = fragmented_db(&root);
    let before = raw(&vol);
    for (fp, method, converted) in [
        ("migrate.carve-removed@1=eio", "snapshot-parent", false),
        // Auto's cut is deferred: it fails while setting the rest aside.
        ("migrate.carve-set-aside@1=enospc", "auto", false),
        ("migrate.carve-set-aside@1=eio", "auto", true),
    ] {
        let when = format!("{fp} with {method}");
        let (killed, out) = child_with(&root, "db", fp, 1 << 20, method);
        assert!(!killed, "{when}: {out}");
        assert!(
            migrate_names(&root)
                .iter()
                .all(|n| n.ends_with(".migrate-old")),
            "{when}: {:?}",
            migrate_names(&root)
        );
        if converted {
            assert!(out.contains("CHILD-RESULT ok Converted"), "{when}: {out}");
            assert!(is_subvolume(&vol), "{when}");
            assert_same(&expected_after(&before), &raw(&vol), &when);
        } else {
            assert!(
                failed_with(&out, ErrorKind::MigrationFailed)
                    && out.contains("is untouched and the snapshot was deleted"),
                "failpoints compiled in? {when}:\n{out}"
            );
            assert!(!is_subvolume(&vol), "{when}");
            assert_same(&before, &raw(&vol), &when);
        }
    }
}

/// Deciding that fails (an I/O error counting the rest) fails no
/// conversion: Auto clones, and says why.
#[test]
fn a_failure_while_deciding_clones() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = fragmented_db(&root);
    let before = raw(&vol);
    let m = Migrator::open(&root).unwrap();
    let planned = m.plan().unwrap();
    assert_eq!(
        planned
            .iter()
            .find(|p| p.package == pkg("db"))
            .and_then(|p| p.decision.clone()),
        Some(volume_migrate::Decision::SnapshotParent),
        "without the failure: {planned:?}"
    );
    let (killed, out) = child(&root, "db", "migrate.decide=eio", 1 << 20);
    assert!(!killed, "{out}");
    assert!(out.contains("CHILD-RESULT ok Converted"), "{out}");
    assert!(is_subvolume(&vol));
    assert_same(&expected_after(&before), &raw(&vol), "cloned");
    assert_nothing_left(&root);
}

/// A volume whose top is immutable cannot be exchanged (the kernel refuses
/// to rename an immutable directory): the conversion says so before it
/// copies anything, and leaves the package directory as it was, nothing
/// beside it.
#[test]
fn an_immutable_top_is_refused_and_left_untouched() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = root.join("db");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    fs::write(vol.join("data/main/db"), b"data").unwrap();
    setflags(&vol, rustix::fs::IFlags::IMMUTABLE);
    let before = raw(&vol);
    let (killed, out) = child(&root, "db", "none", 1 << 20);
    assert!(!killed, "{out}");
    assert!(
        failed_with(&out, ErrorKind::InvalidRequest) && out.contains("is immutable or append-only"),
        "{out}"
    );
    assert!(!is_subvolume(&vol));
    assert_same(&before, &raw(&vol), "untouched");
    assert_nothing_left(&root);
    setflags(&vol, rustix::fs::IFlags::empty());
}

/// A deferred cut's rest, its removal killed just after the rest's own
/// rmdir (before the removal is reported): the rerun finds the rest gone,
/// removes its record, and the volume is exactly the package directory it
/// was, the top's times included.
#[test]
fn a_kill_as_the_rest_leaves_loses_nothing() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = fragmented_db(&root);
    fs::write(root.join("beside"), b"in the rest").unwrap();
    let before = raw(&vol);
    let flags = flags_and_blocks(&vol);

    let (killed, said) = child_run(
        &root,
        "db",
        "migrate.rest-rmdir",
        &[
            (CHILD_METHOD_ENV, "snapshot-parent"),
            (CHILD_DEFER_ENV, "1"),
        ],
    );
    assert!(
        killed,
        "not killed at migrate.rest-rmdir: failpoints compiled in?\n{said}"
    );
    assert!(is_subvolume(&vol), "converted before the kill");
    assert!(
        fs::symlink_metadata(root.join("db.migrate-rest")).is_ok(),
        "the record outlives the kill: {:?}",
        root_names(&root)
    );

    let m = Migrator::open(&root).unwrap();
    assert!(m.remove_old(&pkg("db"), &mut no_progress).unwrap());
    assert_same(&expected_after(&before), &raw(&vol), "after the rerun");
    assert_eq!(flags, flags_and_blocks(&vol), "flags or holes");
    assert_nothing_left(&root);
}

/// A copy of the volume that an interrupted restore may yet make the volume
/// again (`<pkg>.rollback` here) holds the deferred cut's rest too: the
/// rest's record stays while it exists, so the rest is removed again after
/// such a restore; once it is gone, the record goes.
#[test]
fn a_copy_a_restore_may_bring_back_keeps_the_rests_record() {
    let Some((_fs, root)) = new_fs() else { return };
    let vol = fragmented_db(&root);
    fs::write(root.join("beside"), b"in the rest").unwrap();
    let m = Migrator::open(&root).unwrap();
    let r = m
        .convert(
            &pkg("db"),
            &MigrateOptions {
                method: Method::SnapshotParent,
                defer_cut: true,
                ..opts(1 << 20)
            },
            &mut no_progress,
        )
        .unwrap();
    assert_eq!(r.outcome, Outcome::Converted);
    let record = root.join("db.migrate-rest");
    assert!(fs::symlink_metadata(&record).is_ok(), "a deferred cut");
    integration::run(
        Command::new("btrfs")
            .args(["subvolume", "snapshot"])
            .arg(&vol)
            .arg(root.join("db.rollback")),
    )
    .unwrap();
    assert!(m.remove_old(&pkg("db"), &mut no_progress).unwrap());
    assert!(
        fs::symlink_metadata(&record).is_ok(),
        "the record outlives the removal while db.rollback holds the rest"
    );
    integration::run(
        Command::new("btrfs")
            .args(["subvolume", "delete"])
            .arg(root.join("db.rollback")),
    )
    .unwrap();
    assert!(m.remove_old(&pkg("db"), &mut no_progress).unwrap());
    assert!(
        fs::symlink_metadata(&record).is_err(),
        "the record goes with the last copy"
    );
}

/// No name of volume-migrate's is left under `root`.
#[track_caller]
fn assert_nothing_left(root: &Path) {
    let left = migrate_names(root);
    assert!(left.is_empty(), "left under {}: {left:?}", root.display());
}

/// `<root>/db`, a plain package directory holding an 8,000-extent
/// database: enough for Auto to choose the parent snapshot.
fn fragmented_db(root: &Path) -> PathBuf {
    let vol = root.join("db");
    fs::create_dir_all(vol.join("data/main")).unwrap();
    integration::make_fragmented_file(&vol.join("data/main/db.mdb"), 8000 * 8192, 8000, 5)
        .expect("fragmenting");
    vol
}

/// `depth` directories one in another under `top`, a file at the bottom,
/// made level by level through directory fds (no path is that long).
fn nest(top: &Path, depth: usize) {
    fs::create_dir_all(top).unwrap();
    let mut dir = fs::File::open(top).unwrap();
    for _ in 0..depth {
        rustix::fs::mkdirat(&dir, "d", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        let next = rustix::fs::openat(
            &dir,
            "d",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        dir = fs::File::from(next);
    }
    let f = rustix::fs::openat(
        &dir,
        "bottom",
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
        rustix::fs::Mode::from_raw_mode(0o644),
    )
    .unwrap();
    rustix::io::write(&f, b"at the bottom").unwrap();
}

/// How many `d` directories [`nest`] made under `top`, and what the bottom
/// file says (walked through fds: the path is too long for a name).
fn nested(top: &Path) -> (usize, Vec<u8>) {
    let mut dir = fs::File::open(top).unwrap();
    let mut depth = 0;
    loop {
        match rustix::fs::openat(
            &dir,
            "d",
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::NOFOLLOW,
            rustix::fs::Mode::empty(),
        ) {
            Ok(next) => {
                dir = fs::File::from(next);
                depth += 1;
            }
            Err(rustix::io::Errno::NOENT) => break,
            Err(e) => panic!("walking {}: {e}", top.display()),
        }
    }
    let f = rustix::fs::openat(
        &dir,
        "bottom",
        rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let mut buf = vec![0u8; 64];
    let n = rustix::io::read(&f, &mut buf).unwrap();
    buf.truncate(n);
    (depth, buf)
}

/// A package nests directories as deep as it likes. Through start-core's
/// boot (its tasks), both a package nested 20,000 levels deep and one
/// `copy::MAX_DEPTH` levels deep convert by snapshot (a snapshot has no
/// depth bound), and the cleanup removes the deep tree from the other's
/// rest. Through the CLI with `--method clone`, the one nested
/// `copy::MAX_DEPTH` levels deep converts, old tree removed, and the
/// deeper one is refused with one line naming it, left exactly as it was
/// with nothing beside it. (20,000 levels used to overflow a thread's
/// stack and abort the process.)
#[test]
fn trees_deeper_than_the_copy_bound_convert_by_snapshot_and_a_clone_refuses_them() {
    let limit = volume::copy::MAX_DEPTH;
    for way in ["core", "cli"] {
        let Some((_fs, root)) = new_fs() else { return };
        nest(&root.join("deep"), 20_000);
        nest(&root.join("ok"), limit - 1);
        match way {
            "core" => {
                let ids: Vec<String> = vec!["deep".into(), "ok".into()];
                let mut progress = integration::compare::Progress::new();
                // One runtime: the cleanup task is the boot's.
                let boot = integration::compare::block_on(async {
                    let mut boot = startos_core::volume::boot_volume_maintenance_at(
                        &root,
                        &ids,
                        &ids,
                        &mut progress,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("core's boot: {e}"));
                    if let Some(cleanup) = boot.cleanup.take() {
                        cleanup.await.expect("cleanup task").expect("cleanup");
                    }
                    boot
                });
                assert_eq!(progress.ready.len(), 2, "{:?}", progress.ready);
                assert!(boot.failed.is_empty(), "{:?}", boot.failed);
                assert!(is_subvolume(&root.join("deep")), "{way}");
            }
            _ => {
                let out = Command::new(volume_migrate_bin())
                    .arg("--root")
                    .arg(&root)
                    .args(["--method", "clone"])
                    .env_remove("RUST_LOG")
                    .stdin(Stdio::null())
                    .output()
                    .expect("running volume-migrate");
                assert_eq!(out.status.code(), Some(1), "{out:?}");
                let err = String::from_utf8_lossy(&out.stderr).into_owned();
                assert_eq!(common::cli::said(&err).len(), 1, "one line: {err}");
                assert!(err.contains("package deep"), "{err}");
                assert!(
                    err.contains("nested deeper than 2048 levels"),
                    "{way}: {err}"
                );
                assert!(!is_subvolume(&root.join("deep")), "{way}");
            }
        }
        assert!(is_subvolume(&root.join("ok")), "{way}");
        assert_eq!(
            nested(&root.join("ok")),
            (limit - 1, b"at the bottom".to_vec()),
            "{way}"
        );
        assert_eq!(
            nested(&root.join("deep")),
            (20_000, b"at the bottom".to_vec()),
            "{way}"
        );
        assert!(
            migrate_names(&root).is_empty(),
            "{way}: {:?}",
            migrate_names(&root)
        );
    }
}

/// What a package's count must find, from a walk of its own: every entry,
/// each regular file once (hardlinks), its size, and its extent items as a
/// search of that one inode returns them.
fn counted_by_hand(top: &Path) -> (u64, u64, u64, u64) {
    use std::collections::HashSet;
    use std::os::unix::fs::MetadataExt;
    let (mut entries, mut files, mut bytes, mut extents) = (0, 0, 0, 0);
    let mut seen = HashSet::new();
    let mut dirs = vec![top.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let fd = fs::File::open(&dir).unwrap();
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let m = fs::symlink_metadata(e.path()).unwrap();
            entries += 1;
            if m.is_dir() {
                dirs.push(e.path());
            } else if m.is_file() && seen.insert(m.ino()) {
                files += 1;
                bytes += m.len();
                let range =
                    volume::sys::KeyRange::inode_items(m.ino(), volume::sys::EXTENT_DATA_KEY);
                volume::sys::search(fd.as_fd(), range, |_, _| {
                    extents += 1;
                    std::ops::ControlFlow::Continue(())
                })
                .unwrap();
            }
        }
    }
    (entries, files, bytes, extents)
}

/// The count reads a directory's files in runs of inode numbers: one
/// package's files created between another's fragmented ones (their inode
/// numbers interleaved), small inline files, hardlinks, a symlink and a
/// FIFO are counted exactly as one search per file counts them.
#[test]
fn counts_match_each_files_own_items_whatever_the_inode_order() {
    let Some((_fs, root)) = new_fs() else { return };
    for p in ["alpha/data", "alpha/data/sub", "beta/data"] {
        fs::create_dir_all(root.join(p)).unwrap();
    }
    for i in 0..300u64 {
        let len = if i % 3 == 0 { 900 } else { 6000 };
        fs::write(
            root.join(format!("alpha/data/f{i}")),
            vec![i as u8 | 1; len],
        )
        .unwrap();
        integration::make_fragmented_file(
            &root.join(format!("beta/data/g{i}")),
            64 * 1024,
            8,
            i + 1,
        )
        .expect("fragmenting");
    }
    fs::hard_link(root.join("alpha/data/f1"), root.join("alpha/data/sub/hard")).unwrap();
    fs::hard_link(root.join("alpha/data/f2"), root.join("alpha/data/hard2")).unwrap();
    std::os::unix::fs::symlink("f1", root.join("alpha/data/link")).unwrap();
    integration::run(Command::new("mkfifo").arg(root.join("alpha/data/sub/fifo"))).unwrap();
    rustix::fs::sync();

    let m = Migrator::open(&root).unwrap();
    for e in m.plan().unwrap() {
        let est = e.estimate.expect("counted");
        let want = counted_by_hand(&root.join(e.package.as_str()));
        assert_eq!(
            (est.entries, est.files, est.bytes, est.extents),
            want,
            "{}: entries, files, bytes, extents",
            e.package
        );
        // Interleaved or not, neither package's count holds the other's.
        assert!(want.3 >= 300, "{}: {} extents", e.package, want.3);
    }
}

/// A clone's small files are shared between the walk and helper threads
/// (one per core beyond the first): the copy is still whole, every entry
/// is reported once, in the walk's thread, and a copy stopped by its
/// progress callback has no helper writing into it once it returned.
#[test]
fn a_clone_shares_its_small_files_with_helpers_and_loses_nothing() {
    use std::collections::HashSet;
    let Some((_fs, root)) = new_fs() else { return };
    let src = root.join("src");
    build_rich_tree(&src, 1 << 20);
    for d in 0..6 {
        let dir = src.join(format!("many/{d}"));
        fs::create_dir_all(&dir).unwrap();
        for i in 0..250 {
            let f = dir.join(format!("{i}"));
            fs::write(&f, vec![(d * 7 + i) as u8; 100 + 37 * i]).unwrap();
            if i % 5 == 0 {
                let v = format!("{d}-{i}");
                rustix::fs::setxattr(&f, "user.k", v.as_bytes(), rustix::fs::XattrFlags::empty())
                    .unwrap();
            }
        }
    }
    let before = raw(&src);
    let flags = flags_and_blocks(&src);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let copy = |dst: &Path, fail_at: Option<usize>| {
        subvolume_create(dst);
        let (s, d) = (fs::File::open(&src).unwrap(), fs::File::open(dst).unwrap());
        let mut entries = Vec::new();
        let on_walk = std::thread::current().id();
        let opts = volume::copy::CopyOptions {
            chunk_bytes: Some(1 << 20),
            nested_subvolumes: true,
            ..Default::default()
        };
        let r = volume::copy::reflink_into(s.as_fd(), d.as_fd(), &opts, &mut |ev| {
            assert_eq!(std::thread::current().id(), on_walk, "events on the walk");
            if let volume::copy::CopyEvent::Entry { rel } = ev {
                entries.push(rel.to_path_buf());
                if Some(entries.len()) == fail_at {
                    return Err(std::io::Error::other("stopped by the test"));
                }
            }
            Ok(())
        });
        (r, entries)
    };

    let whole = root.join("whole");
    let (r, entries) = copy(&whole, None);
    let stats = r.expect("copy");
    assert_same(&expected_after(&before), &raw(&whole), "the copy");
    assert_eq!(flags, flags_and_blocks(&whole), "flags and blocks");
    let unique: HashSet<_> = entries.iter().collect();
    assert_eq!(unique.len(), entries.len(), "each entry reported once");
    assert_eq!(
        entries.len() as u64,
        stats.entries + 1,
        "every entry and the top"
    );
    if cores > 1 {
        assert!(stats.helped_files > 100, "{stats:?}");
    } else {
        assert_eq!(stats.helped_files, 0, "{stats:?}");
    }

    let stopped = root.join("stopped");
    let (r, entries) = copy(&stopped, Some(700));
    let e = r.expect_err("stopped");
    assert_eq!(e.to_string(), "stopped by the test");
    assert_eq!(entries.len(), 700);
    let at_return = raw(&stopped);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_same(
        &at_return,
        &raw(&stopped),
        "nothing written after the return",
    );
}

/// The boot's cleanup goes on past a package it cannot clean: with the
/// first entry of the first package's rest failing to go (EIO), it fails
/// with that error once every other package is done, that package's rest
/// and record kept for the next cleanup, which removes them.
#[test]
fn a_cleanup_that_fails_for_one_package_still_cleans_the_others() {
    let Some((_fs, root)) = new_fs() else { return };
    for p in ["alpha", "bravo"] {
        fs::create_dir_all(root.join(p).join("data/main")).unwrap();
        populate_volume(&root.join(p), false);
    }
    let before: Vec<_> = ["alpha", "bravo"]
        .iter()
        .map(|p| raw(&root.join(p)))
        .collect();
    let m = Migrator::open(&root).unwrap();
    let opts = MigrateOptions {
        defer_cut: true,
        remove_old: false,
        ..MigrateOptions::default()
    };
    let reports = m.run(&opts, &mut no_progress, &mut |_| {}).unwrap();
    assert!(
        reports
            .iter()
            .all(|r| r.method == Some(Method::SnapshotParent)),
        "{reports:?}"
    );
    let rest = |p: &str| root.join(p).join(integration::identity::CARVE_REST);
    assert!(rest("alpha").is_dir() && rest("bravo").is_dir());

    let (_, said) = child_run(
        &root,
        "alpha",
        "migrate.rest-removed@1=eio",
        &[(CHILD_CLEANUP_ENV, "1")],
    );
    assert!(
        said.contains("CHILD-RESULT err"),
        "failpoints compiled in?\n{said}"
    );
    assert!(rest("alpha").exists(), "alpha's rest, kept: {said}");
    assert!(fs::symlink_metadata(root.join("alpha.migrate-rest")).is_ok());
    assert!(
        !rest("bravo").exists(),
        "bravo cleaned all the same: {said}"
    );
    assert!(
        !root.join("bravo.migrate-old").exists(),
        "{:?}",
        root_names(&root)
    );

    m.remove_all_old(&mut no_progress).unwrap();
    assert!(!rest("alpha").exists());
    assert!(
        migrate_names(&root).is_empty(),
        "{:?}",
        migrate_names(&root)
    );
    for (p, b) in ["alpha", "bravo"].iter().zip(&before) {
        assert_same(&expected_after(b), &raw(&root.join(p)), p);
    }
}

/// The running transaction's id (`fs_info->generation`) of the btrfs on
/// `device`, from sysfs.
fn running_transaction(device: &Path) -> u64 {
    let out = Command::new("blkid")
        .args(["-s", "UUID", "-o", "value"])
        .arg(device)
        .output()
        .expect("blkid");
    let uuid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    fs::read_to_string(format!("/sys/fs/btrfs/{uuid}/generation"))
        .expect("the filesystem's generation")
        .trim()
        .parse()
        .expect("a number")
}

/// Nothing is committed between a clone's creation and its first read, so
/// a source file written in the very transaction that created the partial
/// copy, after the copy cloned it, must count as changed when the copy is
/// resumed. Killed with files copied, every source file is rewritten before
/// that transaction commits (`commit=300`; checked from the filesystem's
/// generation, attempts repeated if something else committed meanwhile);
/// the resumed clone holds the new bytes.
#[test]
fn a_resumed_clone_copies_again_what_changed_in_its_creating_transaction() {
    // noatime: the test's own reads must mark nothing changed, or the
    // resume starts over and proves nothing.
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        integration::FsKind::Btrfs,
        512 << 20,
        "commit=300,noatime"
    ));
    let root = volumes_root(&fs);
    let mut same_transaction = 0;
    for attempt in 0..4 {
        let name = format!("app{attempt}");
        let main = root.join(&name).join("data/main");
        fs::create_dir_all(&main).expect("mkdir");
        for i in 0..60 {
            fs::write(
                main.join(format!("f{i}")),
                bytes(i, 5000 + i as usize * 997),
            )
            .expect("write");
        }
        integration::run(&mut Command::new("sync")).expect("sync");
        let (killed, _, out) =
            common::cli::cli_run_with(&root, &["--method", "clone"], Some("migrate.entry@30"));
        assert!(killed, "{out}");
        for i in 0..60 {
            let f = fs::OpenOptions::new()
                .write(true)
                .open(main.join(format!("f{i}")))
                .expect("open");
            std::os::unix::fs::FileExt::write_all_at(&f, b"CHANGED", 0).expect("rewrite");
        }
        let copy = fs::File::open(root.join(format!("{name}.migrate"))).expect("the partial copy");
        let created = volume::sys::subvolume_info(copy.as_fd())
            .expect("subvolume info")
            .created_transid;
        drop(copy);
        if running_transaction(fs.device()) == created {
            same_transaction += 1;
        }
        let (killed, _, out) = common::cli::cli_run_with(&root, &["--method", "clone"], None);
        assert!(!killed, "{out}");
        assert!(out.contains("\"resumed\":true"), "{out}");
        for i in 0..60 {
            let mut want = bytes(i, 5000 + i as usize * 997);
            want[..7].copy_from_slice(b"CHANGED");
            let got = fs::read(main.join(format!("f{i}"))).expect("read");
            assert!(got == want, "{name}/f{i}: the resumed clone lost a write");
        }
        if same_transaction > 0 {
            break;
        }
    }
    assert!(
        same_transaction > 0,
        "no attempt wrote in the creating transaction"
    );
}
