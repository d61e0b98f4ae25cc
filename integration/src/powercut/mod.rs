//! Power-cut safety: a QEMU guest runs one operation on a btrfs image whose
//! every request is logged, and the image is then rebuilt as it stood at
//! each point a power cut could have left it.
//!
//! - [`guest`]: the guest (Debian's cloud kernel, a busybox initramfs with
//!   the project's binaries) and [`guest::run`], which boots it on a disk,
//!   logged or direct, and can SIGKILL it part-way (a real cut);
//! - [`log`]: the dm-log-writes log format QEMU's `blklogwrites` writes,
//!   and the [`log::Replayer`] that rebuilds a disk from a base image and a
//!   prefix of the log;
//! - [`Sweep`]: one logged run and the states it yields, checked to replay
//!   to the guest's final disk byte for byte;
//! - [`btrfs_check`]: `btrfs check --readonly` of a state;
//! - [`finalize`]: the update-finalization workload, through start-core's
//!   own call sites (the fixture's `call-sites` runner, in the guest too).
//!
//! What a state must then hold (old or new tree, after recovery one
//! complete tree and no temporary name) is the tests' business
//! (`integration/tests/powercut.rs`).

pub mod finalize;
pub mod guest;
pub mod log;

use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use guest::{Disk, GuestKit, RunResult};
pub use log::{LogEntry, Replayer, WriteLog, sparse_copy};

/// A prefix of the log: the disk as it stood before entry `end` reached it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cut {
    /// Entries applied.
    pub end: usize,
    /// Whether the next entry is a flush or FUA (the state a power cut
    /// leaves when the disk's cache loses nothing it was told to keep, up
    /// to that flush), as opposed to an ordinary write.
    pub before_barrier: bool,
}

/// One logged run of a workload: the disk before it, the log, and the disk
/// the guest left.
#[derive(Debug)]
pub struct Sweep {
    /// The disk before the run.
    pub base: PathBuf,
    /// The disk after it.
    pub last: PathBuf,
    /// The parsed log.
    pub log: WriteLog,
}

impl Sweep {
    /// Reads the log of a run that started from `base` and left `last`.
    pub fn new(base: PathBuf, last: PathBuf, log: &Path) -> io::Result<Sweep> {
        let log = WriteLog::open(log)?;
        Ok(Sweep { base, last, log })
    }

    /// The states before each flush or FUA entry, plus the final one.
    pub fn barrier_cuts(&self) -> Vec<Cut> {
        let mut cuts: Vec<Cut> = self
            .log
            .barriers()
            .into_iter()
            .map(|end| Cut {
                end,
                before_barrier: true,
            })
            .collect();
        cuts.push(Cut {
            end: self.log.entries.len(),
            before_barrier: false,
        });
        cuts.dedup_by_key(|c| c.end);
        cuts
    }

    /// The states before every entry, plus the final one.
    pub fn every_cut(&self) -> Vec<Cut> {
        (0..=self.log.entries.len())
            .map(|end| Cut {
                end,
                before_barrier: self.log.entries.get(end).is_some_and(|e| e.is_barrier()),
            })
            .collect()
    }

    /// Replays the whole log onto a copy of the base under `scratch` and
    /// checks it equals the disk the guest left, byte for byte: otherwise
    /// the log or the replay is wrong, and no state means anything.
    pub fn verify_full_replay(&self, scratch: &Path) -> io::Result<()> {
        let img = scratch.join("full-replay.img");
        let mut r = Replayer::new(&self.log, &self.base, &img)?;
        r.advance_to(self.log.entries.len())?;
        drop(r);
        let same = same_bytes(&img, &self.last);
        fs::remove_file(&img)?;
        match same? {
            None => Ok(()),
            Some(at) => Err(io::Error::other(format!(
                "replaying all {} log entries onto {} differs from the disk the guest left ({}) \
                 from byte {at}: the log or the replay is wrong",
                self.log.entries.len(),
                self.base.display(),
                self.last.display()
            ))),
        }
    }

    /// Rebuilds each state in `cuts` (sorted by `end`) in turn into
    /// `<scratch>/state.img` and calls `check` on it. The image is the
    /// caller's to change or delete; the next state is rebuilt from the
    /// replay's own copy. Stops at the first error.
    pub fn for_each<E>(
        &self,
        cuts: &[Cut],
        scratch: &Path,
        mut check: impl FnMut(Cut, &Path) -> Result<(), E>,
    ) -> io::Result<Result<(), E>> {
        let cursor = scratch.join("cursor.img");
        let state = scratch.join("state.img");
        let mut r = Replayer::new(&self.log, &self.base, &cursor)?;
        for &cut in cuts {
            if cut.end < r.applied() {
                return Err(io::Error::other("cuts must be sorted by their end"));
            }
            r.advance_to(cut.end)?;
            r.save(&state)?;
            let outcome = check(cut, &state);
            let _ = fs::remove_file(&state);
            if outcome.is_err() {
                drop(r);
                fs::remove_file(&cursor)?;
                return Ok(outcome);
            }
        }
        drop(r);
        fs::remove_file(&cursor)?;
        Ok(Ok(()))
    }

    /// Rebuilds the single state `cut` into `path`.
    pub fn rebuild(&self, cut: Cut, path: &Path) -> io::Result<()> {
        let mut r = Replayer::new(&self.log, &self.base, path)?;
        r.advance_to(cut.end)
    }
}

/// The first byte at which the files at `a` and `b` differ (a length
/// difference counts), `None` if they are the same.
pub fn same_bytes(a: &Path, b: &Path) -> io::Result<Option<u64>> {
    let fa = fs::File::open(a)?;
    let fb = fs::File::open(b)?;
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < la.min(lb) {
        let n = usize::try_from((la.min(lb) - at).min(1 << 20)).unwrap_or(1 << 20);
        fa.read_exact_at(&mut ba[..n], at)?;
        fb.read_exact_at(&mut bb[..n], at)?;
        if let Some(i) = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y) {
            return Ok(Some(at + i as u64));
        }
        at += n as u64;
    }
    Ok((la != lb).then_some(la.min(lb)))
}

/// `btrfs check --readonly` of the image at `image` (not mounted): its
/// report as the error if it finds anything.
pub fn btrfs_check(image: &Path) -> Result<(), String> {
    let out = Command::new("btrfs")
        .args(["check", "--readonly"])
        .arg(image)
        .output()
        .map_err(|e| format!("cannot run btrfs check: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "btrfs check --readonly {} failed ({}):\n{}{}",
            image.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
