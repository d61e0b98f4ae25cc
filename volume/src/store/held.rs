//! Trees kept while mounted: the volume a restore replaced, or one a delete
//! took off the package's name, that a mount in some mount namespace still
//! holds (a dependent's bind mount of its `data_dir`, say) is moved into
//! `<pkg>.held/<n>` instead of being deleted, so nothing written through
//! that mount is deleted while it is mounted; recovery moves it to the
//! trash, to be deleted off the lock, once no mount holds it (see
//! [`crate::layout::HELD_SUFFIX`]).
//!
//! A mount never makes a restore or a delete fail: the operation goes on,
//! and the holders are named in a warning and in its outcome, for the
//! caller to restart them on the volume now under the package's name.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::AsFd;

use models::{Error, ErrorKind, PackageId, ResultExt};

use super::VolumeStore;
use crate::failpoint::failpoint;
use crate::layout::Names;
use crate::mounts::{self, MountTables, MountUse};
use crate::outcome::{HeldTree, Holder};
use crate::sys;

/// What became of a tree the store no longer uses.
#[derive(Debug)]
pub(super) enum Disposal {
    /// No mount held it: moved to the trash, deleted once the package's
    /// lock is released ([`super::trash`]).
    Deleted,
    /// A mount held it: kept under `<pkg>.held`.
    Held(HeldTree),
}

impl Disposal {
    /// The kept tree, if it was kept.
    pub(super) fn held(self) -> Option<HeldTree> {
        match self {
            Disposal::Deleted => None,
            Disposal::Held(h) => Some(h),
        }
    }
}

/// `u` as data for an outcome.
fn holder(u: &MountUse) -> Holder {
    Holder {
        pid: u.pids.first().copied().unwrap_or(0),
        command: u.command.clone(),
        mount_point: u.mount_point.clone(),
        namespace: u.namespace,
        own_namespace: u.own_namespace,
    }
}

impl VolumeStore {
    /// Removes the tree `name` of the root, one the package no longer uses
    /// (the volume a restore replaced, a volume being deleted): moved to
    /// the trash ([`super::trash`]) if no mount in any namespace holds it,
    /// else moved into `<pkg>.held` and kept, with a warning naming the
    /// holders. `None` if it is absent.
    ///
    /// A crash leaves the tree under `name` (the caller's recovery runs
    /// this again), in the trash (garbage), or whole in `<pkg>.held`. A mount made between the reading of the tables and
    /// the delete is not seen (the name is off the package's by then, so
    /// only a process already holding a mount of it can make one).
    pub(super) fn discard_tree(
        &self,
        pkg: &PackageId,
        names: &Names,
        name: &OsStr,
    ) -> Result<Option<Disposal>, Error> {
        if self.tree(pkg, name)?.is_none() {
            return Ok(None);
        }
        let path = self.root.path().join(name);
        let uses = mounts::uses_of(&path).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })?;
        if uses.is_empty() {
            // Deleted after the lock is released: deleting evicts its
            // cached inodes, seconds for a million files.
            self.trash(pkg, name)?;
            return Ok(Some(Disposal::Deleted));
        }
        self.keep_held(pkg, names, name, &uses)
            .map(|h| Some(Disposal::Held(h)))
    }

    /// Moves the tree `name` of the root, which `uses` hold, into
    /// `<pkg>.held` under the next number, and warns naming them.
    fn keep_held(
        &self,
        pkg: &PackageId,
        names: &Names,
        name: &OsStr,
        uses: &[MountUse],
    ) -> Result<HeldTree, Error> {
        let moved = || -> io::Result<OsString> {
            let dir = super::dir_made(self.root_fd(), &names.held)?;
            let n = super::next_numbered(dir.as_fd(), "")?;
            failpoint("held.moving")?;
            sys::rename_at(self.root_fd(), name, dir.as_fd(), &n)?;
            self.commit_root()?;
            Ok(n)
        };
        let from = self.root.path().join(name);
        let n = moved().with_ctx(|_| {
            (
                ErrorKind::DiskManagement,
                pkg.context(format!(
                    "keeping {}, still mounted, under {}",
                    from.display(),
                    self.root.path().join(&names.held).display()
                )),
            )
        })?;
        let path = self.root.path().join(&names.held).join(&n);
        tracing::warn!(
            package = %pkg,
            "{} is still mounted, at {}: kept as {} until no mount holds it (restart the \
             processes holding it to have them use {}); then the package's next operation, \
             or the boot's, deletes it",
            from.display(),
            mounts::describe(uses),
            path.display(),
            self.volume_path(pkg).display()
        );
        // A mount on top of something inside moved with the tree: named
        // where it is now.
        let holders = uses
            .iter()
            .map(|u| {
                let mut h = holder(u);
                if let Ok(rest) = h.mount_point.strip_prefix(&from) {
                    h.mount_point = path.join(rest);
                }
                h
            })
            .collect();
        Ok(HeldTree { path, holders })
    }

    /// The entries of `<pkg>.held`, sorted; empty if it is absent. An
    /// entry under that name that is no directory is refused as any stray
    /// under one of the package's names.
    ///
    /// Safe without the package's lock (`info` reads it so): a reclaim
    /// that removes the directory between the look and the open, or
    /// between the open and the read, leaves it absent, as if looked at
    /// after.
    pub(super) fn held_trees(
        &self,
        pkg: &PackageId,
        names: &Names,
    ) -> Result<Vec<OsString>, Error> {
        if self.tree(pkg, &names.held)?.is_none() {
            return Ok(Vec::new());
        }
        let ctx = |_: &io::Error| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!(
                    "reading {}",
                    self.root.path().join(&names.held).display()
                )),
            )
        };
        let dir = match sys::open_dir_at(self.root_fd(), &names.held) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            dir => dir.with_ctx(ctx)?,
        };
        let mut out: Vec<OsString> = match sys::read_dir_names(dir.as_fd()) {
            // Removed since it was opened (reading a removed directory
            // fails with ENOENT).
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            names => names.with_ctx(ctx)?,
        }
        .into_iter()
        .map(|(name, _, _)| name)
        .collect();
        out.sort();
        Ok(out)
    }

    /// Moves each tree of `<pkg>.held` that no mount in any namespace
    /// holds any more into the trash (`trash_garbage`: deleted once the
    /// lock is released, as every tree the store no longer uses), then
    /// removes the directory once empty; one action line per tree. Never
    /// fails for a held tree: one still mounted is kept, and a failure to
    /// read the mount tables or to move one is a warning (the next
    /// recovery tries again), so no operation of the package ever fails
    /// because a dependent still holds an old volume.
    pub(super) fn reclaim_held(
        &self,
        pkg: &PackageId,
        names: &Names,
        actions: &mut Vec<String>,
    ) -> Result<(), Error> {
        if self.tree(pkg, &names.held)?.is_none() {
            return Ok(());
        }
        let entries = self.held_trees(pkg, names)?;
        let base = self.root.path().join(&names.held);
        let mut kept = 0;
        if !entries.is_empty() {
            let tables = match MountTables::read_fresh() {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(package = %pkg, "kept {}: reading the mount tables failed: {e}", base.display());
                    return Ok(());
                }
            };
            let dir = match sys::open_dir_at(self.root_fd(), &names.held) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(package = %pkg, "kept {}: {e}", base.display());
                    return Ok(());
                }
            };
            for name in &entries {
                let path = base.join(name);
                if !tables.uses_of(&path).is_empty() {
                    kept += 1;
                    continue;
                }
                match self.trash_garbage(pkg, dir.as_fd(), name) {
                    Ok(()) => actions.push(format!(
                        "deleted {} (into the trash), kept while it was mounted, now that no mount holds it",
                        path.display()
                    )),
                    Err(e) => {
                        kept += 1;
                        tracing::warn!(package = %pkg, "could not move {} (no longer mounted) to the trash: {e}; the next recovery tries again", path.display());
                    }
                }
            }
        }
        if kept == 0 {
            match sys::rmdir_at(self.root_fd(), &names.held).and_then(|()| self.fsync_root()) {
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!(package = %pkg, "could not remove {}: {e}", base.display())
                }
            }
        }
        Ok(())
    }
}
