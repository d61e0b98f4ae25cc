//! Extended attributes (ACLs and file capabilities included), on an open
//! fd or, for entries that are never opened (symlinks, FIFOs, devices), by
//! name through `/proc/self/fd/<dir>/<name>` with the l* calls, which do
//! not follow the final component. Names and values are raw bytes.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use rustix::fs::XattrFlags;
use rustix::io::Errno;

/// Calls a size-returning xattr getter with a growing buffer until it fits
/// (ERANGE means the buffer was short; 16 MiB is past any xattr Linux
/// stores).
fn read_growing(mut f: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>) -> io::Result<Vec<u8>> {
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

/// Splits a NUL-separated xattr name list.
fn split_names(list: &[u8]) -> Vec<OsString> {
    list.split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| OsString::from_vec(n.to_vec()))
        .collect()
}

/// `/proc/self/fd/<dir>/<name>`: `name` in `dir` as a path, for the l*
/// calls, which take no directory fd.
fn proc_path(dir: BorrowedFd<'_>, name: &OsStr) -> PathBuf {
    let mut p = OsString::from(format!("/proc/self/fd/{}/", dir.as_raw_fd()));
    p.push(name);
    PathBuf::from(p)
}

/// Names of every xattr of the inode open as `fd`.
pub(crate) fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    super::fault::check("flistxattr")?;
    Ok(split_names(&read_growing(|buf| {
        rustix::fs::flistxattr(fd, buf)
    })?))
}

/// The value of xattr `name` of the inode open as `fd`; ENODATA if it has
/// none, EOPNOTSUPP where the filesystem has no such namespace.
pub(crate) fn get_xattr(fd: BorrowedFd<'_>, name: &OsStr) -> io::Result<Vec<u8>> {
    super::fault::check("fgetxattr")?;
    read_growing(|buf| rustix::fs::fgetxattr(fd, name, buf))
}

/// Sets xattr `name` of the inode open as `fd` to `value`, creating or
/// replacing it.
pub(crate) fn set_xattr(fd: BorrowedFd<'_>, name: &OsStr, value: &[u8]) -> io::Result<()> {
    super::fault::check("fsetxattr")?;
    Ok(rustix::fs::fsetxattr(fd, name, value, XattrFlags::empty())?)
}

/// Removes xattr `name` of the inode open as `fd`; ENODATA if absent.
pub(crate) fn remove_xattr(fd: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    super::fault::check("fremovexattr")?;
    Ok(rustix::fs::fremovexattr(fd, name)?)
}

/// [`list_xattrs`] of `name` in `dir`, never following it; ENOTSUP where
/// the filesystem keeps none.
pub(crate) fn list_xattrs_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Vec<OsString>> {
    let path = proc_path(dir, name);
    super::fault::check("llistxattr")?;
    Ok(split_names(&read_growing(|buf| {
        rustix::fs::llistxattr(&path, buf)
    })?))
}

/// [`get_xattr`] of `name` in `dir`, never following it.
pub(crate) fn get_xattr_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    xattr: &OsStr,
) -> io::Result<Vec<u8>> {
    let path = proc_path(dir, name);
    super::fault::check("lgetxattr")?;
    read_growing(|buf| rustix::fs::lgetxattr(&path, xattr, buf))
}

/// [`set_xattr`] of `name` in `dir`, never following it.
pub(crate) fn set_xattr_at(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    xattr: &OsStr,
    value: &[u8],
) -> io::Result<()> {
    let path = proc_path(dir, name);
    super::fault::check("lsetxattr")?;
    Ok(rustix::fs::lsetxattr(
        &path,
        xattr,
        value,
        XattrFlags::empty(),
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_lists_split_on_nul() {
        let names = split_names(b"user.a\0security.capability\0\0");
        assert_eq!(names, ["user.a", "security.capability"]);
        assert!(split_names(b"").is_empty());
    }
}
