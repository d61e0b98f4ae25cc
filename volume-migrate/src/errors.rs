//! How the conversion's I/O errors are told: the context naming the
//! package and the step. The one errno family that changes what a failed
//! step leaves behind (out of space: a partial copy is removed, not kept
//! for a rerun that would meet the same wall) is told by
//! [`volume::errors::is_enospc`], as the store tells it.

use std::io;

use models::{ErrorKind, PackageId};

/// The error context for a step of `pkg`'s conversion.
pub(crate) fn step<'a>(
    pkg: &'a PackageId,
    what: &'static str,
) -> impl FnOnce(&io::Error) -> (ErrorKind, String) + 'a {
    move |_| (ErrorKind::MigrationFailed, pkg.context(what))
}
