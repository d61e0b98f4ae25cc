//! Where the fields of the b-tree items read here sit in an item's body
//! (little endian, as on disk), and how to read them: one parser per item
//! that carries more than a field (the references' names), each checking
//! everything it reads lies inside the body.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;

use super::ioctl::malformed;

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

/// `BTRFS_ROOT_REF_KEY`: (parent id, ROOT_REF, child id) in the root tree,
/// one per subvolume linked into a directory of the parent.
pub const ROOT_REF_KEY: u8 = 156;
/// `dirid` in `struct btrfs_root_ref` (packed): the directory of the
/// parent subvolume holding the child.
const ROOT_REF_DIRID: usize = 0;
/// `name_len` (little-endian u16).
const ROOT_REF_NAME_LEN: usize = 16;
/// Where the name follows the packed struct.
const ROOT_REF_NAME: usize = 18;

/// `BTRFS_INODE_REF_KEY`: (inode, INODE_REF, parent directory's inode),
/// holding the inode's names in that directory.
pub const INODE_REF_KEY: u8 = 12;
/// `name_len` in `struct btrfs_inode_ref` (packed: index, name_len).
const INODE_REF_NAME_LEN: usize = 8;
/// Where the name follows the packed struct.
const INODE_REF_NAME: usize = 10;

/// The name an item carries after a little-endian u16 length at `len_at`,
/// from `name_at` on: checked to lie inside the body and to be one path
/// component (1 to 255 bytes, no `/` or NUL, not `.` or `..`), as the
/// kernel writes it; anything else is `InvalidData` naming `item`.
fn item_name<'b>(
    body: &'b [u8],
    len_at: usize,
    name_at: usize,
    item: &str,
) -> io::Result<&'b [u8]> {
    let len = body
        .get(len_at..name_at)
        .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
        .ok_or_else(|| malformed(&format!("{item} item shorter than its header")))?;
    let name = body
        .get(name_at..name_at + len)
        .ok_or_else(|| malformed(&format!("{item} name runs past its item")))?;
    if name.is_empty()
        || name.len() > 255
        || name == b"."
        || name == b".."
        || name.iter().any(|b| *b == 0 || *b == b'/')
    {
        return Err(malformed(&format!("{item} name is not one path component")));
    }
    Ok(name)
}

/// The first name of an INODE_REF item's body (`struct btrfs_inode_ref`,
/// then the name): a directory has exactly one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRef {
    /// The name, one path component of 1 to 255 bytes.
    pub name: OsString,
}

impl InodeRef {
    /// Parses the first reference of `body`.
    pub fn parse(body: &[u8]) -> io::Result<InodeRef> {
        let name = item_name(body, INODE_REF_NAME_LEN, INODE_REF_NAME, "INODE_REF")?;
        Ok(InodeRef {
            name: OsString::from_vec(name.to_vec()),
        })
    }
}

/// One ROOT_REF item of the root tree: child subvolume `child` sits in
/// directory `dirid` of its parent under `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootRef {
    /// The child subvolume's id (the item key's offset).
    pub child: u64,
    /// The directory of the parent holding it.
    pub dirid: u64,
    /// Its name there, one path component.
    pub name: Vec<u8>,
}

impl RootRef {
    /// Parses the body of the ROOT_REF item keyed (parent, ROOT_REF,
    /// `child`): `struct btrfs_root_ref` (dirid, sequence, name_len:
    /// packed, little endian) followed by the name.
    pub fn parse(child: u64, body: &[u8]) -> io::Result<RootRef> {
        let dirid = le64(body, ROOT_REF_DIRID).ok_or_else(|| malformed("short ROOT_REF item"))?;
        let name = item_name(body, ROOT_REF_NAME_LEN, ROOT_REF_NAME, "ROOT_REF")?;
        Ok(RootRef {
            child,
            dirid,
            name: name.to_vec(),
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

    fn root_ref_body(dirid: u64, name: &[u8], claimed_len: u16) -> Vec<u8> {
        let mut v = dirid.to_le_bytes().to_vec();
        v.extend_from_slice(&3u64.to_le_bytes());
        v.extend_from_slice(&claimed_len.to_le_bytes());
        v.extend_from_slice(name);
        v
    }

    const NOT_ONE_COMPONENT: [&[u8]; 5] = [b"", b".", b"..", b"a/b", b"a\0b"];

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
        for bad in NOT_ONE_COMPONENT {
            assert!(InodeRef::parse(&inode_ref(bad, bad.len() as u16)).is_err());
        }
    }

    #[test]
    fn a_root_ref_parses() {
        let r = RootRef::parse(300, &root_ref_body(257, b"data", 4)).expect("parses");
        assert_eq!(
            r,
            RootRef {
                child: 300,
                dirid: 257,
                name: b"data".to_vec()
            }
        );
    }

    #[test]
    fn a_malformed_root_ref_is_an_error() {
        assert!(RootRef::parse(300, &root_ref_body(257, b"data", 40)).is_err());
        assert!(RootRef::parse(300, &root_ref_body(257, b"", 0)[..10]).is_err());
        for bad in NOT_ONE_COMPONENT {
            assert!(RootRef::parse(300, &root_ref_body(257, bad, bad.len() as u16)).is_err());
        }
    }
}
