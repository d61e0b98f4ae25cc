//! Helpers shared by the tests that drive the fixture's call sites in the
//! reordered order (`finalize_call_sites.rs`, `crash_call_sites.rs`,
//! `faults_call_sites.rs`): boxes on a loop-mounted btrfs, the runner's
//! steps, and the checks that a package came back on its old version with
//! its old data, byte for byte, or on its new version with the old data
//! under the new, with no name of it left but its volume.
#![allow(dead_code)]

use std::path::PathBuf;

use integration::call_sites::{Box_, Ended, Order, Run};
use integration::{LoopFs, TreeDigest};
use serde_json::{Value, json};

use crate::common::{assert_same, digest};

/// Big enough for a box a kill point.
pub const SIZE: u64 = 512 << 20;

/// The `call-sites` runner.
pub fn bin() -> PathBuf {
    integration::workspace_bin("call-sites").unwrap_or_else(|e| {
        panic!("{e} (build it first: cargo build --workspace --bins --features ...)")
    })
}

/// A box of its own on `fs`: its data directory `name`.
pub fn new_box(fs: &LoopFs, name: &str) -> Box_ {
    let data = fs.path(name);
    std::fs::create_dir_all(&data).unwrap_or_else(|e| panic!("{}: {e}", data.display()));
    Box_ { bin: bin(), data }
}

/// The step that picks the reordered call sites: the order that stands
/// for our finalization.
pub fn reordered() -> Value {
    Order::Reordered.step()
}

pub fn boot() -> Value {
    json!("boot")
}

pub fn install(id: &str, version: &str) -> Value {
    json!({"install": {"id": id, "version": version}})
}

pub fn install_failing(id: &str, version: &str, fail: &str) -> Value {
    json!({"install": {"id": id, "version": version, "fail": fail}})
}

pub fn uninstall(id: &str, soft: bool) -> Value {
    json!({"uninstall": {"id": id, "soft": soft}})
}

pub fn arm(failpoint: &str) -> Value {
    json!({"arm": {"failpoint": failpoint}})
}

/// `steps` after the reordered order's step.
pub fn ordered(steps: &[Value]) -> Vec<Value> {
    std::iter::once(reordered())
        .chain(steps.iter().cloned())
        .collect()
}

/// Runs the reordered `steps` as one boot, killed or not.
pub fn run_any(b: &Box_, steps: &[Value]) -> Ended {
    b.run(&ordered(steps)).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs the reordered `steps` as one boot, which must not be killed.
pub fn run(b: &Box_, steps: &[Value]) -> Run {
    b.completed(&ordered(steps))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Runs the reordered `steps`, each of which must succeed.
#[track_caller]
pub fn run_ok(b: &Box_, steps: &[Value]) -> Run {
    let run = run(b, steps);
    assert!(run.ok(), "steps failed: {:?}\n{}", run.steps, run.stderr);
    run
}

/// The reordered `steps`, which must be killed at the failpoint armed.
#[track_caller]
pub fn killed(b: &Box_, steps: &[Value], when: &str) -> Run {
    match run_any(b, steps) {
        Ended::Killed(run) => run,
        Ended::Completed(run) => panic!(
            "{when}: not killed: run the tests with the failpoints features (as `make test` \
             does), or the kill point is not on the path\n{}",
            run.stderr
        ),
    }
}

/// The package's container's log in its main volume.
fn log_name(id: &str) -> String {
    format!("data/main/{id}.log")
}

/// The package's volume as the package sees it: every file, its content,
/// mode, owner, xattrs, which directories are subvolumes, but not the log
/// its container appends to (it goes on writing after each restart) or the
/// directory times those appends change.
pub fn content(b: &Box_, id: &str) -> TreeDigest {
    digest(&b.volumes().join(id))
        .without(log_name(id))
        .ignore_dir_mtimes()
}

/// What a package's data was before an operation: its content and its log.
#[derive(Debug, Clone)]
pub struct Before {
    pub content: TreeDigest,
    pub log: String,
}

/// The package's data now, with its service stopped (at a run's end).
pub fn before(b: &Box_, id: &str) -> Before {
    Before {
        content: content(b, id),
        log: log(b, id),
    }
}

/// The log its container wrote in the package's main volume.
pub fn log(b: &Box_, id: &str) -> String {
    std::fs::read_to_string(b.volumes().join(id).join(log_name(id))).unwrap_or_default()
}

/// `id` is `Installed` at `version`, running it, with no load of it failed,
/// and no name of it left but its volume (no backup, no transient name).
#[track_caller]
pub fn assert_settled(b: &Box_, run: &Run, id: &str, version: &str, when: &str) {
    assert_running(run, id, version, when);
    assert_eq!(b.names(id), [id], "{when}: names left");
}

/// `id` is `Installed` at `version`, running it, with no load of it failed.
#[track_caller]
pub fn assert_running(run: &Run, id: &str, version: &str, when: &str) {
    assert_eq!(
        run.installed(id).as_deref(),
        Some(version),
        "{when}: installed ({:?})\n{}",
        run.db.get(id),
        run.stderr
    );
    assert_eq!(
        run.running.get(id).map(String::as_str),
        Some(version),
        "{when}: running"
    );
    assert!(!run.loads_failed(id), "{when}: {:?}", run.loads(id));
}

/// The last line `id`'s container wrote before each stop in `run`, as the
/// run logged it.
pub fn last_writes_before_stop(run: &Run, id: &str) -> Vec<String> {
    let logged = format!("container of {id} stopped; last write: ");
    run.stderr
        .lines()
        .filter_map(|l| l.split_once(logged.as_str()))
        .map(|(_, w)| w.trim().trim_matches('"').to_owned())
        .filter(|w| !w.is_empty())
        .collect()
}

/// The pids of `id`'s containers that `run` started for a version other
/// than `version`, as the run logged them.
pub fn other_versions_pids(run: &Run, id: &str, version: &str) -> Vec<String> {
    let logged = format!("container of {id} ");
    run.stderr
        .lines()
        .filter_map(|l| l.split_once(logged.as_str()))
        .filter_map(|(_, rest)| rest.split_once(" started: pid "))
        .filter(|(v, _)| *v != version)
        .map(|(_, pid)| pid.trim().to_owned())
        .collect()
}

/// Back on `old` with the data it had, byte for byte: every write its
/// service made kept, the log going on from where it was, the last line
/// its container wrote before a stop in `run` (the update's) in it, and
/// none of what a container of another version started in `run` wrote.
#[track_caller]
pub fn assert_old(b: &Box_, run: &Run, id: &str, old: &str, before: &Before, when: &str) {
    assert_settled(b, run, id, old, when);
    assert_same(&before.content, &content(b, id), when);
    let now = log(b, id);
    assert!(
        now.starts_with(&before.log),
        "{when}: the log lost writes ({} bytes before)",
        before.log.len()
    );
    for last in last_writes_before_stop(run, id) {
        assert!(
            now.lines().any(|l| l == last),
            "{when}: the rollback lost {last:?}, written before the stop"
        );
    }
    for pid in other_versions_pids(run, id, old) {
        let theirs = format!("{id} {pid} ");
        assert!(
            !now.lines().any(|l| l.starts_with(&theirs)),
            "{when}: the log keeps what the container of another version (pid {pid}) wrote"
        );
    }
}

/// On `new`, with its init's data over the old data, which is all there.
/// Returns whether the install backup is left beside it: upstream's
/// protocol keeps it until the next `begin` when a crash came between the
/// commit of `Installed` and its `remove`; it then holds the old data,
/// byte for byte. No other name is left.
#[track_caller]
pub fn assert_new(b: &Box_, run: &Run, id: &str, new: &str, before: &Before, when: &str) -> bool {
    assert_running(run, id, new, when);
    let backup = format!("{id}.install-backup");
    let names = b.names(id);
    let kept = names == [id.to_owned(), backup.clone()];
    assert!(kept || names == [id], "{when}: names left: {names:?}");
    if kept {
        let old = digest(&b.volumes().join(&backup))
            .without(log_name(id))
            .ignore_dir_mtimes();
        assert_same(&before.content, &old, &format!("{when}: the backup left"));
    }
    let main = b.main(id);
    assert_eq!(
        std::fs::read_to_string(main.join("version"))
            .ok()
            .as_deref(),
        Some(new),
        "{when}: data version"
    );
    let old_data = before.content.clone().without("data/main/version");
    let now = content(b, id)
        .without("data/main/version")
        .without(format!("data/main/data-{new}"));
    assert_same(&old_data, &now, when);
    assert!(
        log(b, id).starts_with(&before.log),
        "{when}: the log lost writes"
    );
    kept
}
