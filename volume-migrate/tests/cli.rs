//! The `volume-migrate` binary: exit codes, one-line errors, --dry-run and
//! --json output, on real loop-mounted filesystems.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use test_fs::{LoopFs, fs_or_skip, tree_digest};

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_volume-migrate"))
        .args(args)
        .env_remove("STARTOS_VOLUME_FAILPOINT")
        .output()
        .expect("running volume-migrate")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

fn make_volume(root: &Path, pkg: &str) {
    let main = root.join(pkg).join("data/main");
    fs::create_dir_all(&main).unwrap();
    fs::write(main.join("db"), vec![7u8; 300_000]).unwrap();
    fs::write(root.join(pkg).join("data/.version"), b"1\n").unwrap();
}

#[test]
fn bad_input_is_one_line_and_nonzero() {
    let o = cli(&["--root", "/nonexistent/volumes"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("/nonexistent/volumes"));
    // Usage errors: one line naming what was wrong, exit 2.
    for (args, needle) in [
        (&["--no-such-flag"][..], "'--no-such-flag'"),
        (
            &["--method", "x"],
            "possible values: auto, clone, snapshot-parent",
        ),
        (&["--root"], "'--root <ROOT>'"),
    ] {
        let o = cli(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("volume-migrate: ") && err.contains(needle),
            "{args:?}: must name {needle}: {err}"
        );
        assert_eq!(stdout(&o), "", "{args:?}");
    }
    for flag in ["--help", "--version"] {
        let o = cli(&[flag]);
        assert_eq!(o.status.code(), Some(0), "{flag}: {o:?}");
        assert!(stdout(&o).contains("volume-migrate"), "{flag}: {o:?}");
    }
}

#[test]
fn off_btrfs_does_nothing_and_says_so() {
    let fs = fs_or_skip!(LoopFs::ext4(64 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "lnd");
    let o = cli(&["--root", root.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0));
    let why = format!("the volumes root {} is on ext4, not btrfs", root.display());
    assert_eq!(stdout(&o), format!("nothing to convert: {why}\n"));
    let o = cli(&["--root", root.to_str().unwrap(), "--json"]);
    let event = &json_lines(&o)[0];
    assert_eq!(event["event"], "not-btrfs");
    assert_eq!(event["why"], why, "{event}");
}

#[test]
fn dry_run_then_convert_with_json_then_nothing_to_do() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "lnd");
    make_volume(&root, "bitcoind");
    let before = tree_digest(&root.join("lnd")).unwrap();
    let r = root.to_str().unwrap();

    let o = cli(&["--root", r, "--dry-run"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("would convert bitcoind") && text.contains("would convert lnd"),
        "{text}"
    );
    assert!(text.contains("extents"), "{text}");
    let o = cli(&["--root", r, "--dry-run", "--json"]);
    let lines = json_lines(&o);
    let plan: Vec<_> = lines.iter().filter(|l| l["event"] == "plan").collect();
    assert_eq!(plan.len(), 2);
    assert!(
        plan[0]["estimate"]["extents"].as_u64().unwrap() >= 1,
        "{:?}",
        plan[0]
    );
    assert_eq!(
        plan[0]["method"], "snapshot-parent",
        "every package by a snapshot of the parent, small ones too"
    );
    assert_eq!(
        plan[0]["decision"]["method"], "snapshot-parent",
        "{:?}",
        plan[0]
    );
    assert!(
        text.contains("would convert lnd: snapshot its parent subvolume")
            && text.contains("every file keeping its identity"),
        "{text}"
    );
    // The space the conversions need, beside what the filesystem has free.
    let summary = lines.last().unwrap();
    assert_eq!(summary["event"], "summary");
    let needed: u64 = plan
        .iter()
        .map(|p| p["metadata_bytes"].as_u64().unwrap())
        .sum();
    assert!(needed > 0, "{plan:?}");
    assert_eq!(summary["metadata_needed"].as_u64(), Some(needed));
    let free = {
        let dir = fs::File::open(&root).unwrap();
        volume::sys::metadata_space(std::os::fd::AsFd::as_fd(&dir))
            .unwrap()
            .free()
    };
    // Equal unless a commit (of the scan's atime updates) fell in between.
    let reported = summary["metadata_free"].as_u64().unwrap();
    assert!(reported.abs_diff(free) < 4 << 20, "{summary} vs {free}");
    assert_eq!(summary["enough_space"], true);
    assert!(text.contains("metadata space:"), "{text}");
    assert!(
        !root.join("lnd.migrate").exists(),
        "a dry run changes nothing"
    );
    assert_eq!(tree_digest(&root.join("lnd")).unwrap(), before);

    let o = cli(&["--root", r, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines = json_lines(&o);
    let done: Vec<_> = lines.iter().filter(|l| l["event"] == "package").collect();
    assert_eq!(done.len(), 2);
    assert!(
        done.iter().all(|l| l["report"]["outcome"] == "converted"),
        "{done:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["event"] == "progress" && l["progress"]["phase"] == "carve")
    );
    let summary = lines.last().unwrap();
    assert_eq!(summary["event"], "summary");
    assert_eq!(summary["converted"], 2);
    assert_eq!(summary["old_removed"], 2);
    assert!(!root.join("lnd.migrate-old").exists());

    let o = cli(&["--root", r]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("nothing to convert"), "{}", stdout(&o));
}

/// A volume with little beside it: the dry run says it would snapshot the
/// parent, and the run does.
#[test]
fn dry_run_and_run_say_when_the_parent_is_snapshotted() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "electrs");
    test_fs::make_fragmented_file(&root.join("electrs/data/main/index"), 6000 * 8192, 6000, 3)
        .unwrap();
    let r = root.to_str().unwrap();
    let o = cli(&["--root", r, "--dry-run"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("would convert electrs: snapshot its parent subvolume"),
        "{}",
        stdout(&o)
    );
    let o = cli(&["--root", r, "--dry-run", "--json"]);
    let plan = json_lines(&o);
    assert_eq!(plan[0]["method"], "snapshot-parent", "{:?}", plan[0]);
    assert!(plan[0]["estimated_seconds"].is_null(), "{:?}", plan[0]);
    // Why: the estimated cost of each way, the cut at most half the clone.
    let micros = |way: &str| {
        plan[0][way]["micros"]
            .as_u64()
            .unwrap_or_else(|| panic!("{way}: {:?}", plan[0]))
    };
    assert!(
        micros("cut_cost") * 2 <= micros("clone_cost"),
        "{:?}",
        plan[0]
    );
    assert_eq!(
        plan[0]["decision"]["method"], "snapshot-parent",
        "{:?}",
        plan[0]
    );
    let o = cli(&["--root", r]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("converted electrs: a snapshot of its parent subvolume"),
        "{}",
        stdout(&o)
    );
    assert!(!root.join("electrs.migrate-old").exists());
}

#[test]
fn a_failed_package_exits_nonzero_naming_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "busy");
    make_volume(&root, "fine");
    let target = root.join("busy/data/main/mnt");
    fs::create_dir_all(&target).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&target)
        .status()
        .unwrap();
    assert!(mounted.success());
    let o = cli(&["--root", root.to_str().unwrap()]);
    let _ = Command::new("umount").arg("-l").arg(&target).status();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    // Progress lines, printed off a terminal once a run lasts a second, are
    // not part of the one line an error is.
    let said = err
        .lines()
        .filter(|l| !l.starts_with("volume-migrate: progress: "));
    assert_eq!(said.count(), 1, "{err}");
    assert!(
        err.contains("package busy") && err.contains("mounted at"),
        "{err}"
    );
    assert!(stdout(&o).contains("converted fine"), "{}", stdout(&o));
}

/// Off a terminal, progress is plain lines on stderr, each marked as
/// progress, none in a run's first second and at most ten a second after
/// it; stdout keeps one line per package and the summary.
#[test]
fn off_a_terminal_progress_is_plain_marked_lines_at_a_bounded_rate() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "electrs");
    let many = root.join("electrs/data/main/index");
    fs::create_dir_all(&many).unwrap();
    for i in 0..20_000 {
        fs::write(many.join(format!("{i:05}")), [i as u8; 64]).unwrap();
    }
    let r = root.to_str().unwrap();
    let started = std::time::Instant::now();
    let o = cli(&["--root", r, "--method", "clone"]);
    let took = started.elapsed().as_secs_f64();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("volume-migrate: progress: electrs ")),
        "{err}"
    );
    let bound = ((took - 1.0).max(0.0) * 10.0).ceil() as usize + 1;
    assert!(
        lines.len() <= bound,
        "{} lines in {took:.1} s: {err}",
        lines.len()
    );
    if took >= 2.5 {
        assert!(!lines.is_empty(), "a {took:.1} s run printed no progress");
    }
    assert!(stdout(&o).contains("converted electrs: "), "{}", stdout(&o));
    assert!(!stdout(&o).contains("progress"), "{}", stdout(&o));
}

/// With `--json`, a failure that ends the run is an `error` event on
/// stdout (the error, its kind and code) beside its one line on stderr.
#[test]
fn with_json_a_failed_run_says_why_on_stdout() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let file = fs.path("a-file");
    fs::write(&file, b"not a directory").unwrap();
    let f = file.to_str().unwrap();
    for args in [
        &["--json", "--root", "/nonexistent/volumes"][..],
        &["--json", "--dry-run", "--root", "/nonexistent/volumes"],
        &["--json", "--root", f],
    ] {
        let o = cli(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{args:?}: {}", stderr(&o));
        let lines = json_lines(&o);
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        let e = &lines[0];
        assert_eq!(e["event"], "error", "{e}");
        assert!(e["kind"].is_string() && e["code"].is_i64(), "{e}");
        let said = e["error"].as_str().unwrap_or_default();
        assert!(said.contains(args[args.len() - 1]), "{e}");
        assert!(stderr(&o).contains(said), "{e} vs {}", stderr(&o));
    }
    assert_eq!(fs::read(&file).unwrap(), b"not a directory");
}

/// A package volume holding a NOCOW file, for a clone to release in place.
fn make_nocow_volume(root: &Path, pkg: &str) {
    let main = root.join(pkg).join("data/main");
    fs::create_dir_all(&main).unwrap();
    let db = main.join("db");
    fs::write(&db, b"").unwrap();
    let chattr = Command::new("chattr").arg("+C").arg(&db).status().unwrap();
    assert!(chattr.success(), "chattr +C {}", db.display());
    fs::write(&db, vec![7u8; 300_000]).unwrap();
}

/// Entries named as packages that are no package volume: a file, a
/// symlink, a FIFO, by name, sorted; beside two packages with NOCOW files
/// (a clone of each releases them in place, listing the root again).
fn root_with_strays(fs: &LoopFs) -> (std::path::PathBuf, [&'static str; 3]) {
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("notes"), b"the operator's notes").unwrap();
    std::os::unix::fs::symlink("/etc", root.join("link")).unwrap();
    let fifo = Command::new("mkfifo")
        .arg(root.join("pipe"))
        .status()
        .unwrap();
    assert!(fifo.success());
    make_nocow_volume(&root, "db1");
    make_nocow_volume(&root, "db2");
    (root, ["link", "notes", "pipe"])
}

/// Each entry the run passes over is warned of once, however many clones
/// release their NOCOW files (each of which lists the root again).
#[test]
fn each_skipped_entry_is_warned_of_once() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let (root, strays) = root_with_strays(&fs);
    let o = cli(&["--root", root.to_str().unwrap(), "--method", "clone"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("converted db2"), "{}", stdout(&o));
    let err = stderr(&o);
    for stray in strays {
        let said = err
            .lines()
            .filter(|l| l.contains("skipped") && l.contains(&format!("/{stray}:")))
            .count();
        assert_eq!(said, 1, "{stray} said {said} times: {err}");
    }
    assert_eq!(
        fs::read(root.join("notes")).unwrap(),
        b"the operator's notes"
    );
}

/// With `--json`, each entry passed over is a `skipped` event on stdout
/// (its name, path and why), once, and no warning on stderr: in the dry
/// run and in the run.
#[test]
fn with_json_skipped_entries_are_events() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let (root, strays) = root_with_strays(&fs);
    let r = root.to_str().unwrap();
    for args in [
        &["--root", r, "--json", "--dry-run"][..],
        &["--root", r, "--json", "--method", "clone"],
    ] {
        let o = cli(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(
            !stderr(&o).contains("skipped"),
            "{args:?}: events, not warnings: {}",
            stderr(&o)
        );
        let skipped: Vec<_> = json_lines(&o)
            .into_iter()
            .filter(|l| l["event"] == "skipped")
            .collect();
        let names: Vec<_> = skipped.iter().map(|l| l["package"].clone()).collect();
        assert_eq!(names, strays, "{args:?}: {skipped:?}");
        for l in &skipped {
            assert!(
                l["why"]
                    .as_str()
                    .is_some_and(|w| w.contains("not a directory")),
                "{l}"
            );
            let name = l["package"].as_str().unwrap();
            assert_eq!(l["path"], format!("{r}/{name}"), "{l}");
        }
    }
    assert!(!root.join("db1.migrate-old").exists(), "db1 converted");
}

/// With `--json`, no progress report counts past its total once the totals
/// are known: the clone's entries end at the scan's count, the top of the
/// volume not among them.
#[test]
fn progress_never_counts_past_its_total() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 << 20));
    let root = fs.path("volumes");
    make_volume(&root, "lnd");
    let many = root.join("lnd/data/main/many");
    fs::create_dir_all(&many).unwrap();
    for i in 0..200 {
        fs::write(many.join(format!("{i:03}")), [i as u8; 64]).unwrap();
    }
    let o = cli(&[
        "--root",
        root.to_str().unwrap(),
        "--json",
        "--method",
        "clone",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let reports: Vec<_> = json_lines(&o)
        .into_iter()
        .filter(|l| l["event"] == "progress" && l["progress"]["totals_known"] == true)
        .map(|l| l["progress"].clone())
        .collect();
    assert!(!reports.is_empty(), "{}", stdout(&o));
    for p in &reports {
        for what in ["bytes", "extents", "entries"] {
            let (done, total) = (&p[format!("{what}_done")], &p[format!("{what}_total")]);
            assert!(
                done.as_u64() <= total.as_u64(),
                "{what} past its total: {p}"
            );
        }
    }
    let last = reports.last().unwrap();
    assert_eq!(last["phase"], "done", "{last}");
    assert_eq!(last["entries_done"], last["entries_total"], "{last}");
}

/// A root whose path is not UTF-8, with a stray in it, on btrfs and off
/// it: every `--json` line is JSON naming it lossily (serde refuses such a
/// path, and the event was built with `json!`, which panicked).
#[test]
fn a_root_whose_name_is_not_utf8_is_reported_in_json() {
    use std::os::unix::ffi::OsStrExt;
    for fs in [LoopFs::btrfs(512 << 20), LoopFs::ext4(64 << 20)] {
        let fs = fs_or_skip!(fs);
        let root = fs
            .path("")
            .join(std::ffi::OsStr::from_bytes(b"vol\xffumes"));
        make_volume(&root, "lnd");
        fs::write(root.join("stray"), b"not a volume").unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_volume-migrate"))
            .arg("--root")
            .arg(&root)
            .args(["--json", "--dry-run"])
            .env_remove("STARTOS_VOLUME_FAILPOINT")
            .output()
            .expect("running volume-migrate");
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let lines = json_lines(&o);
        let lossy = root.to_string_lossy();
        assert!(
            lines.iter().any(
                |l| l["path"].as_str().is_some_and(|p| p.starts_with(&*lossy))
                    || l["root"] == *lossy
            ),
            "{lines:?}"
        );
    }
}
