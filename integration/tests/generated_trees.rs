//! Hostile tree shapes, generated: every operation of `startos-volume` and
//! `volume-migrate` on trees of random shape (`integration::r#gen`),
//! each generated from a seed inside a package volume on a loop-mounted
//! btrfs, and built through descriptors only: chains 20,000 levels deep,
//! paths past 32 KiB, raw-byte names, hardlinks, symlinks, FIFOs, sockets,
//! devices, xattrs, immutable, append-only and NOCOW flags, hundreds of
//! nested subvolumes (some read-only, some nested in others, some far
//! below long paths), and a tmpfs mounted inside.
//!
//! Every command runs as a child process with a soft RLIMIT_NOFILE of 64
//! and a timeout (a hang is a failure), and is held to one invariant
//! ([`Case::step`]):
//!
//! 1. it exits 0, or non-zero with exactly one line on stderr
//!    (`volume-migrate`: one line naming the package, warnings aside);
//! 2. the package's trees (volume and backup, compared with `deep_digest`)
//!    are then exactly the state before the command or the state after it;
//! 3. `startos-volume recover` then exits 0, changes nothing, and leaves
//!    no name of the package but `<pkg>`, `<pkg>.install-backup` and
//!    `<pkg>.install-backup.ro`.
//!
//! On top of it, each flow states what the code does today, command by
//! command (which of the two states, which refusal).
//!
//! `make test` runs [`FIXED_SEEDS`]; `GEN_FULL=1` adds 100 more (or
//! `GEN_COUNT`); `GEN_SEED=<n>` replays seed `n` alone (`GEN_SEED=3,5` or
//! `GEN_SEED=0..40`: those). Each tree's seed is printed before it is built.

mod common;

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use common::cli::{limit_nofile, wait_within};
use common::*;
use integration::deep::{self, DeepDigest, DeepEntry, DeepKind};
use integration::r#gen::{Params, Rng, Stats, Tree, VolumeShape};
use integration::{LoopFs, fs_or_skip};

/// The seeds `make test` runs. Together they hold (checked at the end of
/// the run, [`Coverage`]), for each kind of volume: a 20,000-deep chain,
/// paths past 32 KiB, a tree with 200 or more nested subvolumes, every
/// special file type, every flag, a mount inside; and, in plain
/// directories, chains at 2,048 levels below the volume's top and at
/// 2,049 (the copy's limit).
const FIXED_SEEDS: &[u64] = &[2, 3, 5, 9, 11, 16, 19, 20, 23, 24, 25, 27];

/// Seeds `GEN_FULL=1` runs besides the fixed ones, unless `GEN_COUNT`.
const FULL_COUNT: u64 = 100;

/// Commands run, in all trees.
static COMMANDS: AtomicU64 = AtomicU64::new(0);

/// The soft RLIMIT_NOFILE of every command.
const NOFILE: u64 = 64;

/// How long a command may take (a debug build walking 20,000 levels
/// several times, or snapshotting hundreds of subvolumes) before it is
/// killed as hung.
const TIMEOUT: Duration = Duration::from_secs(300);

/// Trees built at once.
const WORKERS: usize = 2;

/// The depth below a volume's top to which a copy goes (`volume::copy`'s
/// `MAX_DEPTH`): deeper is refused.
const COPY_DEPTH: usize = 2048;

/// Levels of `<pkg>/data/main`, the generated tree's top, below the
/// volume's.
const TOP_DEPTH: usize = 2;

fn bin(name: &str) -> PathBuf {
    integration::workspace_bin(name).unwrap_or_else(|e| panic!("{e}; run `make test`"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

// ---------------------------------------------------------------- running commands

/// Which tool a command runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tool {
    Volume,
    Migrate,
}

/// Runs `tool --root <root> <args>` with a soft RLIMIT_NOFILE of
/// [`NOFILE`] (the hard limit as it is), killed and failed past
/// [`TIMEOUT`].
fn run_tool(tool: Tool, root: &Path, args: &[&str]) -> Output {
    let name = match tool {
        Tool::Volume => "startos-volume",
        Tool::Migrate => "volume-migrate",
    };
    let mut cmd = Command::new(bin(name));
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV)
        .env_remove(volume::sys::fault::FAULT_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    limit_nofile(&mut cmd, NOFILE);
    let what = format!("{name} {}", args.join(" "));
    COMMANDS.fetch_add(1, Ordering::Relaxed);
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let (out, hung) = wait_within(child, TIMEOUT);
    assert!(
        !hung,
        "{what} hung: not done within {} s (killed); stdout {:?}, stderr {:?}",
        TIMEOUT.as_secs(),
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

// ---------------------------------------------------------------- states

/// A package's two trees, each absent or with its digest (shared: a
/// 20,000-deep chain's digest holds hundreds of megabytes of paths).
#[derive(Clone, Default)]
struct Pair {
    live: Option<Arc<DeepDigest>>,
    backup: Option<Arc<DeepDigest>>,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Pair) -> bool {
        fn same(a: &Option<Arc<DeepDigest>>, b: &Option<Arc<DeepDigest>>) -> bool {
            match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b) || **a == **b,
                _ => false,
            }
        }
        same(&self.live, &other.live) && same(&self.backup, &other.backup)
    }
}

impl Pair {
    fn show(&self) -> String {
        let one = |d: &Option<Arc<DeepDigest>>| match d {
            Some(d) => format!("{} entries", d.len()),
            None => "absent".to_owned(),
        };
        format!("volume {}, backup {}", one(&self.live), one(&self.backup))
    }

    /// How `self` differs from `other`, a few lines.
    fn diff(&self, other: &Pair) -> String {
        let one =
            |what: &str, a: &Option<Arc<DeepDigest>>, b: &Option<Arc<DeepDigest>>| match (a, b) {
                (Some(a), Some(b)) => {
                    let d = a.diff(b);
                    if d.is_empty() {
                        String::new()
                    } else {
                        format!("{what}:\n      {}", d.join("\n      "))
                    }
                }
                (None, None) => String::new(),
                (Some(_), None) => format!("{what}: present, not absent"),
                (None, Some(_)) => format!("{what}: absent, not present"),
            };
        [
            one("volume", &self.live, &other.live),
            one("backup", &self.backup, &other.backup),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n    ")
    }
}

#[track_caller]
fn digest_of(path: &Path) -> DeepDigest {
    deep::deep_digest(path).unwrap_or_else(|e| panic!("deep digest of {}: {e}", path.display()))
}

/// Trees deeper than this are checked after each `recover` by the
/// identity of their tops and the package's names, not by a digest of
/// every entry (a digest of a 20,000-deep chain takes over a second).
const LIGHT_DEPTH: usize = 3000;

/// Device, inode and ctime of the top of the tree at `path`, if any: what a
/// recovery that renamed, replaced or touched it would change.
fn identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Whether `path` is a directory (not following a symlink).
fn is_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// `d` with its top marked a subvolume, as a conversion makes it.
fn converted(d: &DeepDigest) -> DeepDigest {
    let mut d = d.clone();
    if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
        top.kind = DeepKind::Dir { subvolume: true };
    }
    d
}

// ---------------------------------------------------------------- a tmpfs inside

/// A tmpfs mounted over a directory of the volume, through
/// `/proc/self/fd/<parent>/<name>` (so no path the kernel resolves is
/// long), with a file of its own; unmounted when dropped, whatever
/// happened.
struct Tmpfs {
    parent: OwnedFd,
    name: OsString,
    /// Its path from the volume's top, as digests key it.
    rel: Vec<u8>,
    /// Its own entry, from before the mount.
    entry: DeepEntry,
    mounted: bool,
}

impl Tmpfs {
    fn target(&self) -> PathBuf {
        let mut p = format!("/proc/self/fd/{}/", self.parent.as_raw_fd()).into_bytes();
        p.extend_from_slice(self.name.as_bytes());
        PathBuf::from(OsString::from_vec(p))
    }

    fn mount(parent: OwnedFd, name: &OsStr, rel: Vec<u8>, before: &DeepDigest) -> Tmpfs {
        let entry = before
            .get(&rel)
            .unwrap_or_else(|| panic!("no entry for the mount point {}", rel.escape_ascii()))
            .clone();
        let mut t = Tmpfs {
            parent,
            name: name.to_owned(),
            rel,
            entry,
            mounted: false,
        };
        // The tmpfs's own root looks like the directory it covers, so that
        // only its file tells them apart.
        let data = format!("size=1m,mode={:o},uid=0,gid=0", t.entry.mode);
        let data = std::ffi::CString::new(data).expect("mount options");
        rustix::mount::mount(
            "tmpfs",
            t.target(),
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            data.as_c_str(),
        )
        .unwrap_or_else(|e| panic!("mounting a tmpfs at {}: {e}", t.rel.escape_ascii()));
        t.mounted = true;
        let inside = volume::sys::open_dir_at(t.parent.as_fd(), &t.name).expect("the tmpfs");
        deep::write_at(inside.as_fd(), OsStr::new("on-tmpfs"), b"not the volume's").unwrap();
        t
    }

    fn unmount(&mut self) {
        if self.mounted {
            rustix::mount::unmount(self.target(), rustix::mount::UnmountFlags::empty())
                .unwrap_or_else(|e| panic!("unmounting the tmpfs: {e}"));
            self.mounted = false;
        }
    }

    /// `d`, a digest of the volume while mounted, as the volume's own
    /// content: the tmpfs's entries out, the mount point's own entry in.
    fn strip(&self, mut d: DeepDigest) -> DeepDigest {
        let mut prefix = self.rel.clone();
        prefix.push(b'/');
        let inside: Vec<Vec<u8>> = d
            .entries_mut()
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for k in inside {
            d.entries_mut().remove(&k);
        }
        if let Some(e) = d.entries_mut().get_mut(&self.rel) {
            *e = self.entry.clone();
        }
        d
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = rustix::mount::unmount(self.target(), rustix::mount::UnmountFlags::DETACH);
        }
    }
}

// ---------------------------------------------------------------- one package

/// Where a command left the package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Landed {
    Before,
    After,
}

/// A command's result, once checked against the invariant.
struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
    landed: Landed,
    what: String,
}

impl Ran {
    /// It must have succeeded, into the after-state.
    #[track_caller]
    fn must_succeed(&self) -> &Ran {
        assert!(
            self.ok && self.landed == Landed::After,
            "{} must succeed into the after-state: ok {}, landed {:?}; stdout {:?}, stderr {:?}",
            self.what,
            self.ok,
            self.landed,
            self.stdout,
            self.stderr
        );
        self
    }

    /// It must have been refused, with `needle` on stderr, changing
    /// nothing.
    #[track_caller]
    fn must_refuse(&self, needle: &str) -> &Ran {
        assert!(
            !self.ok && self.landed == Landed::Before,
            "{} must be refused, changing nothing: ok {}, landed {:?}; stdout {:?}, stderr {:?}",
            self.what,
            self.ok,
            self.landed,
            self.stdout,
            self.stderr
        );
        assert!(
            self.stderr.contains(needle),
            "{} must say {needle:?}: {:?}",
            self.what,
            self.stderr
        );
        self
    }

    /// Succeeded into the after-state, or refused changing nothing.
    #[track_caller]
    fn either(&self) -> &Ran {
        assert!(
            self.ok == (self.landed == Landed::After),
            "{}: exit {} but landed {:?}; stdout {:?}, stderr {:?}",
            self.what,
            if self.ok { "0" } else { "non-zero" },
            self.landed,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// One package under test: its root, the tree generated in it, a mount
/// inside, and what it must look like now.
struct Case<'t> {
    fs: &'t LoopFs,
    root: PathBuf,
    pkg: &'static str,
    tree: &'t Tree,
    tmpfs: Option<Tmpfs>,
    expect: Pair,
    commands: u64,
    log: String,
}

impl<'t> Case<'t> {
    fn new(fs: &'t LoopFs, root: PathBuf, pkg: &'static str, tree: &'t Tree) -> Case<'t> {
        Case {
            fs,
            root,
            pkg,
            tree,
            tmpfs: None,
            expect: Pair::default(),
            commands: 0,
            log: String::new(),
        }
    }

    fn live(&self) -> PathBuf {
        self.root.join(self.pkg)
    }

    /// `<pkg>/data/main`, the generated tree's top.
    fn top(&self) -> PathBuf {
        self.live().join("data/main")
    }

    fn backup(&self) -> PathBuf {
        self.root.join(format!("{}.install-backup", self.pkg))
    }

    /// The package's trees as they are (the volume's own content, without
    /// a tmpfs mounted inside).
    fn state(&self) -> Pair {
        let (live, backup) = (self.live(), self.backup());
        // The two digests at once: a deep tree's take seconds each.
        let (live, backup) = thread::scope(|s| {
            let backup = s.spawn(|| is_dir(&backup).then(|| Arc::new(digest_of(&backup))));
            let live = is_dir(&live).then(|| {
                let d = digest_of(&live);
                Arc::new(match &self.tmpfs {
                    Some(t) if t.mounted => t.strip(d),
                    _ => d,
                })
            });
            (live, backup.join().expect("digesting the backup"))
        });
        Pair { live, backup }
    }

    /// Runs a command and holds it to the invariant (see the module
    /// docs); `after` is the state it must leave on success.
    #[track_caller]
    fn step(&mut self, tool: Tool, args: &[&str], after: Pair) -> Ran {
        let what = format!(
            "seed {}: {} {}",
            self.tree.params().seed,
            match tool {
                Tool::Volume => "startos-volume",
                Tool::Migrate => "volume-migrate",
            },
            args.join(" ")
        );
        let out = run_tool(tool, &self.root, args);
        self.commands += 1;
        let ok = out.status.success();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        self.log.push_str(&format!(
            "  {what}: {}\n",
            if ok { "ok" } else { "refused" }
        ));
        if !ok {
            match tool {
                Tool::Volume => assert_eq!(
                    stderr.lines().count(),
                    1,
                    "{what} failed ({}) with other than one line on stderr: {stderr:?}",
                    out.status
                ),
                Tool::Migrate => {
                    let lines: Vec<&str> = common::cli::said(&stderr)
                        .into_iter()
                        .filter(|l| !l.trim_start().starts_with("WARN"))
                        .collect();
                    assert!(
                        lines.len() == 1 && lines[0].contains(&format!("package {}", self.pkg)),
                        "{what} failed ({}) without one line naming package {}: {stderr:?}",
                        out.status,
                        self.pkg
                    );
                }
            }
        }
        let now = self.state();
        // A command that changes nothing lands in both: its exit says which.
        let (is_before, is_after) = (now == self.expect, now == after);
        let landed = if is_after && (ok || !is_before) {
            Landed::After
        } else if is_before {
            Landed::Before
        } else {
            panic!(
                "{what} (exit {}, stderr {stderr:?}) left the package in neither the state \
                 before nor the one after: now {}; before {}, after {}\n  against before:\n    \
                 {}\n  against after:\n    {}",
                out.status,
                now.show(),
                self.expect.show(),
                after.show(),
                self.expect.diff(&now),
                after.diff(&now),
            )
        };
        if landed == Landed::After {
            self.expect = after;
        }
        self.recover(&what);
        Ran {
            ok,
            stdout,
            stderr,
            landed,
            what,
        }
    }

    /// `recover` exits 0, changes nothing, and leaves no name of the
    /// package but its volume and backup (and the backup's record).
    #[track_caller]
    fn recover(&mut self, after: &str) {
        let ids = [identity(&self.live()), identity(&self.backup())];
        let out = run_tool(Tool::Volume, &self.root, &["recover"]);
        self.commands += 1;
        assert!(
            out.status.success(),
            "recover after {after} failed ({}): {}",
            out.status,
            text(&out.stderr)
        );
        if self.tree.stats().max_depth <= LIGHT_DEPTH {
            let now = self.state();
            assert!(
                now == self.expect,
                "recover after {after} changed the package: now {}, was {}\n    {}",
                now.show(),
                self.expect.show(),
                self.expect.diff(&now)
            );
        } else {
            for (path, was) in [self.live(), self.backup()].iter().zip(ids) {
                assert_eq!(
                    was,
                    identity(path),
                    "recover after {after} replaced {}",
                    path.display()
                );
            }
        }
        let mut allowed = vec![
            self.pkg.to_owned(),
            format!("{}.install-backup", self.pkg),
            format!("{}.install-backup.ro", self.pkg),
        ];
        // A tree kept while the tmpfs in it is mounted.
        if self.mounted() {
            allowed.push(format!("{}.held", self.pkg));
        }
        let left: Vec<String> = package_names(&self.root, self.pkg)
            .into_iter()
            .filter(|n| !allowed.contains(n))
            .collect();
        assert!(left.is_empty(), "after {after} and recover: left {left:?}");
    }

    /// `create <pkg> main`: must make a subvolume holding `data/main`,
    /// empty, and nothing else.
    fn create(&mut self) {
        let out = run_tool(Tool::Volume, &self.root, &["create", self.pkg, "main"]);
        self.commands += 1;
        assert!(
            out.status.success(),
            "create {} failed: {}",
            self.pkg,
            text(&out.stderr)
        );
        let now = self.state();
        let live = now.live.as_ref().expect("create made no volume");
        assert!(
            live.len() == 3 && live.get(b"data").is_some() && live.get(b"data/main").is_some(),
            "create must make data/main and nothing else: {} entries",
            live.len()
        );
        assert_eq!(
            live.get(b"").map(|e| &e.kind),
            Some(&DeepKind::Dir { subvolume: true })
        );
        assert!(now.backup.is_none());
        self.expect = now;
        self.recover("create");
    }

    /// Runs `startos-volume <args>`: a command that changes nothing.
    #[track_caller]
    fn read_only(&mut self, args: &[&str]) -> Ran {
        let same = self.expect.clone();
        self.step(Tool::Volume, args, same)
    }

    fn snapshot(&mut self) -> Ran {
        let after = Pair {
            live: self.expect.live.clone(),
            backup: self.expect.live.clone(),
        };
        self.step(Tool::Volume, &["snapshot", self.pkg], after)
    }

    fn restore(&mut self) -> Ran {
        let after = Pair {
            live: self.expect.backup.clone(),
            backup: None,
        };
        self.step(Tool::Volume, &["restore", self.pkg], after)
    }

    fn drop_backup(&mut self) -> Ran {
        let after = Pair {
            live: self.expect.live.clone(),
            backup: None,
        };
        self.step(Tool::Volume, &["drop", self.pkg], after)
    }

    fn delete(&mut self) -> Ran {
        self.step(Tool::Volume, &["delete", self.pkg], Pair::default())
    }

    fn migrate(&mut self, args: &[&str]) -> Ran {
        let after = Pair {
            live: self.expect.live.as_ref().map(|d| Arc::new(converted(d))),
            backup: self.expect.backup.clone(),
        };
        self.step(Tool::Migrate, args, after)
    }

    /// Mounts the tmpfs over the tree's mount point, if it has one.
    fn mount(&mut self) {
        let Some(node) = self.tree.mount_point() else {
            return;
        };
        let parent = self
            .tree
            .open_dir(&self.top(), self.tree.parent(node))
            .expect("opening the mount point's parent");
        let mut rel = b"data/main/".to_vec();
        rel.extend(self.tree.rel_path(node));
        let before = self.expect.live.clone().expect("a volume to mount in");
        self.tmpfs = Some(Tmpfs::mount(parent, self.tree.name(node), rel, &before));
        assert!(
            self.state() == self.expect,
            "the mounted volume's own content must be what it was"
        );
    }

    fn mounted(&self) -> bool {
        self.tmpfs.as_ref().is_some_and(|t| t.mounted)
    }

    fn unmount(&mut self) {
        if let Some(t) = &mut self.tmpfs {
            t.unmount();
        }
        self.tmpfs = None;
    }

    /// What a service does after a backup: rewrites a few files, adds one
    /// at the top. The new state is the expected one.
    fn modify(&mut self, rng: &mut Rng) {
        let files = self.tree.mutable_files();
        for _ in 0..2.min(files.len()) {
            let f = *rng.pick(&files);
            let dir = self
                .tree
                .open_dir(&self.top(), self.tree.parent(f))
                .expect("opening a file's directory");
            let fd = rustix::fs::openat(
                &dir,
                self.tree.name(f),
                rustix::fs::OFlags::WRONLY
                    | rustix::fs::OFlags::TRUNC
                    | rustix::fs::OFlags::NOFOLLOW
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .unwrap_or_else(|e| panic!("rewriting a file: {e}"));
            volume::sys::write_all(fd.as_fd(), &rng.bytes(100)).expect("writing");
        }
        fs::write(self.top().join("written after the backup"), b"new data").expect("adding a file");
        self.expect.live = self.state().live;
    }

    /// Every nested subvolume of the tree is one, read-only as planned.
    fn check_subvolumes(&self, when: &str) {
        for (node, read_only) in self.tree.subvolumes() {
            let fd = self.tree.open_dir(&self.top(), node).unwrap_or_else(|e| {
                panic!(
                    "seed {} {when}: opening a nested subvolume: {e}",
                    self.tree.params().seed
                )
            });
            assert!(
                volume::sys::is_subvolume(fd.as_fd()).unwrap(),
                "seed {} {when}: {} must be a subvolume",
                self.tree.params().seed,
                shown(&self.tree.rel_path(node))
            );
            assert_eq!(
                volume::sys::is_read_only(fd.as_fd()).unwrap(),
                read_only,
                "seed {} {when}: {} must be {}",
                self.tree.params().seed,
                shown(&self.tree.rel_path(node)),
                if read_only { "read-only" } else { "writable" }
            );
        }
    }

    /// Nothing of the package is left: no name, no subvolume.
    fn check_gone(&self, when: &str) {
        assert_eq!(
            package_names(&self.root, self.pkg),
            Vec::<String>::new(),
            "seed {} {when}",
            self.tree.params().seed
        );
        let left = subvolumes_of(self.fs, &self.root, self.pkg);
        assert!(
            left.is_empty(),
            "seed {} {when}: subvolumes left: {left:?}",
            self.tree.params().seed
        );
    }
}

fn shown(path: &[u8]) -> String {
    if path.len() <= 100 {
        path.escape_ascii().to_string()
    } else {
        format!(
            "{}...({} bytes)...{}",
            path[..50].escape_ascii(),
            path.len(),
            path[path.len() - 50..].escape_ascii()
        )
    }
}

// ---------------------------------------------------------------- the flows

/// What one tree did, for the summary.
struct Report {
    stats: Stats,
    commands: u64,
    outcomes: Vec<String>,
}

/// The volume's depth of directories below its own top.
fn volume_depth(tree: &Tree) -> usize {
    TOP_DEPTH + tree.stats().max_dir_depth
}

/// A subvolume volume: `create`, the tree under `data/main`, then
/// snapshot, usage, list, volume-migrate (nothing to do), a restore while
/// a tmpfs is mounted inside (the replaced volume kept until unmounted),
/// drop, snapshot, a service's changes, restore, snapshot, delete.
fn subvolume_flow(tree: &Tree) -> Report {
    let seed = tree.params().seed;
    let fs = LoopFs::btrfs(1 << 30).expect("a btrfs");
    let root = volumes_root(&fs);
    let mut c = Case::new(&fs, root, "sv", tree);
    let mut outcomes = Vec::new();
    c.create();
    tree.build(&c.top())
        .unwrap_or_else(|e| panic!("seed {seed}: building the tree: {e}"));
    c.expect = c.state();
    c.mount();
    c.snapshot().must_succeed();
    assert!(
        c.expect.backup == c.expect.live,
        "seed {seed}: the backup is the volume"
    );
    c.read_only(&["usage", "sv"]).must_succeed();
    c.read_only(&["list"]).must_succeed();
    let same = c.expect.clone();
    c.step(Tool::Migrate, &["--dry-run"], same.clone())
        .must_succeed();
    c.step(Tool::Migrate, &[], same).must_succeed();
    if c.mounted() {
        // A mount inside never stops a restore: the replaced volume, the
        // mount in it, is kept under `.held` until it is unmounted (the
        // next command's recovery then deletes it).
        c.restore().must_succeed();
        assert!(
            c.root.join("sv.held/1").is_dir(),
            "seed {seed}: the replaced volume is kept while mounted"
        );
        c.unmount();
        outcomes
            .push("restored while mounted, the replaced volume kept until unmounted".to_owned());
    }
    c.drop_backup().must_succeed();
    c.snapshot().must_succeed();
    let backup = c.expect.backup.clone();
    let mut rng = Rng::new(seed ^ 0x00C4_A96E);
    c.modify(&mut rng);
    c.restore().must_succeed();
    assert!(c.expect.live == backup, "seed {seed}: restored the backup");
    c.check_subvolumes("after the restore");
    c.read_only(&["list"]).must_succeed();
    c.snapshot().must_succeed();
    c.delete().must_succeed();
    c.check_gone("after the delete");
    Report {
        stats: tree.stats().clone(),
        commands: c.commands,
        outcomes,
    }
}

/// A plain-directory volume: the tree under `<pkg>/data/main`, then
/// snapshot (a reflink copy, or refused: too deep, a mount inside), usage,
/// list, a service's changes and restore (with a backup), volume-migrate
/// refused while mounted, volume-migrate (default method),
/// delete; then the same tree again, volume-migrate --method clone, delete.
fn plain_flow(tree: &Tree) -> Report {
    let seed = tree.params().seed;
    let fs = LoopFs::btrfs(1 << 30).expect("a btrfs");
    let root = volumes_root(&fs);
    let too_deep = volume_depth(tree) > COPY_DEPTH;
    let mut outcomes = Vec::new();
    let mut commands = 0;
    {
        let mut c = Case::new(&fs, root.clone(), "pd", tree);
        fs::create_dir_all(c.top()).unwrap();
        tree.build(&c.top())
            .unwrap_or_else(|e| panic!("seed {seed}: building the tree: {e}"));
        c.expect = c.state();
        c.mount();
        let snap = c.snapshot();
        if too_deep && c.mounted() {
            snap.must_refuse("");
            assert!(
                snap.stderr.contains("deeper than 2048") || snap.stderr.contains("mount"),
                "seed {seed}: a snapshot too deep and with a mount inside must say one: {:?}",
                snap.stderr
            );
        } else if too_deep {
            snap.must_refuse("deeper than 2048");
        } else if c.mounted() {
            snap.must_refuse("mount");
        } else {
            snap.must_succeed();
            assert!(
                snap.stdout.starts_with("reflink copy"),
                "seed {seed}: {}",
                snap.stdout
            );
        }
        if !snap.ok {
            assert_eq!(
                package_names(&root, "pd"),
                ["pd"],
                "seed {seed}: a refused snapshot leaves no backup, whole or partial"
            );
        }
        outcomes.push(format!(
            "snapshot {}",
            if snap.ok { "copied" } else { "refused" }
        ));
        let usage = c.read_only(&["usage", "pd"]);
        if c.mounted() {
            usage.either();
        } else {
            usage.must_succeed();
        }
        c.read_only(&["list"]).must_succeed();
        if c.expect.backup.is_some() {
            let backup = c.expect.backup.clone();
            let mut rng = Rng::new(seed ^ 0x00C4_A96E);
            c.modify(&mut rng);
            c.restore().must_succeed();
            assert!(c.expect.live == backup, "seed {seed}: restored the backup");
            c.check_subvolumes("after the restore");
        }
        if c.mounted() {
            let m = c.migrate(&[]);
            m.must_refuse("pd");
            c.unmount();
            outcomes.push("volume-migrate refused while mounted".to_owned());
        }
        let m = c.migrate(&[]);
        m.either();
        if !too_deep {
            m.must_succeed();
        }
        if m.ok {
            c.check_subvolumes("after volume-migrate");
        }
        outcomes.push(format!(
            "volume-migrate {}",
            if m.ok { "converted" } else { "refused" }
        ));
        c.delete().must_succeed();
        c.check_gone("after the delete");
        commands += c.commands;
    }
    // The same tree again, in a root of its own, converted by clone.
    let root2 = fs.path("volumes2");
    fs::create_dir_all(&root2).unwrap();
    let mut c = Case::new(&fs, root2, "pd", tree);
    fs::create_dir_all(c.top()).unwrap();
    tree.build(&c.top())
        .unwrap_or_else(|e| panic!("seed {seed}: building the tree again: {e}"));
    c.expect = c.state();
    let m = c.migrate(&["--method", "clone"]);
    if too_deep {
        m.must_refuse("deeper than 2048");
    } else {
        m.must_succeed();
        c.check_subvolumes("after volume-migrate --method clone");
    }
    outcomes.push(format!(
        "volume-migrate --method clone {}",
        if m.ok { "converted" } else { "refused" }
    ));
    c.read_only(&["list"]).must_succeed();
    c.delete().must_succeed();
    c.check_gone("after the delete");
    commands += c.commands;
    Report {
        stats: tree.stats().clone(),
        commands,
        outcomes,
    }
}

/// Held to write by a tree with a mount, to read by the others.
static MOUNTS: RwLock<()> = RwLock::new(());

fn one_tree(seed: u64) -> Report {
    let params = Params::from_seed(seed);
    let tree = Tree::generate(&params);
    eprintln!(
        "seed {seed} ({:?} volume; replay with GEN_SEED={seed}): {}",
        params.volume,
        tree.stats()
    );
    // A mount is seen by every command on the machine (they read every
    // mount namespace's table): a tree with one runs alone, so that what
    // a seed does never depends on what else runs.
    let _alone = if params.mount {
        Err(MOUNTS.write().unwrap_or_else(|e| e.into_inner()))
    } else {
        Ok(MOUNTS.read().unwrap_or_else(|e| e.into_inner()))
    };
    let started = Instant::now();
    let report = match params.volume {
        VolumeShape::Subvolume => subvolume_flow(&tree),
        VolumeShape::Plain => plain_flow(&tree),
    };
    eprintln!(
        "seed {seed}: {} commands, all passing, in {:.1} s; {}",
        report.commands,
        started.elapsed().as_secs_f64(),
        report.outcomes.join(", ")
    );
    report
}

// ---------------------------------------------------------------- the run

/// What the fixed seeds must hold between them, per kind of volume.
#[derive(Default)]
struct Coverage {
    deepest: usize,
    longest: usize,
    most_subvolumes: u64,
    stats: Stats,
    at_limit: bool,
    past_limit: bool,
}

impl Coverage {
    fn add(&mut self, s: &Stats) {
        self.deepest = self.deepest.max(s.max_depth);
        self.longest = self.longest.max(s.longest_path);
        self.most_subvolumes = self.most_subvolumes.max(s.subvolumes);
        self.at_limit |= TOP_DEPTH + s.max_dir_depth == COPY_DEPTH;
        self.past_limit |= TOP_DEPTH + s.max_dir_depth == COPY_DEPTH + 1;
        self.stats.add(s);
    }

    fn missing(&self, shape: VolumeShape) -> Vec<&'static str> {
        let s = &self.stats;
        let mut out = Vec::new();
        for (ok, what) in [
            (self.deepest >= 20_000, "a 20,000-deep chain"),
            (self.longest > 32 << 10, "a path past 32 KiB"),
            (self.most_subvolumes >= 200, "200+ nested subvolumes"),
            (s.read_only > 0, "a read-only nested subvolume"),
            (s.fifos > 0, "a FIFO"),
            (s.sockets > 0, "a socket"),
            (s.char_devices > 0, "a character device"),
            (s.block_devices > 0, "a block device"),
            (s.hardlinks > 0, "a hardlink"),
            (s.symlinks > 0, "a symlink"),
            (s.sparse > 0, "a sparse file"),
            (s.xattrs > 0, "an xattr"),
            (s.immutable > 0, "an immutable flag"),
            (s.append > 0, "an append-only flag"),
            (s.nocow > 0, "a NOCOW flag"),
            (s.mounts > 0, "a mount inside"),
        ] {
            if !ok {
                out.push(what);
            }
        }
        if shape == VolumeShape::Plain {
            if !self.at_limit {
                out.push("a plain tree 2,048 levels deep");
            }
            if !self.past_limit {
                out.push("a plain tree 2,049 levels deep");
            }
        }
        out
    }
}

fn seeds() -> (Vec<u64>, bool) {
    if let Some(spec) = std::env::var_os("GEN_SEED") {
        let spec = spec.to_string_lossy().into_owned();
        fn bad<T>(spec: &str) -> T {
            panic!("GEN_SEED must be a seed, a list (3,5,8) or a range (0..40): {spec:?}")
        }
        let mut seeds = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once("..") {
                Some((a, b)) => {
                    let (a, b): (u64, u64) = match (a.parse(), b.parse()) {
                        (Ok(a), Ok(b)) => (a, b),
                        _ => bad(&spec),
                    };
                    seeds.extend(a..b);
                }
                None => seeds.push(part.parse().unwrap_or_else(|_| bad(&spec))),
            }
        }
        return (seeds, false);
    }
    let mut seeds = FIXED_SEEDS.to_vec();
    if std::env::var_os("GEN_FULL").is_some() {
        let count = std::env::var("GEN_COUNT")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(FULL_COUNT);
        seeds.extend((1000..).take(count as usize));
        return (seeds, false);
    }
    (seeds, true)
}

#[test]
fn generated_trees_through_every_command() {
    drop(fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE)));
    let started = Instant::now();
    let (seeds, fixed) = seeds();
    // Trees with a mount run alone: first, then the largest first, so that
    // the two workers end together.
    let mut order: Vec<(bool, u64, u64)> = seeds
        .iter()
        .map(|&s| {
            let p = Params::from_seed(s);
            let cost = Tree::generate(&p).stats().entries;
            (!p.mount, u64::MAX - cost, s)
        })
        .collect();
    order.sort();
    let queue = Arc::new(Mutex::new(
        order.iter().map(|&(_, _, s)| s).collect::<VecDeque<u64>>(),
    ));
    let results = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..WORKERS.min(seeds.len()))
        .map(|_| {
            let (queue, results) = (queue.clone(), results.clone());
            thread::spawn(move || {
                loop {
                    let Some(seed) = queue.lock().unwrap().pop_front() else {
                        break;
                    };
                    let r = catch_unwind(AssertUnwindSafe(|| one_tree(seed))).map_err(|p| {
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "a panic".to_owned())
                    });
                    results.lock().unwrap().push((seed, r));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker");
    }
    let results = std::mem::take(&mut *results.lock().unwrap());
    let mut all = Stats::default();
    let mut cover = [Coverage::default(), Coverage::default()];
    let mut failed = Vec::new();
    let mut shapes = [0, 0];
    for (seed, r) in &results {
        // What a tree holds is its seed's, whether it passed or not.
        let params = Params::from_seed(*seed);
        let stats = match r {
            Ok(rep) => rep.stats.clone(),
            Err(_) => Tree::generate(&params).stats().clone(),
        };
        let k = usize::from(params.volume == VolumeShape::Plain);
        all.add(&stats);
        shapes[k] += 1;
        cover[k].add(&stats);
        if let Err(msg) = r {
            failed.push(format!(
                "seed {seed} ({:?}; replay with GEN_SEED={seed}): {msg}",
                params.volume
            ));
        }
    }
    println!(
        "generated trees: {} trees ({} subvolume volumes, {} plain directories), {} entries in \
         all, max depth {}, longest path {} bytes, {} nested subvolumes, {} specials, {} flags, \
         {} mounts, {} commands run, {} in {:.1} s",
        results.len(),
        shapes[0],
        shapes[1],
        all.entries,
        all.max_depth,
        all.longest_path,
        all.subvolumes,
        all.specials(),
        all.flagged(),
        all.mounts,
        COMMANDS.load(Ordering::Relaxed),
        if failed.is_empty() {
            "all passing".to_owned()
        } else {
            format!("{} of {} trees FAILED", failed.len(), results.len())
        },
        started.elapsed().as_secs_f64()
    );
    if fixed {
        for (k, shape) in [(0, VolumeShape::Subvolume), (1, VolumeShape::Plain)] {
            let missing = cover[k].missing(shape);
            assert!(
                missing.is_empty(),
                "the fixed seeds' {shape:?} trees lack: {}",
                missing.join(", ")
            );
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} trees failed:\n{}",
        failed.len(),
        results.len(),
        failed.join("\n")
    );
}
