//! A copied file's data checksums made its source's, which btrfs demands of
//! a reflink.
//!
//! btrfs refuses (EINVAL) to clone between two files of which one has data
//! checksums and the other not (BTRFS_INODE_NODATASUM, checked before
//! anything is cloned). A file gets NODATASUM when created on a
//! `nodatasum` (or `nodatacow`) mount, or with NOCOW; FS_IOC_GETFLAGS
//! shows NOCOW but never NODATASUM alone, so a volume written partly under
//! `nodatasum` holds both kinds with nothing but the inode item to tell
//! them apart, and a new file takes whatever the mount says now.
//!
//! Only a file with no data yet can change either flag, and a refused
//! clone clones nothing: so the copy clones first, and only when the first
//! clone into an empty file is refused does it read the source's inode
//! item and change the new file, then clone once more. Free for the files
//! whose states agree, which is all of them on a volume never mounted
//! otherwise. (A file with no data has nothing to clone, and keeps the
//! state the mount gives it.) What the kernel allows on an empty regular
//! file:
//! - a checksummed source: NOCOW set then cleared clears NODATACOW and
//!   NODATASUM together, whatever the mount, so the copy has checksums
//!   even on a `nodatasum` mount;
//! - a source without checksums that is copied on write (written under
//!   `nodatasum`), on a mount that checksums new files: no call sets
//!   NODATASUM alone, only NOCOW sets it (with NODATACOW). The copy gets
//!   NOCOW, the one state btrfs shares those extents with: its data is the
//!   source's, and as unchecksummed, but later writes go in place and
//!   uncompressed ([`super::CopyStats::nodatasum_nocow`] counts them).
//!
//! A clone still refused after that, or a new file whose flags cannot be
//! changed, is [`Unclonable`]: a resumed copy meets the same refusal, so
//! callers discard the copy rather than keep it for one.

use std::fmt;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

use super::CopyStats;
use crate::failpoint::failpoint;
use crate::sys::{self, InodeFlags, inode_flags, set_inode_flags};

/// A file the copy cannot reflink, whatever a later run does: the payload
/// of the copy's error for it (see [`is_unclonable`]).
#[derive(Debug)]
pub struct Unclonable {
    /// Its path from the top of the copy.
    pub path: PathBuf,
    /// Why, in a few words.
    pub why: String,
}

impl fmt::Display for Unclonable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} cannot be reflinked: {}",
            crate::walk::printable(&self.path),
            self.why
        )
    }
}

impl std::error::Error for Unclonable {}

/// Whether `e` is a copy's [`Unclonable`]: final, a resumed copy meets it
/// again, so a partial copy left by it is worth nothing.
pub fn is_unclonable(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Unclonable>())
}

fn unclonable(path: &Path, why: String) -> io::Error {
    io::Error::other(Unclonable {
        path: path.to_owned(),
        why,
    })
}

/// Clones `len` bytes (`None`: the whole file, FICLONE) of `src` at `off`
/// into `dst` at the same offset, matching `dst`'s data checksums to
/// `src`'s first if btrfs refuses the clone for them (only at offset 0 of
/// a file with no data: the copy's only clone there is into an empty
/// file). `rel`: the file's path from the top of the copy, for errors.
pub(super) fn clone_range(
    dst: BorrowedFd<'_>,
    src: BorrowedFd<'_>,
    off: u64,
    len: Option<u64>,
    rel: &Path,
    stats: &mut CopyStats,
) -> io::Result<()> {
    let clone = || match len {
        None => sys::ficlone(dst, src),
        Some(len) => sys::ficlone_range(dst, src, off, len),
    };
    let refused = match clone() {
        Err(e) if off == 0 && e.raw_os_error() == Some(libc::EINVAL) => e,
        done => return done,
    };
    let size = sys::stat(src)?.size;
    if sys::stat(dst)?.size != 0 || !match_source(src, dst, rel, stats)? {
        return Err(refused);
    }
    match clone() {
        // A source cut short since its stat refuses a range past its end:
        // a resumed copy takes it as it is then.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && sys::stat(src)?.size == size => {
            Err(unclonable(
                rel,
                format!(
                    "btrfs refused the reflink ({e}) even with the copy's data checksums made the source's"
                ),
            ))
        }
        done => done,
    }
}

/// Gives the empty file `dst` the data checksums of `src` (by its inode
/// item, committed first if too new to be in the tree), if they can
/// differ; `false` if the refusal is not theirs (a NOCOW source: the copy
/// made `dst` NOCOW before any clone).
fn match_source(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    rel: &Path,
    stats: &mut CopyStats,
) -> io::Result<bool> {
    let item = match sys::inode_item(src)? {
        Some(item) => Some(item),
        None => {
            sys::commit_metadata(src)?;
            sys::inode_item(src)?
        }
    };
    let Some(item) = item else {
        return Ok(false);
    };
    if item.nodatacow() {
        return Ok(false);
    }
    let flags = inode_flags(dst)?;
    let changed = failpoint("copy.checksums").and_then(|()| {
        set_inode_flags(dst, flags | InodeFlags::NOCOW)?;
        if !item.nodatasum() {
            // Clearing NOCOW on an empty file clears NODATASUM with it.
            set_inode_flags(dst, flags.difference(InodeFlags::NOCOW))?;
        }
        Ok(())
    });
    if let Err(e) = changed {
        // Only a refusal is final: space, I/O or memory may be back next run.
        let refusal = [libc::EPERM, libc::EACCES, libc::EOPNOTSUPP, libc::EINVAL];
        if !e.raw_os_error().is_some_and(|n| refusal.contains(&n)) {
            return Err(e);
        }
        let state = match item.nodatasum() {
            true => {
                "the source has no data checksums (written under nodatasum) and the copy's \
                     file could not be made NOCOW, the one way to have none on this mount"
            }
            false => {
                "the source has data checksums and the copy's file, created without \
                      (a nodatasum mount), could not be given them"
            }
        };
        return Err(unclonable(
            rel,
            format!("{state} ({e}); btrfs reflinks only between files alike in data checksums"),
        ));
    }
    if item.nodatasum() {
        stats.nodatasum_nocow += 1;
        stats.nocow_files += 1;
    }
    Ok(true)
}
