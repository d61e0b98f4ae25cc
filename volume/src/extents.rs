//! Extent counting for plain directories, with an early stop.
//!
//! A reflink copy costs O(file extent items), so the count decides whether a
//! not-yet-converted volume can be backed up by reflink in reasonable time.
//! Each file is looked up with one tight TREE_SEARCH_V2 per inode; the walk
//! stops as soon as the bound is passed, so a 10^8-extent database costs at
//! most `limit + 1` items read, not a full scan.

use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;

use crate::sys::{EXTENT_DATA_KEY, KeyRange, Searcher};
use crate::walk::{Visit, walk_files};

/// Counts file extent items below the directory `dir`, never following a
/// symlink, never opening anything but directories. Returns a number greater
/// than `limit` as soon as one is certain (the exact total is then unknown).
pub fn count_tree_extents(dir: BorrowedFd<'_>, limit: u64) -> io::Result<u64> {
    let mut count = 0u64;
    let mut searcher = Searcher::default();
    walk_files(dir, &mut |parent, ino| {
        // The search runs in the subvolume of `parent`, which is the file's.
        searcher.search(
            parent,
            KeyRange::inode_items(ino, EXTENT_DATA_KEY),
            |key, _| {
                if key.item_type == EXTENT_DATA_KEY && key.objectid == ino {
                    count += 1;
                }
                if count > limit {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            },
        )?;
        Ok(if count > limit {
            Visit::Stop
        } else {
            Visit::Continue
        })
    })?;
    Ok(count)
}
