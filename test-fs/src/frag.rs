//! Building files fragmented like a random-write database, and counting extents.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The btrfs sector size, and the page size that database engines write in.
const BLOCK: u64 = 4096;

/// Rewrites between `fdatasync` calls: bounds dirty memory, and spreads each batch's
/// freshly allocated blocks over several transactions, as a database's commits would.
const REWRITES_PER_SYNC: usize = 32 * 1024;

/// Creates (or truncates) `path` as a file of `size_bytes` (rounded down to 4 KiB)
/// with at least `target_extents` extents, if the file is big enough to hold them,
/// and returns the extent count measured with FIEMAP.
///
/// The file is first written sequentially, which yields a handful of large extents.
/// Then even-numbered 4 KiB blocks, picked in a shuffled order, are rewritten one at
/// a time, with an fdatasync every 32Ki rewrites (128 MiB): on a copy-on-write
/// filesystem every such rewrite lands somewhere new and splits the extent it fell
/// in, adding two extents, while the never-rewritten odd blocks in between keep
/// neighbours from merging. So the most this can reach is about `size_bytes / 4096`
/// extents; 500,000 extents need a 2 GiB file. As with a real database, the old
/// extents stay allocated as long as any piece of them is referenced, so the file
/// takes about `size_bytes + 2 KiB * extents` on disk.
///
/// Same arguments, same content: which blocks are rewritten depends on the arguments
/// only, unless the filesystem merges or splits extents unexpectedly. On a filesystem
/// or file that rewrites in place (ext4, `chattr +C` on btrfs) the count stays low;
/// the function gives up once every even block was rewritten and returns what it got.
pub fn make_fragmented_file(
    path: &Path,
    size_bytes: u64,
    target_extents: u64,
    seed: u64,
) -> io::Result<u64> {
    let blocks = size_bytes / BLOCK;
    let mut rng = XorShift::new(seed);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    write_sequentially(&file, blocks, &mut rng)?;
    file.sync_all()?;

    let mut order: Vec<u64> = (0..blocks).step_by(2).collect();
    rng.shuffle(&mut order);

    // The first round's size comes from the target alone, not from a measurement, so
    // that the same arguments rewrite the same blocks however writeback happened to
    // split the sequential write. Each rewrite adds two extents, except next to an
    // extent boundary or a file end, where it adds one; but every boundary also
    // counted one extent to begin with, so `target / 2 + 1` rewrites reach the target
    // whatever the initial layout. Later rounds only run if reality disagrees.
    let mut want = if target_extents > 1 {
        target_extents / 2 + 1
    } else {
        0
    };
    let mut pending = order.as_mut_slice();
    while want > 0 && !pending.is_empty() {
        let take = usize::try_from(want)
            .unwrap_or(usize::MAX)
            .min(pending.len());
        let (batch, rest) = std::mem::take(&mut pending).split_at_mut(take);
        rewrite_blocks(&file, batch, seed)?;
        pending = rest;
        want = target_extents
            .saturating_sub(fiemap_extent_count(&file)?)
            .div_ceil(2);
    }
    fiemap_extent_count(&file)
}

/// Overwrites each listed block with content derived from `seed` and the block's
/// index only, so the result does not depend on how the rewrites were batched.
fn rewrite_blocks(file: &File, blocks: &mut [u64], seed: u64) -> io::Result<()> {
    let mut content = [0u8; BLOCK as usize];
    for sync_batch in blocks.chunks_mut(REWRITES_PER_SYNC) {
        // Writeback allocates a batch's blocks in file order whatever order they
        // were dirtied in, so sorting leaves the same file on disk, and it halved
        // the time of a 500k-extent file when measured (20-25 s down to 10-12 s).
        sync_batch.sort_unstable();
        for &index in sync_batch.iter() {
            XorShift::new(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)).fill(&mut content);
            file.write_all_at(&content, index * BLOCK)?;
        }
        file.sync_data()?;
    }
    Ok(())
}

/// Fills the file with a 1 MiB pseudo-random pattern, stamping each 4 KiB block with
/// its index so that no two blocks are identical (and nothing dedupes or compresses
/// the file into something unlike a database's).
fn write_sequentially(file: &File, blocks: u64, rng: &mut XorShift) -> io::Result<()> {
    const CHUNK_BLOCKS: u64 = 256;
    let mut chunk = vec![0u8; (CHUNK_BLOCKS * BLOCK) as usize];
    rng.fill(&mut chunk);
    let mut first = 0;
    while first < blocks {
        let count = CHUNK_BLOCKS.min(blocks - first);
        let bytes = &mut chunk[..(count * BLOCK) as usize];
        for (i, block) in bytes.chunks_exact_mut(BLOCK as usize).enumerate() {
            block[..8].copy_from_slice(&(first + i as u64).to_le_bytes());
        }
        file.write_all_at(bytes, first * BLOCK)?;
        first += count;
    }
    Ok(())
}

/// Number of extents of the file at `path`, as FIEMAP reports them.
///
/// Dirty data is flushed first, so the count includes what was just written.
pub fn extent_count(path: &Path) -> io::Result<u64> {
    fiemap_extent_count(&File::open(path)?)
}

/// The header of `struct fiemap` from `<linux/fiemap.h>`, without the trailing
/// `fm_extents[]` array: asking for zero extents needs no room for any.
#[repr(C)]
#[derive(Default)]
struct Fiemap {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}

/// `_IOWR('f', 11, struct fiemap)`; the libc crate does not define it.
const FS_IOC_FIEMAP: u32 = 0xC020_660B;
/// Write back dirty pages before mapping, so delayed allocation is counted.
const FIEMAP_FLAG_SYNC: u32 = 0x1;
/// Map the whole file.
const FIEMAP_MAX_OFFSET: u64 = u64::MAX;

/// Counts extents with one `FS_IOC_FIEMAP` call.
///
/// With `fm_extent_count == 0` the kernel copies no extent records and only returns
/// how many there are in `fm_mapped_extents`, so this costs one walk of the file's
/// extent items and no memory proportional to the count. Filesystems may merge
/// extents that are adjacent both in the file and on disk (btrfs does), which is what
/// a copy of the file has to walk anyway.
#[allow(unsafe_code)] // FS_IOC_FIEMAP through libc
fn fiemap_extent_count(file: &File) -> io::Result<u64> {
    const _: () = assert!(size_of::<Fiemap>() == 32);
    let mut fiemap = Fiemap {
        fm_start: 0,
        fm_length: FIEMAP_MAX_OFFSET,
        fm_flags: FIEMAP_FLAG_SYNC,
        ..Fiemap::default()
    };
    // SAFETY: `fiemap` is a properly laid out `struct fiemap` header that outlives the
    // call, and with `fm_extent_count == 0` the kernel writes nothing past it.
    let ret = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            FS_IOC_FIEMAP as libc::Ioctl,
            &mut fiemap as *mut Fiemap,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::from(fiemap.fm_mapped_extents))
}

/// xorshift64*: deterministic, fast, and good enough to pick blocks and fill pages.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        // Spread the seed (splitmix64 finalizer) so small seeds differ at once, and
        // avoid the all-zero state that xorshift never leaves.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        XorShift((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform enough in `0..n` for n far below 2^64 (multiply-shift, no modulo bias
    /// worth caring about here).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for word in buf.chunks_mut(8) {
            let bytes = self.next().to_le_bytes();
            word.copy_from_slice(&bytes[..word.len()]);
        }
    }

    /// Fisher-Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_seed_dependent() {
        let (mut a, mut b, mut c) = (XorShift::new(7), XorShift::new(7), XorShift::new(8));
        let xs: Vec<u64> = (0..4).map(|_| a.next()).collect();
        let ys: Vec<u64> = (0..4).map(|_| b.next()).collect();
        let zs: Vec<u64> = (0..4).map(|_| c.next()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut items: Vec<u32> = (0..1000).collect();
        XorShift::new(1).shuffle(&mut items);
        assert_ne!(items, (0..1000).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..1000).collect::<Vec<_>>());
    }
}
