//! The update-finalization workload, through start-core's own call sites:
//! the `call-sites` runner of `fixtures/upstream-call-sites` updates a
//! package on the disk under test with the reordered `ServiceMap::install`
//! (stop, snapshot, install, then drop or restore), the runner's data
//! directory being the disk's mount point: its state store (the fixture's
//! `db.rs`, one JSON file a package under `main/db/`), the s9pk archive and
//! the volumes root (`package-data/volumes`) all on that disk. Recovery is
//! the next boot of the box: the runner's `boot` step (boot maintenance,
//! then each package's `Service::load`).
//!
//! The new version's init (the fixture's stand-in) writes `data-<version>`
//! and `version` in the package's `main` volume; its container appends to
//! `<pkg>.log` there while it runs.

use std::io;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::call_sites::{Box_, Order, Run, boot, install};

/// The version installed before the update.
pub const OLD_VERSION: &str = "1.0.0";
/// The version the update installs.
pub const NEW_VERSION: &str = "2.0.0";
/// The volumes root under the runner's data directory.
pub const VOLUMES: &str = "package-data/volumes";

/// Sets `path`'s times without following a symlink: access `sec`, modify
/// `sec` and `nsec` (a nonzero `nsec` shows a copy keeps nanoseconds).
pub fn set_mtime(path: &Path, sec: i64, nsec: i64) -> io::Result<()> {
    let t = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: sec,
            tv_nsec: 0,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: sec,
            tv_nsec: nsec as _,
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &t,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(io::Error::from)
}

/// The runner beside this binary (in the guest, `/bin/call-sites`), else
/// the workspace's.
pub fn runner() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let beside = exe.with_file_name("call-sites");
    if beside.is_file() {
        return Ok(beside);
    }
    crate::workspace_bin("call-sites")
}

/// Runs `steps` as one boot of the box whose data directory is `data`;
/// every step must succeed.
pub fn run(data: &Path, steps: &[Value]) -> Result<Run, String> {
    let b = Box_ {
        bin: runner()?,
        data: data.to_owned(),
    };
    let run = b.completed(steps)?;
    if !run.ok() {
        return Err(format!(
            "call-sites {steps:?}: {:?}\n{}",
            run.steps, run.stderr
        ));
    }
    Ok(run)
}

/// The package `pkg`, installed at [`OLD_VERSION`] by an earlier system: its
/// state and s9pk written (the runner's `seed` step), nothing started.
pub fn seed(data: &Path, pkg: &str) -> Result<Run, String> {
    run(
        data,
        &[json!({"seed": {"id": pkg, "version": OLD_VERSION}})],
    )
}

/// The update of `pkg` to [`NEW_VERSION`] through the reordered install
/// task, with no boot before it (the service is not running).
pub fn update(data: &Path, pkg: &str) -> Result<Run, String> {
    run(
        data,
        &[Order::Reordered.step(), install(pkg, NEW_VERSION, None)],
    )
}

/// The box's next boot, through the reordered `Service::load`: what a
/// power cut is recovered by.
pub fn recover(data: &Path) -> Result<Run, String> {
    run(data, &[Order::Reordered.step(), boot()])
}

/// `pkg`'s state in the runner's state store on `data` (the fixture's
/// `PackageState` as its `db.rs` writes it), `None` if it lists none.
pub fn state(data: &Path, pkg: &str) -> Result<Option<Value>, String> {
    let path = data.join("main/db").join(format!("{pkg}.json"));
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The box's next boot, then the user's retry of the update to
/// [`NEW_VERSION`]: the next operation after a cut.
pub fn boot_and_update(data: &Path, pkg: &str) -> Result<Run, String> {
    run(
        data,
        &[
            Order::Reordered.step(),
            boot(),
            install(pkg, NEW_VERSION, None),
        ],
    )
}
