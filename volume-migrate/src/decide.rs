//! How each package is converted: the [`Decision`], and the cost rule
//! [`Method::Auto`] decides by.
//!
//! Every plain package directory under one volumes root lives in the same
//! subvolume, the *parent* (the top-level one, after the ext4-to-btrfs
//! conversion). Converting package `P` by snapshotting the parent costs
//! `K(P)`, the cut: removing from the snapshot everything but `P` (the rest
//! of the parent, `R` less `P`'s own share) and lifting `P`'s top entries.
//! Cloning costs `C(P)`. Both are estimated from counts of entries and
//! extent items with the per-unit costs of [`crate::cost`], and the parent
//! snapshot is chosen when `K(P) <= C(P) / CUT_AT_MOST_DIVISOR`.
//!
//! At most one package per parent can win: once it is converted, its old
//! tree is in every other package's rest. The one to try is the
//! *dominant* package, the one with the largest `C(P) + 2 CUT(P)` (with
//! the divisor at 2): the rule reads `C(P) + 2 CUT(P) >= 2 (R + lifted)`,
//! and `R` is the same for every package, so if any package passes, the
//! dominant one does (up to its top entries). Counting finds it without
//! counting it whole: every package is counted on a thread of its own that
//! pauses at a budget ([`FIRST_ROUND_US`], times [`ROUND_GROWTH`] each
//! round, the paused counts going on where they stood) until at most one is
//! left over it, so the dominant one is counted only about as far as the
//! others weigh. Its rest is then what was counted of
//! the others plus everything else in the parent, which is counted only up
//! to what the rule allows (and the dominant further, if the rest needs
//! it). Deciding thus costs about what counting the other packages costs,
//! whatever the dominant one holds.
//!
//! NOCOW and preallocated files: btrfs copies their extents on their next
//! write once their subvolume has been snapshotted. Those of the packages
//! the same run converts do not count: each is converted next, into a new
//! subvolume of its own that was never snapshotted. While its old tree
//! and its old directory in the snapshot's rest exist, its files share
//! their extents with them, so each first write to a block would be a copy
//! (`bench --only boot` measured 8,190 new extents for 4,096 writes); a
//! clone that copied NOCOW files therefore removes those old copies before
//! the package is reported done ([`crate::MigrateOptions::defer_cut`]), and
//! its service's first writes are in place, as after upstream's
//! conversion. Those anywhere else in the parent stay in a snapshotted
//! subvolume for good, and veto the snapshot.

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::thread::ScopedJoinHandle;

use models::PackageId;
use serde::Serialize;
use volume::failpoint::failpoint;
use volume::sys;

use crate::cost::{self, CLONE_ENTRY_US, CUT, CUT_AT_MOST_DIVISOR, CUT_ENTRY_US, Cost};
use crate::scan::{self, Counted, Gate, Limits, Status, Weights, scan_within};
use crate::{Estimate, Method};

/// A package whose clone costs less than this (microseconds, by
/// [`crate::cost`]) is cloned without looking further: 25 ms, about the
/// commit a snapshot itself waits for (11-17 ms measured) plus deciding.
pub const SNAPSHOT_MIN_CLONE_US: u64 = 25_000;
/// The first round's budget when counting for the dominant package, in
/// microseconds of the rank's weight (a clone plus two cuts): 1 s, about
/// 6,400 entries or 77,000 extent items, so most packages are counted
/// whole in the first round.
pub const FIRST_ROUND_US: u64 = 1_000_000;
/// Each round lets the counts still going run four times as far: few
/// rounds, and the dominant package counted at most four times further
/// than the rule needed.
pub const ROUND_GROWTH: u64 = 4;

/// The weights packages are ranked by: a clone plus the divisor's cuts.
const RANK: Weights = Weights {
    entry: CLONE_ENTRY_US + CUT_AT_MOST_DIVISOR * CUT_ENTRY_US,
    extent: cost::CLONE_EXTENT_US + CUT_AT_MOST_DIVISOR * cost::CUT_EXTENT_US,
};

/// The dominant package's count is taken this much further than the cut
/// known so far needs (an eighth): the extrapolation assumes its uncounted
/// part weighs like its counted part, and the rest outside the packages is
/// counted only afterwards.
const NEEDED_MARGIN_DIVISOR: u128 = 8;

/// The dominant package's next budget (in [`RANK`] units), having counted
/// `rank_now` of it, a clone of `clone_now` microseconds so far, against a
/// cut of at least `cut_floor`: enough for the clone to reach
/// [`CUT_AT_MOST_DIVISOR`] times the cut (and a margin), extrapolated from
/// what was counted, and never less than a quarter more than `budget`;
/// where the cut is `unbounded` (its count stopped at its bound), at least
/// [`ROUND_GROWTH`] times `budget`. Counting it a fixed factor further
/// instead made deciding grow with the dominant package's extents: at 2
/// million, the count went three times as far as the rule needed (1.78 s
/// before the first service, against 786 ms at 500,000).
fn next_budget(budget: u64, rank_now: u64, clone_now: u64, cut_floor: u64, unbounded: bool) -> u64 {
    let want_clone = u128::from(cut_floor) * u128::from(CUT_AT_MOST_DIVISOR);
    let want_clone = want_clone + want_clone / NEEDED_MARGIN_DIVISOR;
    let target = u128::from(rank_now.max(1)) * want_clone / u128::from(clone_now.max(1));
    let target = u64::try_from(target).unwrap_or(u64::MAX);
    let least = if unbounded {
        budget.saturating_mul(ROUND_GROWTH)
    } else {
        budget.saturating_add(budget / 4)
    };
    target.max(least)
}

/// How one plain package directory is converted, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "method", content = "reason", rename_all = "kebab-case")]
pub enum Decision {
    /// Snapshot the parent subvolume and cut the snapshot down to the
    /// package ([`Method::SnapshotParent`]): forced, or the cut costs at
    /// most [`CUT_AT_MOST_DIVISOR`]th of the clone and nothing vetoes it.
    SnapshotParent,
    /// Reflink every entry into a new subvolume ([`Method::Clone`]).
    Clone(CloneReason),
}

impl Decision {
    /// The method this decision converts by.
    pub fn method(&self) -> Method {
        match self {
            Decision::SnapshotParent => Method::SnapshotParent,
            Decision::Clone(_) => Method::Clone,
        }
    }
}

/// Why a package is cloned rather than converted by snapshotting its
/// parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum CloneReason {
    /// [`Method::Clone`] was asked for.
    Forced,
    /// An interrupted run's partial clone is there to finish.
    Resume,
    /// The clone costs less than [`SNAPSHOT_MIN_CLONE_US`].
    Small,
    /// Cutting the parent's snapshot down would cost more than
    /// [`CUT_AT_MOST_DIVISOR`]th of the clone.
    CutCostsMore,
    /// Another package of the same parent is converted by snapshot;
    /// removing it from this one's snapshot would cost what it saves.
    NotDominant {
        /// The package converted by snapshot.
        dominant: PackageId,
    },
    /// The package holds nested subvolumes, which a snapshot leaves out.
    NestedSubvolumes,
    /// The root of the parent subvolume is not reachable from the volumes
    /// root's mount (a bind mount of a subdirectory, say).
    ParentUnreachable {
        /// The volumes root.
        root: PathBuf,
    },
    /// Something is mounted inside the parent, hiding what a snapshot
    /// would hold.
    MountedInParent {
        /// The mount points.
        mounts: Vec<PathBuf>,
    },
    /// The parent holds NOCOW or preallocated files outside the packages
    /// this run converts, which a snapshot would make copy their data on
    /// their next write.
    InPlaceFiles {
        /// How many.
        files: u64,
    },
    /// The free metadata space does not cover the cut.
    Space {
        /// The figures.
        why: String,
    },
    /// Deciding, or the cut, failed: a clone still works.
    Failed {
        /// What failed.
        why: String,
    },
}

impl fmt::Display for CloneReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloneReason::Forced => f.write_str("the clone method was asked for"),
            CloneReason::Resume => f.write_str("an interrupted clone is there to finish"),
            CloneReason::Small => write!(
                f,
                "the clone costs under {} ms",
                SNAPSHOT_MIN_CLONE_US / 1000
            ),
            CloneReason::CutCostsMore => write!(
                f,
                "cutting a snapshot of the parent down would cost more than 1/{CUT_AT_MOST_DIVISOR} \
                 of the clone"
            ),
            CloneReason::NotDominant { dominant } => write!(
                f,
                "{dominant} is converted by snapshotting the parent, and its old tree would be \
                 this one's cut"
            ),
            CloneReason::NestedSubvolumes => f.write_str("the volume holds nested subvolumes"),
            CloneReason::ParentUnreachable { root } => write!(
                f,
                "the root of the subvolume holding {} is not reachable from its mount",
                root.display()
            ),
            CloneReason::MountedInParent { mounts } => write!(
                f,
                "{} is mounted inside its subvolume",
                mounts
                    .iter()
                    .map(|m| m.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            CloneReason::InPlaceFiles { files } => write!(
                f,
                "the rest of its subvolume holds {files} NOCOW or preallocated files outside \
                 the packages being converted, which a snapshot would make copy their data on \
                 the next write"
            ),
            CloneReason::Space { why } | CloneReason::Failed { why } => f.write_str(why),
        }
    }
}

/// The subvolume holding the volumes root, as far as a snapshot of it is
/// concerned.
pub(crate) struct Parent {
    /// Its root directory.
    pub root: OwnedFd,
    /// The volumes root's path from there.
    pub path: PathBuf,
    /// The entries of the volumes root (by inode number) that hold a
    /// subvolume somewhere below them: a snapshot would leave it out.
    holding: HashSet<u64>,
}

impl Parent {
    /// The parent of the volumes root open as `volumes` (at `root_path`),
    /// or why it cannot be snapshotted for a package.
    pub fn of(
        volumes: BorrowedFd<'_>,
        root_path: &Path,
    ) -> io::Result<Result<Parent, CloneReason>> {
        let Some((root, path)) = sys::subvolume_root_of(volumes)? else {
            return Ok(Err(CloneReason::ParentUnreachable {
                root: root_path.to_owned(),
            }));
        };
        // The snapshot holds what mounts hide, which nothing here can count.
        let hidden = volume::mounts::mount_points_below(&sys::fd_path(root.as_fd())?)?;
        if !hidden.is_empty() {
            return Ok(Err(CloneReason::MountedInParent { mounts: hidden }));
        }
        let holding = entries_holding_subvolumes(root.as_fd(), sys::stat(volumes)?.ino)?;
        Ok(Ok(Parent {
            root,
            path: path.iter().collect(),
            holding,
        }))
    }

    /// The path of the package directory `name` from the parent's root.
    pub fn keep(&self, name: &std::ffi::OsStr) -> PathBuf {
        self.path.join(name)
    }

    /// Whether the package directory with inode number `ino` (an entry of
    /// the volumes root) holds nested subvolumes.
    pub fn holds_nested(&self, ino: u64) -> bool {
        self.holding.contains(&ino)
    }
}

/// The entries of the directory `volumes` (inode number, in the subvolume
/// whose root is open as `parent`) below which a subvolume is nested, found
/// by walking up from each subvolume linked into `parent` through the
/// inodes' reference items: no path is built, so a subvolume under names
/// far past PATH_MAX, anywhere in the parent, is placed like any other.
fn entries_holding_subvolumes(parent: BorrowedFd<'_>, volumes: u64) -> io::Result<HashSet<u64>> {
    let tree = sys::subvolume_info(parent)?.id;
    let mut holding = HashSet::new();
    // Those nested deeper sit inside one of these.
    for n in sys::nested_subvolumes(parent)?
        .iter()
        .filter(|n| n.depth == 1)
    {
        let (mut below, mut cur) = (None, n.dirid);
        while cur != volumes {
            let Some((up, _)) = sys::dir_parent(parent, tree, cur)? else {
                break;
            };
            (below, cur) = (Some(cur), up);
        }
        if cur == volumes
            && let Some(entry) = below
        {
            holding.insert(entry);
        }
    }
    Ok(holding)
}

/// One package to decide for.
pub(crate) struct Candidate {
    /// The package.
    pub package: PackageId,
    /// Its plain directory.
    pub dir: OwnedFd,
    /// Its directory's (device, inode).
    pub key: (u64, u64),
    /// Whether it can be snapshotted at all (no partial clone to resume, no
    /// nested subvolumes): if not, the reason.
    pub ineligible: Option<CloneReason>,
    /// What counting found so far, once counted.
    pub count: Option<Counted>,
}

impl Candidate {
    /// Whether it has been counted to the end.
    fn complete(&self) -> bool {
        self.count.is_some_and(|c| c.complete)
    }

    /// What was counted of it (nothing yet: zeros).
    fn est(&self) -> Estimate {
        self.count.map(|c| c.est).unwrap_or_default()
    }

    /// Its clone's cost, as far as counted.
    fn clone_cost(&self) -> Option<Cost> {
        self.count.map(|c| Cost::clone_of(&c.est, c.complete))
    }
}

/// What deciding found for one candidate.
#[derive(Debug, Clone)]
pub(crate) struct Decided {
    /// The decision.
    pub decision: Decision,
    /// The clone's cost, as far as counted (`None`: not counted).
    pub clone: Option<Cost>,
    /// The cut's cost, as far as counted (`None`: not counted).
    pub cut: Option<Cost>,
    /// What counting found of the package, if it was counted.
    pub count: Option<Counted>,
}

/// Every candidate's count, each on its own thread behind a [`Gate`]: the
/// rounds raise budgets instead of counting again, and the counts of
/// different packages overlap (on two cores, and on the disk when cold).
struct Counts<'scope, 'g> {
    gates: &'g [Gate],
    handles: Vec<Option<ScopedJoinHandle<'scope, io::Result<Counted>>>>,
    /// What each has counted so far: whole once its thread finished.
    now: Vec<Counted>,
}

impl Counts<'_, '_> {
    /// Waits for count `i` to pause or finish, and takes what it has.
    fn refresh(&mut self, i: usize) -> io::Result<()> {
        match self.gates[i].wait() {
            Status::Paused(est) => {
                self.now[i] = Counted {
                    est,
                    complete: false,
                    in_place: 0,
                };
            }
            Status::Finished => {
                if let Some(h) = self.handles[i].take() {
                    self.now[i] = match h.join() {
                        Ok(r) => r?,
                        Err(panic) => std::panic::resume_unwind(panic),
                    };
                }
            }
        }
        Ok(())
    }

    /// Lets count `i` go on up to `budget`, and waits for it.
    fn raise(&mut self, i: usize, budget: u64) -> io::Result<()> {
        self.gates[i].raise(budget);
        self.refresh(i)
    }
}

/// Stops every count when deciding ends, however it ends, so that no
/// thread waits at its gate for ever.
struct StopAll<'g>(&'g [Gate]);

impl Drop for StopAll<'_> {
    fn drop(&mut self) {
        self.0.iter().for_each(Gate::stop);
    }
}

/// [`Method::Auto`]'s decisions for the candidates, all plain directories
/// of one volumes root, by the rule in the module docs. `parent`: the
/// parent subvolume or why none can be snapshotted. Returns the decisions
/// in the candidates' order. Reads only. Deciding that fails (an entry
/// vanishing under a count, an unreadable directory anywhere in the
/// parent) fails no package: each is cloned, `Failed` saying why, and the
/// clone reports its own errors, package by package.
pub(crate) fn decide(
    candidates: &mut [Candidate],
    parent: &Result<Parent, CloneReason>,
) -> Vec<Decided> {
    match try_decide(candidates, parent) {
        Ok(decided) => decided,
        Err(e) => {
            // A tree a conversion refuses is that package's to report: it
            // fails on its own, saying why.
            if volume::walk::is_too_deep(&e) || volume::walk::is_crossing(&e) {
                tracing::info!(error = %e, "deciding how to convert failed; cloning every package");
            } else {
                tracing::warn!(error = %e, "deciding how to convert failed; cloning every package");
            }
            let why = format!("deciding failed ({e}): a clone still works");
            all_clone(candidates, |_| CloneReason::Failed { why: why.clone() })
        }
    }
}

fn try_decide(
    candidates: &mut [Candidate],
    parent: &Result<Parent, CloneReason>,
) -> io::Result<Vec<Decided>> {
    let parent = match parent {
        Ok(p) => p,
        Err(reason) => return Ok(all_clone(candidates, |_| reason.clone())),
    };
    // The ineligible are counted whole: they are part of the dominant
    // one's rest.
    let gates: Vec<Gate> = candidates
        .iter()
        .map(|c| {
            Gate::new(if c.ineligible.is_some() {
                u64::MAX
            } else {
                FIRST_ROUND_US
            })
        })
        .collect();
    let (verdict, d, counts) = std::thread::scope(|scope| -> io::Result<_> {
        let _stop = StopAll(&gates);
        let mut counts = Counts {
            gates: &gates,
            handles: candidates
                .iter()
                .zip(&gates)
                .map(|(c, gate)| {
                    let dir = c.dir.as_fd();
                    scan::walker()
                        .spawn_scoped(scope, move || {
                            let stop = AtomicBool::new(false);
                            let r = scan_within(
                                dir,
                                Limits {
                                    max_work: gate.budget(),
                                    weights: RANK,
                                    gate: Some(gate),
                                    // For the order: read with the extents.
                                    in_place: true,
                                    ..Limits::all(&stop)
                                },
                            );
                            gate.finish();
                            r
                        })
                        .map(Some)
                })
                .collect::<io::Result<_>>()?,
            now: vec![Counted::default(); candidates.len()],
        };
        for i in 0..candidates.len() {
            counts.refresh(i)?;
        }
        // Rounds, until at most one eligible candidate is left over the
        // budget.
        let mut budget = FIRST_ROUND_US;
        loop {
            let open: Vec<usize> = (0..candidates.len())
                .filter(|&i| candidates[i].ineligible.is_none() && !counts.now[i].complete)
                .collect();
            if open.len() <= 1 {
                break;
            }
            budget = budget.saturating_mul(ROUND_GROWTH);
            for &i in &open {
                counts.gates[i].raise(budget);
            }
            for &i in &open {
                counts.refresh(i)?;
            }
        }
        let dominant = (0..candidates.len())
            .filter(|&i| candidates[i].ineligible.is_none())
            .max_by_key(|&i| (!counts.now[i].complete, RANK.of(&counts.now[i].est)));
        let Some(d) = dominant else {
            return Ok((None, 0, counts.now));
        };

        let lifted = sys::read_dir_names(candidates[d].dir.as_fd())?.len() as u64;
        let others = (0..candidates.len())
            .filter(|&i| i != d)
            .fold(Estimate::default(), |acc, i| acc.plus(&counts.now[i].est));
        let skip: HashSet<(u64, u64)> = candidates.iter().map(|c| c.key).collect();
        let verdict = loop {
            let complete = counts.now[d].complete;
            let clone = Cost::clone_of(&counts.now[d].est, complete);
            if complete && clone.micros < SNAPSHOT_MIN_CLONE_US {
                break Verdict::Clone(CloneReason::Small, None);
            }
            let allowed = clone.micros / CUT_AT_MOST_DIVISOR;
            let known = Cost::cut_of(&others, lifted, true);
            if known.micros <= allowed {
                failpoint("migrate.decide")?;
                let stop = AtomicBool::new(false);
                let rest = scan_within(
                    parent.root.as_fd(),
                    Limits {
                        stop: &stop,
                        max_work: allowed - known.micros,
                        weights: CUT,
                        skip: Some(&skip),
                        one_device: true,
                        in_place: true,
                        gate: None,
                    },
                )?;
                let cut = Cost::cut_of(&others.plus(&rest.est), lifted, rest.complete);
                if rest.complete {
                    if rest.in_place > 0 {
                        break Verdict::Clone(
                            CloneReason::InPlaceFiles {
                                files: rest.in_place,
                            },
                            Some(cut),
                        );
                    }
                    break Verdict::Snapshot(cut);
                }
                if complete {
                    break Verdict::Clone(CloneReason::CutCostsMore, Some(cut));
                }
            } else if complete {
                break Verdict::Clone(CloneReason::CutCostsMore, Some(known.at_least()));
            }
            // The cut may still fit in a clone counted further: as far as
            // the cut known so far needs, or a round further where the
            // rest's own count stopped at its bound (its size unknown).
            let (floor, unbounded) = if known.micros > allowed {
                (known.micros, false)
            } else {
                (allowed, true)
            };
            budget = next_budget(
                budget,
                RANK.of(&counts.now[d].est),
                clone.micros,
                floor,
                unbounded,
            );
            counts.raise(d, budget)?;
        };
        Ok((Some(verdict), d, counts.now))
    })?;
    for (c, counted) in candidates.iter_mut().zip(counts) {
        c.count = Some(counted);
    }
    let Some(verdict) = verdict else {
        return Ok(all_clone(candidates, |_| CloneReason::CutCostsMore));
    };

    let dominant_pkg = candidates[d].package.clone();
    let snapshot = matches!(verdict, Verdict::Snapshot(_));
    let mut out = all_clone(candidates, |c| {
        if snapshot {
            CloneReason::NotDominant {
                dominant: dominant_pkg.clone(),
            }
        } else if c.complete()
            && c.clone_cost()
                .is_some_and(|k| k.micros < SNAPSHOT_MIN_CLONE_US)
        {
            CloneReason::Small
        } else {
            CloneReason::CutCostsMore
        }
    });
    match verdict {
        Verdict::Snapshot(cut) => {
            out[d].decision = Decision::SnapshotParent;
            out[d].cut = Some(cut);
        }
        Verdict::Clone(reason, cut) => {
            out[d].decision = Decision::Clone(reason);
            out[d].cut = cut;
        }
    }
    out[d].clone = candidates[d].clone_cost();
    out[d].count = candidates[d].count;
    // Everyone else's cut holds at least the others' shares.
    for (i, o) in out.iter_mut().enumerate() {
        if i != d {
            let rest = candidates
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .fold(Estimate::default(), |acc, (_, c)| acc.plus(&c.est()));
            o.cut = Some(Cost::cut_of(&rest, 0, false));
        }
    }
    Ok(out)
}

/// The dominant candidate's verdict.
enum Verdict {
    Snapshot(Cost),
    Clone(CloneReason, Option<Cost>),
}

/// Every candidate cloned, for `reason` unless it is ineligible.
fn all_clone(
    candidates: &[Candidate],
    mut reason: impl FnMut(&Candidate) -> CloneReason,
) -> Vec<Decided> {
    candidates
        .iter()
        .map(|c| Decided {
            decision: Decision::Clone(c.ineligible.clone().unwrap_or_else(|| reason(c))),
            clone: c.clone_cost(),
            cut: None,
            count: c.count,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dominant_count_goes_as_far_as_the_cut_needs() {
        // 4 s of rank counted, 2.1 s of clone in it, a cut of 1.34 s: the
        // clone must reach 2.68 s and an eighth, about 5.74 s of rank,
        // whatever the package holds beyond.
        let next = next_budget(4_000_000, 4_000_000, 2_100_000, 1_340_000, false);
        assert_eq!(next, 4_000_000 * 3_015_000 / 2_100_000);
        // Never less than a quarter further, so the loop ends.
        assert_eq!(
            next_budget(4_000_000, 4_000_000, 4_000_000, 1, false),
            5_000_000
        );
        // A rest whose count stopped at its bound: a whole round further.
        assert_eq!(
            next_budget(4_000_000, 4_000_000, 2_100_000, 1_050_000, true),
            16_000_000
        );
        // Nothing counted yet and huge figures neither divide by zero nor wrap.
        assert!(next_budget(1, 0, 0, u64::MAX, false) == u64::MAX);
    }
}
