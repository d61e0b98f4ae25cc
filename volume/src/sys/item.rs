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
/// `nlink`.
const INODE_NLINK: usize = 40;
/// `mode`.
const INODE_MODE: usize = 52;
/// `flags`.
const INODE_FLAGS: usize = 64;
/// `sizeof(struct btrfs_inode_item)`: the kernel writes every inode item
/// whole (its tree checker refuses any other size).
const INODE_ITEM_LEN: usize = 160;
/// `BTRFS_INODE_NODATASUM` in those flags: no checksums (a file created
/// on a `nodatasum` mount, or NOCOW).
const INODE_NODATASUM: u64 = 1 << 0;
/// `BTRFS_INODE_NODATACOW`: written in place (`chattr +C`, which sets
/// NODATASUM too, or a `nodatacow` mount).
const INODE_NODATACOW: u64 = 1 << 1;

/// `BTRFS_EMPTY_SUBVOL_DIR_OBJECTID`: the inode number of the stub a
/// subvolume nested in another leaves in a snapshot of that other (an empty
/// directory that can be removed, not renamed). No inode of a subvolume's
/// tree has it: theirs start at 256.
pub const EMPTY_SUBVOL_DIR_OBJECTID: u64 = 2;

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
    /// Its number of names (hard links).
    pub nlink: u32,
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
            nlink: le32(body, INODE_NLINK).ok_or(short)?,
            mode: le32(body, INODE_MODE).ok_or(short)?,
            flags: le64(body, INODE_FLAGS).ok_or(short)?,
        })
    }

    /// Whether btrfs writes the file in place (`chattr +C`).
    pub fn nodatacow(&self) -> bool {
        self.flags & INODE_NODATACOW != 0
    }

    /// Whether the file's data has no checksums (a NOCOW file, or one
    /// created on a `nodatasum` mount, which is still copied on write).
    pub fn nodatasum(&self) -> bool {
        self.flags & INODE_NODATASUM != 0
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
        // The bits as fs/btrfs/btrfs_inode.h numbers them, not this
        // module's constants: NODATASUM (1 << 0), NODATACOW (1 << 1),
        // and NODUMP (1 << 8).
        let body = inode_item(12345, libc::S_IFREG | 0o644, 0b10 | 0x100);
        let i = InodeItem::parse(&body).expect("parses");
        assert_eq!((i.generation, i.size), (42, 12345));
        assert!(i.is_regular() && i.nodatacow() && !i.nodatasum());
        let sum = InodeItem::parse(&inode_item(1, libc::S_IFREG, 0b01)).expect("parses");
        assert!(sum.nodatasum() && !sum.nodatacow());
        let dir = InodeItem::parse(&inode_item(0, libc::S_IFDIR | 0o755, 0)).expect("parses");
        assert!(!dir.is_regular() && !dir.nodatacow() && !dir.nodatasum());
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

    /// Items the kernel wrote, read back by TREE_SEARCH, against what the
    /// kernel says of the same files by other means (stat, `lsattr -v`,
    /// the flags it sets itself): the offsets and bits above are the
    /// kernel's, not only consistent with themselves.
    mod kernel_written {
        use std::fs::{self, File};
        use std::io::{Seek, SeekFrom, Write};
        use std::ops::ControlFlow;
        use std::os::fd::AsFd;
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        use std::path::Path;

        use super::super::*;
        use crate::sys::{self, EXTENT_DATA_KEY, INODE_ITEM_KEY, InodeFlags, KeyRange, Searcher};

        /// Every item of type `item_type` of `path`'s inode, committed
        /// first (a new inode's items may wait in memory until then).
        fn items_of(path: &Path, item_type: u8) -> Vec<(u64, Vec<u8>)> {
            let f = File::open(path).unwrap();
            sys::commit(f.as_fd()).unwrap();
            let ino = f.metadata().unwrap().ino();
            let mut out = Vec::new();
            sys::search(
                f.as_fd(),
                KeyRange::inode_items(ino, item_type),
                |k, body| {
                    out.push((k.offset, body.to_vec()));
                    ControlFlow::Continue(())
                },
            )
            .unwrap();
            out
        }

        fn inode_of(path: &Path) -> InodeItem {
            let items = items_of(path, INODE_ITEM_KEY);
            assert_eq!(items.len(), 1, "{}", path.display());
            InodeItem::parse(&items[0].1).expect("the kernel's inode item parses")
        }

        fn extents_of(path: &Path) -> Vec<(u64, FileExtent)> {
            items_of(path, EXTENT_DATA_KEY)
                .into_iter()
                .map(|(at, body)| (at, FileExtent::parse(&body).expect("the kernel's item")))
                .collect()
        }

        /// The inode generation `lsattr -v` prints (FS_IOC_GETVERSION).
        fn lsattr_generation(path: &Path) -> u64 {
            let out = test_fs::run(std::process::Command::new("lsattr").arg("-v").arg(path))
                .expect("lsattr -v");
            let text = String::from_utf8_lossy(&out.stdout);
            let first = text.split_whitespace().next().expect("a generation");
            first.parse().unwrap_or_else(|e| panic!("{first:?}: {e}"))
        }

        fn nocow_file(path: &Path, data: &[u8]) {
            let mut f = File::create(path).unwrap();
            sys::set_inode_flags(f.as_fd(), InodeFlags::NOCOW).unwrap();
            f.write_all(data).unwrap();
        }

        /// A plain file, a `chattr +C` one and one created on a
        /// `nodatasum` mount: the kernel sets NODATACOW and NODATASUM for
        /// the second, NODATASUM alone for the third. Generation, size and
        /// mode are what `lsattr -v` and stat say.
        #[test]
        fn inode_items_and_flags_are_the_kernels() {
            let fs = test_fs::fs_or_skip!(test_fs::LoopFs::btrfs(256 << 20));
            let plain = fs.path("plain");
            fs::write(&plain, vec![7u8; 12345]).unwrap();
            fs::set_permissions(&plain, fs::Permissions::from_mode(0o640)).unwrap();
            let nocow = fs.path("nocow");
            nocow_file(&nocow, &[1u8; 5000]);
            for path in [&plain, &nocow] {
                let (item, st) = (inode_of(path), fs::metadata(path).unwrap());
                assert_eq!(item.size, st.size());
                assert_eq!(item.mode, st.mode());
                assert!(item.is_regular());
                assert_eq!(item.generation, lsattr_generation(path));
            }
            let item = inode_of(&plain);
            assert!(!item.nodatacow() && !item.nodatasum(), "{:#x}", item.flags);
            let item = inode_of(&nocow);
            assert!(item.nodatacow() && item.nodatasum(), "{:#x}", item.flags);
            let dir = inode_of(fs.mount_point());
            assert!(!dir.is_regular() && dir.mode & libc::S_IFMT == libc::S_IFDIR);

            let nosum_fs = test_fs::fs_or_skip!(test_fs::LoopFs::with_mount_options(
                test_fs::FsKind::Btrfs,
                256 << 20,
                "nodatasum"
            ));
            let nosum = nosum_fs.path("nosum");
            fs::write(&nosum, vec![3u8; 9000]).unwrap();
            let item = inode_of(&nosum);
            assert!(item.nodatasum() && !item.nodatacow(), "{:#x}", item.flags);
        }

        /// File extent items as the kernel writes them: inline and
        /// compressed (with its uncompressed size), regular with an offset
        /// into its extent after a partial overwrite, preallocated.
        #[test]
        fn file_extent_items_are_the_kernels() {
            let fs = test_fs::fs_or_skip!(test_fs::LoopFs::with_mount_options(
                test_fs::FsKind::Btrfs,
                256 << 20,
                "compress-force=zstd,max_inline=2048"
            ));
            let small = fs.path("small");
            fs::write(&small, vec![b'a'; 1000]).unwrap();
            let e = extents_of(&small);
            assert_eq!(e.len(), 1);
            let (at, inline) = e[0];
            assert_eq!(
                (at, inline.extent_type, inline.disk),
                (0, ExtentType::Inline, None)
            );
            assert_eq!((inline.ram_bytes, inline.compression), (1000, 3));
            assert!(inline.inline_len > 0 && inline.inline_len < 1000);

            // NOCOW: never compressed; overwritten in place, so a COW
            // file shows the offset: a clean 64 KiB extent, then its
            // first 4 KiB written again.
            let cow = fs.path("cow");
            nocow_file(&fs.path("nocow"), &[5u8; 65536]);
            let whole = extents_of(&fs.path("nocow"));
            assert_eq!(whole.len(), 1);
            let d = whole[0].1.disk.expect("on disk");
            assert_eq!(
                (whole[0].1.extent_type, whole[0].1.compression),
                (ExtentType::Regular, 0)
            );
            assert_eq!((d.disk_num_bytes, d.num_bytes, d.offset), (65536, 65536, 0));
            assert_eq!(whole[0].1.ram_bytes, 65536);
            assert_ne!(d.disk_bytenr, 0);
            // A reflink of its second half starts 32 KiB into the extent.
            let src = File::open(fs.path("nocow")).unwrap();
            let mut dst = File::create(&cow).unwrap();
            sys::set_inode_flags(dst.as_fd(), InodeFlags::NOCOW).unwrap();
            sys::ficlone_range(dst.as_fd(), src.as_fd(), 32768, 32768).unwrap();
            let half = extents_of(&cow);
            assert_eq!(half.len(), 1);
            assert_eq!(half[0].0, 32768, "keyed by its offset in the file");
            let h = half[0].1.disk.expect("on disk");
            assert_eq!((h.disk_bytenr, h.disk_num_bytes), (d.disk_bytenr, 65536));
            assert_eq!((h.offset, h.num_bytes), (32768, 32768));

            dst.seek(SeekFrom::Start(0)).unwrap();
            rustix::fs::fallocate(
                &dst,
                rustix::fs::FallocateFlags::KEEP_SIZE,
                1 << 20,
                1 << 20,
            )
            .unwrap();
            let all = extents_of(&cow);
            let (at, pre) = all.last().copied().expect("two items");
            assert_eq!((at, pre.extent_type), (1 << 20, ExtentType::Prealloc));
            assert_eq!(pre.disk.map(|p| p.num_bytes), Some(1 << 20));
        }

        /// A subvolume nested in another is, in a snapshot of that other, a
        /// directory with the stub's inode number; its ROOT_REF names the
        /// directory and the name it was made under, and a directory's
        /// INODE_REF its name and parent.
        #[test]
        fn refs_and_the_stubs_number_are_the_kernels() {
            let fs = test_fs::fs_or_skip!(test_fs::LoopFs::btrfs(256 << 20));
            fs::create_dir(fs.path("d")).unwrap();
            let top = File::open(fs.mount_point()).unwrap();
            let d = File::open(fs.path("d")).unwrap();
            sys::create_subvolume(d.as_fd(), "sub".as_ref()).unwrap();
            sys::snapshot(top.as_fd(), top.as_fd(), "snap".as_ref()).unwrap();
            let stub = fs::symlink_metadata(fs.path("snap/d/sub")).unwrap();
            assert!(stub.is_dir());
            assert_eq!(stub.ino(), EMPTY_SUBVOL_DIR_OBJECTID);

            let d_ino = d.metadata().unwrap().ino();
            let refs = items_of(&fs.path("d"), INODE_REF_KEY);
            assert_eq!(refs.len(), 1);
            assert_eq!(refs[0].0, 256, "keyed by the parent directory");
            assert_eq!(InodeRef::parse(&refs[0].1).unwrap().name, "d");

            let sub = File::open(fs.path("d/sub")).unwrap();
            let sub_id = sys::subvolume_info(sub.as_fd()).unwrap().id;
            let mut found = Vec::new();
            // The root tree (1); the top-level subvolume is tree 5.
            let range = KeyRange {
                min: sys::ItemKey {
                    objectid: 5,
                    item_type: ROOT_REF_KEY,
                    offset: 0,
                },
                max: sys::ItemKey {
                    objectid: 5,
                    item_type: ROOT_REF_KEY,
                    offset: u64::MAX,
                },
            };
            Searcher::default()
                .search_tree(top.as_fd(), 1, range, |k, body| {
                    found.push(RootRef::parse(k.offset, body).unwrap());
                    ControlFlow::Continue(())
                })
                .unwrap();
            let r = found
                .iter()
                .find(|r| r.child == sub_id)
                .expect("its ROOT_REF");
            assert_eq!((r.dirid, r.name.as_slice()), (d_ino, b"sub".as_slice()));
        }
    }
}
