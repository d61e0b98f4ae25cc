//! POSIX wrappers: fd-based, never following a symlink, names as raw bytes.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

/// `BTRFS_SUPER_MAGIC` from `linux/magic.h`.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;

/// The type of an inode, from `st_mode` or a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    /// A regular file.
    RegularFile,
    /// A directory.
    Directory,
    /// A symbolic link.
    Symlink,
    /// A named pipe.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A character device.
    CharacterDevice,
    /// A block device.
    BlockDevice,
    /// A directory entry whose filesystem did not say (DT_UNKNOWN): stat it.
    Unknown,
}

impl FileType {
    pub(super) fn from_rustix(t: rustix::fs::FileType) -> FileType {
        use rustix::fs::FileType as R;
        match t {
            R::RegularFile => FileType::RegularFile,
            R::Directory => FileType::Directory,
            R::Symlink => FileType::Symlink,
            R::Fifo => FileType::Fifo,
            R::Socket => FileType::Socket,
            R::CharacterDevice => FileType::CharacterDevice,
            R::BlockDevice => FileType::BlockDevice,
            R::Unknown => FileType::Unknown,
        }
    }

    fn to_rustix(self) -> rustix::fs::FileType {
        use rustix::fs::FileType as R;
        match self {
            FileType::RegularFile => R::RegularFile,
            FileType::Directory => R::Directory,
            FileType::Symlink => R::Symlink,
            FileType::Fifo => R::Fifo,
            FileType::Socket => R::Socket,
            FileType::CharacterDevice => R::CharacterDevice,
            FileType::BlockDevice => R::BlockDevice,
            FileType::Unknown => R::Unknown,
        }
    }
}

/// A time of an inode: (seconds, nanoseconds) since the epoch.
pub type FileTime = (i64, i64);

/// The access and modification times of an inode, as `utimensat` sets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Times {
    /// Last access (`st_atime`).
    pub access: FileTime,
    /// Last modification of the contents (`st_mtime`).
    pub modification: FileTime,
}

impl Times {
    // Timespec's field widths differ between targets.
    #[allow(clippy::unnecessary_cast)]
    fn to_rustix(self) -> rustix::fs::Timestamps {
        let ts = |(sec, nsec): FileTime| rustix::fs::Timespec {
            tv_sec: sec as _,
            tv_nsec: nsec as _,
        };
        rustix::fs::Timestamps {
            last_access: ts(self.access),
            last_modification: ts(self.modification),
        }
    }
}

/// What `fstat` and `lstat` report of an inode, as far as the crates look:
/// its type, where it lives, owner, permissions, size, link count, device
/// number and times, for the copy and carve code that reproduces an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// File type, from `st_mode`'s type bits.
    pub file_type: FileType,
    /// Permission, setuid, setgid and sticky bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Device the inode lives on (each btrfs subvolume has its own).
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Number of hard links.
    pub nlink: u64,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number, for a character or block device.
    pub rdev: u64,
    /// Size in bytes.
    pub size: u64,
    /// Last access.
    pub atime: FileTime,
    /// Last modification of the contents.
    pub mtime: FileTime,
    /// Last change of the inode (contents or metadata).
    pub ctime: FileTime,
}

impl Stat {
    /// The fields callers use of rustix's (the libc's) `struct stat`.
    // The field widths differ between targets.
    #[allow(clippy::unnecessary_cast)]
    fn from_rustix(st: &rustix::fs::Stat) -> Stat {
        Stat {
            file_type: FileType::from_rustix(rustix::fs::FileType::from_raw_mode(st.st_mode)),
            mode: (st.st_mode as u32) & 0o7777,
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            nlink: st.st_nlink as u64,
            uid: st.st_uid as u32,
            gid: st.st_gid as u32,
            rdev: st.st_rdev as u64,
            size: st.st_size as u64,
            atime: (st.st_atime as i64, st.st_atime_nsec as i64),
            mtime: (st.st_mtime as i64, st.st_mtime_nsec as i64),
            ctime: (st.st_ctime as i64, st.st_ctime_nsec as i64),
        }
    }

    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.file_type == FileType::Directory
    }

    /// The access and modification times, as [`set_times`] takes them.
    pub fn times(&self) -> Times {
        Times {
            access: self.atime,
            modification: self.mtime,
        }
    }
}

/// Opens a directory by absolute or relative path, refusing a final symlink.
pub fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    super::fault::check("open")?;
    open_read_only(
        rustix::fs::CWD,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
    )
}

/// Opens the directory `name` inside `dir`, never following a symlink.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    super::fault::check("openat")?;
    open_read_only(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
    )
}

/// openat for reading, with O_NOATIME where the caller may: a walk, a
/// copy or a count reads a package's tree without writing its access
/// times, which would dirty every inode it reads (metadata written in the
/// next transaction) and mark each as changed since a copy of it began
/// (`copy::SourceChanges`). O_NOATIME needs the file's owner or
/// CAP_FOWNER (root has it); without either the kernel says EPERM, and the
/// open goes on without the flag.
fn open_read_only<P: rustix::path::Arg + Copy>(
    dir: BorrowedFd<'_>,
    name: P,
    flags: OFlags,
) -> io::Result<OwnedFd> {
    match rustix::fs::openat(dir, name, flags | OFlags::NOATIME, Mode::empty()) {
        Err(Errno::PERM) => Ok(rustix::fs::openat(dir, name, flags, Mode::empty())?),
        r => Ok(r?),
    }
}

/// Opens (creating if needed) a regular file inside `dir` for writing.
pub(crate) fn create_file_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<OwnedFd> {
    super::fault::check("openat")?;
    Ok(rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )?)
}

/// Creates the empty regular file `name` in `dir`, never following a
/// symlink; already there is fine. Needs no data space.
pub(crate) fn touch_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    super::fault::check("openat")?;
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

/// `lstat` of `name` in `dir`, never following a final symlink; `None`
/// when it does not exist. `name` may hold several components (resolved
/// from `dir`, as `statat` does); the crates pass more than one only for
/// paths inside a tree they built themselves.
pub fn stat_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Stat>> {
    super::fault::check("statat")?;
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(Stat::from_rustix(&st))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// [`stat_at`] of a name that must exist: ENOENT when absent.
pub(crate) fn stat_existing_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Stat> {
    stat_at(dir, name)?.ok_or_else(|| Errno::NOENT.into())
}

/// `fstat` of an open fd.
pub fn stat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    super::fault::check("fstat")?;
    let st = rustix::fs::fstat(fd)?;
    Ok(Stat::from_rustix(&st))
}

/// Access and modification times of `fd`, to the nanosecond.
pub fn times(fd: BorrowedFd<'_>) -> io::Result<Times> {
    Ok(stat(fd)?.times())
}

/// Sets the access and modification times of `fd`.
pub fn set_times(fd: BorrowedFd<'_>, times: &Times) -> io::Result<()> {
    super::fault::check("futimens")?;
    Ok(rustix::fs::futimens(fd, &times.to_rustix())?)
}

/// Writes all of `data` to `fd`.
pub fn write_all(fd: BorrowedFd<'_>, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        super::fault::check("write")?;
        match rustix::io::write(fd, data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Whether `fd` lives on a btrfs filesystem.
pub fn is_btrfs(fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(fs_magic(fd)? == BTRFS_SUPER_MAGIC)
}

/// The magic number of the filesystem `fd` lives on (statfs's `f_type`,
/// `linux/magic.h`): what tells btrfs, and names another filesystem where
/// its mount table entry cannot be read ([`fs_name_of_magic`]).
pub(crate) fn fs_magic(fd: BorrowedFd<'_>) -> io::Result<i64> {
    super::fault::check("fstatfs")?;
    let st = rustix::fs::fstatfs(fd)?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libcs
    Ok(st.f_type as i64)
}

/// btrfs's magic number, as [`fs_magic`] reads it.
pub(crate) fn fs_magic_btrfs() -> i64 {
    BTRFS_SUPER_MAGIC
}

/// A filesystem named by its magic number ([`fs_magic`]), for messages
/// where its mount table entry, which names it, cannot be read. No table
/// of names: each would be a constant of the kernel's to keep in step.
pub(crate) fn fs_name_of_magic(magic: i64) -> String {
    format!("a filesystem of magic {magic:#x}")
}

/// Creates the symlink `name` in `dir` pointing at `target`, never
/// replacing anything (EEXIST). One atomic step: after a crash the name is
/// either absent or holds the whole target. On btrfs the target lives in
/// the metadata tree, so this needs no data space.
pub(crate) fn symlink_at(dir: BorrowedFd<'_>, name: &OsStr, target: &[u8]) -> io::Result<()> {
    super::fault::check("symlinkat")?;
    Ok(rustix::fs::symlinkat(OsStr::from_bytes(target), dir, name)?)
}

/// The target of the symlink `name` in `dir`, never followed; `None` if
/// `name` does not exist, EINVAL if it is not a symlink.
pub(crate) fn read_link_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Vec<u8>>> {
    super::fault::check("readlinkat")?;
    match rustix::fs::readlinkat(dir, name, Vec::new()) {
        Ok(target) => Ok(Some(target.into_bytes())),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Opens the directory at relative path `rel` below `dir`, refusing any
/// symlink on the way, any `..` that would leave `dir`, and any mount on
/// the way (EXDEV). For short paths the crates build themselves; a walk of
/// a package's tree goes one name at a time ([`crate::walk`]).
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    use rustix::fs::ResolveFlags;
    super::fault::check("openat2")?;
    Ok(rustix::fs::openat2(
        dir,
        rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH
            | ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS
            | ResolveFlags::NO_XDEV,
    )?)
}

/// Atomically swaps the entries `a` and `b` of `dir` (renameat2
/// RENAME_EXCHANGE). Both must exist and sit in the same subvolume.
pub fn rename_exchange(dir: BorrowedFd<'_>, a: &OsStr, b: &OsStr) -> io::Result<()> {
    super::fault::check("renameat_with")?;
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
    super::fault::check("renameat_with")?;
    Ok(rustix::fs::renameat_with(
        dir,
        from,
        dir,
        to,
        RenameFlags::NOREPLACE,
    )?)
}

/// Removes the file `name` from `dir`; absent is fine.
pub(crate) fn unlink_if_exists(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    super::fault::check("unlinkat")?;
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates directory `name` in `dir`; already existing is fine.
pub(crate) fn mkdir_if_missing(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    super::fault::check("mkdirat")?;
    match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates the directory at `path` (its parent must exist); already
/// existing is fine.
pub(crate) fn mkdir_path_if_missing(path: &Path, mode: u32) -> io::Result<()> {
    super::fault::check("mkdir")?;
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
    super::fault::check("fsync")?;
    Ok(rustix::fs::fsync(fd)?)
}

/// `syncfs` of the filesystem holding `fd`: every dirty page and inode of
/// it written and, where the filesystem has one, its journal committed.
pub(crate) fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    super::fault::check("syncfs")?;
    Ok(rustix::fs::syncfs(fd)?)
}

/// Creation time (statx btime; a subvolume root's otime on btrfs) of the
/// inode open as `fd`, as (seconds, nanoseconds); `None` where the
/// filesystem does not record one.
pub fn birth_time(fd: BorrowedFd<'_>) -> io::Result<Option<FileTime>> {
    use rustix::fs::{StatxFlags, statx};
    let st = statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BTIME)?;
    if !StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::BTIME) {
        return Ok(None);
    }
    Ok(Some((st.stx_btime.tv_sec, i64::from(st.stx_btime.tv_nsec))))
}

/// The id of the mount holding the file open as `fd` (statx's
/// STATX_MNT_ID): two names in one tree share it unless a mount lies
/// between them, a bind mount of the same filesystem included, which a
/// device number does not tell (a btrfs subvolume has a device number of
/// its own, yet is no mount). `None` before Linux 5.8, which does not say.
pub(crate) fn mount_id(fd: BorrowedFd<'_>) -> io::Result<Option<u64>> {
    use rustix::fs::{StatxFlags, statx};
    let st = super::fault::check("statx")
        .and_then(|()| Ok(statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)?))
        .map_err(statx_error)?;
    Ok(StatxFlags::from_bits_retain(st.stx_mask)
        .contains(StatxFlags::MNT_ID)
        .then_some(st.stx_mnt_id))
}

/// [`mount_id`] of the entry `name` of `dir`, never following a final
/// symlink: for entries that are never opened (FIFOs, sockets, devices),
/// over which a file can be bind-mounted all the same.
pub(crate) fn mount_id_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<u64>> {
    use rustix::fs::{StatxFlags, statx};
    let st = super::fault::check("statx")
        .and_then(|()| {
            Ok(statx(
                dir,
                name,
                AtFlags::SYMLINK_NOFOLLOW,
                StatxFlags::MNT_ID,
            )?)
        })
        .map_err(statx_error)?;
    Ok(StatxFlags::from_bits_retain(st.stx_mask)
        .contains(StatxFlags::MNT_ID)
        .then_some(st.stx_mnt_id))
}

/// The mount id of the directory open as `fd`, which every walk compares
/// to tell a mount inside a tree: an error naming the kernel needed where
/// statx does not give one (before Linux 5.8), so that the first call on a
/// volumes root says so in one line rather than walking blind.
pub(crate) fn require_mount_id(fd: BorrowedFd<'_>) -> io::Result<u64> {
    mount_id(fd)?.ok_or_else(|| needs_kernel("statx's mount id (STATX_MNT_ID)", "5.8"))
}

/// statx's error, where ENOSYS (no statx at all, before Linux 4.11) says
/// which kernel the crate needs.
fn statx_error(e: io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(libc::ENOSYS) => needs_kernel("statx's mount id (STATX_MNT_ID)", "5.8"),
        _ => e,
    }
}

/// An error saying that `what` needs Linux `version` or later, naming the
/// running kernel (`Unsupported`, so no errno the kernel did not give is
/// made up).
pub(crate) fn needs_kernel(what: &str, version: &str) -> io::Error {
    let release = rustix::system::uname();
    let release = release.release().to_string_lossy();
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{what} needs Linux {version} or later; this kernel is {release}"),
    )
}

/// Locks `fd` exclusively (flock), waiting as long as it takes.
///
/// flock locks belong to the open file description, so two threads of one
/// process that each opened the lock file exclude each other too.
pub(crate) fn lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<()> {
    loop {
        super::fault::check("flock")?;
        match rustix::fs::flock(fd, rustix::fs::FlockOperation::LockExclusive) {
            Err(Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Locks `fd` shared (flock), waiting as long as it takes: any number of
/// shared holders, none beside an exclusive one.
pub(crate) fn lock_shared(fd: BorrowedFd<'_>) -> io::Result<()> {
    loop {
        super::fault::check("flock")?;
        match rustix::fs::flock(fd, rustix::fs::FlockOperation::LockShared) {
            Err(Errno::INTR) => continue,
            r => return Ok(r?),
        }
    }
}

/// Releases the flock this open file description holds on `fd`, if any.
pub(crate) fn unlock(fd: BorrowedFd<'_>) -> io::Result<()> {
    super::fault::check("flock")?;
    Ok(rustix::fs::flock(fd, rustix::fs::FlockOperation::Unlock)?)
}

/// Locks `fd` exclusively (flock) if nobody holds it; `false` if another
/// open file description does.
pub(crate) fn try_lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<bool> {
    use rustix::fs::FlockOperation;
    loop {
        super::fault::check("flock")?;
        match rustix::fs::flock(fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(true),
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The block size of the filesystem holding `fd` (statvfs `f_bsize`, at
/// least 512): the unit FICLONERANGE offsets must be multiples of.
pub(crate) fn block_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    super::fault::check("fstatvfs")?;
    Ok(rustix::fs::fstatvfs(fd)?.f_bsize.max(512))
}

/// Opens `name` in `dir` read-only, never following a final symlink and
/// never blocking: O_NONBLOCK, so an entry swapped for a FIFO since the
/// caller's stat cannot hang the open (the caller's fstat then tells).
/// `name` may hold several components, as for [`stat_at`].
pub(crate) fn open_read_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    super::fault::check("openat")?;
    open_read_only(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
    )
}

/// Opens the regular file `name` in `dir` for writing, never following a
/// symlink nor blocking on a FIFO. With `create`, the file must be new
/// (O_CREAT | O_EXCL: EEXIST otherwise) and gets `mode` (less the umask);
/// without, it must exist.
pub(crate) fn open_write_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    create: bool,
    mode: u32,
) -> io::Result<OwnedFd> {
    let create = if create {
        OFlags::CREATE | OFlags::EXCL
    } else {
        OFlags::empty()
    };
    super::fault::check("openat")?;
    Ok(rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | create | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )?)
}

/// Creates the directory `name` in `dir` with `mode` (less the umask);
/// EEXIST if anything is there already.
pub fn mkdir_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    super::fault::check("mkdirat")?;
    Ok(rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode))?)
}

/// Creates the FIFO, socket or device node `name` in `dir` (mknodat),
/// with permission bits `mode` (less the umask) and, for a device,
/// device number `rdev`.
pub(crate) fn mknod_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    file_type: FileType,
    mode: u32,
    rdev: u64,
) -> io::Result<()> {
    super::fault::check("mknodat")?;
    Ok(rustix::fs::mknodat(
        dir,
        name,
        file_type.to_rustix(),
        Mode::from_raw_mode(mode & 0o7777),
        rdev,
    )?)
}

/// Removes the non-directory entry `name` of `dir` (unlinkat); ENOENT if
/// absent, EPERM if an immutable or append-only flag forbids it.
pub(crate) fn unlink_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    super::fault::check("unlinkat")?;
    Ok(rustix::fs::unlinkat(dir, name, AtFlags::empty())?)
}

/// Removes the empty directory `name` of `dir`; ENOTEMPTY otherwise.
pub fn rmdir_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    super::fault::check("unlinkat")?;
    Ok(rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)?)
}

/// Renames `from` in `from_dir` to `to` in `to_dir` (renameat), replacing
/// what `to` names as rename(2) does. Both in one filesystem; never
/// follows a symlink (a symlink is renamed itself).
pub fn rename_at(
    from_dir: BorrowedFd<'_>,
    from: &OsStr,
    to_dir: BorrowedFd<'_>,
    to: &OsStr,
) -> io::Result<()> {
    super::fault::check("renameat")?;
    Ok(rustix::fs::renameat(from_dir, from, to_dir, to)?)
}

/// Makes `new` in `new_dir` another name of the inode `old` names in
/// `old_dir` (linkat, never following a final symlink). `old` may hold
/// several components, as for [`stat_at`]; EEXIST if `new` exists.
pub(crate) fn link_at(
    old_dir: BorrowedFd<'_>,
    old: &OsStr,
    new_dir: BorrowedFd<'_>,
    new: &OsStr,
) -> io::Result<()> {
    super::fault::check("linkat")?;
    Ok(rustix::fs::linkat(
        old_dir,
        old,
        new_dir,
        new,
        AtFlags::empty(),
    )?)
}

/// Truncates (or extends with a hole) the file open as `fd` to `len`.
pub(crate) fn truncate(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    super::fault::check("ftruncate")?;
    Ok(rustix::fs::ftruncate(fd, len)?)
}

/// Sets the owner of the inode open as `fd`. The kernel clears the setuid
/// and setgid bits and file capabilities on a chown: callers set the mode
/// and xattrs after it.
pub(crate) fn chown(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    super::fault::check("fchown")?;
    Ok(rustix::fs::fchown(
        fd,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    )?)
}

/// Sets the permission bits (`mode & 0o7777`) of the inode open as `fd`.
pub(crate) fn chmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    super::fault::check("fchmod")?;
    Ok(rustix::fs::fchmod(fd, Mode::from_raw_mode(mode & 0o7777))?)
}

/// Sets the owner of `name` in `dir`, never following a symlink (a
/// symlink's own owner is set), for entries that are never opened.
pub(crate) fn chown_at(dir: BorrowedFd<'_>, name: &OsStr, uid: u32, gid: u32) -> io::Result<()> {
    super::fault::check("chownat")?;
    Ok(rustix::fs::chownat(
        dir,
        name,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )?)
}

/// Sets the permission bits (`mode & 0o7777`) of `name` in `dir`, an entry
/// that is never opened (FIFO, socket, device). fchmodat cannot refuse to
/// follow a symlink (Linux has no AT_SYMLINK_NOFOLLOW for it), so callers
/// pass only names they created as something else.
pub(crate) fn chmod_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    super::fault::check("chmodat")?;
    Ok(rustix::fs::chmodat(
        dir,
        name,
        Mode::from_raw_mode(mode & 0o7777),
        AtFlags::empty(),
    )?)
}

/// Sets the access and modification times of `name` in `dir`, never
/// following a symlink (a symlink's own times are set).
pub(crate) fn set_times_at(dir: BorrowedFd<'_>, name: &OsStr, times: &Times) -> io::Result<()> {
    super::fault::check("utimensat")?;
    Ok(rustix::fs::utimensat(
        dir,
        name,
        &times.to_rustix(),
        AtFlags::SYMLINK_NOFOLLOW,
    )?)
}

/// The process's effective user and group ids (never fail).
pub(crate) fn effective_ids() -> (u32, u32) {
    (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    )
}

/// Major and minor numbers of a device number (pure arithmetic, kept here
/// with the calls that return device numbers).
pub(crate) fn major_minor(dev: u64) -> (u32, u32) {
    (rustix::fs::major(dev), rustix::fs::minor(dev))
}

/// Canonicalizes `path` (realpath), following every symlink: for the
/// volumes root, a trusted path from the operator's configuration.
pub(crate) fn canonicalize(path: &Path) -> io::Result<std::path::PathBuf> {
    super::fault::check("realpath")?;
    std::fs::canonicalize(path)
}

/// Creates the directory `path` and every missing parent (`mkdir -p`, mode
/// 0777 less the umask), following symlinks: for the volumes root, a
/// trusted path from the operator's configuration.
pub(crate) fn create_dir_all(path: &Path) -> io::Result<()> {
    super::fault::check("mkdir -p")?;
    std::fs::create_dir_all(path)
}

/// The process's limit on open files, as (soft, hard); unlimited is
/// `u64::MAX`.
pub fn nofile_limit() -> (u64, u64) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (l.current.unwrap_or(u64::MAX), l.maximum.unwrap_or(u64::MAX))
}

/// Sets both the soft and the hard limit on open files to `n` (raising the
/// hard one needs CAP_SYS_RESOURCE).
pub fn set_nofile_limit(n: u64) -> io::Result<()> {
    let l = rustix::process::Rlimit {
        current: Some(n),
        maximum: Some(n),
    };
    super::fault::check("setrlimit")?;
    Ok(rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        l,
    )?)
}

/// Stops the calling process with SIGSTOP, until someone sends SIGCONT: a
/// failpoint's pause, for a test to act at that step.
///
/// The signal goes to the calling thread, which takes it before it
/// returns from the call: the process stops at the step itself. Sent to
/// the process, it may go to another thread, and the caller runs on to
/// its next system call (a batch's clock read in between would not see
/// the pause).
#[cfg(all(feature = "failpoints", startos_failpoints))]
pub(crate) fn stop_self() {
    // SAFETY: raise takes no pointer and has no precondition.
    let _ = unsafe { libc::raise(libc::SIGSTOP) };
}

/// Kills the calling process with SIGKILL: a failpoint's crash, which no
/// handler, unwinding or buffered write can soften. Returns only if the
/// signal could not be sent.
#[cfg(all(feature = "failpoints", startos_failpoints))]
pub(crate) fn kill_self() {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
}
