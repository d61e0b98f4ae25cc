//! Helpers for the arguments of btrfs ioctls, and the filesystem check that
//! comes before them.

use std::io;
use std::os::fd::BorrowedFd;

use rustix::io::Errno;

use super::fs::is_btrfs;

/// `BTRFS_IOCTL_MAGIC`: the type byte of every btrfs ioctl number.
pub(super) const BTRFS_IOCTL_MAGIC: u8 = 0x94;

/// Fails with ENOTTY unless `fd` lives on btrfs.
///
/// Ioctl numbers are only unique per driver: another filesystem may give
/// a btrfs number a meaning of its own (0x94 is also the type byte of the
/// generic FICLONE family), and would then act on, or write into, a
/// structure laid out for btrfs. Asking the filesystem type first means a
/// btrfs request only ever reaches btrfs. ENOTTY is what the kernel itself
/// answers for an ioctl a filesystem does not know, so callers treat both
/// alike.
pub(super) fn ensure_btrfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    if is_btrfs(fd)? {
        Ok(())
    } else {
        Err(Errno::NOTTY.into())
    }
}

/// An `InvalidData` error for a kernel reply that does not parse: no OS
/// error number fits, and a reply that breaks its own layout must stop the
/// caller rather than be half-read.
pub(super) fn malformed(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed btrfs ioctl reply: {what}"),
    )
}

/// The argument of a btrfs ioctl that is a fixed header followed by a
/// buffer the header sizes (TREE_SEARCH_V2, SPACE_INFO): one 8-byte aligned
/// allocation of words, with the opcode its header's size gives.
pub(super) struct WordsArg<'a> {
    pub(super) opcode: rustix::ioctl::Opcode,
    pub(super) words: &'a mut [u64],
}

// SAFETY: `words` is writable for its whole length; each caller passes the
// opcode whose header it lays out first, and sizes the buffer after it as
// that header announces, so the kernel writes nothing beyond it.
unsafe impl rustix::ioctl::Ioctl for WordsArg<'_> {
    type Output = ();
    const IS_MUTATING: bool = true;
    fn opcode(&self) -> rustix::ioctl::Opcode {
        self.opcode
    }
    fn as_ptr(&mut self) -> *mut std::ffi::c_void {
        self.words.as_mut_ptr().cast()
    }
    unsafe fn output_from_ptr(
        _: rustix::ioctl::IoctlOutput,
        _: *mut std::ffi::c_void,
    ) -> rustix::io::Result<()> {
        Ok(())
    }
}
