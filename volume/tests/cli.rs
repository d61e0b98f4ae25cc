//! The `startos-volume` binary, end to end, on loop-mounted filesystems.
//!
//! Every subcommand in text and `--json` form, and the promise for failures: exit
//! non-zero, exactly one line on stderr naming the problem, nothing changed on disk.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};
use test_fs::{LoopFs, TreeDigest, fs_or_skip, run, tree_digest};

const BIN: &str = env!("CARGO_BIN_EXE_startos-volume");

fn startos_volume(root: &OsStr, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("running startos-volume")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs a command that must succeed quietly and returns its stdout.
#[track_caller]
fn ok(root: &Path, args: &[&str]) -> String {
    let out = startos_volume(root.as_os_str(), args);
    assert!(
        out.status.success(),
        "startos-volume {args:?} failed ({}): {}",
        out.status,
        text(&out.stderr)
    );
    assert_eq!(
        text(&out.stderr),
        "",
        "startos-volume {args:?} wrote to stderr"
    );
    text(&out.stdout)
}

/// Runs a command with `--json` that must succeed and print one JSON document.
#[track_caller]
fn ok_json(root: &Path, args: &[&str]) -> Value {
    let mut with_json = vec!["--json"];
    with_json.extend_from_slice(args);
    let stdout = ok(root, &with_json);
    assert_eq!(stdout.lines().count(), 1, "one line of JSON: {stdout:?}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: bad JSON {stdout:?}: {e}"))
}

/// Runs a command that must fail with exactly one line on stderr containing
/// `needle`, and print nothing on stdout but, with `--json`, one object
/// holding the same error and its kind and code.
#[track_caller]
fn fails(root: &OsStr, args: &[&str], needle: &str) -> String {
    let out = startos_volume(root, args);
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success(),
        "startos-volume {args:?} must fail; stdout: {}",
        text(&out.stdout)
    );
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    let stdout = text(&out.stdout);
    if args.contains(&"--json") {
        assert_eq!(
            stdout.lines().count(),
            1,
            "{args:?}: one JSON line: {stdout:?}"
        );
        let v: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{args:?}: bad JSON {stdout:?}: {e}"));
        let error = v["error"].as_str().unwrap_or_default();
        assert!(error.contains(needle), "{args:?}: {v}");
        assert!(v["kind"].is_string() && v["code"].is_i64(), "{args:?}: {v}");
    } else {
        assert_eq!(stdout, "", "{args:?}: nothing on stdout");
    }
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?}: exactly one line on stderr, got {stderr:?}"
    );
    assert!(
        stderr.starts_with("startos-volume: "),
        "{args:?}: {stderr:?}"
    );
    assert!(
        stderr.contains(needle),
        "{args:?}: stderr must name {needle:?}: {stderr:?}"
    );
    stderr
}

fn volumes_root(fs: &LoopFs) -> PathBuf {
    let root = fs.path("volumes");
    fs::create_dir(&root).expect("mkdir volumes");
    root
}

fn digest(path: &Path) -> TreeDigest {
    tree_digest(path).unwrap_or_else(|e| panic!("digest of {}: {e}", path.display()))
}

#[track_caller]
fn assert_unchanged(before: &TreeDigest, root: &Path, what: &str) {
    let diff = before.diff(&digest(root));
    assert!(
        diff.is_empty(),
        "{what} changed the root:\n  {}",
        diff.join("\n  ")
    );
}

#[test]
fn every_subcommand_in_text_and_json() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    let canon = root.canonicalize().unwrap();

    // create
    let out = ok(&root, &["create", "app", "main", "extra"]);
    assert_eq!(
        out,
        format!("created {} (subvolume)\n", canon.join("app").display())
    );
    assert!(root.join("app/data/main").is_dir() && root.join("app/data/extra").is_dir());
    let v = ok_json(&root, &["create", "db", "main"]);
    assert_eq!(
        v,
        json!({"package": "db", "volume": "subvolume", "path": canon.join("db"), "existed": false})
    );
    // Again: it already existed, and says so; the volume dirs it lacked
    // are made.
    let out = ok(&root, &["create", "app", "main", "more"]);
    assert_eq!(
        out,
        format!(
            "already existed: {} (subvolume)\n",
            canon.join("app").display()
        )
    );
    assert!(root.join("app/data/more").is_dir());
    fs::remove_dir(root.join("app/data/more")).unwrap();
    let v = ok_json(&root, &["create", "db", "main"]);
    assert_eq!(
        v,
        json!({"package": "db", "volume": "subvolume", "path": canon.join("db"), "existed": true})
    );
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    fs::write(root.join("db/data/main/state"), b"v1").unwrap();

    // snapshot
    let out = ok(&root, &["snapshot", "app"]);
    assert_eq!(
        out,
        format!("snapshot {}\n", canon.join("app.install-backup").display())
    );
    let v = ok_json(&root, &["snapshot", "db"]);
    assert_eq!(
        v,
        json!({"package": "db", "backup": {"outcome": "snapshot"}, "created": true})
    );
    // A package with nothing under the root: one line, exit 1, for every
    // command that names it, and nothing made for it (not even a lock).
    let r = root.as_os_str();
    let before = digest(&root);
    for op in ["snapshot", "restore", "drop", "delete", "usage", "recover"] {
        fails(r, &[op, "fresh"], "no volume for fresh");
        fails(r, &["--json", op, "fresh"], "no volume for fresh");
    }
    assert_unchanged(&before, &root, "commands on a package that does not exist");

    // list, --json after the subcommand too (a global flag)
    let out = ok(&root, &["list"]);
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines,
        [
            vec![
                "PACKAGE",
                "VOLUME",
                "BACKUP",
                "USAGE",
                "BACKUP-ONLY",
                "OTHER"
            ],
            vec!["app", "subvolume", "subvolume", "2", "B", "0", "B", "-"],
            vec!["db", "subvolume", "subvolume", "2", "B", "0", "B", "-"],
        ],
        "{out}"
    );
    let out = ok(&root, &["list", "--json"]);
    let v: Value = serde_json::from_str(&out).expect("list --json");
    let rows = v.as_array().expect("list --json is an array");
    assert_eq!(rows.len(), 2, "{v}");
    for (row, name) in rows.iter().zip(["app", "db"]) {
        assert_eq!(row["package"], name);
        assert_eq!(row["volume"], "subvolume");
        assert_eq!(row["backup"], "subvolume");
        // "v1" is stored inline: 2 bytes on disk, shared with the backup.
        assert_eq!(row["usage"]["volume"]["total"]["disk"], 2, "{row}");
        assert_eq!(row["usage"]["volume"]["inline"], 1, "{row}");
        assert_eq!(row["usage"]["split"]["backup_only"], 0, "{row}");
    }

    // usage
    let v = ok_json(&root, &["usage", "app"]);
    assert_eq!(v["package"], "app");
    assert_eq!(v["volume"]["files"], 1, "{v}");
    assert_eq!(v["backup"]["files"], 1, "{v}");
    let out = ok(&root, &["usage", "app"]);
    assert!(
        out.starts_with("volume: 1 files, 0 regular extents (0 refs), 1 inline\n"),
        "{out}"
    );
    assert!(out.contains("install backup: 1 files"), "{out}");

    // restore
    fs::write(root.join("app/data/main/state"), b"v2").unwrap();
    fs::write(root.join("db/data/main/state"), b"v2").unwrap();
    let out = ok(&root, &["restore", "app"]);
    assert_eq!(
        out,
        format!(
            "restored {} from its install backup\n",
            canon.join("app").display()
        )
    );
    assert_eq!(fs::read(root.join("app/data/main/state")).unwrap(), b"v1");
    assert_eq!(
        ok_json(&root, &["restore", "db"]),
        json!({"package": "db", "restored": true, "held": null})
    );
    assert_eq!(fs::read(root.join("db/data/main/state")).unwrap(), b"v1");
    assert_eq!(
        ok_json(&root, &["restore", "db"]),
        json!({"package": "db", "restored": false, "held": null})
    );
    assert_eq!(
        ok(&root, &["restore", "db"]),
        "no install backup for db: nothing restored\n"
    );
    assert!(!root.join("app.install-backup").exists());

    // drop
    ok(&root, &["snapshot", "app"]);
    ok(&root, &["snapshot", "db"]);
    assert_eq!(
        ok(&root, &["drop", "app"]),
        "dropped the install backup of app\n"
    );
    assert_eq!(ok(&root, &["drop", "app"]), "no install backup for app\n");
    assert_eq!(
        ok_json(&root, &["drop", "db"]),
        json!({"package": "db", "dropped": true})
    );
    assert_eq!(
        ok_json(&root, &["drop", "db"]),
        json!({"package": "db", "dropped": false})
    );
    assert!(!root.join("app.install-backup").exists() && !root.join("db.install-backup").exists());

    // recover: nothing to do, then something
    assert_eq!(ok(&root, &["recover"]), "");
    assert_eq!(ok_json(&root, &["recover"]), json!([]));
    assert_eq!(
        ok_json(&root, &["recover", "app"]),
        json!([{"package": "app", "actions": []}])
    );
    fs::create_dir(root.join("app.install-backup.tmp")).unwrap();
    fs::write(root.join("app.install-backup.tmp/partial"), b"x").unwrap();
    // Recovery logs what it did as a warning on stderr, so not `ok`.
    let mut cmd = Command::new(BIN);
    let out = run(cmd.args(["--json", "--root"]).arg(&root).arg("recover")).expect("recover");
    let v: Value = serde_json::from_slice(&out.stdout).expect("recover --json");
    assert_eq!(
        v,
        json!([{"package": "app", "actions": ["deleted an incomplete install backup"]}])
    );
    assert!(!root.join("app.install-backup.tmp").exists());
    fs::create_dir(root.join("db.install-backup.tmp")).unwrap();
    let out = run(Command::new(BIN)
        .arg("--root")
        .arg(&root)
        .args(["recover", "db"]))
    .expect("recover db");
    assert_eq!(
        text(&out.stdout),
        "db: deleted an incomplete install backup\n"
    );
    assert!(!root.join("db.install-backup.tmp").exists());

    // delete
    ok(&root, &["snapshot", "app"]);
    assert_eq!(ok(&root, &["delete", "app"]), "deleted the volume of app\n");
    fails(root.as_os_str(), &["delete", "app"], "no volume for app");
    assert_eq!(
        ok_json(&root, &["delete", "db"]),
        json!({"package": "db", "deleted": true, "held": null})
    );
    fails(
        root.as_os_str(),
        &["--json", "delete", "db"],
        "no volume for db",
    );
    assert_eq!(ok_json(&root, &["list"]), json!([]));
    assert_eq!(ok(&root, &["list"]).lines().count(), 1, "just the header");
    let left: Vec<_> = fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left in the root: {left:?}");
}

#[test]
fn snapshot_on_ext4_reports_the_skip() {
    let fs = fs_or_skip!(LoopFs::ext4(64 << 20));
    let root = volumes_root(&fs);
    let canon = root.canonicalize().unwrap();
    // Each fallback says why: the root, and what it is on.
    let why = format!("the volumes root {} is on ext4, not btrfs", canon.display());
    let v = ok_json(&root, &["create", "app", "main"]);
    assert_eq!(v["volume"], json!("directory"), "{v}");
    assert_eq!(v["why"], json!(why), "{v}");
    assert_eq!(
        ok(&root, &["create", "web", "main"]),
        format!(
            "created {} (directory: {why})\n",
            canon.join("web").display()
        )
    );
    let out = startos_volume(root.as_os_str(), &["--json", "snapshot", "app"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("snapshot --json");
    assert_eq!(v["created"], json!(false), "{v}");
    assert_eq!(v["backup"]["outcome"], json!("skipped"), "{v}");
    assert_eq!(v["backup"]["reason"], json!(why), "{v}");
    assert_eq!(v["why"], json!(why), "{v}");
    // The skip is also a warning on stderr, naming the package and why.
    let warned = text(&out.stderr);
    assert!(warned.contains("app") && warned.contains(&why), "{warned}");
    let out = startos_volume(root.as_os_str(), &["snapshot", "web"]);
    assert_eq!(text(&out.stdout), format!("no backup for web: {why}\n"));
    assert!(!root.join("app.install-backup").exists());

    // Space accounting reads btrfs trees: off btrfs it says so, in one line,
    // and `list` still works, without the usage figures.
    fails(root.as_os_str(), &["usage", "app"], "not on btrfs");
    let out = ok(&root, &["list"]);
    assert!(
        out.lines()
            .nth(1)
            .is_some_and(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["app", "directory", "-", "-", "-", "-"]),
        "{out}"
    );
}

/// On btrfs, a volume still a plain directory (made before the conversion)
/// is backed up by a reflink copy, not a snapshot: the line and the JSON
/// say so, and why.
#[test]
fn a_reflink_copy_in_place_of_a_snapshot_says_why() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    let canon = root.canonicalize().unwrap();
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    let why = "the volume is a plain directory, not yet converted to a subvolume \
               (volume-migrate converts it)";
    let v = ok_json(&root, &["create", "app", "main"]);
    assert_eq!(v["volume"], json!("directory"), "{v}");
    assert_eq!(v["existed"], json!(true), "{v}");
    assert_eq!(v["why"], json!(why), "{v}");
    let out = ok(&root, &["snapshot", "app"]);
    assert_eq!(
        out,
        format!(
            "reflink copy {} (1 extents), not a snapshot: {why}\n",
            canon.join("app.install-backup").display()
        )
    );
    ok(&root, &["drop", "app"]);
    let v = ok_json(&root, &["snapshot", "app"]);
    assert_eq!(v["backup"]["outcome"], json!("reflink-copy"), "{v}");
    assert_eq!(v["why"], json!(why), "{v}");
}

#[test]
fn bad_input_fails_with_one_line_and_changes_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    ok(&root, &["create", "app", "main"]);
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    ok(&root, &["snapshot", "app"]);
    let before = digest(&root);

    let r = root.as_os_str();
    for (args, needle) in [
        (&["create", "Bad.Id", "main"][..], "\"Bad.Id\""),
        (&["snapshot", "Bad.Id"], "\"Bad.Id\""),
        (&["restore", "../x"], "\"../x\""),
        (&["drop", "../x"], "\"../x\""),
        (&["delete", ""], "invalid id \"\""),
        (&["recover", "app.install-backup"], "\"app.install-backup\""),
        (&["create", "app", "main", "Bad_Vol"], "\"Bad_Vol\""),
        (&["create", "app", "../../etc"], "\"../../etc\""),
        (&["usage", "Bad.Id"], "\"Bad.Id\""),
    ] {
        fails(r, args, needle);
        assert_unchanged(&before, &root, &format!("{args:?}"));
    }

    let missing = fs.path("no-such-dir");
    let m = missing.display().to_string();
    fails(missing.as_os_str(), &["list"], &m);
    fails(missing.as_os_str(), &["create", "app", "main"], &m);
    assert!(!missing.exists(), "a missing root must not be created");

    let file = fs.path("a-file");
    fs::write(&file, b"not a directory").unwrap();
    let f = file.display().to_string();
    fails(file.as_os_str(), &["list"], &f);
    fails(file.as_os_str(), &["create", "app", "main"], &f);
    assert_eq!(fs::read(&file).unwrap(), b"not a directory");
    assert_unchanged(&before, &root, "bad roots");
}

/// A bind mount made by the test, undone even if the test fails.
struct Bind(Option<PathBuf>);

impl Bind {
    fn new(source: &Path, target: &Path) -> Bind {
        fs::create_dir_all(target).unwrap();
        run(Command::new("mount").arg("--bind").arg(source).arg(target)).expect("mount --bind");
        Bind(Some(target.to_path_buf()))
    }

    fn unmount(mut self) {
        if let Some(target) = self.0.take() {
            run(Command::new("umount").arg(&target)).expect("umount");
        }
    }
}

impl Drop for Bind {
    fn drop(&mut self) {
        if let Some(target) = self.0.take() {
            let _ = Command::new("umount").arg("-l").arg(target).output();
        }
    }
}

#[test]
fn an_existing_backup_fails_with_one_line_and_a_mount_keeps_the_replaced_tree() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    ok(&root, &["create", "app", "main"]);
    fs::write(root.join("app/data/main/state"), b"v1").unwrap();
    ok(&root, &["snapshot", "app"]);
    fs::write(root.join("app/data/main/state"), b"v2").unwrap();
    let before = digest(&root);

    // snapshot over an existing backup
    let backup = root.canonicalize().unwrap().join("app.install-backup");
    let line = fails(
        root.as_os_str(),
        &["snapshot", "app"],
        &backup.display().to_string(),
    );
    assert!(line.contains("Incoherent"), "{line}");
    assert_unchanged(&before, &root, "a refused snapshot");

    // A restore of a bind-mounted volume goes on: the replaced tree is
    // kept under app.held/1 while the mount shows it, the mount point named.
    let target = fs.path("container/rootfs/data");
    let bind = Bind::new(&root.join("app/data/main"), &target);
    let run = startos_volume(root.as_os_str(), &["restore", "app"]);
    assert!(run.status.success(), "restore under a mount: {run:?}");
    let (out, warned) = (text(&run.stdout), text(&run.stderr));
    let t = target.display().to_string();
    assert!(out.contains("app.held/1") && out.contains(&t), "{out}");
    assert_eq!(warned.lines().count(), 1, "one warning line: {warned:?}");
    assert!(warned.contains("WARN") && warned.contains(&t), "{warned}");
    assert_eq!(fs::read(root.join("app/data/main/state")).unwrap(), b"v1");
    assert_eq!(
        fs::read(target.join("state")).unwrap(),
        b"v2",
        "the mount still shows the replaced tree, kept whole"
    );
    bind.unmount();
    // Once nothing holds it, the next operation reclaims it.
    let recovered = startos_volume(root.as_os_str(), &["recover"]);
    assert!(recovered.status.success(), "recover: {recovered:?}");
    assert!(!root.join("app.held").exists(), "reclaimed once unmounted");
}

/// A usage error (an unknown flag, a missing argument, a bad value) is one
/// line on stderr naming what was wrong, exit 2, before anything is
/// opened; `--help` and `--version` print as usual and exit 0.
#[test]
fn usage_errors_are_one_line_and_help_still_works() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    ok(&root, &["create", "app", "main"]);
    let before = digest(&root);
    for (args, needle) in [
        (&["--bogus", "list"][..], "'--bogus'"),
        (&["create"], "<PKG>"),
        (&["--lock-wait", "soon", "list"], "'soon'"),
        (&["frobnicate"], "'frobnicate'"),
    ] {
        let out = startos_volume(root.as_os_str(), args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr:?}");
        assert!(
            stderr.starts_with("startos-volume: ") && stderr.contains(needle),
            "{args:?}: must name {needle}: {stderr:?}"
        );
        assert_eq!(text(&out.stdout), "", "{args:?}");
    }
    assert_unchanged(&before, &root, "usage errors");
    for flag in ["--help", "--version"] {
        let out = startos_volume(root.as_os_str(), &[flag]);
        assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
        assert!(
            text(&out.stdout).contains("startos-volume"),
            "{flag}: {out:?}"
        );
    }
    assert!(text(&startos_volume(root.as_os_str(), &["--help"]).stdout).contains("Usage:"));
}

/// A package whose lock another process holds is reported busy by
/// `recover`, by name (a `Timeout`, not `Incoherent`: nothing is wrong
/// with it), and with `--json` the one document is the list, that
/// package's entry marked busy.
#[test]
fn recover_reports_a_busy_package_as_busy() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = volumes_root(&fs);
    ok(&root, &["create", "app", "main"]);
    ok(&root, &["create", "web", "main"]);
    let dir = fs::File::open(&root).unwrap();
    let locks = volume::lock::LockDir::for_root(std::os::fd::AsFd::as_fd(&dir)).unwrap();
    let app: volume::PackageId = "app".parse().unwrap();
    let held = locks.lock(&app).unwrap();

    let wait = ["--lock-wait", "0.2"];
    let out = startos_volume(root.as_os_str(), &[&wait[..], &["recover"]].concat());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("startos-volume: Timeout Error: package app is busy: "),
        "{stderr}"
    );
    assert!(!stderr.contains("Incoherent"), "{stderr}");

    let out = startos_volume(
        root.as_os_str(),
        &[&wait[..], &["--json", "recover"]].concat(),
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "one JSON document: {stdout}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v[0]["package"], "app", "{v}");
    assert_eq!(v[0]["busy"], true, "{v}");
    assert_eq!(v.as_array().map(Vec::len), Some(1), "web recovered: {v}");

    // One package named: its own busy error.
    let out = startos_volume(root.as_os_str(), &[&wait[..], &["recover", "app"]].concat());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("package app: busy"), "{stderr}");
    drop(held);
    assert_eq!(ok(&root, &["recover"]), "");
}
