//! What upstream's own volume code (start-core's `volume.rs` before this
//! crate took its place) leaves behind when one of its operations is cut
//! short, and how recovery resolves each state with nothing lost.
//!
//! A box upgraded from upstream's release may carry any of these. Each is
//! resolved from names and types alone, in steps that are each one rename
//! or one delete, so a crash in the middle of resolving leaves a state this
//! same code resolves again:
//!
//! | left by upstream | resolved as |
//! |---|---|
//! | `<pkg>.install-backup-tmp` (its snapshot being made) | deleted, as upstream does |
//! | `<pkg>.convert-tmp` (its conversion's copy) | deleted, as upstream does |
//! | `<pkg>.convert-old`, `<pkg>` present | garbage: renamed to `<pkg>.migrate-old`, which volume-migrate removes after services start |
//! | `<pkg>.convert-old`, no `<pkg>` | renamed back to `<pkg>` |
//! | `<pkg>.restore-old` and a backup, no `<pkg>` | the backup renamed in, then as the next row |
//! | `<pkg>.restore-old` and a backup, `<pkg>` a recreated empty skeleton | the skeleton moved aside (garbage), then as above |
//! | `<pkg>.restore-old` and a backup, `<pkg>` holding files (upstream's "restore-conflict", left for manual cleanup) | `<pkg>` kept as `<pkg>.restore-conflict` for the operator, then as above |
//! | `<pkg>.restore-old`, no backup, `<pkg>` present | the restore landed: `.restore-old` is garbage (`<pkg>.replaced`) |
//! | `<pkg>.restore-old`, no backup, no `<pkg>` | renamed back to `<pkg>`: the only copy |
//! | a writable `<pkg>.install-backup` (upstream's snapshots are writable) | made read-only, so nothing changes it any more |
//!
//! `<pkg>.install-fresh`, upstream's marker of an install with no volume
//! before it, is state that start-core's install flow reads; it is left to
//! the code that reads it.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use models::{Error, ErrorKind, PackageId, ResultExt};

use crate::layout::Names;
use crate::outcome::VolumeKind;
use crate::store::{Entry, VolumeStore};
use crate::sys::{self, FileType};
use crate::walk::{Step, Walk, is_crossing};

/// Whether the tree open as `dir` holds anything but directories (a file,
/// a symlink, a special file, or a mount), never following a symlink, at
/// any depth ([`crate::walk`]); stops at the first one. A recreated volume
/// root is a skeleton of empty directories.
fn holds_files(dir: BorrowedFd<'_>) -> io::Result<bool> {
    let mut walk = Walk::new(dir, None)?;
    while let Some(step) = walk.step()? {
        let Step::Entry(entry) = step else {
            continue;
        };
        match walk.entry_type(&entry)? {
            None => {}
            Some(FileType::Directory) => match walk.enter(&entry.name) {
                Ok(()) => {}
                Err(e) if is_crossing(&e) => return Ok(true),
                Err(e) => return Err(e),
            },
            Some(_) => return Ok(true),
        }
    }
    Ok(false)
}

impl VolumeStore {
    /// Resolves whatever upstream's own code left for `pkg` (see the module
    /// docs), before this crate's own recovery. Appends what it did.
    pub(super) fn recover_upstream(
        &self,
        pkg: &PackageId,
        names: &Names,
        actions: &mut Vec<String>,
    ) -> Result<(), Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        for (name, what) in [
            (
                &names.upstream_backup_tmp,
                "an interrupted snapshot of upstream's",
            ),
            (
                &names.convert_tmp,
                "an interrupted conversion copy of upstream's",
            ),
        ] {
            if self.tree(pkg, name)?.is_some() {
                self.delete_entry(name)
                    .and_then(|()| self.fsync_root())
                    .with_ctx(io_ctx("deleting an interrupted step of upstream's"))?;
                actions.push(format!("deleted {what}"));
            }
        }
        if self.tree(pkg, &names.convert_old)?.is_some() {
            let action = self
                .settle_convert_old(names)
                .with_ctx(io_ctx("settling upstream's interrupted conversion"))?;
            actions.push(action.to_owned());
        }
        if self.tree(pkg, &names.restore_old)?.is_some() {
            actions.extend(self.settle_restore_old(pkg, names)?);
        }
        if self
            .entry(&names.backup)
            .with_ctx(io_ctx("inspecting the backup"))?
            == Entry::Tree(VolumeKind::Subvolume)
        {
            let backup = sys::open_dir_at(self.root_fd(), &names.backup)
                .with_ctx(io_ctx("opening the backup"))?;
            if !sys::is_read_only(backup.as_fd()).with_ctx(io_ctx("inspecting the backup"))? {
                sys::make_tree_read_only(backup.as_fd())
                    .and_then(|()| sys::commit_metadata(self.root_fd()))
                    .with_ctx(io_ctx("making upstream's writable backup read-only"))?;
                actions.push("made upstream's writable install backup read-only".to_owned());
            }
        }
        Ok(())
    }

    /// `<pkg>.convert-old`: upstream's conversion moved the plain directory
    /// aside, then renamed its copy in (or died first).
    fn settle_convert_old(&self, names: &Names) -> io::Result<&'static str> {
        if !self.exists_at(&names.live)? {
            sys::rename_noreplace(self.root_fd(), &names.convert_old, &names.live)?;
            self.fsync_root()?;
            return Ok(
                "put back the directory an interrupted conversion of upstream's moved aside",
            );
        }
        if self.exists_at(&names.migrate_old)? {
            self.delete_entry(&names.convert_old)?;
        } else {
            sys::rename_noreplace(self.root_fd(), &names.convert_old, &names.migrate_old)?;
        }
        self.fsync_root()?;
        Ok("set aside for removal the directory upstream's conversion replaced")
    }

    /// `<pkg>.restore-old`: upstream's restore moved the live volume aside,
    /// and was to rename the backup in, then delete what it moved aside.
    fn settle_restore_old(&self, pkg: &PackageId, names: &Names) -> Result<Vec<String>, Error> {
        let io_ctx = |what: &'static str| {
            move |_: &io::Error| (ErrorKind::DiskManagement, pkg.context(what))
        };
        let mut actions = Vec::new();
        let backup = self.tree(pkg, &names.backup)?;
        let live = self.tree(pkg, &names.live)?;
        if backup.is_some() {
            // The backup never landed: it is the volume the restore was for.
            if live.is_some() {
                let fd = sys::open_dir_at(self.root_fd(), &names.live)
                    .with_ctx(io_ctx("opening the volume"))?;
                let aside: &OsStr =
                    if holds_files(fd.as_fd()).with_ctx(io_ctx("looking inside the volume"))? {
                        if self
                            .exists_at(&names.restore_conflict)
                            .with_ctx(io_ctx("looking for an earlier conflict"))?
                        {
                            return Err(Error::for_package(
                                pkg,
                                ErrorKind::Incoherent,
                                format!(
                                    "an interrupted restore of upstream's left {} holding files \
                                 beside its backup, and {} already exists; move that away, \
                                 then retry",
                                    self.volume_path(pkg).display(),
                                    self.root.path().join(&names.restore_conflict).display()
                                ),
                            ));
                        }
                        actions.push(format!(
                            "kept what was written into a volume recreated during an \
                         interrupted restore of upstream's as {}",
                            self.root.path().join(&names.restore_conflict).display()
                        ));
                        &names.restore_conflict
                    } else {
                        self.delete_entry(&names.replaced)
                            .with_ctx(io_ctx("deleting the volume a restore replaced"))?;
                        &names.replaced
                    };
                drop(fd);
                sys::rename_noreplace(self.root_fd(), &names.live, aside)
                    .and_then(|()| self.fsync_root())
                    .with_ctx(io_ctx("moving the recreated volume aside"))?;
            }
            sys::rename_noreplace(self.root_fd(), &names.backup, &names.live)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("renaming upstream's backup in"))?;
            actions.push("finished an interrupted restore of upstream's".to_owned());
        } else if live.is_none() {
            // The backup is gone and nothing came back: this is the only copy.
            sys::rename_noreplace(self.root_fd(), &names.restore_old, &names.live)
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx(
                    "putting back the volume upstream's restore moved aside",
                ))?;
            actions.push(
                "put back the only copy an interrupted restore of upstream's left".to_owned(),
            );
            return Ok(actions);
        }
        // The restore landed: what it moved aside is garbage.
        if self.tree(pkg, &names.restore_old)?.is_some() {
            self.delete_entry(&names.replaced)
                .and_then(|()| {
                    sys::rename_noreplace(self.root_fd(), &names.restore_old, &names.replaced)
                })
                .and_then(|()| self.fsync_root())
                .with_ctx(io_ctx("setting aside what upstream's restore replaced"))?;
            actions.push("set aside for deletion what upstream's restore replaced".to_owned());
        }
        Ok(actions)
    }
}
