//! Reflink copy of a directory tree, losing nothing `cp -a` keeps and more.
//!
//! Used for the backup of a volume that is still a plain directory on btrfs
//! (and, later, by the one-time conversion to subvolumes). Unlike
//! `cp -a --reflink=always`, it handles NOCOW files: the flag is set on the
//! new file before any data is cloned, which is the only order in which the
//! kernel allows a reflink of NOCOW data; and a new file whose data
//! checksums differ from its source's (a volume written partly under a
//! `nodatasum` mount) is given the source's before its data (`checksums`).
//!
//! Contents are untrusted: every name is resolved relative to an open
//! directory, nothing is followed through a symlink, and only regular files
//! and directories are ever opened (FIFOs, sockets and devices are recreated
//! with mknod). Names are raw bytes. The source is read by one walk
//! ([`crate::walk`]): a bounded number of descriptors at any depth, paths
//! of any length, and nothing across a mount: a directory, file or node
//! another mount puts in the tree stops the copy with a
//! [`crate::walk::CrossesMount`] error naming it, for the caller to refuse
//! the package with, as it does a tree deeper than [`MAX_DEPTH`].
//!
//! Per entry, the order matters: data, then owner (a chown clears setuid and
//! file capabilities), then mode, then xattrs (ACLs and capabilities
//! included), then timestamps, then the immutable and append-only flags
//! (which forbid everything before them). Directories get theirs after their
//! children, so their mtime is the source's.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use crate::sys::{self, FileType, InodeFlags, Stat, inode_flags, set_inode_flags as set_flags};
use crate::walk::{Chain, Step, Walk, crosses_mount};

mod changes;
mod checksums;
mod helpers;
mod metadata;
mod remove;

pub use changes::SourceChanges;
pub use checksums::{Unclonable, is_unclonable};
use helpers::{HELPER_MAX_BYTES, Helpers, SharedDirs};
use metadata::{Target, copy_xattrs_at, finish_file_metadata, finish_metadata};
pub use metadata::{finish_fd_metadata, remove_xattrs_missing_from};
pub use remove::remove_tree_at;

/// How deep a copy goes below the top of what it copies before refusing
/// with [`too_deep`]: volume-migrate's counts keep the same bound, so a
/// package they count is one a copy takes. A package nests its directories
/// as deep as it likes; a walk holds a bounded number of descriptors and
/// no stack at any depth ([`crate::walk`]), so the bound is the copy's
/// own: 2,048 levels is past any real package's tree (a path of 2,048
/// one-byte names already fills PATH_MAX), and a copy refuses what lies
/// beyond rather than spend a boot on it.
pub const MAX_DEPTH: usize = 2048;

/// The error for a tree nested deeper than [`MAX_DEPTH`] levels.
pub fn too_deep() -> io::Error {
    crate::walk::too_deep(MAX_DEPTH)
}

pub use crate::walk::is_too_deep;

/// What a copy did, for reports and progress.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Entries created (hardlinks count once per name).
    pub entries: u64,
    /// Bytes shared by reflink (file sizes).
    pub bytes: u64,
    /// Of `bytes`, those cloned by this call (the rest a resumed copy found
    /// already in place).
    pub bytes_cloned: u64,
    /// Entries a resumed copy found already in place and kept (their
    /// metadata is applied again).
    pub entries_reused: u64,
    /// Destination entries a resumed copy threw away because their source
    /// changed since, or no longer exists.
    pub entries_discarded: u64,
    /// Files whose data was cloned NOCOW (once per inode): until the
    /// source is gone they share extents, so their next writes are copies.
    pub nocow_files: u64,
    /// Of those, files without data checksums but copied on write (written
    /// under `nodatasum`) made NOCOW: on a mount that checksums new files,
    /// the only state btrfs reflinks their data into (`checksums`).
    pub nodatasum_nocow: u64,
    /// Regular files copied on a helper thread rather than the walk's.
    pub helped_files: u64,
}

/// How [`reflink_into`] copies.
#[derive(Debug, Default, Clone, Copy)]
pub struct CopyOptions<'a> {
    /// Reuse what an interrupted earlier copy left in the destination:
    /// directories are recursed into, regular files continue from their
    /// current size (aligned down to the block size), symlinks and special
    /// files are recreated, metadata is applied again, hardlinks are
    /// re-detected, and destination names absent from the source removed.
    /// Without it every destination name must be new (EEXIST otherwise).
    pub resume: bool,
    /// Clone regular files in ranges of this many bytes (rounded up to the
    /// block size) with FICLONERANGE, in offset order, reporting progress
    /// and allowing a stop between ranges; `None`: one FICLONE per file.
    pub chunk_bytes: Option<u64>,
    /// Recreate a nested btrfs subvolume of the source as a subvolume (and
    /// read-only if the source is); without it, as a plain directory.
    pub nested_subvolumes: bool,
    /// With `resume`: the source entries changed since the earlier copy
    /// began, as the filesystem orders changes (never by a clock): each
    /// one's destination (a whole subtree for a directory) is discarded and
    /// copied again. `None`: every existing destination entry is trusted.
    pub changed_since: Option<&'a SourceChanges>,
}

/// A step of a copy, for progress and cancellation: returning an error from
/// the callback stops the copy there with that error.
#[derive(Debug)]
pub enum CopyEvent<'a> {
    /// A range of a regular file is in place.
    Data {
        /// Path relative to the copied tree's top.
        rel: &'a Path,
        /// Source device and inode (to look up per-file figures).
        src: (u64, u64),
        /// The file's size.
        size: u64,
        /// Bytes now in place, from offset 0.
        done: u64,
        /// Of those, bytes cloned by this step (the rest of the step's
        /// increase was found in place by a resumed copy).
        cloned: u64,
    },
    /// An entry (of any type) is complete, metadata included; last of
    /// all, the copied tree's top itself, with an empty `rel`.
    Entry {
        /// Path relative to the copied tree's top.
        rel: &'a Path,
    },
}

/// Callback type for [`reflink_into`].
pub type Progress<'a> = dyn FnMut(CopyEvent<'_>) -> io::Result<()> + 'a;

/// Copies the directory open as `src` to a new directory `dst_name` inside
/// `dst_parent`, sharing every extent (FICLONE; never a byte copy).
///
/// A crash part-way leaves a partial tree under `dst_name`; callers use a
/// temporary name and delete it on recovery.
pub fn reflink_tree(
    src: BorrowedFd<'_>,
    dst_parent: BorrowedFd<'_>,
    dst_name: &OsStr,
) -> io::Result<CopyStats> {
    sys::mkdir_at(dst_parent, dst_name, 0o700)?;
    let dst = sys::open_dir_at(dst_parent, dst_name)?;
    reflink_into(src, dst.as_fd(), &CopyOptions::default(), &mut |_| Ok(()))
}

/// Copies the contents of the directory open as `src` into the existing
/// directory open as `dst`, then `src`'s own metadata onto `dst`, sharing
/// every extent (never a byte copy). See [`CopyOptions`] for resuming and
/// chunking.
///
/// Never modifies anything in `src`. A crash or error part-way leaves a
/// partial tree in `dst`, which a later call with `resume` completes.
pub fn reflink_into(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    opts: &CopyOptions,
    progress: &mut Progress<'_>,
) -> io::Result<CopyStats> {
    let st = sys::stat(src)?;
    let block = sys::block_size(dst)?;
    helpers::with_helpers(block, opts.chunk_bytes, |helpers| {
        let mut copier = Copier {
            root: dst,
            links: HashMap::new(),
            stats: CopyStats::default(),
            opts: *opts,
            block,
            progress,
            helpers,
        };
        copier.copy_tree(src, dst, st)?;
        Ok(copier.stats)
    })
}

impl CopyStats {
    /// Adds what another part of the same copy did.
    fn absorb(&mut self, o: &CopyStats) {
        self.entries += o.entries;
        self.bytes += o.bytes;
        self.bytes_cloned += o.bytes_cloned;
        self.entries_reused += o.entries_reused;
        self.entries_discarded += o.entries_discarded;
        self.nocow_files += o.nocow_files;
        self.nodatasum_nocow += o.nodatasum_nocow;
        self.helped_files += o.helped_files;
    }
}

struct Copier<'a, 'p> {
    root: BorrowedFd<'a>,
    /// Where the first copy of each multiply-linked source inode went, so
    /// later names become hardlinks again.
    links: HashMap<(u64, u64), FirstLink>,
    stats: CopyStats,
    opts: CopyOptions<'a>,
    /// Filesystem block size: FICLONERANGE offsets are multiples of it.
    block: u64,
    progress: &'p mut Progress<'p>,
    /// Threads copying some of the regular files.
    helpers: Helpers,
}

/// Whether a stat is of a btrfs subvolume root (checked on the fd's fs).
fn is_subvolume_root(st: &Stat, fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(st.file_type == FileType::Directory
        && st.ino == sys::SUBVOLUME_ROOT_INO
        && sys::is_btrfs(fd)?)
}

impl Copier<'_, '_> {
    /// Takes in the files helpers finished: their stats, and their events
    /// reported. With `all`, waits until none is outstanding.
    fn collect(&mut self, all: bool) -> io::Result<()> {
        while let Some(done) = self.helpers.next(all)? {
            let stats = done.report(&mut *self.progress)?;
            self.stats.absorb(&stats);
        }
        Ok(())
    }

    /// Whether a file of `size` bytes is cloned in one piece, small enough
    /// for a helper ([`HELPER_MAX_BYTES`]).
    fn one_piece(&self, size: u64) -> bool {
        size <= self
            .opts
            .chunk_bytes
            .unwrap_or(u64::MAX)
            .min(HELPER_MAX_BYTES)
    }

    /// Copies `src`'s tree into `dst`, then `src`'s metadata onto it: one
    /// walk ([`crate::walk`]) of the source, at most [`MAX_DEPTH`] levels
    /// deep and never across a mount, beside a [`Chain`] of the
    /// destination's directories, each side holding a bounded number of
    /// descriptors whatever the depth.
    fn copy_tree(&mut self, src: BorrowedFd<'_>, dst: BorrowedFd<'_>, st: Stat) -> io::Result<()> {
        let mut walk = Walk::new(src, Some(MAX_DEPTH))?;
        let mut out = Chain::new(dst);
        // The current entry's path from the top, for events and messages:
        // one buffer, a name pushed and popped per level, so a deep tree of
        // long names costs its path once, not once per level.
        let mut rel = PathBuf::new();
        let top = self.begin_dir(&walk, dst, st, self.opts.resume, false)?;
        let mut frames = vec![top];
        while let Some(step) = walk.step()? {
            let Some(frame) = frames.last_mut() else {
                break;
            };
            match step {
                Step::Entry(entry) => {
                    rel.push(&entry.name);
                    let placed =
                        self.copy_entry(&walk, out.dir(), &entry.name, &rel, &mut frame.shared)?;
                    let Placed::Dir {
                        st,
                        existing,
                        nested,
                    } = placed
                    else {
                        rel.pop();
                        self.collect(false)?;
                        continue;
                    };
                    // This level's shared fds stay with its queued files
                    // only: below, each level shares its own.
                    frame.shared = None;
                    let made = sys::open_dir_at(out.dir(), &entry.name)?;
                    walk.enter(&entry.name)?;
                    out.push(&entry.name, made)?;
                    let below = self.begin_dir(&walk, out.dir(), st, existing, nested)?;
                    frames.push(below);
                }
                Step::End => {
                    let Some(frame) = frames.pop() else {
                        break;
                    };
                    self.end_dir(walk.dir(), out.dir(), frame, &rel)?;
                    if walk.leave()?.is_some() {
                        out.pop()?;
                        rel.pop();
                    }
                }
            }
        }
        Ok(())
    }

    /// A directory of the copy just entered (its source current in `walk`,
    /// its destination open as `dst`): its flags readied for its entries.
    /// `existing`: `dst` was there before this call (resume).
    fn begin_dir(
        &mut self,
        walk: &Walk<'_>,
        dst: BorrowedFd<'_>,
        st: Stat,
        existing: bool,
        nested: bool,
    ) -> io::Result<DirFrame> {
        let src = walk.dir();
        if existing {
            sys::clear_stuck_flags(dst)?;
            if nested && sys::is_read_only(dst)? {
                sys::set_read_only(dst, false)?;
            }
        } else {
            // A new directory inherits NOCOW from its parent; it must carry
            // the source's (its children inherit it in turn).
            let want = inode_flags(src)?.contains(InodeFlags::NOCOW);
            let have = inode_flags(dst)?;
            if have.contains(InodeFlags::NOCOW) != want {
                set_flags(dst, have ^ InodeFlags::NOCOW)?;
            }
        }
        Ok(DirFrame {
            st,
            nested,
            resumed: existing,
            shared: None,
        })
    }

    /// A directory of the copy whose entries are all done (source open as
    /// `src`, destination as `dst`, at `rel` from the top): names a resumed
    /// copy had that the source lacks go, then the directory gets its own
    /// metadata.
    fn end_dir(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        frame: DirFrame,
        rel: &Path,
    ) -> io::Result<()> {
        // Every child complete before the directory's own metadata.
        self.collect(true)?;
        if frame.resumed {
            self.stats.entries_discarded += remove::remove_missing_from(src, dst)?;
        }
        finish_metadata(&frame.st, Target::Fd(dst), Some(src))?;
        if frame.nested && sys::is_read_only(src)? {
            sys::set_read_only(dst, true)?;
        }
        (self.progress)(CopyEvent::Entry { rel })
    }

    /// Copies the entry `name` of the walk's current directory into
    /// `dst_dir`, but for a directory, which it only creates (or finds, in
    /// a resumed copy): the caller enters it.
    fn copy_entry(
        &mut self,
        walk: &Walk<'_>,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        shared: &mut Option<SharedDirs>,
    ) -> io::Result<Placed> {
        let src_dir = walk.dir();
        let st = sys::stat_existing_at(src_dir, name)?;
        let ty = st.file_type;
        let nested = ty == FileType::Directory
            && self.opts.nested_subvolumes
            && st.ino == sys::SUBVOLUME_ROOT_INO
            && sys::is_btrfs(src_dir)?;
        let existing = self.kept_from_earlier_copy(src_dir, dst_dir, name, &st, nested)?;
        if ty != FileType::Directory
            && st.nlink > 1
            && let Some(placed) = self.link_to_first(dst_dir, name, rel, &st, existing.as_ref())?
        {
            return Ok(placed);
        }
        self.stats.entries += 1;
        if existing.is_some() {
            self.stats.entries_reused += 1;
        }
        match ty {
            FileType::Directory => {
                if existing.is_none() {
                    if nested {
                        sys::create_subvolume(dst_dir, name)?;
                    } else {
                        sys::mkdir_at(dst_dir, name, 0o700)?;
                    }
                }
                Ok(Placed::Dir {
                    st,
                    existing: existing.is_some(),
                    nested,
                })
            }
            FileType::RegularFile => {
                let fresh = existing.is_none();
                let file = FileAt {
                    src_dir,
                    dst_dir,
                    name,
                    rel,
                    mount: walk.mount(),
                };
                // A hardlinked file stays on the walk, which links its
                // other names to its first.
                if fresh
                    && st.nlink == 1
                    && self.one_piece(st.size)
                    && self.helpers.any()
                    && self.helpers.offer(&file, shared)?
                {
                    return Ok(Placed::Done);
                }
                FileCopier {
                    block: self.block,
                    chunk_bytes: self.opts.chunk_bytes,
                    stats: &mut self.stats,
                    progress: &mut *self.progress,
                }
                .copy_file(&file, fresh)?;
                Ok(Placed::Done)
            }
            _ => self.copy_special(walk, dst_dir, name, rel, &st, ty),
        }
    }

    /// What an earlier, interrupted copy left under `name`, if it can be
    /// kept: the same type, and a source unchanged since. Anything else
    /// there is removed (and counted), so the entry is made afresh.
    fn kept_from_earlier_copy(
        &mut self,
        src_dir: BorrowedFd<'_>,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        st: &Stat,
        nested: bool,
    ) -> io::Result<Option<Stat>> {
        let ty = st.file_type;
        if !self.opts.resume {
            return Ok(None);
        }
        let Some(dst_st) = sys::stat_at(dst_dir, name)? else {
            return Ok(None);
        };
        let dst_ty = dst_st.file_type;
        let changed = match self.opts.changed_since {
            Some(c) => c.changed(src_dir, name, st)?,
            None => false,
        };
        let keep = !changed
            && dst_ty == ty
            && match ty {
                FileType::Directory => is_subvolume_root(&dst_st, dst_dir)? == nested,
                FileType::RegularFile => true,
                _ => false,
            };
        if keep {
            return Ok(Some(dst_st));
        }
        remove_tree_at(dst_dir, name, &mut |_| Ok(()))?;
        self.stats.entries_discarded += 1;
        Ok(None)
    }

    /// For a file of several names: a later name is linked to the copy of
    /// the first (`Some`, done), or kept where an earlier copy already
    /// linked it; the first name is recorded for the others and copied
    /// (`None`).
    fn link_to_first(
        &mut self,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        st: &Stat,
        existing: Option<&Stat>,
    ) -> io::Result<Option<Placed>> {
        let key = (st.dev, st.ino);
        let Some(first) = self.links.get(&key) else {
            let first = FirstLink {
                tree: sys::subvolume_info(dst_dir)?.id,
                dir: sys::stat(dst_dir)?.ino,
                name: name.to_owned(),
            };
            self.links.insert(key, first);
            return Ok(None);
        };
        let holder = sys::open_tree_dir(self.root, first.tree, first.dir)?;
        let (holder, leaf) = (holder.as_fd(), first.name.as_os_str());
        if let Some(dst_st) = existing {
            let first_st = sys::stat_existing_at(holder, leaf)?;
            if (first_st.dev, first_st.ino) == (dst_st.dev, dst_st.ino) {
                self.stats.entries += 1;
                self.stats.entries_reused += 1;
                (self.progress)(CopyEvent::Entry { rel })?;
                return Ok(Some(Placed::Done));
            }
            remove_tree_at(dst_dir, name, &mut |_| Ok(()))?;
            self.stats.entries_discarded += 1;
        }
        link_to(holder, leaf, dst_dir, name)?;
        self.stats.entries += 1;
        (self.progress)(CopyEvent::Entry { rel })?;
        Ok(Some(Placed::Done))
    }

    /// A symlink, FIFO, socket or device node: made anew with its
    /// metadata (a FIFO is never opened, so never read).
    fn copy_special(
        &mut self,
        walk: &Walk<'_>,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        st: &Stat,
        ty: FileType,
    ) -> io::Result<Placed> {
        let src_dir = walk.dir();
        match ty {
            FileType::Symlink => {
                let target = sys::read_link_at(src_dir, name)?
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
                sys::symlink_at(dst_dir, name, &target)?;
                finish_metadata(st, Target::At(dst_dir, name), None)?;
                copy_xattrs_at(src_dir, name, dst_dir, name)?;
            }
            FileType::Fifo
            | FileType::Socket
            | FileType::CharacterDevice
            | FileType::BlockDevice => {
                // A file bind-mounted over it would be what its stat
                // described: never copied as the volume's own.
                if sys::mount_id_at(src_dir, name)? != walk.mount() {
                    return Err(crosses_mount(rel.to_owned()));
                }
                sys::mknod_at(dst_dir, name, ty, st.mode, st.rdev)?;
                copy_xattrs_at(src_dir, name, dst_dir, name)?;
                finish_metadata(st, Target::At(dst_dir, name), None)?;
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: unknown file type", crate::walk::printable(rel)),
                ));
            }
        }
        (self.progress)(CopyEvent::Entry { rel })?;
        Ok(Placed::Done)
    }
}

/// What [`Copier::copy_entry`] left for the walk.
enum Placed {
    /// The entry is copied (or queued for a helper).
    Done,
    /// A directory, created in the destination (or found there): the walk
    /// enters it.
    Dir {
        /// The source directory's metadata.
        st: Stat,
        /// It was there from an interrupted copy (resume).
        existing: bool,
        /// It is a nested subvolume, copied as one.
        nested: bool,
    },
}

/// A directory of the copy whose entries are being copied.
struct DirFrame {
    /// The source directory's metadata, applied once its entries are done.
    st: Stat,
    /// It is a nested subvolume, copied as one.
    nested: bool,
    /// It was there before (a resumed copy): once its entries are done,
    /// the names the source no longer has go.
    resumed: bool,
    /// This directory's pair of descriptors, shared with the helpers
    /// copying its files.
    shared: Option<SharedDirs>,
}

/// Where the first copy of a multiply-linked file went: its directory in
/// the copy by number (tree id and inode, opened by handle,
/// [`sys::open_tree_dir`]) and its name. No path: one per hardlinked file
/// would cost a deep tree's whole path each, and could not be opened past
/// PATH_MAX. (A reflink copy is on btrfs, where handles work.)
struct FirstLink {
    tree: u64,
    dir: u64,
    name: OsString,
}

/// One regular file to copy: the directories it is in and goes to, its
/// name, its path from the top of the copy (for events), and the mount the
/// copy's source is on (the file must be on it too).
pub(crate) struct FileAt<'a> {
    pub src_dir: BorrowedFd<'a>,
    pub dst_dir: BorrowedFd<'a>,
    pub name: &'a OsStr,
    pub rel: &'a Path,
    pub mount: Option<u64>,
}

/// Copies one regular file, on the walk's thread or on a helper's: what it
/// adds goes to `stats` (all but the entry count, the walk's), each step to
/// `progress`.
pub(crate) struct FileCopier<'s, 'p> {
    /// Filesystem block size: FICLONERANGE offsets are multiples of it.
    pub block: u64,
    /// [`CopyOptions::chunk_bytes`].
    pub chunk_bytes: Option<u64>,
    pub stats: &'s mut CopyStats,
    pub progress: &'s mut Progress<'p>,
}

impl FileCopier<'_, '_> {
    /// Copies the regular file `f` (new in the destination if `fresh`,
    /// else continued from what an earlier copy left there): data, then
    /// metadata, then its [`CopyEvent::Entry`].
    pub fn copy_file(&mut self, f: &FileAt<'_>, fresh: bool) -> io::Result<()> {
        // O_NONBLOCK: if the entry was swapped for a FIFO since the
        // stat, opening it must not hang; fstat below then refuses it.
        let src = sys::open_read_at(f.src_dir, f.name)?;
        // A file bind-mounted over this name is no part of the volume.
        if sys::mount_id(src.as_fd())? != f.mount {
            return Err(crosses_mount(f.rel.to_owned()));
        }
        let st = sys::stat(src.as_fd())?;
        if st.file_type != FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} changed type during the copy",
                    crate::walk::printable(f.rel)
                ),
            ));
        }
        let create_mode = if fresh {
            // Like cp: when the owner will not change, create the
            // file with its final permission bits (never the setuid,
            // setgid or sticky bit, nor more than the source allows),
            // so the chown and chmod below are usually no-ops and
            // skipped; otherwise private until the chown.
            let same_owner = (st.uid, st.gid) == sys::effective_ids();
            if same_owner { st.mode & 0o777 } else { 0o600 }
        } else {
            // An immutable or append-only file cannot be opened for
            // writing: clear those flags (set again at the end) first.
            let ro = sys::open_read_at(f.dst_dir, f.name)?;
            sys::clear_stuck_flags(ro.as_fd())?;
            0o600
        };
        let dst = sys::open_write_at(f.dst_dir, f.name, fresh, create_mode)?;
        let dst_st = sys::stat(dst.as_fd())?;
        let src_flags = inode_flags(src.as_fd())?;
        self.copy_data(src.as_fd(), dst.as_fd(), &st, &dst_st, src_flags, f.rel)?;
        // A fresh file has no setuid or setgid bit nor capability for
        // the clone to clear, so its owner and mode are still those
        // of `dst_st`; a reused one is set whatever it has.
        let now = fresh.then_some(&dst_st);
        finish_file_metadata(&st, dst.as_fd(), src.as_fd(), src_flags, now)?;
        (self.progress)(CopyEvent::Entry { rel: f.rel })
    }

    /// Puts `src`'s data into `dst` by reflink: NOCOW first (the kernel only
    /// clones NOCOW data into a NOCOW file), then from what is already in
    /// `dst` (its size, aligned down to the block size) to the end, in
    /// offset order; data checksums made the source's where btrfs refuses
    /// the first clone for them (`checksums`).
    fn copy_data(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        st: &Stat,
        dst_st: &Stat,
        src_flags: InodeFlags,
        rel: &Path,
    ) -> io::Result<()> {
        let size = st.size;
        let src_id = (st.dev, st.ino);
        let want_nocow = src_flags.contains(InodeFlags::NOCOW);
        if want_nocow {
            self.stats.nocow_files += 1;
        }
        let dst_flags = inode_flags(dst)?;
        let mut start = dst_st.size.min(size);
        if dst_flags.contains(InodeFlags::NOCOW) != want_nocow {
            // Only possible for a file with no data yet; be safe anyway.
            start = 0;
            if dst_st.size != 0 {
                sys::truncate(dst, 0)?;
            }
            let flags = if want_nocow {
                dst_flags | InodeFlags::NOCOW
            } else {
                dst_flags.difference(InodeFlags::NOCOW)
            };
            set_flags(dst, flags)?;
        }
        if start < size {
            // A partial file: its last block may be partial too.
            start -= start % self.block;
        }
        if dst_st.size != start {
            sys::truncate(dst, start)?;
        }
        self.stats.bytes += size;
        if start > 0 {
            (self.progress)(CopyEvent::Data {
                rel,
                src: src_id,
                size,
                done: start,
                cloned: 0,
            })?;
        }
        match self.chunk_bytes {
            None => {
                if size > start {
                    let len = (start > 0).then_some(size - start);
                    checksums::clone_range(dst, src, start, len, rel, self.stats)?;
                    self.stats.bytes_cloned += size - start;
                    (self.progress)(CopyEvent::Data {
                        rel,
                        src: src_id,
                        size,
                        done: size,
                        cloned: size - start,
                    })?;
                }
            }
            Some(chunk) => {
                let chunk = chunk.max(1).div_ceil(self.block) * self.block;
                let mut off = start;
                while off < size {
                    let len = chunk.min(size - off);
                    checksums::clone_range(dst, src, off, Some(len), rel, self.stats)?;
                    off += len;
                    self.stats.bytes_cloned += len;
                    (self.progress)(CopyEvent::Data {
                        rel,
                        src: src_id,
                        size,
                        done: off,
                        cloned: len,
                    })?;
                }
            }
        }
        // A clone ending in a hole may leave the size short: holes are kept
        // as holes either way.
        if sys::stat(dst)?.size != size {
            sys::truncate(dst, size)?;
        }
        Ok(())
    }
}

/// Makes `name` in `dir` another link to `first` in `holder` (inside the
/// copy). The kernel refuses to link an immutable or append-only inode,
/// and the first copy already carries the source's flags, so they are lifted
/// for the link ([`sys::with_stuck_flags_lifted`]); a resumed copy applies every
/// file's metadata again.
fn link_to(
    holder: BorrowedFd<'_>,
    first: &OsStr,
    dir: BorrowedFd<'_>,
    name: &OsStr,
) -> io::Result<()> {
    sys::with_stuck_flags_lifted(holder, first, || sys::link_at(holder, first, dir, name))
}
