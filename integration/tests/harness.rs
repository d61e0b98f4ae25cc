//! Tests of the harness itself, on real loop-mounted filesystems.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use integration::{
    FsKind, Kind, LoopFs, Subvolume, extent_count, fs_or_skip, is_mounted, make_fragmented_file,
    run, sh, tree_digest,
};

/// A small tree with one of everything the digest distinguishes.
fn populate(root: &Path) {
    let dir = root.join("data");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("file"), b"hello world\n").unwrap();
    fs::write(dir.join(OsStr::from_bytes(b"caf\xe9")), b"latin-1 name").unwrap();
    fs::hard_link(dir.join("file"), dir.join("file-link")).unwrap();
    symlink("file", dir.join("symlink")).unwrap();
    symlink(OsStr::from_bytes(b"/nowhere/\xff"), dir.join("dangling")).unwrap();
    run(Command::new("mkfifo").arg(dir.join("fifo"))).unwrap();
    run(Command::new("mknod")
        .arg(dir.join("null"))
        .args(["c", "1", "3"]))
    .unwrap();
    UnixListener::bind(dir.join("socket")).unwrap();
    fs::create_dir(dir.join("sub")).unwrap();
    fs::write(dir.join("sub/empty"), b"").unwrap();
    rustix::fs::lsetxattr(
        dir.join("file"),
        "user.note",
        b"v1",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
}

/// Changes one thing at a time and checks the digest notices exactly that.
fn check_digest_detects_changes(root: &Path) {
    populate(root);
    let file = root.join("data/file");
    let before = tree_digest(root).unwrap();
    assert_eq!(before, tree_digest(root).unwrap(), "digest must be stable");
    assert!(before.diff(&before).is_empty());

    let d = before.get("data/file").unwrap();
    assert!(matches!(d.kind, Kind::File { size: 12, .. }), "{d:?}");
    assert_eq!(d.hardlink_group.as_deref(), Some(&b"data/file"[..]));
    assert_eq!(
        before.get("data/file-link").unwrap().hardlink_group,
        d.hardlink_group
    );
    assert_eq!(
        d.xattrs.get(&b"user.note"[..]).map(Vec::as_slice),
        Some(&b"v1"[..])
    );
    assert!(matches!(before.get("data/fifo").unwrap().kind, Kind::Fifo));
    assert!(matches!(
        before.get("data/socket").unwrap().kind,
        Kind::Socket
    ));
    assert!(matches!(
        before.get("data/null").unwrap().kind,
        Kind::CharDevice { rdev } if rdev == libc::makedev(1, 3)
    ));
    assert!(matches!(
        &before.get("data/dangling").unwrap().kind,
        Kind::Symlink { target } if target == b"/nowhere/\xff"
    ));
    assert!(before.get(OsStr::from_bytes(b"data/caf\xe9")).is_some());

    // One changed byte, same size; restore the mtime so only the content differs.
    let mtime = fs::metadata(&file).unwrap().modified().unwrap();
    fs::write(&file, b"hello World\n").unwrap();
    File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let changed = tree_digest(root).unwrap();
    assert_ne!(before, changed);
    let diff = before.diff(&changed);
    // The hard link is the same inode, so it changes too.
    assert_eq!(diff.len(), 2, "{diff:#?}");
    assert!(diff[0].starts_with("data/file: sha256 "), "{diff:#?}");
    assert!(diff[1].starts_with("data/file-link: sha256 "), "{diff:#?}");

    fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
    let diff = changed.diff(&tree_digest(root).unwrap());
    assert_eq!(
        diff,
        [
            "data/file: mode 0644 -> 0600",
            "data/file-link: mode 0644 -> 0600"
        ]
    );

    let before_xattr = tree_digest(root).unwrap();
    rustix::fs::lsetxattr(&file, "user.note", b"v2", rustix::fs::XattrFlags::empty()).unwrap();
    let diff = before_xattr.diff(&tree_digest(root).unwrap());
    assert!(
        diff.contains(&r#"data/file: xattr user.note "v1" -> "v2""#.to_owned()),
        "{diff:#?}"
    );

    let before_new = tree_digest(root).unwrap();
    fs::write(root.join("data/sub/new"), b"x").unwrap();
    let after_new = tree_digest(root).unwrap();
    let diff = before_new.diff(&after_new);
    assert!(
        diff.iter()
            .any(|d| d.starts_with("data/sub/new: only in right")),
        "{diff:#?}"
    );
    assert!(
        diff.iter().any(|d| d.starts_with("data/sub: mtime ")),
        "{diff:#?}"
    );
    assert_eq!(
        before_new
            .clone()
            .ignore_dir_mtimes()
            .diff(&after_new.ignore_dir_mtimes())
            .len(),
        1
    );
}

#[test]
fn btrfs_digest_detects_changes() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    assert_eq!(fs.kind(), FsKind::Btrfs);
    check_digest_detects_changes(fs.mount_point());
}

#[test]
fn ext4_digest_detects_changes() {
    let fs = fs_or_skip!(LoopFs::ext4(64 << 20));
    assert_eq!(fs.kind(), FsKind::Ext4);
    check_digest_detects_changes(fs.mount_point());
    // ext4's root is inode 2, which must not be mistaken for a btrfs placeholder.
    assert_eq!(
        tree_digest(fs.mount_point())
            .unwrap()
            .get("")
            .unwrap()
            .subvolume,
        Subvolume::No
    );
}

#[test]
fn digest_survives_cp_a() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    populate(fs.mount_point());
    run(Command::new("cp")
        .arg("-a")
        .arg(fs.path("data"))
        .arg(fs.path("copy")))
    .unwrap();
    let original = tree_digest(&fs.path("data")).unwrap();
    let copy = tree_digest(&fs.path("copy")).unwrap();
    assert_eq!(original.diff(&copy), Vec::<String>::new());
    assert_eq!(original, copy);
}

#[test]
fn digest_flags_subvolumes() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let vol = fs.path("vol");
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(&vol))
    .unwrap();
    fs::write(vol.join("a"), b"a").unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(vol.join("nested")))
    .unwrap();
    fs::write(vol.join("nested/b"), b"b").unwrap();
    fs::create_dir(vol.join("plain")).unwrap();

    let digest = tree_digest(&vol).unwrap();
    assert_eq!(digest.get("").unwrap().subvolume, Subvolume::Root);
    assert_eq!(digest.get("nested").unwrap().subvolume, Subvolume::Root);
    assert_eq!(digest.get("plain").unwrap().subvolume, Subvolume::No);
    assert!(
        digest.get("nested/b").is_some(),
        "nested subvolumes are walked"
    );

    let snap = fs.path("snap");
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot"])
        .arg(&vol)
        .arg(&snap))
    .unwrap();
    let snap_digest = tree_digest(&snap).unwrap();
    assert_eq!(
        snap_digest.get("nested").unwrap().subvolume,
        Subvolume::Placeholder
    );
    let diff = digest.diff(&snap_digest);
    assert!(
        diff.iter().any(|d| d.starts_with("nested/b: only in left")),
        "{diff:#?}"
    );
}

#[test]
fn mount_options_are_applied() {
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        256 << 20,
        "compress=zstd:3,noatime"
    ));
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    let line = mounts
        .lines()
        .find(|l| l.split(' ').nth(1) == fs.mount_point().to_str())
        .unwrap();
    assert!(line.contains("compress=zstd:3"), "{line}");
    assert!(line.contains("noatime"), "{line}");
}

#[test]
fn fragmented_file_reaches_target() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let path = fs.path("db");
    let started = Instant::now();
    let extents = make_fragmented_file(&path, 128 << 20, 20_000, 42).unwrap();
    eprintln!(
        "20k-extent target: {extents} extents in {:?}",
        started.elapsed()
    );
    assert!(extents >= 19_000, "only {extents} extents");
    // Most rewrites add two extents; the loop must not wildly overshoot either.
    assert!(extents < 21_000, "{extents} extents");
    assert_eq!(extent_count(&path).unwrap(), extents);
    assert_eq!(fs::metadata(&path).unwrap().len(), 128 << 20);

    // Same seed, same content.
    let again = fs.path("db2");
    make_fragmented_file(&again, 128 << 20, 20_000, 42).unwrap();
    assert_eq!(
        integration::sha256_file(&path).unwrap(),
        integration::sha256_file(&again).unwrap()
    );
}

#[test]
fn fragmenting_stops_when_the_file_is_too_small() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    // 256 blocks hold at most about 256 extents.
    let extents = make_fragmented_file(&fs.path("small"), 1 << 20, 10_000, 1).unwrap();
    assert!((200..=300).contains(&extents), "{extents} extents");
}

/// Waits for the kernel to let go of a loop device, which may lag behind umount.
fn wait_detached(device: &Path) -> bool {
    let Some(name) = device.file_name() else {
        return false;
    };
    let backing = Path::new("/sys/block").join(name).join("loop/backing_file");
    let deadline = Instant::now() + Duration::from_secs(5);
    while backing.exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn drop_unmounts_and_detaches() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let mount_point = fs.mount_point().to_path_buf();
    let device = fs.device().to_path_buf();
    let image = fs.image_path().to_path_buf();
    assert!(is_mounted(&mount_point).unwrap());
    fs::write(fs.path("x"), b"x").unwrap();
    drop(fs);
    assert!(!is_mounted(&mount_point).unwrap());
    assert!(!mount_point.exists());
    assert!(!image.exists());
    assert!(
        wait_detached(&device),
        "{} still attached",
        device.display()
    );
}

#[test]
fn drop_unmounts_after_panic() {
    let seen: Mutex<Option<(PathBuf, PathBuf)>> = Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let fs = match LoopFs::ext4(64 << 20) {
            Ok(fs) => fs,
            Err(err) => {
                integration::skip_or_panic(err);
                return;
            }
        };
        *seen.lock().unwrap() = Some((fs.mount_point().to_owned(), fs.device().to_owned()));
        fs::write(fs.path("x"), b"x").unwrap();
        panic!("deliberate panic with the filesystem mounted");
    });
    let Some((mount_point, device)) = seen.into_inner().unwrap() else {
        return; // skipped
    };
    assert!(result.is_err());
    assert!(!is_mounted(&mount_point).unwrap());
    assert!(!mount_point.exists());
    assert!(
        wait_detached(&device),
        "{} still attached",
        device.display()
    );
}

#[test]
fn drop_while_busy_unmounts_lazily() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    fs::write(fs.path("x"), b"still here").unwrap();
    let mut open = File::open(fs.path("x")).unwrap();
    let mount_point = fs.mount_point().to_path_buf();
    let device = fs.device().to_path_buf();
    drop(fs);
    assert!(!is_mounted(&mount_point).unwrap());
    let mut content = String::new();
    open.read_to_string(&mut content).unwrap();
    assert_eq!(content, "still here");
    drop(open);
    assert!(
        wait_detached(&device),
        "{} still attached",
        device.display()
    );
}

/// `LoopFs::unmount` keeps the image for a caller to copy (the power-cut
/// sweep's base image): a mount namespace another process made meanwhile
/// holds a copy of the mount, so the image must hold everything written
/// before `unmount` returns, and nothing may write it after.
#[test]
fn unmount_leaves_the_whole_image_while_another_namespace_holds_it() {
    let mut fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    fs::write(fs.path("x"), b"written just before").unwrap();
    let mut holder = Command::new("unshare")
        .args(["--mount", "sh", "-c", "echo ready; sleep 2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = [0u8; 6];
    holder
        .stdout
        .take()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    assert_eq!(&ready, b"ready\n");
    fs.unmount().unwrap();
    let copy = fs.image_path().with_extension("copy.img");
    integration::powercut::sparse_copy(fs.image_path(), &copy).unwrap();
    assert!(
        holder.try_wait().unwrap().is_some(),
        "unmount returned while another namespace still held the filesystem"
    );
    let again = LoopFs::from_image(FsKind::Btrfs, &copy, "").unwrap();
    assert_eq!(fs::read(again.path("x")).unwrap(), b"written just before");
    again.close().unwrap();
    fs.close().unwrap();
}

#[test]
fn remount_keeps_synced_data() {
    let mut fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    fs::write(fs.path("x"), b"kept").unwrap();
    fs.remount().unwrap();
    assert_eq!(fs::read(fs.path("x")).unwrap(), b"kept");
    fs.close().unwrap();
}

#[test]
fn run_reports_stderr() {
    let err = run(Command::new("sh").args(["-c", "echo oops >&2; exit 3"])).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("oops") && msg.contains('3'), "{msg}");
    assert_eq!(sh("printf hi").unwrap(), "hi");
    assert!(sh("exit 1").is_err());
}

/// Timing of large fragmented files, for the record: `cargo test --release -p
/// integration --test harness -- --ignored --nocapture fragment_timing`.
#[test]
#[ignore = "slow: builds 100k- and 500k-extent files"]
fn fragment_timing() {
    let fs = fs_or_skip!(LoopFs::btrfs(8 << 30));
    for (name, target) in [("db100k", 100_000u64), ("db500k", 500_000)] {
        let started = Instant::now();
        let extents = make_fragmented_file(&fs.path(name), 2 << 30, target, 7).unwrap();
        eprintln!(
            "{target} target: {extents} extents in {:?}",
            started.elapsed()
        );
        assert!(extents * 100 >= target * 95);
    }
}
