//! Test harness for package volumes on real filesystems.
//!
//! Tests here run against loop-mounted btrfs and ext4 images rather than mocks, since
//! what is under test (subvolume snapshots, reflinks, `renameat2` across subvolumes,
//! crash recovery) is kernel behaviour. The harness provides, from
//! [`test_fs`] (which the library crates' own tests use, and which depends on
//! no crate of the workspace so that none builds twice for its tests):
//!
//! - [`LoopFs`]: a scratch filesystem that is unmounted and detached on drop, and
//!   [`fs_or_skip!`] to skip (or, under `CI=true`, fail) where that is impossible;
//! - [`make_fragmented_file`]: a database-like file with hundreds of thousands of
//!   extents, built in seconds, and [`extent_count`];
//! - [`tree_digest`]: a comparable record of a tree's content and metadata;
//! - [`run`] and [`sh`]: external commands whose failures carry their stderr;
//!
//! and of its own, for what needs the workspace or is only the harness's:
//!
//! - [`deep`]: trees deeper than `PATH_MAX`, built, digested and removed
//!   through directory descriptors;
//! - `r#gen` (`gen` is a reserved word): hostile trees of random shape,
//!   generated from a seed and built through directory descriptors;
//! - [`upstream`]: upstream's own volume code, restated as a baseline;
//! - [`compare`]: scenarios run against that baseline and against ours;
//! - [`call_sites`]: the fixture's `call-sites` runner driven from outside:
//!   boxes, flows and kill-point sweeps in both orders, and (`boot_loads`) a
//!   box's first boot, each package's `Service::load` volume calls timed;
//! - [`rss`]: a child process's peak memory, for memory bounds;
//! - [`lmdb`]: real LMDB environments written like the seed's Monero node's,
//!   and a check that reads every key back.
//!
//! Everything here needs Linux; most of it needs root.

pub mod call_sites;
pub mod compare;
pub mod deep;
pub mod dist;
pub mod fmt;
pub mod identity;
pub mod lmdb;
// `gen` is a reserved word in Rust 2024: the module is `r#gen`.
pub mod r#gen;
pub mod node;
pub mod powercut;
pub mod rss;
pub mod upstream;

// By name, not by glob: what the harness's tests, bench and comparison may
// use from `test_fs` is this list, under the same paths as before it moved.
pub use test_fs::{
    Entry, FsKind, Kind, LoopFs, LoopFsBuilder, Subvolume, TMPDIR_ENV, Timestamp, TreeDigest,
    check_support, extent_count, fs_or_skip, in_ci, is_mounted, make_fragmented_file,
    require_root_and_loop, require_support, run, sh, sha256_file, skip_or_fail, skip_or_panic,
    tree_digest, workspace_bin,
};
