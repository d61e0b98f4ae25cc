//! Real space use of a volume, without qgroups.
//!
//! qgroups stall I/O, take long rescans and report wrong numbers after a
//! snapshot is dropped, so they are never turned on. Instead the figures are
//! read straight from the file extent items of the volume's b-tree, with the
//! same rules as compsize 1.5: an extent's disk bytes count once however many
//! files or offsets reference it; referenced bytes count every reference.
//!
//! For a subvolume, one TREE_SEARCH_V2 sweep over its own tree reads every
//! item once, in key order within disjoint key ranges read by several
//! threads (no directory walk, no per-inode call; see [`crate::usage::sweep`]),
//! then each nested subvolume's tree likewise. For a plain directory, a walk
//! that never follows a symlink does one tight search per inode.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;

use serde::Serialize;

use crate::sys::item::{ExtentType, FileExtent, InodeItem};
use crate::sys::{self, EXTENT_DATA_KEY, INODE_ITEM_KEY, ItemKey, KeyRange, Searcher};
use crate::walk::{Visit, walk_files};

pub use crate::extents::count_tree_extents;
pub mod sweep;

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

/// A regular (or preallocated) extent, as its references describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Bytes on disk.
    pub disk: u64,
    /// Bytes once uncompressed.
    pub uncompressed: u64,
    /// Compression type, or 256 for a preallocated extent.
    slot: u16,
}

/// The distinct regular extents a tree references, by disk byte number.
///
/// Membership is a sparse bitmap of 4 KiB disk sectors (an extent starts on
/// a sector boundary, so its first sector names it), in cache-line pages of
/// 2 MiB of disk: extents allocated near each other share a page, so a
/// fragmented file's half a million references cost a few hundred KiB of
/// hot memory instead of a half-million-entry hash table missing the cache
/// on every insert. The extents themselves are kept in a list, each once.
#[derive(Debug, Default, Clone)]
pub struct ExtentSet {
    list: Vec<(u64, Extent)>,
    pages: HashMap<u64, [u64; PAGE_WORDS], BuildHasherDefault<PageHasher>>,
    /// Byte numbers not on a 4 KiB boundary (sectors smaller than 4 KiB are
    /// an experimental btrfs option): kept exactly.
    odd: HashSet<u64>,
}

/// Bits per page: one cache line.
const PAGE_WORDS: usize = 8;
const SECTOR_SHIFT: u32 = 12;
const PAGE_SHIFT: u32 = SECTOR_SHIFT + 9;

impl ExtentSet {
    /// Adds the extent at `bytenr` unless it is already in; returns whether
    /// it was new.
    fn insert(&mut self, bytenr: u64, extent: Extent) -> bool {
        let new = if bytenr & ((1 << SECTOR_SHIFT) - 1) != 0 {
            self.odd.insert(bytenr)
        } else {
            let page = self.pages.entry(bytenr >> PAGE_SHIFT).or_default();
            let bit = (bytenr >> SECTOR_SHIFT) & ((PAGE_WORDS as u64 * 64) - 1);
            let (word, mask) = ((bit / 64) as usize, 1u64 << (bit % 64));
            let new = page[word] & mask == 0;
            page[word] |= mask;
            new
        };
        if new {
            self.list.push((bytenr, extent));
        }
        new
    }

    /// Whether the extent at `bytenr` is in the set.
    pub fn contains(&self, bytenr: u64) -> bool {
        if bytenr & ((1 << SECTOR_SHIFT) - 1) != 0 {
            return self.odd.contains(&bytenr);
        }
        let bit = (bytenr >> SECTOR_SHIFT) & ((PAGE_WORDS as u64 * 64) - 1);
        self.pages
            .get(&(bytenr >> PAGE_SHIFT))
            .is_some_and(|page| page[(bit / 64) as usize] & (1 << (bit % 64)) != 0)
    }

    /// How many distinct extents.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Each extent once, with its disk byte number, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Extent)> {
        self.list.iter().map(|(bytenr, e)| (*bytenr, e))
    }

    /// Adds every extent of `other`.
    fn extend(&mut self, other: ExtentSet) {
        for (bytenr, extent) in other.list {
            self.insert(bytenr, extent);
        }
    }
}

/// Hashes a page number (disk byte number over 2 MiB) with one multiply;
/// keys come from our own filesystem, so SipHash's DoS resistance buys
/// nothing.
#[derive(Default, Clone, Copy)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
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

const PREALLOC_SLOT: usize = 256;

/// Accumulates items into compsize's figures and the extent set. An
/// extent's disk and uncompressed bytes count once, however many references
/// it has: they are added up from the set in [`Tally::finish`], after the
/// tallies of a parallel sweep are merged.
struct Tally {
    files: u64,
    refs: u64,
    inline: u64,
    by_type: Vec<Bytes>,
    extents: ExtentSet,
    /// The inode whose item came last, and whether it is a regular file:
    /// a symlink's target is stored as an inline extent, which compsize,
    /// counting regular files' data only, leaves out, and so do we. The
    /// inode item comes before its extents in key order; a range of a
    /// parallel sweep that starts inside an inode (only ever inside one
    /// large file, see the `sweep` module) sees extents with no item
    /// before them, and counts them, as they are a regular file's.
    last_inode: Option<(u64, bool)>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            files: 0,
            refs: 0,
            inline: 0,
            by_type: vec![Bytes::default(); PREALLOC_SLOT + 1],
            extents: ExtentSet::default(),
            last_inode: None,
        }
    }

    fn item(&mut self, key: ItemKey, body: &[u8]) -> io::Result<()> {
        match key.item_type {
            INODE_ITEM_KEY => {
                // A malformed inode item is no regular file's.
                let regular = InodeItem::parse(body).is_ok_and(|inode| inode.is_regular());
                if regular {
                    self.files += 1;
                }
                self.last_inode = Some((key.objectid, regular));
                Ok(())
            }
            EXTENT_DATA_KEY if self.last_inode == Some((key.objectid, false)) => Ok(()),
            EXTENT_DATA_KEY => self.extent(body),
            _ => Ok(()),
        }
    }

    fn extent(&mut self, body: &[u8]) -> io::Result<()> {
        let extent = FileExtent::parse(body)?;
        let slot = match extent.extent_type {
            ExtentType::Prealloc => PREALLOC_SLOT,
            ExtentType::Inline | ExtentType::Regular => usize::from(extent.compression),
        };
        let Some(disk) = extent.disk else {
            let b = &mut self.by_type[slot];
            b.disk += extent.inline_len;
            b.uncompressed += extent.ram_bytes;
            b.referenced += extent.ram_bytes;
            self.inline += 1;
            return Ok(());
        };
        if disk.disk_bytenr == 0 {
            return Ok(()); // a hole
        }
        self.extents.insert(
            disk.disk_bytenr,
            Extent {
                disk: disk.disk_num_bytes,
                uncompressed: extent.ram_bytes,
                slot: slot as u16,
            },
        );
        self.by_type[slot].referenced += disk.num_bytes;
        self.refs += 1;
        Ok(())
    }

    /// Adds the tally of the part of the trees that comes after this one
    /// in key order: an extent both reference stays booked under this
    /// tally's type for it, as a one-thread sweep would book it (a partly
    /// written preallocated extent has both regular and prealloc references).
    fn merge(mut self, other: Tally) -> Tally {
        self.files += other.files;
        self.refs += other.refs;
        self.inline += other.inline;
        for (b, o) in self.by_type.iter_mut().zip(other.by_type) {
            b.add(o);
        }
        self.extents.extend(other.extents);
        self
    }

    fn finish(mut self) -> (Usage, ExtentSet) {
        for (_, e) in self.extents.iter() {
            let b = &mut self.by_type[usize::from(e.slot)];
            b.disk += e.disk;
            b.uncompressed += e.uncompressed;
        }
        let mut usage = Usage {
            files: self.files,
            extents: self.extents.len() as u64,
            refs: self.refs,
            inline: self.inline,
            ..Usage::default()
        };
        for (slot, b) in self.by_type.into_iter().enumerate() {
            usage.total.add(b);
            // compsize lists a type only if it holds uncompressed bytes: a
            // type with references alone (to extents booked under another)
            // counts in the total only.
            if b.uncompressed == 0 {
                continue;
            }
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

/// Threads sweeping a subvolume's tree (see [`crate::usage::sweep`]): warm, one
/// per core copies items out; cold, more keep several leaf reads in flight,
/// so at least 8 whatever the cores. Measured once, with a temporary knob,
/// on the bench's trees on a 2-core VM (loop-mounted btrfs, kernel 6.18),
/// whole process, medians of 5 cold (`drop_caches`) and 7 warm runs:
///
/// | threads | 100k small files, cold / warm | one 500k-extent file, cold / warm |
/// |---------|-------------------------------|-----------------------------------|
/// | 1       | 758 ms / 155 ms               | 587 ms / 129 ms                   |
/// | 2       | 412 ms / 75 ms                | 309 ms / 60 ms                    |
/// | 4       | 320 ms                        | 248 ms                            |
/// | 8       | 286-297 ms / 77 ms            | 225-235 ms / 64 ms                |
/// | 16      | 296 ms / 80 ms                | 214 ms / 66 ms                    |
///
/// Cold, the small-files tree's leaves (about 15,600, 245 MiB; the bench
/// prints the count) are then read by 8 threads at once.
fn sweep_threads() -> usize {
    std::thread::available_parallelism().map_or(8, |n| n.get().clamp(8, 16))
}

/// Sweeps the whole tree `tree` (0: that of the subvolume holding `fd`)
/// into `tally`.
fn sweep(fd: BorrowedFd<'_>, tree: u64, tally: Tally) -> io::Result<Tally> {
    let ranges =
        crate::usage::sweep::sweep(fd, tree, sweep_threads(), Tally::new, |t, key, body| {
            t.item(key, body)
        })?;
    Ok(ranges.into_iter().map(|(_, t)| t).fold(tally, Tally::merge))
}

/// Usage of the subvolume open as `fd` and every subvolume nested in it, as
/// `compsize` reports for its path, plus the set of extents it references.
/// Each nested subvolume's tree is swept by its id: no path is taken, so
/// no depth, name length or mount inside the volume stands in the way.
pub fn subvolume_usage(fd: BorrowedFd<'_>) -> io::Result<(Usage, ExtentSet)> {
    let mut tally = sweep(fd, 0, Tally::new())?;
    for n in sys::nested_subvolumes(fd)? {
        tally = sweep(fd, n.id, tally)?;
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
    /// Held by the backup and not by the live volume: at most what
    /// dropping the backup frees. Only these two trees are compared; an
    /// extent another tree also holds (a conversion's old tree or its rest,
    /// a reflink copy elsewhere on the filesystem) stays allocated after
    /// the drop, so this overstates by whatever they share with the backup.
    pub backup_only: u64,
    /// Held only by the live volume.
    pub live_only: u64,
    /// Held by both.
    pub shared: u64,
}

/// Splits the disk bytes of two extent sets.
pub fn split(live: &ExtentSet, backup: &ExtentSet) -> Split {
    let mut s = Split::default();
    for (bytenr, e) in live.iter() {
        if backup.contains(bytenr) {
            s.shared += e.disk;
        } else {
            s.live_only += e.disk;
        }
    }
    s.backup_only = backup
        .iter()
        .filter(|&(bytenr, _)| !live.contains(bytenr))
        .map(|(_, e)| e.disk)
        .sum();
    s
}
