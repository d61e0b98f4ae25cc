//! `make demo`: today's upstream StartOS beside ours, where they differ, on
//! scratch loop-mounted btrfs images, in well under a minute.
//!
//! The history: StartOS used to copy a volume with `cp -a --reflink` before
//! each update, O(extents) with the service running. Upstream now snapshots
//! subvolumes (PR #3533 and after); `integration::upstream` restates its
//! protocol step by step. The demo shows three things side by side:
//! 1. a volume holding nested subvolumes (one read-only) through an update
//!    that fails and is rolled back: upstream's snapshot holds them empty,
//!    and its restore deletes their data; ours gives them back, flags and
//!    all;
//! 2. the first boot of a box of plain-directory packages, one with a
//!    fragmented database: upstream's services all wait for every
//!    conversion and every old tree's removal; ours start one by one as
//!    each volume is ready;
//! 3. ours alone: an update of a running service through
//!    [`startos_core::Finalizer::install`] (stop, snapshot, install,
//!    notification, backup dropped in the background), then one that fails
//!    and comes back byte for byte. `make demo` builds the
//!    `startos-core-service` binary first.
//!
//! Needs root; exits 1 with one line on stderr on any error.

// Shared with the bench, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration::services::ProcessServices;
use integration::{make_fragmented_file, sha256_file, tree_digest};
use startos_core::{
    Cancel, Db, Event, FileDb, Finalizer, InstallRequest, Notification, Phase, Services, StateInfo,
};
use volume::PackageId;

use crate::common::{Result, Scratch, fmt_count, fmt_duration, install_and_drop, volume_err};

/// The running service's volume holds a database of this size and extent
/// count beside what the service writes.
const FILE_BYTES: u64 = 256 << 20;
const IMAGE_BYTES: u64 = 1 << 30;
const TARGET_EXTENTS: u64 = 50_000;
fn run() -> Result<()> {
    println!("today's upstream (its protocol restated in integration::upstream) beside ours");
    println!();
    let scale = integration::compare::Scale::quick();

    // 1. Nested subvolumes through a failed update's restore.
    let n = integration::compare::nested::run(&scale).map_err(|e| e.to_string())?;
    let kept = |o: &integration::compare::nested::NestedOutcome| {
        let ro = o.nested.iter().filter(|c| c.read_only_before).count();
        let ro_kept = o
            .nested
            .iter()
            .filter(|c| c.read_only_before && c.read_only_kept)
            .count();
        format!(
            "{} of {} nested subvolumes' data back, {ro_kept} of {ro} read-only",
            o.data_kept(),
            o.nested.len()
        )
    };
    println!("1. a failed update, rolled back, of a volume with nested subvolumes");
    println!("   upstream: {}", kept(&n.upstream));
    println!("   ours:     {}", kept(&n.ours));
    println!("   (upstream's snapshot holds them empty; its restore deletes the replaced tree)");
    println!();

    // 2. The first boot of a box of plain-directory packages.
    // A database big enough for its extents to show.
    let boot_scale = integration::compare::Scale {
        image_bytes: 4 << 30,
        boot_small_files: 2_000,
        boot_db_bytes: 512 << 20,
        boot_db_extents: 100_000,
        ..scale
    };
    let b = integration::compare::boot::run(&boot_scale).map_err(|e| e.to_string())?;
    println!(
        "2. first boot: {} plain-directory packages, a {}-extent database among them",
        b.ours.ready.len(),
        fmt_count(b.db_extents)
    );
    let ready = |o: &integration::compare::boot::BootOutcome| {
        let first = o.ready.iter().map(|(_, t)| *t).min().unwrap_or_default();
        format!(
            "services may start after {} (first) to {} (last); old trees gone after {}",
            fmt_duration(first),
            fmt_duration(o.all_ready),
            fmt_duration(o.old_removed)
        )
    };
    println!("   upstream: {}", ready(&b.upstream));
    println!("   ours:     {}", ready(&b.ours));
    println!(
        "   (upstream removes every old tree before any service; ours after, in the background)"
    );
    println!();

    // 3. Ours alone: an update of a running service, then a failed one.
    let vol = Scratch::new(IMAGE_BYTES)?;
    make_fragmented_file(&vol.file, FILE_BYTES, TARGET_EXTENTS, 1)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(update_flow(&vol))?;
    vol.close()
}

/// What the failing update is checked against: read-only snapshots of the
/// volume taken right after the old service stopped (what it left) and right
/// before the old version starts again after the rollback (what it gets
/// back). Each is one `btrfs subvolume snapshot -r`, a few milliseconds.
struct Capture {
    old_version: String,
    before: PathBuf,
    after: PathBuf,
    took_before: bool,
}

/// [`ProcessServices`], taking the [`Capture`] snapshots when one is armed.
struct Recorder {
    inner: ProcessServices,
    live: PathBuf,
    capture: Mutex<Option<Capture>>,
}

fn snapshot_ro(src: &Path, dst: &Path) -> std::result::Result<(), volume::Error> {
    integration::run(
        Command::new("btrfs")
            .args(["-q", "subvolume", "snapshot", "-r"])
            .arg(src)
            .arg(dst),
    )
    .map(drop)
    .map_err(|e| volume::Error::new(e, volume::ErrorKind::Filesystem))
}

impl Recorder {
    fn capture(&self) -> std::sync::MutexGuard<'_, Option<Capture>> {
        self.capture.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Services for Recorder {
    async fn stop(&self, pkg: &PackageId) -> std::result::Result<(), volume::Error> {
        self.inner.stop(pkg).await?;
        let mut c = self.capture();
        if let Some(c) = c.as_mut().filter(|c| !c.took_before) {
            snapshot_ro(&self.live, &c.before)?;
            c.took_before = true;
        }
        Ok(())
    }

    async fn uninit(
        &self,
        pkg: &PackageId,
        version: &str,
        target: Option<&str>,
    ) -> std::result::Result<(), volume::Error> {
        self.inner.uninit(pkg, version, target).await
    }

    async fn install(
        &self,
        pkg: &PackageId,
        version: &str,
        s9pk: &str,
    ) -> std::result::Result<(), volume::Error> {
        self.inner.install(pkg, version, s9pk).await
    }

    async fn init(
        &self,
        pkg: &PackageId,
        version: &str,
        from: Option<&str>,
    ) -> std::result::Result<(), volume::Error> {
        self.inner.init(pkg, version, from).await
    }

    async fn start(
        &self,
        pkg: &PackageId,
        version: &str,
    ) -> std::result::Result<(), volume::Error> {
        let armed = self.capture().take_if(|c| c.old_version == version);
        if let Some(c) = armed {
            snapshot_ro(&self.live, &c.after)?;
        }
        self.inner.start(pkg, version).await
    }
}

fn request(pkg: &PackageId, version: &str) -> InstallRequest {
    InstallRequest {
        package: pkg.clone(),
        version: version.to_owned(),
        s9pk: format!("/media/startos/data/package-data/archive/{pkg}-{version}.s9pk"),
    }
}

/// The update flow on the demo's volume: see the module documentation.
async fn update_flow(vol: &Scratch) -> Result<()> {
    const RUN: Duration = Duration::from_millis(300);
    let pkg = vol.package().clone();
    let program = ProcessServices::locate_program().map_err(volume_err)?;
    let recorder = Recorder {
        inner: ProcessServices::new(vol.root(), vol.path("run"), program).map_err(volume_err)?,
        live: vol.live().to_owned(),
        capture: Mutex::new(None),
    };
    let db = FileDb::open(vol.path("state.json")).map_err(volume_err)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Notification>();
    let fin = Finalizer::new(db, Arc::new(recorder), Arc::new(tx), vol.root());
    println!("3. ours: updates of {pkg}, its service writing random 4 KiB blocks until stopped");

    // 1.0: installed over the existing volume, and running.
    install_and_drop(&fin, &request(&pkg, "1.0")).await?;
    rx.recv().await.ok_or("no notification for 1.0")?;
    tokio::time::sleep(RUN).await;

    // A successful update.
    let f = fin
        .install(&request(&pkg, "2.0"), &Cancel::new())
        .await
        .map_err(volume_err)?;
    let installed = rx.recv().await.ok_or("no notification for 2.0")?;
    if installed.event
        != (Event::Installed {
            version: "2.0".into(),
        })
    {
        return Err(format!("unexpected notification {:?}", installed.event).into());
    }
    let t = Instant::now();
    let dropped = f
        .backup_drop
        .await
        .map_err(|e| format!("backup drop task: {e}"))?
        .map_err(volume_err)?;
    let drop_took = t.elapsed();
    if !dropped || vol.backup().exists() {
        return Err("the backup of the update to 2.0 was not dropped".into());
    }
    let tm = &f.timings;
    println!(
        "  update 1.0 -> 2.0 succeeds: stop {}, snapshot {}, uninit+install+init+start {}",
        fmt_duration(tm.stop),
        fmt_duration(tm.snapshot),
        fmt_duration(tm.service),
    );
    println!(
        "    notification {} after install done, {} of overhead in all",
        fmt_duration(tm.install_done_to_notify),
        fmt_duration(tm.overhead()),
    );
    println!(
        "    backup dropped in the background in {}",
        fmt_duration(drop_took)
    );
    tokio::time::sleep(RUN).await;

    // An update that fails in its install phase.
    let captures = vol.path("captures");
    std::fs::create_dir(&captures)?;
    *fin.services().capture() = Some(Capture {
        old_version: "2.0".into(),
        before: captures.join("before"),
        after: captures.join("after"),
        took_before: false,
    });
    fin.services().inner.fail_at(&pkg, Phase::Install);
    let t0 = Instant::now();
    let err = match fin.install(&request(&pkg, "3.0"), &Cancel::new()).await {
        Ok(_) => return Err("the update to 3.0 should have failed".into()),
        Err(e) => e,
    };
    let n = rx.recv().await.ok_or("no notification for 3.0")?;
    let Event::Failed {
        phase,
        message,
        rolled_back_to,
        ..
    } = &n.event
    else {
        return Err(format!("unexpected notification {:?} ({err})", n.event).into());
    };
    println!(
        "  update 2.0 -> 3.0 fails in {phase}: failure notification after {}:",
        fmt_duration(n.at.duration_since(t0)),
    );
    println!("    \"{message}\"");
    let before = tree_digest(&captures.join("before"))?;
    let after = tree_digest(&captures.join("after"))?;
    let diff = before.diff(&after);
    if !diff.is_empty() {
        return Err(format!("the rolled-back volume differs: {}", diff.join("; ")).into());
    }
    let data = Path::new("data/main/data.mdb");
    let sha = sha256_file(&captures.join("after").join(data))?;
    let state = fin.db().peek().await.get(&pkg).cloned();
    let running_again = rolled_back_to.as_deref() == Some("2.0")
        && fin.services().inner.is_running(&pkg)
        && state.is_some_and(|e| {
            e.state_info == StateInfo::Installed && e.version.as_deref() == Some("2.0")
        });
    if !running_again {
        return Err("2.0 is not installed and running again after the rollback".into());
    }
    println!(
        "    volume byte-identical to what 2.0 left when stopped ({} entries, data.mdb sha256 {}..)",
        before.len(),
        &sha[..12],
    );
    println!("    2.0 installed and running again");
    fin.services().stop(&pkg).await.map_err(volume_err)?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}
