//! Upstream's volume code as it is today, restated as a baseline to compare
//! ours against, step by step.
//!
//! Upstream (Start9Labs/start-technologies) keeps its install backups and
//! its boot-time conversion in `shared-libs/crates/start-core/src/volume.rs`
//! (modelled at [`VOLUME_RS_COMMIT`]), on top of `util/btrfs.rs` (the
//! `btrfs` CLI) and `util/clone.rs` (its reflink tree copy), both modelled at
//! [`UTIL_COMMIT`]. This module does what those do, in the same order, with
//! the same names on disk and the same tools (the `btrfs` command for
//! subvolumes, `remove_dir_all` for plain trees, FICLONERANGE in 1 GiB
//! chunks), so that a scenario measures upstream's behaviour rather than
//! an idea of it. It is written anew for this workspace; nothing is copied.
//!
//! Differences, none of which changes what ends up on disk:
//! - upstream is async (tokio); this is blocking. Its byte progress, polled
//!   every 500 ms while a clone runs, is polled the same way here, from the
//!   calling thread while the clone runs on another;
//! - upstream's `btrfs` commands run with a 60 s timeout, never reached in
//!   these scenarios and not modelled;
//! - what upstream logs (`tracing` warnings, and the errors `.log_err()`
//!   swallows) is collected in a [`Log`], so a scenario can show that an
//!   error was only logged;
//! - boot maintenance returns a [`BootReport`] of what it did (upstream
//!   returns `()`), for the measurements.
//!
//! Every step that changes the disk is followed by a named crash site,
//! `upstream.<operation>.<step>` ([`volume::failpoint::failpoint`]): with
//! the `volume/failpoints` feature, naming it in
//! [`volume::FAILPOINT_ENV`] kills the process there (or, with `=enospc`,
//! makes that step fail), as the crash tests do to our own operations.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File, Metadata, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use models::PackageId;
use rustix::fs::{AtFlags, FileType, Gid, IFlags, Mode, Timespec, Timestamps, Uid, XattrFlags};
use volume::failpoint::failpoint;

use crate::run;

/// The commit of upstream's `volume.rs` this module models.
pub const VOLUME_RS_COMMIT: &str = "48408e8c540d322412519feeec119216bb261bfa";
/// The commit of upstream's `util/btrfs.rs` and `util/clone.rs` this module
/// models.
pub const UTIL_COMMIT: &str = "bd14f8664972c44a2d7d926c3dad76a3609e83ab";
/// The commit of upstream's `util/io.rs` (the file helpers `volume.rs`
/// calls) this module models.
pub const IO_RS_COMMIT: &str = "950be49dd13373d1f9021ae943eb72ad59535eac";

/// The install backup: a writable snapshot of the live root.
pub const INSTALL_BACKUP_SUFFIX: &str = ".install-backup";
/// A snapshot being taken, renamed to the backup when complete.
pub const INSTALL_BACKUP_TMP_SUFFIX: &str = ".install-backup-tmp";
/// An empty file: `begin` found no live root (a fresh install).
pub const INSTALL_FRESH_SUFFIX: &str = ".install-fresh";
/// The live root a restore moved aside: while it exists, a restore is
/// under way.
pub const RESTORE_OLD_SUFFIX: &str = ".restore-old";
/// The subvolume a boot conversion clones the plain root into.
pub const CONVERT_TMP_SUFFIX: &str = ".convert-tmp";
/// The plain root a boot conversion replaced, until it is removed.
pub const CONVERT_OLD_SUFFIX: &str = ".convert-old";

/// `BTRFS_FIRST_FREE_OBJECTID`: upstream's test for a subvolume root.
const SUBVOL_INO: u64 = 256;
const BTRFS_SUPER_MAGIC: u32 = 0x9123_683E;
/// `clone.rs`'s clone granularity.
const CLONE_CHUNK: u64 = 1 << 30;
/// How often upstream's boot conversion updates its byte progress.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

// ------------------------------------------------------------------ the log

/// What upstream would have logged: its warnings and infos, and the errors
/// its `.log_err()` calls swallow. Clones share one log.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    /// A new, empty log.
    pub fn new() -> Log {
        Log::default()
    }

    fn push(&self, level: &str, msg: impl fmt::Display) {
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        lines.push(format!("{level}: {msg}"));
    }

    fn info(&self, msg: impl fmt::Display) {
        self.push("info", msg);
    }

    fn warn(&self, msg: impl fmt::Display) {
        self.push("warn", msg);
    }

    /// Upstream's `ResultExt::log_err` (`error.rs`): an error becomes a log
    /// line and is otherwise ignored.
    fn log_err<T>(&self, r: io::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.push("error", e);
                None
            }
        }
    }

    /// Every line so far, oldest first, each prefixed with its level.
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl fmt::Debug for Log {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.lines()).finish()
    }
}

// ------------------------------------------------------------------ errors

/// Upstream's `volume.restore-conflict` refusal (`volume.rs` at
/// [`VOLUME_RS_COMMIT`]): a restore was interrupted between its two renames,
/// and the live path has since gained files, so `resolve_pending` will not pick
/// a winner. Someone must clean up by hand.
#[derive(Debug)]
pub struct RestoreConflict {
    /// The package.
    pub package: String,
}

impl fmt::Display for RestoreConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "restore-conflict: {}: an interrupted restore left files at the volume path \
             beside the backup; manual cleanup needed",
            self.package
        )
    }
}

impl std::error::Error for RestoreConflict {}

/// Whether `e` is upstream's [`RestoreConflict`] refusal.
pub fn is_restore_conflict(e: &io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<RestoreConflict>().is_some())
}

/// `e`, its kind kept, with `what` in front (upstream's `with_ctx`).
fn ctx(what: impl fmt::Display) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A crash site after the step whose result is `r`: an injected error
/// takes that step's error path.
fn step(r: io::Result<()>, site: &str) -> io::Result<()> {
    r.and_then(|()| failpoint(site))
}

fn is_not_found(r: &io::Result<Metadata>) -> bool {
    matches!(r, Err(e) if e.kind() == io::ErrorKind::NotFound)
}

// ------------------------------------------------------------------ util/io.rs

/// Upstream's `create_file` (`util/io.rs` at [`IO_RS_COMMIT`]): makes the
/// parent directories, then creates (or truncates) the file.
pub fn create_file(path: &Path) -> io::Result<File> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(ctx(format!("mkdir -p {}", parent.display())))?;
    }
    File::create(path).map_err(ctx(format!("create {}", path.display())))
}

/// Upstream's `delete_file` (`util/io.rs` at [`IO_RS_COMMIT`]): a missing file
/// is no error.
fn delete_file(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(ctx(format!("delete {}", path.display()))(e))
        }
        _ => Ok(()),
    }
}

/// Upstream's `delete_dir` (`util/io.rs` at [`IO_RS_COMMIT`]):
/// `remove_dir_all`, O(entries and extents); a missing tree is no error.
fn delete_dir(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(ctx(format!("delete dir {}", path.display()))(e))
        }
        _ => Ok(()),
    }
}

/// Upstream's `rename` (`util/io.rs` at [`IO_RS_COMMIT`]): makes the
/// destination's parent directories, then renames.
fn rename(src: &Path, dst: &Path) -> io::Result<()> {
    if let Some(parent) = dst.parent() {
        fs::create_dir_all(parent).map_err(ctx(format!("mkdir -p {}", parent.display())))?;
    }
    fs::rename(src, dst).map_err(ctx(format!("mv {} -> {}", src.display(), dst.display())))
}

/// Upstream's `dir_size` (`util/io.rs` at [`IO_RS_COMMIT`]): the sizes of the
/// regular files below `path`, by a full walk (symlinks not followed, nested
/// subvolumes walked).
pub fn dir_size(path: &Path) -> io::Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        // A directory entry's metadata does not follow a symlink.
        let m = entry.metadata()?;
        if m.is_file() {
            total += m.len();
        } else if m.is_dir() {
            total += dir_size(&entry.path())?;
        }
    }
    Ok(total)
}

// ------------------------------------------------------------------ util/btrfs.rs

/// Upstream's `is_btrfs` (`btrfs.rs` at [`UTIL_COMMIT`]): statfs says btrfs;
/// false on any error.
pub fn is_btrfs(path: &Path) -> bool {
    // The magic is a 32-bit pattern; f_type is signed on some targets.
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type as u32 == BTRFS_SUPER_MAGIC)
}

/// Upstream's `is_subvolume` (`btrfs.rs` at [`UTIL_COMMIT`]): a directory
/// (symlinks followed) with inode 256 on btrfs.
pub fn is_subvolume(path: &Path) -> bool {
    match fs::metadata(path) {
        Ok(m) if m.is_dir() && m.ino() == SUBVOL_INO => is_btrfs(path),
        _ => false,
    }
}

/// One `btrfs` command, as upstream's `Invoke` (`util/mod.rs`) runs it: failure
/// carries its stderr.
fn btrfs_cli(args: &[&str], path: &Path, second: Option<&Path>) -> io::Result<()> {
    let mut cmd = Command::new("btrfs");
    cmd.args(args).arg(path);
    if let Some(p) = second {
        cmd.arg(p);
    }
    run(&mut cmd).map(drop)
}

/// Upstream's `create_subvolume` (`btrfs.rs` at [`UTIL_COMMIT`]): `btrfs
/// subvolume create`.
pub fn create_subvolume(path: &Path) -> io::Result<()> {
    btrfs_cli(&["subvolume", "create"], path, None)
}

/// Upstream's `snapshot_subvolume` (`btrfs.rs` at [`UTIL_COMMIT`]): `btrfs
/// subvolume snapshot`, writable. A nested subvolume shows in the snapshot as
/// an empty directory.
pub fn snapshot_subvolume(src: &Path, dst: &Path) -> io::Result<()> {
    btrfs_cli(&["subvolume", "snapshot"], src, Some(dst))
}

/// Upstream's `nested_subvolumes` (`btrfs.rs` at [`UTIL_COMMIT`]): every
/// subvolume root (inode 256) below `path`, by a full walk, deepest first.
/// Entries whose metadata cannot be read are skipped.
pub fn nested_subvolumes(path: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(ctx(format!("read dir {}", dir.display())))? {
            let entry = entry?;
            let Ok(m) = entry.metadata() else { continue };
            if m.is_dir() {
                if m.ino() == SUBVOL_INO {
                    found.push(entry.path());
                }
                stack.push(entry.path());
            }
        }
    }
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    Ok(found)
}

/// Upstream's private `delete_subvolume` (`btrfs.rs` at [`UTIL_COMMIT`]):
/// `btrfs subvolume delete` of each nested subvolume, deepest first, then of
/// `path`.
fn delete_subvolume(path: &Path) -> io::Result<()> {
    for nested in nested_subvolumes(path)? {
        btrfs_cli(&["subvolume", "delete"], &nested, None)?;
    }
    btrfs_cli(&["subvolume", "delete"], path, None)
}

/// Upstream's `delete_tree` (`btrfs.rs` at [`UTIL_COMMIT`]), which upstream's
/// uninstall calls on a volume root: a subvolume through the `btrfs` CLI,
/// nested ones first; anything else with `remove_dir_all` (O(extents));
/// nothing there is no error.
pub fn delete_tree(path: &Path) -> io::Result<()> {
    if is_subvolume(path) {
        delete_subvolume(path)
    } else {
        delete_dir(path)
    }
}

// ------------------------------------------------------------------ volume.rs: InstallBackup

/// `<dir>/<name><suffix>`: upstream's `with_suffix` (`volume.rs` at
/// [`VOLUME_RS_COMMIT`]), which only ever appends since a package id has no
/// dot.
fn with_suffix(live: &Path, suffix: &str) -> PathBuf {
    let mut name = live.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    live.with_file_name(name)
}

/// Upstream's `InstallBackup` (`volume.rs` at [`VOLUME_RS_COMMIT`]): a
/// package's install backup and the protocol around it, over
/// `<pkg>.install-backup`, `<pkg>.install-backup-tmp`,
/// `<pkg>.install-fresh` and `<pkg>.restore-old`.
pub struct InstallBackup {
    pkg: String,
    live: PathBuf,
    backup: PathBuf,
    backup_tmp: PathBuf,
    fresh: PathBuf,
    restore_old: PathBuf,
    log: Log,
}

impl InstallBackup {
    /// The install backup of `pkg` under the volumes root `volumes`
    /// (upstream's private `new`; its `of` uses the server's root).
    pub fn new(volumes: &Path, pkg: &str) -> InstallBackup {
        InstallBackup::with_log(volumes, pkg, Log::new())
    }

    /// [`InstallBackup::new`], logging to `log`.
    pub fn with_log(volumes: &Path, pkg: &str, log: Log) -> InstallBackup {
        let live = volumes.join(pkg);
        InstallBackup {
            pkg: pkg.to_owned(),
            backup: with_suffix(&live, INSTALL_BACKUP_SUFFIX),
            backup_tmp: with_suffix(&live, INSTALL_BACKUP_TMP_SUFFIX),
            fresh: with_suffix(&live, INSTALL_FRESH_SUFFIX),
            restore_old: with_suffix(&live, RESTORE_OLD_SUFFIX),
            live,
            log,
        }
    }

    /// What this package's calls logged.
    pub fn log(&self) -> &Log {
        &self.log
    }

    /// `<root>/<pkg>`.
    pub fn live(&self) -> &Path {
        &self.live
    }

    /// `<root>/<pkg>.install-backup`.
    pub fn backup(&self) -> &Path {
        &self.backup
    }

    /// `<root>/<pkg>.restore-old`.
    pub fn restore_old(&self) -> &Path {
        &self.restore_old
    }

    /// Upstream's `InstallBackup::exists` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]): `<pkg>.install-backup` is there.
    pub fn exists(&self) -> bool {
        fs::metadata(&self.backup).is_ok()
    }

    /// Upstream's `InstallBackup::begin` (`volume.rs` at [`VOLUME_RS_COMMIT`]):
    /// resolves a pending restore, deletes the previous backup, and creates
    /// `<pkg>.install-fresh` when there is no live root (removes it otherwise).
    pub fn begin(&self) -> io::Result<()> {
        self.resolve_pending()?;
        step(delete_tree(&self.backup), "upstream.begin.backup-deleted")?;
        if is_not_found(&fs::metadata(&self.live)) {
            step(create_file(&self.fresh).map(drop), "upstream.begin.marked")
        } else {
            step(delete_file(&self.fresh), "upstream.begin.marked")
        }
    }

    /// Upstream's `InstallBackup::is_fresh` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]): the fresh marker is there.
    pub fn is_fresh(&self) -> bool {
        fs::metadata(&self.fresh).is_ok()
    }

    /// Upstream's `InstallBackup::snapshot` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]): resolves a pending restore; then, if the live
    /// root is a subvolume, `btrfs subvolume snapshot` of it to
    /// `<pkg>.install-backup-tmp`, deletes the old backup and renames the new
    /// one into place. `Ok(false)`, with a warning, when the root is a plain
    /// directory or any of those steps fails; an error only when resolving the
    /// pending restore does. Upstream's caller ignores the `bool`.
    pub fn snapshot(&self) -> io::Result<bool> {
        self.resolve_pending()?;
        if !is_subvolume(&self.live) {
            if fs::metadata(&self.live).is_ok() {
                self.log.warn(format_args!(
                    "Could not create install backup for {}: volume root is not a btrfs subvolume",
                    self.pkg
                ));
            }
            return Ok(false);
        }
        self.log.log_err(delete_tree(&self.backup_tmp));
        let staged = step(
            snapshot_subvolume(&self.live, &self.backup_tmp),
            "upstream.snapshot.staged",
        )
        .and_then(|()| {
            step(
                delete_tree(&self.backup),
                "upstream.snapshot.old-backup-deleted",
            )
        })
        .and_then(|()| {
            step(
                rename(&self.backup_tmp, &self.backup),
                "upstream.snapshot.renamed",
            )
        });
        if let Err(e) = staged {
            self.log.warn(format_args!(
                "Could not create install backup for {}: {e}",
                self.pkg
            ));
            self.log.log_err(delete_tree(&self.backup_tmp));
            return Ok(false);
        }
        self.log.info(format_args!(
            "Created install backup for {} at {}",
            self.pkg,
            self.backup.display()
        ));
        Ok(true)
    }

    /// Upstream's `InstallBackup::restore` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]): a no-op without a backup; otherwise deletes a
    /// stale `<pkg>.restore-old`, renames the live root to `<pkg>.restore-old`
    /// (from here until the next rename there is no volume at the path),
    /// renames the backup to the live root, then deletes `<pkg>.restore-old`
    /// (its failure only logged), nested subvolumes with it.
    pub fn restore(&self) -> io::Result<()> {
        if !self.exists() {
            return Ok(());
        }
        step(
            delete_tree(&self.restore_old),
            "upstream.restore.old-cleared",
        )?;
        if fs::metadata(&self.live).is_ok() {
            rename(&self.live, &self.restore_old)?;
        }
        failpoint("upstream.restore.live-moved")?;
        step(
            rename(&self.backup, &self.live),
            "upstream.restore.backup-moved",
        )?;
        self.log.log_err(step(
            delete_tree(&self.restore_old),
            "upstream.restore.old-deleted",
        ));
        self.log.info(format_args!(
            "Restored volumes from install backup for {}",
            self.pkg
        ));
        Ok(())
    }

    /// Upstream's `InstallBackup::resolve_pending` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]), which every other call runs first: with no
    /// `<pkg>.restore-old`, nothing to do. With one and a backup, the backup
    /// never landed: if the live path holds anything but directories, refuse
    /// ([`RestoreConflict`]); otherwise delete what is there, rename the backup
    /// in, and delete `<pkg>.restore-old`. With no backup and no live root, the
    /// restore-old tree is the only copy and is renamed back; with no backup
    /// but a live root, the restore had finished and `<pkg>.restore-old` is
    /// deleted.
    pub fn resolve_pending(&self) -> io::Result<()> {
        if fs::metadata(&self.restore_old).is_err() {
            return Ok(());
        }
        if self.exists() {
            if holds_files(&self.live)? {
                return Err(io::Error::other(RestoreConflict {
                    package: self.pkg.clone(),
                }));
            }
            step(delete_tree(&self.live), "upstream.resolve.live-cleared")?;
            step(
                rename(&self.backup, &self.live),
                "upstream.resolve.backup-moved",
            )?;
        } else if fs::metadata(&self.live).is_err() {
            step(
                rename(&self.restore_old, &self.live),
                "upstream.resolve.old-moved-back",
            )?;
            self.log.info(format_args!(
                "Completed interrupted volume restore for {}",
                self.pkg
            ));
            return Ok(());
        }
        step(
            delete_tree(&self.restore_old),
            "upstream.resolve.old-deleted",
        )?;
        self.log.info(format_args!(
            "Completed interrupted volume restore for {}",
            self.pkg
        ));
        Ok(())
    }

    /// Upstream's `InstallBackup::remove` (`volume.rs` at
    /// [`VOLUME_RS_COMMIT`]): deletes the fresh marker, resolves a pending
    /// restore, deletes the backup.
    pub fn remove(&self) -> io::Result<()> {
        delete_file(&self.fresh)?;
        self.resolve_pending()?;
        step(delete_tree(&self.backup), "upstream.remove.backup-deleted")
    }
}

/// Upstream's `holds_files` (`volume.rs` at [`VOLUME_RS_COMMIT`]): anything but
/// directories below `path` (a missing directory holds nothing).
fn holds_files(path: &Path) -> io::Result<bool> {
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ctx(format!("read dir {}", dir.display()))(e)),
        };
        for entry in entries {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                stack.push(entry.path());
            } else {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Upstream's `ensure_volume_root` (`volume.rs` at [`VOLUME_RS_COMMIT`]):
/// resolves a pending restore, then, if `<volumes>/<pkg>` is missing, creates
/// it as a subvolume on btrfs (a plain directory if that fails, or off btrfs).
pub fn ensure_volume_root(volumes: &Path, pkg: &str, log: &Log) -> io::Result<()> {
    InstallBackup::with_log(volumes, pkg, log.clone()).resolve_pending()?;
    let path = volumes.join(pkg);
    if fs::metadata(&path).is_ok() {
        return Ok(());
    }
    fs::create_dir_all(volumes).map_err(ctx(format!("mkdir -p {}", volumes.display())))?;
    if is_btrfs(volumes) {
        match create_subvolume(&path) {
            Ok(()) => return Ok(()),
            Err(e) => log.warn(format_args!("Could not create subvolume for {pkg}: {e}")),
        }
    }
    fs::create_dir_all(&path).map_err(ctx(format!("mkdir -p {}", path.display())))
}

// ------------------------------------------------------------------ volume.rs: boot

/// What one package's boot conversion did (upstream logs it; this module
/// measures it).
#[derive(Clone, Debug)]
pub struct Conversion {
    /// The package.
    pub package: String,
    /// Its size by the full walk that sized it.
    pub bytes: u64,
    /// Bytes `clone_tree` cloned (all of them again after a crash: the
    /// partial copy is deleted at boot).
    pub cloned: u64,
    /// Creating the subvolume and cloning into it.
    pub clone_time: Duration,
    /// The inline `remove_dir_all` of the old tree.
    pub removal_time: Duration,
    /// Whether the old tree was removed (its failure is only logged, and
    /// the tree stays as `<pkg>.convert-old`).
    pub old_removed: bool,
    /// Why the conversion failed (only logged upstream; the package stays
    /// a plain directory).
    pub error: Option<String>,
}

/// What [`boot_volume_maintenance`] did.
#[derive(Clone, Debug, Default)]
pub struct BootReport {
    /// The conversions, in the order they ran.
    pub conversions: Vec<Conversion>,
    /// Everything upstream would have logged.
    pub log: Vec<String>,
}

/// Upstream's `boot_volume_maintenance` (`volume.rs` at
/// [`VOLUME_RS_COMMIT`]), which its boot runs before any service starts and
/// whose error is only logged: does nothing without a volumes root;
/// otherwise [`recover_and_sweep`], then converts each installed package's
/// plain root into a subvolume: every one sized by a full walk first, then
/// one after the other cloned, swapped in, and its old tree removed
/// inline. Per-package failures are only logged. Every service waits for
/// all of it. `progress` gets the byte total, then bytes done every
/// 500 ms during a clone and after each package (never `package_ready`:
/// upstream has no such signal).
pub fn boot_volume_maintenance(
    volumes: &Path,
    installed: &BTreeSet<PackageId>,
    all: &BTreeSet<PackageId>,
    progress: &mut impl startos_core::volume::BootProgress,
) -> io::Result<BootReport> {
    let log = Log::new();
    let mut report = BootReport::default();
    if fs::metadata(volumes).is_err() {
        return Ok(report);
    }
    recover_and_sweep(volumes, installed, all, &log)?;
    convert_to_subvolumes(volumes, installed, progress, &log, &mut report.conversions);
    report.log = log.lines();
    Ok(report)
}

/// Upstream's `recover_and_sweep` (`volume.rs` at [`VOLUME_RS_COMMIT`]), boot's
/// first step. Two passes over the root's names (those that are UTF-8). First:
/// deletes every `*.convert-tmp` and `*.install-backup-tmp`, and resolves every
/// `*.restore-old` ([`InstallBackup::resolve_pending`]). Second: a
/// `*.convert-old` is deleted if its package's root exists and renamed back to
/// it otherwise; a `*.install-backup` of a package in the database but not
/// installed (mid-install) is left alone, of one with no live root is renamed
/// to the root, and of one no longer in the database deleted; a
/// `*.install-fresh` of an installed or unknown package is deleted. Every
/// failure is only logged.
pub fn recover_and_sweep(
    volumes: &Path,
    installed: &BTreeSet<PackageId>,
    all: &BTreeSet<PackageId>,
    log: &Log,
) -> io::Result<()> {
    let mut names = Vec::new();
    for entry in fs::read_dir(volumes).map_err(ctx(format!("read dir {}", volumes.display())))? {
        if let Some(name) = entry?.file_name().to_str() {
            names.push(name.to_owned());
        }
    }
    for name in &names {
        if name.ends_with(CONVERT_TMP_SUFFIX) || name.ends_with(INSTALL_BACKUP_TMP_SUFFIX) {
            log.log_err(step(
                delete_tree(&volumes.join(name)),
                "upstream.sweep.tmp-deleted",
            ));
        } else if let Some(owner) = name.strip_suffix(RESTORE_OLD_SUFFIX)
            && owner.parse::<PackageId>().is_ok()
        {
            log.log_err(InstallBackup::with_log(volumes, owner, log.clone()).resolve_pending());
        }
    }
    for name in &names {
        let entry = volumes.join(name);
        if let Some(owner) = name.strip_suffix(CONVERT_OLD_SUFFIX) {
            let live = volumes.join(owner);
            if fs::metadata(&live).is_ok() {
                log.log_err(step(delete_tree(&entry), "upstream.sweep.convert-old"));
            } else {
                log.log_err(step(rename(&entry, &live), "upstream.sweep.convert-old"));
            }
        } else if let Some(owner) = name.strip_suffix(INSTALL_BACKUP_SUFFIX) {
            let Ok(id) = owner.parse::<PackageId>() else {
                continue;
            };
            if !installed.contains(&id) && all.contains(&id) {
                continue;
            }
            let live = volumes.join(owner);
            if fs::metadata(&live).is_err() {
                log.info(format_args!(
                    "Completing interrupted volume restore for {owner}"
                ));
                log.log_err(step(rename(&entry, &live), "upstream.sweep.backup"));
            } else if !all.contains(&id) {
                log.info(format_args!(
                    "Removing orphaned install backup {}",
                    entry.display()
                ));
                log.log_err(step(delete_tree(&entry), "upstream.sweep.backup"));
            }
        } else if let Some(owner) = name.strip_suffix(INSTALL_FRESH_SUFFIX) {
            let Ok(id) = owner.parse::<PackageId>() else {
                continue;
            };
            if installed.contains(&id) || !all.contains(&id) {
                log.log_err(delete_file(&entry));
            }
        }
    }
    Ok(())
}

/// Upstream's `needs_subvolume_conversion` (`volume.rs` at
/// [`VOLUME_RS_COMMIT`]): a directory, not a subvolume, on btrfs.
fn needs_subvolume_conversion(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_dir()) && !is_subvolume(path) && is_btrfs(path)
}

/// Upstream's `convert_package_to_subvolume` (`volume.rs` at
/// [`VOLUME_RS_COMMIT`]), which its 0.3.6 migration calls before installing a
/// migrated package: `convert_one` if the root needs it, with no progress.
pub fn convert_package_to_subvolume(volumes: &Path, pkg: &str, log: &Log) -> io::Result<()> {
    let src = volumes.join(pkg);
    if needs_subvolume_conversion(&src) {
        convert_one(pkg, &src, None, log).map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// Upstream's `convert_to_subvolumes` (`volume.rs` at [`VOLUME_RS_COMMIT`]):
/// sizes every installed plain root first (a failure drops that package,
/// logged), sets the total, then converts them one by one, a failure only
/// logged.
fn convert_to_subvolumes(
    volumes: &Path,
    installed: &BTreeSet<PackageId>,
    progress: &mut impl startos_core::volume::BootProgress,
    log: &Log,
    done_list: &mut Vec<Conversion>,
) {
    let pending: Vec<(String, PathBuf)> = installed
        .iter()
        .map(|id| (id.to_string(), volumes.join(id.as_str())))
        .filter(|(_, src)| needs_subvolume_conversion(src))
        .collect();
    if pending.is_empty() {
        return;
    }
    let mut sized = Vec::new();
    let mut total = 0;
    for (id, src) in pending {
        match dir_size(&src) {
            Ok(size) => {
                total += size;
                sized.push((id, src, size));
            }
            Err(e) => log.warn(format_args!(
                "Could not size volumes of {id} for conversion: {e}"
            )),
        }
    }
    progress.set_total(total);
    let mut done = 0;
    for (id, src, size) in sized {
        let conversion = convert_one(&id, &src, Some((&mut *progress, done)), log);
        let conversion = match conversion {
            Ok(c) => c,
            Err((e, c)) => {
                log.warn(format_args!(
                    "Could not convert volumes of {id} to a subvolume: {e}"
                ));
                c
            }
        };
        done_list.push(Conversion {
            bytes: size,
            ..conversion
        });
        done += size;
        progress.set_done(done);
    }
}

/// Upstream's `convert_one` (`volume.rs` at [`VOLUME_RS_COMMIT`]): deletes a
/// stale `<pkg>.convert-tmp`, creates it as a subvolume (`btrfs subvolume
/// create`), [`clone_tree`]s the plain root into it (progress every 500 ms),
/// renames the root to `<pkg>.convert-old` (from here until the next rename
/// there is no volume at the path), the new subvolume to the root, then
/// `remove_dir_all`s the old tree inline, its failure only logged. A failed
/// clone or rename deletes the new subvolume (and puts the root back). No fsync
/// anywhere. Returns what it did, also on failure.
fn convert_one(
    id: &str,
    src: &Path,
    progress: Option<(&mut dyn startos_core::volume::BootProgress, u64)>,
    log: &Log,
) -> Result<Conversion, (io::Error, Conversion)> {
    let start = Instant::now();
    let tmp = with_suffix(src, CONVERT_TMP_SUFFIX);
    let old = with_suffix(src, CONVERT_OLD_SUFFIX);
    let ctr = AtomicU64::new(0);
    let mut conversion = Conversion {
        package: id.to_owned(),
        bytes: 0,
        cloned: 0,
        clone_time: Duration::ZERO,
        removal_time: Duration::ZERO,
        old_removed: false,
        error: None,
    };
    let fail = |e: io::Error, mut c: Conversion, ctr: &AtomicU64| {
        c.cloned = ctr.load(Ordering::Relaxed);
        c.error = Some(e.to_string());
        (e, c)
    };
    let prepared = delete_tree(&tmp)
        .and_then(|()| step(create_subvolume(&tmp), "upstream.convert.tmp-created"));
    if let Err(e) = prepared {
        return Err(fail(e, conversion, &ctr));
    }
    let cloned = match progress {
        Some((phase, base)) => {
            with_byte_progress(phase, base, &ctr, || clone_tree(src, &tmp, &ctr, log))
        }
        None => clone_tree(src, &tmp, &ctr, log),
    };
    conversion.clone_time = start.elapsed();
    if let Err(e) = step(cloned, "upstream.convert.cloned") {
        log.log_err(delete_tree(&tmp));
        return Err(fail(e, conversion, &ctr));
    }
    if let Err(e) = step(rename(src, &old), "upstream.convert.src-moved") {
        log.log_err(delete_tree(&tmp));
        return Err(fail(e, conversion, &ctr));
    }
    if let Err(e) = step(rename(&tmp, src), "upstream.convert.tmp-moved") {
        log.log_err(rename(&old, src));
        log.log_err(delete_tree(&tmp));
        return Err(fail(e, conversion, &ctr));
    }
    let removing = Instant::now();
    conversion.old_removed = log
        .log_err(step(delete_dir(&old), "upstream.convert.old-removed"))
        .is_some();
    conversion.removal_time = removing.elapsed();
    conversion.cloned = ctr.load(Ordering::Relaxed);
    log.info(format_args!(
        "Converted volumes of {id} to a subvolume in {:?}",
        start.elapsed()
    ));
    Ok(conversion)
}

/// Upstream's `with_byte_progress` (`volume.rs` at [`VOLUME_RS_COMMIT`]): runs
/// `work` (on another thread here), and sets `base` plus the bytes cloned so
/// far every 500 ms until it is done; its end is noticed at once.
fn with_byte_progress(
    phase: &mut dyn startos_core::volume::BootProgress,
    base: u64,
    ctr: &AtomicU64,
    work: impl FnOnce() -> io::Result<()> + Send,
) -> io::Result<()> {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(work());
        });
        loop {
            match rx.recv_timeout(PROGRESS_EVERY) {
                Ok(result) => break result,
                Err(RecvTimeoutError::Timeout) => {
                    phase.set_done(base + ctr.load(Ordering::Relaxed))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    break Err(io::Error::other("the clone thread panicked"));
                }
            }
        }
    })
}

// ------------------------------------------------------------------ util/clone.rs

/// Upstream's `clone_tree` (`clone.rs` at [`UTIL_COMMIT`]): copies the tree
/// at `src` into `dst` (created if it is not a directory) by reflinks only,
/// adding every cloned byte to `ctr`. What it keeps and what it drops, as
/// upstream's does:
/// - directories: created, NOCOW mirrored, xattrs copied, contents, then
///   owner, mode (`& 0o7777`), atime and mtime; a nested subvolume is
///   walked as a plain directory (its boundary and read-only flag lost);
/// - regular files: created with `mode & 0o777`, NOCOW mirrored (set or
///   cleared to match the source, before any data), data by FICLONERANGE
///   in 1 GiB chunks, then xattrs, then the owner (a chown, which makes
///   the kernel drop `security.capability`), mode, atime and mtime;
///   hardlinks within the tree kept;
/// - symlinks: target, xattrs, owner, times;
/// - FIFOs: mode, xattrs, owner, times;
/// - sockets and device nodes: skipped with a warning;
/// - never kept: immutable, append-only and every inode flag but NOCOW,
///   ctime, birth time.
///
/// The first error stops the copy, with the path in its message.
pub fn clone_tree(src: &Path, dst: &Path, ctr: &AtomicU64, log: &Log) -> io::Result<()> {
    Cloner {
        ctr,
        log,
        hardlinks: HashMap::new(),
    }
    .clone_root(src, dst)
    .map_err(ctx(format!(
        "cloning {} -> {}",
        src.display(),
        dst.display()
    )))
}

/// Upstream's `Cloner` (`clone.rs` at [`UTIL_COMMIT`]): the counter, and the
/// first destination of each multiply linked source inode.
struct Cloner<'a> {
    ctr: &'a AtomicU64,
    log: &'a Log,
    hardlinks: HashMap<(u64, u64), PathBuf>,
}

impl Cloner<'_> {
    fn clone_root(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(src)?;
        if !dst.is_dir() {
            fs::create_dir(dst)?;
        }
        copy_dir_flags(src, dst)?;
        copy_xattrs_nofollow(src, dst)?;
        self.clone_dir_contents(src, dst)?;
        apply_dir_metadata(dst, &meta)
    }

    fn clone_dir_contents(&mut self, src: &Path, dst: &Path) -> io::Result<()> {
        for entry in fs::read_dir(src)? {
            let entry = entry?;
            let src_path = entry.path();
            let dst_path = dst.join(entry.file_name());
            let meta = fs::symlink_metadata(&src_path)?;
            let ft = meta.file_type();
            if ft.is_dir() {
                fs::create_dir(&dst_path)?;
                copy_dir_flags(&src_path, &dst_path)?;
                copy_xattrs_nofollow(&src_path, &dst_path)?;
                self.clone_dir_contents(&src_path, &dst_path)?;
                apply_dir_metadata(&dst_path, &meta)?;
            } else if ft.is_file() {
                if meta.nlink() > 1 {
                    let key = (meta.dev(), meta.ino());
                    if let Some(first) = self.hardlinks.get(&key) {
                        fs::hard_link(first, &dst_path)?;
                        continue;
                    }
                    self.hardlinks.insert(key, dst_path.clone());
                }
                self.clone_file(&src_path, &dst_path, &meta)?;
                failpoint("upstream.convert.file")?;
            } else if ft.is_symlink() {
                let target = fs::read_link(&src_path)?;
                std::os::unix::fs::symlink(&target, &dst_path)?;
                copy_xattrs_nofollow(&src_path, &dst_path)?;
                lchown(&dst_path, &meta)?;
                set_times_nofollow(&dst_path, &meta)?;
            } else if ft.is_fifo() {
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &dst_path,
                    FileType::Fifo,
                    Mode::from_raw_mode(meta.mode() & 0o7777),
                    0,
                )?;
                copy_xattrs_nofollow(&src_path, &dst_path)?;
                lchown(&dst_path, &meta)?;
                // mkfifo's mode went through the umask.
                fs::set_permissions(&dst_path, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
                set_times_nofollow(&dst_path, &meta)?;
            } else {
                self.log.warn(format_args!(
                    "clone_tree: skipping special file {}",
                    src_path.display()
                ));
            }
        }
        Ok(())
    }

    fn clone_file(&mut self, src: &Path, dst: &Path, meta: &Metadata) -> io::Result<()> {
        let src_f = File::open(src)?;
        let dst_f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(meta.mode() & 0o777)
            .open(dst)?;
        // btrfs refuses a clone between a NOCOW and a COW file, and NOCOW
        // only sticks to a file without data: match it first, both ways
        // (the new file may have inherited NOCOW from its directory).
        mirror_nocow(&src_f, &dst_f)?;
        let size = meta.len();
        let mut offset = 0;
        while offset < size {
            let len = CLONE_CHUNK.min(size - offset);
            clone_range(&src_f, &dst_f, offset, len)?;
            self.ctr.fetch_add(len, Ordering::Relaxed);
            offset += len;
        }
        copy_xattrs(&src_f, &dst_f)?;
        rustix::fs::fchown(
            &dst_f,
            Some(Uid::from_raw(meta.uid())),
            Some(Gid::from_raw(meta.gid())),
        )?;
        dst_f.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        rustix::fs::futimens(&dst_f, &times_of(meta))?;
        Ok(())
    }
}

/// Upstream's `clone_range` (`clone.rs` at [`UTIL_COMMIT`]): one FICLONERANGE,
/// `len` bytes at `offset` of `src` to the same offset of `dst`.
#[allow(unsafe_code)] // FICLONERANGE, as upstream's clone does
fn clone_range(src: &File, dst: &File, offset: u64, len: u64) -> io::Result<()> {
    let range = libc::file_clone_range {
        src_fd: i64::from(src.as_raw_fd()),
        src_offset: offset,
        src_length: len,
        dest_offset: offset,
    };
    // SAFETY: `range` is a valid `struct file_clone_range` that outlives the
    // call, and both descriptors are open.
    let ret = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONERANGE, &range) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Upstream's `mirror_nocow` (`clone.rs` at [`UTIL_COMMIT`]): sets or clears
/// NOCOW on `dst` to match `src`, keeping `dst`'s other flags.
fn mirror_nocow(src: &File, dst: &File) -> io::Result<()> {
    let src_nocow = rustix::fs::ioctl_getflags(src)?.contains(IFlags::NOCOW);
    let dst_flags = rustix::fs::ioctl_getflags(dst)?;
    if src_nocow != dst_flags.contains(IFlags::NOCOW) {
        let flags = if src_nocow {
            dst_flags | IFlags::NOCOW
        } else {
            dst_flags - IFlags::NOCOW
        };
        rustix::fs::ioctl_setflags(dst, flags)?;
    }
    Ok(())
}

/// Upstream's `copy_dir_flags` (`clone.rs` at [`UTIL_COMMIT`]): NOCOW mirrored
/// on a directory, so the files created in it inherit what the source's did.
fn copy_dir_flags(src: &Path, dst: &Path) -> io::Result<()> {
    mirror_nocow(&File::open(src)?, &File::open(dst)?)
}

/// Upstream's `apply_dir_metadata` (`clone.rs` at [`UTIL_COMMIT`]): owner, then
/// mode, then times.
fn apply_dir_metadata(dst: &Path, meta: &Metadata) -> io::Result<()> {
    let f = File::open(dst)?;
    rustix::fs::fchown(
        &f,
        Some(Uid::from_raw(meta.uid())),
        Some(Gid::from_raw(meta.gid())),
    )?;
    f.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    rustix::fs::futimens(&f, &times_of(meta))?;
    Ok(())
}

/// `lchown` to `meta`'s owner, as upstream's clone does for symlinks and
/// FIFOs (`clone.rs` at [`UTIL_COMMIT`]).
fn lchown(path: &Path, meta: &Metadata) -> io::Result<()> {
    rustix::fs::chownat(
        rustix::fs::CWD,
        path,
        Some(Uid::from_raw(meta.uid())),
        Some(Gid::from_raw(meta.gid())),
        AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// The access and modification times of `meta`: upstream's `timespecs`
/// (`clone.rs` at [`UTIL_COMMIT`]).
fn times_of(meta: &Metadata) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec() as _,
        },
        last_modification: Timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec() as _,
        },
    }
}

/// Upstream's `set_times_nofollow` (`clone.rs` at [`UTIL_COMMIT`]): `utimensat`
/// without following a symlink.
fn set_times_nofollow(path: &Path, meta: &Metadata) -> io::Result<()> {
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &times_of(meta),
        AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// Names in an xattr list buffer.
fn xattr_names(list: &[u8]) -> impl Iterator<Item = &std::ffi::OsStr> {
    use std::os::unix::ffi::OsStrExt;
    list.split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(std::ffi::OsStr::from_bytes)
}

/// A size query, then the call: upstream's `list_xattrs` and `read_xattr`
/// (`clone.rs` at [`UTIL_COMMIT`]). No
/// xattr support at all reads as none.
fn sized(
    query: impl Fn() -> rustix::io::Result<usize>,
    fill: impl Fn(&mut [u8]) -> rustix::io::Result<usize>,
    unsupported_is_empty: bool,
) -> io::Result<Vec<u8>> {
    let len = match query() {
        Ok(n) => n,
        Err(rustix::io::Errno::OPNOTSUPP) if unsupported_is_empty => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    if len == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; len];
    let n = fill(&mut buf)?;
    buf.truncate(n);
    Ok(buf)
}

/// Upstream's `copy_xattrs` (`clone.rs` at [`UTIL_COMMIT`]), by descriptor.
fn copy_xattrs(src: &File, dst: &File) -> io::Result<()> {
    let list = sized(
        || rustix::fs::flistxattr_query(src),
        |b| rustix::fs::flistxattr(src, b),
        true,
    )?;
    for name in xattr_names(&list) {
        let value = sized(
            || rustix::fs::fgetxattr_query(src, name),
            |b| rustix::fs::fgetxattr(src, name, b),
            false,
        )?;
        rustix::fs::fsetxattr(dst.as_fd(), name, &value, XattrFlags::empty())?;
    }
    Ok(())
}

/// Upstream's `copy_xattrs_nofollow` (`clone.rs` at [`UTIL_COMMIT`]), by path,
/// never through a symlink.
fn copy_xattrs_nofollow(src: &Path, dst: &Path) -> io::Result<()> {
    let list = sized(
        || rustix::fs::llistxattr_query(src),
        |b| rustix::fs::llistxattr(src, b),
        true,
    )?;
    for name in xattr_names(&list) {
        let value = sized(
            || rustix::fs::lgetxattr_query(src, name),
            |b| rustix::fs::lgetxattr(src, name, b),
            false,
        )?;
        rustix::fs::lsetxattr(dst, name, &value, XattrFlags::empty())?;
    }
    Ok(())
}
