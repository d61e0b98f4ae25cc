//! The conversion itself (Linux only).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use models::{Error, ErrorKind, PackageId, ResultExt};
use rustix::fs::IFlags;
use serde::Serialize;
use volume::copy;
use volume::failpoint::failpoint;
use volume::layout::{
    MIGRATE_OLD_SUFFIX, MIGRATE_PARENT_SUFFIX, MIGRATE_REST_SUFFIX, MIGRATE_SUFFIX, Names,
    package_of,
};
use volume::lock::PackageLock;
use volume::sys;

use crate::carve;
use crate::cost::Cost;
use crate::decide::{self, Candidate, CloneReason, Decided, Decision, Parent};
use crate::job::{Job, ParentPlan, step};
use crate::report::{Outcome, PackageReport, Planned, ReportError};
use crate::rest::RestRecord;
use crate::scan::{self, Limits, Weights, scan, scan_within};
use crate::shed::Pace;
use crate::track::Tracker;
use crate::{Estimate, Method, Phase, ProgressSink};

/// Default FICLONERANGE chunk: 64 MiB. Each chunk is one ioctl costing
/// O(extents in it); a crash loses at most one chunk of work.
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 20;
/// Headroom of free metadata space kept on top of the estimated need (the
/// global reserve is already held back): what the estimate may miss, and
/// room for the services' first writes after the conversion. By default
/// 1/128 of the filesystem's size ([`default_reserve`]), between these
/// bounds: 64 MiB from 8 GiB up, 8 MiB on 1 GiB, so a small filesystem can
/// still convert.
pub const MAX_RESERVE_BYTES: u64 = 64 << 20;
/// The least default reserve: 1 MiB, a few dozen tree nodes.
pub const MIN_RESERVE_BYTES: u64 = 1 << 20;
const RESERVE_FRACTION: u64 = 128;

/// The default reserve for a filesystem of `space`'s size: 1/128 of it,
/// clamped to [`MIN_RESERVE_BYTES`]..=[`MAX_RESERVE_BYTES`].
pub fn default_reserve(space: &sys::MetadataSpace) -> u64 {
    (space.device_bytes / RESERVE_FRACTION).clamp(MIN_RESERVE_BYTES, MAX_RESERVE_BYTES)
}
/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrateOptions {
    /// Only scan and report what would be converted; change nothing (not
    /// even leftovers of an interrupted run).
    pub dry_run: bool,
    /// Bytes per FICLONERANGE call (rounded up to the block size).
    pub chunk_bytes: u64,
    /// Free metadata space required beyond the estimate; see
    /// [`Migrator::convert`]. `None`: [`default_reserve`], scaled with the
    /// filesystem.
    pub reserve_bytes: Option<u64>,
    /// [`Migrator::run`]: after converting every package, remove the old
    /// directories too (otherwise call [`Migrator::remove_all_old`] later).
    pub remove_old: bool,
    /// How to convert; see [`Migrator::convert`].
    pub method: Method,
    /// A cut of the parent's snapshot only sets the rest aside before the
    /// exchange (O(the parent's top entries)), and [`Migrator::remove_old`]
    /// removes it with the old directory, after services start; see the
    /// `rest` module. Off: the cut removes it before the exchange. On, a
    /// cloned package holding NOCOW files has its old copies (its
    /// `<pkg>.migrate-old` and its directory in every rest) removed before
    /// it is reported done: shared, each first write to them would be a
    /// copy. A crash meanwhile leaves only garbage, for `remove_old`.
    pub defer_cut: bool,
}

impl MigrateOptions {
    /// The reserve to keep on a filesystem of `space`'s size.
    pub fn reserve(&self, space: &sys::MetadataSpace) -> u64 {
        self.reserve_bytes.unwrap_or_else(|| default_reserve(space))
    }
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            dry_run: false,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            reserve_bytes: None,
            remove_old: true,
            method: Method::Auto,
            defer_cut: false,
        }
    }
}

/// What `<root>/<name>` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Absent,
    Dir,
    Subvolume,
    Other,
}

/// What one package's names hold: the conversion's state on disk.
#[derive(Debug, Clone, Copy)]
struct State {
    /// `<pkg>`.
    live: Kind,
    /// `<pkg>.migrate`: a partial clone, or the old directory after the
    /// exchange.
    tmp: Kind,
    /// `<pkg>.migrate-parent`: a cut in progress, or the old directory
    /// after the exchange.
    parent: Kind,
    /// `<pkg>.migrate-old`.
    old: Kind,
    /// `<pkg>.migrate-rest`, the record of a deferred cut.
    rest: bool,
}

impl State {
    /// Whether old trees wait for [`Migrator::remove_old`].
    fn old_pending(&self) -> bool {
        self.old != Kind::Absent
            || self.rest
            || ((self.tmp == Kind::Dir || self.parent == Kind::Dir) && self.live != Kind::Dir)
    }
}

pub(crate) fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Converts the plain directories under one volumes root. Open it with
/// [`Migrator::open`]; every method that changes anything takes the
/// package's volume lock.
///
/// The root itself is trusted; everything inside a volume is not: names are
/// resolved relative to open directories, nothing is followed through a
/// symlink, only directories and regular files are ever opened.
pub struct Migrator {
    root: volume::Root,
}

impl Migrator {
    /// Opens the volumes root. `NotFound` if it does not exist,
    /// `InvalidRequest` if it is not a directory. Works on any filesystem;
    /// off btrfs every call does nothing ([`Migrator::is_btrfs`]).
    pub fn open(root: impl AsRef<Path>) -> Result<Self, Error> {
        Ok(Migrator {
            root: volume::Root::open(root)?,
        })
    }

    /// The canonical volumes root.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Whether the root is on btrfs. If not, there is nothing to convert and
    /// every call reports nothing.
    pub fn is_btrfs(&self) -> bool {
        self.root.is_btrfs()
    }

    pub(crate) fn root_fd(&self) -> BorrowedFd<'_> {
        self.root.fd()
    }

    fn kind(&self, name: &OsStr) -> io::Result<Kind> {
        match sys::stat_at(self.root_fd(), name)? {
            None => Ok(Kind::Absent),
            Some(st) if st.is_dir() => {
                let fd = sys::open_dir_at(self.root_fd(), name)?;
                Ok(if sys::is_subvolume(fd.as_fd())? {
                    Kind::Subvolume
                } else {
                    Kind::Dir
                })
            }
            Some(_) => Ok(Kind::Other),
        }
    }

    fn state(&self, pkg: &PackageId, names: &Names) -> Result<State, Error> {
        let kind = |name: &OsString, what: &'static str| {
            self.kind(name)
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context(what)))
        };
        Ok(State {
            live: kind(&names.live, "inspecting the volume")?,
            tmp: kind(&names.migrate, "inspecting the partial copy")?,
            parent: kind(&names.migrate_parent, "inspecting the parent snapshot")?,
            old: kind(&names.migrate_old, "inspecting the old directory")?,
            rest: sys::stat_at(self.root_fd(), &names.migrate_rest)
                .with_ctx(|_| {
                    (
                        ErrorKind::Filesystem,
                        pkg.context("inspecting the cut's record"),
                    )
                })?
                .is_some(),
        })
    }

    /// Packages with anything for the conversion to do, sorted: `<pkg>` a
    /// plain directory, or a `<pkg>.migrate`, `<pkg>.migrate-parent`,
    /// `<pkg>.migrate-old` or `<pkg>.migrate-rest` left by an interrupted
    /// run. Empty off btrfs.
    pub fn packages(&self) -> Result<Vec<PackageId>, Error> {
        if !self.root.is_btrfs() {
            return Ok(Vec::new());
        }
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.path().display()),
            )
        })?;
        let mut out = Vec::new();
        for (name, _, _) in entries {
            let pkg = match package_of(&name) {
                Some(Ok(pkg)) => pkg,
                // No package's, whatever it holds: reported, left alone,
                // and no reason to stop the others.
                Some(Err(e)) => {
                    tracing::warn!(
                        "skipped {}: not a package volume: {e}",
                        self.root.path().join(&name).display()
                    );
                    continue;
                }
                None => continue,
            };
            let s = name.to_string_lossy();
            let relevant = if s == pkg.as_str() {
                match self
                    .kind(&name)
                    .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("inspecting the volume")))?
                {
                    Kind::Dir => true,
                    Kind::Other => {
                        // Not a volume, whatever its name: nothing to
                        // convert, and no reason to stop the others.
                        tracing::warn!(
                            "skipped {}: not a directory, so not a package volume",
                            self.root.path().join(&name).display()
                        );
                        false
                    }
                    Kind::Subvolume | Kind::Absent => false,
                }
            } else {
                [
                    MIGRATE_SUFFIX,
                    MIGRATE_PARENT_SUFFIX,
                    MIGRATE_OLD_SUFFIX,
                    MIGRATE_REST_SUFFIX,
                ]
                .iter()
                .any(|suffix| s.ends_with(suffix))
            };
            if relevant {
                out.push(pkg);
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// What a run would do (a dry run): [`Migrator::schedule`] of every
    /// package of [`Migrator::packages`], with each plain directory also
    /// scanned whole ([`Planned::estimate`]), in the order a run takes
    /// them. Changes nothing (it commits the filesystem, so that data still
    /// in the page cache has its extents; nothing anyone can see).
    pub fn plan(&self) -> Result<Vec<Planned>, Error> {
        self.plan_with(&MigrateOptions::default())
    }

    /// [`Migrator::plan`] for a run with `opts` (its method).
    pub fn plan_with(&self, opts: &MigrateOptions) -> Result<Vec<Planned>, Error> {
        let mut planned = self.schedule_for(&self.packages()?, opts, true)?;
        for p in &mut planned {
            if p.decision.is_none() {
                continue;
            }
            let pkg = &p.package;
            let fd = sys::open_dir_at(self.root_fd(), OsStr::new(pkg.as_str()))
                .with_ctx(step(pkg, "opening the volume"))?;
            match scan(fd.as_fd(), &AtomicBool::new(false)) {
                Ok((est, _)) => {
                    p.clone = Some(Cost::clone_of(&est, true));
                    p.estimate = Some(est);
                }
                // A snapshot has no depth bound: the estimate is unknown,
                // the decision stands.
                Err(e)
                    if volume::walk::is_too_deep(&e)
                        && p.decision == Some(Decision::SnapshotParent) => {}
                // A tree a clone refuses (too deep, a mount inside), as the
                // run would refuse it.
                Err(e) if volume::walk::is_too_deep(&e) || volume::walk::is_crossing(&e) => {
                    p.refused = Some(format!(
                        "{}: {e}",
                        self.root.path().join(pkg.as_str()).display()
                    ));
                    p.decision = None;
                }
                Err(e) => return Err(e).with_ctx(step(pkg, "scanning the volume")),
            }
        }
        // What each snapshot sheds in the background: the rest outside the
        // packages, which the schedule counted, and every other package.
        let all = planned
            .iter()
            .filter_map(|p| p.estimate)
            .fold(Estimate::default(), |acc, e| acc.plus(&e));
        for p in &mut planned {
            if let (Some(cut), Some(own)) = (p.cut, p.estimate) {
                let others = Estimate {
                    entries: all.entries - own.entries,
                    extents: all.extents - own.extents,
                    ..Estimate::default()
                };
                let outside = Estimate {
                    entries: cut.entries,
                    extents: cut.extents,
                    ..Estimate::default()
                };
                p.cut = Some(Cost::cut_of(&others.plus(&outside), 0, !cut.at_least));
            }
        }
        Ok(planned)
    }

    /// Decides how each of `packages` is to be converted, all in one run, by
    /// `opts.method` (for [`Method::Auto`], the rule in the `decide`
    /// module's docs: every package a snapshot can serve is converted by
    /// snapshotting the parent), and in which order: those by name, then
    /// the clones by name. Plain directories under the root that are not
    /// in `packages` count as the rest of the parent, as anything else
    /// there. Packages with nothing to convert but leftovers are listed
    /// with no decision; those with nothing at all are left out. Reads
    /// only; counts nothing of the packages, and the rest outside them only
    /// up to [`crate::REST_MAX_US`].
    pub fn schedule(
        &self,
        packages: &[PackageId],
        opts: &MigrateOptions,
    ) -> Result<Vec<Planned>, Error> {
        self.schedule_for(packages, opts, true)
    }

    /// [`Migrator::schedule`]; `bytes`: also count the file bytes of every
    /// plain directory the decision did not count whole.
    fn schedule_for(
        &self,
        packages: &[PackageId],
        opts: &MigrateOptions,
        bytes: bool,
    ) -> Result<Vec<Planned>, Error> {
        if !self.root.is_btrfs() {
            return Ok(Vec::new());
        }
        // Data still in the page cache has no extents yet.
        sys::commit(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("flushing the filesystem of {}", self.root.path().display()),
            )
        })?;
        let mut leftovers = Vec::new();
        let mut refused = Vec::new();
        let mut candidates = Vec::new();
        let parent = match opts.method {
            Method::Auto => Some(Parent::of(self.root_fd(), self.root.path()).with_ctx(|_| {
                (
                    ErrorKind::MigrationFailed,
                    format!(
                        "inspecting the subvolume holding {}",
                        self.root.path().display()
                    ),
                )
            })?),
            Method::Clone | Method::SnapshotParent => None,
        };
        for pkg in packages {
            let names = Names::new(pkg)?;
            let state = self.state(pkg, &names)?;
            let planned = Planned::undecided(
                pkg.clone(),
                state.live == Kind::Dir && state.tmp == Kind::Subvolume,
                state.old_pending(),
            );
            if state.live != Kind::Dir {
                if state.old_pending() || state.tmp != Kind::Absent || state.parent != Kind::Absent
                {
                    leftovers.push(planned);
                }
                continue;
            }
            let dir = sys::open_dir_at(self.root_fd(), &names.live)
                .with_ctx(step(pkg, "opening the volume"))?;
            // Refused whatever the method: not decided, and the run fails
            // it with the reason (its tree is part of the rest every
            // snapshot sheds).
            if let Some(why) = self.refusal(pkg, &names, dir.as_fd())? {
                refused.push(Planned {
                    refused: Some(why),
                    ..planned
                });
                continue;
            }
            let st = sys::stat(dir.as_fd()).with_ctx(step(pkg, "stat of the volume"))?;
            // `refusal` already turned away a volume on another filesystem.
            let ineligible = if planned.resume {
                Some(CloneReason::Resume)
            } else if let Some(Ok(p)) = &parent
                && p.holds_nested(st.ino)
            {
                Some(CloneReason::NestedSubvolumes)
            } else {
                None
            };
            candidates.push((
                planned,
                Candidate {
                    key: (st.dev, st.ino),
                    ineligible,
                },
            ));
        }
        let (mut planned, cands): (Vec<Planned>, Vec<Candidate>) = candidates.into_iter().unzip();
        let decided: Vec<Decided> = match &parent {
            Some(parent) => decide::decide(&cands, parent),
            None => cands
                .iter()
                .map(|c| Decided {
                    decision: match (opts.method, &c.ineligible) {
                        (Method::SnapshotParent, _) => Decision::SnapshotParent,
                        (_, Some(CloneReason::Resume)) => Decision::Clone(CloneReason::Resume),
                        _ => Decision::Clone(CloneReason::Forced),
                    },
                    cut: None,
                })
                .collect(),
        };
        for (p, d) in planned.iter_mut().zip(decided) {
            // For progress only, so only where there is progress to show: a
            // snapshot takes milliseconds, and a stat of each of its
            // entries would delay every service. A tree it cannot count
            // (too deep, say) is the conversion's to refuse, package by
            // package.
            if bytes && d.decision != Decision::SnapshotParent {
                p.bytes = sys::open_dir_at(self.root_fd(), OsStr::new(p.package.as_str()))
                    .and_then(|dir| scan::bytes(dir.as_fd()))
                    .map(|est| est.bytes)
                    .unwrap_or_else(|e| {
                        tracing::warn!(package = %p.package, error = %e, "counting the volume's bytes");
                        0
                    });
            }
            p.decision = Some(d.decision);
            p.cut = d.cut;
        }
        planned.extend(refused);
        // The snapshots first, each in milliseconds, so that no service
        // waits for a clone; then the clones, by name.
        planned.sort_by_key(|p| {
            (
                p.decision != Some(Decision::SnapshotParent),
                p.package.clone(),
            )
        });
        planned.extend(leftovers);
        Ok(planned)
    }

    fn lock(&self, pkg: &PackageId) -> Result<PackageLock, Error> {
        PackageLock::for_package(self.root_fd(), pkg).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("taking the package lock"),
            )
        })
    }

    /// Converts every package of [`Migrator::packages`] in the order of
    /// [`Migrator::schedule`], calling `on_done` with each report as soon as
    /// that package is done (so its service can start), then, with
    /// `opts.remove_old`, removes the old trees. A failing package does not
    /// stop the others: its report says why. Fails only if the root cannot
    /// be read or the schedule cannot be made.
    pub fn run(
        &self,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
        on_done: &mut dyn FnMut(&PackageReport),
    ) -> Result<Vec<PackageReport>, Error> {
        let mut reports = Vec::new();
        for planned in self.schedule_for(&self.packages()?, opts, false)? {
            let started = Instant::now();
            let report = self
                .convert_planned(&planned, opts, sink)
                .unwrap_or_else(|e| PackageReport {
                    package: planned.package.clone(),
                    outcome: Outcome::Failed,
                    estimate: None,
                    method: None,
                    resumed: false,
                    bytes_cloned: 0,
                    entries_reused: 0,
                    nocow_files: 0,
                    old_removed: false,
                    elapsed: started.elapsed(),
                    error: Some(ReportError::from(&e)),
                });
            on_done(&report);
            reports.push(report);
        }
        if opts.remove_old && !opts.dry_run {
            for r in &mut reports {
                if r.outcome == Outcome::Failed {
                    continue;
                }
                match self.remove_old(&r.package, sink) {
                    Ok(_) => r.old_removed = true,
                    Err(e) => {
                        r.outcome = Outcome::Failed;
                        r.error = Some(ReportError::from(&e));
                    }
                }
            }
        }
        Ok(reports)
    }

    /// Removes every old tree left under the root ([`Migrator::remove_old`]
    /// for each package); the second phase, fine to run while services run.
    /// Returns the packages cleaned.
    ///
    /// The order matters to the services already running: a deferred cut's
    /// rest holds a copy of every other package's old tree, and until both
    /// it and a package's own old tree are gone, the NOCOW files cloned into
    /// that package share their extents, so each of its first writes there
    /// is a copy (a new extent) instead of an overwrite. The rests go first,
    /// then the cloned packages' old trees, and last the old trees of the
    /// packages converted by a cut (whose extents only their own volumes
    /// share, so a NOCOW first write there copies once either way).
    ///
    /// One package that cannot be cleaned (an unreadable record, an I/O
    /// error, too little metadata space) stops none of the others: each is
    /// tried, and the first error is returned once all were.
    ///
    /// The calling thread does it in the idle I/O class
    /// ([`sys::IdleIo`]), back at its own priority on return: the services
    /// that started meanwhile come first.
    pub fn remove_all_old(&self, sink: &mut dyn ProgressSink) -> Result<Vec<PackageId>, Error> {
        let _idle = sys::IdleIo::enter()
            .inspect_err(|e| tracing::warn!(error = %e, "entering the idle I/O class"))
            .ok();
        let (cut, cloned): (Vec<PackageId>, Vec<PackageId>) =
            self.packages()?.into_iter().partition(|pkg| {
                // A record that cannot be read is for remove_old to report.
                Names::new(pkg).is_ok_and(|names| {
                    !matches!(
                        RestRecord::read(self.root_fd(), &names.migrate_rest),
                        Ok(None)
                    )
                })
            });
        let mut done = Vec::new();
        let mut failed: Vec<(PackageId, Error)> = Vec::new();
        for pkg in &cut {
            match self.remove_parts(pkg, false, sink) {
                Ok(true) => done.push(pkg.clone()),
                Ok(false) => {}
                Err(e) => failed.push((pkg.clone(), e)),
            }
        }
        // A package whose rest failed is left whole for the next cleanup:
        // its old tree would meet the same wall, and be reported twice.
        for pkg in cloned.iter().chain(&cut) {
            if failed.iter().any(|(p, _)| p == pkg) {
                continue;
            }
            match self.remove_old(pkg, sink) {
                Ok(true) if !done.contains(pkg) => done.push(pkg.clone()),
                Ok(_) => {}
                Err(e) => failed.push((pkg.clone(), e)),
            }
        }
        for (pkg, e) in &failed {
            tracing::error!(package = %pkg, error = %e, "removing what the conversion left");
        }
        let first_error = failed.into_iter().next().map(|(_, e)| e);
        match first_error {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Removes the old trees a conversion of `pkg` left: the rest a
    /// deferred cut set aside in the new `<pkg>` ([`MigrateOptions::defer_cut`]),
    /// then `<pkg>.migrate-old`, the plain directory it replaced: O(their
    /// extents), entry by entry (nested subvolumes in O(1)). Returns whether
    /// there was anything. Both only ever hold data that lives elsewhere
    /// (the converted `<pkg>`, or the rest of the parent), so a crash
    /// part-way is harmless: the rest is removed by the next call. (An
    /// immutable or append-only file also linked from outside them keeps
    /// its flags, cleared for the unlink and put back; a crash in between
    /// leaves them off that other name.) Also finishes an exchange whose
    /// rename aside was interrupted.
    pub fn remove_old(&self, pkg: &PackageId, sink: &mut dyn ProgressSink) -> Result<bool, Error> {
        self.remove_parts(pkg, true, sink)
    }

    /// [`Migrator::remove_old`], or with `old` false only the rest of a
    /// deferred cut (`<pkg>.migrate-old` left for a later call).
    fn remove_parts(
        &self,
        pkg: &PackageId,
        old: bool,
        sink: &mut dyn ProgressSink,
    ) -> Result<bool, Error> {
        if !self.root.is_btrfs() {
            return Ok(false);
        }
        let names = Names::new(pkg)?;
        let _lock = self.lock(pkg)?;
        self.settle_exchanged(pkg, &names)?;
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        let reserve = default_reserve(&self.metadata_space(pkg)?);
        let pace = || Pace::start(self.root_fd(), reserve);
        let rest = self.remove_rest(pkg, &names, &mut tracker, &pace)?;
        if !old
            || self
                .kind(&names.migrate_old)
                .with_ctx(step(pkg, "inspecting the old directory"))?
                == Kind::Absent
        {
            if rest {
                tracker.phase(Phase::Done);
            }
            return Ok(rest);
        }
        tracker.phase(Phase::RemoveOld);
        let pace = pace();
        copy::remove_tree_at(self.root_fd(), &names.migrate_old, &mut |n| {
            tracker.entries(n);
            pace.step(n)?;
            failpoint("migrate.remove")
        })
        .and_then(|()| sys::fsync(self.root_fd()))
        .with_ctx(step(pkg, "removing the old directory"))?;
        tracker.phase(Phase::Done);
        tracing::info!(package = %pkg, "old plain volume directory removed");
        Ok(true)
    }

    /// Removes what a deferred cut set aside in `<pkg>`, by its record (see
    /// the `rest` module); returns whether there was a record.
    fn remove_rest<'m>(
        &'m self,
        pkg: &PackageId,
        names: &Names,
        tracker: &mut Tracker<'_>,
        pace: &dyn Fn() -> Pace<'m>,
    ) -> Result<bool, Error> {
        let root = self.root_fd();
        let Some(record) = RestRecord::read(root, &names.migrate_rest).with_ctx(|e| {
            (
                ErrorKind::Incoherent,
                pkg.context(format!("reading the deferred cut's record: {e}")),
            )
        })?
        else {
            return Ok(false);
        };
        if self
            .kind(&names.live)
            .with_ctx(step(pkg, "inspecting the volume"))?
            == Kind::Subvolume
        {
            let live =
                sys::open_dir_at(root, &names.live).with_ctx(step(pkg, "opening the volume"))?;
            if record
                .is_in(live.as_fd())
                .with_ctx(step(pkg, "looking for the cut's rest"))?
            {
                tracker.phase(Phase::RemoveOld);
                let pace = pace();
                carve::remove_rest(live.as_fd(), &record.name, record.root_stuck, &mut |n| {
                    tracker.entries(n);
                    pace.step(n)?;
                    failpoint("migrate.rest-removed")
                })
                .and_then(|()| sys::commit(live.as_fd()))
                .with_ctx(step(pkg, "removing the rest of the parent's snapshot"))?;
                tracing::info!(package = %pkg, "the rest of the parent's snapshot removed");
            } else {
                // Removed before a crash that came before the record's
                // removal: the root's flags may still be lifted.
                carve::put_back_root_flags(live.as_fd(), record.root_stuck)
                    .with_ctx(step(pkg, "putting back the volume root's flags"))?;
            }
        }
        // A backup taken before the removal holds the rest too; a restore of
        // it would bring it back, so the record stays while it exists. So
        // does every copy an interrupted backup or restore may yet turn
        // into the volume (ours or upstream's), named here.
        let mut in_backup = false;
        for copy in [
            &names.backup,
            &names.backup_tmp,
            &names.rollback,
            &names.replaced,
            &names.upstream_backup_tmp,
            &names.restore_old,
            &names.restore_conflict,
        ] {
            let holds = match sys::stat_at(root, copy)
                .with_ctx(step(pkg, "inspecting a copy of the volume"))?
            {
                Some(st) if st.is_dir() => {
                    let dir = sys::open_dir_at(root, copy)
                        .with_ctx(step(pkg, "opening a copy of the volume"))?;
                    record
                        .is_in(dir.as_fd())
                        .with_ctx(step(pkg, "looking for the cut's rest in a copy"))?
                }
                _ => false,
            };
            in_backup |= holds;
        }
        if !in_backup {
            volume::record::remove(root, &names.migrate_rest)
                .and_then(|()| sys::fsync(root))
                .with_ctx(step(pkg, "removing the deferred cut's record"))?;
        }
        Ok(true)
    }

    /// After the exchange, `<pkg>.migrate` (or `<pkg>.migrate-parent`) is
    /// the old plain directory: move it to `<pkg>.migrate-old`. A subvolume
    /// under either name beside no plain `<pkg>` is a partial copy whose
    /// source is gone: removed. Returns whether an old directory was moved.
    pub(crate) fn settle_exchanged(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let live = self
            .kind(&names.live)
            .with_ctx(step(pkg, "inspecting the volume"))?;
        if live == Kind::Dir {
            return Ok(false);
        }
        let mut moved = false;
        for tmp in [&names.migrate, &names.migrate_parent] {
            match self
                .kind(tmp)
                .with_ctx(step(pkg, "inspecting the partial copy"))?
            {
                Kind::Dir => {
                    if self
                        .kind(&names.migrate_old)
                        .with_ctx(step(pkg, "inspecting the old directory"))?
                        != Kind::Absent
                    {
                        copy::remove_tree_at(self.root_fd(), &names.migrate_old, &mut |_| Ok(()))
                            .with_ctx(step(pkg, "removing an older old directory"))?;
                    }
                    sys::rename_noreplace(self.root_fd(), tmp, &names.migrate_old)
                        .and_then(|()| sys::fsync(self.root_fd()))
                        .with_ctx(step(pkg, "moving the old directory aside"))?;
                    failpoint("migrate.old-renamed").with_ctx(step(pkg, "failpoint"))?;
                    moved = true;
                }
                Kind::Subvolume => {
                    // A partial copy whose source is gone or was replaced by
                    // a subvolume (a volume operation since): worthless.
                    copy::remove_tree_at(self.root_fd(), tmp, &mut |_| Ok(()))
                        .and_then(|()| sys::fsync(self.root_fd()))
                        .with_ctx(step(pkg, "removing a stale partial copy"))?;
                }
                Kind::Absent | Kind::Other => {}
            }
        }
        Ok(moved)
    }

    /// Converts `<pkg>`, if it is a plain directory, into a subvolume with
    /// the same contents and attributes, leaving the old directory as
    /// `<pkg>.migrate-old` for [`Migrator::remove_old`]: the
    /// [`Migrator::schedule`] of this one package, then
    /// [`Migrator::convert_planned`]. Resumes or finishes whatever an
    /// interrupted run left. Off btrfs, or with `<pkg>` already a
    /// subvolume, does nothing.
    ///
    /// Refuses (`InvalidRequest`, naming the package) while anything is
    /// mounted from inside `<pkg>`, and when `<pkg>` is on another
    /// filesystem than the root. Refuses (`MigrationFailed`) when free
    /// space is short. A reflink shares data, so no data space is needed
    /// (inline file data lives in metadata): only metadata grows. The free
    /// metadata space, read from btrfs's allocator before anything is
    /// created (free space in metadata block groups beyond the global
    /// reserve, plus unallocated device space over the metadata profile's
    /// copies; see [`sys::MetadataSpace`]), must cover the estimated new
    /// metadata, 128 bytes per extent item plus 1 KiB per entry, plus
    /// `opts.reserve_bytes`. The estimate can miss, so an ENOSPC during the
    /// copy removes the partial subvolume and leaves `<pkg>` untouched. Other
    /// errors during the copy keep the partial copy for the next run.
    ///
    /// The scan that counts entries, bytes and extents (a stat and a tree
    /// search per file) runs on a second thread while the clone starts, so
    /// it costs no wall time: progress totals (and the ETA) arrive when it
    /// finishes ([`crate::Progress::totals_known`]). The reserve alone is checked
    /// before anything is created; the full estimate as soon as the scan
    /// has it, and if short the clone stops there, the partial subvolume is
    /// removed, and `<pkg>` is untouched, as for an ENOSPC. A dry run scans
    /// only.
    ///
    /// The method ([`MigrateOptions::method`]): [`Method::Auto`] resumes an
    /// interrupted clone, and otherwise snapshots the parent subvolume
    /// wherever a snapshot can serve (see [`Decision`] for every reason it
    /// clones instead). The free metadata space must cover a node per entry
    /// removed or lifted, 128 bytes per extent item removed, of the rest
    /// outside the packages (what the snapshot holds of other packages
    /// leaves it later), and the reserve. Auto always defers the cut
    /// ([`MigrateOptions::defer_cut`] or not): the exchange waits for
    /// renames only, and [`Migrator::remove_old`] sheds the rest. Should
    /// space be short, or the cut fail for any reason but
    /// ENOSPC, Auto deletes the snapshot and clones instead (if the
    /// snapshot cannot be deleted, that is the error).
    /// [`Method::SnapshotParent`] forces the method:
    /// `InvalidRequest` where the parent's root is out of reach, something
    /// is mounted inside it, the package holds nested subvolumes, or the
    /// rest of the parent holds a NOCOW or preallocated file.
    ///
    /// A crash at any point leaves `<pkg>` complete (old or new); see the
    /// crate docs for what the next run does.
    pub fn convert(
        &self,
        pkg: &PackageId,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
    ) -> Result<PackageReport, Error> {
        let planned = self
            .schedule_for(std::slice::from_ref(pkg), opts, false)?
            .pop()
            .unwrap_or_else(|| Planned::undecided(pkg.clone(), false, false));
        self.convert_planned(&planned, opts, sink)
    }

    /// Converts one package of a [`Migrator::schedule`] as planned (the
    /// state on disk is checked again first: the plan may be stale); see
    /// [`Migrator::convert`] for everything else.
    pub fn convert_planned(
        &self,
        planned: &Planned,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
    ) -> Result<PackageReport, Error> {
        let pkg = &planned.package;
        let started = Instant::now();
        let mut report = PackageReport {
            package: pkg.clone(),
            outcome: Outcome::AlreadySubvolume,
            estimate: None,
            method: None,
            resumed: false,
            bytes_cloned: 0,
            entries_reused: 0,
            nocow_files: 0,
            old_removed: false,
            elapsed: Duration::ZERO,
            error: None,
        };
        if !self.root.is_btrfs() {
            return Ok(report);
        }
        let names = Names::new(pkg)?;
        let lock = self.lock(pkg)?;
        if !opts.dry_run {
            // A restore, snapshot or delete of the volume store cut short is
            // finished first: converting a volume a restore has recorded
            // would change the identity its recovery goes by.
            volume::VolumeStore::open_without_recovery(self.root.path())?
                .recover_held(pkg, &lock)?;
        }
        let state = self.state(pkg, &names)?;
        let incoherent = [
            (&names.migrate, state.tmp),
            (&names.migrate_parent, state.parent),
        ]
        .into_iter()
        .find(|&(_, kind)| kind == Kind::Other || (state.live, kind) == (Kind::Dir, Kind::Dir));
        if let Some((name, _)) = incoherent {
            return Err(Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "{} is neither a partial copy nor the old directory; move it away",
                    self.root.path().join(name).display()
                ),
            ));
        }
        match state.live {
            Kind::Other => {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    format!(
                        "{} is not a directory",
                        self.root.path().join(&names.live).display()
                    ),
                ));
            }
            Kind::Dir => {}
            Kind::Subvolume | Kind::Absent => {
                if !opts.dry_run && self.settle_exchanged(pkg, &names)? {
                    report.outcome = Outcome::Finished;
                }
                report.elapsed = started.elapsed();
                return Ok(report);
            }
        }

        // `<pkg>` is a plain directory.
        if state.parent == Kind::Subvolume && !opts.dry_run {
            // An interrupted cut, holding a copy of the whole parent: drop it
            // (O(1): a new snapshot costs nothing), and its record.
            copy::remove_tree_at(self.root_fd(), &names.migrate_parent, &mut |_| Ok(()))
                .and_then(|()| volume::record::remove(self.root_fd(), &names.migrate_rest))
                .and_then(|()| sys::fsync(self.root_fd()))
                .with_ctx(step(pkg, "removing an interrupted parent snapshot"))?;
        }
        let live_path = self.root.path().join(&names.live);
        let src = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(step(pkg, "opening the volume"))?;
        if let Some(why) = self.refusal(pkg, &names, src.as_fd())? {
            return Err(Error::for_package(pkg, ErrorKind::InvalidRequest, why));
        }

        // Scan: data still in the page cache has no extents yet, so flush.
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        tracker.phase(Phase::Scan);
        sys::commit(src.as_fd()).with_ctx(step(pkg, "flushing the volume"))?;
        if opts.dry_run {
            let (estimate, _) = scan(src.as_fd(), &AtomicBool::new(false))
                .with_ctx(step(pkg, "scanning the volume"))?;
            report.estimate = Some(estimate);
            report.outcome = Outcome::WouldConvert;
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        // Free space is read once, before anything is created, and the
        // estimate checked against it when the scan has it. The reserve alone
        // is checked now, so a volumes root short of it is never touched.
        let space = self.metadata_space(pkg)?;
        let room = MetadataRoom {
            free: space.free(),
            reserve: opts.reserve(&space),
        };
        if room.check(&Estimate::default()).is_err() {
            // Short of the reserve alone: count the package too, so the
            // refusal gives what it really needs.
            let (estimate, _) = scan(src.as_fd(), &AtomicBool::new(false))
                .with_ctx(step(pkg, "scanning the volume"))?;
            return Err(Error::for_package(
                pkg,
                ErrorKind::MigrationFailed,
                format!("{}; nothing was changed", room.shortfall(&estimate)),
            ));
        }
        let mut job = Job {
            m: self,
            pkg,
            names: &names,
            opts,
            src,
            space,
            room,
            tracker,
            report,
        };

        let forced = opts.method == Method::SnapshotParent;
        let resume = state.tmp == Kind::Subvolume;
        let carve = match &planned.decision {
            Some(Decision::SnapshotParent) if forced || !resume => {
                match self.prepare_carve(&job, planned, forced)? {
                    Prepared::Carve(plan) => Some(plan),
                    Prepared::Clone(reason) if forced => {
                        return Err(Error::for_package(
                            pkg,
                            ErrorKind::InvalidRequest,
                            format!(
                                "cannot convert {} by snapshotting its parent: {reason}",
                                live_path.display()
                            ),
                        ));
                    }
                    Prepared::Clone(reason) => {
                        tracing::info!(package = %pkg, "cloning, not snapshotting the parent: {reason}");
                        None
                    }
                }
            }
            _ => None,
        };
        if let Some(plan) = carve {
            if forced && resume {
                copy::remove_tree_at(self.root_fd(), &names.migrate, &mut |_| Ok(()))
                    .with_ctx(step(pkg, "removing a partial copy"))?;
            }
            match job.carve_parent(plan) {
                Ok(carved) => {
                    job.swap_in(&names.migrate_parent, carved)?;
                    let mut report = job.report;
                    report.method = Some(Method::SnapshotParent);
                    report.outcome = Outcome::Converted;
                    if opts.method == Method::Auto && !opts.defer_cut {
                        // Auto deferred the cut whatever the options (its
                        // snapshot holds every other package's tree, which
                        // nothing counted); this caller wants it gone on
                        // return: shed now, the volume already in place.
                        // A failure leaves garbage for the next cleanup.
                        drop(lock);
                        if let Err(e) = self.remove_parts(pkg, false, sink) {
                            tracing::warn!(package = %pkg, error = %e, "removing the rest of the parent's snapshot");
                        }
                    }
                    report.elapsed = started.elapsed();
                    return Ok(report);
                }
                Err(failure) if forced || !failure.can_clone() => {
                    return Err(failure.into_error(pkg, &live_path));
                }
                Err(failure) => {
                    tracing::warn!(package = %pkg, "cutting a parent snapshot failed, cloning instead: {}", failure.reason());
                }
            }
        }
        job.clone_volume(resume)?;
        job.report.method = Some(Method::Clone);
        job.report.outcome = Outcome::Converted;
        if opts.defer_cut && job.report.nocow_files > 0 {
            // Its service must not start while its NOCOW files share their
            // extents: each first write would be a copy, for good. The
            // conversion is done either way: a failure here is the
            // cleanup's to finish.
            match self.release_in_place(pkg, &names) {
                Ok(()) => job.report.old_removed = true,
                Err(e) => {
                    tracing::warn!(package = %pkg, error = %e, "removing the old copies of its NOCOW files")
                }
            }
        }
        job.report.elapsed = started.elapsed();
        Ok(job.report)
    }

    /// Removes, for the cloned package `pkg`, every other copy of its old
    /// files: `<pkg>.migrate-old`, and `pkg`'s old directory inside each
    /// deferred cut's rest (verified by the rest's record, under the path
    /// the volumes root has in the parent subvolume). Everything removed is
    /// garbage already, so a crash part-way leaves only less for
    /// [`Migrator::remove_old`]. Holds each other package's lock while in
    /// its volume.
    fn release_in_place(&self, pkg: &PackageId, names: &Names) -> Result<(), Error> {
        let root = self.root_fd();
        if self
            .kind(&names.migrate_old)
            .with_ctx(step(pkg, "inspecting the old directory"))?
            != Kind::Absent
        {
            copy::remove_tree_at(root, &names.migrate_old, &mut |_| Ok(()))
                .and_then(|()| sys::fsync(root))
                .with_ctx(step(pkg, "removing the old directory"))?;
        }
        let Some((_, volumes_path)) =
            sys::subvolume_root_of(root).with_ctx(step(pkg, "finding the parent subvolume"))?
        else {
            return Ok(());
        };
        let old: PathBuf = volumes_path.iter().collect();
        for other in self.packages()? {
            if &other == pkg {
                continue;
            }
            let theirs = Names::new(&other)?;
            let Ok(Some(record)) = RestRecord::read(root, &theirs.migrate_rest) else {
                continue;
            };
            let _lock = self.lock(&other)?;
            if self
                .kind(&theirs.live)
                .with_ctx(step(&other, "inspecting the volume"))?
                != Kind::Subvolume
            {
                continue;
            }
            let live = sys::open_dir_at(root, &theirs.live)
                .with_ctx(step(&other, "opening the volume"))?;
            if !record
                .is_in(live.as_fd())
                .with_ctx(step(&other, "looking for the cut's rest"))?
            {
                continue;
            }
            let in_rest = Path::new(&record.name).join(&old);
            let dir = match sys::open_beneath(live.as_fd(), &in_rest) {
                Ok(dir) => dir,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => {
                    return Err(e).with_ctx(step(pkg, "opening its old copy in a cut's rest"));
                }
            };
            copy::remove_tree_at(dir.as_fd(), &names.live, &mut |_| Ok(()))
                .and_then(|()| sys::commit(live.as_fd()))
                .with_ctx(step(pkg, "removing its old copy from a cut's rest"))?;
            tracing::info!(package = %pkg, rest_of = %other, "old copies of its NOCOW files removed");
        }
        Ok(())
    }

    /// Why the plain directory `<pkg>` (open as `src`) cannot be converted
    /// at all, if it cannot: something is mounted from inside it (in any
    /// mount namespace: the conversion would leave the mount on the old
    /// tree), it is on another filesystem than the root, or it is
    /// immutable or append-only (the kernel renames no such directory, so
    /// the exchange would fail after the whole copy). The same checks for
    /// a dry run and a real one, so that they agree.
    fn refusal(
        &self,
        pkg: &PackageId,
        names: &Names,
        src: BorrowedFd<'_>,
    ) -> Result<Option<String>, Error> {
        let live_path = self.root.path().join(&names.live);
        let busy = volume::mounts::uses_of(&live_path).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })?;
        if !busy.is_empty() {
            return Ok(Some(format!(
                "{} is in use, mounted at {}; unmount it first",
                live_path.display(),
                volume::mounts::describe(&busy)
            )));
        }
        let src_st = sys::stat(src).with_ctx(step(pkg, "stat of the volume"))?;
        if src_st.dev != self.root.dev()
            || !sys::is_btrfs(src).with_ctx(step(pkg, "statfs of the volume"))?
        {
            return Ok(Some(format!(
                "{} is on another filesystem than the volumes root {}",
                live_path.display(),
                self.root.path().display()
            )));
        }
        let stuck = sys::inode_flags(src)
            .with_ctx(step(pkg, "reading the volume's inode flags"))?
            .intersection(IFlags::IMMUTABLE | IFlags::APPEND);
        if !stuck.is_empty() {
            return Ok(Some(format!(
                "{} is immutable or append-only, and the kernel renames no such \
                 directory; clear the flag (chattr -i -a) and convert again",
                live_path.display()
            )));
        }
        Ok(None)
    }

    /// Checks, just before the cut, what can have changed since the
    /// schedule (the parent's root, mounts inside it, nested subvolumes in
    /// the package) and the free space for the cut; `forced`: also counts
    /// the whole rest of the parent, NOCOW and preallocated files included
    /// (the schedule did not).
    fn prepare_carve(
        &self,
        job: &Job<'_, '_>,
        planned: &Planned,
        forced: bool,
    ) -> Result<Prepared, Error> {
        let pkg = job.pkg;
        let parent = match Parent::of(self.root_fd(), self.root.path()).with_ctx(step(
            pkg,
            "inspecting the subvolume holding the volumes root",
        ))? {
            Ok(p) => p,
            Err(reason) => return Ok(Prepared::Clone(reason)),
        };
        let keep = parent.keep(&job.names.live);
        let st = sys::stat(job.src.as_fd()).with_ctx(step(pkg, "stat of the volume"))?;
        if parent.holds_nested(st.ino) {
            return Ok(Prepared::Clone(CloneReason::NestedSubvolumes));
        }
        let lifted = sys::read_dir_names(job.src.as_fd())
            .with_ctx(step(pkg, "reading the volume"))?
            .len() as u64;
        // The schedule counted the rest outside the packages; what the
        // snapshot holds of the other packages leaves it in the background,
        // which checks its own space.
        let rest = match planned.cut {
            Some(cut) if !forced => Estimate {
                entries: cut.entries,
                extents: cut.extents,
                ..Estimate::default()
            },
            _ => {
                let stop = AtomicBool::new(false);
                let mut skip = HashSet::from([(st.dev, st.ino)]);
                skip.extend(&parent.garbage);
                let rest = scan_within(
                    parent.root.as_fd(),
                    Limits {
                        stop: &stop,
                        max_work: u64::MAX,
                        weights: Weights::UNIT,
                        skip: Some(&skip),
                        one_device: true,
                        in_place: true,
                    },
                )
                .with_ctx(step(
                    pkg,
                    "counting the rest of the volumes root's subvolume",
                ))?;
                if rest.in_place > 0 {
                    return Ok(Prepared::Clone(CloneReason::InPlaceFiles {
                        files: rest.in_place,
                    }));
                }
                rest.est
            }
        };
        let plan = ParentPlan {
            root: parent.root,
            keep,
            ino: st.ino,
            rest,
            lifted,
        };
        match plan.check_space(&job.space, job.room.reserve) {
            Ok(()) => Ok(Prepared::Carve(plan)),
            Err(why) if forced => Err(Error::for_package(
                pkg,
                ErrorKind::MigrationFailed,
                format!("{why}; nothing was changed"),
            )),
            Err(why) => Ok(Prepared::Clone(CloneReason::Space { why })),
        }
    }

    /// The metadata bytes the filesystem holding the root can still take,
    /// and the reserve `opts` keeps, as [`Migrator::convert`] reads them
    /// before converting; for a dry run to show beside the estimates'
    /// [`Estimate::metadata_bytes`]. Off btrfs, `None`.
    pub fn metadata_room(&self, opts: &MigrateOptions) -> Result<Option<MetadataRoom>, Error> {
        if !self.root.is_btrfs() {
            return Ok(None);
        }
        sys::metadata_space(self.root_fd())
            .map(|space| {
                Some(MetadataRoom {
                    free: space.free(),
                    reserve: opts.reserve(&space),
                })
            })
            .with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    format!(
                        "reading the metadata space of the filesystem holding {}",
                        self.root.path().display()
                    ),
                )
            })
    }

    /// The metadata space of the filesystem (see [`sys::MetadataSpace`]).
    fn metadata_space(&self, pkg: &PackageId) -> Result<sys::MetadataSpace, Error> {
        sys::metadata_space(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the filesystem's metadata space"),
            )
        })
    }
}

/// What [`Migrator::prepare_carve`] found.
enum Prepared {
    /// The cut can go ahead.
    Carve(ParentPlan),
    /// It cannot, for this reason.
    Clone(CloneReason),
}

/// The free metadata space of the filesystem holding the volumes root, as
/// read before a conversion, and the reserve to keep on top of what it
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MetadataRoom {
    /// New metadata the filesystem can take ([`sys::MetadataSpace::free`]).
    pub free: u64,
    /// What must stay free beyond a conversion's estimate
    /// ([`MigrateOptions::reserve`]).
    pub reserve: u64,
}

impl MetadataRoom {
    /// Whether the free space covers converting `est`; see
    /// [`Migrator::convert`].
    pub(crate) fn check(&self, est: &Estimate) -> Result<(), String> {
        if self.free < self.need(est) {
            return Err(self.shortfall(est));
        }
        Ok(())
    }

    /// What converting `est` needs, the reserve included.
    pub fn need(&self, est: &Estimate) -> u64 {
        est.metadata_bytes().saturating_add(self.reserve)
    }

    /// Why `est` does not fit, with the figures.
    fn shortfall(&self, est: &Estimate) -> String {
        format!(
            "not enough free metadata space to convert: {} bytes free, {} needed \
             ({} extents, {} entries, plus {} reserved)",
            self.free,
            self.need(est),
            est.extents,
            est.entries,
            self.reserve
        )
    }
}
