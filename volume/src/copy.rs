//! Reflink copy of a directory tree, losing nothing `cp -a` keeps and more.
//!
//! Used for the backup of a volume that is still a plain directory on btrfs
//! (and, later, by the one-time conversion to subvolumes). Unlike
//! `cp -a --reflink=always`, it handles NOCOW files: the flag is set on the
//! new file before any data is cloned, which is the only order in which the
//! kernel allows a reflink of NOCOW data.
//!
//! Contents are untrusted: every name is resolved relative to an open
//! directory, nothing is followed through a symlink, and only regular files
//! and directories are ever opened (FIFOs, sockets and devices are recreated
//! with mknod). Names are raw bytes.
//!
//! Per entry, the order matters: data, then owner (a chown clears setuid and
//! file capabilities), then mode, then xattrs (ACLs and capabilities
//! included), then timestamps, then the immutable and append-only flags
//! (which forbid everything before them). Directories get theirs after their
//! children, so their mtime is the source's.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, IFlags, Mode, OFlags, Stat, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;

use crate::sys;

/// What a copy did, for reports and progress.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Entries created (hardlinks count once per name).
    pub entries: u64,
    /// Bytes shared by reflink (file sizes).
    pub bytes: u64,
}

/// Copies the directory open as `src` to a new directory `dst_name` inside
/// `dst_parent`, sharing every extent (FICLONE; never a byte copy).
///
/// A crash part-way leaves a partial tree under `dst_name`; callers use a
/// temporary name and delete it on recovery.
pub fn reflink_tree(
    src: BorrowedFd<'_>,
    dst_parent: BorrowedFd<'_>,
    dst_name: &OsStr,
) -> io::Result<CopyStats> {
    let st = rustix::fs::fstat(src)?;
    rustix::fs::mkdirat(dst_parent, dst_name, Mode::from_raw_mode(0o700))?;
    let dst = sys::open_dir_at(dst_parent, dst_name)?;
    let mut copier = Copier {
        root: dst.as_fd(),
        links: HashMap::new(),
        stats: CopyStats::default(),
    };
    copier.copy_children(src, dst.as_fd(), Path::new(""))?;
    finish_metadata(&st, Target::Fd(dst.as_fd()), Some(src))?;
    Ok(copier.stats)
}

struct Copier<'a> {
    root: BorrowedFd<'a>,
    /// First destination path (relative to `root`) of each multiply-linked
    /// source inode, so later names become hardlinks again.
    links: HashMap<(u64, u64), PathBuf>,
    stats: CopyStats,
}

/// Where to apply metadata: an open fd (files, directories) or a name in a
/// directory (symlinks and special files, which are never opened).
enum Target<'a> {
    Fd(BorrowedFd<'a>),
    At(BorrowedFd<'a>, &'a OsStr),
}

/// Stat's time fields differ in width between targets; Timespec's too.
#[allow(clippy::unnecessary_cast)]
fn ts(sec: i64, nsec: i64) -> Timespec {
    Timespec {
        tv_sec: sec as _,
        tv_nsec: nsec as _,
    }
}

impl Copier<'_> {
    fn copy_children(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        rel: &Path,
    ) -> io::Result<()> {
        for (name, _, _) in sys::read_dir_names(src)? {
            self.copy_entry(src, dst, &name, &rel.join(&name))?;
        }
        Ok(())
    }

    fn copy_entry(
        &mut self,
        src_dir: BorrowedFd<'_>,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
    ) -> io::Result<()> {
        let st = rustix::fs::statat(src_dir, name, AtFlags::SYMLINK_NOFOLLOW)?;
        let ty = FileType::from_raw_mode(st.st_mode);
        if ty != FileType::Directory && st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key) {
                rustix::fs::linkat(self.root, first, dst_dir, name, AtFlags::empty())?;
                self.stats.entries += 1;
                return Ok(());
            }
            self.links.insert(key, rel.to_path_buf());
        }
        self.stats.entries += 1;
        match ty {
            FileType::Directory => {
                let src = sys::open_dir_at(src_dir, name)?;
                rustix::fs::mkdirat(dst_dir, name, Mode::from_raw_mode(0o700))?;
                let dst = sys::open_dir_at(dst_dir, name)?;
                self.copy_children(src.as_fd(), dst.as_fd(), rel)?;
                finish_metadata(&st, Target::Fd(dst.as_fd()), Some(src.as_fd()))
            }
            FileType::RegularFile => {
                // O_NONBLOCK: if the entry was swapped for a FIFO since the
                // stat, opening it must not hang; fstat below then refuses it.
                let src = rustix::fs::openat(
                    src_dir,
                    name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                let st = rustix::fs::fstat(&src)?;
                if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{} changed type during the copy", rel.display()),
                    ));
                }
                let dst = rustix::fs::openat(
                    dst_dir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )?;
                let flags = inode_flags(src.as_fd())?;
                if flags.contains(IFlags::NOCOW) {
                    rustix::fs::ioctl_setflags(&dst, IFlags::NOCOW)?;
                }
                if st.st_size > 0 {
                    sys::ficlone(dst.as_fd(), src.as_fd())?;
                }
                self.stats.bytes += st.st_size as u64;
                finish_metadata(&st, Target::Fd(dst.as_fd()), Some(src.as_fd()))
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(src_dir, name, Vec::new())?;
                rustix::fs::symlinkat(target.as_c_str(), dst_dir, name)?;
                finish_metadata(&st, Target::At(dst_dir, name), None)?;
                copy_xattrs_at(src_dir, name, dst_dir, name)
            }
            FileType::Fifo
            | FileType::Socket
            | FileType::CharacterDevice
            | FileType::BlockDevice => {
                rustix::fs::mknodat(
                    dst_dir,
                    name,
                    ty,
                    Mode::from_raw_mode(st.st_mode & 0o7777),
                    st.st_rdev,
                )?;
                copy_xattrs_at(src_dir, name, dst_dir, name)?;
                finish_metadata(&st, Target::At(dst_dir, name), None)
            }
            FileType::Unknown => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: unknown file type", rel.display()),
            )),
        }
    }
}

/// Clears the immutable and append-only flags, which forbid unlinking, on the
/// directory open as `dir` and on every directory and regular file below it,
/// so the tree can be removed. Like the copy, never follows a symlink and
/// opens nothing but directories and regular files.
pub fn clear_undeletable_flags(dir: BorrowedFd<'_>) -> io::Result<()> {
    fn clear(fd: BorrowedFd<'_>) -> io::Result<()> {
        let stuck = IFlags::IMMUTABLE | IFlags::APPEND;
        let flags = inode_flags(fd)?;
        if flags.intersects(stuck) {
            rustix::fs::ioctl_setflags(fd, flags.difference(stuck))?;
        }
        Ok(())
    }
    clear(dir)?;
    for (name, ty, _) in sys::read_dir_names(dir)? {
        match crate::walk::entry_type(dir, &name, ty)? {
            Some(FileType::Directory) => {
                let sub = sys::open_dir_at(dir, &name)?;
                clear_undeletable_flags(sub.as_fd())?;
            }
            Some(FileType::RegularFile) => {
                let file = rustix::fs::openat(
                    dir,
                    &name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                clear(file.as_fd())?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Inode flags (chattr), or none where the filesystem has no such notion.
fn inode_flags(fd: BorrowedFd<'_>) -> io::Result<IFlags> {
    match rustix::fs::ioctl_getflags(fd) {
        Ok(f) => Ok(f),
        Err(Errno::NOTTY | Errno::OPNOTSUPP | Errno::INVAL) => Ok(IFlags::empty()),
        Err(e) => Err(e.into()),
    }
}

/// Owner, mode, xattrs (for fds), timestamps and the remaining inode flags,
/// in the only order in which each survives the next.
fn finish_metadata(st: &Stat, target: Target<'_>, src: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let uid = Some(rustix::fs::Uid::from_raw(st.st_uid));
    let gid = Some(rustix::fs::Gid::from_raw(st.st_gid));
    let times = Timestamps {
        last_access: ts(st.st_atime as _, st.st_atime_nsec as _),
        last_modification: ts(st.st_mtime as _, st.st_mtime_nsec as _),
    };
    match target {
        Target::Fd(fd) => {
            rustix::fs::fchown(fd, uid, gid)?;
            rustix::fs::fchmod(fd, Mode::from_raw_mode(st.st_mode & 0o7777))?;
            if let Some(src) = src {
                copy_xattrs_fd(src, fd)?;
            }
            rustix::fs::futimens(fd, &times)?;
            if let Some(src) = src {
                let rest = inode_flags(src)?.difference(IFlags::NOCOW);
                if !rest.is_empty() {
                    rustix::fs::ioctl_setflags(fd, inode_flags(fd)? | rest)?;
                }
            }
            Ok(())
        }
        Target::At(dir, name) => {
            rustix::fs::chownat(dir, name, uid, gid, AtFlags::SYMLINK_NOFOLLOW)?;
            let ty = FileType::from_raw_mode(st.st_mode);
            if ty != FileType::Symlink {
                // mknod applied the umask; chmodat cannot follow a non-link.
                rustix::fs::chmodat(
                    dir,
                    name,
                    Mode::from_raw_mode(st.st_mode & 0o7777),
                    AtFlags::empty(),
                )?;
            }
            rustix::fs::utimensat(dir, name, &times, AtFlags::SYMLINK_NOFOLLOW)?;
            Ok(())
        }
    }
}

fn split_names(list: &[u8]) -> impl Iterator<Item = &[u8]> {
    list.split(|b| *b == 0).filter(|n| !n.is_empty())
}

fn copy_xattrs_fd(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    let list = read_list(|buf| rustix::fs::flistxattr(src, buf))?;
    for name in split_names(&list) {
        let name = OsStr::from_bytes(name);
        let value = read_list(|buf| rustix::fs::fgetxattr(src, name, buf))?;
        rustix::fs::fsetxattr(dst, name, &value, XattrFlags::empty())?;
    }
    Ok(())
}

/// Xattrs of an entry that is never opened (symlink, FIFO, device), through
/// `/proc/self/fd/<dir>/<name>` with the l* calls, which do not follow the
/// final component.
fn copy_xattrs_at(
    src_dir: BorrowedFd<'_>,
    src_name: &OsStr,
    dst_dir: BorrowedFd<'_>,
    dst_name: &OsStr,
) -> io::Result<()> {
    let src = proc_path(src_dir, src_name);
    let dst = proc_path(dst_dir, dst_name);
    let list = match read_list(|buf| rustix::fs::llistxattr(&src, buf)) {
        Ok(l) => l,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    for name in split_names(&list) {
        let name = OsStr::from_bytes(name);
        let value = read_list(|buf| rustix::fs::lgetxattr(&src, name, buf))?;
        rustix::fs::lsetxattr(&dst, name, &value, XattrFlags::empty())?;
    }
    Ok(())
}

fn proc_path(dir: BorrowedFd<'_>, name: &OsStr) -> PathBuf {
    use std::os::fd::AsRawFd;
    let mut p = OsString::from(format!("/proc/self/fd/{}/", dir.as_raw_fd()));
    p.push(name);
    PathBuf::from(p)
}

/// Calls a size-returning xattr getter with a growing buffer until it fits.
fn read_list(mut f: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 1024];
    loop {
        match f(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(Errno::RANGE) if buf.len() < (1 << 24) => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e.into()),
        }
    }
}
