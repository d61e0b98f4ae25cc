//! Real space use of a volume, without qgroups.
//!
//! qgroups stall I/O, take long rescans and report wrong numbers after a
//! snapshot is dropped, so they are never turned on. Instead the figures are
//! read straight from the file extent items of the volume's b-tree, with the
//! same rules as compsize 1.5: an extent's disk bytes count once however many
//! files or offsets reference it; referenced bytes count every reference.
//!
//! For a subvolume, one TREE_SEARCH_V2 sweep over its own tree reads every
//! item in key order (no directory walk, no per-inode call), then each nested
//! subvolume's tree likewise. For a plain directory, a walk that never
//! follows a symlink does one tight search per inode.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, BorrowedFd};

use serde::Serialize;

use crate::sys::{self, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher};
use crate::walk::{Visit, walk_files};

/// compsize's three figures, for one compression type or in total.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bytes {
    /// Bytes on disk (compressed size), each extent once.
    pub disk: u64,
    /// The same extents' uncompressed size.
    pub uncompressed: u64,
    /// Bytes of file data referencing them (shared references counted each time).
    pub referenced: u64,
}

impl Bytes {
    fn add(&mut self, o: Bytes) {
        self.disk += o.disk;
        self.uncompressed += o.uncompressed;
        self.referenced += o.referenced;
    }
}

/// Space use of a tree, as compsize reports it.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Regular files (inodes; compsize counts a hardlinked file once per name).
    pub files: u64,
    /// Distinct regular extents.
    pub extents: u64,
    /// References to regular extents.
    pub refs: u64,
    /// Inline extents (data stored in the metadata item).
    pub inline: u64,
    /// All compression types together.
    pub total: Bytes,
    /// Per compression type: `none`, `zlib`, `lzo`, `zstd`, `prealloc`
    /// (preallocated, unwritten), or `?N` for a type unknown here.
    pub by_type: BTreeMap<String, Bytes>,
}

/// The regular extents a tree references: disk byte number to disk size.
pub type ExtentSet = HashMap<u64, u64, BuildHasherDefault<BytenrHasher>>;

/// Hashes a disk byte number with one multiply. The default SipHash (DoS
/// resistance we do not need: keys come from our own filesystem) was about a
/// fifth of `usage`'s user time. Byte numbers are multiples of the sector
/// size, so the low bits of the product are zero: the high half is folded in.
#[derive(Default, Clone, Copy)]
pub struct BytenrHasher(u64);

impl Hasher for BytenrHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// TREE_SEARCH_V2 buffer for a whole-tree sweep. A bigger one saves ioctls
/// (tree re-descents) but the kernel faults the whole buffer in on every call;
/// measured warm, whole process, medians of 7 (kernel 6.18, loop-mounted):
///
/// | buffer  | 100k small files | one file, 1M extents |
/// |---------|------------------|----------------------|
/// | 64 KiB  | 120 ms           | 292 ms               |
/// | 256 KiB | 118 ms           | 294 ms               |
/// | 1 MiB   | 123 ms           | 314 ms               |
/// | 4 MiB   | 136 ms           | 315 ms               |
///
/// No size wins beyond noise, so the default stays.
const SWEEP_BUF_SIZE: usize = sys::DEFAULT_BUF_SIZE;

/// File extent item layout (`struct btrfs_file_extent_item`, little endian).
mod item {
    pub const RAM_BYTES: usize = 8;
    pub const COMPRESSION: usize = 16;
    pub const TYPE: usize = 20;
    pub const DISK_BYTENR: usize = 21;
    pub const DISK_NUM_BYTES: usize = 29;
    pub const NUM_BYTES: usize = 45;
    /// Header size of an inline extent; the data follows.
    pub const INLINE_HEADER: usize = 21;
    /// Size of a regular or prealloc extent item.
    pub const REGULAR_LEN: usize = 53;
    pub const TYPE_INLINE: u8 = 0;
    pub const TYPE_PREALLOC: u8 = 2;
    /// `st_mode` in `struct btrfs_inode_item`.
    pub const INODE_MODE: usize = 52;
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

const PREALLOC_SLOT: usize = 256;

/// Accumulates items into compsize's figures and the extent set.
struct Tally {
    files: u64,
    refs: u64,
    inline: u64,
    by_type: Vec<Bytes>,
    extents: ExtentSet,
}

impl Tally {
    fn new() -> Self {
        Tally {
            files: 0,
            refs: 0,
            inline: 0,
            by_type: vec![Bytes::default(); PREALLOC_SLOT + 1],
            extents: ExtentSet::default(),
        }
    }

    fn item(&mut self, key: ItemKey, body: &[u8]) -> io::Result<()> {
        match key.item_type {
            INODE_ITEM_KEY if body.len() >= item::INODE_MODE + 4 => {
                let mode = le32(body, item::INODE_MODE);
                if mode & libc::S_IFMT == libc::S_IFREG {
                    self.files += 1;
                }
                Ok(())
            }
            EXTENT_DATA_KEY => self.extent(body),
            _ => Ok(()),
        }
    }

    fn extent(&mut self, body: &[u8]) -> io::Result<()> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed file extent item");
        if body.len() < item::DISK_BYTENR {
            return Err(bad());
        }
        let ram_bytes = le64(body, item::RAM_BYTES);
        let mut slot = usize::from(body[item::COMPRESSION]);
        match body[item::TYPE] {
            item::TYPE_INLINE => {
                let b = &mut self.by_type[slot];
                b.disk += (body.len() - item::INLINE_HEADER) as u64;
                b.uncompressed += ram_bytes;
                b.referenced += ram_bytes;
                self.inline += 1;
                return Ok(());
            }
            item::TYPE_PREALLOC => slot = PREALLOC_SLOT,
            _ => {}
        }
        if body.len() != item::REGULAR_LEN {
            return Err(bad());
        }
        let disk_bytenr = le64(body, item::DISK_BYTENR);
        if disk_bytenr == 0 {
            return Ok(()); // a hole
        }
        let disk_num_bytes = le64(body, item::DISK_NUM_BYTES);
        let b = &mut self.by_type[slot];
        if self.extents.insert(disk_bytenr, disk_num_bytes).is_none() {
            b.disk += disk_num_bytes;
            b.uncompressed += ram_bytes;
        }
        b.referenced += le64(body, item::NUM_BYTES);
        self.refs += 1;
        Ok(())
    }

    fn finish(self) -> (Usage, ExtentSet) {
        let mut usage = Usage {
            files: self.files,
            extents: self.extents.len() as u64,
            refs: self.refs,
            inline: self.inline,
            ..Usage::default()
        };
        for (slot, b) in self.by_type.into_iter().enumerate() {
            if b == Bytes::default() {
                continue;
            }
            usage.total.add(b);
            let name = match slot {
                0 => "none".to_owned(),
                1 => "zlib".to_owned(),
                2 => "lzo".to_owned(),
                3 => "zstd".to_owned(),
                PREALLOC_SLOT => "prealloc".to_owned(),
                n => format!("?{n}"),
            };
            usage.by_type.insert(name, b);
        }
        (usage, self.extents)
    }
}

/// Sweeps the whole tree of the subvolume holding `fd` into `tally`.
fn sweep(fd: BorrowedFd<'_>, tally: &mut Tally) -> io::Result<()> {
    let mut err = None;
    Searcher::new(SWEEP_BUF_SIZE).search(fd, KeyRange::all(), |key, body| {
        match tally.item(key, body) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                err = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    err.map_or(Ok(()), Err)
}

/// Usage of the subvolume open as `fd` and every subvolume nested in it, as
/// `compsize` reports for its path, plus the set of extents it references.
pub fn subvolume_usage(fd: BorrowedFd<'_>) -> io::Result<(Usage, ExtentSet)> {
    let mut tally = Tally::new();
    sweep(fd, &mut tally)?;
    for rel in sys::nested_subvolumes(fd)? {
        let sub = sys::open_beneath(fd, &rel)?;
        sweep(sub.as_fd(), &mut tally)?;
    }
    Ok(tally.finish())
}

/// Usage of a plain directory tree, one tight search per regular file.
/// Unlike a sweep, a hardlinked file is counted once per name (as compsize).
pub fn directory_usage(dir: BorrowedFd<'_>) -> io::Result<(Usage, ExtentSet)> {
    let mut tally = Tally::new();
    let mut err = None;
    let mut searcher = Searcher::default();
    walk_files(dir, &mut |parent, ino| {
        tally.files += 1;
        searcher.search(
            parent,
            KeyRange::inode_items(ino, EXTENT_DATA_KEY),
            |key, body| {
                if key.item_type != EXTENT_DATA_KEY {
                    return ControlFlow::Continue(());
                }
                match tally.extent(body) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => {
                        err = Some(e);
                        ControlFlow::Break(())
                    }
                }
            },
        )?;
        Ok(if err.is_some() {
            Visit::Stop
        } else {
            Visit::Continue
        })
    })?;
    err.map_or(Ok(()), Err)?;
    Ok(tally.finish())
}

/// Usage of the directory or subvolume open as `fd`, whichever it is.
pub fn tree_usage(fd: BorrowedFd<'_>) -> io::Result<(Usage, ExtentSet)> {
    if sys::is_subvolume(fd)? {
        subvolume_usage(fd)
    } else {
        directory_usage(fd)
    }
}

/// How the disk bytes of a volume and its install backup split.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Split {
    /// Held only by the backup: what dropping it frees.
    pub backup_only: u64,
    /// Held only by the live volume.
    pub live_only: u64,
    /// Held by both.
    pub shared: u64,
}

/// Splits the disk bytes of two extent sets.
pub fn split(live: &ExtentSet, backup: &ExtentSet) -> Split {
    let mut s = Split::default();
    for (bytenr, len) in live {
        if backup.contains_key(bytenr) {
            s.shared += len;
        } else {
            s.live_only += len;
        }
    }
    s.backup_only = backup
        .iter()
        .filter(|(bytenr, _)| !live.contains_key(bytenr))
        .map(|(_, len)| len)
        .sum();
    s
}
