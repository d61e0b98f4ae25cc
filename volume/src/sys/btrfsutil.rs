//! The libbtrfsutil backend of [`super::subvolume`], behind the `btrfsutil`
//! feature: the same primitives through libbtrfsutil's fd-based entry
//! points (`*_fd`, `*_fd2`), which resolve every name relative to a
//! directory already open. Needs libclang to build and libbtrfsutil to run;
//! kept to cross-check the `native` ioctl backend against a reference
//! implementation (the primitives tests run against both).

use btrfsutil_sys as bu;
use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use super::qgroup::QgroupInherit;
use super::subvolume_info::Nested;

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

/// A libbtrfsutil qgroup inheritance specifier, destroyed on drop.
struct Inherit(*mut bu::btrfs_util_qgroup_inherit);

impl Inherit {
    /// libbtrfsutil's copy of `inherit`; a null specifier for `None`.
    fn of(inherit: Option<&QgroupInherit>) -> io::Result<Inherit> {
        let Some(inherit) = inherit else {
            return Ok(Inherit(std::ptr::null_mut()));
        };
        let mut out = Inherit(std::ptr::null_mut());
        // SAFETY: flags must be zero; the out-pointer is valid.
        check(unsafe { bu::btrfs_util_create_qgroup_inherit(0, &mut out.0) })?;
        for group in &inherit.groups {
            // SAFETY: out.0 came from btrfs_util_create_qgroup_inherit; the
            // call may reallocate it and writes the new pointer back.
            check(unsafe { bu::btrfs_util_qgroup_inherit_add_group(&mut out.0, *group) })?;
        }
        Ok(out)
    }
}

impl Drop for Inherit {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: made by btrfs_util_create_qgroup_inherit, freed once.
            unsafe { bu::btrfs_util_destroy_qgroup_inherit(self.0) };
        }
    }
}

pub(super) fn create_subvolume(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    let c = c_name(name)?;
    let inherit = Inherit::of(inherit)?;
    // SAFETY: valid fd and NUL-terminated name; a null async pointer is
    // allowed, and the qgroup one is null or a live specifier.
    check(unsafe {
        bu::btrfs_util_create_subvolume_fd(
            parent.as_raw_fd(),
            c.as_ptr(),
            0,
            std::ptr::null_mut(),
            inherit.0,
        )
    })
}

/// libbtrfsutil's snapshot of `source` as `name` in `parent`, with its
/// `BTRFS_UTIL_CREATE_SNAPSHOT_*` flags.
fn snapshot_with_flags(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    flags: i32,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    let c = c_name(name)?;
    let inherit = Inherit::of(inherit)?;
    // SAFETY: valid fds and NUL-terminated name; a null async pointer is
    // allowed, and the qgroup one is null or a live specifier.
    check(unsafe {
        bu::btrfs_util_create_snapshot_fd2(
            source.as_raw_fd(),
            parent.as_raw_fd(),
            c.as_ptr(),
            flags,
            std::ptr::null_mut(),
            inherit.0,
        )
    })
}

pub(super) fn create_snapshot(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    read_only: bool,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    let flags = if read_only {
        bu::BTRFS_UTIL_CREATE_SNAPSHOT_READ_ONLY as i32
    } else {
        0
    };
    snapshot_with_flags(source, parent, name, flags, inherit)
}

pub(super) fn snapshot_recursive(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    snapshot_with_flags(
        source,
        parent,
        name,
        bu::BTRFS_UTIL_CREATE_SNAPSHOT_RECURSIVE as i32,
        inherit,
    )
}

pub(super) fn set_read_only(fd: BorrowedFd<'_>, read_only: bool) -> io::Result<()> {
    // SAFETY: valid fd.
    check(unsafe { bu::btrfs_util_set_subvolume_read_only_fd(fd.as_raw_fd(), read_only) })
}

pub(super) fn is_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut ro = false;
    // SAFETY: valid fd and out-pointer.
    check(unsafe { bu::btrfs_util_get_subvolume_read_only_fd(fd.as_raw_fd(), &mut ro) })?;
    Ok(ro)
}

/// libbtrfsutil's pre-order iterator, each subvolume with its info
/// (parent id, directory): the same listing as the native backend's.
pub(super) fn nested_subvolumes(fd: BorrowedFd<'_>) -> io::Result<Vec<Nested>> {
    let mut iter: *mut bu::btrfs_util_subvolume_iterator = std::ptr::null_mut();
    // SAFETY: valid fd and out-pointer; top 0 means "the subvolume of fd";
    // flags 0 asks for pre-order.
    check(unsafe { bu::btrfs_util_create_subvolume_iterator_fd(fd.as_raw_fd(), 0, 0, &mut iter) })?;
    let mut out = Vec::new();
    let result = loop {
        let mut path: *mut libc::c_char = std::ptr::null_mut();
        // SAFETY: plain integers and arrays; the library fills it.
        let mut info: bu::btrfs_util_subvolume_info = unsafe { std::mem::zeroed() };
        // SAFETY: iter is live until destroyed below; path is malloc'd by the library.
        let code =
            unsafe { bu::btrfs_util_subvolume_iterator_next_info(iter, &mut path, &mut info) };
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
        // Parents come first: one below its parent, or a child of the top.
        let depth = out
            .iter()
            .rev()
            .find(|n: &&Nested| n.id == info.parent_id)
            .map_or(1, |p| p.depth + 1);
        let name = bytes
            .rsplit(|b| *b == b'/')
            .next()
            .unwrap_or_default()
            .to_vec();
        out.push(Nested {
            id: info.id,
            parent: info.parent_id,
            dirid: info.dir_id,
            name: OsString::from_vec(name),
            depth,
        });
    };
    // SAFETY: created above, destroyed once.
    unsafe { bu::btrfs_util_destroy_subvolume_iterator(iter) };
    result.map(|()| out)
}

pub(super) fn delete_subvolume(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    recursive: bool,
) -> io::Result<()> {
    let c = c_name(name)?;
    let flags = if recursive {
        bu::BTRFS_UTIL_DELETE_SUBVOLUME_RECURSIVE as i32
    } else {
        0
    };
    // SAFETY: valid fd and NUL-terminated name.
    check(unsafe { bu::btrfs_util_delete_subvolume_fd(parent.as_raw_fd(), c.as_ptr(), flags) })
}

pub(super) fn commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: valid fd.
    check(unsafe { bu::btrfs_util_sync_fd(fd.as_raw_fd()) })
}

pub(super) fn start_commit(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut transid = 0u64;
    // SAFETY: valid fd and out-pointer.
    check(unsafe { bu::btrfs_util_start_sync_fd(fd.as_raw_fd(), &mut transid) })?;
    Ok(transid)
}

pub(super) fn ask_commit(fd: BorrowedFd<'_>) -> io::Result<u64> {
    start_commit(fd)
}
