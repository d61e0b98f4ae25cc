//! One package's conversion in flight, from its plain directory to the
//! exchange: the [`Job`], with its two ways of building the new subvolume
//! ([`Job::clone_volume`], [`Job::carve_parent`]) and the common end
//! ([`Job::swap_in`]).
//!
//! The crash states are the crate's (see the crate docs): a job only ever
//! writes under `<pkg>.migrate`, `<pkg>.migrate-parent` and
//! `<pkg>.migrate-rest` until the exchange, which is one rename.

use std::cell::OnceCell;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::thread::ScopedJoinHandle;
use std::time::Instant;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::copy::{self, CopyEvent, CopyOptions};
use volume::errors::is_enospc;
use volume::failpoint::failpoint;
use volume::layout::Names;
use volume::quota::QuotaCarry;
use volume::record::Identity;
use volume::sys::{self, InodeFlags};

use crate::carve::{self, CarveEvent, Removal};
use crate::decide::CloneReason;
use crate::errors::step;
use crate::options::{MetadataRoom, MetadataShortfall, MigrateOptions};
use crate::parent_plan::ParentPlan;
use crate::report::PackageReport;
use crate::rest::RestRecord;
use crate::scan::{self, ExtentsByInode};
use crate::state::settle_exchanged;
use crate::track::Tracker;
use crate::{Estimate, Phase};

/// How often a conversion starts a background commit while cloning (see
/// [`crate::Migrator::convert`]): often enough that the final, waited-for commit is
/// short, rarely enough that commits do not dominate. Measured once, with a
/// temporary knob, on the bench's 500k-extent file: the final commit took a
/// median of 42.6 ms at 500 ms and 18.3 ms at 250 ms, the clone 2.99 s at
/// both.
const BACKGROUND_COMMIT_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// One package's conversion: the plain directory open, the free space read
/// before anything was created, progress and the report so far. It holds
/// the volumes root, not the migrator: a job is one package's, and the
/// package's lock is its caller's to hold throughout.
pub(crate) struct Job<'a, 's> {
    pub root: &'a volume::Root,
    pub pkg: &'a PackageId,
    pub names: &'a Names,
    pub opts: &'a MigrateOptions,
    /// `<pkg>`, the plain directory.
    pub src: OwnedFd,
    pub space: sys::MetadataSpace,
    pub room: MetadataRoom,
    pub tracker: Tracker<'s>,
    pub report: PackageReport,
    /// Set when [`Job::clone_volume`] failed on a file no clone can copy
    /// ([`copy::is_unclonable`]) and discarded its partial copy: nothing
    /// of the clone is left for a later run to resume.
    pub unclonable: bool,
    /// The qgroup limit and groups of the subvolume `<pkg>` sits in, for
    /// the new subvolume ([`Job::quota`]): read once per job.
    pub quota: OnceCell<Option<QuotaCarry>>,
}

/// Why [`Job::carve_parent`] did not carve: the step that failed, and
/// whether the snapshot (and its record) are gone.
pub(crate) struct CarveFailure {
    what: String,
    error: io::Error,
    cleanup: io::Result<()>,
}

impl CarveFailure {
    /// Whether [`Method::Auto`](crate::Method::Auto) may clone instead: the
    /// snapshot is gone and space did not run out.
    pub fn can_clone(&self) -> bool {
        self.cleanup.is_ok() && !is_enospc(&self.error)
    }

    /// Why cloning instead, for the logs.
    pub fn reason(&self) -> CloneReason {
        CloneReason::Failed {
            why: format!("{}: {}", self.what, self.error),
        }
    }

    /// The error to report.
    pub fn into_error(self, pkg: &PackageId, live: &std::path::Path) -> Error {
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
    /// The scan's estimate does not fit in the free space.
    Space(MetadataShortfall),
}

/// The scan that runs beside a clone, feeding the progress totals and the
/// space check: it need not delay the clone, so it runs on a second thread.
struct ScanWatch<'scope> {
    handle: Option<ScopedJoinHandle<'scope, io::Result<(Estimate, ExtentsByInode)>>>,
    /// Why the scan stopped the clone, once it did.
    failure: Option<ScanFailure>,
}

impl ScanWatch<'_> {
    /// Takes the scan's result if it is done (`wait`: waits for it): totals
    /// to the tracker, the estimate to the report, and the space check. An
    /// error stops the clone; the reason stays in `failure`.
    fn take(
        &mut self,
        wait: bool,
        room: &MetadataRoom,
        tracker: &mut Tracker<'_>,
        report: &mut PackageReport,
    ) -> io::Result<()> {
        let Some(handle) = self.handle.take_if(|h| wait || h.is_finished()) else {
            return Ok(());
        };
        let result = match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        self.failure = match result {
            Err(e) => Some(ScanFailure::Io(e)),
            Ok((estimate, per_file)) => {
                report.estimate = Some(estimate);
                tracker.scanned(estimate, per_file);
                room.check(&estimate).err().map(ScanFailure::Space)
            }
        };
        match self.failure {
            Some(_) => Err(io::Error::other("the scan stopped the copy")),
            None => Ok(()),
        }
    }
}

impl Job<'_, '_> {
    /// What the new subvolume carries of the qgroup of the subvolume the
    /// plain directory sits in (its limit and groups: see
    /// [`volume::quota`]), read at the job's first need: without quotas,
    /// one search of the quota tree per job and nothing more.
    fn quota(&self) -> Result<Option<&QuotaCarry>, Error> {
        if self.quota.get().is_none() {
            let carry = volume::quota::or_warn(
                format_args!("converting {}", self.live_path().display()),
                QuotaCarry::read(self.src.as_fd()),
            );
            let _ = self.quota.set(carry);
        }
        Ok(self.quota.get().and_then(Option::as_ref))
    }

    /// `<pkg>`'s path, for messages.
    fn live_path(&self) -> PathBuf {
        self.root.path().join(&self.names.live)
    }

    /// Clones `<pkg>` into the subvolume `<pkg>.migrate` (resuming the one
    /// there if `resume`), then swaps it in; with `recheck`, once the copy
    /// is made, only if nothing is mounted from inside `<pkg>` now
    /// ([`Job::ensure_unmounted`]). Without, the refusal's check before it
    /// stands, as it does for a snapshot: for a clone that starts at once
    /// and copies a few dozen entries (a light package's), a window no
    /// longer than a snapshot's; but one that took long enough to start a
    /// commit in the background (many at once on few cores, its commit
    /// starts waiting) is checked again all the same, its window no longer
    /// a snapshot's. On ENOSPC, or when the scan
    /// finds the space short, the partial subvolume is removed and `<pkg>`
    /// is untouched; on other errors the partial copy is kept for the next
    /// run, but for a file no clone can copy ([`copy::is_unclonable`]: a
    /// resume would meet it again), which discards it too and sets
    /// [`Job::unclonable`].
    pub fn clone_volume(&mut self, resume: bool, recheck: bool) -> Result<(), Error> {
        let stop_scan = AtomicBool::new(false);
        let scan_fd = self
            .src
            .try_clone()
            .with_ctx(step(self.pkg, "opening the volume for its scan"))?;
        std::thread::scope(|scope| {
            let stop = &stop_scan;
            let handle = scan::walker()
                .spawn_scoped(scope, move || scan::scan(scan_fd.as_fd(), stop))
                .with_ctx(step(self.pkg, "starting the volume's scan"))?;
            let mut watch = ScanWatch {
                handle: Some(handle),
                failure: None,
            };
            let result = self.clone_with(resume, recheck, &mut watch);
            stop_scan.store(true, std::sync::atomic::Ordering::Relaxed);
            result
        })
    }

    fn clone_with(
        &mut self,
        resume: bool,
        recheck: bool,
        watch: &mut ScanWatch<'_>,
    ) -> Result<(), Error> {
        let pkg = self.pkg;
        let tmp_path = self.root.path().join(&self.names.migrate);
        let (dst, since) = self.open_clone_target(resume)?;
        let resumed = since.is_some();
        self.report.resumed = resumed;
        self.tracker.phase(Phase::Clone);
        let copy_opts = CopyOptions {
            resume: resumed,
            chunk_bytes: Some(self.opts.chunk_bytes),
            nested_subvolumes: true,
            changed_since: since.as_ref(),
        };
        // The exchange's commit carries every cloned extent reference;
        // starting commits in the background as the clone goes leaves the
        // last one only the tail (see `swap_in_clone`).
        let mut last_commit = Instant::now();
        let mut background = false;
        let dst_fd = dst.as_fd();
        let (tracker, report, room) = (&mut self.tracker, &mut self.report, &self.room);
        let copied = copy::reflink_into(self.src.as_fd(), dst.as_fd(), &copy_opts, &mut |ev| {
            if last_commit.elapsed() >= BACKGROUND_COMMIT_EVERY {
                sys::start_commit(dst_fd)?;
                last_commit = Instant::now();
                background = true;
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
                CopyEvent::Entry { rel } => {
                    tracker.entry_copied(rel);
                    failpoint("migrate.entry")?;
                }
            }
            watch.take(false, room, tracker, report)
        })
        // The clone is done before the scan: wait for it, it may still find
        // the space short.
        .and_then(|stats| watch.take(true, room, tracker, report).map(|()| stats));
        let stats = match (copied, watch.failure.take()) {
            (Err(_), Some(ScanFailure::Space(short))) => return Err(self.abandon(dst, short)),
            // Final: a partial copy kept would fail the same way each run.
            (Err(e), _) | (_, Some(ScanFailure::Io(e))) if copy::is_too_deep(&e) => {
                let why = format!("{} holds {e}", self.live_path().display());
                return Err(self.abandon(dst, why));
            }
            (Err(e), _) if copy::is_unclonable(&e) => {
                self.unclonable = true;
                let why = format!("cloning {}: {e}", self.live_path().display());
                return Err(self.abandon(dst, why));
            }
            (Err(_), Some(ScanFailure::Io(e))) => {
                return Err(e).with_ctx(step(
                    pkg,
                    "scanning the volume (the partial copy is kept for the next run)",
                ));
            }
            (Err(e), None) if is_enospc(&e) => {
                let why = format!(
                    "out of space while cloning into {} ({e})",
                    tmp_path.display()
                );
                return Err(self.abandon(dst, why));
            }
            (copied, _) => copied.with_ctx(|_| {
                (
                    ErrorKind::MigrationFailed,
                    pkg.context(format!(
                        "cloning {} into {} (the partial copy is kept for the next run)",
                        self.live_path().display(),
                        tmp_path.display()
                    )),
                )
            })?,
        };
        self.note_copy(&stats);
        failpoint("migrate.copied").with_ctx(step(pkg, "failpoint"))?;
        let estimate = self.report.estimate.unwrap_or_default();
        tracing::info!(package = %pkg, bytes = estimate.bytes, extents = estimate.extents, "volume cloned into a subvolume");
        if recheck || background {
            self.ensure_unmounted()?;
        }
        self.swap_in_clone(dst, background)
    }

    /// What the copy made goes in the report.
    fn note_copy(&mut self, stats: &copy::CopyStats) {
        self.report.bytes_cloned = stats.bytes_cloned;
        self.report.entries_reused = stats.entries_reused;
        self.report.nocow_files = stats.nocow_files;
        if stats.nodatasum_nocow > 0 {
            // No other state shares their extents on a checksumming mount.
            tracing::warn!(package = %self.pkg, files = stats.nodatasum_nocow, "files without data checksums (written under nodatasum) were copied as NOCOW files");
        }
    }

    /// Swaps the finished clone `dst` in; `background`: the clone started
    /// commits in the background as it went. Then a full commit first, not
    /// for durability (see `swap_in`): a commit start right after the
    /// background ones waited out this kernel's missed wake-up
    /// (`sys::COMMIT_START_PATIENCE`, 2 s) in every run of the bench's
    /// 500k-extent clone; the full commit takes the tail, and the
    /// exchange's own commit is then short. A clone too short to have
    /// started one (a light package's) goes without.
    fn swap_in_clone(&mut self, dst: OwnedFd, background: bool) -> Result<(), Error> {
        if background {
            sys::commit(dst.as_fd()).with_ctx(step(self.pkg, "committing the clone"))?;
        }
        let tmp = self.names.migrate.clone();
        self.swap_in(&tmp, dst)
    }

    /// Refuses the exchange if anything is mounted from inside `<pkg>` now,
    /// in any mount namespace. A clone takes long, services of converted
    /// packages start meanwhile, and a dependent's may mount this volume:
    /// after the exchange that mount would show the old tree, and its
    /// removal would take the writes made through it. The copy is kept, so
    /// the conversion once unmounted goes on from it.
    fn ensure_unmounted(&self) -> Result<(), Error> {
        self.refuse_if_mounted("it was cloned", ", and the copy is kept for the next run")
    }

    /// Refuses the conversion if anything is mounted from inside `<pkg>`
    /// now, in any mount namespace, saying it was mounted while `during`
    /// and what else is left (`kept`): where a step since the refusal's
    /// check took long (a clone, a share's cut), as [`Job::ensure_unmounted`]
    /// says why.
    pub(crate) fn refuse_if_mounted(&self, during: &str, kept: &str) -> Result<(), Error> {
        let live = self.live_path();
        let busy = crate::plan::read_mount_tables(self.pkg)?.uses_of(&live);
        if busy.is_empty() {
            return Ok(());
        }
        Err(Error::for_package(
            self.pkg,
            ErrorKind::InvalidRequest,
            format!(
                "{} was mounted at {} while {during}, so it is in use; unmount it and \
                 convert again (it is untouched{kept})",
                live.display(),
                volume::mounts::describe(&busy)
            ),
        ))
    }

    /// The subvolume to clone into, and with a partial copy to resume, what
    /// changed in the source since that copy was created (those entries
    /// are copied again), as the filesystem orders changes: by transaction,
    /// never by a clock a box without a real-time clock boots behind. A
    /// partial copy is replaced when `<pkg>`'s top changed since.
    fn open_clone_target(
        &self,
        resume: bool,
    ) -> Result<(OwnedFd, Option<copy::SourceChanges>), Error> {
        let pkg = self.pkg;
        let root = self.root.fd();
        if resume {
            let fd = sys::open_dir_at(root, &self.names.migrate)
                .with_ctx(step(pkg, "opening the partial copy"))?;
            let created = sys::subvolume_info(fd.as_fd())
                .with_ctx(step(pkg, "reading the partial copy's creating transaction"))?
                .created_transid;
            let changes = copy::SourceChanges::since(self.src.as_fd(), created).with_ctx(step(
                pkg,
                "reading what changed in the volume since the partial copy",
            ))?;
            let top = sys::stat(self.src.as_fd()).with_ctx(step(pkg, "stat of the volume"))?;
            match changes.top_changed(&top) {
                false => return Ok((fd, Some(changes))),
                true => {
                    tracing::warn!(package = %pkg, "volume changed since the partial copy was started: starting over");
                    drop(fd);
                    copy::remove_tree_at(root, &self.names.migrate, &mut |_| Ok(()))
                        .with_ctx(step(pkg, "removing an outdated partial copy"))?;
                }
            }
        }
        // Created in the groups of the volume's subvolume, while empty:
        // with full quotas, joining one later, sharing every extent,
        // would mark the quotas inconsistent.
        match QuotaCarry::inherit_of(self.quota()?) {
            Some(inherit) => sys::create_subvolume_with(root, &self.names.migrate, &inherit),
            None => sys::create_subvolume(root, &self.names.migrate),
        }
        .with_ctx(|_| {
            (
                ErrorKind::MigrationFailed,
                pkg.context(format!(
                    "creating subvolume {}",
                    self.root.path().join(&self.names.migrate).display()
                )),
            )
        })?;
        // Not committed before the first source entry is read: a resumed
        // run counts every source inode written in the transaction that
        // created the copy, or later, as changed (`copy::SourceChanges`).
        // A power cut before that transaction commits loses only the empty
        // subvolume.
        failpoint("migrate.created").with_ctx(step(pkg, "failpoint"))?;
        let fd = sys::open_dir_at(root, &self.names.migrate)
            .with_ctx(step(pkg, "opening the new subvolume"))?;
        Ok((fd, None))
    }

    /// Gives up a clone that cannot complete (space, a tree too deep, a
    /// file no clone can copy): the partial subvolume
    /// goes, `<pkg>` is untouched; the error says so and why.
    fn abandon(&self, dst: OwnedFd, why: impl std::fmt::Display) -> Error {
        drop(dst);
        let root = self.root.fd();
        let cleanup = copy::remove_tree_at(root, &self.names.migrate, &mut |_| Ok(()))
            .and_then(|()| sys::commit(root));
        let msg = format!(
            "{why}; {} is untouched{}",
            self.live_path().display(),
            match &cleanup {
                Ok(()) => " and the partial subvolume was removed".to_owned(),
                Err(c) => format!(", but removing the partial subvolume failed: {c}"),
            }
        );
        Error::for_package(self.pkg, ErrorKind::MigrationFailed, msg)
    }

    /// [`Method::SnapshotParent`](crate::Method::SnapshotParent) up to the
    /// exchange: snapshots the parent subvolume as `<pkg>.migrate-parent`
    /// and cuts it down to `<pkg>` ([`carve::carve`]); with
    /// [`MigrateOptions::defer_cut`], sets the rest aside and records it
    /// ([`RestRecord`]). On failure the snapshot and the record are deleted
    /// (O(1)). Returns the snapshot, open.
    pub fn carve_parent(&mut self, plan: ParentPlan) -> Result<OwnedFd, CarveFailure> {
        let root = self.root.fd();
        let names = self.names;
        self.tracker.set_estimate(Estimate {
            entries: plan.rest.entries + plan.lifted,
            ..plan.rest
        });
        self.tracker.phase(Phase::Carve);
        let snapshot = self.root.path().join(&names.migrate_parent);
        let what = format!("snapshotting its subvolume as {}", snapshot.display());
        // The snapshot joins its source's groups (see `volume::quota`).
        let inherit = self.quota().map_err(|e| CarveFailure {
            what: what.clone(),
            error: io::Error::other(e.source.to_string()),
            cleanup: Ok(()),
        })?;
        match QuotaCarry::inherit_of(inherit) {
            Some(i) => {
                sys::create_snapshot_with(plan.root.as_fd(), root, &names.migrate_parent, false, &i)
            }
            None => sys::snapshot(plan.root.as_fd(), root, &names.migrate_parent),
        }
        .map_err(|error| CarveFailure {
            what,
            error,
            cleanup: Ok(()),
        })?;
        drop(plan.root);
        // Auto's snapshot holds every other package's tree, which no count
        // weighed: always deferred, so the exchange waits for renames only.
        let removal = if self.opts.defer_cut || self.opts.method == crate::Method::Auto {
            Removal::Deferred
        } else {
            Removal::Now
        };
        let tracker = &mut self.tracker;
        let result = failpoint("migrate.parent-snapshot")
            .and_then(|()| volume::record::remove(root, &names.migrate_rest))
            .and_then(|()| sys::open_dir_at(root, &names.migrate_parent))
            .and_then(|fd| {
                // The path was read before the snapshot: it must still lead
                // to the volume (the same inode in the snapshot).
                if sys::stat(sys::open_beneath(fd.as_fd(), &plan.keep)?.as_fd())?.ino != plan.ino {
                    return Err(io::Error::other(format!(
                        "{} in the snapshot is not the volume; was it moved?",
                        plan.keep.display()
                    )));
                }
                let carved = carve::carve(fd.as_fd(), &plan.keep, removal, &mut |ev| match ev {
                    CarveEvent::Held => failpoint("migrate.carve-held"),
                    CarveEvent::Removed(n) => {
                        tracker.entries(n);
                        failpoint("migrate.carve-removed")
                    }
                    CarveEvent::SetAside(_) => failpoint("migrate.carve-set-aside"),
                    CarveEvent::Lifted(_) => failpoint("migrate.carve-lifted"),
                })?;
                if let Some(rest) = carved.rest {
                    let identity = Identity::of_entry(fd.as_fd(), &rest)?.ok_or_else(|| {
                        io::Error::other("the rest's directory vanished from the snapshot")
                    })?;
                    let root_stuck = sys::inode_flags(fd.as_fd())?
                        .intersection(InodeFlags::IMMUTABLE | InodeFlags::APPEND);
                    RestRecord {
                        name: rest,
                        identity,
                        root_stuck,
                    }
                    .write(root, &names.migrate_rest)?;
                    failpoint("migrate.rest-recorded")?;
                }
                Ok(fd)
            });
        result.map_err(|error| CarveFailure {
            what: format!("cutting {} down to the volume", snapshot.display()),
            error,
            cleanup: copy::remove_tree_at(root, &names.migrate_parent, &mut |_| Ok(()))
                .and_then(|()| volume::record::remove(root, &names.migrate_rest))
                .and_then(|()| sys::fsync(root)),
        })
    }

    /// The last steps of either method: exchange the new subvolume `tmp`
    /// (open as `dst`) with `<pkg>`, make the exchange durable, move the
    /// old directory to `<pkg>.migrate-old`.
    ///
    /// Nothing is committed before the exchange: neither method writes file
    /// data. A cut only renamed entries of a snapshot whose creation wrote
    /// out and committed its data; a clone only shared extents
    /// (`FICLONE`, which writes out the source's range and waits for its
    /// extents first) and set metadata. Every change either made (and the
    /// rest's record, a symlink, and the quota carried over) is metadata of
    /// the exchange's transaction or an earlier one, and btrfs commits
    /// transactions in order, so no state a crash leaves shows the exchange
    /// without them (the power-cut sweep's `convert-parent` and
    /// `convert-clone` check it state by state). A commit here would also
    /// write out the dirty data of every service already started, and with
    /// packages converted at once, it was one more commit each waits on.
    pub fn swap_in(&mut self, tmp: &OsStr, dst: OwnedFd) -> Result<(), Error> {
        let pkg = self.pkg;
        let root = self.root.fd();
        // The limit and groups of the subvolume the directory sat in, on
        // the new subvolume before its exchange: no committed state shows
        // the volume without them.
        if let Some(Err(e)) = self.quota()?.map(|c| c.apply(dst.as_fd())) {
            tracing::warn!(package = %pkg, "converting: qgroup limit and groups not carried to the new subvolume: {e}");
        }
        // The phase (and its failpoint) where the copy was made durable
        // before: crash tests stop here.
        self.tracker.phase(Phase::Sync);
        drop(dst);
        let tracker = &mut self.tracker;
        let exchanged = failpoint("migrate.durable").and_then(|()| {
            tracker.phase(Phase::Exchange);
            sys::rename_exchange(root, tmp, &self.names.live)
        });
        if let Err(e) = exchanged {
            let what = format!(
                "exchanging {} with {}",
                self.root.path().join(tmp).display(),
                self.live_path().display()
            );
            if !is_enospc(&e) {
                return Err(e).with_ctx(|_| (ErrorKind::MigrationFailed, pkg.context(what)));
            }
            // Out of metadata space with the copy complete: a rerun would
            // meet the same wall, so the copy goes and frees what it took.
            let cleanup = copy::remove_tree_at(root, tmp, &mut |_| Ok(()))
                .and_then(|()| volume::record::remove(root, &self.names.migrate_rest))
                .and_then(|()| sys::fsync(root));
            return Err(Error::for_package(
                pkg,
                ErrorKind::MigrationFailed,
                format!(
                    "out of metadata space {what} ({e}); {} is untouched{}",
                    self.live_path().display(),
                    match cleanup {
                        Ok(()) => " and the copy was removed".to_owned(),
                        Err(c) => format!(", but removing the copy failed: {c}"),
                    }
                ),
            ));
        }
        // The exchange made durable by a commit, by name: an fsync of the
        // root would commit too, but only because btrfs's log tree cannot
        // record a subvolume's rename, an implementation detail.
        sys::commit_metadata(root).with_ctx(step(pkg, "committing the exchange"))?;
        failpoint("migrate.exchanged").with_ctx(step(pkg, "failpoint"))?;
        settle_exchanged(self.root, pkg, self.names)?;
        self.tracker.phase(Phase::Done);
        tracing::info!(package = %pkg, "volume converted to a subvolume");
        Ok(())
    }
}
