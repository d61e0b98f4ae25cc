//! The harness of the I/O-error sweep (`faults.rs`, `faults_call_sites.rs`);
//! see `faults.rs` for what it checks.
#![allow(dead_code)]

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::cli::text;
use super::*;
use integration::{LoopFs, TreeDigest, fs_or_skip};
use volume::sys::fault;

/// The errnos each call is made to fail with.
pub const ERRNOS: [&str; 5] = ["eio", "enospc", "erofs", "eperm", "emfile"];

/// The command that follows a failed one, chosen by k.
pub const NEXT: [&str; 5] = ["recover", "list", "snapshot", "restore", "drop"];

/// What the sweep writes into the live volume after a failure.
pub const MARKER: &str = "written-after-the-failure";

/// The specs `FAULTS_SPECS` names (comma-separated, such as `156:eio`), to
/// replay a failure the sweep found; `None` to sweep.
pub fn only_specs() -> Option<Vec<String>> {
    let list = std::env::var("FAULTS_SPECS").ok()?;
    Some(list.split(',').map(str::to_owned).collect())
}

/// Whether every k runs (`make faults`), not a sample.
pub fn full() -> bool {
    std::env::var_os("FAULTS_FULL").is_some()
}

pub fn bin(name: &str) -> PathBuf {
    integration::workspace_bin(name).unwrap_or_else(|e| panic!("{e}; run `make test`"))
}

/// A package's two trees, each absent or with its digest.
#[derive(Clone, PartialEq)]
pub struct Pair {
    pub live: Option<TreeDigest>,
    pub backup: Option<TreeDigest>,
}

impl Pair {
    pub fn of(root: &Path, pkg: &str) -> Pair {
        let tree = |p: PathBuf| {
            fs::symlink_metadata(&p)
                .is_ok_and(|m| m.is_dir())
                .then(|| digest(&p))
        };
        Pair {
            live: tree(root.join(pkg)),
            backup: tree(root.join(format!("{pkg}.install-backup"))),
        }
    }

    /// Both trees as [`strip`] leaves them.
    pub fn stripped(&self, ignore_mtimes: bool) -> Pair {
        Pair {
            live: self.live.clone().map(|d| strip(d, ignore_mtimes)),
            backup: self.backup.clone().map(|d| strip(d, ignore_mtimes)),
        }
    }

    pub fn show(&self) -> String {
        let one = |d: &Option<TreeDigest>| match d {
            Some(d) => format!("{} entries", d.len()),
            None => "absent".to_owned(),
        };
        format!("live {}, backup {}", one(&self.live), one(&self.backup))
    }
}

/// `d` without the marker, and without what writing it changed (the top's
/// time) or what a conversion changes by design: whether the top is a
/// subvolume, and the directory at its top where a cut set aside the rest
/// of its parent's snapshot (recorded as `<pkg>.migrate-rest`, removed by
/// the next run); with `ignore_mtimes`, no times at all (for trees made
/// anew, such as a created volume).
pub fn strip(d: TreeDigest, ignore_mtimes: bool) -> TreeDigest {
    let rests: Vec<Vec<u8>> = d
        .entries()
        .keys()
        .filter(|k| k.starts_with(b".startos-carve") && !k.contains(&b'/'))
        .cloned()
        .collect();
    let mut d = d.without(MARKER);
    for rest in rests {
        d = d.without(std::ffi::OsStr::from_bytes(&rest));
    }
    if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
        top.mtime = None;
        top.subvolume = integration::Subvolume::No;
    }
    if ignore_mtimes { d.ignore_mtimes() } else { d }
}

/// Which tool an operation runs.
#[derive(Clone, Copy)]
pub enum Tool {
    /// `startos-volume`.
    Volume,
    /// `volume-migrate`; its next step is the next boot's run.
    Migrate,
    /// This test binary run again as a child doing start-core's boot
    /// maintenance ([`CHILD_ENV`]); its next step is the next boot's.
    Boot,
}

/// One operation to sweep.
pub struct Case {
    /// Its name, for messages.
    pub name: &'static str,
    pub tool: Tool,
    /// The packages it concerns; the first is the one the command names.
    pub packages: &'static [&'static str],
    /// The tool's arguments.
    pub args: &'static [&'static str],
    /// Builds the state before the call (the root is empty).
    pub setup: fn(&Path),
    /// The complete state after the call, from the one before.
    pub after: fn(&Pair) -> Pair,
    /// Trees are made anew (times differ run to run).
    pub ignore_mtimes: bool,
}

/// A root and the binary directory, for a case's runs.
struct Sweep<'c> {
    root: PathBuf,
    case: &'c Case,
    log: PathBuf,
    /// Failures the call absorbed (exit 0, after-state), for the report:
    /// the call that failed, and how many times.
    absorbed: std::collections::BTreeMap<String, u64>,
    runs: u64,
}

/// Environment variable naming what a child run of this test binary does
/// (`boot`: start-core's boot maintenance), with [`CHILD_ROOT_ENV`].
pub const CHILD_ENV: &str = "FAULTS_CHILD_OP";
/// Environment variable: the volumes root of a child run.
pub const CHILD_ROOT_ENV: &str = "FAULTS_CHILD_ROOT";
/// The test a child run of this binary runs.
pub const CHILD_TEST: &str = "fault_child";

pub fn tool_command(tool: Tool, root: &Path, args: &[&str]) -> Command {
    let mut cmd = match tool {
        Tool::Volume => Command::new(bin("startos-volume")),
        Tool::Migrate => Command::new(bin("volume-migrate")),
        Tool::Boot => {
            let mut c = Command::new(std::env::current_exe().expect("current_exe"));
            c.args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, "boot")
                .env(CHILD_ROOT_ENV, root);
            c
        }
    };
    if !matches!(tool, Tool::Boot) {
        cmd.arg("--root").arg(root).args(args);
    }
    cmd.env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV)
        .env_remove(fault::FAULT_ENV)
        .stdin(Stdio::null());
    cmd
}

/// Removes everything under `root`: subvolumes whole (read-only ones made
/// writable), the rest entry by entry.
pub fn wipe(root: &Path) {
    let dir = volume::sys::open_dir_path(root).expect("opening the root");
    let dir = std::os::fd::AsFd::as_fd(&dir);
    for (name, _, _) in volume::sys::read_dir_names(dir).expect("reading the root") {
        volume::delete_tree_at(dir, &name)
            .unwrap_or_else(|e| panic!("wiping {}: {e}", root.join(&name).display()));
    }
}

impl Sweep<'_> {
    /// Runs the case with `spec` (`k:errno` or `k+:errno`); `false` if the
    /// fault never fired (the case makes fewer than k calls).
    fn run_one(&mut self, spec: &str, next: &str) -> bool {
        let c = self.case;
        let when = format!("{} with call {spec} failing", c.name);
        wipe(&self.root);
        (c.setup)(&self.root);
        let pkg = c.packages[0];
        let before: Vec<Pair> = c.packages.iter().map(|p| Pair::of(&self.root, p)).collect();
        let after: Vec<Pair> = before.iter().map(|b| (c.after)(b)).collect();
        let _ = fs::remove_file(&self.log);
        let out = tool_command(c.tool, &self.root, c.args)
            .env(fault::FAULT_ENV, spec)
            .env(fault::FAULT_LOG_ENV, &self.log)
            .output()
            .expect("running the operation");
        let fired = fs::read_to_string(&self.log).ok();
        let Some(fired) = fired else {
            assert!(
                out.status.success(),
                "{when}: never fired, yet failed: {}",
                text(&out.stderr)
            );
            return false;
        };
        self.runs += 1;
        let when = format!("{when} ({})", fired.trim());
        // 1 and 2: reported, and every volume is before or after.
        let now: Vec<Pair> = c.packages.iter().map(|p| Pair::of(&self.root, p)).collect();
        if out.status.success() {
            let call = fired.trim().split_once(' ').map_or("?", |(_, c)| c);
            *self
                .absorbed
                .entry(format!(
                    "{call} ({})",
                    spec.rsplit(':').next().unwrap_or("?")
                ))
                .or_default() += 1;
            for ((p, now), want) in c.packages.iter().zip(&now).zip(&after) {
                let ok = now.stripped(c.ignore_mtimes) == want.stripped(c.ignore_mtimes);
                assert!(
                    ok,
                    "{when}: exited 0, but {p} is not the after-state: {}; stdout {}",
                    now.show(),
                    text(&out.stdout)
                );
            }
        } else {
            let err = text(&out.stderr);
            match c.tool {
                // One error line, after any warnings the operation logged on
                // its way (a quota carry that failed before the error, say).
                Tool::Volume => {
                    assert_eq!(
                        err.lines().filter(|l| !l.starts_with(" WARN ")).count(),
                        1,
                        "{when}: one line on stderr: {err:?}"
                    )
                }
                // One line per package that failed, each naming it, or
                // one naming the volumes root; and warnings.
                Tool::Migrate | Tool::Boot => assert!(
                    !err.is_empty()
                        && err.lines().all(|l| {
                            c.packages
                                .iter()
                                .any(|p| l.contains(&format!("package {p}")))
                                || l.contains(&*self.root.to_string_lossy())
                                || l.starts_with(" WARN ")
                                || l.starts_with("volume-migrate: progress: ")
                        }),
                    "{when}: a line per failed package on stderr: {err:?}"
                ),
            }
        }
        for ((p, now), (b, a)) in c.packages.iter().zip(&now).zip(before.iter().zip(&after)) {
            let live = now.live.clone().map(|d| strip(d, c.ignore_mtimes));
            let ok = [b, a]
                .iter()
                .any(|s| s.stripped(c.ignore_mtimes).live == live);
            assert!(ok, "{when}: {p}'s volume is neither before nor after");
        }
        // 3: a write into the live volume survives the next command.
        let marked: Vec<bool> = c
            .packages
            .iter()
            .map(|p| {
                let live = self.root.join(p);
                let dir = fs::symlink_metadata(&live).is_ok_and(|m| m.is_dir());
                if dir {
                    fs::write(live.join(MARKER), b"the service went on")
                        .unwrap_or_else(|e| panic!("{when}: writing into {p}: {e}"));
                }
                dir
            })
            .collect();
        let restored = self.next(c, next, pkg, &when);
        for ((p, marked), (b, a)) in c
            .packages
            .iter()
            .zip(&marked)
            .zip(before.iter().zip(&after))
        {
            let live = self.root.join(p);
            let kept = live.join(MARKER).exists();
            if *marked && !(restored && *p == pkg) {
                assert!(
                    kept,
                    "{when}: the write into {p} after the failure is gone after `{next}`"
                );
            }
            // 4: nothing of it is left but its volume and backup, and what
            // it holds is the before or after state, less what `next` did.
            let pair = Pair::of(&self.root, p).stripped(c.ignore_mtimes);
            let (b, a) = (b.stripped(c.ignore_mtimes), a.stripped(c.ignore_mtimes));
            let live_ok = [&b.live, &a.live, &b.backup, &a.backup].contains(&&pair.live);
            assert!(
                live_ok,
                "{when}: after `{next}`, {p}'s volume is none of before, after, or a backup"
            );
            let names = package_names(&self.root, p);
            let allowed = [
                p.to_string(),
                format!("{p}.install-backup"),
                format!("{p}.install-backup.ro"),
            ];
            let left: Vec<&String> = names.iter().filter(|n| !allowed.contains(n)).collect();
            assert!(
                left.is_empty(),
                "{when}: after `{next}` and recovery, {p} left {left:?}"
            );
        }
        true
    }

    /// Runs the next command (no fault) and a recovery; whether the next
    /// command restored `pkg` (replacing what was written).
    fn next(&self, c: &Case, next: &str, pkg: &str, when: &str) -> bool {
        let out = match c.tool {
            // A conversion's next step is the next boot's run.
            Tool::Migrate | Tool::Boot => tool_command(c.tool, &self.root, &[]).output(),
            Tool::Volume => match next {
                "list" | "recover" => tool_command(Tool::Volume, &self.root, &[next]).output(),
                _ => tool_command(Tool::Volume, &self.root, &[next, pkg]).output(),
            },
        }
        .expect("running the next command");
        if !out.status.success() {
            // Refusing to snapshot over a backup, or a package with nothing
            // under the root, is fine (its recovery may have said what it
            // did first); anything else is not.
            let err = text(&out.stderr);
            let last = err.lines().last().unwrap_or_default();
            assert!(
                last.contains("already exists") || last.contains("no volume for"),
                "{when}: `{next}` after the failure failed: {err}"
            );
        }
        let restored = next == "restore" && text(&out.stdout).starts_with("restored ");
        let rec = tool_command(Tool::Volume, &self.root, &["recover"])
            .output()
            .expect("running recover");
        assert!(
            rec.status.success(),
            "{when}: `recover` after `{next}` failed: {}",
            text(&rec.stderr)
        );
        restored
    }

    /// How many calls the case makes, from a trace.
    fn calls(&mut self) -> u64 {
        wipe(&self.root);
        (self.case.setup)(&self.root);
        let _ = fs::remove_file(&self.log);
        let out: Output = tool_command(self.case.tool, &self.root, self.case.args)
            .env(fault::FAULT_ENV, "trace")
            .env(fault::FAULT_LOG_ENV, &self.log)
            .output()
            .expect("tracing the operation");
        assert!(
            out.status.success(),
            "{}: fails without a fault: {}",
            self.case.name,
            text(&out.stderr)
        );
        let n = fs::read_to_string(&self.log).map_or(0, |t| t.lines().count() as u64);
        assert!(
            n > 0,
            "{}: no call went through volume::sys",
            self.case.name
        );
        n
    }
}

/// Sweeps `case` and prints its counts: every k (full) or a sample of
/// about `sample` per errno and mode.
pub fn sweep(case: &Case, sample: u64) {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let mut s = Sweep {
        root,
        case,
        log: fs.path("fault.log"),
        absorbed: Default::default(),
        runs: 0,
    };
    let calls = s.calls();
    let mut specs = Vec::new();
    for (e, errno) in ERRNOS.iter().enumerate() {
        for sticky in [false, true] {
            let plus = if sticky { "+" } else { "" };
            let ks: Vec<u64> = if full() {
                (1..=calls + 1).collect()
            } else {
                // A stride through the calls, shifted by errno and mode so
                // that the sample covers different calls for each.
                let step = (calls / sample).max(1);
                let shift = (e as u64 * 2 + u64::from(sticky)) % step;
                (0..)
                    .map(|i| 1 + shift + i * step)
                    .take_while(|&k| k <= calls)
                    .collect()
            };
            for k in ks {
                specs.push((format!("{k}{plus}:{errno}"), k));
            }
        }
    }
    if let Some(only) = only_specs() {
        specs = only
            .into_iter()
            .map(|spec| {
                let k = spec.split([':', '+']).next().and_then(|k| k.parse().ok());
                (spec, k.unwrap_or(1))
            })
            .collect();
    }
    let mut past_end = 0;
    for (spec, k) in &specs {
        let next = NEXT[(*k as usize) % NEXT.len()];
        if !s.run_one(spec, next) {
            past_end += 1;
        }
    }
    let absorbed: u64 = s.absorbed.values().sum();
    println!(
        "fault sweep: {}: {} calls; {} injected failures ({} absorbed by design: {:?}), {} past the last call, all passing",
        case.name, calls, s.runs, absorbed, s.absorbed, past_end
    );
}

/// The calls `tool --root ROOT ARGS` makes through `volume::sys`.
pub fn trace(tool: &str, root: &Path, args: &[&str]) -> Vec<String> {
    let log = root.with_extension(format!("trace-{tool}-{}", args.join("-")));
    let _ = fs::remove_file(&log);
    let out = Command::new(bin(tool))
        .arg("--root")
        .arg(root)
        .args(args)
        .env(fault::FAULT_ENV, "trace")
        .env(fault::FAULT_LOG_ENV, &log)
        .output()
        .expect("running the tool");
    assert!(out.status.success(), "{tool} {args:?}: {out:?}");
    let calls = fs::read_to_string(&log)
        .expect("reading the trace")
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(_, call)| call.to_owned()))
        .collect();
    let _ = fs::remove_file(&log);
    calls
}
