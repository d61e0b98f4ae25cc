//! Hostile trees of random shape, generated from a seed and built through
//! directory descriptors.
//!
//! A package writes what it likes inside its volume: [`Tree::generate`]
//! plans such a tree from a seed (its own xorshift generator, so a seed
//! names the same tree on every machine and every run), and [`Tree::build`]
//! makes it below an existing directory, one name at a time relative to an
//! open directory, never through a path: the trees go far beyond PATH_MAX.
//! What a tree may hold, each drawn at random per seed ([`Params`]):
//!
//! - directories of breadth 0 to 5 to a random depth; a spine of
//!   directories with 240-255-byte names (paths past 32 KiB); a chain of
//!   one-byte names up to 20,000 levels deep;
//! - names of 1 to 255 raw bytes: control characters, non-UTF-8 bytes,
//!   never `/` or NUL, never `.` or `..`;
//! - regular files (small random content, some empty, one sparse file
//!   with holes in the middle and at the end, made by ftruncate),
//!   hardlinks (within one subvolume), symlinks (to `/etc`, to `../../..`,
//!   dangling, 1,000-byte targets), FIFOs, sockets, character and block
//!   devices (never opened by anything here);
//! - `user.*` xattrs with values up to 4 KiB on files and directories;
//!   owners above 65535, setuid, setgid and sticky modes, and mtimes before
//!   1970 or far ahead, to the nanosecond;
//! - inode flags: NOCOW (set while a file or directory is still empty),
//!   append-only and immutable (set last, once everything below is made);
//! - nested btrfs subvolumes, some nested in each other, some read-only
//!   (made so after everything inside), some far below long paths or at
//!   the bottom of the chain; in some trees a few hundred of them.
//!
//! Building needs root (devices, flags, owners) and, for subvolumes, btrfs.

use std::collections::{BTreeSet, HashSet};
use std::ffi::OsStr;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, IFlags, Mode, OFlags, Timespec, Timestamps, XattrFlags};

/// A xorshift64* generator: small, fast, and the same sequence everywhere
/// for a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Rng {
        // splitmix64 of the seed: nearby seeds start far apart, and the
        // state is never 0 (xorshift's one fixed point).
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Rng(if z == 0 { 0x2545_F491_4F6C_DD1D } else { z })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 for `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// `usize` in `lo..=hi`.
    pub fn urange(&mut self, lo: usize, hi: usize) -> usize {
        self.range(lo as u64, hi as u64) as usize
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// One element of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// What kind of package volume a tree is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeShape {
    /// `startos-volume create`: the volume is a subvolume.
    Subvolume,
    /// A plain directory, as on a box converted from ext4.
    Plain,
}

/// The shape of one tree, all drawn from its seed.
#[derive(Clone, Debug)]
pub struct Params {
    /// The seed.
    pub seed: u64,
    /// The volume the tree is for.
    pub volume: VolumeShape,
    /// Entries of the random part at most.
    pub max_entries: usize,
    /// Directory levels of the random part at most.
    pub max_depth: usize,
    /// Levels of the spine of 240-255-byte names (0: none).
    pub spine: usize,
    /// Levels of the chain of one-byte names (0: none).
    pub chain: usize,
    /// Whether the chain's bottom holds a subvolume (one level more).
    pub chain_subvolume: bool,
    /// Percent of the random part's directories made subvolumes.
    pub subvolume_percent: u64,
    /// Nested subvolumes of the random part at most.
    pub subvolume_budget: usize,
    /// Subvolumes of the farm, a directory of a few hundred (0: none).
    pub farm: usize,
    /// FIFOs, sockets and devices.
    pub specials: bool,
    /// Append-only, immutable and NOCOW flags.
    pub flags: bool,
    /// A tmpfs to be mounted over a shallow directory (the tree plans an
    /// empty directory for it, [`Tree::mount_point`]).
    pub mount: bool,
}

impl Params {
    /// The parameters of seed `seed`.
    pub fn from_seed(seed: u64) -> Params {
        let mut r = Rng::new(seed ^ 0x005E_ED0F_7EE5);
        let volume = if r.chance(50) {
            VolumeShape::Plain
        } else {
            VolumeShape::Subvolume
        };
        let max_entries = r.urange(40, 1200);
        let max_depth = r.urange(1, 12);
        let spine = match r.below(10) {
            0..=3 => 0,
            4..=6 => r.urange(8, 40),
            _ => r.urange(130, 170),
        };
        let mut chain_subvolume = false;
        let chain = if r.chance(30) {
            match r.below(8) {
                // At the copy's limit of 2,048 levels below the volume's
                // top (the tree's top is `<pkg>/data/main`, 2 levels
                // down), and one past it.
                0 => 2046,
                1 => 2047,
                2 => r.urange(100, 2000),
                3 => r.urange(2049, 19_999),
                _ => {
                    chain_subvolume = r.chance(60);
                    20_000
                }
            }
        } else {
            0
        };
        let (subvolume_percent, subvolume_budget) = if r.chance(70) {
            (r.range(5, 25), r.urange(1, 16))
        } else {
            (0, 0)
        };
        let farm = if r.chance(12) { r.urange(200, 260) } else { 0 };
        Params {
            seed,
            volume,
            max_entries,
            max_depth,
            spine,
            chain,
            chain_subvolume,
            subvolume_percent,
            subvolume_budget,
            farm,
            specials: r.chance(70),
            flags: r.chance(65),
            mount: r.chance(30),
        }
    }
}

/// What a node of the plan is.
#[derive(Clone, Debug)]
enum Kind {
    /// A directory (a subvolume if so, read-only if so).
    Dir { subvolume: bool, read_only: bool },
    /// Directories nested in each other, one per byte of the name list,
    /// each named by its byte; the node's children are at the bottom.
    Chain(Vec<u8>),
    /// A regular file; `sparse`: holes in the middle and at the end.
    File { data: Vec<u8>, sparse: bool },
    /// A hardlink to the file node it names.
    Link(usize),
    /// A symbolic link with this target.
    Symlink(Vec<u8>),
    /// A FIFO, socket or device node.
    Special(FileType, u64),
}

#[derive(Clone, Debug)]
struct Node {
    parent: usize,
    name: Vec<u8>,
    kind: Kind,
    /// Levels below the top (a chain: its bottom).
    depth: usize,
    /// Bytes of the path from the top (a chain: to its bottom).
    path_len: usize,
    /// The node whose subvolume holds this one (0: the top's).
    subvol: usize,
    children: Vec<usize>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    owner: Option<(u32, u32)>,
    mode: Option<u32>,
    mtime: Option<(i64, i64)>,
    /// NOCOW, set while empty.
    nocow: bool,
    /// Immutable and append-only, set last.
    stuck: IFlags,
}

impl Node {
    /// A node with no children and no attributes yet, `at` (depth, path
    /// length) below the top.
    fn new(parent: usize, name: Vec<u8>, kind: Kind, at: (usize, usize), subvol: usize) -> Node {
        Node {
            parent,
            name,
            kind,
            depth: at.0,
            path_len: at.1,
            subvol,
            children: Vec::new(),
            xattrs: Vec::new(),
            owner: None,
            mode: None,
            mtime: None,
            nocow: false,
            stuck: IFlags::empty(),
        }
    }
}

/// Counts of what a tree holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Entries below the top (each level of a chain one).
    pub entries: u64,
    /// Levels of the deepest entry below the top.
    pub max_depth: usize,
    /// Levels of the deepest directory below the top.
    pub max_dir_depth: usize,
    /// Bytes of the longest path from the top.
    pub longest_path: usize,
    /// Nested subvolumes.
    pub subvolumes: u64,
    /// Of those, read-only.
    pub read_only: u64,
    /// Regular files (inodes).
    pub files: u64,
    /// Sparse files.
    pub sparse: u64,
    /// Extra names of files.
    pub hardlinks: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// FIFOs.
    pub fifos: u64,
    /// Socket nodes.
    pub sockets: u64,
    /// Character devices.
    pub char_devices: u64,
    /// Block devices.
    pub block_devices: u64,
    /// Extended attributes.
    pub xattrs: u64,
    /// Files and directories with the immutable flag.
    pub immutable: u64,
    /// With the append-only flag.
    pub append: u64,
    /// With NOCOW.
    pub nocow: u64,
    /// Mounts planned (0 or 1).
    pub mounts: u64,
}

impl Stats {
    /// FIFOs, sockets and devices.
    pub fn specials(&self) -> u64 {
        self.fifos + self.sockets + self.char_devices + self.block_devices
    }

    /// Files and directories with a flag.
    pub fn flagged(&self) -> u64 {
        self.immutable + self.append + self.nocow
    }

    /// Adds `other`'s counts; maxima stay maxima.
    pub fn add(&mut self, other: &Stats) {
        self.entries += other.entries;
        self.max_depth = self.max_depth.max(other.max_depth);
        self.max_dir_depth = self.max_dir_depth.max(other.max_dir_depth);
        self.longest_path = self.longest_path.max(other.longest_path);
        self.subvolumes += other.subvolumes;
        self.read_only += other.read_only;
        self.files += other.files;
        self.sparse += other.sparse;
        self.hardlinks += other.hardlinks;
        self.symlinks += other.symlinks;
        self.fifos += other.fifos;
        self.sockets += other.sockets;
        self.char_devices += other.char_devices;
        self.block_devices += other.block_devices;
        self.xattrs += other.xattrs;
        self.immutable += other.immutable;
        self.append += other.append;
        self.nocow += other.nocow;
        self.mounts += other.mounts;
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entries, max depth {}, longest path {} bytes, {} nested subvolumes ({} read-only), \
             {} specials (fifo {}, socket {}, chr {}, blk {}), {} flags (immutable {}, append {}, \
             nocow {}), {} mounts; {} files ({} sparse), {} hardlinks, {} symlinks, {} xattrs",
            self.entries,
            self.max_depth,
            self.longest_path,
            self.subvolumes,
            self.read_only,
            self.specials(),
            self.fifos,
            self.sockets,
            self.char_devices,
            self.block_devices,
            self.flagged(),
            self.immutable,
            self.append,
            self.nocow,
            self.mounts,
            self.files,
            self.sparse,
            self.hardlinks,
            self.symlinks,
            self.xattrs
        )
    }
}

/// A planned tree: [`Tree::generate`], then [`Tree::build`].
#[derive(Clone, Debug)]
pub struct Tree {
    params: Params,
    nodes: Vec<Node>,
    mount_point: Option<usize>,
    stats: Stats,
}

/// A node of a [`Tree`], for a test to reach it again.
pub type NodeId = usize;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn open_dir(dir: BorrowedFd<'_>, name: &[u8]) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        dir,
        OsStr::from_bytes(name),
        dir_flags(),
        Mode::empty(),
    )?)
}

fn open_file(dir: BorrowedFd<'_>, name: &[u8]) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        dir,
        OsStr::from_bytes(name),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn with_name(e: impl Into<io::Error>, what: &str, name: &[u8]) -> io::Error {
    let e = e.into();
    let shown: String = if name.len() > 40 {
        format!("{}...({} bytes)", name[..40].escape_ascii(), name.len())
    } else {
        name.escape_ascii().to_string()
    };
    io::Error::new(e.kind(), format!("{what} \"{shown}\": {e}"))
}

/// A name of `len` random bytes: printable, control and high bytes mixed,
/// never `/` or NUL, never `.` or `..`.
fn random_name(r: &mut Rng, len: usize) -> Vec<u8> {
    loop {
        let name: Vec<u8> = (0..len)
            .map(|_| {
                loop {
                    let b = match r.below(4) {
                        0 | 1 => r.range(0x20, 0x7e) as u8,
                        2 => *r.pick(&[1u8, 7, 8, 9, 10, 13, 27, 31, 127, b' ', b'\\', b'*']),
                        _ => r.range(0x80, 0xff) as u8,
                    };
                    if b != b'/' && b != 0 {
                        break b;
                    }
                }
            })
            .collect();
        if name != b"." && name != b".." {
            return name;
        }
    }
}

/// A name of about `len` bytes (at most 255) that is valid UTF-8:
/// printable ASCII, control characters and multi-byte characters mixed,
/// never `/` or NUL, never `.` or `..`.
fn random_utf8_name(r: &mut Rng, len: usize) -> Vec<u8> {
    loop {
        let mut name = String::new();
        while name.len() < len {
            let c = match r.below(4) {
                0 | 1 => r.range(0x20, 0x7e) as u8 as char,
                2 => *r.pick(&['\u{1}', '\t', '\n', '\r', '\u{1b}', '\u{7f}', ' ', '\\']),
                _ => *r.pick(&['é', 'ß', 'Ж', '日', '本', '€', '\u{200b}', '🦀']),
            };
            if c != '/' && name.len() + c.len_utf8() <= 255 {
                name.push(c);
            } else if name.len() + c.len_utf8() > 255 {
                break;
            }
        }
        if !name.is_empty() && name != "." && name != ".." {
            return name.into_bytes();
        }
    }
}

fn name_len(r: &mut Rng) -> usize {
    match r.below(20) {
        0..=11 => r.urange(1, 12),
        12..=16 => r.urange(13, 100),
        _ => r.urange(200, 255),
    }
}

impl Tree {
    /// The plan of seed `params.seed`'s tree.
    pub fn generate(params: &Params) -> Tree {
        let mut g = Gen {
            r: Rng::new(params.seed),
            p: params.clone(),
            nodes: vec![Node::new(
                0,
                Vec::new(),
                Kind::Dir {
                    subvolume: false,
                    read_only: false,
                },
                (0, 0),
                0,
            )],
            names: vec![HashSet::new()],
            subvolumes: 0,
            mount: None,
            no_flags: BTreeSet::from([0]),
        };
        g.random_part();
        g.spine();
        g.chain();
        g.farm();
        let mount_point = g.mount_point();
        g.guaranteed();
        let mut t = Tree {
            params: params.clone(),
            nodes: g.nodes,
            mount_point,
            stats: Stats::default(),
        };
        t.stats = t.count();
        t
    }

    /// The parameters it was made from.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// What it holds.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The empty directory planned for a mount, if any: depth 1 or 2, no
    /// flags, no xattrs, owned by root.
    pub fn mount_point(&self) -> Option<NodeId> {
        self.mount_point
    }

    /// The name of `node` in its parent directory.
    pub fn name(&self, node: NodeId) -> &OsStr {
        OsStr::from_bytes(&self.nodes[node].name)
    }

    /// The directory holding `node`.
    pub fn parent(&self, node: NodeId) -> NodeId {
        self.nodes[node].parent
    }

    /// The path of `node` from the top, `/`-separated raw bytes (chains
    /// spelled out level by level).
    pub fn rel_path(&self, node: NodeId) -> Vec<u8> {
        let mut parts = Vec::new();
        let mut n = node;
        while n != 0 {
            parts.push(n);
            n = self.nodes[n].parent;
        }
        let mut out = Vec::new();
        for &n in parts.iter().rev() {
            let names: Vec<&[u8]> = match &self.nodes[n].kind {
                Kind::Chain(levels) => levels.chunks(1).collect(),
                _ => vec![&self.nodes[n].name[..]],
            };
            for name in names {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(name);
            }
        }
        out
    }

    /// Nested subvolumes, each with whether it was made read-only.
    pub fn subvolumes(&self) -> Vec<(NodeId, bool)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match n.kind {
                Kind::Dir {
                    subvolume: true,
                    read_only,
                } => Some((i, read_only)),
                _ => None,
            })
            .collect()
    }

    /// Whether `node` is inside a read-only subvolume (or is one).
    fn under_read_only(&self, node: NodeId) -> bool {
        let mut n = node;
        loop {
            if let Kind::Dir {
                read_only: true, ..
            } = self.nodes[n].kind
            {
                return true;
            }
            if n == 0 {
                return false;
            }
            n = self.nodes[n].parent;
        }
    }

    /// Regular files a service could still rewrite: no flag of their own,
    /// not in a read-only subvolume (their directory may be immutable:
    /// that forbids new names, not writes).
    pub fn mutable_files(&self) -> Vec<NodeId> {
        (1..self.nodes.len())
            .filter(|&i| {
                matches!(self.nodes[i].kind, Kind::File { .. })
                    && self.nodes[i].stuck.is_empty()
                    && !self.under_read_only(i)
            })
            .collect()
    }

    fn count(&self) -> Stats {
        let mut s = Stats::default();
        for n in self.nodes.iter().skip(1) {
            let depth = n.depth;
            s.entries += 1;
            match &n.kind {
                Kind::Dir {
                    subvolume,
                    read_only,
                } => {
                    s.max_dir_depth = s.max_dir_depth.max(depth);
                    if *subvolume {
                        s.subvolumes += 1;
                        s.read_only += u64::from(*read_only);
                    }
                }
                Kind::Chain(levels) => {
                    s.entries += levels.len() as u64 - 1;
                    s.max_dir_depth = s.max_dir_depth.max(depth);
                }
                Kind::File { sparse, .. } => {
                    s.files += 1;
                    s.sparse += u64::from(*sparse);
                }
                Kind::Link(_) => s.hardlinks += 1,
                Kind::Symlink(_) => s.symlinks += 1,
                Kind::Special(ty, _) => match ty {
                    FileType::Fifo => s.fifos += 1,
                    FileType::Socket => s.sockets += 1,
                    FileType::CharacterDevice => s.char_devices += 1,
                    _ => s.block_devices += 1,
                },
            }
            s.max_depth = s.max_depth.max(depth);
            s.longest_path = s.longest_path.max(n.path_len);
            s.xattrs += n.xattrs.len() as u64;
            s.immutable += u64::from(n.stuck.contains(IFlags::IMMUTABLE));
            s.append += u64::from(n.stuck.contains(IFlags::APPEND));
            s.nocow += u64::from(n.nocow);
        }
        s.mounts = u64::from(self.mount_point.is_some());
        s
    }

    /// Opens the directory `node` below `top` (the directory the tree was
    /// built in), one name at a time.
    pub fn open_dir(&self, top: &Path, node: NodeId) -> io::Result<OwnedFd> {
        let mut parts = Vec::new();
        let mut n = node;
        while n != 0 {
            parts.push(n);
            n = self.nodes[n].parent;
        }
        let mut cur = rustix::fs::open(top, dir_flags(), Mode::empty())?;
        for &n in parts.iter().rev() {
            cur = self.enter(cur.as_fd(), n)?;
        }
        Ok(cur)
    }

    /// Opens the directory `node` (a chain: its bottom) in `parent`.
    fn enter(&self, parent: BorrowedFd<'_>, node: NodeId) -> io::Result<OwnedFd> {
        match &self.nodes[node].kind {
            Kind::Chain(levels) => {
                let mut cur = open_dir(parent, &levels[..1])?;
                for b in levels[1..].chunks(1) {
                    cur = open_dir(cur.as_fd(), b)?;
                }
                Ok(cur)
            }
            _ => open_dir(parent, &self.nodes[node].name)
                .map_err(|e| with_name(e, "opening", &self.nodes[node].name)),
        }
    }

    fn is_dir(&self, node: NodeId) -> bool {
        matches!(self.nodes[node].kind, Kind::Dir { .. } | Kind::Chain(_))
    }

    /// Makes the tree below `top`, an existing empty directory (on btrfs
    /// if the tree has subvolumes): everything first, then the immutable
    /// and append-only flags bottom up, each directory's after all below
    /// it, and last the read-only flags of subvolumes.
    pub fn build(&self, top: &Path) -> io::Result<()> {
        let top_fd = rustix::fs::open(top, dir_flags(), Mode::empty())?;
        // The directories from the top to the current one, open, each
        // with how many of its subdirectories were made.
        let mut stack: Vec<(NodeId, OwnedFd, usize)> = Vec::new();
        self.make_leaves(0, top_fd.as_fd(), &stack)?;
        stack.push((0, top_fd, 0));
        while let Some((node, fd, next)) = stack.last_mut() {
            let node = *node;
            let dirs: Vec<NodeId> = self.nodes[node]
                .children
                .iter()
                .copied()
                .filter(|&c| self.is_dir(c))
                .collect();
            if *next >= dirs.len() {
                stack.pop();
                continue;
            }
            let child = dirs[*next];
            *next += 1;
            let cfd = self.make_dir(fd.as_fd(), child)?;
            self.make_leaves(child, cfd.as_fd(), &stack)?;
            stack.push((child, cfd, 0));
        }
        self.seal(top)
    }

    /// Makes the directory `node` in `parent` with its attributes (a
    /// chain: every level), and returns it (a chain: its bottom) open.
    fn make_dir(&self, parent: BorrowedFd<'_>, node: NodeId) -> io::Result<OwnedFd> {
        let n = &self.nodes[node];
        let fd = match &n.kind {
            Kind::Chain(levels) => {
                let mut cur: Option<OwnedFd> = None;
                for b in levels.chunks(1) {
                    let at = cur.as_ref().map_or(parent, |c| c.as_fd());
                    rustix::fs::mkdirat(at, OsStr::from_bytes(b), Mode::from_raw_mode(0o755))?;
                    cur = Some(open_dir(at, b)?);
                }
                return cur.ok_or_else(|| io::Error::other("an empty chain"));
            }
            Kind::Dir { subvolume, .. } => {
                if *subvolume {
                    volume::sys::create_subvolume(parent, OsStr::from_bytes(&n.name))
                        .map_err(|e| with_name(e, "creating the subvolume", &n.name))?;
                } else {
                    rustix::fs::mkdirat(
                        parent,
                        OsStr::from_bytes(&n.name),
                        Mode::from_raw_mode(0o755),
                    )
                    .map_err(|e| with_name(e, "mkdir", &n.name))?;
                }
                open_dir(parent, &n.name)?
            }
            _ => unreachable!("make_dir of a non-directory"),
        };
        if n.nocow {
            let cur = rustix::fs::ioctl_getflags(&fd)?;
            rustix::fs::ioctl_setflags(&fd, cur | IFlags::NOCOW)
                .map_err(|e| with_name(e, "NOCOW on", &n.name))?;
        }
        self.attributes(fd.as_fd(), node)?;
        Ok(fd)
    }

    /// Owner, mode, xattrs and mtime of the file or directory open as `fd`.
    fn attributes(&self, fd: BorrowedFd<'_>, node: NodeId) -> io::Result<()> {
        let n = &self.nodes[node];
        if let Some((uid, gid)) = n.owner {
            rustix::fs::fchown(
                fd,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
            )?;
        }
        if let Some(mode) = n.mode {
            rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))?;
        }
        for (k, v) in &n.xattrs {
            rustix::fs::fsetxattr(fd, OsStr::from_bytes(k), v, XattrFlags::empty())
                .map_err(|e| with_name(e, "setting the xattr", k))?;
        }
        if let Some(t) = n.mtime {
            rustix::fs::futimens(fd, &timestamps(t))?;
        }
        Ok(())
    }

    /// The files, links, symlinks and special files of `node`, open as
    /// `fd`; `stack` holds its ancestors, open (hardlink sources).
    fn make_leaves(
        &self,
        node: NodeId,
        fd: BorrowedFd<'_>,
        stack: &[(NodeId, OwnedFd, usize)],
    ) -> io::Result<()> {
        let children = &self.nodes[node].children;
        // Files first, so that the links below find them.
        for &c in children {
            let n = &self.nodes[c];
            let name = OsStr::from_bytes(&n.name);
            match &n.kind {
                Kind::File { data, sparse } => {
                    let f = rustix::fs::openat(
                        fd,
                        name,
                        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                        Mode::from_raw_mode(0o644),
                    )
                    .map_err(|e| with_name(e, "creating", &n.name))?;
                    if n.nocow {
                        let cur = rustix::fs::ioctl_getflags(&f)?;
                        rustix::fs::ioctl_setflags(&f, cur | IFlags::NOCOW)
                            .map_err(|e| with_name(e, "NOCOW on", &n.name))?;
                    }
                    write_all_at(f.as_fd(), data, 0)?;
                    if *sparse {
                        write_all_at(f.as_fd(), data, 512 << 10)?;
                        rustix::fs::ftruncate(&f, 2 << 20)?;
                    }
                    self.attributes(f.as_fd(), c)?;
                }
                Kind::Symlink(target) => {
                    rustix::fs::symlinkat(OsStr::from_bytes(target), fd, name)
                        .map_err(|e| with_name(e, "symlink", &n.name))?;
                    self.attributes_at(fd, c)?;
                }
                Kind::Special(ty, rdev) => {
                    rustix::fs::mknodat(fd, name, *ty, Mode::from_raw_mode(0o640), *rdev)
                        .map_err(|e| with_name(e, "mknod", &n.name))?;
                    self.attributes_at(fd, c)?;
                }
                _ => {}
            }
        }
        for &c in children {
            let n = &self.nodes[c];
            if let Kind::Link(target) = n.kind {
                let holder = self.nodes[target].parent;
                let src = if holder == node {
                    fd
                } else {
                    stack
                        .iter()
                        .find(|(s, _, _)| *s == holder)
                        .map(|(_, f, _)| f.as_fd())
                        .ok_or_else(|| io::Error::other("a hardlink's source is not above it"))?
                };
                rustix::fs::linkat(
                    src,
                    OsStr::from_bytes(&self.nodes[target].name),
                    fd,
                    OsStr::from_bytes(&n.name),
                    AtFlags::empty(),
                )
                .map_err(|e| with_name(e, "hardlink", &n.name))?;
            }
        }
        Ok(())
    }

    /// Owner, mode (not of a symlink) and mtime of the symlink or special
    /// file `node` in `dir`, never following it.
    fn attributes_at(&self, dir: BorrowedFd<'_>, node: NodeId) -> io::Result<()> {
        let n = &self.nodes[node];
        let name = OsStr::from_bytes(&n.name);
        if let Some((uid, gid)) = n.owner {
            rustix::fs::chownat(
                dir,
                name,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )?;
        }
        if let (Some(mode), Kind::Special(..)) = (n.mode, &n.kind) {
            rustix::fs::chmodat(dir, name, Mode::from_raw_mode(mode), AtFlags::empty())?;
        }
        if let Some(t) = n.mtime {
            rustix::fs::utimensat(dir, name, &timestamps(t), AtFlags::SYMLINK_NOFOLLOW)?;
        }
        Ok(())
    }

    /// The immutable and append-only flags, bottom up, then the read-only
    /// flags of subvolumes (each after everything inside it).
    fn seal(&self, top: &Path) -> io::Result<()> {
        // Which nodes have something to seal at or below them.
        let mut needs = vec![false; self.nodes.len()];
        for i in (1..self.nodes.len()).rev() {
            let n = &self.nodes[i];
            let own = !n.stuck.is_empty()
                || matches!(
                    n.kind,
                    Kind::Dir {
                        read_only: true,
                        ..
                    }
                );
            if own || needs[i] {
                needs[i] = true;
                needs[n.parent] = true;
            }
        }
        if !needs[0] {
            return Ok(());
        }
        let top_fd = rustix::fs::open(top, dir_flags(), Mode::empty())?;
        self.seal_files(0, top_fd.as_fd())?;
        let mut stack: Vec<(NodeId, OwnedFd, usize)> = vec![(0, top_fd, 0)];
        while let Some((node, fd, next)) = stack.last_mut() {
            let node = *node;
            let dirs: Vec<NodeId> = self.nodes[node]
                .children
                .iter()
                .copied()
                .filter(|&c| self.is_dir(c) && needs[c])
                .collect();
            if *next < dirs.len() {
                let child = dirs[*next];
                *next += 1;
                let cfd = self.enter(fd.as_fd(), child)?;
                self.seal_files(child, cfd.as_fd())?;
                stack.push((child, cfd, 0));
                continue;
            }
            let (node, fd, _) = stack.pop().expect("a frame");
            let n = &self.nodes[node];
            if !n.stuck.is_empty() {
                set_stuck(fd.as_fd(), n.stuck).map_err(|e| with_name(e, "flags of", &n.name))?;
            }
            if let Kind::Dir {
                read_only: true, ..
            } = n.kind
            {
                volume::sys::set_read_only(fd.as_fd(), true)
                    .map_err(|e| with_name(e, "making read-only", &n.name))?;
            }
        }
        Ok(())
    }

    /// The immutable and append-only flags of the files of `node`.
    fn seal_files(&self, node: NodeId, fd: BorrowedFd<'_>) -> io::Result<()> {
        for &c in &self.nodes[node].children {
            let n = &self.nodes[c];
            if matches!(n.kind, Kind::File { .. }) && !n.stuck.is_empty() {
                let f = open_file(fd, &n.name)?;
                set_stuck(f.as_fd(), n.stuck).map_err(|e| with_name(e, "flags of", &n.name))?;
            }
        }
        Ok(())
    }
}

fn set_stuck(fd: BorrowedFd<'_>, flags: IFlags) -> io::Result<()> {
    let cur = rustix::fs::ioctl_getflags(fd)?;
    rustix::fs::ioctl_setflags(fd, cur | flags)?;
    Ok(())
}

fn timestamps((sec, nsec): (i64, i64)) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
        last_modification: Timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
    }
}

fn write_all_at(fd: BorrowedFd<'_>, mut data: &[u8], mut at: u64) -> io::Result<()> {
    while !data.is_empty() {
        let n = rustix::io::pwrite(fd, data, at)?;
        data = &data[n..];
        at += n as u64;
    }
    Ok(())
}

/// The planner's state.
struct Gen {
    r: Rng,
    p: Params,
    nodes: Vec<Node>,
    /// Names taken, per node (directories only).
    names: Vec<HashSet<Vec<u8>>>,
    subvolumes: usize,
    /// The directory planned for a mount.
    mount: Option<NodeId>,
    /// Directories never to flag (the top, the mount point, chains).
    no_flags: BTreeSet<NodeId>,
}

impl Gen {
    fn unique_name(&mut self, dir: NodeId, len: usize) -> Vec<u8> {
        self.unique_name_of(dir, len, false)
    }

    /// A name not taken in `dir`; with `utf8`, valid UTF-8.
    fn unique_name_of(&mut self, dir: NodeId, len: usize, utf8: bool) -> Vec<u8> {
        let mut len = len;
        for attempt in 0.. {
            let name = if utf8 {
                random_utf8_name(&mut self.r, len)
            } else {
                random_name(&mut self.r, len)
            };
            if self.names[dir].insert(name.clone()) {
                return name;
            }
            // Short names run out: lengthen them.
            if attempt % 8 == 7 {
                len = (len + 1).min(255);
            }
        }
        unreachable!()
    }

    fn add(&mut self, parent: NodeId, name: Vec<u8>, kind: Kind) -> NodeId {
        let p = &self.nodes[parent];
        let sep = usize::from(parent != 0);
        let (depth, path_len) = match &kind {
            Kind::Chain(levels) => (
                p.depth + levels.len(),
                p.path_len + sep + 2 * levels.len() - 1,
            ),
            _ => (p.depth + 1, p.path_len + sep + name.len()),
        };
        let id = self.nodes.len();
        let subvol = match kind {
            Kind::Dir {
                subvolume: true, ..
            } => id,
            _ => p.subvol,
        };
        self.nodes
            .push(Node::new(parent, name, kind, (depth, path_len), subvol));
        self.names.push(HashSet::new());
        self.nodes[parent].children.push(id);
        id
    }

    fn add_dir(&mut self, parent: NodeId, name_len: usize, subvolume: bool) -> NodeId {
        let name = self.unique_name(parent, name_len);
        let read_only = subvolume && self.r.chance(30);
        self.subvolumes += usize::from(subvolume);
        let d = self.add(
            parent,
            name,
            Kind::Dir {
                subvolume,
                read_only,
            },
        );
        self.decorate(d);
        if self.p.flags && self.r.chance(8) {
            self.nodes[d].nocow = true;
        }
        d
    }

    /// Random xattrs, owner, mode and mtime, by the node's kind.
    fn decorate(&mut self, node: NodeId) {
        let is_file_or_dir = matches!(self.nodes[node].kind, Kind::Dir { .. } | Kind::File { .. });
        if is_file_or_dir && self.r.chance(20) {
            for _ in 0..self.r.range(1, 3) {
                let key_len = self.r.urange(1, 40);
                let mut key = b"user.".to_vec();
                key.extend(random_name(&mut self.r, key_len));
                let len = match self.r.below(10) {
                    0 => 0,
                    1 => 4096,
                    2..=4 => self.r.urange(100, 4096),
                    _ => self.r.urange(1, 64),
                };
                let value = self.r.bytes(len);
                let xattrs = &mut self.nodes[node].xattrs;
                if !xattrs.iter().any(|(k, _)| *k == key) {
                    xattrs.push((key, value));
                }
            }
        }
        if self.r.chance(15) {
            let id = |r: &mut Rng| *r.pick(&[0u32, 1, 1000, 65534, 65536, 100_000, 2_000_000_000]);
            let owner = (id(&mut self.r), id(&mut self.r));
            self.nodes[node].owner = Some(owner);
        }
        if !matches!(self.nodes[node].kind, Kind::Symlink(_)) && self.r.chance(20) {
            self.nodes[node].mode = Some(self.r.below(0o10000) as u32);
        }
        if !matches!(self.nodes[node].kind, Kind::Dir { .. }) && self.r.chance(50) {
            let sec = self.r.range(0, 1 << 34) as i64 - (1 << 31);
            let nsec = self.r.below(1_000_000_000) as i64;
            self.nodes[node].mtime = Some((sec, nsec));
        }
    }

    fn file(&mut self, dir: NodeId) -> NodeId {
        let len = match self.r.below(10) {
            0..=1 => 0,
            2..=4 => self.r.urange(1, 64),
            5..=8 => self.r.urange(65, 8192),
            _ => self.r.urange(8193, 64 << 10),
        };
        let data = self.r.bytes(len);
        let name_len = name_len(&mut self.r);
        let name = self.unique_name(dir, name_len);
        let f = self.add(
            dir,
            name,
            Kind::File {
                data,
                sparse: false,
            },
        );
        self.decorate(f);
        if self.p.flags && self.r.chance(6) {
            self.nodes[f].nocow = true;
        }
        f
    }

    fn symlink(&mut self, dir: NodeId) -> NodeId {
        let target = match self.r.below(5) {
            0 => b"/etc".to_vec(),
            1 => b"../../..".to_vec(),
            2 => {
                let mut t = b"no/such/".to_vec();
                let l = self.r.urange(1, 30);
                t.extend(random_name(&mut self.r, l));
                t
            }
            3 => (0..1000)
                .map(|_| self.r.range(1, 255) as u8)
                .collect::<Vec<u8>>(),
            _ => {
                let l = self.r.urange(1, 255);
                random_name(&mut self.r, l)
            }
        };
        let name_len = name_len(&mut self.r);
        let name = self.unique_name(dir, name_len);
        let s = self.add(dir, name, Kind::Symlink(target));
        self.decorate(s);
        s
    }

    fn special(&mut self, dir: NodeId, which: u64) -> NodeId {
        let (ty, rdev) = match which {
            0 => (FileType::Fifo, 0),
            1 => (FileType::Socket, 0),
            2 => (FileType::CharacterDevice, rustix::fs::makedev(1, 3)),
            _ => (FileType::BlockDevice, rustix::fs::makedev(7, 200)),
        };
        let name_len = name_len(&mut self.r);
        let name = self.unique_name(dir, name_len);
        let s = self.add(dir, name, Kind::Special(ty, rdev));
        self.decorate(s);
        s
    }

    /// A hardlink in `dir` to a file of `dir` or of a directory above it
    /// in the same subvolume, if there is one.
    fn link(&mut self, dir: NodeId) -> Option<NodeId> {
        let sv = self.nodes[dir].subvol;
        let mut candidates = Vec::new();
        let mut a = dir;
        loop {
            if self.nodes[a].subvol != sv {
                break;
            }
            candidates.extend(
                self.nodes[a]
                    .children
                    .iter()
                    .copied()
                    .filter(|&c| matches!(self.nodes[c].kind, Kind::File { .. })),
            );
            if a == 0 {
                break;
            }
            a = self.nodes[a].parent;
        }
        if candidates.is_empty() {
            return None;
        }
        let target = *self.r.pick(&candidates);
        let name_len = name_len(&mut self.r);
        let name = self.unique_name(dir, name_len);
        Some(self.add(dir, name, Kind::Link(target)))
    }

    /// Directories of breadth 0-5 to a random depth, each with a few
    /// leaves, expanded in random order until the budget is spent.
    fn random_part(&mut self) {
        let mut pending = vec![0usize];
        while !pending.is_empty() && self.nodes.len() < self.p.max_entries {
            let i = self.r.below(pending.len() as u64) as usize;
            let dir = pending.swap_remove(i);
            for _ in 0..self.r.range(0, 4) {
                match self.r.below(20) {
                    0..=11 => {
                        self.file(dir);
                    }
                    12..=14 => {
                        self.symlink(dir);
                    }
                    15..=17 => {
                        self.link(dir);
                    }
                    _ if self.p.specials => {
                        let which = self.r.below(4);
                        self.special(dir, which);
                    }
                    _ => {
                        self.file(dir);
                    }
                }
            }
            if self.nodes[dir].depth >= self.p.max_depth {
                continue;
            }
            let breadth = if dir == 0 {
                self.r.range(2, 5)
            } else {
                self.r.range(0, 5)
            };
            for _ in 0..breadth {
                let subvolume = self.subvolumes < self.p.subvolume_budget
                    && self.r.chance(self.p.subvolume_percent);
                let len = name_len(&mut self.r);
                let d = self.add_dir(dir, len, subvolume);
                pending.push(d);
            }
        }
    }

    /// The spine of long names from a shallow directory, and at its end a
    /// file, a symlink and, where subvolumes are made, one (maybe
    /// read-only) holding a file.
    fn spine(&mut self) {
        if self.p.spine == 0 {
            return;
        }
        let shallow: Vec<NodeId> = (0..self.nodes.len())
            .filter(|&i| matches!(self.nodes[i].kind, Kind::Dir { .. }) && self.nodes[i].depth <= 1)
            .collect();
        let mut cur = *self.r.pick(&shallow);
        for _ in 0..self.p.spine {
            let len = self.r.urange(240, 255);
            cur = self.add_dir(cur, len, false);
        }
        self.file(cur);
        self.symlink(cur);
        if self.p.subvolume_budget > 0 {
            let len = self.r.urange(200, 255);
            let sv = self.add_dir(cur, len, true);
            self.file(sv);
            let inner = self.add_dir(sv, 8, true);
            self.file(inner);
        }
    }

    /// The chain of one-byte names from the top, a file and a FIFO at its
    /// bottom, and maybe a subvolume there.
    fn chain(&mut self) {
        if self.p.chain == 0 {
            return;
        }
        let levels: Vec<u8> = (0..self.p.chain)
            .map(|_| {
                loop {
                    let b = self.r.range(1, 255) as u8;
                    if b != b'/' && b != b'.' {
                        break b;
                    }
                }
            })
            .collect();
        let mut levels = levels;
        // The first level is a name of the top: one not taken.
        while !self.names[0].insert(vec![levels[0]]) {
            levels[0] = loop {
                let b = self.r.range(1, 255) as u8;
                if b != b'/' && b != b'.' {
                    break b;
                }
            };
        }
        let first = vec![levels[0]];
        let c = self.add(0, first, Kind::Chain(levels));
        self.no_flags.insert(c);
        self.file(c);
        self.special(c, 0);
        if self.p.chain_subvolume {
            let sv = self.add_dir(c, 12, true);
            self.file(sv);
        }
    }

    /// A directory of a few hundred subvolumes, some nested in others,
    /// some read-only, each with a small file.
    fn farm(&mut self) {
        if self.p.farm == 0 {
            return;
        }
        let len = self.r.urange(1, 20);
        let dir = self.add_dir(0, len, false);
        let mut made = vec![dir];
        for _ in 0..self.p.farm {
            let parent = if made.len() > 1 && self.r.chance(35) {
                *self.r.pick(&made[1..])
            } else {
                dir
            };
            let len = self.r.urange(1, 16);
            let sv = self.add_dir(parent, len, true);
            if self.r.chance(50) {
                let len = self.r.urange(0, 100);
                let data = self.r.bytes(len);
                let name = self.unique_name(sv, 4);
                self.add(
                    sv,
                    name,
                    Kind::File {
                        data,
                        sparse: false,
                    },
                );
            }
            made.push(sv);
        }
    }

    /// Whether the path of `node` from the top is valid UTF-8.
    fn utf8_path(&self, node: NodeId) -> bool {
        let mut n = node;
        while n != 0 {
            if std::str::from_utf8(&self.nodes[n].name).is_err() {
                return false;
            }
            n = self.nodes[n].parent;
        }
        true
    }

    /// An empty directory at depth 1 or 2 for a mount, with no flags; in
    /// half the trees at a path that is valid UTF-8 (as a mount table
    /// shows it), in the others at whatever bytes.
    fn mount_point(&mut self) -> Option<NodeId> {
        if !self.p.mount {
            return None;
        }
        let utf8 = self.r.chance(50);
        let shallow: Vec<NodeId> = (0..self.nodes.len())
            .filter(|&i| {
                matches!(self.nodes[i].kind, Kind::Dir { .. })
                    && self.nodes[i].depth <= 1
                    && (!utf8 || self.utf8_path(i))
            })
            .collect();
        let parent = *self.r.pick(&shallow);
        let len = name_len(&mut self.r);
        let name = self.unique_name_of(parent, len, utf8);
        let m = self.add(
            parent,
            name,
            Kind::Dir {
                subvolume: false,
                read_only: false,
            },
        );
        self.no_flags.insert(m);
        self.mount = Some(m);
        Some(m)
    }

    /// One sparse file; with `specials`, one of each kind; with `flags`,
    /// each flag on some files and directories, at least once.
    fn guaranteed(&mut self) {
        let dirs: Vec<NodeId> = (0..self.nodes.len())
            .filter(|&i| {
                matches!(self.nodes[i].kind, Kind::Dir { .. } | Kind::Chain(_))
                    && Some(i) != self.mount
            })
            .collect();
        let at = *self.r.pick(&dirs);
        let data = self.r.bytes(4096);
        let name = self.unique_name(at, 10);
        let f = self.add(at, name, Kind::File { data, sparse: true });
        self.decorate(f);
        if self.p.specials {
            for which in 0..4 {
                let at = *self.r.pick(&dirs);
                self.special(at, which);
            }
        }
        if !self.p.flags {
            return;
        }
        // NOCOW on an empty file and a new, empty directory.
        let at = *self.r.pick(&dirs);
        let name = self.unique_name(at, 6);
        let f = self.add(
            at,
            name,
            Kind::File {
                data: Vec::new(),
                sparse: false,
            },
        );
        self.nodes[f].nocow = true;
        let at = *self.r.pick(&dirs);
        let d = self.add_dir(at, 6, false);
        self.nodes[d].nocow = true;
        let f = self.file(d);
        self.nodes[f].nocow = false;
        // Immutable and append-only on files and directories: some at
        // random, and at least one of each.
        let files: Vec<NodeId> = (1..self.nodes.len())
            .filter(|&i| matches!(self.nodes[i].kind, Kind::File { .. }))
            .collect();
        let flaggable: Vec<NodeId> = (1..self.nodes.len())
            .filter(|&i| {
                matches!(self.nodes[i].kind, Kind::Dir { .. }) && !self.no_flags.contains(&i)
            })
            .collect();
        for (pool, percent) in [(&files, 6), (&flaggable, 4)] {
            for flag in [IFlags::IMMUTABLE, IFlags::APPEND] {
                for &i in pool.iter() {
                    if self.nodes[i].stuck.is_empty() && self.r.chance(percent) {
                        self.nodes[i].stuck = flag;
                    }
                }
                let free: Vec<NodeId> = pool
                    .iter()
                    .copied()
                    .filter(|&i| self.nodes[i].stuck.is_empty())
                    .collect();
                if !pool.iter().any(|&i| self.nodes[i].stuck.contains(flag)) && !free.is_empty() {
                    let i = *self.r.pick(&free);
                    self.nodes[i].stuck = flag;
                }
            }
        }
    }
}
