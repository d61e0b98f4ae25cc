//! What each way of converting a package costs, from counts of entries and
//! extent items and costs per unit measured on this project's 2-core VM.
//!
//! The figures come from `bench --only costs`, which times each way on
//! trees that isolate one unit (20,000 files of 8 KiB for entries, each
//! with one extent item; one file of 200,000 extents for extent items),
//! release build, each from a settled filesystem out of the page cache.
//! Three runs on 2026-12-01, medians (and the spread):
//! - a clone (FICLONERANGE into a new subvolume, every attribute set):
//!   7.08 us per extent item (6.94-7.11), 40.7 us per entry beyond its
//!   extent (37.6-46.3);
//! - removing from a fresh snapshot (what the cut of a parent snapshot
//!   does: each leaf it touches is copied first, as the snapshot shares it):
//!   2.72 us per extent item (2.66-2.88), 58.3 us per entry (56.7-65.9);
//! - lifting a top entry of the package out of the snapshot: a rename,
//!   taken as an entry removed.
//!
//! They bound the rest outside the packages that every package's snapshot
//! sheds ([`crate::REST_MAX_US`]) and give the dry run's estimates;
//! absolute times vary with the machine. Since the
//! copy shares small files with a helper thread, one run measured a clone
//! at 37.75 us per entry: within the spread, so the figures stand.

use serde::Serialize;

use crate::Estimate;
use crate::scan::Weights;

/// Microseconds per entry cloned.
pub const CLONE_ENTRY_US: u64 = 41;
/// Microseconds per extent item cloned.
pub const CLONE_EXTENT_US: u64 = 7;
/// Microseconds per entry removed from a fresh snapshot.
pub const CUT_ENTRY_US: u64 = 58;
/// Microseconds per extent item removed from a fresh snapshot.
pub const CUT_EXTENT_US: u64 = 3;

/// The weights of a clone's work, for a scan's limit.
pub(crate) const CLONE: Weights = Weights {
    entry: CLONE_ENTRY_US,
    extent: CLONE_EXTENT_US,
};
/// The weights of a cut's work.
pub(crate) const CUT: Weights = Weights {
    entry: CUT_ENTRY_US,
    extent: CUT_EXTENT_US,
};

/// An estimated cost, in microseconds of this machine's time, with what
/// it counts. `at_least`: the count stopped early, so the cost is more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Cost {
    /// Entries counted.
    pub entries: u64,
    /// Extent items counted.
    pub extents: u64,
    /// The estimate, microseconds.
    pub micros: u64,
    /// Whether counting stopped before the end: the cost is at least this.
    pub at_least: bool,
}

impl Cost {
    /// What cloning `est` costs.
    pub fn clone_of(est: &Estimate, complete: bool) -> Cost {
        Cost {
            entries: est.entries,
            extents: est.extents,
            micros: CLONE.of(est),
            at_least: !complete,
        }
    }

    /// What removing `rest` from a fresh snapshot and lifting `lifted` top
    /// entries costs.
    pub fn cut_of(rest: &Estimate, lifted: u64, complete: bool) -> Cost {
        let est = Estimate {
            entries: rest.entries + lifted,
            ..*rest
        };
        Cost {
            entries: est.entries,
            extents: est.extents,
            micros: CUT.of(&est),
            at_least: !complete,
        }
    }

    /// The same, as a lower bound.
    pub fn at_least(self) -> Cost {
        Cost {
            at_least: true,
            ..self
        }
    }

    /// As a duration, for people.
    pub fn duration(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.micros)
    }
}

impl std::fmt::Display for Cost {
    /// `1.2 s (22,000 entries, 1,900 extents)`, with `>= ` before a lower
    /// bound.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{:.2} s ({} entries, {} extents)",
            if self.at_least { ">= " } else { "" },
            self.duration().as_secs_f64(),
            self.entries,
            self.extents
        )
    }
}
