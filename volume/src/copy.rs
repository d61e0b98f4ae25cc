//! Reflink copy of a directory tree, losing nothing `cp -a` keeps and more.
//!
//! Used for the backup of a volume that is still a plain directory on btrfs
//! (and, later, by the one-time conversion to subvolumes). Unlike
//! `cp -a --reflink=always`, it handles NOCOW files: the flag is set on the
//! new file before any data is cloned, which is the only order in which the
//! kernel allows a reflink of NOCOW data.
//!
//! Contents are untrusted: every name is resolved relative to an open
//! directory, nothing is followed through a symlink, and only regular files
//! and directories are ever opened (FIFOs, sockets and devices are recreated
//! with mknod). Names are raw bytes.
//!
//! Per entry, the order matters: data, then owner (a chown clears setuid and
//! file capabilities), then mode, then xattrs (ACLs and capabilities
//! included), then timestamps, then the immutable and append-only flags
//! (which forbid everything before them). Directories get theirs after their
//! children, so their mtime is the source's.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, IFlags, Timespec, Timestamps};

use crate::sys::{self, Metadata as Stat, inode_flags, set_inode_flags as set_flags};

mod helpers;

use helpers::{HELPER_MAX_BYTES, Helpers, SharedDirs};

/// How deep the walks here, and volume-migrate's counts, go below the top
/// of what they walk before refusing with [`too_deep`]. A package nests its
/// directories as deep as it likes, and each level of a walk holds an open
/// directory and a stack frame: a 20,000-deep tree overflowed the stack of
/// volume-migrate's count threads and aborted the whole process, which
/// start-core's boot would share. 2,048 is past any real package's tree (a
/// path of 2,048 one-byte names already fills PATH_MAX), on a thread of
/// [`WALK_STACK_BYTES`] (tested at this depth).
pub const MAX_DEPTH: usize = 2048;

/// The stack of a thread that walks a package's tree (copies, removals,
/// volume-migrate's counts): room for [`MAX_DEPTH`] levels in an
/// unoptimised build too (the 2 MiB default held about 1,000 there), and
/// only address space until touched. Callers run such walks on a thread
/// of this size: `volume-migrate`'s CLI and counts, `startos-core`'s tasks.
pub const WALK_STACK_BYTES: usize = 64 << 20;

/// Directories nested deeper than [`MAX_DEPTH`] levels: the payload of
/// [`too_deep`]'s error, which [`is_too_deep`] recognises.
#[derive(Debug)]
pub struct TooDeep;

impl std::fmt::Display for TooDeep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "directories nested deeper than {MAX_DEPTH} levels")
    }
}

impl std::error::Error for TooDeep {}

/// The error for a tree nested deeper than [`MAX_DEPTH`] levels below the
/// top of what was walked. It is final: walking again meets it again.
pub fn too_deep() -> io::Error {
    io::Error::other(TooDeep)
}

/// Whether `e` is [`too_deep`]'s.
pub fn is_too_deep(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<TooDeep>())
}

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
    /// Regular files copied on a helper thread rather than the walk's.
    pub helped_files: u64,
}

/// How [`reflink_into`] copies.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyOptions {
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
    /// With `resume`: a source entry whose ctime is at or after this instant
    /// (seconds, nanoseconds) changed since the earlier copy started, so its
    /// destination (a whole subtree for a directory) is discarded and copied
    /// again. `None`: every existing destination entry is trusted.
    pub changed_since: Option<(i64, i64)>,
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
    /// An entry (of any type) is complete, metadata included.
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
    let st = sys::metadata(src)?;
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
        copier.copy_dir(src, dst, &st, Path::new(""), opts.resume, false)?;
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
        self.helped_files += o.helped_files;
    }
}

struct Copier<'a, 'p> {
    root: BorrowedFd<'a>,
    /// First destination path (relative to `root`) of each multiply-linked
    /// source inode, so later names become hardlinks again.
    links: HashMap<(u64, u64), PathBuf>,
    stats: CopyStats,
    opts: CopyOptions,
    /// Filesystem block size: FICLONERANGE offsets are multiples of it.
    block: u64,
    progress: &'p mut Progress<'p>,
    /// Threads copying some of the regular files.
    helpers: Helpers,
}

/// Where to apply metadata: an open fd (files, directories) or a name in a
/// directory (symlinks and special files, which are never opened).
enum Target<'a> {
    Fd(BorrowedFd<'a>),
    At(BorrowedFd<'a>, &'a OsStr),
}

/// Stat's time fields differ in width between targets; Timespec's too.
#[allow(clippy::unnecessary_cast)]
fn ts(sec: i64, nsec: i64) -> Timespec {
    Timespec {
        tv_sec: sec as _,
        tv_nsec: nsec as _,
    }
}

/// Whether a stat is of a btrfs subvolume root (checked on the fd's fs).
fn is_subvolume_root(st: &Stat, fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(FileType::from_raw_mode(st.st_mode) == FileType::Directory
        && st.st_ino == sys::SUBVOLUME_ROOT_INO
        && sys::is_btrfs(fd)?)
}

#[allow(clippy::unnecessary_cast)]
fn ctime(st: &Stat) -> (i64, i64) {
    (st.st_ctime as i64, st.st_ctime_nsec as i64)
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

    /// Copies `src`'s children into `dst`, then `src`'s metadata onto it.
    /// `existing`: `dst` was there before this call (resume).
    fn copy_dir(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        st: &Stat,
        rel: &Path,
        existing: bool,
        nested: bool,
    ) -> io::Result<()> {
        if rel.components().count() > MAX_DEPTH {
            return Err(too_deep());
        }
        if existing {
            sys::clear_stuck_flags(dst)?;
            if nested && sys::is_read_only(dst)? {
                sys::set_read_only(dst, false)?;
            }
        } else {
            // A new directory inherits NOCOW from its parent; it must carry
            // the source's (its children inherit it in turn).
            let want = inode_flags(src)?.contains(IFlags::NOCOW);
            let have = inode_flags(dst)?;
            if have.contains(IFlags::NOCOW) != want {
                set_flags(dst, have ^ IFlags::NOCOW)?;
            }
        }
        let children = sys::read_dir_names(src)?;
        let mut shared = None;
        for (name, _, _) in &children {
            self.copy_entry(src, dst, name, &rel.join(name), &mut shared)?;
            self.collect(false)?;
        }
        // Every child complete before the directory's own metadata.
        self.collect(true)?;
        if existing {
            let wanted: HashSet<&OsStr> = children.iter().map(|(n, _, _)| n.as_os_str()).collect();
            for (name, _, _) in sys::read_dir_names(dst)? {
                if !wanted.contains(name.as_os_str()) {
                    remove_tree_at(dst, &name, &mut |_| Ok(()))?;
                    self.stats.entries_discarded += 1;
                }
            }
        }
        finish_metadata(st, Target::Fd(dst), Some(src))?;
        if nested && sys::is_read_only(src)? {
            sys::set_read_only(dst, true)?;
        }
        (self.progress)(CopyEvent::Entry { rel })
    }

    fn copy_entry(
        &mut self,
        src_dir: BorrowedFd<'_>,
        dst_dir: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        shared: &mut Option<SharedDirs>,
    ) -> io::Result<()> {
        let st = sys::metadata_at(src_dir, name)?;
        let ty = FileType::from_raw_mode(st.st_mode);
        let nested = ty == FileType::Directory
            && self.opts.nested_subvolumes
            && st.st_ino == sys::SUBVOLUME_ROOT_INO
            && sys::is_btrfs(src_dir)?;
        // What an earlier, interrupted copy left under this name, if it can
        // be kept: the same type, and a source unchanged since.
        let mut existing = None;
        let found = if self.opts.resume {
            sys::metadata_at_if_exists(dst_dir, name)?
        } else {
            None
        };
        if let Some(dst_st) = found {
            let dst_ty = FileType::from_raw_mode(dst_st.st_mode);
            let changed = self.opts.changed_since.is_some_and(|t| ctime(&st) >= t);
            let keep = !changed
                && dst_ty == ty
                && match ty {
                    FileType::Directory => is_subvolume_root(&dst_st, dst_dir)? == nested,
                    FileType::RegularFile => true,
                    _ => false,
                };
            if keep {
                existing = Some(dst_st);
            } else {
                remove_tree_at(dst_dir, name, &mut |_| Ok(()))?;
                self.stats.entries_discarded += 1;
            }
        }
        if ty != FileType::Directory && st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key) {
                if let Some(dst_st) = &existing {
                    let first_st = sys::metadata_at(self.root, first.as_os_str())?;
                    if (first_st.st_dev, first_st.st_ino) == (dst_st.st_dev, dst_st.st_ino) {
                        self.stats.entries += 1;
                        self.stats.entries_reused += 1;
                        return (self.progress)(CopyEvent::Entry { rel });
                    }
                    remove_tree_at(dst_dir, name, &mut |_| Ok(()))?;
                    self.stats.entries_discarded += 1;
                }
                link_to(self.root, first, dst_dir, name)?;
                self.stats.entries += 1;
                return (self.progress)(CopyEvent::Entry { rel });
            }
            self.links.insert(key, rel.to_path_buf());
        }
        self.stats.entries += 1;
        if existing.is_some() {
            self.stats.entries_reused += 1;
        }
        match ty {
            FileType::Directory => {
                // This level's shared fds stay with its queued files only:
                // below, each level shares its own.
                *shared = None;
                let src = sys::open_dir_at(src_dir, name)?;
                if existing.is_none() {
                    if nested {
                        sys::create_subvolume(dst_dir, name)?;
                    } else {
                        sys::mkdir_at(dst_dir, name, 0o700)?;
                    }
                }
                let dst = sys::open_dir_at(dst_dir, name)?;
                self.copy_dir(
                    src.as_fd(),
                    dst.as_fd(),
                    &st,
                    rel,
                    existing.is_some(),
                    nested,
                )
            }
            FileType::RegularFile => {
                let fresh = existing.is_none();
                let file = FileAt {
                    src_dir,
                    dst_dir,
                    name,
                    rel,
                };
                // A hardlinked file stays on the walk, which links its
                // other names to its first.
                if fresh
                    && st.st_nlink == 1
                    && self.one_piece(st.st_size as u64)
                    && self.helpers.any()
                    && self.helpers.offer(&file, shared)?
                {
                    return Ok(());
                }
                FileCopier {
                    block: self.block,
                    chunk_bytes: self.opts.chunk_bytes,
                    stats: &mut self.stats,
                    progress: &mut *self.progress,
                }
                .copy_file(&file, fresh)
            }
            FileType::Symlink => {
                let target = sys::read_link_at(src_dir, name)?
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
                sys::symlink_at(dst_dir, name, &target)?;
                finish_metadata(&st, Target::At(dst_dir, name), None)?;
                copy_xattrs_at(src_dir, name, dst_dir, name)?;
                (self.progress)(CopyEvent::Entry { rel })
            }
            FileType::Fifo
            | FileType::Socket
            | FileType::CharacterDevice
            | FileType::BlockDevice => {
                sys::mknod_at(dst_dir, name, ty, st.st_mode, st.st_rdev)?;
                copy_xattrs_at(src_dir, name, dst_dir, name)?;
                finish_metadata(&st, Target::At(dst_dir, name), None)?;
                (self.progress)(CopyEvent::Entry { rel })
            }
            FileType::Unknown => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: unknown file type", rel.display()),
            )),
        }
    }
}

/// One regular file to copy: the directories it is in and goes to, its
/// name, and its path from the top of the copy (for events).
pub(crate) struct FileAt<'a> {
    pub src_dir: BorrowedFd<'a>,
    pub dst_dir: BorrowedFd<'a>,
    pub name: &'a OsStr,
    pub rel: &'a Path,
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
        let st = sys::metadata(src.as_fd())?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} changed type during the copy", f.rel.display()),
            ));
        }
        let create_mode = if fresh {
            // Like cp: when the owner will not change, create the
            // file with its final permission bits (never the setuid,
            // setgid or sticky bit, nor more than the source allows),
            // so the chown and chmod below are usually no-ops and
            // skipped; otherwise private until the chown.
            let same_owner = (st.st_uid, st.st_gid) == sys::effective_ids();
            if same_owner {
                st.st_mode & 0o777
            } else {
                0o600
            }
        } else {
            // An immutable or append-only file cannot be opened for
            // writing: clear those flags (set again at the end) first.
            let ro = sys::open_read_at(f.dst_dir, f.name)?;
            sys::clear_stuck_flags(ro.as_fd())?;
            0o600
        };
        let dst = sys::open_write_at(f.dst_dir, f.name, fresh, create_mode)?;
        let dst_st = sys::metadata(dst.as_fd())?;
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
    /// offset order.
    fn copy_data(
        &mut self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        st: &Stat,
        dst_st: &Stat,
        src_flags: IFlags,
        rel: &Path,
    ) -> io::Result<()> {
        let size = st.st_size as u64;
        let src_id = (st.st_dev, st.st_ino);
        let want_nocow = src_flags.contains(IFlags::NOCOW);
        if want_nocow {
            self.stats.nocow_files += 1;
        }
        let dst_flags = inode_flags(dst)?;
        let mut start = (dst_st.st_size as u64).min(size);
        if dst_flags.contains(IFlags::NOCOW) != want_nocow {
            // Only possible for a file with no data yet; be safe anyway.
            start = 0;
            if dst_st.st_size != 0 {
                sys::truncate(dst, 0)?;
            }
            let flags = if want_nocow {
                dst_flags | IFlags::NOCOW
            } else {
                dst_flags.difference(IFlags::NOCOW)
            };
            set_flags(dst, flags)?;
        }
        if start < size {
            // A partial file: its last block may be partial too.
            start -= start % self.block;
        }
        if dst_st.st_size as u64 != start {
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
                    if start == 0 {
                        sys::ficlone(dst, src)?;
                    } else {
                        sys::ficlone_range(dst, src, start, size - start)?;
                    }
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
                    sys::ficlone_range(dst, src, off, len)?;
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
        if sys::metadata(dst)?.st_size as u64 != size {
            sys::truncate(dst, size)?;
        }
        Ok(())
    }
}

/// Removes the entry `name` of `parent` and everything below it, whatever
/// its type, never following a symlink and opening nothing but directories
/// (and a regular file whose immutable or append-only flag forbids the
/// unlink). A nested btrfs subvolume is deleted whole, O(1) (read-only
/// flags cleared first); everything else is unlinked one by one, which for a
/// plain directory costs O(extents). Absent is fine.
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
    remove_inner(parent, name, 0, &mut count, on_entry)
}

fn remove_inner(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    depth: usize,
    count: &mut u64,
    on_entry: &mut dyn FnMut(u64) -> io::Result<()>,
) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    let Some(st) = sys::metadata_at_if_exists(parent, name)? else {
        return Ok(());
    };
    if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
        let dir = sys::open_dir_at(parent, name)?;
        if is_subvolume_root(&st, parent)? && sys::stat(dir.as_fd())?.dev != sys::stat(parent)?.dev
        {
            sys::make_tree_writable(dir.as_fd())?;
            drop(dir);
            sys::delete_subvolume(parent, name, true)?;
        } else {
            sys::clear_stuck_flags(dir.as_fd())?;
            for (child, _, _) in sys::read_dir_names(dir.as_fd())? {
                remove_inner(dir.as_fd(), &child, depth + 1, count, on_entry)?;
            }
            drop(dir);
            sys::rmdir_at(parent, name)?;
        }
    } else {
        match sys::unlink_at(parent, name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            // Names elsewhere (hardlinks outside the tree) keep the inode,
            // and so its flags.
            Err(e)
                if e.raw_os_error() == Some(libc::EPERM)
                    && FileType::from_raw_mode(st.st_mode) == FileType::RegularFile =>
            {
                sys::with_stuck_flags_lifted(parent, name, || sys::unlink_at(parent, name))?;
            }
            Err(e) => return Err(e),
        }
    }
    *count += 1;
    on_entry(*count)
}

/// Makes `name` in `dir` another link to `first` (relative to `root`, inside
/// the copy). The kernel refuses to link an immutable or append-only inode,
/// and the first copy already carries the source's flags, so they are lifted
/// for the link ([`sys::with_stuck_flags_lifted`]); a resumed copy applies every
/// file's metadata again.
fn link_to(
    root: BorrowedFd<'_>,
    first: &Path,
    dir: BorrowedFd<'_>,
    name: &OsStr,
) -> io::Result<()> {
    let first = first.as_os_str();
    sys::with_stuck_flags_lifted(root, first, || sys::link_at(root, first, dir, name))
}

/// Owner, mode, xattrs (for fds), timestamps and the remaining inode flags,
/// in the only order in which each survives the next.
fn finish_metadata(st: &Stat, target: Target<'_>, src: Option<BorrowedFd<'_>>) -> io::Result<()> {
    match target {
        Target::Fd(fd) => {
            let src_flags = match src {
                Some(src) => Some(inode_flags(src)?),
                None => None,
            };
            finish_fd_metadata(st, fd, src, src_flags, None)
        }
        Target::At(dir, name) => {
            sys::chown_at(dir, name, st.st_uid, st.st_gid)?;
            let ty = FileType::from_raw_mode(st.st_mode);
            if ty != FileType::Symlink {
                // mknod applied the umask; chmodat cannot follow a non-link.
                sys::chmod_at(dir, name, st.st_mode)?;
            }
            sys::set_times_at(dir, name, &times(st))?;
            Ok(())
        }
    }
}

/// [`finish_metadata`] for a regular file whose source flags are known.
/// `now`: the file's current owner and mode, when known, to skip a chown or
/// chmod that would change nothing.
fn finish_file_metadata(
    st: &Stat,
    dst: BorrowedFd<'_>,
    src: BorrowedFd<'_>,
    src_flags: IFlags,
    now: Option<&Stat>,
) -> io::Result<()> {
    finish_fd_metadata(st, dst, Some(src), Some(src_flags), now)
}

#[allow(clippy::unnecessary_cast)]
fn times(st: &Stat) -> Timestamps {
    Timestamps {
        last_access: ts(st.st_atime as _, st.st_atime_nsec as _),
        last_modification: ts(st.st_mtime as _, st.st_mtime_nsec as _),
    }
}

/// Gives the file or directory open as `fd` the metadata `st` describes:
/// owner, mode, xattrs (copied from `src`, when given), timestamps, then
/// `src_flags` but NOCOW added to the fd's flags, the order in which each
/// survives the next (a chown clears setuid and capabilities, the
/// immutable flag forbids all the rest). `now`: the fd's current owner and
/// mode, when known, to skip a chown or chmod that would change nothing.
/// A failure part-way leaves some of it applied.
pub fn finish_fd_metadata(
    st: &Stat,
    fd: BorrowedFd<'_>,
    src: Option<BorrowedFd<'_>>,
    src_flags: Option<IFlags>,
    now: Option<&Stat>,
) -> io::Result<()> {
    let same_owner = now.is_some_and(|n| (n.st_uid, n.st_gid) == (st.st_uid, st.st_gid));
    if !same_owner {
        sys::chown(fd, st.st_uid, st.st_gid)?;
    }
    // A chown may clear the setuid and setgid bits: after one, always chmod.
    let same_mode = same_owner && now.is_some_and(|n| n.st_mode & 0o7777 == st.st_mode & 0o7777);
    if !same_mode {
        sys::chmod(fd, st.st_mode)?;
    }
    if let Some(src) = src {
        copy_xattrs_fd(src, fd)?;
    }
    sys::set_times(fd, &times(st))?;
    if let Some(src_flags) = src_flags {
        let rest = src_flags.difference(IFlags::NOCOW);
        if !rest.is_empty() {
            set_flags(fd, inode_flags(fd)? | rest)?;
        }
    }
    Ok(())
}

/// Removes every xattr of `dst` that `src` does not have (both open fds).
pub fn remove_xattrs_missing_from(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    let keep: HashSet<OsString> = sys::list_xattrs(src)?.into_iter().collect();
    for name in sys::list_xattrs(dst)?.iter().filter(|n| !keep.contains(*n)) {
        match sys::remove_xattr(dst, name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn copy_xattrs_fd(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    for name in sys::list_xattrs(src)? {
        let value = sys::get_xattr(src, &name)?;
        sys::set_xattr(dst, &name, &value)?;
    }
    Ok(())
}

/// Xattrs of an entry that is never opened (symlink, FIFO, device).
fn copy_xattrs_at(
    src_dir: BorrowedFd<'_>,
    src_name: &OsStr,
    dst_dir: BorrowedFd<'_>,
    dst_name: &OsStr,
) -> io::Result<()> {
    let list = match sys::list_xattrs_at(src_dir, src_name) {
        Ok(l) => l,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    for name in list {
        let value = sys::get_xattr_at(src_dir, src_name, &name)?;
        sys::set_xattr_at(dst_dir, dst_name, &name, &value)?;
    }
    Ok(())
}
