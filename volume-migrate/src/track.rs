//! Progress reports for one package's conversion.

use std::time::{Duration, Instant};

use models::PackageId;

use crate::scan::{ExtentsByInode, usual_extents};
use crate::{Estimate, Phase, Progress, ProgressSink};

/// Turns copy events into throttled [`Progress`] reports with an ETA.
///
/// The scan runs beside the clone, so its counts of fragmented files may
/// arrive after some files are cloned: until then every file is credited
/// its [`usual_extents`], and what that missed of the files cloned before
/// (and of fragmented files past [`crate::scan::UNUSUAL_MAX`]) is credited
/// when the clone ends. Nothing is kept per file cloned: a million files
/// cost no more than ten.
pub(crate) struct Tracker<'s> {
    p: Progress,
    sink: &'s mut dyn ProgressSink,
    started: Instant,
    /// Work done when this run started cloning (resumed work is not a rate).
    work_at_start: Option<u64>,
    /// Work credited for what an earlier run had done.
    reused_work: u64,
    last_sent: Option<Instant>,
    /// Extent items of the files with other than their usual number, once
    /// the scan is done.
    per_file: Option<ExtentsByInode>,
    /// The file being cloned and the bytes credited so far.
    current_bytes: Option<((u64, u64), u64)>,
    /// The file being cloned and the extents credited so far.
    current_extents: Option<((u64, u64), u64)>,
}

impl<'s> Tracker<'s> {
    pub(crate) fn new(package: PackageId, est: Estimate, sink: &'s mut dyn ProgressSink) -> Self {
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
            current_bytes: None,
            current_extents: None,
        };
        t.set_estimate(est);
        t
    }

    pub(crate) fn set_estimate(&mut self, est: Estimate) {
        self.p.bytes_total = est.bytes;
        self.p.extents_total = est.extents;
        self.p.entries_total = est.entries;
    }

    /// The scan is done: totals known.
    pub(crate) fn scanned(&mut self, est: Estimate, per_file: ExtentsByInode) {
        self.set_estimate(est);
        self.p.totals_known = true;
        self.per_file = Some(per_file);
        self.p.extents_done = self.p.extents_done.min(self.p.extents_total);
        self.send();
    }

    pub(crate) fn phase(&mut self, phase: Phase) {
        // A clone that ended has every extent in place, those of files
        // credited less than theirs included.
        if self.p.phase == Phase::Clone && phase == Phase::Sync && self.p.totals_known {
            self.p.extents_done = self.p.extents_total;
        }
        // A phase that does the work over from nothing (a clone after a
        // cut that failed part-way, a cut after a clone that could not
        // finish, the old tree's removal) counts from nothing: carried
        // over, the first's count ran on past the total, or the second's
        // absolute count (`entries`) went back below it.
        if phase != self.p.phase && matches!(phase, Phase::Clone | Phase::Carve | Phase::RemoveOld)
        {
            self.restart();
        }
        self.p.phase = phase;
        if phase == Phase::Done {
            self.p.eta = Some(Duration::ZERO);
        }
        self.send();
    }

    pub(crate) fn file_data(&mut self, key: (u64, u64), size: u64, done: u64, cloned: u64) {
        let prev = match self.current_bytes {
            Some((k, b)) if k == key => b,
            _ => 0,
        };
        self.p.bytes_done += done.saturating_sub(prev);
        self.current_bytes = Some((key, done));
        self.credit_extents(key, size, done, cloned);
        self.maybe_send();
    }

    /// Extents are exact per finished file once the scan is done (but past
    /// [`crate::scan::UNUSUAL_MAX`] fragmented files), proportional to bytes
    /// within one; never past the total.
    fn credit_extents(&mut self, key: (u64, u64), size: u64, done: u64, cloned: u64) {
        let extents = self
            .per_file
            .as_ref()
            .and_then(|m| m.get(&key))
            .copied()
            .unwrap_or_else(|| usual_extents(size));
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
        if self.p.totals_known {
            self.p.extents_done = self.p.extents_done.min(self.p.extents_total);
        }
        self.current_extents = Some((key, ext));
        if cloned == 0 {
            // What a resumed copy found in place: no measure of speed.
            self.reused_work += ext.saturating_sub(prev);
        }
    }

    /// The entry `rel` of the copy is complete. The copied tree's top
    /// itself (an empty `rel`, the copy's last event) is not counted: the
    /// scan's total leaves it out, and counted, every clone ended one entry
    /// past its total.
    pub(crate) fn entry_copied(&mut self, rel: &std::path::Path) {
        if rel.as_os_str().is_empty() {
            return;
        }
        self.p.entries_done += 1;
        self.maybe_send();
    }

    /// For the removal phase: entries removed so far.
    pub(crate) fn entries(&mut self, n: u64) {
        self.p.entries_done = n;
        self.maybe_send();
    }

    /// Nothing done yet, the totals kept: the work starts over.
    fn restart(&mut self) {
        self.p.bytes_done = 0;
        self.p.extents_done = 0;
        self.p.entries_done = 0;
        self.work_at_start = None;
        self.reused_work = 0;
        self.current_bytes = None;
        self.current_extents = None;
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
        // Once the totals are known, never past them (a file that grew
        // while it was cloned, an entry made meanwhile).
        if self.p.totals_known {
            self.p.bytes_done = self.p.bytes_done.min(self.p.bytes_total);
            self.p.entries_done = self.p.entries_done.min(self.p.entries_total);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A cut that fails part-way, then the clone instead, then a clone
    /// that fails and a carve after it: each report within its totals,
    /// and each work phase counting from nothing.
    #[test]
    fn a_fallback_counts_its_work_from_nothing_and_never_past_the_total() {
        let mut seen: Vec<Progress> = Vec::new();
        let mut sink = |p: &Progress| seen.push(p.clone());
        let est = Estimate {
            entries: 10,
            files: 10,
            bytes: 100,
            extents: 10,
            nested_subvolumes: 0,
        };
        {
            let pkg: PackageId = "app".parse().expect("an id");
            let mut t = Tracker::new(pkg, est, &mut sink);
            t.scanned(est, ExtentsByInode::default());
            t.phase(Phase::Carve);
            t.entries(7);
            t.phase(Phase::Scan);
            t.phase(Phase::Clone);
            for i in 0..12u64 {
                t.file_data((1, i), 10, 10, 10);
                t.entry_copied(std::path::Path::new("f"));
                t.send();
            }
            t.phase(Phase::Carve);
            t.entries(3);
            t.send();
        }
        for p in &seen {
            assert!(p.entries_done <= p.entries_total, "{p:?}");
            assert!(p.bytes_done <= p.bytes_total, "{p:?}");
            assert!(p.extents_done <= p.extents_total, "{p:?}");
        }
        let carve = seen
            .iter()
            .rev()
            .find(|p| p.phase == Phase::Carve)
            .expect("a carve");
        assert_eq!(carve.entries_done, 3, "{carve:?}");
        let clone = seen
            .iter()
            .filter(|p| p.phase == Phase::Clone)
            .map(|p| p.entries_done)
            .collect::<Vec<_>>();
        assert!(clone.windows(2).all(|w| w[0] <= w[1]), "{clone:?}");
        assert_eq!(clone.last(), Some(&10), "{clone:?}");
    }
}
