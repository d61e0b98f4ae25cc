//! Cutting a snapshot of a subvolume down to one of its directories.
//!
//! A snapshot of the subvolume holding a plain directory shares all of it in
//! O(1); removing everything else from the snapshot and lifting the
//! directory's entries to its root turns it into a subvolume with exactly
//! that directory's contents. The cost is O(what is removed), not O(what is
//! kept): for a directory that is most of its subvolume, far less than a
//! reflink copy, which is O(extents kept). Everything kept is the very same
//! inode (number, timestamps, xattrs, flags, hardlinks, holes), changed only
//! by the renames that lift the top entries and by the removal of names
//! outside the directory (link count and ctime). The root stays the
//! subvolume's own (inode 256) and takes the directory's metadata.
//!
//! Subvolumes nested in the snapshotted one are not part of a snapshot (they
//! show as empty placeholder directories), so the directory kept must hold
//! none: callers check that first.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use volume::copy;
use volume::failpoint::failpoint;
use volume::sys::item::EMPTY_SUBVOL_DIR_OBJECTID;
use volume::sys::{self, FileType, InodeFlags};

/// A step of [`carve`], for progress and cancellation: an error returned
/// from the callback stops the carve there with that error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CarveEvent {
    /// The kept directory was moved to the snapshot's top, under a name of
    /// its own, out of the way of what is removed.
    Held,
    /// One more entry of what is not kept, at any depth, was removed (the
    /// count so far).
    Removed(u64),
    /// With [`Removal::Deferred`]: one more top entry of what is not kept
    /// was moved into the rest's directory, or removed if a nested
    /// subvolume's stub (the count so far).
    SetAside(u64),
    /// One more entry of the kept directory was lifted to the root (the
    /// count so far).
    Lifted(u64),
}

/// When what is not kept goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Now, entry by entry: O(what is removed).
    Now,
    /// Later: each top entry of it is moved into one directory at the root
    /// ([`Carved::rest`]), O(top entries), for the caller to remove once the
    /// subvolume is in use ([`remove_rest`]); the stub of a subvolume
    /// nested at the top, which cannot be moved, is removed at once.
    Deferred,
}

/// What [`carve`] left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carved {
    /// With [`Removal::Deferred`]: the directory at the root holding what
    /// is not kept.
    pub rest: Option<OsString>,
}

/// The name under which the kept directory waits at the snapshot's top.
const HOLD: &str = ".startos-carve";
/// The name of the directory holding what a deferred cut did not remove.
const REST: &str = ".startos-carve-rest";

/// Cuts the writable subvolume open as `snapshot` (a fresh snapshot, which
/// nothing else uses) down to its directory at `keep` (relative, no
/// symlinks, no `..`): afterwards the subvolume's root holds exactly that
/// directory's entries (and, with [`Removal::Deferred`], the one directory
/// holding the rest), and carries its owner, mode, xattrs (any other
/// removed), timestamps and inode flags. With [`Removal::Now`] everything
/// else the subvolume held is removed, entry by entry (immutable and
/// append-only flags cleared first); placeholders of nested subvolumes are
/// removed by `rmdir`. With [`Removal::Deferred`] too, a placeholder at
/// the top: the kernel refuses to rename one (ENOTEMPTY), so moving it
/// into the rest would fail the cut whenever a subvolume sits at the top
/// of the snapshot (a converted package beside the volumes root's
/// packages, or any subvolume at the top of the filesystem).
///
/// The directory itself must hold no nested subvolume (its placeholders
/// would be kept as empty directories).
///
/// A crash or error part-way leaves the subvolume half cut: callers carve
/// under a temporary name and delete the whole subvolume (O(1)) on
/// recovery. Costs O(entries and extents removed) plus O(entries lifted);
/// deferred, O(top entries) plus O(entries lifted).
pub fn carve(
    snapshot: BorrowedFd<'_>,
    keep: &Path,
    removal: Removal,
    on_event: &mut dyn FnMut(CarveEvent) -> io::Result<()>,
) -> io::Result<Carved> {
    let (Some(parent_rel), Some(name)) = (keep.parent(), keep.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the directory to keep must be below the subvolume's root",
        ));
    };
    sys::clear_stuck_flags(snapshot)?;
    let parent = if parent_rel.as_os_str().is_empty() {
        None
    } else {
        Some(sys::open_beneath(snapshot, parent_rel)?)
    };
    let parent = parent.as_ref().map_or(snapshot, |fd| fd.as_fd());
    sys::clear_stuck_flags(parent)?;
    let kept = sys::open_dir_at(parent, name)?;
    let kept_st = sys::stat(kept.as_fd())?;
    let kept_flags = sys::inode_flags(kept.as_fd())?;
    let kept_names = sys::read_dir_names(kept.as_fd())?;
    let mut top_names = sys::read_dir_names(snapshot)?;
    let hold = free_name(HOLD, &top_names, &kept_names, None);
    if parent_rel.as_os_str().is_empty() {
        // The kept directory is itself a top entry: it becomes the hold.
        top_names.retain(|(entry, _, _)| entry.as_os_str() != name);
    }
    sys::clear_stuck_flags(kept.as_fd())?;
    sys::rename_at(parent, name, snapshot, &hold)?;
    on_event(CarveEvent::Held)?;

    let rest = match removal {
        Removal::Now => {
            let mut removed = 0u64;
            for (entry, _, _) in &top_names {
                let before = removed;
                copy::remove_tree_at(snapshot, entry, &mut |n| {
                    removed = before + n;
                    on_event(CarveEvent::Removed(removed))
                })?;
            }
            None
        }
        Removal::Deferred => {
            let rest = free_name(REST, &top_names, &kept_names, Some(&hold));
            sys::mkdir_at(snapshot, &rest, 0o700)?;
            let rest_fd = sys::open_dir_at(snapshot, &rest)?;
            for (i, (entry, kind, _)) in top_names.iter().enumerate() {
                // A nested subvolume's stub cannot be renamed (ENOTEMPTY);
                // it holds nothing, so it goes now.
                if is_subvolume_stub(snapshot, entry, *kind)? {
                    sys::rmdir_at(snapshot, entry)?;
                } else {
                    lift(snapshot, rest_fd.as_fd(), entry)?;
                }
                on_event(CarveEvent::SetAside(i as u64 + 1))?;
            }
            Some(rest)
        }
    };

    for (i, (entry, _, _)) in kept_names.iter().enumerate() {
        lift(kept.as_fd(), snapshot, entry)?;
        on_event(CarveEvent::Lifted(i as u64 + 1))?;
    }

    // The root takes the kept directory's metadata: exact flags but the
    // immutable and append-only ones first (NOCOW included), xattrs while
    // the directory can still be read, times after its rmdir (which changes
    // the root's), the immutable and append-only flags last.
    sys::set_inode_flags(
        snapshot,
        kept_flags.difference(InodeFlags::IMMUTABLE | InodeFlags::APPEND),
    )?;
    copy::remove_xattrs_missing_from(kept.as_fd(), snapshot)?;
    copy::finish_fd_metadata(&kept_st, snapshot, Some(kept.as_fd()), None, None)?;
    drop(kept);
    sys::rmdir_at(snapshot, &hold)?;
    let now = sys::stat(snapshot)?;
    copy::finish_fd_metadata(&kept_st, snapshot, None, Some(kept_flags), Some(&now))?;
    Ok(Carved { rest })
}

/// Cuts the writable subvolume open as `snapshot` (a fresh snapshot, which
/// nothing else uses) down to the entries of its directory at `dir`
/// (relative, no symlinks, no `..`; empty: the root) for which `keep` holds:
/// every other entry, at any depth, is removed entry by entry (immutable and
/// append-only flags cleared first, nested subvolumes' placeholders by
/// `rmdir`), and so is every entry beside the directories leading to `dir`,
/// which stay with their metadata. `on_removed` gets the count of entries
/// removed so far. The entries kept are untouched: the very same inodes.
///
/// A crash or error part-way leaves the subvolume half cut: callers cut
/// under a temporary name and delete the whole subvolume on recovery.
/// Costs O(entries and extents removed).
pub fn cut_to(
    snapshot: BorrowedFd<'_>,
    dir: &Path,
    keep: &dyn Fn(&OsStr) -> bool,
    on_removed: &mut dyn FnMut(u64) -> io::Result<()>,
) -> io::Result<()> {
    let path: Vec<&OsStr> = dir
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the directory to cut down to must be a plain relative path",
            )),
        })
        .collect::<io::Result<_>>()?;
    let mut removed = 0u64;
    let mut held: Option<std::os::fd::OwnedFd> = None;
    for level in 0..=path.len() {
        let here = held.as_ref().map_or(snapshot, |fd| fd.as_fd());
        sys::clear_stuck_flags(here)?;
        for (entry, _, _) in sys::read_dir_names(here)? {
            let kept = match path.get(level) {
                Some(next) => entry.as_os_str() == *next,
                None => keep(&entry),
            };
            if kept {
                continue;
            }
            let before = removed;
            copy::remove_tree_at(here, &entry, &mut |n| {
                removed = before + n;
                on_removed(removed)
            })?;
        }
        if let Some(next) = path.get(level) {
            let fd = sys::open_dir_at(here, next)?;
            held = Some(fd);
        }
    }
    Ok(())
}

/// Removes the directory `rest` that a deferred [`carve`] left at the root
/// of the subvolume open as `volume`, now in use: O(what it holds), entry
/// by entry. `root_stuck`: the immutable and append-only flags the cut gave
/// the root ([`crate::rest::RestRecord::root_stuck`]). `on_removed` gets
/// the count of entries removed so far.
///
/// Everything below `rest` goes first, which changes nothing of the root;
/// only `rest`'s own rmdir needs the root's immutable and append-only flags
/// lifted and changes its times, which are put back at once. A crash
/// part-way leaves the rest of it, which a later call removes, the root's
/// flags put back from `root_stuck` whatever the crash left; a crash
/// between the rmdir and putting the times back (two system calls) leaves
/// the root's modification time at that moment.
pub fn remove_rest(
    volume: BorrowedFd<'_>,
    rest: &OsStr,
    root_stuck: InodeFlags,
    on_removed: &mut dyn FnMut(u64) -> io::Result<()>,
) -> io::Result<()> {
    let stuck_bits = InodeFlags::IMMUTABLE | InodeFlags::APPEND;
    let mut removed = 0u64;
    if let Some(st) = sys::stat_at(volume, rest)?
        && st.file_type == FileType::Directory
    {
        let dir = sys::open_dir_at(volume, rest)?;
        sys::clear_stuck_flags(dir.as_fd())?;
        for (child, _, _) in sys::read_dir_names(dir.as_fd())? {
            let before = removed;
            copy::remove_tree_at(dir.as_fd(), &child, &mut |n| {
                removed = before + n;
                on_removed(removed)
            })?;
        }
    }
    let flags = sys::inode_flags(volume)?;
    let lifted = flags.difference(stuck_bits);
    let times = sys::times(volume)?;
    if flags != lifted {
        sys::set_inode_flags(volume, lifted)?;
    }
    let gone = match sys::rmdir_at(volume, rest) {
        Ok(()) => {
            sys::set_times(volume, &times)?;
            // Inside the moment the root's flags are lifted.
            failpoint("migrate.rest-rmdir")?;
            true
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => false,
        Err(e) => return Err(e),
    };
    put_back_root_flags(volume, root_stuck)?;
    // Only once the flags are back: a callback that stops the removal
    // here leaves nothing lifted.
    if gone {
        on_removed(removed + 1)?;
    }
    Ok(())
}

/// Gives the volume's root open as `volume` the immutable and append-only
/// flags of `root_stuck` again, if it lacks any: what a crash inside
/// [`remove_rest`] may have left lifted.
pub fn put_back_root_flags(volume: BorrowedFd<'_>, root_stuck: InodeFlags) -> io::Result<()> {
    let flags = sys::inode_flags(volume)?;
    let wanted = flags.union(root_stuck.intersection(InodeFlags::IMMUTABLE | InodeFlags::APPEND));
    if wanted != flags {
        sys::set_inode_flags(volume, wanted)?;
    }
    Ok(())
}

/// `base`, or `base.N`: a name neither the top nor the kept directory has
/// (nor `also`).
fn free_name(
    base: &str,
    top: &[(OsString, FileType, u64)],
    kept: &[(OsString, FileType, u64)],
    also: Option<&OsStr>,
) -> OsString {
    let taken = |n: &OsStr| top.iter().chain(kept).any(|(t, _, _)| t == n) || also == Some(n);
    let mut name = OsString::from(base);
    let mut i = 0u64;
    while taken(&name) {
        i += 1;
        name = OsString::from(format!("{base}.{i}"));
    }
    name
}

/// Whether the entry `name` of the snapshot open as `snapshot` (of type
/// `kind`, as its directory said) is the stub a nested subvolume leaves in
/// a snapshot: a directory whose inode number is
/// [`EMPTY_SUBVOL_DIR_OBJECTID`], which no inode of a subvolume's tree can
/// have (theirs start at 256). Decided by what the kernel reports, never by
/// the name; a fresh snapshot has nothing mounted in it, and `rmdir`
/// removes nothing else that is not empty.
fn is_subvolume_stub(snapshot: BorrowedFd<'_>, name: &OsStr, kind: FileType) -> io::Result<bool> {
    if !matches!(kind, FileType::Directory | FileType::Unknown) {
        return Ok(false);
    }
    Ok(sys::stat_at(snapshot, name)?
        .is_some_and(|st| st.is_dir() && st.ino == EMPTY_SUBVOL_DIR_OBJECTID))
}

/// Moves `name` from `from` to `to`. An immutable or append-only entry
/// cannot be renamed: its flags are lifted for the move.
fn lift(from: BorrowedFd<'_>, to: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    let rename = || sys::rename_at(from, name, to, name);
    match rename() {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            sys::with_stuck_flags_lifted(from, name, rename)
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// A deferred cut of a snapshot whose top holds a nested subvolume's
    /// stub and an empty plain directory: the stub is removed (it cannot be
    /// moved), the plain directory set aside like anything else, and the
    /// kept directory's file is the very same inode.
    #[test]
    fn a_deferred_cut_removes_a_stub_at_the_top_and_sets_the_rest_aside() {
        let fs = test_fs::fs_or_skip!(test_fs::LoopFs::btrfs(256 << 20));
        let top = fs::File::open(fs.mount_point()).unwrap();
        sys::create_subvolume(top.as_fd(), OsStr::new("src")).unwrap();
        let src = fs.path("src");
        let src_fd = fs::File::open(&src).unwrap();
        sys::create_subvolume(src_fd.as_fd(), OsStr::new("sub")).unwrap();
        fs::create_dir(src.join("empty")).unwrap();
        fs::create_dir(src.join("keep")).unwrap();
        fs::write(src.join("keep/file"), b"kept").unwrap();
        let ino = fs::metadata(src.join("keep/file")).unwrap().ino();
        sys::snapshot(src_fd.as_fd(), top.as_fd(), OsStr::new("snap")).unwrap();
        let snap = fs.path("snap");
        assert_eq!(
            fs::symlink_metadata(snap.join("sub")).unwrap().ino(),
            EMPTY_SUBVOL_DIR_OBJECTID
        );

        let snap_fd = fs::File::open(&snap).unwrap();
        let carved = carve(
            snap_fd.as_fd(),
            Path::new("keep"),
            Removal::Deferred,
            &mut |_| Ok(()),
        )
        .expect("the cut");
        let rest = carved.rest.expect("a rest");
        let mut names: Vec<_> = fs::read_dir(&snap)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, [rest.clone(), OsString::from("file")]);
        assert_eq!(fs::metadata(snap.join("file")).unwrap().ino(), ino);
        let aside: Vec<_> = fs::read_dir(snap.join(&rest))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(aside, [OsString::from("empty")]);
    }
}
