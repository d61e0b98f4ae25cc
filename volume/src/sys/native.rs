//! The default backend of [`super::subvolume`]: btrfs's own ioctls,
//! through rustix, with argument structs laid out here after
//! `linux/btrfs.h` (each checked by size at compile time). Needs no C
//! toolchain to build and no C library to run.
//!
//! Every function first checks that its fd lives on btrfs
//! ([`ensure_btrfs`]), so a request laid out for btrfs never reaches a
//! filesystem that may read the same ioctl number differently.
//!
//! Nested subvolumes are found in the root tree (tree 1) with
//! TREE_SEARCH_V2 (its ROOT_REF items: child id, directory, name), rather
//! than with the unprivileged GET_SUBVOL_ROOTREF: the crate already needs
//! CAP_SYS_ADMIN for its own tree searches (usage, extents), and one
//! search returns every reference of a subvolume where GET_SUBVOL_ROOTREF
//! pages by 255. They are then reached by number ([`super::inode`]), never
//! by a path through a package's directories, which may be longer than
//! INO_LOOKUP's 4,080 bytes, covered by a mount, or renamed meanwhile.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::fs::AtFlags;
use rustix::io::Errno;
use rustix::ioctl::{Getter, NoArg, Opcode, Setter, Updater, opcode};

use super::flags::{clear_stuck_flags, with_own_stuck_flags_lifted};
use super::fs::{open_dir_at, stat};
use super::inode::{open_subvolume, open_tree_dir};
use super::ioctl::{BTRFS_IOCTL_MAGIC, ensure_btrfs, malformed};
use super::item::{ROOT_REF_KEY, RootRef};
use super::qgroup::QgroupInherit;
use super::search::{ItemKey, KeyRange, Searcher};
use super::subvolume_info::{Nested, SUBVOLUME_ROOT_INO};

/// `BTRFS_SUBVOL_NAME_MAX`: the name field of the v2 volume args holds this
/// many bytes and a NUL.
const SUBVOL_NAME_MAX: usize = 4039;
/// `BTRFS_NAME_LEN`: the longest name a btrfs directory entry can have.
const NAME_LEN: usize = 255;
/// `BTRFS_SUBVOL_RDONLY`, in the v2 args' flags and in SUBVOL_GETFLAGS.
const SUBVOL_RDONLY: u64 = 1 << 1;
/// `BTRFS_SUBVOL_QGROUP_INHERIT`: the args carry a qgroup inherit.
const SUBVOL_QGROUP_INHERIT: u64 = 1 << 2;
/// `BTRFS_ROOT_TREE_OBJECTID`: the tree of trees.
const ROOT_TREE: u64 = 1;
/// `BTRFS_INO_LOOKUP_PATH_MAX`.
const INO_LOOKUP_PATH_MAX: usize = 4080;

/// `struct btrfs_ioctl_vol_args_v2`: `fd`, `transid`, `flags`, the
/// qgroup-inherit union (`size` and `qgroup_inherit`, a pointer, in its
/// first two words, set with BTRFS_SUBVOL_QGROUP_INHERIT; zero otherwise),
/// then the union of `name` (NUL-terminated) and `subvolid` (unused here).
#[repr(C)]
#[derive(Clone, Copy)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; SUBVOL_NAME_MAX + 1],
}
const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);
const _: () = assert!(std::mem::align_of::<VolArgsV2>() == 8);

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
#[derive(Clone, Copy)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; INO_LOOKUP_PATH_MAX],
}
const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);

const SYNC: Opcode = opcode::none(BTRFS_IOCTL_MAGIC, 8);
const INO_LOOKUP: Opcode = opcode::read_write::<InoLookupArgs>(BTRFS_IOCTL_MAGIC, 18);
const SNAP_CREATE_V2: Opcode = opcode::write::<VolArgsV2>(BTRFS_IOCTL_MAGIC, 23);
const START_SYNC: Opcode = opcode::read::<u64>(BTRFS_IOCTL_MAGIC, 24);
const SUBVOL_CREATE_V2: Opcode = opcode::write::<VolArgsV2>(BTRFS_IOCTL_MAGIC, 24);
const SUBVOL_GETFLAGS: Opcode = opcode::read::<u64>(BTRFS_IOCTL_MAGIC, 25);
const SUBVOL_SETFLAGS: Opcode = opcode::write::<u64>(BTRFS_IOCTL_MAGIC, 26);
const SNAP_DESTROY_V2: Opcode = opcode::write::<VolArgsV2>(BTRFS_IOCTL_MAGIC, 63);

impl VolArgsV2 {
    fn zeroed() -> Self {
        VolArgsV2 {
            fd: 0,
            transid: 0,
            flags: 0,
            unused: [0; 4],
            name: [0; SUBVOL_NAME_MAX + 1],
        }
    }

    /// Args naming the new or doomed entry `name`: one path component.
    /// The kernel checks names too, but only a NUL-terminated copy can be
    /// handed over, so a NUL (which would cut the name short) or a `/`
    /// (which the kernel refuses with EINVAL anyway) is refused here.
    fn named(name: &OsStr) -> io::Result<Self> {
        let bytes = name.as_bytes();
        if bytes.is_empty()
            || bytes == b"."
            || bytes == b".."
            || bytes.iter().any(|b| *b == 0 || *b == b'/')
        {
            return Err(Errno::INVAL.into());
        }
        if bytes.len() > NAME_LEN {
            return Err(Errno::NAMETOOLONG.into());
        }
        let mut args = VolArgsV2::zeroed();
        args.name[..bytes.len()].copy_from_slice(bytes);
        Ok(args)
    }

    /// Points the args at `words`, a laid-out `struct
    /// btrfs_qgroup_inherit` ([`QgroupInherit::to_words`]), which must
    /// outlive the ioctl.
    fn inheriting(&mut self, words: &[u64]) {
        self.flags |= SUBVOL_QGROUP_INHERIT;
        self.unused[0] = (words.len() * 8) as u64;
        self.unused[1] = words.as_ptr() as u64;
    }
}

/// Issues one of the `_IOW` volume-args ioctls on `fd`.
fn vol_ioctl<const OPCODE: Opcode>(fd: BorrowedFd<'_>, args: VolArgsV2) -> io::Result<()> {
    // Named apart in the trace when it carries a qgroup inherit.
    super::fault::check(match args.flags & SUBVOL_QGROUP_INHERIT {
        0 => "btrfs volume ioctl",
        _ => "btrfs volume ioctl with qgroup inherit",
    })?;
    // SAFETY: every OPCODE passed is an _IOW btrfs ioctl taking a `struct
    // btrfs_ioctl_vol_args_v2`, which VolArgsV2 matches in size and layout
    // (checked above); the kernel only reads it, and the inherit its
    // pointer may name, which the caller keeps alive across the call.
    unsafe { rustix::ioctl::ioctl(fd, Setter::<OPCODE, VolArgsV2>::new(args)) }?;
    Ok(())
}

pub(super) fn create_subvolume(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    ensure_btrfs(parent)?;
    let mut args = VolArgsV2::named(name)?;
    let words = inherit.map(QgroupInherit::to_words).transpose()?;
    if let Some(words) = &words {
        args.inheriting(words);
    }
    vol_ioctl::<SUBVOL_CREATE_V2>(parent, args)
}

pub(super) fn create_snapshot(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    read_only: bool,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    ensure_btrfs(parent)?;
    ensure_btrfs(source)?;
    let mut args = VolArgsV2::named(name)?;
    args.fd = i64::from(source.as_raw_fd());
    if read_only {
        args.flags = SUBVOL_RDONLY;
    }
    let words = inherit.map(QgroupInherit::to_words).transpose()?;
    if let Some(words) = &words {
        args.inheriting(words);
    }
    vol_ioctl::<SNAP_CREATE_V2>(parent, args)
}

/// Snapshots `source` as `name` in `parent`, then each subvolume nested in
/// `source`, parents before children, into the empty placeholder directory
/// the snapshot above it holds for it (removed first). Every snapshot is
/// writable, so that those nested below it can be placed.
///
/// Nothing is reached by path: each nested subvolume is opened by its id,
/// and the directory of the copy holding its placeholder by its inode
/// number (a snapshot keeps every inode number), so a package's deep or
/// long paths, mounts over them, or renames while this runs, change
/// nothing of what is copied.
pub(super) fn snapshot_recursive(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: Option<&QgroupInherit>,
) -> io::Result<()> {
    // The snapshot ioctl takes whatever subvolume holds its fd: refuse a
    // source that is not a subvolume root before anything is created.
    let st = stat(source)?;
    if st.ino != SUBVOLUME_ROOT_INO || !st.is_dir() {
        return Err(Errno::INVAL.into());
    }
    create_snapshot(source, parent, name, false, inherit)?;
    // Listed once the top is taken, as libbtrfsutil does: a subvolume
    // nested since then has no placeholder in the copy, and its rmdir
    // below fails rather than the copy silently lacking it.
    let nested = nested_pre_order(source)?;
    if nested.is_empty() {
        return Ok(());
    }
    let copy = open_dir_at(parent, name)?;
    // Each source subvolume's copy, by tree id.
    let mut copies = HashMap::from([(subvolume_id(source)?, subvolume_id(copy.as_fd())?)]);
    for n in &nested {
        let Some(&holder_tree) = copies.get(&n.parent) else {
            return Err(malformed("a nested subvolume listed before its parent"));
        };
        let holder = open_tree_dir(copy.as_fd(), holder_tree, n.dirid)?;
        let src = open_subvolume(source, n.id)?;
        // An immutable or append-only holder (the package's, copied with
        // it) forbids replacing its placeholder: lifted for that, in the
        // copy only.
        with_own_stuck_flags_lifted(holder.as_fd(), || {
            super::fault::check("unlinkat")?;
            rustix::fs::unlinkat(holder.as_fd(), &n.name, AtFlags::REMOVEDIR)?;
            create_snapshot(src.as_fd(), holder.as_fd(), &n.name, false, None)
        })?;
        let placed = open_dir_at(holder.as_fd(), &n.name)?;
        copies.insert(n.id, subvolume_id(placed.as_fd())?);
    }
    Ok(())
}

pub(super) fn is_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(subvol_flags(fd)? & SUBVOL_RDONLY != 0)
}

fn subvol_flags(fd: BorrowedFd<'_>) -> io::Result<u64> {
    ensure_btrfs(fd)?;
    super::fault::check("ioctl SUBVOL_GETFLAGS")?;
    // SAFETY: SUBVOL_GETFLAGS is _IOR(0x94, 25, __u64) and writes one u64.
    Ok(unsafe { rustix::ioctl::ioctl(fd, Getter::<SUBVOL_GETFLAGS, u64>::new()) }?)
}

pub(super) fn set_read_only(fd: BorrowedFd<'_>, read_only: bool) -> io::Result<()> {
    let flags = subvol_flags(fd)?;
    let flags = if read_only {
        flags | SUBVOL_RDONLY
    } else {
        flags & !SUBVOL_RDONLY
    };
    super::fault::check("ioctl SUBVOL_SETFLAGS")?;
    // SAFETY: SUBVOL_SETFLAGS is _IOW(0x94, 26, __u64) and reads one u64.
    unsafe { rustix::ioctl::ioctl(fd, Setter::<SUBVOL_SETFLAGS, u64>::new(flags)) }?;
    Ok(())
}

pub(super) fn nested_subvolumes(fd: BorrowedFd<'_>) -> io::Result<Vec<Nested>> {
    nested_pre_order(fd)
}

/// Deletes `name` in `parent` and, with `recursive`, the subvolumes nested
/// in it first, children before parents. Each nested one goes by the name
/// its root reference gives it, in the directory that reference names,
/// opened by number ([`open_tree_dir`]): the kernel then removes exactly
/// the subvolume the listing found, with no path walked through
/// directories a package controls. (Not BTRFS_SUBVOL_SPEC_BY_ID: the
/// kernel builds the subvolume's full path for it, and fails with
/// ENAMETOOLONG past PATH_MAX.) The top goes by the name the caller holds.
pub(super) fn delete_subvolume(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    recursive: bool,
) -> io::Result<()> {
    ensure_btrfs(parent)?;
    let args = VolArgsV2::named(name)?;
    if recursive {
        let top = open_dir_at(parent, name)?;
        // A plain directory has nothing nested; the kernel refuses to
        // delete it below, with its own error.
        if stat(top.as_fd())?.ino == SUBVOLUME_ROOT_INO {
            for n in nested_pre_order(top.as_fd())?.iter().rev() {
                let holder = open_tree_dir(top.as_fd(), n.parent, n.dirid)?;
                // An immutable or append-only holder forbids the unlink
                // (callers clear the subvolumes' own flags, see
                // `make_tree_writable`); the tree is going, so the flags
                // need not come back.
                clear_stuck_flags(holder.as_fd())?;
                destroy(holder.as_fd(), VolArgsV2::named(&n.name)?)?;
            }
        }
    }
    destroy(parent, args)
}

/// SNAP_DESTROY_V2 (Linux 5.7) of the entry `args` names in `parent`, a
/// directory on btrfs: there ENOTTY only ever means a kernel without the
/// ioctl, which gets a line naming the version needed instead of a bare
/// "Inappropriate ioctl for device".
fn destroy(parent: BorrowedFd<'_>, args: VolArgsV2) -> io::Result<()> {
    vol_ioctl::<SNAP_DESTROY_V2>(parent, args).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTTY) => super::fs::needs_kernel("btrfs's SNAP_DESTROY_V2 ioctl", "5.7"),
        _ => e,
    })
}

pub(super) fn commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    ensure_btrfs(fd)?;
    super::fault::check("ioctl SYNC")?;
    // SAFETY: SYNC is _IO(0x94, 8) and takes no argument.
    unsafe { rustix::ioctl::ioctl(fd, NoArg::<SYNC>::new()) }?;
    Ok(())
}

pub(super) fn start_commit(fd: BorrowedFd<'_>) -> io::Result<u64> {
    ensure_btrfs(fd)?;
    super::fault::check("ioctl START_SYNC")?;
    ask_commit(fd)
}

/// START_SYNC again for a start already asked for and counted: no call of
/// the caller's for the I/O-error sweep (it changes nothing on disk that
/// the first would not).
pub(super) fn ask_commit(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: START_SYNC is _IOR(0x94, 24, __u64) and writes the transid.
    Ok(unsafe { rustix::ioctl::ioctl(fd, Getter::<START_SYNC, u64>::new()) }?)
}

/// INO_LOOKUP of inode `objectid` in tree `treeid` (0: `fd`'s own), as the
/// kernel fills it.
fn ino_lookup(fd: BorrowedFd<'_>, treeid: u64, objectid: u64) -> io::Result<InoLookupArgs> {
    let mut args = InoLookupArgs {
        treeid,
        objectid,
        name: [0; INO_LOOKUP_PATH_MAX],
    };
    super::fault::check("ioctl INO_LOOKUP")?;
    // SAFETY: INO_LOOKUP is _IOWR(0x94, 18, struct
    // btrfs_ioctl_ino_lookup_args), which InoLookupArgs matches in size and
    // layout; the kernel reads the two ids and writes the ids and the path.
    unsafe { rustix::ioctl::ioctl(fd, Updater::<INO_LOOKUP, InoLookupArgs>::new(&mut args)) }?;
    Ok(args)
}

/// The id of the subvolume holding `fd`. Unprivileged: INO_LOOKUP of the
/// subvolume's root inode only reports the tree id.
fn subvolume_id(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(ino_lookup(fd, 0, SUBVOLUME_ROOT_INO)?.treeid)
}

/// The ROOT_REF items of subvolume `parent`: the subvolumes linked into its
/// directories, in id order.
fn root_refs(searcher: &mut Searcher, fd: BorrowedFd<'_>, parent: u64) -> io::Result<Vec<RootRef>> {
    let mut refs = Vec::new();
    let mut bad = None;
    searcher.search_tree(
        fd,
        ROOT_TREE,
        KeyRange {
            min: ItemKey {
                objectid: parent,
                item_type: ROOT_REF_KEY,
                offset: 0,
            },
            max: ItemKey {
                objectid: parent,
                item_type: ROOT_REF_KEY,
                offset: u64::MAX,
            },
        },
        |key, body| {
            // The range bounds all three fields, so nothing else comes
            // back; checked all the same, as everything the kernel returns.
            if key.objectid != parent || key.item_type != ROOT_REF_KEY {
                return ControlFlow::Continue(());
            }
            match RootRef::parse(key.offset, body) {
                Ok(r) => {
                    refs.push(r);
                    ControlFlow::Continue(())
                }
                Err(e) => {
                    bad = Some(e);
                    ControlFlow::Break(())
                }
            }
        },
    )?;
    match bad {
        Some(e) => Err(e.into()),
        None => Ok(refs),
    }
}

/// Every subvolume nested below the subvolume whose root directory is open
/// as `fd`, parents first, siblings in id order: the order in which a
/// recursive snapshot recreates them, so the copies' ids keep their
/// sources' order (and their listing, the sources'). From the root tree's
/// ROOT_REF items alone: no path is built, so a package can nest them as
/// deep, and under names as long, as it likes.
fn nested_pre_order(fd: BorrowedFd<'_>) -> io::Result<Vec<Nested>> {
    ensure_btrfs(fd)?;
    let st = stat(fd)?;
    if st.ino != SUBVOLUME_ROOT_INO || !st.is_dir() {
        return Err(Errno::INVAL.into());
    }
    let top = subvolume_id(fd)?;
    let mut searcher = Searcher::default();
    let mut seen = HashSet::from([top]);
    // Depth first with an explicit stack, as a package can nest
    // subvolumes as deep as it likes: each is listed when popped, then
    // its children pushed last first, so they pop next, in id order.
    let mut stack = Vec::new();
    push_children(&mut searcher, fd, top, 0, &mut seen, &mut stack)?;
    let mut out = Vec::new();
    while let Some(n) = stack.pop() {
        push_children(&mut searcher, fd, n.id, n.depth, &mut seen, &mut stack)?;
        out.push(n);
    }
    Ok(out)
}

/// Pushes the subvolumes linked into subvolume `parent` (at `depth`) onto
/// `stack`, highest id first.
fn push_children(
    searcher: &mut Searcher,
    fd: BorrowedFd<'_>,
    parent: u64,
    depth: usize,
    seen: &mut HashSet<u64>,
    stack: &mut Vec<Nested>,
) -> io::Result<()> {
    for r in root_refs(searcher, fd, parent)?.into_iter().rev() {
        // The subvolumes form a tree; a repeat would loop forever.
        if !seen.insert(r.child) {
            return Err(malformed("a subvolume referenced twice"));
        }
        stack.push(Nested {
            id: r.child,
            parent,
            dirid: r.dirid,
            name: OsString::from_vec(r.name),
            depth: depth + 1,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_before_the_ioctl() {
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            let err = VolArgsV2::named(OsStr::new(bad)).err().expect("refused");
            assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        }
        let long = "x".repeat(256);
        let err = VolArgsV2::named(OsStr::new(&long)).err().expect("refused");
        assert_eq!(err.raw_os_error(), Some(libc::ENAMETOOLONG));
        let ok = VolArgsV2::named(OsStr::new("vol")).expect("fits");
        assert_eq!(&ok.name[..4], b"vol\0");
    }
}
