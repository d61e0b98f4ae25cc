//! The light packages cloned beside heavy ones (issue 31 item 1,
//! `CloneReason::Light`), converted as start-core's boot does
//! (`Migrator::convert_each`): a pool killed with several light clones in
//! flight loses nothing, converts nothing twice and resumes each partial
//! clone; unsynced writes of every kind are in the clones and in resumed
//! ones; a light package with a NOCOW file stays a snapshot; one a clone
//! cannot copy falls back to its snapshot; a box without heavy packages
//! keeps the rest bound of shares. (From a hostile review's probes.)

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use common::{boot_opts, converted, is_subvolume, root_names, uuid_of};
use integration::identity::{Identity, identities};
use integration::{FsKind, LoopFs, fs_or_skip};
use volume_migrate::{CloneReason, Decision, Migrator, Planned, Progress};

const CHILD_ROOT_ENV: &str = "LIGHT_CLONES_ROOT";

/// The boot's schedule of every package of `m`'s root, those to convert.
fn boot_plan(m: &Migrator) -> Vec<Planned> {
    m.schedule(&m.packages().unwrap(), &boot_opts())
        .unwrap()
        .into_iter()
        .filter(|p| p.decision.is_some())
        .collect()
}

/// `heavy` packages `h<i>` of `heavy_files` files and `light` packages
/// `l<ii>` of `light_files` files, each file distinct.
fn build(root: &Path, heavy: usize, heavy_files: usize, light: usize, light_files: usize) {
    let make = |name: String, files: usize, seed: usize| {
        let d = root.join(&name).join("data");
        fs::create_dir_all(&d).unwrap();
        for f in 0..files {
            fs::write(d.join(format!("f{f}")), format!("{name} {seed} {f}")).unwrap();
        }
    };
    for i in 0..heavy {
        make(format!("h{i}"), heavy_files + i, i);
    }
    for i in 0..light {
        make(format!("l{i:02}"), light_files, 100 + i);
    }
}

type Before = BTreeMap<String, (BTreeMap<PathBuf, Identity>, BTreeMap<PathBuf, Vec<u8>>)>;

fn contents(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir.join("data")).unwrap() {
        let e = e.unwrap();
        out.insert(
            Path::new("data").join(e.file_name()),
            fs::read(e.path()).unwrap(),
        );
    }
    out
}

fn before_of(root: &Path) -> Before {
    root_names(root)
        .into_iter()
        .filter(|n| !n.contains('.'))
        .map(|p| {
            let dir = root.join(&p);
            (p, (identities(&dir).unwrap(), contents(&dir)))
        })
        .collect()
}

/// The boot's conversion: a schedule, then `convert_each`.
fn boot_convert(root: &Path) -> Vec<(Planned, Result<volume_migrate::PackageReport, String>)> {
    let m = Migrator::open(root).unwrap();
    let opts = boot_opts();
    let planned = boot_plan(&m);
    let outs = m.convert_each(&planned, &opts, &mut |_: &Progress| {}, &|_, _| {});
    planned
        .into_iter()
        .zip(outs)
        .map(|(p, r)| (p, r.map_err(|e| e.to_string())))
        .collect()
}

#[test]
fn light_clones_child() {
    let Some(root) = std::env::var_os(CHILD_ROOT_ENV) else {
        return;
    };
    for (p, r) in boot_convert(Path::new(&root)) {
        println!(
            "CHILD {} {:?} {:?}",
            p.package,
            p.decision,
            r.map(|r| r.outcome)
        );
    }
}

fn child(root: &Path, failpoint: &str) -> (bool, String) {
    common::cli::child_test(
        "light_clones_child",
        &[(CHILD_ROOT_ENV, root.as_os_str())],
        failpoint,
    )
}

fn is_light(p: &Planned) -> bool {
    matches!(p.decision, Some(Decision::Clone(CloneReason::Light { .. })))
}

/// Kills the boot's pool with several light clones in flight, converts
/// again, cleans up: nothing lost, nothing converted twice, the
/// snapshotted packages keeping every identity, each partial clone
/// resumed.
fn kill_sweep(heavy: usize, heavy_files: usize, light: usize, kills: &[&str]) {
    for fp in kills {
        let fs = fs_or_skip!(LoopFs::with_mount_options(
            FsKind::Btrfs,
            1 << 30,
            "commit=1"
        ));
        let root = fs.path("volumes");
        fs::create_dir_all(&root).unwrap();
        build(&root, heavy, heavy_files, light, 40);
        let before = before_of(&root);
        let when = format!("{heavy}h+{light}l killed at `{fp}`");
        let planned = {
            let m = Migrator::open(&root).unwrap();
            m.schedule(&m.packages().unwrap(), &boot_opts()).unwrap()
        };
        let lights: Vec<String> = planned
            .iter()
            .filter(|p| is_light(p))
            .map(|p| p.package.to_string())
            .collect();
        assert!(lights.len() >= 4, "{when}: {planned:?}");
        let (killed, out) = child(&root, fp);
        assert!(killed, "{when}: not killed\n{out}");
        let names = root_names(&root);
        let partial: Vec<String> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".migrate").map(str::to_owned))
            .collect();
        let in_flight: Vec<&String> = names.iter().filter(|n| n.contains(".migrate")).collect();
        eprintln!("{when}: left {in_flight:?}");
        let finished = converted(&root, before.keys());
        let again = boot_convert(&root);
        for (p, r) in &again {
            let r = r
                .as_ref()
                .unwrap_or_else(|e| panic!("{when}: {} failed on rerun: {e}", p.package));
            if partial.contains(&p.package.to_string()) {
                assert_eq!(
                    p.decision,
                    Some(Decision::Clone(CloneReason::Resume)),
                    "{when}: {}",
                    p.package
                );
                assert!(r.resumed, "{when}: {} not resumed: {r:?}", p.package);
            }
        }
        Migrator::open(&root)
            .unwrap()
            .remove_all_old(&mut |_: &Progress| {})
            .expect("the cleanup");
        for (p, (ids, data)) in &before {
            let dir = root.join(p);
            assert!(is_subvolume(&dir), "{when}: {p} not converted");
            assert_eq!(&contents(&dir), data, "{when}: {p}: contents");
            assert_eq!(root_names(&dir), ["data"], "{when}: {p}: top");
            if !lights.contains(p) {
                let now = identities(&dir).unwrap();
                let kept = integration::identity::Kept::of(ids, &now);
                assert_eq!(kept.shares().0, 1.0, "{when}: {p}: identities");
            }
        }
        for (p, uuid) in &finished {
            assert_eq!(&uuid_of(&root.join(p)), uuid, "{when}: {p} converted again");
        }
        let left: Vec<_> = root_names(&root)
            .into_iter()
            .filter(|n| n.contains('.'))
            .collect();
        assert!(left.is_empty(), "{when}: left over: {left:?}");
    }
}

/// Below SPLIT_MIN: one heavy package, seven light (four cloned).
#[test]
fn small_box_killed_with_light_clones_in_flight() {
    kill_sweep(
        1,
        200,
        7,
        &[
            "migrate.entry@60",
            "migrate.copied@3",
            "migrate.durable@3",
            "migrate.exchanged@4",
        ],
    );
}

/// Writes, without any sync, data of every kind into the light package
/// `dir` (which has `data/f*` files): an overwrite in place with the old
/// mtime put back, an append, a preallocated file partly written, a
/// sparse file, a NOCOW file, a small (inline) file; returns what each
/// file must hold.
fn dirty(dir: &Path, seed: u64) -> BTreeMap<PathBuf, Vec<u8>> {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::FileExt;
    let mut want = BTreeMap::new();
    let d = dir.join("data");
    // In place, same size, the mtime put back.
    let f0 = d.join("f0");
    let old = fs::metadata(&f0).unwrap().modified().unwrap();
    let len = fs::read(&f0).unwrap().len();
    let new = vec![b'Z'; len];
    fs::OpenOptions::new()
        .write(true)
        .open(&f0)
        .unwrap()
        .write_all_at(&new, 0)
        .unwrap();
    fs::File::options()
        .write(true)
        .open(&f0)
        .unwrap()
        .set_modified(old)
        .unwrap();
    want.insert(PathBuf::from("data/f0"), new);
    // An append.
    let f1 = d.join("f1");
    let mut a = fs::read(&f1).unwrap();
    let more = common::bytes(seed, 200_000);
    fs::OpenOptions::new()
        .append(true)
        .open(&f1)
        .unwrap()
        .write_all(&more)
        .unwrap();
    a.extend_from_slice(&more);
    want.insert(PathBuf::from("data/f1"), a);
    // Preallocated 1 MiB, 100 KiB written at 300 KiB.
    let pre = d.join("prealloc");
    let f = fs::File::create(&pre).unwrap();
    rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::KEEP_SIZE, 0, 1 << 20).unwrap();
    let body = common::bytes(seed + 1, 100 << 10);
    f.write_all_at(&body, 300 << 10).unwrap();
    let mut p = vec![0u8; 300 << 10];
    p.extend_from_slice(&body);
    want.insert(PathBuf::from("data/prealloc"), p);
    // Sparse: data, a hole, data.
    let sp = d.join("sparse");
    let mut f = fs::File::create(&sp).unwrap();
    let (x, y) = (common::bytes(seed + 2, 8192), common::bytes(seed + 3, 5000));
    f.write_all(&x).unwrap();
    f.seek(SeekFrom::Start(4 << 20)).unwrap();
    f.write_all(&y).unwrap();
    let mut s = x.clone();
    s.resize(4 << 20, 0);
    s.extend_from_slice(&y);
    want.insert(PathBuf::from("data/sparse"), s);
    // NOCOW.
    let nc = d.join("nocow");
    fs::File::create(&nc).unwrap();
    common::rich::setflags(&nc, rustix::fs::IFlags::NOCOW);
    let n = common::bytes(seed + 4, 300_000);
    fs::write(&nc, &n).unwrap();
    want.insert(PathBuf::from("data/nocow"), n);
    // Inline.
    fs::write(d.join("f2"), b"tiny, rewritten").unwrap();
    want.insert(PathBuf::from("data/f2"), b"tiny, rewritten".to_vec());
    want
}

/// Data written to the light packages after the schedule, never synced,
/// is in their clones (no commit before a light clone).
#[test]
fn light_clone_holds_unsynced_writes() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, 2, 900, 16, 40);
    let m = Migrator::open(&root).unwrap();
    let opts = boot_opts();
    let planned = boot_plan(&m);
    let mut before = before_of(&root);
    for (i, p) in planned.iter().filter(|p| is_light(p)).enumerate() {
        let want = dirty(&root.join(p.package.as_str()), i as u64 * 10);
        before.get_mut(p.package.as_str()).unwrap().1.extend(want);
    }
    let outs = m.convert_each(&planned, &opts, &mut |_: &Progress| {}, &|_, _| {});
    for (p, r) in planned.iter().zip(&outs) {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{}: {e}", p.package));
        if is_light(p) {
            assert_eq!(r.method, Some(volume_migrate::Method::Clone), "{r:?}");
            assert!(r.nocow_files > 0, "{r:?}");
        }
    }
    m.remove_all_old(&mut |_: &Progress| {}).unwrap();
    assert_holds(&root, &before);
}

/// Every package of `before` under `root` a subvolume holding every file
/// `before` says it must, byte for byte.
fn assert_holds(root: &Path, before: &Before) {
    for (p, (_, data)) in before {
        assert!(is_subvolume(&root.join(p)), "{p}");
        let now = contents(&root.join(p));
        for (f, want) in data {
            assert!(now.get(f) == Some(want), "{p}/{}: differs", f.display());
        }
    }
}

/// The same writes made between a run killed with light clones in flight
/// and the next: each resumed clone copies them.
#[test]
fn resumed_light_clone_holds_writes_made_since() {
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        1 << 30,
        "commit=1"
    ));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, 2, 900, 16, 40);
    let mut before = before_of(&root);
    let (killed, out) = child(&root, "migrate.entry@250");
    assert!(killed, "{out}");
    let partial: Vec<String> = root_names(&root)
        .iter()
        .filter_map(|n| n.strip_suffix(".migrate").map(str::to_owned))
        .collect();
    assert!(partial.len() >= 4, "{partial:?}");
    for (i, p) in partial.iter().enumerate() {
        let want = dirty(&root.join(p), 1000 + i as u64 * 10);
        before.get_mut(p.as_str()).unwrap().1.extend(want);
    }
    let again = boot_convert(&root);
    for (p, r) in &again {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{}: {e}", p.package));
        if partial.contains(&p.package.to_string()) {
            assert!(r.resumed, "{r:?}");
        }
    }
    Migrator::open(&root)
        .unwrap()
        .remove_all_old(&mut |_: &Progress| {})
        .unwrap();
    assert_holds(&root, &before);
}

/// A light package with a NOCOW file stays a snapshot of the parent (its
/// clone's NOCOW files would share their extents with the old copies the
/// shares being cut still hold, each first write a copy): planned so, it
/// keeps every identity; the light ones beside it are cloned.
#[test]
fn a_light_package_with_a_nocow_file_stays_a_snapshot() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, 5, 900, 15, 40);
    let pinned = ["l00", "l01", "l02"];
    for l in pinned {
        let nc = root.join(l).join("data/nocow");
        fs::File::create(&nc).unwrap();
        common::rich::setflags(&nc, rustix::fs::IFlags::NOCOW);
        fs::write(&nc, common::bytes(5, 4 << 20)).unwrap();
    }
    let before = before_of(&root);
    let m = Migrator::open(&root).unwrap();
    let opts = boot_opts();
    let planned = boot_plan(&m);
    assert!(planned.iter().any(|p| !p.shares.is_empty()), "{planned:?}");
    for p in &planned {
        let name = p.package.as_str();
        let light = name.starts_with('l') && !pinned.contains(&name);
        assert_eq!(is_light(p), light, "{p:?}");
    }
    let outs = m.convert_each(&planned, &opts, &mut |_: &Progress| {}, &|_, _| {});
    for (p, r) in planned.iter().zip(&outs) {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{}: {e}", p.package));
        if pinned.contains(&p.package.as_str()) {
            assert_eq!(
                r.method,
                Some(volume_migrate::Method::SnapshotParent),
                "{r:?}"
            );
        }
    }
    m.remove_all_old(&mut |_: &Progress| {}).unwrap();
    for (p, (ids, data)) in &before {
        let dir = root.join(p);
        assert_eq!(&contents(&dir), data, "{p}");
        if pinned.contains(&p.as_str()) {
            let kept = integration::identity::Kept::of(ids, &identities(&dir).unwrap());
            assert_eq!(kept.shares().0, 1.0, "{p}: identities");
        }
    }
}

/// A light package a clone cannot copy (btrfs refuses the reflink and the
/// copy's checksums cannot be made its source's: the failpoint) where a
/// snapshot would serve: Auto converts it by the snapshot the plan would
/// otherwise have taken, as it does for a resumed clone that turns out
/// unclonable (`carve_after_unclonable`), instead of failing it.
#[test]
fn unclonable_light_package_falls_back_to_its_snapshot() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, 1, 200, 7, 40);
    let before = before_of(&root);
    let planned = {
        let m = Migrator::open(&root).unwrap();
        m.schedule(&m.packages().unwrap(), &boot_opts()).unwrap()
    };
    assert!(
        planned.iter().filter(|p| is_light(p)).count() >= 4,
        "{planned:?}"
    );
    integration::run(
        std::process::Command::new("mount")
            .arg("-o")
            .arg("remount,nodatasum")
            .arg(fs.mount_point()),
    )
    .unwrap();
    let out = std::process::Command::new(common::volume_migrate_bin())
        .arg("--root")
        .arg(&root)
        .env(volume::FAILPOINT_ENV, "copy.checksums=eperm")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let failed: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("volume-migrate: ") && !l.contains("progress"))
        .collect();
    for (p, (_, data)) in &before {
        assert_eq!(&contents(&root.join(p)), data, "{p}");
    }
    assert!(
        out.status.success() && before.keys().all(|p| is_subvolume(&root.join(p))),
        "light packages a snapshot would have converted failed:\n{}",
        failed.join("\n")
    );
}

/// From SPLIT_MIN on, a box with no heavy package clones none as light
/// and shares cuts: the rest outside the packages is shed twice (the
/// dominant package's snapshot and the top share's), so it may be up to
/// REST_MAX_US / 2 of cutting. A version that counted it against
/// REST_MAX_US / PARENT_SNAPSHOTS_MAX whatever the box held cloned every
/// package for a rest between the two (here about 0.75 s), none keeping
/// its inode numbers, where each is snapshotted.
#[test]
fn a_box_without_heavy_packages_keeps_the_rest_bound_of_shares() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, 0, 0, volume_migrate::SPLIT_MIN, 40);
    let outside = fs.path("outside");
    fs::create_dir_all(&outside).unwrap();
    // 13,000 entries: 0.75 s at CUT_ENTRY_US, under 1 s, over 0.67 s.
    for i in 0..13_000 {
        fs::File::create(outside.join(format!("o{i}"))).unwrap();
    }
    let m = Migrator::open(&root).unwrap();
    let planned = m.schedule(&m.packages().unwrap(), &boot_opts()).unwrap();
    assert_eq!(planned.len(), volume_migrate::SPLIT_MIN);
    for p in &planned {
        assert_eq!(
            p.decision,
            Some(Decision::SnapshotParent),
            "{}: {:?}",
            p.package,
            p.decision
        );
    }
}

const CHILD_ONE_ENV: &str = "LIGHT_CLONES_ONE";

/// The child of [`a_slow_light_clone_checks_the_mounts_again`] and
/// [`a_share_member_checks_the_mounts_again_after_its_cut`]: converts the
/// package `LIGHT_CLONES_ONE` of the boot's plan of `LIGHT_CLONES_ROOT`,
/// alone, as planned, and prints the outcome.
#[test]
fn light_clone_one_child() {
    let (Some(root), Some(pkg)) = (
        std::env::var_os(CHILD_ROOT_ENV),
        std::env::var(CHILD_ONE_ENV).ok(),
    ) else {
        return;
    };
    let m = Migrator::open(Path::new(&root)).unwrap();
    let planned = boot_plan(&m);
    let p = planned
        .iter()
        .find(|p| p.package.as_str() == pkg)
        .expect("the package planned");
    let r = m.convert_planned(p, &boot_opts(), &mut |_: &Progress| {});
    println!(
        "CHILD {:?}",
        r.map(|r| r.outcome).map_err(|e| e.to_string())
    );
}

/// Builds a box of `heavy` packages of 900 files and `light` of 40, and
/// converts the first package of its boot's plan that `pick` picks, in a
/// child stopped at `failpoint`, making a bind mount of its `data`
/// directory meanwhile and letting it go on 400 ms later; asserts the
/// conversion was refused naming the mount and saying `while_`, and left
/// the volume and the mount untouched.
fn mounted_while_stopped(
    (heavy, light): (usize, usize),
    pick: impl Fn(&Planned) -> bool,
    failpoint: &str,
    while_: &str,
) {
    use std::process::{Command, Stdio};
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    build(&root, heavy, 900, light, 40);
    let pkg = {
        let m = Migrator::open(&root).unwrap();
        boot_plan(&m)
            .into_iter()
            .find(|p| pick(p))
            .expect("a package to pick")
            .package
            .to_string()
    };
    let pkg = pkg.as_str();
    let root = root.as_path();
    let data = root.join(pkg).join("data");
    let before = contents(&root.join(pkg));
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "light_clone_one_child", "--nocapture"])
        .args(["--test-threads=1"])
        .env(volume::FAILPOINT_ENV, format!("{failpoint}=stop"))
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_ONE_ENV, pkg)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let state = || {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while state() != Some('T') {
        assert!(
            matches!(state(), Some(s) if s != 'Z') && std::time::Instant::now() < deadline,
            "the child never stopped at {failpoint}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let bind = common::MountGuard::bind(&data, &fs.path("bindmnt"));
    std::thread::sleep(std::time::Duration::from_millis(400));
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::CONT,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        said.contains("CHILD Err") && said.contains("mounted at") && said.contains(while_),
        "{pkg}, exchanged with a mount made while {while_}: {said}"
    );
    assert!(!is_subvolume(&root.join(pkg)), "{pkg} converted");
    assert_eq!(contents(&root.join(pkg)), before);
    fs::write(bind.target().join("through"), b"still the volume").unwrap();
    assert_eq!(fs::read(data.join("through")).unwrap(), b"still the volume");
    bind.unmount();
}

/// A light clone has no mount check of its own before its exchange (its
/// window is a snapshot's), but one that turns out slow (here: stopped
/// past the background commit interval, 250 ms, while a mount is made
/// from inside its volume) is checked again: refused, the volume and the
/// mount untouched. Without, it is exchanged, the mount left on the old
/// tree that the cleanup removes.
#[test]
fn a_slow_light_clone_checks_the_mounts_again() {
    mounted_while_stopped((2, 16), is_light, "migrate.entry@2", "it was cloned");
}

/// A share's member is checked for mounts when its conversion starts, then
/// waits for its share's cut (a second or more at 150 packages), with the
/// services of the packages converted before it running: one mount made
/// from inside its volume meanwhile (here: stopped in the cut) refuses it,
/// the volume and the mount untouched. Without the check after the cut,
/// it is exchanged, the mount left on the old tree that the cleanup
/// removes.
#[test]
fn a_share_member_checks_the_mounts_again_after_its_cut() {
    mounted_while_stopped(
        (5, 11),
        |p| !p.shares.is_empty(),
        "migrate.share-removed@1",
        "its shared cut was made",
    );
}
