//! What a library crate's tests need from a real filesystem, and nothing
//! of the workspace itself.
//!
//! Tests run against loop-mounted btrfs and ext4 images rather than mocks, since
//! what is under test (subvolume snapshots, reflinks, `renameat2` across subvolumes,
//! crash recovery) is kernel behaviour. This crate provides:
//!
//! - [`LoopFs`]: a scratch filesystem that is unmounted and detached on drop, and
//!   [`fs_or_skip!`] to skip (or, under `CI=true`, fail) where that is impossible;
//! - [`make_fragmented_file`]: a database-like file with hundreds of thousands of
//!   extents, built in seconds, and [`extent_count`];
//! - [`tree_digest`]: a comparable record of a tree's content and metadata;
//! - [`run`] and [`sh`]: external commands whose failures carry their stderr,
//!   and [`workspace_bin`] to find the workspace's binaries.
//!
//! It depends on no crate of the workspace, so that `volume`, `volume-migrate`
//! and `startos-core` can take it as their dev-dependency without building
//! twice; the `integration` crate re-exports all of it beside the harness
//! that does need the workspace (the upstream baseline, the comparison, the
//! power-cut guest, the bench).
//!
//! Everything here needs Linux; most of it needs root.

mod cmd;
mod fixture;
mod frag;
mod tree;

pub use cmd::{run, sh, workspace_bin};
pub use fixture::{
    FsKind, LoopFs, LoopFsBuilder, TMPDIR_ENV, check_support, in_ci, is_mounted,
    require_root_and_loop, require_support, skip_or_fail, skip_or_panic,
};
pub use frag::{extent_count, make_fragmented_file};
pub use tree::{Entry, Kind, Subvolume, Timestamp, TreeDigest, sha256_file, tree_digest};
