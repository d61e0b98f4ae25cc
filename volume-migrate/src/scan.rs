//! Counting what a conversion involves: entries, bytes and extent items.

use std::collections::{HashMap, HashSet};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};

use rustix::fs::FileType;
use volume::copy;
use volume::sys::{self, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher, item};

use crate::Estimate;

/// File extent items of each regular file, by (device, inode).
pub(crate) type ExtentsByInode = HashMap<(u64, u64), u64>;

/// What an entry and an extent item weigh against [`Limits::max_work`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Weights {
    pub entry: u64,
    pub extent: u64,
}

impl Weights {
    /// Entries and extents alike: the units of [`Estimate::work`].
    pub const UNIT: Weights = Weights {
        entry: 1,
        extent: 1,
    };

    /// `est` weighed.
    pub fn of(&self, est: &Estimate) -> u64 {
        est.entries
            .saturating_mul(self.entry)
            .saturating_add(est.extents.saturating_mul(self.extent))
    }
}

/// What a scan counts and how far it goes.
pub(crate) struct Limits<'a> {
    /// Set by another thread: give up (`Interrupted`) at the next entry.
    pub stop: &'a AtomicBool,
    /// Give up (`Ok(None)`) once the work counted, weighed by `weights`,
    /// exceeds this.
    pub max_work: u64,
    /// How entries and extents weigh.
    pub weights: Weights,
    /// Directories (device, inode) neither counted nor entered.
    pub skip: Option<&'a HashSet<(u64, u64)>>,
    /// Count a directory on another device (a nested subvolume, another
    /// filesystem mounted there) as one entry without entering it.
    pub one_device: bool,
    /// Also count the files that write in place (see [`Counted::in_place`]);
    /// reads each file's inode item beside its extent items.
    pub in_place: bool,
    /// Instead of stopping at `max_work`, pause there until the gate raises
    /// it (or stops the count): a count another thread extends in rounds
    /// without starting over.
    pub gate: Option<&'a Gate>,
}

/// Where a gated count is ([`Gate::wait`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Status {
    /// Paused at its budget, with what it counted so far.
    Paused(Estimate),
    /// Finished (complete, stopped, or failed: the thread's result says).
    Finished,
}

/// The budget of a count running on another thread ([`Limits::gate`]):
/// the count pauses when its work would pass it, and goes on when the
/// deciding thread raises it, so rounds of growing budgets cost one count.
#[derive(Debug)]
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug)]
struct GateState {
    budget: u64,
    stopped: bool,
    paused: Option<Estimate>,
    finished: bool,
}

impl Gate {
    /// A gate at `budget`.
    pub fn new(budget: u64) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                budget,
                stopped: false,
                paused: None,
                finished: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // A panicking count poisons nothing worth refusing: its thread's
        // join reports the panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The count's side: its work would reach `work`, past the budget, with
    /// `est` counted so far. Waits until the budget covers `work` (its new
    /// value) or the count is stopped (`None`).
    fn pause(&self, est: Estimate, work: u64) -> Option<u64> {
        let mut st = self.lock();
        while !st.stopped && st.budget < work {
            // Said again after every raise that is not enough: a raise
            // clears it, and the deciding thread waits for it.
            st.paused = Some(est);
            self.changed.notify_all();
            st = self
                .changed
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        st.paused = None;
        (!st.stopped).then_some(st.budget)
    }

    /// The count's side: it returned.
    pub fn finish(&self) {
        self.lock().finished = true;
        self.changed.notify_all();
    }

    /// Waits until the count pauses or finishes.
    pub fn wait(&self) -> Status {
        let mut st = self.lock();
        loop {
            if st.finished {
                return Status::Finished;
            }
            if let Some(est) = st.paused {
                return Status::Paused(est);
            }
            st = self
                .changed
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The budget now.
    pub fn budget(&self) -> u64 {
        self.lock().budget
    }

    /// Lets the count go on up to `budget`.
    pub fn raise(&self, budget: u64) {
        let mut st = self.lock();
        st.budget = st.budget.max(budget);
        st.paused = None;
        self.changed.notify_all();
    }

    /// Ends the count where it is (it returns what it counted).
    pub fn stop(&self) {
        self.lock().stopped = true;
        self.changed.notify_all();
    }
}

/// A thread for a walk of a package's tree ([`copy::WALK_STACK_BYTES`]).
pub(crate) fn walker() -> std::thread::Builder {
    std::thread::Builder::new()
        .name("volume-walk".to_owned())
        .stack_size(copy::WALK_STACK_BYTES)
}

/// What [`scan_within`] counted.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counted {
    /// Entries, files, bytes and extents.
    pub est: Estimate,
    /// Whether the count reached the end; if not, it stopped once past
    /// [`Limits::max_work`], and `est` is a part.
    pub complete: bool,
    /// With [`Limits::in_place`]: regular files that btrfs writes in place,
    /// NOCOW ones and those with preallocated extents. Once their subvolume
    /// has been snapshotted, each of their extents is copied on its next
    /// write, snapshot deleted or not (btrfs compares the extent's
    /// generation with the subvolume's last snapshot): fragmentation, and
    /// data space their owner did not plan for.
    pub in_place: u64,
}

impl<'a> Limits<'a> {
    /// Everything, nested subvolumes included, until `stop`.
    pub fn all(stop: &'a AtomicBool) -> Self {
        Limits {
            stop,
            max_work: u64::MAX,
            weights: Weights::UNIT,
            skip: None,
            one_device: false,
            in_place: false,
            gate: None,
        }
    }
}

/// Counts what converting the directory open as `dir` involves, with the
/// extent count of each regular file by (device, inode). Never follows a
/// symlink, opens nothing but directories; hardlinked files count once.
pub(crate) fn scan(
    dir: BorrowedFd<'_>,
    stop: &AtomicBool,
) -> io::Result<(Estimate, ExtentsByInode)> {
    let mut scan = Scan::new(Limits::all(stop));
    // Without a work limit it never breaks off.
    let _ = scan.dir(dir)?;
    Ok((scan.est, scan.files))
}

/// [`scan`] within `limits`: stops once the work counted passes
/// `limits.max_work`, so it costs at most about that.
pub(crate) fn scan_within(dir: BorrowedFd<'_>, limits: Limits<'_>) -> io::Result<Counted> {
    let mut scan = Scan::new(limits);
    let complete = scan.dir(dir)?.is_continue();
    Ok(Counted {
        est: scan.est,
        complete,
        in_place: scan.in_place,
    })
}

/// Entries and file bytes of the directory open as `dir`, from stats alone
/// (no extent search): what a progress bar in bytes needs, at the cost of
/// a stat per entry whatever the files' fragmentation.
pub(crate) fn bytes(dir: BorrowedFd<'_>) -> io::Result<Estimate> {
    fn walk(
        dir: BorrowedFd<'_>,
        depth: usize,
        seen: &mut HashSet<(u64, u64)>,
        est: &mut Estimate,
    ) -> io::Result<()> {
        if depth > copy::MAX_DEPTH {
            return Err(copy::too_deep());
        }
        for (name, _, _) in sys::read_dir_names(dir)? {
            let Some(st) = sys::metadata_at_if_exists(dir, &name)? else {
                continue;
            };
            est.entries += 1;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    walk(sys::open_dir_at(dir, &name)?.as_fd(), depth + 1, seen, est)?
                }
                FileType::RegularFile if seen.insert((st.st_dev, st.st_ino)) => {
                    est.files += 1;
                    est.bytes += st.st_size as u64;
                }
                _ => {}
            }
        }
        Ok(())
    }
    let mut est = Estimate::default();
    walk(dir, 0, &mut HashSet::new(), &mut est)?;
    Ok(est)
}

struct Scan<'a> {
    limits: Limits<'a>,
    est: Estimate,
    files: ExtentsByInode,
    in_place: u64,
    searcher: Searcher,
    /// Directories open below the top ([`copy::MAX_DEPTH`] at most).
    depth: usize,
}

impl<'a> Scan<'a> {
    fn new(limits: Limits<'a>) -> Self {
        Scan {
            limits,
            est: Estimate::default(),
            files: HashMap::new(),
            in_place: 0,
            depth: 0,
            searcher: Searcher::default(),
        }
    }

    fn work(&self) -> u64 {
        self.limits.weights.of(&self.est)
    }

    /// Whether the work may grow by `entries` and `extents` more: within
    /// the limit, or once a gate has raised it that far.
    fn allows(&mut self, entries: u64, extents: u64) -> bool {
        let more = entries
            .saturating_mul(self.limits.weights.entry)
            .saturating_add(extents.saturating_mul(self.limits.weights.extent));
        let work = self.work().saturating_add(more);
        if work <= self.limits.max_work {
            return true;
        }
        match self.limits.gate.and_then(|g| g.pause(self.est, work)) {
            Some(budget) => {
                self.limits.max_work = budget;
                true
            }
            None => false,
        }
    }

    fn dir(&mut self, dir: BorrowedFd<'_>) -> io::Result<ControlFlow<()>> {
        let dev = sys::stat(dir)?.dev;
        for (name, _, _) in sys::read_dir_names(dir)? {
            if self.limits.stop.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let Some(st) = sys::metadata_at_if_exists(dir, &name)? else {
                continue;
            };
            if self
                .limits
                .skip
                .is_some_and(|s| s.contains(&(st.st_dev, st.st_ino)))
            {
                continue;
            }
            if !self.allows(1, 0) {
                return Ok(ControlFlow::Break(()));
            }
            self.est.entries += 1;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    if self.limits.one_device && st.st_dev != dev {
                        continue;
                    }
                    if st.st_ino == sys::SUBVOLUME_ROOT_INO {
                        self.est.nested_subvolumes += 1;
                    }
                    if self.depth >= copy::MAX_DEPTH {
                        return Err(copy::too_deep());
                    }
                    let sub = sys::open_dir_at(dir, &name)?;
                    self.depth += 1;
                    let flow = self.dir(sub.as_fd());
                    self.depth -= 1;
                    if flow?.is_break() {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                // A file mounted here: its inode number means nothing in
                // this directory's subvolume, which the search reads.
                FileType::RegularFile if st.st_dev != dev => {}
                FileType::RegularFile => {
                    let key = (st.st_dev, st.st_ino);
                    if self.files.contains_key(&key) {
                        continue;
                    }
                    self.est.files += 1;
                    self.est.bytes += st.st_size as u64;
                    let mut extents = 0u64;
                    let mut in_place = false;
                    let extent_weight = self.limits.weights.extent.max(1);
                    let mut room = self.limits.max_work.saturating_sub(self.work()) / extent_weight;
                    let (gate, base, mut stopped) = (self.limits.gate, self.est, false);
                    let mut range = KeyRange::inode_items(st.st_ino, EXTENT_DATA_KEY);
                    if self.limits.in_place {
                        range.min = ItemKey {
                            objectid: st.st_ino,
                            item_type: INODE_ITEM_KEY,
                            offset: 0,
                        };
                    }
                    let weights = self.limits.weights;
                    let mut raised = None;
                    // The search runs in the subvolume of `dir`, the file's.
                    self.searcher.search(dir, range, |key, body| {
                        if key.objectid != st.st_ino {
                            return ControlFlow::Continue(());
                        }
                        if key.item_type == INODE_ITEM_KEY {
                            // A body too short for the flags (never from a
                            // sane kernel) counts as NOCOW: it can veto a
                            // snapshot, never wrongly allow one.
                            in_place |= item::le64(body, item::INODE_FLAGS)
                                .is_none_or(|flags| flags & item::INODE_NODATACOW != 0);
                        } else if key.item_type == EXTENT_DATA_KEY {
                            in_place |= body.get(item::TYPE) == Some(&item::TYPE_PREALLOC);
                            extents += 1;
                            if extents > room {
                                // Paused mid-file, the search resumes
                                // where it stood once the gate opens.
                                let now = Estimate {
                                    extents: base.extents + extents,
                                    ..base
                                };
                                let work = weights.of(&now);
                                match gate.and_then(|g| g.pause(now, work)) {
                                    Some(budget) => {
                                        raised = Some(budget);
                                        room = budget.saturating_sub(weights.of(&base))
                                            / extent_weight;
                                    }
                                    None => {
                                        stopped = true;
                                        return ControlFlow::Break(());
                                    }
                                }
                            }
                        }
                        ControlFlow::Continue(())
                    })?;
                    if let Some(budget) = raised {
                        self.limits.max_work = budget;
                    }
                    self.est.extents += extents;
                    if in_place {
                        self.in_place += 1;
                    }
                    self.files.insert(key, extents);
                    if stopped || (gate.is_none() && !self.allows(0, 0)) {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                _ => {}
            }
        }
        Ok(ControlFlow::Continue(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// `wait` from another thread, or `None` if it does not return soon:
    /// a hang is the failure this looks for.
    fn wait_briefly(gate: &'static Gate) -> Option<Status> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(gate.wait());
        });
        rx.recv_timeout(Duration::from_secs(5)).ok()
    }

    #[test]
    fn a_raise_short_of_the_work_leaves_the_count_paused() {
        let gate: &'static Gate = Box::leak(Box::new(Gate::new(1)));
        let est = Estimate {
            entries: 3,
            ..Estimate::default()
        };
        let count = std::thread::spawn(move || gate.pause(est, 10));
        assert!(matches!(wait_briefly(gate), Some(Status::Paused(e)) if e.entries == 3));
        gate.raise(5);
        assert!(matches!(wait_briefly(gate), Some(Status::Paused(_))));
        gate.raise(10);
        assert_eq!(count.join().ok().flatten(), Some(10));
        gate.finish();
        assert!(matches!(wait_briefly(gate), Some(Status::Finished)));
    }
}
