//! Per-package mutual exclusion across threads and processes.
//!
//! The locks live in [`LOCK_DIR`] (`/run`, a tmpfs), not beside the volumes:
//! - taking a lock must work when the data filesystem is full, or the very
//!   commands that free space (`drop`, `delete`) could not run;
//! - a lock file cannot be removed while another process may be waiting on
//!   its inode, so each one stays; on the data filesystem they would pile up
//!   beside the operator's files, in `/run` they are gone at the next boot,
//!   when no lock can be held anyway.
//!
//! Each volumes root has its own directory there, named after the root's
//! device and inode numbers, which every process sees alike for as long as
//! the filesystem stays mounted.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use models::PackageId;

use crate::sys;

/// Where every volumes root's lock directory is made.
pub const LOCK_DIR: &str = "/run/startos-volume";

/// The lock directory of one volumes root.
pub struct LockDir {
    path: PathBuf,
    dir: OwnedFd,
}

impl LockDir {
    /// The lock directory of the volumes root open as `root`, created if
    /// missing (with [`LOCK_DIR`]).
    pub fn for_root(root: BorrowedFd<'_>) -> io::Result<Self> {
        let st = sys::stat(root)?;
        let (major, minor) = sys::major_minor(st.dev);
        let path = Path::new(LOCK_DIR).join(format!("{major}:{minor}-{}", st.ino));
        sys::mkdir_path_if_missing(Path::new(LOCK_DIR), 0o700)?;
        sys::mkdir_path_if_missing(&path, 0o700)?;
        let dir = sys::open_dir_path(&path)?;
        Ok(LockDir { path, dir })
    }

    /// The directory's path, for error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Blocks until `pkg` is free, then holds its lock. Different packages
    /// never wait on each other.
    pub fn lock(&self, pkg: &PackageId) -> io::Result<PackageLock> {
        let file = sys::create_file_at(self.dir.as_fd(), OsStr::new(pkg.as_str()), 0o600)?;
        sys::lock_exclusive(file.as_fd())?;
        Ok(PackageLock { _file: file })
    }
}

/// Held while one operation runs on one package; released on drop (or when
/// the process dies, so a crash never leaves a package locked).
pub struct PackageLock {
    _file: OwnedFd,
}

impl PackageLock {
    /// Takes the lock of `pkg` for the volumes root open as `root`, the
    /// same lock every [`crate::VolumeStore`] operation on `pkg` takes, so
    /// other tools (the one-time conversion) never interleave with a volume
    /// operation. Blocks until free; released on drop or when the process
    /// dies.
    pub fn for_package(root: BorrowedFd<'_>, pkg: &PackageId) -> io::Result<Self> {
        LockDir::for_root(root)?.lock(pkg)
    }
}
