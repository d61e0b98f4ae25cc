//! Counting what a conversion involves: entries, bytes and extent items.

use std::collections::HashMap;
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{AtFlags, FileType};
use volume::sys::{self, EXTENT_DATA_KEY, KeyRange, Searcher};

use crate::Estimate;

/// File extent items of each regular file, by (device, inode).
pub(crate) type ExtentsByInode = HashMap<(u64, u64), u64>;

/// What a scan counts and how far it goes.
pub(crate) struct Limits<'a> {
    /// Set by another thread: give up (`Interrupted`) at the next entry.
    pub stop: &'a AtomicBool,
    /// Give up (`Ok(None)`) once entries plus extents exceed this.
    pub max_work: u64,
    /// A directory (device, inode) neither counted nor entered.
    pub skip: Option<(u64, u64)>,
    /// Count a directory on another device (a nested subvolume, another
    /// filesystem mounted there) as one entry without entering it.
    pub one_device: bool,
}

impl<'a> Limits<'a> {
    /// Everything, nested subvolumes included, until `stop`.
    pub fn all(stop: &'a AtomicBool) -> Self {
        Limits {
            stop,
            max_work: u64::MAX,
            skip: None,
            one_device: false,
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

/// [`scan`] within `limits`: `None` once the work counted passes
/// `limits.max_work` (the scan stops there, so it costs at most about that).
pub(crate) fn scan_within(dir: BorrowedFd<'_>, limits: Limits<'_>) -> io::Result<Option<Estimate>> {
    let mut scan = Scan::new(limits);
    Ok(match scan.dir(dir)? {
        ControlFlow::Continue(()) => Some(scan.est),
        ControlFlow::Break(()) => None,
    })
}

struct Scan<'a> {
    limits: Limits<'a>,
    est: Estimate,
    files: ExtentsByInode,
    searcher: Searcher,
}

impl<'a> Scan<'a> {
    fn new(limits: Limits<'a>) -> Self {
        Scan {
            limits,
            est: Estimate::default(),
            files: HashMap::new(),
            searcher: Searcher::default(),
        }
    }

    fn over(&self, more: u64) -> bool {
        self.est.work().saturating_add(more) > self.limits.max_work
    }

    fn dir(&mut self, dir: BorrowedFd<'_>) -> io::Result<ControlFlow<()>> {
        let dev = sys::stat(dir)?.dev;
        for (name, _, _) in sys::read_dir_names(dir)? {
            if self.limits.stop.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let st = match rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(e.into()),
            };
            if self.limits.skip == Some((st.st_dev, st.st_ino)) {
                continue;
            }
            if self.over(1) {
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
                FileType::RegularFile => {
                    let key = (st.st_dev, st.st_ino);
                    if self.files.contains_key(&key) {
                        continue;
                    }
                    self.est.files += 1;
                    self.est.bytes += st.st_size as u64;
                    let mut extents = 0u64;
                    let room = self.limits.max_work.saturating_sub(self.est.work());
                    // The search runs in the subvolume of `dir`, the file's.
                    self.searcher.search(
                        dir,
                        KeyRange::inode_items(st.st_ino, EXTENT_DATA_KEY),
                        |key, _| {
                            if key.item_type == EXTENT_DATA_KEY && key.objectid == st.st_ino {
                                extents += 1;
                                if extents > room {
                                    return ControlFlow::Break(());
                                }
                            }
                            ControlFlow::Continue(())
                        },
                    )?;
                    self.est.extents += extents;
                    self.files.insert(key, extents);
                    if self.over(0) {
                        return Ok(ControlFlow::Break(()));
                    }
                }
                _ => {}
            }
        }
        Ok(ControlFlow::Continue(()))
    }
}
