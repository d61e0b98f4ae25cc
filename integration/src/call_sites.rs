//! Drives the `call-sites` runner of `fixtures/upstream-call-sites`
//! (start-core's own `ServiceMap::install` and `Service::load`, upstream's
//! order or the reordered one) and sweeps a SIGKILL over every step of an
//! update: each store failpoint inside the volume calls and each kill
//! point of the fixture's stand-ins between them (state commits, the
//! download, the container stopped and started, the init). Each kill is
//! followed by a reboot (boot maintenance, then the loads), and the package
//! classified: back on its old version with its old data, on its new
//! version with its new data, or a mix. `integration/tests/reorder.rs`
//! asserts on it, the `compare` binary's row h prints it.
//!
//! Each kill point gets a box of its own (a data directory on the caller's
//! filesystem), so one kill's leftovers never decide another's outcome.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub mod boot_loads;
pub mod sweep;

/// Why a run could not be made or read (as opposed to its outcome).
pub type Failure = String;

/// What one run of the runner (one boot of the box) printed.
#[derive(Debug, Default)]
pub struct Run {
    /// Each step's error, `None` for one that succeeded.
    pub steps: Vec<Option<String>>,
    /// The notifications and loads, as the runner printed them.
    pub events: Vec<Value>,
    /// The running services at the end: package and version.
    pub running: BTreeMap<String, String>,
    /// The database at the end: package and state.
    pub db: BTreeMap<String, Value>,
    /// The `watch` step's findings, per package.
    pub watch: BTreeMap<String, Value>,
    /// The runner's log.
    pub stderr: String,
}

impl Run {
    /// Whether every step succeeded.
    pub fn ok(&self) -> bool {
        self.steps.iter().all(Option::is_none)
    }

    /// The version `id` is `Installed` at, if it is.
    pub fn installed(&self, id: &str) -> Option<String> {
        self.db.get(id)?["Installed"]["installed"]
            .as_str()
            .map(str::to_owned)
    }

    /// The first `kind` event's `ms` for each package.
    pub fn first_ms(&self, kind: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for e in self.events.iter().filter_map(|e| e.get(kind)) {
            if let (Some(id), Some(ms)) = (e["id"].as_str(), e["ms"].as_f64()) {
                out.entry(id.to_owned()).or_insert(ms);
            }
        }
        out
    }

    /// Each `Service::load` of `id`: its disposition, and whether it
    /// returned a service (`Ok(true)`), none, or an error.
    pub fn loads(&self, id: &str) -> Vec<(String, Result<bool, String>)> {
        self.events
            .iter()
            .filter_map(|e| e.get("load"))
            .filter(|l| l["id"] == id)
            .map(|l| {
                let outcome = match l["error"].as_str() {
                    Some(e) => Err(e.to_owned()),
                    None => Ok(l["service"].as_bool().unwrap_or(false)),
                };
                (l["disposition"].as_str().unwrap_or("").to_owned(), outcome)
            })
            .collect()
    }

    /// The notifications for `id`, in order.
    pub fn notifications(&self, id: &str) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| e.get("notification"))
            .filter(|n| n["id"] == id)
            .map(|n| n["message"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

/// How a run ended: to its last step, or by a SIGKILL at a failpoint
/// (with what it printed before).
#[derive(Debug)]
pub enum Ended {
    /// Every step ran (each may have failed).
    Completed(Run),
    /// Killed at the armed failpoint.
    Killed(Run),
}

/// A box: a data directory the runner mounts at upstream's `DATA_DIR`.
#[derive(Debug, Clone)]
pub struct Box_ {
    /// The `call-sites` binary.
    pub bin: PathBuf,
    /// The data directory.
    pub data: PathBuf,
}

fn parse(stdout: &str) -> Result<Run, Failure> {
    let mut run = Run::default();
    for line in stdout.lines() {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{line}: {e}"))?;
        if v.get("step").is_some() {
            run.steps.push(v["error"].as_str().map(str::to_owned));
        } else if let Some(w) = v.get("watch") {
            run.watch = serde_json::from_value(w.clone()).map_err(|e| format!("{line}: {e}"))?;
        } else if v.get("db").is_some() {
            run.running = serde_json::from_value(v["running"].clone()).unwrap_or_default();
            run.db = serde_json::from_value(v["db"].clone()).unwrap_or_default();
        } else {
            run.events.push(v);
        }
    }
    Ok(run)
}

/// Kills what the run left in its process group (its containers) and waits
/// until none is left, as none outlives a reboot.
fn reap_group(pgid: u32) -> Result<(), Failure> {
    let pgid = rustix::process::Pid::from_raw(pgid as i32).ok_or("process group 0")?;
    let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
    let deadline = Instant::now() + Duration::from_secs(5);
    let group = pgid.as_raw_nonzero().to_string();
    while Instant::now() < deadline {
        let alive = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .any(|stat| {
                // After the command's closing parenthesis: state, ppid, pgrp.
                let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
                let f: Vec<&str> = rest.split_whitespace().collect();
                f.len() > 2 && f[0] != "Z" && f[2] == group
            });
        if !alive {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(format!("processes of group {group} alive after SIGKILL"))
}

impl Box_ {
    /// The package's volumes root.
    pub fn volumes(&self) -> PathBuf {
        self.data.join("package-data/volumes")
    }

    /// `id`'s main volume.
    pub fn main(&self, id: &str) -> PathBuf {
        self.volumes().join(id).join("data/main")
    }

    /// The names in the volumes root that belong to `id`, sorted.
    pub fn names(&self, id: &str) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(self.volumes()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n == id || n.starts_with(&format!("{id}.")))
            .collect();
        names.sort();
        names
    }

    /// Runs `steps` as one boot; `pause` stops it at that failpoint
    /// (`<name>=stop`) for that long, then lets it go on.
    pub fn run_paused(
        &self,
        steps: &[Value],
        pause: Option<(&str, Duration)>,
    ) -> Result<Ended, Failure> {
        self.run_with(steps, pause, &[])
    }

    /// Runs `steps` as one boot with `env` set in the runner's environment
    /// (such as `volume::sys::fault`'s, read once, at the runner's first
    /// system call through `volume::sys`).
    pub fn run_env(&self, steps: &[Value], env: &[(&str, &OsStr)]) -> Result<Ended, Failure> {
        self.run_with(steps, None, env)
    }

    fn run_with(
        &self,
        steps: &[Value],
        pause: Option<(&str, Duration)>,
        env: &[(&str, &OsStr)],
    ) -> Result<Ended, Failure> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run").arg(&self.data);
        cmd.args(steps.iter().map(Value::to_string));
        cmd.envs(env.iter().copied());
        cmd.env_remove(startos_core::FAILPOINT_ENV)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if let Some((fp, _)) = pause {
            cmd.env(startos_core::FAILPOINT_ENV, format!("{fp}=stop"));
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting call-sites: {e}"))?;
        let pid = child.id();
        let waiter = std::thread::spawn(move || child.wait_with_output());
        if let Some((_, pause)) = pause {
            wait_stopped(pid, &waiter)?;
            std::thread::sleep(pause);
            let pid = rustix::process::Pid::from_raw(pid as i32).ok_or("pid 0")?;
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::CONT);
        }
        let out = waiter
            .join()
            .map_err(|_| "waiting for call-sites panicked")?
            .map_err(|e| format!("waiting for call-sites: {e}"))?;
        reap_group(pid)?;
        let mut run = parse(&String::from_utf8_lossy(&out.stdout))?;
        run.stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.signal() == Some(libc::SIGKILL) {
            return Ok(Ended::Killed(run));
        }
        match out.status.code() {
            Some(0 | 3) => Ok(Ended::Completed(run)),
            _ => Err(format!(
                "call-sites ended with {}:\n{}",
                out.status, run.stderr
            )),
        }
    }

    /// Runs `steps` as one boot of the box.
    pub fn run(&self, steps: &[Value]) -> Result<Ended, Failure> {
        self.run_paused(steps, None)
    }

    /// Runs `steps`, which must complete.
    pub fn completed(&self, steps: &[Value]) -> Result<Run, Failure> {
        match self.run(steps)? {
            Ended::Completed(run) => Ok(run),
            Ended::Killed(run) => Err(format!("killed with no failpoint:\n{}", run.stderr)),
        }
    }
}

/// Waits until `pid` is stopped (SIGSTOP at its failpoint) or has ended.
fn wait_stopped<T>(pid: u32, waiter: &std::thread::JoinHandle<T>) -> Result<(), Failure> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && !waiter.is_finished() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(')').map_or("", |(_, r)| r).trim_start();
        if state.starts_with('T') {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if waiter.is_finished() {
        return Ok(());
    }
    Err(format!("call-sites {pid} never stopped"))
}

/// Which call sites a run drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Upstream's, as it writes them.
    Upstream,
    /// With the reorder's edits (the fixture's `service/reordered.rs`).
    Reordered,
}

impl Order {
    /// The step that selects it.
    pub fn step(self) -> Value {
        match self {
            Order::Upstream => json!({"order": "upstream"}),
            Order::Reordered => json!({"order": "reordered"}),
        }
    }
}

/// The step that boots the box (maintenance, then the loads as each
/// volume is ready).
pub fn boot() -> Value {
    json!("boot")
}

/// The install task's step: `id` at `version`, failing at `fail` if given.
pub fn install(id: &str, version: &str, fail: Option<&str>) -> Value {
    json!({"install": {"id": id, "version": version, "fail": fail}})
}

/// The step that arms `failpoint` from here on.
pub fn arm(failpoint: &str) -> Value {
    json!({"arm": {"failpoint": failpoint}})
}

/// The step that prints when the run reached it, named `name`
/// ([`Run::first_ms`] of `"mark"` gives it back), to time the steps
/// between two marks.
pub fn mark(name: &str) -> Value {
    json!({"mark": {"name": name}})
}
