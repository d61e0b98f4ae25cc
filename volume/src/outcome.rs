//! What the store's operations report, on every platform (start-core's
//! `volume` module names these types on macOS too, where there is no store).

use models::PackageId;
use serde::Serialize;

/// How a package volume is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeKind {
    /// A btrfs subvolume: snapshots and deletes are O(1).
    Subvolume,
    /// A plain directory (not btrfs, or not yet converted by volume-migrate).
    Directory,
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
