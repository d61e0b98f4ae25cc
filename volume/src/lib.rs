//! StartOS package volumes as btrfs subvolumes.
//!
//! Each package's volume `<root>/<pkg>` is a btrfs subvolume, so the backup
//! taken before an update is a read-only snapshot (milliseconds whatever the
//! fragmentation), a rollback is one atomic `renameat2(RENAME_EXCHANGE)`, and
//! dropping a backup or deleting a volume is O(1). Where the filesystem is not
//! btrfs, or a volume is still a plain directory, it falls back as upstream
//! does, with a warning.
//!
//! [`VolumeStore`] is the API; the free functions keep the names and
//! signatures start-core calls (`snapshot_volumes_for_install`,
//! `restore_volumes_from_install_backup`, `remove_install_backup`,
//! `data_dir`, `PKG_VOLUME_DIR`) so the crate drops in.

use std::path::{Path, PathBuf};

pub use models::{Error, ErrorKind, PackageId, VolumeId};

#[cfg(target_os = "linux")]
pub mod carve;
#[cfg(target_os = "linux")]
pub mod copy;
#[cfg(target_os = "linux")]
pub mod extents;
pub mod failpoint;
#[cfg(target_os = "linux")]
pub mod layout;
#[cfg(target_os = "linux")]
pub mod lock;
#[cfg(target_os = "linux")]
pub mod mounts;
#[cfg(target_os = "linux")]
mod record;
#[cfg(target_os = "linux")]
mod store;
#[cfg(target_os = "linux")]
pub mod sweep;
#[cfg(target_os = "linux")]
pub mod sys;
#[cfg(target_os = "linux")]
pub mod usage;
#[cfg(target_os = "linux")]
pub mod walk;

pub use failpoint::FAILPOINT_ENV;
#[cfg(target_os = "linux")]
pub use layout::INSTALL_BACKUP_SUFFIX;
#[cfg(target_os = "linux")]
pub use mounts::MountUse;
#[cfg(target_os = "linux")]
pub use store::{
    DEFAULT_REFLINK_EXTENT_LIMIT, Recovery, SnapshotOutcome, VolumeInfo, VolumeKind, VolumeStore,
    VolumeUsage, open_locks, open_root,
};

/// Upstream's data directory.
pub const DATA_DIR: &str = "/media/startos/data";
/// Package volumes, relative to [`DATA_DIR`].
pub const PKG_VOLUME_DIR: &str = "package-data/volumes";

/// `<datadir>/package-data/volumes/<pkg>/data/<volume>`, as upstream.
pub fn data_dir<P: AsRef<Path>>(datadir: P, pkg_id: &PackageId, volume_id: &VolumeId) -> PathBuf {
    datadir
        .as_ref()
        .join(PKG_VOLUME_DIR)
        .join(pkg_id.as_str())
        .join("data")
        .join(volume_id.as_str())
}

/// The volumes root on a StartOS server.
pub fn default_root() -> PathBuf {
    Path::new(DATA_DIR).join(PKG_VOLUME_DIR)
}

/// Runs a blocking store operation off the async runtime.
///
/// The drop-in functions open the store without the all-package recovery
/// pass: each operation recovers its own package under its own lock, so an
/// update of one package never waits on another package's lock. The full pass
/// belongs at boot ([`VolumeStore::open`]).
#[cfg(target_os = "linux")]
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(e, ErrorKind::Unknown))?
}

/// Drop-in for start-core: takes the install backup of `pkg_id` under the
/// default root. `true` if a backup now exists; `false` for a fresh install,
/// a non-btrfs filesystem or a volume too fragmented to reflink (each logged).
/// See [`VolumeStore::snapshot`].
#[cfg(target_os = "linux")]
#[tracing::instrument(skip_all, fields(package = %pkg_id))]
pub async fn snapshot_volumes_for_install(pkg_id: &PackageId) -> Result<bool, Error> {
    let pkg = pkg_id.clone();
    blocking(move || {
        Ok(VolumeStore::open_without_recovery(default_root())?
            .snapshot(&pkg)?
            .created())
    })
    .await
}

/// Drop-in for start-core: atomically rolls `pkg_id` back to its install
/// backup; no-op without one. See [`VolumeStore::restore`].
#[cfg(target_os = "linux")]
#[tracing::instrument(skip_all, fields(package = %pkg_id))]
pub async fn restore_volumes_from_install_backup(pkg_id: &PackageId) -> Result<(), Error> {
    let pkg = pkg_id.clone();
    blocking(move || {
        VolumeStore::open_without_recovery(default_root())?
            .restore(&pkg)
            .map(drop)
    })
    .await
}

/// Drop-in for start-core: drops the install backup in O(1). See
/// [`VolumeStore::drop_backup`].
#[cfg(target_os = "linux")]
#[tracing::instrument(skip_all, fields(package = %pkg_id))]
pub async fn remove_install_backup(pkg_id: &PackageId) -> Result<(), Error> {
    let pkg = pkg_id.clone();
    blocking(move || {
        VolumeStore::open_without_recovery(default_root())?
            .drop_backup(&pkg)
            .map(drop)
    })
    .await
}
