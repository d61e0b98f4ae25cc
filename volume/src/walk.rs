//! A directory walk that is safe on untrusted trees: names are raw bytes,
//! nothing is followed through a symlink, only directories are opened.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use rustix::fs::FileType;

use crate::sys;

/// Whether a walk goes on after a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Go on.
    Continue,
    /// Stop the whole walk.
    Stop,
}

/// The type of the entry `name` in `dir`, from its directory entry or, where
/// the filesystem leaves that unknown, from `lstat`. `None` if it vanished.
pub(crate) fn entry_type(
    dir: BorrowedFd<'_>,
    name: &std::ffi::OsStr,
    from_dirent: FileType,
) -> io::Result<Option<FileType>> {
    if from_dirent != FileType::Unknown {
        return Ok(Some(from_dirent));
    }
    Ok(sys::stat_at(dir, name)?.map(|st| st.file_type))
}

/// Calls `file(parent_dir, inode)` for every regular file below `dir`,
/// depth first. Returns `Visit::Stop` if the callback stopped it.
pub fn walk_files(
    dir: BorrowedFd<'_>,
    file: &mut dyn FnMut(BorrowedFd<'_>, u64) -> io::Result<Visit>,
) -> io::Result<Visit> {
    for (name, ty, ino) in sys::read_dir_names(dir)? {
        match entry_type(dir, &name, ty)? {
            Some(FileType::Directory) => {
                let sub = sys::open_dir_at(dir, &name)?;
                if walk_files(sub.as_fd(), file)? == Visit::Stop {
                    return Ok(Visit::Stop);
                }
            }
            Some(FileType::RegularFile) if file(dir, ino)? == Visit::Stop => {
                return Ok(Visit::Stop);
            }
            _ => {}
        }
    }
    Ok(Visit::Continue)
}
