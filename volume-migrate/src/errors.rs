//! How the conversion's I/O errors are told: the context naming the
//! package and the step, and the one errno family that changes what a
//! failed step leaves behind (out of space: a partial copy is removed, not
//! kept for a rerun that would meet the same wall).

use std::io;

use models::{ErrorKind, PackageId};

/// The error context for a step of `pkg`'s conversion.
pub(crate) fn step<'a>(
    pkg: &'a PackageId,
    what: &'static str,
) -> impl FnOnce(&io::Error) -> (ErrorKind, String) + 'a {
    move |_| (ErrorKind::MigrationFailed, pkg.context(what))
}

/// Whether `e` is the filesystem (or a quota) running out of space.
pub(crate) fn is_enospc(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}
