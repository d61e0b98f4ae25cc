//! The names a package owns under the volumes root.
//!
//! Every multi-step operation moves data through names derived from the
//! package id with a fixed suffix. Package ids cannot contain a dot, so these
//! names never collide with a package, and recovery can tell from the names
//! present alone which operation was interrupted and how far it got.
//!
//! Only the volumes root is trusted: a package writes inside `<pkg>`, never
//! beside it. So every name that decides what recovery does sits in the
//! root, and nothing inside a volume is ever read to decide anything.
//!
//! Two kinds of names:
//! - **trees**: `<pkg>` itself, its backup, and the transient names a tree
//!   passes through (`.install-backup.tmp`, `.rollback`, ...);
//! - **records** ([`crate::record`]): small facts kept as the target of a
//!   symlink (`.rollback.id`, `.install-backup.ro`), written in one atomic
//!   step and needing no data space, so they can be written on a full disk.

use std::ffi::{OsStr, OsString};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId};

/// Suffix of the read-only snapshot taken before an install (upstream's name).
pub const INSTALL_BACKUP_SUFFIX: &str = ".install-backup";
/// A new volume being made: renamed to `<pkg>` only once complete, with
/// its volume directories; whatever is left under this name is garbage.
pub const CREATE_SUFFIX: &str = ".create";
/// A backup being built; only renamed to the backup name once complete.
pub const BACKUP_TMP_SUFFIX: &str = ".install-backup.tmp";
/// A backup being dropped, on its way to the trash ([`TRASH_DIR`]):
/// garbage, read-only or not; recovery moves it there.
pub const BACKUP_DROP_SUFFIX: &str = ".install-backup.drop";
/// Record: which subvolumes nested in the backup were read-only in the
/// volume (the backup freezes them all). Written before the backup gets its
/// name, removed after it is dropped; without a backup it is garbage.
pub const BACKUP_RO_SUFFIX: &str = ".install-backup.ro";
/// A restore in progress: the writable copy of the backup before the
/// exchange, the replaced live volume after it.
pub const ROLLBACK_SUFFIX: &str = ".rollback";
/// Record: the identity of the complete rollback copy. Written once the
/// copy is complete and durable, before the exchange; removed as the
/// restore's last step. While it exists, whichever of `<pkg>` and
/// `<pkg>.rollback` has that identity is the restored volume.
pub const ROLLBACK_ID_SUFFIX: &str = ".rollback.id";
/// The volume a restore swapped out, waiting to be deleted: garbage. Kept
/// apart from the restore because deleting it evicts its cached pages, which
/// takes about 0.13 s per cached GiB and need not delay the old service.
pub const REPLACED_SUFFIX: &str = ".replaced";
/// A volume being deleted on uninstall. While it exists, the delete is in
/// progress: recovery drops the backup, then deletes this, last.
pub const DELETE_SUFFIX: &str = ".delete";
/// A directory of ours holding the trees a restore or a delete took off the
/// volume's name while a mount (in any mount namespace: a dependent's bind
/// mount of a `data_dir`, say) still held them, each under a decimal number
/// (`<pkg>.held/1`, `<pkg>.held/2`, ...), so that nothing written through
/// such a mount is deleted while it is mounted. Several can pile up (a
/// restore, then another before the first holder let go), hence numbered
/// entries in one directory rather than one name: the package keeps one
/// name in the root, and [`package_of`] and [`MAX_ID_LEN`] are unchanged.
///
/// An entry is garbage once no mount in any namespace holds it: every
/// operation's recovery, and so the boot's, moves those to the trash, and
/// removes the directory once it is empty. A crash leaves the directory
/// empty (garbage) or a tree in it whole (each move is one rename); out of
/// metadata space, where nothing can be moved, an entry is deleted in
/// place, and a crash leaves it part-deleted (garbage, unmounted). Nothing inside a held tree decides anything;
/// only the entry names in this directory, which only the store makes.
pub const HELD_SUFFIX: &str = ".held";
/// The store's trash: a directory of the volumes root (not a package's:
/// its name starts with a dot, which no package id holds, so
/// [`package_of`] and `list` pass it over, and no operation of a package
/// waits on it) holding trees that no package uses any more, each under
/// `<pkg>.<n>`, waiting to be deleted.
///
/// Deleting a subvolume evicts its cached inodes and pages in the calling
/// thread (about 4 s for a million cached files), and a plain directory
/// (a reflink backup) goes entry by entry, so a restore, a delete, a drop
/// of a backup and a recovery reclaiming a held tree move the tree they no
/// longer use here under the package's lock (one rename and one commit:
/// milliseconds at any size) and it is deleted from
/// here after the lock is released, by [`crate::VolumeStore::empty_trash`]
/// (inline, or in a background thread with [`crate::purge`]). A tree a
/// mount still holds never comes here (it is kept in [`HELD_SUFFIX`]).
///
/// Everything in it is garbage, whatever instant a crash hit: the move in
/// is one rename, and every later recovery of all packages (the boot's)
/// empties it; the directory itself is removed once empty.
pub const TRASH_DIR: &str = ".trash";
/// volume-migrate: the subvolume being built from the plain directory
/// `<pkg>` before the exchange; the old plain directory after it (a plain
/// directory under this name means the exchange happened).
pub const MIGRATE_SUFFIX: &str = ".migrate";
/// volume-migrate: a snapshot of the subvolume holding the volumes root,
/// being cut down to `<pkg>` (`volume_migrate`'s `carve`); garbage before the
/// exchange (never resumed: a new snapshot costs nothing), the old plain
/// directory after it (a plain directory under this name means the exchange
/// happened).
pub const MIGRATE_PARENT_SUFFIX: &str = ".migrate-parent";
/// volume-migrate, record: a cut whose removal of the rest was deferred
/// left it in a directory at the top of the converted `<pkg>`; the record
/// holds that directory's name and identity, so that only that directory
/// is ever removed for it. Removed once the directory is.
pub const MIGRATE_REST_SUFFIX: &str = ".migrate-rest";
/// volume-migrate: the replaced plain directory, waiting to be removed. Only
/// ever holds data that also lives in the converted `<pkg>`: always safe to
/// delete.
pub const MIGRATE_OLD_SUFFIX: &str = ".migrate-old";

/// Upstream's marker of an install with no volume before it (an empty
/// regular file): `InstallBackup::begin` makes it, `remove` drops it.
pub const INSTALL_FRESH_SUFFIX: &str = ".install-fresh";
/// Upstream's snapshot being made (its `.install-backup-tmp`): incomplete,
/// deleted.
pub const UPSTREAM_BACKUP_TMP_SUFFIX: &str = ".install-backup-tmp";
/// Upstream's restore in flight: the live volume moved aside before its
/// backup was renamed in. See [`crate::VolumeStore::recover`].
pub const RESTORE_OLD_SUFFIX: &str = ".restore-old";
/// Upstream's conversion copy being made: incomplete, deleted.
pub const CONVERT_TMP_SUFFIX: &str = ".convert-tmp";
/// Upstream's plain directory moved aside by its conversion: put back if
/// `<pkg>` is missing, garbage (as `.migrate-old`) if not.
pub const CONVERT_OLD_SUFFIX: &str = ".convert-old";
/// Where recovery keeps what a package wrote into a volume root recreated
/// half-way through one of upstream's restores (upstream's
/// "restore-conflict", which it leaves for manual cleanup): nothing is
/// lost, the restore is finished, and this is left for the operator to
/// look at; deleted with the package.
pub const RESTORE_CONFLICT_SUFFIX: &str = ".restore-conflict";

/// Every suffix the crates give a package's names, longest first where one
/// ends another, so [`package_of`] strips the right one.
pub const SUFFIXES: &[&str] = &[
    CREATE_SUFFIX,
    BACKUP_TMP_SUFFIX,
    BACKUP_DROP_SUFFIX,
    BACKUP_RO_SUFFIX,
    UPSTREAM_BACKUP_TMP_SUFFIX,
    INSTALL_BACKUP_SUFFIX,
    INSTALL_FRESH_SUFFIX,
    ROLLBACK_ID_SUFFIX,
    ROLLBACK_SUFFIX,
    REPLACED_SUFFIX,
    DELETE_SUFFIX,
    HELD_SUFFIX,
    RESTORE_OLD_SUFFIX,
    RESTORE_CONFLICT_SUFFIX,
    CONVERT_TMP_SUFFIX,
    CONVERT_OLD_SUFFIX,
    MIGRATE_OLD_SUFFIX,
    MIGRATE_PARENT_SUFFIX,
    MIGRATE_REST_SUFFIX,
    MIGRATE_SUFFIX,
];

/// Linux's limit on one name (`NAME_MAX`), in bytes.
pub const NAME_MAX: usize = 255;

/// The longest package id whose every derived name fits [`NAME_MAX`]: 235,
/// as `.install-backup.drop` takes 20 bytes.
pub const MAX_ID_LEN: usize = NAME_MAX - longest_suffix();

const fn longest_suffix() -> usize {
    let mut i = 0;
    let mut max = 0;
    while i < SUFFIXES.len() {
        if SUFFIXES[i].len() > max {
            max = SUFFIXES[i].len();
        }
        i += 1;
    }
    max
}

/// Refuses, as an `InvalidId` error, a package id some derived name of
/// which would not fit [`NAME_MAX`]: every operation would otherwise fail
/// half-way with ENAMETOOLONG.
pub fn check_id_len(pkg: &PackageId) -> Result<(), Error> {
    if pkg.len() > MAX_ID_LEN {
        return Err(Error::new(
            eyre!(
                "invalid id \"{pkg}\": {} characters, at most {MAX_ID_LEN} allowed \
                 (so that every name derived from it fits NAME_MAX, {NAME_MAX} bytes)",
                pkg.len()
            ),
            ErrorKind::InvalidId,
        ));
    }
    Ok(())
}

/// Every name under the volumes root that the volume store uses for one
/// package.
#[derive(Debug, Clone)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub struct Names {
    /// `<pkg>`, the volume.
    pub live: OsString,
    /// A new volume being made ([`CREATE_SUFFIX`]).
    pub create: OsString,
    /// The install backup ([`INSTALL_BACKUP_SUFFIX`]).
    pub backup: OsString,
    /// A backup being made ([`BACKUP_TMP_SUFFIX`]).
    pub backup_tmp: OsString,
    /// A backup being dropped ([`BACKUP_DROP_SUFFIX`]).
    pub backup_drop: OsString,
    /// The backup's read-only record ([`BACKUP_RO_SUFFIX`]).
    pub backup_ro: OsString,
    /// A restore's copy, or the volume it replaced ([`ROLLBACK_SUFFIX`]).
    pub rollback: OsString,
    /// The rollback record ([`ROLLBACK_ID_SUFFIX`]).
    pub rollback_id: OsString,
    /// The volume a restore replaced ([`REPLACED_SUFFIX`]).
    pub replaced: OsString,
    /// A volume being deleted ([`DELETE_SUFFIX`]).
    pub delete: OsString,
    /// Replaced or deleted trees still mounted somewhere ([`HELD_SUFFIX`]).
    pub held: OsString,
    /// Upstream's fresh-install marker ([`INSTALL_FRESH_SUFFIX`]).
    pub fresh: OsString,
    /// Upstream's snapshot being made ([`UPSTREAM_BACKUP_TMP_SUFFIX`]).
    pub upstream_backup_tmp: OsString,
    /// Upstream's restore in flight ([`RESTORE_OLD_SUFFIX`]).
    pub restore_old: OsString,
    /// What an upstream restore-conflict kept ([`RESTORE_CONFLICT_SUFFIX`]).
    pub restore_conflict: OsString,
    /// Upstream's conversion copy ([`CONVERT_TMP_SUFFIX`]).
    pub convert_tmp: OsString,
    /// Upstream's replaced directory ([`CONVERT_OLD_SUFFIX`]).
    pub convert_old: OsString,
    /// volume-migrate's partial clone (see [`MIGRATE_SUFFIX`]).
    pub migrate: OsString,
    /// volume-migrate's parent snapshot (see [`MIGRATE_PARENT_SUFFIX`]).
    pub migrate_parent: OsString,
    /// volume-migrate's replaced directory (see [`MIGRATE_OLD_SUFFIX`]).
    pub migrate_old: OsString,
    /// volume-migrate's deferred removal (see [`MIGRATE_REST_SUFFIX`]).
    pub migrate_rest: OsString,
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
impl Names {
    /// The names of `pkg`; `InvalidId` if they would not fit [`NAME_MAX`].
    pub fn new(pkg: &PackageId) -> Result<Self, Error> {
        check_id_len(pkg)?;
        let with = |suffix: &str| OsString::from(format!("{pkg}{suffix}"));
        Ok(Names {
            live: OsString::from(pkg.as_str()),
            create: with(CREATE_SUFFIX),
            backup: with(INSTALL_BACKUP_SUFFIX),
            backup_tmp: with(BACKUP_TMP_SUFFIX),
            backup_drop: with(BACKUP_DROP_SUFFIX),
            backup_ro: with(BACKUP_RO_SUFFIX),
            rollback: with(ROLLBACK_SUFFIX),
            rollback_id: with(ROLLBACK_ID_SUFFIX),
            replaced: with(REPLACED_SUFFIX),
            delete: with(DELETE_SUFFIX),
            held: with(HELD_SUFFIX),
            fresh: with(INSTALL_FRESH_SUFFIX),
            upstream_backup_tmp: with(UPSTREAM_BACKUP_TMP_SUFFIX),
            restore_old: with(RESTORE_OLD_SUFFIX),
            restore_conflict: with(RESTORE_CONFLICT_SUFFIX),
            convert_tmp: with(CONVERT_TMP_SUFFIX),
            convert_old: with(CONVERT_OLD_SUFFIX),
            migrate: with(MIGRATE_SUFFIX),
            migrate_parent: with(MIGRATE_PARENT_SUFFIX),
            migrate_old: with(MIGRATE_OLD_SUFFIX),
            migrate_rest: with(MIGRATE_REST_SUFFIX),
        })
    }

    /// Every name, the live volume first.
    pub fn all(&self) -> [&OsStr; 21] {
        [
            &self.live,
            &self.create,
            &self.backup,
            &self.backup_tmp,
            &self.backup_drop,
            &self.backup_ro,
            &self.rollback,
            &self.rollback_id,
            &self.replaced,
            &self.delete,
            &self.held,
            &self.fresh,
            &self.upstream_backup_tmp,
            &self.restore_old,
            &self.restore_conflict,
            &self.convert_tmp,
            &self.convert_old,
            &self.migrate,
            &self.migrate_parent,
            &self.migrate_old,
            &self.migrate_rest,
        ]
    }
}

/// The package an entry of the volumes root belongs to, if any: `lnd`,
/// `lnd.install-backup`, `lnd.rollback`, ... all map to `lnd`. A name
/// whose id is too long for its derived names ([`check_id_len`]) belongs to
/// no package: it is `Err`, with that error, for the caller to report and
/// pass over while it handles the others.
pub fn package_of(name: &OsStr) -> Option<Result<PackageId, Error>> {
    let name = name.to_str()?;
    let stem = SUFFIXES
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    let pkg: PackageId = stem.parse().ok()?;
    Some(check_id_len(&pkg).map(|()| pkg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_maps_back_to_its_package() {
        let pkg: PackageId = "bitcoind".parse().unwrap();
        let n = Names::new(&pkg).unwrap();
        assert_eq!(n.all().len(), SUFFIXES.len() + 1, "every suffix has a name");
        for name in n.all() {
            assert_eq!(
                package_of(name).and_then(Result::ok).as_ref(),
                Some(&pkg),
                "{name:?}"
            );
        }
        assert!(package_of(OsStr::new("lost+found")).is_none());
        assert!(package_of(OsStr::new("x.unknown")).is_none());
        let long = format!("{}.install-backup", "a".repeat(MAX_ID_LEN + 1));
        let err = package_of(OsStr::new(&long))
            .expect("a package name")
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidId);
    }

    #[test]
    fn ids_are_bounded_by_their_longest_name() {
        assert_eq!(MAX_ID_LEN, 235);
        let ok: PackageId = "a".repeat(MAX_ID_LEN).parse().unwrap();
        let names = Names::new(&ok).unwrap();
        assert!(names.all().iter().all(|n| n.len() <= NAME_MAX));
        let long: PackageId = "a".repeat(MAX_ID_LEN + 1).parse().unwrap();
        let err = Names::new(&long).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidId);
        assert!(err.to_string().contains("at most 235"), "{err}");
    }
}
