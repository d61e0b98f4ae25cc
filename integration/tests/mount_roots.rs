//! A container with a root of its own (LXC's rootfs, entered through
//! `pivot_root`) names its mount points, in its mountinfo, as paths from
//! that root. A package can mount anything in its container at the path
//! this process sees another package's volume at, or the `<pkg>.delete`,
//! `<pkg>.replaced` or `<pkg>.held/<n>` the store keeps one under: such a
//! mount must never keep that package's tree held, nor have its conversion
//! refused. A bind mount of the volume in such a container, the data it
//! really shows, still counts (by its source), wherever it is mounted.
//! On real btrfs, each container a process in a mount namespace of its own
//! whose root is a tmpfs, with the host's programs bind-mounted in; and
//! one in a user namespace too, whose root is a FUSE filesystem (bindfs)
//! that answers root's stat of it with EACCES.

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;
use integration::{LoopFs, fs_or_skip};
use volume::VolumeStore;
use volume_migrate::{MigrateOptions, Migrator, Progress};

/// A container: a process in a mount namespace of its own, whose root is
/// a tmpfs it mounted at `rootfs` (seen in its namespace only) and then
/// pivoted into, the host's old root unmounted from it; or, from
/// [`Container::on_fuse`], a FUSE root. Its process group (the FUSE
/// server too) is killed on drop.
struct Container {
    child: Child,
}

/// The script's lines that put the host's programs in `$R` (a mount made
/// in the container's namespace), to be its root.
fn programs_in_r() -> String {
    "mkdir -p \"$R/usr\"; mount --bind /usr \"$R/usr\"; \
     for l in bin sbin lib lib64; do \
       if [ -L \"/$l\" ]; then cp -P \"/$l\" \"$R/$l\"; \
       elif [ -d \"/$l\" ]; then mkdir \"$R/$l\"; mount --bind \"/$l\" \"$R/$l\"; fi; \
     done; "
        .to_owned()
}

/// The script's lines that mount a tmpfs at each of `spoofed` (absolute
/// paths as this process spells them) inside `$R`.
fn spoofs_in_r(spoofed: &[PathBuf]) -> String {
    spoofed
        .iter()
        .map(|p| {
            format!(
                "mkdir -p \"$R{p}\"; mount -t tmpfs spoof \"$R{p}\"; ",
                p = p.display()
            )
        })
        .collect()
}

impl Container {
    /// Starts one with a tmpfs at each of `spoofed` (absolute paths as this
    /// process spells them, made inside the container's root) and, if
    /// given, `bind` (a directory of this namespace) bind-mounted at
    /// `/data` in it.
    fn start(rootfs: &Path, spoofed: &[PathBuf], bind: Option<&Path>) -> Container {
        fs::create_dir_all(rootfs).unwrap();
        let mut script = format!(
            "set -e; R='{}'; mount -t tmpfs rootfs \"$R\"; \
             mkdir -p \"$R/proc\" \"$R/old\"; mount -t proc proc \"$R/proc\"; ",
            rootfs.display()
        );
        script += &programs_in_r();
        script += &spoofs_in_r(spoofed);
        if let Some(src) = bind {
            script += &format!(
                "mkdir \"$R/data\"; mount --bind '{}' \"$R/data\"; ",
                src.display()
            );
        }
        script += "cd \"$R\"; pivot_root . old; umount -l /old; echo ready; exec sleep 600";
        let container = Container::spawn(&[], &script);
        container.assert_spoofs(spoofed);
        container
    }

    /// Starts one in a user namespace of its own too, whose root is a
    /// bindfs (FUSE) mount at `dir/root` of a tmpfs at `dir/src`, with a
    /// tmpfs at each of `spoofed`: root's stat of its root fails (FUSE
    /// answers anyone outside the user namespace that mounted it EACCES).
    /// Entered by `chroot`: the FUSE server, in its namespace too, keeps
    /// our root, and the container must be the namespace's lowest process.
    fn on_fuse(dir: &Path, spoofed: &[PathBuf]) -> Container {
        if Command::new("bindfs").arg("--version").output().is_err() {
            panic!("bindfs is missing: run `make deps`");
        }
        let (src, root) = (dir.join("src"), dir.join("root"));
        fs::create_dir_all(&src).unwrap();
        fs::create_dir_all(&root).unwrap();
        let mut script = format!(
            "set -e; R='{src}'; mount -t tmpfs src \"$R\"; ",
            src = src.display()
        );
        script += &programs_in_r();
        for p in spoofed {
            script += &format!("mkdir -p \"$R{}\"; ", p.display());
        }
        script += &format!(
            "bindfs -f \"$R\" '{root}' & i=0; \
             while ! grep -qF ' {root} ' /proc/self/mountinfo; do \
               i=$((i+1)); [ $i -lt 1000 ] || exit 1; sleep 0.01; \
             done; R='{root}'; ",
            root = root.display()
        );
        for p in spoofed {
            script += &format!("mount -t tmpfs spoof \"$R{}\"; ", p.display());
        }
        script += "echo ready; exec chroot \"$R\" /usr/bin/sleep 600";
        let container = Container::spawn(&["--user", "--map-root-user"], &script);
        let root_stat = fs::metadata(format!("/proc/{}/root", container.pid()));
        assert_eq!(
            root_stat.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::PermissionDenied),
            "the FUSE root must refuse root's stat"
        );
        container.assert_lowest_in_its_namespace();
        container.assert_spoofs(spoofed);
        container
    }

    /// Runs `script` under `unshare --mount` (and `namespaces`) in a
    /// process group of its own, until it says "ready" and is `sleep`.
    fn spawn(namespaces: &[&str], script: &str) -> Container {
        let mut child = Command::new("unshare")
            .args(namespaces)
            .args(["--mount", "--propagation", "private", "sh", "-c", script])
            .process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare");
        let stdout = child.stdout.take().unwrap();
        let container = Container { child };
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the container could not start");
        container.wait_for_sleep();
        container
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// "ready" comes before the exec: waits for the process to be the
    /// `sleep` that messages name.
    fn wait_for_sleep(&self) {
        let comm = format!("/proc/{}/comm", self.pid());
        let start = std::time::Instant::now();
        while fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
            assert!(start.elapsed().as_secs() < 10, "never became sleep");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// What the test stands on: the container's root is not ours, and its
    /// mountinfo spells each spoofed mount point as this process spells
    /// the path.
    fn assert_spoofs(&self, spoofed: &[PathBuf]) {
        let id = |p: &str| fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
        assert_ne!(id(&format!("/proc/{}/root", self.pid())), id("/"));
        let table = fs::read(format!("/proc/{}/mountinfo", self.pid())).unwrap();
        let table = String::from_utf8_lossy(&table);
        for p in spoofed {
            let p = p.display().to_string();
            assert!(
                table.lines().any(|l| l.split(' ').nth(4) == Some(&p)),
                "{p} not in the container's table:\n{table}"
            );
        }
    }

    /// The mount tables are read through a namespace's lowest process:
    /// the container, not the FUSE server beside it.
    fn assert_lowest_in_its_namespace(&self) {
        let ns = |pid: &str| fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        let own = ns(&self.pid().to_string());
        assert!(own.is_some());
        for entry in fs::read_dir("/proc").unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if let Ok(pid) = name.parse::<u32>() {
                assert!(pid >= self.pid() || ns(&name) != own, "pid {pid}");
            }
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let group = rustix::process::Pid::from_raw(self.pid() as i32);
        if let Some(group) = group {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `app`, a volume with `state` in it and a backup of it.
fn app(root: &Path) -> VolumeStore {
    let store = VolumeStore::open(root).unwrap();
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    assert!(store.snapshot(&pkg("app")).expect("snapshot").created());
    store
}

/// app deleted, nothing of it kept under `app.held`: no spoof held it.
fn deleted_holding_nothing(store: &VolumeStore, root: &Path) {
    let deleted = store.delete_outcome(&pkg("app")).expect("delete");
    assert!(deleted.deleted);
    assert!(
        deleted.held.is_none(),
        "the container's own tmpfs held app's deleted volume: {:?}",
        deleted.held
    );
    assert!(!root.join("app.held").exists());
}

/// Today a tmpfs a package mounts in its own container at `app.delete`
/// (or `app.replaced`) keeps app's deleted (replaced) volume under
/// `app.held`, for as long as that container runs.
#[test]
fn a_mount_at_a_removed_volumes_path_in_a_containers_own_root_holds_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = app(&root);
    let spoof = Container::start(
        &fs.path("lxc/evil/rootfs"),
        &[root.join("app.replaced"), root.join("app.delete")],
        None,
    );

    let restored = store.restore_outcome(&pkg("app")).expect("restore");
    assert!(restored.restored);
    assert!(
        restored.held.is_none(),
        "the container's own tmpfs held app's replaced volume: {:?}",
        restored.held
    );
    deleted_holding_nothing(&store, &root);
    assert!(!root.join("app").exists());
    drop(spoof);
}

/// Today a tmpfs a package mounts in its own container at `app.held/1`
/// keeps that tree after its real holder is gone, for as long as the
/// container runs.
#[test]
fn a_mount_at_a_held_trees_path_in_a_containers_own_root_keeps_it_no_longer() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = app(&root);
    let holder = NsHolder::bind(&root.join("app/data/main"), &fs.path("lxc/dep/data"));
    let deleted = store.delete_outcome(&pkg("app")).expect("delete");
    assert!(deleted.held.is_some(), "the dependent holds it");
    assert!(root.join("app.held/1/data/main/state").exists());
    let spoof = Container::start(
        &fs.path("lxc/evil/rootfs"),
        &[root.join("app.held/1")],
        None,
    );

    drop(holder);
    let recovered = store.recover(&pkg("app")).expect("recover");
    assert!(
        !root.join("app.held").exists(),
        "kept for the container's own tmpfs: {:?}",
        recovered.actions
    );
    drop(spoof);
}

/// The same with the container's root a FUSE filesystem its own user
/// namespace mounted, which root may not stat: a root that cannot be
/// stat'ed must not be taken for ours.
#[test]
fn a_mount_at_a_deleted_volumes_path_in_a_containers_fuse_root_holds_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = app(&root);
    let spoof = Container::on_fuse(&fs.path("lxc/evil"), &[root.join("app.delete")]);
    deleted_holding_nothing(&store, &root);
    drop(spoof);
}

fn no_progress(_: &Progress) {}

/// Today a tmpfs a package mounts in its own container at another
/// package's volume path (or below it) has that package's conversion
/// refused, "in use".
#[test]
fn a_mount_at_a_volumes_path_in_a_containers_own_root_refuses_no_conversion() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    let spoof = Container::start(
        &fs.path("lxc/evil/rootfs"),
        &[root.join("app"), root.join("app/data/main/tmp")],
        None,
    );
    let m = Migrator::open(&root).unwrap();
    m.convert(&pkg("app"), &MigrateOptions::default(), &mut no_progress)
        .expect("the container's own tmpfs must not refuse app's conversion");
    assert!(is_subvolume(&root.join("app")));
    assert_eq!(fs::read(root.join("app/data/main/state")).unwrap(), b"v1");
    drop(spoof);
}

/// A bind mount of the volume inside a container with a root of its own
/// is found by its source: a delete keeps the volume while it is mounted
/// and names the container and its mount point (as the container spells
/// it), a conversion refuses it, and the tree is reclaimed once the
/// container is gone.
#[test]
fn a_bind_mount_in_a_containers_own_root_still_holds_the_volume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    let plain = Container::start(
        &fs.path("lxc/plain/rootfs"),
        &[],
        Some(&root.join("plain/data/main")),
    );
    let m = Migrator::open(&root).unwrap();
    let e = m
        .convert(&pkg("plain"), &MigrateOptions::default(), &mut no_progress)
        .expect_err("a bound volume must be refused");
    assert!(e.to_string().contains("mounted at /data"), "{e}");
    assert!(!is_subvolume(&root.join("plain")));
    drop(plain);

    let store = app(&root);
    let container = Container::start(
        &fs.path("lxc/app/rootfs"),
        &[],
        Some(&root.join("app/data/main")),
    );
    let deleted = store.delete_outcome(&pkg("app")).expect("delete");
    let held = deleted.held.expect("the container's bind mount holds it");
    assert!(
        held.holders.iter().any(|h| h.pid == container.pid()
            && !h.own_namespace
            && h.mount_point == Path::new("/data")),
        "{held:?}"
    );
    assert_eq!(
        fs::read(root.join("app.held/1/data/main/state")).unwrap(),
        b"v1"
    );
    store.recover(&pkg("app")).unwrap();
    assert!(root.join("app.held/1").exists(), "still mounted: kept");
    drop(container);
    store.recover(&pkg("app")).unwrap();
    assert!(!root.join("app.held").exists(), "reclaimed once unmounted");
}
