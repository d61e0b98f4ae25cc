//! The volumes the scenarios run on, built the same for both sides, and the
//! probes that look at what tree digests do not record (inode flags,
//! read-only subvolumes, ctimes).

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::{AtFlags, FileType, Gid, IFlags, Mode, Timespec, Timestamps, Uid, XattrFlags};

use super::{Context, Result};
use crate::run;

/// `len` bytes derived from `seed` only.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn write(path: &Path, data: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).ctx(format!("mkdir -p {}", parent.display()))?;
    }
    fs::write(path, data).ctx(format!("writing {}", path.display()))
}

/// `btrfs subvolume create`, as a package's own process could.
pub fn subvolume_create(path: &Path) -> Result<()> {
    run(Command::new("btrfs")
        .args(["-q", "subvolume", "create"])
        .arg(path))?;
    Ok(())
}

/// Makes the subvolume at `path` read-only.
pub fn set_read_only(path: &Path) -> Result<()> {
    run(Command::new("btrfs")
        .args(["property", "set", "-ts"])
        .arg(path)
        .args(["ro", "true"]))?;
    Ok(())
}

/// Whether `path` is a read-only subvolume (false for anything else).
pub fn is_read_only(path: &Path) -> bool {
    run(Command::new("btrfs")
        .args(["property", "get", "-ts"])
        .arg(path)
        .arg("ro"))
    .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "ro=true")
}

/// Whether `path` is a subvolume root (a directory with inode 256).
pub fn is_subvolume(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

fn set_mtime(path: &Path, sec: i64, nsec: i64) -> Result<()> {
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
        .ctx(format!("utimensat {}", path.display()))
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    rustix::fs::chownat(
        rustix::fs::CWD,
        path,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .ctx(format!("chown {}", path.display()))
}

fn open_no_follow(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ctx(format!("open {}", path.display()))
}

/// Adds `flags` (chattr) to the file or directory at `path`.
pub fn add_flags(path: &Path, flags: IFlags) -> Result<()> {
    let f = open_no_follow(path)?;
    let cur = rustix::fs::ioctl_getflags(&f).ctx(format!("getflags {}", path.display()))?;
    rustix::fs::ioctl_setflags(&f, cur | flags).ctx(format!("setflags {}", path.display()))
}

/// The inode flags a conversion should keep: NOCOW, immutable,
/// append-only, no-atime, no-dump, sync.
pub fn kept_flags(path: &Path) -> Result<IFlags> {
    let f = open_no_follow(path)?;
    let flags = rustix::fs::ioctl_getflags(&f).ctx(format!("getflags {}", path.display()))?;
    Ok(flags
        & (IFlags::NOCOW
            | IFlags::IMMUTABLE
            | IFlags::APPEND
            | IFlags::NOATIME
            | IFlags::NODUMP
            | IFlags::SYNC))
}

/// Every path below `dir` (itself first), directories before their
/// contents; symlinks not followed.
pub fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        let p = out[i].clone();
        i += 1;
        let meta = fs::symlink_metadata(&p).ctx(format!("lstat {}", p.display()))?;
        if meta.is_dir() {
            let mut children = Vec::new();
            for e in fs::read_dir(&p).ctx(format!("listing {}", p.display()))? {
                children.push(e.ctx(format!("listing {}", p.display()))?.path());
            }
            children.sort();
            out.extend(children);
        }
    }
    Ok(out)
}

/// A plain volume for the crash scenarios: `data/main` with a database
/// file, a write-ahead log, a config, a hardlink, a symlink and a
/// directory of small files, every time set.
pub fn simple_volume(vol: &Path, seed: u64) -> Result<()> {
    let m = vol.join("data/main");
    write(&m.join("db.sqlite"), &bytes(seed, 300_000))?;
    write(&m.join("db.sqlite-wal"), &bytes(seed + 1, 40_000))?;
    write(&m.join("config.toml"), b"port = 8332\n")?;
    fs::hard_link(m.join("db.sqlite"), m.join("db.link")).ctx("hardlink")?;
    symlink("db.sqlite", m.join("current")).ctx("symlink")?;
    for i in 0..20 {
        write(
            &m.join(format!("blocks/blk{i:05}.dat")),
            &bytes(seed + 10 + i, 5_000),
        )?;
    }
    set_times(vol)
}

/// Gives every entry below `vol` a distinct nanosecond mtime, directories
/// last and deepest first, so a copy that drops a time shows.
fn set_times(vol: &Path) -> Result<()> {
    let all = walk(vol)?;
    let mut n = 0i64;
    let is_dir = |p: &Path| fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    for p in all.iter().filter(|p| !is_dir(p)) {
        n += 1;
        set_mtime(p, 1_600_000_000 + n, n * 1_000_003 % 1_000_000_000)?;
    }
    let mut dirs: Vec<&PathBuf> = all.iter().filter(|p| is_dir(p)).collect();
    dirs.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in dirs {
        n += 1;
        set_mtime(p, 1_600_000_000 + n, n * 7_654_321 % 1_000_000_000)?;
    }
    Ok(())
}

/// The nested subvolumes of [`nested_volume`], relative to the volume:
/// writable, writable two levels down, read-only.
pub const NESTED: [&str; 3] = [
    "data/main/nested",
    "data/main/nested/deeper/inner",
    "data/main/frozen",
];

/// A volume (already a subvolume or a directory) whose `data/main` holds
/// a database file and three nested subvolumes ([`NESTED`]), the last one
/// read-only, each with data of its own.
pub fn nested_volume(vol: &Path) -> Result<()> {
    let m = vol.join("data/main");
    write(&m.join("db.sqlite"), &bytes(1, 100_000))?;
    subvolume_create(&m.join("nested"))?;
    write(&m.join("nested/blob"), &bytes(2, 200_000))?;
    fs::create_dir(m.join("nested/deeper")).ctx("mkdir nested/deeper")?;
    subvolume_create(&m.join("nested/deeper/inner"))?;
    write(&m.join("nested/deeper/inner/wal"), &bytes(3, 50_000))?;
    subvolume_create(&m.join("frozen"))?;
    write(&m.join("frozen/archive"), &bytes(4, 70_000))?;
    set_read_only(&m.join("frozen"))
}

/// The attribute-rich volume of the conversion scenario: in `data/main`,
/// plain, empty and sparse files; a NOCOW file and a NOCOW directory with a
/// file; an immutable file, an append-only file, an immutable directory
/// and a no-atime directory; a socket, a FIFO, a char and a block device;
/// a file capability (`security.capability`), user and trusted xattrs and
/// an ACL; setuid, setgid and sticky modes; owners and groups above 65535;
/// hardlinks; symlinks (one dangling, one owned by a high uid); and nested
/// subvolumes: a writable one, one two levels down, a read-only one. Every
/// mtime set; the flags that forbid changes set last.
pub fn attr_volume(vol: &Path) -> Result<()> {
    let m = vol.join("data/main");
    write(&m.join("config.toml"), b"rpcport = 8332\n")?;
    write(&m.join("empty"), b"")?;
    let f = File::create(m.join("sparse")).ctx("sparse")?;
    f.write_all_at(&bytes(5, 8192), 0).ctx("sparse")?;
    f.write_all_at(&bytes(6, 4096), 1 << 20).ctx("sparse")?;
    f.set_len(3 << 20).ctx("sparse")?;
    drop(f);
    // NOCOW before data, as bitcoind's and database packages' are.
    let f = File::create(m.join("chainstate.ldb")).ctx("nocow file")?;
    rustix::fs::ioctl_setflags(&f, IFlags::NOCOW).ctx("chattr +C")?;
    f.write_all_at(&bytes(7, 200_000), 0).ctx("nocow file")?;
    drop(f);
    fs::create_dir(m.join("blocks")).ctx("mkdir blocks")?;
    add_flags(&m.join("blocks"), IFlags::NOCOW)?;
    write(&m.join("blocks/blk00000.dat"), &bytes(8, 100_000))?;
    write(&m.join("db.mdb"), &bytes(9, 300_000))?;
    fs::hard_link(m.join("db.mdb"), m.join("db.link")).ctx("hardlink")?;
    write(&m.join("bin/ping"), b"\x7fELF pretend")?;
    fs::set_permissions(
        m.join("bin/ping"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .ctx("chmod ping")?;
    // VFS_CAP_REVISION_2 with the effective bit, permitted CAP_NET_RAW (13).
    let mut cap = Vec::new();
    for word in [0x0200_0001u32, 1 << 13, 0, 0, 0] {
        cap.extend_from_slice(&word.to_le_bytes());
    }
    rustix::fs::setxattr(
        m.join("bin/ping"),
        "security.capability",
        &cap,
        XattrFlags::empty(),
    )
    .ctx("setting a file capability")?;
    rustix::fs::setxattr(
        m.join("config.toml"),
        "user.app",
        b"value",
        XattrFlags::empty(),
    )
    .ctx("user xattr")?;
    rustix::fs::setxattr(m.join("db.mdb"), "trusted.t", b"t", XattrFlags::empty())
        .ctx("trusted xattr")?;
    run(Command::new("setfacl")
        .args(["-m", "u:1234:rwx"])
        .arg(m.join("db.mdb")))?;
    write(&m.join("suid"), b"#!/bin/sh\n")?;
    chown(&m.join("suid"), 100_000, 200_123)?;
    fs::set_permissions(
        m.join("suid"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4755),
    )
    .ctx("chmod suid")?;
    fs::create_dir(m.join("shared")).ctx("mkdir shared")?;
    chown(&m.join("shared"), 70_000, 4_000_000)?;
    fs::set_permissions(
        m.join("shared"),
        std::os::unix::fs::PermissionsExt::from_mode(0o3775),
    )
    .ctx("chmod shared")?;
    write(&m.join("shared/owned-high"), b"h")?;
    chown(&m.join("shared/owned-high"), 165_536, 165_537)?;
    symlink("db.mdb", m.join("current")).ctx("symlink")?;
    symlink("nowhere/at/all", m.join("dangling")).ctx("symlink")?;
    chown(&m.join("dangling"), 123_456, 654_321)?;
    let dir = rustix::fs::open(&m, rustix::fs::OFlags::DIRECTORY, Mode::empty()).ctx("open")?;
    for (name, ty, mode, dev) in [
        ("fifo", FileType::Fifo, 0o640, 0),
        ("rpc.sock", FileType::Socket, 0o600, 0),
        (
            "null",
            FileType::CharacterDevice,
            0o666,
            rustix::fs::makedev(1, 3),
        ),
        (
            "loop7",
            FileType::BlockDevice,
            0o660,
            rustix::fs::makedev(7, 7),
        ),
    ] {
        rustix::fs::mknodat(dir.as_fd(), name, ty, Mode::from_raw_mode(mode), dev)
            .ctx(format!("mknod {name}"))?;
    }
    drop(dir);
    write(&m.join("immutable.cfg"), b"frozen")?;
    write(&m.join("debug.log"), b"line\n")?;
    write(&m.join("sealed/inside"), b"in")?;
    write(&m.join("cache/entry"), b"c")?;
    subvolume_create(&m.join("nested"))?;
    write(&m.join("nested/blob"), &bytes(10, 200_000))?;
    fs::create_dir(m.join("nested/deeper")).ctx("mkdir nested/deeper")?;
    subvolume_create(&m.join("nested/deeper/inner"))?;
    write(&m.join("nested/deeper/inner/wal"), &bytes(11, 50_000))?;
    subvolume_create(&m.join("frozen"))?;
    write(&m.join("frozen/archive"), b"ro")?;
    set_times(vol)?;
    add_flags(&m.join("cache"), IFlags::NOATIME)?;
    add_flags(&m.join("immutable.cfg"), IFlags::IMMUTABLE)?;
    add_flags(&m.join("debug.log"), IFlags::APPEND)?;
    add_flags(&m.join("sealed"), IFlags::IMMUTABLE)?;
    set_read_only(&m.join("frozen"))
}

/// bitcoind's volume: `data/main` made NOCOW before anything is written
/// (as its package does), so every file in it is NOCOW: block files, the
/// chainstate database, a config.
pub fn nocow_volume(vol: &Path) -> Result<()> {
    let m = vol.join("data/main");
    fs::create_dir_all(&m).ctx("mkdir data/main")?;
    add_flags(&m, IFlags::NOCOW)?;
    for i in 0..8 {
        write(
            &m.join(format!("blocks/blk{i:05}.dat")),
            &bytes(20 + i, 256 << 10),
        )?;
    }
    for i in 0..4 {
        write(
            &m.join(format!("chainstate/{i:06}.ldb")),
            &bytes(40 + i, 64 << 10),
        )?;
    }
    write(&m.join("bitcoin.conf"), b"prune=550\n")?;
    set_times(vol)
}

/// Inode flags (those of [`kept_flags`]) of every file and directory
/// below `root`, by relative path, and whether each subvolume root is
/// read-only.
pub fn flags_of(root: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for p in walk(root)? {
        let meta = fs::symlink_metadata(&p).ctx(format!("lstat {}", p.display()))?;
        if !(meta.is_file() || meta.is_dir()) {
            continue;
        }
        let rel = p
            .strip_prefix(root)
            .unwrap_or(&p)
            .to_string_lossy()
            .into_owned();
        let mut what = format!("{:?}", kept_flags(&p)?);
        if meta.is_dir() && is_subvolume(&p) && p != root && is_read_only(&p) {
            what.push_str(" read-only");
        }
        out.push((rel, what));
    }
    Ok(out)
}

/// The ctime of every entry below `root`, by relative path.
pub fn ctimes_of(root: &Path) -> Result<Vec<(String, (i64, i64))>> {
    let mut out = Vec::new();
    for p in walk(root)? {
        let meta = fs::symlink_metadata(&p).ctx(format!("lstat {}", p.display()))?;
        let rel = p
            .strip_prefix(root)
            .unwrap_or(&p)
            .to_string_lossy()
            .into_owned();
        out.push((rel, (meta.ctime(), meta.ctime_nsec())));
    }
    Ok(out)
}
