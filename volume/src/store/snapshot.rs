//! The install backup taken before an update ([`VolumeStore::snapshot`]):
//! a read-only snapshot of a volume that is a subvolume, or a reflink copy
//! of one still a plain directory, within the extent bound.
//!
//! Either is built under `<pkg>.install-backup.tmp` and renamed to its
//! real name only once complete and frozen, so a backup under its real
//! name is never partial, and a `.tmp` is always garbage.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use models::{Error, ErrorKind, PackageId, ResultExt};

use super::{VolumeStore, nested_counterparts, with_cleanup};
use crate::failpoint::failpoint;
use crate::layout::Names;
use crate::outcome::{SnapshotOutcome, VolumeKind};
use crate::quota::{self, QuotaCarry};
use crate::record;
use crate::sys;

impl VolumeStore {
    /// Takes the install backup `<pkg>.install-backup` of `<pkg>`.
    ///
    /// On btrfs with `<pkg>` a subvolume: a read-only snapshot, nested
    /// subvolumes included, in milliseconds whatever the fragmentation. It is
    /// built under `<pkg>.install-backup.tmp` and renamed into place only once
    /// complete and frozen, so a backup under its real name is never partial.
    /// Which nested subvolumes were read-only in the volume is recorded
    /// beside it (`<pkg>.install-backup.ro`), so a restore gives them back
    /// read-only and the others writable. With quotas on, the backup's
    /// qgroup joins the volume's groups as it is created (see
    /// [`crate::quota`]); without, the one check costs one search.
    ///
    /// Fallbacks, each logged naming the package: not btrfs, no backup
    /// (a warning, the reason naming the root and its filesystem); a plain
    /// directory on btrfs, a reflink copy if its extent count is within the
    /// configured bound (nested subvolumes copied as subvolumes, read-only
    /// ones kept read-only), else no backup (a warning).
    ///
    /// Fails with `Incoherent` if a backup already exists: it belongs to an
    /// unfinished install that must be restored or dropped first, and
    /// replacing it could throw away the only good copy. A failure removes
    /// whatever the call had made.
    pub fn snapshot(&self, pkg: &PackageId) -> Result<SnapshotOutcome, Error> {
        let Some(names) = self.present(pkg)? else {
            return Ok(SnapshotOutcome::NoVolume);
        };
        let held = self.hold_recovered(pkg, names)?;
        self.snapshot_locked(pkg, &held.names)
    }

    /// [`VolumeStore::snapshot`] once the package is held and recovered.
    pub(super) fn snapshot_locked(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<SnapshotOutcome, Error> {
        let Some(kind) = self.tree(pkg, &names.live)? else {
            return Ok(SnapshotOutcome::NoVolume);
        };
        if self.tree(pkg, &names.backup)?.is_some() {
            return Err(Error::for_package(
                pkg,
                ErrorKind::Incoherent,
                format!(
                    "an install backup already exists at {}; restore or drop it first",
                    self.backup_path(pkg).display()
                ),
            ));
        }
        if let Some(reason) = self.root.why_not_btrfs() {
            tracing::warn!(package = %pkg, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        match kind {
            VolumeKind::Subvolume => self.snapshot_subvolume(pkg, names),
            VolumeKind::Directory => self.reflink_backup(pkg, names),
        }
    }

    fn snapshot_subvolume(&self, pkg: &PackageId, names: &Names) -> Result<SnapshotOutcome, Error> {
        let (what, result) = self.build_snapshot(names);
        if let Err(e) = result {
            // Nothing of a backup may be left unless it has its real name.
            let cleanup = (|| {
                self.delete_entry(&names.backup_tmp)?;
                if !self.exists_at(&names.backup)? {
                    self.delete_entry(&names.backup_ro)?;
                }
                self.fsync_root()
            })();
            let e = self.failed(
                pkg,
                format!("{what} {}", self.volume_path(pkg).display()),
                e,
            );
            return Err(with_cleanup(e, cleanup, "removing the partial snapshot"));
        }
        tracing::info!(package = %pkg, "install backup snapshot taken");
        Ok(SnapshotOutcome::Snapshot)
    }

    /// The steps of a subvolume snapshot; the step that failed, if one did.
    fn build_snapshot(&self, names: &Names) -> (&'static str, io::Result<()>) {
        let live = match sys::open_dir_at(self.root_fd(), &names.live) {
            Ok(fd) => fd,
            Err(e) => return ("opening", Err(e)),
        };
        // The backup joins the volume's qgroups: with full quotas, a
        // snapshot of a group member that joins no group makes the
        // kernel mark every number inconsistent.
        let carry = quota::or_warn(
            format_args!(
                "backing up {}",
                self.root.path().join(&names.live).display()
            ),
            QuotaCarry::read(live.as_fd()),
        );
        let inherit = QuotaCarry::inherit_of(carry.as_ref());
        let inherit = inherit.as_ref();
        match self.read_only_in_one_step(live.as_fd(), names, inherit) {
            Ok(true) => {
                let publish = failpoint("snapshot.created")
                    .and_then(|()| failpoint("snapshot.frozen"))
                    .and_then(|()| {
                        sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)
                    })
                    .and_then(|()| self.commit_root());
                return ("putting in place the snapshot of", publish);
            }
            Ok(false) => {}
            Err(e) => return ("snapshotting", Err(e)),
        }
        let tmp =
            match sys::snapshot_tree_with(live.as_fd(), self.root_fd(), &names.backup_tmp, inherit)
            {
                Ok(fd) => fd,
                Err(e) => return ("snapshotting", Err(e)),
            };
        if let Err(e) = failpoint("snapshot.created") {
            return ("snapshotting", Err(e));
        }
        let ro = match read_only_nested(live.as_fd(), tmp.as_fd()) {
            Ok(ro) => ro,
            Err(e) => {
                return (
                    "reading the read-only flags of the subvolumes nested in",
                    Err(e),
                );
            }
        };
        let recorded = match ro.is_empty() {
            true => Ok(()),
            false => record::write_set(self.root_fd(), &names.backup_ro, &ro),
        };
        if let Err(e) = recorded {
            return ("recording the read-only subvolumes nested in", Err(e));
        }
        if let Err(e) = sys::make_tree_read_only(tmp.as_fd()) {
            return ("making read-only the snapshot of", Err(e));
        }
        if let Err(e) = failpoint("snapshot.frozen") {
            return ("making read-only the snapshot of", Err(e));
        }
        let publish = sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)
            .and_then(|()| self.commit_root());
        ("putting in place the snapshot of", publish)
    }

    /// With no subvolume nested in the volume open as `live`, the backup
    /// is made read-only by the snapshot ioctl itself, under
    /// `<pkg>.install-backup.tmp`: one transaction commit less than
    /// freezing a writable snapshot afterwards (SUBVOL_SETFLAGS commits
    /// one). `false` when something is nested (the tree is snapshotted
    /// subvolume by subvolume, then frozen): also when a subvolume appeared
    /// while the snapshot was taken, whose content the snapshot may lack,
    /// and then the one-step snapshot is deleted again. A crash leaves at
    /// most the `.tmp`, which recovery deletes. With quotas on, `inherit`
    /// names the volume's groups.
    fn read_only_in_one_step(
        &self,
        live: BorrowedFd<'_>,
        names: &Names,
        inherit: Option<&sys::QgroupInherit>,
    ) -> io::Result<bool> {
        if !sys::nested_subvolumes(live)?.is_empty() {
            return Ok(false);
        }
        match inherit {
            Some(i) => sys::create_snapshot_with(live, self.root_fd(), &names.backup_tmp, true, i),
            None => sys::create_snapshot(live, self.root_fd(), &names.backup_tmp, true),
        }?;
        if sys::nested_subvolumes(live)?.is_empty() {
            return Ok(true);
        }
        self.delete_entry(&names.backup_tmp)?;
        Ok(false)
    }

    /// The fallback for a volume that is still a plain directory on btrfs:
    /// a reflink copy if its extent count is within the bound. Over the
    /// bound is a designed skip (no backup, with the reason); any failure
    /// of the count or the copy is an error, the partial copy removed: an
    /// update must not go on believing there is no rollback point to make.
    fn reflink_backup(&self, pkg: &PackageId, names: &Names) -> Result<SnapshotOutcome, Error> {
        let live = sys::open_dir_at(self.root_fd(), &names.live)
            .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("opening the volume")))?;
        let limit = self.reflink_extent_limit;
        // Data still in the page cache has no extents yet; BTRFS_IOC_SYNC
        // flushes it so the count sees what the copy will have to clone.
        sys::commit(live.as_fd()).map_err(|e| self.failed(pkg, "flushing the volume", e))?;
        let extents = crate::extents::count_tree_extents(live.as_fd(), limit)
            .map_err(|e| self.walk_failed(pkg, "counting the extents of the volume", e))?;
        if extents > limit {
            let reason = format!(
                "volume is a plain directory with more than {limit} extents \
                 (a reflink copy would take too long); convert it to a subvolume"
            );
            tracing::warn!(package = %pkg, extents, "no install backup: {reason}");
            return Ok(SnapshotOutcome::Skipped { reason });
        }
        let copy = || -> io::Result<()> {
            sys::mkdir_at(self.root_fd(), &names.backup_tmp, 0o700)?;
            let dst = sys::open_dir_at(self.root_fd(), &names.backup_tmp)?;
            let opts = crate::copy::CopyOptions {
                nested_subvolumes: true,
                ..Default::default()
            };
            crate::copy::reflink_into(live.as_fd(), dst.as_fd(), &opts, &mut |_| Ok(()))?;
            // The copy shares its data with the volume: committing its
            // metadata makes it durable before its name says "complete".
            failpoint("snapshot.created")?;
            sys::commit_metadata(self.root_fd())?;
            sys::rename_noreplace(self.root_fd(), &names.backup_tmp, &names.backup)?;
            self.fsync_root()
        };
        if let Err(e) = copy() {
            let cleanup = self
                .delete_entry(&names.backup_tmp)
                .and_then(|()| self.fsync_root());
            let e = self.walk_failed(pkg, "making the reflink backup", e);
            return Err(with_cleanup(
                e,
                cleanup,
                "removing the partial reflink copy",
            ));
        }
        tracing::info!(package = %pkg, extents, "install backup reflink copy taken");
        Ok(SnapshotOutcome::ReflinkCopy { extents })
    }
}

/// The ids, in the snapshot open as `copy`, of the nested subvolumes whose
/// counterparts in `source` (the subvolume it was taken of) are read-only.
fn read_only_nested(source: BorrowedFd<'_>, copy: BorrowedFd<'_>) -> io::Result<BTreeSet<u64>> {
    let mut ids = BTreeSet::new();
    for (n, counterpart) in nested_counterparts(source, copy)? {
        if sys::is_read_only(sys::open_subvolume(source, n.id)?.as_fd())? {
            ids.insert(counterpart);
        }
    }
    Ok(ids)
}
