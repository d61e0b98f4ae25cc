//! Content-and-metadata digests of directory trees, to compare a volume before and
//! after a snapshot, rollback, conversion or crash.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fmt::{self, Write as _};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// `BTRFS_FIRST_FREE_OBJECTID`: the inode number of every subvolume's root directory.
const BTRFS_SUBVOL_ROOT_INO: u64 = 256;
/// `BTRFS_EMPTY_SUBVOL_DIR_OBJECTID`: the inode of the empty directory that stands in
/// for a nested subvolume inside a snapshot.
const BTRFS_EMPTY_SUBVOL_DIR_INO: u64 = 2;
const BTRFS_SUPER_MAGIC: u32 = 0x9123_683E;

/// What kind of file an entry is, with the content that matters for that kind.
#[derive(Clone, PartialEq, Eq)]
pub enum Kind {
    /// A regular file: its size and the lowercase hex SHA-256 of its content.
    File {
        /// Size in bytes.
        size: u64,
        /// Lowercase hex SHA-256 of the content.
        sha256: String,
    },
    /// A directory. Its size and link count are left out: they are filesystem
    /// bookkeeping (ext4 counts blocks, btrfs name bytes) rather than content.
    Dir,
    /// A symbolic link and its target, byte for byte.
    Symlink {
        /// The target as stored, not resolved.
        target: Vec<u8>,
    },
    /// A block device node.
    BlockDevice {
        /// The device number (`st_rdev`).
        rdev: u64,
    },
    /// A character device node.
    CharDevice {
        /// The device number (`st_rdev`).
        rdev: u64,
    },
    /// A named pipe. Never opened.
    Fifo,
    /// A unix socket. Never opened.
    Socket,
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kind::File { size, sha256 } => write!(f, "file size={size} sha256={sha256}"),
            Kind::Dir => f.write_str("dir"),
            Kind::Symlink { target } => write!(f, "symlink -> \"{}\"", target.escape_ascii()),
            Kind::BlockDevice { rdev } => write!(f, "block device {rdev:#x}"),
            Kind::CharDevice { rdev } => write!(f, "char device {rdev:#x}"),
            Kind::Fifo => f.write_str("fifo"),
            Kind::Socket => f.write_str("socket"),
        }
    }
}

/// Whether a directory is special to btrfs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subvolume {
    /// Anything that is not one of the cases below, including everything off btrfs.
    No,
    /// The root directory of a subvolume (inode 256), e.g. a nested subvolume that a
    /// package created inside its volume. Walked like any directory.
    Root,
    /// The empty stand-in (inode 2) that a snapshot shows where the source had a
    /// nested subvolume: snapshots do not recurse into nested subvolumes.
    Placeholder,
}

/// A modification time, to the nanosecond.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    /// Seconds since the epoch.
    pub sec: i64,
    /// Nanoseconds within the second.
    pub nsec: i64,
}

/// Everything [`tree_digest`] records about one path.
#[derive(Clone, PartialEq, Eq)]
pub struct Entry {
    /// Type, and content for the types that have any.
    pub kind: Kind,
    /// Permission bits, including setuid, setgid and sticky (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time; `None` once cleared by [`TreeDigest::ignore_mtimes`] or
    /// [`TreeDigest::ignore_dir_mtimes`].
    pub mtime: Option<Timestamp>,
    /// Hard link count, counting links outside the tree too; 0 for directories.
    pub nlink: u64,
    /// For a non-directory with more than one link: the first path (in byte order) in
    /// this tree that is the same inode. Equal groups in two digests mean the same
    /// hard link structure, whatever the inode numbers.
    pub hardlink_group: Option<Vec<u8>>,
    /// Extended attributes as `llistxattr`/`lgetxattr` report them (whatever this
    /// process may see: all namespaces for root).
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Whether this directory is a btrfs subvolume root or placeholder.
    pub subvolume: Subvolume,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} mode={:04o} owner={}:{}",
            self.kind, self.mode, self.uid, self.gid
        )?;
        if let Some(t) = self.mtime {
            write!(f, " mtime={}.{:09}", t.sec, t.nsec)?;
        }
        if self.nlink > 1 {
            write!(f, " nlink={}", self.nlink)?;
        }
        if let Some(group) = &self.hardlink_group {
            write!(f, " hardlink_group=\"{}\"", group.escape_ascii())?;
        }
        if self.subvolume != Subvolume::No {
            write!(f, " subvolume={:?}", self.subvolume)?;
        }
        for (name, value) in &self.xattrs {
            write!(
                f,
                " xattr[{}]=\"{}\"",
                name.escape_ascii(),
                value.escape_ascii()
            )?;
        }
        Ok(())
    }
}

/// A sorted map from relative path (raw bytes, `/`-separated, `""` for the root
/// itself) to what [`tree_digest`] recorded there.
///
/// Two digests compare equal when the trees have the same names, types, contents and
/// metadata; [`TreeDigest::diff`] says how they differ.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct TreeDigest {
    entries: BTreeMap<Vec<u8>, Entry>,
}

impl TreeDigest {
    /// All entries, by relative path.
    pub fn entries(&self) -> &BTreeMap<Vec<u8>, Entry> {
        &self.entries
    }

    /// All entries, for a test to adjust what it expects.
    pub fn entries_mut(&mut self) -> &mut BTreeMap<Vec<u8>, Entry> {
        &mut self.entries
    }

    /// The entry at `relative` (`""` for the root).
    pub fn get(&self, relative: impl AsRef<OsStr>) -> Option<&Entry> {
        self.entries.get(relative.as_ref().as_bytes())
    }

    /// Number of entries, the root included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the digest has no entries at all (never the case for a walked tree).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops `relative` and everything below it, e.g. `lost+found` on ext4.
    pub fn without(mut self, relative: impl AsRef<OsStr>) -> Self {
        let gone = relative.as_ref().as_bytes();
        self.entries.retain(|path, _| {
            !(path == gone || (path.starts_with(gone) && path.get(gone.len()) == Some(&b'/')))
        });
        self
    }

    /// Clears every modification time.
    pub fn ignore_mtimes(mut self) -> Self {
        self.entries.values_mut().for_each(|e| e.mtime = None);
        self
    }

    /// Clears directory modification times, which change whenever an entry is added
    /// or removed, even if it is put back the same.
    pub fn ignore_dir_mtimes(mut self) -> Self {
        self.entries
            .values_mut()
            .filter(|e| e.kind == Kind::Dir)
            .for_each(|e| e.mtime = None);
        self
    }

    /// Human-readable differences from `self` (left) to `other` (right), one line
    /// per path and field, in path order. Empty when the digests are equal.
    pub fn diff(&self, other: &TreeDigest) -> Vec<String> {
        let mut out = Vec::new();
        let mut left = self.entries.iter().peekable();
        let mut right = other.entries.iter().peekable();
        loop {
            match (left.peek(), right.peek()) {
                (None, None) => break,
                (Some((path, entry)), None) => {
                    out.push(format!("{}: only in left ({entry:?})", show(path)));
                    left.next();
                }
                (None, Some((path, entry))) => {
                    out.push(format!("{}: only in right ({entry:?})", show(path)));
                    right.next();
                }
                (Some((lp, le)), Some((rp, re))) => match lp.cmp(rp) {
                    std::cmp::Ordering::Less => {
                        out.push(format!("{}: only in left ({le:?})", show(lp)));
                        left.next();
                    }
                    std::cmp::Ordering::Greater => {
                        out.push(format!("{}: only in right ({re:?})", show(rp)));
                        right.next();
                    }
                    std::cmp::Ordering::Equal => {
                        diff_entry(&show(lp), le, re, &mut out);
                        left.next();
                        right.next();
                    }
                },
            }
        }
        out
    }
}

fn show(path: &[u8]) -> String {
    if path.is_empty() {
        "<root>".to_owned()
    } else {
        path.escape_ascii().to_string()
    }
}

fn diff_entry(path: &str, l: &Entry, r: &Entry, out: &mut Vec<String>) {
    let mut field = |name: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{path}: {name} {a} -> {b}"));
        }
    };
    match (&l.kind, &r.kind) {
        (
            Kind::File {
                size: ls,
                sha256: lh,
            },
            Kind::File {
                size: rs,
                sha256: rh,
            },
        ) => {
            field("size", ls.to_string(), rs.to_string());
            field("sha256", lh.clone(), rh.clone());
        }
        (a, b) => field("kind", format!("{a:?}"), format!("{b:?}")),
    }
    field("mode", format!("{:04o}", l.mode), format!("{:04o}", r.mode));
    field("uid", l.uid.to_string(), r.uid.to_string());
    field("gid", l.gid.to_string(), r.gid.to_string());
    let time =
        |t: Option<Timestamp>| t.map_or("-".to_owned(), |t| format!("{}.{:09}", t.sec, t.nsec));
    field("mtime", time(l.mtime), time(r.mtime));
    field("nlink", l.nlink.to_string(), r.nlink.to_string());
    let group = |g: &Option<Vec<u8>>| g.as_deref().map_or("-".to_owned(), show);
    field(
        "hardlink_group",
        group(&l.hardlink_group),
        group(&r.hardlink_group),
    );
    field(
        "subvolume",
        format!("{:?}", l.subvolume),
        format!("{:?}", r.subvolume),
    );
    let value = |v: Option<&Vec<u8>>| {
        v.map_or("<absent>".to_owned(), |v| {
            format!("\"{}\"", v.escape_ascii())
        })
    };
    let names: std::collections::BTreeSet<&Vec<u8>> =
        l.xattrs.keys().chain(r.xattrs.keys()).collect();
    for name in names {
        field(
            &format!("xattr {}", name.escape_ascii()),
            value(l.xattrs.get(name)),
            value(r.xattrs.get(name)),
        );
    }
}

impl fmt::Debug for TreeDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TreeDigest {\n")?;
        for (path, entry) in &self.entries {
            writeln!(f, "    {}: {entry:?}", show(path))?;
        }
        f.write_str("}")
    }
}

/// Walks the tree at `root` and records every entry's type, content and metadata.
///
/// Symlinks are recorded, never followed; FIFOs, sockets and device nodes are never
/// opened. Nested btrfs subvolumes are walked like directories and flagged. Mount
/// points below `root` are not detected: keep them out of digested trees.
pub fn tree_digest(root: &Path) -> io::Result<TreeDigest> {
    let mut entries = BTreeMap::new();
    let mut inodes: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    let mut linked = Vec::new();
    let mut stack: Vec<(PathBuf, Vec<u8>)> = vec![(root.to_path_buf(), Vec::new())];
    while let Some((abs, rel)) = stack.pop() {
        let meta = fs::symlink_metadata(&abs).map_err(|err| at(&abs, err))?;
        let entry = describe(&abs, &meta).map_err(|err| at(&abs, err))?;
        if meta.is_dir() {
            for child in fs::read_dir(&abs).map_err(|err| at(&abs, err))? {
                let name = child.map_err(|err| at(&abs, err))?.file_name();
                let mut child_rel = rel.clone();
                if !child_rel.is_empty() {
                    child_rel.push(b'/');
                }
                child_rel.extend_from_slice(name.as_bytes());
                stack.push((abs.join(&name), child_rel));
            }
        } else if meta.nlink() > 1 {
            // Keep the smallest path per inode, so the group name does not depend on
            // the order readdir happened to return names in.
            let first = inodes
                .entry((meta.dev(), meta.ino()))
                .or_insert_with(|| rel.clone());
            if rel < *first {
                *first = rel.clone();
            }
            linked.push((rel.clone(), (meta.dev(), meta.ino())));
        }
        entries.insert(rel, entry);
    }
    for (rel, inode) in linked {
        if let (Some(entry), Some(first)) = (entries.get_mut(&rel), inodes.get(&inode)) {
            entry.hardlink_group = Some(first.clone());
        }
    }
    Ok(TreeDigest { entries })
}

fn at(path: &Path, err: io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("{}: {err}", path.display()))
}

fn describe(path: &Path, meta: &Metadata) -> io::Result<Entry> {
    let ft = meta.file_type();
    let kind = if ft.is_file() {
        Kind::File {
            size: meta.len(),
            sha256: sha256_file(path)?,
        }
    } else if ft.is_dir() {
        Kind::Dir
    } else if ft.is_symlink() {
        Kind::Symlink {
            target: fs::read_link(path)?.into_os_string().into_encoded_bytes(),
        }
    } else if ft.is_block_device() {
        Kind::BlockDevice { rdev: meta.rdev() }
    } else if ft.is_char_device() {
        Kind::CharDevice { rdev: meta.rdev() }
    } else if ft.is_fifo() {
        Kind::Fifo
    } else {
        Kind::Socket
    };
    let subvolume = match (ft.is_dir(), meta.ino()) {
        (true, BTRFS_SUBVOL_ROOT_INO) if on_btrfs(path)? => Subvolume::Root,
        (true, BTRFS_EMPTY_SUBVOL_DIR_INO) if on_btrfs(path)? => Subvolume::Placeholder,
        _ => Subvolume::No,
    };
    Ok(Entry {
        kind,
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime: Some(Timestamp {
            sec: meta.mtime(),
            nsec: meta.mtime_nsec(),
        }),
        nlink: if ft.is_dir() { 0 } else { meta.nlink() },
        hardlink_group: None,
        xattrs: xattrs(path)?,
        subvolume,
    })
}

/// Inode numbers 2 and 256 mean something only on btrfs (on ext4, 2 is the root).
fn on_btrfs(path: &Path) -> io::Result<bool> {
    let stat = rustix::fs::statfs(path)?;
    // f_type is signed on some targets and magic numbers are 32-bit patterns, so
    // compare the low 32 bits rather than risk a sign extension.
    let magic = stat.f_type as u32;
    Ok(magic == BTRFS_SUPER_MAGIC)
}

/// Reads all extended attributes of `path` itself (not a symlink's target).
fn xattrs(path: &Path) -> io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let names = match read_sized(|buf| {
        if buf.is_empty() {
            rustix::fs::llistxattr_query(path)
        } else {
            rustix::fs::llistxattr(path, buf)
        }
    }) {
        Ok(names) => names,
        Err(err) if err.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(out),
        Err(err) => return Err(err),
    };
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name_os = OsStr::from_bytes(name);
        let value = match read_sized(|buf| {
            if buf.is_empty() {
                rustix::fs::lgetxattr_query(path, name_os)
            } else {
                rustix::fs::lgetxattr(path, name_os, buf)
            }
        }) {
            Ok(value) => value,
            // Removed between list and get.
            Err(err) if err.raw_os_error() == Some(libc::ENODATA) => continue,
            Err(err) => return Err(err),
        };
        out.insert(name.to_vec(), value);
    }
    Ok(out)
}

/// Runs a size-query-then-fetch xattr call (`call(&mut [])` asks for the size),
/// retrying when the value grew in between (ERANGE).
fn read_sized(mut call: impl FnMut(&mut [u8]) -> rustix::io::Result<usize>) -> io::Result<Vec<u8>> {
    loop {
        let size = call(&mut [])?;
        if size == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; size];
        match call(&mut buf) {
            Ok(len) => {
                buf.truncate(len);
                return Ok(buf);
            }
            Err(rustix::io::Errno::RANGE) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// Lowercase hex SHA-256 of the content of the regular file at `path`.
///
/// Refuses to follow a symlink at `path` itself (`O_NOFOLLOW`), and opens without
/// blocking so that a FIFO put there by mistake cannot hang the caller.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        }
    }
    let mut hex = String::with_capacity(64);
    for byte in hasher.finalize() {
        let _ = write!(hex, "{byte:02x}");
    }
    Ok(hex)
}
