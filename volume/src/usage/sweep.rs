//! A subvolume's whole tree read once, in disjoint key ranges, by several
//! threads at once.
//!
//! One thread sweeping with TREE_SEARCH_V2 is bound by the kernel copying
//! items out when the tree is cached, and by reading one leaf at a time when
//! it is not (the search does no readahead). Disjoint key ranges, each read
//! by its own thread with its own buffer, still read every item exactly once,
//! in key order within a range, but use every core warm and keep several
//! leaf reads in flight cold.
//!
//! Ranges start as equal slices of the inode numbers in use. A thread that
//! finishes its range takes the upper half of the largest one left: it
//! bisects the inode numbers, or, when one inode is left (a huge database
//! file), that file's extent offsets up to its size. So a tree that is one
//! fragmented file splits as evenly as a tree of many small files.
//!
//! Nothing is written: a failure leaves nothing behind.

use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::sys::item::InodeItem;
use crate::sys::{Batch, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher};

/// `BTRFS_FIRST_FREE_OBJECTID`: a subvolume's root directory; file inode
/// numbers follow it.
const FIRST_INODE: u64 = 256;
/// `BTRFS_LAST_FREE_OBJECTID`: the highest inode number. Objectids above it
/// are special (orphan items, at `-5`) and hold few items.
const LAST_INODE: u64 = u64::MAX - 255;
/// A file is split by offset only if at least this much of it is left: a
/// smaller one holds too few extents to be worth a thread's hand-over.
const MIN_SPLIT_BYTES: u64 = 1 << 20;
/// Weights that make an inode-number range and an offset range comparable
/// when choosing which to split: an inode is about five items (inode, ref,
/// two directory entries, an extent); a fragmented file has an extent per
/// few KiB.
const INODE_WEIGHT: u64 = 5;
const BYTES_PER_WEIGHT: u64 = 16 << 10;

/// TREE_SEARCH_V2 buffer of each thread. A bigger one saves ioctls
/// (tree re-descents) but the kernel faults the whole buffer in on every call;
/// measured warm, whole process, medians of 7 (kernel 6.18, loop-mounted):
///
/// | buffer  | 100k small files | one file, 1M extents |
/// |---------|------------------|----------------------|
/// | 64 KiB  | 120 ms           | 292 ms               |
/// | 256 KiB | 118 ms           | 294 ms               |
/// | 1 MiB   | 123 ms           | 314 ms               |
/// | 4 MiB   | 136 ms           | 315 ms               |
///
/// No size wins beyond noise, so the default stays.
const BUF_SIZE: usize = crate::sys::DEFAULT_BUF_SIZE;

/// What one thread reads: `next..=end`, unless `done`.
#[derive(Debug, Clone, Copy)]
struct Range {
    next: ItemKey,
    end: ItemKey,
    done: bool,
    /// Whether a thread took it: one that could not be started leaves its
    /// range for another to adopt whole.
    claimed: bool,
    /// The inode number and size of the last inode item read in this range,
    /// so that a file's remaining extents can be bisected by offset.
    inode: Option<(u64, u64)>,
}

impl Range {
    fn new(next: ItemKey, end: ItemKey) -> Range {
        Range {
            next,
            end,
            done: next > end,
            claimed: false,
            inode: None,
        }
    }

    /// Where to cut this range in two, with an estimate of the work left
    /// (in items), or `None` when there is too little to share.
    fn split_point(&self, highest: u64) -> Option<(ItemKey, u64)> {
        if self.done {
            return None;
        }
        let (lo, hi) = (self.next, self.end);
        // No file has a number below the first inode's.
        let first = lo.objectid.max(FIRST_INODE);
        let top = hi.objectid.min(highest);
        if first < top {
            let n = top - first;
            let at = ItemKey {
                objectid: first + n.div_ceil(2),
                item_type: 0,
                offset: 0,
            };
            return Some((at, n.saturating_mul(INODE_WEIGHT)));
        }
        // One inode left: its extent items, keyed by file offset, up to its size.
        let (ino, size) = self.inode.filter(|&(ino, _)| ino == lo.objectid)?;
        let from = match lo.item_type {
            t if t < EXTENT_DATA_KEY => 0,
            EXTENT_DATA_KEY => lo.offset,
            _ => return None,
        };
        let upto = if hi.objectid > ino || hi.item_type > EXTENT_DATA_KEY {
            size
        } else if hi.item_type == EXTENT_DATA_KEY {
            size.min(hi.offset.saturating_add(1))
        } else {
            return None;
        };
        if upto < from.saturating_add(MIN_SPLIT_BYTES) {
            return None;
        }
        let at = ItemKey {
            objectid: ino,
            item_type: EXTENT_DATA_KEY,
            // On a 4 KiB boundary, as extents are; still above `from`,
            // since at least MIN_SPLIT_BYTES are left.
            offset: (from + (upto - from) / 2) & !4095,
        };
        Some((at, (upto - from) / BYTES_PER_WEIGHT))
    }
}

/// What a thread is to read next, `from..=end`.
enum Work {
    /// More of the range it was reading.
    Continue(ItemKey, ItemKey),
    /// A range newly split off another thread's, or adopted whole.
    New(ItemKey, ItemKey),
    /// Nothing: the sweep is over.
    Stop,
}

/// The ranges of all threads, and the highest inode number.
struct Plan {
    ranges: Mutex<Vec<Range>>,
    /// Signalled whenever a range moves on, ends or is split, and when a
    /// thread fails or stops the sweep: an idle thread waits on it for
    /// something to take.
    changed: Condvar,
    highest: u64,
    failed: AtomicBool,
    /// A visitor broke off: every thread ends, without an error.
    stopped: AtomicBool,
}

impl Plan {
    fn lock(&self) -> MutexGuard<'_, Vec<Range>> {
        self.ranges.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What thread `me` reads next: the rest of its range, or, once that is
    /// done, a range no thread took, or a new range split off another,
    /// waiting while none can be split off yet (the last file's size is
    /// known only once its inode item is read). `Stop` once every range is
    /// done, or a thread failed or stopped the sweep.
    fn take_work(&self, me: usize) -> Work {
        let mut ranges = self.lock();
        ranges[me].claimed = true;
        loop {
            if self.failed.load(Ordering::Relaxed) || self.stopped.load(Ordering::Relaxed) {
                return Work::Stop;
            }
            if !ranges[me].done {
                return Work::Continue(ranges[me].next, ranges[me].end);
            }
            if let Some(orphan) = ranges.iter().position(|r| !r.claimed && !r.done) {
                ranges[me] = Range {
                    claimed: true,
                    ..ranges[orphan]
                };
                ranges[orphan].done = true;
                return Work::New(ranges[me].next, ranges[me].end);
            }
            if self.steal(&mut ranges, me) {
                return Work::New(ranges[me].next, ranges[me].end);
            }
            if ranges.iter().all(|r| r.done) {
                return Work::Stop;
            }
            ranges = self
                .changed
                .wait(ranges)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Ends every thread at its next [`Plan::take_work`]: `failed` for an
    /// error, else a visitor's stop.
    fn end(&self, failed: bool) {
        let flag = if failed { &self.failed } else { &self.stopped };
        flag.store(true, Ordering::Relaxed);
        let _guard = self.lock();
        self.changed.notify_all();
    }

    /// Gives the idle thread `me` the upper half of the largest range left.
    /// Returns false when there is nothing worth taking.
    fn steal(&self, ranges: &mut [Range], me: usize) -> bool {
        let best = ranges
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != me)
            .filter_map(|(i, r)| r.split_point(self.highest).map(|(at, w)| (w, i, at)))
            .max_by_key(|&(w, ..)| w);
        let Some((_, victim, at)) = best else {
            return false;
        };
        let Some(before) = at.predecessor() else {
            return false;
        };
        let end = ranges[victim].end;
        ranges[victim].end = before;
        let inode = ranges[victim].inode.filter(|&(ino, _)| ino == at.objectid);
        ranges[me] = Range {
            inode,
            claimed: ranges[me].claimed,
            ..Range::new(at, end)
        };
        true
    }
}

/// The items of one search that fall in a thread's range, in key order:
/// what a sweep's visitor is handed at a time.
#[derive(Clone, Copy)]
pub struct Items<'a> {
    batch: Batch<'a>,
    len: usize,
}

impl<'a> Items<'a> {
    /// How many.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Each item's key and raw body.
    pub fn iter(&self) -> impl Iterator<Item = (ItemKey, &'a [u8])> + use<'a> {
        self.batch.iter().take(self.len)
    }
}

/// What [`sweep_range`] read.
pub struct Swept<S> {
    /// Each range's state with its first key, in key order (see [`sweep`]).
    pub ranges: Vec<(ItemKey, S)>,
    /// Whether a visitor broke off: the ranges then hold a part only.
    pub stopped: bool,
}

/// Reads every item of the tree `tree` (0: that of the subvolume holding
/// `fd`) of the filesystem holding `fd` exactly once,
/// on `threads` threads (at least one). The key space ends up cut into
/// disjoint ranges, each read in key order into its own state, made by
/// `init()` and fed each item by `visit`. Returns each range's state with
/// its first key, in key order: folding them in that order sees every item
/// in the order one thread sweeping the whole tree would (what "the first
/// reference to an extent" means depends on it). The first error (of the
/// ioctl or of `visit`) stops every thread and is returned; a panic in
/// `visit` stops every thread and is resumed on the caller's. Needs
/// CAP_SYS_ADMIN.
pub fn sweep<S, I, V>(
    fd: BorrowedFd<'_>,
    tree: u64,
    threads: usize,
    init: I,
    visit: V,
) -> io::Result<Vec<(ItemKey, S)>>
where
    S: Send,
    I: Fn() -> S + Sync,
    V: Fn(&mut S, ItemKey, &[u8]) -> io::Result<()> + Sync,
{
    let each = |state: &mut S, items: Items<'_>| {
        for (key, body) in items.iter() {
            visit(state, key, body)?;
        }
        Ok(ControlFlow::Continue(()))
    };
    Ok(sweep_range(fd, tree, KeyRange::all(), threads, init, each)?.ranges)
}

/// [`sweep`] of the items in `range` alone, fed to `visit` a search's
/// worth at a time, which may break off: then every thread ends at its
/// next search, and what was read is returned as
/// [`Swept::stopped`]. The threads start on equal shares of the range's
/// inode numbers or, for a range within one inode, of that file's extent
/// offsets up to its size, as ranges are split later on. A thread that
/// cannot be started leaves its share to the others (the caller's thread
/// sweeps if none can be).
pub fn sweep_range<S, I, V>(
    fd: BorrowedFd<'_>,
    tree: u64,
    range: KeyRange,
    threads: usize,
    init: I,
    visit: V,
) -> io::Result<Swept<S>>
where
    S: Send,
    I: Fn() -> S + Sync,
    V: Fn(&mut S, Items<'_>) -> io::Result<ControlFlow<()>> + Sync,
{
    /// Stops the other threads when its thread unwinds: they would
    /// otherwise wait forever for the dead thread's range.
    struct FailOnPanic<'a>(&'a Plan);
    impl Drop for FailOnPanic<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.0.end(true);
            }
        }
    }

    let threads = threads.max(1);
    let plan = first_ranges(fd, tree, range, threads)?;
    let worker = |me: usize| {
        let _guard = FailOnPanic(&plan);
        let out = work(fd, tree, &plan, me, &init, &visit);
        if out.is_err() {
            plan.end(true);
        }
        out
    };
    let per_thread = std::thread::scope(|scope| {
        let mut unstarted = None;
        let mut workers = Vec::with_capacity(threads);
        for me in 0..threads {
            let worker = &worker;
            match std::thread::Builder::new()
                .name("volume-sweep".to_owned())
                .spawn_scoped(scope, move || worker(me))
            {
                Ok(w) => workers.push(w),
                Err(_) => {
                    unstarted.get_or_insert(me);
                }
            }
        }
        let mut out: Vec<_> = unstarted.map(&worker).into_iter().collect();
        for w in workers {
            match w.join() {
                Ok(o) => out.push(o),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out.into_iter().collect::<io::Result<Vec<_>>>()
    })?;
    let mut ranges: Vec<(ItemKey, S)> = per_thread.into_iter().flatten().collect();
    ranges.sort_by_key(|&(start, _)| start);
    Ok(Swept {
        ranges,
        stopped: plan.stopped.load(Ordering::Relaxed),
    })
}

/// `range` cut into `threads` (some maybe empty, done from the start) by
/// the rule that later splits follow: the largest part halved, again and
/// again.
fn first_ranges(
    fd: BorrowedFd<'_>,
    tree: u64,
    range: KeyRange,
    threads: usize,
) -> io::Result<Plan> {
    let (lo, hi) = (range.min, range.max);
    let (highest, inode) = if lo.objectid == hi.objectid {
        let ino = lo.objectid;
        (ino, inode_size(fd, tree, ino)?.map(|size| (ino, size)))
    } else {
        let highest = highest_inode(fd, tree)?.unwrap_or(FIRST_INODE);
        (highest.min(hi.objectid), None)
    };
    Ok(Plan::cut(range, highest, inode, threads))
}

impl Plan {
    /// [`first_ranges`] once the highest inode (and, for a range within
    /// one inode, its number and size) is known.
    fn cut(range: KeyRange, highest: u64, inode: Option<(u64, u64)>, threads: usize) -> Plan {
        let (lo, hi) = (range.min, range.max);
        let mut whole = Range::new(lo, hi);
        whole.inode = inode;
        let done = Range {
            done: true,
            ..Range::new(lo, hi)
        };
        let plan = Plan {
            ranges: Mutex::new(vec![done; threads.max(1)]),
            changed: Condvar::new(),
            highest,
            failed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        };
        {
            let mut ranges = plan.lock();
            ranges[0] = whole;
            for me in 1..threads {
                if !plan.steal(&mut ranges, me) {
                    break;
                }
            }
        }
        plan
    }
}

/// The size of inode `ino` in the tree, from its inode item: one search.
fn inode_size(fd: BorrowedFd<'_>, tree: u64, ino: u64) -> io::Result<Option<u64>> {
    let at = ItemKey {
        objectid: ino,
        item_type: INODE_ITEM_KEY,
        offset: 0,
    };
    let max = ItemKey {
        offset: u64::MAX,
        ..at
    };
    let mut searcher = Searcher::new(BUF_SIZE);
    let batch = searcher.fill_tree(fd, tree, at, max, 1)?;
    Ok(batch
        .iter()
        .find(|(key, _)| key.objectid == ino && key.item_type == INODE_ITEM_KEY)
        .and_then(|(_, body)| InodeItem::parse(body).ok())
        .map(|inode| inode.size))
}

/// The highest inode number with an item in the tree, found with one-item
/// searches: doubling from the first inode number, then bisecting. About
/// 2 log2(highest) searches, each a single descent of the tree.
fn highest_inode(fd: BorrowedFd<'_>, tree: u64) -> io::Result<Option<u64>> {
    let mut searcher = Searcher::new(BUF_SIZE);
    // The objectid of the first item at or above `at`, up to the last inode.
    let mut first_from = |at: u64| -> io::Result<Option<u64>> {
        let from = ItemKey {
            objectid: at,
            item_type: 0,
            offset: 0,
        };
        let max = ItemKey {
            objectid: LAST_INODE,
            item_type: u8::MAX,
            offset: u64::MAX,
        };
        let batch = searcher.fill_tree(fd, tree, from, max, 1)?;
        Ok(batch.iter().next().map(|(key, _)| key.objectid))
    };
    // `lo` has an item at or above it; `hi` has none.
    let Some(mut lo) = first_from(FIRST_INODE)? else {
        return Ok(None);
    };
    let mut hi = loop {
        let probe = lo.saturating_mul(2).min(LAST_INODE);
        match first_from(probe)? {
            Some(found) if probe < LAST_INODE => lo = found,
            Some(found) => return Ok(Some(found)),
            None => break probe,
        }
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match first_from(mid)? {
            Some(found) => lo = found,
            None => hi = mid,
        }
    }
    Ok(Some(lo))
}

/// One thread: reads its range a buffer at a time, then takes over half of
/// another's, until nothing is worth taking. Returns each range it read,
/// with its first key and state.
fn work<S>(
    fd: BorrowedFd<'_>,
    tree: u64,
    plan: &Plan,
    me: usize,
    init: &(impl Fn() -> S + Sync),
    visit: &(impl Fn(&mut S, Items<'_>) -> io::Result<ControlFlow<()>> + Sync),
) -> io::Result<Vec<(ItemKey, S)>> {
    let mut searcher = Searcher::new(BUF_SIZE);
    let mut done = Vec::new();
    let mut current: Option<(ItemKey, S)> = None;
    loop {
        let (from, end) = match plan.take_work(me) {
            Work::Stop => break,
            Work::Continue(from, end) if current.is_some() => (from, end),
            Work::Continue(from, end) | Work::New(from, end) => {
                done.extend(current.replace((from, init())));
                (from, end)
            }
        };
        let batch = searcher.fill_tree(fd, tree, from, end, u32::MAX)?;
        // Another thread may have taken the top of this range while the
        // ioctl ran: under the lock, keep only the items still ours and move
        // `next` past them, so that no item is read by two threads.
        let keep = {
            let mut ranges = plan.lock();
            let r = &mut ranges[me];
            let mut keep = 0;
            let mut last = None;
            for (key, body) in batch.iter() {
                if key > r.end {
                    break;
                }
                if key.item_type == INODE_ITEM_KEY
                    && let Ok(inode) = InodeItem::parse(body)
                {
                    r.inode = Some((key.objectid, inode.size));
                }
                keep += 1;
                last = Some(key);
            }
            // A batch cut short by the range's end, or an empty one, means
            // the range is finished.
            match last.and_then(ItemKey::successor) {
                Some(next) if keep == batch.len() && next <= r.end => r.next = next,
                _ => r.done = true,
            }
            plan.changed.notify_all();
            keep
        };
        if let Some((_, state)) = current.as_mut() {
            let items = Items { batch, len: keep };
            if visit(state, items)?.is_break() {
                plan.end(false);
                break;
            }
        }
    }
    done.extend(current);
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(objectid: u64, item_type: u8, offset: u64) -> ItemKey {
        ItemKey {
            objectid,
            item_type,
            offset,
        }
    }

    #[test]
    fn inode_ranges_split_at_the_middle_inode() {
        let r = Range::new(key(300, 1, 0), key(400, 0, 0));
        let (at, weight) = r.split_point(1000).expect("splittable");
        assert_eq!(at, key(350, 0, 0));
        assert_eq!(weight, 100 * INODE_WEIGHT);
        // The part above the highest inode (orphan items) is not counted.
        let r = Range::new(key(300, 1, 0), key(u64::MAX, u8::MAX, u64::MAX));
        assert_eq!(r.split_point(310).map(|(at, _)| at), Some(key(305, 0, 0)));
    }

    #[test]
    fn one_large_file_splits_by_offset_up_to_its_size() {
        let mut r = Range::new(key(258, EXTENT_DATA_KEY, 4 << 20), key(u64::MAX, 255, 0));
        assert_eq!(r.split_point(258), None, "no inode size known yet");
        r.inode = Some((258, 12 << 20));
        let (at, _) = r.split_point(258).expect("splittable");
        assert_eq!(at, key(258, EXTENT_DATA_KEY, 8 << 20));
        // A range already cut inside the file splits what is left of it.
        r.end = key(258, EXTENT_DATA_KEY, (6 << 20) - 1);
        let (at, _) = r.split_point(258).expect("splittable");
        assert_eq!(at, key(258, EXTENT_DATA_KEY, 5 << 20));
        // Less than MIN_SPLIT_BYTES left: kept whole.
        r.end = key(258, EXTENT_DATA_KEY, (4 << 20) + (512 << 10));
        assert_eq!(r.split_point(258), None);
    }

    #[test]
    fn a_steal_leaves_disjoint_ranges_covering_the_original() {
        let plan = Plan {
            ranges: Mutex::new(vec![
                Range::new(key(256, 0, 0), key(u64::MAX, 255, u64::MAX)),
                Range {
                    done: true,
                    ..Range::new(key(1, 0, 0), key(0, 0, 0))
                },
            ]),
            changed: Condvar::new(),
            highest: 1000,
            failed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        };
        let mut ranges = plan.ranges.lock().expect("lock");
        assert!(plan.steal(&mut ranges, 1));
        assert_eq!(ranges[0].end, key(627, u8::MAX, u64::MAX));
        assert_eq!(ranges[1].next, key(628, 0, 0));
        assert_eq!(ranges[1].end, key(u64::MAX, 255, u64::MAX));
        assert!(!ranges[1].done);
    }
    fn shares(plan: &Plan) -> Vec<(ItemKey, ItemKey)> {
        let mut v: Vec<_> = plan
            .lock()
            .iter()
            .filter(|r| !r.done)
            .map(|r| (r.next, r.end))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_tree_starts_in_equal_shares_of_its_inodes() {
        let all = KeyRange::all();
        let s = shares(&Plan::cut(all, 256 + 4000, None, 4));
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].0, key(0, 0, 0), "the first starts at the first key");
        assert_eq!(s[3].1, all.max, "the last ends at the last key");
        let cuts: Vec<u64> = s[1..].iter().map(|(from, _)| from.objectid).collect();
        assert_eq!(cuts, [1256, 2256, 3256]);
        for w in s.windows(2) {
            assert_eq!(w[0].1.successor(), Some(w[1].0), "disjoint and contiguous");
        }
    }

    #[test]
    fn one_file_starts_in_shares_of_its_offsets_the_last_past_its_end() {
        let range = KeyRange {
            min: key(300, EXTENT_DATA_KEY, 4 << 20),
            max: key(300, EXTENT_DATA_KEY, u64::MAX),
        };
        let s = shares(&Plan::cut(range, 300, Some((300, 12 << 20)), 4));
        let starts: Vec<u64> = s.iter().map(|(from, _)| from.offset).collect();
        assert_eq!(starts, [4 << 20, 6 << 20, 8 << 20, 10 << 20]);
        assert_eq!(s[3].1, range.max);
        // Too small to share: one thread reads it, the others idle.
        let s = shares(&Plan::cut(
            range,
            300,
            Some((300, (4 << 20) + (512 << 10))),
            4,
        ));
        assert_eq!(s, [(range.min, range.max)]);
    }

    #[test]
    fn a_share_whose_thread_never_started_is_adopted_whole() {
        let plan = Plan::cut(KeyRange::all(), 256 + 4000, None, 2);
        let theirs = plan.lock()[1];
        plan.lock()[0].done = true;
        match plan.take_work(0) {
            Work::New(from, end) => assert_eq!((from, end), (theirs.next, theirs.end)),
            _ => panic!("thread 0 must adopt thread 1's share"),
        }
        assert!(plan.lock()[1].done, "adopted: no one else reads it");
    }
}
