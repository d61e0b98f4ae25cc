//! The one tree walker: any depth, a bounded number of descriptors,
//! never across a mount.
//!
//! A package's volume is written by the package, so its tree may be of any
//! shape: a chain of directories 20,000 deep, names of 255 bytes that put
//! a path far past PATH_MAX, a mount (another filesystem, or a bind mount
//! of something else) over one of its directories. A walk that recursed,
//! held one descriptor per level, or resolved paths would fail on the
//! first two (a stack overflow, EMFILE, ENAMETOOLONG) and read the wrong
//! data on the third. So every walk here:
//!
//! - is iterative: its stack is a `Vec` on the heap, one frame per level
//!   with the next names to visit: a batch of at most [`BATCH`], read when
//!   the last one is used up from the position the directory's filesystem
//!   gave with the batch before (a `d_off`, which outlives the descriptor:
//!   a level reopened through `..` goes on where it was). So a walk holds
//!   depth × [`BATCH`] names at most, whatever a directory's size: a
//!   directory of 300,000 entries read whole cost 21 MB. Names added to a
//!   directory while it is walked may or may not be visited, names removed
//!   may or may not be; every other name is visited exactly once;
//! - works relative to descriptors, one component at a time, never
//!   following a symlink and opening nothing but directories;
//! - keeps at most [`FD_BUDGET`] descriptors of its own open, whatever the
//!   depth: past that, the shallowest levels close theirs, and a level is
//!   opened again when the walk comes back up to it, through `..` of the
//!   level below, checked to be the same directory (device and inode)
//!   before anything is done in it; a directory moved away meanwhile is an
//!   error, never a walk through somewhere else;
//! - never enters a directory on another mount than its top's (statx's
//!   mount id, which a bind mount of the same filesystem changes too):
//!   entering one is a [`CrossesMount`] error naming its path, for the
//!   caller to refuse the package with. Nested btrfs subvolumes are no
//!   mounts and are entered; callers that must not, check the device.
//!
//! A [`Chain`] is the stack alone, for the side of a copy that the copy
//! builds itself; a [`Walk`] adds the entries to visit.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use crate::sys::{self, FileType};

/// Descriptors a [`Chain`] keeps open at most, the current directory's
/// included. Every level deeper than that costs, on the way back up, one
/// `openat(.., "..")` and one `fstat`.
pub const FD_BUDGET: usize = 8;

/// Names a [`Walk`] reads of a directory at a time, and holds at most per
/// level: one `getdents` pass and one `lseek` per batch, a few hundred
/// kilobytes of names at most per level.
pub const BATCH: usize = 1024;

/// Whether a walk goes on after a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Go on.
    Continue,
    /// Stop the whole walk.
    Stop,
}

/// Directories nested deeper than a walk's depth limit: the payload of
/// [`too_deep`]'s error, which [`is_too_deep`] recognises.
#[derive(Debug)]
pub struct TooDeep {
    /// The limit.
    pub limit: usize,
}

impl fmt::Display for TooDeep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "directories nested deeper than {} levels", self.limit)
    }
}

impl std::error::Error for TooDeep {}

/// The error for a tree nested deeper than `limit` levels below the top of
/// what was walked. It is final: walking again meets it again.
pub fn too_deep(limit: usize) -> io::Error {
    io::Error::other(TooDeep { limit })
}

/// Whether `e` is [`too_deep`]'s.
pub fn is_too_deep(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<TooDeep>())
}

/// A directory (or file) of the walked tree on another mount than the
/// tree's top: the payload of [`crosses_mount`]'s error.
#[derive(Debug)]
pub struct CrossesMount {
    /// Its path from the top of the walk.
    pub path: PathBuf,
}

impl fmt::Display for CrossesMount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is a mount point (another filesystem, or a bind mount), which is no part \
             of the tree; unmount it first",
            printable(&self.path)
        )
    }
}

impl std::error::Error for CrossesMount {}

/// The error for `path` (from the top of a walk) being a mount point.
pub fn crosses_mount(path: PathBuf) -> io::Error {
    io::Error::other(CrossesMount { path })
}

/// Whether `e` is [`crosses_mount`]'s.
pub fn is_crossing(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<CrossesMount>())
}

/// A path (or any name) for a one-line message: lossy UTF-8, control
/// characters escaped, and cut to its first and last 120 characters past
/// 300: every message that names a path a package chose goes through it.
pub fn printable(path: &std::path::Path) -> String {
    let text: String = path
        .to_string_lossy()
        .chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= 300 {
        return text;
    }
    let head: String = chars[..120].iter().collect();
    let tail: String = chars[chars.len() - 120..].iter().collect();
    format!("{head}...({} characters)...{tail}", chars.len() - 240)
}

/// The type of the entry `name` in `dir`, from its directory entry or, where
/// the filesystem leaves that unknown, from `lstat`. `None` if it vanished.
pub(crate) fn entry_type(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    from_dirent: FileType,
) -> io::Result<Option<FileType>> {
    if from_dirent != FileType::Unknown {
        return Ok(Some(from_dirent));
    }
    Ok(sys::stat_at(dir, name)?.map(|st| st.file_type))
}

/// One level below the top of a [`Chain`].
struct Level {
    /// Its name in the level above.
    name: OsString,
    /// (device, inode): what a reopened descriptor must be.
    id: (u64, u64),
    /// Closed (`None`) once deeper levels used up the budget; always open
    /// for the deepest level.
    fd: Option<OwnedFd>,
}

/// The directories from a top, which the caller holds open, down to the
/// current one, with at most [`FD_BUDGET`] of them open (see the module
/// docs). The current directory is always open.
pub struct Chain<'a> {
    top: BorrowedFd<'a>,
    levels: Vec<Level>,
    open: usize,
}

impl<'a> Chain<'a> {
    /// A chain at `top`.
    pub fn new(top: BorrowedFd<'a>) -> Chain<'a> {
        Chain {
            top,
            levels: Vec::new(),
            open: 0,
        }
    }

    /// The current directory.
    pub fn dir(&self) -> BorrowedFd<'_> {
        match self.levels.last().and_then(|l| l.fd.as_ref()) {
            Some(fd) => fd.as_fd(),
            None => self.top,
        }
    }

    /// Levels below the top (0 at the top).
    pub fn depth(&self) -> usize {
        self.levels.len()
    }

    /// The current directory's path from the top, for messages.
    pub fn path(&self) -> PathBuf {
        self.levels.iter().map(|l| l.name.as_os_str()).collect()
    }

    /// Makes `fd`, the directory `name` of the current one (opened by the
    /// caller), the current directory; closes the shallowest open level's
    /// descriptor if that keeps the chain within its budget.
    pub fn push(&mut self, name: &OsStr, fd: OwnedFd) -> io::Result<()> {
        let st = sys::stat(fd.as_fd())?;
        // The open levels are the deepest `open` ones: the shallowest of
        // them closes.
        let shallowest_open = self.levels.len().saturating_sub(self.open);
        if self.open >= FD_BUDGET
            && let Some(l) = self.levels.get_mut(shallowest_open)
        {
            l.fd = None;
            self.open -= 1;
        }
        self.levels.push(Level {
            name: name.to_owned(),
            id: (st.dev, st.ino),
            fd: Some(fd),
        });
        self.open += 1;
        Ok(())
    }

    /// Goes back up one level, reopening the one above through `..` if its
    /// descriptor was closed, and checking it is the same directory.
    /// Returns the name of the level left. At the top: `None`.
    pub fn pop(&mut self) -> io::Result<Option<OsString>> {
        let Some(left) = self.levels.pop() else {
            return Ok(None);
        };
        self.open -= usize::from(left.fd.is_some());
        if let Some(above) = self.levels.last_mut()
            && above.fd.is_none()
        {
            let from = left.fd.as_ref().map(|fd| fd.as_fd()).ok_or_else(|| {
                io::Error::other("a walk lost its current directory's descriptor")
            })?;
            let up = sys::open_dir_at(from, OsStr::new(".."))?;
            let st = sys::stat(up.as_fd())?;
            if (st.dev, st.ino) != above.id {
                return Err(moved(&above.name));
            }
            above.fd = Some(up);
            self.open += 1;
        }
        Ok(Some(left.name))
    }
}

/// A directory that is not where the walk left it.
fn moved(name: &OsStr) -> io::Error {
    io::Error::other(format!(
        "directory {} was moved while it was walked",
        printable(std::path::Path::new(name))
    ))
}

/// One entry of a directory, as the directory lists it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    /// Its name: raw bytes, one component.
    pub name: OsString,
    /// Its type as the directory entry gives it (`Unknown` where the
    /// filesystem does not say; see [`Walk::entry_type`]).
    pub file_type: FileType,
    /// Its inode number as the directory entry gives it: the entry's own,
    /// never that of something mounted over it.
    pub ino: u64,
}

/// What a [`Walk`] met.
#[derive(Debug)]
pub enum Step {
    /// An entry of the current directory. A directory is only entered if
    /// the caller calls [`Walk::enter`] with it.
    Entry(DirEntry),
    /// The current directory has no more entries. It is still current
    /// (for what is done after its entries, such as its metadata); the
    /// next call of [`Walk::step`] leaves it, or [`Walk::leave`] does.
    End,
}

/// A walk down a tree (see the module docs): entries in directory order,
/// each directory's entries before its [`Step::End`].
pub struct Walk<'a> {
    chain: Chain<'a>,
    /// Per level, the top's included, the entries still to visit.
    pending: Vec<Pending>,
    /// Whether the current directory's `End` was given.
    ended: bool,
    /// The top's mount, which the walk never leaves.
    mount: Option<u64>,
    /// Levels below the top at most, if bounded.
    max_depth: Option<usize>,
}

impl<'a> Walk<'a> {
    /// A walk of the directory open as `top`, at most `max_depth` levels
    /// deep (deeper is a [`too_deep`] error from [`Walk::enter`]).
    pub fn new(top: BorrowedFd<'a>, max_depth: Option<usize>) -> io::Result<Walk<'a>> {
        let mount = sys::mount_id(top)?;
        let entries = Pending::read(top)?;
        Ok(Walk {
            chain: Chain::new(top),
            pending: vec![entries],
            ended: false,
            mount,
            max_depth,
        })
    }

    /// The next step, or `None` once the top's `End` was given.
    pub fn step(&mut self) -> io::Result<Option<Step>> {
        if self.ended {
            if self.chain.depth() == 0 {
                return Ok(None);
            }
            self.leave()?;
        }
        let dir = self.chain.dir();
        let next = match self.pending.last_mut() {
            Some(p) => p.next(dir)?,
            None => None,
        };
        match next {
            Some(entry) => Ok(Some(Step::Entry(entry))),
            None => {
                self.ended = true;
                Ok(Some(Step::End))
            }
        }
    }

    /// Enters the directory `name` of the current one: it becomes current,
    /// its entries next. Refuses a directory on another mount
    /// ([`crosses_mount`]) and one past the depth limit ([`too_deep`]);
    /// `ENOTDIR` for anything but a directory, never following a symlink.
    pub fn enter(&mut self, name: &OsStr) -> io::Result<()> {
        let fd = sys::open_dir_at(self.chain.dir(), name)?;
        self.enter_opened(name, fd)
    }

    /// [`Walk::enter`] for the directory `name` of the current one that the
    /// caller opened already, as `fd`.
    pub fn enter_opened(&mut self, name: &OsStr, fd: OwnedFd) -> io::Result<()> {
        if let Some(limit) = self.max_depth
            && self.chain.depth() >= limit
        {
            return Err(too_deep(limit));
        }
        let crosses = match self.mount {
            Some(_) => sys::mount_id(fd.as_fd())? != self.mount,
            // No mount ids (Linux before 5.8): another device that is no
            // btrfs subvolume root is another filesystem.
            None => {
                sys::stat(fd.as_fd())?.dev != sys::stat(self.chain.dir())?.dev
                    && !sys::is_subvolume(fd.as_fd())?
            }
        };
        if crosses {
            return Err(crosses_mount(self.chain.path().join(name)));
        }
        let entries = Pending::read(fd.as_fd())?;
        self.chain.push(name, fd)?;
        self.pending.push(entries);
        self.ended = false;
        Ok(())
    }

    /// Leaves the current directory for the one above, skipping whatever
    /// of it was not visited yet; returns its name (`None` at the top).
    pub fn leave(&mut self) -> io::Result<Option<OsString>> {
        let name = self.chain.pop()?;
        if name.is_some() {
            self.pending.pop();
            // The directory above had given an entry, not its end.
            self.ended = false;
        }
        Ok(name)
    }

    /// The current directory.
    pub fn dir(&self) -> BorrowedFd<'_> {
        self.chain.dir()
    }

    /// Levels below the top (0 at the top).
    pub fn depth(&self) -> usize {
        self.chain.depth()
    }

    /// The current directory's path from the top, for messages.
    pub fn path(&self) -> PathBuf {
        self.chain.path()
    }

    /// The top's mount id: a file of the tree opened by the caller is on
    /// another mount if its `sys::mount_id` differs (`None` where the
    /// kernel gives none: before Linux 5.8).
    pub fn mount(&self) -> Option<u64> {
        self.mount
    }

    /// The type of `entry`, from its directory entry or, where that does
    /// not say, from `lstat` (`None` if it vanished).
    pub fn entry_type(&self, entry: &DirEntry) -> io::Result<Option<FileType>> {
        entry_type(self.dir(), &entry.name, entry.file_type)
    }
}

/// One level's entries still to visit: the rest of a batch, and where the
/// next batch starts.
struct Pending {
    /// The batch, last first (so that `Vec::pop` gives directory order).
    batch: Vec<DirEntry>,
    /// Where the directory goes on after the batch; `None`: it ends there.
    more: Option<sys::DirPos>,
}

impl Pending {
    /// The first batch of the directory open as `fd`.
    fn read(fd: BorrowedFd<'_>) -> io::Result<Pending> {
        let mut p = Pending {
            batch: Vec::new(),
            more: Some(sys::DirPos::Start),
        };
        p.refill(fd)?;
        Ok(p)
    }

    /// The next entry of the directory open as `fd` (the one this level
    /// lists), reading its next batch when this one is used up.
    fn next(&mut self, fd: BorrowedFd<'_>) -> io::Result<Option<DirEntry>> {
        if self.batch.is_empty() {
            self.refill(fd)?;
        }
        Ok(self.batch.pop())
    }

    fn refill(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        let Some(from) = self.more else {
            return Ok(());
        };
        let (names, more) = sys::read_dir_batch(fd, from, BATCH)?;
        self.more = more;
        self.batch.clear();
        self.batch.extend(
            names
                .into_iter()
                .rev()
                .map(|(name, file_type, ino)| DirEntry {
                    name,
                    file_type,
                    ino,
                }),
        );
        Ok(())
    }
}

/// Calls `file(parent_dir, inode)` for every regular file below `dir`,
/// depth first, never across a mount, through one [`Walk`]: iterative and
/// within [`FD_BUDGET`] descriptors at any depth. No depth limit: a
/// volume's usage and extent count must work on any tree its package made
/// (a copy refuses one deeper than its own bound itself). Returns
/// `Visit::Stop` if the callback stopped it. Reads only: a crash leaves
/// nothing behind.
pub fn walk_files(
    dir: BorrowedFd<'_>,
    file: &mut dyn FnMut(BorrowedFd<'_>, u64) -> io::Result<Visit>,
) -> io::Result<Visit> {
    let mut walk = Walk::new(dir, None)?;
    while let Some(step) = walk.step()? {
        let Step::Entry(entry) = step else {
            continue;
        };
        match walk.entry_type(&entry)? {
            Some(FileType::Directory) => walk.enter(&entry.name)?,
            Some(FileType::RegularFile) if file(walk.dir(), entry.ino)? == Visit::Stop => {
                return Ok(Visit::Stop);
            }
            _ => {}
        }
    }
    Ok(Visit::Continue)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A directory of several batches, whose descriptor the walk closes
    /// while it is deep below it (past [`FD_BUDGET`]) and reopens through
    /// `..`, and which changes meanwhile: every name that stayed is
    /// visited exactly once, the deep chain whole, no name twice.
    #[test]
    fn a_wide_directory_is_walked_in_batches_across_a_reopen_and_a_change() {
        let fs = test_fs::fs_or_skip!(test_fs::LoopFs::btrfs(256 << 20));
        let wide = fs.path("top/wide");
        std::fs::create_dir_all(&wide).unwrap();
        let files = 2 * BATCH + 500;
        for i in 0..files {
            if i == BATCH + 10 {
                let mut d = wide.join("deep");
                for _ in 0..FD_BUDGET + 4 {
                    std::fs::create_dir(&d).unwrap();
                    std::fs::write(d.join("x"), b"x").unwrap();
                    d = d.join("d");
                }
            }
            std::fs::write(wide.join(format!("f{i:05}")), b"").unwrap();
        }
        let top = std::fs::File::open(fs.path("top")).unwrap();
        let mut walk = Walk::new(top.as_fd(), None).unwrap();
        let mut seen: HashMap<(usize, OsString), u32> = HashMap::new();
        let mut changed = false;
        while let Some(step) = walk.step().unwrap() {
            let Step::Entry(entry) = step else { continue };
            *seen.entry((walk.depth(), entry.name.clone())).or_default() += 1;
            if walk.entry_type(&entry).unwrap() == Some(FileType::Directory) {
                walk.enter(&entry.name).unwrap();
            }
            if walk.depth() == FD_BUDGET + 5 && !changed {
                changed = true;
                for i in files - 100..files {
                    std::fs::remove_file(wide.join(format!("f{i:05}"))).unwrap();
                }
                for i in 0..100 {
                    std::fs::write(wide.join(format!("g{i:05}")), b"").unwrap();
                }
            }
        }
        assert!(changed, "the walk went {} deep", FD_BUDGET + 5);
        assert!(seen.values().all(|&n| n == 1), "a name came twice");
        for i in 0..files - 100 {
            let name = OsString::from(format!("f{i:05}"));
            assert!(seen.contains_key(&(1, name)), "f{i:05} was not visited");
        }
        for depth in 2..FD_BUDGET + 6 {
            assert!(
                seen.contains_key(&(depth, OsString::from("x"))),
                "depth {depth}"
            );
        }
    }
}
