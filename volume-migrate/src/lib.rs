//! One-time conversion of plain package volume directories into btrfs
//! subvolumes, at boot: resumable, lossless, with progress.
//!
//! After the ext4-to-btrfs conversion every `<root>/<pkg>` is a plain
//! directory on the top-level subvolume, so its install backup is an
//! O(extents) reflink copy. [`Migrator::convert`] turns one such directory
//! into a subvolume, after which backups are O(1) snapshots. It has two
//! methods ([`Method`]); [`Method::Auto`] snapshots the parent for every
//! package it can, so that every file keeps its inode number and birth
//! time, and clones the others.
//!
//! **Clone**, O(the package's extents and entries):
//!
//! 0. **Scan**: count entries, bytes and extents (progress totals and the
//!    free-space check), on a second thread, beside the clone.
//! 1. **Clone**: create the subvolume `<pkg>.migrate` beside it and reflink
//!    every entry into it ([`volume::copy::reflink_into`]: FICLONERANGE in
//!    offset-ordered chunks, never a byte copy; every attribute kept, nested
//!    subvolumes recreated as subvolumes).
//!
//! **Snapshot the parent**, O(the package's top entries) before the
//! exchange, whatever the package holds below them, plus O(everything else
//! in the subvolume holding the volumes root) afterwards, in the
//! background; every file keeps its inode number, birth time and
//! attributes:
//!
//! 0. **Decide**: whether a snapshot can serve the package, and count the
//!    rest of the subvolume outside the packages, once per run
//!    ([`Decision`]; the rule is in the `decide` module).
//! 1. **Carve**: snapshot that subvolume as `<pkg>.migrate-parent` (O(1))
//!    and cut the snapshot down to `<pkg>`'s contents: the very same inodes,
//!    nothing copied. With [`MigrateOptions::defer_cut`] (a boot's run), the
//!    rest is only set aside in one directory, recorded as
//!    `<pkg>.migrate-rest`, and removed with the old trees.
//!
//! A run ([`Migrator::schedule`], [`Migrator::run`]) snapshots the parent for
//! every package it can, first, and clones the others.
//!
//! Then, for both:
//!
//! 2. **Sync**: the qgroup limit and groups of the subvolume the
//!    directory sat in given to the new one, with quotas on
//!    (`volume::quota`). Nothing is committed: neither method writes file
//!    data (a clone only shares extents), so everything either changed is
//!    metadata committed with the exchange or before it, in order
//!    (`Job::swap_in`).
//! 3. **Exchange**: swap it and `<pkg>` with one
//!    `renameat2(RENAME_EXCHANGE)`, committed, then rename the old
//!    directory to `<pkg>.migrate-old`.
//! 4. **RemoveOld** ([`Migrator::remove_old`]), a separate call that can run
//!    after services start: remove a deferred cut's rest from the new
//!    subvolume, then unlink the old directory, O(their extents).
//!
//! ## Crash safety
//!
//! At every instant `<pkg>` is either the complete original directory or the
//! complete, durable subvolume. The next run tells from names and types alone
//! how far a crashed run got: a *subvolume* `<pkg>.migrate` beside a plain
//! `<pkg>` is a partial copy, resumed (files continue from their destination
//! size, aligned down to the block size; entries whose source changed since
//! the partial copy was started are copied again, told by the transaction
//! that last wrote each source inode against the one that created the
//! copy, never by a clock; a resume that meets a file no clone can copy
//! removes the copy, so none is resumed twice for it); a *subvolume*
//! `<pkg>.migrate-parent` is a cut
//! that did not finish, deleted in O(1) with its record `<pkg>.migrate-rest`
//! (a new snapshot costs nothing); a *plain directory* under either name
//! beside a subvolume `<pkg>` is the old directory after the exchange;
//! anything named `<pkg>.migrate-old` is garbage, and so is the directory a
//! `<pkg>.migrate-rest` beside the subvolume `<pkg>` names (by name and
//! identity, in `<pkg>`). A run killed between packages resumes with the
//! next: a converted package is a subvolume, which nothing converts again. Every step takes the package's volume lock
//! ([`volume::lock::PackageLock`]), so it never interleaves with a
//! [`volume::VolumeStore`] operation on the same package.
//!
//! ## Progress and upstream's `FullProgressTracker`
//!
//! Every report carries the [`Phase`], bytes, extents and entries done and
//! total, and an ETA. In start-core's `cleanup_and_initialize`, one
//! `FullProgressTracker::add_phase("Converting volumes", weight)` per run fits:
//! give it `Some(weight)` proportional to [`Estimate::work`] summed over the
//! [`Migrator::plan`] (extents dominate the cost, entries add a little), then
//! forward each [`Progress`] as `phase.set_total(total work)` and
//! `phase.set_done(work done)` ([`Progress::work_done`], [`Progress::work_total`]),
//! adding the previous packages' totals. The removal of old directories
//! belongs to a second phase added after services start (or a background
//! task), with `entries_done`/`entries_total` as its units.

#[cfg(target_os = "linux")]
mod carve;
#[cfg(target_os = "linux")]
mod cleanup;
#[cfg(target_os = "linux")]
mod convert;
pub mod cost;
#[cfg(target_os = "linux")]
mod decide;
#[cfg(target_os = "linux")]
mod errors;
#[cfg(target_os = "linux")]
mod job;
#[cfg(target_os = "linux")]
mod migrate;
#[cfg(target_os = "linux")]
mod options;
#[cfg(target_os = "linux")]
mod parent_plan;
#[cfg(target_os = "linux")]
mod plan;
#[cfg(target_os = "linux")]
mod pool;
#[cfg(target_os = "linux")]
mod report;
#[cfg(target_os = "linux")]
mod rest;
#[cfg(target_os = "linux")]
mod run;
#[cfg(target_os = "linux")]
mod scan;
#[cfg(target_os = "linux")]
mod shed;
#[cfg(target_os = "linux")]
mod split;
#[cfg(target_os = "linux")]
mod state;
#[cfg(target_os = "linux")]
mod track;

#[cfg(target_os = "linux")]
pub use decide::{CloneReason, Decision, REST_MAX_US};
#[cfg(target_os = "linux")]
pub use migrate::Migrator;
#[cfg(target_os = "linux")]
pub use options::{
    DEFAULT_CHUNK_BYTES, MAX_RESERVE_BYTES, MIN_RESERVE_BYTES, MetadataRoom, MigrateOptions,
    default_reserve,
};
#[cfg(target_os = "linux")]
pub use pool::{Converted, DESCRIPTORS_EACH, WORKERS};
#[cfg(target_os = "linux")]
pub use report::{Outcome, PackageReport, Planned, ReportError, ShareUse, Skipped};
#[cfg(target_os = "linux")]
pub use split::{HEAVY_US, LIGHT_US, ORDER_US, PARENT_SNAPSHOTS_MAX, SPLIT_DIR, SPLIT_MIN, Share};

use std::time::Duration;

use models::PackageId;
use serde::Serialize;

/// A step of one package's conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The checks before a conversion; for a clone (or a count of the
    /// rest a forced cut makes), flushing the plain directory first, and
    /// for a clone starting the count of its entries, bytes and extents
    /// (which goes on beside the clone).
    Scan,
    /// Reflinking the contents into the new subvolume ([`Method::Clone`]).
    Clone,
    /// Snapshotting the parent subvolume and cutting the snapshot down to
    /// the package ([`Method::SnapshotParent`]).
    Carve,
    /// Making the new subvolume durable (a btrfs commit).
    Sync,
    /// Swapping the new subvolume in (renameat2 RENAME_EXCHANGE).
    Exchange,
    /// Unlinking the old plain directory.
    RemoveOld,
    /// This package is finished.
    Done,
}

/// How a plain directory becomes a subvolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// [`Method::SnapshotParent`] where it applies, by the rule of the
    /// crate's `decide` module; otherwise [`Method::Clone`].
    #[default]
    Auto,
    /// Reflink every entry into a new subvolume: O(extents and entries of
    /// the package), resumable after a crash where it stopped.
    Clone,
    /// Snapshot the subvolume holding the volumes root and cut the snapshot
    /// down to the package (the crate's `carve` module): O(everything else in that
    /// subvolume, plus the package's top entries), whatever the package
    /// holds below them. Needs the subvolume's root reachable from the
    /// volumes root's mount, nothing mounted below it, no subvolume nested
    /// in the package, and no NOCOW or preallocated file beside it. Never
    /// resumed: an interrupted one is deleted (O(1)) and started over.
    ///
    /// The package's own NOCOW and preallocated files are then copied on
    /// their next write, once per extent, as after any snapshot of the
    /// volume (the backup before every update does the same); a clone
    /// leaves them writable in place once the old directory is removed.
    SnapshotParent,
}

/// One progress report for one package. Figures cover the whole package,
/// including what an earlier, interrupted run already did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// The package.
    pub package: PackageId,
    /// What it is doing.
    pub phase: Phase,
    /// Whether the `*_total` figures are known. The scan that counts them
    /// runs beside the clone, so early [`Phase::Clone`] reports have totals
    /// of 0 (and no ETA); the done figures are right throughout.
    pub totals_known: bool,
    /// File bytes in place in the new subvolume.
    pub bytes_done: u64,
    /// File bytes to put there (each inode once).
    pub bytes_total: u64,
    /// File extent items in place (exact per finished file, proportional to
    /// bytes within the file being cloned).
    pub extents_done: u64,
    /// File extent items of the directory, from the scan (0 until
    /// `totals_known`).
    pub extents_total: u64,
    /// Entries done (copied, or removed in [`Phase::RemoveOld`]).
    pub entries_done: u64,
    /// Entries in the tree (each name once).
    pub entries_total: u64,
    /// Estimated time left for this package, once the totals are known and
    /// there is a rate to go by.
    #[serde(serialize_with = "ser_secs")]
    pub eta: Option<Duration>,
}

fn ser_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl Progress {
    /// Work done in the units of [`Estimate::work`]: extents plus entries.
    pub fn work_done(&self) -> u64 {
        self.extents_done + self.entries_done
    }

    /// Total work in the units of [`Estimate::work`].
    pub fn work_total(&self) -> u64 {
        self.extents_total + self.entries_total
    }
}

/// Receives progress reports. Called from the converting thread, at most
/// about ten times a second per package plus once per phase change: keep it
/// cheap. Any `FnMut(&Progress)` is one.
pub trait ProgressSink {
    /// One report.
    fn progress(&mut self, p: &Progress);
}

impl<F: FnMut(&Progress)> ProgressSink for F {
    fn progress(&mut self, p: &Progress) {
        self(p)
    }
}

/// What converting a plain directory costs, from one scan of it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Estimate {
    /// Entries of every type (each name once), the top excluded.
    pub entries: u64,
    /// Regular files (inodes).
    pub files: u64,
    /// File bytes (each inode once).
    pub bytes: u64,
    /// File extent items: what a reflink copy's cost is proportional to.
    pub extents: u64,
    /// Nested subvolumes (recreated as subvolumes).
    pub nested_subvolumes: u64,
}

impl Estimate {
    /// Units of work: extents plus entries.
    pub fn work(&self) -> u64 {
        self.extents + self.entries
    }

    /// A clone's expected duration, by the per-entry and per-extent costs
    /// measured in [`cost`].
    pub fn duration(&self) -> Duration {
        cost::Cost::clone_of(self, true).duration()
    }

    /// The sum of two counts.
    pub fn plus(&self, other: &Estimate) -> Estimate {
        Estimate {
            entries: self.entries.saturating_add(other.entries),
            files: self.files.saturating_add(other.files),
            bytes: self.bytes.saturating_add(other.bytes),
            extents: self.extents.saturating_add(other.extents),
            nested_subvolumes: self
                .nested_subvolumes
                .saturating_add(other.nested_subvolumes),
        }
    }

    /// The new metadata a conversion is expected to write: 128 bytes per
    /// extent item plus 1 KiB per entry (a reflink shares the data). What
    /// [`Migrator::convert`] checks against the free metadata space, with
    /// the reserve on top.
    pub fn metadata_bytes(&self) -> u64 {
        self.extents
            .saturating_mul(128)
            .saturating_add(self.entries.saturating_mul(1024))
    }
}
