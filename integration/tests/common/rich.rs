//! A volume directory with every kind of entry and attribute a conversion
//! must keep, and the checks that it did.

use std::ffi::OsStr;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use integration::{TreeDigest, run};
use rustix::fs::{AtFlags, FileType, IFlags, Mode, OFlags, Timespec, Timestamps, XattrFlags};

use super::{bytes, subvolume_create};

fn sh(cmd: &mut Command) {
    run(cmd).unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
}

fn set_mtime(path: &Path, sec: i64, nsec: i64) {
    let t = Timestamps {
        last_access: Timespec {
            tv_sec: sec - 1000,
            tv_nsec: 7,
        },
        last_modification: Timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
    };
    rustix::fs::utimensat(rustix::fs::CWD, path, &t, AtFlags::SYMLINK_NOFOLLOW)
        .unwrap_or_else(|e| panic!("utimensat {}: {e}", path.display()));
}

fn chown(path: &Path, uid: u32, gid: u32) {
    rustix::fs::chownat(
        rustix::fs::CWD,
        path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

fn chmod(path: &Path, mode: u32) {
    rustix::fs::chmod(path, Mode::from_raw_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

pub fn setflags(path: &Path, flags: IFlags) {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let cur = rustix::fs::ioctl_getflags(&f).unwrap_or(IFlags::empty());
    // FS_IOC_SETFLAGS would rewrite btrfs's compression property: the
    // immutable and append-only flags go through FS_IOC_FSSETXATTR.
    let stuck = IFlags::IMMUTABLE | IFlags::APPEND;
    if !flags.difference(stuck).is_empty() {
        rustix::fs::ioctl_setflags(&f, cur | flags.difference(stuck))
            .unwrap_or_else(|e| panic!("setflags {}: {e}", path.display()));
    }
    let all = cur | flags;
    if all.intersects(stuck) {
        volume::sys::set_immutable_append(
            std::os::fd::AsFd::as_fd(&f),
            all.contains(IFlags::IMMUTABLE),
            all.contains(IFlags::APPEND),
        )
        .unwrap_or_else(|e| panic!("immutable/append {}: {e}", path.display()));
    }
}

/// Fills the plain directory `vol` (created) with every kind of entry:
/// regular, empty, sparse (holes in the middle and at the end), NOCOW,
/// immutable and append-only files; setuid, setgid and sticky modes; owners
/// and groups above 65535; user, trusted and security xattrs (a file
/// capability) and POSIX access and default ACLs; hardlinks across
/// directories; symlinks (relative, absolute, dangling, with an xattr); a
/// FIFO, a socket, a char and a block device; empty directories; names with
/// arbitrary bytes; a 60-level deep path; nested subvolumes (one read-only,
/// one two levels down); and nanosecond timestamps set on every directory
/// after its children. With `big` > 0, also `data/db/big.mdb` of `big` bytes.
pub fn build_rich_tree(vol: &Path, big: u64) {
    build(vol, big, true)
}

/// [`build_rich_tree`] without the nested subvolumes (which a snapshot of
/// the parent cannot carry), and with what lifting the top's entries into a
/// new root must keep: an immutable file and an append-only directory at the
/// top, an entry named like the carve's own parking name, and a top
/// directory with its own owner, mode, xattr, default ACL, NOCOW flag and
/// time.
#[allow(dead_code)]
pub fn build_carve_tree(vol: &Path, big: u64) {
    build(vol, big, false);
    fs::write(vol.join("top-immutable"), b"top").unwrap();
    fs::create_dir(vol.join("top-append")).unwrap();
    fs::write(vol.join("top-append/log"), b"l").unwrap();
    fs::write(vol.join(".startos-carve"), b"mine").unwrap();
    chown(vol, 4242, 100_500);
    chmod(vol, 0o2750);
    rustix::fs::setxattr(vol, "user.top", b"t", XattrFlags::empty()).unwrap();
    sh(Command::new("setfacl")
        .args(["-d", "-m", "u:777:rwx"])
        .arg(vol));
    setflags(vol, IFlags::NOCOW);
    set_mtime(&vol.join("top-append"), 1_700_000_001, 1);
    set_mtime(vol, 1_700_000_002, 2);
    setflags(&vol.join("top-immutable"), IFlags::IMMUTABLE);
    setflags(&vol.join("top-append"), IFlags::APPEND);
}

fn build(vol: &Path, big: u64, nested: bool) {
    fs::create_dir_all(vol.join("data/main")).unwrap();
    let m = vol.join("data/main");
    fs::write(m.join("config.toml"), b"port = 8080\n").unwrap();
    fs::write(m.join("empty"), b"").unwrap();
    // Sparse: data, hole, data, trailing hole.
    let f = fs::File::create(m.join("sparse")).unwrap();
    f.write_all_at(&bytes(11, 8192), 0).unwrap();
    f.write_all_at(&bytes(12, 4096), 1 << 20).unwrap();
    f.set_len(3 << 20).unwrap();
    drop(f);
    // NOCOW before data.
    let f = fs::File::create(m.join("nocow.db")).unwrap();
    rustix::fs::ioctl_setflags(&f, IFlags::NOCOW).unwrap();
    f.write_all_at(&bytes(13, 200_000), 0).unwrap();
    drop(f);
    fs::create_dir(m.join("db")).unwrap();
    if big > 0 {
        let f = fs::File::create(m.join("db/big.mdb")).unwrap();
        let chunk = bytes(14, 1 << 20);
        let mut off = 0;
        while off < big {
            let n = chunk.len().min((big - off) as usize);
            f.write_all_at(&chunk[..n], off).unwrap();
            off += n as u64;
        }
        drop(f);
    }
    fs::write(m.join("db/data.mdb"), bytes(1, 300_000)).unwrap();
    fs::hard_link(m.join("db/data.mdb"), m.join("db/data.link")).unwrap();
    fs::create_dir(m.join("elsewhere")).unwrap();
    fs::hard_link(m.join("db/data.mdb"), m.join("elsewhere/third-name")).unwrap();
    // Modes and owners.
    fs::write(m.join("suid"), b"#!/bin/sh\n").unwrap();
    chown(&m.join("suid"), 100_000, 200_123);
    chmod(&m.join("suid"), 0o4755);
    fs::create_dir(m.join("setgid-dir")).unwrap();
    chown(&m.join("setgid-dir"), 70_000, 4_000_000);
    chmod(&m.join("setgid-dir"), 0o2770);
    fs::create_dir(m.join("sticky")).unwrap();
    chmod(&m.join("sticky"), 0o1777);
    fs::write(m.join("sticky/private"), b"x").unwrap();
    chmod(&m.join("sticky/private"), 0o600);
    // xattrs, a capability, ACLs.
    let f = fs::File::open(m.join("config.toml")).unwrap();
    rustix::fs::fsetxattr(&f, "user.app", b"value\0with nul", XattrFlags::empty()).unwrap();
    rustix::fs::fsetxattr(&f, "trusted.overlay", b"t", XattrFlags::empty()).unwrap();
    drop(f);
    fs::write(m.join("ping"), b"binary").unwrap();
    chmod(&m.join("ping"), 0o755);
    // VFS_CAP_REVISION_2 | effective, permitted = CAP_NET_RAW (13).
    let mut cap = Vec::new();
    cap.extend_from_slice(&0x0200_0001u32.to_le_bytes());
    cap.extend_from_slice(&(1u32 << 13).to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    rustix::fs::setxattr(
        m.join("ping"),
        "security.capability",
        &cap,
        XattrFlags::empty(),
    )
    .unwrap();
    sh(Command::new("setfacl")
        .args(["-m", "u:1234:rwx,g:70000:r"])
        .arg(m.join("db/data.mdb")));
    sh(Command::new("setfacl")
        .args(["-d", "-m", "u:4321:rx"])
        .arg(m.join("elsewhere")));
    // Symlinks, never followed.
    symlink("db/data.mdb", m.join("current")).unwrap();
    symlink("/etc/passwd", m.join("absolute")).unwrap();
    symlink("nowhere/at/all", m.join("dangling")).unwrap();
    rustix::fs::lsetxattr(
        m.join("dangling"),
        "trusted.link",
        b"l",
        XattrFlags::empty(),
    )
    .unwrap();
    chown(&m.join("dangling"), 123_456, 654_321);
    // Special files, never opened.
    let md = rustix::fs::open(&m, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    rustix::fs::mknodat(
        md.as_fd(),
        "fifo",
        FileType::Fifo,
        Mode::from_raw_mode(0o640),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        md.as_fd(),
        "sock",
        FileType::Socket,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        md.as_fd(),
        "null",
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    rustix::fs::mknodat(
        md.as_fd(),
        "loopdev",
        FileType::BlockDevice,
        Mode::from_raw_mode(0o660),
        rustix::fs::makedev(7, 200),
    )
    .unwrap();
    rustix::fs::lsetxattr(m.join("fifo"), "trusted.fifo", b"f", XattrFlags::empty()).unwrap();
    drop(md);
    // Empty dirs, odd names, depth.
    fs::create_dir_all(m.join("empty-dir/also-empty")).unwrap();
    let odd = OsStr::from_bytes(b"\xff\xfe odd\nname\twith bytes \x01");
    fs::write(m.join(odd), b"odd").unwrap();
    fs::write(m.join("x".repeat(255)), b"long name").unwrap();
    let mut deep = m.join("deep");
    for i in 0..60 {
        deep.push(format!("d{i}"));
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("leaf"), b"deep").unwrap();
    // Flags: immutable and append-only last, on a file and a directory.
    fs::write(m.join("immutable"), b"frozen").unwrap();
    fs::write(m.join("append.log"), b"line\n").unwrap();
    fs::create_dir(m.join("frozen-dir")).unwrap();
    fs::write(m.join("frozen-dir/inside"), b"in").unwrap();
    fs::create_dir(m.join("nocow-dir")).unwrap();
    setflags(&m.join("nocow-dir"), IFlags::NOCOW);
    fs::write(m.join("nocow-dir/child"), b"c").unwrap();
    // btrfs's compression property (an xattr that chattr would rewrite), on
    // a directory with another flag, inherited by the file created in it, and
    // on an immutable file.
    fs::create_dir(m.join("zstd-dir")).unwrap();
    // With another flag to copy, so that setting flags cannot be skipped.
    setflags(&m.join("zstd-dir"), IFlags::NOATIME);
    sh(Command::new("btrfs")
        .args(["property", "set"])
        .arg(m.join("zstd-dir"))
        .args(["compression", "zstd"]));
    fs::write(m.join("zstd-dir/packed"), bytes(15, 20_000)).unwrap();
    fs::write(m.join("zstd-frozen"), b"frozen and packed").unwrap();
    sh(Command::new("btrfs")
        .args(["property", "set"])
        .arg(m.join("zstd-frozen"))
        .args(["compression", "lzo"]));
    if nested {
        // Nested subvolumes, one read-only, one deeper.
        subvolume_create(&m.join("nested"));
        fs::write(m.join("nested/blob"), bytes(3, 200_000)).unwrap();
        fs::create_dir(m.join("nested/deeper")).unwrap();
        subvolume_create(&m.join("nested/deeper/inner"));
        fs::write(m.join("nested/deeper/inner/wal"), bytes(4, 50_000)).unwrap();
        subvolume_create(&m.join("ro-nested"));
        fs::write(m.join("ro-nested/frozen"), b"ro").unwrap();
    }
    // Timestamps: every entry gets a distinct ns mtime, directories last
    // (deepest first), then the flags that forbid changes.
    let mut all = Vec::new();
    collect(vol, &mut all);
    let mut n = 0i64;
    for p in all.iter().filter(|p| !p.is_dir() || p.is_symlink()) {
        n += 1;
        set_mtime(p, 1_600_000_000 + n, n * 1_000_003 % 1_000_000_000);
    }
    let mut dirs: Vec<&PathBuf> = all
        .iter()
        .filter(|p| p.is_dir() && !p.is_symlink())
        .collect();
    dirs.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in dirs {
        n += 1;
        set_mtime(p, 1_600_000_000 + n, n * 7_654_321 % 1_000_000_000);
    }
    setflags(&m.join("immutable"), IFlags::IMMUTABLE);
    setflags(&m.join("append.log"), IFlags::APPEND);
    setflags(&m.join("frozen-dir"), IFlags::IMMUTABLE);
    setflags(&m.join("zstd-frozen"), IFlags::IMMUTABLE);
    if nested {
        sh(Command::new("btrfs")
            .args(["property", "set", "-ts"])
            .arg(m.join("ro-nested"))
            .args(["ro", "true"]));
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() && !p.is_symlink() {
            collect(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// Inode flags (chattr) and allocated blocks of every regular file and
/// directory below `root`, by relative path, for what tree_digest does not
/// record: NOCOW, immutable, append-only, and holes.
pub fn flags_and_blocks(root: &Path) -> Vec<(PathBuf, String, u64)> {
    let mut all = Vec::new();
    collect(root, &mut all);
    let mut out = Vec::new();
    for p in all {
        let meta = fs::symlink_metadata(&p).unwrap();
        let ft = meta.file_type();
        if !(ft.is_file() || ft.is_dir()) {
            continue;
        }
        let f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&p)
            .unwrap();
        let flags = rustix::fs::ioctl_getflags(&f).unwrap_or(IFlags::empty());
        let interesting = flags & (IFlags::NOCOW | IFlags::IMMUTABLE | IFlags::APPEND);
        let blocks = if ft.is_file() { meta.blocks() } else { 0 };
        out.push((
            p.strip_prefix(root).unwrap().to_path_buf(),
            format!("{interesting:?}"),
            blocks,
        ));
    }
    out.sort();
    out
}

/// What the converted volume's digest must be, given the original's: the
/// same, except that the top is now a subvolume root. Nothing else is
/// normalized: not even the top's mtime, which the copy sets after its
/// children and which the exchange (a rename in the parent) leaves alone.
pub fn expected_after(before: &TreeDigest) -> TreeDigest {
    let mut d = before.clone();
    if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
        top.subvolume = integration::Subvolume::Root;
    }
    d
}
