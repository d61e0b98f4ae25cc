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
//! swaps in libbtrfsutil for the subvolume primitives of `subvolume`'s
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
//! `btrfsutil`) and `inode` (subvolumes and directories reached by number),
//! `subvolume_info` what all of these take about one subvolume (its root's
//! inode number, GET_SUBVOL_INFO, where a nested one sits), `search` the
//! b-tree search engine, `item` on-disk item layouts, `space` metadata
//! space accounting, `qgroup` quota groups (limits, memberships, the
//! inherit a snapshot is made with), `ioprio` the thread's I/O priority, `proc` what
//! `/proc` tells of descriptors, mounts and locks, `fault` the injected
//! failures of the I/O-error sweep: every call that enters the kernel
//! passes through `fault::check` first.

mod clone;
mod dir;
pub mod fault;
mod flags;
mod fs;
mod inode;
mod ioctl;
mod ioprio;
pub mod item;
mod proc;
mod qgroup;
mod search;
mod space;
mod subvolume;
mod subvolume_info;
mod xattr;

#[cfg(feature = "btrfsutil")]
mod btrfsutil;
#[cfg(not(feature = "btrfsutil"))]
mod native;

// What the sibling crates, tools and tests call (each item documented
// where it is defined); the rest is for this crate only.
pub use clone::ficlone_range;
pub use dir::{DirNames, DirPos, read_dir_batch, read_dir_names};
pub use flags::{
    InodeFlags, clear_stuck_flags, inode_flags, set_immutable_append, set_inode_flags,
    with_stuck_flags_lifted,
};
pub use fs::{
    FileTime, FileType, Stat, Times, birth_time, fsync, is_btrfs, mkdir_at, nofile_limit,
    open_beneath, open_dir_at, open_dir_path, rename_at, rename_exchange, rename_noreplace,
    rmdir_at, set_nofile_limit, set_times, stat, stat_at, times, write_all,
};
pub use inode::{dir_parent, inode_beneath, inode_item, inodes_written_since, open_subvolume};
pub use ioprio::IdleIo;
pub use proc::{fd_path, open_descriptors};
pub use qgroup::{
    LIMIT_MAX_EXCL, LIMIT_MAX_RFER, LIMIT_RSV_EXCL, LIMIT_RSV_RFER, QGROUP_LEVEL_SHIFT,
    QgroupInherit, QgroupLimit, QgroupUsage, QuotaMode, QuotaStatus, assign_qgroup, enable_quotas,
    qgroup_level, qgroup_limit, qgroup_parents, qgroup_usage, quota_status, set_qgroup_limit,
};
pub use search::{Batch, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher, search};
pub use space::{MetadataSpace, metadata_space};
pub use subvolume::{
    COMMIT_START_NUDGE, COMMIT_START_PATIENCE, commit, commit_metadata, create_snapshot,
    create_snapshot_with, create_subvolume, create_subvolume_with, delete_subvolume,
    forced_commit_starts, is_read_only, is_subvolume, make_tree_read_only, make_tree_writable,
    nested_paths, nested_subvolumes, nudged_commit_starts, set_read_only, snapshot, snapshot_tree,
    snapshot_tree_with, start_commit, subvolume_root_of,
};
pub use subvolume_info::{Nested, SUBVOLUME_ROOT_INO, SubvolumeInfo, subvolume_info};

pub(crate) use clone::ficlone;
pub(crate) use fs::{
    block_size, canonicalize, chmod, chmod_at, chown, chown_at, create_dir_all, create_file_at,
    effective_ids, fs_magic, fs_magic_btrfs, fs_name_of_magic, link_at, lock_exclusive,
    lock_shared, major_minor, mkdir_if_missing, mkdir_path_if_missing, mknod_at, mount_id,
    mount_id_at, open_read_at, open_write_at, read_link_at, require_mount_id, set_times_at,
    stat_existing_at, symlink_at, syncfs, touch_at, truncate, try_lock_exclusive, unlink_at,
    unlink_if_exists, unlock,
};
#[cfg(all(feature = "failpoints", startos_failpoints))]
pub(crate) use fs::{kill_self, stop_self};
pub(crate) use inode::open_tree_dir;
pub(crate) use proc::{command_of, flock_holders, mount_namespaces, own_mount_table};
pub(crate) use search::DEFAULT_BUF_SIZE;
pub(crate) use subvolume::match_nested;
pub(crate) use xattr::{
    get_xattr, get_xattr_at, list_xattrs, list_xattrs_at, remove_xattr, set_xattr, set_xattr_at,
};
