//! What is mounted from inside a volume, in every mount namespace.
//!
//! A bind mount of a volume that a container (or another package) holds
//! keeps pointing at the same tree when a rollback or a delete takes that
//! tree off the volume's name, so the service goes on writing into it: the
//! store then keeps the tree (`<pkg>.held`) rather than deleting it, until no
//! mount holds it; a conversion refuses instead. Containers hold their mounts
//! in mount namespaces of their own, invisible in `/proc/self/mountinfo`; so
//! every namespace on the machine is read, through the mountinfo of one
//! process in it (its reader).
//!
//! Two kinds of mount use a path. A mount whose source lies inside it (a
//! bind mount of the volume or of anything in it), known by its filesystem
//! and the path in that filesystem that mountinfo gives as the mount's
//! root: the same in every namespace, and what really keeps the data
//! reachable. And a mount on top of it or below it, known by its mount
//! point; but mountinfo gives a mount point as a path from the root
//! directory of the process it is read through, and a container has a root
//! of its own (LXC's rootfs, through `pivot_root`), in which its package
//! may mount anything at a path spelled as this process sees a volume, or
//! the `<pkg>.delete` or `<pkg>.held/<n>` the store keeps one under. Taken
//! at its word, such a mount would keep another package's deleted volume
//! held for as long as that container runs, or have its conversion
//! refused: what a package can make must never decide what becomes of
//! another's data. So a mount point counts only in this namespace, and in
//! one whose reader's root is this process's root (the same directory, by
//! device and inode); anywhere else only the source does.
//!
//! A reader whose root cannot be stat'ed, though its table could be read,
//! is taken not to have ours. Were its root ours, the stat would succeed
//! as this process's own did: the same directory on the same filesystem,
//! and the kernel guards following a process's root with the check that
//! guards its namespace link, without which the namespace is not read at
//! all. A package, though, can make its own root refuse root's stat (a
//! FUSE filesystem its user namespace mounted answers EACCES to anyone
//! outside it), so taking an unknown root as ours would hand it back the
//! spoof. What is given up is a mount on top of or below a tree in a
//! namespace with our root that failed the stat for some other reason (no
//! memory, say): not the tree's data, which its source still finds. A
//! reader gone by then is passed over, as one whose table is gone
//! (`sys::mount_namespaces`).

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::sys;

/// One line of mountinfo, the fields we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MountEntry {
    /// `major:minor` of the filesystem.
    pub dev: String,
    /// Path inside the filesystem that is mounted.
    pub root: PathBuf,
    /// Where it is mounted, as a path from the root directory of the
    /// process the table was read through.
    pub mount_point: PathBuf,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(b: &[u8]) -> PathBuf {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

/// The lines of a mount table, raw bytes: a mount point's name, like any
/// name, may be any bytes but `/` and NUL, and the kernel escapes only
/// space, tab, newline and backslash.
pub(crate) fn parse_mountinfo(text: &[u8]) -> Vec<MountEntry> {
    text.split(|b| *b == b'\n')
        .filter_map(|line| {
            let mut f = line.split(|b| *b == b' ');
            let _id = f.next()?;
            let _parent = f.next()?;
            let dev = String::from_utf8_lossy(f.next()?).into_owned();
            let root = unescape(f.next()?);
            let mount_point = unescape(f.next()?);
            Some(MountEntry {
                dev,
                root,
                mount_point,
            })
        })
        .collect()
}

/// Where `path` (an absolute path with no symlinks, seen from this
/// namespace) sits: its filesystem, and its path inside that filesystem,
/// which is what a bind mount of it shows as its root in any namespace.
fn locate(own: &[MountEntry], path: &Path) -> Option<(String, PathBuf)> {
    let holder = own
        .iter()
        .filter(|e| path.starts_with(&e.mount_point))
        .max_by_key(|e| e.mount_point.as_os_str().len())?;
    let rel = path.strip_prefix(&holder.mount_point).ok()?;
    Some((holder.dev.clone(), holder.root.join(rel)))
}

/// Mount points of `entries` that expose something inside `path`: bind
/// mounts anywhere whose source lies inside `inner` (`path`'s filesystem
/// and its path in there, from [`locate`]), and, if `by_mount_point`
/// (`entries` name their mount points from this process's root, see the
/// module docs), mounts on top of `path` or below it.
fn mounts_inside(
    entries: &[MountEntry],
    path: &Path,
    inner: Option<&(String, PathBuf)>,
    by_mount_point: bool,
) -> Vec<PathBuf> {
    entries
        .iter()
        .filter(|e| {
            (by_mount_point && e.mount_point.starts_with(path))
                || inner.is_some_and(|(dev, p)| e.dev == *dev && e.root.starts_with(p))
        })
        .map(|e| e.mount_point.clone())
        .collect()
}

/// A mount that exposes something of a volume, and who holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountUse {
    /// Where it is mounted, as the processes of its namespace see it.
    pub mount_point: PathBuf,
    /// The mount namespace, by its inode number (`/proc/<pid>/ns/mnt`).
    pub namespace: u64,
    /// Whether that is this process's own namespace.
    pub own_namespace: bool,
    /// Every process in that namespace, sorted (the first is the one
    /// named in messages).
    pub pids: Vec<u32>,
    /// The first process's command name (`/proc/<pid>/comm`).
    pub command: String,
}

/// `bytes` as text for a one-line message (a newline in a mount point a
/// package made, say, escaped).
fn printable(bytes: &[u8]) -> String {
    crate::walk::printable(Path::new(std::ffi::OsStr::from_bytes(bytes)))
}

impl fmt::Display for MountUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = printable(self.mount_point.as_os_str().as_bytes());
        if self.own_namespace {
            write!(f, "{at}")
        } else {
            let pid = self.pids.first().copied().unwrap_or(0);
            write!(
                f,
                "{at} in the mount namespace of pid {pid} ({})",
                printable(self.command.as_bytes())
            )
        }
    }
}

/// Every mount namespace's mount table, read once (see [`MountTables::read`]),
/// to answer [`MountTables::uses_of`] for many paths at the cost of one
/// pass over `/proc`.
///
/// A snapshot: a mount made after the read is not in it. So it serves a
/// plan over many packages (the conversion's schedule); a step that is
/// about to replace a volume's data reads the tables again before it
/// starts and, where that takes long (a clone), again just before the
/// exchange.
#[derive(Debug, Clone)]
pub struct MountTables {
    own_namespace: u64,
    own: Vec<MountEntry>,
    /// Every namespace with a process in it, this one included.
    namespaces: Vec<Namespace>,
}

/// One namespace of [`MountTables`].
#[derive(Debug, Clone)]
struct Namespace {
    id: u64,
    pids: Vec<u32>,
    /// The process of `pids` its table was read through, the one messages
    /// name.
    reader: u32,
    /// Its table; `None` for this process's own, which is `own`.
    entries: Option<Vec<MountEntry>>,
    /// Whether `reader`'s root is this process's, so that its table's mount
    /// points are paths this process can compare with its own (see the
    /// module docs); false if its root could not be stat'ed.
    our_root: bool,
}

impl MountTables {
    /// Reads this process's mount table and that of every other mount
    /// namespace on the machine, through the mountinfo of one process in
    /// each (a process that exits meanwhile, or that root may not inspect,
    /// is passed over; anything else unreadable is an error).
    pub fn read() -> io::Result<MountTables> {
        let own = sys::own_mount_table()?;
        let own_namespace = own.namespace;
        let namespaces = sys::mount_namespaces()?
            .into_iter()
            .map(|ns| Namespace {
                id: ns.id,
                entries: (ns.id != own_namespace).then(|| parse_mountinfo(&ns.mountinfo)),
                reader: ns.reader,
                pids: ns.pids,
                our_root: ns.root == Some(own.root),
            })
            .collect();
        Ok(MountTables {
            own_namespace,
            own: parse_mountinfo(&own.mountinfo),
            namespaces,
        })
    }

    /// [`MountTables::read`], shared with the threads of this process that
    /// ask meanwhile: the tables of a read begun after this call, this
    /// thread's own or another's. Such a read sees every mount
    /// made before the call, as a read of the caller's own would, so a
    /// step that must see the mounts as they are now (a conversion about to
    /// replace a volume's data) may take it. The cost it saves grows with
    /// the box: each read passes over every process and formats every
    /// namespace's table, and a box whose services each hold a namespace
    /// of their own makes a boot converting its packages several at once
    /// read them all once per package, twice for a clone (150 packages
    /// through start-core's call sites, each service's container in a
    /// namespace, one run with the tables not read at all: the last light
    /// package ready about 0.3 s sooner, 12 conversions at once).
    ///
    /// No read serves a call made after it began (the last one is held
    /// only for the callers that waited for it): a namespace's table names
    /// each mount's root by its path now, which a rename changes without
    /// any mount or unmount the kernel would report (a rollback moves a
    /// tree a dependent's container holds aside), so an older table may
    /// name a tree where it no longer is.
    pub fn read_fresh() -> io::Result<Arc<MountTables>> {
        static SHARED: Fresh<MountTables> = Fresh::new();
        SHARED.get(MountTables::read)
    }

    /// Every mount, in every namespace read, that exposes something inside
    /// `path` (an absolute path with no symlinks, as this process sees
    /// it): bind mounts of it or of anything below it, wherever they are
    /// mounted; mounts on top of it or below it, in this namespace and in
    /// each whose reader has this process's root (elsewhere a mount point
    /// is a path from another root: see the module docs). Each namespace
    /// holding one
    /// is named by its process's command name as it is now (read here,
    /// empty if that process has exited since the tables were read).
    pub fn uses_of(&self, path: &Path) -> Vec<MountUse> {
        let inner = locate(&self.own, path);
        let mut out = Vec::new();
        for ns in &self.namespaces {
            let own_namespace = ns.id == self.own_namespace;
            let entries = ns.entries.as_deref().unwrap_or(&self.own);
            let by_mount_point = own_namespace || ns.our_root;
            let found = mounts_inside(entries, path, inner.as_ref(), by_mount_point);
            if found.is_empty() {
                continue;
            }
            // Named now, for a namespace that holds a use: a read of every
            // namespace's name costs a tenth of the read of their tables.
            let command = sys::command_of(ns.reader);
            for mount_point in found {
                out.push(MountUse {
                    mount_point,
                    namespace: ns.id,
                    own_namespace,
                    pids: ns.pids.clone(),
                    command: command.clone(),
                });
            }
        }
        out
    }
}

/// Every mount, in every mount namespace, that exposes something inside
/// `path` (see [`MountTables::uses_of`]), from the tables as they are now.
///
/// Used before any step that would leave such a mount pointing at data that
/// is about to go (a tree a rollback or a delete took off a volume's name,
/// kept while mounted; a conversion, refused).
pub fn uses_of(path: &Path) -> io::Result<Vec<MountUse>> {
    Ok(MountTables::read_fresh()?.uses_of(path))
}

/// A value read now and then, each read shared by the threads that asked
/// while it had not begun: a caller gets the outcome of the first read
/// begun after its call, never an older one (see
/// [`MountTables::read_fresh`]). One read runs at a time; the others wait
/// for it, then take it if it began after them or begin the next one
/// themselves. A read that fails is its own thread's error: the threads
/// waiting for it begin another (an error is not a value to share, and the
/// next read may succeed).
struct Fresh<T> {
    state: Mutex<FreshState<T>>,
    done: Condvar,
}

struct FreshState<T> {
    /// Reads begun so far.
    begun: u64,
    /// Whether one is running (the `begun`th).
    running: bool,
    /// The newest read that succeeded, and its number.
    last: Option<(u64, Arc<T>)>,
}

impl<T> Fresh<T> {
    const fn new() -> Fresh<T> {
        Fresh {
            state: Mutex::new(FreshState {
                begun: 0,
                running: false,
                last: None,
            }),
            done: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FreshState<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn get(&self, read: impl FnOnce() -> io::Result<T>) -> io::Result<Arc<T>> {
        let mut state = self.lock();
        // Any read begun from now on is numbered past this.
        let after = state.begun;
        loop {
            if let Some((n, value)) = &state.last
                && *n > after
            {
                return Ok(Arc::clone(value));
            }
            if !state.running {
                break;
            }
            state = self
                .done
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.begun += 1;
        state.running = true;
        let n = state.begun;
        drop(state);
        // Whatever becomes of the read (a panic included), it is over and
        // the waiters are woken.
        struct Over<'a, T>(&'a Fresh<T>);
        impl<T> Drop for Over<'_, T> {
            fn drop(&mut self) {
                self.0.lock().running = false;
                self.0.done.notify_all();
            }
        }
        let over = Over(self);
        let value = Arc::new(read()?);
        // One read runs at a time: this one is the newest.
        self.lock().last = Some((n, Arc::clone(&value)));
        drop(over);
        Ok(value)
    }
}

/// Reads this process's mount table and returns the mount points strictly
/// below `path` (an absolute path with no symlinks): each hides what lies
/// under it in `path`'s filesystem from anything that walks the tree.
pub fn mount_points_below(path: &Path) -> io::Result<Vec<PathBuf>> {
    let own = sys::own_mount_table()?;
    Ok(parse_mountinfo(&own.mountinfo)
        .into_iter()
        .filter(|e| e.mount_point != path && e.mount_point.starts_with(path))
        .map(|e| e.mount_point)
        .collect())
}

/// The filesystem type (`ext4`, `xfs`, ...) of the mount `id` (statx's
/// mount id, mountinfo's first field) in the mount table `text`: the field
/// after the ` - ` that ends the optional fields. `None` if no line has
/// that id.
pub(crate) fn fs_type_of_mount(text: &[u8], id: u64) -> Option<String> {
    let id = id.to_string();
    text.split(|b| *b == b'\n').find_map(|line| {
        let mut fields = line.split(|b| *b == b' ');
        if fields.next()? != id.as_bytes() {
            return None;
        }
        let fs_type = fields.skip_while(|f| *f != b"-").nth(1)?;
        Some(String::from_utf8_lossy(fs_type).into_owned())
    })
}

/// Formats mount uses for a one-line error.
pub fn describe(uses: &[MountUse]) -> String {
    uses.iter()
        .map(|u| u.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / / rw - ext4 /dev/vda rw
40 22 0:45 / /media/startos/data rw,relatime - btrfs /dev/loop0 rw
41 22 0:45 /package-data/volumes/lnd/data/main /var/lib/lxc/lnd/rootfs/data rw - btrfs /dev/loop0 rw
42 22 0:45 /package-data/volumes/lnd-tools/data/main /mnt/other rw - btrfs /dev/loop0 rw
43 40 0:50 / /media/startos/data/package-data/volumes/bitcoind/data/main/tmp rw - tmpfs tmpfs rw
44 22 0:46 /package-data/volumes/lnd/data/main /mnt/unrelated rw - btrfs /dev/loop1 rw
45 22 0:45 / /mnt/with\\040space rw - btrfs /dev/loop0 rw
";

    /// A container's namespace: its own root, and a bind mount of lnd's
    /// volume from the same filesystem, at a path nobody else sees.
    const CONTAINER: &str = "\
90 80 0:60 / / rw - overlay overlay rw
91 90 0:45 /package-data/volumes/lnd/data/main /data rw - btrfs /dev/loop0 rw
92 90 0:45 /package-data/volumes/electrs/data/main /electrs rw - btrfs /dev/loop0 rw
";

    #[test]
    fn names_a_mount_s_filesystem_type_by_its_id() {
        let text = SAMPLE.as_bytes();
        assert_eq!(fs_type_of_mount(text, 22).as_deref(), Some("ext4"));
        assert_eq!(fs_type_of_mount(text, 43).as_deref(), Some("tmpfs"));
        assert_eq!(fs_type_of_mount(text, 4), None, "no prefix of an id");
        let tagged = b"7 1 0:30 / /x rw shared:1 master:2 - xfs /dev/sdb rw\n";
        assert_eq!(fs_type_of_mount(tagged, 7).as_deref(), Some("xfs"));
    }

    #[test]
    fn finds_bind_mounts_from_inside_and_mounts_on_top() {
        let e = parse_mountinfo(SAMPLE.as_bytes());
        let vols = Path::new("/media/startos/data/package-data/volumes");
        let inside = |p: &Path| mounts_inside(&e, p, locate(&e, p).as_ref(), true);
        assert_eq!(
            inside(&vols.join("lnd")),
            vec![PathBuf::from("/var/lib/lxc/lnd/rootfs/data")],
            "a bind mount of lnd counts, lnd-tools and another filesystem do not"
        );
        assert_eq!(
            inside(&vols.join("bitcoind")),
            vec![vols.join("bitcoind/data/main/tmp")]
        );
        assert!(inside(&vols.join("electrs")).is_empty());
    }

    #[test]
    fn finds_bind_mounts_in_another_namespace_by_their_source() {
        let own = parse_mountinfo(SAMPLE.as_bytes());
        let container = parse_mountinfo(CONTAINER.as_bytes());
        let vols = Path::new("/media/startos/data/package-data/volumes");
        let lnd = vols.join("lnd");
        assert_eq!(
            mounts_inside(&container, &lnd, locate(&own, &lnd).as_ref(), false),
            vec![PathBuf::from("/data")]
        );
        let bitcoind = vols.join("bitcoind");
        assert!(
            mounts_inside(
                &container,
                &bitcoind,
                locate(&own, &bitcoind).as_ref(),
                false
            )
            .is_empty()
        );
    }

    #[test]
    fn one_read_of_the_tables_answers_for_every_volume() {
        let tables = MountTables {
            own_namespace: 1,
            own: parse_mountinfo(SAMPLE.as_bytes()),
            namespaces: vec![
                Namespace {
                    id: 1,
                    pids: vec![1],
                    reader: 1,
                    entries: None,
                    our_root: true,
                },
                Namespace {
                    id: 2,
                    pids: vec![700, 701],
                    reader: 700,
                    entries: Some(parse_mountinfo(CONTAINER.as_bytes())),
                    our_root: false,
                },
            ],
        };
        let vols = Path::new("/media/startos/data/package-data/volumes");
        let at = |pkg: &str| {
            tables
                .uses_of(&vols.join(pkg))
                .into_iter()
                .map(|u| (u.mount_point, u.namespace, u.own_namespace, u.pids[0]))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            at("lnd"),
            vec![
                ("/var/lib/lxc/lnd/rootfs/data".into(), 1, true, 1),
                ("/data".into(), 2, false, 700),
            ]
        );
        assert_eq!(at("electrs"), vec![("/electrs".into(), 2, false, 700)]);
        assert_eq!(
            at("bitcoind"),
            vec![(vols.join("bitcoind/data/main/tmp"), 1, true, 1)]
        );
        assert!(at("mempool").is_empty());
    }

    /// A container whose package mounted a tmpfs in its own root at the
    /// paths this process sees a deleted volume and a held tree at, and
    /// bind-mounted lnd's volume at `/data`.
    const SPOOFING: &str = "\
90 80 0:60 / / rw - overlay overlay rw
91 90 0:70 / /media/startos/data/package-data/volumes/lnd.delete rw - tmpfs none rw
92 90 0:71 / /media/startos/data/package-data/volumes/electrs.held/1/data rw - tmpfs none rw
93 90 0:45 /package-data/volumes/lnd.delete/data/main /data rw - btrfs /dev/loop0 rw
";

    /// Its mount points are paths from its own root: they count only where
    /// that root is ours; the bind mount, by its source, counts anywhere.
    #[test]
    fn a_mount_point_counts_only_from_our_root() {
        let tables = |our_root| MountTables {
            own_namespace: 1,
            own: parse_mountinfo(SAMPLE.as_bytes()),
            namespaces: vec![Namespace {
                id: 2,
                pids: vec![700],
                reader: 700,
                entries: Some(parse_mountinfo(SPOOFING.as_bytes())),
                our_root,
            }],
        };
        let vols = Path::new("/media/startos/data/package-data/volumes");
        let at = |our_root, name: &str| {
            tables(our_root)
                .uses_of(&vols.join(name))
                .into_iter()
                .map(|u| u.mount_point)
                .collect::<Vec<_>>()
        };
        assert_eq!(at(false, "lnd.delete"), [PathBuf::from("/data")]);
        assert!(at(false, "electrs.held/1").is_empty());
        assert_eq!(
            at(true, "lnd.delete"),
            [vols.join("lnd.delete"), PathBuf::from("/data")]
        );
        assert_eq!(
            at(true, "electrs.held/1"),
            [vols.join("electrs.held/1/data")]
        );
    }

    #[test]
    fn a_mount_point_that_is_not_utf8_is_read_as_it_is() {
        let mut table = SAMPLE.as_bytes().to_vec();
        table.extend_from_slice(b"46 40 0:51 / /media/startos/data/package-data/volumes/app/data/\xff\x01 rw - tmpfs tmpfs rw\n");
        let e = parse_mountinfo(&table);
        assert_eq!(e.len(), 8);
        assert_eq!(
            e[7].mount_point.as_os_str().as_bytes(),
            b"/media/startos/data/package-data/volumes/app/data/\xff\x01"
        );
        let app = Path::new("/media/startos/data/package-data/volumes/app");
        assert_eq!(
            mounts_inside(&e, app, None, true),
            vec![e[7].mount_point.clone()]
        );
    }

    #[test]
    fn unescapes_octal() {
        let e = parse_mountinfo(SAMPLE.as_bytes());
        assert_eq!(e[6].mount_point, PathBuf::from("/mnt/with space"));
    }

    /// Eight threads asking at once, each read taking 200 ms: each gets a
    /// read begun after it asked, and a few reads serve them all (eight
    /// without sharing).
    #[test]
    fn fresh_reads_are_shared_and_never_older_than_the_call() {
        use std::sync::Barrier;
        use std::sync::atomic::{AtomicU64, Ordering};
        let shared: Fresh<u64> = Fresh::new();
        let begun = AtomicU64::new(0);
        let barrier = Barrier::new(8);
        let read = || {
            let n = begun.fetch_add(1, Ordering::SeqCst) + 1;
            std::thread::sleep(std::time::Duration::from_millis(200));
            Ok(n)
        };
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    barrier.wait();
                    let before = begun.load(Ordering::SeqCst);
                    let got = *shared.get(read).expect("the read succeeds");
                    assert!(
                        got > before,
                        "read {got} began before the call (after {before})"
                    );
                });
            }
        });
        let reads = begun.load(Ordering::SeqCst);
        assert!(reads <= 3, "{reads} reads for 8 callers");
        // Later, alone: a read of its own, not the last one kept.
        let before = begun.load(Ordering::SeqCst);
        assert_eq!(*shared.get(read).expect("the read succeeds"), before + 1);
    }

    /// A failed read is its caller's error; the next caller reads again,
    /// and a read that panics leaves no one waiting for it.
    #[test]
    fn a_failed_or_panicking_read_is_not_shared() {
        let shared: Fresh<u32> = Fresh::new();
        let failed = shared.get(|| Err(io::Error::other("unreadable")));
        assert_eq!(
            failed.expect_err("the read failed").to_string(),
            "unreadable"
        );
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            shared.get(|| panic!("a read that panics"))
        }));
        assert!(panicked.is_err());
        assert_eq!(*shared.get(|| Ok(7)).expect("the read succeeds"), 7);
    }
}
