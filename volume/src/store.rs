//! The volume store: package volumes as btrfs subvolumes under one root.
//!
//! Layout, as upstream: `<root>/<pkg>/data/<volume-id>/`, and the install
//! backup at `<root>/<pkg>.install-backup`. On btrfs `<pkg>` is a subvolume and
//! the backup a read-only snapshot of it; every other name a package uses is
//! listed in [`crate::layout`].
//!
//! Every operation takes the package's lock, first finishes or undoes
//! whatever a crash left behind for that package ([`VolumeStore::recover`]),
//! then runs. At every instant, and after a crash at any point, `<pkg>` is
//! either the complete volume before the operation or the complete volume
//! after it, and `<pkg>.install-backup` is either absent or a complete backup.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use models::{Error, ErrorKind, PackageId, ResultExt, VolumeId};
use serde::Serialize;

use crate::failpoint::failpoint;
use crate::layout::{self, Names, ROLLBACK_MARKER};
use crate::lock::PackageLock;
use crate::mounts;
use crate::sys;
use crate::usage::{self, Split, Usage};

/// Default bound on the extent count of a plain (not yet converted) volume
/// directory for which a reflink backup is still taken. At the ~6.7 us per
/// extent measured for `cp --reflink`, 100k extents is well under a second.
pub const DEFAULT_REFLINK_EXTENT_LIMIT: u64 = 100_000;

/// How a package volume is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeKind {
    /// A btrfs subvolume: snapshots and deletes are O(1).
    Subvolume,
    /// A plain directory (not btrfs, or not yet converted by volume-migrate).
    Directory,
}

/// What [`VolumeStore::snapshot`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "outcome")]
pub enum SnapshotOutcome {
    /// A read-only subvolume snapshot, nested subvolumes included.
    Snapshot,
    /// A reflink copy of a plain directory on btrfs.
    ReflinkCopy {
        /// File extent items the copy had to clone.
        extents: u64,
    },
    /// No backup was taken; the install goes on without a rollback point.
    Skipped {
        /// Why, for the log and the user.
        reason: String,
    },
    /// The package has no volume yet (a fresh install): nothing to back up.
    NoVolume,
}

impl SnapshotOutcome {
    /// Whether a backup now exists, upstream's `bool`.
    pub fn created(&self) -> bool {
        matches!(
            self,
            SnapshotOutcome::Snapshot | SnapshotOutcome::ReflinkCopy { .. }
        )
    }
}

/// One package's entry in [`VolumeStore::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeInfo {
    /// The package.
    pub package: PackageId,
    /// How its live volume is stored; `None` if it has none.
    pub volume: Option<VolumeKind>,
    /// How its install backup is stored; `None` if it has none.
    pub backup: Option<VolumeKind>,
}

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

/// What [`VolumeStore::recover`] found and did for one package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// The package.
    pub package: PackageId,
    /// One line per action, in order.
    pub actions: Vec<String>,
    /// Why recovery failed, if it did ([`VolumeStore::recover_all`] only;
    /// [`VolumeStore::recover`] returns the error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Package volumes under one root directory (upstream:
/// `/media/startos/data/package-data/volumes`).
///
/// The root itself is trusted; everything inside a volume is not. All names
/// are resolved relative to the root's open file descriptor and never through
/// a symlink.
pub struct VolumeStore {
    root: PathBuf,
    dir: OwnedFd,
    btrfs: bool,
    reflink_extent_limit: u64,
}

/// Canonicalizes the volumes root and opens it, with the errors every
/// caller reports: `NotFound` if it does not exist, `InvalidRequest` if it
/// is not a directory (a symlink as the last component included).
pub fn open_root(root: impl AsRef<Path>) -> Result<(PathBuf, OwnedFd), Error> {
    let root = root.as_ref();
    let canonical = std::fs::canonicalize(root).with_ctx(|e| {
        let kind = if e.kind() == io::ErrorKind::NotFound {
            ErrorKind::NotFound
        } else {
            ErrorKind::Filesystem
        };
        (kind, format!("volumes root {}", root.display()))
    })?;
    let dir = sys::open_dir_path(&canonical).with_ctx(|_| {
        (
            ErrorKind::InvalidRequest,
            format!("volumes root {} is not a directory", canonical.display()),
        )
    })?;
    Ok((canonical, dir))
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
        let (root, dir) = open_root(root)?;
        let btrfs = sys::is_btrfs(dir.as_fd())
            .with_ctx(|_| (ErrorKind::Filesystem, format!("statfs {}", root.display())))?;
        Ok(VolumeStore {
            root,
            dir,
            btrfs,
            reflink_extent_limit: DEFAULT_REFLINK_EXTENT_LIMIT,
        })
    }

    /// Sets the extent bound above which a plain directory gets no reflink
    /// backup (see [`DEFAULT_REFLINK_EXTENT_LIMIT`]).
    pub fn with_reflink_extent_limit(mut self, limit: u64) -> Self {
        self.reflink_extent_limit = limit;
        self
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the root is on btrfs.
    pub fn is_btrfs(&self) -> bool {
        self.btrfs
    }

    /// `<root>/<pkg>`, the package's volume.
    pub fn volume_path(&self, pkg: &PackageId) -> PathBuf {
        self.root.join(pkg.as_str())
    }

    /// `<root>/<pkg>.install-backup`.
    pub fn backup_path(&self, pkg: &PackageId) -> PathBuf {
        self.root.join(&Names::new(pkg).backup)
    }

    /// `<root>/<pkg>/data/<volume>`, where the service sees its volume.
    pub fn data_dir(&self, pkg: &PackageId, volume: &VolumeId) -> PathBuf {
        self.volume_path(pkg).join("data").join(volume.as_str())
    }

    fn root_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    fn lock(&self, pkg: &PackageId, names: &Names) -> Result<PackageLock, Error> {
        PackageLock::acquire(self.root_fd(), &names.lock).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("taking the package lock"),
            )
        })
    }

    fn stat(&self, name: &OsStr) -> io::Result<Option<sys::Stat>> {
        sys::stat_at(self.root_fd(), name)
    }

    fn exists(&self, name: &OsStr) -> io::Result<bool> {
        Ok(self.stat(name)?.is_some())
    }

    /// How the entry `name` of the root is stored, if it is a directory.
    fn kind_of(&self, name: &OsStr) -> io::Result<Option<VolumeKind>> {
        match self.stat(name)? {
            None => Ok(None),
            Some(st) if !st.is_dir() => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a directory", Path::new(name).display()),
            )),
            Some(_) => {
                let fd = sys::open_dir_at(self.root_fd(), name)?;
                Ok(Some(if sys::is_subvolume(fd.as_fd())? {
                    VolumeKind::Subvolume
                } else {
                    VolumeKind::Directory
                }))
            }
        }
    }

    fn fsync_root(&self) -> io::Result<()> {
        sys::fsync(self.root_fd())
    }

    /// Refuses with a one-line error if anything is mounted from inside
    /// `<pkg>`: a bind mount would keep pointing at the old data.
    fn ensure_not_mounted(&self, pkg: &PackageId) -> Result<(), Error> {
        let path = self.volume_path(pkg);
        let busy = mounts::active_mounts_inside(&path).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading /proc/self/mountinfo"),
            )
        })?;
        if busy.is_empty() {
            Ok(())
        } else {
            Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "volume {} is in use, mounted at {}; stop the service first",
                    path.display(),
                    mounts::describe(&busy)
                ),
            ))
        }
    }

    /// Removes the entry `name` of the root and everything below it: a
    /// subvolume tree in O(1) per subvolume, a plain directory file by file.
    ///
    /// Only ever called on transient names, so a crash part-way leaves a
    /// partial tree under a name that recovery deletes again.
    fn delete_entry(&self, name: &OsStr) -> io::Result<()> {
        match self.stat(name)? {
            None => Ok(()),
            Some(st) if st.is_dir() => {
                let fd = sys::open_dir_at(self.root_fd(), name)?;
                if sys::is_subvolume(fd.as_fd())? {
                    sys::make_tree_writable(fd.as_fd())?;
                    drop(fd);
                    failpoint("delete-entry.writable");
                    sys::delete_subvolume(self.root_fd(), name, true)
                } else {
                    drop(fd);
                    // Never follows a symlink; deletes nested subvolumes
                    // whole (a package may have made one read-only) and
                    // clears immutable and append-only flags (which a reflink
                    // copy keeps): anything less would leave this transient
                    // name, and every later recovery of the package, stuck.
                    crate::copy::remove_tree_at(self.root_fd(), name, &mut |_| Ok(()))
                }
            }
            Some(_) => sys::unlink_if_exists(self.root_fd(), name),
        }
    }

    /// Creates `<pkg>` (a subvolume on btrfs, a directory elsewhere) and
    /// `data/<volume>` inside it for each volume. Idempotent: an existing
    /// volume, subvolume or plain directory, is kept as it is.
    ///
    /// Creating the subvolume is one atomic ioctl; a crash afterwards leaves
    /// some volume directories missing, which a rerun adds.
    pub fn create(&self, pkg: &PackageId, volumes: &[VolumeId]) -> Result<VolumeKind, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.recover_locked(pkg, &names)?;
        let kind = match self
            .kind_of(&names.live)
            .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("inspecting the volume")))?
        {
            Some(kind) => kind,
            None if self.btrfs => {
                sys::create_subvolume(self.root_fd(), &names.live).with_ctx(|_| {
                    (
                        ErrorKind::DiskManagement,
                        pkg.context(format!(
                            "creating subvolume {}",
                            self.volume_path(pkg).display()
                        )),
                    )
                })?;
                VolumeKind::Subvolume
            }
            None => {
                sys::mkdir_if_missing(self.root_fd(), &names.live, 0o755).with_ctx(|_| {
                    (
                        ErrorKind::Filesystem,
                        pkg.context(format!("creating {}", self.volume_path(pkg).display())),
                    )
                })?;
                VolumeKind::Directory
            }
        };
        let mk = || -> io::Result<()> {
            let live = sys::open_dir_at(self.root_fd(), &names.live)?;
            sys::mkdir_if_missing(live.as_fd(), OsStr::new("data"), 0o755)?;
            let data = sys::open_dir_at(live.as_fd(), OsStr::new("data"))?;
            for v in volumes {
                sys::mkdir_if_missing(data.as_fd(), OsStr::new(v.as_str()), 0o755)?;
            }
            sys::fsync(data.as_fd())?;
            sys::fsync(live.as_fd())?;
            self.fsync_root()
        };
        mk().with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!(
                    "creating volume directories in {}",
                    self.volume_path(pkg).join("data").display()
                )),
            )
        })?;
        tracing::info!(package = %pkg, ?kind, "volume ready");
        Ok(kind)
    }

    /// Takes the install backup `<pkg>.install-backup` of `<pkg>`.
    ///
    /// On btrfs with `<pkg>` a subvolume: a read-only snapshot, nested
    /// subvolumes included, in milliseconds whatever the fragmentation. It is
    /// built under `<pkg>.install-backup.tmp` and renamed into place only once
    /// complete and frozen, so a backup under its real name is never partial.
    ///
    /// Fallbacks, each with a warning naming the package: not btrfs, no
    /// backup; a plain directory on btrfs, a reflink copy if its extent count
    /// is within the configured bound, else no backup.
    ///
    /// Fails with `Incoherent` if a backup already exists: it belongs to an
    /// unfinished install that must be restored or dropped first, and
    /// replacing it could throw away the only good copy.
    pub fn snapshot(&self, pkg: &PackageId) -> Result<SnapshotOutcome, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.recover_locked(pkg, &names)?;
        let io_ctx = |what: &str| {
            let what = what.to_owned();
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let Some(kind) = self
            .kind_of(&names.live)
            .with_ctx(io_ctx("inspecting the volume"))?
        else {
            return Ok(SnapshotOutcome::NoVolume);
        };
        if self
            .exists(&names.backup)
            .with_ctx(io_ctx("looking for a backup"))?
        {
            return Err(Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "an install backup already exists at {}; restore or drop it first",
                    self.backup_path(pkg).display()
                ),
            ));
        }
        if !self.btrfs {
            let reason = "the volumes root is not on btrfs".to_owned();
            tracing::warn!(package = %pkg, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        match kind {
            VolumeKind::Subvolume => {
                let live = sys::open_dir_at(self.root_fd(), &names.live)
                    .with_ctx(io_ctx("opening the volume"))?;
                let tmp = sys::snapshot_tree(live.as_fd(), self.root_fd(), &names.backup_tmp)
                    .with_ctx(io_ctx(&format!(
                        "snapshotting {} to {}",
                        self.volume_path(pkg).display(),
                        self.root.join(&names.backup_tmp).display()
                    )))?;
                failpoint("snapshot.created");
                sys::make_tree_read_only(tmp.as_fd())
                    .with_ctx(io_ctx("making the snapshot read-only"))?;
                failpoint("snapshot.frozen");
                sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)
                    .with_ctx(io_ctx("renaming the snapshot into place"))?;
                self.fsync_root()
                    .with_ctx(io_ctx("syncing the volumes root"))?;
                tracing::info!(package = %pkg, "install backup snapshot taken");
                Ok(SnapshotOutcome::Snapshot)
            }
            VolumeKind::Directory => self.reflink_backup(pkg, &names),
        }
    }

    /// The fallback for a volume that is still a plain directory on btrfs.
    fn reflink_backup(&self, pkg: &PackageId, names: &Names) -> Result<SnapshotOutcome, Error> {
        let live = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("opening the volume")))?;
        let limit = self.reflink_extent_limit;
        // Data still in the page cache has no extents yet; BTRFS_IOC_SYNC
        // flushes it so the count sees what the copy will have to clone.
        sys::commit(live.as_fd()).with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context("flushing the volume"),
            )
        })?;
        let extents = crate::extents::count_tree_extents(live.as_fd(), limit).with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context("counting the extents of the volume"),
            )
        })?;
        if extents > limit {
            let reason = format!(
                "volume is a plain directory with more than {limit} extents \
                 (a reflink copy would take too long); convert it to a subvolume"
            );
            tracing::warn!(package = %pkg, extents, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        if let Err(e) = crate::copy::reflink_tree(live.as_fd(), self.root_fd(), &names.backup_tmp) {
            let cleanup = self.delete_entry(&names.backup_tmp);
            let reason = format!("reflink copy failed: {e}");
            tracing::warn!(package = %pkg, "no install backup: {reason}");
            cleanup.with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("removing the partial reflink copy"),
                )
            })?;
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        failpoint("snapshot.created");
        let publish = || -> io::Result<()> {
            // The copy's data must be durable before its name says "complete".
            sys::commit(self.root_fd())?;
            sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)?;
            self.fsync_root()
        };
        publish().with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("putting the reflink copy in place"),
            )
        })?;
        tracing::info!(package = %pkg, extents, "install backup reflink copy taken");
        Ok(SnapshotOutcome::ReflinkCopy { extents })
    }

    /// Rolls `<pkg>` back to its install backup, atomically, and removes the
    /// backup. Returns `false` (and changes nothing) if there is no backup.
    ///
    /// A writable snapshot of the backup is made under `<pkg>.rollback`,
    /// marked complete, and swapped with `<pkg>` by one renameat2
    /// RENAME_EXCHANGE; the replaced volume is then deleted. So `<pkg>` is
    /// never missing: before the exchange it is the current volume, after it
    /// the restored one, whatever instant a crash or power cut hits.
    ///
    /// Refuses while anything is mounted from inside `<pkg>`.
    pub fn restore(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
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
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.recover_locked(pkg, &names)?;
        self.restore_locked(pkg, &names)
    }

    /// Deletes the volume a restore replaced (`<pkg>.replaced`), if any:
    /// O(1) per subvolume plus the eviction of its cached pages.
    pub fn purge(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.purge_locked(pkg, &names)
    }

    fn purge_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx = |_: &io::Error| {
            (
                ErrorKind::DiskManagement,
                pkg.context("deleting the volume a restore replaced"),
            )
        };
        if !self.exists(&names.replaced).with_ctx(io_ctx)? {
            return Ok(false);
        }
        self.delete_entry(&names.replaced).with_ctx(io_ctx)?;
        failpoint("restore.replaced-deleted");
        Ok(true)
    }

    fn restore_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx =
            |what: String| move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what));
        let Some(backup_kind) = self
            .kind_of(&names.backup)
            .with_ctx(io_ctx("inspecting the backup".into()))?
        else {
            return Ok(false);
        };
        self.ensure_not_mounted(pkg)?;
        match backup_kind {
            VolumeKind::Subvolume => {
                let backup = sys::open_dir_at(self.root_fd(), &names.backup)
                    .with_ctx(io_ctx("opening the backup".into()))?;
                sys::snapshot_tree(backup.as_fd(), self.root_fd(), &names.rollback).with_ctx(
                    io_ctx(format!(
                        "snapshotting {} to {}",
                        self.backup_path(pkg).display(),
                        self.root.join(&names.rollback).display()
                    )),
                )?;
                failpoint("restore.copied");
                self.mark_complete(&names.rollback)
                    .with_ctx(io_ctx("marking the rollback copy complete".into()))?;
            }
            VolumeKind::Directory => {
                // A reflink backup is already a private copy: use it as is.
                self.mark_complete(&names.backup)
                    .with_ctx(io_ctx("marking the backup complete".into()))?;
                failpoint("restore.copied");
                sys::rename_noreplace(self.root_fd(), &names.backup, &names.rollback)
                    .and_then(|()| self.fsync_root())
                    .with_ctx(io_ctx("moving the backup aside".into()))?;
            }
        }
        failpoint("restore.marked");
        self.swap_in_rollback(names).with_ctx(io_ctx(format!(
            "exchanging {} with {}",
            self.root.join(&names.rollback).display(),
            self.volume_path(pkg).display()
        )))?;
        failpoint("restore.exchanged");
        self.finish_restore(pkg, names)?;
        tracing::info!(package = %pkg, "volume restored from install backup");
        Ok(true)
    }

    /// Creates the completion marker at the top of `name` and makes it and
    /// everything before it durable.
    ///
    /// The marker holds the directory's own access and modification times
    /// from before it was created, so the restore's last step can put them
    /// back: the restored volume is then identical to the backup, its top
    /// directory's mtime included.
    fn mark_complete(&self, name: &OsStr) -> io::Result<()> {
        let dir = sys::open_dir_at(self.root_fd(), name)?;
        let t = sys::times(dir.as_fd())?;
        let marker = sys::create_file_at(dir.as_fd(), OsStr::new(ROLLBACK_MARKER), 0o600)?;
        let record = format!(
            "{} {} {} {}\n",
            t.last_access.tv_sec,
            t.last_access.tv_nsec,
            t.last_modification.tv_sec,
            t.last_modification.tv_nsec
        );
        rustix::fs::ftruncate(&marker, 0)?;
        sys::write_all(marker.as_fd(), record.as_bytes())?;
        sys::fsync(marker.as_fd())?;
        // A reflink backup may keep the marker if a crash stops the restore
        // here; its times stay the backup's all the same.
        sys::set_times(dir.as_fd(), &t)?;
        sys::fsync(dir.as_fd())
    }

    /// The times [`VolumeStore::mark_complete`] recorded, if the marker
    /// holds them.
    fn marked_times(dir: BorrowedFd<'_>) -> io::Result<Option<rustix::fs::Timestamps>> {
        let Some(bytes) = sys::read_small_file_at(dir, OsStr::new(ROLLBACK_MARKER), 128)? else {
            return Ok(None);
        };
        let text = String::from_utf8_lossy(&bytes);
        let n: Vec<i64> = text
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let [a_sec, a_nsec, m_sec, m_nsec] = n[..] else {
            return Ok(None);
        };
        Ok(Some(rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: a_sec as _,
                tv_nsec: a_nsec as _,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: m_sec as _,
                tv_nsec: m_nsec as _,
            },
        }))
    }

    fn has_marker(&self, name: &OsStr) -> io::Result<bool> {
        match self.stat(name)? {
            Some(st) if st.is_dir() => {
                let dir = sys::open_dir_at(self.root_fd(), name)?;
                Ok(sys::stat_at(dir.as_fd(), OsStr::new(ROLLBACK_MARKER))?.is_some())
            }
            _ => Ok(false),
        }
    }

    /// The one step that changes what `<pkg>` is: exchange it with the
    /// complete rollback copy (or just rename the copy in if `<pkg>` is gone).
    fn swap_in_rollback(&self, names: &Names) -> io::Result<()> {
        if self.exists(&names.live)? {
            sys::rename_exchange(self.root_fd(), &names.rollback, &names.live)?;
        } else {
            sys::rename_noreplace(self.root_fd(), &names.rollback, &names.live)?;
        }
        self.fsync_root()
    }

    /// After the exchange: move the replaced volume (now `<pkg>.rollback`)
    /// aside to `<pkg>.replaced`, drop the backup, then remove the marker
    /// from `<pkg>`. Each step is idempotent, and the marker goes last so
    /// recovery can redo the rest.
    fn finish_restore(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        let set_aside = || -> io::Result<()> {
            if !self.exists(&names.rollback)? {
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
        failpoint("restore.replaced-moved");
        self.drop_locked(pkg, names)?;
        failpoint("restore.backup-dropped");
        let unmark = || -> io::Result<()> {
            let live = sys::open_dir_at(self.root_fd(), &names.live)?;
            let times = Self::marked_times(live.as_fd())?;
            sys::unlink_if_exists(live.as_fd(), OsStr::new(ROLLBACK_MARKER))?;
            if let Some(t) = times {
                sys::set_times(live.as_fd(), &t)?;
            }
            sys::fsync(live.as_fd())
        };
        unmark().with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("removing the rollback marker"),
            )
        })
    }

    /// Drops the install backup after a successful install: O(1), the
    /// kernel frees its extents in the background. Returns `false` if there
    /// was none.
    ///
    /// The backup is first renamed to `<pkg>.install-backup.drop`, so a crash
    /// during a multi-subvolume delete never leaves a half-deleted tree under
    /// the backup's name.
    pub fn drop_backup(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.recover_locked(pkg, &names)?;
        self.drop_locked(pkg, &names)
    }

    fn drop_locked(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        if !self
            .exists(&names.backup)
            .with_ctx(io_ctx("looking for the backup"))?
        {
            return Ok(false);
        }
        sys::rename_noreplace(self.root_fd(), &names.backup, &names.backup_drop)
            .and_then(|()| self.fsync_root())
            .with_ctx(io_ctx("moving the backup aside"))?;
        failpoint("drop.renamed");
        self.delete_entry(&names.backup_drop)
            .with_ctx(io_ctx("deleting the backup"))?;
        tracing::info!(package = %pkg, "install backup dropped");
        Ok(true)
    }

    /// Deletes the package's volume and its backup, on uninstall: O(1) per
    /// subvolume, nested subvolumes included. Returns `false` if there was
    /// nothing to delete. Refuses while anything is mounted from inside.
    ///
    /// `<pkg>` is renamed to `<pkg>.delete` first: after a crash the package
    /// either still has its whole volume or none, never a partial one.
    pub fn delete(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        self.recover_locked(pkg, &names)?;
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let mut deleted = false;
        if self
            .exists(&names.live)
            .with_ctx(io_ctx("looking for the volume"))?
        {
            self.ensure_not_mounted(pkg)?;
            sys::rename_noreplace(self.root_fd(), &names.live, &names.delete)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("moving the volume aside"))?;
            failpoint("delete.renamed");
            self.delete_entry(&names.delete)
                .with_ctx(io_ctx("deleting the volume"))?;
            deleted = true;
        }
        deleted |= self.drop_locked(pkg, &names)?;
        if deleted {
            tracing::info!(package = %pkg, "volume deleted");
        }
        Ok(deleted)
    }

    /// Finishes or undoes whatever a crash interrupted for `pkg`, from the
    /// names on disk alone. Idempotent; a no-op costing a few `fstatat`s when
    /// nothing is pending.
    pub fn recover(&self, pkg: &PackageId) -> Result<Recovery, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
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
            match self.recover(&pkg) {
                Ok(r) if r.actions.is_empty() => {}
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::error!(package = %pkg, "recovery failed: {e}");
                    out.push(Recovery {
                        package: pkg,
                        actions: Vec::new(),
                        error: Some(e.to_string()),
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
        // A backup that never got its real name is incomplete: discard it.
        if self
            .exists(&names.backup_tmp)
            .with_ctx(io_ctx("looking for a partial backup"))?
        {
            self.delete_entry(&names.backup_tmp)
                .with_ctx(io_ctx("deleting a partial backup"))?;
            actions.push("deleted an incomplete install backup".to_owned());
        }
        let mut restore_pending = self
            .has_marker(&names.live)
            .with_ctx(io_ctx("checking the volume for a rollback marker"))?;
        if self
            .exists(&names.rollback)
            .with_ctx(io_ctx("looking for a rollback"))?
        {
            if restore_pending {
                // Exchanged already: .rollback holds the replaced volume,
                // which finish_restore below moves aside.
            } else if self
                .has_marker(&names.rollback)
                .with_ctx(io_ctx("checking the rollback copy"))?
            {
                // The same rule as a restore: never swap a volume out from
                // under a bind mount of it.
                self.ensure_not_mounted(pkg)?;
                self.swap_in_rollback(names)
                    .with_ctx(io_ctx("swapping in the complete rollback copy"))?;
                actions.push("finished an interrupted restore (exchanged)".to_owned());
                restore_pending = true;
            } else {
                self.delete_entry(&names.rollback)
                    .with_ctx(io_ctx("deleting an incomplete rollback copy"))?;
                actions.push(
                    "undid an interrupted restore (incomplete copy deleted, backup kept)"
                        .to_owned(),
                );
            }
        }
        if restore_pending {
            self.finish_restore(pkg, names)?;
            actions.push("finished an interrupted restore".to_owned());
        }
        if self
            .exists(&names.backup_drop)
            .with_ctx(io_ctx("looking for a dropped backup"))?
        {
            self.delete_entry(&names.backup_drop)
                .with_ctx(io_ctx("deleting a dropped backup"))?;
            actions.push("finished dropping the install backup".to_owned());
        }
        if self.purge_locked(pkg, names)? {
            actions.push("deleted the volume a restore replaced".to_owned());
        }
        if self
            .exists(&names.delete)
            .with_ctx(io_ctx("looking for a deleted volume"))?
        {
            self.delete_entry(&names.delete)
                .with_ctx(io_ctx("deleting a removed volume"))?;
            actions.push("finished deleting the volume".to_owned());
        }
        for a in &actions {
            tracing::warn!(package = %pkg, "recovery: {a}");
        }
        Ok(Recovery {
            package: pkg.clone(),
            actions,
            error: None,
        })
    }

    /// Every package with any entry under the root, sorted.
    fn packages(&self) -> Result<Vec<PackageId>, Error> {
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.display()),
            )
        })?;
        let mut pkgs: Vec<PackageId> = entries
            .iter()
            .filter_map(|(name, _, _)| layout::package_of(name))
            .collect();
        pkgs.sort();
        pkgs.dedup();
        Ok(pkgs)
    }

    /// Real space use of the package's volume and backup, read from their
    /// file extent items (no qgroups), with the figures compsize prints, and
    /// how the disk bytes split between the two. Read-only; waits for any
    /// operation running on the package.
    pub fn usage(&self, pkg: &PackageId) -> Result<VolumeUsage, Error> {
        let names = Names::new(pkg);
        let _lock = self.lock(pkg, &names)?;
        let measure = |name: &OsStr| -> Result<Option<(Usage, usage::ExtentSet)>, Error> {
            let io_ctx = |_: &io::Error| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context(format!("measuring {}", self.root.join(name).display())),
                )
            };
            if !self.exists(name).with_ctx(io_ctx)? {
                return Ok(None);
            }
            if !self.btrfs {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    "space accounting needs btrfs; the volumes root is not on btrfs",
                ));
            }
            let fd = sys::open_dir_at(self.root_fd(), name).with_ctx(io_ctx)?;
            usage::tree_usage(fd.as_fd()).map(Some).with_ctx(io_ctx)
        };
        let volume = measure(&names.live)?;
        let backup = measure(&names.backup)?;
        let split = match (&volume, &backup) {
            (Some((_, live)), Some((_, bak))) => Some(usage::split(live, bak)),
            (None, Some((_, bak))) => Some(usage::split(&usage::ExtentSet::default(), bak)),
            _ => None,
        };
        Ok(VolumeUsage {
            package: pkg.clone(),
            volume: volume.map(|(u, _)| u),
            backup: backup.map(|(u, _)| u),
            split,
        })
    }

    /// Every package that has a volume or a backup, with how each is stored.
    pub fn list(&self) -> Result<Vec<VolumeInfo>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            let names = Names::new(&pkg);
            let kind = |name: &OsStr| {
                self.kind_of(name)
                    .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("inspecting")))
            };
            let volume = kind(&names.live)?;
            let backup = kind(&names.backup)?;
            if volume.is_some() || backup.is_some() {
                out.push(VolumeInfo {
                    package: pkg,
                    volume,
                    backup,
                });
            }
        }
        Ok(out)
    }
}
