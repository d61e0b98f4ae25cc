//! Counting what a conversion involves: entries, bytes and extent items.

use std::collections::{HashMap, HashSet};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::FileType;
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
        seen: &mut HashSet<(u64, u64)>,
        est: &mut Estimate,
    ) -> io::Result<()> {
        for (name, _, _) in sys::read_dir_names(dir)? {
            let Some(st) = sys::metadata_at_if_exists(dir, &name)? else {
                continue;
            };
            est.entries += 1;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => walk(sys::open_dir_at(dir, &name)?.as_fd(), seen, est)?,
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
    walk(dir, &mut HashSet::new(), &mut est)?;
    Ok(est)
}

struct Scan<'a> {
    limits: Limits<'a>,
    est: Estimate,
    files: ExtentsByInode,
    in_place: u64,
    searcher: Searcher,
}

impl<'a> Scan<'a> {
    fn new(limits: Limits<'a>) -> Self {
        Scan {
            limits,
            est: Estimate::default(),
            files: HashMap::new(),
            in_place: 0,
            searcher: Searcher::default(),
        }
    }

    fn work(&self) -> u64 {
        self.limits.weights.of(&self.est)
    }

    fn over(&self, entries: u64, extents: u64) -> bool {
        let more = entries
            .saturating_mul(self.limits.weights.entry)
            .saturating_add(extents.saturating_mul(self.limits.weights.extent));
        self.work().saturating_add(more) > self.limits.max_work
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
            if self.over(1, 0) {
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
                    let sub = sys::open_dir_at(dir, &name)?;
                    if self.dir(sub.as_fd())?.is_break() {
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
                    let room = self.limits.max_work.saturating_sub(self.work()) / extent_weight;
                    let mut range = KeyRange::inode_items(st.st_ino, EXTENT_DATA_KEY);
                    if self.limits.in_place {
                        range.min = ItemKey {
                            objectid: st.st_ino,
                            item_type: INODE_ITEM_KEY,
                            offset: 0,
                        };
                    }
                    // The search runs in the subvolume of `dir`, the file's.
                    self.searcher.search(dir, range, |key, body| {
                        if key.objectid != st.st_ino {
                            return ControlFlow::Continue(());
                        }
                        if key.item_type == INODE_ITEM_KEY {
                            let flags = item::le64(body, item::INODE_FLAGS).unwrap_or(0);
                            in_place |= flags & item::INODE_NODATACOW != 0;
                        } else if key.item_type == EXTENT_DATA_KEY {
                            in_place |= body.get(item::TYPE) == Some(&item::TYPE_PREALLOC);
                            extents += 1;
                            if extents > room {
                                return ControlFlow::Break(());
                            }
                        }
                        ControlFlow::Continue(())
                    })?;
                    self.est.extents += extents;
                    if in_place {
                        self.in_place += 1;
                    }
                    self.files.insert(key, extents);
                    if self.over(0, 0) {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                _ => {}
            }
        }
        Ok(ControlFlow::Continue(()))
    }
}
