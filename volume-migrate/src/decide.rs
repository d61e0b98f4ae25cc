//! How each package is converted: the [`Decision`], and why a package is
//! cloned where it is.
//!
//! Every plain package directory under one volumes root lives in the same
//! subvolume, the *parent* (the top-level one, after the ext4-to-btrfs
//! conversion). [`Method::Auto`] converts each package by snapshotting
//! the parent and cutting the snapshot down to it ([`crate::carve`]): the
//! only way a btrfs conversion keeps every file's inode number and birth
//! time, whatever the package holds, in O(its top entries) before its
//! service may start. It clones only where a snapshot cannot serve (the
//! [`CloneReason`]s): a package with nested subvolumes (a snapshot leaves
//! them out), a partial clone to finish, a parent it cannot reach or whose
//! mounts would hide part of the snapshot, or NOCOW and preallocated files
//! outside the packages (a snapshot makes each of their extents copy on
//! its next write).
//!
//! What a package's snapshot sheds afterwards, in the background, is what
//! its source holds besides the package. Below [`crate::split::SPLIT_MIN`]
//! packages (a node's box), each is a snapshot of the parent, taken
//! heaviest first, and sheds every other package's old tree and the rest of the
//! parent: every service starts in milliseconds, and the shedding, n - 1
//! boxes, runs at idle I/O priority ([`crate::Migrator::remove_all_old`]),
//! which no service waits for. From [`crate::split::SPLIT_MIN`] on, where
//! that would be out of proportion, all but the dominant package are
//! snapshots of shared cuts, and each sheds only its share's other members
//! (the `split` module, which weighs each package, up to
//! [`crate::split::HEAVY_US`] of cutting, bounds the whole to about log2(n)
//! boxes rather than n, and says why the threshold): a light package then
//! waits for the cuts of its shares, which hold the heavy trees. At any
//! count, in a box holding a heavy package, the light packages are cloned
//! instead ([`CloneReason::Light`], the `split` module's `light_clones`):
//! below [`crate::split::SPLIT_MIN`], those past the
//! [`crate::split::PARENT_SNAPSHOTS_MAX`] heaviest.
//!
//! The rest outside the packages is shed by each snapshot of the parent:
//! every package's below [`crate::split::SPLIT_MIN`], the dominant
//! package's and the top share's from it. So it is counted once per run,
//! and only up to [`REST_MAX_US`] of cutting added up over those: beyond,
//! every package is cloned. The packages' own trees are not counted here:
//! without shares each is shed by the others' snapshots whatever its size,
//! and counting it would delay every service (a 2-million-extent database
//! took 1.1-1.3 s to count); the shares' weighing counts each only up to
//! [`crate::split::HEAVY_US`].
//!
//! NOCOW and preallocated files of the packages themselves are copied on
//! their next write, once per extent, as after any snapshot of a volume
//! (the backup before each update does the same).

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use serde::Serialize;
use volume::failpoint::failpoint;
use volume::layout::{MIGRATE_OLD_SUFFIX, MIGRATE_PARENT_SUFFIX, MIGRATE_SUFFIX};
use volume::sys;

use crate::Method;
use crate::cost::{CUT, Cost};
use crate::scan::{Counted, Limits, scan_within};

/// How much cutting the rest of the parent outside the packages may cost,
/// in microseconds by [`crate::cost`], added up over every package that
/// sheds it: 2 s (about 34,000 entries for one package, 4,300 for eight).
pub const REST_MAX_US: u64 = 2_000_000;

/// How one plain package directory is converted, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "method", content = "reason", rename_all = "kebab-case")]
pub enum Decision {
    /// Snapshot the parent subvolume and cut the snapshot down to the
    /// package ([`Method::SnapshotParent`]).
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
    /// The rest of the parent outside the packages being converted is
    /// more than every package's snapshot may shed
    /// ([`REST_MAX_US`] of cutting, added up over the packages).
    RestTooLarge {
        /// What was counted of the rest before the count stopped.
        counted: Cost,
    },
    /// A light package in a box holding a heavy one: its snapshot would
    /// shed the heavy trees, or wait for a share's cut of them, past the
    /// bounds on the background work and the wait; a clone copies only its
    /// own entries (the `split` module's `light_clones`).
    Light {
        /// What cutting its own tree costs (its clone, about as much).
        weight: Cost,
        /// The packages past the weighing's cap in the box.
        heavy: usize,
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
            CloneReason::RestTooLarge { counted } => write!(
                f,
                "the rest of its subvolume outside the packages, {counted} of cutting, is more \
                 than every package's snapshot may shed ({} s in all)",
                REST_MAX_US / 1_000_000
            ),
            CloneReason::Light { weight, heavy } => write!(
                f,
                "a light volume ({} entries, {} extents: {:.1} ms of cutting) in a box with \
                 {heavy} heavy ones: its \
                 snapshot would shed their trees or wait for a shared cut of them, past the \
                 bounds on the background work and on the wait; cloned, its files get new \
                 inode numbers",
                weight.entries,
                weight.extents,
                weight.duration().as_secs_f64() * 1000.0
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
    /// The old trees (device, inode) earlier runs left in the volumes root
    /// for removal ([`old_trees`]): shed like the rest, but
    /// garbage, so neither weighed against the bound nor a NOCOW veto (a
    /// run killed after converting a large package must not clone the
    /// others for its old tree).
    pub garbage: HashSet<(u64, u64)>,
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
        let garbage = old_trees(volumes)?;
        Ok(Ok(Parent {
            root,
            path: path.iter().collect(),
            holding,
            garbage,
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

/// The old plain directories (device, inode) earlier runs left in the
/// volumes root open as `volumes`: every `<pkg>.migrate-old`, and a
/// `<pkg>.migrate` or `<pkg>.migrate-parent` that is a plain directory
/// beside the subvolume `<pkg>` (the old directory of an exchange whose
/// rename aside was cut short). Names only our renames make: package ids
/// hold no dot.
fn old_trees(volumes: BorrowedFd<'_>) -> io::Result<HashSet<(u64, u64)>> {
    let mut out = HashSet::new();
    for (name, kind, _) in sys::read_dir_names(volumes)? {
        if kind != sys::FileType::Directory {
            continue;
        }
        let bytes = name.as_bytes();
        let old = if bytes.ends_with(MIGRATE_OLD_SUFFIX.as_bytes()) {
            true
        } else if let Some(pkg) = [MIGRATE_SUFFIX, MIGRATE_PARENT_SUFFIX]
            .iter()
            .find_map(|s| bytes.strip_suffix(s.as_bytes()))
        {
            sys::stat_at(volumes, std::ffi::OsStr::from_bytes(pkg))?
                .is_some_and(|live| live.is_dir() && live.ino == sys::SUBVOLUME_ROOT_INO)
        } else {
            false
        };
        // The directory itself must be plain: a subvolume is another device.
        if old
            && let Some(st) = sys::stat_at(volumes, &name)?
            && st.is_dir()
            && st.ino != sys::SUBVOLUME_ROOT_INO
        {
            out.insert((st.dev, st.ino));
        }
    }
    Ok(out)
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
    /// Its directory's (device, inode).
    pub key: (u64, u64),
    /// Whether it can be snapshotted at all (no partial clone to resume, no
    /// nested subvolumes): if not, the reason.
    pub ineligible: Option<CloneReason>,
}

/// What deciding found for one candidate.
#[derive(Debug, Clone)]
pub(crate) struct Decided {
    /// The decision.
    pub decision: Decision,
    /// For a snapshot: what cutting the rest outside the packages from it
    /// costs (the packages' own trees are not counted).
    pub cut: Option<Cost>,
}

/// [`Method::Auto`]'s decisions for the candidates, all plain directories
/// of one volumes root, by the rule in the module docs. `parent`: the
/// parent subvolume or why none can be snapshotted. Returns the decisions
/// in the candidates' order. Reads only. A count that fails (an entry
/// vanishing under it, an unreadable directory in the parent) fails no
/// package: each is cloned, `Failed` saying why, and the clone reports its
/// own errors, package by package.
pub(crate) fn decide(
    candidates: &[Candidate],
    parent: &Result<Parent, CloneReason>,
) -> Vec<Decided> {
    let parent = match parent {
        Ok(p) => p,
        Err(reason) => return all_clone(candidates, reason),
    };
    let carved = candidates.iter().filter(|c| c.ineligible.is_none()).count() as u64;
    if carved == 0 {
        return all_clone(candidates, &CloneReason::Forced);
    }
    // The rest is shed by each snapshot of the parent: with shares, the
    // dominant package's and the top share's (the `split` module, which
    // makes shares rather than more snapshots of the parent where the
    // light packages are cloned and the rest would pass this bound over
    // those left); else every package's.
    let sheds = if carved >= crate::split::SPLIT_MIN as u64 {
        2
    } else {
        carved
    };
    let rest = match count_rest(candidates, parent, REST_MAX_US / sheds) {
        Ok(rest) => rest,
        Err(e) => {
            // A tree a conversion refuses is that package's to report: it
            // fails on its own, saying why.
            if volume::walk::is_too_deep(&e) || volume::walk::is_crossing(&e) {
                tracing::info!(error = %e, "counting the parent's rest failed; cloning every package");
            } else {
                tracing::warn!(error = %e, "counting the parent's rest failed; cloning every package");
            }
            let why = format!("deciding failed ({e}): a clone still works");
            return all_clone(candidates, &CloneReason::Failed { why });
        }
    };
    let cut = Cost::cut_of(&rest.est, 0, rest.complete);
    let veto = if !rest.complete {
        Some(CloneReason::RestTooLarge { counted: cut })
    } else if rest.in_place > 0 {
        Some(CloneReason::InPlaceFiles {
            files: rest.in_place,
        })
    } else {
        None
    };
    if let Some(veto) = veto {
        return all_clone(candidates, &veto);
    }
    candidates
        .iter()
        .map(|c| match &c.ineligible {
            Some(why) => Decided {
                decision: Decision::Clone(why.clone()),
                cut: None,
            },
            None => Decided {
                decision: Decision::SnapshotParent,
                cut: Some(cut),
            },
        })
        .collect()
}

/// The decisions for the candidates when the method is forced
/// ([`Method::Clone`] or [`Method::SnapshotParent`]): nothing is counted,
/// and a partial clone to finish says so. Reads nothing.
pub(crate) fn forced(candidates: &[Candidate], method: Method) -> Vec<Decided> {
    candidates
        .iter()
        .map(|c| Decided {
            decision: match (method, &c.ineligible) {
                (Method::SnapshotParent, _) => Decision::SnapshotParent,
                (_, Some(CloneReason::Resume)) => Decision::Clone(CloneReason::Resume),
                _ => Decision::Clone(CloneReason::Forced),
            },
            cut: None,
        })
        .collect()
}

/// Counts the parent's tree outside every candidate's directory and the
/// old trees, up to `max_work` microseconds of cutting.
fn count_rest(candidates: &[Candidate], parent: &Parent, max_work: u64) -> io::Result<Counted> {
    failpoint("migrate.decide")?;
    let mut skip: HashSet<(u64, u64)> = candidates.iter().map(|c| c.key).collect();
    skip.extend(&parent.garbage);
    let stop = AtomicBool::new(false);
    scan_within(
        parent.root.as_fd(),
        Limits {
            stop: &stop,
            max_work,
            weights: CUT,
            skip: Some(&skip),
            one_device: true,
            in_place: true,
        },
    )
}

/// Every candidate cloned, for `reason` unless it is ineligible.
fn all_clone(candidates: &[Candidate], reason: &CloneReason) -> Vec<Decided> {
    candidates
        .iter()
        .map(|c| Decided {
            decision: Decision::Clone(c.ineligible.clone().unwrap_or_else(|| reason.clone())),
            cut: None,
        })
        .collect()
}
