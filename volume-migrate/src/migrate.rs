//! The conversion itself (Linux only).

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::ScopedJoinHandle;
use std::time::{Duration, Instant};

use crate::carve::{self, CarveEvent};
use models::{Error, ErrorKind, PackageId, ResultExt};
use serde::Serialize;
use volume::copy::{self, CopyEvent, CopyOptions};
use volume::layout::{MIGRATE_OLD_SUFFIX, MIGRATE_PARENT_SUFFIX, MIGRATE_SUFFIX, package_of};
use volume::lock::PackageLock;
use volume::sys;

use crate::scan::{ExtentsByInode, Limits, scan, scan_within};
use crate::{Estimate, Method, Phase, Progress, ProgressSink};
use volume::failpoint::failpoint;

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
/// [`Method::Auto`] clones a package with less work than this (entries plus
/// extent items): its clone takes a fraction of a second (about 30 us an
/// entry, 7 us an extent), not worth snapshotting the parent for.
pub const PARENT_MIN_WORK: u64 = 4096;
/// [`Method::Auto`] snapshots the parent subvolume only if everything else
/// in it is at most this much work (entries plus extent items), and at most
/// half the package's. Removing that from the snapshot then costs about as
/// much as cloning as many entries, well under a second; counting it stops
/// here too (a directory is listed whole before its entries are counted),
/// so deciding costs little whatever the parent holds. The package's top
/// entries, each renamed by the cut, count as part of it.
pub const PARENT_MAX_REST: u64 = 16_384;

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
        }
    }
}

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
    /// Upstream's numeric [`ErrorKind`] code.
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

/// How often a conversion starts a background commit while cloning (see
/// [`Migrator::convert`]): often enough that the final, waited-for commit is
/// short, rarely enough that commits do not dominate. Measured once, with a
/// temporary knob, on the bench's 500k-extent file: the final commit took a
/// median of 42.6 ms at 500 ms and 18.3 ms at 250 ms, the clone 2.99 s at
/// both.
const BACKGROUND_COMMIT_EVERY: Duration = Duration::from_millis(250);

/// The result of converting one package ([`Migrator::convert`]).
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
    /// Whether an interrupted earlier run's partial copy was reused.
    pub resumed: bool,
    /// Bytes cloned by this run (a resumed run skips what was in place).
    pub bytes_cloned: u64,
    /// Entries an earlier run had already copied and this one kept.
    pub entries_reused: u64,
    /// Whether the old directory is gone (else `<pkg>.migrate-old` remains
    /// for [`Migrator::remove_old`]).
    pub old_removed: bool,
    /// Wall time of this call.
    #[serde(serialize_with = "ser_ms")]
    pub elapsed: Duration,
    /// For [`Outcome::Failed`].
    pub error: Option<ReportError>,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// One package the conversion would touch ([`Migrator::plan`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanEntry {
    /// The package.
    pub package: PackageId,
    /// The scan of its plain directory; `None` when only leftovers of an
    /// interrupted run remain (finishing them is cheap, except removing an
    /// old directory).
    pub estimate: Option<Estimate>,
    /// The method [`Method::Auto`] would use now, for a plain directory (the
    /// estimate is a clone's: snapshotting the parent takes milliseconds).
    pub method: Option<Method>,
    /// Whether a partial copy from an interrupted run is there to resume.
    pub resume: bool,
    /// Whether an old directory waits for removal.
    pub old_pending: bool,
}

/// What `<root>/<name>` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Absent,
    Dir,
    Subvolume,
    Other,
}

/// Converts the plain directories under one volumes root. Open it with
/// [`Migrator::open`]; every method takes the package's volume lock.
///
/// The root itself is trusted; everything inside a volume is not: names are
/// resolved relative to open directories, nothing is followed through a
/// symlink, only directories and regular files are ever opened.
pub struct Migrator {
    root: PathBuf,
    dir: OwnedFd,
    dev: u64,
    btrfs: bool,
}

fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

impl Migrator {
    /// Opens the volumes root. `NotFound` if it does not exist,
    /// `InvalidRequest` if it is not a directory. Works on any filesystem;
    /// off btrfs every call does nothing ([`Migrator::is_btrfs`]).
    pub fn open(root: impl AsRef<Path>) -> Result<Self, Error> {
        let (canonical, dir) = volume::open_root(root)?;
        let st = sys::stat(dir.as_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("stat {}", canonical.display()),
            )
        })?;
        let btrfs = sys::is_btrfs(dir.as_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("statfs {}", canonical.display()),
            )
        })?;
        Ok(Migrator {
            root: canonical,
            dir,
            dev: st.dev,
            btrfs,
        })
    }

    /// The canonical volumes root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the root is on btrfs. If not, there is nothing to convert and
    /// every call reports nothing.
    pub fn is_btrfs(&self) -> bool {
        self.btrfs
    }

    fn root_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
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

    /// Packages with anything for the conversion to do, sorted: `<pkg>` a
    /// plain directory, or a `<pkg>.migrate`, `<pkg>.migrate-parent` or
    /// `<pkg>.migrate-old` left by an interrupted run. Empty off btrfs.
    pub fn packages(&self) -> Result<Vec<PackageId>, Error> {
        if !self.btrfs {
            return Ok(Vec::new());
        }
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.display()),
            )
        })?;
        let mut out = Vec::new();
        for (name, _, _) in entries {
            let Some(pkg) = package_of(&name) else {
                continue;
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
                            self.root.join(&name).display()
                        );
                        false
                    }
                    Kind::Subvolume | Kind::Absent => false,
                }
            } else {
                [MIGRATE_SUFFIX, MIGRATE_PARENT_SUFFIX, MIGRATE_OLD_SUFFIX]
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

    /// What a run would do, per package, with the scan of each plain
    /// directory (a dry run). Changes nothing.
    pub fn plan(&self) -> Result<Vec<PlanEntry>, Error> {
        let mut out = Vec::new();
        for package in self.packages()? {
            let pkg = &package;
            let names = Names::new(pkg);
            let _lock = self.lock(pkg)?;
            let io = |what: &'static str| {
                move |_: &io::Error| (ErrorKind::Filesystem, pkg.context(what))
            };
            let live = self
                .kind(&names.live)
                .with_ctx(io("inspecting the volume"))?;
            let tmp = self
                .kind(&names.tmp)
                .with_ctx(io("inspecting the partial copy"))?;
            let parent = self
                .kind(&names.parent)
                .with_ctx(io("inspecting the parent snapshot"))?;
            let old = self
                .kind(&names.old)
                .with_ctx(io("inspecting the old directory"))?;
            let (estimate, method) = if live == Kind::Dir {
                let fd = sys::open_dir_at(self.root_fd(), &names.live)
                    .with_ctx(io("opening the volume"))?;
                // Data still in the page cache has no extents yet. A commit
                // changes nothing anyone can see.
                sys::commit(fd.as_fd()).with_ctx(io("flushing the volume"))?;
                let estimate = scan(fd.as_fd(), &AtomicBool::new(false))
                    .with_ctx(io("scanning the volume"))?
                    .0;
                let space = self.metadata_space(pkg)?;
                let reserve = MigrateOptions::default().reserve(&space);
                let method = match self.auto_parent(pkg, &names, &fd, tmp, &space, reserve) {
                    Some(_) => Method::SnapshotParent,
                    None => Method::Clone,
                };
                (Some(estimate), Some(method))
            } else {
                (None, None)
            };
            out.push(PlanEntry {
                package: pkg.clone(),
                estimate,
                method,
                resume: live == Kind::Dir && tmp == Kind::Subvolume,
                old_pending: old != Kind::Absent
                    || ((tmp == Kind::Dir || parent == Kind::Dir) && live != Kind::Dir),
            });
        }
        Ok(out)
    }

    fn lock(&self, pkg: &PackageId) -> Result<PackageLock, Error> {
        PackageLock::for_package(self.root_fd(), pkg).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("taking the package lock"),
            )
        })
    }

    /// Converts every package of [`Migrator::packages`], one after the
    /// other, calling `on_done` with each report as soon as that package is
    /// done (so its service can start), then, with `opts.remove_old`,
    /// removes the old directories. A failing package does not stop the
    /// others: its report says why. Fails only if the root cannot be read.
    pub fn run(
        &self,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
        on_done: &mut dyn FnMut(&PackageReport),
    ) -> Result<Vec<PackageReport>, Error> {
        let mut reports = Vec::new();
        for pkg in self.packages()? {
            let started = Instant::now();
            let report = self
                .convert(&pkg, opts, sink)
                .unwrap_or_else(|e| PackageReport {
                    package: pkg.clone(),
                    outcome: Outcome::Failed,
                    estimate: None,
                    method: None,
                    resumed: false,
                    bytes_cloned: 0,
                    entries_reused: 0,
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

    /// Removes every `<pkg>.migrate-old` left under the root; the second
    /// phase, fine to run while services run. Returns the packages cleaned.
    pub fn remove_all_old(&self, sink: &mut dyn ProgressSink) -> Result<Vec<PackageId>, Error> {
        let mut done = Vec::new();
        for pkg in self.packages()? {
            if self.remove_old(&pkg, sink)? {
                done.push(pkg);
            }
        }
        Ok(done)
    }

    /// Removes `<pkg>.migrate-old`, the plain directory a conversion
    /// replaced: O(extents), entry by entry (nested subvolumes in O(1)).
    /// Returns whether there was one. It only ever holds data the converted
    /// `<pkg>` also has, so a crash part-way is harmless: the rest is
    /// removed by the next call. (An immutable or append-only file also
    /// linked from outside it keeps its flags, cleared for the unlink and
    /// put back; a crash in between leaves them off that other name.) Also
    /// finishes an exchange whose rename aside was interrupted.
    pub fn remove_old(&self, pkg: &PackageId, sink: &mut dyn ProgressSink) -> Result<bool, Error> {
        if !self.btrfs {
            return Ok(false);
        }
        let names = Names::new(pkg);
        let _lock = self.lock(pkg)?;
        self.settle_exchanged(pkg, &names)?;
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        if self
            .kind(&names.old)
            .with_ctx(io("inspecting the old directory"))?
            == Kind::Absent
        {
            return Ok(false);
        }
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        tracker.phase(Phase::RemoveOld);
        copy::remove_tree_at(self.root_fd(), &names.old, &mut |n| {
            tracker.entries(n);
            failpoint("migrate.remove")
        })
        .and_then(|()| sys::fsync(self.root_fd()))
        .with_ctx(io("removing the old directory"))?;
        tracker.phase(Phase::Done);
        tracing::info!(package = %pkg, "old plain volume directory removed");
        Ok(true)
    }

    /// After the exchange, `<pkg>.migrate` (or `<pkg>.migrate-parent`) is
    /// the old plain directory: move it to `<pkg>.migrate-old`. A subvolume
    /// under either name beside no plain `<pkg>` is a partial copy whose
    /// source is gone: removed. Returns whether an old directory was moved.
    fn settle_exchanged(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        let live = self
            .kind(&names.live)
            .with_ctx(io("inspecting the volume"))?;
        if live == Kind::Dir {
            return Ok(false);
        }
        let mut moved = false;
        for tmp in [&names.tmp, &names.parent] {
            match self.kind(tmp).with_ctx(io("inspecting the partial copy"))? {
                Kind::Dir => {
                    if self
                        .kind(&names.old)
                        .with_ctx(io("inspecting the old directory"))?
                        != Kind::Absent
                    {
                        copy::remove_tree_at(self.root_fd(), &names.old, &mut |_| Ok(()))
                            .with_ctx(io("removing an older old directory"))?;
                    }
                    sys::rename_noreplace(self.root_fd(), tmp, &names.old)
                        .and_then(|()| sys::fsync(self.root_fd()))
                        .with_ctx(io("moving the old directory aside"))?;
                    failpoint("migrate.old-renamed").with_ctx(io("failpoint"))?;
                    moved = true;
                }
                Kind::Subvolume => {
                    // A partial copy whose source is gone or was replaced by
                    // a subvolume (a volume operation since): worthless.
                    copy::remove_tree_at(self.root_fd(), tmp, &mut |_| Ok(()))
                        .and_then(|()| sys::fsync(self.root_fd()))
                        .with_ctx(io("removing a stale partial copy"))?;
                }
                Kind::Absent | Kind::Other => {}
            }
        }
        Ok(moved)
    }

    /// Converts `<pkg>`, if it is a plain directory, into a subvolume with
    /// the same contents and attributes, leaving the old directory as
    /// `<pkg>.migrate-old` for [`Migrator::remove_old`]. Resumes or finishes
    /// whatever an interrupted run left. Off btrfs, or with `<pkg>` already a
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
    /// finishes ([`Progress::totals_known`]). The reserve alone is checked
    /// before anything is created; the full estimate as soon as the scan
    /// has it, and if short the clone stops there, the partial subvolume is
    /// removed, and `<pkg>` is untouched, as for an ENOSPC. A dry run scans
    /// only.
    ///
    /// The method ([`MigrateOptions::method`]): [`Method::Auto`] resumes an
    /// interrupted clone, and otherwise snapshots the parent subvolume when
    /// all of these hold, else clones:
    /// - the package is at least [`PARENT_MIN_WORK`] entries and extent
    ///   items;
    /// - the root of the subvolume holding the volumes root is reachable
    ///   from the volumes root's mount by `..`, and nothing is mounted below
    ///   it (a mount hides what the snapshot would hold);
    /// - no subvolume is nested in the package;
    /// - everything else in that subvolume (other packages' plain
    ///   directories, old directories waiting for removal, whatever else it
    ///   holds; a nested subvolume counts as one entry, its placeholder),
    ///   plus the package's top entries (each renamed), is at most
    ///   [`PARENT_MAX_REST`] and at most half the package's work;
    /// - none of it is a NOCOW file or has preallocated extents: once a
    ///   subvolume has been snapshotted, btrfs copies such extents on their
    ///   next write, which their owners did not plan space for.
    ///
    /// The free metadata space must cover a node per entry removed or
    /// lifted, 128 bytes per extent item removed, and the reserve. Should
    /// deciding fail, space be short, or the cut fail for any reason but
    /// ENOSPC, Auto deletes the snapshot and clones instead (if the snapshot
    /// cannot be deleted, that is the error).
    /// [`Method::SnapshotParent`] forces the method without the size rules:
    /// `InvalidRequest` where another rule is not met.
    ///
    /// A crash at any point leaves `<pkg>` complete (old or new); see the
    /// crate docs for what the next run does.
    pub fn convert(
        &self,
        pkg: &PackageId,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
    ) -> Result<PackageReport, Error> {
        let started = Instant::now();
        let mut report = PackageReport {
            package: pkg.clone(),
            outcome: Outcome::AlreadySubvolume,
            estimate: None,
            method: None,
            resumed: false,
            bytes_cloned: 0,
            entries_reused: 0,
            old_removed: false,
            elapsed: Duration::ZERO,
            error: None,
        };
        if !self.btrfs {
            return Ok(report);
        }
        let names = Names::new(pkg);
        let lock = self.lock(pkg)?;
        if !opts.dry_run {
            // A restore, snapshot or delete of the volume store cut short is
            // finished first: converting a volume a restore has recorded
            // would change the identity its recovery goes by.
            volume::VolumeStore::open_without_recovery(&self.root)?.recover_held(pkg, &lock)?;
        }
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        let live = self
            .kind(&names.live)
            .with_ctx(io("inspecting the volume"))?;
        let tmp = self
            .kind(&names.tmp)
            .with_ctx(io("inspecting the partial copy"))?;
        let parent = self
            .kind(&names.parent)
            .with_ctx(io("inspecting the parent snapshot"))?;
        let incoherent = [(&names.tmp, tmp), (&names.parent, parent)]
            .into_iter()
            .find(|&(_, kind)| kind == Kind::Other || (live, kind) == (Kind::Dir, Kind::Dir));
        if let Some((name, _)) = incoherent {
            return Err(Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "{} is neither a partial copy nor the old directory; move it away",
                    self.root.join(name).display()
                ),
            ));
        }
        match (live, tmp) {
            (Kind::Other, _) => {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    format!(
                        "{} is not a directory",
                        self.root.join(&names.live).display()
                    ),
                ));
            }
            (Kind::Dir, _) => {}
            (_, _) => {
                if !opts.dry_run && self.settle_exchanged(pkg, &names)? {
                    report.outcome = Outcome::Finished;
                }
                report.elapsed = started.elapsed();
                return Ok(report);
            }
        }

        // `<pkg>` is a plain directory.
        if parent == Kind::Subvolume && !opts.dry_run {
            // An interrupted cut, holding a copy of the whole parent: drop it
            // before anything else (a new snapshot costs nothing).
            copy::remove_tree_at(self.root_fd(), &names.parent, &mut |_| Ok(()))
                .and_then(|()| sys::fsync(self.root_fd()))
                .with_ctx(io("removing an interrupted parent snapshot"))?;
        }
        let live_path = self.root.join(&names.live);
        let busy = volume::mounts::uses_of(&live_path).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })?;
        if !busy.is_empty() {
            return Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} is in use, mounted at {}; unmount it first",
                    live_path.display(),
                    volume::mounts::describe(&busy)
                ),
            ));
        }
        let src =
            sys::open_dir_at(self.root_fd(), &names.live).with_ctx(io("opening the volume"))?;
        let src_st = sys::stat(src.as_fd()).with_ctx(io("stat of the volume"))?;
        if src_st.dev != self.dev
            || !sys::is_btrfs(src.as_fd()).with_ctx(io("statfs of the volume"))?
        {
            return Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} is on another filesystem than the volumes root {}",
                    live_path.display(),
                    self.root.display()
                ),
            ));
        }

        // Scan: data still in the page cache has no extents yet, so flush.
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        tracker.phase(Phase::Scan);
        sys::commit(src.as_fd()).with_ctx(io("flushing the volume"))?;
        if opts.dry_run {
            let (estimate, _) =
                scan(src.as_fd(), &AtomicBool::new(false)).with_ctx(io("scanning the volume"))?;
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
        let short = |why: String| {
            Error::for_package(
                pkg,
                ErrorKind::MigrationFailed,
                format!("{why}; nothing was changed"),
            )
        };
        if room.check(&Estimate::default()).is_err() {
            // Short of the reserve alone: count the package too, so the
            // refusal gives what it really needs.
            let (estimate, _) =
                scan(src.as_fd(), &AtomicBool::new(false)).with_ctx(io("scanning the volume"))?;
            report.estimate = Some(estimate);
            return Err(short(room.shortfall(&estimate)));
        }

        let parent_plan = match opts.method {
            Method::Clone => None,
            Method::Auto => self.auto_parent(pkg, &names, &src, tmp, &space, opts.reserve(&space)),
            Method::SnapshotParent => {
                let plan = self.plan_parent(pkg, &names, &src, false)?.map_err(|why| {
                    Error::for_package(
                        pkg,
                        ErrorKind::InvalidRequest,
                        format!(
                            "cannot convert {} by snapshotting its parent: {why}",
                            live_path.display()
                        ),
                    )
                })?;
                plan.check_space(&space, opts.reserve(&space))
                    .map_err(short)?;
                if tmp == Kind::Subvolume {
                    copy::remove_tree_at(self.root_fd(), &names.tmp, &mut |_| Ok(()))
                        .with_ctx(io("removing a partial copy"))?;
                }
                Some(plan)
            }
        };
        if let Some(plan) = parent_plan {
            match self.carve_parent(&names, plan, &mut tracker) {
                Ok(carved) => {
                    self.swap_in(pkg, &names, &names.parent, carved, &mut tracker)?;
                    report.method = Some(Method::SnapshotParent);
                    report.outcome = Outcome::Converted;
                    report.elapsed = started.elapsed();
                    return Ok(report);
                }
                Err(failure) => {
                    if opts.method != Method::Auto || !failure.can_clone() {
                        return Err(failure.into_error(pkg, &live_path));
                    }
                    let e = failure.into_error(pkg, &live_path);
                    tracing::warn!(package = %pkg, error = %e, "cutting a parent snapshot failed: cloning instead");
                }
            }
        }

        // The scan (a stat and a tree search per file) runs on a second
        // thread while the clone starts: it only feeds the progress totals
        // and the space check, so it need not delay the clone.
        let stop_scan = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let src_fd = src.as_fd();
            let stop = &stop_scan;
            let scanner = scope.spawn(move || scan(src_fd, stop));
            let result = self.clone_and_swap(
                pkg,
                &names,
                tmp,
                &src,
                opts,
                room,
                &mut tracker,
                &mut report,
                scanner,
            );
            stop_scan.store(true, Ordering::Relaxed);
            result
        })?;
        report.method = Some(Method::Clone);
        report.outcome = Outcome::Converted;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// [`Migrator::convert`] from the clone on, with the scan of `src`
    /// running as `scanner`.
    #[allow(clippy::too_many_arguments)]
    fn clone_and_swap(
        &self,
        pkg: &PackageId,
        names: &Names,
        tmp: Kind,
        src: &OwnedFd,
        opts: &MigrateOptions,
        room: MetadataRoom,
        tracker: &mut Tracker<'_>,
        report: &mut PackageReport,
        scanner: ScopedJoinHandle<'_, io::Result<(Estimate, ExtentsByInode)>>,
    ) -> Result<(), Error> {
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        let live_path = self.root.join(&names.live);
        let mut scanner = Some(scanner);
        // Why the scan stopped the clone, when it did.
        let mut scan_failure: Option<ScanFailure> = None;
        // Takes the finished scan's result: totals to the tracker, the
        // estimate to the report, and the space check.
        let take_scan = |scanner: ScopedJoinHandle<'_, _>,
                         tracker: &mut Tracker<'_>,
                         report: &mut PackageReport|
         -> Option<ScanFailure> {
            let result = match scanner.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            match result {
                Err(e) => Some(ScanFailure::Io(e)),
                Ok((estimate, per_file)) => {
                    report.estimate = Some(estimate);
                    tracker.scanned(estimate, per_file);
                    room.check(&estimate).err().map(ScanFailure::Space)
                }
            }
        };

        // Clone.
        let mut resume = tmp == Kind::Subvolume;
        let mut dst = None;
        if resume {
            let fd = sys::open_dir_at(self.root_fd(), &names.tmp)
                .with_ctx(io("opening the partial copy"))?;
            let since = sys::birth_time(fd.as_fd())
                .with_ctx(io("reading the partial copy's creation time"))?;
            let src_full = sys::metadata(src.as_fd()).with_ctx(io("stat of the volume"))?;
            #[allow(clippy::unnecessary_cast)]
            let src_ctime = (src_full.st_ctime as i64, src_full.st_ctime_nsec as i64);
            match since {
                Some(t) if src_ctime < t => dst = Some((fd, Some(t))),
                _ => {
                    tracing::warn!(package = %pkg, "volume changed since the partial copy was started: starting over");
                    drop(fd);
                    copy::remove_tree_at(self.root_fd(), &names.tmp, &mut |_| Ok(()))
                        .with_ctx(io("removing an outdated partial copy"))?;
                    resume = false;
                }
            }
        }
        let (dst, since) = match dst {
            Some(d) => d,
            None => {
                // Not made durable here: a power cut that loses it loses
                // only the start of the copy (the subvolume and its name go
                // together, in one transaction), which the next run redoes;
                // the first background commit comes a fraction of a second
                // later. The whole-filesystem commit before the exchange is
                // what makes the name durable: an fsync of the subvolume
                // alone would not. Syncing here took 11-17 ms (measured once).
                sys::create_subvolume(self.root_fd(), &names.tmp).with_ctx(|_| {
                    (
                        ErrorKind::MigrationFailed,
                        pkg.context(format!(
                            "creating subvolume {}",
                            self.root.join(&names.tmp).display()
                        )),
                    )
                })?;
                failpoint("migrate.created").with_ctx(io("failpoint"))?;
                let fd = sys::open_dir_at(self.root_fd(), &names.tmp)
                    .with_ctx(io("opening the new subvolume"))?;
                (fd, None)
            }
        };
        report.resumed = resume;
        tracker.phase(Phase::Clone);
        let copy_opts = CopyOptions {
            resume,
            chunk_bytes: Some(opts.chunk_bytes),
            nested_subvolumes: true,
            changed_since: since,
        };
        let mut poll_scan = |tracker: &mut Tracker<'_>, report: &mut PackageReport| {
            if let Some(h) = scanner.take_if(|h| h.is_finished())
                && let Some(f) = take_scan(h, tracker, report)
            {
                scan_failure = Some(f);
                return Err(io::Error::other("the scan stopped the copy"));
            }
            Ok(())
        };
        // The commit before the exchange must write out every cloned
        // extent reference; starting commits in the background as the clone
        // goes leaves it only the tail to wait for.
        let mut last_commit = Instant::now();
        let dst_fd = dst.as_fd();
        let copied = copy::reflink_into(src.as_fd(), dst.as_fd(), &copy_opts, &mut |ev| {
            if last_commit.elapsed() >= BACKGROUND_COMMIT_EVERY {
                sys::start_commit(dst_fd)?;
                last_commit = Instant::now();
            }
            match ev {
                CopyEvent::Data {
                    src,
                    size,
                    done,
                    cloned,
                    ..
                } => {
                    tracker.file_data(src, size, done, cloned);
                    failpoint("migrate.chunk")?;
                }
                CopyEvent::Entry { .. } => {
                    tracker.entry_done();
                    failpoint("migrate.entry")?;
                }
            }
            poll_scan(tracker, report)
        });
        let copied = match copied {
            // The clone is done before the scan: wait for it, it may still
            // find the space short.
            Ok(stats) => match scanner.take().and_then(|h| take_scan(h, tracker, report)) {
                Some(f) => {
                    scan_failure = Some(f);
                    Err(io::Error::other("the scan stopped the copy"))
                }
                None => Ok(stats),
            },
            Err(e) => Err(e),
        };
        let abandon = |dst: OwnedFd, why: String| -> Error {
            drop(dst);
            let cleanup = copy::remove_tree_at(self.root_fd(), &names.tmp, &mut |_| Ok(()))
                .and_then(|()| sys::commit(self.root_fd()));
            let msg = format!(
                "{why}; {} is untouched{}",
                live_path.display(),
                match &cleanup {
                    Ok(()) => " and the partial subvolume was removed".to_owned(),
                    Err(c) => format!(", but removing the partial subvolume failed: {c}"),
                }
            );
            Error::for_package(pkg, ErrorKind::MigrationFailed, msg)
        };
        let stats = match (copied, scan_failure) {
            (Err(_), Some(ScanFailure::Space(e))) => {
                return Err(abandon(dst, e));
            }
            (Err(_), Some(ScanFailure::Io(e))) => {
                return Err(e).with_ctx(io(
                    "scanning the volume (the partial copy is kept for the next run)",
                ));
            }
            (Err(e), None) if is_enospc(&e) => {
                let why = format!(
                    "out of space while cloning into {} ({e})",
                    self.root.join(&names.tmp).display(),
                );
                return Err(abandon(dst, why));
            }
            (other, _) => other.with_ctx(|_| {
                (
                    ErrorKind::MigrationFailed,
                    pkg.context(format!(
                        "cloning {} into {} (the partial copy is kept for the next run)",
                        live_path.display(),
                        self.root.join(&names.tmp).display()
                    )),
                )
            })?,
        };
        report.bytes_cloned = stats.bytes_cloned;
        report.entries_reused = stats.entries_reused;
        failpoint("migrate.copied").with_ctx(io("failpoint"))?;

        let estimate = report.estimate.unwrap_or_default();
        tracing::info!(package = %pkg, bytes = estimate.bytes, extents = estimate.extents, "volume cloned into a subvolume");
        self.swap_in(pkg, names, &names.tmp, dst, tracker)
    }

    /// The last steps of either method: commit the new subvolume `tmp`
    /// (open as `dst`), exchange it with `<pkg>`, move the old directory to
    /// `<pkg>.migrate-old`.
    fn swap_in(
        &self,
        pkg: &PackageId,
        names: &Names,
        tmp: &OsStr,
        dst: OwnedFd,
        tracker: &mut Tracker<'_>,
    ) -> Result<(), Error> {
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        // Sync: the copy must be durable before its name says "volume".
        tracker.phase(Phase::Sync);
        let committed = sys::commit(dst.as_fd());
        drop(dst);
        let exchanged = committed
            .and_then(|()| failpoint("migrate.durable"))
            .and_then(|()| {
                tracker.phase(Phase::Exchange);
                sys::rename_exchange(self.root_fd(), tmp, &names.live)
            });
        if let Err(e) = exchanged {
            let what = format!(
                "exchanging {} with {}",
                self.root.join(tmp).display(),
                self.root.join(&names.live).display()
            );
            if !is_enospc(&e) {
                return Err(e).with_ctx(|_| (ErrorKind::MigrationFailed, pkg.context(what)));
            }
            // Out of metadata space with the copy complete: a rerun would
            // meet the same wall, so the copy goes and frees what it took.
            let cleanup = copy::remove_tree_at(self.root_fd(), tmp, &mut |_| Ok(()))
                .and_then(|()| sys::fsync(self.root_fd()));
            return Err(Error::for_package(
                pkg,
                ErrorKind::MigrationFailed,
                format!(
                    "out of metadata space {what} ({e}); {} is untouched{}",
                    self.root.join(&names.live).display(),
                    match cleanup {
                        Ok(()) => " and the copy was removed".to_owned(),
                        Err(c) => format!(", but removing the copy failed: {c}"),
                    }
                ),
            ));
        }
        sys::fsync(self.root_fd()).with_ctx(io("syncing the volumes root"))?;
        failpoint("migrate.exchanged").with_ctx(io("failpoint"))?;
        self.settle_exchanged(pkg, names)?;
        tracker.phase(Phase::Done);
        tracing::info!(package = %pkg, "volume converted to a subvolume");
        Ok(())
    }

    /// Whether `<pkg>` (open as `src`) can be converted by snapshotting the
    /// subvolume that holds it, and what that takes; else why not. With
    /// `auto`, also whether that is the cheaper method (see
    /// [`Migrator::convert`]): counting stops at the rule's bounds (the
    /// package up to [`PARENT_MIN_WORK`], the rest up to
    /// [`PARENT_MAX_REST`], then the package up to twice the rest), so this
    /// costs at most a few tens of thousands of entries' worth of stats.
    fn plan_parent(
        &self,
        pkg: &PackageId,
        names: &Names,
        src: &OwnedFd,
        auto: bool,
    ) -> Result<Result<ParentPlan, String>, Error> {
        let io = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::MigrationFailed, pkg.context(what))
        };
        let stop = AtomicBool::new(false);
        // The package's work, counted up to `limit`: whether it reaches it.
        let reaches = |limit: u64| -> Result<bool, Error> {
            let counted = scan_within(
                src.as_fd(),
                Limits {
                    max_work: limit.saturating_sub(1),
                    ..Limits::all(&stop)
                },
            )
            .with_ctx(io("scanning the volume"))?;
            Ok(counted.is_none())
        };
        if auto && !reaches(PARENT_MIN_WORK)? {
            return Ok(Err(format!(
                "the volume is under {PARENT_MIN_WORK} entries and extents: a clone costs less"
            )));
        }
        let Some((root, path)) = sys::subvolume_root_of(self.root_fd())
            .with_ctx(io("looking for the root of the volumes root's subvolume"))?
        else {
            return Ok(Err(format!(
                "the root of the subvolume holding {} is not reachable from its mount",
                self.root.display()
            )));
        };
        // The snapshot holds what mounts hide, which nothing here can count.
        let root_path = sys::fd_path(root.as_fd())
            .with_ctx(io("naming the root of the volumes root's subvolume"))?;
        let hidden = volume::mounts::mount_points_below(&root_path)
            .with_ctx(io("reading /proc/self/mountinfo"))?;
        if !hidden.is_empty() {
            return Ok(Err(format!(
                "{} is mounted inside its subvolume",
                hidden
                    .iter()
                    .map(|m| m.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let keep: PathBuf = path.iter().collect::<PathBuf>().join(&names.live);
        let nested = sys::nested_subvolumes(root.as_fd())
            .with_ctx(io("listing the subvolumes nested in the volumes root's"))?;
        if nested.iter().any(|p| p.starts_with(&keep)) {
            return Ok(Err("the volume holds nested subvolumes".to_owned()));
        }
        let st = sys::stat(src.as_fd()).with_ctx(io("stat of the volume"))?;
        // The cut also renames each of the package's top entries.
        let lifted = sys::read_dir_names(src.as_fd())
            .with_ctx(io("reading the volume"))?
            .len() as u64;
        if auto && lifted > PARENT_MAX_REST {
            return Ok(Err(format!(
                "the volume has {lifted} entries at its top, each to be moved"
            )));
        }
        let max_rest = if auto {
            PARENT_MAX_REST - lifted
        } else {
            u64::MAX
        };
        let rest = scan_within(
            root.as_fd(),
            Limits {
                stop: &stop,
                max_work: max_rest,
                skip: Some((st.dev, st.ino)),
                one_device: true,
                in_place: true,
            },
        )
        .with_ctx(io("counting the rest of the volumes root's subvolume"))?;
        let Some(rest) = rest else {
            return Ok(Err(format!(
                "the rest of its subvolume is more than {max_rest} entries and extents"
            )));
        };
        // The cut's work (what it removes and what it lifts) at most half
        // the package's (the first count went up to the minimum).
        let cut = rest.est.work() + lifted;
        let twice = cut.saturating_mul(2);
        if auto && twice > PARENT_MIN_WORK && !reaches(twice)? {
            return Ok(Err(format!(
                "cutting the snapshot ({} entries and extents beside the volume, {lifted} to \
                 lift) would cost more than half a clone",
                rest.est.work()
            )));
        }
        if rest.in_place > 0 {
            return Ok(Err(format!(
                "the rest of its subvolume holds {} NOCOW or preallocated files, which a \
                 snapshot would make copy their data on the next write",
                rest.in_place
            )));
        }
        Ok(Ok(ParentPlan {
            root,
            keep,
            ino: st.ino,
            rest: rest.est,
            lifted,
        }))
    }

    /// [`Method::Auto`]'s parent snapshot for the plain `<pkg>` (open as
    /// `src`, with `<pkg>.migrate` of kind `tmp`): `Some` when every rule of
    /// [`Migrator::convert`] holds and `space` covers the cut with `reserve`
    /// on top, else `None` (a partial clone to resume, or why not, logged).
    /// Deciding reads the rest of the parent, which anything may be
    /// changing: whatever goes wrong there, a clone still works.
    fn auto_parent(
        &self,
        pkg: &PackageId,
        names: &Names,
        src: &OwnedFd,
        tmp: Kind,
        space: &sys::MetadataSpace,
        reserve: u64,
    ) -> Option<ParentPlan> {
        if tmp != Kind::Absent {
            return None;
        }
        let why = match self.plan_parent(pkg, names, src, true) {
            Ok(Ok(plan)) => match plan.check_space(space, reserve) {
                Ok(()) => return Some(plan),
                Err(why) => why,
            },
            Ok(Err(why)) => why,
            Err(e) => {
                tracing::warn!(package = %pkg, error = %e, "cloning: sizing up the parent subvolume failed");
                return None;
            }
        };
        tracing::debug!(package = %pkg, "cloning, not snapshotting the parent: {why}");
        None
    }

    /// [`Method::SnapshotParent`] up to the exchange: snapshots the parent
    /// subvolume as `<pkg>.migrate-parent` and cuts it down to `<pkg>`
    /// ([`carve::carve`]). On failure the snapshot is deleted (O(1)).
    fn carve_parent(
        &self,
        names: &Names,
        plan: ParentPlan,
        tracker: &mut Tracker<'_>,
    ) -> Result<OwnedFd, CarveFailure> {
        tracker.set_estimate(plan.rest);
        tracker.phase(Phase::Carve);
        let snapshot = self.root.join(&names.parent);
        sys::snapshot(plan.root.as_fd(), self.root_fd(), &names.parent).map_err(|error| {
            CarveFailure {
                what: format!("snapshotting its subvolume as {}", snapshot.display()),
                error,
                cleanup: Ok(()),
            }
        })?;
        drop(plan.root);
        let result = failpoint("migrate.parent-snapshot")
            .and_then(|()| sys::open_dir_at(self.root_fd(), &names.parent))
            .and_then(|fd| {
                // The path was read before the snapshot: it must still lead
                // to the volume (the same inode in the snapshot).
                if sys::stat(sys::open_beneath(fd.as_fd(), &plan.keep)?.as_fd())?.ino != plan.ino {
                    return Err(io::Error::other(format!(
                        "{} in the snapshot is not the volume; was it moved?",
                        plan.keep.display()
                    )));
                }
                carve::carve(fd.as_fd(), &plan.keep, &mut |ev| match ev {
                    CarveEvent::Held => failpoint("migrate.carve-held"),
                    CarveEvent::Removed(n) => {
                        tracker.entries(n);
                        failpoint("migrate.carve-removed")
                    }
                    CarveEvent::Lifted(_) => failpoint("migrate.carve-lifted"),
                })?;
                Ok(fd)
            });
        result.map_err(|error| CarveFailure {
            what: format!("cutting {} down to the volume", snapshot.display()),
            error,
            cleanup: copy::remove_tree_at(self.root_fd(), &names.parent, &mut |_| Ok(()))
                .and_then(|()| sys::fsync(self.root_fd())),
        })
    }

    /// The metadata bytes the filesystem holding the root can still take,
    /// and the reserve `opts` keeps, as [`Migrator::convert`] reads them
    /// before converting; for a dry run to show beside the estimates'
    /// [`Estimate::metadata_bytes`]. Off btrfs, `None`.
    pub fn metadata_room(&self, opts: &MigrateOptions) -> Result<Option<MetadataRoom>, Error> {
        if !self.btrfs {
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
                        self.root.display()
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
    fn check(&self, est: &Estimate) -> Result<(), String> {
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

/// What [`Method::SnapshotParent`] needs, from [`Migrator::plan_parent`].
struct ParentPlan {
    /// The root of the subvolume holding the volumes root.
    root: OwnedFd,
    /// `<pkg>`'s path from there.
    keep: PathBuf,
    /// `<pkg>`'s inode number.
    ino: u64,
    /// What the subvolume holds beside `<pkg>`: what the cut removes.
    rest: Estimate,
    /// `<pkg>`'s entries: what the cut lifts to the new root.
    lifted: u64,
}

impl ParentPlan {
    /// Whether the free metadata space covers the cut. Removing from a fresh
    /// snapshot copies each shared leaf it touches on write (and adds back
    /// references for every extent in it): at worst a leaf per entry
    /// removed or lifted, plus the extent items, plus `reserve`.
    fn check_space(&self, space: &sys::MetadataSpace, reserve: u64) -> Result<(), String> {
        let need = (self.rest.entries + self.lifted)
            .saturating_mul(space.node_size)
            .saturating_add(self.rest.extents.saturating_mul(128))
            .saturating_add(reserve);
        if space.free() < need {
            return Err(format!(
                "not enough free metadata space to cut a snapshot of the parent down: {} bytes \
                 free, {need} needed ({} entries and {} extents to remove, {} to lift, plus {} \
                 reserved)",
                space.free(),
                self.rest.entries,
                self.rest.extents,
                self.lifted,
                reserve
            ));
        }
        Ok(())
    }
}

/// Why [`Migrator::carve_parent`] did not carve: the step that failed,
/// and whether the snapshot is gone.
struct CarveFailure {
    what: String,
    error: io::Error,
    cleanup: io::Result<()>,
}

impl CarveFailure {
    /// Whether [`Method::Auto`] may clone instead: the snapshot is gone and
    /// space did not run out.
    fn can_clone(&self) -> bool {
        self.cleanup.is_ok() && !is_enospc(&self.error)
    }

    fn into_error(self, pkg: &PackageId, live: &Path) -> Error {
        let msg = format!(
            "{}: {}; {} is untouched{}",
            self.what,
            self.error,
            live.display(),
            match self.cleanup {
                Ok(()) => " and the snapshot was deleted".to_owned(),
                Err(c) => format!(", but deleting the snapshot failed: {c}"),
            }
        );
        Error::for_package(pkg, ErrorKind::MigrationFailed, msg)
    }
}

/// Why the scan stopped a clone.
enum ScanFailure {
    /// The scan itself failed.
    Io(io::Error),
    /// The scan's estimate does not fit in the free space: why.
    Space(String),
}

/// The names one package's conversion uses.
struct Names {
    live: OsString,
    tmp: OsString,
    parent: OsString,
    old: OsString,
}

impl Names {
    fn new(pkg: &PackageId) -> Self {
        Names {
            live: OsString::from(pkg.as_str()),
            tmp: OsString::from(format!("{pkg}{MIGRATE_SUFFIX}")),
            parent: OsString::from(format!("{pkg}{MIGRATE_PARENT_SUFFIX}")),
            old: OsString::from(format!("{pkg}{MIGRATE_OLD_SUFFIX}")),
        }
    }
}

/// Turns copy events into throttled [`Progress`] reports with an ETA.
///
/// The scan runs beside the clone, so the per-file extent counts may arrive
/// after some files are cloned: until then their data events wait in
/// `pending` (bytes are credited at once), then are credited as if the
/// counts had been known all along.
struct Tracker<'s> {
    p: Progress,
    sink: &'s mut dyn ProgressSink,
    started: Instant,
    /// Work done when this run started cloning (resumed work is not a rate).
    work_at_start: Option<u64>,
    /// Work credited for what an earlier run had done.
    reused_work: u64,
    last_sent: Option<Instant>,
    /// Extent items of each file, once the scan is done.
    per_file: Option<ExtentsByInode>,
    /// Data events (file, size, done, cloned) seen before the scan was done.
    pending: Vec<((u64, u64), u64, u64, u64)>,
    /// The file being cloned and the bytes credited so far.
    current_bytes: Option<((u64, u64), u64)>,
    /// The file being cloned and the extents credited so far.
    current_extents: Option<((u64, u64), u64)>,
}

impl<'s> Tracker<'s> {
    fn new(package: PackageId, est: Estimate, sink: &'s mut dyn ProgressSink) -> Self {
        let mut t = Tracker {
            p: Progress {
                package,
                phase: Phase::Scan,
                totals_known: false,
                bytes_done: 0,
                bytes_total: 0,
                extents_done: 0,
                extents_total: 0,
                entries_done: 0,
                entries_total: 0,
                eta: None,
            },
            sink,
            started: Instant::now(),
            work_at_start: None,
            reused_work: 0,
            last_sent: None,
            per_file: None,
            pending: Vec::new(),
            current_bytes: None,
            current_extents: None,
        };
        t.set_estimate(est);
        t
    }

    fn set_estimate(&mut self, est: Estimate) {
        self.p.bytes_total = est.bytes;
        self.p.extents_total = est.extents;
        self.p.entries_total = est.entries;
    }

    /// The scan is done: totals known, waiting events credited.
    fn scanned(&mut self, est: Estimate, per_file: ExtentsByInode) {
        self.set_estimate(est);
        self.p.totals_known = true;
        self.per_file = Some(per_file);
        for (key, size, done, cloned) in std::mem::take(&mut self.pending) {
            self.credit_extents(key, size, done, cloned);
        }
        self.send();
    }

    fn phase(&mut self, phase: Phase) {
        self.p.phase = phase;
        if phase == Phase::Done {
            self.p.eta = Some(Duration::ZERO);
        }
        self.send();
    }

    fn file_data(&mut self, key: (u64, u64), size: u64, done: u64, cloned: u64) {
        let prev = match self.current_bytes {
            Some((k, b)) if k == key => b,
            _ => 0,
        };
        self.p.bytes_done += done.saturating_sub(prev);
        self.current_bytes = Some((key, done));
        if self.per_file.is_some() {
            self.credit_extents(key, size, done, cloned);
        } else {
            self.pending.push((key, size, done, cloned));
        }
        self.maybe_send();
    }

    /// Extents are exact per finished file, proportional to bytes within one.
    fn credit_extents(&mut self, key: (u64, u64), size: u64, done: u64, cloned: u64) {
        let extents = self
            .per_file
            .as_ref()
            .and_then(|m| m.get(&key))
            .copied()
            .unwrap_or(0);
        let prev = match self.current_extents {
            Some((k, e)) if k == key => e,
            _ => 0,
        };
        let ext = if size == 0 {
            extents
        } else {
            (u128::from(extents) * u128::from(done) / u128::from(size)) as u64
        };
        self.p.extents_done += ext.saturating_sub(prev);
        self.current_extents = Some((key, ext));
        if cloned == 0 {
            // What a resumed copy found in place: no measure of speed.
            self.reused_work += ext.saturating_sub(prev);
        }
    }

    fn entry_done(&mut self) {
        self.p.entries_done += 1;
        self.maybe_send();
    }

    /// For the removal phase: entries removed so far.
    fn entries(&mut self, n: u64) {
        self.p.entries_done = n;
        self.maybe_send();
    }

    fn maybe_send(&mut self) {
        if self
            .last_sent
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(100))
        {
            self.send();
        }
    }

    fn send(&mut self) {
        let done = self.p.work_done().saturating_sub(self.reused_work);
        let start = *self.work_at_start.get_or_insert(done);
        let elapsed = self.started.elapsed();
        if self.p.phase != Phase::Done
            && self.p.totals_known
            && done > start
            && elapsed > Duration::from_millis(200)
        {
            let left = self.p.work_total().saturating_sub(self.p.work_done());
            let rate = (done - start) as f64 / elapsed.as_secs_f64();
            self.p.eta = Some(Duration::from_secs_f64(left as f64 / rate));
        }
        self.last_sent = Some(Instant::now());
        self.sink.progress(&self.p);
    }
}
