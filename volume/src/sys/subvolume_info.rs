//! What is known of one subvolume, below both the subvolume API
//! ([`super::subvolume`]) and what it calls (its backends, `native` or
//! `btrfsutil`, and [`super::inode`]), which all take these: the inode
//! number of every subvolume root, GET_SUBVOL_INFO, and [`Nested`], where
//! a nested subvolume sits.

use std::ffi::OsString;
use std::io;
use std::os::fd::BorrowedFd;

use super::ioctl::{BTRFS_IOCTL_MAGIC, ensure_btrfs};

/// Inode number of every subvolume root (`BTRFS_FIRST_FREE_OBJECTID`).
pub const SUBVOLUME_ROOT_INO: u64 = 256;

/// A subvolume nested below another, located by numbers alone: which
/// subvolume's directory holds it, and under which name. A package can
/// nest subvolumes as deep and under names as long as it likes, beyond
/// any path a system call takes; these numbers reach them all
/// ([`super::inode::open_subvolume`], `open_tree_dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nested {
    /// Its tree id.
    pub id: u64,
    /// The tree id of the subvolume holding it (the listed one, or another
    /// nested one).
    pub parent: u64,
    /// The inode number, in `parent`, of the directory holding it.
    pub dirid: u64,
    /// Its name in that directory: one component, raw bytes.
    pub name: OsString,
    /// Levels below the listed subvolume: 1 for its own children.
    pub depth: usize,
}

/// What the kernel records of one subvolume (BTRFS_IOC_GET_SUBVOL_INFO).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubvolumeInfo {
    /// The subvolume's tree id (5 for the top level).
    pub id: u64,
    /// Its own UUID, drawn at creation: unique among every subvolume the
    /// filesystem ever held, so it names this one subvolume for good.
    pub uuid: [u8; 16],
    /// The UUID of the subvolume it is a snapshot of; zero if none.
    pub parent_uuid: [u8; 16],
    /// Whether it is read-only.
    pub read_only: bool,
    /// The transaction that created it (`otransid`): every change made
    /// after it was created is in this transaction or a later one.
    pub created_transid: u64,
}

/// [`SubvolumeInfo`] of the subvolume holding the directory open as `fd`
/// (Linux 4.18+, no privilege needed). ENOTTY off btrfs.
pub fn subvolume_info(fd: BorrowedFd<'_>) -> io::Result<SubvolumeInfo> {
    use rustix::ioctl::{Getter, opcode};
    /// `struct btrfs_ioctl_timespec`, padded as the C compiler pads it.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Timespec {
        sec: u64,
        nsec: u32,
    }
    /// `struct btrfs_ioctl_get_subvol_info_args` from `linux/btrfs.h`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Args {
        treeid: u64,
        name: [u8; 256],
        parent_id: u64,
        dirid: u64,
        generation: u64,
        flags: u64,
        uuid: [u8; 16],
        parent_uuid: [u8; 16],
        received_uuid: [u8; 16],
        ctransid: u64,
        otransid: u64,
        stransid: u64,
        rtransid: u64,
        times: [Timespec; 4],
        reserved: [u64; 8],
    }
    const _: () = assert!(std::mem::size_of::<Args>() == 504);
    const GET_SUBVOL_INFO: rustix::ioctl::Opcode = opcode::read::<Args>(BTRFS_IOCTL_MAGIC, 60);
    /// `BTRFS_ROOT_SUBVOL_RDONLY` in the root item's flags.
    const ROOT_SUBVOL_RDONLY: u64 = 1;
    ensure_btrfs(fd)?;
    super::fault::check("ioctl GET_SUBVOL_INFO")?;
    // SAFETY: GET_SUBVOL_INFO is _IOR(0x94, 60, struct
    // btrfs_ioctl_get_subvol_info_args) and fills that struct, which Args
    // matches in size and layout.
    let args = unsafe { rustix::ioctl::ioctl(fd, Getter::<GET_SUBVOL_INFO, Args>::new()) }?;
    Ok(SubvolumeInfo {
        id: args.treeid,
        uuid: args.uuid,
        parent_uuid: args.parent_uuid,
        read_only: args.flags & ROOT_SUBVOL_RDONLY != 0,
        created_transid: args.otransid,
    })
}
