//! A box shaped like the field reports' (issue 12): every package volume a
//! plain directory on the top-level subvolume, as after the ext4-to-btrfs
//! conversion, with one dominant database.
//!
//! - `monerod`: one LMDB file fragmented to many extents
//!   ([`crate::make_fragmented_file`]), and its lock file;
//! - `bitcoind`: block files written whole, and a LevelDB of many small
//!   files, in a data directory made NOCOW (`chattr +C`, as in the field),
//!   so every file is;
//! - `electrs`: many small files;
//! - five small packages of a few dozen files each.
//!
//! [`NodeShape::field`] is the box (monerod 3 GiB, 120 block files
//! of 16 MiB, 1,500 LevelDB files, 20,000 electrs files);
//! [`NodeShape::small`] the same shape in miniature, for the test suite.
//! Same shape, same content: every byte comes from the package name and the
//! file's index.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::IFlags;

/// The five small packages.
pub const SMALL_PACKAGES: [&str; 5] = ["btcpayserver", "lnd", "mempool", "nextcloud", "tor"];
/// The dominant package.
pub const DOMINANT: &str = "monerod";
/// The package whose data directory is NOCOW.
pub const NOCOW_PACKAGE: &str = "bitcoind";
/// The package of many small files.
pub const SMALL_FILES_PACKAGE: &str = "electrs";

/// How big each part of the box is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeShape {
    /// Extents of monerod's database...
    pub monerod_extents: u64,
    /// ... and its size in bytes.
    pub monerod_bytes: u64,
    /// bitcoind's block files...
    pub block_files: u32,
    /// ... of this many bytes each.
    pub block_file_bytes: usize,
    /// bitcoind's LevelDB files...
    pub leveldb_files: u32,
    /// ... of this many bytes each.
    pub leveldb_file_bytes: usize,
    /// electrs's small files.
    pub electrs_files: u32,
    /// Files in each small package.
    pub small_package_files: u32,
}

impl NodeShape {
    /// The box, with monerod's database at `extents` extents: 3 GiB,
    /// or 5 KiB per extent if that is more (a rewrite of every other block
    /// reaches at most one extent per 4 KiB block).
    pub fn field(extents: u64) -> NodeShape {
        NodeShape {
            monerod_extents: extents,
            monerod_bytes: (3u64 << 30).max(extents * 5 * 1024),
            block_files: 120,
            block_file_bytes: 16 << 20,
            leveldb_files: 1_500,
            leveldb_file_bytes: 64 << 10,
            electrs_files: 20_000,
            small_package_files: 40,
        }
    }

    /// The same shape, small enough for the test suite: the dominant
    /// database still outweighs the rest by the margin the field's does.
    pub fn small() -> NodeShape {
        NodeShape {
            monerod_extents: 20_000,
            monerod_bytes: 20_000 * 8 * 1024,
            block_files: 6,
            block_file_bytes: 1 << 20,
            leveldb_files: 60,
            leveldb_file_bytes: 16 << 10,
            electrs_files: 400,
            small_package_files: 10,
        }
    }

    /// Every package of the box, sorted.
    pub fn packages(&self) -> Vec<&'static str> {
        let mut all = vec![DOMINANT, NOCOW_PACKAGE, SMALL_FILES_PACKAGE];
        all.extend(SMALL_PACKAGES);
        all.sort_unstable();
        all
    }

    /// A sparse image size the box fits in with room to convert it.
    pub fn image_bytes(&self) -> u64 {
        let data = self.monerod_bytes
            + u64::from(self.block_files) * self.block_file_bytes as u64
            + u64::from(self.leveldb_files) * self.leveldb_file_bytes as u64
            + u64::from(self.electrs_files) * 8192;
        // The fragmented file keeps its rewritten blocks' old extents, and
        // each extent item costs metadata (twice, with DUP).
        data * 2 + self.monerod_extents * 4096 + (1 << 30)
    }
}

/// Content of file `i` of `what`: `len` bytes, the same for the same
/// arguments.
fn content(what: &str, i: u64, len: usize) -> Vec<u8> {
    let mut x = what.bytes().fold(0x9e37_79b9_7f4a_7c15u64 ^ i, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3)
    }) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn write_files(
    dir: &Path,
    what: &str,
    n: u32,
    len: impl Fn(u32) -> usize,
    per_dir: u32,
) -> io::Result<()> {
    for i in 0..n {
        let sub = dir.join(format!("{:03}", i / per_dir));
        if i % per_dir == 0 {
            fs::create_dir_all(&sub)?;
        }
        fs::write(
            sub.join(format!("{i:06}")),
            content(what, u64::from(i), len(i)),
        )?;
    }
    Ok(())
}

/// Builds the box's plain package directories under `root` (which must
/// exist); returns the paths of the package directories, sorted by name,
/// and monerod's extent count as measured.
pub fn build(root: &Path, shape: &NodeShape) -> io::Result<(Vec<PathBuf>, u64)> {
    let pkg = |name: &str| -> io::Result<PathBuf> {
        let dir = root.join(name);
        fs::create_dir_all(dir.join("data/main"))?;
        fs::create_dir_all(dir.join("assets"))?;
        fs::write(
            dir.join("data/main/start9-config.yaml"),
            content(name, u64::MAX, 700),
        )?;
        Ok(dir)
    };

    let monerod = pkg(DOMINANT)?;
    let lmdb = monerod.join("data/main/lmdb");
    fs::create_dir_all(&lmdb)?;
    let extents = crate::make_fragmented_file(
        &lmdb.join("data.mdb"),
        shape.monerod_bytes,
        shape.monerod_extents,
        7,
    )?;
    fs::write(lmdb.join("lock.mdb"), content(DOMINANT, 1, 8192))?;

    let bitcoind = pkg(NOCOW_PACKAGE)?;
    let data = bitcoind.join("data/main/bitcoin");
    fs::create_dir_all(&data)?;
    // NOCOW only takes on empty files: set on the directory, every file
    // created in it inherits it.
    let dir = fs::File::open(&data)?;
    let flags = rustix::fs::ioctl_getflags(&dir)?;
    rustix::fs::ioctl_setflags(&dir, flags | IFlags::NOCOW)?;
    drop(dir);
    let blocks = data.join("blocks");
    fs::create_dir_all(&blocks)?;
    for i in 0..shape.block_files {
        fs::write(
            blocks.join(format!("blk{i:05}.dat")),
            content("block", u64::from(i), shape.block_file_bytes),
        )?;
    }
    write_files(
        &data.join("chainstate"),
        "leveldb",
        shape.leveldb_files,
        |i| shape.leveldb_file_bytes - (i as usize % 7) * 512,
        500,
    )?;

    let electrs = pkg(SMALL_FILES_PACKAGE)?;
    write_files(
        &electrs.join("data/main/db"),
        SMALL_FILES_PACKAGE,
        shape.electrs_files,
        |i| 1024 + (i as usize * 37) % 7000,
        1000,
    )?;

    for name in SMALL_PACKAGES {
        let dir = pkg(name)?;
        write_files(
            &dir.join("data/main/files"),
            name,
            shape.small_package_files,
            |i| 512 + (i as usize * 131) % 16_000,
            100,
        )?;
    }
    let mut all: Vec<PathBuf> = shape.packages().iter().map(|p| root.join(p)).collect();
    all.sort();
    Ok((all, extents))
}

/// A bitcoind block file of the box, for the first-write measurements.
pub fn block_file(root: &Path, i: u32) -> PathBuf {
    root.join(NOCOW_PACKAGE)
        .join(format!("data/main/bitcoin/blocks/blk{i:05}.dat"))
}
