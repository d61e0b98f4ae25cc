//! Counting what a conversion involves: entries, bytes and extent items.

use std::collections::{HashMap, HashSet};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use volume::copy;
use volume::sys::item::{ExtentType, InodeItem};
use volume::sys::{self, EXTENT_DATA_KEY, FileType, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher};
use volume::usage::sweep;
use volume::walk::{Step, Walk};

use crate::Estimate;

/// File extent items of regular files, by (device, inode): only those with
/// other than [`usual_extents`] of them (fragmented files, mostly), and at
/// most [`UNUSUAL_MAX`] of those, so that it weighs nothing like one entry
/// per file (at a million files, 25 bytes each and twice that while the
/// table grows was most of a conversion's memory).
pub(crate) type ExtentsByInode = HashMap<(u64, u64), u64>;

/// The extent items a regular file of `size` bytes usually has: one (or an
/// inline extent) if it has data, none if it is empty. A file the scan
/// found otherwise is in [`ExtentsByInode`], unless past [`UNUSUAL_MAX`].
pub(crate) fn usual_extents(size: u64) -> u64 {
    u64::from(size > 0)
}

/// Files [`ExtentsByInode`] holds at most (a megabyte or two): past that,
/// progress counts the other fragmented files' extents when their copy ends
/// rather than as it goes.
pub(crate) const UNUSUAL_MAX: usize = 1 << 16;

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
}

/// A thread for a count of a package's tree: walks are iterative, with a
/// bounded number of descriptors ([`volume::walk`]), so the default stack
/// serves at any depth.
pub(crate) fn walker() -> std::thread::Builder {
    std::thread::Builder::new().name("volume-walk".to_owned())
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
    Ok((scan.tally.est, scan.tally.unusual))
}

/// [`scan`] within `limits`: stops once the work counted passes
/// `limits.max_work`, so it costs at most about that.
pub(crate) fn scan_within(dir: BorrowedFd<'_>, limits: Limits<'_>) -> io::Result<Counted> {
    let mut scan = Scan::new(limits);
    let complete = scan.dir(dir)?.is_continue();
    Ok(Counted {
        est: scan.tally.est,
        complete,
        in_place: scan.tally.in_place,
    })
}

/// Entries and file bytes of the directory open as `dir`, from stats alone
/// (no extent search): what a progress bar in bytes needs, at the cost of
/// a stat per entry whatever the files' fragmentation.
pub(crate) fn bytes(dir: BorrowedFd<'_>) -> io::Result<Estimate> {
    let mut seen = HashSet::new();
    let mut est = Estimate::default();
    let mut walk = Walk::new(dir, Some(copy::MAX_DEPTH))?;
    while let Some(step) = walk.step()? {
        let Step::Entry(entry) = step else {
            continue;
        };
        let Some(st) = sys::stat_at(walk.dir(), &entry.name)? else {
            continue;
        };
        est.entries += 1;
        match st.file_type {
            FileType::Directory => walk.enter(&entry.name)?,
            // Only a file of several names can come again.
            FileType::RegularFile if st.nlink < 2 || seen.insert((st.dev, st.ino)) => {
                est.files += 1;
                est.bytes += st.size;
            }
            _ => {}
        }
    }
    Ok(est)
}

/// Regular files of one directory counted by one run of tree searches (at
/// most this many at a time): a directory's files are usually consecutive
/// inodes, so their items are consecutive in the subvolume's tree and a
/// few ioctls return them all. A stat and two searches per file (the
/// second to learn that the first had everything) made counting the boot
/// box's electrs, 20,000 small files, take 717 ms from a cold cache, the
/// longest part of deciding; in runs, 213 ms.
const FILE_BATCH: usize = 1024;

/// A file whose count has reached this many extent items (a few searches'
/// worth: it is fragmented) has the rest counted by [`SLICES`] searches at
/// once, each over its own range of offsets.
const SLICE_AFTER: u64 = 2048;
/// How many: a cold count is a chain of synchronous leaf reads, which
/// overlap when several searches run. Counting the boot box's monerod, 2
/// million extent items, from a cold cache on this project's 2-core VM:
/// 2.48-2.83 s on one thread, 1.25 s on two, 1.12-1.33 s on four, 0.97 s
/// on eight; four take most of the gain without a thread per core's worth
/// of buffers more.
const SLICES: usize = 4;

struct Scan<'a> {
    tally: Tally<'a>,
    searcher: Searcher,
}

/// What a scan has counted, and its limits.
struct Tally<'a> {
    limits: Limits<'a>,
    est: Estimate,
    /// Files with several names already counted, which their other names
    /// must not count again: only these, so a tree without hardlinks costs
    /// no memory per file.
    linked: HashSet<(u64, u64)>,
    /// See [`ExtentsByInode`].
    unusual: ExtentsByInode,
    in_place: u64,
}

impl Tally<'_> {
    fn work(&self) -> u64 {
        self.limits.weights.of(&self.est)
    }

    /// Whether `entries` and `extents` more stay within the limit as it
    /// stands.
    fn fits(&self, entries: u64, extents: u64) -> bool {
        self.more(entries, extents) <= self.limits.max_work
    }

    fn more(&self, entries: u64, extents: u64) -> u64 {
        let more = entries
            .saturating_mul(self.limits.weights.entry)
            .saturating_add(extents.saturating_mul(self.limits.weights.extent));
        self.work().saturating_add(more)
    }

    /// Whether the work may grow by `entries` and `extents` more.
    fn allows(&mut self, entries: u64, extents: u64) -> bool {
        self.fits(entries, extents)
    }
}

/// One file of a batch, while its items are read.
#[derive(Default)]
struct FileItems {
    seen: bool,
    /// Its size, from its inode item.
    size: u64,
    /// It has more than one name.
    linked: bool,
    extents: u64,
    in_place: bool,
}

impl<'a> Scan<'a> {
    fn new(limits: Limits<'a>) -> Self {
        Scan {
            tally: Tally {
                limits,
                est: Estimate::default(),
                linked: HashSet::new(),
                unusual: HashMap::new(),
                in_place: 0,
            },
            searcher: Searcher::default(),
        }
    }

    /// Whether one more entry is allowed; past the limit, the files still
    /// pending are counted first, so that a pause or a stop reports whole
    /// files.
    fn allows_entry(
        &mut self,
        dir: BorrowedFd<'_>,
        dev: u64,
        pending: &mut Vec<u64>,
    ) -> io::Result<bool> {
        if self.tally.fits(1, 0) {
            return Ok(true);
        }
        if self.files(dir, dev, pending)?.is_break() {
            return Ok(false);
        }
        Ok(self.tally.allows(1, 0))
    }

    /// Counts the tree of the directory open as `top`: one walk
    /// ([`volume::walk`]), at most [`copy::MAX_DEPTH`] levels deep (as a
    /// copy goes) and never across a mount, each directory's regular
    /// files gathered into batches of inode numbers for [`Scan::files`].
    fn dir(&mut self, top: BorrowedFd<'_>) -> io::Result<ControlFlow<()>> {
        let mut walk = Walk::new(top, Some(copy::MAX_DEPTH))?;
        // Per level: the device of its files, their inodes still to count.
        let mut levels: Vec<(u64, Vec<u64>)> = vec![(sys::stat(top)?.dev, Vec::new())];
        while let Some(step) = walk.step()? {
            let Some((dev, pending)) = levels.last_mut() else {
                break;
            };
            let (dev, dir) = (*dev, walk.dir());
            let entry = match step {
                Step::Entry(entry) => entry,
                Step::End => {
                    if self.files(dir, dev, pending)?.is_break() {
                        return Ok(ControlFlow::Break(()));
                    }
                    levels.pop();
                    continue;
                }
            };
            if self.tally.limits.stop.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::Interrupted.into());
            }
            // Regular files go by the inode number and type the directory
            // itself holds (no stat each): their size and flags are in the
            // inode item the search returns with their extents.
            if entry.file_type == FileType::RegularFile {
                if !self.allows_entry(dir, dev, pending)? {
                    return Ok(ControlFlow::Break(()));
                }
                self.tally.est.entries += 1;
                pending.push(entry.ino);
                if pending.len() >= FILE_BATCH && self.files(dir, dev, pending)?.is_break() {
                    return Ok(ControlFlow::Break(()));
                }
                continue;
            }
            let Some(st) = sys::stat_at(dir, &entry.name)? else {
                continue;
            };
            if self
                .tally
                .limits
                .skip
                .is_some_and(|s| s.contains(&(st.dev, st.ino)))
            {
                continue;
            }
            if !self.allows_entry(dir, dev, pending)? {
                return Ok(ControlFlow::Break(()));
            }
            self.tally.est.entries += 1;
            match st.file_type {
                FileType::Directory => {
                    if self.tally.limits.one_device && st.dev != dev {
                        continue;
                    }
                    if st.ino == sys::SUBVOLUME_ROOT_INO {
                        self.tally.est.nested_subvolumes += 1;
                    }
                    // What a pause below reports includes these files.
                    if self.files(dir, dev, pending)?.is_break() {
                        return Ok(ControlFlow::Break(()));
                    }
                    walk.enter(&entry.name)?;
                    levels.push((st.dev, Vec::new()));
                }
                // A file mounted here: its inode number means nothing in
                // this directory's subvolume, which the search reads.
                FileType::RegularFile if st.dev != dev => {}
                // A type the directory did not say (DT_UNKNOWN).
                FileType::RegularFile => pending.push(st.ino),
                _ => {}
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Counts the regular files `pending` (inode numbers in the subvolume
    /// of `dir`, taken from it) and empties it: their inode items (size,
    /// NOCOW) and extent items, read in inode order. An inode in between
    /// that is not one of them (another directory's) is skipped: its items
    /// in a buffer are passed over, and a buffer ending among them starts
    /// the next search past it, so it costs at most one buffer. Hardlinks
    /// count once; a file gone since its directory was read counts as an
    /// entry only.
    fn files(
        &mut self,
        dir: BorrowedFd<'_>,
        dev: u64,
        pending: &mut Vec<u64>,
    ) -> io::Result<ControlFlow<()>> {
        let mut wanted = std::mem::take(pending);
        wanted.sort_unstable();
        wanted.dedup();
        wanted.retain(|ino| !self.tally.linked.contains(&(dev, *ino)));
        let (Some(&first), Some(&last)) = (wanted.first(), wanted.last()) else {
            return Ok(ControlFlow::Continue(()));
        };
        let t = &mut self.tally;
        let max = ItemKey {
            objectid: last,
            item_type: EXTENT_DATA_KEY,
            offset: u64::MAX,
        };
        let at_inode = |objectid| ItemKey {
            objectid,
            item_type: INODE_ITEM_KEY,
            offset: 0,
        };
        let mut i = 0;
        let mut cur = FileItems::default();
        let mut from = at_inode(first);
        let mut stopped = false;
        'search: loop {
            // The search runs in the subvolume of `dir`, the files'.
            let batch = self.searcher.fill(dir, from, max, u32::MAX)?;
            if batch.is_empty() {
                break;
            }
            let mut next = None;
            for (key, body) in batch.iter() {
                while wanted.get(i).is_some_and(|&w| w < key.objectid) {
                    t.finish_file(dev, wanted[i], std::mem::take(&mut cur));
                    i += 1;
                }
                let Some(&ino) = wanted.get(i) else {
                    break 'search;
                };
                // Another directory's inode: its items in this buffer are
                // skipped; if the buffer ends among them, the next search
                // starts at the next wanted inode, past however many it has.
                if key.objectid != ino {
                    next = Some(at_inode(ino));
                    continue;
                }
                next = key.successor();
                if key.item_type == INODE_ITEM_KEY {
                    t.inode_item(&mut cur, body);
                } else if key.item_type == EXTENT_DATA_KEY && cur.seen {
                    match t.extent_item(dir, ino, key, body, &mut cur)? {
                        Extent::Counted => {}
                        Extent::Stopped => {
                            stopped = true;
                            break 'search;
                        }
                        // The rest of this file's items, in this buffer
                        // too, went to the slices; the search goes on
                        // after its last one.
                        Extent::Sliced => {
                            next = ItemKey {
                                offset: u64::MAX,
                                ..key
                            }
                            .successor();
                            break;
                        }
                    }
                }
            }
            match next {
                Some(n) if n <= max => from = n,
                _ => break,
            }
        }
        if let Some(&ino) = wanted.get(i) {
            t.finish_file(dev, ino, cur);
        }
        if stopped || !t.allows(0, 0) {
            return Ok(ControlFlow::Break(()));
        }
        Ok(ControlFlow::Continue(()))
    }
}

/// What the slices of one file's count share.
struct Slicing<'t, 'a> {
    tally: &'t mut Tally<'a>,
    file: &'t mut FileItems,
    /// The limit was reached: every slice ends.
    stopped: bool,
}

/// Counts the extent items of the regular file `ino`, in the subvolume of
/// `dir`, at offsets from `from` on, into `t` and `file`: one ranged
/// sweep ([`sweep::sweep_range`]) on [`SLICES`] threads, each starting on
/// its share of the offsets up to the file's size (the last also past it,
/// where preallocated extents may lie). Each slice adds a buffer's items
/// at a time, under one lock, and only if the limit allows them: what a
/// stopped count reports is items it read, a lower bound. `Break` when the
/// limit stopped it. A slice whose thread cannot be started is counted by
/// the others.
fn extents_sliced(
    dir: BorrowedFd<'_>,
    ino: u64,
    from: u64,
    t: &mut Tally<'_>,
    file: &mut FileItems,
) -> io::Result<ControlFlow<()>> {
    let stop = t.limits.stop;
    let at = |offset| ItemKey {
        objectid: ino,
        item_type: EXTENT_DATA_KEY,
        offset,
    };
    let range = KeyRange {
        min: at(from),
        max: at(u64::MAX),
    };
    let shared = Mutex::new(Slicing {
        tally: t,
        file,
        stopped: false,
    });
    let count = |_: &mut (), items: sweep::Items<'_>| {
        if stop.load(Ordering::Relaxed) {
            return Err(io::ErrorKind::Interrupted.into());
        }
        let n = items.len() as u64;
        let prealloc = items
            .iter()
            .any(|(_, body)| ExtentType::of(body) == Ok(ExtentType::Prealloc));
        let mut s = shared.lock().unwrap_or_else(PoisonError::into_inner);
        if s.stopped || !s.tally.allows(0, n) {
            s.stopped = true;
            return Ok(ControlFlow::Break(()));
        }
        s.tally.est.extents += n;
        s.file.extents += n;
        s.file.in_place |= prealloc;
        Ok(ControlFlow::Continue(()))
    };
    sweep::sweep_range(dir, 0, range, SLICES, || (), count)?;
    let shared = shared.into_inner().unwrap_or_else(PoisonError::into_inner);
    Ok(if shared.stopped {
        ControlFlow::Break(())
    } else {
        ControlFlow::Continue(())
    })
}

/// What one extent item of a batch's file did to the count.
enum Extent {
    /// Counted.
    Counted,
    /// Counted, and the rest of the file's items with it, by
    /// [`extents_sliced`].
    Sliced,
    /// Not counted: the limit is reached.
    Stopped,
}

impl Tally<'_> {
    /// A file's inode item: its size, and whether it is NOCOW.
    fn inode_item(&mut self, cur: &mut FileItems, body: &[u8]) {
        let inode = InodeItem::parse(body).ok();
        cur.seen = true;
        cur.size = inode.map_or(0, |i| i.size);
        cur.linked = inode.is_some_and(|i| i.nlink > 1);
        self.est.files += 1;
        self.est.bytes += cur.size;
        // A malformed inode item (never from a sane kernel) counts as
        // NOCOW: it can veto a snapshot, never wrongly allow one.
        if self.limits.in_place {
            cur.in_place |= inode.is_none_or(|i| i.nodatacow());
        }
    }

    /// The extent item at `key` of the regular file `ino`, in the
    /// subvolume of `dir`: counted if the limit allows it. Once the file
    /// has [`SLICE_AFTER`] of them, the rest are counted by slices.
    fn extent_item(
        &mut self,
        dir: BorrowedFd<'_>,
        ino: u64,
        key: ItemKey,
        body: &[u8],
        cur: &mut FileItems,
    ) -> io::Result<Extent> {
        if !self.allows(0, 1) {
            return Ok(Extent::Stopped);
        }
        cur.in_place |= ExtentType::of(body) == Ok(ExtentType::Prealloc);
        cur.extents += 1;
        self.est.extents += 1;
        // (An item at the last offset has nothing after it.)
        if let Some(rest) = key.offset.checked_add(1)
            && cur.extents == SLICE_AFTER
        {
            if extents_sliced(dir, ino, rest, self, cur)?.is_break() {
                return Ok(Extent::Stopped);
            }
            return Ok(Extent::Sliced);
        }
        Ok(Extent::Counted)
    }

    /// A file of a batch is counted: its extents, once per inode.
    fn finish_file(&mut self, dev: u64, ino: u64, file: FileItems) {
        if !file.seen {
            return;
        }
        if file.in_place {
            self.in_place += 1;
        }
        if file.linked {
            self.linked.insert((dev, ino));
        }
        if file.extents != usual_extents(file.size) && self.unusual.len() < UNUSUAL_MAX {
            self.unusual.insert((dev, ino), file.extents);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// Extent items of `path` as one search of its inode returns them.
    fn items_of(path: &std::path::Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(path).unwrap().ino();
        let f = std::fs::File::open(path).unwrap();
        let mut n = 0;
        sys::search(
            f.as_fd(),
            sys::KeyRange::inode_items(ino, EXTENT_DATA_KEY),
            |_, _| {
                n += 1;
                ControlFlow::Continue(())
            },
        )
        .unwrap();
        n
    }

    /// A fragmented file's items past [`SLICE_AFTER`] are counted by
    /// slices of its offsets at once: whole, its preallocated extents past
    /// its end included (they make it write in place), the files after it
    /// too; a limited count stops within its limit.
    #[test]
    fn a_fragmented_files_slices_count_it_exactly() {
        let fs = test_fs::fs_or_skip!(test_fs::LoopFs::btrfs(1 << 30));
        let dir = fs.path("pkg");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("a"), vec![1u8; 9000]).unwrap();
        let big = dir.join("big");
        test_fs::make_fragmented_file(&big, 64 << 20, 12_000, 7).unwrap();
        {
            let f = std::fs::OpenOptions::new().write(true).open(&big).unwrap();
            rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::KEEP_SIZE, 65 << 20, 1 << 20)
                .unwrap();
        }
        std::fs::write(dir.join("z"), vec![2u8; 9000]).unwrap();
        rustix::fs::sync();
        let want_big = items_of(&big);
        let want = want_big + items_of(&dir.join("a")) + items_of(&dir.join("z"));
        assert!(want_big > 4 * SLICE_AFTER, "{want_big} extent items");
        let top = std::fs::File::open(&dir).unwrap();
        let stop = AtomicBool::new(false);

        let (est, files) = scan(top.as_fd(), &stop).unwrap();
        assert_eq!((est.entries, est.files, est.extents), (3, 3, want));
        use std::os::unix::fs::MetadataExt;
        let key = |p: &std::path::Path| {
            let m = std::fs::metadata(p).unwrap();
            (m.dev(), m.ino())
        };
        assert_eq!(files.get(&key(&big)), Some(&want_big));
        let all = Limits {
            in_place: true,
            ..Limits::all(&stop)
        };
        let counted = scan_within(top.as_fd(), all).unwrap();
        assert!(counted.complete);
        assert_eq!((counted.est.extents, counted.in_place), (want, 1));

        let limited = Limits {
            max_work: 5000,
            ..Limits::all(&stop)
        };
        let part = scan_within(top.as_fd(), limited).unwrap();
        assert!(!part.complete);
        assert!(part.est.work() <= 5000, "{:?}", part.est);
        assert!(part.est.extents > SLICE_AFTER, "{:?}", part.est);
    }
}
