//! Reaching a btrfs inode by its number, without a path.
//!
//! A path into a package's volume runs through directories the package
//! controls: it can be longer than PATH_MAX, be covered by a mount, or be
//! renamed while it is walked. A subvolume, or a directory inside one, also
//! has a number the package cannot change: its tree id, and its inode
//! number in that tree. btrfs exports both as a file handle
//! (`FILEID_BTRFS_WITHOUT_PARENT`: inode, tree id, generation), and
//! `open_by_handle_at` opens the inode itself, whatever the directories
//! above it are called, however deep it sits, and whatever is mounted over
//! it. It needs CAP_DAC_READ_SEARCH, which the crate's tree searches
//! (CAP_SYS_ADMIN) already imply in practice: both are root's.
//!
//! Each open is checked after the fact: the fd must be a directory of the
//! wanted tree with the wanted inode number, so a handle the kernel
//! resolves otherwise is an error, never a wrong directory.
//!
//! The generation in the handle is the inode item's: a number reused after
//! a deletion gets a new generation, so a stale handle fails (ESTALE).
//!
//! Inode items also say which transaction last changed each inode: what a
//! resumed copy asks ([`inodes_written_since`]), the filesystem's own order
//! of changes rather than times a clock wrote.

use std::collections::HashSet;
use std::ffi::OsString;
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::fs::{is_btrfs, stat};
use super::ioctl::{ensure_btrfs, malformed};
use super::item::{self, InodeItem, InodeRef};
use super::search::{INODE_ITEM_KEY, KeyRange, Searcher};
use super::subvolume_info::{SUBVOLUME_ROOT_INO, subvolume_info};

/// `FILEID_BTRFS_WITHOUT_PARENT` from `include/linux/exportfs.h`.
const FILEID_BTRFS_WITHOUT_PARENT: i32 = 0x4d;
/// Its length: `objectid` and `root_objectid` (u64), `gen` (u32), packed.
const FID_LEN: usize = 20;

/// `struct file_handle` with room for a btrfs fid.
#[repr(C)]
struct FileHandle {
    handle_bytes: u32,
    handle_type: i32,
    f_handle: [u8; FID_LEN],
}

/// The generation of inode `ino` in tree `tree` of the filesystem holding
/// `fs`, from its inode item; `NotFound` if the tree has no such inode.
fn generation(fs: BorrowedFd<'_>, tree: u64, ino: u64) -> io::Result<u64> {
    let found = find_inode_item(fs, tree, ino)?.map(|inode| inode.generation);
    found.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no inode {ino} in subvolume {tree}"),
        )
    })
}

/// The inode item of the file or directory open as `fd`, as its
/// subvolume's tree holds it: what it says of the inode's data (NODATASUM,
/// NODATACOW) and no FS_IOC_GETFLAGS shows. `None` while the inode is
/// newer than the last commit (btrfs keeps new inodes in memory until one
/// writes them into the tree). Needs CAP_SYS_ADMIN; ENOTTY off btrfs.
pub fn inode_item(fd: BorrowedFd<'_>) -> io::Result<Option<InodeItem>> {
    find_inode_item(fd, 0, stat(fd)?.ino)
}

/// Inode `ino`'s item in tree `tree` (0: the tree of `fs`), if there.
fn find_inode_item(fs: BorrowedFd<'_>, tree: u64, ino: u64) -> io::Result<Option<InodeItem>> {
    let mut found = None;
    let mut bad = None;
    Searcher::default().search_tree(
        fs,
        tree,
        KeyRange::inode_items(ino, INODE_ITEM_KEY),
        |key, body| {
            if key.objectid == ino && key.item_type == INODE_ITEM_KEY {
                match InodeItem::parse(body) {
                    Ok(inode) => found = Some(inode),
                    Err(e) => bad = Some(e),
                }
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        },
    )?;
    match bad {
        Some(e) => Err(e.into()),
        None => Ok(found),
    }
}

/// The inode numbers of the subvolume holding `fd` whose inode item was
/// written in transaction `since` or later: every file changed in any way
/// (data, size, times, owner, mode, links, xattrs) from that transaction
/// on, as the filesystem orders its changes, whatever the clock said.
/// Reads only the tree blocks written since (a leaf written since may
/// hold older items too, each told apart by its own `transid`), so it costs
/// what changed, not the tree.
///
/// btrfs keeps the latest inode updates in memory (delayed items) until a
/// commit writes them into the tree: commit first
/// ([`super::commit_metadata`]) for an answer that holds every change made
/// before the call. Needs CAP_SYS_ADMIN; ENOTTY off btrfs.
pub fn inodes_written_since(fd: BorrowedFd<'_>, since: u64) -> io::Result<HashSet<u64>> {
    let mut changed = HashSet::new();
    let mut bad = None;
    Searcher::default()
        .written_since(since)
        .search_tree(fd, 0, KeyRange::all(), |key, body| {
            if key.item_type != INODE_ITEM_KEY {
                return ControlFlow::Continue(());
            }
            match InodeItem::parse(body) {
                Ok(inode) if inode.transid >= since => {
                    changed.insert(key.objectid);
                }
                Ok(_) => {}
                Err(e) => {
                    bad = Some(e);
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })?;
    match bad {
        Some(e) => Err(e.into()),
        None => Ok(changed),
    }
}

/// How many directories [`inode_beneath`] climbs before it gives up: far
/// past any real tree's depth (a path is at most 4,096 bytes).
const MAX_DEPTH: usize = 4096;

/// Whether inode `ino` of the subvolume holding `fs` lies beneath its
/// directory `dir` (or is it), climbing each directory's one reference
/// item up to the subvolume's root; `None` if the tree has no inode
/// `ino`. A file with other than one name (hard links, or none left) is
/// answered `Some(true)`: only one of its names would be followed, and a
/// caller asking whether a change may concern `dir` must not be told no
/// wrongly. An inode without a reference item, or a climb past
/// 4,096 levels (`MAX_DEPTH`), is an error. Reads the tree as committed plus
/// btrfs's in-memory changes written into it so far (commit first, as for
/// [`inodes_written_since`]). Needs CAP_SYS_ADMIN; ENOTTY off btrfs.
pub fn inode_beneath(fs: BorrowedFd<'_>, ino: u64, dir: u64) -> io::Result<Option<bool>> {
    let Some(item) = find_inode_item(fs, 0, ino)? else {
        return Ok(None);
    };
    if ino == dir || (item.mode & libc::S_IFMT != libc::S_IFDIR && item.nlink != 1) {
        return Ok(Some(true));
    }
    let mut at = ino;
    for _ in 0..MAX_DEPTH {
        match dir_parent(fs, 0, at)? {
            None => return Ok(Some(false)),
            Some((up, _)) if up == dir => return Ok(Some(true)),
            Some((up, _)) => at = up,
        }
    }
    Err(io::Error::other(format!(
        "inode {ino} lies over {MAX_DEPTH} directories deep"
    )))
}

/// Opens the directory that is inode `ino` of tree `tree`, on the
/// filesystem holding `fs` (any fd on it), by file handle: no path, no
/// symlink, no mount on the way. Checked to be a directory of that tree
/// with that number. ENOTTY off btrfs.
pub(crate) fn open_tree_dir(fs: BorrowedFd<'_>, tree: u64, ino: u64) -> io::Result<OwnedFd> {
    ensure_btrfs(fs)?;
    let generation = generation(fs, tree, ino)?;
    let mut handle = FileHandle {
        handle_bytes: FID_LEN as u32,
        handle_type: FILEID_BTRFS_WITHOUT_PARENT,
        f_handle: [0; FID_LEN],
    };
    handle.f_handle[..8].copy_from_slice(&ino.to_ne_bytes());
    handle.f_handle[8..16].copy_from_slice(&tree.to_ne_bytes());
    // The handle holds the low 32 bits, as the kernel's own do.
    handle.f_handle[16..].copy_from_slice(&(generation as u32).to_ne_bytes());
    super::fault::check("open_by_handle_at")?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: open_by_handle_at(2) takes a mount fd, a pointer to a
    // `struct file_handle` whose `handle_bytes` (20) covers the bytes
    // that follow it (FileHandle is repr(C) with exactly that many), and
    // open flags; it only reads the handle. rustix has no wrapper for it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            fs.as_raw_fd(),
            &mut handle as *mut FileHandle,
            flags,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let raw = i32::try_from(ret).map_err(|_| malformed("fd out of range"))?;
    // SAFETY: a non-negative return of open_by_handle_at is a new fd that
    // nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let st = stat(fd.as_fd())?;
    if !st.is_dir() || st.ino != ino || !is_btrfs(fd.as_fd())? {
        return Err(malformed("a file handle opened another inode"));
    }
    if subvolume_info(fd.as_fd())?.id != tree {
        return Err(malformed(
            "a file handle opened an inode of another subvolume",
        ));
    }
    Ok(fd)
}

/// Opens the root directory of subvolume `id` on the filesystem holding
/// `fs` (`open_tree_dir` of its inode 256).
pub fn open_subvolume(fs: BorrowedFd<'_>, id: u64) -> io::Result<OwnedFd> {
    open_tree_dir(fs, id, SUBVOLUME_ROOT_INO)
}

/// The directory holding directory `ino` of tree `tree`, and its name
/// there, from the inode's reference item (a directory has exactly one);
/// `None` for the tree's root. `NotFound` if the tree has no such inode.
pub fn dir_parent(fs: BorrowedFd<'_>, tree: u64, ino: u64) -> io::Result<Option<(u64, OsString)>> {
    if ino == SUBVOLUME_ROOT_INO {
        return Ok(None);
    }
    let mut found = None;
    let mut bad = None;
    Searcher::default().search_tree(
        fs,
        tree,
        KeyRange::inode_items(ino, item::INODE_REF_KEY),
        |key, body| {
            if key.objectid != ino || key.item_type != item::INODE_REF_KEY {
                return ControlFlow::Continue(());
            }
            match InodeRef::parse(body) {
                Ok(r) => found = Some((key.offset, r.name)),
                Err(e) => bad = Some(e),
            }
            ControlFlow::Break(())
        },
    )?;
    if let Some(e) = bad {
        return Err(e.into());
    }
    found.map(Some).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no reference to inode {ino} in subvolume {tree}"),
        )
    })
}
