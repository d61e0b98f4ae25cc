//! What the `bench` and `demo` binaries share: a package volume on a scratch
//! btrfs with upstream's operations and ours on it, settling the filesystem
//! between timed operations, timing, and formatting.

use std::error::Error;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

// Each binary takes what it prints with.
#[allow(unused_imports)]
pub use integration::fmt::{fmt_bytes, fmt_count, fmt_duration, fmt_ratio};
use integration::{LoopFs, run};
use volume::{PackageId, SnapshotOutcome, VolumeId, VolumeStore};

/// What both binaries return from fallible steps.
pub type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// The package, its volume and the database file in it.
const PACKAGE: &str = "monerod";
const VOLUME: &str = "main";
const FILE: &str = "data.mdb";

/// `volume`'s error as one line: it keeps its kind and context chain.
pub fn volume_err(e: volume::Error) -> Box<dyn Error> {
    e.to_string().into()
}

/// Package `monerod` with volume `main`, created by [`VolumeStore::create`]
/// (so a subvolume) under `<mnt>/volumes` on a fresh loop-mounted btrfs, and
/// the paths upstream's commands work on.
pub struct Scratch {
    fs: LoopFs,
    store: VolumeStore,
    pkg: PackageId,
    /// `<root>/<pkg>`.
    live: PathBuf,
    /// `<root>/<pkg>.install-backup`.
    backup: PathBuf,
    /// `<root>/<pkg>/data/main/data.mdb`, for the caller to fill.
    pub file: PathBuf,
}

impl Scratch {
    /// Makes a sparse btrfs image of `image_bytes`, mounts it and creates the
    /// package volume.
    pub fn new(image_bytes: u64) -> Result<Scratch> {
        Scratch::on(LoopFs::btrfs(image_bytes)?)
    }

    /// The package volume on `fs`, a mounted btrfs: created (with the
    /// volumes root) if absent, else the one there (an image a benchmark
    /// kept, see `bench --only lmdb`).
    pub fn on(fs: LoopFs) -> Result<Scratch> {
        let root = fs.path("volumes");
        if !root.is_dir() {
            std::fs::create_dir(&root)?;
        }
        let store = VolumeStore::open(&root).map_err(volume_err)?;
        let pkg: PackageId = PACKAGE.parse()?;
        let vol: VolumeId = VOLUME.parse()?;
        store
            .create(&pkg, std::slice::from_ref(&vol))
            .map_err(volume_err)?;
        Ok(Scratch {
            live: store.volume_path(&pkg),
            backup: store.backup_path(&pkg),
            file: store.data_dir(&pkg, &vol).join(FILE),
            fs,
            store,
            pkg,
        })
    }

    /// The volumes root, `<mnt>/volumes`.
    pub fn root(&self) -> PathBuf {
        self.fs.path("volumes")
    }

    /// `<mnt>/<relative>`, beside the volumes root (for a state database or
    /// a service's run directory).
    pub fn path(&self, relative: &str) -> PathBuf {
        self.fs.path(relative)
    }

    /// The loop device the filesystem is on.
    pub fn device(&self) -> &Path {
        self.fs.device()
    }

    /// The package, `monerod`.
    pub fn package(&self) -> &PackageId {
        &self.pkg
    }

    /// `<root>/<pkg>`, the live volume.
    pub fn live(&self) -> &Path {
        &self.live
    }

    /// Commits everything on the filesystem and waits until the btrfs
    /// cleaner has finished with deleted subvolumes, so that the next timed
    /// operation neither pays for earlier dirty data and metadata nor
    /// competes with background work. Returns how long that took: the work
    /// the previous operation left for later.
    ///
    /// `btrfs filesystem sync` (BTRFS_IOC_SYNC) commits and wakes the
    /// cleaner, which otherwise sleeps until the next periodic commit, up to
    /// 30 s later; `btrfs subvolume sync` waits until every deleted subvolume
    /// is gone; the last commit writes out what the cleaner changed.
    pub fn settle(&self) -> Result<Duration> {
        settle(self.fs.mount_point())
    }

    /// Drops the clean page-cache pages of the database file (call it after
    /// [`Scratch::settle`]).
    ///
    /// Deleting a volume evicts its cached inodes synchronously, at about
    /// 0.13 s per GiB of cached file data here, whichever way it is deleted;
    /// timed operations start with the file uncached so that they compare
    /// like with like.
    pub fn evict_page_cache(&self) -> Result<()> {
        let file = File::open(&self.file)?;
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)?;
        Ok(())
    }

    /// Ours: `VolumeStore::snapshot`, which must take a subvolume snapshot.
    pub fn snapshot(&self) -> Result<()> {
        match self.store.snapshot(&self.pkg).map_err(volume_err)? {
            SnapshotOutcome::Snapshot => Ok(()),
            other => Err(format!("expected a subvolume snapshot, got {other:?}").into()),
        }
    }

    /// Ours: `VolumeStore::drop_backup`.
    pub fn drop_backup(&self) -> Result<()> {
        if self.store.drop_backup(&self.pkg).map_err(volume_err)? {
            Ok(())
        } else {
            Err("drop_backup found no backup".into())
        }
    }

    /// Ours: `VolumeStore::restore`.
    pub fn restore(&self) -> Result<()> {
        if self.store.restore(&self.pkg).map_err(volume_err)? {
            Ok(())
        } else {
            Err("restore found no backup".into())
        }
    }

    /// Upstream's snapshot: `cp -a --reflink=always <root>/<pkg>
    /// <root>/<pkg>.install-backup`. Run on our subvolume it clones every
    /// extent one by one, exactly upstream's cost on its plain directory.
    pub fn upstream_snapshot(&self) -> Result<()> {
        cp_reflink(&self.live, &self.backup)
    }

    /// Upstream's drop: `rm -rf <root>/<pkg>.install-backup`.
    pub fn upstream_drop(&self) -> Result<()> {
        rm_rf(&self.backup)
    }

    /// An upstream backup to restore from: the same `cp -a --reflink=always`
    /// clone of every extent, only into a fresh subvolume, so that after
    /// [`Scratch::upstream_restore`]'s `mv` the package is a subvolume again
    /// for our operations. What is timed, `rm -rf` and `mv`, costs the same
    /// either way.
    pub fn upstream_backup_for_restore(&self) -> Result<()> {
        run(Command::new("btrfs")
            .args(["-q", "subvolume", "create"])
            .arg(&self.backup))?;
        let mut contents = self.live.as_os_str().to_owned();
        contents.push("/.");
        cp_reflink(Path::new(&contents), &self.backup)
    }

    /// Upstream's `restore_volumes_from_install_backup`: `rm -rf <pkg>`,
    /// then `mv <pkg>.install-backup <pkg>`, with no volume in between.
    pub fn upstream_restore(&self) -> Result<()> {
        rm_rf(&self.live)?;
        run(Command::new("mv").arg(&self.backup).arg(&self.live))?;
        Ok(())
    }

    /// The filesystem, the store closed: for unmounting it and keeping its
    /// image.
    pub fn into_fs(self) -> LoopFs {
        // The store holds the root open: close it before unmounting.
        let Scratch { fs, store, .. } = self;
        drop(store);
        fs
    }

    /// Unmounts and removes the filesystem, reporting any problem.
    pub fn close(self) -> Result<()> {
        Ok(self.into_fs().close()?)
    }
}

/// [`Scratch::settle`] for the btrfs mounted at `mount_point`: commits
/// everything, waits for the cleaner to finish with deleted subvolumes, commits
/// what it changed, and returns how long that took.
pub fn settle(mount_point: &Path) -> Result<Duration> {
    let btrfs = |args: &[&str]| run(Command::new("btrfs").args(args).arg(mount_point));
    timed(|| {
        btrfs(&["filesystem", "sync"])?;
        btrfs(&["subvolume", "sync"])?;
        btrfs(&["filesystem", "sync"])?;
        Ok(())
    })
    .map(|((), took)| took)
}

/// `cp -a --reflink=always <src> <dst>`: upstream's install backup.
pub fn cp_reflink(src: &Path, dst: &Path) -> Result<()> {
    run(Command::new("cp")
        .args(["-a", "--reflink=always"])
        .arg(src)
        .arg(dst))?;
    Ok(())
}

/// `rm -rf <path>`: upstream's removal of a backup.
pub fn rm_rf(path: &Path) -> Result<()> {
    run(Command::new("rm").arg("-rf").arg(path))?;
    Ok(())
}

/// Runs `f` and returns its value with the wall-clock time it took.
pub fn timed<T, E>(f: impl FnOnce() -> Result<T, E>) -> Result<(T, Duration), E> {
    let start = Instant::now();
    let value = f()?;
    Ok((value, start.elapsed()))
}

/// Overwrites `blocks` 4 KiB blocks of `path`, spread over the file, with
/// bytes derived from `seed`, then makes them durable: the divergence from
/// the backup that a failed migration leaves.
pub fn scribble(path: &Path, blocks: u64, seed: u64) -> Result<()> {
    const BLOCK: u64 = 4096;
    let file = OpenOptions::new().write(true).open(path)?;
    let len = file.metadata()?.len() / BLOCK;
    if len == 0 {
        return Err(format!("{} is empty", path.display()).into());
    }
    // xorshift64, seeded away from zero.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut buf = [0u8; BLOCK as usize];
    for _ in 0..blocks {
        for word in buf.chunks_exact_mut(8) {
            word.copy_from_slice(&next().to_le_bytes());
        }
        file.write_all_at(&buf, (next() % len) * BLOCK)?;
    }
    file.sync_all()?;
    Ok(())
}
