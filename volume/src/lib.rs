//! StartOS package volumes as btrfs subvolumes.
//!
//! Each package's volume `<root>/<pkg>` is a btrfs subvolume, so the backup
//! taken before an update is a read-only snapshot (milliseconds whatever the
//! fragmentation), a rollback is one atomic `renameat2(RENAME_EXCHANGE)`, and
//! dropping a backup or deleting a volume is O(1). Where the filesystem is not
//! btrfs, or a volume is still a plain directory, it falls back as upstream
//! does, with a warning.
//!
//! [`VolumeStore`] is the API. start-core's `volume` module, upstream's
//! names and call shapes, is `startos_core::volume`, on top of it.
//!
//! The public modules are the pieces the sibling crates build on, each an
//! API of its own: [`sys`] (every system call, btrfs's ioctls included),
//! [`copy`] (the lossless reflink copy and the tree removal the conversion
//! uses), [`layout`] (the names a package owns), [`lock`] (the per-package
//! lock every tool takes), [`record`] (the small facts kept beside a
//! package's trees), [`mounts`] (who holds a mount of a volume),
//! [`usage`] (space accounting from the b-tree), [`walk`] (the tree walker),
//! [`purge`] (emptying the trash in a background thread),
//! [`errors`] (the I/O errors that change what a failed step does next)
//! and [`failpoint`] (the crash sites the tests name); with the `cli`
//! feature, `cli` (what the two command-line tools share in how they
//! answer). Everything else is internal.

use std::path::{Path, PathBuf};

// The crate's public API, item by item: what start-core, volume-migrate,
// the command-line tools and the tests call; everything else is internal.
// Each item's line is a plain comment: an outer doc comment would merge
// into the item's own docs (and, on a module, break their intra-doc links).

// The error type every fallible call returns, and the ids it names.
pub use models::{Error, ErrorKind, PackageId, VolumeId};

// Work over a list spread across threads, results in the list's order.
pub mod at_once;
// How the command-line tools answer: one-line usage errors, JSON failures.
#[cfg(feature = "cli")]
pub mod cli;
// The lossless reflink copy and the tree removal the conversion uses.
#[cfg(target_os = "linux")]
pub mod copy;
// The I/O errors that change what a failed step does next.
#[cfg(target_os = "linux")]
pub mod errors;
#[cfg(target_os = "linux")]
mod extents;
// The named crash sites of the crash-safety tests.
pub mod failpoint;
// The names a package owns under the volumes root.
pub mod layout;
// The per-package lock every tool takes.
#[cfg(target_os = "linux")]
pub mod lock;
// Who holds a mount of a volume, in every mount namespace.
#[cfg(target_os = "linux")]
pub mod mounts;
mod outcome;
// A volume's qgroup limit and memberships, carried to what replaces it.
#[cfg(target_os = "linux")]
pub mod quota;
// The small facts kept beside a package's trees.
#[cfg(target_os = "linux")]
pub mod record;
// Emptying the trash in a background thread, for long-lived processes.
#[cfg(target_os = "linux")]
pub mod purge;
#[cfg(target_os = "linux")]
mod root;
#[cfg(target_os = "linux")]
mod store;
// Every system call the crates make, btrfs's ioctls included.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // the one module that makes system calls
pub mod sys;
// Real space use of a volume, from the b-tree.
#[cfg(target_os = "linux")]
pub mod usage;
// The one tree walker: any depth, bounded descriptors, never across a mount.
#[cfg(target_os = "linux")]
pub mod walk;

// The environment variable naming the failpoint to fire.
pub use failpoint::FAILPOINT_ENV;
// The suffix of the snapshot taken before an install (upstream's name).
pub use layout::INSTALL_BACKUP_SUFFIX;
// What the store's operations report.
pub use outcome::{
    CreateOutcome, DeleteOutcome, HeldTree, Holder, Recovery, RestoreOutcome, SnapshotOutcome,
    VolumeInfo, VolumeKind,
};
// The volumes root, open.
#[cfg(target_os = "linux")]
pub use root::Root;
// The store, its usage figures, what its `begin_install` did, the default
// bound on a reflink backup, and the deletion of a tree by path.
#[cfg(target_os = "linux")]
pub use store::{
    Begun, DEFAULT_REFLINK_EXTENT_LIMIT, VolumeStore, VolumeUsage, delete_tree, delete_tree_at,
    delete_tree_in, delete_tree_in_deferring_purge, empty_trash_at,
};

/// Upstream's data directory.
pub const DATA_DIR: &str = "/media/startos/data";
/// Package volumes, relative to [`DATA_DIR`].
pub const PKG_VOLUME_DIR: &str = "package-data/volumes";

/// Sends the crates' log to stderr, one line each, warnings and worse
/// unless `RUST_LOG` says otherwise, coloured only on a terminal: how the
/// command-line tools (`startos-volume`, `volume-migrate`) report what the
/// library warns of. Call once, first thing in `main`.
#[cfg(feature = "cli")]
pub fn init_command_line_log() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
}

/// `n` bytes in binary units with one decimal (`3.0 GiB`, `512 B`): the
/// one way the workspace prints a size, so that the tools' tables, their
/// messages and the benches quoting them agree.
///
/// ```
/// assert_eq!(volume::human_bytes(3 << 30), "3.0 GiB");
/// assert_eq!(volume::human_bytes(1536), "1.5 KiB");
/// assert_eq!(volume::human_bytes(512), "512 B");
/// assert_eq!(volume::human_bytes(1024), "1.0 KiB");
/// assert_eq!(volume::human_bytes(534 << 20 | 400 << 10), "534.4 MiB");
/// assert_eq!(volume::human_bytes(u64::MAX), "16.0 EiB");
/// ```
pub fn human_bytes(n: u64) -> String {
    // Written out rather than taken from a crate: a library dependency of
    // start-core for one line of the tools' output would not pay its way.
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let (mut unit, mut scale) = (0, 1024u64);
    while unit + 1 < UNITS.len() && n / scale >= 1024 {
        unit += 1;
        scale *= 1024;
    }
    format!("{:.1} {}", n as f64 / scale as f64, UNITS[unit])
}

/// The volumes root on a StartOS server.
pub fn default_root() -> PathBuf {
    Path::new(DATA_DIR).join(PKG_VOLUME_DIR)
}
