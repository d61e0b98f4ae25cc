//! Converting one package ([`Migrator::convert`], [`Migrator::convert_planned`]):
//! the state on disk checked again, leftovers of an interrupted run
//! finished or dropped, the checks before anything is created (mounts,
//! filesystem, flags, free space), then a [`Job`] that snapshots the parent
//! or clones, and the exchange.
//!
//! At every instant `<pkg>` is either the complete original directory or
//! the complete, durable subvolume (see the crate docs for the states a
//! crash leaves, and what the next run does with each).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{MutexGuard, PoisonError};
use std::time::Instant;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::copy;
use volume::failpoint::failpoint;
use volume::layout::Names;
use volume::sys;

use crate::decide::{CloneReason, Decision};
use crate::errors::step;
use crate::job::Job;
use crate::migrate::Migrator;
use crate::options::{MetadataRoom, MigrateOptions};
use crate::parent_plan::{ParentPlan, forced_refusal};
use crate::report::{Outcome, PackageReport, Planned, ShareUse};
use crate::rest::RestRecord;
use crate::scan::scan;
use crate::split;
use crate::state::{Kind, State, settle_exchanged};
use crate::track::Tracker;
use crate::{Estimate, Method, Phase, ProgressSink};

impl Migrator {
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
    /// copy removes the partial subvolume and leaves `<pkg>` untouched, as
    /// does a file no clone can copy ([`copy::is_unclonable`]), which a
    /// resume would meet again; Auto, if it was resuming, then plans the
    /// package afresh and snapshots the parent where that applies. Other
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
            .schedule_for(std::slice::from_ref(pkg), opts, false, false)?
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
        let mut report = PackageReport::new(pkg.clone(), Outcome::AlreadySubvolume);
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
        let state = State::read(&self.root, pkg, &names)?;
        self.check_coherent(pkg, &names, &state)?;
        if state.live != Kind::Dir {
            if !opts.dry_run && settle_exchanged(&self.root, pkg, &names)? {
                report.outcome = Outcome::Finished;
            }
            report.elapsed = started.elapsed();
            return Ok(report);
        }

        // `<pkg>` is a plain directory.
        let src = self.open_plain(pkg, &names, &state, opts.dry_run)?;
        let mut tracker = Tracker::new(pkg.clone(), Estimate::default(), sink);
        tracker.phase(Phase::Scan);
        let resume = state.tmp == Kind::Subvolume;
        let flushed = opts.dry_run || !cuts_uncounted(planned, resume);
        if flushed {
            flush(pkg, src.as_fd())?;
        }
        if opts.dry_run {
            let (estimate, _) = scan(src.as_fd(), &AtomicBool::new(false))
                .with_ctx(step(pkg, "scanning the volume"))?;
            report.estimate = Some(estimate);
            report.outcome = Outcome::WouldConvert;
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        let (space, room) = self.room_for(pkg, src.as_fd(), opts)?;
        let mut job = Job {
            root: &self.root,
            pkg,
            names: &names,
            opts,
            src,
            space,
            room,
            tracker,
            report,
            unclonable: false,
            quota: Default::default(),
        };
        if self.carve_as_planned(&mut job, planned, resume)? {
            let report = job.report;
            return Ok(self.carved(report, lock, opts, sink, started));
        }
        // A light package's clone (a few dozen entries, weighed by the
        // schedule) takes no turn and no commit first: it waits on its one
        // commit mostly, with the others cloned at once.
        let _turn = match planned.is_light() {
            true => None,
            false => Some(self.turn_to_clone(&mut job, flushed)?),
        };
        if let Err(e) = job.clone_volume(resume, !planned.is_light()) {
            let replan = resume || planned.is_light();
            if !self.carve_after_unclonable(&mut job, replan, &e)? {
                return Err(e);
            }
            let report = job.report;
            return Ok(self.carved(report, lock, opts, sink, started));
        }
        job.report.method = Some(Method::Clone);
        job.report.decision = Some(Decision::Clone(
            match (&job.report.fallback, &planned.decision) {
                (Some(why), _) => why.clone(),
                (None, Some(Decision::Clone(why))) => why.clone(),
                (None, _) if resume => CloneReason::Resume,
                (None, _) => CloneReason::Forced,
            },
        ));
        job.report.outcome = Outcome::Converted;
        if opts.defer_cut && job.report.nocow_files > 0 {
            self.release_nocow(&mut job.report, &names);
        }
        job.report.elapsed = started.elapsed();
        Ok(job.report)
    }

    /// The report of a package converted by a snapshot of its parent. Auto
    /// deferred the cut whatever the options (its snapshot holds every
    /// other package's tree, which nothing counted); a caller without
    /// [`MigrateOptions::defer_cut`] wants it gone on return: shed now,
    /// the volume already in place (a failure leaves garbage for the next
    /// cleanup).
    fn carved(
        &self,
        mut report: PackageReport,
        lock: volume::lock::PackageLock,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
        started: Instant,
    ) -> PackageReport {
        let pkg = report.package.clone();
        report.method = Some(Method::SnapshotParent);
        report.decision = Some(Decision::SnapshotParent);
        report.outcome = Outcome::Converted;
        if opts.method == Method::Auto && !opts.defer_cut {
            drop(lock);
            if let Err(e) = self.remove_parts(&pkg, false, sink) {
                tracing::warn!(package = %pkg, error = %e, "removing the rest of the parent's snapshot");
            }
        }
        report.elapsed = started.elapsed();
        report
    }

    /// After a clone failed with `error`: where [`Method::Auto`] cloned to
    /// resume a partial copy, or cloned a light package in a snapshot's
    /// place ([`CloneReason::Light`]), and that copy was discarded as
    /// unclonable ([`Job::unclonable`]), plans the package again as it now
    /// is (alone: no package is light then) and, if that says to snapshot
    /// the parent, converts it so; returns whether it did. `false`: the
    /// clone's error stands (a snapshot does not apply either, or the
    /// clone was `Auto`'s choice for no such reason: `replan` false). So a
    /// partial copy never jams Auto, and a light package a snapshot can
    /// serve is not failed for its clone.
    fn carve_after_unclonable(
        &self,
        job: &mut Job<'_, '_>,
        replan: bool,
        error: &Error,
    ) -> Result<bool, Error> {
        if !(job.unclonable && replan && job.opts.method == Method::Auto) {
            return Ok(false);
        }
        let fresh = self.schedule_for(std::slice::from_ref(job.pkg), job.opts, false, false)?;
        let Some(planned) = fresh
            .into_iter()
            .find(|p| p.decision == Some(Decision::SnapshotParent))
        else {
            return Ok(false);
        };
        tracing::warn!(package = %job.pkg, %error, "the partial clone was discarded: snapshotting the parent instead");
        job.report.resumed = false;
        self.carve_as_planned(job, &planned, false)
    }

    /// Waits for this clone's turn, held until the guard drops: one clone
    /// at a time, also among packages converted at once (the `pool`
    /// module), since a clone reads and writes O(its extents) and its
    /// check of the free space must not count what another is taking. The
    /// space is read again once the turn is taken (with a commit first if
    /// not `flushed`).
    fn turn_to_clone(
        &self,
        job: &mut Job<'_, '_>,
        flushed: bool,
    ) -> Result<MutexGuard<'_, ()>, Error> {
        let turn = self
            .clone_turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if flushed {
            job.space = self.metadata_space(job.pkg)?;
            job.room = MetadataRoom::of(&job.space, job.opts);
        } else {
            self.flush_for_clone(job)?;
        }
        Ok(turn)
    }

    /// A cut planned without a commit first fell back to a clone: write
    /// the data out now, so that the clone's count sees every extent, and
    /// read the free metadata space again, since writing it out took some.
    fn flush_for_clone(&self, job: &mut Job<'_, '_>) -> Result<(), Error> {
        job.tracker.phase(Phase::Scan);
        flush(job.pkg, job.src.as_fd())?;
        job.space = self.metadata_space(job.pkg)?;
        job.room = MetadataRoom::of(&job.space, job.opts);
        Ok(())
    }

    /// For a package just cloned with NOCOW files, under a deferred cut:
    /// its service must not start while those files share their extents
    /// (each first write would be a copy, for good), so their old copies go
    /// now ([`Migrator::release_in_place`]). The conversion is done either
    /// way: a failure is logged, and the cleanup's to finish.
    fn release_nocow(&self, report: &mut PackageReport, names: &Names) {
        let pkg = &report.package;
        match self.release_in_place(pkg, names) {
            Ok(true) => report.old_removed = true,
            Ok(false) => {
                tracing::warn!(package = %pkg, "old copies of its NOCOW files left in a busy package's rest, for the cleanup")
            }
            Err(e) => {
                tracing::warn!(package = %pkg, error = %e, "removing the old copies of its NOCOW files")
            }
        }
    }

    /// Refuses a state no run of ours leaves: a `<pkg>.migrate` or
    /// `<pkg>.migrate-parent` that is neither a partial copy nor the old
    /// directory (`Incoherent`), or a `<pkg>` that is no directory
    /// (`InvalidRequest`). Reads nothing: `state` was read.
    pub(crate) fn check_coherent(
        &self,
        pkg: &PackageId,
        names: &Names,
        state: &State,
    ) -> Result<(), Error> {
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
        if state.live == Kind::Other {
            return Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} is not a directory",
                    self.root.path().join(&names.live).display()
                ),
            ));
        }
        Ok(())
    }

    /// Opens the plain directory `<pkg>` for its conversion, first dropping
    /// an interrupted cut (unless `dry_run`), and refuses it
    /// (`InvalidRequest`) where no method can convert it.
    fn open_plain(
        &self,
        pkg: &PackageId,
        names: &Names,
        state: &State,
        dry_run: bool,
    ) -> Result<OwnedFd, Error> {
        if state.parent == Kind::Subvolume && !dry_run {
            // An interrupted cut, holding a copy of the whole parent: drop it
            // (O(1): a new snapshot costs nothing), and its record.
            copy::remove_tree_at(self.root_fd(), &names.migrate_parent, &mut |_| Ok(()))
                .and_then(|()| volume::record::remove(self.root_fd(), &names.migrate_rest))
                .and_then(|()| sys::fsync(self.root_fd()))
                .with_ctx(step(pkg, "removing an interrupted parent snapshot"))?;
        }
        let src = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(step(pkg, "opening the volume"))?;
        // Read again, not the plan's: a service started since may have
        // mounted this volume.
        let mounts = crate::plan::read_mount_tables(pkg)?;
        if let Some(why) = self.refusal(pkg, names, src.as_fd(), &mounts)? {
            return Err(Error::for_package(pkg, ErrorKind::InvalidRequest, why));
        }
        Ok(src)
    }

    /// The free metadata space, read once before anything is created (the
    /// estimate is checked against it when the scan has it), and the room
    /// it leaves with `opts`' reserve. The reserve alone is checked now, so
    /// a volumes root short of it is never touched; if short, the package
    /// (open as `src`) is counted too, so the refusal gives what it really
    /// needs.
    fn room_for(
        &self,
        pkg: &PackageId,
        src: BorrowedFd<'_>,
        opts: &MigrateOptions,
    ) -> Result<(sys::MetadataSpace, MetadataRoom), Error> {
        let space = self.metadata_space(pkg)?;
        let room = MetadataRoom::of(&space, opts);
        if room.check(&Estimate::default()).is_err() {
            flush(pkg, src)?;
            let (estimate, _) =
                scan(src, &AtomicBool::new(false)).with_ctx(step(pkg, "scanning the volume"))?;
            return Err(room.shortfall(&estimate).refusal(pkg));
        }
        Ok((space, room))
    }

    /// Converts `job` by snapshotting the parent, if the plan says so and
    /// it still can, up to the exchange; returns whether it did. False:
    /// clone instead (a snapshot taken is gone again). With the method
    /// forced ([`Method::SnapshotParent`]), every reason not to is the
    /// error, and a partial clone is removed first.
    fn carve_as_planned(
        &self,
        job: &mut Job<'_, '_>,
        planned: &Planned,
        resume: bool,
    ) -> Result<bool, Error> {
        let (pkg, names) = (job.pkg, job.names);
        let forced = job.opts.method == Method::SnapshotParent;
        let plan = match self.parent_plan(job, planned, forced, resume)? {
            Ok(plan) => plan,
            Err(fallback) => {
                job.report.fallback = fallback;
                return Ok(false);
            }
        };
        if forced && resume {
            copy::remove_tree_at(self.root_fd(), &names.migrate, &mut |_| Ok(()))
                .with_ctx(step(pkg, "removing a partial copy"))?;
        }
        let plan = self.take_from_share(pkg, plan, planned, &mut job.report);
        // A member's wait for its share's cut (a second or more at 150
        // packages) came after the refusal's check, with services started
        // meanwhile: a dependent's mount of this volume made then would
        // show the old tree after the exchange, as for a clone.
        let carved = match planned.shares.is_empty() {
            true => Ok(job.carve_parent(plan)),
            false => job
                .refuse_if_mounted("its shared cut was made", "")
                .map(|()| job.carve_parent(plan)),
        };
        // Whatever became of this package, the shares it was the last
        // member of serve no one now.
        if let Err(e) = split::drop_shares(self.root_fd(), &planned.drop_shares) {
            tracing::warn!(package = %pkg, error = %e, "deleting the shared cuts it was the last member of");
        }
        match carved? {
            Ok(carved) => {
                job.swap_in(&names.migrate_parent, carved)?;
                Ok(true)
            }
            Err(failure) if forced || !failure.can_clone() => {
                Err(failure.into_error(pkg, &self.root.path().join(&names.live)))
            }
            Err(failure) => {
                let why = failure.reason();
                tracing::warn!(package = %pkg, "cutting a parent snapshot failed, cloning instead: {why}");
                job.report.fallback = Some(why);
                Ok(false)
            }
        }
    }

    /// `plan` with the snapshot to take from the last of `planned`'s shares
    /// (the `split` module), each made now if not yet, under this
    /// package's lock; unchanged (the parent) if it has none. A share that
    /// cannot be made, or whose tree of this package may be older than the
    /// package's directory ([`split::member_written`]: something beneath it
    /// was written since the share's snapshot, or that could not be
    /// checked), is not used: the parent is snapshotted instead, which
    /// keeps every identity and every write, and only sheds more. `report`
    /// says which ([`ShareUse`]).
    fn take_from_share(
        &self,
        pkg: &PackageId,
        mut plan: ParentPlan,
        planned: &Planned,
        report: &mut PackageReport,
    ) -> ParentPlan {
        let Some(share) = planned.shares.last() else {
            return plan;
        };
        let volumes = plan.keep.parent().unwrap_or(Path::new("")).to_owned();
        let made = split::source(
            self.root_fd(),
            plan.root.as_fd(),
            &volumes,
            &planned.shares,
            &self.share_locks,
            &mut || {
                self.count_removed();
                failpoint("migrate.share-removed")
            },
        );
        let checked = made.and_then(|(fd, taken)| {
            failpoint("migrate.share-taken")?;
            let written = split::member_written(plan.root.as_fd(), fd.as_fd(), plan.ino, taken);
            Ok((fd, taken, written))
        });
        let why = match checked {
            Ok((fd, _, Ok(None))) => {
                plan.root = fd;
                report.share = Some(ShareUse::Taken(share.id.clone()));
                return plan;
            }
            Ok((_, taken, Ok(Some(ino)))) => format!(
                "inode {ino} beneath its directory was written after transaction {taken}, \
                 which took its share's snapshot"
            ),
            Ok((_, _, Err(e))) => format!("checking its directory against its share failed: {e}"),
            Err(e) => format!("making its shared cut failed: {e}"),
        };
        tracing::warn!(package = %pkg, "snapshotting the parent instead of its share: {why}");
        report.share = Some(ShareUse::Parent(why));
        plan
    }

    /// What the cut needs, where the plan decided on a snapshot of the
    /// parent (and, unless forced, no partial clone is there to finish) and
    /// the checks just before it still allow one; else why not, where the
    /// plan said to snapshot (`None`: it said to clone).
    fn parent_plan(
        &self,
        job: &Job<'_, '_>,
        planned: &Planned,
        forced: bool,
        resume: bool,
    ) -> Result<Result<ParentPlan, Option<CloneReason>>, Error> {
        match &planned.decision {
            Some(Decision::SnapshotParent) if forced || !resume => {}
            Some(Decision::SnapshotParent) => return Ok(Err(Some(CloneReason::Resume))),
            Some(Decision::Clone(why)) => {
                // Said where a service waits on it (start-core's boot logs
                // outcomes only): its files get new inode numbers.
                tracing::info!(package = %job.pkg, "cloning, not snapshotting the parent: {why}");
                return Ok(Err(None));
            }
            // Refused by the schedule: the check below says why, now.
            None if forced => {}
            None => return Ok(Err(None)),
        }
        let pkg = job.pkg;
        let prepared = ParentPlan::prepare(
            &self.root,
            pkg,
            &job.names.live,
            job.src.as_fd(),
            planned.cut,
            forced,
        )?;
        let reason = match prepared {
            Ok(plan) => match plan.check_space(&job.space, job.room.reserve) {
                Ok(()) => return Ok(Ok(plan)),
                Err(short) if forced => {
                    return Err(Error::for_package(
                        pkg,
                        ErrorKind::MigrationFailed,
                        format!("{short}; nothing was changed"),
                    ));
                }
                Err(short) => CloneReason::Space {
                    why: short.to_string(),
                },
            },
            Err(reason) => reason,
        };
        if forced {
            return Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                forced_refusal(&self.root.path().join(&job.names.live), &reason),
            ));
        }
        tracing::info!(package = %pkg, "cloning, not snapshotting the parent: {reason}");
        Ok(Err(Some(reason)))
    }

    /// Removes, for the cloned package `pkg`, every other copy of its old
    /// files: `<pkg>.migrate-old`, and `pkg`'s old directory inside each
    /// deferred cut's rest (verified by the rest's record, under the path
    /// the volumes root has in the parent subvolume). Everything removed is
    /// garbage already, so a crash part-way leaves only less for
    /// [`Migrator::remove_old`]. Holds each other package's lock while in
    /// its volume; returns false if it left a copy in a package whose lock
    /// it could not take in time.
    fn release_in_place(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        let root = self.root_fd();
        if Kind::of(&self.root, &names.migrate_old)
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
            return Ok(true);
        };
        let old: PathBuf = volumes_path.iter().collect();
        let mut all = true;
        for other in self.listing()?.0 {
            if &other == pkg {
                continue;
            }
            let theirs = Names::new(&other)?;
            let Ok(Some(record)) = RestRecord::read(root, &theirs.migrate_rest) else {
                continue;
            };
            // A bounded wait: with packages converted at once (the `pool`
            // module), `other` may be a clone releasing its own old
            // copies, holding its lock and waiting for this one's. Its
            // rest then keeps this package's copy for the cleanup.
            let taken = volume::lock::LockDir::for_root(root).and_then(|d| {
                d.lock_with(&other, volume::lock::LockWait::Within(OTHER_LOCK_PATIENCE))
            });
            let _lock = match taken {
                Ok(lock) => lock,
                Err(e) if volume::lock::busy(&e).is_some() => {
                    tracing::info!(package = %pkg, rest_of = %other, "its old copy in a busy package's rest is left to the cleanup");
                    all = false;
                    continue;
                }
                Err(e) => return Err(e).with_ctx(step(&other, "taking the package lock")),
            };
            if Kind::of(&self.root, &theirs.live).with_ctx(step(&other, "inspecting the volume"))?
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
        Ok(all)
    }
}

/// How long [`Migrator::release_in_place`] waits for another package's
/// lock before leaving its copy in that package's rest to the cleanup.
const OTHER_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether `planned` will be cut from a snapshot of the parent with nothing
/// counted first, or cloned as a light package: what the schedule already
/// weighed (Auto's, whose counts ran after the schedule's commit), not a
/// resume. Such a conversion needs no commit of its own before it starts:
/// the snapshot flushes the subvolume it is taken of, and a clone writes
/// out each file's range before it clones it; a light package's clone
/// counts its few extents as the schedule saw them. Every other way counts
/// extents first (a clone, a forced cut's count of the rest, a dry run's
/// scan), and data still in the page cache has none yet.
fn cuts_uncounted(planned: &Planned, resume: bool) -> bool {
    let weighed = match planned.decision {
        Some(Decision::SnapshotParent) => planned.cut.is_some(),
        _ => planned.is_light(),
    };
    weighed && !resume
}

/// Commits the filesystem holding `src`, the volume of `pkg` (see
/// [`cuts_uncounted`] for when), before its extents are counted or its
/// free space read for a clone.
fn flush(pkg: &PackageId, src: BorrowedFd<'_>) -> Result<(), Error> {
    sys::commit(src).with_ctx(step(pkg, "flushing the volume"))
}
