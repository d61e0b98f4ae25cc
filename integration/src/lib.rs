//! Test harness for package volumes on real filesystems.
//!
//! Tests here run against loop-mounted btrfs and ext4 images rather than mocks, since
//! what is under test (subvolume snapshots, reflinks, `renameat2` across subvolumes,
//! crash recovery) is kernel behaviour. The harness provides:
//!
//! - [`LoopFs`]: a scratch filesystem that is unmounted and detached on drop, and
//!   [`fs_or_skip!`] to skip (or, under `CI=true`, fail) where that is impossible;
//! - [`make_fragmented_file`]: a database-like file with hundreds of thousands of
//!   extents, built in seconds, and [`extent_count`];
//! - [`tree_digest`]: a comparable record of a tree's content and metadata;
//! - [`deep`]: trees deeper than `PATH_MAX`, built, digested and removed
//!   through directory descriptors;
//! - `r#gen` (`gen` is a reserved word): hostile trees of random shape,
//!   generated from a seed and built through directory descriptors;
//! - [`run`] and [`sh`]: external commands whose failures carry their stderr;
//! - [`upstream`]: upstream's own volume code, restated as a baseline;
//! - [`compare`]: scenarios run against that baseline and against ours.
//!
//! Everything here needs Linux; most of it needs root.

#![warn(missing_docs)]

mod cmd;
pub mod compare;
pub mod deep;
mod fixture;
pub mod fmt;
pub mod identity;
// `gen` is a reserved word in Rust 2024: the module is `r#gen`.
mod frag;
pub mod r#gen;
pub mod node;
pub mod powercut;
pub mod services;
mod tree;
pub mod upstream;

pub use cmd::{run, sh, workspace_bin};
pub use fixture::{
    FsKind, LoopFs, LoopFsBuilder, TMPDIR_ENV, check_support, in_ci, is_mounted,
    require_root_and_loop, require_support, skip_or_fail, skip_or_panic,
};
pub use frag::{extent_count, make_fragmented_file};
pub use tree::{Entry, Kind, Subvolume, Timestamp, TreeDigest, sha256_file, tree_digest};
