//! `Migrator::convert_each` (the `pool` module), as start-core's boot
//! converts: the box of `migrate_split` (48 packages, shares) converted
//! several packages at once, killed at failpoints with several in flight
//! (a child process), then converted again; a member written while the
//! pool runs; the light packages beside heavy ones cloned at once, killed
//! in flight; fallback clones one at a time; a NOCOW copy left in a busy
//! package's rest not reported removed; a panic failing one package only.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::box48::{Before, PACKAGES, assert_kept, before_of, boxed, contents, spawn_stopped};
use common::{boot_opts, converted, is_subvolume, root_names, uuid_of};
use integration::{FsKind, LoopFs, fs_or_skip};
use volume_migrate::{CloneReason, Decision, MigrateOptions, Migrator, Progress};

const CHILD_ROOT_ENV: &str = "POOL_PROBE_ROOT";

/// The boot's conversion, as start-core calls it: a schedule, then
/// `convert_each`; prints each package's outcome.
fn boot_convert(root: &Path) -> Vec<String> {
    let m = Migrator::open(root).unwrap();
    let opts = boot_opts();
    let planned = m.schedule(&m.packages().unwrap(), &opts).unwrap();
    let planned: Vec<_> = planned
        .into_iter()
        .filter(|p| p.decision.is_some())
        .collect();
    let outs = m.convert_each(&planned, &opts, &mut |_: &Progress| {}, &|_, _| {});
    planned
        .iter()
        .zip(outs)
        .filter_map(|(p, r)| match r {
            Ok(r) => {
                println!("SHARE {} {:?}", p.package, r.share);
                None
            }
            Err(e) => Some(format!("{}: {e}", p.package)),
        })
        .collect()
}

/// Child mode: the boot's conversion of the root in the environment.
#[test]
fn pool_child() {
    let Some(root) = std::env::var_os(CHILD_ROOT_ENV) else {
        return;
    };
    let failed = boot_convert(Path::new(&root));
    println!("CHILD-FAILED {failed:?}");
}

fn child(root: &Path, failpoint: &str) -> (bool, String) {
    common::cli::child_test(
        "pool_child",
        &[(CHILD_ROOT_ENV, root.as_os_str())],
        failpoint,
    )
}

/// SIGKILL of the pool (several packages in flight, shares being cut),
/// then the next boot's pool, then the cleanup: every package its
/// subvolume with every identity and byte, those converted before the kill
/// not converted again, nothing left over.
#[test]
fn a_pool_killed_in_flight_loses_nothing() {
    const KILLS: &[&str] = &[
        "migrate.share-removed@1",
        "migrate.share-removed@700",
        "migrate.share-taken@4",
        "migrate.parent-snapshot@6",
        "migrate.rest-recorded@9",
        "migrate.durable@12",
        "migrate.exchanged@15",
    ];
    for fp in KILLS {
        // One-second commits: a thread of the killed child still waiting
        // in BTRFS_IOC_START_SYNC (a wake-up this kernel sometimes misses;
        // the process's own kick thread died with it, see
        // `volume::sys::COMMIT_START_PATIENCE`) holds the child's pipes
        // until some commit comes, by default the 30 s periodic one.
        let fs = fs_or_skip!(LoopFs::with_mount_options(
            FsKind::Btrfs,
            1 << 30,
            "commit=1"
        ));
        let (root, _, before) = boxed(&fs);
        let (when, finished) = kill_then_boot(&root, fp, &before);
        assert_kept(&before, &root, &when);
        assert_nothing_redone(&root, &before, &finished, &when);
    }
}

/// Kills the boot's pool of the box under `root` (which held `before`) at
/// `fp`, then boots again and cleans up; returns the case's name and the
/// packages the kill found converted, with their subvolumes' UUIDs.
fn kill_then_boot(root: &Path, fp: &str, before: &Before) -> (String, Vec<(String, [u8; 16])>) {
    let when = format!("killed at `{fp}`");
    let (killed, out) = child(root, fp);
    assert!(killed, "{when}: not killed\n{out}");
    let in_flight: Vec<String> = root_names(root)
        .into_iter()
        .filter(|n| n.contains(".migrate"))
        .collect();
    eprintln!("{when}: left {in_flight:?}");
    let finished = converted(root, before.keys());
    let failed = boot_convert(root);
    assert!(
        failed.is_empty(),
        "{when}: failed on the next boot: {failed:?}"
    );
    Migrator::open(root)
        .unwrap()
        .remove_all_old(&mut |_: &Progress| {})
        .expect("the cleanup");
    (when, finished)
}

/// After [`kill_then_boot`]: every package's top as built, none `finished`
/// before the kill converted again, nothing left over.
fn assert_nothing_redone(
    root: &Path,
    before: &Before,
    finished: &[(String, [u8; 16])],
    when: &str,
) {
    for p in before.keys() {
        let dir = root.join(p);
        assert_eq!(root_names(&dir), ["assets", "data"], "{when}: {p}: top");
    }
    for (p, uuid) in finished {
        assert_eq!(&uuid_of(&root.join(p)), uuid, "{when}: {p} converted again");
    }
    let left: Vec<_> = root_names(root)
        .into_iter()
        .filter(|n| !n.starts_with("pkg") || n.contains('.'))
        .collect();
    assert!(left.is_empty(), "{when}: left over: {left:?}");
}

/// The 48-package box with four packages made heavy (past the weighing's
/// cap: 1,200 more files each): its root and what every package holds.
fn heavy_box(fs: &LoopFs) -> (PathBuf, Before) {
    let (root, _, _) = boxed(fs);
    for p in HEAVY {
        let dir = root.join(p).join("data");
        for f in 0..1200 {
            fs::write(dir.join(format!("h{f}")), format!("{p} {f}")).unwrap();
        }
    }
    let before = before_of(&root);
    (root, before)
}

/// The heavy packages of [`heavy_box`].
const HEAVY: [&str; 4] = ["pkg07", "pkg20", "pkg33", "pkg40"];

/// The light packages of a box holding heavy ones are cloned, named with
/// why, several at once in the pool (the heavy ones snapshotted); SIGKILL
/// with several clones in flight, then the next boot's pool, then the
/// cleanup: every package its subvolume with every byte, the heavy ones
/// with every identity, those converted before the kill not converted
/// again, nothing left over.
#[test]
fn light_clones_killed_in_flight_lose_nothing() {
    const KILLS: &[&str] = &[
        "migrate.entry@150",
        "migrate.copied@6",
        "migrate.durable@9",
        "migrate.exchanged@14",
        "migrate.old-renamed@30",
    ];
    for (i, fp) in KILLS.iter().enumerate() {
        let fs = fs_or_skip!(LoopFs::with_mount_options(
            FsKind::Btrfs,
            1 << 30,
            "commit=1"
        ));
        let (root, before) = heavy_box(&fs);
        if i == 0 {
            let m = Migrator::open(&root).unwrap();
            let plan = m.schedule(&m.packages().unwrap(), &boot_opts()).unwrap();
            for p in &plan {
                let heavy = HEAVY.contains(&p.package.as_str());
                let light = matches!(
                    p.decision,
                    Some(Decision::Clone(CloneReason::Light { heavy: 4, .. }))
                );
                assert_eq!(light, !heavy, "{p:?}");
            }
        }
        let (when, finished) = kill_then_boot(&root, fp, &before);
        let (heavy, light): (Before, Before) = before
            .clone()
            .into_iter()
            .partition(|(p, _)| HEAVY.contains(&p.as_str()));
        assert_kept(&heavy, &root, &when);
        for (p, (_, data)) in &light {
            let dir = root.join(p);
            assert!(is_subvolume(&dir), "{when}: {p} not converted");
            assert_eq!(&contents(&dir), data, "{when}: {p}: contents");
        }
        assert_nothing_redone(&root, &before, &finished, &when);
    }
}

/// The pool stopped once a member has its share in hand (several others
/// in flight); the two packages last in the schedule are written (a new
/// file, an overwrite in place); the pool goes on. Both keep the write
/// (snapshotted from the parent), every other member takes its share.
#[test]
fn a_member_written_while_the_pool_runs_keeps_the_write() {
    use std::io::Write;
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let (root, _, mut before) = boxed(&fs);
    let order: Vec<String> = {
        let m = Migrator::open(&root).unwrap();
        m.schedule(&m.packages().unwrap(), &boot_opts())
            .unwrap()
            .into_iter()
            .map(|p| p.package.to_string())
            .collect()
    };
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "pool_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ROOT_ENV, &root);
    let child = spawn_stopped(cmd, "migrate.share-taken@3");
    let (added, overwritten) = (
        order[order.len() - 1].clone(),
        order[order.len() - 2].clone(),
    );
    assert!(!is_subvolume(&root.join(&added)) && !is_subvolume(&root.join(&overwritten)));
    fs::write(root.join(&added).join("data/late"), b"written late").unwrap();
    let f0 = root.join(&overwritten).join("data/f0");
    let new = vec![b'X'; fs::read(&f0).unwrap().len()];
    fs::OpenOptions::new()
        .write(true)
        .open(&f0)
        .and_then(|mut f| f.write_all(&new))
        .unwrap();
    before
        .get_mut(&added)
        .unwrap()
        .1
        .insert(PathBuf::from("data/late"), b"written late".to_vec());
    before
        .get_mut(&overwritten)
        .unwrap()
        .1
        .insert(PathBuf::from("data/f0"), new);
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("CHILD-FAILED []"), "{text}");
    assert_kept(&before, &root, "");
    let mut taken = 0;
    for l in text.lines().filter(|l| l.starts_with("SHARE ")) {
        let p = l.split(' ').nth(1).unwrap();
        if p == added || p == overwritten {
            assert!(l.contains("written after transaction"), "{l}");
        } else if l.contains("Taken(") {
            taken += 1;
        }
    }
    assert_eq!(taken, PACKAGES - 3, "{text}");
}

/// Packages the schedule said to snapshot, whose parent can no longer be
/// snapshotted when their turn comes (a mount appeared inside it), clone
/// instead: one at a time, as the pool's docs say of clones ("several at
/// once would only interleave their I/O and add up their memory", and
/// each one's free-space check reads a space the others are spending).
#[test]
fn fallback_clones_in_the_pool_run_one_at_a_time() {
    use std::collections::BTreeSet;
    use std::sync::Mutex;
    use volume_migrate::Phase;
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    for i in 0..8u64 {
        let d = root.join(format!("pkg{i}/data"));
        fs::create_dir_all(&d).unwrap();
        for f in 0..64u64 {
            fs::write(
                d.join(format!("f{f}")),
                common::bytes(i * 1000 + f, 64 << 10),
            )
            .unwrap();
        }
    }
    let m = Migrator::open(&root).unwrap();
    let opts = boot_opts();
    let planned = m.schedule(&m.packages().unwrap(), &opts).unwrap();
    assert!(
        planned
            .iter()
            .all(|p| p.decision == Some(volume_migrate::Decision::SnapshotParent)),
        "{planned:?}"
    );
    fs::create_dir_all(fs.path("mnt")).unwrap();
    let _mount = common::MountGuard::tmpfs(&fs.path("mnt"));
    let cloning = Mutex::new(BTreeSet::new());
    let most = Mutex::new(0usize);
    let outs = m.convert_each(
        &planned,
        &opts,
        &mut |pr: &Progress| {
            let mut c = cloning.lock().unwrap();
            if pr.phase == Phase::Clone {
                c.insert(pr.package.clone());
            } else if pr.phase != Phase::Scan {
                c.remove(&pr.package);
            }
            let mut m = most.lock().unwrap();
            *m = (*m).max(c.len());
        },
        &|_, _| {},
    );
    for (p, r) in planned.iter().zip(&outs) {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{}: {e}", p.package));
        assert_eq!(r.method, Some(volume_migrate::Method::Clone), "{r:?}");
    }
    let most = *most.lock().unwrap();
    assert!(most <= 1, "{most} clones at once");
}

/// A cloned package's NOCOW files' old copies in another package's rest
/// go before its service starts (`release_in_place`), or the report does
/// not say they went: with that package's lock held for 3 s by someone
/// else (a volume operation on the ready package), the clone either waits
/// and removes the copy, or reports `old_removed: false`.
#[test]
fn a_nocow_copy_left_in_a_busy_rest_is_not_reported_removed() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(root.join("p/data")).unwrap();
    fs::write(root.join("p/data/x"), b"p's").unwrap();
    fs::create_dir_all(root.join("c/db")).unwrap();
    let nocow = root.join("c/db/nocow");
    fs::File::create(&nocow).unwrap();
    common::rich::setflags(&nocow, rustix::fs::IFlags::NOCOW);
    fs::write(&nocow, common::bytes(7, 1 << 20)).unwrap();
    let m = Migrator::open(&root).unwrap();
    let opts = boot_opts();
    let planned = m.schedule(&m.packages().unwrap(), &opts).unwrap();
    let p = planned.iter().find(|x| x.package.as_str() == "p").unwrap();
    assert_eq!(p.decision, Some(volume_migrate::Decision::SnapshotParent));
    m.convert_planned(p, &opts, &mut |_: &Progress| {}).unwrap();
    let rest: Vec<_> = fs::read_dir(root.join("p"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "data")
        .collect();
    assert_eq!(rest.len(), 1, "{rest:?}");
    let copy = root.join("p").join(&rest[0]).join("volumes/c/db/nocow");
    assert!(copy.exists(), "the rest holds c's old tree");
    let root_dir = fs::File::open(&root).unwrap();
    let held = {
        use std::os::fd::AsFd;
        volume::lock::LockDir::for_root(root_dir.as_fd())
            .unwrap()
            .lock(&common::pkg("p"))
            .unwrap()
    };
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(3));
        drop(held);
    });
    let clone = MigrateOptions {
        method: volume_migrate::Method::Clone,
        ..boot_opts()
    };
    let r = m
        .convert(&common::pkg("c"), &clone, &mut |_: &Progress| {})
        .unwrap();
    release.join().unwrap();
    assert!(r.nocow_files > 0, "{r:?}");
    assert!(
        !(r.old_removed && copy.exists()),
        "reported removed, but the old copy of its NOCOW file is still in p's rest: {r:?}"
    );
}

/// A panic while converting one package (here its progress callback) is
/// that package's failure, as `convert_each`'s docs say of a failing
/// package ("does not stop the others"): not a panic of the whole call,
/// which loses every other outcome (start-core's boot maintenance then
/// fails as a whole, its `failed` list and the shares' deletion lost).
#[test]
fn a_panic_in_one_conversion_fails_only_that_package() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    for i in 0..8 {
        let d = root.join(format!("pkg{i}/data"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("f"), format!("{i}")).unwrap();
    }
    let m = Migrator::open(&root).unwrap();
    let opts = boot_opts();
    let planned = m.schedule(&m.packages().unwrap(), &opts).unwrap();
    let outs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.convert_each(
            &planned,
            &opts,
            &mut |p: &Progress| {
                if p.package.as_str() == "pkg3" {
                    panic!("a bug while converting pkg3");
                }
            },
            &|_, _| {},
        )
    }));
    let outs = outs.unwrap_or_else(|_| panic!("convert_each panicked: every outcome lost"));
    for (p, r) in planned.iter().zip(&outs) {
        assert_eq!(
            r.is_err(),
            p.package.as_str() == "pkg3",
            "{}: {r:?}",
            p.package
        );
    }
}
