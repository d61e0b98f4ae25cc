//! Planning a run: which packages there are to convert, how each is to be
//! converted ([`Migrator::schedule`], by the rule of the `decide` module),
//! in which order, and for a dry run what each costs ([`Migrator::plan`]).
//!
//! Reads only (besides a commit of the filesystem, so that data still in
//! the page cache has its extents): a crash while planning leaves nothing
//! behind.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::AtomicBool;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::layout::Names;
use volume::sys::{self, InodeFlags};

use crate::cost::Cost;
use crate::decide::{self, Candidate, CloneReason, Decided, Decision, Parent};
use crate::errors::step;
use crate::migrate::Migrator;
use crate::options::MigrateOptions;
use crate::parent_plan::{ParentPlan, forced_refusal};
use crate::report::Planned;
use crate::scan::{self, scan};
use crate::state::{Kind, State};
use crate::{Estimate, Method};
use crate::{pool, split};

/// The packages of a schedule, sorted by what there is to do, before
/// anything is decided.
#[derive(Default)]
struct Survey {
    /// Plain directories to decide for, each with what deciding needs.
    candidates: Vec<(Planned, Candidate)>,
    /// Plain directories no method can convert, with the reason.
    refused: Vec<Planned>,
    /// Packages with only an interrupted run's leftovers to finish.
    leftovers: Vec<Planned>,
    /// Every namespace's mount table, read when the first plain directory
    /// needs it and then reused: one pass over `/proc` for the whole plan,
    /// not one per package before the first service may start. The
    /// conversion checks each package again just before it converts it.
    mounts: Option<std::sync::Arc<volume::mounts::MountTables>>,
}

impl Migrator {
    /// What a run would do (a dry run): [`Migrator::schedule`] of every
    /// package of [`Migrator::packages`], with each plain directory also
    /// scanned whole ([`Planned::estimate`]), in the order a run takes
    /// them. Changes nothing (it commits the filesystem, so that data still
    /// in the page cache has its extents; nothing anyone can see). Like
    /// [`Migrator::run`], it does not warn of the entries it passes over
    /// ([`Migrator::skipped`]).
    pub fn plan(&self) -> Result<Vec<Planned>, Error> {
        self.plan_with(&MigrateOptions::default())
    }

    /// [`Migrator::plan`] for a run with `opts`: its method (forced
    /// [`Method::SnapshotParent`]: each package checked as the run checks
    /// it just before the cut, at the same cost, and refused with the
    /// run's reason), and whether it removes the old trees
    /// ([`MigrateOptions::remove_old`]: without, a package with only old
    /// trees left is left out, as the run leaves it).
    pub fn plan_with(&self, opts: &MigrateOptions) -> Result<Vec<Planned>, Error> {
        let mut planned = self.schedule_for(&self.listing()?.0, opts, true, false)?;
        for p in &mut planned {
            if opts.method == Method::SnapshotParent && p.decision.is_some() {
                self.check_forced(p)?;
            }
            if p.decision.is_some() {
                self.estimate(p)?;
            }
        }
        if !opts.remove_old {
            planned = self.without_old(planned)?;
        }
        shed_costs(&mut planned);
        Ok(planned)
    }

    /// The run's check of a forced snapshot of the parent just before the
    /// cut ([`ParentPlan::prepare`], the whole rest of the parent counted
    /// for NOCOW and preallocated files): `p` refused with the run's
    /// reason if it fails.
    fn check_forced(&self, p: &mut Planned) -> Result<(), Error> {
        let pkg = &p.package;
        let names = Names::new(pkg)?;
        let src = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(step(pkg, "opening the volume"))?;
        let prepared = ParentPlan::prepare(&self.root, pkg, &names.live, src.as_fd(), None, true)?;
        if let Err(why) = prepared {
            p.refused = Some(forced_refusal(&self.root.path().join(&names.live), &why));
            p.decision = None;
        }
        Ok(())
    }

    /// `planned` for a run that keeps the old trees: a package with only
    /// old trees left is left out, and one with an exchange to finish has
    /// no old trees to remove.
    fn without_old(&self, planned: Vec<Planned>) -> Result<Vec<Planned>, Error> {
        let mut kept = Vec::with_capacity(planned.len());
        for mut p in planned {
            if p.decision.is_none() && p.refused.is_none() && p.old_pending {
                let state = State::read(&self.root, &p.package, &Names::new(&p.package)?)?;
                if state.tmp == Kind::Absent && state.parent == Kind::Absent {
                    continue;
                }
                p.old_pending = false;
            }
            kept.push(p);
        }
        Ok(kept)
    }

    /// Scans the plain directory of `p` whole, for its estimate and the
    /// cost of a clone; refuses it, as the run would, where a clone
    /// cannot serve and nothing else does.
    fn estimate(&self, p: &mut Planned) -> Result<(), Error> {
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
        Ok(())
    }

    /// Decides how each of `packages` is to be converted, all in one run, by
    /// `opts.method` (for [`Method::Auto`], the rule in the `decide`
    /// module's docs: every package a snapshot can serve is converted by
    /// snapshotting the parent; forced [`Method::SnapshotParent`]: a
    /// package whose parent or tree rules a snapshot out is refused, with
    /// the run's reason), and in which order: those heaviest first
    /// (with shares, a share's members together: the `split` module), then
    /// the clones by name. Plain directories under the root that are not
    /// in `packages` count as the rest of the parent, as anything else
    /// there. Packages with nothing to convert but leftovers are listed
    /// with no decision; those with nothing at all are left out. Reads
    /// only; counts each package to be snapshotted only up to
    /// [`split::HEAVY_US`] of cutting, and the rest outside them only up to
    /// [`crate::REST_MAX_US`].
    pub fn schedule(
        &self,
        packages: &[PackageId],
        opts: &MigrateOptions,
    ) -> Result<Vec<Planned>, Error> {
        self.schedule_for(packages, opts, true, !opts.dry_run)
    }

    /// [`Migrator::schedule`]; `bytes`: also count the file bytes of every
    /// plain directory the decision did not count whole; `fresh`: a run
    /// follows, so the shares an earlier run left are deleted first if any
    /// are planned (not for a dry run, which changes nothing).
    pub(crate) fn schedule_for(
        &self,
        packages: &[PackageId],
        opts: &MigrateOptions,
        bytes: bool,
        fresh: bool,
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
        // A forced snapshot is checked as the run checks it just before
        // the cut, so that the plan refuses what the run would.
        let parent = match opts.method {
            Method::Auto | Method::SnapshotParent => Some(self.parent()?),
            Method::Clone => None,
        };
        let mut survey = Survey::default();
        for pkg in packages {
            self.survey(pkg, parent.as_ref(), &mut survey)?;
        }
        let Survey {
            candidates,
            refused,
            leftovers,
            mounts: _,
        } = survey;
        let (mut planned, cands): (Vec<Planned>, Vec<Candidate>) = candidates.into_iter().unzip();
        let decided: Vec<Decided> = match (&parent, opts.method) {
            (Some(parent), Method::Auto) => decide::decide(&cands, parent),
            _ => decide::forced(&cands, opts.method),
        };
        for (p, d) in planned.iter_mut().zip(decided) {
            // For progress only, so only where there is progress to show: a
            // snapshot takes milliseconds, and a stat of each of its
            // entries would delay every service.
            if bytes && d.decision != Decision::SnapshotParent {
                p.bytes = self.count_bytes(&p.package);
            }
            p.decision = Some(d.decision);
            p.cut = d.cut;
        }
        if let Some(parent) = parent
            .as_ref()
            .filter(|_| opts.method == Method::SnapshotParent)
        {
            self.refuse_forced(&mut planned, &cands, parent);
        }
        let ranks = match (&parent, opts.method) {
            (Some(Ok(_)), Method::Auto) => self.lay_out(&mut planned, fresh)?,
            _ => HashMap::new(),
        };
        planned.extend(refused);
        // The snapshots first, so that no service waits for a clone: with
        // shares in the order of their shares (the `split` module: the
        // dominant one first, a share's members together), else by name,
        // then the light packages cloned in their place; then the other
        // clones, by name.
        planned.sort_by_key(|p| {
            (
                !p.scheduled(),
                ranks.get(&p.package).copied().unwrap_or(usize::MAX),
                p.package.clone(),
            )
        });
        planned.extend(leftovers);
        Ok(planned)
    }

    /// With [`Method::SnapshotParent`] forced, refuses each of `planned`
    /// (decided from `cands`, in the same order) that the run's check just
    /// before the cut would refuse for what the schedule already read: the
    /// parent out of reach or with mounts inside, nested subvolumes. Same
    /// reason text as the run's error. Reads nothing.
    fn refuse_forced(
        &self,
        planned: &mut [Planned],
        cands: &[Candidate],
        parent: &Result<Parent, CloneReason>,
    ) {
        for (p, c) in planned.iter_mut().zip(cands) {
            let why = match (parent, &c.ineligible) {
                (Err(why), _) | (Ok(_), Some(why @ CloneReason::NestedSubvolumes)) => why,
                _ => continue,
            };
            p.refused = Some(forced_refusal(
                &self.root.path().join(p.package.as_str()),
                why,
            ));
            p.decision = None;
        }
    }

    /// Where each package to be snapshotted takes its snapshot from (the
    /// `split` module), with what that costs; returns each one's rank in
    /// the order (none for fewer than two). Weighs each package first, up
    /// to [`split::HEAVY_US`] of cutting, and below [`split::SPLIT_MIN`]
    /// too, up to [`split::ORDER_US`], so that the dominant package goes
    /// first (a node's eight: 13 ms of weighing, cold, ready at 48 ms
    /// instead of sixth in name order at 109-129 ms). With `fresh`, deletes the shares an
    /// earlier run left, if any shares are planned (if it cannot, plans
    /// none).
    fn lay_out(
        &self,
        planned: &mut [Planned],
        fresh: bool,
    ) -> Result<HashMap<PackageId, usize>, Error> {
        let snaps: Vec<&Planned> = planned
            .iter()
            .filter(|p| p.decision == Some(Decision::SnapshotParent))
            .collect();
        if snaps.len() < 2 {
            return Ok(HashMap::new());
        }
        let rest = snaps.iter().find_map(|p| p.cut).unwrap_or_default();
        // A cold count is a chain of synchronous reads: threads overlap
        // them, each taking the next package (one heavy package per thread
        // at most at a time, not a fixed share that may hold several).
        let names: Vec<&PackageId> = snaps.iter().map(|p| &p.package).collect();
        // Below SPLIT_MIN the count only orders the packages (the
        // dominant one first): a tenth of the cap, so that a box of many
        // large packages, cold, does not hold every service back for it.
        let cap = if snaps.len() < split::SPLIT_MIN {
            split::ORDER_US
        } else {
            split::HEAVY_US
        };
        let weights = pool::at_once(
            &names,
            pool::workers_within(pool::WORKERS),
            &mut |_: &crate::Progress| {},
            &|p: &&PackageId, _: &mut dyn crate::ProgressSink| {
                // A count that panics weighs as heavy, as one that fails:
                // no package's weighing stops the others' conversions.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.weigh(p, cap)))
                    .unwrap_or_else(|_| {
                        tracing::error!(package = %p, "weighing the volume panicked: taken as heavy");
                        (heavy(cap), false)
                    })
            },
        );
        let pinned: HashSet<PackageId> = names
            .iter()
            .zip(&weights)
            .filter(|(_, (_, in_place))| *in_place)
            .map(|(p, _)| (*p).clone())
            .collect();
        let weighed: Vec<(PackageId, Cost)> = names
            .into_iter()
            .cloned()
            .zip(weights.into_iter().map(|(c, _)| c))
            .collect();
        let ranks = Self::place(planned, &weighed, &pinned, rest);
        // An earlier run's share must not serve this one's (its members'
        // trees may have changed since). Left where it cannot be deleted,
        // no share is made this run: each package is snapshotted from the
        // parent, as without shares.
        if fresh
            && planned.iter().any(|p| !p.shares.is_empty())
            && let Err(e) = split::wipe(self.root_fd())
        {
            tracing::warn!(error = %e, "deleting the shared cuts an earlier run left failed: snapshotting every package from the parent");
            for p in planned.iter_mut() {
                p.shares.clear();
                p.drop_shares.clear();
            }
        }
        Ok(ranks)
    }

    /// Files the `weighed` packages of `planned` by the `split` module: the
    /// light ones it clones (their trees then shed with `rest`) but those
    /// `pinned` (holding NOCOW or preallocated files), the others' sources;
    /// returns each one's rank in the order, the clones after the snapshots
    /// (by name).
    fn place(
        planned: &mut [Planned],
        weighed: &[(PackageId, Cost)],
        pinned: &HashSet<PackageId>,
        rest: Cost,
    ) -> HashMap<PackageId, usize> {
        // A package with NOCOW or preallocated files stays a snapshot: its
        // clone's files would share their extents with the old copies that
        // the snapshots and shares taken meanwhile hold, until they are
        // cut, and each first write would copy.
        let light: HashSet<PackageId> = split::light_clones(weighed)
            .into_iter()
            .filter(|p| !pinned.contains(p))
            .collect();
        let heavy = weighed.iter().filter(|(_, c)| c.at_least).count();
        let (mut light, snaps): (Vec<_>, Vec<_>) = weighed
            .iter()
            .cloned()
            .partition(|(p, _)| light.contains(p));
        light.sort_by(|a, b| a.0.cmp(&b.0));
        let shed = light.iter().fold(rest, |r, (_, c)| split::plus(r, *c));
        let shares = split::shared(weighed.len(), snaps.len(), &rest, decide::REST_MAX_US);
        let placed = split::layout(&snaps, shed, shares);
        let mut ranks = HashMap::new();
        for (rank, (pkg, placed)) in placed.into_iter().enumerate() {
            if let Some(p) = planned.iter_mut().find(|p| p.package == pkg) {
                p.shed = Some(placed.cost);
                p.shares = placed.shares;
                p.drop_shares = placed.drop;
            }
            ranks.insert(pkg, rank);
        }
        for (pkg, weight) in light {
            if let Some(p) = planned.iter_mut().find(|p| p.package == pkg) {
                p.decision = Some(Decision::Clone(CloneReason::Light { weight, heavy }));
                p.cut = None;
                p.clone = Some(weight);
            }
            ranks.insert(pkg, ranks.len());
        }
        ranks
    }

    /// What cutting the tree of the plain directory `pkg` out of a snapshot
    /// costs, counted up to `cap` (then a lower bound), and whether what
    /// was counted holds a NOCOW or preallocated file. A tree that cannot
    /// be counted weighs as heavy: the conversion reports its own errors.
    fn weigh(&self, pkg: &PackageId, cap: u64) -> (Cost, bool) {
        let stop = AtomicBool::new(false);
        let counted = sys::open_dir_at(self.root_fd(), OsStr::new(pkg.as_str())).and_then(|dir| {
            scan::scan_within(
                dir.as_fd(),
                scan::Limits {
                    stop: &stop,
                    max_work: cap,
                    weights: crate::cost::CUT,
                    skip: None,
                    one_device: true,
                    in_place: true,
                },
            )
        });
        match counted {
            Ok(c) => (Cost::cut_of(&c.est, 0, c.complete), c.in_place > 0),
            Err(e) => {
                tracing::info!(package = %pkg, error = %e, "weighing the volume failed: taken as heavy");
                (heavy(cap), false)
            }
        }
    }

    /// The subvolume holding the volumes root, or why no package can be
    /// converted by snapshotting it.
    fn parent(&self) -> Result<Result<Parent, CloneReason>, Error> {
        Parent::of(self.root_fd(), self.root.path()).with_ctx(|_| {
            (
                ErrorKind::MigrationFailed,
                format!(
                    "inspecting the subvolume holding {}",
                    self.root.path().display()
                ),
            )
        })
    }

    /// Files `pkg` into `survey` by what its names hold: a plain directory
    /// to decide for (with its identity and whether a snapshot could serve
    /// it at all), one refused whatever the method, leftovers only, or
    /// nothing (left out).
    fn survey(
        &self,
        pkg: &PackageId,
        parent: Option<&Result<Parent, CloneReason>>,
        survey: &mut Survey,
    ) -> Result<(), Error> {
        let names = Names::new(pkg)?;
        let state = State::read(&self.root, pkg, &names)?;
        let planned = Planned::undecided(
            pkg.clone(),
            state.live == Kind::Dir && state.tmp == Kind::Subvolume,
            state.old_pending(),
        );
        if state.live != Kind::Dir {
            if state.old_pending() || state.tmp != Kind::Absent || state.parent != Kind::Absent {
                survey.leftovers.push(planned);
            }
            return Ok(());
        }
        // A state no run of ours leaves: refused here as the run refuses
        // it, so that a dry run says so.
        if let Err(e) = self.check_coherent(pkg, &names, &state) {
            survey.refused.push(Planned {
                refused: Some(format!("{:#}", e.source)),
                ..planned
            });
            return Ok(());
        }
        let dir = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(step(pkg, "opening the volume"))?;
        let mounts = match &mut survey.mounts {
            Some(tables) => tables,
            slot @ None => slot.insert(read_mount_tables(pkg)?),
        };
        // Refused whatever the method: not decided, and the run fails
        // it with the reason (its tree is part of the rest every
        // snapshot sheds).
        if let Some(why) = self.refusal(pkg, &names, dir.as_fd(), mounts)? {
            survey.refused.push(Planned {
                refused: Some(why),
                ..planned
            });
            return Ok(());
        }
        let st = sys::stat(dir.as_fd()).with_ctx(step(pkg, "stat of the volume"))?;
        // `refusal` already turned away a volume on another filesystem.
        let ineligible = if planned.resume {
            Some(CloneReason::Resume)
        } else if let Some(Ok(p)) = parent
            && p.holds_nested(st.ino)
        {
            Some(CloneReason::NestedSubvolumes)
        } else {
            None
        };
        survey.candidates.push((
            planned,
            Candidate {
                key: (st.dev, st.ino),
                ineligible,
            },
        ));
        Ok(())
    }

    /// Why the plain directory `<pkg>` (open as `src`) cannot be converted
    /// at all, if it cannot: something is mounted from inside it (in any
    /// mount namespace: the conversion would leave the mount on the old
    /// tree), it is on another filesystem than the root, or it is
    /// immutable or append-only (the kernel renames no such directory, so
    /// the exchange would fail after the whole copy). The same checks for
    /// a dry run and a real one, so that they agree. `mounts`: the mount
    /// tables to look in ([`read_mount_tables`]).
    pub(crate) fn refusal(
        &self,
        pkg: &PackageId,
        names: &Names,
        src: BorrowedFd<'_>,
        mounts: &volume::mounts::MountTables,
    ) -> Result<Option<String>, Error> {
        let live_path = self.root.path().join(&names.live);
        let busy = mounts.uses_of(&live_path);
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
            .intersection(InodeFlags::IMMUTABLE | InodeFlags::APPEND);
        if !stuck.is_empty() {
            return Ok(Some(format!(
                "{} is immutable or append-only, and the kernel renames no such \
                 directory; clear the flag (chattr -i -a) and convert again",
                live_path.display()
            )));
        }
        Ok(None)
    }

    /// The file bytes of the plain directory `pkg`, for progress only: a
    /// tree it cannot count (too deep, say) is the conversion's to refuse,
    /// package by package, so here it counts 0.
    fn count_bytes(&self, pkg: &PackageId) -> u64 {
        sys::open_dir_at(self.root_fd(), OsStr::new(pkg.as_str()))
            .and_then(|dir| scan::bytes(dir.as_fd()))
            .map(|est| est.bytes)
            .unwrap_or_else(|e| {
                tracing::warn!(package = %pkg, error = %e, "counting the volume's bytes");
                0
            })
    }
}

/// The weight of a package whose count failed, counted up to `cap`:
/// heavy, a lower bound.
fn heavy(cap: u64) -> Cost {
    Cost {
        micros: cap,
        at_least: true,
        ..Cost::default()
    }
}

/// Every mount namespace's mount table as it is now (a read begun after
/// this call, shared with the packages converted at once), for the refusal
/// of `pkg` (and, in a plan, of the packages after it).
pub(crate) fn read_mount_tables(
    pkg: &PackageId,
) -> Result<std::sync::Arc<volume::mounts::MountTables>, Error> {
    volume::mounts::MountTables::read_fresh().with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            pkg.context("reading the mount tables of every mount namespace"),
        )
    })
}

/// What each snapshot of a dry run's plan sheds in the background: for one
/// of the parent, the rest outside the packages, which the schedule
/// counted, and every other package; for one of a share, what the schedule
/// weighed of its share's other members and the shares it makes.
fn shed_costs(planned: &mut [Planned]) {
    let all = planned
        .iter()
        .filter_map(|p| p.estimate)
        .fold(Estimate::default(), |acc, e| acc.plus(&e));
    for p in planned {
        // A share's member sheds its share's other members, which the
        // schedule weighed: that is its cost.
        if !p.shares.is_empty() {
            p.cut = p.shed;
            continue;
        }
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
}
