//! BTRFS_IOC_TREE_SEARCH_V2: reading a subvolume's own b-tree items.

use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{Opcode, opcode};

use super::ioctl::{BTRFS_IOCTL_MAGIC, WordsArg, ensure_btrfs, malformed};

/// `BTRFS_INODE_ITEM_KEY`: one per inode, holding its mode.
pub const INODE_ITEM_KEY: u8 = 1;
/// `BTRFS_EXTENT_DATA_KEY`: one item per file extent reference.
pub const EXTENT_DATA_KEY: u8 = 108;
/// The default result buffer: 64 KiB is the largest metadata node, hence
/// the largest item, so any search fits; a bigger buffer only costs the
/// kernel time faulting it in on every call (see compsize's history),
/// which hurts tight per-inode searches.
pub(crate) const DEFAULT_BUF_SIZE: usize = 64 * 1024;
/// The kernel's limit on a TREE_SEARCH_V2 buffer.
const MAX_BUF_SIZE: usize = 16 << 20;
const HEADER_LEN: usize = 32;

/// A b-tree key: items are sorted by (objectid, type, offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ItemKey {
    /// Inode number for file items.
    pub objectid: u64,
    /// Item type (`*_KEY`).
    pub item_type: u8,
    /// Type-specific; the file offset for extent items.
    pub offset: u64,
}

impl ItemKey {
    /// The smallest key after this one, or `None` at the very end.
    pub fn successor(self) -> Option<ItemKey> {
        if let Some(offset) = self.offset.checked_add(1) {
            return Some(ItemKey { offset, ..self });
        }
        if let Some(item_type) = self.item_type.checked_add(1) {
            return Some(ItemKey {
                item_type,
                offset: 0,
                ..self
            });
        }
        Some(ItemKey {
            objectid: self.objectid.checked_add(1)?,
            item_type: 0,
            offset: 0,
        })
    }

    /// The largest key before this one, or `None` at the very start.
    pub fn predecessor(self) -> Option<ItemKey> {
        if let Some(offset) = self.offset.checked_sub(1) {
            return Some(ItemKey { offset, ..self });
        }
        if let Some(item_type) = self.item_type.checked_sub(1) {
            return Some(ItemKey {
                item_type,
                offset: u64::MAX,
                ..self
            });
        }
        Some(ItemKey {
            objectid: self.objectid.checked_sub(1)?,
            item_type: u8::MAX,
            offset: u64::MAX,
        })
    }
}

/// An inclusive range of keys, compared as whole tuples (the kernel's
/// semantics: every item between `min` and `max` is returned, whatever
/// its type, so callers filter by type).
#[derive(Debug, Clone, Copy)]
pub struct KeyRange {
    /// First key.
    pub min: ItemKey,
    /// Last key.
    pub max: ItemKey,
}

impl KeyRange {
    /// Every item of one type of one inode.
    pub fn inode_items(ino: u64, item_type: u8) -> Self {
        KeyRange {
            min: ItemKey {
                objectid: ino,
                item_type,
                offset: 0,
            },
            max: ItemKey {
                objectid: ino,
                item_type,
                offset: u64::MAX,
            },
        }
    }

    /// Every item of the tree.
    pub fn all() -> Self {
        KeyRange {
            min: ItemKey {
                objectid: 0,
                item_type: 0,
                offset: 0,
            },
            max: ItemKey {
                objectid: u64::MAX,
                item_type: u8::MAX,
                offset: u64::MAX,
            },
        }
    }
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct SearchKey {
    tree_id: u64,
    min_objectid: u64,
    max_objectid: u64,
    min_offset: u64,
    max_offset: u64,
    min_transid: u64,
    max_transid: u64,
    min_type: u32,
    max_type: u32,
    nr_items: u32,
    unused: u32,
    unused1: u64,
    unused2: u64,
    unused3: u64,
    unused4: u64,
}

/// `struct btrfs_ioctl_search_args_v2` without its flexible buffer; the
/// ioctl number encodes this size.
#[repr(C)]
struct SearchArgsV2 {
    key: SearchKey,
    buf_size: u64,
}

// `struct btrfs_ioctl_search_key` is 104 bytes, the v2 args header 112.
const _: () = assert!(std::mem::size_of::<SearchKey>() == 104);
const _: () = assert!(std::mem::size_of::<SearchArgsV2>() == 112);
const ARGS_WORDS: usize = std::mem::size_of::<SearchArgsV2>() / 8;
const _: () = assert!(std::mem::size_of::<SearchArgsV2>().is_multiple_of(8));

/// BTRFS_IOC_TREE_SEARCH_V2: its argument is the args header followed
/// by the result buffer, `ARGS_WORDS + buf_size / 8` words in all.
const TREE_SEARCH_V2: Opcode = opcode::read_write::<SearchArgsV2>(BTRFS_IOCTL_MAGIC, 17);

/// The item at byte `pos` of a result buffer: its key, its body, and where
/// the next item starts. `None` when the header, or the body it announces,
/// runs past the buffer's end: the kernel never writes such a buffer, but
/// nothing read from it is trusted to stay in bounds.
fn item_at(buf: &[u8], pos: usize) -> Option<(ItemKey, &[u8], usize)> {
    let h = buf.get(pos..pos.checked_add(HEADER_LEN)?)?;
    let word = |at: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(h.get(at..at + 8)?.try_into().ok()?))
    };
    let half = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(h.get(at..at + 4)?.try_into().ok()?))
    };
    let key = ItemKey {
        objectid: word(8)?,
        offset: word(16)?,
        item_type: u8::try_from(half(24)?).ok()?,
    };
    let start = pos + HEADER_LEN;
    let end = start.checked_add(usize::try_from(half(28)?).ok()?)?;
    Some((key, buf.get(start..end)?, end))
}

impl<'a> Batch<'a> {
    /// The first `len` items of the result buffer `buf`, once each is
    /// checked to lie wholly inside it: an error, never a panic, for a
    /// count or an item length the buffer cannot hold.
    pub fn parse(buf: &'a [u8], len: usize) -> io::Result<Batch<'a>> {
        let mut pos = 0;
        for n in 0..len {
            match item_at(buf, pos) {
                Some((_, _, next)) => pos = next,
                None => {
                    return Err(malformed(&format!(
                        "tree search item {n} of {len} runs past the {}-byte buffer",
                        buf.len()
                    )));
                }
            }
        }
        Ok(Batch { buf, len })
    }
}

/// A reusable TREE_SEARCH_V2 buffer. Allocating (and zeroing) a fresh
/// 64 KiB buffer per search used to cost more than a small file's search
/// itself: callers doing one search per inode keep one `Searcher`.
pub struct Searcher {
    mem: Vec<u64>,
    buf_size: usize,
    /// The oldest transaction whose tree blocks are read (see
    /// [`Searcher::written_since`]); 0, every block.
    min_transid: u64,
    /// The name its ioctls carry in the fault trace.
    call: &'static str,
}

impl Default for Searcher {
    fn default() -> Self {
        Searcher::new(DEFAULT_BUF_SIZE)
    }
}

impl Searcher {
    /// A searcher whose result buffer holds `buf_size` bytes (at least
    /// the default 64 KiB, at most the kernel's 16 MiB limit).
    pub fn new(buf_size: usize) -> Self {
        let buf_size = buf_size.clamp(DEFAULT_BUF_SIZE, MAX_BUF_SIZE) / 8 * 8;
        Searcher {
            // calloc'd: pages the kernel never fills are never touched.
            mem: vec![0u64; ARGS_WORDS + buf_size / 8],
            buf_size,
            min_transid: 0,
            call: "ioctl TREE_SEARCH_V2",
        }
    }

    /// The same searcher, its ioctls named `call` in the fault trace
    /// ([`super::fault`]), so a trace tells one tree's searches apart.
    pub(crate) fn named(mut self, call: &'static str) -> Self {
        self.call = call;
        self
    }

    /// Reads only the tree blocks written in transaction `transid` or
    /// later: the kernel skips every older node and leaf, so a search for
    /// what changed since costs what changed, not the tree. A leaf is
    /// written whole, so the items it returns still include older ones:
    /// each item's own record of its transaction decides (an inode item's
    /// `transid`, for one).
    pub(crate) fn written_since(mut self, transid: u64) -> Self {
        self.min_transid = transid;
        self
    }

    fn args(&mut self) -> &mut SearchArgsV2 {
        // SAFETY: `mem` starts with ARGS_WORDS aligned words, the size of
        // the repr(C) SearchArgsV2, made of plain integers.
        unsafe { &mut *self.mem.as_mut_ptr().cast::<SearchArgsV2>() }
    }

    fn buf(&self) -> &[u8] {
        // SAFETY: the words after the header are `buf_size` plain bytes.
        unsafe {
            std::slice::from_raw_parts(
                self.mem.as_ptr().add(ARGS_WORDS).cast::<u8>(),
                self.buf_size,
            )
        }
    }

    /// One ioctl: fills the buffer with the first items, in key order,
    /// from `from` to `max` of the subvolume holding `fd`, at most `limit`
    /// of them. An empty batch means the range holds nothing more;
    /// otherwise the items after the batch's last key may follow. Needs
    /// CAP_SYS_ADMIN; ENOTTY off btrfs.
    pub fn fill(
        &mut self,
        fd: BorrowedFd<'_>,
        from: ItemKey,
        max: ItemKey,
        limit: u32,
    ) -> io::Result<Batch<'_>> {
        self.fill_tree(fd, 0, from, max, limit)
    }

    /// [`Searcher::fill`] in the tree `tree_id` of the filesystem holding
    /// `fd` (0: the fd's own subvolume; 1: the root tree, which holds the
    /// subvolumes' root items and references).
    pub fn fill_tree(
        &mut self,
        fd: BorrowedFd<'_>,
        tree_id: u64,
        from: ItemKey,
        max: ItemKey,
        limit: u32,
    ) -> io::Result<Batch<'_>> {
        ensure_btrfs(fd)?;
        self.fill_unchecked(fd, tree_id, from, max, limit)
    }

    /// [`Searcher::fill_tree`] once the caller checked `fd` is on btrfs:
    /// tight per-inode loops pay for one `fstatfs` per search, not per
    /// ioctl.
    fn fill_unchecked(
        &mut self,
        fd: BorrowedFd<'_>,
        tree_id: u64,
        from: ItemKey,
        max: ItemKey,
        limit: u32,
    ) -> io::Result<Batch<'_>> {
        let buf_size = self.buf_size as u64;
        let min_transid = self.min_transid;
        let args = self.args();
        args.key = SearchKey {
            tree_id,
            min_objectid: from.objectid,
            max_objectid: max.objectid,
            min_offset: from.offset,
            max_offset: max.offset,
            min_transid,
            max_transid: u64::MAX,
            min_type: u32::from(from.item_type),
            max_type: u32::from(max.item_type),
            nr_items: limit,
            ..SearchKey::default()
        };
        args.buf_size = buf_size;
        super::fault::check(self.call)?;
        // SAFETY: `mem` holds the header and the `buf_size` bytes it
        // announces.
        unsafe {
            rustix::ioctl::ioctl(
                fd,
                WordsArg {
                    opcode: TREE_SEARCH_V2,
                    words: &mut self.mem,
                },
            )?
        };
        let len = usize::try_from(self.args().key.nr_items).map_err(|_| malformed("item count"))?;
        Batch::parse(self.buf(), len)
    }

    /// Visits, in key order, every item in `range` of the subvolume
    /// holding `fd`, with its key and raw (little-endian, on-disk)
    /// body, until the range ends or the visitor breaks. One ioctl per
    /// buffer-full of items. Needs CAP_SYS_ADMIN; ENOTTY off btrfs.
    pub fn search(
        &mut self,
        fd: BorrowedFd<'_>,
        range: KeyRange,
        visit: impl FnMut(ItemKey, &[u8]) -> ControlFlow<()>,
    ) -> io::Result<()> {
        self.search_tree(fd, 0, range, visit)
    }

    /// [`Searcher::search`] in the tree `tree_id` (see
    /// [`Searcher::fill_tree`]).
    pub fn search_tree(
        &mut self,
        fd: BorrowedFd<'_>,
        tree_id: u64,
        range: KeyRange,
        mut visit: impl FnMut(ItemKey, &[u8]) -> ControlFlow<()>,
    ) -> io::Result<()> {
        ensure_btrfs(fd)?;
        let mut from = range.min;
        loop {
            let batch = self.fill_unchecked(fd, tree_id, from, range.max, u32::MAX)?;
            let mut last = None;
            for (key, body) in batch.iter() {
                last = Some(key);
                if visit(key, body).is_break() {
                    return Ok(());
                }
            }
            match last.and_then(ItemKey::successor) {
                Some(next) if next <= range.max => from = next,
                _ => return Ok(()),
            }
        }
    }
}

/// The items one [`Searcher::fill`] returned, borrowed from its buffer.
#[derive(Clone, Copy)]
pub struct Batch<'a> {
    buf: &'a [u8],
    len: usize,
}

impl<'a> Batch<'a> {
    /// How many items the batch holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range held nothing more.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The items with their keys and raw bodies, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (ItemKey, &'a [u8])> + use<'a> {
        let buf = self.buf;
        let mut pos = 0usize;
        // `parse` checked every item: `item_at` cannot fail here, and if
        // it did the iteration would just end early.
        (0..self.len).map_while(move |_| {
            let (key, body, next) = item_at(buf, pos)?;
            pos = next;
            Some((key, body))
        })
    }
}

/// [`Searcher::search`] with a one-off buffer of the default 64 KiB. For
/// one search per inode, keep a [`Searcher`] instead.
pub fn search(
    fd: BorrowedFd<'_>,
    range: KeyRange,
    visit: impl FnMut(ItemKey, &[u8]) -> ControlFlow<()>,
) -> io::Result<()> {
    Searcher::default().search(fd, range, visit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One result-buffer item: header (transid, objectid, offset, type,
    /// len) then body, as the kernel lays them out.
    fn item(objectid: u64, item_type: u32, offset: u64, len: u32, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&7u64.to_ne_bytes());
        v.extend_from_slice(&objectid.to_ne_bytes());
        v.extend_from_slice(&offset.to_ne_bytes());
        v.extend_from_slice(&item_type.to_ne_bytes());
        v.extend_from_slice(&len.to_ne_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn well_formed_items_parse_in_order() {
        let mut buf = item(256, 1, 0, 3, b"abc");
        buf.extend(item(257, 108, 4096, 0, b""));
        buf.resize(buf.len() + 64, 0);
        let batch = Batch::parse(&buf, 2).expect("parses");
        let items: Vec<_> = batch.iter().collect();
        assert_eq!(items.len(), 2);
        assert_eq!(
            items[0],
            (
                ItemKey {
                    objectid: 256,
                    item_type: 1,
                    offset: 0
                },
                &b"abc"[..]
            )
        );
        assert_eq!(items[1].0.offset, 4096);
        assert!(items[1].1.is_empty());
    }

    #[test]
    fn an_empty_batch_needs_no_bytes() {
        assert!(Batch::parse(&[], 0).expect("parses").is_empty());
    }

    #[test]
    fn a_body_longer_than_the_buffer_is_an_error() {
        let buf = item(256, 1, 0, 100, b"short");
        let err = Batch::parse(&buf, 1).err().expect("must fail");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_length_that_overflows_is_an_error() {
        let buf = item(256, 1, 0, u32::MAX, b"");
        assert!(Batch::parse(&buf, 1).is_err());
    }

    #[test]
    fn a_truncated_header_is_an_error() {
        let buf = item(256, 1, 0, 0, b"");
        assert!(Batch::parse(&buf[..HEADER_LEN - 1], 1).is_err());
    }

    #[test]
    fn more_items_than_fit_is_an_error() {
        let mut buf = item(256, 1, 0, 2, b"xy");
        buf.extend(item(257, 1, 0, 2, b"zw"));
        assert!(Batch::parse(&buf, 2).is_ok());
        assert!(Batch::parse(&buf, 3).is_err());
        assert!(Batch::parse(&buf, usize::MAX).is_err());
    }

    #[test]
    fn a_type_wider_than_a_byte_is_an_error() {
        let buf = item(256, 0x1_01, 0, 0, b"");
        assert!(Batch::parse(&buf, 1).is_err());
    }
}
