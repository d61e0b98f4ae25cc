//! `make demo`: an update of a Monero node's volume, upstream's way and ours,
//! on a scratch loop-mounted btrfs, in well under a minute.
//!
//! Builds a package volume `monerod` (a subvolume) whose volume `main` holds
//! one LMDB-like file fragmented into ~200k extents, then walks through an
//! update: the backup before the install, a failed install rolled back (and
//! checked byte for byte with sha256), and a successful install whose backup
//! is dropped. Each step is timed against upstream's commands on the same
//! volume, both from a settled filesystem with the file out of the page
//! cache; one more restore is timed with the file cached.
//!
//! Then the whole update flow on the same volume, through
//! [`startos_core::Finalizer::install`], with the package's service running
//! as a `startos-core-service` process that keeps writing random 4 KiB
//! blocks into the volume until stopped: a successful update (stop,
//! snapshot, the service's phases, notification, backup dropped in the
//! background) and one that fails in its install phase, rolled back to a
//! volume byte-identical to what the old version left, with the old version
//! running again. `make demo` builds that binary first (it is looked for
//! beside this one, or at `$STARTOS_CORE_SERVICE_BIN`).
//!
//! Needs root; exits 1 with one line on stderr on any error.

mod common;

use std::fs::File;
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

use crate::common::{
    Result, Scratch, fmt_bytes, fmt_count, fmt_duration, fmt_ratio, install_and_drop, scribble,
    timed, volume_err,
};

const FILE_BYTES: u64 = 1 << 30;
const IMAGE_BYTES: u64 = 4 << 30;
const TARGET_EXTENTS: u64 = 200_000;
/// 4 KiB blocks of garbage a failed migration leaves in the file (16 MiB).
const GARBAGE_BLOCKS: u64 = 4096;

/// Times `op` from a settled filesystem with the database file out of the
/// page cache: the same starting point for upstream and ours.
fn time(vol: &Scratch, op: impl FnOnce() -> Result<()>) -> Result<Duration> {
    vol.settle()?;
    vol.evict_page_cache()?;
    timed(op).map(|((), took)| took)
}

/// Times `op` from a settled filesystem with the whole database file in the
/// page cache, as the service that just ran would leave it.
fn time_cached(vol: &Scratch, op: impl FnOnce() -> Result<()>) -> Result<Duration> {
    vol.settle()?;
    std::io::copy(&mut File::open(&vol.file)?, &mut std::io::sink())?;
    timed(op).map(|((), took)| took)
}

fn row(step: &str, upstream: Duration, ours: Duration, note: &str) {
    let ratio = upstream.as_secs_f64() / ours.as_secs_f64();
    let line = format!(
        "{step:<32} {:>9} {:>8} {:>9}  {note}",
        fmt_duration(upstream),
        fmt_duration(ours),
        fmt_ratio(ratio)
    );
    println!("{}", line.trim_end());
}

/// Checks that the database file is byte-identical to `original`.
fn check_restored(vol: &Scratch, original: &str) -> Result<()> {
    if sha256_file(&vol.file)? == original {
        Ok(())
    } else {
        Err("after the restore, the file differs from before the update".into())
    }
}

fn run() -> Result<()> {
    let vol = Scratch::new(IMAGE_BYTES)?;
    let (extents, took) = timed(|| -> Result<u64> {
        Ok(make_fragmented_file(
            &vol.file,
            FILE_BYTES,
            TARGET_EXTENTS,
            1,
        )?)
    })?;
    println!(
        "building a fragmented LMDB-like file: {} extents ({}) in {}",
        fmt_count(extents),
        fmt_bytes(FILE_BYTES),
        fmt_duration(took)
    );
    let original = sha256_file(&vol.file)?;
    println!();
    println!(
        "{:<32} {:>9} {:>8} {:>9}",
        "step", "upstream", "ours", "speed-up"
    );

    // Before the install: upstream clones every extent, we snapshot.
    let up_snapshot = time(&vol, || vol.upstream_snapshot())?;
    let up_drop = time(&vol, || vol.upstream_drop())?;
    let snapshot = time(&vol, || vol.snapshot())?;
    row("update: snapshot before install", up_snapshot, snapshot, "");

    // The install fails half-way through migrating the database.
    scribble(&vol.file, GARBAGE_BLOCKS, 2)?;
    if sha256_file(&vol.file)? == original {
        return Err("the garbage did not change the file".into());
    }
    let restore = time(&vol, || vol.restore())?;
    check_restored(&vol, &original)?;
    vol.upstream_backup_for_restore()?;
    scribble(&vol.file, GARBAGE_BLOCKS, 3)?;
    let up_restore = time(&vol, || vol.upstream_restore())?;
    row(
        "failed install: restore",
        up_restore,
        restore,
        "restored, sha256 matches",
    );

    // The same failure with the database in the page cache: deleting the
    // replaced volume evicts its cached pages before the restore returns.
    vol.snapshot()?;
    scribble(&vol.file, GARBAGE_BLOCKS, 4)?;
    let restore_cached = time_cached(&vol, || vol.restore())?;
    check_restored(&vol, &original)?;

    // The next install succeeds: the backup goes.
    vol.snapshot()?;
    let drop = time(&vol, || vol.drop_backup())?;
    row("successful install: drop backup", up_drop, drop, "");

    println!();
    println!(
        "times from a settled filesystem, file not in the page cache; with its {} cached,",
        fmt_bytes(FILE_BYTES)
    );
    println!(
        "our restore took {} (deleting the replaced volume evicts its pages)",
        fmt_duration(restore_cached)
    );
    println!("upstream: cp -a --reflink=always; rm -rf <pkg> + mv (no volume in between); rm -rf");
    println!("ours:     read-only subvolume snapshot; atomic RENAME_EXCHANGE; subvolume delete");

    println!();
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
    println!(
        "update flow: {pkg}'s service (startos-core-service) writing random 4 KiB blocks into \
         the volume"
    );

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
