//! Where the fields of the b-tree items read here sit in an item's body
//! (little endian, as on disk), and how to read them.

/// `ram_bytes` in `struct btrfs_file_extent_item`.
pub const RAM_BYTES: usize = 8;
/// `compression`.
pub const COMPRESSION: usize = 16;
/// `type`: inline, regular or prealloc.
pub const TYPE: usize = 20;
/// `disk_bytenr` (regular and prealloc only, as all that follow).
pub const DISK_BYTENR: usize = 21;
/// `disk_num_bytes`.
pub const DISK_NUM_BYTES: usize = 29;
/// `num_bytes`.
pub const NUM_BYTES: usize = 45;
/// Header size of an inline extent; the data follows.
pub const INLINE_HEADER: usize = 21;
/// Size of a regular or prealloc extent item.
pub const REGULAR_LEN: usize = 53;
/// Extent type: data stored in the item itself.
pub const TYPE_INLINE: u8 = 0;
/// Extent type: allocated, never written.
pub const TYPE_PREALLOC: u8 = 2;
/// `size` in `struct btrfs_inode_item`.
pub const INODE_SIZE: usize = 16;
/// `mode` in `struct btrfs_inode_item`.
pub const INODE_MODE: usize = 52;
/// `flags` in `struct btrfs_inode_item`.
pub const INODE_FLAGS: usize = 64;
/// `BTRFS_INODE_NODATACOW` in those flags (`chattr +C`).
pub const INODE_NODATACOW: u64 = 1;

/// `dirid` in `struct btrfs_root_ref` (packed): the directory of the
/// parent subvolume holding the child.
pub const ROOT_REF_DIRID: usize = 0;
/// `name_len` (little-endian u16).
pub const ROOT_REF_NAME_LEN: usize = 16;
/// Where the name follows the packed struct.
pub const ROOT_REF_NAME: usize = 18;

/// The little-endian u64 at `at`, or `None` past the body's end.
pub fn le64(body: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
}

/// The little-endian u32 at `at`, or `None` past the body's end.
pub fn le32(body: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?))
}
