//! What the store's operations report, on every platform (start-core's
//! `volume` module names these types on macOS too, where there is no store).

use std::path::{Path, PathBuf};

use models::PackageId;
use serde::{Serialize, Serializer};

/// How a package volume is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeKind {
    /// A btrfs subvolume: snapshots and deletes are O(1).
    Subvolume,
    /// A plain directory (not btrfs, or not yet converted by volume-migrate).
    Directory,
}

/// What `VolumeStore::create_outcome` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CreateOutcome {
    /// How the volume is stored.
    pub kind: VolumeKind,
    /// Whether it was there already (kept as it was, given only the volume
    /// directories it lacked), rather than made now.
    pub existed: bool,
}

/// What `VolumeStore::snapshot` did.
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

/// A process holding a mount of a tree the store took off a volume's name
/// (one `volume::mounts::MountUse`, as data), for a caller to restart it on
/// the volume now under that name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// The first process of the mount namespace holding the mount.
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`).
    pub command: String,
    /// Where the mount is, as the processes of that namespace see it (raw
    /// bytes; lossy in JSON).
    #[serde(serialize_with = "lossy")]
    pub mount_point: PathBuf,
    /// The mount namespace, by its inode number.
    pub namespace: u64,
    /// Whether that namespace is the calling process's own.
    pub own_namespace: bool,
}

/// A tree a restore replaced, or a delete removed, that a mount still held:
/// kept under the package's `<pkg>.held` (`volume::layout::HELD_SUFFIX`)
/// rather than deleted, until no mount holds it; then the package's next
/// operation, or the boot's recovery, moves it to the trash, where it is
/// deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeldTree {
    /// Where it is kept now (`<root>/<pkg>.held/<n>`).
    #[serde(serialize_with = "lossy")]
    pub path: PathBuf,
    /// Who holds it, one entry a mount.
    pub holders: Vec<Holder>,
}

/// What `VolumeStore::restore_outcome` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreOutcome {
    /// Whether the volume was restored (`false`: there was no backup).
    pub restored: bool,
    /// The replaced volume, if a mount held it: kept, not deleted. The
    /// processes named there still see the old volume, and need a restart
    /// to see the restored one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<HeldTree>,
    /// What failed after the exchange that restored the volume (the
    /// replaced volume's move aside or removal, the backup's), if anything:
    /// the volume is the restored one all the same, and the next operation
    /// of the package (its recovery) finishes what is left. `None` when the
    /// restore is complete, or did nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unfinished: Option<String>,
}

/// What `VolumeStore::delete_outcome` (or `purge_outcome`) did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeleteOutcome {
    /// Whether there was anything to delete.
    pub deleted: bool,
    /// The volume, if a mount held it: off the package's name (a new
    /// install gets a fresh volume), but kept until that mount is gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<HeldTree>,
}

fn lossy<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

/// One package's entry in `VolumeStore::list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeInfo {
    /// The package.
    pub package: PackageId,
    /// How its live volume is stored; `None` if it has none.
    pub volume: Option<VolumeKind>,
    /// How its install backup is stored; `None` if it has none.
    pub backup: Option<VolumeKind>,
    /// Its other names under the volumes root, whatever they hold: what an
    /// interrupted operation or a conversion run with `--keep-old` left,
    /// which an uninstall removes with the rest (the record of a backup's
    /// read-only nested subvolumes, part of the backup, is not one).
    /// A tree kept while mounted is listed as `<pkg>.held/<n>`.
    pub leftovers: Vec<String>,
}

/// What `VolumeStore::recover` found and did for one package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// The package.
    pub package: PackageId,
    /// One line per action, in order.
    pub actions: Vec<String>,
    /// Why recovery failed, if it did (`VolumeStore::recover_all` only;
    /// `VolumeStore::recover` returns the error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Whether it failed because another process held the package's lock
    /// past the store's patience (the error names the holder).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub busy: bool,
}
