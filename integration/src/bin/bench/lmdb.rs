//! The `lmdb` section (issue 31): the seed's database for real. An LMDB
//! environment written by the LMDB library itself as monerod writes its
//! blockchain ([`integration::lmdb`]: random-key puts, 1,000 a transaction,
//! `MDB_NOSYNC` with a sync every 4), about 300,000 extents at 1.3 GiB, in
//! package `monerod`'s volume; then the snapshot section's rounds on it
//! (upstream's `cp -a --reflink=always`, `rm -rf`, `rm -rf` + `mv` against
//! ours, same run) and the usage section's tools (ours, compsize, `btrfs
//! filesystem du`), with the synthetic file's targets.
//!
//! Before each restore, a failed update writes 2,000 more keys over 20
//! transactions; after each restore, upstream's and ours, every key is read
//! back and checked ([`integration::lmdb::check`]): exactly the keys built,
//! every byte. A failed check fails the benchmark.
//!
//! Building takes minutes, so the btrfs image holding the built environment
//! is kept in `target/bench-cache/` (trimmed, sparse: about the
//! environment's size), named by the recipe's version, size and seed, with
//! what was built beside it as JSON; a run copies it and mounts the copy.
//! `--lmdb-fresh` builds it again. A crash while saving leaves at most a
//! `.tmp` image, which the next save overwrites: the image is renamed into
//! place last, after its JSON.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use integration::lmdb::{self, Built, Spec};
use integration::{FsKind, LoopFs};
use serde::{Deserialize, Serialize};

use crate::common::{Result, Scratch, fmt_bytes, fmt_count, fmt_duration, timed};
use crate::fixture::{Tree, TreeKind};
use crate::{Case, Op, Row, Samples, SnapshotReport, Stats, usage};

/// Keys a failed update writes after the snapshot, before each restore...
const LATER_KEYS: u64 = 2_000;
/// ... in transactions of this many puts, each synced.
const LATER_PER_TXN: u64 = 100;
/// Bump when the environment's recipe changes: cached images of another
/// version are not used.
const RECIPE: u32 = 1;

/// What the section runs on, from the bench's arguments.
struct Options {
    /// Size of `data.mdb` to build (`--lmdb-size`).
    bytes: u64,
    /// Seed of the keys and values (`--seed`).
    seed: u64,
    /// Timed rounds (after one warm-up) and usage runs (`--runs`).
    runs: u32,
    /// Build the environment again even if a cached image exists
    /// (`--lmdb-fresh`).
    fresh: bool,
}

/// The environment measured.
#[derive(Clone, Serialize, Deserialize)]
pub struct Environment {
    /// Recipe version ([`RECIPE`]).
    recipe: u32,
    /// Seed of the keys and values.
    seed: u64,
    /// What the build wrote: keys, transactions, `data.mdb`'s size.
    built: Built,
    /// `data.mdb`'s extents (FIEMAP) after the build.
    extents: u64,
    /// How long the build took.
    build_seconds: f64,
    /// The sparse image's size.
    image_bytes: u64,
}

/// Every read-back after a restore.
#[derive(Serialize)]
pub struct Checks {
    /// Restores checked, upstream's and ours (warm-up included).
    restores: u32,
    /// Keys read and checked each time.
    keys: u64,
    /// Bytes of keys and values read each time.
    bytes: u64,
    /// Time of each check.
    seconds: Stats,
}

/// The section's results.
#[derive(Serialize)]
pub struct Report {
    environment: Environment,
    /// Whether the environment came from the cache.
    from_cache: bool,
    /// Copying the cached image and mounting it.
    load_seconds: f64,
    snapshot: SnapshotReport,
    checks: Checks,
    usage: usage::Report,
    total_seconds: f64,
}

/// `target/bench-cache`, beside the directory of this binary.
fn cache_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| format!("locating the bench binary: {e}"))?;
    let target = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("the bench binary is not in a target directory")?;
    Ok(target.join("bench-cache"))
}

fn cp_sparse(from: &Path, to: &Path) -> Result<()> {
    integration::run(Command::new("cp").arg("--sparse=always").arg(from).arg(to))?;
    fs::File::open(to)?.sync_all()?;
    Ok(())
}

/// Builds the environment on a fresh image and saves the image, trimmed,
/// as `image` with `meta` beside it.
fn build_into_cache(opts: &Options, image: &Path, meta: &Path) -> Result<()> {
    const GIB: u64 = 1 << 30;
    let image_bytes = 3 * opts.bytes + 2 * GIB;
    let vol = Scratch::new(image_bytes)?;
    let dir = vol.file.parent().ok_or("no data dir")?.to_path_buf();
    eprintln!(
        "lmdb: building a {} environment with LMDB (cached afterwards in {}) ...",
        fmt_bytes(opts.bytes),
        image.display()
    );
    let spec = Spec::node(opts.bytes, opts.seed);
    let (built, took) = timed(|| lmdb::build(&dir, &spec))?;
    let extents = integration::extent_count(&vol.file)?;
    eprintln!(
        "lmdb: {} keys in {} transactions, {}, {} extents, built in {}",
        fmt_count(built.keys),
        fmt_count(built.txns),
        fmt_bytes(built.file_bytes),
        fmt_count(extents),
        fmt_duration(took)
    );
    vol.settle()?;
    // Freed blocks become holes in the image: the cache holds about the
    // live data, not everything the build ever wrote.
    integration::run(Command::new("fstrim").arg(vol.path("")))?;
    let mut fs = vol.into_fs();
    fs.unmount()?;
    let env = Environment {
        recipe: RECIPE,
        seed: opts.seed,
        built,
        extents,
        build_seconds: took.as_secs_f64(),
        image_bytes,
    };
    let tmp = image.with_extension("img.tmp");
    cp_sparse(fs.image_path(), &tmp)?;
    fs::write(meta, serde_json::to_vec_pretty(&env)?)?;
    fs::rename(&tmp, image)?;
    fs.close()?;
    Ok(())
}

/// The environment's volume, from the cache (built first if absent).
fn load(opts: &Options) -> Result<(Scratch, Environment, bool, Duration)> {
    let dir = cache_dir()?;
    fs::create_dir_all(&dir)?;
    let name = format!("lmdb-r{RECIPE}-{}-seed{}", opts.bytes, opts.seed);
    let image = dir.join(format!("{name}.img"));
    let meta = dir.join(format!("{name}.json"));
    let cached = !opts.fresh && image.is_file() && meta.is_file();
    if !cached {
        build_into_cache(opts, &image, &meta)?;
    }
    let env: Environment = serde_json::from_slice(&fs::read(&meta)?)
        .map_err(|e| format!("{}: {e}", meta.display()))?;
    eprintln!("lmdb: copying and mounting {} ...", image.display());
    let copy = dir.join(format!("{name}.img.loading"));
    let (vol, took) = timed(|| -> Result<Scratch> {
        cp_sparse(&image, &copy)?;
        Scratch::on(LoopFs::from_image(FsKind::Btrfs, &copy, "")?)
    })?;
    Ok((vol, env, cached, took))
}

/// One round: every operation once, upstream's and ours, each from a
/// settled filesystem with `data.mdb` out of the page cache; more keys
/// written before each restore, every key checked after it.
fn round(
    vol: &Scratch,
    env: &Environment,
    s: &mut [Samples; 3],
    checks: &mut Vec<Duration>,
    read: &mut u64,
) -> Result<()> {
    let dir = vol.file.parent().ok_or("no data dir")?;
    let keys = env.built.keys;
    let later = Spec {
        puts_per_txn: LATER_PER_TXN,
        txns_per_sync: 1,
        ..Spec::node(env.built.file_bytes, env.seed)
    };
    let mut check = |who: &str| -> Result<()> {
        let (bytes, took) = timed(|| lmdb::check(dir, env.seed, keys))
            .map_err(|e| format!("after {who} restore, the keys differ: {e}"))?;
        checks.push(took);
        *read = bytes;
        Ok(())
    };
    let mut write = |_| Ok(lmdb::put_keys(dir, &later, keys, LATER_KEYS)?);
    crate::round_with(vol, s, &mut write, &mut check)
}

/// Runs the section.
pub fn run(args: &crate::Args) -> Result<Report> {
    let start = Instant::now();
    let opts = &Options {
        bytes: args.lmdb_size,
        seed: args.seed,
        runs: args.runs.unwrap_or(crate::DEFAULT_RUNS),
        fresh: args.lmdb_fresh,
    };
    let (vol, env, from_cache, load) = load(opts)?;
    let dir = vol.file.parent().ok_or("no data dir")?.to_path_buf();
    eprintln!(
        "lmdb: {} extents, checking every key once before the rounds ...",
        fmt_count(integration::extent_count(&vol.file)?)
    );
    lmdb::check(&dir, env.seed, env.built.keys)
        .map_err(|e| format!("the environment as built: {e}"))?;

    eprintln!(
        "lmdb: {} rounds after a warm-up, every key checked after each restore ...",
        opts.runs
    );
    let mut checks = Vec::new();
    let mut read = 0;
    let mut warmup: [Samples; 3] = Default::default();
    round(&vol, &env, &mut warmup, &mut checks, &mut read)?;
    let mut samples: [Samples; 3] = Default::default();
    for _ in 0..opts.runs {
        round(&vol, &env, &mut samples, &mut checks, &mut read)?;
    }
    let case = Case {
        target_extents: env.extents,
        extents: env.extents,
        file_bytes: env.built.file_bytes,
        image_bytes: env.image_bytes,
        build_seconds: env.build_seconds,
        rows: Op::ALL
            .iter()
            .zip(&samples)
            .map(|(&op, s)| Row::new(op, s))
            .collect(),
    };
    let cases = vec![case];
    let snapshot = SnapshotReport {
        runs: opts.runs,
        seed: opts.seed,
        targets: crate::verdicts(&cases),
        cases,
        total_seconds: start.elapsed().as_secs_f64(),
    };

    let tree = Tree {
        kind: TreeKind::Fragmented,
        label: "LMDB environment".to_owned(),
        pkg: vol.package().clone(),
        path: vol.live().to_path_buf(),
        files: 2,
        bytes: env.built.file_bytes,
    };
    let usage = usage::run_on(&vol.root(), vol.device(), &[tree], opts.runs)?;
    vol.close()?;
    Ok(Report {
        checks: Checks {
            restores: checks.len() as u32,
            keys: env.built.keys,
            bytes: read,
            seconds: Stats::of(&checks),
        },
        environment: env,
        from_cache,
        load_seconds: load.as_secs_f64(),
        snapshot,
        usage,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

/// The section's tables and target lines.
pub fn print(report: &Report) {
    let env = &report.environment;
    println!(
        "LMDB environment written by LMDB (random-key puts, 1,000 a transaction, MDB_NOSYNC,\n\
         \x20 a sync every 4): data.mdb {}, {} keys in {} transactions, {} extents (FIEMAP);\n\
         \x20 built in {}{}",
        fmt_bytes(env.built.file_bytes),
        fmt_count(env.built.keys),
        fmt_count(env.built.txns),
        fmt_count(env.extents),
        fmt_duration(Duration::from_secs_f64(env.build_seconds)),
        if report.from_cache {
            format!(
                " (an earlier run; this one copied and mounted the cached image in {})",
                fmt_duration(Duration::from_secs_f64(report.load_seconds))
            )
        } else {
            String::new()
        }
    );
    crate::print_snapshot(&report.snapshot);
    let c = &report.checks;
    println!(
        "every key read back after each restore ({} restores, upstream's and ours, warm-up\n\
         \x20 included; {} more keys written before each): {} keys, {} each time, all exact;\n\
         \x20 check median {}",
        c.restores,
        fmt_count(LATER_KEYS),
        fmt_count(c.keys),
        fmt_bytes(c.bytes),
        fmt_duration(c.seconds.median()),
    );
    println!();
    usage::print(&report.usage);
}
