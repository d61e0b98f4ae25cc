//! Per-package mutual exclusion across threads and processes.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use models::PackageId;

use crate::sys;

/// Held while one operation runs on one package; released on drop (or when
/// the process dies, so a crash never leaves a package locked).
///
/// The lock file `<pkg>.lock` stays in the volumes root for good: removing it
/// while another process waits on the old inode would let two holders in.
pub struct PackageLock {
    _file: OwnedFd,
}

impl PackageLock {
    /// Blocks until this package is free. Different packages never wait on
    /// each other.
    pub(crate) fn acquire(root: BorrowedFd<'_>, lock_name: &OsStr) -> io::Result<Self> {
        let file = sys::create_file_at(root, lock_name, 0o600)?;
        sys::lock_exclusive(file.as_fd())?;
        Ok(PackageLock { _file: file })
    }

    /// Takes the lock of `pkg` in the volumes root open as `root`
    /// (`<root>/<pkg>.lock`, created if missing), the same lock every
    /// [`crate::VolumeStore`] operation on `pkg` takes, so other tools (the
    /// one-time conversion) never interleave with a volume operation. Blocks
    /// until free; released on drop or when the process dies.
    pub fn for_package(root: BorrowedFd<'_>, pkg: &PackageId) -> io::Result<Self> {
        Self::acquire(root, crate::layout::Names::new(pkg).lock.as_os_str())
    }
}
