//! The names a package owns under the volumes root.
//!
//! Every multi-step operation moves data through names derived from the
//! package id with a fixed suffix. Package ids cannot contain a dot, so these
//! names never collide with a package, and recovery can tell from the names
//! present alone which operation was interrupted and how far it got.

use std::ffi::{OsStr, OsString};

use models::PackageId;

/// Suffix of the read-only snapshot taken before an install (upstream's name).
pub const INSTALL_BACKUP_SUFFIX: &str = ".install-backup";
/// A backup being built; only renamed to the backup name once complete.
pub(crate) const BACKUP_TMP_SUFFIX: &str = ".install-backup.tmp";
/// A backup being dropped; whatever is left of it is garbage.
pub(crate) const BACKUP_DROP_SUFFIX: &str = ".install-backup.drop";
/// A restore in progress: the writable copy of the backup before the
/// exchange, the replaced live volume after it.
pub(crate) const ROLLBACK_SUFFIX: &str = ".rollback";
/// The volume a restore swapped out, waiting to be deleted: garbage. Kept
/// apart from the restore because deleting it evicts its cached pages, which
/// takes about 0.13 s per cached GiB and need not delay the old service.
pub(crate) const REPLACED_SUFFIX: &str = ".replaced";
/// A volume being deleted on uninstall.
pub(crate) const DELETE_SUFFIX: &str = ".delete";
/// The per-package lock file.
pub const LOCK_SUFFIX: &str = ".lock";
/// volume-migrate: the subvolume being built from the plain directory
/// `<pkg>` before the exchange; the old plain directory after it (a plain
/// directory under this name means the exchange happened).
pub const MIGRATE_SUFFIX: &str = ".migrate";
/// volume-migrate: a snapshot of the subvolume holding the volumes root,
/// being cut down to `<pkg>` ([`crate::carve`]); garbage before the
/// exchange (never resumed: a new snapshot costs nothing), the old plain
/// directory after it (a plain directory under this name means the exchange
/// happened).
pub const MIGRATE_PARENT_SUFFIX: &str = ".migrate-parent";
/// volume-migrate: the replaced plain directory, waiting to be removed. Only
/// ever holds data that also lives in the converted `<pkg>`: always safe to
/// delete.
pub const MIGRATE_OLD_SUFFIX: &str = ".migrate-old";
/// Created at the top of a rollback copy once it is complete and durable.
/// Which side of the exchange holds it tells recovery whether the exchange
/// happened; it is removed from the live volume as the restore's last step.
pub(crate) const ROLLBACK_MARKER: &str = ".startos-rollback-complete";

/// Every name under the volumes root that belongs to one package.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub live: OsString,
    pub backup: OsString,
    pub backup_tmp: OsString,
    pub backup_drop: OsString,
    pub rollback: OsString,
    pub replaced: OsString,
    pub delete: OsString,
    pub lock: OsString,
}

impl Names {
    pub fn new(pkg: &PackageId) -> Self {
        let with = |suffix: &str| OsString::from(format!("{pkg}{suffix}"));
        Names {
            live: OsString::from(pkg.as_str()),
            backup: with(INSTALL_BACKUP_SUFFIX),
            backup_tmp: with(BACKUP_TMP_SUFFIX),
            backup_drop: with(BACKUP_DROP_SUFFIX),
            rollback: with(ROLLBACK_SUFFIX),
            replaced: with(REPLACED_SUFFIX),
            delete: with(DELETE_SUFFIX),
            lock: with(LOCK_SUFFIX),
        }
    }
}

/// The package an entry of the volumes root belongs to, if any: `lnd`,
/// `lnd.install-backup`, `lnd.rollback`, ... all map to `lnd`.
pub fn package_of(name: &OsStr) -> Option<PackageId> {
    let name = name.to_str()?;
    let stem = [
        BACKUP_TMP_SUFFIX,
        BACKUP_DROP_SUFFIX,
        INSTALL_BACKUP_SUFFIX,
        ROLLBACK_SUFFIX,
        REPLACED_SUFFIX,
        DELETE_SUFFIX,
        LOCK_SUFFIX,
        MIGRATE_OLD_SUFFIX,
        MIGRATE_PARENT_SUFFIX,
        MIGRATE_SUFFIX,
    ]
    .iter()
    .find_map(|s| name.strip_suffix(s))
    .unwrap_or(name);
    stem.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_maps_back_to_its_package() {
        let pkg: PackageId = "bitcoind".parse().unwrap();
        let n = Names::new(&pkg);
        for name in [
            &n.live,
            &n.backup,
            &n.backup_tmp,
            &n.backup_drop,
            &n.rollback,
            &n.replaced,
            &n.delete,
            &n.lock,
            &OsString::from("bitcoind.migrate"),
            &OsString::from("bitcoind.migrate-old"),
            &OsString::from("bitcoind.migrate-parent"),
        ] {
            assert_eq!(package_of(name).as_ref(), Some(&pkg), "{name:?}");
        }
        assert_eq!(package_of(OsStr::new("lost+found")), None);
        assert_eq!(package_of(OsStr::new("x.unknown")), None);
    }
}
