//! How a conversion runs ([`MigrateOptions`]), and the free metadata space
//! it must find before it creates anything ([`MetadataRoom`]).
//!
//! A reflink shares data, so only metadata grows: the room is read once per
//! package, before the first subvolume is created, and checked against
//! the estimate plus a reserve. Reading it changes nothing on disk, so a
//! crash here leaves nothing behind.

use std::fmt;

use models::{Error, ErrorKind, PackageId};
use serde::Serialize;
use volume::sys;

use crate::{Estimate, Method};

/// Default FICLONERANGE chunk: 64 MiB. Each chunk is one ioctl costing
/// O(extents in it); a crash loses at most one chunk of work.
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 20;
/// Headroom of free metadata space kept on top of the estimated need (the
/// global reserve is already held back): what the estimate may miss, and
/// room for the services' first writes after the conversion. By default
/// 1/128 of the filesystem's size ([`default_reserve`]), between these
/// bounds: 64 MiB from 8 GiB up, 8 MiB on 1 GiB, so a small filesystem can
/// still convert.
pub const MAX_RESERVE_BYTES: u64 = 64 << 20;
/// The least default reserve: 1 MiB, a few dozen tree nodes.
pub const MIN_RESERVE_BYTES: u64 = 1 << 20;
const RESERVE_FRACTION: u64 = 128;

/// The default reserve for a filesystem of `space`'s size: 1/128 of it,
/// clamped to [`MIN_RESERVE_BYTES`]..=[`MAX_RESERVE_BYTES`].
pub fn default_reserve(space: &sys::MetadataSpace) -> u64 {
    (space.device_bytes / RESERVE_FRACTION).clamp(MIN_RESERVE_BYTES, MAX_RESERVE_BYTES)
}
/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrateOptions {
    /// Only scan and report what would be converted; change nothing (not
    /// even leftovers of an interrupted run).
    pub dry_run: bool,
    /// Bytes per FICLONERANGE call (rounded up to the block size).
    pub chunk_bytes: u64,
    /// Free metadata space required beyond the estimate; see
    /// [`crate::Migrator::convert`]. `None`: [`default_reserve`], scaled
    /// with the filesystem.
    pub reserve_bytes: Option<u64>,
    /// [`crate::Migrator::run`]: after converting every package, remove the
    /// old directories too (otherwise call
    /// [`crate::Migrator::remove_all_old`] later).
    pub remove_old: bool,
    /// How to convert; see [`crate::Migrator::convert`].
    pub method: Method,
    /// A cut of the parent's snapshot only sets the rest aside before the
    /// exchange (O(the parent's top entries)), and
    /// [`crate::Migrator::remove_old`] removes it with the old directory,
    /// after services start; see the `rest` module. Off: the cut removes
    /// it before the exchange. On, a cloned package holding NOCOW files has
    /// its old copies (its `<pkg>.migrate-old` and its directory in every
    /// rest) removed before it is reported done: shared, each first write
    /// to them would be a copy. A crash meanwhile leaves only garbage, for
    /// `remove_old`.
    pub defer_cut: bool,
}

impl MigrateOptions {
    /// The reserve to keep on a filesystem of `space`'s size.
    pub fn reserve(&self, space: &sys::MetadataSpace) -> u64 {
        self.reserve_bytes.unwrap_or_else(|| default_reserve(space))
    }
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            dry_run: false,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            reserve_bytes: None,
            remove_old: true,
            method: Method::Auto,
            defer_cut: false,
        }
    }
}

/// The free metadata space of the filesystem holding the volumes root, as
/// read before a conversion, and the reserve to keep on top of what it
/// needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MetadataRoom {
    /// New metadata the filesystem can take ([`sys::MetadataSpace::free`]).
    pub free: u64,
    /// What must stay free beyond a conversion's estimate
    /// ([`MigrateOptions::reserve`]).
    pub reserve: u64,
}

impl MetadataRoom {
    /// The room on a filesystem whose metadata space is `space`, with the
    /// reserve `opts` keeps.
    pub(crate) fn of(space: &sys::MetadataSpace, opts: &MigrateOptions) -> MetadataRoom {
        MetadataRoom {
            free: space.free(),
            reserve: opts.reserve(space),
        }
    }

    /// Whether the free space covers converting `est`; see
    /// [`crate::Migrator::convert`].
    pub(crate) fn check(&self, est: &Estimate) -> Result<(), MetadataShortfall> {
        if self.free < self.need(est) {
            return Err(self.shortfall(est));
        }
        Ok(())
    }

    /// Why `est` does not fit, with the figures.
    pub(crate) fn shortfall(&self, est: &Estimate) -> MetadataShortfall {
        MetadataShortfall {
            free: self.free,
            need: self.need(est),
            extents: est.extents,
            entries: est.entries,
            reserve: self.reserve,
        }
    }

    /// What converting `est` needs, the reserve included.
    pub fn need(&self, est: &Estimate) -> u64 {
        est.metadata_bytes().saturating_add(self.reserve)
    }
}

/// Why an estimate does not fit in the [`MetadataRoom`], with the figures;
/// its `Display` is the line users see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MetadataShortfall {
    /// [`MetadataRoom::free`].
    pub free: u64,
    /// [`MetadataRoom::need`] of the estimate: its metadata plus the reserve.
    pub need: u64,
    /// The estimate's extent items.
    pub extents: u64,
    /// The estimate's entries.
    pub entries: u64,
    /// [`MetadataRoom::reserve`].
    pub reserve: u64,
}

impl MetadataShortfall {
    /// The refusal of `pkg` before anything was created.
    pub fn refusal(&self, pkg: &PackageId) -> Error {
        Error::for_package(
            pkg,
            ErrorKind::MigrationFailed,
            format!("{self}; nothing was changed"),
        )
    }
}

impl fmt::Display for MetadataShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not enough free metadata space to convert: {} bytes free, {} needed \
             ({} extents, {} entries, plus {} reserved)",
            self.free, self.need, self.extents, self.entries, self.reserve
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line users see, pinned: it was a format string before it was a
    /// type.
    #[test]
    fn a_shortfall_reads_as_before() {
        let room = MetadataRoom {
            free: 1000,
            reserve: 4096,
        };
        let est = Estimate {
            entries: 3,
            extents: 5,
            ..Estimate::default()
        };
        let short = room.check(&est).expect_err("short");
        assert_eq!(
            short.to_string(),
            "not enough free metadata space to convert: 1000 bytes free, 7808 needed \
             (5 extents, 3 entries, plus 4096 reserved)"
        );
        let pkg: PackageId = "db".parse().expect("a package id");
        let refusal = short.refusal(&pkg);
        assert_eq!(refusal.kind, ErrorKind::MigrationFailed);
        assert_eq!(
            refusal.to_string(),
            format!("Migration Failed: package db: {short}; nothing was changed")
        );
        assert!(room.check(&Estimate::default()).is_err());
        assert!(
            MetadataRoom {
                free: 7808,
                reserve: 4096
            }
            .check(&est)
            .is_ok()
        );
    }
}
