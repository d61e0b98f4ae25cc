//! Inode flags (chattr): FS_IOC_GETFLAGS / FS_IOC_SETFLAGS and the
//! FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR pair.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use rustix::fs::IFlags;
use rustix::io::Errno;

use super::fs::{FileType, open_read_at, stat, stat_existing_at};
use super::xattr::{get_xattr, remove_xattr, set_xattr};

/// The xattr under which btrfs keeps a file's compression property.
const COMPRESSION_XATTR: &str = "btrfs.compression";

bitflags::bitflags! {
    /// Inode flags (chattr), the `FS_*_FL` bits of FS_IOC_GETFLAGS. Every
    /// bit the kernel reports is kept, named or not (`from_bits_retain`);
    /// the crates act on three.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct InodeFlags: u32 {
        /// `chattr +i`: neither the inode nor, on a directory, its entries
        /// may change.
        const IMMUTABLE = IFlags::IMMUTABLE.bits();
        /// `chattr +a`: a file may only grow; a directory's entries may
        /// only be added.
        const APPEND = IFlags::APPEND.bits();
        /// `chattr +C`: no copy on write (nor checksums, nor compression)
        /// for the file's data, or for files created in the directory.
        const NOCOW = IFlags::NOCOW.bits();
        // Every other bit is the kernel's to define, and kept as it is.
        const _ = !0;
    }
}

/// The inode flags (chattr) of the file or directory open as `fd`
/// (FS_IOC_GETFLAGS), or none where the filesystem has no such notion.
pub fn inode_flags(fd: BorrowedFd<'_>) -> io::Result<InodeFlags> {
    super::fault::check("ioctl_getflags")?;
    match rustix::fs::ioctl_getflags(fd) {
        Ok(f) => Ok(InodeFlags::from_bits_retain(f.bits())),
        Err(Errno::NOTTY | Errno::OPNOTSUPP | Errno::INVAL) => Ok(InodeFlags::empty()),
        Err(e) => Err(e.into()),
    }
}

/// Sets the inode flags (chattr) of `fd` to exactly `flags`.
///
/// FS_IOC_SETFLAGS on btrfs rewrites the compression property from the
/// compression bits it is given (to the mount's default algorithm, or
/// away), so the property is put back as it was; the immutable and
/// append-only flags, which would forbid that, are set last and apart
/// ([`set_immutable_append`]).
pub fn set_inode_flags(fd: BorrowedFd<'_>, flags: InodeFlags) -> io::Result<()> {
    let stuck = InodeFlags::IMMUTABLE | InodeFlags::APPEND;
    let current = inode_flags(fd)?;
    if current.difference(stuck) != flags.difference(stuck) {
        if current.intersects(stuck) {
            set_immutable_append(fd, false, false)?;
        }
        let property = match get_xattr(fd, OsStr::new(COMPRESSION_XATTR)) {
            Ok(v) => Some(v),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENODATA | libc::EOPNOTSUPP)) => None,
            Err(e) => return Err(e),
        };
        super::fault::check("ioctl_setflags")?;
        let rest = IFlags::from_bits_retain(flags.difference(stuck).bits());
        rustix::fs::ioctl_setflags(fd, rest)?;
        match property {
            Some(v) => set_xattr(fd, OsStr::new(COMPRESSION_XATTR), &v)?,
            None => match remove_xattr(fd, OsStr::new(COMPRESSION_XATTR)) {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENODATA | libc::EOPNOTSUPP)) => {}
                Err(e) => return Err(e),
            },
        }
    }
    if current.intersects(stuck) || flags.intersects(stuck) {
        set_immutable_append(
            fd,
            flags.contains(InodeFlags::IMMUTABLE),
            flags.contains(InodeFlags::APPEND),
        )?;
    }
    Ok(())
}

/// Clears the immutable and append-only flags of the file or directory open
/// as `fd`, which forbid changing it (or, on a directory, its entries).
pub fn clear_stuck_flags(fd: BorrowedFd<'_>) -> io::Result<()> {
    if inode_flags(fd)?.intersects(InodeFlags::IMMUTABLE | InodeFlags::APPEND) {
        set_immutable_append(fd, false, false)?;
    }
    Ok(())
}

/// Runs `op`, a change of the directory (or file) open as `fd` or of its
/// entries, with its own immutable and append-only flags, which forbid
/// both, lifted, and puts them back afterwards, whatever `op` returned. A
/// crash in between leaves them off: callers only lift them in trees of
/// their own making (a copy being built) or about to go.
pub(crate) fn with_own_stuck_flags_lifted<T>(
    fd: BorrowedFd<'_>,
    op: impl FnOnce() -> io::Result<T>,
) -> io::Result<T> {
    let flags = inode_flags(fd)?;
    let stuck = InodeFlags::IMMUTABLE | InodeFlags::APPEND;
    if !flags.intersects(stuck) {
        return op();
    }
    set_immutable_append(fd, false, false)?;
    let done = op();
    set_immutable_append(
        fd,
        flags.contains(InodeFlags::IMMUTABLE),
        flags.contains(InodeFlags::APPEND),
    )?;
    done
}

/// Runs `op`, a rename, link or unlink of the entry `name` of `dir`, with
/// the entry's immutable and append-only flags, which forbid all three,
/// lifted; puts them back afterwards, whatever `op` returned, if the inode
/// still has a name (an unlink may have removed its last). A crash in
/// between leaves them off. Only a regular file or a directory is opened
/// (O_NONBLOCK, in case it was swapped for a FIFO since the stat); any other
/// entry, or one without those flags, just gets `op`. `name` may hold
/// several components, resolved from `dir` (see [`stat_at`](super::stat_at)).
pub fn with_stuck_flags_lifted(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    op: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    let st = stat_existing_at(dir, name)?;
    if !matches!(st.file_type, FileType::RegularFile | FileType::Directory) {
        return op();
    }
    let fd = open_read_at(dir, name)?;
    let flags = inode_flags(fd.as_fd())?;
    if !flags.intersects(InodeFlags::IMMUTABLE | InodeFlags::APPEND) {
        return op();
    }
    clear_stuck_flags(fd.as_fd())?;
    let done = op();
    if stat(fd.as_fd())?.nlink > 0 {
        set_inode_flags(fd.as_fd(), flags)?;
    }
    done
}

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
    super::fault::check("ioctl FS_IOC_FSGETXATTR")?;
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
        super::fault::check("ioctl FS_IOC_FSSETXATTR")?;
        // SAFETY: FS_IOC_FSSETXATTR is _IOW('X', 32, struct fsxattr) and reads
        // that struct, as FS_IOC_FSGETXATTR filled it but for the flags.
        unsafe { rustix::ioctl::ioctl(fd, Setter::<SET, FsXattr>::new(attr)) }?;
    }
    Ok(())
}
