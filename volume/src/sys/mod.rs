//! Every system call the volume and volume-migrate crates make, in one place.
//! Linux only: the rest of the crate is gated on it.
//!
//! Every name is resolved relative to a directory already open, and no call
//! follows a symlink: nothing a package writes into its volume (a symlink
//! where a directory was, say) can redirect an operation elsewhere. Names
//! are raw bytes.
//!
//! Subvolume operations are btrfs ioctls issued through rustix, so the
//! default build needs no C toolchain, no libclang and no C library: it fits
//! static musl builds for every target. The `btrfsutil` cargo feature
//! swaps in libbtrfsutil for the subvolume primitives of [`subvolume`]'s
//! backend (create, snapshot, delete, read-only flag, nested listing,
//! commits), as a cross-check of the ioctl code; everything else is the
//! same in both builds.
//!
//! All functions return plain `io::Error`s carrying the OS error number (or,
//! for a reply from the kernel that does not parse, `InvalidData`); callers
//! add which package and path it was about.
//!
//! Files by concern: `fs` POSIX wrappers, `xattr` extended attributes,
//! `flags` inode flags, `clone` reflinks, `ioctl` argument helpers,
//! `subvolume` the subvolume API over its backend (`native` ioctls or
//! `btrfsutil`), `search` the b-tree search engine, `item` on-disk item
//! layouts, `space` metadata space accounting, `ioprio` the thread's I/O priority, `fault` the injected failures of
//! the I/O-error sweep: every call that enters the kernel passes through
//! [`fault::check`] first.

mod clone;
pub mod fault;
mod flags;
mod fs;
mod inode;
mod ioctl;
mod ioprio;
pub mod item;
mod proc;
mod search;
mod space;
mod subvolume;
mod xattr;

#[cfg(feature = "btrfsutil")]
mod btrfsutil;
#[cfg(not(feature = "btrfsutil"))]
mod native;

pub use clone::*;
pub use flags::*;
pub use fs::*;
pub use inode::{dir_parent, open_subvolume, open_tree_dir};
pub use ioprio::IdleIo;
pub use proc::{MountNamespace, fd_path, flock_holders, mount_namespaces, own_mount_table};
pub use search::{
    Batch, DEFAULT_BUF_SIZE, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher, search,
};
pub use space::{MetadataSpace, metadata_space};
pub use subvolume::*;
pub use xattr::*;
