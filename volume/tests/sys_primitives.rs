//! Every subvolume primitive of `volume::sys` on a loop-mounted btrfs.
//!
//! `make test` runs this file twice: with the default backend (btrfs's
//! ioctls through rustix) and with `--features volume/btrfsutil`
//! (libbtrfsutil), so both must give the same answers.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use test_fs::{LoopFs, fs_or_skip};
use volume::sys;

const SIZE: u64 = 256 << 20;

fn open(path: &Path) -> OwnedFd {
    sys::open_dir_path(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

fn name(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn write(path: &Path, data: &str) {
    fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn is_subvolume(path: &Path) -> bool {
    sys::is_subvolume(open(path).as_fd()).expect("is_subvolume")
}

fn read_only(path: &Path) -> bool {
    sys::is_read_only(open(path).as_fd()).expect("is_read_only")
}

fn mtime(path: &Path) -> (i64, i64) {
    let m = fs::symlink_metadata(path).expect("stat");
    (m.mtime(), m.mtime_nsec())
}

/// Sets a directory's times to a fixed instant in the past, unlike any a
/// test could produce by changing it now.
fn age(path: &Path, secs: i64) {
    let fd = open(path);
    let t = (secs, 123_456_789);
    sys::set_times(
        fd.as_fd(),
        &sys::Times {
            access: t,
            modification: t,
        },
    )
    .expect("set times");
}

fn paths(v: &[&str]) -> Vec<PathBuf> {
    v.iter().map(PathBuf::from).collect()
}

/// The paths of the subvolumes nested in the one at `path`, in listing order.
fn listed(path: &Path) -> Vec<PathBuf> {
    let fd = open(path);
    let nested = sys::nested_subvolumes(fd.as_fd()).expect("list");
    sys::nested_paths(fd.as_fd(), &nested).expect("paths")
}

fn ino(fd: &OwnedFd) -> u64 {
    sys::stat(fd.as_fd()).expect("stat").ino
}

/// `<mnt>/a`, a subvolume holding a file, `n1` (a subvolume holding `n3`,
/// read-only, two levels down) and `dir/n2` (a subvolume in a plain
/// directory), each with a file; the directories holding placeholders aged.
fn build_tree(fs: &LoopFs) -> PathBuf {
    let root = open(fs.mount_point());
    sys::create_subvolume(root.as_fd(), name("a")).expect("create a");
    let a = fs.path("a");
    write(&a.join("top.txt"), "top");
    let a_fd = open(&a);
    sys::create_subvolume(a_fd.as_fd(), name("n1")).expect("create n1");
    fs::create_dir(a.join("dir")).expect("mkdir dir");
    sys::create_subvolume(open(&a.join("dir")).as_fd(), name("n2")).expect("create n2");
    sys::create_subvolume(open(&a.join("n1")).as_fd(), name("n3")).expect("create n3");
    write(&a.join("n1/one.txt"), "one");
    write(&a.join("dir/n2/two.txt"), "two");
    write(&a.join("n1/n3/three.txt"), "three");
    sys::set_read_only(open(&a.join("n1/n3")).as_fd(), true).expect("n3 read-only");
    age(&a.join("n1"), 1_000_000_000);
    age(&a.join("dir"), 1_100_000_000);
    age(&a, 1_200_000_000);
    a
}

#[test]
fn create_info_and_read_only_flags() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let root = open(fs.mount_point());
    sys::create_subvolume(root.as_fd(), name("vol")).expect("create");
    let vol = fs.path("vol");
    assert!(is_subvolume(&vol));
    assert!(fs.path("vol").read_dir().expect("read").next().is_none());
    let again = sys::create_subvolume(root.as_fd(), name("vol")).expect_err("exists");
    assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{again}");
    assert!(sys::create_subvolume(root.as_fd(), name("x/y")).is_err());

    let info = sys::subvolume_info(open(&vol).as_fd()).expect("info");
    assert!(info.id >= 256, "{info:?}");
    assert_ne!(info.uuid, [0; 16]);
    assert_eq!(info.parent_uuid, [0; 16]);
    assert!(!info.read_only);
    let top = sys::subvolume_info(root.as_fd()).expect("top-level info");
    assert_eq!(top.id, 5);

    assert!(!read_only(&vol));
    sys::set_read_only(open(&vol).as_fd(), true).expect("set read-only");
    assert!(read_only(&vol));
    assert!(
        sys::subvolume_info(open(&vol).as_fd())
            .expect("info")
            .read_only
    );
    let denied = fs::write(vol.join("f"), "x").expect_err("read-only");
    assert_eq!(denied.raw_os_error(), Some(libc::EROFS), "{denied}");
    sys::set_read_only(open(&vol).as_fd(), false).expect("clear read-only");
    assert!(!read_only(&vol));
    write(&vol.join("f"), "x");
    // Clearing it again is no error.
    sys::set_read_only(open(&vol).as_fd(), false).expect("clear twice");
}

#[test]
fn snapshots_writable_and_read_only() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let root = open(fs.mount_point());
    sys::create_subvolume(root.as_fd(), name("src")).expect("create");
    let src = fs.path("src");
    write(&src.join("f"), "before");
    sys::create_subvolume(open(&src).as_fd(), name("inner")).expect("create inner");
    write(&src.join("inner/g"), "inner");
    let src_fd = open(&src);
    let src_info = sys::subvolume_info(src_fd.as_fd()).expect("info");

    sys::snapshot(src_fd.as_fd(), root.as_fd(), name("rw")).expect("snapshot");
    let rw = fs.path("rw");
    assert!(is_subvolume(&rw));
    assert!(!read_only(&rw));
    assert_eq!(read(&rw.join("f")), "before");
    // Non-recursive: the nested subvolume is an empty placeholder.
    assert!(!is_subvolume(&rw.join("inner")));
    assert!(rw.join("inner").read_dir().expect("read").next().is_none());
    assert!(
        sys::nested_subvolumes(open(&rw).as_fd())
            .expect("list")
            .is_empty()
    );
    let rw_info = sys::subvolume_info(open(&rw).as_fd()).expect("info");
    assert_eq!(rw_info.parent_uuid, src_info.uuid);
    assert_ne!(rw_info.uuid, src_info.uuid);
    assert_ne!(rw_info.id, src_info.id);
    write(&rw.join("f"), "after");
    assert_eq!(read(&src.join("f")), "before");

    sys::create_snapshot(src_fd.as_fd(), root.as_fd(), name("ro"), true).expect("ro snapshot");
    let ro = fs.path("ro");
    assert!(is_subvolume(&ro));
    assert!(read_only(&ro));
    assert!(
        sys::subvolume_info(open(&ro).as_fd())
            .expect("info")
            .read_only
    );
    assert_eq!(read(&ro.join("f")), "before");
    assert!(fs::write(ro.join("new"), "x").is_err());

    sys::create_snapshot(src_fd.as_fd(), root.as_fd(), name("rw2"), false).expect("rw snapshot");
    assert!(!read_only(&fs.path("rw2")));
    let taken = sys::snapshot(src_fd.as_fd(), root.as_fd(), name("rw")).expect_err("exists");
    assert_eq!(taken.raw_os_error(), Some(libc::EEXIST), "{taken}");
}

#[test]
fn nested_listing_is_parents_first_relative_to_the_fd() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let a = build_tree(&fs);
    assert_eq!(listed(&a), paths(&["n1", "n1/n3", "dir/n2"]));
    let nested = sys::nested_subvolumes(open(&a).as_fd()).expect("list");
    let depths: Vec<usize> = nested.iter().map(|n| n.depth).collect();
    assert_eq!(depths, [1, 2, 1]);
    let top = sys::subvolume_info(open(&a).as_fd()).expect("info").id;
    assert_eq!((nested[0].parent, nested[1].parent), (top, nested[0].id));
    for (n, rel) in nested.iter().zip(["n1", "n1/n3", "dir/n2"]) {
        let by_id = sys::open_subvolume(open(&a).as_fd(), n.id).expect("open by id");
        assert_eq!(ino(&by_id), 256);
        assert_eq!(
            sys::subvolume_info(by_id.as_fd()).expect("info").id,
            sys::subvolume_info(open(&a.join(rel)).as_fd())
                .expect("info")
                .id
        );
    }
    assert_eq!(listed(&a.join("n1")), paths(&["n3"]));
    assert!(listed(&a.join("n1/n3")).is_empty());
    // The top level lists everything, with paths from the mount's root.
    assert_eq!(
        listed(fs.mount_point()),
        paths(&["a", "a/n1", "a/n1/n3", "a/dir/n2"])
    );
    // Only a subvolume root has a listing.
    assert!(sys::nested_subvolumes(open(&a.join("dir")).as_fd()).is_err());
}

#[test]
fn snapshot_tree_copies_every_level_with_its_times() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let a = build_tree(&fs);
    let root = open(fs.mount_point());
    let copy = sys::snapshot_tree(open(&a).as_fd(), root.as_fd(), name("t")).expect("snapshot");
    let t = fs.path("t");
    let _ = copy;
    assert_eq!(listed(&t), paths(&["n1", "n1/n3", "dir/n2"]));
    for (rel, file, data) in [
        ("", "top.txt", "top"),
        ("n1", "one.txt", "one"),
        ("dir/n2", "two.txt", "two"),
        ("n1/n3", "three.txt", "three"),
    ] {
        let dir = t.join(rel);
        assert!(is_subvolume(&dir), "{rel} is a subvolume");
        assert_eq!(read(&dir.join(file)), data);
        // Every level is writable, the read-only n3's copy included.
        assert!(!read_only(&dir), "{rel} writable");
        let copied = sys::subvolume_info(open(&dir).as_fd()).expect("info");
        let source = sys::subvolume_info(open(&a.join(rel)).as_fd()).expect("info");
        assert_eq!(
            copied.parent_uuid, source.uuid,
            "{rel} is a snapshot of its source"
        );
    }
    assert!(read_only(&a.join("n1/n3")), "the source is untouched");
    // The directories whose placeholders were replaced keep their times.
    for rel in ["", "n1", "dir"] {
        assert_eq!(mtime(&t.join(rel)), mtime(&a.join(rel)), "mtime of {rel:?}");
    }
    // A plain directory is no source.
    assert!(sys::snapshot_tree(open(&a.join("dir")).as_fd(), root.as_fd(), name("u")).is_err());
}

#[test]
fn delete_recursive_after_make_tree_writable() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let a = build_tree(&fs);
    let root = open(fs.mount_point());
    // Nested subvolumes stop a plain delete.
    assert!(sys::delete_subvolume(root.as_fd(), name("a"), false).is_err());
    assert!(a.join("n1/n3/three.txt").exists());

    sys::make_tree_read_only(open(&a).as_fd()).expect("freeze");
    for rel in ["", "n1", "n1/n3", "dir/n2"] {
        assert!(read_only(&a.join(rel)), "{rel} read-only");
    }
    // Inside a read-only subvolume nothing can be unlinked.
    assert!(sys::delete_subvolume(root.as_fd(), name("a"), true).is_err());
    assert!(a.exists());

    sys::make_tree_writable(open(&a).as_fd()).expect("thaw");
    for rel in ["", "n1", "n1/n3", "dir/n2"] {
        assert!(!read_only(&a.join(rel)), "{rel} writable");
    }
    sys::delete_subvolume(root.as_fd(), name("a"), true).expect("delete");
    assert!(!a.exists());
    assert!(
        sys::nested_subvolumes(root.as_fd())
            .expect("list")
            .is_empty()
    );

    // A lone read-only subvolume can go as it is.
    sys::create_subvolume(root.as_fd(), name("lone")).expect("create");
    sys::set_read_only(open(&fs.path("lone")).as_fd(), true).expect("ro");
    sys::delete_subvolume(root.as_fd(), name("lone"), false).expect("delete lone");
    assert!(!fs.path("lone").exists());
    let gone = sys::delete_subvolume(root.as_fd(), name("lone"), true).expect_err("absent");
    assert_eq!(gone.raw_os_error(), Some(libc::ENOENT), "{gone}");
}

#[test]
fn commits() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let root = open(fs.mount_point());
    write(&fs.path("f"), "data");
    sys::start_commit(root.as_fd()).expect("start commit");
    sys::commit(root.as_fd()).expect("commit");
    sys::commit_metadata(root.as_fd()).expect("commit metadata");

    // Off btrfs, the btrfs requests are refused, not reinterpreted.
    let proc = open(Path::new("/proc"));
    let errno = |r: io::Result<()>| r.expect_err("refused off btrfs").raw_os_error();
    assert_eq!(errno(sys::commit(proc.as_fd())), Some(libc::ENOTTY));
    assert_eq!(errno(sys::start_commit(proc.as_fd())), Some(libc::ENOTTY));
    assert_eq!(
        errno(sys::commit_metadata(proc.as_fd())),
        Some(libc::ENOTTY)
    );
    assert_eq!(
        sys::subvolume_info(proc.as_fd())
            .expect_err("off btrfs")
            .raw_os_error(),
        Some(libc::ENOTTY)
    );
    assert!(!sys::is_subvolume(proc.as_fd()).expect("is_subvolume"));
}

/// A subvolume, a snapshot and a recursive snapshot made with a qgroup
/// inherit join exactly the groups it names, on both backends; the nested
/// snapshots of a recursive one are made without. Simple quotas, so the
/// kernel would otherwise add each to the groups of the subvolume it is
/// created in (those of `holder` here); skipped before Linux 6.7.
#[test]
fn an_inherit_names_the_groups_a_new_subvolume_joins() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let root = open(fs.mount_point());
    if let Err(e) = sys::enable_quotas(root.as_fd(), sys::QuotaMode::Simple) {
        return test_fs::skip_or_fail(&format!("simple quotas (Linux 6.7+): {e}"));
    }
    let group = |n: u64| 1 << sys::QGROUP_LEVEL_SHIFT | n;
    let parents = |path: &Path| {
        let fd = open(path);
        let id = sys::subvolume_info(fd.as_fd()).expect("info").id;
        sys::qgroup_parents(fd.as_fd(), id).expect("parents")
    };
    for n in [100, 200] {
        test_fs::run(
            std::process::Command::new("btrfs")
                .args(["qgroup", "create", &format!("1/{n}")])
                .arg(fs.mount_point()),
        )
        .expect("qgroup create");
    }
    let both = sys::QgroupInherit {
        groups: vec![group(100), group(200)],
    };
    sys::create_subvolume_with(root.as_fd(), name("holder"), &both).expect("create");
    assert_eq!(parents(&fs.path("holder")), both.groups);
    let holder = open(&fs.path("holder"));
    let one = sys::QgroupInherit {
        groups: vec![group(200)],
    };
    sys::create_subvolume_with(holder.as_fd(), name("src"), &one).expect("create");
    sys::create_subvolume(open(&fs.path("holder/src")).as_fd(), name("inner")).expect("inner");
    let src = open(&fs.path("holder/src"));
    sys::create_snapshot_with(src.as_fd(), holder.as_fd(), name("ro"), true, &one)
        .expect("snapshot");
    assert!(read_only(&fs.path("holder/ro")));
    assert_eq!(parents(&fs.path("holder/ro")), one.groups);
    // Empty, it keeps the kernel from adding the holder's groups.
    let none = sys::QgroupInherit::default();
    sys::create_snapshot_with(src.as_fd(), holder.as_fd(), name("bare"), false, &none)
        .expect("snapshot");
    assert_eq!(parents(&fs.path("holder/bare")), Vec::<u64>::new());
    sys::snapshot_tree_with(src.as_fd(), holder.as_fd(), name("tree"), Some(&one))
        .expect("snapshot tree");
    assert_eq!(parents(&fs.path("holder/tree")), one.groups);
    // Made without: the groups of the subvolume it sits in, the copy.
    assert!(is_subvolume(&fs.path("holder/tree/inner")));
    assert_eq!(parents(&fs.path("holder/tree/inner")), one.groups);
    let missing = sys::QgroupInherit {
        groups: vec![group(999)],
    };
    let err =
        sys::create_subvolume_with(root.as_fd(), name("bad"), &missing).expect_err("no 1/999");
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
}

/// `inode_beneath` climbs a snapshot's tree, not the live one: in a
/// snapshot of `m/a/f`, `m/h` (two names, one outside `m`) and `o/g`, the
/// files under `m` are beneath `m` (and the hard-linked one whichever name
/// is followed), `o/g` and `m`'s own parent are not, and a file made after
/// the snapshot is no inode of it (`None`). Each answer is wrong if the
/// live tree were read, where `m/a/f` has since moved out of `m`.
#[test]
fn inode_beneath_climbs_the_snapshots_tree() {
    let fs = fs_or_skip!(LoopFs::btrfs(SIZE));
    let src = fs.path("src");
    sys::create_subvolume(open(fs.mount_point()).as_fd(), name("src")).unwrap();
    for d in ["m/a", "o"] {
        fs::create_dir_all(src.join(d)).unwrap();
    }
    write(&src.join("m/a/f"), "f");
    write(&src.join("o/g"), "g");
    write(&src.join("m/h"), "h");
    fs::hard_link(src.join("m/h"), src.join("o/h2")).unwrap();
    let ino = |p: &str| fs::symlink_metadata(src.join(p)).unwrap().ino();
    let (m, f, g, h, a) = (ino("m"), ino("m/a/f"), ino("o/g"), ino("m/h"), ino("m/a"));
    sys::snapshot(
        open(&src).as_fd(),
        open(fs.mount_point()).as_fd(),
        name("snap"),
    )
    .unwrap();
    // The live tree moves on: f leaves m, a new file comes.
    fs::rename(src.join("m/a/f"), src.join("o/f")).unwrap();
    write(&src.join("m/new"), "new");
    let new = ino("m/new");
    sys::commit(open(&src).as_fd()).unwrap();
    let snap = open(&fs.path("snap"));
    let beneath = |i| sys::inode_beneath(snap.as_fd(), i, m).unwrap();
    assert_eq!(beneath(f), Some(true), "m/a/f, in the snapshot");
    assert_eq!(beneath(a), Some(true));
    assert_eq!(beneath(m), Some(true), "m itself");
    assert_eq!(beneath(h), Some(true), "two names, one beneath m");
    assert_eq!(beneath(g), Some(false), "o/g");
    assert_eq!(beneath(ino("o")), Some(false));
    assert_eq!(beneath(new), None, "made after the snapshot");
    let live = open(&src);
    assert_eq!(sys::inode_beneath(live.as_fd(), f, m).unwrap(), Some(false));
}
