//! What [`Method::SnapshotParent`](crate::Method::SnapshotParent) needs of
//! one package, checked just before the cut ([`ParentPlan::prepare`],
//! [`ParentPlan::check_space`]):
//! what can have changed since the schedule, and the free space for the
//! cut. Reads only: a crash here leaves nothing behind.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use models::{Error, PackageId, ResultExt};
use volume::sys;

use crate::Estimate;
use crate::cost::Cost;
use crate::decide::{CloneReason, Parent};
use crate::errors::step;
use crate::scan::{Limits, Weights, scan_within};

/// What [`Method::SnapshotParent`](crate::Method::SnapshotParent) needs,
/// checked just before the cut.
pub(crate) struct ParentPlan {
    /// The root of the subvolume holding the volumes root.
    pub root: OwnedFd,
    /// `<pkg>`'s path from there.
    pub keep: PathBuf,
    /// `<pkg>`'s inode number.
    pub ino: u64,
    /// What the cut touches: the rest of the subvolume, which it removes
    /// (or sets aside), and `<pkg>`'s top entries, which it lifts.
    pub rest: Estimate,
    /// `<pkg>`'s top entries.
    pub lifted: u64,
}

impl ParentPlan {
    /// Checks, just before the cut, what can have changed since the
    /// schedule (the parent's root, mounts inside it, nested subvolumes in
    /// `pkg`, the plain directory `live` under `root`, open as `src`), and
    /// counts what the cut touches; or why a snapshot cannot serve. `cut`:
    /// what the schedule counted of the rest outside the packages;
    /// `forced`: counts the whole rest of the parent again, NOCOW and
    /// preallocated files included (the schedule did not). The free space
    /// is the caller's to check ([`ParentPlan::check_space`]).
    pub fn prepare(
        root: &volume::Root,
        pkg: &PackageId,
        live: &OsStr,
        src: BorrowedFd<'_>,
        cut: Option<Cost>,
        forced: bool,
    ) -> Result<Result<ParentPlan, CloneReason>, Error> {
        let parent = match Parent::of(root.fd(), root.path()).with_ctx(step(
            pkg,
            "inspecting the subvolume holding the volumes root",
        ))? {
            Ok(p) => p,
            Err(reason) => return Ok(Err(reason)),
        };
        let keep = parent.keep(live);
        let st = sys::stat(src).with_ctx(step(pkg, "stat of the volume"))?;
        if parent.holds_nested(st.ino) {
            return Ok(Err(CloneReason::NestedSubvolumes));
        }
        let lifted = sys::read_dir_names(src)
            .with_ctx(step(pkg, "reading the volume"))?
            .len() as u64;
        // The schedule counted the rest outside the packages; what the
        // snapshot holds of the other packages leaves it in the background,
        // which checks its own space.
        let rest = match cut {
            Some(cut) if !forced => Estimate {
                entries: cut.entries,
                extents: cut.extents,
                ..Estimate::default()
            },
            _ => match count_rest(pkg, &parent, (st.dev, st.ino))? {
                Ok(rest) => rest,
                Err(reason) => return Ok(Err(reason)),
            },
        };
        Ok(Ok(ParentPlan {
            root: parent.root,
            keep,
            ino: st.ino,
            rest,
            lifted,
        }))
    }

    /// Whether the free metadata space covers the cut. Removing from a fresh
    /// snapshot copies each shared leaf it touches on write (and adds back
    /// references for every extent in it): at worst a leaf per entry
    /// removed or lifted, plus the extent items, plus `reserve`. A deferred
    /// cut spends the same later, so it is held to the same.
    pub fn check_space(
        &self,
        space: &sys::MetadataSpace,
        reserve: u64,
    ) -> Result<(), CutShortfall> {
        let need = (self.rest.entries + self.lifted)
            .saturating_mul(space.node_size)
            .saturating_add(self.rest.extents.saturating_mul(128))
            .saturating_add(reserve);
        if space.free() < need {
            return Err(CutShortfall {
                free: space.free(),
                need,
                rest: self.rest,
                lifted: self.lifted,
                reserve,
            });
        }
        Ok(())
    }
}

/// The whole rest of the parent outside `<pkg>` (its `key`) and the old
/// trees, counted for the cut; or why a snapshot must not serve (NOCOW or
/// preallocated files in it).
fn count_rest(
    pkg: &PackageId,
    parent: &Parent,
    key: (u64, u64),
) -> Result<Result<Estimate, CloneReason>, Error> {
    let stop = AtomicBool::new(false);
    let mut skip = HashSet::from([key]);
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
        return Ok(Err(CloneReason::InPlaceFiles {
            files: rest.in_place,
        }));
    }
    Ok(Ok(rest.est))
}

/// The run's refusal of a forced snapshot of the parent for the plain
/// directory at `live`, for `reason`: the error's text, and a dry run's.
pub(crate) fn forced_refusal(live: &Path, reason: &CloneReason) -> String {
    format!(
        "cannot convert {} by snapshotting its parent: {reason}",
        live.display()
    )
}

/// Why the free metadata space does not cover a cut, with the figures; its
/// `Display` is the line users see.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CutShortfall {
    free: u64,
    need: u64,
    rest: Estimate,
    lifted: u64,
    reserve: u64,
}

impl fmt::Display for CutShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not enough free metadata space to cut a snapshot of the parent down: {} bytes \
             free, {} needed ({} entries and {} extents to remove, {} to lift, plus {} \
             reserved)",
            self.free, self.need, self.rest.entries, self.rest.extents, self.lifted, self.reserve
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line users see, pinned: it was a format string before it was a
    /// type.
    #[test]
    fn a_cut_shortfall_reads_as_before() {
        let short = CutShortfall {
            free: 10,
            need: 20,
            rest: Estimate {
                entries: 2,
                extents: 3,
                ..Estimate::default()
            },
            lifted: 4,
            reserve: 5,
        };
        assert_eq!(
            short.to_string(),
            "not enough free metadata space to cut a snapshot of the parent down: 10 bytes \
             free, 20 needed (2 entries and 3 extents to remove, 4 to lift, plus 5 reserved)"
        );
    }
}
