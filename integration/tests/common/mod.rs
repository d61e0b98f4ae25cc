//! Helpers shared by the `volume` test files (`volume_ops.rs`, `volume_crash.rs`).
//!
//! Each test file compiles this module on its own and uses a different subset.
#![allow(dead_code)]

pub mod box48;
pub mod cli;
pub mod rich;
pub mod sweep;

use std::fs::{self, File, OpenOptions};
use std::io::BufRead;
use std::os::unix::fs::{FileExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use integration::{LoopFs, TreeDigest, run, tree_digest};
use volume::{PackageId, VolumeId};

pub const MIB: u64 = 1 << 20;
/// Every btrfs test filesystem: small (the image is sparse), so many fit in parallel.
pub const BTRFS_SIZE: u64 = 512 * MIB;

/// Name suffixes that only exist while an operation is in flight. None may be left
/// under the volumes root once an operation (or recovery) has returned.
pub const TRANSIENT_SUFFIXES: &[&str] = &[
    ".rollback",
    ".rollback.id",
    ".replaced",
    ".install-backup.tmp",
    ".install-backup.drop",
    ".delete",
];

pub fn pkg(id: &str) -> PackageId {
    id.parse()
        .unwrap_or_else(|e| panic!("test package id {id:?}: {e}"))
}

pub fn vol(id: &str) -> VolumeId {
    id.parse()
        .unwrap_or_else(|e| panic!("test volume id {id:?}: {e}"))
}

/// `<mount point>/volumes`, created: the store's root, like upstream's
/// `package-data/volumes` on the data filesystem.
pub fn volumes_root(fs: &LoopFs) -> PathBuf {
    let root = fs.path("volumes");
    fs::create_dir_all(&root).expect("creating the volumes root");
    root
}

/// `btrfs subvolume create <path>`, as a package's own process could do.
pub fn subvolume_create(path: &Path) {
    run(Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(path))
    .unwrap_or_else(|e| panic!("btrfs subvolume create {}: {e}", path.display()));
}

/// Whether `path` is a read-only subvolume, as `btrfs property get` reports it.
pub fn is_read_only(path: &Path) -> bool {
    let out = run(Command::new("btrfs")
        .args(["property", "get", "-ts"])
        .arg(path)
        .arg("ro"))
    .unwrap_or_else(|e| panic!("btrfs property get {}: {e}", path.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    match text.trim() {
        "ro=true" => true,
        "ro=false" => false,
        other => panic!("unexpected `btrfs property get ro` output for {path:?}: {other:?}"),
    }
}

/// Paths (relative to the mount point) of every subvolume that `btrfs subvolume
/// list` shows for package `id` of the volumes root `volumes/`: its volume,
/// backup or any transient name, and anything nested in them.
pub fn package_subvolumes(fs: &LoopFs, id: &str) -> Vec<String> {
    subvolumes_of(fs, &fs.path("volumes"), id)
}

/// Every subvolume `btrfs subvolume list` shows for `pkg` in `root`: its
/// volume, backup, any other name of it, and anything nested in them.
pub fn subvolumes_of(fs: &LoopFs, root: &Path, pkg: &str) -> Vec<String> {
    let out = run(Command::new("btrfs")
        .args(["subvolume", "list"])
        .arg(fs.mount_point()))
    .expect("btrfs subvolume list");
    let rel = root
        .strip_prefix(fs.mount_point())
        .expect("a root on the filesystem")
        .to_string_lossy()
        .into_owned();
    let live = format!("{rel}/{pkg}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once(" path ").map(|(_, p)| p.to_owned()))
        .filter(|p| {
            p == &live || p.starts_with(&format!("{live}/")) || p.starts_with(&format!("{live}."))
        })
        .collect()
}

/// Where the store keeps the lock of package `id` for the volumes root `root`.
pub fn lock_path(root: &Path, id: &str) -> PathBuf {
    let dir = volume::sys::open_dir_path(root).expect("opening the volumes root");
    volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir))
        .expect("opening the lock directory")
        .path()
        .join(id)
}

/// Names in the volumes root, sorted, once this process's background
/// purges are done (start-core's restore and delete leave the tree they
/// replaced in the root's `.trash` for a background thread to delete).
pub fn root_names(root: &Path) -> Vec<String> {
    volume::purge::wait_purged();
    let mut names: Vec<String> = fs::read_dir(root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .map(|e| {
            e.expect("reading a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// The names under `root` that belong to `pkg` (itself, its backup, any
/// transient name or record).
pub fn package_names(root: &Path, pkg: &str) -> Vec<String> {
    root_names(root)
        .into_iter()
        .filter(|n| n == pkg || n.starts_with(&format!("{pkg}.")))
        .collect()
}

/// Transient names (see [`TRANSIENT_SUFFIXES`]) left in the volumes root.
pub fn transient_names(root: &Path) -> Vec<String> {
    root_names(root)
        .into_iter()
        .filter(|n| TRANSIENT_SUFFIXES.iter().any(|s| n.ends_with(s)))
        .collect()
}

#[track_caller]
pub fn assert_no_transient_names(root: &Path, when: &str) {
    let left = transient_names(root);
    assert!(
        left.is_empty(),
        "{when}: transient names left in {}: {left:?}",
        root.display()
    );
}

/// A digest of a volume for comparing its content across snapshot, restore and
/// crash recovery.
///
/// Digest of the tree at `path`, everything compared: content, types, modes,
/// owners, xattrs, hard links, which directories are subvolumes, and every file
/// and directory mtime. (A restore puts back the times of the directories it
/// touches: the top, which held its completion marker, and the parents of nested
/// subvolumes, whose placeholders a recursive snapshot replaces.)
pub fn digest(path: &Path) -> TreeDigest {
    tree_digest(path).unwrap_or_else(|e| panic!("digest of {}: {e}", path.display()))
}

#[track_caller]
pub fn assert_same(expected: &TreeDigest, actual: &TreeDigest, what: &str) {
    let diff = expected.diff(actual);
    assert!(
        diff.is_empty(),
        "{what}: trees differ (left = expected, right = actual):\n  {}",
        diff.join("\n  ")
    );
}

/// Deterministic, incompressible-looking bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn write(path: &Path, data: &[u8]) {
    fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn mkdir(path: &Path) {
    fs::create_dir_all(path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
}

/// Fills a package volume (`<root>/<pkg>`, with `data/main` already there) the way
/// a service would: files, a subdirectory, a hard link, a symlink, the data version,
/// a second volume, and, on btrfs with `nested`, a subvolume the package made inside
/// its data (`data/main/nested`) with another one two levels down
/// (`data/main/nested/deeper/inner`).
pub fn populate_volume(vol: &Path, nested: bool) {
    let main = vol.join("data/main");
    write(&vol.join("data/.version"), b"0.3.5\n");
    write(&main.join("config.toml"), b"[server]\nport = 8080\n");
    mkdir(&main.join("db"));
    write(&main.join("db/data.mdb"), &bytes(1, 300_000));
    write(&main.join("db/lock.mdb"), &bytes(2, 8192));
    fs::hard_link(main.join("db/data.mdb"), main.join("db/data.mdb.link"))
        .expect("hard link in the volume");
    symlink("db/data.mdb", main.join("current")).expect("symlink in the volume");
    mkdir(&vol.join("data/other"));
    write(&vol.join("data/other/notes"), b"other volume\n");
    if nested {
        subvolume_create(&main.join("nested"));
        write(&main.join("nested/blob"), &bytes(3, 200_000));
        mkdir(&main.join("nested/deeper"));
        subvolume_create(&main.join("nested/deeper/inner"));
        write(&main.join("nested/deeper/inner/wal"), &bytes(4, 50_000));
    }
}

/// Changes a volume filled by [`populate_volume`]: a file rewritten, one added, one
/// removed, in the top subvolume and, with `nested`, in both nested ones.
pub fn modify_volume(vol: &Path, nested: bool) {
    let main = vol.join("data/main");
    write(&main.join("config.toml"), b"[server]\nport = 9090\n");
    write(&main.join("new-after-snapshot"), b"new\n");
    fs::remove_file(main.join("db/lock.mdb")).expect("removing a file");
    let f = OpenOptions::new()
        .write(true)
        .open(main.join("db/data.mdb"))
        .expect("opening data.mdb");
    f.write_all_at(b"rewritten page", 4096)
        .expect("rewriting a page");
    fs::remove_file(vol.join("data/other/notes")).expect("removing notes");
    if nested {
        write(&main.join("nested/added"), b"added\n");
        write(&main.join("nested/deeper/inner/wal"), &bytes(5, 60_000));
        fs::remove_file(main.join("nested/blob")).expect("removing blob");
    }
}

/// Writes and reads back a file at `path`, proving its directory is writable.
#[track_caller]
pub fn assert_writable(dir: &Path) {
    let probe = dir.join("writable-probe");
    let mut f =
        File::create(&probe).unwrap_or_else(|e| panic!("{} must be writable: {e}", dir.display()));
    std::io::Write::write_all(&mut f, b"probe").expect("writing the probe");
    drop(f);
    assert_eq!(fs::read(&probe).expect("reading the probe"), b"probe");
    fs::remove_file(&probe).expect("removing the probe");
}

/// A mount made by a test, unmounted (lazily if need be) when dropped, so that a
/// failing test never leaves it behind to block the loop filesystem's teardown.
pub struct MountGuard {
    target: PathBuf,
    mounted: bool,
}

impl MountGuard {
    /// `mount --bind <source> <target>`; creates `target`.
    pub fn bind(source: &Path, target: &Path) -> Self {
        mkdir(target);
        run(Command::new("mount").arg("--bind").arg(source).arg(target))
            .unwrap_or_else(|e| panic!("bind mount: {e}"));
        MountGuard {
            target: target.to_path_buf(),
            mounted: true,
        }
    }

    /// A small tmpfs at `target`; creates `target`.
    pub fn tmpfs(target: &Path) -> Self {
        mkdir(target);
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(target))
        .unwrap_or_else(|e| panic!("tmpfs mount: {e}"));
        MountGuard {
            target: target.to_path_buf(),
            mounted: true,
        }
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    pub fn unmount(mut self) {
        run(Command::new("umount").arg(&self.target))
            .unwrap_or_else(|e| panic!("umount {}: {e}", self.target.display()));
        self.mounted = false;
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.target).output();
        }
    }
}

/// Runs `recover` until `<root>/<pkg>.held` is gone, for at most 10 s,
/// after the last mount of it this test made is gone: a mount made in this
/// namespace is copied into any mount namespace another process on the
/// machine makes meanwhile (`unshare -m` copies every mount), which holds
/// the tree too until that process exits. Panics naming what still holds it.
#[track_caller]
pub fn reclaimed_eventually(root: &Path, pkg: &str, mut recover: impl FnMut()) {
    let held = root.join(format!("{pkg}.held"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        recover();
        if !held.exists() {
            return;
        }
        if std::time::Instant::now() > deadline {
            let uses = volume::mounts::uses_of(&held).unwrap_or_default();
            panic!(
                "{} still kept after 10 s, held by: {}",
                held.display(),
                volume::mounts::describe(&uses)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The `volume-migrate` binary beside this test's (built by
/// `cargo build --bins --features volume-migrate/cli`, as `make test` does).
pub fn volume_migrate_bin() -> PathBuf {
    integration::workspace_bin("volume-migrate")
        .unwrap_or_else(|e| panic!("{e}: run `cargo build --bins --features volume-migrate/cli`"))
}

/// Whether `path` is the root of a btrfs subvolume (inode 256).
pub fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

/// The UUID of the subvolume at `path`.
pub fn uuid_of(path: &Path) -> [u8; 16] {
    use std::os::fd::AsFd;
    let dir = File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    volume::sys::subvolume_info(dir.as_fd())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .uuid
}

/// The entries of the volumes root `root`'s trash, sorted (none if it is
/// absent).
pub fn trash_entries(root: &Path) -> Vec<String> {
    let Ok(dir) = fs::read_dir(root.join(volume::layout::TRASH_DIR)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = dir
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The options start-core's boot converts with: the cut deferred, the old
/// trees left to the background cleanup.
pub fn boot_opts() -> volume_migrate::MigrateOptions {
    volume_migrate::MigrateOptions {
        remove_old: false,
        defer_cut: true,
        ..volume_migrate::MigrateOptions::default()
    }
}

/// Which of `packages` under `root` are subvolumes now, each with its
/// UUID: what a rerun must not convert again.
pub fn converted<'a>(
    root: &std::path::Path,
    packages: impl IntoIterator<Item = &'a String>,
) -> Vec<(String, [u8; 16])> {
    packages
        .into_iter()
        .filter(|p| is_subvolume(&root.join(p)))
        .map(|p| (p.clone(), uuid_of(&root.join(p))))
        .collect()
}

/// A process in a mount namespace of its own, holding a bind mount of
/// `source` at `target`, as a container holds a dependency's volume. Killed
/// on drop.
pub struct NsHolder {
    child: std::process::Child,
}

impl NsHolder {
    pub fn bind(source: &Path, target: &Path) -> NsHolder {
        fs::create_dir_all(target).unwrap();
        let script = format!(
            "mount --bind '{}' '{}' && echo ready && exec sleep 600",
            source.display(),
            target.display()
        );
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("unshare");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the holder could not mount");
        // "ready" comes before the exec: wait for the process to be the
        // `sleep` that messages name.
        let comm = format!("/proc/{}/comm", child.id());
        let start = std::time::Instant::now();
        while fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
            assert!(
                start.elapsed().as_secs() < 10,
                "the holder never became sleep"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        NsHolder { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NsHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
