//! The drop-in for start-core's own `volume` module: the same names and
//! call shapes, on [`volume::VolumeStore`] and [`volume_migrate::Migrator`].
//!
//! Upstream's `src/volume.rs` becomes a re-export of this module, its
//! `crate::Error` gains one `From<models::Error>` impl, and its
//! `PhaseProgressTrackerHandle` implements [`BootProgress`] in a few lines
//! (`docs/upstream.md` has the whole wiring). Where upstream's protocol is
//! sound this keeps its contract; where it can lose data this one is
//! stronger, and says so on each item:
//! - [`InstallBackup::restore`] is one `RENAME_EXCHANGE`: the volume path
//!   is never empty (upstream renames the live volume away, then the backup
//!   in);
//! - nested subvolumes are snapshotted and restored with their read-only
//!   flags (upstream's snapshot shows them as empty directories, and its
//!   restore deletes their data with the replaced tree);
//! - a `false` from [`InstallBackup::snapshot`] is always logged with why,
//!   and [`InstallBackup::snapshot_outcome`] returns the reason;
//! - a dependent's mount of the volume (upstream's dependency `mount`
//!   effect) never makes [`InstallBackup::restore`] or [`delete_tree`]
//!   fail, and what is written through it is never deleted while it is
//!   mounted: the tree it shows is kept until then (upstream deletes it);
//! - the only good copy of a package's volume is never deleted
//!   ([`InstallBackup::begin`] puts back a backup that has no live volume
//!   beside it rather than deleting it, deciding under one hold of the
//!   package's lock); a package the database no longer lists is another
//!   matter: [`delete_tree`] and the boot sweep remove its backup, as
//!   upstream's uninstall and sweep do, so an uninstall stays one;
//! - every interrupted step of upstream's own code that a box upgraded from
//!   its release may carry is resolved with nothing lost (see
//!   [`volume::VolumeStore::recover`]).
//!
//! Ids are whatever upstream passes (its `PackageId`, `VolumeId`,
//! `VersionString`): anything that displays as the id. Each is validated
//! here; an invalid one is an `InvalidId` error, and never makes a path
//! outside the volumes root.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::{Path, PathBuf};

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, VolumeId};

use crate::blocking::blocking;

/// Package volumes, relative to the data directory (upstream's constant).
pub const PKG_VOLUME_DIR: &str = volume::PKG_VOLUME_DIR;
/// Where backups to a backup target are mounted (upstream's constant).
pub const BACKUP_DIR: &str = "/media/startos/backups";

/// One path component for an id that must be `valid`: the id itself, or,
/// for one that is not (upstream's own types never hold one), `%` and its
/// bytes in hex: one component, never `.` or `..`, never a package's name
/// (`%` is in no valid id). Logged, as it means a caller's bug.
fn component(id: &str, valid: bool) -> String {
    if valid {
        return id.to_owned();
    }
    tracing::error!("invalid id {id:?} in a volume path; escaped");
    // A leading `%` even for an empty id, so it still is one component.
    std::iter::once("%".to_owned())
        .chain(id.bytes().map(|b| format!("{b:02x}")))
        .collect()
}

/// Upstream's `SYSTEM_PACKAGE_ID` (`id/package.rs`, from `SYSTEM_ID` in
/// `id/mod.rs`): a `PackageId` its deserializer makes from this string,
/// though its own pattern rejects the `_`. Upstream's paths join it raw;
/// so do these, as it is one safe component (no `/`, not `.` or `..`, no
/// `.` to meet a suffixed name).
const UPSTREAM_SYSTEM_PACKAGE_ID: &str = "x_system";

/// A package's component: every id upstream's `PackageId` can hold from
/// its parser or deserializer is joined raw, as upstream joins it.
fn package_component(pkg_id: &impl Display) -> String {
    let id = pkg_id.to_string();
    let valid = id == UPSTREAM_SYSTEM_PACKAGE_ID || id.parse::<PackageId>().is_ok();
    component(&id, valid)
}

/// `<datadir>/package-data/volumes/<pkg>/data/<volume>`, where a volume is
/// bind-mounted into the package's container: upstream's path, byte for
/// byte, for every id its `PackageId` and `VolumeId` can hold (its system
/// package id `x_system` included); any other id is escaped into one
/// component, logged, rather than joined.
pub fn data_dir<P: AsRef<Path>>(
    datadir: P,
    pkg_id: &(impl Display + ?Sized),
    volume_id: &(impl Display + ?Sized),
) -> PathBuf {
    let vol = volume_id.to_string();
    let valid = vol.parse::<VolumeId>().is_ok();
    datadir
        .as_ref()
        .join(PKG_VOLUME_DIR)
        .join(package_component(&pkg_id))
        .join("data")
        .join(component(&vol, valid))
}

/// `<datadir>/package-data/volumes/<pkg>/assets/<version>`.
pub fn asset_dir<P: AsRef<Path>>(
    datadir: P,
    pkg_id: &(impl Display + ?Sized),
    version: &(impl Display + ?Sized),
) -> PathBuf {
    let v = version.to_string();
    let valid = !v.is_empty() && v != "." && v != ".." && !v.contains(['/', '\0']);
    datadir
        .as_ref()
        .join(PKG_VOLUME_DIR)
        .join(package_component(&pkg_id))
        .join("assets")
        .join(component(&v, valid))
}

/// `/media/startos/backups/<pkg>/data`.
pub fn backup_dir(pkg_id: &(impl Display + ?Sized)) -> PathBuf {
    Path::new(BACKUP_DIR)
        .join(package_component(&pkg_id))
        .join("data")
}

/// How long a call of this module (but those below) waits for a package's
/// lock, which another operation of the same package holds, before failing
/// with `Timeout` naming the holder's pid (nothing changed). The caller
/// cannot see the wait: it awaits a future, and dropping it does not stop
/// the wait (see [`InstallBackup`]). Every legitimate holder is far
/// quicker: the store's operations take milliseconds (a plain directory's
/// reflink backup, bounded by its extent limit, up to about a second), the
/// boot cleanup gives the lock up after each batch of a few milliseconds,
/// and a conversion of the package, which can take minutes, runs before
/// its service is loaded. So a wait this long is a holder that hangs.
/// [`delete_tree`] of a volume and [`convert_package_to_subvolume`] wait
/// without bound, as failing costs more: an uninstall has dropped the
/// package from the database by then, and a volume left would greet a
/// reinstall; the 0.3.6 migration would skip installing the package. So
/// do the boot's conversions, each before its service is loaded.
pub const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs the backend's operation `f` on `root` and `pkg` off the async
/// runtime, its error naming `pkg` if it does not yet: a step on the whole
/// volumes root (opening it) failed for this package's call, and start-core
/// logs and notifies per package.
async fn on_package<T: Send + 'static>(
    root: PathBuf,
    pkg: PackageId,
    f: fn(&Path, &PackageId) -> Result<T, Error>,
) -> Result<T, Error> {
    let named = pkg.clone();
    blocking(move || f(&root, &pkg)).await.map_err(|e| {
        match e.to_string().contains(named.as_str()) {
            true => e,
            false => Error::new(e.source.wrap_err(format!("package {named}")), e.kind),
        }
    })
}

/// The volumes root on a StartOS server.
pub fn volumes_root() -> PathBuf {
    volume::default_root()
}

/// A package id parsed and checked for every name derived from it.
fn parse_package(pkg_id: &str) -> Result<PackageId, Error> {
    let pkg: PackageId = pkg_id.parse()?;
    volume::layout::check_id_len(&pkg)?;
    Ok(pkg)
}

/// A package's install backup and the protocol around it, as upstream's:
/// [`InstallBackup::begin`] before an install, [`InstallBackup::snapshot`]
/// once the old service is stopped, then [`InstallBackup::remove`] on
/// success or [`InstallBackup::restore`] on failure.
///
/// Every call first finishes or undoes whatever a crash left for the
/// package ([`InstallBackup::resolve_pending`]), under the package's lock.
///
/// Each call runs on tokio's blocking pool. Dropping its future (a
/// `select!`, a timeout, a cancelled install) does not stop it: the
/// operation goes on to its end on that thread, as one atomic step of the
/// store, and leaves the package as before or as after it, never between;
/// what it returns is lost with the future. A call waits for the
/// package's lock at most [`LOCK_PATIENCE`], then fails naming the holder.
pub struct InstallBackup {
    root: PathBuf,
    pkg: Result<PackageId, String>,
}

impl InstallBackup {
    /// The install backup of `pkg_id` under upstream's volumes root.
    pub fn of(pkg_id: &(impl Display + ?Sized)) -> Self {
        Self::at(volumes_root(), pkg_id)
    }

    /// The install backup of `pkg_id` under `volumes_root` (tests, image
    /// builds).
    pub fn at(volumes_root: impl Into<PathBuf>, pkg_id: &(impl Display + ?Sized)) -> Self {
        let id = pkg_id.to_string();
        InstallBackup {
            root: volumes_root.into(),
            pkg: parse_package(&id).map_err(|_| id),
        }
    }

    fn package(&self) -> Result<PackageId, Error> {
        match &self.pkg {
            Ok(p) => Ok(p.clone()),
            Err(id) => parse_package(id),
        }
    }

    /// The package as given, valid or not, for log lines.
    fn name(&self) -> &str {
        match &self.pkg {
            Ok(p) => p.as_str(),
            Err(id) => id,
        }
    }

    /// Runs `f` (one of the backend's operations) on the volumes root and
    /// the package, off the async runtime.
    async fn run<T: Send + 'static>(
        &self,
        f: fn(&Path, &PackageId) -> Result<T, Error>,
    ) -> Result<T, Error> {
        on_package(self.root.clone(), self.package()?, f).await
    }

    /// Whether the backup `<pkg>.install-backup` exists, once whatever a
    /// crash left is finished or undone (a backup a restore was past its
    /// exchange with is spent: the volume is it). `false` for an invalid id
    /// or when it cannot be told.
    pub async fn exists(&self) -> bool {
        self.run(backend::exists).await.unwrap_or(false)
    }

    /// Before an install: resolves a pending restore, discards the previous
    /// backup, and marks a rootless install (`<pkg>.install-fresh`), as
    /// upstream. Stronger: a backup with no live volume beside it is the
    /// only copy of the data, so it is put back as the volume rather than
    /// deleted.
    pub async fn begin(&self) -> Result<(), Error> {
        self.run(backend::begin).await
    }

    /// Whether [`InstallBackup::begin`] found no volume.
    pub async fn is_fresh(&self) -> bool {
        self.run(backend::is_fresh).await.unwrap_or(false)
    }

    /// Takes the backup: a read-only snapshot, nested subvolumes included,
    /// in milliseconds; for a volume that is still a plain directory, a
    /// reflink copy (NOCOW files included) within the extent bound. `true`
    /// if a backup now exists. `false` (a fresh install, not btrfs, a
    /// plain directory too fragmented to copy) is always logged with why;
    /// see [`InstallBackup::snapshot_outcome`] for the reason as data. An
    /// earlier backup left by an install that skipped `begin` is replaced,
    /// decided under the same hold of the lock as the snapshot
    /// ([`volume::VolumeStore::snapshot_replacing`]): one with no live
    /// volume beside it is the only copy, and kept. A snapshot that fails
    /// is an `Err` naming the package and the step (upstream logs it and
    /// returns `Ok(false)`): an update must not go on without the rollback
    /// point it asked for.
    pub async fn snapshot(&self) -> Result<bool, Error> {
        let outcome = self.snapshot_outcome().await?;
        match &outcome {
            volume::SnapshotOutcome::Skipped { reason } => {
                tracing::warn!(package = %self.name(), "no install backup: {reason}");
            }
            volume::SnapshotOutcome::NoVolume => {
                tracing::info!(package = %self.name(), "no install backup: no volume yet (a fresh install)");
            }
            _ => {}
        }
        Ok(outcome.created())
    }

    /// [`InstallBackup::snapshot`], with what it did.
    pub async fn snapshot_outcome(&self) -> Result<volume::SnapshotOutcome, Error> {
        self.run(backend::snapshot).await
    }

    /// Rolls the volume back to the backup and consumes it; a no-op
    /// without one, logged as a warning when there is a volume it leaves
    /// as the failed install wrote it (not a fresh install). One `RENAME_EXCHANGE`: the volume path holds the
    /// complete old or the complete restored volume at every instant
    /// (upstream's path is empty between two renames), nested subvolumes
    /// included. A mount of the volume, in any mount namespace (a
    /// dependent's bind mount of its `data_dir`), never makes it fail: the
    /// replaced volume it still shows is kept, not deleted, until no mount
    /// holds it, and the holders (pid, mount point) are named in a warning;
    /// see [`InstallBackup::restore_outcome`] for them as data. Returns in
    /// milliseconds whatever the volumes hold: the replaced one is deleted
    /// after, in a background thread ([`volume::purge`]). Past the
    /// exchange the rollback is done: a failure in the cleanup after it is
    /// logged, not returned (start-core would report a failed rollback and
    /// fail the load of a package rolled back), and the next call for the
    /// package finishes it ([`volume::RestoreOutcome::unfinished`]).
    pub async fn restore(&self) -> Result<(), Error> {
        self.restore_outcome().await.map(drop)
    }

    /// [`InstallBackup::restore`], with what it did: whether it restored,
    /// and the replaced volume if a mount held it (where it is kept, and
    /// the processes holding it, to restart so they see the restored one).
    pub async fn restore_outcome(&self) -> Result<volume::RestoreOutcome, Error> {
        self.run(backend::restore).await
    }

    /// Finishes or undoes whatever a crash interrupted for the package,
    /// this crate's operations and upstream's own alike (see
    /// [`volume::VolumeStore::recover`]). Idempotent.
    pub async fn resolve_pending(&self) -> Result<(), Error> {
        self.run(backend::resolve_pending).await
    }

    /// Once the install is over: drops the fresh marker and the backup.
    pub async fn remove(&self) -> Result<(), Error> {
        self.run(backend::remove).await
    }
}

/// Makes sure the package's volume exists, creating it empty if missing (a
/// subvolume on btrfs, else a directory), after resolving whatever a crash
/// left for it.
pub async fn ensure_volume_root(pkg_id: &(impl Display + ?Sized)) -> Result<(), Error> {
    ensure_volume_root_at(volumes_root(), pkg_id).await
}

/// [`ensure_volume_root`] under `volumes_root`.
pub async fn ensure_volume_root_at(
    volumes_root: impl Into<PathBuf>,
    pkg_id: &(impl Display + ?Sized),
) -> Result<(), Error> {
    let pkg = parse_package(&pkg_id.to_string())?;
    on_package(volumes_root.into(), pkg, backend::ensure).await
}

/// Makes everything written so far in the package's volume durable: on
/// btrfs one commit after its dirty data is written out, elsewhere
/// `syncfs`. For start-core between a new version's init and the commit
/// of `Installed`: the state store's fsync makes only its own file
/// durable, so without this a power cut can keep `Installed` and lose the
/// init's writes it vouches for, and the next boot runs the new version
/// on the old version's data. Takes no lock and changes nothing; a crash
/// in the middle leaves the volume as it was. Nothing to do without a
/// volume.
pub async fn sync_volume_root(pkg_id: &(impl Display + ?Sized)) -> Result<(), Error> {
    sync_volume_root_at(volumes_root(), pkg_id).await
}

/// [`sync_volume_root`] under `volumes_root`.
pub async fn sync_volume_root_at(
    volumes_root: impl Into<PathBuf>,
    pkg_id: &(impl Display + ?Sized),
) -> Result<(), Error> {
    let pkg = parse_package(&pkg_id.to_string())?;
    on_package(volumes_root.into(), pkg, backend::sync).await
}

/// Deletes whatever is at `path` (upstream's `util::btrfs::delete_tree`,
/// which its uninstall cleanup calls on a package's volume root): a
/// package's volume root under upstream's volumes root goes with every
/// name of the package, its backup included, so a hard uninstall leaves
/// nothing a reinstall could find; anything else is deleted in place,
/// as upstream's; see [`delete_tree_at`]. A dependent's mount of the
/// volume never makes it fail: the volume leaves its name, and is kept as
/// `<pkg>.held/<n>` (the holders named in a warning) until no mount holds
/// it, then deleted by the package's next operation or the next boot, the
/// last of the package's names to go. A volume no mount holds is moved to
/// the volumes root's trash and deleted after, in a background thread
/// ([`volume::purge`]): this returns in milliseconds whatever it holds.
pub async fn delete_tree(path: impl AsRef<Path>) -> Result<(), Error> {
    delete_tree_at(volumes_root(), path).await
}

/// [`delete_tree`], with `volumes_root` the volumes root: only a direct
/// child of it named as a package is a volume (see
/// [`volume::delete_tree_in`]); the same name anywhere else is a plain
/// tree, deleted with no package lock and nothing done beside it.
pub async fn delete_tree_at(
    volumes_root: impl Into<PathBuf>,
    path: impl AsRef<Path>,
) -> Result<(), Error> {
    let root = volumes_root.into();
    let path = path.as_ref().to_owned();
    blocking(move || backend::delete_tree(&root, &path)).await
}

/// Where boot maintenance reports to: upstream's
/// `PhaseProgressTrackerHandle` implements it with a few lines of glue
/// (`docs/upstream.md`).
pub trait BootProgress {
    /// Bytes to convert in all.
    fn set_total(&mut self, bytes: u64);
    /// Bytes converted so far.
    fn set_done(&mut self, bytes: u64);
    /// `pkg`'s volume is ready (already a subvolume, or just converted):
    /// its service may start now, whatever the other packages still need.
    fn package_ready(&mut self, pkg: &str) {
        let _ = pkg;
    }
}

/// What [`boot_volume_maintenance`] did.
#[derive(Debug)]
pub struct BootMaintenance {
    /// What recovery finished or undid, package by package.
    pub recovered: Vec<volume::Recovery>,
    /// Installed packages whose volume is ready, in the order they became
    /// so.
    pub ready: Vec<PackageId>,
    /// Packages whose recovery or conversion failed, with why; each keeps
    /// its volume as it was (a plain directory still gets a reflink
    /// backup before updates).
    pub failed: Vec<(PackageId, Error)>,
    /// The removal of the plain directories the conversions replaced,
    /// running in the background after the function returned (O(their
    /// extents)); await it, or let it run. Resolves to the packages cleaned.
    pub cleanup: Option<tokio::task::JoinHandle<Result<Vec<PackageId>, Error>>>,
}

/// An event from the blocking boot work to the caller's progress handle.
pub(crate) enum BootEvent {
    Total(u64),
    Done(u64),
    Ready(PackageId),
}

/// Boot-time maintenance, before any service starts: finishes or undoes
/// whatever a crash left for every package (this crate's operations and
/// upstream's own), sweeps what upstream's sweep sweeps (the backups and
/// fresh markers of packages no longer in the database), then converts
/// each installed package's plain-directory volume into a subvolume with
/// volume-migrate (resumable after a crash, every attribute kept), and
/// reports each package ready as soon as its own volume is. The old
/// directories are removed afterwards, in the background
/// ([`BootMaintenance::cleanup`]). A package's failure is reported and the
/// others go on; only an unreadable volumes root is an error.
pub async fn boot_volume_maintenance<'a, P: Display + 'a>(
    installed: impl IntoIterator<Item = &'a P>,
    all: impl IntoIterator<Item = &'a P>,
    progress: &mut impl BootProgress,
) -> Result<BootMaintenance, Error> {
    boot_volume_maintenance_at(volumes_root(), installed, all, progress).await
}

/// [`boot_volume_maintenance`] under `volumes_root`.
pub async fn boot_volume_maintenance_at<'a, P: Display + 'a>(
    volumes_root: impl Into<PathBuf>,
    installed: impl IntoIterator<Item = &'a P>,
    all: impl IntoIterator<Item = &'a P>,
    progress: &mut impl BootProgress,
) -> Result<BootMaintenance, Error> {
    let root = volumes_root.into();
    let ids = |set: &mut dyn Iterator<Item = String>| -> BTreeSet<String> { set.collect() };
    let installed = ids(&mut installed.into_iter().map(|p| p.to_string()));
    let all = ids(&mut all.into_iter().map(|p| p.to_string()));
    if !root.exists() {
        return Ok(BootMaintenance {
            recovered: Vec::new(),
            ready: Vec::new(),
            failed: Vec::new(),
            cleanup: None,
        });
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let work = {
        let root = root.clone();
        crate::blocking::spawn_walk(move || backend::boot(&root, &installed, &all, &tx))
    };
    let mut ready = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            BootEvent::Total(b) => progress.set_total(b),
            BootEvent::Done(b) => progress.set_done(b),
            BootEvent::Ready(pkg) => {
                progress.package_ready(pkg.as_str());
                ready.push(pkg);
            }
        }
    }
    let (recovered, failed, old_trees) = work
        .await
        .map_err(|e| Error::new(eyre!("boot maintenance task: {e}"), ErrorKind::Unknown))??;
    let cleanup = old_trees.then(|| crate::blocking::spawn_walk(move || backend::cleanup(&root)));
    Ok(BootMaintenance {
        recovered,
        ready,
        failed,
        cleanup,
    })
}

/// Converts one package's plain-directory volume into a subvolume
/// (upstream calls it for a package migrated from 0.3.x before installing
/// it), and removes the old directory; a failure of that is only logged,
/// the directory left as `<pkg>.migrate-old` for the next boot's cleanup.
/// A no-op for a subvolume, off btrfs, or with no volumes root.
pub async fn convert_package_to_subvolume(pkg_id: &(impl Display + ?Sized)) -> Result<(), Error> {
    convert_package_to_subvolume_at(volumes_root(), pkg_id).await
}

/// [`convert_package_to_subvolume`] under `volumes_root`.
pub async fn convert_package_to_subvolume_at(
    volumes_root: impl Into<PathBuf>,
    pkg_id: &(impl Display + ?Sized),
) -> Result<(), Error> {
    let pkg = parse_package(&pkg_id.to_string())?;
    on_package(volumes_root.into(), pkg, backend::convert).await
}

/// The volume store and volume-migrate, on Linux.
#[cfg(target_os = "linux")]
mod backend;

#[cfg(not(target_os = "linux"))]
mod portable;
#[cfg(not(target_os = "linux"))]
use portable as backend;
