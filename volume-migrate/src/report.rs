//! What a run reports: per package, what happened ([`PackageReport`]) and
//! what is planned ([`Planned`]).

use std::time::Duration;

use models::{Error, PackageId};
use serde::Serialize;

use crate::cost::Cost;
use crate::decide::{CloneReason, Decision};
use crate::split::Share;
use crate::{Estimate, Method};

/// What happened to one package.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Converted now (possibly resuming an interrupted run).
    Converted,
    /// An earlier run had already swapped the subvolume in; only its
    /// bookkeeping (renaming the old directory aside) was left.
    Finished,
    /// Already a subvolume: nothing to do.
    AlreadySubvolume,
    /// Dry run: would be converted.
    WouldConvert,
    /// Failed; see [`PackageReport::error`]. `<pkg>` is untouched.
    Failed,
}

/// An error, flattened for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReportError {
    /// Upstream's numeric [`models::ErrorKind`] code.
    pub code: i32,
    /// The kind's title.
    pub kind: String,
    /// One line naming the package and path.
    pub message: String,
}

impl From<&Error> for ReportError {
    fn from(e: &Error) -> Self {
        ReportError {
            code: e.kind.code(),
            kind: e.kind.as_str().to_owned(),
            message: e.to_string(),
        }
    }
}

/// An entry under the volumes root that a run passes over
/// ([`crate::Migrator::skipped`]): left as it is, converted by nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Its name in the root (lossy where it is not UTF-8): the package it
    /// is named as, or a name no package id fits.
    pub name: String,
    /// Its path.
    pub path: std::path::PathBuf,
    /// Why it is no package volume.
    pub why: String,
}

/// Where the snapshot of a package placed below a share was taken
/// ([`PackageReport::share`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShareUse {
    /// Of its share (the `split` module), by that id.
    Taken(String),
    /// Of the parent, as below [`crate::SPLIT_MIN`]: its share could not be
    /// made, or something beneath its directory was written after the
    /// share's snapshot (or that could not be checked); why.
    Parent(String),
}

/// The result of converting one package ([`crate::Migrator::convert`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PackageReport {
    /// The package.
    pub package: PackageId,
    /// What happened.
    pub outcome: Outcome,
    /// The scan of the plain directory, when there was one to scan.
    pub estimate: Option<Estimate>,
    /// How it was converted, when it was now.
    pub method: Option<Method>,
    /// How it was converted and why, when it was now: what a dry run's
    /// [`Planned::decision`] says unless the conversion fell back
    /// ([`PackageReport::fallback`]).
    pub decision: Option<Decision>,
    /// Why it was cloned although its schedule said to snapshot the
    /// parent (checked again just before the cut, or the cut failed and its
    /// snapshot was deleted): the difference between the dry run and the
    /// run, which every report shows, never only a log line.
    pub fallback: Option<CloneReason>,
    /// In a run with shares, for a package its schedule placed below one:
    /// whether its volume is a snapshot of its share, or why the parent
    /// was snapshotted instead (every report shows it, as for
    /// [`PackageReport::fallback`]).
    pub share: Option<ShareUse>,
    /// Whether an interrupted earlier run's partial copy was reused.
    pub resumed: bool,
    /// Bytes cloned by this run (a resumed run skips what was in place).
    pub bytes_cloned: u64,
    /// Entries an earlier run had already copied and this one kept.
    pub entries_reused: u64,
    /// NOCOW files the clone copied; with a deferred cut, their old copies
    /// were removed before the package was reported done (see
    /// [`crate::MigrateOptions::defer_cut`]).
    pub nocow_files: u64,
    /// Whether this call removed old trees of the package (else any
    /// `<pkg>.migrate-old` remains for [`crate::Migrator::remove_old`]);
    /// false where there were none to remove.
    pub old_removed: bool,
    /// Wall time of this call.
    #[serde(serialize_with = "ser_ms")]
    pub elapsed: Duration,
    /// For [`Outcome::Failed`].
    pub error: Option<ReportError>,
}

impl PackageReport {
    /// `package` with `outcome`, nothing done yet.
    pub(crate) fn new(package: PackageId, outcome: Outcome) -> PackageReport {
        PackageReport {
            package,
            outcome,
            estimate: None,
            method: None,
            decision: None,
            fallback: None,
            share: None,
            resumed: false,
            bytes_cloned: 0,
            entries_reused: 0,
            nocow_files: 0,
            old_removed: false,
            elapsed: Duration::ZERO,
            error: None,
        }
    }

    /// `package` failed with `error` after `elapsed`.
    pub(crate) fn failed(package: PackageId, elapsed: Duration, error: &Error) -> PackageReport {
        PackageReport {
            elapsed,
            error: Some(ReportError::from(error)),
            ..PackageReport::new(package, Outcome::Failed)
        }
    }
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// One package of a run, before it is converted
/// ([`crate::Migrator::schedule`], or [`crate::Migrator::plan`] for a dry
/// run).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Planned {
    /// The package.
    pub package: PackageId,
    /// For a plain directory, how it is to be converted and why; `None`
    /// when only leftovers of an interrupted run remain (finishing them is
    /// cheap, except removing old trees).
    pub decision: Option<Decision>,
    /// What cloning it costs, as far as deciding counted.
    pub clone: Option<Cost>,
    /// What cutting a snapshot of its parent down to it costs, as far as
    /// deciding counted.
    pub cut: Option<Cost>,
    /// The whole scan of the plain directory: [`crate::Migrator::plan`]
    /// only.
    pub estimate: Option<Estimate>,
    /// File bytes of the plain directory (each inode once), for progress
    /// totals in bytes; 0 when not asked for, and for a package converted
    /// by a snapshot of the parent (milliseconds, whatever it holds).
    pub bytes: u64,
    /// Whether a partial copy from an interrupted run is there to resume.
    pub resume: bool,
    /// Whether old trees wait for removal.
    pub old_pending: bool,
    /// Why the plain directory cannot be converted, if it cannot (see
    /// [`crate::Migrator::plan`]): a run fails it with this reason, and
    /// converts the others.
    pub refused: Option<String>,
    /// For a snapshot: what it costs in the background with the other
    /// packages it carries, by [`crate::cost`]: what its snapshot sheds
    /// (every other package and the rest, for one of the parent; the other
    /// members, for one of a share) and the cuts of the shares it makes
    /// (the `split` module). At least this where a count stopped.
    pub shed: Option<Cost>,
    /// The shares its volume's snapshot is taken of, from the top down
    /// (the `split` module); empty: the parent itself.
    pub shares: Vec<Share>,
    /// The shares its conversion deletes once done: it is their last
    /// member in the schedule's order.
    pub drop_shares: Vec<String>,
}

impl Planned {
    /// Whether it is converted in the schedule's order, before the clones
    /// of the packages a snapshot cannot serve: a snapshot, or a light
    /// package cloned in a snapshot's place ([`crate::CloneReason::Light`]),
    /// which is cheap.
    pub(crate) fn scheduled(&self) -> bool {
        self.decision == Some(Decision::SnapshotParent) || self.is_light()
    }

    /// Whether it is a light package cloned in a snapshot's place
    /// ([`crate::CloneReason::Light`]).
    pub(crate) fn is_light(&self) -> bool {
        matches!(
            self.decision,
            Some(Decision::Clone(CloneReason::Light { .. }))
        )
    }

    /// `package`, nothing decided or counted yet.
    pub(crate) fn undecided(package: PackageId, resume: bool, old_pending: bool) -> Planned {
        Planned {
            package,
            decision: None,
            clone: None,
            cut: None,
            estimate: None,
            bytes: 0,
            resume,
            old_pending,
            refused: None,
            shed: None,
            shares: Vec::new(),
            drop_shares: Vec::new(),
        }
    }

    /// The method it is to be converted by.
    pub fn method(&self) -> Option<Method> {
        self.decision.as_ref().map(Decision::method)
    }
}
