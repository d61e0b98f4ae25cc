//! Removing a tree entry by entry, at any depth.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;

use crate::sys::{self, FileType};
use crate::walk::{Step, Walk, crosses_mount};

/// Removes the entry `name` of `parent` and everything below it, whatever
/// its type, never following a symlink and opening nothing but directories
/// (and a regular file whose immutable or append-only flag forbids the
/// unlink). A nested btrfs subvolume is deleted whole, O(1) (read-only
/// flags cleared first); everything else is unlinked one by one, which for a
/// plain directory costs O(extents). Absent is fine. Works at any depth
/// with a bounded number of descriptors ([`crate::walk`]); a mount inside
/// is refused ([`crate::walk::crosses_mount`]), its contents untouched.
///
/// `on_entry` is called after each entry removed, with the number removed so
/// far; an error from it stops the removal there. A crash part-way leaves a
/// partial tree under `name`, which a second call removes.
pub fn remove_tree_at(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    on_entry: &mut dyn FnMut(u64) -> io::Result<()>,
) -> io::Result<()> {
    let mut count = 0u64;
    let mut removed = |count: &mut u64| {
        *count += 1;
        on_entry(*count)
    };
    let Some(st) = sys::stat_at(parent, name)? else {
        return Ok(());
    };
    if st.file_type != FileType::Directory {
        unlink(parent, name, &st)?;
        return removed(&mut count);
    }
    let dir = sys::open_dir_at(parent, name)?;
    // A mount over `name` is no part of the tree: refused before anything
    // under it is touched (a subvolume mounted there would otherwise be
    // deleted by its own listing, wherever it lives).
    if sys::mount_id(dir.as_fd())? != sys::mount_id(parent)? {
        return Err(crosses_mount(PathBuf::from(name)));
    }
    if delete_if_subvolume(parent, name, &st, dir.as_fd())? {
        return removed(&mut count);
    }
    sys::clear_stuck_flags(dir.as_fd())?;
    let mut walk = Walk::new(dir.as_fd(), None)?;
    while let Some(step) = walk.step()? {
        match step {
            Step::Entry(entry) => {
                let here = walk.dir();
                let Some(st) = sys::stat_at(here, &entry.name)? else {
                    continue;
                };
                if st.file_type != FileType::Directory {
                    unlink(here, &entry.name, &st)?;
                    removed(&mut count)?;
                    continue;
                }
                let sub = sys::open_dir_at(here, &entry.name)?;
                if sys::mount_id(sub.as_fd())? != walk.mount() {
                    return Err(crosses_mount(walk.path().join(&entry.name)));
                }
                if delete_if_subvolume(here, &entry.name, &st, sub.as_fd())? {
                    removed(&mut count)?;
                    continue;
                }
                walk.enter_opened(&entry.name, sub)?;
                sys::clear_stuck_flags(walk.dir())?;
            }
            Step::End => {
                if let Some(left) = walk.leave()? {
                    sys::rmdir_at(walk.dir(), &left)?;
                    removed(&mut count)?;
                }
            }
        }
    }
    drop(walk);
    drop(dir);
    sys::rmdir_at(parent, name)?;
    removed(&mut count)
}

/// Removes (with [`remove_tree_at`]) every entry of the directory open as
/// `dst` whose name the directory open as `src` does not hold (now: one
/// lstat each), reading `dst` a bounded batch at a time
/// ([`crate::walk::BATCH`]) rather than holding either directory's names.
/// Returns how many went. A crash part-way leaves some of them, which a
/// second call removes.
pub(super) fn remove_missing_from(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<u64> {
    let mut removed = 0;
    let mut from = Some(sys::DirPos::Start);
    while let Some(pos) = from {
        let (names, more) = sys::read_dir_batch(dst, pos, crate::walk::BATCH)?;
        from = more;
        for (name, _, _) in names {
            if sys::stat_at(src, &name)?.is_none() {
                remove_tree_at(dst, &name, &mut |_| Ok(()))?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

/// Deletes the directory `name` of `parent` (open as `dir`, stat'ed as
/// `st`) in one step if it is the root of a nested subvolume, read-only
/// flags cleared first, every subvolume below it included; returns whether
/// it was one.
fn delete_if_subvolume(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    st: &sys::Stat,
    dir: BorrowedFd<'_>,
) -> io::Result<bool> {
    if st.ino != sys::SUBVOLUME_ROOT_INO
        || !sys::is_btrfs(dir)?
        || sys::stat(dir)?.dev == sys::stat(parent)?.dev
    {
        return Ok(false);
    }
    sys::make_tree_writable(dir)?;
    sys::delete_subvolume(parent, name, true)?;
    Ok(true)
}

/// Unlinks the non-directory `name` of `dir`, lifting an immutable or
/// append-only flag that forbids it; absent is fine.
fn unlink(dir: BorrowedFd<'_>, name: &OsStr, st: &sys::Stat) -> io::Result<()> {
    match sys::unlink_at(dir, name) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        // Names elsewhere (hardlinks outside the tree) keep the inode, and
        // so its flags.
        Err(e)
            if e.raw_os_error() == Some(libc::EPERM) && st.file_type == FileType::RegularFile =>
        {
            sys::with_stuck_flags_lifted(dir, name, || sys::unlink_at(dir, name))
        }
        Err(e) => Err(e),
    }
}
