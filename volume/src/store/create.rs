//! Making a package's volume: [`VolumeStore::ensure`] (upstream's
//! `ensure_volume_root`), [`VolumeStore::create`] with its volume
//! directories, and [`VolumeStore::sync_volume`].
//!
//! A new volume is built whole under `<pkg>.create` and renamed to `<pkg>`
//! in one step, so `<pkg>` is never a half-made volume; a `.create` a crash
//! left is garbage to recovery.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use models::{Error, ErrorKind, PackageId, ResultExt, VolumeId};

use super::{VolumeStore, with_cleanup};
use crate::failpoint::failpoint;
use crate::layout::Names;
use crate::outcome::{CreateOutcome, VolumeKind};
use crate::sys;

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

/// Refuses the first of `data` and `data/<volume>` for each of `volumes`,
/// below the tree open as `top`, that exists and is no directory, before
/// anything is made: bad input changes nothing.
fn refuse_non_directories(top: BorrowedFd<'_>, volumes: &[VolumeId]) -> Result<(), MakeFailed> {
    let not_dir = |dir: BorrowedFd<'_>, name: &str| -> io::Result<bool> {
        let st = sys::stat_at(dir, OsStr::new(name))?;
        Ok(st.is_some_and(|st| st.file_type != sys::FileType::Directory))
    };
    if not_dir(top, "data")? {
        return Err(MakeFailed::NotADirectory("data".to_owned()));
    }
    let data = match sys::open_dir_at(top, OsStr::new("data")) {
        Ok(data) => data,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(MakeFailed::Io(e)),
    };
    for v in volumes {
        if not_dir(data.as_fd(), v.as_str())? {
            return Err(MakeFailed::NotADirectory(format!("data/{v}")));
        }
    }
    Ok(())
}

impl VolumeStore {
    /// Makes sure `<pkg>` exists, creating it empty if missing: a subvolume
    /// on btrfs, a directory elsewhere (upstream's `ensure_volume_root`).
    /// An existing volume, subvolume or plain directory, is kept as it is.
    /// A missing volume beside an install backup is not made empty: the
    /// backup is the only copy of the data, and is put back as the volume
    /// (as [`VolumeStore::begin_install`] does), since an empty volume
    /// beside it would make the next install's `begin` drop it.
    /// Finishes whatever a crash left for the package first. One atomic
    /// step: after a crash `<pkg>` is absent or empty.
    ///
    /// A volume that is there with nothing pending is returned without the
    /// package's lock: a service load must not wait for whoever holds it
    /// (the cleanup after a conversion, a backup of the package). Nothing
    /// pending means no name exists that recovery acts on or that an
    /// operation in flight makes (`.install-backup.tmp`, `.rollback`,
    /// `.delete`, upstream's `.restore-old`, a conversion's `.migrate`,
    /// ...), nor a writable backup; the garbage the cleanup removes
    /// meanwhile (`.migrate-old`, a deferred cut's rest) does not count,
    /// nor does what is kept for the operator. That is read
    /// without the lock, name by name, and still sound: the store's
    /// operations change `<pkg>` only by atomic renames and exchanges, so
    /// at every instant `<pkg>`, if there, is a complete volume; an
    /// operation in flight that has made none of its names yet has changed
    /// nothing, and one that has made them forces the slow way, which waits
    /// for it and recovers what a crash left.
    pub fn ensure(&self, pkg: &PackageId) -> Result<VolumeKind, Error> {
        let names = Names::new(pkg)?;
        if !self.may_need_recovery(pkg, &names)?
            && let super::Entry::Tree(kind) = self.entry(&names.live).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context(format!("inspecting {}", self.volume_path(pkg).display())),
                )
            })?
        {
            return Ok(kind);
        }
        let held = self.hold_recovered(pkg, names)?;
        self.ensure_locked(pkg, &held.names)
    }

    /// [`VolumeStore::ensure`] under the lock.
    fn ensure_locked(&self, pkg: &PackageId, names: &Names) -> Result<VolumeKind, Error> {
        if let Some(kind) = self.tree(pkg, &names.live)? {
            return Ok(kind);
        }
        if self.restore_locked(pkg, names)? {
            self.purge_locked(pkg, names)?;
            tracing::warn!(package = %pkg, "ensure: no volume, but an install backup, the only copy of the data; put it back as the volume");
            if let Some(kind) = self.tree(pkg, &names.live)? {
                return Ok(kind);
            }
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
        self.create_outcome(pkg, volumes).map(|o| o.kind)
    }

    /// [`VolumeStore::create`], saying also whether the volume was there
    /// already (decided under the package's lock).
    pub fn create_outcome(
        &self,
        pkg: &PackageId,
        volumes: &[VolumeId],
    ) -> Result<CreateOutcome, Error> {
        let held = self.hold_recovered(pkg, Names::new(pkg)?)?;
        let names = &held.names;
        if let Some(kind) = self.tree(pkg, &names.live)? {
            self.make_volume_dirs(pkg, &names.live, volumes)?;
            return Ok(CreateOutcome {
                kind,
                existed: true,
            });
        }
        let kind = self.make_tree(pkg, &names.create)?;
        let made = self
            .make_volume_dirs(pkg, &names.create, volumes)
            .and_then(|()| {
                failpoint("create.made")
                    .and_then(|()| {
                        sys::rename_noreplace(self.root_fd(), &names.create, &names.live)
                    })
                    .and_then(|()| self.commit_root())
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
        Ok(CreateOutcome {
            kind,
            existed: false,
        })
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
            refuse_non_directories(top.as_fd(), volumes)?;
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
}
