//! What the kernel says under `/proc`: the mount namespaces and their
//! tables, the holders of a lock, the path of an open file. Read-only, and
//! each function is one step for the I/O-error sweep ([`super::fault`]),
//! however many files it reads.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStrExt;

use super::fs::{major_minor, stat};

/// One mount namespace with a process in it.
#[derive(Debug, Clone)]
pub(crate) struct MountNamespace {
    /// Its inode number (`/proc/<pid>/ns/mnt`).
    pub id: u64,
    /// Every process in it, sorted.
    pub pids: Vec<u32>,
    /// Its mount table, read through `reader`'s `mountinfo`: raw bytes, as
    /// a mount point's name need not be UTF-8.
    pub mountinfo: Vec<u8>,
    /// The process of `pids` the table was read through (the lowest that
    /// could be read), the one messages name.
    pub reader: u32,
    /// `reader`'s root directory, stat'ed just before its table was read:
    /// the table names each mount point by its path from that root.
    /// `None` if the stat failed though the table could be read (a FUSE
    /// root that a user namespace mounted answers root EACCES).
    pub root: Option<DirId>,
}

/// A directory by what a stat of it gives, device and inode: the same pair
/// is the same directory, whatever path or mount namespace reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DirId {
    /// The device it lives on.
    pub dev: u64,
    /// Its inode number.
    pub ino: u64,
}

/// This process's own mount table, and what it is relative to.
#[derive(Debug, Clone)]
pub(crate) struct OwnMountTable {
    /// Its mount namespace, by inode number (`/proc/self/ns/mnt`).
    pub namespace: u64,
    /// Its root directory, which the table's mount points are paths from.
    pub root: DirId,
    /// The table, raw bytes: a mount point's name need not be UTF-8.
    pub mountinfo: Vec<u8>,
}

/// Whether `e` says the process can be passed over: it went away while
/// being read (a process that has just exited, a zombie, answers EINVAL
/// for its mountinfo), or even root may not inspect it (a process of a
/// user namespace above ours, such as a sandbox's own init; on a StartOS
/// box root may inspect every process).
fn passed_over(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(
            e.raw_os_error(),
            Some(libc::ESRCH | libc::EINVAL | libc::EACCES | libc::EPERM)
        )
}

/// This process's mount namespace, root directory and mount table.
pub(crate) fn own_mount_table() -> io::Result<OwnMountTable> {
    super::fault::check("read /proc/self/mountinfo")?;
    let namespace = namespace_at("/proc/self/ns/mnt")?;
    let root = dir_id("/proc/self/root")?;
    let mut mountinfo = Vec::with_capacity(MOUNTINFO_CAPACITY);
    read_whole("/proc/self/mountinfo", &mut mountinfo)?;
    Ok(OwnMountTable {
        namespace,
        root,
        mountinfo,
    })
}

/// The directory at `path`, a symlink followed: `/proc/<pid>/root` is one
/// the kernel resolves to that process's root in its own mount namespace,
/// however far from ours. The filesystem is asked nothing
/// (`AT_STATX_DONT_SYNC`: what the kernel has cached), so a root a package
/// serves itself (FUSE) cannot make the read of every table wait on it.
fn dir_id(path: &str) -> io::Result<DirId> {
    use rustix::fs::{AtFlags, CWD, StatxFlags, makedev, statx};
    let flags = AtFlags::STATX_DONT_SYNC | AtFlags::NO_AUTOMOUNT;
    let st = statx(CWD, path, flags, StatxFlags::INO)?;
    Ok(DirId {
        dev: makedev(st.stx_dev_major, st.stx_dev_minor),
        ino: st.stx_ino,
    })
}

/// Process `pid`'s root directory (see [`MountNamespace::root`]), `None`
/// whatever the reason it cannot be stat'ed: whether the process is gone
/// is for the read of its table to say, which the kernel answers without
/// asking the root's filesystem (and so without the package that may
/// serve it).
fn root_of(pid: u32) -> Option<DirId> {
    dir_id(&format!("/proc/{pid}/root")).ok()
}

/// Every mount namespace on the machine that has a process in it, by
/// inode, each with its processes, its mount table and the root directory
/// of the process it was read through. A process that
/// exits while being read, or that root may not inspect, is passed over
/// ([`passed_over`]); anything else that cannot be read is an error, never
/// a namespace quietly left out. A namespace kept alive with no process in
/// it (by a bind-mounted or open `nsfs` file) is not seen: nothing in it
/// can write either.
pub(crate) fn mount_namespaces() -> io::Result<Vec<MountNamespace>> {
    super::fault::check("read /proc/*/mountinfo")?;
    let mut pids_by_ns: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        match namespace_of(pid) {
            Ok(id) => pids_by_ns.entry(id).or_default().push(pid),
            Err(e) if passed_over(&e) => {}
            Err(e) => return Err(e),
        }
    }
    let mut out = Vec::new();
    // One buffer for every table: each is read whole into it, then copied
    // out at its own length.
    let mut buf = Vec::with_capacity(MOUNTINFO_CAPACITY);
    for (id, mut pids) in pids_by_ns {
        pids.sort_unstable();
        for &pid in &pids {
            // The root before the table: a process that exits in between
            // fails the table's read and is passed over, as any process
            // gone before its table was read.
            let root = root_of(pid);
            match read_whole(&format!("/proc/{pid}/mountinfo"), &mut buf) {
                Ok(()) => {
                    out.push(MountNamespace {
                        id,
                        mountinfo: buf.clone(),
                        pids,
                        reader: pid,
                        root,
                    });
                    break;
                }
                Err(e) if passed_over(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// Bytes a mount table read starts with room for: a container's table of
/// a few dozen mounts fits, so the kernel formats it in one `read`
/// (`std::fs::read` sizes its buffer from the file's size, which proc
/// gives as 0, and starts with 32-byte reads).
const MOUNTINFO_CAPACITY: usize = 16 * 1024;

/// Reads the file at `path` to its end into `buf` (emptied first).
fn read_whole(path: &str, buf: &mut Vec<u8>) -> io::Result<()> {
    use std::io::Read;
    buf.clear();
    std::fs::File::open(path)?.read_to_end(buf)?;
    Ok(())
}

/// The mount namespace of process `pid`, by its inode number, from the
/// text of its `ns/mnt` link (`mnt:[4026531841]`): a `readlink` costs
/// about half the `stat` that follows the link to the namespace's inode,
/// and the kernel writes that inode's number into the link.
fn namespace_of(pid: u32) -> io::Result<u64> {
    namespace_at(&format!("/proc/{pid}/ns/mnt"))
}

/// The mount namespace a `ns/mnt` link at `path` names (see
/// [`namespace_of`]).
fn namespace_at(path: &str) -> io::Result<u64> {
    let link = std::fs::read_link(path)?;
    parse_namespace_link(link.as_os_str().as_bytes()).ok_or_else(|| {
        io::Error::other(format!("{path}: not a mount namespace: {}", link.display()))
    })
}

/// The inode number in a mount namespace link's text, `mnt:[N]`.
fn parse_namespace_link(text: &[u8]) -> Option<u64> {
    let digits = text.strip_prefix(b"mnt:[")?.strip_suffix(b"]")?;
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Process `pid`'s command name (`comm`), empty if it cannot be read (it
/// exited, say): only ever shown in messages, so read only for a
/// namespace a message names, not for every namespace of a read.
pub(crate) fn command_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_default()
}

/// How many descriptors this process has open, from `/proc/self/fd` (the
/// one the count reads through not counted).
pub fn open_descriptors() -> io::Result<usize> {
    super::fault::check("read /proc/self/fd")?;
    let mut n = 0usize;
    for entry in std::fs::read_dir("/proc/self/fd")? {
        entry?;
        n += 1;
    }
    // The directory's own descriptor is one of the entries while it is read.
    Ok(n.saturating_sub(1))
}

/// The processes holding a flock on the file open as `fd`, from
/// `/proc/locks` (the process that took each lock; its children may hold
/// it too). Empty if none, or if the kernel does not say.
pub(crate) fn flock_holders(fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let st = stat(fd)?;
    super::fault::check("read /proc/locks")?;
    let text = std::fs::read_to_string("/proc/locks")?;
    Ok(parse_flock_holders(&text, major_minor(st.dev), st.ino))
}

/// The pids of `/proc/locks` lines that are flocks on inode `ino` of the
/// device (major, minor): lines like `1: FLOCK  ADVISORY  WRITE 4242
/// fe:00:1234 0 EOF`, the device in hex, the inode in decimal.
pub(crate) fn parse_flock_holders(text: &str, (major, minor): (u32, u32), ino: u64) -> Vec<u32> {
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace().skip(1);
            if words.next()? != "FLOCK" {
                return None;
            }
            let pid = words.nth(2)?.parse().ok()?;
            (words.next()? == want).then_some(pid)
        })
        .collect()
}

/// The path the kernel gives the open file `fd` (`/proc/self/fd/N`), for
/// messages and for looking the file up in the mount table. Not a handle:
/// what the path names can change after the call.
pub fn fd_path(fd: BorrowedFd<'_>) -> io::Result<std::path::PathBuf> {
    use std::os::fd::AsRawFd;
    super::fault::check("readlink")?;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flock_holders_are_found_by_device_and_inode() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 fe:00:1234 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 77 fe:00:1234 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 99 fe:00:12345 0 EOF\n\
                     4: FLOCK  ADVISORY  WRITE 5 103:1f:1234 0 EOF\n\
                     5: -> FLOCK  ADVISORY  WRITE 6 fe:00:1234 0 EOF\n";
        assert_eq!(parse_flock_holders(locks, (254, 0), 1234), [4242]);
        assert_eq!(parse_flock_holders(locks, (259, 31), 1234), [5]);
        assert!(parse_flock_holders("garbage\n", (254, 0), 1234).is_empty());
    }

    #[test]
    fn a_namespace_link_names_the_inode_stat_finds() {
        use std::os::unix::fs::MetadataExt;
        // What the kernel writes, against what a stat through the link
        // finds, for this process and every other one there is.
        let own = std::fs::metadata("/proc/self/ns/mnt").unwrap().ino();
        assert_eq!(namespace_at("/proc/self/ns/mnt").unwrap(), own);
        let mut checked = 0;
        for entry in std::fs::read_dir("/proc").unwrap() {
            let name = entry.unwrap().file_name();
            let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let (Ok(linked), Ok(m)) = (
                namespace_of(pid),
                std::fs::metadata(format!("/proc/{pid}/ns/mnt")),
            ) else {
                continue;
            };
            assert_eq!(linked, m.ino(), "pid {pid}");
            checked += 1;
        }
        assert!(checked > 1, "{checked}");
        assert_eq!(parse_namespace_link(b"mnt:[4026531841]"), Some(4026531841));
        for bad in [&b"net:[4026531841]"[..], b"mnt:[]", b"mnt:[12", b"mnt:[x1]"] {
            assert_eq!(parse_namespace_link(bad), None);
        }
    }

    /// A process's root, followed through `/proc`, is the directory a stat
    /// of `/` finds in that process; a process that is gone has none.
    #[test]
    fn a_root_is_the_directory_its_process_sees_as_slash() {
        use std::os::unix::fs::MetadataExt;
        let slash = std::fs::metadata("/").unwrap();
        let slash = DirId {
            dev: slash.dev(),
            ino: slash.ino(),
        };
        assert_eq!(own_mount_table().unwrap().root, slash);
        assert_eq!(root_of(std::process::id()), Some(slash));
        assert_eq!(root_of(u32::MAX), None);
    }

    #[test]
    fn a_table_is_read_whole_past_the_first_capacity() {
        // A proc file, which gives its size as 0 (this process's command
        // line: unlike its mount table, no other test thread changes it).
        let mut buf = Vec::new();
        read_whole("/proc/self/cmdline", &mut buf).unwrap();
        assert!(!buf.is_empty());
        assert_eq!(buf, std::fs::read("/proc/self/cmdline").unwrap());
        // A file longer than the buffer's room grows it.
        let dir = std::env::temp_dir().join(format!("proc-read-whole-{}", std::process::id()));
        let long: Vec<u8> = (0..MOUNTINFO_CAPACITY * 3).map(|i| i as u8).collect();
        std::fs::write(&dir, &long).unwrap();
        let mut buf = Vec::with_capacity(MOUNTINFO_CAPACITY);
        buf.extend_from_slice(b"left over");
        read_whole(dir.to_str().unwrap(), &mut buf).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(buf, long);
    }

    #[test]
    fn open_descriptors_counts_what_this_process_opens() {
        let before = open_descriptors().unwrap();
        let files: Vec<std::fs::File> = (0..5)
            .map(|_| std::fs::File::open("/proc/self/stat").unwrap())
            .collect();
        // Other test threads open and close files meanwhile: retried.
        let during = (0..50)
            .map(|_| open_descriptors().unwrap())
            .find(|n| *n == before + files.len());
        assert_eq!(during, Some(before + files.len()), "before {before}");
    }
}
