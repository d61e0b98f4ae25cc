//! The volume store: package volumes as btrfs subvolumes under one root.
//!
//! Layout, as upstream: `<root>/<pkg>/data/<volume-id>/`, and the install
//! backup at `<root>/<pkg>.install-backup`. On btrfs `<pkg>` is a subvolume and
//! the backup a read-only snapshot of it; every other name a package uses is
//! listed in [`crate::layout`].
//!
//! Every operation takes the package's lock ([`crate::lock`]), first
//! finishes or undoes whatever a crash left behind for that package
//! ([`VolumeStore::recover`]), then runs. At every instant, and after a
//! crash at any point, `<pkg>` is either the complete volume before the
//! operation or the complete volume after it, and `<pkg>.install-backup` is
//! either absent or a complete backup. An operation that fails puts back
//! what it changed before returning the error, so the disk is as it was
//! before the call (a step past the operation's commit point is left for
//! recovery to finish instead).
//!
//! ## What decides recovery
//!
//! Only names in the volumes root, their types, and the records this crate
//! writes there ([`crate::record`]): never anything inside a volume, which
//! the package's own processes write. The states, per operation:
//!
//! - **snapshot**: `<pkg>.install-backup.tmp` exists until the complete,
//!   frozen snapshot is renamed to `<pkg>.install-backup`: a `.tmp` is
//!   always incomplete, deleted. `<pkg>.install-backup.ro`, the record of
//!   the read-only nested subvolumes, is written before that rename and is
//!   garbage without a backup.
//! - **restore**: the writable copy `<pkg>.rollback` is made, then the
//!   record `<pkg>.rollback.id` naming that copy's identity (subvolume UUID,
//!   or inode and birth time of a plain directory) once it is complete and
//!   committed, then one `RENAME_EXCHANGE` swaps it with `<pkg>`, then the
//!   replaced volume moves to `<pkg>.replaced`, the backup is dropped, and
//!   the record removed. Without the record, `.rollback` is an incomplete
//!   copy (deleted; the backup stays). With it, whichever of `<pkg>` and
//!   `<pkg>.rollback` has the recorded identity is the restored volume:
//!   `<pkg>` means the exchange happened (finish), `.rollback` that it did
//!   not (exchange, then finish).
//! - **drop**: the backup is renamed to `.install-backup.drop`, garbage,
//!   made writable and moved into the trash, then committed; recovery
//!   moves a `.drop` a crash left into the trash.
//! - **delete**: `<pkg>` is renamed to `<pkg>.delete`, the commit point;
//!   while `.delete` exists the delete is under way, so recovery drops the
//!   backup, then deletes `.delete`, last.
//! - `<pkg>.replaced` is always garbage; moved to the trash, or, while a
//!   mount in any namespace holds it, into `<pkg>.held`.
//! - **trash** ([`trash`]): a tree no package uses any more and no mount
//!   holds (the volume a restore replaced, a deleted one) is moved, in one
//!   rename under the package's lock, into `.trash` (no package's name),
//!   and deleted from there after the lock is released: everything there
//!   is garbage.
//! - **kept while mounted** ([`held`]): the volume a restore replaced, or
//!   a deleted one (`.delete`), that a mount still holds is moved into
//!   `<pkg>.held/<n>` in one rename rather than deleted; an entry there is
//!   garbage once no mount holds it, moved to the trash by recovery, then
//!   the empty directory removed. No mount ever makes a restore or a
//!   delete fail.
//!
//! ## Where each operation lives
//!
//! Here: the store, its opening, the helpers the operations share, and
//! [`Held`], the one way an operation takes its package (names, lock, and
//! recovery where it recovers first). The operations, one family a file:
//! [`create`], [`snapshot`], [`restore`], [`removal`] (with [`held`], the
//! trees kept while mounted, and [`trash`], where the trees no package
//! uses any more wait to be deleted off the lock), [`install`] (upstream's `begin` and
//! `snapshot`, each decided under one hold), [`recovery`] (with
//! what upstream's own code leaves behind, in `recovery/upstream.rs`) and
//! [`query`].

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt, VolumeId};

use crate::layout::{self, Names};
use crate::lock::{LockDir, LockWait, PackageLock};
use crate::outcome::VolumeKind;
use crate::root::Root;
use crate::sys::{self, FileType};

mod create;
mod held;
mod install;
mod query;
mod recovery;
mod removal;
mod restore;
mod snapshot;
mod trash;

pub use install::Begun;
pub use query::VolumeUsage;
pub use removal::{delete_tree, delete_tree_at, delete_tree_in, delete_tree_in_deferring_purge};
pub use trash::empty_trash_at;

/// Default bound on the extent count of a plain (not yet converted) volume
/// directory for which a reflink backup is still taken. At the ~6.7 us per
/// extent measured for `cp --reflink`, 100k extents is well under a second.
pub const DEFAULT_REFLINK_EXTENT_LIMIT: u64 = 100_000;

/// What an entry of the volumes root is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Absent,
    Tree(VolumeKind),
    /// Not a directory: no volume of ours, whatever its name.
    Other(FileType),
}

/// A file type in words, for messages.
fn type_name(ty: FileType) -> &'static str {
    match ty {
        FileType::RegularFile => "a regular file",
        FileType::Symlink => "a symlink",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Directory => "a directory",
        _ => "not a directory",
    }
}

/// Package volumes under one root directory (upstream:
/// `/media/startos/data/package-data/volumes`).
///
/// The root itself is trusted; everything inside a volume is not. All names
/// are resolved relative to the root's open file descriptor and never through
/// a symlink.
pub struct VolumeStore {
    root: Root,
    reflink_extent_limit: u64,
    locks: LockDir,
    read_wait: LockWait,
    change_wait: LockWait,
    /// Who empties the trash after an operation ([`trash`]).
    purge: trash::Purge,
}

/// A package held for one operation: its names, and its lock until this is
/// dropped. Only [`VolumeStore::hold`] and its variants make one, so every
/// operation takes the names, the lock and (where it does) recovery the
/// same way and in the same order; an operation keeps it to its end.
struct Held {
    /// What the package owns under the root.
    names: Names,
    _lock: PackageLock,
}

/// The lock directory of the volumes root open as `dir`, with the error
/// every caller reports.
fn open_locks(root: &Path, dir: BorrowedFd<'_>) -> Result<LockDir, Error> {
    LockDir::for_root(dir).with_ctx(|_| {
        (
            ErrorKind::Filesystem,
            format!(
                "opening the lock directory of {} under {}",
                root.display(),
                crate::lock::LOCK_DIR
            ),
        )
    })
}

/// The directory `name` of the root open as `root`, open; made, and the
/// root synced, if it was absent: where the store keeps trees it numbers
/// (`<pkg>.held`, the trash).
fn dir_made(root: BorrowedFd<'_>, name: &OsStr) -> io::Result<OwnedFd> {
    match sys::mkdir_at(root, name, 0o700) {
        Ok(()) => sys::fsync(root)?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    sys::open_dir_at(root, name)
}

/// The entry name `<prefix><n>` after the highest such `n` in the
/// directory open as `dir` (`<prefix>1` if there is none). Only the store
/// names entries there, each under the lock of the package it is for.
fn next_numbered(dir: BorrowedFd<'_>, prefix: &str) -> io::Result<OsString> {
    let highest = sys::read_dir_names(dir)?
        .iter()
        .filter_map(|(name, _, _)| name.to_str()?.strip_prefix(prefix)?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    Ok(OsString::from(format!("{prefix}{}", highest + 1)))
}

/// Appends to `e` that undoing the failed step failed too, if it did.
fn with_cleanup(e: Error, cleanup: io::Result<()>, what: &str) -> Error {
    match cleanup {
        Ok(()) => e,
        Err(c) => {
            let kind = e.kind;
            Error::new(
                e.source.wrap_err(format!(
                    "{what} failed too ({c}); the next operation retries"
                )),
                kind,
            )
        }
    }
}

impl VolumeStore {
    /// Opens the store at `root` (which must be an existing directory) and
    /// finishes or undoes every operation a crash interrupted, for all
    /// packages, each under its own lock, several at once
    /// ([`VolumeStore::recover_all`]).
    pub fn open(root: impl AsRef<Path>) -> Result<Self, Error> {
        let store = Self::open_without_recovery(root)?;
        store.recover_all()?;
        Ok(store)
    }

    /// Opens the store without running recovery. Operations still recover
    /// their own package before running.
    pub fn open_without_recovery(root: impl AsRef<Path>) -> Result<Self, Error> {
        let root = Root::open(root)?;
        let locks = open_locks(root.path(), root.fd())?;
        Ok(VolumeStore {
            root,
            reflink_extent_limit: DEFAULT_REFLINK_EXTENT_LIMIT,
            locks,
            read_wait: LockWait::Forever,
            change_wait: LockWait::Forever,
            purge: trash::Purge::Inline,
        })
    }

    /// Sets the extent bound above which a plain directory gets no reflink
    /// backup (see [`DEFAULT_REFLINK_EXTENT_LIMIT`]).
    pub fn with_reflink_extent_limit(mut self, limit: u64) -> Self {
        self.reflink_extent_limit = limit;
        self
    }

    /// Sets how long the commands that only read or recover ([`usage`],
    /// [`recover`], [`recover_all`]) wait for a package another process
    /// holds before reporting it busy (`Timeout`, naming the holder's pid):
    /// [`LockWait::Forever`] by default. Operations that change a package
    /// wait as [`VolumeStore::with_change_wait`] says.
    ///
    /// [`usage`]: VolumeStore::usage
    /// [`recover`]: VolumeStore::recover
    /// [`recover_all`]: VolumeStore::recover_all
    pub fn with_lock_wait(mut self, wait: LockWait) -> Self {
        self.read_wait = wait;
        self
    }

    /// Sets how long the operations that change a package wait for its
    /// lock before failing (`Timeout`, naming the holder's pid, with
    /// nothing changed): [`LockWait::Forever`] by default, where an
    /// operator sees the wait (the CLI). A caller that cannot see it (a
    /// service load awaiting a future) bounds it, so that a holder that
    /// hangs (a stopped process, a stuck mount) shows as an error naming it
    /// rather than as a load that never returns.
    pub fn with_change_wait(mut self, wait: LockWait) -> Self {
        self.change_wait = wait;
        self
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Whether the root is on btrfs.
    pub fn is_btrfs(&self) -> bool {
        self.root.is_btrfs()
    }

    /// Why volumes here are plain directories with no snapshots, naming
    /// the root and its filesystem (see [`crate::Root::why_not_btrfs`]);
    /// `None` on btrfs.
    pub fn why_not_btrfs(&self) -> Option<String> {
        self.root.why_not_btrfs()
    }

    /// `<root>/<pkg>`, the package's volume.
    pub fn volume_path(&self, pkg: &PackageId) -> PathBuf {
        self.root.path().join(pkg.as_str())
    }

    /// `<root>/<pkg>.install-backup`.
    pub fn backup_path(&self, pkg: &PackageId) -> PathBuf {
        self.root
            .path()
            .join(format!("{pkg}{}", layout::INSTALL_BACKUP_SUFFIX))
    }

    /// `<root>/<pkg>/data/<volume>`, where the service sees its volume.
    pub fn data_dir(&self, pkg: &PackageId, volume: &VolumeId) -> PathBuf {
        self.volume_path(pkg).join("data").join(volume.as_str())
    }

    fn root_fd(&self) -> BorrowedFd<'_> {
        self.root.fd()
    }

    /// The names of `pkg` if it has anything under the root (see
    /// [`VolumeStore::exists`]); `None` when it has nothing, so the
    /// operation has nothing to do and takes no lock.
    fn present(&self, pkg: &PackageId) -> Result<Option<Names>, Error> {
        let names = Names::new(pkg)?;
        Ok(self.any_name(pkg, &names)?.then_some(names))
    }

    /// Holds `pkg`, whose names are `names`, for an operation that changes
    /// it: takes its lock, waiting its turn as long as
    /// [`VolumeStore::with_change_wait`] lets it. Nothing else: for the
    /// operations that must not recover first.
    fn hold(&self, pkg: &PackageId, names: Names) -> Result<Held, Error> {
        let lock = self.lock_with(pkg, self.change_wait)?;
        Ok(Held { names, _lock: lock })
    }

    /// [`VolumeStore::hold`], then finishes or undoes whatever a crash left
    /// for the package ([`VolumeStore::recover`]): how an operation that
    /// changes a package starts, so it runs on one of the states the
    /// store's docs list and on no half-done one.
    fn hold_recovered(&self, pkg: &PackageId, names: Names) -> Result<Held, Error> {
        let held = self.hold(pkg, names)?;
        self.recover_locked(pkg, &held.names)?;
        Ok(held)
    }

    /// Holds `pkg` for a command that only reads or recovers: waits for its
    /// lock as [`VolumeStore::with_lock_wait`] set, then `Timeout`, naming
    /// the holder.
    fn hold_for_read(&self, pkg: &PackageId, names: Names) -> Result<Held, Error> {
        let lock = self.lock_with(pkg, self.read_wait)?;
        Ok(Held { names, _lock: lock })
    }

    fn lock_with(&self, pkg: &PackageId, wait: LockWait) -> Result<PackageLock, Error> {
        self.locks
            .lock_with(pkg, wait)
            .map_err(|e| match crate::lock::busy(&e) {
                Some(busy) => Error::for_package(pkg, ErrorKind::Timeout, busy),
                None => Error::new(
                    eyre!(e).wrap_err(pkg.context(format!(
                        "taking the package lock in {}",
                        self.locks.path().display()
                    ))),
                    ErrorKind::Filesystem,
                ),
            })
    }

    fn stat(&self, name: &OsStr) -> io::Result<Option<sys::Stat>> {
        sys::stat_at(self.root_fd(), name)
    }

    fn exists_at(&self, name: &OsStr) -> io::Result<bool> {
        Ok(self.stat(name)?.is_some())
    }

    fn any_name(&self, pkg: &PackageId, names: &Names) -> Result<bool, Error> {
        for name in names.all() {
            if self
                .exists_at(name)
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("looking for its names")))?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What the entry `name` of the root is.
    fn entry(&self, name: &OsStr) -> io::Result<Entry> {
        match self.stat(name)? {
            None => Ok(Entry::Absent),
            Some(st) if !st.is_dir() => Ok(Entry::Other(st.file_type)),
            Some(_) => {
                let fd = match sys::open_dir_at(self.root_fd(), name) {
                    // Removed since the stat: for a reader without the
                    // package's lock (`info`, `list`), as if looked at after.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Entry::Absent),
                    fd => fd?,
                };
                Ok(Entry::Tree(if sys::is_subvolume(fd.as_fd())? {
                    VolumeKind::Subvolume
                } else {
                    VolumeKind::Directory
                }))
            }
        }
    }

    /// How the tree `name` is stored, `None` if absent; an error naming the
    /// entry if it is not a directory (no volume or backup of ours).
    fn tree(&self, pkg: &PackageId, name: &OsStr) -> Result<Option<VolumeKind>, Error> {
        let path = self.root.path().join(name);
        match self.entry(name).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context(format!("inspecting {}", path.display())),
            )
        })? {
            Entry::Absent => Ok(None),
            Entry::Tree(kind) => Ok(Some(kind)),
            Entry::Other(ty) => Err(Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!(
                    "{} is {}, not a package volume; move it out of the volumes root",
                    path.display(),
                    type_name(ty)
                ),
            )),
        }
    }

    fn fsync_root(&self) -> io::Result<()> {
        sys::fsync(self.root_fd())
    }

    /// Makes a subvolume's rename (or exchange) in the root durable, by
    /// name: on btrfs by committing the running transaction's metadata
    /// ([`sys::commit_metadata`]), which writes out no file's data. An
    /// fsync of the root would do it too, but only as a side effect: btrfs's
    /// log tree cannot record a subvolume's rename, so that fsync falls back
    /// to a full commit, an implementation detail no durability here rests
    /// on. Off btrfs (plain directories), an fsync of the root.
    fn commit_root(&self) -> io::Result<()> {
        match self.root.is_btrfs() {
            true => sys::commit_metadata(self.root_fd()),
            false => self.fsync_root(),
        }
    }

    /// Removes the entry `name` of the root and everything below it (see
    /// [`delete_tree_at`]).
    ///
    /// Only ever called on transient names, so a crash part-way leaves a
    /// partial tree under a name that recovery deletes again.
    fn delete_entry(&self, name: &OsStr) -> io::Result<()> {
        delete_tree_at(self.root_fd(), name)
    }

    /// Whether the tree `name` can be deleted in one atomic step, under its
    /// own name: a subvolume with no subvolume nested in it (one
    /// `SNAP_DESTROY`, which leaves it either whole or gone, read-only or
    /// not).
    fn can_delete_in_one_step(&self, name: &OsStr) -> io::Result<bool> {
        if self.entry(name)? != Entry::Tree(VolumeKind::Subvolume) {
            return Ok(false);
        }
        let fd = sys::open_dir_at(self.root_fd(), name)?;
        Ok(sys::nested_subvolumes(fd.as_fd())?.is_empty())
    }

    /// Deletes the tree `name` in one atomic step if it can be
    /// ([`VolumeStore::can_delete_in_one_step`]), for when renaming it
    /// aside failed for want of metadata space: a rename needs some, while
    /// deleting a subvolume may draw on the filesystem's global reserve.
    /// Returns whether it did.
    fn one_step_delete(&self, name: &OsStr) -> io::Result<bool> {
        if !self.can_delete_in_one_step(name)? {
            return Ok(false);
        }
        sys::delete_subvolume(self.root_fd(), name, false)?;
        self.fsync_root()?;
        Ok(true)
    }

    /// The error for a step that failed with `e`, saying `what` it was; when
    /// the filesystem ran out of space, also how much metadata space is free
    /// and what to do (snapshots, renames and records need metadata space
    /// only, so a full data space never stops them).
    fn failed(&self, pkg: &PackageId, what: impl std::fmt::Display, e: io::Error) -> Error {
        let root = self.root.path().display();
        let what = match e.raw_os_error() {
            Some(libc::ENOSPC) => {
                // The allocator's figure, for the operator: btrfs refuses a
                // step when what it reserves for it exceeds what is free,
                // which can be more than the step uses.
                let free = match self.root.is_btrfs() {
                    true => sys::metadata_space(self.root_fd())
                        .map(|s| {
                            format!("btrfs counts {} KiB of metadata space free", s.free() >> 10)
                        })
                        .unwrap_or_else(|_| "no figure for the free metadata space".to_owned()),
                    false => "not btrfs".to_owned(),
                };
                format!(
                    "{what}: the filesystem holding {root} is out of space ({free}); this step \
                     needs metadata space only: free some (delete files, or drop another \
                     package's backup) and retry"
                )
            }
            Some(libc::EDQUOT) => format!(
                "{what}: a quota (qgroup limit) on the filesystem holding {root} is reached; \
                 raise or remove it, or free space under it, and retry"
            ),
            _ => what.to_string(),
        };
        Error::new(
            eyre!(e).wrap_err(pkg.context(what)),
            ErrorKind::DiskManagement,
        )
    }

    /// [`VolumeStore::failed`] for a step that walks the volume's tree:
    /// a mount inside it, or a tree deeper than a copy goes, is the
    /// package's shape, refused (`InvalidRequest`) with the path named.
    fn walk_failed(&self, pkg: &PackageId, what: &str, e: io::Error) -> Error {
        if crate::walk::is_crossing(&e) || crate::walk::is_too_deep(&e) {
            return Error::for_package(
                pkg,
                ErrorKind::InvalidRequest,
                format!("{what} of {}: {e}", self.volume_path(pkg).display()),
            );
        }
        self.failed(
            pkg,
            format!("{what} of {}", self.volume_path(pkg).display()),
            e,
        )
    }
}

/// Each subvolume nested in `source`, with the id of its counterpart in
/// `copy`, a recursive snapshot of it ([`sys::match_nested`]). A nested
/// subvolume the copy lacks is an error: the copy is not what it should be.
fn nested_counterparts(
    source: BorrowedFd<'_>,
    copy: BorrowedFd<'_>,
) -> io::Result<Vec<(sys::Nested, u64)>> {
    let sources = sys::nested_subvolumes(source)?;
    if sources.is_empty() {
        return Ok(Vec::new());
    }
    let copies = sys::nested_subvolumes(copy)?;
    let tops = (
        sys::subvolume_info(source)?.id,
        sys::subvolume_info(copy)?.id,
    );
    let found = sys::match_nested(&sources, tops.0, &copies, tops.1);
    sources
        .into_iter()
        .zip(found)
        .map(|(n, j)| match j {
            Some(j) => Ok((n, copies[j].id)),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the copy lacks the subvolume nested as {:?} in its source",
                    n.name
                ),
            )),
        })
        .collect()
}
