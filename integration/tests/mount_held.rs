//! A dependent's mount of a volume (upstream's dependency `mount` effect
//! bind-mounts another package's `data_dir` into the dependent's container,
//! read-only or writable, in the container's own mount namespace) never
//! makes a rollback or an uninstall fail: the tree taken off the volume's
//! name is kept under `<pkg>.held/<n>` while any mount holds it, with
//! everything written through that mount, the holders are named, and the
//! tree is reclaimed once the last mount is gone. On real btrfs, with the
//! mounts held by a process in a mount namespace of its own.

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};

use common::cli::{must_succeed, text};
use common::*;
use integration::{LoopFs, fs_or_skip};
use startos_core::volume::{
    self as core_volume, BootProgress, InstallBackup, boot_volume_maintenance_at,
};
use volume::VolumeStore;

fn volume_cli(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let bin = integration::workspace_bin("startos-volume")
        .unwrap_or_else(|e| panic!("{e}; run `make test`"));
    let mut cmd = Command::new(bin);
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).output().expect("startos-volume")
}

/// A dependent's container: a process in a mount namespace of its own
/// holding a read-only and a writable bind mount of `source` (a volume's
/// `data_dir`), which writes `after` through the writable one when told
/// to. Killed on drop.
struct Dependent {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    ro: PathBuf,
    rw: PathBuf,
}

impl Dependent {
    fn mount(source: &Path, at: &Path) -> Dependent {
        let (ro, rw) = (at.join("ro"), at.join("rw"));
        fs::create_dir_all(&ro).unwrap();
        fs::create_dir_all(&rw).unwrap();
        let script = format!(
            "mount --bind '{src}' '{ro}' && mount -o remount,bind,ro '{ro}' && \
             mount --bind '{src}' '{rw}' && echo ready && \
             while read line; do \
               echo \"$line\" > '{rw}/after' && cat '{ro}/after' && \
               if {{ echo x > '{ro}/denied'; }} 2>/dev/null; then echo ro-writable; else echo ro-refused; fi; \
             done; exec sleep 600",
            src = source.display(),
            ro = ro.display(),
            rw = rw.display(),
        );
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the dependent could not mount");
        assert!(
            !integration::is_mounted(&rw).unwrap(),
            "its mounts must be invisible in this namespace"
        );
        Dependent {
            child,
            stdin,
            stdout,
            ro,
            rw,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes `text` to `after` through the writable mount; returns what
    /// the read-only mount then shows of it, and whether the read-only one
    /// refused a write.
    fn write(&mut self, text: &str) -> (String, bool) {
        writeln!(self.stdin, "{text}").unwrap();
        let mut seen = String::new();
        self.stdout.read_line(&mut seen).unwrap();
        let mut ro = String::new();
        self.stdout.read_line(&mut ro).unwrap();
        (seen.trim().to_owned(), ro.trim() == "ro-refused")
    }

    /// Kills it: its namespace, and so its mounts, go with it.
    fn exit(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dependent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct NoProgress;
impl BootProgress for NoProgress {
    fn set_total(&mut self, _: u64) {}
    fn set_done(&mut self, _: u64) {}
}

/// `app` with a volume whose `data/main/state` is `v1` in its backup and
/// `v2` live, as an update that failed leaves it.
fn app_v1_backup_v2(store: &VolumeStore) -> PathBuf {
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let main = store.data_dir(&app, &vol("main"));
    fs::write(main.join("state"), b"v1").unwrap();
    assert!(store.snapshot(&app).expect("snapshot").created());
    fs::write(main.join("state"), b"v2").unwrap();
    main
}

fn held(root: &Path, n: u32) -> PathBuf {
    root.join(format!("app.held/{n}/data/main"))
}

fn leftovers(store: &VolumeStore) -> Vec<String> {
    store
        .list()
        .unwrap()
        .into_iter()
        .flat_map(|i| i.leftovers)
        .collect()
}

/// Today: `restore` fails "in use" (and `report_failed_rollback` would
/// leave the package down); the drop-in must restore, keep the replaced
/// volume with what the dependent writes through its mount, name the
/// dependent, and reclaim the tree once it is gone.
#[tokio::test]
async fn a_rollback_under_a_dependents_mounts_restores_and_keeps_the_replaced_volume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    let main = app_v1_backup_v2(&store);
    let mut dep = Dependent::mount(&main, &fs.path("lxc/wallet/rootfs/lnd"));
    assert_eq!(dep.write("before").0, "before");

    let ib = InstallBackup::at(&root, "app");
    let outcome = ib
        .restore_outcome()
        .await
        .expect("the rollback must succeed");
    assert!(outcome.restored);
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1", "restored");
    assert!(!main.join("after").exists(), "nothing of v2 in the volume");
    let kept = outcome.held.expect("the replaced volume is held");
    assert_eq!(kept.path, root.join("app.held/1"));
    let points: Vec<(u32, PathBuf, bool)> = kept
        .holders
        .iter()
        .map(|h| (h.pid, h.mount_point.clone(), h.own_namespace))
        .collect();
    for at in [&dep.ro, &dep.rw] {
        assert!(
            points.contains(&(dep.pid(), at.clone(), false)),
            "{at:?} of pid {} must be named: {points:?}",
            dep.pid()
        );
    }

    // The dependent still sees, and writes into, the replaced volume: kept.
    let (seen, ro_refused) = dep.write("written after the rollback");
    assert_eq!(seen, "written after the rollback", "the ro mount shows it");
    assert!(ro_refused, "the read-only mount stays read-only");
    assert_eq!(fs::read(held(&root, 1).join("state")).unwrap(), b"v2");
    assert_eq!(
        fs::read(held(&root, 1).join("after")).unwrap(),
        b"written after the rollback\n",
        "what the dependent writes through its mount is kept"
    );
    assert!(!main.join("after").exists());
    assert_eq!(
        leftovers(&store),
        ["app.held/1"],
        "list shows the held tree"
    );

    // Every operation's recovery keeps it while it is mounted.
    ib.resolve_pending().await.unwrap();
    assert!(held(&root, 1).join("after").exists(), "still mounted: kept");

    dep.exit();
    ib.resolve_pending().await.unwrap();
    assert!(!root.join("app.held").exists(), "reclaimed once unmounted");
    assert!(leftovers(&store).is_empty());
    assert_eq!(root_names(&root), ["app"]);
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1");
}

/// Today: `delete` refuses "in use". A hard delete under a dependent's
/// mount takes the volume off the package's name (a reinstall gets a fresh
/// one), keeps it while mounted, and the boot's maintenance deletes it, the
/// last name of the package, once the dependent is gone.
#[tokio::test]
async fn a_delete_under_a_dependents_mount_keeps_the_volume_until_the_boot_after_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    let main = app_v1_backup_v2(&store);
    let mut dep = Dependent::mount(&main, &fs.path("lxc/wallet/rootfs/lnd"));

    let outcome = store.delete_outcome(&pkg("app")).expect("delete succeeds");
    assert!(outcome.deleted);
    let kept = outcome.held.expect("the volume is held");
    assert!(kept.holders.iter().any(|h| h.pid == dep.pid()), "{kept:?}");
    assert_eq!(
        root_names(&root),
        ["app.held"],
        "only the held tree is left"
    );
    dep.write("after the uninstall");
    assert_eq!(
        fs::read(held(&root, 1).join("after")).unwrap(),
        b"after the uninstall\n"
    );
    assert_eq!(fs::read(held(&root, 1).join("state")).unwrap(), b"v2");

    // A reinstall gets a fresh volume beside it.
    core_volume::ensure_volume_root_at(&root, "app")
        .await
        .unwrap();
    assert!(!main.join("state").exists(), "a fresh volume");
    assert!(held(&root, 1).join("after").exists());

    dep.exit();
    let app = ["app"];
    let done = boot_volume_maintenance_at(&root, &app, &app, &mut NoProgress)
        .await
        .expect("boot maintenance");
    assert!(
        done.recovered
            .iter()
            .any(|r| r.actions.iter().any(|a| a.contains("app.held/1"))),
        "{:?}",
        done.recovered
    );
    assert_eq!(root_names(&root), ["app"], "the held tree is gone");
}

/// The CLI's delete and restore under a mount held in another namespace:
/// exit 0, the warning and the output name the holder's pid and mount
/// point, `list` shows the held tree, `recover` reclaims it once unmounted.
#[test]
fn the_cli_names_the_holder_and_lists_the_held_tree() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    let main = app_v1_backup_v2(&store);
    let dep = Dependent::mount(&main, &fs.path("lxc/wallet/rootfs/lnd"));
    let pid = format!("pid {}", dep.pid());
    let rw = dep.rw.display().to_string();

    let out = volume_cli(&root, &["restore", "app"], &[]);
    let said = must_succeed(&out, "restore under a dependent's mount");
    let warned = text(&out.stderr);
    for needle in [&pid, &rw, &"app.held/1".to_owned()] {
        assert!(
            said.contains(needle.as_str()),
            "stdout names {needle}: {said}"
        );
        assert!(
            warned.contains(needle.as_str()),
            "warning names {needle}: {warned}"
        );
    }
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1");

    // The restored volume is mounted again by the dependent, then deleted.
    let dep2 = Dependent::mount(&main, &fs.path("lxc/wallet2/rootfs/lnd"));
    let out = volume_cli(&root, &["delete", "app"], &[]);
    let said = must_succeed(&out, "delete under a dependent's mount");
    assert!(said.contains("app.held/2"), "{said}");
    assert!(said.contains(&format!("pid {}", dep2.pid())), "{said}");
    let listed = must_succeed(&volume_cli(&root, &["list", "--json"], &[]), "list");
    assert!(
        listed.contains("app.held/1") && listed.contains("app.held/2"),
        "{listed}"
    );
    assert_eq!(fs::read(held(&root, 1).join("state")).unwrap(), b"v2");
    assert_eq!(fs::read(held(&root, 2).join("state")).unwrap(), b"v1");

    dep.exit();
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(!root.join("app.held/1").exists(), "unmounted: reclaimed");
    assert!(held(&root, 2).exists(), "still mounted: kept");
    dep2.exit();
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    let listed = must_succeed(&volume_cli(&root, &["list", "--json"], &[]), "list");
    assert!(!listed.contains("app.held"), "{listed}");
    assert!(root_names(&root).is_empty(), "nothing of app is left");
}

/// Killed between the exchange and the move to `.held`, and again in the
/// move itself: recovery finishes the restore and keeps the replaced
/// volume while the dependent holds it, with what it wrote; never deleted.
#[test]
fn a_restore_killed_before_its_replaced_volume_is_held_is_finished_keeping_it() {
    for failpoint in ["restore.exchanged", "held.moving"] {
        let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
        let root = volumes_root(&fs);
        let store = VolumeStore::open(&root).unwrap();
        let main = app_v1_backup_v2(&store);
        let mut dep = Dependent::mount(&main, &fs.path("lxc/wallet/rootfs/lnd"));
        let out = volume_cli(
            &root,
            &["restore", "app"],
            &[(volume::FAILPOINT_ENV, failpoint)],
        );
        assert_eq!(out.status.code(), None, "killed at {failpoint}");
        dep.write("between the kill and the recovery");

        let r = store.recover(&pkg("app")).expect("recovery");
        assert!(
            r.actions.iter().any(|a| a.contains("app.held/1")),
            "{failpoint}: {:?}",
            r.actions
        );
        assert_eq!(fs::read(main.join("state")).unwrap(), b"v1", "{failpoint}");
        assert_eq!(
            fs::read(held(&root, 1).join("after")).unwrap(),
            b"between the kill and the recovery\n",
            "{failpoint}"
        );
        assert_no_transient_names(&root, failpoint);
        dep.exit();
        store.recover(&pkg("app")).unwrap();
        assert_eq!(root_names(&root), ["app"], "{failpoint}");
    }
}
