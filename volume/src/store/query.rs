//! What is under the root, read without changing anything: whether a
//! package has anything there, how its trees are stored, their real space
//! use, the mounts from inside its volume; and upstream's fresh-install
//! marker, which [`VolumeStore::mark_fresh`] sets or clears in one atomic
//! step.

use std::ffi::OsStr;
use std::io;
use std::os::fd::AsFd;

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt};
use serde::Serialize;

use super::{Entry, VolumeStore};
use crate::layout::{self, Names};
use crate::mounts::{self, MountUse};
use crate::outcome::VolumeInfo;
use crate::sys::{self, FileType};
use crate::usage::{self, Split, Usage};

/// Real space use of a package's volume and backup ([`VolumeStore::usage`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeUsage {
    /// The package.
    pub package: PackageId,
    /// The live volume, nested subvolumes included; `None` if it has none.
    pub volume: Option<Usage>,
    /// The install backup; `None` if it has none.
    pub backup: Option<Usage>,
    /// With a backup: disk bytes held by it and not by the live volume (at
    /// most what dropping it frees: no other tree is compared, see
    /// [`Split::backup_only`]), by the live volume and not the backup, and
    /// by both.
    ///
    /// [`Split::backup_only`]: crate::usage::Split::backup_only
    pub split: Option<Split>,
}

impl VolumeStore {
    /// Whether `pkg` has anything under the root: a volume, a backup, or
    /// any of the names an operation passes through. Without any, every
    /// operation but `create` has nothing to do, and takes no lock.
    pub fn exists(&self, pkg: &PackageId) -> Result<bool, Error> {
        Ok(self.present(pkg)?.is_some())
    }

    /// Every mount, in any mount namespace, that exposes something inside
    /// `<pkg>` (see [`mounts::uses_of`]): what goes on showing the old
    /// volume after a restore, or a deleted one, which is then kept under
    /// `<pkg>.held` until that mount is gone. A caller that can stop the
    /// processes holding them (start-core, through its services) does so
    /// first, and starts them again after.
    pub fn mount_uses(&self, pkg: &PackageId) -> Result<Vec<MountUse>, Error> {
        mounts::uses_of(&self.volume_path(pkg)).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the mount tables of every mount namespace"),
            )
        })
    }

    /// How `pkg`'s volume and backup are stored, each `None` if absent. An
    /// entry under the package's name that is no directory is an error
    /// naming it. Reads its names (and the entries of `<pkg>.held`); takes
    /// no lock.
    pub fn info(&self, pkg: &PackageId) -> Result<VolumeInfo, Error> {
        let names = Names::new(pkg)?;
        Ok(VolumeInfo {
            package: pkg.clone(),
            volume: self.tree(pkg, &names.live)?,
            backup: self.tree(pkg, &names.backup)?,
            leftovers: self.other_names(pkg, &names)?,
        })
    }

    /// The names of `pkg` present under the root beside its volume and
    /// backup (and the backup's read-only record), whatever they hold; each
    /// tree kept while mounted as `<pkg>.held/<n>`.
    fn other_names(&self, pkg: &PackageId, names: &Names) -> Result<Vec<String>, Error> {
        let mut out = Vec::new();
        let theirs = [&names.live, &names.backup, &names.backup_ro].map(|n| n.as_os_str());
        for name in names.all() {
            if theirs.contains(&name) {
                continue;
            }
            if name == names.held {
                let held = self.held_trees(pkg, names)?;
                let base = names.held.to_string_lossy();
                out.extend(
                    held.iter()
                        .map(|n| format!("{base}/{}", n.to_string_lossy())),
                );
                if held.is_empty() && self.tree(pkg, name)?.is_some() {
                    out.push(base.into_owned());
                }
                continue;
            }
            if self
                .exists_at(name)
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("looking for its names")))?
            {
                out.push(name.to_string_lossy().into_owned());
            }
        }
        Ok(out)
    }

    /// Every package that has anything under the root, with how its volume
    /// and backup are stored and what else of it is there. An entry under a
    /// package's name that is no directory is no volume: it is skipped with
    /// a warning, and the listing goes on; so is an entry that cannot be
    /// read, with why.
    pub fn list(&self) -> Result<Vec<VolumeInfo>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            let Ok(names) = Names::new(&pkg) else {
                continue;
            };
            let tree = |name: &OsStr| match self.tree(&pkg, name) {
                Ok(kind) => kind,
                Err(e) => {
                    tracing::warn!("skipped: {e}");
                    None
                }
            };
            let volume = tree(&names.live);
            let backup = tree(&names.backup);
            let leftovers = self.other_names(&pkg, &names).unwrap_or_else(|e| {
                tracing::warn!("{e}");
                Vec::new()
            });
            if volume.is_some() || backup.is_some() || !leftovers.is_empty() {
                out.push(VolumeInfo {
                    package: pkg,
                    volume,
                    backup,
                    leftovers,
                });
            }
        }
        Ok(out)
    }

    /// Every package with any entry under the root, sorted. A name too
    /// long to be a package's is reported (a warning naming it) and passed
    /// over: it blocks no other package.
    pub(super) fn packages(&self) -> Result<Vec<PackageId>, Error> {
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.path().display()),
            )
        })?;
        let mut pkgs = Vec::new();
        for (name, _, _) in &entries {
            match layout::package_of(name) {
                Some(Ok(pkg)) => pkgs.push(pkg),
                Some(Err(e)) => tracing::warn!(
                    "skipped {}: not a package volume: {e}",
                    self.root.path().join(name).display()
                ),
                None => {}
            }
        }
        pkgs.sort();
        pkgs.dedup();
        Ok(pkgs)
    }

    /// Real space use of the package's volume and backup, read from their
    /// file extent items (no qgroups), with the figures compsize prints, and
    /// how the disk bytes split between the two. Read-only; waits for any
    /// operation running on the package.
    pub fn usage(&self, pkg: &PackageId) -> Result<VolumeUsage, Error> {
        let none = VolumeUsage {
            package: pkg.clone(),
            volume: None,
            backup: None,
            split: None,
        };
        let Some(names) = self.present(pkg)? else {
            return Ok(none);
        };
        let held = self.hold_for_read(pkg, names)?;
        let names = &held.names;
        let measure = |name: &OsStr| -> Result<Option<(Usage, usage::ExtentSet)>, Error> {
            let io_ctx = |_: &io::Error| {
                (
                    ErrorKind::DiskManagement,
                    pkg.context(format!(
                        "measuring {}",
                        self.root.path().join(name).display()
                    )),
                )
            };
            if self.tree(pkg, name)?.is_none() {
                return Ok(None);
            }
            if !self.root.is_btrfs() {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    "space accounting needs btrfs; the volumes root is not on btrfs",
                ));
            }
            let fd = sys::open_dir_at(self.root_fd(), name).with_ctx(io_ctx)?;
            usage::tree_usage(fd.as_fd()).map(Some).map_err(|e| {
                if crate::walk::is_crossing(&e) {
                    return Error::for_package(
                        pkg,
                        ErrorKind::InvalidRequest,
                        format!(
                            "measuring {}: {e}; a plain directory is measured by walking it",
                            self.root.path().join(name).display()
                        ),
                    );
                }
                let (kind, what) = io_ctx(&e);
                Error::new(eyre!(e).wrap_err(what), kind)
            })
        };
        let volume = measure(&names.live)?;
        let backup = measure(&names.backup)?;
        let split = match (&volume, &backup) {
            (Some((_, live)), Some((_, bak))) => Some(usage::split(live, bak)),
            (None, Some((_, bak))) => Some(usage::split(&usage::ExtentSet::default(), bak)),
            _ => None,
        };
        Ok(VolumeUsage {
            volume: volume.map(|(u, _)| u),
            backup: backup.map(|(u, _)| u),
            split,
            ..none
        })
    }

    /// Sets or clears upstream's `<pkg>.install-fresh` marker (an empty
    /// regular file): an install with no volume before it, whose rollback
    /// deletes the volume it made. One atomic step each way.
    pub fn mark_fresh(&self, pkg: &PackageId, fresh: bool) -> Result<(), Error> {
        let held = self.hold(pkg, Names::new(pkg)?)?;
        self.mark_fresh_locked(pkg, &held.names.fresh, fresh)
    }

    pub(super) fn mark_fresh_locked(
        &self,
        pkg: &PackageId,
        name: &OsStr,
        fresh: bool,
    ) -> Result<(), Error> {
        let ctx = |_: &io::Error| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!(
                    "{} the fresh-install marker",
                    if fresh { "writing" } else { "removing" }
                )),
            )
        };
        match self.entry(name).with_ctx(ctx)? {
            Entry::Other(FileType::RegularFile) if !fresh => {
                sys::unlink_if_exists(self.root_fd(), name).with_ctx(ctx)?
            }
            Entry::Absent if fresh => sys::touch_at(self.root_fd(), name, 0o600).with_ctx(ctx)?,
            Entry::Absent | Entry::Other(FileType::RegularFile) => return Ok(()),
            Entry::Tree(_) | Entry::Other(_) => {
                return Err(Error::for_package(
                    pkg,
                    ErrorKind::InvalidRequest,
                    format!(
                        "{} is not a regular file, so no fresh-install marker; move it away",
                        self.root.path().join(name).display()
                    ),
                ));
            }
        }
        self.fsync_root().with_ctx(ctx)
    }

    /// Whether upstream's `<pkg>.install-fresh` marker is there.
    pub fn is_fresh(&self, pkg: &PackageId) -> Result<bool, Error> {
        let names = Names::new(pkg)?;
        self.exists_at(&names.fresh).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("looking for the fresh-install marker"),
            )
        })
    }

    /// Every package with upstream's fresh-install marker.
    pub fn fresh_packages(&self) -> Result<Vec<PackageId>, Error> {
        let mut out = Vec::new();
        for pkg in self.packages()? {
            if self.is_fresh(&pkg)? {
                out.push(pkg);
            }
        }
        Ok(out)
    }
}
