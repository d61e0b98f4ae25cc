//! The subvolume API: what the rest of the crate calls, over the backend
//! chosen at compile time (`native` ioctls by default, libbtrfsutil with
//! the `btrfsutil` feature). What both backends share (read-only trees,
//! the timestamps of a recursive snapshot, the metadata commit) is written
//! once, here; what they and `inode` take back (the subvolume root's inode
//! number, GET_SUBVOL_INFO, [`Nested`]) lives below them all, in
//! [`super::subvolume_info`](mod@super::subvolume_info).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

#[cfg(feature = "btrfsutil")]
use super::btrfsutil as backend;
use super::dir::read_dir_names;
use super::flags::{clear_stuck_flags, with_own_stuck_flags_lifted};
use super::fs::{FileType, is_btrfs, open_dir_at, set_times, stat, times};
use super::inode::{open_subvolume, open_tree_dir};
use super::ioctl::{BTRFS_IOCTL_MAGIC, ensure_btrfs};
#[cfg(not(feature = "btrfsutil"))]
use super::native as backend;
use super::qgroup::QgroupInherit;
use super::subvolume_info::{Nested, SUBVOLUME_ROOT_INO, subvolume_info};

/// Whether `fd` is the root directory of a btrfs subvolume.
///
/// A subvolume root is always inode 256 on btrfs; checking the filesystem
/// first keeps an ext4 directory that happens to be inode 256 from passing.
pub fn is_subvolume(fd: BorrowedFd<'_>) -> io::Result<bool> {
    if !is_btrfs(fd)? {
        return Ok(false);
    }
    let st = stat(fd)?;
    Ok(st.ino == SUBVOLUME_ROOT_INO && st.is_dir())
}

/// Creates an empty subvolume `name` inside `parent`. Atomic: after a crash
/// either nothing or an empty subvolume exists under `name`. `name` is one
/// path component (no `/`, no NUL, at most 255 bytes); ENOTTY off btrfs.
pub fn create_subvolume(parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    backend::create_subvolume(parent, name, None)
}

/// [`create_subvolume`], the new subvolume's qgroup made a member of the
/// groups `inherit` names in the same transaction (with quotas off the
/// kernel ignores it). ENOENT if a group named does not exist.
pub fn create_subvolume_with(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: &QgroupInherit,
) -> io::Result<()> {
    backend::create_subvolume(parent, name, Some(inherit))
}

/// Snapshots the subvolume open as `source` (its root directory) to a new
/// subvolume `name` inside `parent`, read-only if `read_only`, without the
/// subvolumes nested in it: each shows in the snapshot as an empty
/// placeholder directory, which `rmdir` removes. O(1) whatever the source
/// holds; atomic (after a crash the snapshot is either all there or
/// absent), read-only flag included. The kernel flushes the source's dirty
/// data first. ENOTTY off btrfs.
pub fn create_snapshot(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    read_only: bool,
) -> io::Result<()> {
    backend::create_snapshot(source, parent, name, read_only, None)
}

/// [`create_snapshot`] with a qgroup inherit: the snapshot's qgroup joins
/// exactly the groups `inherit` names, atomically with its creation. With
/// full quotas the kernel keeps its numbers consistent only when the
/// source is a member of exactly one group, that group is the one named,
/// and it holds all its bytes alone (`qgroup_snapshot_quick_inherit`);
/// otherwise it marks the quotas inconsistent, as it does for any
/// snapshot of a group member made without an inherit.
pub fn create_snapshot_with(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    read_only: bool,
    inherit: &QgroupInherit,
) -> io::Result<()> {
    backend::create_snapshot(source, parent, name, read_only, Some(inherit))
}

/// [`create_snapshot`], writable.
pub fn snapshot(source: BorrowedFd<'_>, parent: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    create_snapshot(source, parent, name, false)
}

/// Snapshots the subvolume open as `source`, and every subvolume nested in
/// it, to a new writable subvolume `name` inside `parent`, and returns it
/// open. The copy matches the source to the nanosecond: each nested
/// subvolume's snapshot replaces an empty placeholder (an rmdir, then a
/// snapshot under the same name), which changes its parent directory's
/// times, so those are set back to the source's. Every nested snapshot is
/// writable too, whatever its source's flag.
///
/// One ioctl per subvolume, so a crash can leave a partial tree: callers
/// snapshot under a temporary name. Writable because nested snapshots are
/// placed inside the new one; callers freeze it afterwards if they must
/// ([`make_tree_read_only`]).
pub fn snapshot_tree(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
) -> io::Result<OwnedFd> {
    snapshot_tree_with(source, parent, name, None)
}

/// [`snapshot_tree`], the top snapshot created with `inherit` (see
/// [`create_snapshot_with`]); the nested ones without.
pub fn snapshot_tree_with(
    source: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    inherit: Option<&QgroupInherit>,
) -> io::Result<OwnedFd> {
    backend::snapshot_recursive(source, parent, name, inherit)?;
    let copy = open_dir_at(parent, name)?;
    let sources = nested_subvolumes(source)?;
    if sources.is_empty() {
        return Ok(copy);
    }
    let copies = nested_subvolumes(copy.as_fd())?;
    let (source_id, copy_id) = (subvolume_info(source)?.id, subvolume_info(copy.as_fd())?.id);
    for (n, found) in sources
        .iter()
        .zip(match_nested(&sources, source_id, &copies, copy_id))
    {
        let Some(c) = found.map(|j| &copies[j]) else {
            continue;
        };
        let t = times(open_tree_dir(source, n.parent, n.dirid)?.as_fd())?;
        let holder = open_tree_dir(copy.as_fd(), c.parent, c.dirid)?;
        with_own_stuck_flags_lifted(holder.as_fd(), || set_times(holder.as_fd(), &t))?;
    }
    Ok(copy)
}

/// The path of each of `nested` (the listing of the subvolume open as
/// `fd`, parents first) relative to `fd`, for messages and tests: built
/// from the inodes' reference items ([`super::inode::dir_parent`]), so it
/// exists however long it is, but, being a path, is never opened.
pub fn nested_paths(fd: BorrowedFd<'_>, nested: &[Nested]) -> io::Result<Vec<PathBuf>> {
    let top = subvolume_info(fd)?.id;
    let mut by_id: HashMap<u64, PathBuf> = HashMap::from([(top, PathBuf::new())]);
    let mut out = Vec::with_capacity(nested.len());
    for n in nested {
        let mut names = vec![n.name.clone()];
        let mut cur = n.dirid;
        while let Some((up, name)) = super::inode::dir_parent(fd, n.parent, cur)? {
            names.push(name);
            cur = up;
        }
        let mut path = by_id.get(&n.parent).cloned().unwrap_or_default();
        path.extend(names.iter().rev());
        by_id.insert(n.id, path.clone());
        out.push(path);
    }
    Ok(out)
}

/// For each of `a` (the nested listing of subvolume `a_top`), the index in
/// `b` (that of `b_top`) of the subvolume at the same place: held by the
/// counterpart of its parent, in the directory with the same inode number,
/// under the same name. A snapshot keeps inode numbers and names, so a
/// recursive snapshot's nested subvolumes match their sources one to one;
/// `None` where `b` has nothing there. Both listings parents first, as
/// [`nested_subvolumes`] gives them.
pub(crate) fn match_nested(
    a: &[Nested],
    a_top: u64,
    b: &[Nested],
    b_top: u64,
) -> Vec<Option<usize>> {
    let by_place: HashMap<(u64, u64, &OsStr), usize> = b
        .iter()
        .enumerate()
        .map(|(j, n)| ((n.parent, n.dirid, n.name.as_os_str()), j))
        .collect();
    let mut counterpart = HashMap::from([(a_top, b_top)]);
    a.iter()
        .map(|n| {
            let parent = counterpart.get(&n.parent)?;
            let j = *by_place.get(&(*parent, n.dirid, n.name.as_os_str()))?;
            counterpart.insert(n.id, b[j].id);
            Some(j)
        })
        .collect()
}

/// The root directory of the subvolume holding the directory open as
/// `dir`, found by walking `..` without leaving `dir`'s mount, with the
/// names that lead from it down to `dir` (empty when `dir` is that root).
/// `None` when the mount's root lies below the subvolume's root (a
/// subdirectory or bind mount): the subvolume root is then out of reach.
pub fn subvolume_root_of(dir: BorrowedFd<'_>) -> io::Result<Option<(OwnedFd, Vec<OsString>)>> {
    // Before Linux 5.8 statx has no mount id: then nothing is known.
    let mount_of = super::fs::mount_id;
    let Some(mount) = mount_of(dir)? else {
        return Ok(None);
    };
    let mut cur = open_dir_at(dir, OsStr::new("."))?;
    let mut names = Vec::new();
    loop {
        let st = stat(cur.as_fd())?;
        if st.ino == SUBVOLUME_ROOT_INO {
            names.reverse();
            return Ok(Some((cur, names)));
        }
        let up = open_dir_at(cur.as_fd(), OsStr::new(".."))?;
        let up_st = stat(up.as_fd())?;
        if up_st.dev != st.dev || up_st.ino == st.ino || mount_of(up.as_fd())? != Some(mount) {
            return Ok(None);
        }
        // A directory has one name: the entry of `up` with its inode number.
        let Some((name, _, _)) = read_dir_names(up.as_fd())?
            .into_iter()
            .find(|(_, ty, ino)| *ino == st.ino && *ty == FileType::Directory)
        else {
            return Ok(None);
        };
        names.push(name);
        cur = up;
    }
}

/// Sets or clears the read-only flag of the subvolume open as `fd` (its
/// root directory), leaving its other flags alone. ENOTTY off btrfs.
pub fn set_read_only(fd: BorrowedFd<'_>, read_only: bool) -> io::Result<()> {
    backend::set_read_only(fd, read_only)
}

/// Whether the subvolume open as `fd` is read-only. ENOTTY off btrfs.
pub fn is_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    backend::is_read_only(fd)
}

/// Every subvolume nested below the subvolume open as `fd` (its root
/// directory: EINVAL otherwise), parents first (each followed by
/// everything nested in it), siblings in the order of their ids; walk it
/// backwards for children before their parents. Needs CAP_SYS_ADMIN (the
/// root tree is searched). ENOTTY off btrfs.
pub fn nested_subvolumes(fd: BorrowedFd<'_>) -> io::Result<Vec<Nested>> {
    backend::nested_subvolumes(fd)
}

/// Deletes the subvolume `name` inside `parent`, and with `recursive` every
/// subvolume nested in it, children first. O(1) per subvolume: the kernel's
/// cleaner frees the extents later, in the background. ENOTTY off btrfs.
///
/// A nested subvolume inside a read-only one cannot be unlinked, so callers
/// clear read-only flags first (see [`make_tree_writable`]).
pub fn delete_subvolume(parent: BorrowedFd<'_>, name: &OsStr, recursive: bool) -> io::Result<()> {
    backend::delete_subvolume(parent, name, recursive)
}

/// Clears what would stop the subvolume open as `fd` and every subvolume
/// nested in it from being deleted: each one's read-only flag, and the
/// immutable and append-only flags of each one's root directory (a
/// package can set both on anything it owns). For a tree about to go: the
/// flags do not come back.
pub fn make_tree_writable(fd: BorrowedFd<'_>) -> io::Result<()> {
    let writable = |sub: BorrowedFd<'_>| -> io::Result<()> {
        if is_read_only(sub)? {
            set_read_only(sub, false)?;
        }
        clear_stuck_flags(sub)
    };
    writable(fd)?;
    for n in nested_subvolumes(fd)? {
        writable(open_subvolume(fd, n.id)?.as_fd())?;
    }
    Ok(())
}

/// Sets the read-only flag on every subvolume nested in `fd`, children
/// first, then on `fd` itself: once the top is read-only, the tree is frozen.
pub fn make_tree_read_only(fd: BorrowedFd<'_>) -> io::Result<()> {
    for n in nested_subvolumes(fd)?.iter().rev() {
        set_read_only(open_subvolume(fd, n.id)?.as_fd(), true)?;
    }
    set_read_only(fd, true)
}

/// Commits the current btrfs transaction (BTRFS_IOC_SYNC) of the filesystem
/// holding `fd`, after writing out every file's dirty data. ENOTTY off
/// btrfs.
pub fn commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    backend::commit(fd)
}

/// How long BTRFS_IOC_START_SYNC may wait for its commit to start before
/// the commit is made on another thread instead (BTRFS_IOC_SYNC). The
/// ioctl only asks btrfs's transaction thread to commit, then waits for it
/// to start; on this project's 6.18 kernel that wait sometimes misses its
/// wake-up and lasts until some later commit. Seen here: 4 calls in 2,000
/// back to back took 30-32 s, one waited 100 s on an idle filesystem, and
/// a boot's clone, which starts a commit every 250 ms, stalled 30-34 s in
/// 3 runs of 8. Waits that end well were 2-66 ms (one boot's clones,
/// traced); a start also waits for the commit before it, which slow
/// storage stretches, so two seconds leave every start that would end
/// alone and still cut the stall fifteenfold. Before that, at
/// [`COMMIT_START_NUDGE`], the commit is asked for again.
pub const COMMIT_START_PATIENCE: Duration = Duration::from_secs(2);

/// How long BTRFS_IOC_START_SYNC may wait for its commit to start before
/// another thread asks for it again, with a second BTRFS_IOC_START_SYNC
/// (then again at twice the wait, and so on). The missed wake-up, as the
/// kernel reads: START_SYNC (`btrfs_commit_transaction_async`, in
/// `fs/btrfs/transaction.c`) sets the commit request bit and wakes the
/// transaction thread (`transaction_kthread`, in `fs/btrfs/disk-io.c`),
/// which tests that bit at the top of its loop and, once done, sleeps for
/// up to its commit interval (30 s) without testing it again: a wake-up
/// that finds it awake (between its test and its sleep, or all through a
/// commit of the transaction before) is lost, and the request is seen
/// only when the thread next wakes. Another request's wake-up finds it
/// asleep. An ask while the first still waits joins the same transaction
/// (its commit has not started, or the first would have returned), or
/// waits with it for the commit before to end, and asks for no other
/// commit: it costs a thread and a descriptor until that commit starts
/// (an ask made just as the first's began may join the next transaction,
/// a commit more; it is watched in its turn, forced at
/// [`COMMIT_START_PATIENCE`] and never asked again, so that no ask waits
/// out the commit interval), and writes out no file data, unlike the
/// commit at [`COMMIT_START_PATIENCE`], which stays for misses past every
/// ask.
/// Waits that end well were 2-66 ms (above); a miss costs about this much.
pub const COMMIT_START_NUDGE: Duration = Duration::from_millis(25);

/// Commit starts [`start_commit_bounded`] forced, since the process
/// started.
static FORCED_COMMIT_STARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Commit starts [`start_commit_bounded`] asked for again, since the
/// process started.
static NUDGED_COMMIT_STARTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many commit starts ([`start_commit`], [`commit_metadata`]) waited
/// past [`COMMIT_START_PATIENCE`] and were forced by a commit from another
/// thread, in this process so far: missed wake-ups that asking again did
/// not end, or starts that were merely that slow.
pub fn forced_commit_starts() -> u64 {
    FORCED_COMMIT_STARTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many commit starts waited past [`COMMIT_START_NUDGE`] and were
/// asked for again, in this process so far.
pub fn nudged_commit_starts() -> u64 {
    NUDGED_COMMIT_STARTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// BTRFS_IOC_START_SYNC, bounded: once it has waited
/// [`COMMIT_START_NUDGE`], another thread asks for the commit again (a
/// second BTRFS_IOC_START_SYNC, on a thread of its own: it may miss its
/// wake-up too); once it has waited [`COMMIT_START_PATIENCE`], another
/// thread commits the transaction itself (BTRFS_IOC_SYNC, which first
/// writes out the filesystem's dirty file data), and that commit starting
/// releases this one. The other threads hold their own descriptors and
/// are not waited for: the caller goes on once its own ioctl returns.
/// Returns the transaction's id. If a thread or its descriptor cannot be
/// had, the ioctl waits unbounded (or until the commit), as it would
/// anyway.
fn start_commit_bounded(fd: BorrowedFd<'_>) -> io::Result<u64> {
    ensure_btrfs(fd)?;
    watched(fd, backend::start_commit, true)
}

/// `start` (a BTRFS_IOC_START_SYNC) on `fd`, watched from a thread of its
/// own ([`kick`]): asked for again if `asks`, forced at
/// [`COMMIT_START_PATIENCE`]. Returns `start`'s outcome.
fn watched(
    fd: BorrowedFd<'_>,
    start: fn(BorrowedFd<'_>) -> io::Result<u64>,
    asks: bool,
) -> io::Result<u64> {
    let started: Arc<Started> = Arc::default();
    if let Ok(own) = fd.try_clone_to_owned() {
        let started = Arc::clone(&started);
        // The kick's own errors are not the caller's: the ioctl's is.
        let _ = std::thread::Builder::new()
            .name("btrfs-commit-kick".to_owned())
            .spawn(move || kick(&own, &started, asks));
    }
    let transid = start(fd);
    let (lock, wake) = &*started;
    *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
    wake.notify_all();
    transid
}

/// Whether a commit start returned, and its wake-up.
type Started = (Mutex<bool>, Condvar);

/// Watches a commit start (`started`) on the filesystem open as `fd`: with
/// `asks`, asks for the commit again at [`COMMIT_START_NUDGE`], then at
/// twice that and so on while it waits, each ask on a thread of its own
/// and watched in its turn, without asks (it may miss its wake-up too, and
/// may have joined the next transaction, which nothing else may commit
/// for 30 s); and commits at [`COMMIT_START_PATIENCE`].
fn kick(fd: &OwnedFd, started: &Started, asks: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    let ask = |waited: Duration| {
        NUDGED_COMMIT_STARTS.fetch_add(1, Relaxed);
        tracing::debug!("a btrfs commit start waited {waited:?}; asking again");
        if let Ok(again) = fd.try_clone() {
            let _ = std::thread::Builder::new()
                .name("btrfs-commit-ask".to_owned())
                .spawn(move || watched(again.as_fd(), backend::ask_commit, false));
        }
    };
    let force = || {
        FORCED_COMMIT_STARTS.fetch_add(1, Relaxed);
        tracing::debug!("a btrfs commit start waited {COMMIT_START_PATIENCE:?}; committing here");
        let _ = backend::commit(fd.as_fd());
    };
    kick_with(started, asks, ask, force);
}

/// [`kick`]'s schedule: with `asks`, `ask` at [`COMMIT_START_NUDGE`], twice
/// that and so on; `force` at [`COMMIT_START_PATIENCE`]; while `started`
/// is not set.
fn kick_with(started: &Started, asks: bool, ask: impl Fn(Duration), force: impl FnOnce()) {
    let (lock, wake) = started;
    let mut done = lock.lock().unwrap_or_else(PoisonError::into_inner);
    let mut waited = Duration::ZERO;
    let mut next = match asks {
        true => COMMIT_START_NUDGE,
        false => COMMIT_START_PATIENCE,
    };
    loop {
        let until = next.min(COMMIT_START_PATIENCE);
        let timeout;
        (done, timeout) = wake
            .wait_timeout_while(done, until.saturating_sub(waited), |done| !*done)
            .unwrap_or_else(PoisonError::into_inner);
        if !timeout.timed_out() {
            return;
        }
        waited = until;
        if waited >= COMMIT_START_PATIENCE {
            break;
        }
        ask(waited);
        next = next.saturating_mul(2);
    }
    drop(done);
    force();
}

/// Starts committing the current btrfs transaction of the filesystem
/// holding `fd` (BTRFS_IOC_START_SYNC) and returns once the commit has
/// started: long copies call it now and then so that the commit they must
/// wait for at the end has little left to write. A start past
/// [`COMMIT_START_NUDGE`] is asked for again, and one past
/// [`COMMIT_START_PATIENCE`] forced, which then also waits for the
/// filesystem's dirty data to be written out. ENOTTY off btrfs.
pub fn start_commit(fd: BorrowedFd<'_>) -> io::Result<()> {
    start_commit_bounded(fd).map(drop)
}

/// Commits the running btrfs transaction of the filesystem holding `fd`
/// and waits until it is on disk (BTRFS_IOC_START_SYNC, bounded as in
/// [`start_commit`], then BTRFS_IOC_WAIT_SYNC), without first writing out
/// every file's dirty data as [`commit`] does (unless the start had to be
/// forced): every metadata change made so far (renames, times, flags,
/// records) is then durable, at the cost of one commit, however much data
/// other writers have in the page cache.
pub fn commit_metadata(fd: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::ioctl::{Setter, opcode};
    const WAIT_SYNC: rustix::ioctl::Opcode = opcode::write::<u64>(BTRFS_IOCTL_MAGIC, 22);
    // Checks that `fd` is on btrfs, as WAIT_SYNC needs.
    let transid = start_commit_bounded(fd)?;
    super::fault::check("ioctl WAIT_SYNC")?;
    // SAFETY: WAIT_SYNC is _IOW(0x94, 22, __u64) and reads the transid.
    unsafe { rustix::ioctl::ioctl(fd, Setter::<WAIT_SYNC, u64>::new(transid)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A start that never returns is asked for again at 25, 50, 100 ms and
    /// so on, then forced at two seconds.
    #[test]
    fn a_start_that_waits_is_asked_for_again_then_forced() {
        let started = Started::default();
        let asks = Mutex::new(Vec::new());
        let begun = Instant::now();
        let mut forced = None;
        kick_with(
            &started,
            true,
            |w| asks.lock().expect("asks").push(w),
            || forced = Some(begun.elapsed()),
        );
        let asks = asks.into_inner().expect("asks");
        assert_eq!(asks, [25, 50, 100, 200, 400, 800, 1600].map(ms));
        assert!(forced.expect("forced") >= COMMIT_START_PATIENCE);
    }

    /// An ask is watched without asks of its own: forced at two seconds,
    /// never asked again.
    #[test]
    fn an_ask_that_waits_is_forced_not_asked_again() {
        let started = Started::default();
        let begun = Instant::now();
        let mut forced = None;
        kick_with(
            &started,
            false,
            |w| panic!("asked again after {w:?}"),
            || forced = Some(begun.elapsed()),
        );
        assert!(forced.expect("forced") >= COMMIT_START_PATIENCE);
    }

    /// One that returns meanwhile is asked for no more, and not forced.
    #[test]
    fn a_start_that_returns_is_left_alone() {
        let started: Arc<Started> = Arc::default();
        let set = Arc::clone(&started);
        let returns = std::thread::spawn(move || {
            std::thread::sleep(ms(60));
            *set.0.lock().expect("started") = true;
            set.1.notify_all();
        });
        let asks = Mutex::new(Vec::new());
        kick_with(
            &started,
            true,
            |w| asks.lock().expect("asks").push(w),
            || panic!("forced"),
        );
        returns.join().expect("the start returns");
        let asks = asks.into_inner().expect("asks");
        assert!(asks.starts_with(&[ms(25), ms(50)]), "{asks:?}");
        assert!(asks.len() < 7, "{asks:?}");
    }
}
