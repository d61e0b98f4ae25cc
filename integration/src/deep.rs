//! Trees beyond `PATH_MAX`, built and read through directory descriptors.
//!
//! `std::fs` resolves whole paths, so it cannot make or read a tree deeper
//! than `PATH_MAX` (4096 bytes): everything here goes one name at a time,
//! relative to an open directory (`openat`, `mkdirat`, `statat`), never
//! following a symlink, never opening a FIFO, and holding a bounded number
//! of descriptors whatever the depth (the current directory, and briefly
//! one child). The walks are iterative: a 20,000-deep chain needs no deep
//! stack.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use sha2::{Digest, Sha256};

/// How many differences [`DeepDigest::diff`] reports at most.
const MAX_DIFFS: usize = 20;
/// How many bytes of a path [`DeepDigest::diff`] shows.
const SHOWN_PATH_BYTES: usize = 120;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn open_dir(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(dir, name, dir_flags(), Mode::empty())?)
}

fn open_top(top: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(top, dir_flags(), Mode::empty())?)
}

/// `mkdirat`, where already being a directory is fine.
fn mkdir_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o755)) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) => {
            let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is no directory", name.to_string_lossy()),
                ))
            }
        }
        Err(e) => Err(e.into()),
    }
}

fn write_file_at(dir: BorrowedFd<'_>, name: &OsStr, data: &[u8]) -> io::Result<()> {
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )?;
    let mut rest = data;
    while !rest.is_empty() {
        let n = rustix::io::write(&fd, rest)?;
        rest = &rest[n..];
    }
    Ok(())
}

/// Creates `depth` nested directories, each named `name`, below `top`
/// (which must exist), and, with `leaf_file`, a file with that name and
/// content in the deepest one. Directories already there are used as they
/// are. At most two descriptors are open at a time.
pub fn make_chain(
    top: &Path,
    name: &OsStr,
    depth: usize,
    leaf_file: Option<(&OsStr, &[u8])>,
) -> io::Result<()> {
    let mut cur = open_top(top)?;
    for _ in 0..depth {
        mkdir_at(cur.as_fd(), name)?;
        cur = open_dir(cur.as_fd(), name)?;
    }
    if let Some((file, data)) = leaf_file {
        write_file_at(cur.as_fd(), file, data)?;
    }
    Ok(())
}

/// Creates the nested directories `names` (the first directly below `top`)
/// and returns the deepest one open, for the caller to put files or a
/// subvolume there (`volume::sys::create_subvolume(fd, name)`).
pub fn make_long_path(top: &Path, names: &[OsString]) -> io::Result<OwnedFd> {
    let mut cur = open_top(top)?;
    for name in names {
        mkdir_at(cur.as_fd(), name)?;
        cur = open_dir(cur.as_fd(), name)?;
    }
    Ok(cur)
}

/// Writes `data` to the file `name` in the directory open as `dir`
/// (created or truncated, never through a symlink).
pub fn write_at(dir: BorrowedFd<'_>, name: &OsStr, data: &[u8]) -> io::Result<()> {
    write_file_at(dir, name, data)
}

/// Reads the regular file `name` in the directory open as `dir`.
pub fn read_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Vec<u8>> {
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    std::fs::File::from(fd).read_to_end(&mut out)?;
    Ok(out)
}

/// Opens the directory at `names` below `top`, one component at a time.
pub fn open_long_path(top: &Path, names: &[OsString]) -> io::Result<OwnedFd> {
    let mut cur = open_top(top)?;
    for name in names {
        cur = open_dir(cur.as_fd(), name)?;
    }
    Ok(cur)
}

/// Opens the directory `depth` levels of `name` below `top` (the bottom of
/// a [`make_chain`]).
pub fn open_chain(top: &Path, name: &OsStr, depth: usize) -> io::Result<OwnedFd> {
    let mut cur = open_top(top)?;
    for _ in 0..depth {
        cur = open_dir(cur.as_fd(), name)?;
    }
    Ok(cur)
}

/// What an entry is, with the content that matters for its kind.
#[derive(Clone, PartialEq, Eq)]
pub enum DeepKind {
    /// A regular file: size and SHA-256 of the content.
    File {
        /// Size in bytes.
        size: u64,
        /// SHA-256 of the content.
        sha256: [u8; 32],
    },
    /// A directory; `subvolume` when it is the root of a btrfs subvolume.
    Dir {
        /// Whether this directory is a btrfs subvolume root (inode 256).
        subvolume: bool,
    },
    /// A symbolic link, its target byte for byte.
    Symlink(Vec<u8>),
    /// A FIFO, socket or device node (never opened), with its `st_rdev`.
    Special {
        /// `st_mode & S_IFMT`.
        file_type: u32,
        /// `st_rdev`.
        rdev: u64,
    },
}

impl fmt::Debug for DeepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeepKind::File { size, sha256 } => {
                write!(f, "file size={size} sha256=")?;
                for b in &sha256[..8] {
                    write!(f, "{b:02x}")?;
                }
                f.write_str("..")
            }
            DeepKind::Dir { subvolume: false } => f.write_str("dir"),
            DeepKind::Dir { subvolume: true } => f.write_str("subvolume"),
            DeepKind::Symlink(t) => write!(f, "symlink -> \"{}\"", t.escape_ascii()),
            DeepKind::Special { file_type, rdev } => {
                write!(f, "special type={file_type:#o} rdev={rdev:#x}")
            }
        }
    }
}

/// Everything [`deep_digest`] records about one entry.
#[derive(Clone, PartialEq, Eq)]
pub struct DeepEntry {
    /// Type and content.
    pub kind: DeepKind,
    /// `st_mode & 0o7777`.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time (seconds, nanoseconds), for non-directories only.
    pub mtime: Option<(i64, i64)>,
    /// Extended attributes of files and directories (not of symlinks or
    /// special files, which are never opened).
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl fmt::Debug for DeepEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} mode={:04o} owner={}:{}",
            self.kind, self.mode, self.uid, self.gid
        )?;
        if let Some((s, ns)) = self.mtime {
            write!(f, " mtime={s}.{ns:09}")?;
        }
        for (k, v) in &self.xattrs {
            write!(f, " xattr[{}]=\"{}\"", k.escape_ascii(), v.escape_ascii())?;
        }
        Ok(())
    }
}

/// A digest of a tree of any depth: relative path (raw bytes, `/`-separated,
/// empty for the top) to entry.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct DeepDigest {
    entries: BTreeMap<Vec<u8>, DeepEntry>,
}

fn shown(path: &[u8]) -> String {
    if path.is_empty() {
        return "<top>".to_owned();
    }
    if path.len() <= SHOWN_PATH_BYTES {
        return path.escape_ascii().to_string();
    }
    format!(
        "{}...({} bytes)...{}",
        path[..SHOWN_PATH_BYTES / 2].escape_ascii(),
        path.len(),
        path[path.len() - SHOWN_PATH_BYTES / 2..].escape_ascii()
    )
}

impl DeepDigest {
    /// Number of entries, the top included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no entry at all (never so for a walked tree).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry at `path` (relative, `/`-separated; empty for the top).
    pub fn get(&self, path: &[u8]) -> Option<&DeepEntry> {
        self.entries.get(path)
    }

    /// All entries, for a test to adjust what it expects (a top
    /// directory's mode, say).
    pub fn entries_mut(&mut self) -> &mut BTreeMap<Vec<u8>, DeepEntry> {
        &mut self.entries
    }

    /// The first differences (at most 20) between `self` (left) and
    /// `other` (right), each on one line, paths cut to 120 bytes.
    pub fn diff(&self, other: &DeepDigest) -> Vec<String> {
        let mut out = Vec::new();
        let mut a = self.entries.iter().peekable();
        let mut b = other.entries.iter().peekable();
        while out.len() < MAX_DIFFS {
            match (a.peek(), b.peek()) {
                (None, None) => break,
                (Some((pa, ea)), Some((pb, eb))) if pa == pb => {
                    if ea != eb {
                        out.push(format!("{}: {ea:?} != {eb:?}", shown(pa)));
                    }
                    a.next();
                    b.next();
                }
                (Some((pa, ea)), Some((pb, _))) if pa < pb => {
                    out.push(format!("{}: only on the left ({ea:?})", shown(pa)));
                    a.next();
                }
                (Some((pa, ea)), None) => {
                    out.push(format!("{}: only on the left ({ea:?})", shown(pa)));
                    a.next();
                }
                (_, Some((pb, eb))) => {
                    out.push(format!("{}: only on the right ({eb:?})", shown(pb)));
                    b.next();
                }
            }
        }
        out
    }
}

/// The names in the directory open as `dir`, sorted in reverse (so that
/// popping gives them in order), `.` and `..` left out.
fn child_names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let own = open_dir(dir, OsStr::new("."))?;
    let mut reader = rustix::fs::Dir::new(own)?;
    let mut names = Vec::new();
    while let Some(entry) = reader.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        names.push(OsString::from_vec(name.to_vec()));
    }
    names.sort_unstable_by(|a, b| b.cmp(a));
    Ok(names)
}

fn xattrs_of(fd: BorrowedFd<'_>) -> io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let len = match rustix::fs::flistxattr_query(fd) {
        Ok(len) => len,
        Err(rustix::io::Errno::NOTSUP) => return Ok(out),
        Err(e) => return Err(e.into()),
    };
    if len == 0 {
        return Ok(out);
    }
    let mut list = vec![0u8; len + 256];
    let n = rustix::fs::flistxattr(fd, &mut list[..])?;
    list.truncate(n);
    for name in list.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name_os = OsStr::from_bytes(name);
        let size = match rustix::fs::fgetxattr_query(fd, name_os) {
            Ok(size) => size,
            Err(rustix::io::Errno::NODATA) => continue,
            Err(e) => return Err(e.into()),
        };
        let mut value = vec![0u8; size + 256];
        let n = rustix::fs::fgetxattr(fd, name_os, &mut value[..])?;
        value.truncate(n);
        out.insert(name.to_vec(), value);
    }
    Ok(out)
}

fn dev_ino(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev, st.st_ino)
}

fn io_at(e: impl Into<io::Error>, what: &str, path: &[u8]) -> io::Error {
    let e = e.into();
    io::Error::new(e.kind(), format!("{what} {}: {e}", shown(path)))
}

fn file_entry(dir: BorrowedFd<'_>, name: &OsStr, path: &[u8]) -> io::Result<(DeepKind, OwnedFd)> {
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_at(e, "opening", path))?;
    let st = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(io::Error::other(format!(
            "{} changed type while it was read",
            shown(path)
        )));
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut size = 0u64;
    loop {
        let n = rustix::io::read(&fd, &mut buf[..]).map_err(|e| io_at(e, "reading", path))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok((
        DeepKind::File {
            size,
            sha256: hasher.finalize().into(),
        },
        fd,
    ))
}

/// One directory on the way down: where its name starts in the current
/// path, the names in it still to visit, and its identity, checked when
/// the walk comes back up to it through `..`.
struct Frame {
    path_len: usize,
    remaining: Vec<OsString>,
    id: (u64, u64),
}

/// Digest of the tree at `top` (a directory), of any depth: for every
/// entry its path, type, mode, owner, size and SHA-256 of a file's
/// content, a symlink's target, the mtime of non-directories, the xattrs
/// of files and directories, and whether a directory is a btrfs subvolume
/// root. Never follows a symlink, never opens a FIFO or device, and holds
/// at most three descriptors at a time: the walk keeps only the current
/// directory open and climbs back through `..`, checking that it lands
/// where it came from.
pub fn deep_digest(top: &Path) -> io::Result<DeepDigest> {
    let mut digest = DeepDigest::default();
    let mut cur = open_top(top)?;
    let st = rustix::fs::fstat(&cur)?;
    digest.entries.insert(
        Vec::new(),
        DeepEntry {
            kind: DeepKind::Dir {
                subvolume: volume::sys::is_subvolume(cur.as_fd())?,
            },
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime: None,
            xattrs: xattrs_of(cur.as_fd())?,
        },
    );
    let mut path: Vec<u8> = Vec::new();
    let mut stack = vec![Frame {
        path_len: 0,
        remaining: child_names(cur.as_fd())?,
        id: dev_ino(&st),
    }];
    while let Some(frame) = stack.last_mut() {
        let Some(name) = frame.remaining.pop() else {
            let done = stack.pop().expect("a frame");
            path.truncate(done.path_len);
            let Some(parent) = stack.last() else {
                break;
            };
            cur = open_dir(cur.as_fd(), OsStr::new("..")).map_err(|e| io_at(e, "..", &path))?;
            let up = dev_ino(&rustix::fs::fstat(&cur)?);
            if up != parent.id {
                return Err(io::Error::other(format!(
                    "climbing back to {} landed elsewhere ({up:?}, not {:?}): the tree moved",
                    shown(&path),
                    parent.id
                )));
            }
            continue;
        };
        let child_start = path.len();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(name.as_bytes());
        let st = match rustix::fs::statat(&cur, &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) => return Err(io_at(e, "stat of", &path)),
        };
        let ty = FileType::from_raw_mode(st.st_mode);
        let mut entry = DeepEntry {
            kind: DeepKind::Dir { subvolume: false },
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime: Some((st.st_mtime, st.st_mtime_nsec as i64)),
            xattrs: BTreeMap::new(),
        };
        match ty {
            FileType::Directory => {
                let fd = open_dir(cur.as_fd(), &name).map_err(|e| io_at(e, "opening", &path))?;
                let fst = rustix::fs::fstat(&fd)?;
                if dev_ino(&fst) != dev_ino(&st) {
                    return Err(io::Error::other(format!(
                        "{} was replaced while it was read",
                        shown(&path)
                    )));
                }
                entry.kind = DeepKind::Dir {
                    subvolume: volume::sys::is_subvolume(fd.as_fd())?,
                };
                entry.mtime = None;
                entry.xattrs = xattrs_of(fd.as_fd()).map_err(|e| io_at(e, "xattrs of", &path))?;
                let remaining = child_names(fd.as_fd()).map_err(|e| io_at(e, "listing", &path))?;
                digest.entries.insert(path.clone(), entry);
                stack.push(Frame {
                    path_len: child_start,
                    remaining,
                    id: dev_ino(&fst),
                });
                cur = fd;
                continue;
            }
            FileType::RegularFile => {
                let (kind, fd) = file_entry(cur.as_fd(), &name, &path)?;
                entry.kind = kind;
                entry.xattrs = xattrs_of(fd.as_fd()).map_err(|e| io_at(e, "xattrs of", &path))?;
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(&cur, &name, Vec::new())
                    .map_err(|e| io_at(e, "readlink", &path))?;
                entry.kind = DeepKind::Symlink(target.into_bytes());
            }
            _ => {
                entry.kind = DeepKind::Special {
                    file_type: st.st_mode & libc::S_IFMT,
                    rdev: st.st_rdev,
                };
            }
        }
        digest.entries.insert(path.clone(), entry);
        path.truncate(child_start);
    }
    Ok(digest)
}

/// Removes `top` and everything below it, at any depth, iteratively:
/// files by unlink, directories (empty subvolumes included, read-only ones
/// made writable first) by rmdir once emptied. Never follows a symlink.
/// Absent is fine.
pub fn remove_all(top: &Path) -> io::Result<()> {
    let top_fd = match open_top(top) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let writable = |fd: BorrowedFd<'_>| -> io::Result<()> {
        if volume::sys::is_subvolume(fd)? && volume::sys::is_read_only(fd)? {
            volume::sys::set_read_only(fd, false)?;
        }
        Ok(())
    };
    writable(top_fd.as_fd())?;
    // Each frame: the directory's name in its parent (to rmdir it from
    // there) and its identity (to check `..` on the way up).
    let mut stack: Vec<(OsString, (u64, u64))> = Vec::new();
    let mut cur = top_fd;
    let mut ids = vec![dev_ino(&rustix::fs::fstat(&cur)?)];
    loop {
        let mut descended = false;
        for name in child_names(cur.as_fd())? {
            let st = rustix::fs::statat(&cur, &name, AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                match rustix::fs::unlinkat(&cur, &name, AtFlags::REMOVEDIR) {
                    Ok(()) => continue,
                    Err(rustix::io::Errno::NOTEMPTY | rustix::io::Errno::PERM) => {}
                    Err(e) => return Err(e.into()),
                }
                let fd = open_dir(cur.as_fd(), &name)?;
                writable(fd.as_fd())?;
                stack.push((name, dev_ino(&st)));
                ids.push(dev_ino(&st));
                cur = fd;
                descended = true;
                break;
            }
            rustix::fs::unlinkat(&cur, &name, AtFlags::empty())?;
        }
        if descended {
            continue;
        }
        // `cur` is empty now: climb and remove it from its parent.
        let Some((name, _)) = stack.pop() else {
            break;
        };
        ids.pop();
        cur = open_dir(cur.as_fd(), OsStr::new(".."))?;
        let up = dev_ino(&rustix::fs::fstat(&cur)?);
        if Some(&up) != ids.last() {
            return Err(io::Error::other(format!(
                "climbing out of {} landed elsewhere",
                name.to_string_lossy()
            )));
        }
        rustix::fs::unlinkat(&cur, &name, AtFlags::REMOVEDIR)?;
    }
    drop(cur);
    std::fs::remove_dir(top)
}
