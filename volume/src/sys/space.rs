//! How much new metadata a btrfs filesystem can take, from the figures
//! its allocator keeps: BTRFS_IOC_SPACE_INFO for the block groups,
//! BTRFS_IOC_FS_INFO and BTRFS_IOC_DEV_INFO for the raw space not yet
//! allocated to any. statvfs cannot tell: it reports data space.

use std::io;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{Opcode, Updater, opcode};

use super::ioctl::{BTRFS_IOCTL_MAGIC, WordsArg, ensure_btrfs};

const BLOCK_GROUP_METADATA: u64 = 1 << 2;
const BLOCK_GROUP_RAID1: u64 = 1 << 4;
const BLOCK_GROUP_DUP: u64 = 1 << 5;
const BLOCK_GROUP_RAID10: u64 = 1 << 6;
const BLOCK_GROUP_RAID5: u64 = 1 << 7;
const BLOCK_GROUP_RAID6: u64 = 1 << 8;
const BLOCK_GROUP_RAID1C3: u64 = 1 << 9;
const BLOCK_GROUP_RAID1C4: u64 = 1 << 10;
const SPACE_INFO_GLOBAL_RSV: u64 = 1 << 49;

/// Metadata space of a filesystem, in logical bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataSpace {
    /// Bytes in metadata block groups (mixed ones included).
    pub total: u64,
    /// Of which used.
    pub used: u64,
    /// The global reserve, held back from metadata for the
    /// filesystem's own use: not available to new items.
    pub global_reserve: u64,
    /// Raw device bytes allocated to no block group yet, summed over
    /// devices.
    pub unallocated: u64,
    /// Raw bytes of every device, summed: the filesystem's size.
    pub device_bytes: u64,
    /// Raw bytes one metadata byte takes (2 for DUP and RAID1, ...;
    /// rounded up for RAID5 and RAID6).
    pub copies: u64,
    /// Bytes of one tree node (leaf): what copying one on write costs.
    pub node_size: u64,
}

impl MetadataSpace {
    /// New metadata the filesystem can take: what is free in its
    /// metadata block groups beyond the global reserve, plus what new
    /// metadata block groups could hold in the unallocated space. An
    /// upper bound where devices differ in size (mirrored copies must
    /// land on different devices) or data chunks claim the unallocated
    /// space first; exact on one device.
    pub fn free(&self) -> u64 {
        self.total
            .saturating_sub(self.used)
            .saturating_sub(self.global_reserve)
            .saturating_add(self.unallocated / self.copies.max(1))
    }
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct SpaceInfo {
    flags: u64,
    total_bytes: u64,
    used_bytes: u64,
}

// `struct btrfs_ioctl_space_info`: flags, total_bytes, used_bytes.
const _: () = assert!(std::mem::size_of::<SpaceInfo>() == 24);

/// BTRFS_IOC_SPACE_INFO: its argument is `struct btrfs_ioctl_space_args`
/// (space_slots, total_spaces) followed by `space_slots` entries.
const SPACE_INFO: Opcode = opcode::read_write::<[u64; 2]>(BTRFS_IOCTL_MAGIC, 20);

fn space_infos(fd: BorrowedFd<'_>) -> io::Result<Vec<SpaceInfo>> {
    const WORDS: usize = std::mem::size_of::<SpaceInfo>() / 8;
    // Asked with no slots, the kernel says how many there are; a block
    // group type may appear in between, so ask for a few more.
    let mut head = [0u64; 2];
    super::fault::check("ioctl SPACE_INFO")?;
    // SAFETY: zero slots: the kernel only writes the header.
    unsafe {
        rustix::ioctl::ioctl(
            fd,
            WordsArg {
                opcode: SPACE_INFO,
                words: &mut head,
            },
        )?
    };
    let slots = head[1] as usize + 4;
    let mut mem = vec![0u64; 2 + slots * WORDS];
    mem[0] = slots as u64;
    super::fault::check("ioctl SPACE_INFO")?;
    // SAFETY: `mem` holds the header and the `slots` entries it announces.
    unsafe {
        rustix::ioctl::ioctl(
            fd,
            WordsArg {
                opcode: SPACE_INFO,
                words: &mut mem,
            },
        )?
    };
    let filled = (mem[1] as usize).min(slots);
    Ok(mem[2..2 + filled * WORDS]
        .chunks_exact(WORDS)
        .map(|w| SpaceInfo {
            flags: w[0],
            total_bytes: w[1],
            used_bytes: w[2],
        })
        .collect())
}

/// `struct btrfs_ioctl_fs_info_args`: max_id, num_devices, fsid,
/// nodesize, then fields not needed here (`flags`, read by the kernel,
/// left zero).
#[repr(C)]
struct FsInfo {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    nodesize: u32,
    rest: [u8; 1024 - 36],
}

/// `struct btrfs_ioctl_dev_info_args`: devid, uuid, bytes_used,
/// total_bytes, fsid, then the unused words and the path.
#[repr(C)]
struct DevInfo {
    devid: u64,
    uuid: [u8; 16],
    bytes_used: u64,
    total_bytes: u64,
    fsid: [u8; 16],
    rest: [u8; 4096 - 56],
}

const _: () = assert!(std::mem::size_of::<FsInfo>() == 1024);
const _: () = assert!(std::mem::size_of::<DevInfo>() == 4096);

const FS_INFO: Opcode = opcode::read::<FsInfo>(BTRFS_IOCTL_MAGIC, 31);
const DEV_INFO: Opcode = opcode::read_write::<DevInfo>(BTRFS_IOCTL_MAGIC, 30);

/// The filesystem's FS_INFO: device count, fsid, node size.
fn fs_info(fd: BorrowedFd<'_>) -> io::Result<FsInfo> {
    let mut fs = FsInfo {
        max_id: 0,
        num_devices: 0,
        fsid: [0; 16],
        nodesize: 0,
        rest: [0; 1024 - 36],
    };
    super::fault::check("ioctl FS_INFO")?;
    // SAFETY: FS_INFO reads and fills a `struct btrfs_ioctl_fs_info_args`,
    // which FsInfo matches in size and layout; zeroed, as the kernel
    // reads its `flags`.
    unsafe { rustix::ioctl::ioctl(fd, Updater::<FS_INFO, FsInfo>::new(&mut fs))? };
    Ok(fs)
}

/// Raw bytes allocated to no block group, and raw bytes in all, over
/// the devices of the filesystem `fs` describes. A seed device (read-only) has its own fsid
/// and is skipped; kernels before 6.3 leave DEV_INFO's fsid zero, and
/// there every device counts.
fn unallocated(fd: BorrowedFd<'_>, fs: &FsInfo) -> io::Result<(u64, u64)> {
    let (mut free, mut size, mut found) = (0u64, 0u64, 0u64);
    for devid in 1..=fs.max_id {
        if found >= fs.num_devices {
            break;
        }
        let mut dev = DevInfo {
            devid,
            uuid: [0; 16],
            bytes_used: 0,
            total_bytes: 0,
            fsid: [0; 16],
            rest: [0; 4096 - 56],
        };
        super::fault::check("ioctl DEV_INFO")?;
        // SAFETY: DEV_INFO reads and fills a `struct
        // btrfs_ioctl_dev_info_args`, which DevInfo matches in size and
        // layout.
        match unsafe { rustix::ioctl::ioctl(fd, Updater::<DEV_INFO, DevInfo>::new(&mut dev)) } {
            Ok(()) if dev.fsid == fs.fsid || dev.fsid == [0; 16] => {
                found += 1;
                free += dev.total_bytes.saturating_sub(dev.bytes_used);
                size += dev.total_bytes;
            }
            Ok(()) => {}
            // Ids of removed devices leave gaps.
            Err(rustix::io::Errno::NODEV) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((free, size))
}

/// The metadata space of the btrfs filesystem holding `fd`, as of the
/// last commit: what the running transaction has reserved is not taken
/// off, so commit first for a figure that holds. ENOTTY off btrfs.
pub fn metadata_space(fd: BorrowedFd<'_>) -> io::Result<MetadataSpace> {
    ensure_btrfs(fd)?;
    let fs = fs_info(fd)?;
    let (unallocated, device_bytes) = unallocated(fd, &fs)?;
    let mut out = MetadataSpace {
        total: 0,
        used: 0,
        global_reserve: 0,
        unallocated,
        device_bytes,
        copies: 1,
        node_size: u64::from(fs.nodesize),
    };
    for info in space_infos(fd)? {
        if info.flags & SPACE_INFO_GLOBAL_RSV != 0 {
            out.global_reserve = info.total_bytes;
        } else if info.flags & BLOCK_GROUP_METADATA != 0 {
            out.total += info.total_bytes;
            out.used += info.used_bytes;
            let copies = match info.flags {
                f if f & BLOCK_GROUP_RAID1C4 != 0 => 4,
                f if f & (BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID6) != 0 => 3,
                f if f
                    & (BLOCK_GROUP_DUP
                        | BLOCK_GROUP_RAID1
                        | BLOCK_GROUP_RAID10
                        | BLOCK_GROUP_RAID5)
                    != 0 =>
                {
                    2
                }
                _ => 1,
            };
            out.copies = out.copies.max(copies);
        }
    }
    Ok(out)
}
