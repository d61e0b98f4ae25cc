//! The b-tree items read here, parsed from their bodies (little endian,
//! as on disk): one type per item, and the one place that checks every
//! field read lies inside the body. Readers take the typed item, never a
//! raw offset, so a body shorter than its type, or a length that runs
//! past it, is an [`ItemError`] here and never a panic or a misread there.
//!
//! Parsing reads only: a failure leaves nothing behind.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::ffi::OsStringExt;

/// `ram_bytes` in `struct btrfs_file_extent_item`.
const RAM_BYTES: usize = 8;
/// `compression`.
const COMPRESSION: usize = 16;
/// `type`: inline, regular or prealloc.
const TYPE: usize = 20;
/// `disk_bytenr` (regular and prealloc only, as all that follow).
const DISK_BYTENR: usize = 21;
/// `disk_num_bytes`.
const DISK_NUM_BYTES: usize = 29;
/// `offset`: where in the extent the file's data starts.
const OFFSET: usize = 37;
/// `num_bytes`.
const NUM_BYTES: usize = 45;
/// Header size of an inline extent; the data follows.
const INLINE_HEADER: usize = 21;
/// Size of a regular or prealloc extent item.
const REGULAR_LEN: usize = 53;
/// Extent type: data stored in the item itself.
const TYPE_INLINE: u8 = 0;
/// Extent type: allocated, never written.
const TYPE_PREALLOC: u8 = 2;
/// The item the parse errors of [`FileExtent`] name.
const FILE_EXTENT: &str = "file extent";

/// `generation` in `struct btrfs_inode_item`.
const INODE_GENERATION: usize = 0;
/// `transid`: the transaction that last wrote the inode item.
const INODE_TRANSID: usize = 8;
/// `size`.
const INODE_SIZE: usize = 16;
/// `mode`.
const INODE_MODE: usize = 52;
/// `flags`.
const INODE_FLAGS: usize = 64;
/// `sizeof(struct btrfs_inode_item)`: the kernel writes every inode item
/// whole (its tree checker refuses any other size).
const INODE_ITEM_LEN: usize = 160;
/// `BTRFS_INODE_NODATACOW` in those flags (`chattr +C`).
const INODE_NODATACOW: u64 = 1;

/// `BTRFS_ROOT_REF_KEY`: (parent id, ROOT_REF, child id) in the root tree,
/// one per subvolume linked into a directory of the parent.
#[cfg_attr(feature = "btrfsutil", allow(dead_code))] // read by the native backend only
pub(crate) const ROOT_REF_KEY: u8 = 156;
/// `dirid` in `struct btrfs_root_ref` (packed): the directory of the
/// parent subvolume holding the child.
#[cfg_attr(feature = "btrfsutil", allow(dead_code))]
const ROOT_REF_DIRID: usize = 0;
/// `name_len` (little-endian u16).
#[cfg_attr(feature = "btrfsutil", allow(dead_code))]
const ROOT_REF_NAME_LEN: usize = 16;
/// Where the name follows the packed struct.
#[cfg_attr(feature = "btrfsutil", allow(dead_code))]
const ROOT_REF_NAME: usize = 18;

/// `BTRFS_INODE_REF_KEY`: (inode, INODE_REF, parent directory's inode),
/// holding the inode's names in that directory.
pub(crate) const INODE_REF_KEY: u8 = 12;
/// `name_len` in `struct btrfs_inode_ref` (packed: index, name_len).
const INODE_REF_NAME_LEN: usize = 8;
/// Where the name follows the packed struct.
const INODE_REF_NAME: usize = 10;

/// What is wrong with an item body (see [`ItemError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Problem {
    /// Shorter than the fixed part of its type.
    Short,
    /// Too short for the length of the name it carries.
    ShortNameHeader,
    /// Not the exact size its type has (a regular file extent).
    Length,
    /// The name's length runs past the body.
    NamePastEnd,
    /// The name is not one path component.
    NotOneComponent,
}

/// An item body that is not what its type says: never written by a sane
/// kernel, so every reader treats it as corrupt data (an `InvalidData`
/// I/O error once converted), never as something to guess around.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemError {
    /// The item, as messages name it (`"ROOT_REF"`, `"inode"`...).
    pub(crate) item: &'static str,
    /// What is wrong with it.
    pub(crate) problem: Problem,
}

impl ItemError {
    fn new(item: &'static str, problem: Problem) -> ItemError {
        ItemError { item, problem }
    }
}

impl fmt::Display for ItemError {
    // The texts the readers gave before parsing moved here: a file extent
    // item's were usage's own, the others the ioctl layer's.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let item = self.item;
        if item == FILE_EXTENT {
            return write!(f, "malformed {item} item");
        }
        f.write_str("malformed btrfs ioctl reply: ")?;
        match self.problem {
            Problem::Short | Problem::Length => write!(f, "short {item} item"),
            Problem::ShortNameHeader => write!(f, "{item} item shorter than its header"),
            Problem::NamePastEnd => write!(f, "{item} name runs past its item"),
            Problem::NotOneComponent => write!(f, "{item} name is not one path component"),
        }
    }
}

impl std::error::Error for ItemError {}

impl From<ItemError> for io::Error {
    fn from(e: ItemError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// The type of a file extent item, from its `type` byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentType {
    /// The data is stored in the item itself.
    Inline,
    /// The data is in an extent on disk.
    Regular,
    /// An extent allocated and never written (reads as zeroes).
    Prealloc,
}

impl ExtentType {
    /// The type of the file extent item `body`, from its header alone
    /// (what a count of items needs, whatever the rest holds). A byte
    /// other than inline's or prealloc's reads as regular, as it always
    /// did here (the kernel's tree checker lets no other through).
    pub fn of(body: &[u8]) -> Result<ExtentType, ItemError> {
        match body.get(TYPE) {
            None => Err(ItemError::new(FILE_EXTENT, Problem::Short)),
            Some(&TYPE_INLINE) => Ok(ExtentType::Inline),
            Some(&TYPE_PREALLOC) => Ok(ExtentType::Prealloc),
            Some(_) => Ok(ExtentType::Regular),
        }
    }
}

/// A regular or preallocated extent, as one file extent item references
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DiskExtent {
    /// Where the extent starts on disk; 0 for a hole (no extent).
    pub disk_bytenr: u64,
    /// Its size on disk (compressed, if it is).
    pub disk_num_bytes: u64,
    /// Where in the extent, once uncompressed, the file's data starts.
    pub offset: u64,
    /// How many bytes of the file it holds.
    pub num_bytes: u64,
}

/// An EXTENT_DATA item: one reference of a file to its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileExtent {
    /// Its type.
    pub extent_type: ExtentType,
    /// The compression type (0 none, 1 zlib, 2 lzo, 3 zstd).
    pub compression: u8,
    /// The data's size once uncompressed (for a regular extent, the whole
    /// extent's, however much of it the file references).
    pub ram_bytes: u64,
    /// An inline extent's bytes in the item (compressed, if it is).
    pub inline_len: u64,
    /// A regular or preallocated extent; `None` inline.
    pub disk: Option<DiskExtent>,
}

impl FileExtent {
    /// Parses `struct btrfs_file_extent_item`: an inline one is its
    /// 21-byte header and the data, any other exactly 53 bytes.
    pub fn parse(body: &[u8]) -> Result<FileExtent, ItemError> {
        let extent_type = ExtentType::of(body)?;
        let short = ItemError::new(FILE_EXTENT, Problem::Short);
        let field = |at| le64(body, at).ok_or(short);
        let mut extent = FileExtent {
            extent_type,
            compression: body.get(COMPRESSION).copied().ok_or(short)?,
            ram_bytes: field(RAM_BYTES)?,
            inline_len: 0,
            disk: None,
        };
        if extent_type == ExtentType::Inline {
            extent.inline_len = (body.len() - INLINE_HEADER) as u64;
            return Ok(extent);
        }
        if body.len() != REGULAR_LEN {
            return Err(ItemError::new(FILE_EXTENT, Problem::Length));
        }
        extent.disk = Some(DiskExtent {
            disk_bytenr: field(DISK_BYTENR)?,
            disk_num_bytes: field(DISK_NUM_BYTES)?,
            offset: field(OFFSET)?,
            num_bytes: field(NUM_BYTES)?,
        });
        Ok(extent)
    }
}

/// The fields of an INODE_ITEM read here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InodeItem {
    /// The transaction that made the inode, which a file handle carries
    /// to tell a reused number apart.
    pub(crate) generation: u64,
    /// The transaction that last wrote the item: any change to the file
    /// (data, size, times, owner, mode, links, xattrs) updates its ctime and
    /// so writes the item in the transaction the change is part of. The
    /// filesystem's own order of changes, which no clock can set back.
    pub(crate) transid: u64,
    /// The file's size in bytes.
    pub size: u64,
    /// Its mode (type and permissions).
    pub(crate) mode: u32,
    /// Its btrfs inode flags.
    pub flags: u64,
}

impl InodeItem {
    /// Parses `struct btrfs_inode_item`, checked to be whole.
    pub fn parse(body: &[u8]) -> Result<InodeItem, ItemError> {
        let short = ItemError::new("inode", Problem::Short);
        if body.len() < INODE_ITEM_LEN {
            return Err(short);
        }
        Ok(InodeItem {
            generation: le64(body, INODE_GENERATION).ok_or(short)?,
            transid: le64(body, INODE_TRANSID).ok_or(short)?,
            size: le64(body, INODE_SIZE).ok_or(short)?,
            mode: le32(body, INODE_MODE).ok_or(short)?,
            flags: le64(body, INODE_FLAGS).ok_or(short)?,
        })
    }

    /// Whether btrfs writes the file in place (`chattr +C`).
    pub fn nodatacow(&self) -> bool {
        self.flags & INODE_NODATACOW != 0
    }

    /// Whether it is a regular file.
    pub(crate) fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
}

/// The name an item carries after a little-endian u16 length at `len_at`,
/// from `name_at` on: checked to lie inside the body and to be one path
/// component (1 to 255 bytes, no `/` or NUL, not `.` or `..`), as the
/// kernel writes it.
fn item_name<'b>(
    body: &'b [u8],
    len_at: usize,
    name_at: usize,
    item: &'static str,
) -> Result<&'b [u8], ItemError> {
    let len = body
        .get(len_at..name_at)
        .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
        .ok_or(ItemError::new(item, Problem::ShortNameHeader))?;
    let name = body
        .get(name_at..name_at + len)
        .ok_or(ItemError::new(item, Problem::NamePastEnd))?;
    if name.is_empty()
        || name.len() > 255
        || name == b"."
        || name == b".."
        || name.iter().any(|b| *b == 0 || *b == b'/')
    {
        return Err(ItemError::new(item, Problem::NotOneComponent));
    }
    Ok(name)
}

/// The first name of an INODE_REF item's body (`struct btrfs_inode_ref`,
/// then the name): a directory has exactly one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InodeRef {
    /// The name, one path component of 1 to 255 bytes.
    pub name: OsString,
}

impl InodeRef {
    /// Parses the first reference of `body`.
    pub fn parse(body: &[u8]) -> Result<InodeRef, ItemError> {
        let name = item_name(body, INODE_REF_NAME_LEN, INODE_REF_NAME, "INODE_REF")?;
        Ok(InodeRef {
            name: OsString::from_vec(name.to_vec()),
        })
    }
}

/// One ROOT_REF item of the root tree: child subvolume `child` sits in
/// directory `dirid` of its parent under `name`.
#[cfg_attr(feature = "btrfsutil", allow(dead_code))] // read by the native backend only
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RootRef {
    /// The child subvolume's id (the item key's offset).
    pub child: u64,
    /// The directory of the parent holding it.
    pub dirid: u64,
    /// Its name there, one path component.
    pub name: Vec<u8>,
}

#[cfg_attr(feature = "btrfsutil", allow(dead_code))]
impl RootRef {
    /// Parses the body of the ROOT_REF item keyed (parent, ROOT_REF,
    /// `child`): `struct btrfs_root_ref` (dirid, sequence, name_len:
    /// packed, little endian) followed by the name.
    pub fn parse(child: u64, body: &[u8]) -> Result<RootRef, ItemError> {
        let dirid = le64(body, ROOT_REF_DIRID).ok_or(ItemError::new("ROOT_REF", Problem::Short))?;
        let name = item_name(body, ROOT_REF_NAME_LEN, ROOT_REF_NAME, "ROOT_REF")?;
        Ok(RootRef {
            child,
            dirid,
            name: name.to_vec(),
        })
    }
}

/// The little-endian u64 at `at`, or `None` past the body's end.
fn le64(body: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(body.get(at..at + 8)?.try_into().ok()?))
}

/// The little-endian u32 at `at`, or `None` past the body's end.
fn le32(body: &[u8], at: usize) -> Option<u32> {
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

    /// A file extent item: header (generation, ram_bytes, compression,
    /// encryption, other_encoding, type), then `rest`.
    fn extent(ram: u64, compression: u8, kind: u8, rest: &[u8]) -> Vec<u8> {
        let mut v = 9u64.to_le_bytes().to_vec();
        v.extend_from_slice(&ram.to_le_bytes());
        v.extend_from_slice(&[compression, 0, 0, 0, kind]);
        v.extend_from_slice(rest);
        v
    }

    fn on_disk(bytenr: u64, disk: u64, offset: u64, num: u64) -> Vec<u8> {
        [bytenr, disk, offset, num]
            .iter()
            .flat_map(|n| n.to_le_bytes())
            .collect()
    }

    fn inode_item(size: u64, mode: u32, flags: u64) -> Vec<u8> {
        let mut v = vec![0u8; INODE_ITEM_LEN];
        v[..8].copy_from_slice(&42u64.to_le_bytes());
        v[INODE_SIZE..INODE_SIZE + 8].copy_from_slice(&size.to_le_bytes());
        v[INODE_MODE..INODE_MODE + 4].copy_from_slice(&mode.to_le_bytes());
        v[INODE_FLAGS..INODE_FLAGS + 8].copy_from_slice(&flags.to_le_bytes());
        v
    }

    #[test]
    fn a_regular_extent_parses() {
        let body = extent(8192, 3, 1, &on_disk(1 << 20, 4096, 512, 2048));
        let e = FileExtent::parse(&body).expect("parses");
        assert_eq!(
            (e.extent_type, e.compression, e.ram_bytes),
            (ExtentType::Regular, 3, 8192)
        );
        assert_eq!(
            e.disk,
            Some(DiskExtent {
                disk_bytenr: 1 << 20,
                disk_num_bytes: 4096,
                offset: 512,
                num_bytes: 2048
            })
        );
        let pre = FileExtent::parse(&extent(4096, 0, 2, &on_disk(0, 0, 0, 4096))).expect("parses");
        assert_eq!(pre.extent_type, ExtentType::Prealloc);
        assert_eq!(pre.disk.map(|d| d.disk_bytenr), Some(0), "a hole");
    }

    #[test]
    fn an_inline_extent_parses_with_its_data() {
        let e = FileExtent::parse(&extent(300, 0, 0, &[7; 300])).expect("parses");
        assert_eq!(
            (e.extent_type, e.inline_len, e.ram_bytes, e.disk),
            (ExtentType::Inline, 300, 300, None)
        );
        let empty = FileExtent::parse(&extent(0, 1, 0, b"")).expect("parses");
        assert_eq!((empty.inline_len, empty.compression), (0, 1));
    }

    #[test]
    fn an_unknown_extent_type_reads_as_regular() {
        let body = extent(4096, 0, 7, &on_disk(4096, 4096, 0, 4096));
        assert_eq!(ExtentType::of(&body), Ok(ExtentType::Regular));
        assert!(FileExtent::parse(&body).is_ok());
    }

    #[test]
    fn a_malformed_file_extent_is_an_error() {
        let short = |body: &[u8]| FileExtent::parse(body).err().map(|e| e.problem);
        let regular = extent(4096, 0, 1, &on_disk(4096, 4096, 0, 4096));
        // Truncated anywhere: inside the header, then inside the extent.
        for cut in [0, 8, 16, TYPE] {
            assert_eq!(short(&regular[..cut]), Some(Problem::Short), "cut at {cut}");
            assert!(ExtentType::of(&regular[..cut]).is_err());
        }
        for cut in [DISK_BYTENR, NUM_BYTES, REGULAR_LEN - 1] {
            assert_eq!(
                short(&regular[..cut]),
                Some(Problem::Length),
                "cut at {cut}"
            );
        }
        // Longer than a regular extent: an inode item's body, say.
        let mut long = regular.clone();
        long.push(0);
        assert_eq!(short(&long), Some(Problem::Length));
        let prealloc = extent(4096, 0, 2, &on_disk(4096, 4096, 0, 4096));
        assert_eq!(short(&prealloc[..40]), Some(Problem::Length));
        let err = io::Error::from(FileExtent::parse(&regular[..3]).expect_err("short"));
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(err.to_string(), "malformed file extent item");
    }

    #[test]
    fn an_inode_item_parses() {
        let body = inode_item(12345, libc::S_IFREG | 0o644, INODE_NODATACOW | 0x10);
        let i = InodeItem::parse(&body).expect("parses");
        assert_eq!((i.generation, i.size), (42, 12345));
        assert!(i.is_regular() && i.nodatacow());
        let dir = InodeItem::parse(&inode_item(0, libc::S_IFDIR | 0o755, 0)).expect("parses");
        assert!(!dir.is_regular() && !dir.nodatacow());
    }

    #[test]
    fn a_truncated_inode_item_is_an_error() {
        let body = inode_item(1, libc::S_IFREG, 0);
        for cut in [0, 7, INODE_SIZE + 8, INODE_FLAGS + 8, INODE_ITEM_LEN - 1] {
            let err = InodeItem::parse(&body[..cut]).expect_err("short");
            assert_eq!(err.problem, Problem::Short, "cut at {cut}");
            assert_eq!(
                io::Error::from(err).to_string(),
                "malformed btrfs ioctl reply: short inode item"
            );
        }
        // A file extent item's body is no inode item.
        assert!(InodeItem::parse(&extent(1, 0, 1, &on_disk(1, 1, 0, 1))).is_err());
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
        let problem = |body: &[u8]| InodeRef::parse(body).err().map(|e| e.problem);
        assert_eq!(problem(&inode_ref(b"data", 40)), Some(Problem::NamePastEnd));
        assert_eq!(
            problem(&inode_ref(b"", 0)[..9]),
            Some(Problem::ShortNameHeader)
        );
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
        let problem = |body: &[u8]| RootRef::parse(300, body).err().map(|e| e.problem);
        assert_eq!(
            problem(&root_ref_body(257, b"data", 40)),
            Some(Problem::NamePastEnd)
        );
        assert_eq!(
            problem(&root_ref_body(257, b"", 0)[..10]),
            Some(Problem::ShortNameHeader)
        );
        assert_eq!(
            problem(&root_ref_body(257, b"", 0)[..7]),
            Some(Problem::Short)
        );
        let err = io::Error::from(RootRef::parse(300, &[0; 12]).expect_err("short"));
        assert_eq!(
            err.to_string(),
            "malformed btrfs ioctl reply: ROOT_REF item shorter than its header"
        );
        for bad in NOT_ONE_COMPONENT {
            assert!(RootRef::parse(300, &root_ref_body(257, bad, bad.len() as u16)).is_err());
        }
    }
}
