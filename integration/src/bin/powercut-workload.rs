//! What the power-cut guest runs besides `startos-volume` (see
//! `integration::powercut` and `integration/tests/powercut.rs`): library
//! calls the command-line tools do not offer.
//!
//! ```text
//! powercut-workload convert ROOT PKG clone|snapshot-parent
//!     volume_migrate::Migrator::convert with that method, then remove_old
//! powercut-workload boot ROOT PKG
//!     startos_core::volume::boot_volume_maintenance_at for PKG, cleanup included
//! powercut-workload finalize DATA PKG
//!     integration::powercut::finalize::update: PKG's update through the
//!     call-sites runner (beside this binary) on its data directory DATA
//! powercut-workload recover DATA
//!     integration::powercut::finalize::recover: the runner's boot
//! ```
//!
//! Exit 0 on success; on failure one line on stderr and exit 1.

use std::path::Path;
use std::process::ExitCode;

use volume::PackageId;
use volume_migrate::{Method, MigrateOptions, Migrator, Progress};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("powercut-workload: {e}");
            ExitCode::FAILURE
        }
    }
}

fn package(s: &str) -> Result<PackageId, String> {
    s.parse().map_err(|e| format!("package id {s:?}: {e}"))
}

fn run(args: &[String]) -> Result<String, String> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["convert", root, pkg, method] => {
            let method = match *method {
                "clone" => Method::Clone,
                "snapshot-parent" => Method::SnapshotParent,
                "auto" => Method::Auto,
                other => return Err(format!("unknown method {other:?}")),
            };
            let pkg = package(pkg)?;
            let m = Migrator::open(root).map_err(|e| e.to_string())?;
            let opts = MigrateOptions {
                method,
                ..Default::default()
            };
            let mut sink = |_: &Progress| {};
            let report = m
                .convert(&pkg, &opts, &mut sink)
                .map_err(|e| e.to_string())?;
            let removed = m.remove_old(&pkg, &mut sink).map_err(|e| e.to_string())?;
            Ok(format!(
                "converted {pkg}: {:?} by {:?}, old tree removed: {removed}",
                report.outcome, report.method
            ))
        }
        ["boot", root, pkg] => {
            let pkg = package(pkg)?;
            runtime()?.block_on(boot(root, &pkg))
        }
        ["finalize", data, pkg] => {
            package(pkg)?;
            integration::powercut::finalize::update(Path::new(data), pkg)?;
            Ok(format!("updated {pkg}"))
        }
        ["recover", data] => {
            let run = integration::powercut::finalize::recover(Path::new(data))?;
            Ok(format!("booted: {:?}", run.db))
        }
        _ => Err(format!(
            "usage: powercut-workload convert ROOT PKG clone|snapshot-parent|auto \
             | boot ROOT PKG | finalize DATA PKG | recover DATA (got {words:?})"
        )),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
}

/// No progress display: the boot's figures are not what is tested here.
struct Quiet;

impl startos_core::volume::BootProgress for Quiet {
    fn set_total(&mut self, _: u64) {}
    fn set_done(&mut self, _: u64) {}
    fn package_ready(&mut self, _: &str) {}
}

async fn boot(root: &str, pkg: &PackageId) -> Result<String, String> {
    let ids = [pkg.to_string()];
    let mut progress = Quiet;
    let m = startos_core::volume::boot_volume_maintenance_at(root, &ids, &ids, &mut progress)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(cleanup) = m.cleanup {
        cleanup
            .await
            .map_err(|e| format!("boot cleanup task: {e}"))?
            .map_err(|e| e.to_string())?;
    }
    if !m.failed.is_empty() {
        return Err(format!("boot maintenance failed: {:?}", m.failed));
    }
    Ok(format!(
        "boot maintenance: recovered {:?}, ready {:?}",
        m.recovered, m.ready
    ))
}
