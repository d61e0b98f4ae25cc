//! Regular files copied on helper threads while the walk goes on.
//!
//! A clone of many small files is bound by system calls per file (create,
//! clone, times, close: about 60 us each here), all on one core; the
//! files of a directory are independent of one another. The walk offers
//! each new, singly-linked file of at most [`HELPER_MAX_BYTES`] to a
//! helper and copies it itself when none is free, so every core copies.
//! What a helper did (its stats, its progress events) goes back to the walk,
//! which reports it in its own thread, and waits for every file of a
//! directory before that directory's own metadata, as a walk alone does.
//!
//! A crash leaves what a walk alone leaves: some files of the copy whole,
//! at most one per thread partial, and the same resume completes it.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};

use super::{CopyEvent, CopyStats, FileAt, FileCopier};

/// Files larger than this stay on the walk's thread, which reports their
/// progress chunk by chunk as it goes: a helper's events reach the walk
/// only once its file is done.
pub const HELPER_MAX_BYTES: u64 = 64 << 20;

/// At most this many helpers: they all create inodes in the same
/// subvolume's b-tree, whose locks they share (measured with one helper,
/// on this 2-core machine, only).
const MAX_HELPERS: usize = 3;

/// The directory a file is in and the one it goes to, shared with helpers
/// for as long as any of that directory's files is queued.
#[derive(Clone)]
pub(super) struct SharedDirs {
    src: Arc<OwnedFd>,
    dst: Arc<OwnedFd>,
}

struct FileJob {
    dirs: SharedDirs,
    name: OsString,
    rel: PathBuf,
    mount: Option<u64>,
}

/// A progress event a helper recorded, for the walk to report.
enum Recorded {
    Data {
        src: (u64, u64),
        size: u64,
        done: u64,
        cloned: u64,
    },
    Entry,
}

impl Recorded {
    fn of(ev: &CopyEvent<'_>) -> Recorded {
        match *ev {
            CopyEvent::Data {
                src,
                size,
                done,
                cloned,
                ..
            } => Recorded::Data {
                src,
                size,
                done,
                cloned,
            },
            CopyEvent::Entry { .. } => Recorded::Entry,
        }
    }

    fn event<'a>(&self, rel: &'a Path) -> CopyEvent<'a> {
        match *self {
            Recorded::Data {
                src,
                size,
                done,
                cloned,
            } => CopyEvent::Data {
                rel,
                src,
                size,
                done,
                cloned,
            },
            Recorded::Entry => CopyEvent::Entry { rel },
        }
    }
}

/// A file a helper finished (or failed).
pub(super) struct FileDone {
    rel: PathBuf,
    result: io::Result<(CopyStats, Vec<Recorded>)>,
}

impl FileDone {
    /// What the file added to the stats, once each of its events went to
    /// `report`; the helper's error, if it failed.
    pub fn report(
        self,
        report: &mut dyn FnMut(CopyEvent<'_>) -> io::Result<()>,
    ) -> io::Result<CopyStats> {
        let (stats, events) = self.result?;
        for ev in &events {
            report(ev.event(&self.rel))?;
        }
        Ok(stats)
    }
}

/// The walk's side: where it offers files and collects them.
pub(super) struct Helpers {
    jobs: Option<SyncSender<FileJob>>,
    done: Option<Receiver<FileDone>>,
    outstanding: usize,
}

impl Helpers {
    /// Whether any helper runs.
    pub fn any(&self) -> bool {
        self.jobs.is_some()
    }

    /// Hands the new file `f` to a free helper; `false` if none is free
    /// (the walk copies it itself). `shared`: the directory pair of `f`,
    /// opened again once per directory.
    pub fn offer(&mut self, f: &FileAt<'_>, shared: &mut Option<SharedDirs>) -> io::Result<bool> {
        let Some(jobs) = &self.jobs else {
            return Ok(false);
        };
        let dirs = match shared {
            Some(d) => d.clone(),
            None => {
                // Out of fds (a deep tree): the walk copies it itself.
                let (Ok(src), Ok(dst)) = (
                    f.src_dir.try_clone_to_owned(),
                    f.dst_dir.try_clone_to_owned(),
                ) else {
                    return Ok(false);
                };
                shared
                    .insert(SharedDirs {
                        src: Arc::new(src),
                        dst: Arc::new(dst),
                    })
                    .clone()
            }
        };
        let job = FileJob {
            dirs,
            name: f.name.to_owned(),
            rel: f.rel.to_owned(),
            mount: f.mount,
        };
        match jobs.try_send(job) {
            Ok(()) => {
                self.outstanding += 1;
                Ok(true)
            }
            Err(TrySendError::Full(_)) => Ok(false),
            Err(TrySendError::Disconnected(_)) => {
                self.jobs = None;
                Ok(false)
            }
        }
    }

    /// The next file a helper finished: waiting for it if `wait`, `None`
    /// once none is outstanding (or, without `wait`, none is done yet).
    pub fn next(&mut self, wait: bool) -> io::Result<Option<FileDone>> {
        let Some(done) = &self.done else {
            return Ok(None);
        };
        if self.outstanding == 0 {
            return Ok(None);
        }
        let got = if wait {
            done.recv().map_err(|_| stopped())?
        } else {
            match done.try_recv() {
                Ok(d) => d,
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return Err(stopped()),
            }
        };
        self.outstanding -= 1;
        Ok(Some(got))
    }
}

/// Every helper gone with files outstanding: only a panic does that, and
/// the scope re-raises it.
fn stopped() -> io::Error {
    io::Error::other("the copy's helper threads stopped")
}

/// How many helpers a copy starts: one per core beyond the walk's.
fn helper_count() -> usize {
    std::thread::available_parallelism()
        .map_or(0, |n| n.get() - 1)
        .min(MAX_HELPERS)
}

/// Runs `walk` with helpers copying files for it (none on one core, or if
/// no thread can be started). Every helper has stopped when this returns,
/// so nothing writes into the copy after it; after an error, they skip
/// the files still queued.
pub(super) fn with_helpers<T>(
    block: u64,
    chunk_bytes: Option<u64>,
    walk: impl FnOnce(Helpers) -> io::Result<T>,
) -> io::Result<T> {
    let wanted = helper_count();
    let none = || Helpers {
        jobs: None,
        done: None,
        outstanding: 0,
    };
    if wanted == 0 {
        return walk(none());
    }
    // Room for one file per helper: the walk copies a file itself whenever
    // every helper is busy, so both sides keep working.
    let (job_tx, job_rx) = mpsc::sync_channel::<FileJob>(wanted);
    let job_rx = Mutex::new(job_rx);
    let (done_tx, done_rx) = mpsc::channel::<FileDone>();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let mut started = 0;
        for _ in 0..wanted {
            let (jobs, done, stop) = (&job_rx, done_tx.clone(), &stop);
            let spawned = std::thread::Builder::new()
                .name("volume-copy".to_owned())
                .spawn_scoped(scope, move || help(jobs, done, block, chunk_bytes, stop));
            if spawned.is_err() {
                break;
            }
            started += 1;
        }
        drop(done_tx);
        let helpers = if started == 0 {
            none()
        } else {
            Helpers {
                jobs: Some(job_tx),
                done: Some(done_rx),
                outstanding: 0,
            }
        };
        let r = walk(helpers);
        if r.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        r
    })
}

/// A helper: copies the files it is given until the walk closes the queue.
fn help(
    jobs: &Mutex<Receiver<FileJob>>,
    done: Sender<FileDone>,
    block: u64,
    chunk_bytes: Option<u64>,
    stop: &AtomicBool,
) {
    loop {
        let next = jobs.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = next else { return };
        if stop.load(Ordering::Relaxed) {
            continue;
        }
        let mut stats = CopyStats {
            helped_files: 1,
            ..CopyStats::default()
        };
        let mut events = Vec::new();
        let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            FileCopier {
                block,
                chunk_bytes,
                stats: &mut stats,
                progress: &mut |ev| {
                    events.push(Recorded::of(&ev));
                    Ok(())
                },
            }
            .copy_file(
                &FileAt {
                    src_dir: job.dirs.src.as_fd(),
                    dst_dir: job.dirs.dst.as_fd(),
                    name: &job.name,
                    rel: &job.rel,
                    mount: job.mount,
                },
                true,
            )
        }));
        let (result, panic) = match copied {
            Ok(r) => (r, None),
            // The walk waits for this file: it hears of the failure, ends,
            // and the scope raises the panic again.
            Err(p) => (Err(stopped()), Some(p)),
        };
        let finished = FileDone {
            rel: job.rel,
            result: result.map(|()| (stats, events)),
        };
        let sent = done.send(finished);
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        if sent.is_err() {
            return;
        }
    }
}
