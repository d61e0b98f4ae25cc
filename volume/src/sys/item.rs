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
/// `generation` in `struct btrfs_inode_item`: the transaction that made
/// the inode, which a file handle carries to tell a reused number apart.
pub const INODE_GENERATION: usize = 0;
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

/// `BTRFS_INODE_REF_KEY`: (inode, INODE_REF, parent directory's inode),
/// holding the inode's names in that directory.
pub const INODE_REF_KEY: u8 = 12;
/// `index` in `struct btrfs_inode_ref` (packed): the name's position in
/// the directory's index.
const INODE_REF_NAME_LEN: usize = 8;
/// Where the name follows the packed struct.
const INODE_REF_NAME: usize = 10;

/// The first name of an INODE_REF item's body (`struct btrfs_inode_ref`,
/// then the name): a directory has exactly one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRef {
    /// The name, one path component of 1 to 255 bytes.
    pub name: std::ffi::OsString,
}

impl InodeRef {
    /// Parses the first reference of `body`, checking that its name lies
    /// inside the body and is one path component.
    pub fn parse(body: &[u8]) -> std::io::Result<InodeRef> {
        use std::os::unix::ffi::OsStringExt;
        let bad = |what: &str| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("malformed INODE_REF item: {what}"),
            )
        };
        let len = body
            .get(INODE_REF_NAME_LEN..INODE_REF_NAME)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
            .ok_or_else(|| bad("shorter than its header"))?;
        let name = body
            .get(INODE_REF_NAME..INODE_REF_NAME + len)
            .ok_or_else(|| bad("name runs past the item"))?;
        if name.is_empty()
            || name.len() > 255
            || name == b"."
            || name == b".."
            || name.iter().any(|b| *b == 0 || *b == b'/')
        {
            return Err(bad("name is not one path component"));
        }
        Ok(InodeRef {
            name: std::ffi::OsString::from_vec(name.to_vec()),
        })
    }
}

/// The little-endian u64 at `at`, or `None` past the body's end.
pub fn le64(body: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
}

/// The little-endian u32 at `at`, or `None` past the body's end.
pub fn le32(body: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode_ref(name: &[u8], claimed: u16) -> Vec<u8> {
        let mut v = 2u64.to_le_bytes().to_vec();
        v.extend_from_slice(&claimed.to_le_bytes());
        v.extend_from_slice(name);
        v
    }

    #[test]
    fn an_inode_ref_parses_its_first_name() {
        let mut body = inode_ref(b"data", 4);
        body.extend(inode_ref(b"other", 5));
        assert_eq!(InodeRef::parse(&body).expect("parses").name, "data");
    }

    #[test]
    fn a_malformed_inode_ref_is_an_error() {
        assert!(InodeRef::parse(&inode_ref(b"data", 40)).is_err());
        assert!(InodeRef::parse(&inode_ref(b"", 0)[..9]).is_err());
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
            assert!(InodeRef::parse(&inode_ref(bad, bad.len() as u16)).is_err());
        }
    }
}
