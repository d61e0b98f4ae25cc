//! The [`Migrator`]: the volumes root opened for conversion, and the
//! packages under it with anything to convert (Linux only). What it does
//! with them is in the modules above this one, each adding methods: how a
//! run is planned in `plan`, one package's conversion in `convert`, the
//! removal of what it leaves in `cleanup`, a whole run in `run`. Each
//! method that changes anything holds the package's volume lock, so what a
//! crash leaves is the per-package state the crate docs describe.

use std::os::fd::BorrowedFd;
use std::path::Path;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::layout::{
    MIGRATE_OLD_SUFFIX, MIGRATE_PARENT_SUFFIX, MIGRATE_REST_SUFFIX, MIGRATE_SUFFIX, package_of,
};
use volume::lock::PackageLock;
use volume::sys;

use crate::options::{MetadataRoom, MigrateOptions};
use crate::report::Skipped;
use crate::state::Kind;

/// Converts the plain directories under one volumes root. Open it with
/// [`Migrator::open`]; every method that changes anything takes the
/// package's volume lock.
///
/// The root itself is trusted; everything inside a volume is not: names are
/// resolved relative to open directories, nothing is followed through a
/// symlink, only directories and regular files are ever opened.
pub struct Migrator {
    pub(crate) root: volume::Root,
    /// Entries removed so far by this migrator's cuts of shares, rests and
    /// old trees ([`Migrator::entries_removed`]).
    pub(crate) removed: std::sync::atomic::AtomicU64,
    /// The shares' locks, for conversions running at once (the `pool`
    /// module).
    pub(crate) share_locks: crate::split::ShareLocks,
    /// Taken for a clone: one at a time, also among conversions running
    /// at once (`convert`).
    pub(crate) clone_turn: std::sync::Mutex<()>,
}

impl Migrator {
    /// Opens the volumes root. `NotFound` if it does not exist,
    /// `InvalidRequest` if it is not a directory. Works on any filesystem;
    /// off btrfs every call does nothing ([`Migrator::is_btrfs`]).
    pub fn open(root: impl AsRef<Path>) -> Result<Self, Error> {
        Ok(Migrator {
            root: volume::Root::open(root)?,
            removed: std::sync::atomic::AtomicU64::new(0),
            share_locks: Default::default(),
            clone_turn: Default::default(),
        })
    }

    /// Every entry this migrator has removed so far, at any depth: from the
    /// shares it cut (the `split` module), the rests of deferred cuts and
    /// the old trees. The background work of a run, in entries, whatever
    /// the wall clock says.
    pub fn entries_removed(&self) -> u64 {
        self.removed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts one more entry removed ([`Migrator::entries_removed`]).
    pub(crate) fn count_removed(&self) {
        self.removed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The canonical volumes root.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Whether the root is on btrfs. If not, there is nothing to convert and
    /// every call reports nothing.
    pub fn is_btrfs(&self) -> bool {
        self.root.is_btrfs()
    }

    /// Why there is nothing to convert off btrfs, naming the root and its
    /// filesystem (see [`volume::Root::why_not_btrfs`]); `None` on btrfs.
    pub fn why_not_btrfs(&self) -> Option<String> {
        self.root.why_not_btrfs()
    }

    pub(crate) fn root_fd(&self) -> BorrowedFd<'_> {
        self.root.fd()
    }

    /// Packages with anything for the conversion to do, sorted: `<pkg>` a
    /// plain directory, or a `<pkg>.migrate`, `<pkg>.migrate-parent`,
    /// `<pkg>.migrate-old` or `<pkg>.migrate-rest` left by an interrupted
    /// run. Empty off btrfs. Each entry under a package's name that is no
    /// package volume ([`Migrator::skipped`]) is passed over with a
    /// warning, once a call: the run, the plan and the cleanup list the
    /// packages again without one, so that a caller calls this (or
    /// [`Migrator::skipped`]) once and each entry is said once.
    pub fn packages(&self) -> Result<Vec<PackageId>, Error> {
        let (packages, skipped) = self.listing()?;
        for s in &skipped {
            tracing::warn!("skipped {}: {}", s.path.display(), s.why);
        }
        Ok(packages)
    }

    /// The entries under the root that [`Migrator::packages`] passes over,
    /// sorted by name, each with why: named as a package but no directory
    /// (a file, a symlink, a FIFO), or a name no package id fits. Nothing
    /// converts them and nothing touches them. Empty off btrfs. Reads only.
    pub fn skipped(&self) -> Result<Vec<Skipped>, Error> {
        Ok(self.listing()?.1)
    }

    /// [`Migrator::packages`] without the warnings, and what it passes
    /// over.
    pub(crate) fn listing(&self) -> Result<(Vec<PackageId>, Vec<Skipped>), Error> {
        if !self.root.is_btrfs() {
            return Ok((Vec::new(), Vec::new()));
        }
        let entries = sys::read_dir_names(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("reading {}", self.root.path().display()),
            )
        })?;
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        let mut skip = |name: &std::ffi::OsStr, why: String| {
            skipped.push(Skipped {
                name: name.to_string_lossy().into_owned(),
                path: self.root.path().join(name),
                why,
            })
        };
        for (name, _, _) in entries {
            let pkg = match package_of(&name) {
                Some(Ok(pkg)) => pkg,
                // No package's, whatever it holds: reported, left alone,
                // and no reason to stop the others.
                Some(Err(e)) => {
                    skip(&name, format!("not a package volume: {e}"));
                    continue;
                }
                None => continue,
            };
            let s = name.to_string_lossy();
            let relevant = if s == pkg.as_str() {
                match Kind::of(&self.root, &name)
                    .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("inspecting the volume")))?
                {
                    Kind::Dir => true,
                    Kind::Other => {
                        // Not a volume, whatever its name: nothing to
                        // convert, and no reason to stop the others.
                        skip(&name, "not a directory, so not a package volume".to_owned());
                        false
                    }
                    Kind::Subvolume | Kind::Absent => false,
                }
            } else {
                [
                    MIGRATE_SUFFIX,
                    MIGRATE_PARENT_SUFFIX,
                    MIGRATE_OLD_SUFFIX,
                    MIGRATE_REST_SUFFIX,
                ]
                .iter()
                .any(|suffix| s.ends_with(suffix))
            };
            if relevant {
                out.push(pkg);
            }
        }
        out.sort();
        out.dedup();
        skipped.sort_by(|a, b| a.name.cmp(&b.name));
        Ok((out, skipped))
    }

    pub(crate) fn lock(&self, pkg: &PackageId) -> Result<PackageLock, Error> {
        PackageLock::for_package(self.root_fd(), pkg).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("taking the package lock"),
            )
        })
    }

    /// The metadata bytes the filesystem holding the root can still take,
    /// and the reserve `opts` keeps, as [`Migrator::convert`] reads them
    /// before converting; for a dry run to show beside the estimates'
    /// [`crate::Estimate::metadata_bytes`]. Off btrfs, `None`.
    pub fn metadata_room(&self, opts: &MigrateOptions) -> Result<Option<MetadataRoom>, Error> {
        if !self.root.is_btrfs() {
            return Ok(None);
        }
        sys::metadata_space(self.root_fd())
            .map(|space| Some(MetadataRoom::of(&space, opts)))
            .with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    format!(
                        "reading the metadata space of the filesystem holding {}",
                        self.root.path().display()
                    ),
                )
            })
    }

    /// The metadata space of the filesystem (see [`sys::MetadataSpace`]).
    pub(crate) fn metadata_space(&self, pkg: &PackageId) -> Result<sys::MetadataSpace, Error> {
        sys::metadata_space(self.root_fd()).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("reading the filesystem's metadata space"),
            )
        })
    }
}
