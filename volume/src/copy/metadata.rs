//! The metadata a copy gives each entry, in the only order in which each
//! part survives the next: owner (a chown clears setuid and file
//! capabilities), mode, xattrs (ACLs and capabilities included),
//! timestamps, then the inode flags (immutable and append-only forbid
//! everything before them).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::BorrowedFd;

use crate::sys::{self, FileType, InodeFlags, Stat, inode_flags, set_inode_flags as set_flags};

/// Where to apply metadata: an open fd (files, directories) or a name in a
/// directory (symlinks and special files, which are never opened).
pub(super) enum Target<'a> {
    Fd(BorrowedFd<'a>),
    At(BorrowedFd<'a>, &'a OsStr),
}

/// Owner, mode, xattrs (for fds), timestamps and the remaining inode flags,
/// in the only order in which each survives the next.
pub(super) fn finish_metadata(
    st: &Stat,
    target: Target<'_>,
    src: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    match target {
        Target::Fd(fd) => {
            let src_flags = match src {
                Some(src) => Some(inode_flags(src)?),
                None => None,
            };
            finish_fd_metadata(st, fd, src, src_flags, None)
        }
        Target::At(dir, name) => {
            sys::chown_at(dir, name, st.uid, st.gid)?;
            if st.file_type != FileType::Symlink {
                // mknod applied the umask; chmodat cannot follow a non-link.
                sys::chmod_at(dir, name, st.mode)?;
            }
            sys::set_times_at(dir, name, &st.times())?;
            Ok(())
        }
    }
}

/// [`finish_metadata`] for a regular file whose source flags are known.
/// `now`: the file's current owner and mode, when known, to skip a chown or
/// chmod that would change nothing.
pub(super) fn finish_file_metadata(
    st: &Stat,
    dst: BorrowedFd<'_>,
    src: BorrowedFd<'_>,
    src_flags: InodeFlags,
    now: Option<&Stat>,
) -> io::Result<()> {
    finish_fd_metadata(st, dst, Some(src), Some(src_flags), now)
}

/// Gives the file or directory open as `fd` the metadata `st` describes:
/// owner, mode, xattrs (copied from `src`, when given), timestamps, then
/// `src_flags` but NOCOW added to the fd's flags, the order in which each
/// survives the next (a chown clears setuid and capabilities, the
/// immutable flag forbids all the rest). `now`: the fd's current owner and
/// mode, when known, to skip a chown or chmod that would change nothing.
/// A failure part-way leaves some of it applied.
pub fn finish_fd_metadata(
    st: &Stat,
    fd: BorrowedFd<'_>,
    src: Option<BorrowedFd<'_>>,
    src_flags: Option<InodeFlags>,
    now: Option<&Stat>,
) -> io::Result<()> {
    let same_owner = now.is_some_and(|n| (n.uid, n.gid) == (st.uid, st.gid));
    if !same_owner {
        sys::chown(fd, st.uid, st.gid)?;
    }
    // A chown may clear the setuid and setgid bits: after one, always chmod.
    let same_mode = same_owner && now.is_some_and(|n| n.mode == st.mode);
    if !same_mode {
        sys::chmod(fd, st.mode)?;
    }
    if let Some(src) = src {
        copy_xattrs_fd(src, fd)?;
    }
    sys::set_times(fd, &st.times())?;
    if let Some(src_flags) = src_flags {
        let rest = src_flags.difference(InodeFlags::NOCOW);
        if !rest.is_empty() {
            set_flags(fd, inode_flags(fd)? | rest)?;
        }
    }
    Ok(())
}

/// Removes every xattr of `dst` that `src` does not have (both open fds).
pub fn remove_xattrs_missing_from(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    let keep: HashSet<OsString> = sys::list_xattrs(src)?.into_iter().collect();
    for name in sys::list_xattrs(dst)?.iter().filter(|n| !keep.contains(*n)) {
        match sys::remove_xattr(dst, name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn copy_xattrs_fd(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    for name in sys::list_xattrs(src)? {
        let value = sys::get_xattr(src, &name)?;
        sys::set_xattr(dst, &name, &value)?;
    }
    Ok(())
}

/// Xattrs of an entry that is never opened (symlink, FIFO, device).
pub(super) fn copy_xattrs_at(
    src_dir: BorrowedFd<'_>,
    src_name: &OsStr,
    dst_dir: BorrowedFd<'_>,
    dst_name: &OsStr,
) -> io::Result<()> {
    let list = match sys::list_xattrs_at(src_dir, src_name) {
        Ok(l) => l,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    for name in list {
        let value = sys::get_xattr_at(src_dir, src_name, &name)?;
        sys::set_xattr_at(dst_dir, dst_name, &name, &value)?;
    }
    Ok(())
}
