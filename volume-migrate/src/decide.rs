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
//! counting it whole: every package is counted in rounds of growing
//! budget until at most one is left over the budget ([`FIRST_ROUND_US`],
//! times [`ROUND_GROWTH`] each round), so the dominant one is counted only
//! about as far as the others weigh. Its rest is then what was counted of
//! the others plus everything else in the parent, which is counted only up
//! to what the rule allows (and the dominant further, if the rest needs
//! it). Deciding thus costs about what counting the other packages costs,
//! whatever the dominant one holds.
//!
//! NOCOW and preallocated files: btrfs copies their extents on their next
//! write once their subvolume has been snapshotted. Those of the packages
//! the same run converts do not count: each is converted next, into a new
//! subvolume of its own that was never snapshotted, and its old tree and
//! the rest of the snapshot are removed after services start (measured by
//! `bench --only boot`: their first writes cost the same both ways). Those
//! anywhere else in the parent stay in a snapshotted subvolume for good,
//! and veto the snapshot.

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use models::PackageId;
use serde::Serialize;
use volume::sys;

use crate::cost::{self, CLONE_ENTRY_US, CUT, CUT_AT_MOST_DIVISOR, CUT_ENTRY_US, Cost};
use crate::scan::{Counted, Limits, Weights, scan_within};
use crate::{Estimate, Method};

/// A package whose clone costs less than this (microseconds, by
/// [`crate::cost`]) is cloned without looking further: 25 ms, about the
/// commit a snapshot itself waits for (11-17 ms measured) plus deciding.
pub const SNAPSHOT_MIN_CLONE_US: u64 = 25_000;
/// The first round's budget when counting for the dominant package, in
/// microseconds of the rank's weight (a clone plus two cuts): 1 s, about 7,000 entries or 90,000
/// extent items, so most packages are counted whole in the first round.
pub const FIRST_ROUND_US: u64 = 1_000_000;
/// Each round counts four times as far as the one before: recounting from
/// the start each round then costs at most a third more than one count.
pub const ROUND_GROWTH: u64 = 4;

/// The weights packages are ranked by: a clone plus the divisor's cuts.
const RANK: Weights = Weights {
    entry: CLONE_ENTRY_US + CUT_AT_MOST_DIVISOR * CUT_ENTRY_US,
    extent: cost::CLONE_EXTENT_US + CUT_AT_MOST_DIVISOR * cost::CUT_EXTENT_US,
};

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
    /// Subvolumes nested in it, by path from its root.
    pub nested: Vec<PathBuf>,
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
        let nested = sys::nested_subvolumes(root.as_fd())?;
        Ok(Ok(Parent {
            root,
            path: path.iter().collect(),
            nested,
        }))
    }

    /// The path of the package directory `name` from the parent's root.
    pub fn keep(&self, name: &std::ffi::OsStr) -> PathBuf {
        self.path.join(name)
    }

    /// Whether the package at `keep` holds nested subvolumes.
    pub fn holds_nested(&self, keep: &Path) -> bool {
        self.nested.iter().any(|p| p.starts_with(keep))
    }
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

/// Counts `dir` with `weights` up to `max_work` (no limit: `u64::MAX`).
fn count(dir: BorrowedFd<'_>, weights: Weights, max_work: u64) -> io::Result<Counted> {
    let stop = AtomicBool::new(false);
    scan_within(
        dir,
        Limits {
            max_work,
            weights,
            ..Limits::all(&stop)
        },
    )
}

/// [`Method::Auto`]'s decisions for the candidates, all plain directories
/// of one volumes root, by the rule in the module docs. `parent`: the
/// parent subvolume or why none can be snapshotted. Returns the decisions
/// in the candidates' order. Reads only.
pub(crate) fn decide(
    candidates: &mut [Candidate],
    parent: &Result<Parent, CloneReason>,
) -> io::Result<Vec<Decided>> {
    let parent = match parent {
        Ok(p) => p,
        Err(reason) => return Ok(all_clone(candidates, |_| reason.clone())),
    };
    // Rounds: count every open candidate up to the budget, until at most one
    // eligible candidate is left over it. The ineligible are counted whole:
    // they are part of the dominant one's rest.
    for c in candidates.iter_mut().filter(|c| c.ineligible.is_some()) {
        c.count = Some(count(c.dir.as_fd(), RANK, u64::MAX)?);
    }
    let mut budget = FIRST_ROUND_US;
    loop {
        let mut open = 0;
        for c in candidates
            .iter_mut()
            .filter(|c| c.ineligible.is_none() && !c.complete())
        {
            let counted = count(c.dir.as_fd(), RANK, budget)?;
            open += usize::from(!counted.complete);
            c.count = Some(counted);
        }
        if open <= 1 {
            break;
        }
        budget = budget.saturating_mul(ROUND_GROWTH);
    }
    let dominant = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.ineligible.is_none())
        .max_by_key(|(_, c)| (!c.complete(), RANK.of(&c.est())))
        .map(|(i, _)| i);
    let Some(d) = dominant else {
        return Ok(all_clone(candidates, |_| CloneReason::CutCostsMore));
    };

    let lifted = sys::read_dir_names(candidates[d].dir.as_fd())?.len() as u64;
    let others = candidates
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != d)
        .fold(Estimate::default(), |acc, (_, c)| acc.plus(&c.est()));
    let skip: HashSet<(u64, u64)> = candidates.iter().map(|c| c.key).collect();
    let verdict = loop {
        let complete = candidates[d].complete();
        let clone = Cost::clone_of(&candidates[d].est(), complete);
        if complete && clone.micros < SNAPSHOT_MIN_CLONE_US {
            break Verdict::Clone(CloneReason::Small, None);
        }
        let allowed = clone.micros / CUT_AT_MOST_DIVISOR;
        let known = Cost::cut_of(&others, lifted, true);
        if known.micros <= allowed {
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
        // The cut may still fit in a clone counted further.
        budget = budget.saturating_mul(ROUND_GROWTH);
        candidates[d].count = Some(count(candidates[d].dir.as_fd(), RANK, budget)?);
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
