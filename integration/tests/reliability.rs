//! `startos-volume` and `volume-migrate` where the earlier suites did not
//! look: an exchange and its undo that both fail, a mount made while a
//! restore copies, mounts inside a plain-directory volume, a copy that
//! runs out of descriptors, trees far deeper than PATH_MAX, ids too long
//! for the root, read-only commands behind a held lock, names a delete or
//! a listing must not miss, and non-directories under a package's name.
//!
//! Each test states the behaviour after the fix of its item; its first
//! comment line says how it fails on the code before that fix.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::cli::*;
use common::*;
use integration::deep::{self, DeepDigest};
use integration::{LoopFs, TreeDigest, fs_or_skip, run};

/// How long any child command may take before it is killed and the test
/// fails: a hang must never hang the test run.
const TIMEOUT: Duration = Duration::from_secs(60);
/// The same for commands walking 20,000-deep trees in a debug build.
const DEEP_TIMEOUT: Duration = Duration::from_secs(180);

/// A binary of the workspace, beside this test's own directory (`make test`
/// builds every binary first, with the same features), or in
/// `$RELIABILITY_BIN_DIR` (to run these tests against another build).
fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("RELIABILITY_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    integration::workspace_bin(name).unwrap_or_else(|e| panic!("{e}; run `make test`"))
}

/// Kills a child (and its process group, when it leads one) unless it
/// has been waited for.
struct ChildGuard {
    child: Option<Child>,
    group: bool,
}

impl ChildGuard {
    fn new(child: Child, group: bool) -> Self {
        ChildGuard {
            child: Some(child),
            group,
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running child").id()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.group
                && let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32)
            {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the child to exit, for at most `timeout`; past that it is
    /// killed and the test fails, naming `what` and what it printed.
    #[track_caller]
    fn wait(mut self, timeout: Duration, what: &str) -> Output {
        let child = self.child.take().expect("a running child");
        let (out, hung) = wait_within(child, timeout);
        assert!(
            !hung,
            "{what} did not finish within {} s (killed); stdout {:?}, stderr {:?}",
            timeout.as_secs(),
            text(&out.stdout),
            text(&out.stderr)
        );
        out
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How to run one of the workspace's commands.
#[derive(Clone, Copy)]
struct Opts<'a> {
    env: &'a [(&'a str, &'a str)],
    nofile: Option<u64>,
    timeout: Duration,
}

const PLAIN: Opts<'static> = Opts {
    env: &[],
    nofile: None,
    timeout: TIMEOUT,
};

fn command(name: &str, root: &Path, args: &[&str], opts: Opts<'_>) -> Command {
    let mut cmd = Command::new(bin(name));
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV);
    for (k, v) in opts.env {
        cmd.env(k, v);
    }
    if let Some(n) = opts.nofile {
        limit_nofile(&mut cmd, n);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn spawn(name: &str, root: &Path, args: &[&str], opts: Opts<'_>) -> ChildGuard {
    let child = command(name, root, args, opts)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    ChildGuard::new(child, false)
}

#[track_caller]
fn run_with(name: &str, root: &Path, args: &[&str], opts: Opts<'_>) -> Output {
    spawn(name, root, args, opts).wait(opts.timeout, &format!("{name} {}", args.join(" ")))
}

/// `startos-volume --root <root> <args>`, with `env` set.
#[track_caller]
fn volume_cli(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    run_with("startos-volume", root, args, Opts { env, ..PLAIN })
}

/// `startos-volume` with a soft RLIMIT_NOFILE of `nofile`.
#[track_caller]
fn volume_limited(root: &Path, args: &[&str], nofile: u64) -> Output {
    run_with(
        "startos-volume",
        root,
        args,
        Opts {
            nofile: Some(nofile),
            timeout: DEEP_TIMEOUT,
            ..PLAIN
        },
    )
}

#[track_caller]
fn migrate_cli(root: &Path, args: &[&str]) -> Output {
    run_with("volume-migrate", root, args, PLAIN)
}

/// The exit status, which must be `code`. Returns stderr.
#[track_caller]
fn must_exit(out: &Output, code: i32, what: &str) -> String {
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: exit status; stdout {:?}, stderr {err:?}",
        text(&out.stdout)
    );
    err
}

/// The exit code, which must be `code`, and one line on stderr holding
/// every one of `needles`.
#[track_caller]
fn must_exit_with(out: &Output, code: i32, what: &str, needles: &[&str]) -> String {
    let err = must_exit(out, code, what);
    assert_eq!(said(&err).len(), 1, "{what}: one line on stderr: {err:?}");
    for needle in needles {
        assert!(
            err.contains(needle),
            "{what}: stderr must say {needle:?}: {err:?}"
        );
    }
    err
}

/// The exit status of a command over several packages is `code`, and one
/// line of its stderr names every one of `needles` (the package's line,
/// among the others and the run's summary). Returns stderr.
#[track_caller]
fn must_exit_naming(out: &Output, code: i32, what: &str, needles: &[&str]) -> String {
    let err = must_exit(out, code, what);
    assert!(
        err.lines().any(|l| needles.iter().all(|n| l.contains(n))),
        "{what}: one line on stderr must say each of {needles:?}: {err:?}"
    );
    err
}

#[track_caller]
fn deep_of(path: &Path) -> DeepDigest {
    deep::deep_digest(path).unwrap_or_else(|e| panic!("deep digest of {}: {e}", path.display()))
}

#[track_caller]
fn assert_deep_same(expected: &DeepDigest, actual: &DeepDigest, what: &str) {
    let diff = expected.diff(actual);
    assert!(
        diff.is_empty(),
        "{what}: trees differ (left = expected, right = actual):\n  {}",
        diff.join("\n  ")
    );
}

fn is_subvolume_root(path: &Path) -> bool {
    fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .ino()
        == 256
}

fn chattr(flag: &str, path: &Path) {
    run(Command::new("chattr").arg(flag).arg(path))
        .unwrap_or_else(|e| panic!("chattr {flag} {}: {e}", path.display()));
}

/// `chattr +a` on a directory, taken off again when dropped.
struct AppendOnly(PathBuf);

impl AppendOnly {
    fn set(path: &Path) -> Self {
        chattr("+a", path);
        AppendOnly(path.to_path_buf())
    }

    fn clear(self) {
        chattr("-a", &self.0);
        std::mem::forget(self);
    }
}

impl Drop for AppendOnly {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-a").arg(&self.0).output();
    }
}

// ---------------------------------------------------------------- the harness itself

// Harness checks, not an item: these pass on the code before the fix too.
#[test]
fn deep_digest_reads_a_5000_deep_chain_and_sees_a_changed_byte_at_the_bottom() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join("t");
    fs::create_dir(&top).unwrap();
    let d = OsStr::new("d");
    deep::make_chain(&top, d, 5000, Some((OsStr::new("leaf"), b"bottom"))).unwrap();
    let a = deep_of(&top);
    assert_eq!(a.len(), 5002, "the top, 5000 directories and the leaf");
    assert_deep_same(&a, &deep_of(&top), "the same tree twice");
    let bottom = deep::open_chain(&top, d, 5000).unwrap();
    deep::write_at(bottom.as_fd(), OsStr::new("leaf"), b"bottoM").unwrap();
    let b = deep_of(&top);
    let diff = a.diff(&b);
    assert_eq!(diff.len(), 1, "{diff:?}");
    assert!(diff[0].contains("leaf"), "{diff:?}");
    assert!(diff[0].len() < 600, "paths are shown cut: {}", diff[0]);
    // A FIFO and a symlink at the bottom are recorded, never opened nor
    // followed.
    rustix::fs::mknodat(
        &bottom,
        "pipe",
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    rustix::fs::symlinkat("/etc", &bottom, "link").unwrap();
    let c = deep_of(&top);
    assert_eq!(c.len(), 5004);
    drop(bottom);
    deep::remove_all(&top).unwrap();
    assert!(!top.exists());
}

#[test]
fn make_long_path_goes_beyond_path_max() {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<OsString> = (0..20)
        .map(|i| OsString::from(format!("{i:02}{}", "x".repeat(248))))
        .collect();
    let fd = deep::make_long_path(dir.path(), &names).unwrap();
    deep::write_at(fd.as_fd(), OsStr::new("f"), b"far down").unwrap();
    drop(fd);
    let d = deep_of(dir.path());
    assert_eq!(d.len(), 22);
    let fd = deep::open_long_path(dir.path(), &names).unwrap();
    assert_eq!(
        deep::read_at(fd.as_fd(), OsStr::new("f")).unwrap(),
        b"far down"
    );
    drop(fd);
    deep::remove_all(&dir.path().join(&names[0])).unwrap();
}

// ---------------------------------------------------------------- 1. exchange and undo both fail

/// A subvolume volume `app` with state "v1" and two nested subvolumes,
/// its backup taken, then state "v2". Returns the backup's digest.
fn app_v1_backup_v2(root: &Path) -> TreeDigest {
    must_succeed(&volume_cli(root, &["create", "app", "main"], &[]), "create");
    let main = root.join("app/data/main");
    fs::write(main.join("state"), b"v1").unwrap();
    for (sub, data) in [("one", "first nested"), ("two", "second nested")] {
        subvolume_create(&main.join(sub));
        fs::write(main.join(sub).join("f"), data).unwrap();
    }
    must_succeed(&volume_cli(root, &["snapshot", "app"], &[]), "snapshot");
    let backup = digest(&root.join("app.install-backup"));
    fs::write(main.join("state"), b"v2").unwrap();
    backup
}

// Today: each of list, drop and recover logs "finished an interrupted restore (exchanged)" and the live state reads "v1", not "v2".
#[test]
fn a_restore_whose_exchange_and_undo_both_fail_is_undone_not_rolled_forward() {
    for next in [&["list"][..], &["drop", "app"], &["recover"]] {
        let when = format!("next = {next:?}");
        let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
        let root = volumes_root(&fs);
        let backup = app_v1_backup_v2(&root);
        // Append-only: renames and unlinks in the root fail, creates work,
        // so the exchange fails and so does removing the rollback record.
        let guard = AppendOnly::set(&root);
        let out = volume_cli(&root, &["restore", "app"], &[]);
        assert!(
            !succeeded_or_one_line(&out, "restore in an append-only root"),
            "{when}: the restore cannot have succeeded: {}",
            text(&out.stdout)
        );
        guard.clear();
        let main = root.join("app/data/main");
        fs::write(main.join("after"), b"written after the failure").unwrap();
        let out = volume_cli(&root, next, &[]);
        let said = must_succeed(&out, &format!("{next:?} after the failed restore"));
        let check_live = |after: &str| {
            assert_eq!(
                fs::read(main.join("state")).ok().as_deref(),
                Some(&b"v2"[..]),
                "{when}, {after}: the live state must still be v2 (stdout {said:?}, stderr {:?})",
                text(&out.stderr)
            );
            assert_eq!(
                fs::read(main.join("after")).ok().as_deref(),
                Some(&b"written after the failure"[..]),
                "{when}, {after}: what the service wrote after the failure must be kept"
            );
        };
        check_live(&format!("after {next:?}"));
        must_succeed(&volume_cli(&root, &["recover"], &[]), "a final recover");
        check_live("after a final recover");
        let names = package_names(&root, "app");
        let allowed = ["app", "app.install-backup", "app.install-backup.ro"];
        assert!(
            names.iter().all(|n| allowed.contains(&n.as_str())),
            "{when}: left {names:?}"
        );
        if next == ["list"] {
            must_succeed(
                &volume_cli(&root, &["restore", "app"], &[]),
                "the restore, once the root is writable",
            );
            assert_same(&backup, &digest(&root.join("app")), "the restored volume");
            Expect {
                live: Some(backup.clone()),
                backup: None,
            }
            .check(&root, "app", "after the restore");
        }
    }
}

// ---------------------------------------------------------------- 2. a mount made during a restore

/// The state of process `pid` (field 3 of /proc/<pid>/stat), if it exists.
fn proc_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

/// `child`, once it has stopped at the `=stop` failpoint `site`; panics
/// if it exits first or does not stop within [`TIMEOUT`].
fn stopped_at(child: ChildGuard, site: &str) -> ChildGuard {
    let pid = child.pid();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match proc_state(pid) {
            Some('T') => return child,
            // Exited (a zombie until waited for, or gone).
            Some('Z') | Some('X') | None => {
                let out = child.wait(TIMEOUT, site);
                panic!(
                    "never stopped at {site}: it exited ({}) with stdout {:?}, stderr {:?}",
                    out.status,
                    text(&out.stdout),
                    text(&out.stderr)
                );
            }
            Some(_) if Instant::now() >= deadline => {
                panic!("never stopped at {site} within {TIMEOUT:?}")
            }
            Some(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Lets a child stopped at a failpoint go on (SIGCONT).
fn go_on(child: &ChildGuard) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.pid() as i32).unwrap(),
        rustix::process::Signal::CONT,
    )
    .unwrap();
}

// Today: the `=stop` failpoint mode is unknown, so the restore runs to the end: "restore never stopped at restore.copied".
#[test]
fn a_mount_made_while_a_restore_copies_keeps_the_replaced_volume_and_nothing_is_lost() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    must_succeed(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        "create",
    );
    let main = root.join("app/data/main");
    fs::write(main.join("state"), b"before").unwrap();
    for (i, sub) in ["one", "two", "one/three"].iter().enumerate() {
        subvolume_create(&main.join(sub));
        fs::write(main.join(sub).join("f"), bytes(i as u64, 5000)).unwrap();
    }
    must_succeed(&volume_cli(&root, &["snapshot", "app"], &[]), "snapshot");
    let backup = digest(&root.join("app.install-backup"));
    fs::write(main.join("state"), b"modified").unwrap();
    fs::write(main.join("one/three/f"), b"modified too").unwrap();
    let live = digest(&root.join("app"));

    let restore = spawn(
        "startos-volume",
        &root,
        &["restore", "app"],
        Opts {
            env: &[(volume::FAILPOINT_ENV, "restore.copied=stop")],
            ..PLAIN
        },
    );
    let restore = stopped_at(restore, "restore.copied");
    let bind = MountGuard::bind(&main, &fs.path("bindmnt"));
    go_on(&restore);
    let out = restore.wait(TIMEOUT, "the continued restore");
    must_succeed(&out, "a restore with a mount made while it copied");
    // The mount shows the replaced volume, kept while it is mounted: what
    // is written through it is never deleted from under it.
    let held = root.join("app.held/1");
    assert_same(&live, &digest(&held), "the replaced volume, kept");
    fs::write(bind.target().join("through-the-mount"), b"the old volume").unwrap();
    assert_eq!(
        fs::read(held.join("data/main/through-the-mount"))
            .ok()
            .as_deref(),
        Some(&b"the old volume"[..]),
        "the mount must still show the replaced volume"
    );
    assert!(!main.join("through-the-mount").exists());
    bind.unmount();
    reclaimed_eventually(&root, "app", || {
        must_succeed(
            &volume_cli(&root, &["recover"], &[]),
            "the recovery once unmounted",
        );
    });
    Expect {
        live: Some(backup),
        backup: None,
    }
    .check(&root, "app", "after the restore");
}

// Today: `volume-migrate --method clone` exits 0 ("converted app"), the bind mount left on the old tree, which the cleanup then removes with whatever was written through it.
#[test]
fn a_mount_made_while_a_conversion_clones_is_refused_and_the_copy_kept() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = root.join("app/data/main");
    fs::create_dir_all(&main).unwrap();
    for i in 0..50u64 {
        fs::write(main.join(format!("f{i}")), bytes(i, 20_000)).unwrap();
    }
    let before = digest(&root.join("app"));
    let convert = spawn(
        "volume-migrate",
        &root,
        &["--method", "clone"],
        Opts {
            env: &[(volume::FAILPOINT_ENV, "migrate.copied=stop")],
            ..PLAIN
        },
    );
    let convert = stopped_at(convert, "migrate.copied");
    let bind = MountGuard::bind(&main, &fs.path("bindmnt"));
    go_on(&convert);
    let out = convert.wait(TIMEOUT, "the continued conversion");
    let err = must_exit(&out, 1, "a conversion with a mount made while it cloned");
    let said = said(&err);
    assert!(
        said.len() == 1 && said[0].contains("package app") && said[0].contains("mounted at"),
        "one line naming the package and the mount: {err:?}"
    );
    assert!(
        !is_subvolume_root(&root.join("app")),
        "app must still be the plain directory"
    );
    assert_same(&before, &digest(&root.join("app")), "app after the refusal");
    assert!(
        is_subvolume_root(&root.join("app.migrate")),
        "the copy must be kept for the next run"
    );
    fs::write(bind.target().join("through-the-mount"), b"still the volume").unwrap();
    assert_eq!(
        fs::read(main.join("through-the-mount")).ok().as_deref(),
        Some(&b"still the volume"[..]),
        "the mount must still show the volume"
    );
    fs::remove_file(main.join("through-the-mount")).unwrap();
    bind.unmount();
    let before = digest(&root.join("app"));
    must_succeed(
        &migrate_cli(&root, &["--method", "clone"]),
        "the conversion once unmounted",
    );
    assert!(
        is_subvolume_root(&root.join("app")),
        "app converted once unmounted"
    );
    assert_same(
        &common::rich::expected_after(&before),
        &digest(&root.join("app")),
        "app after the conversion",
    );
}

// ---------------------------------------------------------------- 3. mounts inside a plain-directory volume

// Today: `snapshot app` exits 0 with "reflink copy <root>/app.install-backup (1 extents)": it copied through the mount.
#[test]
fn a_mount_inside_a_plain_directory_volume_is_never_crossed() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let sub = root.join("app/data/main/sub");
    fs::create_dir_all(&sub).unwrap();
    fs::write(sub.join("own"), b"volume's own").unwrap();
    let foreign = fs.path("foreign");
    fs::create_dir_all(&foreign).unwrap();
    fs::write(foreign.join("f"), b"foreign").unwrap();
    let mount = MountGuard::bind(&foreign, &sub);

    let out = volume_cli(&root, &["snapshot", "app"], &[]);
    must_exit_with(
        &out,
        1,
        "snapshot of a plain volume with a mount inside",
        &["mount", "data/main/sub"],
    );
    assert_eq!(
        package_names(&root, "app"),
        ["app"],
        "no backup, whole or partial"
    );
    assert_eq!(fs::read(foreign.join("f")).unwrap(), b"foreign");

    let out = migrate_cli(&root, &["--dry-run"]);
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        !said.contains("would convert app"),
        "the dry run must not plan to convert app: {said}"
    );
    assert!(
        said.lines()
            .any(|l| l.contains("app") && l.contains("mount")),
        "the dry run must say app has a mount inside: {said}"
    );
    let out = migrate_cli(&root, &[]);
    must_exit_naming(
        &out,
        1,
        "volume-migrate with a mount inside app",
        &["app", "mount"],
    );
    assert!(
        !is_subvolume_root(&root.join("app")),
        "app must still be a plain directory"
    );
    assert_eq!(fs::read(sub.join("f")).unwrap(), b"foreign");
    mount.unmount();
    assert_eq!(fs::read(sub.join("own")).unwrap(), b"volume's own");
    assert_eq!(fs::read(foreign.join("f")).unwrap(), b"foreign");
}

// Today: `list` exits 1: "measuring <root>/plain: Inappropriate ioctl for device" (the walk measures the tmpfs).
#[test]
fn a_tmpfs_inside_a_volume_blocks_neither_list_nor_usage() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["sv", "third"] {
        must_succeed(&volume_cli(&root, &["create", p, "main"], &[]), "create");
        fs::write(root.join(p).join("data/main/f"), b"data").unwrap();
    }
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    fs::write(root.join("plain/data/main/f"), b"data").unwrap();
    let _sv_tmp = MountGuard::tmpfs(&root.join("sv/data/main/tmp"));
    let _plain_tmp = MountGuard::tmpfs(&root.join("plain/data/main/tmp"));
    for m in ["sv", "plain"] {
        fs::write(root.join(m).join("data/main/tmp/scratch"), b"on tmpfs").unwrap();
    }

    let listed = must_succeed(&volume_cli(&root, &["list"], &[]), "list");
    for p in ["sv", "plain", "third"] {
        assert!(
            listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(p)),
            "list must show {p}: {listed}"
        );
    }
    must_succeed(&volume_cli(&root, &["usage", "sv"], &[]), "usage sv");
    must_exit_with(
        &volume_cli(&root, &["usage", "plain"], &[]),
        1,
        "usage plain",
        &["mount"],
    );
    must_succeed(&volume_cli(&root, &["snapshot", "sv"], &[]), "snapshot sv");
}

/// Found by the generated trees running beside the sweep: a mount point
/// whose name is not UTF-8 (mountinfo holds it raw) made every reading of
/// the mount tables fail, so no restore, delete or conversion of any
/// package worked while it was mounted. Read as bytes, it is one more
/// mount, named (escaped) where its own package's restore keeps the
/// replaced volume.
#[test]
fn a_mount_point_that_is_not_utf8_blocks_no_other_package() {
    use std::os::unix::ffi::OsStrExt;
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["odd", "other"] {
        must_succeed(&volume_cli(&root, &["create", p, "main"], &[]), "create");
        must_succeed(&volume_cli(&root, &["snapshot", p], &[]), "snapshot");
    }
    let odd = root
        .join("odd/data/main")
        .join(OsStr::from_bytes(b"not-utf8-\xff\xfe"));
    let _mount = MountGuard::tmpfs(&odd);
    must_succeed(
        &volume_cli(&root, &["restore", "other"], &[]),
        "restore other",
    );
    let out = volume_cli(&root, &["restore", "odd"], &[]);
    must_succeed(&out, "restore odd");
    let warned = text(&out.stderr);
    assert!(
        warned.contains("odd.held/1") && warned.contains("not-utf8-"),
        "{warned}"
    );
    must_succeed(
        &volume_cli(&root, &["delete", "other"], &[]),
        "delete other",
    );
}

/// Found by the generated trees: a nested subvolume in an immutable or
/// append-only directory could not be snapshotted (the copy's holder kept
/// the flag, so its placeholder could not be replaced), and one with an
/// immutable root, or in such a directory, could not be deleted: a drop,
/// a restore's purge or a delete then stopped past its commit point and
/// left a transient name no recovery could remove.
#[test]
fn nested_subvolumes_below_immutable_and_append_only_directories_come_and_go() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    must_succeed(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        "create",
    );
    let main = root.join("app/data/main");
    for (dir, flag) in [("locked", "+i"), ("log", "+a")] {
        fs::create_dir(main.join(dir)).unwrap();
        subvolume_create(&main.join(dir).join("sub"));
        fs::write(main.join(dir).join("sub/f"), dir).unwrap();
        run(Command::new("chattr")
            .arg(flag)
            .arg(main.join(dir).join("sub")))
        .unwrap();
        run(Command::new("chattr").arg(flag).arg(main.join(dir))).unwrap();
    }
    let before = digest(&root.join("app"));
    must_succeed(&volume_cli(&root, &["snapshot", "app"], &[]), "snapshot");
    assert_same(
        &before,
        &digest(&root.join("app.install-backup")),
        "the backup",
    );
    must_succeed(&volume_cli(&root, &["drop", "app"], &[]), "drop");
    must_succeed(
        &volume_cli(&root, &["snapshot", "app"], &[]),
        "snapshot again",
    );
    must_succeed(&volume_cli(&root, &["restore", "app"], &[]), "restore");
    assert_same(&before, &digest(&root.join("app")), "the restored volume");
    must_succeed(&volume_cli(&root, &["delete", "app"], &[]), "delete");
    assert_eq!(package_names(&root, "app"), Vec::<String>::new());
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
}

// ---------------------------------------------------------------- 4. a reflink copy out of descriptors

// Today: with 12 descriptors the extent count fails first (an accepted error), but with 52 `snapshot app` exits 0 with "no backup for app: reflink copy failed: Too many open files".
#[test]
fn a_failed_reflink_backup_copy_is_an_error_never_no_backup() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let mut dir = root.join("app/data/main");
    fs::create_dir_all(&dir).unwrap();
    for i in 0..40 {
        dir.push("d");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("f"), format!("level {i}")).unwrap();
    }
    let before = deep_of(&root.join("app"));
    // 12, as the item asks; but there the count of extents runs out first
    // (an accepted error), so the limits at which the count gets through
    // and the copy may not are tried too.
    for nofile in (12..=100).step_by(4) {
        let what = format!("snapshot with {nofile} descriptors");
        let out = volume_limited(&root, &["snapshot", "app"], nofile);
        let said = text(&out.stdout);
        if succeeded_or_one_line(&out, &what) {
            assert!(
                said.starts_with("reflink copy"),
                "{what}: a snapshot that exits 0 must have made its copy: {said:?}"
            );
            let backup = root.join("app.install-backup");
            assert!(backup.is_dir(), "{what}: {said:?}: no {}", backup.display());
            assert_deep_same(&before, &deep_of(&backup), &format!("{what}: the copy"));
            must_succeed(&volume_cli(&root, &["drop", "app"], &[]), "drop");
        } else {
            assert_eq!(
                package_names(&root, "app"),
                ["app"],
                "{what}: a failed snapshot leaves no backup, whole or partial"
            );
        }
        assert_deep_same(&before, &deep_of(&root.join("app")), &what);
    }
}

// ---------------------------------------------------------------- 5. deep trees, few descriptors

/// The soft RLIMIT_NOFILE every command of item 5 runs with.
const FEW_FDS: u64 = 64;

/// `<root>/<pkg>/data/main` as a plain directory with a chain of `depth`
/// directories named `d` and a file `bottom` at its end.
fn plain_chain(root: &Path, pkg: &str, depth: usize) -> PathBuf {
    let main = root.join(pkg).join("data/main");
    fs::create_dir_all(&main).unwrap();
    deep::make_chain(
        &main,
        OsStr::new("d"),
        depth,
        Some((OsStr::new("bottom"), b"at the bottom")),
    )
    .unwrap();
    main
}

#[track_caller]
fn few(root: &Path, args: &[&str]) -> Output {
    volume_limited(root, args, FEW_FDS)
}

// Today: `snapshot deep` exits 1 with "counting the extents of the volume: Too many open files", not "deeper than 2048".
#[test]
fn deep_trees_work_at_any_depth_with_few_descriptors_a_plain_beyond_the_copy_limit() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    plain_chain(&root, "deep", 20_000);
    let out = few(&root, &["snapshot", "deep"]);
    must_fail(&out, "snapshot deep", "deeper than 2048");
    assert_eq!(package_names(&root, "deep"), ["deep"], "no backup left");
    let listed = must_succeed(&few(&root, &["list"]), "list");
    assert!(
        listed
            .lines()
            .any(|l| l.split_whitespace().next() == Some("deep")),
        "list must show deep: {listed}"
    );
    must_succeed(&few(&root, &["usage", "deep"]), "usage deep");
    must_succeed(&few(&root, &["recover"]), "recover");
    must_succeed(&few(&root, &["delete", "deep"]), "delete deep");
    assert_eq!(package_names(&root, "deep"), Vec::<String>::new());
}

// Today: `snapshot mid` exits 1: "counting the extents of the volume: Too many open files".
#[test]
fn deep_trees_work_at_any_depth_with_few_descriptors_b_plain_within_the_copy_limit() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = plain_chain(&root, "mid", 1500);
    let before = deep_of(&root.join("mid"));
    let said = must_succeed(&few(&root, &["snapshot", "mid"]), "snapshot mid");
    assert!(said.starts_with("reflink copy"), "{said}");
    let backup = deep_of(&root.join("mid.install-backup"));
    assert_deep_same(&before, &backup, "the reflink copy");
    let bottom = deep::open_chain(&main, OsStr::new("d"), 1500).unwrap();
    deep::write_at(bottom.as_fd(), OsStr::new("bottom"), b"changed").unwrap();
    drop(bottom);
    must_succeed(&few(&root, &["restore", "mid"]), "restore mid");
    assert_deep_same(&backup, &deep_of(&root.join("mid")), "the restored volume");
    must_succeed(&few(&root, &["delete", "mid"]), "delete mid");
    assert_eq!(package_names(&root, "mid"), Vec::<String>::new());
}

// Today: passes (noted): a subvolume volume works at any depth with 64 descriptors already; kept as a guard for the fix.
#[test]
fn deep_trees_work_at_any_depth_with_few_descriptors_c_subvolume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    must_succeed(&few(&root, &["create", "sv", "main"]), "create sv");
    let main = root.join("sv/data/main");
    deep::make_chain(
        &main,
        OsStr::new("d"),
        20_000,
        Some((OsStr::new("bottom"), b"at the bottom")),
    )
    .unwrap();
    must_succeed(&few(&root, &["snapshot", "sv"]), "snapshot sv");
    must_succeed(&few(&root, &["usage", "sv"]), "usage sv");
    let listed = must_succeed(&few(&root, &["list"]), "list");
    assert!(
        listed
            .lines()
            .any(|l| l.split_whitespace().next() == Some("sv")),
        "list must show sv: {listed}"
    );
    let bottom = deep::open_chain(&main, OsStr::new("d"), 20_000).unwrap();
    deep::write_at(bottom.as_fd(), OsStr::new("bottom"), b"changed").unwrap();
    drop(bottom);
    must_succeed(&few(&root, &["restore", "sv"]), "restore sv");
    let bottom = deep::open_chain(&main, OsStr::new("d"), 20_000).unwrap();
    assert_eq!(
        deep::read_at(bottom.as_fd(), OsStr::new("bottom")).unwrap(),
        b"at the bottom",
        "the restore puts back the bottom file"
    );
    drop(bottom);
    must_succeed(&few(&root, &["delete", "sv"]), "delete sv");
    assert_eq!(package_names(&root, "sv"), Vec::<String>::new());
    assert_eq!(package_subvolumes(&fs, "sv"), Vec::<String>::new());
}

// ---------------------------------------------------------------- 6. paths beyond PATH_MAX

/// 20 names of 250 characters: over 5,000 bytes of path.
fn long_names() -> Vec<OsString> {
    (0..20)
        .map(|i| OsString::from(format!("{i:02}{}", "L".repeat(248))))
        .collect()
}

/// Below `top`, the [`long_names`] directories, and at their end a nested
/// subvolume `nested` holding `file`, and, with `frozen`, a read-only one.
fn long_path_with_nested(top: &Path, frozen: bool) {
    let deepest = deep::make_long_path(top, &long_names()).unwrap();
    volume::sys::create_subvolume(deepest.as_fd(), OsStr::new("nested")).unwrap();
    let nested = volume::sys::open_dir_at(deepest.as_fd(), OsStr::new("nested")).unwrap();
    deep::write_at(nested.as_fd(), OsStr::new("file"), b"nested, far down").unwrap();
    if frozen {
        volume::sys::create_subvolume(deepest.as_fd(), OsStr::new("frozen")).unwrap();
        let f = volume::sys::open_dir_at(deepest.as_fd(), OsStr::new("frozen")).unwrap();
        deep::write_at(f.as_fd(), OsStr::new("sealed"), b"read-only").unwrap();
        volume::sys::set_read_only(f.as_fd(), true).unwrap();
    }
}

/// The deepest of the [`long_names`] directories below `top`, open.
fn long_path_end(top: &Path) -> std::os::fd::OwnedFd {
    deep::open_long_path(top, &long_names())
        .unwrap_or_else(|e| panic!("opening the long path below {}: {e}", top.display()))
}

/// Item 6 for one package, a subvolume volume or a plain directory.
fn long_paths_in(fs: &LoopFs, root: &Path, pkg: &str, plain: bool) {
    if plain {
        fs::create_dir_all(root.join(pkg).join("data/main")).unwrap();
    } else {
        must_succeed(&volume_cli(root, &["create", pkg, "main"], &[]), "create");
    }
    let main = root.join(pkg).join("data/main");
    long_path_with_nested(&main, true);
    let before = deep_of(&root.join(pkg));
    let said = must_succeed(&volume_cli(root, &["snapshot", pkg], &[]), "snapshot");
    assert!(
        said.starts_with(if plain { "reflink copy" } else { "snapshot" }),
        "{pkg}: {said}"
    );
    must_succeed(&volume_cli(root, &["usage", pkg], &[]), "usage");
    must_succeed(&volume_cli(root, &["list"], &[]), "list");
    let backup = deep_of(&root.join(format!("{pkg}.install-backup")));
    assert_deep_same(&before, &backup, &format!("{pkg}: the backup"));
    let end = long_path_end(&main);
    let nested = volume::sys::open_dir_at(end.as_fd(), OsStr::new("nested")).unwrap();
    deep::write_at(nested.as_fd(), OsStr::new("file"), b"changed").unwrap();
    drop((nested, end));
    must_succeed(&volume_cli(root, &["restore", pkg], &[]), "restore");
    let end = long_path_end(&main);
    let nested = volume::sys::open_dir_at(end.as_fd(), OsStr::new("nested")).unwrap();
    assert_eq!(
        deep::read_at(nested.as_fd(), OsStr::new("file")).unwrap(),
        b"nested, far down",
        "{pkg}: the restore puts back the nested file"
    );
    let frozen = volume::sys::open_dir_at(end.as_fd(), OsStr::new("frozen")).unwrap();
    assert!(
        volume::sys::is_read_only(frozen.as_fd()).unwrap(),
        "{pkg}: the read-only nested subvolume must come back read-only"
    );
    drop((nested, frozen, end));
    assert_deep_same(&backup, &deep_of(&root.join(pkg)), "the restored volume");
    must_succeed(&volume_cli(root, &["delete", pkg], &[]), "delete");
    assert_eq!(package_names(root, pkg), Vec::<String>::new());
    assert_eq!(package_subvolumes(fs, pkg), Vec::<String>::new());
}

// Today: `snapshot lp` exits 1: "snapshotting <root>/lp: File name too long (os error 36)".
#[test]
fn long_paths_beyond_path_max_work_a_subvolume_volume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    long_paths_in(&fs, &root, "lp", false);
}

// Today: passes (noted): a plain directory's reflink copy, restore and delete already go by descriptors; kept as a guard for the fix.
#[test]
fn long_paths_beyond_path_max_work_b_plain_directory_volume() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    long_paths_in(&fs, &root, "pd", true);
}

// Today: `volume-migrate --dry-run` exits 1: "inspecting the subvolume holding <root>: File name too long (os error 36)".
#[test]
fn long_paths_beyond_path_max_work_c_volume_migrate_beside_one() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = root.join("p1/data/main");
    fs::create_dir_all(main.join("sub")).unwrap();
    fs::write(main.join("a"), b"first").unwrap();
    fs::write(main.join("sub/b"), bytes(7, 20_000)).unwrap();
    symlink("sub/b", main.join("link")).unwrap();
    let elsewhere = fs.path("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    long_path_with_nested(&elsewhere, false);
    let before = deep_of(&root.join("p1"));
    let out = migrate_cli(&root, &["--dry-run"]);
    let said = must_succeed(&out, "volume-migrate --dry-run");
    assert!(said.contains("would convert p1"), "{said}");
    must_succeed(&migrate_cli(&root, &[]), "volume-migrate");
    assert!(
        is_subvolume_root(&root.join("p1")),
        "p1 must be a subvolume now"
    );
    let mut after = deep_of(&root.join("p1"));
    // The top is a subvolume now: that is the conversion.
    if let Some(top) = after.entries_mut().get_mut(&Vec::new()) {
        top.kind = deep::DeepKind::Dir { subvolume: false };
    }
    assert_deep_same(&before, &after, "p1 converted");
}

// ---------------------------------------------------------------- 7. an overlong id in the root

// Today: `volume-migrate` exits 1: "Invalid ID: invalid id PackageId(\"aaa…\"): 240 characters, at most 235 allowed", nothing converted.
#[test]
fn an_overlong_id_in_the_root_blocks_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let odd = "a".repeat(240);
    fs::create_dir(root.join(&odd)).unwrap();
    fs::write(root.join(&odd).join("f"), b"not a package of ours").unwrap();
    for p in ["p1", "p2"] {
        fs::create_dir_all(root.join(p).join("data/main")).unwrap();
        fs::write(root.join(p).join("data/main/f"), p).unwrap();
    }
    let odd_before = digest(&root.join(&odd));
    let out = migrate_cli(&root, &[]);
    let err = text(&out.stderr);
    must_succeed(&out, "volume-migrate beside an overlong id");
    for p in ["p1", "p2"] {
        assert!(is_subvolume_root(&root.join(p)), "{p} must be converted");
    }
    assert!(
        err.contains(&odd),
        "volume-migrate must name the entry it left alone: {err}"
    );
    assert_same(&odd_before, &digest(&root.join(&odd)), "the odd directory");
    assert!(!is_subvolume_root(&root.join(&odd)), "left as it was");
    let listed = must_succeed(&volume_cli(&root, &["list"], &[]), "list");
    for p in ["p1", "p2"] {
        assert!(
            listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(p)),
            "list must show {p}: {listed}"
        );
    }
}

// ---------------------------------------------------------------- 8. read-only commands and a held lock

/// Whether /proc/locks shows a lock held by `pid`.
fn holds_a_lock(pid: u32) -> bool {
    fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&"FLOCK") && f.get(4) == Some(&pid.to_string().as_str())
        })
}

/// How long each command of item 8 may take.
const LOCK_TIMEOUT: Duration = Duration::from_secs(30);

#[track_caller]
fn lock_wait_cli(root: &Path, args: &[&str]) -> Output {
    let mut all = vec!["--lock-wait", "1"];
    all.extend_from_slice(args);
    run_with(
        "startos-volume",
        root,
        &all,
        Opts {
            timeout: LOCK_TIMEOUT,
            ..PLAIN
        },
    )
}

// Today: `list` exits 2: "unexpected argument '--lock-wait' found"; without the option it hangs until killed at 30 s.
#[test]
fn read_only_commands_never_hang_behind_a_lock() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["busy", "free"] {
        must_succeed(&volume_cli(&root, &["create", p, "main"], &[]), "create");
    }
    fs::create_dir(root.join("free.install-backup.tmp")).unwrap();
    let lock = lock_path(&root, "busy");
    let holder = Command::new("flock")
        .arg("-x")
        .arg(&lock)
        .args(["-c", "sleep 300"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("flock (util-linux)");
    let mut holder = ChildGuard::new(holder, true);
    let pid = holder.pid();
    let deadline = Instant::now() + TIMEOUT;
    while !holds_a_lock(pid) {
        assert!(
            Instant::now() < deadline,
            "flock {} never took the lock",
            lock.display()
        );
        thread::sleep(Duration::from_millis(10));
    }
    let pid_s = pid.to_string();

    let out = lock_wait_cli(&root, &["list"]);
    let listed = must_succeed(&out, "list");
    for p in ["busy", "free"] {
        assert!(
            listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(p)),
            "list must show {p}: {listed}"
        );
    }
    let err = text(&out.stderr);
    assert!(
        err.lines()
            .any(|l| l.contains("busy") && l.contains(&pid_s)),
        "list must say busy is held, by pid {pid}: {err:?}"
    );
    must_exit_with(
        &lock_wait_cli(&root, &["usage", "busy"]),
        1,
        "usage busy",
        &["busy", &pid_s],
    );
    must_exit_naming(
        &lock_wait_cli(&root, &["recover"]),
        1,
        "recover, busy held",
        &["busy", &pid_s],
    );
    assert!(
        !root.join("free.install-backup.tmp").exists(),
        "recover must still recover free"
    );
    let out = lock_wait_cli(&root, &["recover", "busy"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "recover busy: {:?}",
        text(&out.stderr)
    );
    must_succeed(&lock_wait_cli(&root, &["usage", "free"]), "usage free");
    holder.kill();
}

// ---------------------------------------------------------------- 9. leftovers

// Today: `list` does not mention "app.migrate-old" (only "app  subvolume  -  4 B  -"), and `recover` leaves an orphaned one.
#[test]
fn delete_removes_every_name_and_list_shows_leftovers() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    fs::write(root.join("app/data/main/f"), b"data").unwrap();
    must_succeed(
        &migrate_cli(&root, &["--keep-old"]),
        "volume-migrate --keep-old",
    );
    assert!(
        root.join("app.migrate-old").is_dir(),
        "{:?}",
        root_names(&root)
    );
    let listed = must_succeed(&volume_cli(&root, &["list"], &[]), "list");
    assert!(listed.contains("app.migrate-old"), "{listed}");
    let json = must_succeed(&volume_cli(&root, &["--json", "list"], &[]), "list --json");
    let rows: serde_json::Value = serde_json::from_str(&json).expect("list --json");
    let app = rows
        .as_array()
        .expect("an array")
        .iter()
        .find(|r| r["package"] == "app")
        .unwrap_or_else(|| panic!("no app in {json}"));
    assert!(
        app["leftovers"].to_string().contains("app.migrate-old"),
        "app's leftovers: {app}"
    );
    must_succeed(&volume_cli(&root, &["delete", "app"], &[]), "delete app");
    assert_eq!(package_names(&root, "app"), Vec::<String>::new());

    let orphan = root.join("orphan.migrate-old");
    fs::create_dir_all(orphan.join("data/main")).unwrap();
    fs::write(orphan.join("data/main/f"), b"old data").unwrap();
    // With no volume left, a conversion's old directory is garbage, which
    // recovery (a `list` runs it too) removes, saying so.
    let said = must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(
        said.contains("orphan: deleted the old directory of a conversion"),
        "{said}"
    );
    assert_eq!(package_names(&root, "orphan"), Vec::<String>::new());
}

// ---------------------------------------------------------------- 10. non-directories under the name

// Today: `drop app` and `recover app` exit 0 ("no install backup for app") for a file, a symlink and a FIFO alike.
#[test]
fn drop_and_recover_refuse_a_non_directory_under_the_package_name() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let path = root.join("app");
    let shown = path.display().to_string();
    for kind in ["a regular file", "a symlink", "a FIFO"] {
        match kind {
            "a regular file" => fs::write(&path, b"the operator's").unwrap(),
            "a symlink" => symlink("/etc", &path).unwrap(),
            _ => mkfifo(&path),
        }
        let check = |when: &str| {
            let md = fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{when}: {e}"));
            match kind {
                "a regular file" => {
                    assert_eq!(fs::read(&path).unwrap(), b"the operator's", "{when}")
                }
                "a symlink" => assert_eq!(fs::read_link(&path).unwrap(), Path::new("/etc")),
                _ => assert!(md.file_type().is_fifo(), "{when}"),
            }
        };
        for op in ["drop", "recover"] {
            let what = format!("{op} app, app being {kind}");
            must_exit_with(&volume_cli(&root, &[op, "app"], &[]), 1, &what, &[&shown]);
            check(&what);
        }
        fs::remove_file(&path).unwrap();
    }
}
fn mkfifo(path: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

// ---------------------------------------------------------------- 11. smaller items

// Today: `create <236 a's> main` says "invalid id PackageId(\"aaa…\"): 236 characters, …" (Bad_Id is already fine).
#[test]
fn a_bad_id_is_refused_in_one_line_without_debug_formatting() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let long = "a".repeat(236);
    for id in ["Bad_Id", long.as_str()] {
        let out = volume_cli(&root, &["create", id, "main"], &[]);
        let err = must_fail(&out, &format!("create {id}"), "");
        assert!(!err.contains("PackageId("), "create {id}: {err}");
    }
    assert!(root_names(&root).is_empty(), "{:?}", root_names(&root));
}

// Today: `create app main` exits 0 with "created <root>/app (directory)", the dangling data/main left as it was.
#[test]
fn create_over_a_dangling_symlink_names_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data")).unwrap();
    symlink("/nonexistent/target", root.join("app/data/main")).unwrap();
    must_exit_with(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        1,
        "create over a dangling data/main",
        &["data/main"],
    );
    assert_eq!(
        fs::read_link(root.join("app/data/main")).unwrap(),
        Path::new("/nonexistent/target"),
        "the symlink is left as it was"
    );
}

// Today: the 235-character row pushes its VOLUME column to byte 236, the header's is at byte 33.
#[test]
fn list_columns_line_up_with_the_longest_id() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let long = "b".repeat(235);
    for p in [long.as_str(), "app"] {
        must_succeed(&volume_cli(&root, &["create", p, "main"], &[]), "create");
    }
    let listed = must_succeed(&volume_cli(&root, &["list"], &[]), "list");
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "a header and two rows: {listed}");
    let header = lines[0].find("VOLUME").expect("a VOLUME column");
    for row in &lines[1..] {
        let at = row.find("subvolume").expect("the volume's kind");
        assert_eq!(
            at, header,
            "the VOLUME column must start at byte {header} in every row:\n{listed}"
        );
    }
}

// Today: `restore app` exits 1 with "finishing the restore: Input/output error (os error 5)": no word that it was restored.
#[test]
fn a_restore_failing_after_its_exchange_says_the_volume_was_restored() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let backup = app_v1_backup_v2(&root);
    let out = volume_cli(
        &root,
        &["restore", "app"],
        &[(volume::FAILPOINT_ENV, "restore.exchanged=eio")],
    );
    must_exit_with(&out, 1, "restore failing after the exchange", &["restored"]);
    assert_same(&backup, &digest(&root.join("app")), "the live volume");
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert_no_transient_names(&root, "after the recovery");
    Expect {
        live: Some(backup),
        backup: None,
    }
    .check(&root, "app", "after the recovery");
}

// Today: `recover` fails with "deleting the volume: Invalid argument": the
// removal took the mount point for a subvolume of the tree and tried to
// delete it.
#[test]
fn a_mount_inside_a_volume_being_deleted_is_never_deleted_with_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let sub = root.join("app/data/main/sub");
    fs::create_dir_all(&sub).unwrap();
    fs::write(sub.join("own"), b"volume's own").unwrap();
    let foreign = fs.path("foreign");
    subvolume_create(&foreign);
    fs::write(foreign.join("f"), b"foreign").unwrap();

    let out = volume_cli(
        &root,
        &["delete", "app"],
        &[(volume::FAILPOINT_ENV, "delete.renamed=eio")],
    );
    must_exit_with(&out, 1, "delete failing after its rename", &["app"]);
    let mount = MountGuard::bind(&foreign, &root.join("app.delete/data/main/sub"));

    // The delete is finished, the volume kept, with the mount in it, while
    // that is mounted.
    must_succeed(
        &volume_cli(&root, &["recover"], &[]),
        "recover with a mount inside",
    );
    let moved = root.join("app.held/1/data/main/sub");
    assert_eq!(fs::read(moved.join("f")).unwrap(), b"foreign");
    assert_eq!(fs::read(foreign.join("f")).unwrap(), b"foreign");
    assert!(is_subvolume_root(&foreign), "the foreign subvolume is kept");
    integration::run(Command::new("umount").arg(&moved)).unwrap();
    drop(mount);
    assert_eq!(
        fs::read(moved.join("own")).unwrap(),
        b"volume's own",
        "kept whole until unmounted"
    );
    reclaimed_eventually(&root, "app", || {
        must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    });

    must_succeed(
        &volume_cli(&root, &["recover"], &[]),
        "recover after the unmount",
    );
    assert!(package_names(&root, "app").is_empty(), "app is deleted");
    assert_eq!(fs::read(foreign.join("f")).unwrap(), b"foreign");
}

// Today: `recover` says "the restore was undone": it exchanged back because
// the replaced volume is mounted, and what was written into the restored
// volume since is gone. Then it refused ("in use"); now it finishes the
// restore and keeps the replaced volume while it is mounted.
#[test]
fn recovery_never_exchanges_back_a_restore_whose_replaced_volume_is_in_use() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    app_v1_backup_v2(&root);
    let out = volume_cli(
        &root,
        &["restore", "app"],
        &[(volume::FAILPOINT_ENV, "restore.exchanged")],
    );
    assert_eq!(out.status.code(), None, "killed at restore.exchanged");
    let main = root.join("app/data/main");
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1", "exchanged");
    // Something still holds the replaced volume; the restored one is written.
    let held = fs.path("held");
    fs::create_dir_all(&held).unwrap();
    let mount = MountGuard::bind(&root.join("app.rollback/data/main"), &held);
    fs::write(main.join("after"), b"written after the restore").unwrap();

    let out = volume_cli(&root, &["recover"], &[]);
    must_succeed(&out, "recover beside the mount of the replaced volume");
    assert!(
        text(&out.stderr).contains("app.held/1"),
        "{}",
        text(&out.stderr)
    );
    fs::write(held.join("through"), b"kept").unwrap();
    assert_eq!(
        fs::read(root.join("app.held/1/data/main/through")).unwrap(),
        b"kept"
    );
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1");
    assert_eq!(
        fs::read(main.join("after")).unwrap(),
        b"written after the restore",
        "what was written into the restored volume is kept"
    );
    assert_eq!(
        fs::read(held.join("state")).unwrap(),
        b"v2",
        "the replaced one too"
    );
    mount.unmount();

    reclaimed_eventually(&root, "app", || {
        must_succeed(
            &volume_cli(&root, &["recover"], &[]),
            "recover after the unmount",
        );
    });
    assert_no_transient_names(&root, "after the recovery");
    assert_eq!(fs::read(main.join("state")).unwrap(), b"v1");
    assert_eq!(
        fs::read(main.join("after")).unwrap(),
        b"written after the restore"
    );
}

// ---------------------------------------------------------------- 3. the purge after a restore or a delete

/// `app`, a volume of `files` small files, all read once (cached, as a
/// running service's are), with an install backup taken before the last
/// one of them was changed.
fn cached_volume_with_backup(root: &Path, files: usize) -> PathBuf {
    must_succeed(&volume_cli(root, &["create", "app", "main"], &[]), "create");
    let main = root.join("app/data/main");
    for i in 0..files {
        fs::write(main.join(format!("f{i}")), i.to_string()).unwrap();
    }
    must_succeed(&volume_cli(root, &["snapshot", "app"], &[]), "snapshot");
    for i in 0..files {
        fs::read(main.join(format!("f{i}"))).unwrap();
    }
    fs::write(main.join("f0"), b"changed after the backup").unwrap();
    main
}

// Today: the replaced volume is deleted under the package's lock, with no trash step to stop at: "never stopped at trash.deleting: it exited (exit status: 0)".
/// Deleting a subvolume evicts its cached inodes in the calling thread
/// (seconds for a million files): a restore and a delete are complete and
/// durable before it, their old tree waits in the trash, and the package's
/// lock is free while it is deleted, so another command on the package
/// runs to its end meanwhile. Structural: the process is stopped in its
/// purge, whatever the machine's speed.
#[test]
fn a_restore_and_a_delete_finish_before_their_purge_which_holds_no_lock() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = cached_volume_with_backup(&root, 2000);
    let stop = [(volume::FAILPOINT_ENV, "trash.deleting=stop")];

    let restore = spawn(
        "startos-volume",
        &root,
        &["restore", "app"],
        Opts {
            env: &stop,
            ..PLAIN
        },
    );
    let restore = stopped_at(restore, "trash.deleting");
    assert_eq!(
        fs::read_to_string(main.join("f0")).unwrap(),
        "0",
        "restored"
    );
    assert!(!root.join("app.install-backup").exists(), "backup consumed");
    // The backup (dropped first), then the replaced volume.
    assert_eq!(
        trash_entries(&root),
        ["app.1", "app.2"],
        "the backup and the replaced volume"
    );
    let replaced = root.join(volume::layout::TRASH_DIR).join("app.2");
    assert_eq!(
        fs::read(replaced.join("data/main/f0")).unwrap(),
        b"changed after the backup",
        "the replaced volume, whole until its purge"
    );
    // The package is free while its old volume waits: a snapshot runs now.
    must_succeed(
        &volume_cli(&root, &["snapshot", "app"], &[]),
        "a snapshot while the restore's purge is stopped",
    );
    assert!(root.join("app.install-backup").exists());
    go_on(&restore);
    must_succeed(&restore.wait(TIMEOUT, "the continued restore"), "restore");
    assert_eq!(trash_entries(&root), Vec::<String>::new());
    assert!(
        !root.join(volume::layout::TRASH_DIR).exists(),
        "trash removed"
    );

    let delete = spawn(
        "startos-volume",
        &root,
        &["delete", "app"],
        Opts {
            env: &stop,
            ..PLAIN
        },
    );
    let delete = stopped_at(delete, "trash.deleting");
    assert_eq!(package_names(&root, "app"), Vec::<String>::new(), "deleted");
    // The snapshot above made a backup: it goes first, then the volume.
    assert_eq!(
        trash_entries(&root).len(),
        2,
        "the deleted volume and its backup"
    );
    // A reinstall's create runs now, on a fresh volume.
    must_succeed(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        "a create while the delete's purge is stopped",
    );
    assert!(!main.join("f0").exists(), "a fresh volume");
    go_on(&delete);
    must_succeed(&delete.wait(TIMEOUT, "the continued delete"), "delete");
    assert!(
        !root.join(volume::layout::TRASH_DIR).exists(),
        "trash removed"
    );
    assert_no_transient_names(&root, "after the purges");
}

// Today: nothing is left in a trash for a crash to leave: "never reached trash.deleting" (the restore exits 0).
/// A crash in the purge leaves the old tree in the trash: garbage that no
/// listing shows and the next recovery of all packages (the boot's)
/// deletes.
#[test]
fn a_crash_in_the_purge_leaves_garbage_the_next_recovery_deletes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = cached_volume_with_backup(&root, 100);
    let out = volume_cli(
        &root,
        &["restore", "app"],
        &[(volume::FAILPOINT_ENV, "trash.deleting")],
    );
    assert!(!out.status.success(), "never reached trash.deleting");
    assert_eq!(
        fs::read_to_string(main.join("f0")).unwrap(),
        "0",
        "restored"
    );
    assert_eq!(trash_entries(&root), ["app.1", "app.2"]);
    let list = must_succeed(&volume_cli(&root, &["list"], &[]), "list");
    assert!(!list.contains("trash"), "the trash is no package: {list}");
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(
        !root.join(volume::layout::TRASH_DIR).exists(),
        "trash emptied"
    );
    assert_eq!(package_names(&root, "app"), ["app"]);
}

/// Dropping a backup (start-core's last step of a successful install)
/// takes it off the package in one rename under the lock, whatever it
/// holds: a snapshot with nested subvolumes (a commit each, deleted under
/// the lock) or a plain directory's reflink copy (entry by entry: 1.6 s for
/// 100k files). It is deleted from the trash with the lock free, so the
/// package's next command runs meanwhile. Structural: the drop is stopped
/// in its purge, whatever the machine's speed.
#[test]
fn a_drop_finishes_before_its_purge_which_holds_no_lock() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let stop = [(volume::FAILPOINT_ENV, "trash.deleting=stop")];
    for (pkg, plain) in [("app", false), ("plain", true)] {
        let main = root.join(pkg).join("data/main");
        if plain {
            fs::create_dir_all(&main).unwrap();
        } else {
            must_succeed(&volume_cli(&root, &["create", pkg, "main"], &[]), "create");
            subvolume_create(&main.join("nested"));
        }
        for i in 0..200 {
            fs::write(main.join(format!("f{i}")), i.to_string()).unwrap();
        }
        must_succeed(&volume_cli(&root, &["snapshot", pkg], &[]), "snapshot");
        let backup = root.join(format!("{pkg}.install-backup"));
        assert!(backup.join("data/main/f1").exists(), "{pkg}: the backup");

        let drop = spawn(
            "startos-volume",
            &root,
            &["drop", pkg],
            Opts {
                env: &stop,
                ..PLAIN
            },
        );
        let drop = stopped_at(drop, "trash.deleting");
        assert!(!backup.exists(), "{pkg}: dropped before its purge");
        let trashed = format!("{pkg}.1");
        assert_eq!(
            trash_entries(&root),
            [trashed.as_str()],
            "{pkg}: the backup"
        );
        let in_trash = root.join(volume::layout::TRASH_DIR).join(&trashed);
        assert_eq!(
            fs::read_to_string(in_trash.join("data/main/f1")).unwrap(),
            "1"
        );
        // The package is free while its old backup waits: the next
        // update's snapshot runs now.
        must_succeed(
            &volume_cli(&root, &["snapshot", pkg], &[]),
            "a snapshot while the drop's purge is stopped",
        );
        assert!(backup.join("data/main/f1").exists(), "{pkg}: a new backup");
        go_on(&drop);
        must_succeed(&drop.wait(TIMEOUT, "the continued drop"), "drop");
        assert!(
            !root.join(volume::layout::TRASH_DIR).exists(),
            "{pkg}: trash removed"
        );
        assert_eq!(fs::read_to_string(main.join("f1")).unwrap(), "1");
    }
    assert_no_transient_names(&root, "after the drops");
}

/// A tree kept while mounted (`<pkg>.held/<n>`), once unmounted, leaves the
/// package in one rename under its lock, as every tree the store no longer
/// uses: deleting it there took 0.5 s for 200k cached files, which held the
/// package's next operation (the one whose recovery reclaims it). It is
/// deleted from the trash with the lock free. Structural, as above.
#[test]
fn a_held_tree_once_unmounted_is_deleted_off_the_lock() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let main = cached_volume_with_backup(&root, 200);
    let mount = MountGuard::bind(&main, &fs.path("lxc/app/rootfs/data"));
    must_succeed(&volume_cli(&root, &["restore", "app"], &[]), "restore");
    let held = root.join("app.held/1");
    assert!(
        held.join("data/main/f1").exists(),
        "the replaced volume, kept"
    );
    mount.unmount();

    let stop = [(volume::FAILPOINT_ENV, "trash.deleting=stop")];
    let recover = spawn(
        "startos-volume",
        &root,
        &["recover", "app"],
        Opts {
            env: &stop,
            ..PLAIN
        },
    );
    let recover = stopped_at(recover, "trash.deleting");
    assert!(
        !root.join("app.held").exists(),
        "reclaimed before the purge"
    );
    assert_eq!(trash_entries(&root), ["app.1"], "the held tree");
    let in_trash = root.join(volume::layout::TRASH_DIR).join("app.1");
    assert_eq!(
        fs::read(in_trash.join("data/main/f0")).unwrap(),
        b"changed after the backup"
    );
    must_succeed(
        &volume_cli(&root, &["snapshot", "app"], &[]),
        "a snapshot while the reclaim's purge is stopped",
    );
    go_on(&recover);
    must_succeed(&recover.wait(TIMEOUT, "the continued recover"), "recover");
    assert!(
        !root.join(volume::layout::TRASH_DIR).exists(),
        "trash removed"
    );
    assert_no_transient_names(&root, "after the reclaim");
}
