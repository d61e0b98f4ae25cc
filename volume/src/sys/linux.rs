//! Every system call the crate makes on a volume, in one place.
//!
//! Subvolume operations go through libbtrfsutil's fd-based entry points
//! (`*_fd`, `*_fd2`): a name is always resolved relative to a directory we
//! already hold open, so nothing a package writes into its volume (a symlink
//! where a directory was, say) can redirect an operation elsewhere. The few
//! calls libbtrfsutil lacks (renameat2, FICLONE, TREE_SEARCH_V2, SPACE_INFO,
//! FS_INFO, DEV_INFO) go through rustix.
//!
//! All functions return plain `io::Error`s carrying the OS error number;
//! callers add which package and path it was about.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use btrfsutil_sys as bu;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

/// `BTRFS_SUPER_MAGIC` from `linux/magic.h`.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
/// Inode number of every subvolume root (`BTRFS_FIRST_FREE_OBJECTID`).
pub const SUBVOLUME_ROOT_INO: u64 = 256;

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

fn c_name(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Turns a libbtrfsutil status into an `io::Error` with the errno it left.
fn check(code: bu::btrfs_util_error) -> io::Result<()> {
    if code == bu::btrfs_util_error_BTRFS_UTIL_OK {
        return Ok(());
    }
    let os = io::Error::last_os_error();
    if os.raw_os_error().is_some_and(|e| e != 0) {
        return Err(os);
    }
    // SAFETY: btrfs_util_strerror returns a static string for any code.
    let msg = unsafe { CStr::from_ptr(bu::btrfs_util_strerror(code)) };
    Err(io::Error::other(msg.to_string_lossy().into_owned()))
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

/// Whether `fd` is the root directory of a btrfs subvolume.
///
/// A subvolume root is always inode 256 on btrfs; checking the filesystem
/// first keeps an ext4 directory that happens to be inode 256 from passing.
pub fn is_subvolume(fd: BorrowedFd<'_>) -> io::Result<bool> {
    if !is_btrfs(fd)? {
        return Ok(false);
    }
    let st = stat(fd)?;
    Ok(st.ino == SUBVOLUME_ROOT_INO && st.is_dir())
}

/// Creates an empty subvolume `name` inside `parent`. Atomic: after a crash
/// either nothing or an empty subvolume exists under `name`.
pub fn create_subvolume(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    let c = c_name(name)?;
    // SAFETY: valid fd and NUL-terminated name; null async/qgroup pointers are allowed.
    check(unsafe {
        bu::btrfs_util_create_subvolume_fd(
            parent.as_raw_fd(),
            c.as_ptr(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })
}

/// Snapshots the subvolume open as `source`, and every subvolume nested in
/// it, to a new writable subvolume `name` inside `parent`, and returns it
/// open. The copy matches the source to the nanosecond: each nested
/// subvolume's snapshot replaces an empty placeholder (an rmdir, then a
/// snapshot under the same name), which changes its parent directory's
/// times, so those are set back to the source's.
///
/// One ioctl per subvolume, so a crash can leave a partial tree: callers
/// snapshot under a temporary name. Writable because nested snapshots are
/// placed inside the new one; callers freeze it afterwards if they must
/// ([`make_tree_read_only`]).
pub fn snapshot_tree(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
) -> io::Result<OwnedFd> {
    create_snapshot(
        source,
        parent,
        name,
        bu::BTRFS_UTIL_CREATE_SNAPSHOT_RECURSIVE as i32,
    )?;
    let copy = open_dir_at(parent, name)?;
    for rel in nested_subvolumes(copy.as_fd())? {
        let dir = rel.parent().unwrap_or(Path::new(""));
        let (t, target) = if dir.as_os_str().is_empty() {
            (times(source)?, None)
        } else {
            (
                times(open_beneath(source, dir)?.as_fd())?,
                Some(open_beneath(copy.as_fd(), dir)?),
            )
        };
        set_times(target.as_ref().map_or(copy.as_fd(), |fd| fd.as_fd()), &t)?;
    }
    Ok(copy)
}

/// Snapshots the subvolume open as `source` (its root directory) to a new
/// writable subvolume `name` inside `parent`, without the subvolumes nested
/// in it: each shows in the snapshot as an empty placeholder directory,
/// which `rmdir` removes. O(1) whatever the source holds; atomic (after a
/// crash the snapshot is either all there or absent). The kernel flushes
/// the source's dirty data first.
pub fn snapshot(source: BorrowedFd<'_>, parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    create_snapshot(source, parent, name, 0)
}

/// libbtrfsutil's snapshot of `source` as `name` in `parent`, with its
/// `BTRFS_UTIL_CREATE_SNAPSHOT_*` flags.
fn create_snapshot(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    flags: i32,
) -> io::Result<()> {
    let c = c_name(name)?;
    // SAFETY: valid fds and NUL-terminated name; null async/qgroup pointers are allowed.
    check(unsafe {
        bu::btrfs_util_create_snapshot_fd2(
            source.as_raw_fd(),
            parent.as_raw_fd(),
            c.as_ptr(),
            flags,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })
}

/// The root directory of the subvolume holding the directory open as
/// `dir`, found by walking `..` without leaving `dir`'s mount, with the
/// names that lead from it down to `dir` (empty when `dir` is that root).
/// `None` when the mount's root lies below the subvolume's root (a
/// subdirectory or bind mount): the subvolume root is then out of reach.
pub fn subvolume_root_of(dir: BorrowedFd<'_>) -> io::Result<Option<(OwnedFd, Vec<OsString>)>> {
    use rustix::fs::{StatxFlags, statx};
    // Before Linux 5.8 statx has no mount id: then nothing is known.
    let mount_of = |fd: BorrowedFd<'_>| -> io::Result<Option<u64>> {
        let st = statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)?;
        Ok(StatxFlags::from_bits_retain(st.stx_mask)
            .contains(StatxFlags::MNT_ID)
            .then_some(st.stx_mnt_id))
    };
    let Some(mount) = mount_of(dir)? else {
        return Ok(None);
    };
    let mut cur = open_dir_at(dir, OsStr::new("."))?;
    let mut names = Vec::new();
    loop {
        let st = stat(cur.as_fd())?;
        if st.ino == SUBVOLUME_ROOT_INO {
            names.reverse();
            return Ok(Some((cur, names)));
        }
        let up = open_dir_at(cur.as_fd(), OsStr::new(".."))?;
        let up_st = stat(up.as_fd())?;
        if up_st.dev != st.dev || up_st.ino == st.ino || mount_of(up.as_fd())? != Some(mount) {
            return Ok(None);
        }
        // A directory has one name: the entry of `up` with its inode number.
        let Some((name, _, _)) = read_dir_names(up.as_fd())?
            .into_iter()
            .find(|(_, ty, ino)| *ino == st.ino && *ty == FileType::Directory)
        else {
            return Ok(None);
        };
        names.push(name);
        cur = up;
    }
}

/// Sets or clears the read-only flag of the subvolume open as `fd`.
pub fn set_read_only(fd: BorrowedFd<'_>, read_only: bool) -> io::Result<()> {
    // SAFETY: valid fd.
    check(unsafe { bu::btrfs_util_set_subvolume_read_only_fd(fd.as_raw_fd(), read_only) })
}

/// Whether the subvolume open as `fd` is read-only.
pub fn is_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut ro = false;
    // SAFETY: valid fd and out-pointer.
    check(unsafe { bu::btrfs_util_get_subvolume_read_only_fd(fd.as_raw_fd(), &mut ro) })?;
    Ok(ro)
}

/// What the kernel records of one subvolume (BTRFS_IOC_GET_SUBVOL_INFO).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubvolumeInfo {
    /// The subvolume's tree id (5 for the top level).
    pub id: u64,
    /// Its own UUID, drawn at creation: unique among every subvolume the
    /// filesystem ever held, so it names this one subvolume for good.
    pub uuid: [u8; 16],
    /// The UUID of the subvolume it is a snapshot of; zero if none.
    pub parent_uuid: [u8; 16],
    /// Whether it is read-only.
    pub read_only: bool,
}

/// [`SubvolumeInfo`] of the subvolume holding the directory open as `fd`
/// (Linux 4.18+, no privilege needed). Fails with ENOTTY off btrfs.
pub fn subvolume_info(fd: BorrowedFd<'_>) -> io::Result<SubvolumeInfo> {
    use rustix::ioctl::{Getter, opcode};
    /// `struct btrfs_ioctl_timespec`, padded as the C compiler pads it.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Timespec {
        sec: u64,
        nsec: u32,
    }
    /// `struct btrfs_ioctl_get_subvol_info_args` from `linux/btrfs.h`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Args {
        treeid: u64,
        name: [u8; 256],
        parent_id: u64,
        dirid: u64,
        generation: u64,
        flags: u64,
        uuid: [u8; 16],
        parent_uuid: [u8; 16],
        received_uuid: [u8; 16],
        ctransid: u64,
        otransid: u64,
        stransid: u64,
        rtransid: u64,
        times: [Timespec; 4],
        reserved: [u64; 8],
    }
    const _: () = assert!(std::mem::size_of::<Args>() == 504);
    const GET_SUBVOL_INFO: rustix::ioctl::Opcode = opcode::read::<Args>(0x94, 60);
    /// `BTRFS_ROOT_SUBVOL_RDONLY` in the root item's flags.
    const ROOT_SUBVOL_RDONLY: u64 = 1;
    // SAFETY: GET_SUBVOL_INFO is _IOR(0x94, 60, struct
    // btrfs_ioctl_get_subvol_info_args) and fills that struct, which Args
    // matches in size and layout.
    let args = unsafe { rustix::ioctl::ioctl(fd, Getter::<GET_SUBVOL_INFO, Args>::new()) }?;
    Ok(SubvolumeInfo {
        id: args.treeid,
        uuid: args.uuid,
        parent_uuid: args.parent_uuid,
        read_only: args.flags & ROOT_SUBVOL_RDONLY != 0,
    })
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

/// Paths (relative to `fd`) of every subvolume nested below the subvolume
/// open as `fd`, children before their parents.
pub fn nested_subvolumes(fd: BorrowedFd<'_>) -> io::Result<Vec<PathBuf>> {
    let mut iter: *mut bu::btrfs_util_subvolume_iterator = std::ptr::null_mut();
    // SAFETY: valid fd and out-pointer; top 0 means "the subvolume of fd".
    check(unsafe {
        bu::btrfs_util_create_subvolume_iterator_fd(
            fd.as_raw_fd(),
            0,
            bu::BTRFS_UTIL_SUBVOLUME_ITERATOR_POST_ORDER as i32,
            &mut iter,
        )
    })?;
    let mut out = Vec::new();
    let result = loop {
        let mut path: *mut libc::c_char = std::ptr::null_mut();
        let mut id = 0u64;
        // SAFETY: iter is live until destroyed below; path is malloc'd by the library.
        let code = unsafe { bu::btrfs_util_subvolume_iterator_next(iter, &mut path, &mut id) };
        if code == bu::btrfs_util_error_BTRFS_UTIL_ERROR_STOP_ITERATION {
            break Ok(());
        }
        if let Err(e) = check(code) {
            break Err(e);
        }
        // SAFETY: on success path is a NUL-terminated malloc'd string we now own.
        let bytes = unsafe { CStr::from_ptr(path) }.to_bytes().to_vec();
        // SAFETY: allocated by libbtrfsutil with malloc.
        unsafe { libc::free(path.cast()) };
        out.push(PathBuf::from(OsString::from_vec(bytes)));
    };
    // SAFETY: created above, destroyed once.
    unsafe { bu::btrfs_util_destroy_subvolume_iterator(iter) };
    result.map(|()| out)
}

/// Deletes the subvolume `name` inside `parent`, and with `recursive` every
/// subvolume nested in it. O(1) per subvolume: the kernel's cleaner frees the
/// extents later, in the background.
///
/// A nested subvolume inside a read-only one cannot be unlinked, so callers
/// clear read-only flags first (see [`make_tree_writable`]).
pub fn delete_subvolume(parent: BorrowedFd<'_>, name: &OsStr, recursive: bool) -> io::Result<()> {
    let c = c_name(name)?;
    let flags = if recursive {
        bu::BTRFS_UTIL_DELETE_SUBVOLUME_RECURSIVE as i32
    } else {
        0
    };
    // SAFETY: valid fd and NUL-terminated name.
    check(unsafe { bu::btrfs_util_delete_subvolume_fd(parent.as_raw_fd(), c.as_ptr(), flags) })
}

/// Clears the read-only flag on the subvolume open as `fd` and on every
/// subvolume nested in it, so the tree can be deleted.
pub fn make_tree_writable(fd: BorrowedFd<'_>) -> io::Result<()> {
    if is_read_only(fd)? {
        set_read_only(fd, false)?;
    }
    for rel in nested_subvolumes(fd)? {
        let sub = open_beneath(fd, &rel)?;
        if is_read_only(sub.as_fd())? {
            set_read_only(sub.as_fd(), false)?;
        }
    }
    Ok(())
}

/// Sets the read-only flag on every subvolume nested in `fd`, children
/// first, then on `fd` itself: once the top is read-only, the tree is frozen.
pub fn make_tree_read_only(fd: BorrowedFd<'_>) -> io::Result<()> {
    for rel in nested_subvolumes(fd)? {
        let sub = open_beneath(fd, &rel)?;
        set_read_only(sub.as_fd(), true)?;
    }
    set_read_only(fd, true)
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

/// Commits the current btrfs transaction (BTRFS_IOC_SYNC) of the filesystem
/// holding `fd`.
pub fn commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: valid fd.
    check(unsafe { bu::btrfs_util_sync_fd(fd.as_raw_fd()) })
}

/// Starts committing the current btrfs transaction of the filesystem
/// holding `fd` (BTRFS_IOC_START_SYNC) without waiting for it: long copies
/// call it now and then so that the commit they must wait for at the end
/// has little left to write.
pub fn start_commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut transid = 0u64;
    // SAFETY: valid fd and out-pointer.
    check(unsafe { bu::btrfs_util_start_sync_fd(fd.as_raw_fd(), &mut transid) })
}

/// Commits the running btrfs transaction of the filesystem holding `fd`
/// and waits until it is on disk (BTRFS_IOC_START_SYNC, then
/// BTRFS_IOC_WAIT_SYNC), without first writing out every file's dirty
/// data as [`commit`] does: every metadata change made so far (renames,
/// times, flags, records) is then durable, at the cost of one commit,
/// however much data other writers have in the page cache.
pub fn commit_metadata(fd: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::ioctl::{Getter, Setter, opcode};
    const START_SYNC: rustix::ioctl::Opcode = opcode::read::<u64>(0x94, 24);
    const WAIT_SYNC: rustix::ioctl::Opcode = opcode::write::<u64>(0x94, 22);
    // SAFETY: START_SYNC is _IOR(0x94, 24, __u64) and writes the transid.
    let transid = unsafe { rustix::ioctl::ioctl(fd, Getter::<START_SYNC, u64>::new()) }?;
    // SAFETY: WAIT_SYNC is _IOW(0x94, 22, __u64) and reads the transid.
    unsafe { rustix::ioctl::ioctl(fd, Setter::<WAIT_SYNC, u64>::new(transid)) }?;
    Ok(())
}

/// Sets or clears the immutable and append-only flags of the file or
/// directory open as `fd`, leaving every other attribute alone, through
/// FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR. Unlike FS_IOC_SETFLAGS, which on
/// btrfs rewrites the `btrfs.compression` property from the compression
/// bits it is given, this changes nothing else.
pub fn set_immutable_append(fd: BorrowedFd<'_>, immutable: bool, append: bool) -> io::Result<()> {
    use rustix::ioctl::{Getter, Setter, opcode};
    /// `struct fsxattr` from `linux/fs.h`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct FsXattr {
        xflags: u32,
        extsize: u32,
        nextents: u32,
        projid: u32,
        cowextsize: u32,
        pad: [u8; 8],
    }
    const _: () = assert!(std::mem::size_of::<FsXattr>() == 28);
    const GET: rustix::ioctl::Opcode = opcode::read::<FsXattr>(b'X', 31);
    const SET: rustix::ioctl::Opcode = opcode::write::<FsXattr>(b'X', 32);
    const IMMUTABLE: u32 = 0x8;
    const APPEND: u32 = 0x10;
    // SAFETY: FS_IOC_FSGETXATTR is _IOR('X', 31, struct fsxattr) and fills
    // that struct, which FsXattr matches in size and layout.
    let mut attr = unsafe { rustix::ioctl::ioctl(fd, Getter::<GET, FsXattr>::new()) }?;
    let mut xflags = attr.xflags & !(IMMUTABLE | APPEND);
    if immutable {
        xflags |= IMMUTABLE;
    }
    if append {
        xflags |= APPEND;
    }
    if xflags != attr.xflags {
        attr.xflags = xflags;
        // SAFETY: FS_IOC_FSSETXATTR is _IOW('X', 32, struct fsxattr) and reads
        // that struct, as FS_IOC_FSGETXATTR filled it but for the flags.
        unsafe { rustix::ioctl::ioctl(fd, Setter::<SET, FsXattr>::new(attr)) }?;
    }
    Ok(())
}

/// Shares all of `src`'s extents with `dst` (FICLONE), a reflink copy.
pub fn ficlone(dst: BorrowedFd<'_>, src: BorrowedFd<'_>) -> io::Result<()> {
    Ok(rustix::fs::ioctl_ficlone(dst, src)?)
}

/// Shares `len` bytes of `src` at `offset` with `dst` at the same offset
/// (FICLONERANGE), a reflink of one range. `offset` must be a multiple of the
/// filesystem block size, and so must `len` unless the range ends at `src`'s
/// end of file. Cost is O(extents in the range), so a caller cloning a huge
/// file in chunks can stop and resume between them.
pub fn ficlone_range(
    dst: BorrowedFd<'_>,
    src: BorrowedFd<'_>,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    use rustix::ioctl::{Setter, opcode};
    /// `struct file_clone_range` from `linux/fs.h`.
    #[repr(C)]
    struct FileCloneRange {
        src_fd: i64,
        src_offset: u64,
        src_length: u64,
        dest_offset: u64,
    }
    const FICLONERANGE: rustix::ioctl::Opcode = opcode::write::<FileCloneRange>(0x94, 13);
    let arg = FileCloneRange {
        src_fd: i64::from(src.as_raw_fd()),
        src_offset: offset,
        src_length: len,
        dest_offset: offset,
    };
    // SAFETY: FICLONERANGE is _IOW(0x94, 13, struct file_clone_range) and
    // takes a pointer to that struct, which Setter passes.
    unsafe { rustix::ioctl::ioctl(dst, Setter::<FICLONERANGE, FileCloneRange>::new(arg)) }?;
    Ok(())
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

/// The argument of a btrfs ioctl that is a fixed header followed by a
/// buffer the header sizes (TREE_SEARCH_V2, SPACE_INFO): one 8-byte aligned
/// allocation of words, with the opcode its header's size gives.
struct WordsArg<'a> {
    opcode: rustix::ioctl::Opcode,
    words: &'a mut [u64],
}

// SAFETY: `words` is writable for its whole length; each caller passes the
// opcode whose header it lays out first, and sizes the buffer after it as
// that header announces, so the kernel writes nothing beyond it.
unsafe impl rustix::ioctl::Ioctl for WordsArg<'_> {
    type Output = ();
    const IS_MUTATING: bool = true;
    fn opcode(&self) -> rustix::ioctl::Opcode {
        self.opcode
    }
    fn as_ptr(&mut self) -> *mut std::ffi::c_void {
        self.words.as_mut_ptr().cast()
    }
    unsafe fn output_from_ptr(
        _: rustix::ioctl::IoctlOutput,
        _: *mut std::ffi::c_void,
    ) -> rustix::io::Result<()> {
        Ok(())
    }
}

pub mod item {
    //! Where the fields of the b-tree items read here sit in an item's body
    //! (little endian, as on disk), and how to read them.

    /// `ram_bytes` in `struct btrfs_file_extent_item`.
    pub const RAM_BYTES: usize = 8;
    /// `compression`.
    pub const COMPRESSION: usize = 16;
    /// `type`: inline, regular or prealloc.
    pub const TYPE: usize = 20;
    /// `disk_bytenr` (regular and prealloc only, as all that follow).
    pub const DISK_BYTENR: usize = 21;
    /// `disk_num_bytes`.
    pub const DISK_NUM_BYTES: usize = 29;
    /// `num_bytes`.
    pub const NUM_BYTES: usize = 45;
    /// Header size of an inline extent; the data follows.
    pub const INLINE_HEADER: usize = 21;
    /// Size of a regular or prealloc extent item.
    pub const REGULAR_LEN: usize = 53;
    /// Extent type: data stored in the item itself.
    pub const TYPE_INLINE: u8 = 0;
    /// Extent type: allocated, never written.
    pub const TYPE_PREALLOC: u8 = 2;
    /// `size` in `struct btrfs_inode_item`.
    pub const INODE_SIZE: usize = 16;
    /// `mode` in `struct btrfs_inode_item`.
    pub const INODE_MODE: usize = 52;
    /// `flags` in `struct btrfs_inode_item`.
    pub const INODE_FLAGS: usize = 64;
    /// `BTRFS_INODE_NODATACOW` in those flags (`chattr +C`).
    pub const INODE_NODATACOW: u64 = 1;

    /// The little-endian u64 at `at`, or `None` past the body's end.
    pub fn le64(body: &[u8], at: usize) -> Option<u64> {
        Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
    }

    /// The little-endian u32 at `at`, or `None` past the body's end.
    pub fn le32(body: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?))
    }
}

pub use space::{MetadataSpace, metadata_space};

mod space {
    //! How much new metadata a btrfs filesystem can take, from the figures
    //! its allocator keeps: BTRFS_IOC_SPACE_INFO for the block groups,
    //! BTRFS_IOC_FS_INFO and BTRFS_IOC_DEV_INFO for the raw space not yet
    //! allocated to any. statvfs cannot tell: it reports data space.

    use std::io;
    use std::os::fd::BorrowedFd;

    use rustix::ioctl::{Opcode, Updater, opcode};

    use super::WordsArg;

    const BLOCK_GROUP_METADATA: u64 = 1 << 2;
    const BLOCK_GROUP_RAID1: u64 = 1 << 4;
    const BLOCK_GROUP_DUP: u64 = 1 << 5;
    const BLOCK_GROUP_RAID10: u64 = 1 << 6;
    const BLOCK_GROUP_RAID5: u64 = 1 << 7;
    const BLOCK_GROUP_RAID6: u64 = 1 << 8;
    const BLOCK_GROUP_RAID1C3: u64 = 1 << 9;
    const BLOCK_GROUP_RAID1C4: u64 = 1 << 10;
    const SPACE_INFO_GLOBAL_RSV: u64 = 1 << 49;

    /// Metadata space of a filesystem, in logical bytes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MetadataSpace {
        /// Bytes in metadata block groups (mixed ones included).
        pub total: u64,
        /// Of which used.
        pub used: u64,
        /// The global reserve, held back from metadata for the
        /// filesystem's own use: not available to new items.
        pub global_reserve: u64,
        /// Raw device bytes allocated to no block group yet, summed over
        /// devices.
        pub unallocated: u64,
        /// Raw bytes of every device, summed: the filesystem's size.
        pub device_bytes: u64,
        /// Raw bytes one metadata byte takes (2 for DUP and RAID1, ...;
        /// rounded up for RAID5 and RAID6).
        pub copies: u64,
        /// Bytes of one tree node (leaf): what copying one on write costs.
        pub node_size: u64,
    }

    impl MetadataSpace {
        /// New metadata the filesystem can take: what is free in its
        /// metadata block groups beyond the global reserve, plus what new
        /// metadata block groups could hold in the unallocated space. An
        /// upper bound where devices differ in size (mirrored copies must
        /// land on different devices) or data chunks claim the unallocated
        /// space first; exact on one device.
        pub fn free(&self) -> u64 {
            self.total
                .saturating_sub(self.used)
                .saturating_sub(self.global_reserve)
                .saturating_add(self.unallocated / self.copies.max(1))
        }
    }

    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct SpaceInfo {
        flags: u64,
        total_bytes: u64,
        used_bytes: u64,
    }

    /// BTRFS_IOC_SPACE_INFO: its argument is `struct btrfs_ioctl_space_args`
    /// (space_slots, total_spaces) followed by `space_slots` entries.
    const SPACE_INFO: Opcode = opcode::read_write::<[u64; 2]>(0x94, 20);

    fn space_infos(fd: BorrowedFd<'_>) -> io::Result<Vec<SpaceInfo>> {
        const WORDS: usize = std::mem::size_of::<SpaceInfo>() / 8;
        // Asked with no slots, the kernel says how many there are; a block
        // group type may appear in between, so ask for a few more.
        let mut head = [0u64; 2];
        // SAFETY: zero slots: the kernel only writes the header.
        unsafe {
            rustix::ioctl::ioctl(
                fd,
                WordsArg {
                    opcode: SPACE_INFO,
                    words: &mut head,
                },
            )?
        };
        let slots = head[1] as usize + 4;
        let mut mem = vec![0u64; 2 + slots * WORDS];
        mem[0] = slots as u64;
        // SAFETY: `mem` holds the header and the `slots` entries it announces.
        unsafe {
            rustix::ioctl::ioctl(
                fd,
                WordsArg {
                    opcode: SPACE_INFO,
                    words: &mut mem,
                },
            )?
        };
        let filled = (mem[1] as usize).min(slots);
        Ok(mem[2..2 + filled * WORDS]
            .chunks_exact(WORDS)
            .map(|w| SpaceInfo {
                flags: w[0],
                total_bytes: w[1],
                used_bytes: w[2],
            })
            .collect())
    }

    /// `struct btrfs_ioctl_fs_info_args`: max_id, num_devices, fsid,
    /// nodesize, then fields not needed here (`flags`, read by the kernel,
    /// left zero).
    #[repr(C)]
    struct FsInfo {
        max_id: u64,
        num_devices: u64,
        fsid: [u8; 16],
        nodesize: u32,
        rest: [u8; 1024 - 36],
    }

    /// `struct btrfs_ioctl_dev_info_args`: devid, uuid, bytes_used,
    /// total_bytes, fsid, then the unused words and the path.
    #[repr(C)]
    struct DevInfo {
        devid: u64,
        uuid: [u8; 16],
        bytes_used: u64,
        total_bytes: u64,
        fsid: [u8; 16],
        rest: [u8; 4096 - 56],
    }

    const _: () = assert!(std::mem::size_of::<FsInfo>() == 1024);
    const _: () = assert!(std::mem::size_of::<DevInfo>() == 4096);

    const FS_INFO: Opcode = opcode::read::<FsInfo>(0x94, 31);
    const DEV_INFO: Opcode = opcode::read_write::<DevInfo>(0x94, 30);

    /// The filesystem's FS_INFO: device count, fsid, node size.
    fn fs_info(fd: BorrowedFd<'_>) -> io::Result<FsInfo> {
        let mut fs = FsInfo {
            max_id: 0,
            num_devices: 0,
            fsid: [0; 16],
            nodesize: 0,
            rest: [0; 1024 - 36],
        };
        // SAFETY: FS_INFO reads and fills a `struct btrfs_ioctl_fs_info_args`,
        // which FsInfo matches in size and layout; zeroed, as the kernel
        // reads its `flags`.
        unsafe { rustix::ioctl::ioctl(fd, Updater::<FS_INFO, FsInfo>::new(&mut fs))? };
        Ok(fs)
    }

    /// Raw bytes allocated to no block group, and raw bytes in all, over
    /// the devices of the filesystem `fs` describes. A seed device (read-only) has its own fsid
    /// and is skipped; kernels before 6.3 leave DEV_INFO's fsid zero, and
    /// there every device counts.
    fn unallocated(fd: BorrowedFd<'_>, fs: &FsInfo) -> io::Result<(u64, u64)> {
        let (mut free, mut size, mut found) = (0u64, 0u64, 0u64);
        for devid in 1..=fs.max_id {
            if found >= fs.num_devices {
                break;
            }
            let mut dev = DevInfo {
                devid,
                uuid: [0; 16],
                bytes_used: 0,
                total_bytes: 0,
                fsid: [0; 16],
                rest: [0; 4096 - 56],
            };
            // SAFETY: DEV_INFO reads and fills a `struct
            // btrfs_ioctl_dev_info_args`, which DevInfo matches in size and
            // layout.
            match unsafe { rustix::ioctl::ioctl(fd, Updater::<DEV_INFO, DevInfo>::new(&mut dev)) } {
                Ok(()) if dev.fsid == fs.fsid || dev.fsid == [0; 16] => {
                    found += 1;
                    free += dev.total_bytes.saturating_sub(dev.bytes_used);
                    size += dev.total_bytes;
                }
                Ok(()) => {}
                // Ids of removed devices leave gaps.
                Err(rustix::io::Errno::NODEV) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok((free, size))
    }

    /// The metadata space of the btrfs filesystem holding `fd`, as of the
    /// last commit: what the running transaction has reserved is not taken
    /// off, so commit first for a figure that holds.
    pub fn metadata_space(fd: BorrowedFd<'_>) -> io::Result<MetadataSpace> {
        let fs = fs_info(fd)?;
        let (unallocated, device_bytes) = unallocated(fd, &fs)?;
        let mut out = MetadataSpace {
            total: 0,
            used: 0,
            global_reserve: 0,
            unallocated,
            device_bytes,
            copies: 1,
            node_size: u64::from(fs.nodesize),
        };
        for info in space_infos(fd)? {
            if info.flags & SPACE_INFO_GLOBAL_RSV != 0 {
                out.global_reserve = info.total_bytes;
            } else if info.flags & BLOCK_GROUP_METADATA != 0 {
                out.total += info.total_bytes;
                out.used += info.used_bytes;
                let copies = match info.flags {
                    f if f & BLOCK_GROUP_RAID1C4 != 0 => 4,
                    f if f & (BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID6) != 0 => 3,
                    f if f
                        & (BLOCK_GROUP_DUP
                            | BLOCK_GROUP_RAID1
                            | BLOCK_GROUP_RAID10
                            | BLOCK_GROUP_RAID5)
                        != 0 =>
                    {
                        2
                    }
                    _ => 1,
                };
                out.copies = out.copies.max(copies);
            }
        }
        Ok(out)
    }
}

pub use tree_search::{
    Batch, DEFAULT_BUF_SIZE, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher, search,
};

mod tree_search {
    //! BTRFS_IOC_TREE_SEARCH_V2: reading a subvolume's own b-tree items.

    use std::io;
    use std::ops::ControlFlow;
    use std::os::fd::BorrowedFd;

    use rustix::ioctl::{Opcode, opcode};

    use super::WordsArg;

    /// `BTRFS_INODE_ITEM_KEY`: one per inode, holding its mode.
    pub const INODE_ITEM_KEY: u8 = 1;
    /// `BTRFS_EXTENT_DATA_KEY`: one item per file extent reference.
    pub const EXTENT_DATA_KEY: u8 = 108;
    /// The default result buffer: 64 KiB is the largest metadata node, hence
    /// the largest item, so any search fits; a bigger buffer only costs the
    /// kernel time faulting it in on every call (see compsize's history),
    /// which hurts tight per-inode searches.
    pub const DEFAULT_BUF_SIZE: usize = 64 * 1024;
    /// The kernel's limit on a TREE_SEARCH_V2 buffer.
    const MAX_BUF_SIZE: usize = 16 << 20;
    const HEADER_LEN: usize = 32;

    /// A b-tree key: items are sorted by (objectid, type, offset).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub struct ItemKey {
        /// Inode number for file items.
        pub objectid: u64,
        /// Item type (`*_KEY`).
        pub item_type: u8,
        /// Type-specific; the file offset for extent items.
        pub offset: u64,
    }

    impl ItemKey {
        /// The smallest key after this one, or `None` at the very end.
        pub fn successor(self) -> Option<ItemKey> {
            if let Some(offset) = self.offset.checked_add(1) {
                return Some(ItemKey { offset, ..self });
            }
            if let Some(item_type) = self.item_type.checked_add(1) {
                return Some(ItemKey {
                    item_type,
                    offset: 0,
                    ..self
                });
            }
            Some(ItemKey {
                objectid: self.objectid.checked_add(1)?,
                item_type: 0,
                offset: 0,
            })
        }

        /// The largest key before this one, or `None` at the very start.
        pub fn predecessor(self) -> Option<ItemKey> {
            if let Some(offset) = self.offset.checked_sub(1) {
                return Some(ItemKey { offset, ..self });
            }
            if let Some(item_type) = self.item_type.checked_sub(1) {
                return Some(ItemKey {
                    item_type,
                    offset: u64::MAX,
                    ..self
                });
            }
            Some(ItemKey {
                objectid: self.objectid.checked_sub(1)?,
                item_type: u8::MAX,
                offset: u64::MAX,
            })
        }
    }

    /// An inclusive range of keys, compared as whole tuples (the kernel's
    /// semantics: every item between `min` and `max` is returned, whatever
    /// its type, so callers filter by type).
    #[derive(Debug, Clone, Copy)]
    pub struct KeyRange {
        /// First key.
        pub min: ItemKey,
        /// Last key.
        pub max: ItemKey,
    }

    impl KeyRange {
        /// Every item of one type of one inode.
        pub fn inode_items(ino: u64, item_type: u8) -> Self {
            KeyRange {
                min: ItemKey {
                    objectid: ino,
                    item_type,
                    offset: 0,
                },
                max: ItemKey {
                    objectid: ino,
                    item_type,
                    offset: u64::MAX,
                },
            }
        }

        /// Every item of the tree.
        pub fn all() -> Self {
            KeyRange {
                min: ItemKey {
                    objectid: 0,
                    item_type: 0,
                    offset: 0,
                },
                max: ItemKey {
                    objectid: u64::MAX,
                    item_type: u8::MAX,
                    offset: u64::MAX,
                },
            }
        }
    }

    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct SearchKey {
        tree_id: u64,
        min_objectid: u64,
        max_objectid: u64,
        min_offset: u64,
        max_offset: u64,
        min_transid: u64,
        max_transid: u64,
        min_type: u32,
        max_type: u32,
        nr_items: u32,
        unused: u32,
        unused1: u64,
        unused2: u64,
        unused3: u64,
        unused4: u64,
    }

    /// `struct btrfs_ioctl_search_args_v2` without its flexible buffer; the
    /// ioctl number encodes this size.
    #[repr(C)]
    struct SearchArgsV2 {
        key: SearchKey,
        buf_size: u64,
    }

    const ARGS_WORDS: usize = std::mem::size_of::<SearchArgsV2>() / 8;
    const _: () = assert!(std::mem::size_of::<SearchArgsV2>().is_multiple_of(8));

    /// BTRFS_IOC_TREE_SEARCH_V2: its argument is the args header followed
    /// by the result buffer, `ARGS_WORDS + buf_size / 8` words in all.
    const TREE_SEARCH_V2: Opcode = opcode::read_write::<SearchArgsV2>(0x94, 17);

    fn u64_at(b: &[u8], at: usize) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[at..at + 8]);
        u64::from_ne_bytes(a)
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        let mut a = [0u8; 4];
        a.copy_from_slice(&b[at..at + 4]);
        u32::from_ne_bytes(a)
    }

    /// A reusable TREE_SEARCH_V2 buffer. Allocating (and zeroing) a fresh
    /// 64 KiB buffer per search used to cost more than a small file's search
    /// itself: callers doing one search per inode keep one `Searcher`.
    pub struct Searcher {
        mem: Vec<u64>,
        buf_size: usize,
    }

    impl Default for Searcher {
        fn default() -> Self {
            Searcher::new(DEFAULT_BUF_SIZE)
        }
    }

    impl Searcher {
        /// A searcher whose result buffer holds `buf_size` bytes (at least
        /// [`DEFAULT_BUF_SIZE`], at most the kernel's 16 MiB limit).
        pub fn new(buf_size: usize) -> Self {
            let buf_size = buf_size.clamp(DEFAULT_BUF_SIZE, MAX_BUF_SIZE) / 8 * 8;
            Searcher {
                // calloc'd: pages the kernel never fills are never touched.
                mem: vec![0u64; ARGS_WORDS + buf_size / 8],
                buf_size,
            }
        }

        fn args(&mut self) -> &mut SearchArgsV2 {
            // SAFETY: `mem` starts with ARGS_WORDS aligned words, the size of
            // the repr(C) SearchArgsV2, made of plain integers.
            unsafe { &mut *self.mem.as_mut_ptr().cast::<SearchArgsV2>() }
        }

        fn buf(&self) -> &[u8] {
            // SAFETY: the words after the header are `buf_size` plain bytes.
            unsafe {
                std::slice::from_raw_parts(
                    self.mem.as_ptr().add(ARGS_WORDS).cast::<u8>(),
                    self.buf_size,
                )
            }
        }

        /// One ioctl: fills the buffer with the first items, in key order,
        /// from `from` to `max` of the subvolume holding `fd` (tree id 0:
        /// the fd's own subvolume), at most `limit` of them. An empty batch
        /// means the range holds nothing more; otherwise the items after
        /// the batch's last key may follow. Needs CAP_SYS_ADMIN.
        pub fn fill(
            &mut self,
            fd: BorrowedFd<'_>,
            from: ItemKey,
            max: ItemKey,
            limit: u32,
        ) -> io::Result<Batch<'_>> {
            let buf_size = self.buf_size as u64;
            let args = self.args();
            args.key = SearchKey {
                tree_id: 0,
                min_objectid: from.objectid,
                max_objectid: max.objectid,
                min_offset: from.offset,
                max_offset: max.offset,
                min_transid: 0,
                max_transid: u64::MAX,
                min_type: u32::from(from.item_type),
                max_type: u32::from(max.item_type),
                nr_items: limit,
                ..SearchKey::default()
            };
            args.buf_size = buf_size;
            // SAFETY: `mem` holds the header and the `buf_size` bytes it
            // announces.
            unsafe {
                rustix::ioctl::ioctl(
                    fd,
                    WordsArg {
                        opcode: TREE_SEARCH_V2,
                        words: &mut self.mem,
                    },
                )?
            };
            let len = self.args().key.nr_items as usize;
            Ok(Batch {
                buf: self.buf(),
                len,
            })
        }

        /// Visits, in key order, every item in `range` of the subvolume
        /// holding `fd`, with its key and raw (little-endian, on-disk)
        /// body, until the range ends or the visitor breaks. One ioctl per
        /// buffer-full of items. Needs CAP_SYS_ADMIN.
        pub fn search(
            &mut self,
            fd: BorrowedFd<'_>,
            range: KeyRange,
            mut visit: impl FnMut(ItemKey, &[u8]) -> ControlFlow<()>,
        ) -> io::Result<()> {
            let mut from = range.min;
            loop {
                let batch = self.fill(fd, from, range.max, u32::MAX)?;
                let mut last = None;
                for (key, body) in batch.iter() {
                    last = Some(key);
                    if visit(key, body).is_break() {
                        return Ok(());
                    }
                }
                match last.and_then(ItemKey::successor) {
                    Some(next) if next <= range.max => from = next,
                    _ => return Ok(()),
                }
            }
        }
    }

    /// The items one [`Searcher::fill`] returned, borrowed from its buffer.
    #[derive(Clone, Copy)]
    pub struct Batch<'a> {
        buf: &'a [u8],
        len: usize,
    }

    impl<'a> Batch<'a> {
        /// How many items the batch holds.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether the range held nothing more.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// The items with their keys and raw bodies, in key order.
        pub fn iter(&self) -> impl Iterator<Item = (ItemKey, &'a [u8])> + use<'a> {
            let buf = self.buf;
            let mut pos = 0usize;
            (0..self.len).map(move |_| {
                let h = &buf[pos..pos + HEADER_LEN];
                let key = ItemKey {
                    objectid: u64_at(h, 8),
                    offset: u64_at(h, 16),
                    item_type: u32_at(h, 24) as u8,
                };
                let len = u32_at(h, 28) as usize;
                let body = &buf[pos + HEADER_LEN..pos + HEADER_LEN + len];
                pos += HEADER_LEN + len;
                (key, body)
            })
        }
    }

    /// [`Searcher::search`] with a one-off [`DEFAULT_BUF_SIZE`] buffer. For
    /// one search per inode, keep a [`Searcher`] instead.
    pub fn search(
        fd: BorrowedFd<'_>,
        range: KeyRange,
        visit: impl FnMut(ItemKey, &[u8]) -> ControlFlow<()>,
    ) -> io::Result<()> {
        Searcher::default().search(fd, range, visit)
    }
}
