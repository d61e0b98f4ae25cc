//! How the crates tell apart the I/O errors that change what a failed step
//! does next, so that the store and the conversion agree on them.

use std::io;

/// Whether `e` is the filesystem, or a quota on it (`EDQUOT`), running out
/// of space (`ENOSPC`).
///
/// Such a step is not retried as it stands: the store falls back to a step
/// that needs less space, and the conversion removes a partial copy rather
/// than keep it for a rerun that would meet the same wall.
pub fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}
