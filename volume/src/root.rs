//! The volumes root, opened once.
//!
//! Every operation on package volumes works relative to one descriptor of
//! the root directory, never to its path: a rename of a path component
//! after the open cannot make an operation land elsewhere. [`Root`] holds
//! that descriptor with what every caller asks of it (its canonical path
//! for messages, its device, whether it is on btrfs), so the store and the
//! migrator agree on them and read them once.
//!
//! Opening changes nothing on disk: a crash during it leaves nothing behind.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use models::{Error, ErrorKind, ResultExt};

use crate::sys;

/// The volumes root, open.
///
/// Invariants: `path` is canonical as of the open, `dir` is a directory
/// opened from it without following a symlink, and `dev` and `magic`
/// describe that directory (not whatever the path names later).
#[derive(Debug)]
pub struct Root {
    path: PathBuf,
    dir: OwnedFd,
    dev: u64,
    /// statfs's `f_type` of the directory.
    magic: i64,
}

impl Root {
    /// Canonicalizes `path` and opens it. `NotFound` if it does not
    /// exist, `InvalidRequest` if it is not a directory (a symlink as the
    /// last component included), `Filesystem` if a stat of it fails.
    pub fn open(path: impl AsRef<Path>) -> Result<Root, Error> {
        let path = path.as_ref();
        let canonical = sys::canonicalize(path).with_ctx(|e| {
            let kind = if e.kind() == io::ErrorKind::NotFound {
                ErrorKind::NotFound
            } else {
                ErrorKind::Filesystem
            };
            (kind, format!("volumes root {}", path.display()))
        })?;
        let dir = sys::open_dir_path(&canonical).with_ctx(|_| {
            (
                ErrorKind::InvalidRequest,
                format!("volumes root {} is not a directory", canonical.display()),
            )
        })?;
        let st = sys::stat(dir.as_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("stat of the volumes root {}", canonical.display()),
            )
        })?;
        // Every walk tells a mount inside a tree by statx's mount id: a
        // kernel without it is refused here, once, in one line.
        sys::require_mount_id(dir.as_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("volumes root {}", canonical.display()),
            )
        })?;
        let magic = sys::fs_magic(dir.as_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("statfs of the volumes root {}", canonical.display()),
            )
        })?;
        Ok(Root {
            path: canonical,
            dir,
            dev: st.dev,
            magic,
        })
    }

    /// Creates the directory `path` and its parents if missing (upstream's
    /// `mkdir -p` before its first volume). A crash part-way leaves some of
    /// the parents, which the next call completes.
    pub fn create(path: &Path) -> Result<(), Error> {
        sys::create_dir_all(path).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("creating {}", path.display()),
            )
        })
    }

    /// The canonical path, for messages and for tools that take paths.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory itself: what every operation works relative to.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    /// The device the root directory lives on (each btrfs subvolume has
    /// its own).
    pub fn dev(&self) -> u64 {
        self.dev
    }

    /// Whether the root is on btrfs. If not, volumes are plain directories
    /// and nothing converts.
    pub fn is_btrfs(&self) -> bool {
        self.magic == sys::fs_magic_btrfs()
    }

    /// The type of the filesystem the root is on, for messages: as its
    /// mount table entry names it (`ext4`), else statfs's magic number.
    /// Reads the mount table: best effort, never an error.
    pub fn filesystem(&self) -> String {
        let from_table = || -> Option<String> {
            let id = sys::mount_id(self.fd()).ok()??;
            let own = sys::own_mount_table().ok()?;
            crate::mounts::fs_type_of_mount(&own.mountinfo, id)
        };
        from_table().unwrap_or_else(|| sys::fs_name_of_magic(self.magic))
    }

    /// Why volumes under this root fall back to plain directories and
    /// get no snapshots: `the volumes root <path> is on <type>, not btrfs`
    /// ([`Root::filesystem`]); `None` on btrfs.
    pub fn why_not_btrfs(&self) -> Option<String> {
        (!self.is_btrfs()).then(|| {
            format!(
                "the volumes root {} is on {}, not btrfs",
                self.path.display(),
                self.filesystem()
            )
        })
    }
}
