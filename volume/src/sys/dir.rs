//! Reading a directory a bounded batch at a time, from a position that
//! outlives the descriptor it was read through.

use std::ffi::OsString;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStringExt;

use super::FileType;

/// Names of a directory as it lists them: raw bytes, type, inode number.
pub type DirNames = Vec<(OsString, FileType, u64)>;

/// Where a [`read_dir_batch`] goes on from: a position in the directory
/// as its filesystem gives one (a `d_off`), `Start` for the first entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirPos {
    /// Before the first entry.
    Start,
    /// After the entry whose `d_off` this is.
    At(i64),
}

/// Reads at most `max` names (`.` and `..` excepted, as raw bytes) of the
/// directory open as `fd`, from `from` on, through a description of its
/// own (`fd`'s offset is neither used nor moved, so `fd` may be a walk's
/// descriptor reopened through `..`). Returns them in directory order with
/// the position to go on from, `None` once the directory is read to its
/// end. Names added or removed between two batches may or may not be
/// returned; every other name is returned exactly once (the positions are
/// the filesystem's own: a btrfs directory index, an ext4 hash cookie).
/// Reads only: a crash leaves nothing behind.
pub fn read_dir_batch(
    fd: BorrowedFd<'_>,
    from: DirPos,
    max: usize,
) -> io::Result<(DirNames, Option<DirPos>)> {
    super::fault::check("getdents")?;
    let mut dir = rustix::fs::Dir::read_from(fd)?;
    if let DirPos::At(off) = from {
        dir.seek(off)?;
    }
    let mut out = Vec::new();
    let mut pos = from;
    while out.len() < max.max(1) {
        let Some(entry) = dir.read() else {
            return Ok((out, None));
        };
        let entry = entry?;
        pos = DirPos::At(entry.offset());
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        out.push((
            OsString::from_vec(name.to_vec()),
            FileType::from_rustix(entry.file_type()),
            entry.ino(),
        ));
    }
    Ok((out, Some(pos)))
}

/// Reads all names in a directory except `.` and `..`, as raw bytes: one
/// [`read_dir_batch`] from the start, with no bound.
pub fn read_dir_names(fd: BorrowedFd<'_>) -> io::Result<DirNames> {
    let (names, _) = read_dir_batch(fd, DirPos::Start, usize::MAX)?;
    Ok(names)
}
