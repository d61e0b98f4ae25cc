//! Emptying the trash ([`crate::layout::TRASH_DIR`]) in a background
//! thread, for a long-lived process (start-core): its restore or delete
//! returns as soon as the package is in its new state and durable, and the
//! tree it no longer uses is deleted here, after, on no caller's path and
//! under no package's lock.
//!
//! One thread per process at most, started on demand and ending when it
//! has nothing left: the volumes roots asked for are emptied one after the
//! other ([`crate::empty_trash_at`]); a root asked for again while it is
//! being emptied is emptied once more after, so nothing put in the trash
//! before a request is left behind by it. Nothing here is durable: a
//! process that exits (or crashes) with work pending leaves trees in the
//! trash, garbage that the next emptying, or the boot's recovery
//! ([`crate::VolumeStore::recover_all`]), deletes.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};

/// What the thread has to do.
struct State {
    /// Roots to empty the trash of, oldest request first.
    queue: Vec<PathBuf>,
    /// Whether the thread is running.
    running: bool,
    /// How many [`Paused`] guards are alive.
    paused: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    queue: Vec::new(),
    running: false,
    paused: 0,
});
static CHANGED: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Empties the trash of the volumes root at `root` in the background
/// thread, starting it if it is not running; nothing if `root` has no
/// trash (a call that put nothing there costs one `stat`). Returns at
/// once. If no thread can be started, empties it here.
pub fn in_background(root: &Path) {
    if !root.join(crate::layout::TRASH_DIR).exists() {
        return;
    }
    let mut s = state();
    if !s.queue.iter().any(|r| r == root) {
        s.queue.push(root.to_owned());
    }
    CHANGED.notify_all();
    if s.running {
        return;
    }
    s.running = true;
    drop(s);
    let spawned = std::thread::Builder::new()
        .name("volume-purge".to_owned())
        .spawn(run);
    if let Err(e) = spawned {
        tracing::warn!("no thread to purge in ({e}): purging inline");
        state().running = false;
        run();
    }
}

/// The thread: empties each root asked for until none is left.
fn run() {
    loop {
        let root = {
            let mut s = state();
            while s.paused > 0 {
                s = CHANGED.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            if s.queue.is_empty() {
                s.running = false;
                CHANGED.notify_all();
                return;
            }
            s.queue.remove(0)
        };
        if let Err(e) = empty(&root) {
            tracing::warn!(
                "emptying the trash of {}: {e}; the next purge or the boot's recovery \
                 tries again",
                root.display()
            );
        }
    }
}

fn empty(root: &Path) -> Result<usize, models::Error> {
    use models::ResultExt;
    let fd = crate::sys::open_dir_path(root).with_ctx(|_| {
        (
            models::ErrorKind::Filesystem,
            format!("opening {}", root.display()),
        )
    })?;
    crate::empty_trash_at(std::os::fd::AsFd::as_fd(&fd), root)
}

/// Waits until every trash asked for with [`in_background`] is emptied
/// (one a restore or delete of this process filled, before the call). For
/// a test, a benchmark, or a shutdown that wants the disk quiet; must not
/// be called while a [`Paused`] guard of the calling thread is alive (it
/// would wait for itself).
pub fn wait_purged() {
    let mut s = state();
    while s.running || !s.queue.is_empty() {
        s = CHANGED.wait(s).unwrap_or_else(|p| p.into_inner());
    }
}

/// Holds off the background thread's next emptying (one under way goes on)
/// while alive: for a caller that wants the disk quiet for a while (a
/// benchmark timing something else), or a test that looks at the trash
/// before it is emptied. Requests are kept, and served once the last guard
/// is dropped.
#[must_use = "the purge resumes when the guard is dropped"]
pub struct Paused(());

/// Holds off the background purges until the guard is dropped (see
/// [`Paused`]).
pub fn pause() -> Paused {
    state().paused += 1;
    Paused(())
}

impl Drop for Paused {
    fn drop(&mut self) {
        let mut s = state();
        s.paused -= 1;
        CHANGED.notify_all();
    }
}
