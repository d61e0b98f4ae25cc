//! The `call-sites` runner of `fixtures/upstream-call-sites` driven from
//! outside, for the boot benchmark and its smoke test: one run of the
//! runner is one boot of a box (its data directory, which the runner
//! mounts at upstream's `/media/startos/data`), and [`first_boot`] measures
//! the readiness a service sees where it waits: from the boot's start to
//! the return of its `Service::load` volume calls (`ensure_volume_root`,
//! the `data_dir` checks), set beside its volume's exchange and beside any
//! wait on its lock, with the boot's background cleanup running.
//!
//! Both orders run start-core's call sites as upstream writes them, on the
//! drop-in (`startos_core::volume`): [`Order::Readiness`] is the optional
//! readiness step (each package loaded as its volume is reported ready),
//! [`Order::Upstream`] upstream's `cleanup_and_initialize` (every load
//! after the whole maintenance). Neither is upstream's own conversion
//! protocol ([`crate::upstream`] restates that).

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use super::Run;

/// Runs `steps` as one boot of the box whose data directory is `data`,
/// with the runner `bin` ([`super::Box_::completed`]); every step must
/// succeed.
pub fn run(bin: &Path, data: &Path, steps: &[Value]) -> io::Result<Run> {
    let boxed = super::Box_ {
        bin: bin.to_owned(),
        data: data.to_owned(),
    };
    let run = boxed.completed(steps).map_err(io::Error::other)?;
    if !run.ok() {
        let tail: String = run
            .stderr
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n");
        return Err(io::Error::other(format!(
            "call-sites {steps:?}: a step failed: {:?}; its last log lines, newest first:\n{tail}",
            run.steps
        )));
    }
    Ok(run)
}

/// Records each of `packages` in the box's database as installed by an
/// earlier system at version 1 (its volume as that system left it): a run
/// of its own, before the boot to measure.
pub fn seed(bin: &Path, data: &Path, packages: &[&str]) -> io::Result<()> {
    let steps: Vec<Value> = packages
        .iter()
        .map(|p| json!({"seed": {"id": p, "version": "1"}}))
        .collect();
    run(bin, data, &steps).map(drop)
}

/// Which boot of start-core's the runner runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// `cleanup_and_initialize_when_ready`: the readiness step, each
    /// package loaded once its volume is reported ready.
    Readiness,
    /// `cleanup_and_initialize` as upstream writes it: every load after
    /// the whole maintenance (on the drop-in).
    Upstream,
}

/// One package on one boot, in milliseconds from the boot's start.
#[derive(Debug, Clone, Serialize)]
pub struct PackageLoad {
    /// The package.
    pub package: String,
    /// When its volume root became a subvolume: at the earliest (the last
    /// sample of the runner's watch that saw it a plain directory, so that
    /// [`PackageLoad::after_exchange`] errs long), none if it already was
    /// one.
    pub exchanged: Option<f64>,
    /// And at the latest (the first sample that saw it a subvolume).
    pub exchanged_seen: Option<f64>,
    /// When its `Service::load` was called.
    pub load_started: Option<f64>,
    /// When its load's volume calls returned.
    pub volumes_ready: Option<f64>,
    /// Whether its load returned a service; the error if it failed.
    pub loaded: Result<bool, String>,
    /// The waits for its lock seen while its volume calls ran (from its
    /// load's start to their return), `[from, to]`: at a boot, the load
    /// waiting on the background cleanup's removal of its old tree.
    pub lock_waits: Vec<[f64; 2]>,
    /// When its lock was first and last seen held after its exchange (its
    /// load's calls, the cleanup's removal), until the run ended.
    pub held_after_exchange: Option<[f64; 2]>,
}

impl PackageLoad {
    /// From its exchange to its volume calls' return.
    pub fn after_exchange(&self) -> Option<f64> {
        Some(self.volumes_ready? - self.exchanged?)
    }

    /// From its load's start to its volume calls' return.
    pub fn calls(&self) -> Option<f64> {
        Some(self.volumes_ready? - self.load_started?)
    }

    /// The waits for its lock seen during its volume calls, in all (each
    /// span at least one sample period long).
    pub fn waited(&self) -> f64 {
        self.lock_waits
            .iter()
            .map(|[a, b]| b - a + WATCH_PERIOD_MS)
            .sum()
    }
}

/// The runner's watch samples every millisecond
/// (`upstream_call_sites::watch::PERIOD`).
pub const WATCH_PERIOD_MS: f64 = 1.0;

/// What [`first_boot`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct BootLoads {
    /// Which boot.
    pub order: Order,
    /// Every package the database lists, by name.
    pub packages: Vec<PackageLoad>,
}

fn spans(v: &Value) -> Vec<[f64; 2]> {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

/// Boots the box whose data directory is `data` (its packages seeded)
/// once, in `order`, watched; returns each package's times.
pub fn first_boot(bin: &Path, data: &Path, order: Order) -> io::Result<BootLoads> {
    let boot = match order {
        Order::Readiness => json!("boot"),
        Order::Upstream => json!("boot_upstream"),
    };
    let r = run(bin, data, &[json!("watch"), boot])?;
    if !r.ok() {
        return Err(io::Error::other(format!(
            "call-sites: a step failed: {:?}\n{}",
            r.steps, r.stderr
        )));
    }
    let started = r.first_ms("load_started");
    let ready = r.first_ms("volumes_ready");
    let mut loaded: BTreeMap<String, Result<bool, String>> = BTreeMap::new();
    for l in r.events.iter().filter_map(|e| e.get("load")) {
        let outcome = match l["error"].as_str() {
            Some(e) => Err(e.to_owned()),
            None => Ok(l["service"].as_bool().unwrap_or(false)),
        };
        loaded.insert(l["id"].as_str().unwrap_or_default().to_owned(), outcome);
    }
    let packages = r
        .watch
        .iter()
        .map(|(p, w)| {
            let exchanged = w["exchanged_ms"][0].as_f64();
            let (from, to) = (started.get(p).copied(), ready.get(p).copied());
            let lock_waits = match (from, to) {
                (Some(a), Some(b)) => spans(&w["waited"])
                    .into_iter()
                    .filter(|[x, y]| *y >= a && *x <= b)
                    .collect(),
                _ => Vec::new(),
            };
            let since = exchanged.unwrap_or(0.0);
            let held: Vec<[f64; 2]> = spans(&w["held"])
                .into_iter()
                .filter(|[_, y]| *y >= since)
                .collect();
            PackageLoad {
                package: p.clone(),
                exchanged,
                exchanged_seen: w["exchanged_ms"][1].as_f64(),
                load_started: from,
                volumes_ready: to,
                loaded: loaded
                    .remove(p)
                    .unwrap_or_else(|| Err("never loaded".to_owned())),
                lock_waits,
                held_after_exchange: held
                    .first()
                    .zip(held.last())
                    .map(|(a, b)| [a[0].max(since), b[1]]),
            }
        })
        .collect();
    Ok(BootLoads { order, packages })
}
