//! Reflinks: sharing a file's extents with another (FICLONE,
//! FICLONERANGE), generic VFS ioctls that btrfs, XFS and others implement.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Shares all of `src`'s extents with `dst` (FICLONE), a reflink copy.
pub(crate) fn ficlone(dst: BorrowedFd<'_>, src: BorrowedFd<'_>) -> io::Result<()> {
    super::fault::check("ioctl_ficlone")?;
    Ok(rustix::fs::ioctl_ficlone(dst, src)?)
}

/// Shares `len` bytes of `src` at `offset` with `dst` at the same offset
/// (FICLONERANGE), a reflink of one range. `offset` must be a multiple of the
/// filesystem block size, and so must `len` unless the range ends at `src`'s
/// end of file. Cost is O(extents in the range), so a caller cloning a huge
/// file in chunks can stop and resume between them.
pub fn ficlone_range(
    dst: BorrowedFd<'_>,
    src: BorrowedFd<'_>,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    use rustix::ioctl::{Setter, opcode};
    /// `struct file_clone_range` from `linux/fs.h`.
    #[repr(C)]
    struct FileCloneRange {
        src_fd: i64,
        src_offset: u64,
        src_length: u64,
        dest_offset: u64,
    }
    const _: () = assert!(std::mem::size_of::<FileCloneRange>() == 32);
    const FICLONERANGE: rustix::ioctl::Opcode = opcode::write::<FileCloneRange>(0x94, 13);
    let arg = FileCloneRange {
        src_fd: i64::from(src.as_raw_fd()),
        src_offset: offset,
        src_length: len,
        dest_offset: offset,
    };
    super::fault::check("ioctl FICLONERANGE")?;
    // SAFETY: FICLONERANGE is _IOW(0x94, 13, struct file_clone_range) and
    // takes a pointer to that struct, which Setter passes.
    unsafe { rustix::ioctl::ioctl(dst, Setter::<FICLONERANGE, FileCloneRange>::new(arg)) }?;
    Ok(())
}
