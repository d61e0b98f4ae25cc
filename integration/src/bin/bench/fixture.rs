//! The two trees the `usage` and `migrate` sections measure, built once on
//! one loop-mounted btrfs: about 100k small files a few directories deep, and
//! one database file fragmented to about 500k extents. Each is a package
//! volume created with [`VolumeStore::create`], so a subvolume: what our
//! usage scan sweeps in one pass, and the source the `migrate` section
//! reflink-copies its plain directories from.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use integration::LoopFs;
use volume::{PackageId, VolumeId, VolumeStore};

use crate::common::{Result, fmt_bytes, fmt_count, fmt_duration, settle, timed};

/// Files per leaf directory of the small-files tree.
const FILES_PER_DIR: u64 = 100;
/// Largest small file meant to be inline: comfortably below btrfs's default
/// `max_inline` of 2048 bytes.
const INLINE_MAX: u64 = 2000;

/// Which of the two trees.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TreeKind {
    /// Many small files, most of them inline.
    SmallFiles,
    /// One heavily fragmented database file.
    Fragmented,
}

/// One package volume of the fixture.
pub struct Tree {
    /// Which tree it is.
    pub kind: TreeKind,
    /// What the tables call it, e.g. `100,000 small files`.
    pub label: String,
    /// The package, a subvolume `<root>/<pkg>`.
    pub pkg: PackageId,
    /// `<root>/<pkg>`.
    pub path: PathBuf,
    /// Regular files in it.
    pub files: u64,
    /// File data bytes.
    pub bytes: u64,
}

/// The scratch btrfs with both trees under the volumes root `<mnt>/volumes`.
pub struct Fixture {
    fs: LoopFs,
    /// The store the trees were created with.
    pub store: VolumeStore,
    /// `<mnt>/volumes`.
    pub root: PathBuf,
    /// The small-files tree, then the fragmented file.
    pub trees: Vec<Tree>,
}

/// What to build.
pub struct Spec {
    /// Small files in the first tree.
    pub files: u64,
    /// Extents to fragment the database file to.
    pub extents: u64,
    /// Size of the database file.
    pub db_bytes: u64,
    /// Seed for contents, sizes and the fragmentation pattern.
    pub seed: u64,
}

impl Fixture {
    /// Formats a sparse image big enough for both trees and the copies the
    /// `migrate` section makes of them (reflinks: metadata only), and builds
    /// both trees.
    pub fn build(spec: &Spec) -> Result<Fixture> {
        const GIB: u64 = 1 << 30;
        // Small files average about 10 KiB; the copies add metadata only.
        let tree_bytes = spec.files.saturating_mul(16 << 10);
        let image_bytes = 2 * spec.db_bytes + 2 * tree_bytes + 2 * GIB;
        let fs = LoopFs::btrfs(image_bytes)?;
        let root = fs.path("volumes");
        fs::create_dir(&root)?;
        let store = VolumeStore::open(&root).map_err(|e| e.to_string())?;
        let main: VolumeId = "main".parse()?;

        let mut trees = Vec::new();
        let files_pkg: PackageId = "bench-files".parse()?;
        store
            .create(&files_pkg, std::slice::from_ref(&main))
            .map_err(|e| e.to_string())?;
        eprintln!(
            "fixture: writing {} small files on a {} btrfs image ...",
            fmt_count(spec.files),
            fmt_bytes(image_bytes)
        );
        let (bytes, took) =
            timed(|| make_small_files(&store.data_dir(&files_pkg, &main), spec.files, spec.seed))?;
        settle(fs.mount_point())?;
        eprintln!(
            "fixture: {} small files ({}) written in {}",
            fmt_count(spec.files),
            fmt_bytes(bytes),
            fmt_duration(took)
        );
        trees.push(Tree {
            kind: TreeKind::SmallFiles,
            label: format!("{} small files", fmt_count(spec.files)),
            path: store.volume_path(&files_pkg),
            pkg: files_pkg,
            files: spec.files,
            bytes,
        });

        let db_pkg: PackageId = "bench-db".parse()?;
        store
            .create(&db_pkg, std::slice::from_ref(&main))
            .map_err(|e| e.to_string())?;
        eprintln!(
            "fixture: building a {} file fragmented to {} extents ...",
            fmt_bytes(spec.db_bytes),
            fmt_count(spec.extents)
        );
        let file = store.data_dir(&db_pkg, &main).join("data.mdb");
        let (extents, took) = timed(|| {
            integration::make_fragmented_file(&file, spec.db_bytes, spec.extents, spec.seed)
        })?;
        settle(fs.mount_point())?;
        eprintln!(
            "fixture: {} extents, built in {}",
            fmt_count(extents),
            fmt_duration(took)
        );
        trees.push(Tree {
            kind: TreeKind::Fragmented,
            label: format!("{}-extent file", fmt_count(extents)),
            path: store.volume_path(&db_pkg),
            pkg: db_pkg,
            files: 1,
            bytes: spec.db_bytes,
        });

        Ok(Fixture {
            fs,
            store,
            root,
            trees,
        })
    }

    /// Where the filesystem is mounted.
    pub fn mount_point(&self) -> &Path {
        self.fs.mount_point()
    }

    /// The loop device the filesystem is on.
    pub fn device(&self) -> &Path {
        self.fs.device()
    }

    /// Unmounts and removes the filesystem, reporting any problem.
    pub fn close(self) -> Result<()> {
        // The store holds the root open: close it before unmounting.
        drop(self.store);
        Ok(self.fs.close()?)
    }
}

/// xorshift64, seeded away from zero.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `lo..=hi` (near enough for sizes).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Writes `count` files under `dir`, [`FILES_PER_DIR`] per leaf directory,
/// three levels down (`d0/e3/f7/file42`), and returns their total size.
/// Sizes: 1% empty, 69% 1 byte to [`INLINE_MAX`] (inline), 30% 4 to 64 KiB
/// (one or a few regular extents). Contents are slices of one random buffer
/// at random offsets; no compression is on, and nothing is deduplicated.
fn make_small_files(dir: &Path, count: u64, seed: u64) -> Result<u64> {
    const BIG_MAX: u64 = 64 << 10;
    let mut rng = Rng::new(seed);
    let mut pool = vec![0u8; 2 * BIG_MAX as usize];
    for word in pool.chunks_exact_mut(8) {
        word.copy_from_slice(&rng.next().to_le_bytes());
    }
    let mut total = 0;
    let mut leaf = PathBuf::new();
    for i in 0..count {
        if i % FILES_PER_DIR == 0 {
            let n = i / FILES_PER_DIR;
            leaf = dir
                .join(format!("d{}", n / 100))
                .join(format!("e{}", n / 10 % 10))
                .join(format!("f{}", n % 10));
            fs::create_dir_all(&leaf).map_err(|e| format!("creating {}: {e}", leaf.display()))?;
        }
        let size = match rng.next() % 100 {
            0 => 0,
            1..70 => rng.between(1, INLINE_MAX),
            _ => rng.between(4 << 10, BIG_MAX),
        };
        let at = (rng.next() % BIG_MAX) as usize;
        let path = leaf.join(format!("file{}", i % FILES_PER_DIR));
        File::create(&path)
            .and_then(|mut f| f.write_all(&pool[at..at + size as usize]))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        total += size;
    }
    Ok(total)
}
