//! The volume store: package volumes as btrfs subvolumes under one root.
//!
//! Layout, as upstream: `<root>/<pkg>/data/<volume-id>/`, and the install
//! backup at `<root>/<pkg>.install-backup`. On btrfs `<pkg>` is a subvolume and
//! the backup a read-only snapshot of it; every other name a package uses is
//! listed in [`crate::layout`].
//!
//! Every operation takes the package's lock ([`crate::lock`]), first
//! finishes or undoes whatever a crash left behind for that package
//! ([`VolumeStore::recover`]), then runs. At every instant, and after a
//! crash at any point, `<pkg>` is either the complete volume before the
//! operation or the complete volume after it, and `<pkg>.install-backup` is
//! either absent or a complete backup. An operation that fails puts back
//! what it changed before returning the error, so the disk is as it was
//! before the call (a step past the operation's commit point is left for
//! recovery to finish instead).
//!
//! ## What decides recovery
//!
//! Only names in the volumes root, their types, and the records this crate
//! writes there ([`crate::record`]): never anything inside a volume, which
//! the package's own processes write. The states, per operation:
//!
//! - **snapshot**: `<pkg>.install-backup.tmp` exists until the complete,
//!   frozen snapshot is renamed to `<pkg>.install-backup`: a `.tmp` is
//!   always incomplete, deleted. `<pkg>.install-backup.ro`, the record of
//!   the read-only nested subvolumes, is written before that rename and is
//!   garbage without a backup.
//! - **restore**: the writable copy `<pkg>.rollback` is made, then the
//!   record `<pkg>.rollback.id` naming that copy's identity (subvolume UUID,
//!   or inode and birth time of a plain directory) once it is complete and
//!   committed, then one `RENAME_EXCHANGE` swaps it with `<pkg>`, then the
//!   replaced volume moves to `<pkg>.replaced`, the backup is dropped, and
//!   the record removed. Without the record, `.rollback` is an incomplete
//!   copy (deleted; the backup stays). With it, whichever of `<pkg>` and
//!   `<pkg>.rollback` has the recorded identity is the restored volume:
//!   `<pkg>` means the exchange happened (finish), `.rollback` that it did
//!   not (exchange, then finish).
//! - **drop**: the backup is renamed to `.install-backup.drop`, which is
//!   garbage.
//! - **delete**: `<pkg>` is renamed to `<pkg>.delete`, the commit point;
//!   while `.delete` exists the delete is under way, so recovery drops the
//!   backup, then deletes `.delete`, last.
//! - `<pkg>.replaced` is always garbage.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt, VolumeId};
use rustix::fs::FileType;
use serde::Serialize;

use crate::failpoint::failpoint;
use crate::layout::{self, Names};
use crate::lock::{LockDir, LockWait, PackageLock};
use crate::mounts::{self, MountUse};
use crate::outcome::{Recovery, SnapshotOutcome, VolumeInfo, VolumeKind};
use crate::record::{self, Identity};
use crate::root::Root;
use crate::sys;
use crate::usage::{self, Split, Usage};

mod upstream;

/// Default bound on the extent count of a plain (not yet converted) volume
/// directory for which a reflink backup is still taken. At the ~6.7 us per
/// extent measured for `cp --reflink`, 100k extents is well under a second.
pub const DEFAULT_REFLINK_EXTENT_LIMIT: u64 = 100_000;

/// Real space use of a package's volume and backup ([`VolumeStore::usage`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeUsage {
    /// The package.
    pub package: PackageId,
    /// The live volume, nested subvolumes included; `None` if it has none.
    pub volume: Option<Usage>,
    /// The install backup; `None` if it has none.
    pub backup: Option<Usage>,
    /// With a backup: disk bytes held only by it (what dropping it frees),
    /// only by the live volume, and by both.
    pub split: Option<Split>,
}

/// What an entry of the volumes root is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Absent,
    Tree(VolumeKind),
    /// Not a directory: no volume of ours, whatever its name.
    Other(FileType),
}

/// Why making a volume's directories failed.
enum MakeFailed {
    /// This path below the volume exists and is no directory (a symlink,
    /// dangling or not, a file): no volume directory, refused.
    NotADirectory(String),
    /// A system call failed.
    Io(io::Error),
}

impl From<io::Error> for MakeFailed {
    fn from(e: io::Error) -> Self {
        MakeFailed::Io(e)
    }
}

/// Makes the directory `name` in `dir` unless it is there, and opens it,
/// never through a symlink; `rel` names it below the volume for a refusal.
fn make_dir_at(dir: BorrowedFd<'_>, name: &OsStr, rel: &str) -> Result<OwnedFd, MakeFailed> {
    sys::mkdir_if_missing(dir, name, 0o755)?;
    sys::open_dir_at(dir, name).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP | libc::ENOTDIR) => MakeFailed::NotADirectory(rel.to_owned()),
        _ => MakeFailed::Io(e),
    })
}

/// What kind of entry a leftover name of a package is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leftover {
    /// A tree: deleted whole.
    Tree,
    /// A record (a symlink): unlinked.
    Record,
}

/// A file type in words, for messages.
fn type_name(ty: FileType) -> &'static str {
    match ty {
        FileType::RegularFile => "a regular file",
        FileType::Symlink => "a symlink",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Directory => "a directory",
        _ => "not a directory",
    }
}

/// Package volumes under one root directory (upstream:
/// `/media/startos/data/package-data/volumes`).
///
/// The root itself is trusted; everything inside a volume is not. All names
/// are resolved relative to the root's open file descriptor and never through
/// a symlink.
pub struct VolumeStore {
    root: Root,
    reflink_extent_limit: u64,
    locks: LockDir,
    read_wait: LockWait,
}

/// The lock directory of the volumes root open as `dir`, with the error
/// every caller reports.
pub fn open_locks(root: &Path, dir: BorrowedFd<'_>) -> Result<LockDir, Error> {
    LockDir::for_root(dir).with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            format!(
                "opening the lock directory of {} under {}",
                root.display(),
                crate::lock::LOCK_DIR
            ),
        )
    })
}

fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Appends to `e` that undoing the failed step failed too, if it did.
fn with_cleanup(e: Error, cleanup: io::Result<()>, what: &str) -> Error {
    match cleanup {
        Ok(()) => e,
        Err(c) => {
            let kind = e.kind;
            Error::new(
                e.source.wrap_err(format!(
                    "{what} failed too ({c}); the next operation retries"
                )),
                kind,
            )
        }
    }
}

impl VolumeStore {
    /// Opens the store at `root` (which must be an existing directory) and
    /// finishes or undoes every operation a crash interrupted, for all
    /// packages, taking each package's lock in turn.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, Error> {
        let store = Self::open_without_recovery(root)?;
        store.recover_all()?;
        Ok(store)
    }

    /// Opens the store without running recovery. Operations still recover
    /// their own package before running.
    pub fn open_without_recovery(root: impl AsRef<Path>) -> Result<Self, Error> {
        let root = Root::open(root)?;
        let locks = open_locks(root.path(), root.fd())?;
        Ok(VolumeStore {
            root,
            reflink_extent_limit: DEFAULT_REFLINK_EXTENT_LIMIT,
            locks,
            read_wait: LockWait::Forever,
        })
    }

    /// Sets the extent bound above which a plain directory gets no reflink
    /// backup (see [`DEFAULT_REFLINK_EXTENT_LIMIT`]).
    pub fn with_reflink_extent_limit(mut self, limit: u64) -> Self {
        self.reflink_extent_limit = limit;
        self
    }

    /// Sets how long the commands that only read or recover ([`usage`],
    /// [`recover`], [`recover_all`]) wait for a package another process
    /// holds before reporting it busy (`Timeout`, naming the holder's pid):
    /// [`LockWait::Forever`] by default. Operations that change a package
    /// always wait their turn.
    ///
    /// [`usage`]: VolumeStore::usage
    /// [`recover`]: VolumeStore::recover
    /// [`recover_all`]: VolumeStore::recover_all
    pub fn with_lock_wait(mut self, wait: LockWait) -> Self {
        self.read_wait = wait;
        self
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Whether the root is on btrfs.
    pub fn is_btrfs(&self) -> bool {
        self.root.is_btrfs()
    }

    /// `<root>/<pkg>`, the package's volume.
    pub fn volume_path(&self, pkg: &PackageId) -> PathBuf {
        self.root.path().join(pkg.as_str())
    }

    /// `<root>/<pkg>.install-backup`.
    pub fn backup_path(&self, pkg: &PackageId) -> PathBuf {
        self.root
            .path()
            .join(format!("{pkg}{}", layout::INSTALL_BACKUP_SUFFIX))
    }

    /// `<root>/<pkg>/data/<volume>`, where the service sees its volume.
    pub fn data_dir(&self, pkg: &PackageId, volume: &VolumeId) -> PathBuf {
        self.volume_path(pkg).join("data").join(volume.as_str())
    }

    fn root_fd(&self) -> BorrowedFd<'_> {
        self.root.fd()
    }

    fn lock(&self, pkg: &PackageId) -> Result<PackageLock, Error> {
        self.lock_with(pkg, LockWait::Forever)
    }

    /// The lock of `pkg` for a command that only reads or recovers: waits
    /// as [`VolumeStore::with_lock_wait`] set, then `Timeout`, naming the
    /// holder.
    fn lock_for_read(&self, pkg: &PackageId) -> Result<PackageLock, Error> {
        self.lock_with(pkg, self.read_wait)
    }

    fn lock_with(&self, pkg: &PackageId, wait: LockWait) -> Result<PackageLock, Error> {
        self.locks
            .lock_with(pkg, wait)
            .map_err(|e| match crate::lock::busy(&e) {
                Some(busy) => Error::for_package(pkg, ErrorKind::Timeout, busy),
                None => Error::new(
                    eyre!(e).wrap_err(pkg.context(format!(
                        "taking the package lock in {}",
                        self.locks.path().display()
                    ))),
                    ErrorKind::Filesystem,
                ),
            })
    }

    fn stat(&self, name: &OsStr) -> io::Result<Option<sys::Stat>> {
        sys::stat_at(self.root_fd(), name)
    }

    fn exists_at(&self, name: &OsStr) -> io::Result<bool> {
        Ok(self.stat(name)?.is_some())
    }

    /// Whether `pkg` has anything under the root: a volume, a backup, or
    /// any of the names an operation passes through. Without any, every
    /// operation but `create` has nothing to do, and takes no lock.
    pub fn exists(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        self.any_name(pkg, &names)
    }

    fn any_name(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        for name in names.all() {
            if self
                .exists_at(name)
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("looking for its names")))?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What the entry `name` of the root is.
    fn entry(&self, name: &OsStr) -> io::Result<Entry> {
        match self.stat(name)? {
            None => Ok(Entry::Absent),
            Some(st) if !st.is_dir() => Ok(Entry::Other(st.file_type)),
            Some(_) => {
                let fd = sys::open_dir_at(self.root_fd(), name)?;
                Ok(Entry::Tree(if sys::is_subvolume(fd.as_fd())? {
                    VolumeKind::Subvolume
                } else {
                    VolumeKind::Directory
                }))
            }
        }
    }

    /// How the tree `name` is stored, `None` if absent; an error naming the
    /// entry if it is not a directory (no volume or backup of ours).
    fn tree(&self, pkg: &PackageId, name: &OsStr) -> Result<Option<VolumeKind>, Error> {
        let path = self.root.path().join(name);
        match self.entry(name).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!("inspecting {}", path.display())),
            )
        })? {
            Entry::Absent => Ok(None),
            Entry::Tree(kind) => Ok(Some(kind)),
            Entry::Other(ty) => Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} is {}, not a package volume; move it out of the volumes root",
                    path.display(),
                    type_name(ty)
                ),
            )),
        }
    }

    fn fsync_root(&self) -> io::Result<()> {
        sys::fsync(self.root_fd())
    }

    /// Every mount, in any mount namespace, that exposes something inside
    /// `<pkg>` (see [`mounts::uses_of`]): what a restore or a delete refuses
    /// to run beside. A caller that can stop the processes holding them
    /// (start-core, through its services) does so first.
    pub fn mount_uses(&self, pkg: &PackageId) -> Result<Vec<MountUse>, Error> {
        mounts::uses_of(&self.volume_path(pkg)).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })
    }

    /// Refuses with a one-line error if anything is mounted from inside
    /// `<pkg>`, in any mount namespace: a bind mount would keep pointing at
    /// the old data.
    fn ensure_not_mounted(&self, pkg: &PackageId) -> Result<(), Error> {
        let busy = self.mount_uses(pkg)?;
        if busy.is_empty() {
            Ok(())
        } else {
            Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "volume {} is in use, mounted at {}; stop the service first",
                    self.volume_path(pkg).display(),
                    mounts::describe(&busy)
                ),
            ))
        }
    }

    /// Removes the entry `name` of the root and everything below it (see
    /// [`delete_tree_at`]).
    ///
    /// Only ever called on transient names, so a crash part-way leaves a
    /// partial tree under a name that recovery deletes again.
    fn delete_entry(&self, name: &OsStr) -> io::Result<()> {
        delete_tree_at(self.root_fd(), name)
    }

    /// Whether the tree `name` can be deleted in one atomic step, under its
    /// own name: a subvolume with no subvolume nested in it (one
    /// `SNAP_DESTROY`, which leaves it either whole or gone, read-only or
    /// not).
    fn can_delete_in_one_step(&self, name: &OsStr) -> io::Result<bool> {
        if self.entry(name)? != Entry::Tree(VolumeKind::Subvolume) {
            return Ok(false);
        }
        let fd = sys::open_dir_at(self.root_fd(), name)?;
        Ok(sys::nested_subvolumes(fd.as_fd())?.is_empty())
    }

    /// Deletes the tree `name` in one atomic step if it can be
    /// ([`VolumeStore::can_delete_in_one_step`]), for when renaming it
    /// aside failed for want of metadata space: a rename needs some, while
    /// deleting a subvolume may draw on the filesystem's global reserve.
    /// Returns whether it did.
    fn one_step_delete(&self, name: &OsStr) -> io::Result<bool> {
        if !self.can_delete_in_one_step(name)? {
            return Ok(false);
        }
        sys::delete_subvolume(self.root_fd(), name, false)?;
        self.fsync_root()?;
        Ok(true)
    }

    /// The error for a step that failed with `e`, saying `what` it was; when
    /// the filesystem ran out of space, also how much metadata space is free
    /// and what to do (snapshots, renames and records need metadata space
    /// only, so a full data space never stops them).
    fn failed(&self, pkg: &PackageId, what: impl std::fmt::Display, e: io::Error) -> Error {
        let root = self.root.path().display();
        let what = match e.raw_os_error() {
            Some(libc::ENOSPC) => {
                // The allocator's figure, for the operator: btrfs refuses a
                // step when what it reserves for it exceeds what is free,
                // which can be more than the step uses.
                let free = match self.root.is_btrfs() {
                    true => sys::metadata_space(self.root_fd())
                        .map(|s| {
                            format!("btrfs counts {} KiB of metadata space free", s.free() >> 10)
                        })
                        .unwrap_or_else(|_| "no figure for the free metadata space".to_owned()),
                    false => "not btrfs".to_owned(),
                };
                format!(
                    "{what}: the filesystem holding {root} is out of space ({free}); this step \
                     needs metadata space only: free some (delete files, or drop another \
                     package's backup) and retry"
                )
            }
            Some(libc::EDQUOT) => format!(
                "{what}: a quota (qgroup limit) on the filesystem holding {root} is reached; \
                 raise or remove it, or free space under it, and retry"
            ),
            _ => what.to_string(),
        };
        Error::new(
            eyre!(e).wrap_err(pkg.context(what)),
            ErrorKind::DiskManagement,
        )
    }

    /// Makes sure `<pkg>` exists, creating it empty if missing: a subvolume
    /// on btrfs, a directory elsewhere (upstream's `ensure_volume_root`).
    /// An existing volume, subvolume or plain directory, is kept as it is.
    /// Finishes whatever a crash left for the package first. One atomic
    /// step: after a crash `<pkg>` is absent or empty.
    pub fn ensure(&self, pkg: &PackageId) -> Result<VolumeKind, Error> {
        let names = Names::new(pkg)?;
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        self.ensure_locked(pkg, &names)
    }

    /// [`VolumeStore::ensure`] under the lock.
    fn ensure_locked(&self, pkg: &PackageId, names: &Names) -> Result<VolumeKind, Error> {
        if let Some(kind) = self.tree(pkg, &names.live)? {
            return Ok(kind);
        }
        let kind = self.make_tree(pkg, &names.live)?;
        self.fsync_root().with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("syncing the volumes root"),
            )
        })?;
        Ok(kind)
    }

    /// Makes the empty tree `name` in the root, in one step: a subvolume on
    /// btrfs, a directory elsewhere. Not yet durable.
    fn make_tree(&self, pkg: &PackageId, name: &OsStr) -> Result<VolumeKind, Error> {
        let path = self.root.path().join(name);
        if self.root.is_btrfs() {
            sys::create_subvolume(self.root_fd(), name).with_ctx(|_| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context(format!("creating subvolume {}", path.display())),
                )
            })?;
            Ok(VolumeKind::Subvolume)
        } else {
            sys::mkdir_at(self.root_fd(), name, 0o755).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context(format!("creating {}", path.display())),
                )
            })?;
            Ok(VolumeKind::Directory)
        }
    }

    /// Creates `<pkg>` (a subvolume on btrfs, a directory elsewhere) and
    /// `data/<volume>` inside it for each volume. Idempotent: an existing
    /// volume, subvolume or plain directory, is kept as it is, and gets the
    /// volume directories it lacks.
    ///
    /// A new volume is made whole under `<pkg>.create`, its directories
    /// made and synced, then renamed to `<pkg>` in one step: after a crash
    /// or a failure `<pkg>` is absent or complete, and a `.create` left
    /// behind is garbage, which the next operation's recovery deletes. In
    /// an existing volume, each missing directory is one `mkdir`: a failure
    /// part-way leaves some of them made, which a rerun completes.
    pub fn create(&self, pkg: &PackageId, volumes: &[VolumeId]) -> Result<VolumeKind, Error> {
        let names = Names::new(pkg)?;
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        if let Some(kind) = self.tree(pkg, &names.live)? {
            self.make_volume_dirs(pkg, &names.live, volumes)?;
            return Ok(kind);
        }
        let kind = self.make_tree(pkg, &names.create)?;
        let made = self
            .make_volume_dirs(pkg, &names.create, volumes)
            .and_then(|()| {
                failpoint("create.made")
                    .and_then(|()| {
                        sys::rename_noreplace(self.root_fd(), &names.create, &names.live)
                    })
                    .and_then(|()| self.fsync_root())
                    .map_err(|e| self.failed(pkg, "putting the new volume in place", e))
            });
        if let Err(e) = made {
            // Nothing half-made stays under the package's name.
            let cleanup = self
                .delete_entry(&names.create)
                .and_then(|()| self.fsync_root());
            return Err(with_cleanup(e, cleanup, "removing the new volume"));
        }
        tracing::info!(package = %pkg, ?kind, "volume ready");
        Ok(kind)
    }

    /// Makes `data/<volume>` for each of `volumes` in the tree `name` of the
    /// root, those missing, and syncs them. An existing name that is no
    /// directory (a symlink, dangling or not, a file) is refused, naming it.
    fn make_volume_dirs(
        &self,
        pkg: &PackageId,
        name: &OsStr,
        volumes: &[VolumeId],
    ) -> Result<(), Error> {
        let mk = || -> Result<(), MakeFailed> {
            let top = sys::open_dir_at(self.root_fd(), name)?;
            let data = make_dir_at(top.as_fd(), OsStr::new("data"), "data")?;
            for v in volumes {
                make_dir_at(data.as_fd(), OsStr::new(v.as_str()), &format!("data/{v}"))?;
            }
            sys::fsync(data.as_fd())?;
            sys::fsync(top.as_fd())?;
            Ok(())
        };
        mk().map_err(|e| match e {
            MakeFailed::NotADirectory(rel) => Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} exists and is not a directory; move it away",
                    self.volume_path(pkg).join(rel).display()
                ),
            ),
            MakeFailed::Io(e) => self.failed(
                pkg,
                format!(
                    "creating volume directories in {}",
                    self.root.path().join(name).join("data").display()
                ),
                e,
            ),
        })
    }

    /// Makes everything written so far inside `<pkg>` durable: on btrfs a
    /// commit after writing out the dirty data (BTRFS_IOC_SYNC), elsewhere
    /// `syncfs`. For a caller about to record that the volume's contents are
    /// final, such as start-core before it records an update installed and
    /// so lets its backup go: without this, a power cut can keep that record
    /// and lose the writes it vouches for (a migration's last changes), with
    /// the backup gone. Does nothing when there is no volume; takes no lock.
    pub fn sync_volume(&self, pkg: &PackageId) -> Result<(), Error> {
        let names = Names::new(pkg)?;
        if self.tree(pkg, &names.live)?.is_none() {
            return Ok(());
        }
        let sync = || -> io::Result<()> {
            let live = sys::open_dir_at(self.root_fd(), &names.live)?;
            if self.root.is_btrfs() {
                sys::commit(live.as_fd())
            } else {
                sys::syncfs(live.as_fd())
            }
        };
        sync().map_err(|e| self.failed(pkg, "making the volume's contents durable", e))
    }

    /// Takes the install backup `<pkg>.install-backup` of `<pkg>`.
    ///
    /// On btrfs with `<pkg>` a subvolume: a read-only snapshot, nested
    /// subvolumes included, in milliseconds whatever the fragmentation. It is
    /// built under `<pkg>.install-backup.tmp` and renamed into place only once
    /// complete and frozen, so a backup under its real name is never partial.
    /// Which nested subvolumes were read-only in the volume is recorded
    /// beside it (`<pkg>.install-backup.ro`), so a restore gives them back
    /// read-only and the others writable.
    ///
    /// Fallbacks, each with a warning naming the package: not btrfs, no
    /// backup; a plain directory on btrfs, a reflink copy if its extent count
    /// is within the configured bound (nested subvolumes copied as
    /// subvolumes, read-only ones kept read-only), else no backup.
    ///
    /// Fails with `Incoherent` if a backup already exists: it belongs to an
    /// unfinished install that must be restored or dropped first, and
    /// replacing it could throw away the only good copy. A failure removes
    /// whatever the call had made.
    pub fn snapshot(&self, pkg: &PackageId) -> Result<SnapshotOutcome, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(SnapshotOutcome::NoVolume);
        }
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        let Some(kind) = self.tree(pkg, &names.live)? else {
            return Ok(SnapshotOutcome::NoVolume);
        };
        if self.tree(pkg, &names.backup)?.is_some() {
            return Err(Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "an install backup already exists at {}; restore or drop it first",
                    self.backup_path(pkg).display()
                ),
            ));
        }
        if !self.root.is_btrfs() {
            let reason = "the volumes root is not on btrfs".to_owned();
            tracing::warn!(package = %pkg, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        match kind {
            VolumeKind::Subvolume => self.snapshot_subvolume(pkg, &names),
            VolumeKind::Directory => self.reflink_backup(pkg, &names),
        }
    }

    fn snapshot_subvolume(&self, pkg: &PackageId, names: &Names) -> Result<SnapshotOutcome, Error> {
        let (what, result) = self.build_snapshot(names);
        if let Err(e) = result {
            // Nothing of a backup may be left unless it has its real name.
            let cleanup = (|| {
                self.delete_entry(&names.backup_tmp)?;
                if !self.exists_at(&names.backup)? {
                    self.delete_entry(&names.backup_ro)?;
                }
                self.fsync_root()
            })();
            let e = self.failed(
                pkg,
                format!("{what} {}", self.volume_path(pkg).display()),
                e,
            );
            return Err(with_cleanup(e, cleanup, "removing the partial snapshot"));
        }
        tracing::info!(package = %pkg, "install backup snapshot taken");
        Ok(SnapshotOutcome::Snapshot)
    }

    /// The steps of a subvolume snapshot; the step that failed, if one did.
    fn build_snapshot(&self, names: &Names) -> (&'static str, io::Result<()>) {
        let live = match sys::open_dir_at(self.root_fd(), &names.live) {
            Ok(fd) => fd,
            Err(e) => return ("opening", Err(e)),
        };
        let tmp = match sys::snapshot_tree(live.as_fd(), self.root_fd(), &names.backup_tmp) {
            Ok(fd) => fd,
            Err(e) => return ("snapshotting", Err(e)),
        };
        if let Err(e) = failpoint("snapshot.created") {
            return ("snapshotting", Err(e));
        }
        let ro = match read_only_nested(live.as_fd(), tmp.as_fd()) {
            Ok(ro) => ro,
            Err(e) => {
                return (
                    "reading the read-only flags of the subvolumes nested in",
                    Err(e),
                );
            }
        };
        let recorded = match ro.is_empty() {
            true => Ok(()),
            false => record::write_set(self.root_fd(), &names.backup_ro, &ro),
        };
        if let Err(e) = recorded {
            return ("recording the read-only subvolumes nested in", Err(e));
        }
        if let Err(e) = sys::make_tree_read_only(tmp.as_fd()) {
            return ("making read-only the snapshot of", Err(e));
        }
        if let Err(e) = failpoint("snapshot.frozen") {
            return ("making read-only the snapshot of", Err(e));
        }
        let publish = sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)
            .and_then(|()| self.fsync_root());
        ("putting in place the snapshot of", publish)
    }

    /// The fallback for a volume that is still a plain directory on btrfs:
    /// a reflink copy if its extent count is within the bound. Over the
    /// bound is a designed skip (no backup, with the reason); any failure
    /// of the count or the copy is an error, the partial copy removed: an
    /// update must not go on believing there is no rollback point to make.
    fn reflink_backup(&self, pkg: &PackageId, names: &Names) -> Result<SnapshotOutcome, Error> {
        let live = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("opening the volume")))?;
        let limit = self.reflink_extent_limit;
        // Data still in the page cache has no extents yet; BTRFS_IOC_SYNC
        // flushes it so the count sees what the copy will have to clone.
        sys::commit(live.as_fd()).map_err(|e| self.failed(pkg, "flushing the volume", e))?;
        let extents = crate::extents::count_tree_extents(live.as_fd(), limit)
            .map_err(|e| self.walk_failed(pkg, "counting the extents of the volume", e))?;
        if extents > limit {
            let reason = format!(
                "volume is a plain directory with more than {limit} extents \
                 (a reflink copy would take too long); convert it to a subvolume"
            );
            tracing::warn!(package = %pkg, extents, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        let copy = || -> io::Result<()> {
            sys::mkdir_at(self.root_fd(), &names.backup_tmp, 0o700)?;
            let dst = sys::open_dir_at(self.root_fd(), &names.backup_tmp)?;
            let opts = crate::copy::CopyOptions {
                nested_subvolumes: true,
                ..Default::default()
            };
            crate::copy::reflink_into(live.as_fd(), dst.as_fd(), &opts, &mut |_| Ok(()))?;
            // The copy shares its data with the volume: committing its
            // metadata makes it durable before its name says "complete".
            failpoint("snapshot.created")?;
            sys::commit_metadata(self.root_fd())?;
            sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)?;
            self.fsync_root()
        };
        if let Err(e) = copy() {
            let cleanup = self
                .delete_entry(&names.backup_tmp)
                .and_then(|()| self.fsync_root());
            let e = self.walk_failed(pkg, "making the reflink backup", e);
            return Err(with_cleanup(
                e,
                cleanup,
                "removing the partial reflink copy",
            ));
        }
        tracing::info!(package = %pkg, extents, "install backup reflink copy taken");
        Ok(SnapshotOutcome::ReflinkCopy { extents })
    }

    /// [`VolumeStore::failed`] for a step that walks the volume's tree:
    /// a mount inside it, or a tree deeper than a copy goes, is the
    /// package's shape, refused (`InvalidRequest`) with the path named.
    fn walk_failed(&self, pkg: &PackageId, what: &str, e: io::Error) -> Error {
        if crate::walk::is_crossing(&e) || crate::walk::is_too_deep(&e) {
            return Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!("{what} of {}: {e}", self.volume_path(pkg).display()),
            );
        }
        self.failed(
            pkg,
            format!("{what} of {}", self.volume_path(pkg).display()),
            e,
        )
    }

    /// Rolls `<pkg>` back to its install backup, atomically, and removes the
    /// backup. Returns `false` (and changes nothing) if there is no backup.
    ///
    /// A writable snapshot of the backup is made under `<pkg>.rollback`
    /// (read-only nested subvolumes made read-only again), its identity is
    /// recorded once it is complete and committed, and one renameat2
    /// RENAME_EXCHANGE swaps it with `<pkg>`; the replaced volume is then
    /// deleted. So `<pkg>` is never missing: before the exchange it is the
    /// current volume, after it the restored one, whatever instant a crash
    /// or power cut hits. Nothing is written inside either volume.
    ///
    /// Refuses while anything is mounted from inside `<pkg>`, in any mount
    /// namespace. A failure before the exchange removes the copy and the
    /// record: the disk is as before the call.
    pub fn restore(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        let restored = self.restore_locked(pkg, &names)?;
        self.purge_locked(pkg, &names)?;
        Ok(restored)
    }

    /// [`VolumeStore::restore`] without deleting the replaced volume, which
    /// is left under `<pkg>.replaced` for [`VolumeStore::purge`].
    ///
    /// Deleting a subvolume evicts its cached pages first (about 0.13 s per
    /// cached GiB here), so for a database the service had in memory the
    /// delete can take seconds: a caller restarting the old service should
    /// do that first and purge afterwards. The restore itself is complete
    /// when this returns; `<pkg>.replaced` is garbage that any later
    /// operation's recovery, or `purge`, deletes.
    pub fn restore_deferring_purge(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        self.restore_locked(pkg, &names)
    }

    /// Deletes the volume a restore replaced (`<pkg>.replaced`), if any:
    /// O(1) per subvolume plus the eviction of its cached pages.
    pub fn purge(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        let _lock = self.lock(pkg)?;
        self.purge_locked(pkg, &names)
    }

    fn purge_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx = |_: &io::Error| {
            (
                ErrorKind::DiskManagement,
                pkg.context("deleting the volume a restore replaced"),
            )
        };
        if self.tree(pkg, &names.replaced)?.is_none() {
            return Ok(false);
        }
        self.delete_entry(&names.replaced).with_ctx(io_ctx)?;
        failpoint("restore.replaced-deleted").with_ctx(io_ctx)?;
        Ok(true)
    }

    fn restore_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        // Refuses a non-directory under the package's name first.
        self.tree(pkg, &names.live)?;
        let Some(backup_kind) = self.tree(pkg, &names.backup)? else {
            return Ok(false);
        };
        self.ensure_not_mounted(pkg)?;
        let prepared = match backup_kind {
            VolumeKind::Subvolume => self.prepare_rollback_copy(names),
            VolumeKind::Directory => self.prepare_rollback_in_place(names),
        };
        let exchanged = prepared.and_then(|()| {
            failpoint("restore.recorded").map_err(|e| ("exchanging the volume with", e))?;
            self.swap_in_rollback(names)
        });
        if let Err((what, e)) = exchanged {
            let cleanup = self.undo_rollback(names, backup_kind);
            let e = self.failed(
                pkg,
                format!(
                    "{what} {}",
                    self.root.path().join(&names.rollback).display()
                ),
                e,
            );
            return Err(with_cleanup(e, cleanup, "undoing the restore"));
        }
        // The exchange is the commit point: from here on, a failure is
        // finished by recovery, never undone (but for a mount of the
        // replaced volume made meanwhile, see `undo_if_replaced_in_use`).
        let synced = self
            .fsync_root()
            .and_then(|()| failpoint("restore.exchanged"))
            .map_err(|e| self.failed(pkg, "syncing the volumes root after the exchange", e));
        // Its own message, undone or not: no "was restored" around it.
        if synced.is_ok() {
            self.undo_if_replaced_in_use(pkg, names)?;
        }
        let finished = synced.and_then(|()| self.finish_restore(pkg, names));
        if let Err(e) = finished {
            if !self.is_restored(names) {
                return Err(e);
            }
            let kind = e.kind;
            return Err(Error::new(
                e.source.wrap_err(format!(
                    "the volume {} was restored, but cleaning up after it failed; the next \
                     operation finishes it",
                    self.volume_path(pkg).display()
                )),
                kind,
            ));
        }
        tracing::info!(package = %pkg, "volume restored from install backup");
        Ok(true)
    }

    /// Makes the rollback copy of a snapshot backup: a writable snapshot,
    /// nested subvolumes included and the read-only ones made read-only
    /// again, then its identity recorded and everything committed.
    fn prepare_rollback_copy(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let backup = sys::open_dir_at(self.root_fd(), &names.backup)
            .map_err(|e| ("opening the backup for", e))?;
        let copy = sys::snapshot_tree(backup.as_fd(), self.root_fd(), &names.rollback)
            .map_err(|e| ("snapshotting the backup to", e))?;
        failpoint("restore.copied").map_err(|e| ("snapshotting the backup to", e))?;
        self.restore_read_only_flags(names, backup.as_fd(), copy.as_fd())
            .map_err(|e| ("making read-only again the nested subvolumes of", e))?;
        self.record_rollback(names, copy.as_fd())
    }

    /// A reflink backup is already a private copy, used as is: its identity
    /// recorded, then renamed to `<pkg>.rollback`.
    fn prepare_rollback_in_place(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let backup = sys::open_dir_at(self.root_fd(), &names.backup)
            .map_err(|e| ("opening the backup for", e))?;
        self.record_rollback(names, backup.as_fd())?;
        failpoint("restore.copied")
            .and_then(|()| sys::rename_noreplace(self.root_fd(), &names.backup, &names.rollback))
            .and_then(|()| self.fsync_root())
            .map_err(|e| ("moving the backup to", e))
    }

    /// Records the identity of the complete rollback copy open as `copy`
    /// and commits (off btrfs, where only a plain directory is ever used
    /// in place, syncs the root), so the copy, its flags and times, and the
    /// record are durable together before anything is exchanged.
    fn record_rollback(
        &self,
        names: &Names,
        copy: BorrowedFd<'_>,
    ) -> Result<(), (&'static str, io::Error)> {
        let id = Identity::of(copy).map_err(|e| ("reading the identity of", e))?;
        record::write(self.root_fd(), &names.rollback_id, &id.encode())
            .map_err(|e| ("recording the identity of", e))?;
        if self.root.is_btrfs() {
            sys::commit_metadata(self.root_fd())
        } else {
            self.fsync_root()
        }
        .map_err(|e| ("committing", e))
    }

    /// Sets the read-only flag, in the rollback copy open as `copy`, on each
    /// nested subvolume whose counterpart in the backup open as `backup` is
    /// listed in the backup's read-only record.
    fn restore_read_only_flags(
        &self,
        names: &Names,
        backup: BorrowedFd<'_>,
        copy: BorrowedFd<'_>,
    ) -> io::Result<()> {
        let Some(ids) = record::read_set(self.root_fd(), &names.backup_ro)? else {
            return Ok(());
        };
        for (n, counterpart) in nested_counterparts(backup, copy)? {
            if ids.contains(&n.id) {
                sys::set_read_only(sys::open_subvolume(copy, counterpart)?.as_fd(), true)?;
            }
        }
        Ok(())
    }

    /// Whether `<pkg>` is the volume a restore put in, after its exchange:
    /// the rollback record names it, or the record is gone and so is the
    /// backup (the restore finished; undone, the backup would be there). A
    /// failure to read counts as not restored: the message then claims
    /// nothing.
    fn is_restored(&self, names: &Names) -> bool {
        match record::read(self.root_fd(), &names.rollback_id) {
            Ok(Some(text)) => {
                Identity::decode(&text).is_some()
                    && Identity::of_entry(self.root_fd(), &names.live)
                        .ok()
                        .flatten()
                        == Identity::decode(&text)
            }
            Ok(None) => self.exists_at(&names.backup).is_ok_and(|b| !b),
            Err(_) => false,
        }
    }

    /// How the rollback copy of a recorded restore was made, from its
    /// record: a subvolume is a snapshot of the backup (which stays until
    /// the restore is done), a plain directory the reflink backup itself,
    /// moved to `<pkg>.rollback`.
    fn rollback_source(&self, pkg: &PackageId, names: &Names) -> Result<VolumeKind, Error> {
        let text = record::read(self.root_fd(), &names.rollback_id)
            .with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("reading the rollback record"),
                )
            })?
            .ok_or_else(|| {
                Error::for_package(
                    pkg,
                    ErrorKind::Incoherent,
                    format!(
                        "the rollback record {} is missing",
                        self.root.path().join(&names.rollback_id).display()
                    ),
                )
            })?;
        Identity::decode(&text)
            .map(|id| copy_kind(&id))
            .ok_or_else(|| {
                Error::for_package(
                    pkg,
                    ErrorKind::Incoherent,
                    format!(
                        "unreadable rollback record {} ({text:?})",
                        self.root.path().join(&names.rollback_id).display()
                    ),
                )
            })
    }

    /// Puts back what a failed restore made before its exchange: the record
    /// goes, a snapshot copy is deleted, a reflink backup gets its name back.
    ///
    /// The order keeps every instant recoverable: a snapshot copy loses its
    /// record first (without one it is garbage to recovery; with one, half
    /// deleted, it would be swapped in), a reflink backup gets its name back
    /// first (without a record, a plain `.rollback` beside no backup is
    /// refused, never deleted).
    fn undo_rollback(&self, names: &Names, backup_kind: VolumeKind) -> io::Result<()> {
        match backup_kind {
            VolumeKind::Subvolume => {
                record::remove(self.root_fd(), &names.rollback_id)?;
                self.fsync_root()?;
                self.delete_entry(&names.rollback)?;
            }
            VolumeKind::Directory => {
                if self.exists_at(&names.rollback)? && !self.exists_at(&names.backup)? {
                    sys::rename_noreplace(self.root_fd(), &names.rollback, &names.backup)?;
                    self.fsync_root()?;
                }
                record::remove(self.root_fd(), &names.rollback_id)?;
            }
        }
        self.fsync_root()
    }

    /// The one step that changes what `<pkg>` is: exchange it with the
    /// complete rollback copy (or just rename the copy in if `<pkg>` is gone).
    fn swap_in_rollback(&self, names: &Names) -> Result<(), (&'static str, io::Error)> {
        let live = self
            .exists_at(&names.live)
            .map_err(|e| ("looking for the volume to exchange with", e))?;
        if live {
            sys::rename_exchange(self.root_fd(), &names.rollback, &names.live)
        } else {
            sys::rename_noreplace(self.root_fd(), &names.rollback, &names.live)
        }
        .map_err(|e| ("exchanging the volume with", e))
    }

    /// After the exchange: move the replaced volume (now `<pkg>.rollback`)
    /// aside to `<pkg>.replaced`, drop the backup, then remove the rollback
    /// record. Each step is idempotent, and the record goes last so recovery
    /// can redo the rest.
    fn finish_restore(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        self.refuse_replacing_in_use(pkg, names)?;
        let set_aside = || -> io::Result<()> {
            if !self.exists_at(&names.rollback)? {
                return Ok(());
            }
            // Garbage from an earlier restore nobody purged.
            self.delete_entry(&names.replaced)?;
            sys::rename_noreplace(self.root_fd(), &names.rollback, &names.replaced)?;
            self.fsync_root()
        };
        set_aside().with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context("moving the replaced volume aside"),
            )
        })?;
        failpoint("restore.replaced-moved").with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context("moving the replaced volume aside"),
            )
        })?;
        self.drop_locked(pkg, names)?;
        failpoint("restore.backup-dropped")
            .and_then(|()| record::remove(self.root_fd(), &names.rollback_id))
            .and_then(|()| self.fsync_root())
            .with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("removing the rollback record"),
                )
            })
    }

    /// The mounts, in any namespace, of the volume a restore replaced (now
    /// `<pkg>.rollback`), if it is there.
    fn replaced_in_use(&self, pkg: &PackageId, names: &Names) -> Result<Vec<MountUse>, Error> {
        if self.tree(pkg, &names.rollback)?.is_none() {
            return Ok(Vec::new());
        }
        mounts::uses_of(&self.root.path().join(&names.rollback)).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })
    }

    /// The restore's own check, right after its exchange: a mount of the
    /// replaced volume made while the restore copied (after the check
    /// before the copy) would keep writing into a tree about to go. The
    /// exchange is undone (exchanged back, the copy and record removed) and
    /// the restore refused as any under a mount is; unless the restored
    /// volume is in use too, when nothing is changed and the restore is
    /// refused. A failure of the exchange back leaves the restore for the
    /// next operation, which never deletes a replaced volume in use.
    fn undo_if_replaced_in_use(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        let busy = self.replaced_in_use(pkg, names)?;
        if busy.is_empty() {
            return Ok(());
        }
        let refused = |what: &str| {
            Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "volume {} is in use, mounted at {} while the restore ran; {what}: stop the \
                     service first, then restore again",
                    self.volume_path(pkg).display(),
                    mounts::describe(&busy)
                ),
            )
        };
        if !self.mount_uses(pkg)?.is_empty() {
            return Err(refused(
                "the restored volume is in use too, so both are kept as they are",
            ));
        }
        let kind = self.rollback_source(pkg, names)?;
        let undone = sys::rename_exchange(self.root_fd(), &names.rollback, &names.live)
            .and_then(|()| self.fsync_root())
            .and_then(|()| self.undo_rollback(names, kind));
        Err(with_cleanup(
            refused("the restore was undone"),
            undone,
            "undoing the restore",
        ))
    }

    /// Before finishing a restore past its exchange, here or in recovery:
    /// a replaced volume still in use is kept (the restore is complete, its
    /// cleanup waits), never deleted from under the process writing to it.
    fn refuse_replacing_in_use(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        let busy = self.replaced_in_use(pkg, names)?;
        if busy.is_empty() {
            return Ok(());
        }
        Err(Error::for_package(
            pkg,
            ErrorKind::InvalidRequest,
            format!(
                "the volume a restore replaced, {}, is in use, mounted at {}; the restore is \
                 complete and the replaced volume is kept until that stops: stop it, then run \
                 recover",
                self.root.path().join(&names.rollback).display(),
                mounts::describe(&busy)
            ),
        ))
    }

    /// Drops the install backup after a successful install: O(1), the
    /// kernel frees its extents in the background. Returns `false` if there
    /// was none.
    ///
    /// The backup is first renamed to `<pkg>.install-backup.drop`, so a crash
    /// during a multi-subvolume delete never leaves a half-deleted tree under
    /// the backup's name.
    pub fn drop_backup(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        self.tree(pkg, &names.live)?;
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        self.drop_locked(pkg, &names)
    }

    fn drop_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let existed = self.tree(pkg, &names.backup)?.is_some();
        // Looked at first: a stray under the record's name stops the drop
        // before anything changed.
        let record = self.tree(pkg, &names.backup_ro)?.is_some();
        if existed {
            match sys::rename_noreplace(self.root_fd(), &names.backup, &names.backup_drop) {
                Ok(()) => {
                    self.fsync_root()
                        .and_then(|()| failpoint("drop.renamed"))
                        .and_then(|()| self.delete_entry(&names.backup_drop))
                        .with_ctx(io_ctx("deleting the backup"))?;
                }
                Err(e) if is_enospc(&e) => {
                    if !self
                        .one_step_delete(&names.backup)
                        .with_ctx(io_ctx("deleting the backup"))?
                    {
                        return Err(self.failed(pkg, "dropping the backup", e));
                    }
                }
                Err(e) => {
                    return Err(e).with_ctx(io_ctx("moving the backup aside"));
                }
            }
            tracing::info!(package = %pkg, "install backup dropped");
        }
        if record {
            self.delete_entry(&names.backup_ro)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("removing the backup's read-only record"))?;
        }
        Ok(existed)
    }

    /// Deletes the package's volume and its backup, on uninstall: O(1) per
    /// subvolume, nested subvolumes included. Returns `false` if there was
    /// nothing to delete. Refuses while anything is mounted from inside,
    /// and refuses an entry under the package's name that is no directory.
    ///
    /// `<pkg>` is renamed to `<pkg>.delete` first, the commit point: after a
    /// crash the package either still has its whole volume and backup, or
    /// the delete goes on until nothing of it is left (the backup is
    /// dropped, then `.delete` deleted last).
    pub fn delete(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let mut deleted = false;
        if self.tree(pkg, &names.live)?.is_some() {
            self.ensure_not_mounted(pkg)?;
            // A stray under one of its names stops the delete before it
            // starts, not half-way.
            self.leftovers(pkg, &names)?;
            match sys::rename_noreplace(self.root_fd(), &names.live, &names.delete) {
                Ok(()) => {
                    self.fsync_root()
                        .and_then(|()| failpoint("delete.renamed"))
                        .with_ctx(io_ctx("deleting the volume"))?;
                }
                Err(e) if is_enospc(&e) => {
                    // No room to rename: the backup, then the volume, each
                    // in one atomic step. A crash in between leaves the
                    // package with its volume and no backup, which the next
                    // delete finishes.
                    if !self
                        .can_delete_in_one_step(&names.live)
                        .with_ctx(io_ctx("inspecting the volume"))?
                    {
                        return Err(self.failed(pkg, "deleting the volume", e));
                    }
                    self.drop_locked(pkg, &names)?;
                    if !self
                        .one_step_delete(&names.live)
                        .with_ctx(io_ctx("deleting the volume"))?
                    {
                        return Err(self.failed(pkg, "deleting the volume", e));
                    }
                    tracing::info!(package = %pkg, "volume deleted");
                    return Ok(true);
                }
                Err(e) => return Err(e).with_ctx(io_ctx("moving the volume aside")),
            }
            deleted = true;
        }
        deleted |= self.finish_delete(pkg, &names)?;
        if deleted {
            tracing::info!(package = %pkg, "volume deleted");
        }
        Ok(deleted)
    }

    /// The rest of a delete once `<pkg>` is `<pkg>.delete` (or gone): the
    /// backup, the package's other names, then `.delete` itself. Returns
    /// whether anything was there.
    fn finish_delete(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let dropped = self.drop_locked(pkg, names)?;
        let io_ctx = |_: &io::Error| {
            (
                ErrorKind::DiskManagement,
                pkg.context("deleting the volume"),
            )
        };
        failpoint("delete.backup-dropped").with_ctx(io_ctx)?;
        // Every other name of the package goes with it: what an interrupted
        // restore of upstream's kept for the operator, a conversion's old
        // trees kept with `--keep-old` or left by a crash, upstream's
        // marker of a fresh install.
        let mut removed = false;
        for (name, kind) in self.leftovers(pkg, names)? {
            match kind {
                Leftover::Tree => self.delete_entry(name),
                Leftover::Record => record::remove(self.root_fd(), name),
            }
            .with_ctx(io_ctx)?;
            removed = true;
        }
        if removed {
            self.fsync_root().with_ctx(io_ctx)?;
        }
        self.mark_fresh_locked(pkg, &names.fresh, false)?;
        let pending = self.tree(pkg, &names.delete)?.is_some();
        if pending {
            self.delete_entry(&names.delete)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx)?;
        }
        Ok(dropped || removed || pending)
    }

    /// The names of `pkg` an uninstall removes beside its volume, backup and
    /// `<pkg>.delete` (which the delete itself takes care of), each with its
    /// kind; an error naming the first one that is not of its kind (a file
    /// under a tree's name, say: no state of ours, left alone).
    fn leftovers<'n>(
        &self,
        pkg: &PackageId,
        names: &'n Names,
    ) -> Result<Vec<(&'n OsStr, Leftover)>, Error> {
        let mut out = Vec::new();
        for name in [
            &names.restore_conflict,
            &names.migrate,
            &names.migrate_parent,
            &names.migrate_old,
        ] {
            if self.tree(pkg, name)?.is_some() {
                out.push((name.as_os_str(), Leftover::Tree));
            }
        }
        let rest = record::read(self.root_fd(), &names.migrate_rest).map_err(|e| {
            Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{}: {e}",
                    self.root.path().join(&names.migrate_rest).display()
                ),
            )
        })?;
        if rest.is_some() {
            out.push((names.migrate_rest.as_os_str(), Leftover::Record));
        }
        Ok(out)
    }

    /// Finishes or undoes whatever a crash interrupted for `pkg`, from the
    /// names and records on disk alone. Idempotent; a no-op costing a few
    /// `fstatat`s when nothing is pending.
    pub fn recover(&self, pkg: &PackageId) -> Result<Recovery, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(Recovery {
                package: pkg.clone(),
                actions: Vec::new(),
                error: None,
                busy: false,
            });
        }
        // A file, symlink or FIFO under the package's name is no volume of
        // ours: refused, as by every other command on the package.
        self.tree(pkg, &names.live)?;
        let _lock = self.lock_for_read(pkg)?;
        self.recover_locked(pkg, &names)
    }

    /// [`VolumeStore::recover`] for a caller that already holds the
    /// package's lock (taking it again here would wait on itself):
    /// volume-migrate, which must not convert a volume a restore is still
    /// exchanging.
    pub fn recover_held(&self, pkg: &PackageId, _lock: &PackageLock) -> Result<Recovery, Error> {
        let names = Names::new(pkg)?;
        self.recover_locked(pkg, &names)
    }

    /// [`VolumeStore::recover`] for every package with anything under the root.
    ///
    /// One package's failure does not stop the others: it is logged and
    /// returned as a [`Recovery`] with its `error` set, and that package's
    /// own operations keep failing (each recovers first) until it is fixed.
    pub fn recover_all(&self) -> Result<Vec<Recovery>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            // Not a volume, whatever its name (`list` says so): nothing to
            // recover, and no reason to stop the others.
            if matches!(self.entry(OsStr::new(pkg.as_str())), Ok(Entry::Other(_))) {
                continue;
            }
            match self.recover(&pkg) {
                Ok(r) if r.actions.is_empty() => {}
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::error!(package = %pkg, "recovery failed: {e}");
                    out.push(Recovery {
                        package: pkg,
                        actions: Vec::new(),
                        error: Some(e.to_string()),
                        busy: e.kind == ErrorKind::Timeout,
                    });
                }
            }
        }
        Ok(out)
    }

    fn recover_locked(&self, pkg: &PackageId, names: &Names) -> Result<Recovery, Error> {
        let mut actions = Vec::new();
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        // What upstream's own code left comes first: it is older than
        // anything of ours.
        self.recover_upstream(pkg, names, &mut actions)?;
        // A new volume that never got its name is incomplete: discard it.
        if self.tree(pkg, &names.create)?.is_some() {
            self.delete_entry(&names.create)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting an incomplete new volume"))?;
            actions.push("deleted an incomplete new volume".to_owned());
        }
        // A backup that never got its real name is incomplete: discard it.
        if self.tree(pkg, &names.backup_tmp)?.is_some() {
            self.delete_entry(&names.backup_tmp)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting a partial backup"))?;
            actions.push("deleted an incomplete install backup".to_owned());
        }
        if let Some(action) = self.recover_restore(pkg, names)? {
            actions.push(action.to_owned());
        }
        if self.tree(pkg, &names.backup_drop)?.is_some() {
            self.delete_entry(&names.backup_drop)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting a dropped backup"))?;
            actions.push("finished dropping the install backup".to_owned());
        }
        if self.tree(pkg, &names.backup)?.is_none() && self.tree(pkg, &names.backup_ro)?.is_some() {
            self.delete_entry(&names.backup_ro)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("removing the read-only record of a dropped backup"))?;
            actions.push("removed the read-only record of a dropped backup".to_owned());
        }
        if self.purge_locked(pkg, names)? {
            actions.push("deleted the volume a restore replaced".to_owned());
        }
        if self.tree(pkg, &names.delete)?.is_some() {
            self.finish_delete(pkg, names)?;
            actions.push("finished deleting the volume and its backup".to_owned());
        }
        // A conversion's replaced directory only ever holds data the
        // converted volume holds too: with no volume left (an uninstall of
        // an earlier version kept it), it is garbage.
        if self.tree(pkg, &names.live)?.is_none() && self.tree(pkg, &names.migrate_old)?.is_some() {
            self.delete_entry(&names.migrate_old)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting the old directory of a conversion"))?;
            actions
                .push("deleted the old directory of a conversion whose volume is gone".to_owned());
        }
        for a in &actions {
            tracing::warn!(package = %pkg, "recovery: {a}");
        }
        Ok(Recovery {
            package: pkg.clone(),
            actions,
            error: None,
            busy: false,
        })
    }

    /// Finishes or undoes an interrupted restore, from the rollback record
    /// and the identities of the trees; returns what it did, if anything.
    fn recover_restore(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<Option<&'static str>, Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let text = record::read(self.root_fd(), &names.rollback_id)
            .with_ctx(io_ctx("reading the rollback record"))?;
        let Some(text) = text else {
            // No record: the copy was never complete, so the exchange never
            // happened. The backup stays.
            if self.tree(pkg, &names.rollback)?.is_none() {
                return Ok(None);
            }
            if self.tree(pkg, &names.backup)?.is_none() {
                // Never this crate's own state (a copy is made from a
                // backup that stays until the record is gone); an earlier
                // version's reflink restore moved its backup here, and this
                // may be the only copy of it. Never deleted.
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::Incoherent,
                    format!(
                        "{} has no rollback record and there is no backup: it may be the only \
                         copy of the data an interrupted restore was putting back; keep whichever \
                         of it and {} holds the data to keep as {}, move the other away",
                        self.root.path().join(&names.rollback).display(),
                        self.volume_path(pkg).display(),
                        self.volume_path(pkg).display()
                    ),
                ));
            }
            self.delete_entry(&names.rollback)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("deleting an incomplete rollback copy"))?;
            return Ok(Some(
                "undid an interrupted restore (incomplete copy deleted, backup kept)",
            ));
        };
        let recorded = Identity::decode(&text).ok_or_else(|| {
            Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "unreadable rollback record {} ({text:?}); check which of {} and {} is \
                     the right volume, then remove the record",
                    self.root.path().join(&names.rollback_id).display(),
                    self.volume_path(pkg).display(),
                    self.root.path().join(&names.rollback).display()
                ),
            )
        })?;
        let identity = |name: &OsStr| {
            Identity::of_entry(self.root_fd(), name)
                .with_ctx(io_ctx("reading the identity of a tree"))
        };
        if identity(&names.live)? == Some(recorded) {
            self.finish_restore(pkg, names)?;
            return Ok(Some("finished an interrupted restore"));
        }
        if identity(&names.rollback)? == Some(recorded) {
            // The exchange never happened: `<pkg>` is still the volume the
            // restore would have replaced, and may hold what was written
            // since (a restore that failed returned its error, and the
            // service went on). Only the restore itself exchanges; here it
            // is undone, the backup kept for a restore to come.
            self.undo_rollback(names, copy_kind(&recorded))
                .with_ctx(io_ctx("undoing an interrupted restore"))?;
            return Ok(Some(
                "undid an interrupted restore (it never exchanged; the volume and its backup \
                 are as they were)",
            ));
        }
        if identity(&names.backup)? == Some(recorded) && self.tree(pkg, &names.rollback)?.is_none()
        {
            // A reflink backup recorded but not yet moved: nothing changed.
            record::remove(self.root_fd(), &names.rollback_id)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("removing the rollback record"))?;
            return Ok(Some("undid an interrupted restore (backup kept)"));
        }
        Err(Error::for_package(
            pkg,
            ErrorKind::Incoherent,
            format!(
                "the rollback record {} names a tree that is none of {}, {} and {}, so which \
                 holds the data to keep cannot be told: keep that one as the volume, move the \
                 others away, then remove the record",
                self.root.path().join(&names.rollback_id).display(),
                self.volume_path(pkg).display(),
                self.root.path().join(&names.rollback).display(),
                self.backup_path(pkg).display()
            ),
        ))
    }

    /// Sets or clears upstream's `<pkg>.install-fresh` marker (an empty
    /// regular file): an install with no volume before it, whose rollback
    /// deletes the volume it made. One atomic step each way.
    pub fn mark_fresh(&self, pkg: &PackageId, fresh: bool) -> Result<(), Error> {
        let names = Names::new(pkg)?;
        let _lock = self.lock(pkg)?;
        self.mark_fresh_locked(pkg, &names.fresh, fresh)
    }

    fn mark_fresh_locked(&self, pkg: &PackageId, name: &OsStr, fresh: bool) -> Result<(), Error> {
        let ctx = |_: &io::Error| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!(
                    "{} the fresh-install marker",
                    if fresh { "writing" } else { "removing" }
                )),
            )
        };
        match self.entry(name).with_ctx(ctx)? {
            Entry::Other(FileType::RegularFile) if !fresh => {
                sys::unlink_if_exists(self.root_fd(), name).with_ctx(ctx)?
            }
            Entry::Absent if fresh => sys::touch_at(self.root_fd(), name, 0o600).with_ctx(ctx)?,
            Entry::Absent | Entry::Other(FileType::RegularFile) => return Ok(()),
            Entry::Tree(_) | Entry::Other(_) => {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    format!(
                        "{} is not a regular file, so no fresh-install marker; move it away",
                        self.root.path().join(name).display()
                    ),
                ));
            }
        }
        self.fsync_root().with_ctx(ctx)
    }

    /// Whether upstream's `<pkg>.install-fresh` marker is there.
    pub fn is_fresh(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        self.exists_at(&names.fresh).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("looking for the fresh-install marker"),
            )
        })
    }

    /// Deletes the live volume `<pkg>` only, keeping its backup: what
    /// upstream's uninstall cleanup and fresh-install rollback ask of
    /// `delete_tree` on a volume root, after which a restore may still put
    /// the backup in. The volume is renamed to `<pkg>.replaced` first
    /// (garbage to recovery, which never touches the backup for it), then
    /// deleted: O(1) per subvolume. Returns whether there was a volume.
    /// Refuses while anything is mounted from inside it.
    pub fn discard_volume(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        if !self.any_name(pkg, &names)? {
            return Ok(false);
        }
        let _lock = self.lock(pkg)?;
        self.recover_locked(pkg, &names)?;
        if self.tree(pkg, &names.live)?.is_none() {
            return Ok(false);
        }
        self.ensure_not_mounted(pkg)?;
        sys::rename_noreplace(self.root_fd(), &names.live, &names.replaced)
            .and_then(|()| self.fsync_root())
            .with_ctx(|_| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context("moving the volume aside"),
                )
            })?;
        self.purge_locked(pkg, &names)?;
        tracing::info!(package = %pkg, "volume deleted, backup kept");
        Ok(true)
    }

    /// Every package with any entry under the root, sorted. A name too
    /// long to be a package's is reported (a warning naming it) and passed
    /// over: it blocks no other package.
    fn packages(&self) -> Result<Vec<PackageId>, Error> {
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.path().display()),
            )
        })?;
        let mut pkgs = Vec::new();
        for (name, _, _) in &entries {
            match layout::package_of(name) {
                Some(Ok(pkg)) => pkgs.push(pkg),
                Some(Err(e)) => tracing::warn!(
                    "skipped {}: not a package volume: {e}",
                    self.root.path().join(name).display()
                ),
                None => {}
            }
        }
        pkgs.sort();
        pkgs.dedup();
        Ok(pkgs)
    }

    /// Real space use of the package's volume and backup, read from their
    /// file extent items (no qgroups), with the figures compsize prints, and
    /// how the disk bytes split between the two. Read-only; waits for any
    /// operation running on the package.
    pub fn usage(&self, pkg: &PackageId) -> Result<VolumeUsage, Error> {
        let names = Names::new(pkg)?;
        let none = VolumeUsage {
            package: pkg.clone(),
            volume: None,
            backup: None,
            split: None,
        };
        if !self.any_name(pkg, &names)? {
            return Ok(none);
        }
        let _lock = self.lock_for_read(pkg)?;
        let measure = |name: &OsStr| -> Result<Option<(Usage, usage::ExtentSet)>, Error> {
            let io_ctx = |_: &io::Error| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context(format!(
                        "measuring {}",
                        self.root.path().join(name).display()
                    )),
                )
            };
            if self.tree(pkg, name)?.is_none() {
                return Ok(None);
            }
            if !self.root.is_btrfs() {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    "space accounting needs btrfs; the volumes root is not on btrfs",
                ));
            }
            let fd = sys::open_dir_at(self.root_fd(), name).with_ctx(io_ctx)?;
            usage::tree_usage(fd.as_fd()).map(Some).map_err(|e| {
                if crate::walk::is_crossing(&e) {
                    return Error::for_package(
                        pkg,
                        ErrorKind::InvalidRequest,
                        format!(
                            "measuring {}: {e}; a plain directory is measured by walking it",
                            self.root.path().join(name).display()
                        ),
                    );
                }
                let (kind, what) = io_ctx(&e);
                Error::new(eyre!(e).wrap_err(what), kind)
            })
        };
        let volume = measure(&names.live)?;
        let backup = measure(&names.backup)?;
        let split = match (&volume, &backup) {
            (Some((_, live)), Some((_, bak))) => Some(usage::split(live, bak)),
            (None, Some((_, bak))) => Some(usage::split(&usage::ExtentSet::default(), bak)),
            _ => None,
        };
        Ok(VolumeUsage {
            volume: volume.map(|(u, _)| u),
            backup: backup.map(|(u, _)| u),
            split,
            ..none
        })
    }

    /// How `pkg`'s volume and backup are stored, each `None` if absent. An
    /// entry under the package's name that is no directory is an error
    /// naming it. Reads two names; takes no lock.
    pub fn info(&self, pkg: &PackageId) -> Result<VolumeInfo, Error> {
        let names = Names::new(pkg)?;
        Ok(VolumeInfo {
            package: pkg.clone(),
            volume: self.tree(pkg, &names.live)?,
            backup: self.tree(pkg, &names.backup)?,
            leftovers: self.other_names(pkg, &names)?,
        })
    }

    /// The names of `pkg` present under the root beside its volume and
    /// backup (and the backup's read-only record), whatever they hold.
    fn other_names(&self, pkg: &PackageId, names: &Names) -> Result<Vec<String>, Error> {
        let mut out = Vec::new();
        let theirs = [&names.live, &names.backup, &names.backup_ro].map(|n| n.as_os_str());
        for name in names.all() {
            if theirs.contains(&name) {
                continue;
            }
            if self
                .exists_at(name)
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("looking for its names")))?
            {
                out.push(name.to_string_lossy().into_owned());
            }
        }
        Ok(out)
    }

    /// Every package with upstream's fresh-install marker.
    pub fn fresh_packages(&self) -> Result<Vec<PackageId>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            if self.is_fresh(&pkg)? {
                out.push(pkg);
            }
        }
        Ok(out)
    }

    /// Every package that has anything under the root, with how its volume
    /// and backup are stored and what else of it is there. An entry under a
    /// package's name that is no directory is no volume: it is skipped with
    /// a warning, and the listing goes on; so is an entry that cannot be
    /// read, with why.
    pub fn list(&self) -> Result<Vec<VolumeInfo>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            let Ok(names) = Names::new(&pkg) else {
                continue;
            };
            let tree = |name: &OsStr| match self.tree(&pkg, name) {
                Ok(kind) => kind,
                Err(e) => {
                    tracing::warn!("skipped: {e}");
                    None
                }
            };
            let volume = tree(&names.live);
            let backup = tree(&names.backup);
            let leftovers = self.other_names(&pkg, &names).unwrap_or_else(|e| {
                tracing::warn!("{e}");
                Vec::new()
            });
            if volume.is_some() || backup.is_some() || !leftovers.is_empty() {
                out.push(VolumeInfo {
                    package: pkg,
                    volume,
                    backup,
                    leftovers,
                });
            }
        }
        Ok(out)
    }
}

/// Removes the entry `name` of the directory open as `dir` and everything
/// below it, whatever it is: a subvolume tree in O(1) per subvolume
/// (read-only ones made writable first), a plain directory entry by entry
/// (nested subvolumes whole, immutable and append-only flags cleared), a
/// file or special file by unlink; absent is fine. Never follows a symlink.
/// Not atomic for a tree of several subvolumes or a plain directory: a
/// crash leaves part of it.
pub fn delete_tree_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match sys::stat_at(dir, name)? {
        None => Ok(()),
        Some(st) if st.is_dir() => {
            let fd = sys::open_dir_at(dir, name)?;
            if sys::mount_id(fd.as_fd())? != sys::mount_id(dir)? {
                return Err(crate::walk::crosses_mount(PathBuf::from(name)));
            }
            if sys::is_subvolume(fd.as_fd())? && sys::stat(dir)?.dev != st.dev {
                sys::make_tree_writable(fd.as_fd())?;
                drop(fd);
                failpoint("delete-entry.writable")?;
                sys::delete_subvolume(dir, name, true)
            } else {
                drop(fd);
                // Never follows a symlink; deletes nested subvolumes whole
                // (a package may have made one read-only) and clears
                // immutable and append-only flags (which a reflink copy
                // keeps): anything less would leave a transient name, and
                // every later recovery of the package, stuck.
                crate::copy::remove_tree_at(dir, name, &mut |_| Ok(()))
            }
        }
        Some(_) => sys::unlink_if_exists(dir, name),
    }
}

/// Deletes whatever is at `path`, as upstream's `util::btrfs::delete_tree`:
/// its parent is resolved as given (a trusted path), its last component
/// never followed; absent is fine.
///
/// A package's volume root (`<volumes root>/<pkg>`, the one place upstream
/// calls it) goes through [`VolumeStore::discard_volume`]: renamed aside
/// first, so a crash never leaves half a volume under its name, then
/// deleted in O(1) per subvolume, and its backup kept for the restore that
/// may follow. Anything else is deleted in place ([`delete_tree_at`]).
pub fn delete_tree(path: &Path) -> Result<(), Error> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(Error::new(
            eyre!("cannot delete {}: no parent directory", path.display()),
            ErrorKind::InvalidRequest,
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let pkg = name.to_str().and_then(|n| n.parse::<PackageId>().ok());
    if let Some(pkg) = pkg.filter(|p| layout::check_id_len(p).is_ok()) {
        return VolumeStore::open_without_recovery(parent)?
            .discard_volume(&pkg)
            .map(drop);
    }
    let dir = sys::open_dir_path(parent).with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            format!("opening {}", parent.display()),
        )
    })?;
    delete_tree_at(dir.as_fd(), name).with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            format!("deleting {}", path.display()),
        )
    })
}

/// How a rollback copy with the recorded identity `id` was made (see
/// [`VolumeStore::rollback_source`]).
fn copy_kind(id: &Identity) -> VolumeKind {
    match id {
        Identity::Subvolume(_) => VolumeKind::Subvolume,
        Identity::Directory { .. } => VolumeKind::Directory,
    }
}

/// The ids, in the snapshot open as `copy`, of the nested subvolumes whose
/// counterparts in `source` (the subvolume it was taken of) are read-only.
fn read_only_nested(source: BorrowedFd<'_>, copy: BorrowedFd<'_>) -> io::Result<BTreeSet<u64>> {
    let mut ids = BTreeSet::new();
    for (n, counterpart) in nested_counterparts(source, copy)? {
        if sys::is_read_only(sys::open_subvolume(source, n.id)?.as_fd())? {
            ids.insert(counterpart);
        }
    }
    Ok(ids)
}

/// Each subvolume nested in `source`, with the id of its counterpart in
/// `copy`, a recursive snapshot of it ([`sys::match_nested`]). A nested
/// subvolume the copy lacks is an error: the copy is not what it should be.
fn nested_counterparts(
    source: BorrowedFd<'_>,
    copy: BorrowedFd<'_>,
) -> io::Result<Vec<(sys::Nested, u64)>> {
    let sources = sys::nested_subvolumes(source)?;
    if sources.is_empty() {
        return Ok(Vec::new());
    }
    let copies = sys::nested_subvolumes(copy)?;
    let tops = (
        sys::subvolume_info(source)?.id,
        sys::subvolume_info(copy)?.id,
    );
    let found = sys::match_nested(&sources, tops.0, &copies, tops.1);
    sources
        .into_iter()
        .zip(found)
        .map(|(n, j)| match j {
            Some(j) => Ok((n, copies[j].id)),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the copy lacks the subvolume nested as {:?} in its source",
                    n.name
                ),
            )),
        })
        .collect()
}
