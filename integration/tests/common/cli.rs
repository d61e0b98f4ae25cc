//! What the CLI tests check of every command: it succeeds or says why on
//! one line, and what a package looks like afterwards.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, Output};
use std::thread;
use std::time::{Duration, Instant};

use integration::TreeDigest;

use super::{assert_same, digest, package_names};

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The lines of a tool's stderr that say something other than progress:
/// off a terminal, `volume-migrate` prints plain progress lines once a run
/// has lasted a second (a loaded machine makes any run that long), and
/// those are not part of the one line an error must be.
pub fn said(err: &str) -> Vec<&str> {
    err.lines()
        .filter(|l| !l.starts_with("volume-migrate: progress: "))
        .collect()
}

/// Whether the command succeeded; if not, it must have said why on exactly
/// one line of stderr.
#[track_caller]
pub fn succeeded_or_one_line(out: &Output, what: &str) -> bool {
    if out.status.success() {
        return true;
    }
    let err = text(&out.stderr);
    assert_eq!(
        said(&err).len(),
        1,
        "{what} failed ({}) with other than one line on stderr: {err:?}",
        out.status
    );
    false
}

#[track_caller]
pub fn must_succeed(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} must succeed ({}): {}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[track_caller]
pub fn must_fail(out: &Output, what: &str, needle: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} must fail; stdout {}",
        text(&out.stdout)
    );
    let err = text(&out.stderr);
    assert_eq!(said(&err).len(), 1, "{what}: one line on stderr: {err:?}");
    assert!(
        err.contains(needle),
        "{what}: stderr must say {needle:?}: {err:?}"
    );
    err
}

/// What a package must look like: its live volume and its backup.
#[derive(Clone)]
pub struct Expect {
    pub live: Option<TreeDigest>,
    pub backup: Option<TreeDigest>,
}

impl Expect {
    pub fn of(root: &Path, pkg: &str) -> Expect {
        let (live, backup) = (root.join(pkg), root.join(format!("{pkg}.install-backup")));
        Expect {
            live: live.exists().then(|| digest(&live)),
            backup: backup.exists().then(|| digest(&backup)),
        }
    }

    /// Checks `pkg` against this, and that nothing but its volume and
    /// backup is left under its names.
    #[track_caller]
    pub fn check(&self, root: &Path, pkg: &str, when: &str) {
        let now = Expect::of(root, pkg);
        for (what, want, got) in [
            ("volume", &self.live, &now.live),
            ("backup", &self.backup, &now.backup),
        ] {
            match (want, got) {
                (Some(w), Some(g)) => assert_same(w, g, &format!("{when}: {pkg}'s {what}")),
                (None, None) => {}
                (w, g) => panic!(
                    "{when}: {pkg}'s {what} should {}exist, but {}",
                    if w.is_some() { "" } else { "not " },
                    if g.is_some() { "it does" } else { "it is gone" }
                ),
            }
        }
        let mut allowed = vec![pkg.to_owned()];
        allowed.push(format!("{pkg}.install-backup"));
        // The record of a backup's read-only nested subvolumes lives with it.
        if self.backup.is_some() {
            allowed.push(format!("{pkg}.install-backup.ro"));
        }
        let left: Vec<String> = package_names(root, pkg)
            .into_iter()
            .filter(|n| !allowed.contains(n))
            .collect();
        assert!(left.is_empty(), "{when}: {pkg} left {left:?}");
    }
}

/// Waits for `child` to exit, reading its piped stdout and stderr
/// meanwhile, for at most `timeout`; past that it is killed. Returns what it
/// printed and how it ended, and whether it had to be killed.
pub fn wait_within(mut child: Child, timeout: Duration) -> (Output, bool) {
    fn read_all<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<Vec<u8>> {
        thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    }
    let out_t = read_all(child.stdout.take());
    let err_t = read_all(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let mut hung = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for a child") {
            break status;
        }
        if Instant::now() >= deadline {
            hung = true;
            let _ = child.kill();
            break child.wait().expect("waiting for a killed child");
        }
        thread::sleep(Duration::from_millis(5));
    };
    let output = Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    };
    (output, hung)
}

/// Makes `cmd` run with a soft RLIMIT_NOFILE of `soft` (the hard limit as
/// it is).
#[allow(unsafe_code)] // setrlimit between fork and exec
pub fn limit_nofile(cmd: &mut Command, soft: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let hard = getrlimit(Resource::Nofile).maximum;
    // SAFETY: between fork and exec only setrlimit is called, which is
    // async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(soft),
                    maximum: hard,
                },
            )
            .map_err(std::io::Error::from)
        });
    }
}

/// `volume-migrate --root <root> --json`, with `failpoint` armed: whether
/// it was SIGKILLed, its exit code, and its stdout then stderr.
pub fn cli_run(root: &Path, failpoint: Option<&str>) -> (bool, i32, String) {
    cli_run_with(root, &[], failpoint)
}

/// [`cli_run`] with more arguments.
pub fn cli_run_with(root: &Path, args: &[&str], failpoint: Option<&str>) -> (bool, i32, String) {
    let mut cmd = Command::new(super::volume_migrate_bin());
    cmd.arg("--root")
        .arg(root)
        .arg("--json")
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null());
    if let Some(fp) = failpoint {
        cmd.env(volume::FAILPOINT_ENV, fp);
    }
    let out = cmd.output().expect("running volume-migrate");
    (
        out.status.signal() == Some(libc::SIGKILL),
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Runs the test `name` of this test binary alone as a child process, with
/// `env` set and the failpoint `failpoint` armed: whether SIGKILL ended it
/// (a failpoint's kill), and its stdout then stderr.
pub fn child_test(name: &str, env: &[(&str, &std::ffi::OsStr)], failpoint: &str) -> (bool, String) {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(volume::FAILPOINT_ENV, failpoint)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the child");
    (
        out.status.signal() == Some(libc::SIGKILL),
        text(&out.stdout) + &text(&out.stderr),
    )
}
