//! Inode flags (chattr): FS_IOC_GETFLAGS / FS_IOC_SETFLAGS and the
//! FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR pair.

use std::io;
use std::os::fd::BorrowedFd;

/// Sets or clears the immutable and append-only flags of the file or
/// directory open as `fd`, leaving every other attribute alone, through
/// FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR. Unlike FS_IOC_SETFLAGS, which on
/// btrfs rewrites the `btrfs.compression` property from the compression
/// bits it is given, this changes nothing else.
pub fn set_immutable_append(fd: BorrowedFd<'_>, immutable: bool, append: bool) -> io::Result<()> {
    use rustix::ioctl::{Getter, Setter, opcode};
    /// `struct fsxattr` from `linux/fs.h`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct FsXattr {
        xflags: u32,
        extsize: u32,
        nextents: u32,
        projid: u32,
        cowextsize: u32,
        pad: [u8; 8],
    }
    const _: () = assert!(std::mem::size_of::<FsXattr>() == 28);
    const GET: rustix::ioctl::Opcode = opcode::read::<FsXattr>(b'X', 31);
    const SET: rustix::ioctl::Opcode = opcode::write::<FsXattr>(b'X', 32);
    const IMMUTABLE: u32 = 0x8;
    const APPEND: u32 = 0x10;
    // SAFETY: FS_IOC_FSGETXATTR is _IOR('X', 31, struct fsxattr) and fills
    // that struct, which FsXattr matches in size and layout.
    let mut attr = unsafe { rustix::ioctl::ioctl(fd, Getter::<GET, FsXattr>::new()) }?;
    let mut xflags = attr.xflags & !(IMMUTABLE | APPEND);
    if immutable {
        xflags |= IMMUTABLE;
    }
    if append {
        xflags |= APPEND;
    }
    if xflags != attr.xflags {
        attr.xflags = xflags;
        // SAFETY: FS_IOC_FSSETXATTR is _IOW('X', 32, struct fsxattr) and reads
        // that struct, as FS_IOC_FSGETXATTR filled it but for the flags.
        unsafe { rustix::ioctl::ioctl(fd, Setter::<SET, FsXattr>::new(attr)) }?;
    }
    Ok(())
}
