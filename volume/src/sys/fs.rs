//! POSIX wrappers: fd-based, never following a symlink, names as raw bytes.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

/// `BTRFS_SUPER_MAGIC` from `linux/magic.h`.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;

/// The subset of `struct stat` the crate looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// File type bits.
    pub file_type: FileType,
    /// Device the inode lives on (each btrfs subvolume has its own).
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

impl Stat {
    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.file_type == FileType::Directory
    }
}

/// Opens a directory by absolute or relative path, refusing a final symlink.
pub fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens the directory `name` inside `dir`, never following a symlink.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens (creating if needed) a regular file inside `dir` for writing.
pub fn create_file_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )?)
}

/// Creates the empty regular file `name` in `dir`, never following a
/// symlink; already there is fine. Needs no data space.
pub fn touch_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    match rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    ) {
        Ok(_) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `lstat` of `name` in `dir`; `None` when it does not exist.
pub fn stat_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Stat>> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(Stat {
            file_type: FileType::from_raw_mode(st.st_mode),
            dev: st.st_dev,
            ino: st.st_ino,
        })),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `fstat` of an open fd.
pub fn stat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    let st = rustix::fs::fstat(fd)?;
    Ok(Stat {
        file_type: FileType::from_raw_mode(st.st_mode),
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// Access and modification times of `fd`, to the nanosecond.
pub fn times(fd: BorrowedFd<'_>) -> io::Result<rustix::fs::Timestamps> {
    let st = rustix::fs::fstat(fd)?;
    #[allow(clippy::unnecessary_cast)] // the field widths differ between targets
    Ok(rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: st.st_atime as _,
            tv_nsec: st.st_atime_nsec as _,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: st.st_mtime as _,
            tv_nsec: st.st_mtime_nsec as _,
        },
    })
}

/// Sets the access and modification times of `fd`.
pub fn set_times(fd: BorrowedFd<'_>, times: &rustix::fs::Timestamps) -> io::Result<()> {
    Ok(rustix::fs::futimens(fd, times)?)
}

/// Writes all of `data` to `fd`.
pub fn write_all(fd: BorrowedFd<'_>, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        match rustix::io::write(fd, data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads the small regular file `name` in `dir` (at most `limit` bytes),
/// refusing a symlink and never blocking on a FIFO; `None` if absent.
pub fn read_small_file_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    limit: usize,
) -> io::Result<Option<Vec<u8>>> {
    let fd = match rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if stat(fd.as_fd())?.file_type != FileType::RegularFile {
        return Ok(None);
    }
    let mut buf = vec![0u8; limit];
    let mut len = 0;
    while len < limit {
        match rustix::io::read(&fd, &mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    buf.truncate(len);
    Ok(Some(buf))
}

/// Whether `fd` lives on a btrfs filesystem.
pub fn is_btrfs(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let st = rustix::fs::fstatfs(fd)?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    Ok(st.f_type as i64 == BTRFS_SUPER_MAGIC)
}

/// Creates the symlink `name` in `dir` pointing at `target`, never
/// replacing anything (EEXIST). One atomic step: after a crash the name is
/// either absent or holds the whole target. On btrfs the target lives in
/// the metadata tree, so this needs no data space.
pub fn symlink_at(dir: BorrowedFd<'_>, name: &OsStr, target: &[u8]) -> io::Result<()> {
    Ok(rustix::fs::symlinkat(OsStr::from_bytes(target), dir, name)?)
}

/// The target of the symlink `name` in `dir`, never followed; `None` if
/// `name` does not exist, EINVAL if it is not a symlink.
pub fn read_link_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Vec<u8>>> {
    match rustix::fs::readlinkat(dir, name, Vec::new()) {
        Ok(target) => Ok(Some(target.into_bytes())),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Opens the directory at relative path `rel` below `dir`, refusing any
/// symlink on the way and any `..` that would leave `dir`.
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    use rustix::fs::ResolveFlags;
    Ok(rustix::fs::openat2(
        dir,
        rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?)
}

/// Atomically swaps the entries `a` and `b` of `dir` (renameat2
/// RENAME_EXCHANGE). Both must exist and sit in the same subvolume.
pub fn rename_exchange(dir: BorrowedFd<'_>, a: &OsStr, b: &OsStr) -> io::Result<()> {
    Ok(rustix::fs::renameat_with(
        dir,
        a,
        dir,
        b,
        RenameFlags::EXCHANGE,
    )?)
}

/// Renames `from` to `to` in `dir`, failing with EEXIST rather than replacing.
pub fn rename_noreplace(dir: BorrowedFd<'_>, from: &OsStr, to: &OsStr) -> io::Result<()> {
    Ok(rustix::fs::renameat_with(
        dir,
        from,
        dir,
        to,
        RenameFlags::NOREPLACE,
    )?)
}

/// Removes the file `name` from `dir`; absent is fine.
pub fn unlink_if_exists(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates directory `name` in `dir`; already existing is fine.
pub fn mkdir_if_missing(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates the directory at `path` (its parent must exist); already
/// existing is fine.
pub fn mkdir_path_if_missing(path: &Path, mode: u32) -> io::Result<()> {
    match rustix::fs::mkdir(path, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `fsync` of a file or directory.
///
/// On btrfs a directory fsync after a rename goes through the tree log, or
/// commits the transaction when the rename moved a subvolume root: either way
/// the rename survives a power cut once this returns.
pub fn fsync(fd: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::fs::fsync(fd)?)
}

/// Creation time (statx btime; a subvolume root's otime on btrfs) of the
/// inode open as `fd`, as (seconds, nanoseconds); `None` where the
/// filesystem does not record one.
pub fn birth_time(fd: BorrowedFd<'_>) -> io::Result<Option<(i64, i64)>> {
    use rustix::fs::{StatxFlags, statx};
    let st = statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BTIME)?;
    if !StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::BTIME) {
        return Ok(None);
    }
    Ok(Some((st.stx_btime.tv_sec, i64::from(st.stx_btime.tv_nsec))))
}

/// Locks `fd` exclusively (flock), waiting as long as it takes.
///
/// flock locks belong to the open file description, so two threads of one
/// process that each opened the lock file exclude each other too.
pub fn lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<()> {
    loop {
        match rustix::fs::flock(fd, rustix::fs::FlockOperation::LockExclusive) {
            Err(Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Reads all names in a directory except `.` and `..`, as raw bytes.
pub fn read_dir_names(fd: BorrowedFd<'_>) -> io::Result<Vec<(OsString, FileType, u64)>> {
    let mut dir = rustix::fs::Dir::read_from(fd)?;
    let mut out = Vec::new();
    while let Some(entry) = dir.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        out.push((
            OsString::from_vec(name.to_vec()),
            entry.file_type(),
            entry.ino(),
        ));
    }
    Ok(out)
}
