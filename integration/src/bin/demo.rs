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
//! 3. an update of a running service, then one whose init fails, through
//!    start-core's own `ServiceMap::install` and `Service::load` (the
//!    `call-sites` runner of `fixtures/upstream-call-sites`): the reordered
//!    call sites (stop, snapshot, install, then drop or restore) bring the
//!    failed one back byte for byte with every write the old container
//!    made; upstream's unedited ones snapshot it while it runs and lose
//!    what it wrote until its stop. `make demo` builds the runner first
//!    (with its kill points: the demo pauses it at the stop).
//!
//! Needs root; exits 1 with one line on stderr on any error.

// Shared with the bench, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::process::ExitCode;
use std::time::Duration;

use integration::call_sites::{Box_, Ended, Order, Run, boot, install, mark};
use integration::lmdb::{self, Spec};
use integration::{LoopFs, TreeDigest, sha256_file, tree_digest};
use serde_json::{Value, json};

use crate::common::{Result, fmt_count, fmt_duration};

/// The package of section 3.
const PKG: &str = "monerod";
/// Its volume holds an LMDB environment of this size, written by LMDB as
/// the seed's Monero node writes it (random-key puts, many transactions:
/// tens of thousands of extents), beside the log its container writes.
const FILE_BYTES: u64 = 256 << 20;
const IMAGE_BYTES: u64 = 1 << 30;
/// Keys and values of the environment derive from it.
const SEED: u64 = 1;
/// How long the old version runs before each update.
const RUN_MS: u64 = 300;
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

    // 3. Updates through start-core's own call sites, both orders.
    updates()
}

/// How long the old container writes on once the runner reached its stop
/// (the runner paused there, as a slow stop would leave it): what upstream's
/// order snapshots before, and the reorder after.
const STOP_PAUSE: Duration = Duration::from_millis(300);

/// A step of the runner: pauses the boot this long (the services run).
fn wait(ms: u64) -> Value {
    json!({"wait": {"ms": ms}})
}

/// `Box_::completed`, failing on any step that failed.
fn all_ok(b: &Box_, steps: &[Value]) -> Result<Run> {
    let run = b.completed(steps)?;
    if !run.ok() {
        return Err(format!("call-sites: {:?}\n{}", run.steps, run.stderr).into());
    }
    Ok(run)
}

/// The first `kind` event of the package after the mark `mark`, in
/// milliseconds after the mark.
fn after_mark(run: &Run, mark: &str, kind: &str) -> Option<f64> {
    let at = run.first_ms("mark").get(mark).copied()?;
    let then = run
        .events
        .iter()
        .filter_map(|e| e.get(kind))
        .filter(|e| e["id"] == PKG)
        .filter_map(|e| e["ms"].as_f64())
        .find(|&ms| ms >= at)?;
    Some(then - at)
}

fn ms(ms: f64) -> String {
    fmt_duration(Duration::from_secs_f64(ms.max(0.0) / 1000.0))
}

/// The last line the old container wrote before it was stopped, as the run
/// logged it.
fn last_write_before_stop(run: &Run) -> Result<String> {
    run.stderr
        .lines()
        .find_map(|l| l.split_once(&format!("container of {PKG} stopped; last write: ")))
        .map(|(_, w)| w.trim().trim_matches('"').to_owned())
        .ok_or_else(|| format!("no stop logged:\n{}", run.stderr).into())
}

/// The volume as the checks compare it: every entry but the container's log,
/// which the restarted old version appends to.
fn volume_digest(b: &Box_) -> Result<TreeDigest> {
    let log = format!("data/main/{PKG}.log");
    Ok(tree_digest(&b.volumes().join(PKG))?.without(log))
}

/// Section 3: an update, then one whose init fails, of a running service
/// through start-core's own `ServiceMap::install` and `Service::load` (the
/// fixture's `call-sites` runner, a fresh box each order): the reordered
/// call sites, then upstream's unedited ones.
fn updates() -> Result<()> {
    let bin = integration::workspace_bin("call-sites")
        .map_err(|e| format!("{e} (`make demo` builds it)"))?;
    println!(
        "3. updates of {PKG} through start-core's own ServiceMap::install and Service::load\n   \
         (fixtures/upstream-call-sites), its container appending to a log in the volume until stopped"
    );
    for (order, label) in [
        (Order::Reordered, "ours (the reordered call sites)"),
        (Order::Upstream, "upstream's (its call sites unedited)"),
    ] {
        let fs = LoopFs::btrfs(IMAGE_BYTES)?;
        let b = Box_ {
            bin: bin.clone(),
            data: fs.path("data"),
        };
        std::fs::create_dir(&b.data)?;
        println!("  {label}:");
        update_flow(&b, order)?;
        fs.close()?;
    }
    Ok(())
}

/// The update flow in one box: see [`updates`].
fn update_flow(b: &Box_, order: Order) -> Result<()> {
    // 1.0 installed, then its volume given its database, written by LMDB.
    all_ok(b, &[order.step(), boot(), install(PKG, "1.0", None)])?;
    let built = lmdb::build(&b.main(PKG), &Spec::node(FILE_BYTES, SEED))?;
    println!(
        "    {PKG}'s LMDB environment: {} keys in {} transactions, {} MiB",
        fmt_count(built.keys),
        fmt_count(built.txns),
        built.file_bytes >> 20
    );

    // A successful update, 1.0 running for a moment first.
    let run = all_ok(
        b,
        &[
            order.step(),
            boot(),
            wait(RUN_MS),
            mark("update"),
            install(PKG, "2.0", None),
            mark("done"),
        ],
    )?;
    let marks = run.first_ms("mark");
    let took = marks
        .get("done")
        .zip(marks.get("update"))
        .map(|(d, u)| d - u);
    let ready = after_mark(&run, "update", "volumes_ready");
    let (Some(took), Some(ready)) = (took, ready) else {
        return Err(format!("no marks or no load in the update's run: {:?}", run.events).into());
    };
    if run.installed(PKG).as_deref() != Some("2.0") || b.names(PKG) != [PKG] {
        return Err(format!(
            "after the update to 2.0: {:?}, names {:?}",
            run.db,
            b.names(PKG)
        )
        .into());
    }
    println!(
        "    update 1.0 -> 2.0 succeeds: the install task {}, 2.0's volume ready for its container after {}; backup dropped",
        ms(took),
        ms(ready),
    );

    // An update whose init fails after writing into the volume, the runner
    // paused at the old container's stop.
    let before = volume_digest(b)?;
    let steps = [
        order.step(),
        boot(),
        wait(RUN_MS),
        install(PKG, "3.0", Some("init")),
    ];
    let Ended::Completed(run) = b.run_paused(&steps, Some(("flow.stopping", STOP_PAUSE)))? else {
        return Err("the failing update was killed".into());
    };
    let failed = run
        .notifications(PKG)
        .into_iter()
        .find(|n| n.contains("service.install.failed"))
        .ok_or_else(|| format!("no failure notification: {:?}", run.events))?;
    println!("    update 2.0 -> 3.0 fails in its init, rolled back; notification:");
    println!("      \"{failed}\"");
    let after = volume_digest(b)?;
    let diff = before.diff(&after);
    if !diff.is_empty() {
        return Err(format!("the rolled-back volume differs: {}", diff.join("; ")).into());
    }
    let sha = sha256_file(&b.main(PKG).join("data.mdb"))?;
    println!(
        "      volume byte-identical to what 2.0 left ({} entries, data.mdb sha256 {}..), its log aside",
        before.len(),
        &sha[..12],
    );
    lmdb::check(&b.main(PKG), SEED, built.keys)
        .map_err(|e| format!("the rolled-back database: {e}"))?;
    println!(
        "      every one of its {} keys read back through LMDB, each value as written",
        fmt_count(built.keys)
    );
    let last = last_write_before_stop(&run)?;
    let log = std::fs::read_to_string(b.main(PKG).join(format!("{PKG}.log")))?;
    let kept = log.lines().any(|l| l == last);
    match (order, kept) {
        (Order::Reordered, true) => println!(
            "      the log keeps 2.0's last write before its stop (\"{last}\"): stopped, then snapshotted"
        ),
        (Order::Upstream, false) => println!(
            "      the log lost 2.0's writes up to its stop (\"{last}\"): snapshotted while it ran"
        ),
        (order, kept) => {
            return Err(format!(
                "{order:?}: the last write {last:?} kept: {kept} (the runner must be built \
                 with its kill points, as `make demo` does, to pause at the stop)"
            )
            .into());
        }
    }
    if run.installed(PKG).as_deref() != Some("2.0")
        || run.running.get(PKG).map(String::as_str) != Some("2.0")
    {
        return Err(format!("2.0 is not installed and running again: {:?}", run.db).into());
    }
    println!("      2.0 installed and running again");
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
