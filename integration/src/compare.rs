//! The same scenarios run against upstream's baseline ([`crate::upstream`])
//! and against ours (`startos_core::volume`, on [`volume::VolumeStore`] and
//! `volume_migrate`), each on loop-mounted btrfs, returning what happened
//! as data: whether anything was lost, which files and attributes differ,
//! whether the volume path went missing, how long it took.
//!
//! One module per scenario of the issue:
//! - [`nested`] (a): nested subvolumes, writable and read-only, through a
//!   snapshot and a restore;
//! - [`crash`] (b): SIGKILL at each step of a restore and of a conversion,
//!   then the next call or boot;
//! - [`attrs`] (c): converting a tree with every kind of entry and
//!   attribute, compared entry by entry;
//! - [`resume`] (d): a conversion killed at 90% and run again;
//! - [`bind`] (e): a restore while another mount namespace holds a bind
//!   mount of the volume and writes to it;
//! - [`nocow`] (f): NOCOW files in a plain-directory volume: is a backup
//!   taken, is a missing one reported;
//! - [`boot`] (g): a box of several plain-directory packages converted at
//!   boot: when may every service start, when are the old trees gone;
//! - [`reorder`] (h): start-core's own call sites killed at every step of
//!   an update and a rollback, in upstream's order and reordered.
//!
//! [`trees`] builds the volumes they run on; [`table`] lays out the rows.
//!
//! Each returns a `...Comparison` with an `upstream` and an `ours` outcome
//! of the same type (so a test can assert on ours and only report
//! upstream's), and [`Report::rows`] for the table of the `compare` binary
//! ([`table::render`]).
//!
//! Scenarios that kill a process re-execute a program chosen by the caller
//! ([`Launcher`]) with the operation in environment variables; that program
//! must call [`child_main`] first thing (the `compare` binary does in
//! `main`, the test file in a `crash_child` test). The kills need the
//! `failpoints` features (`volume/failpoints,volume-migrate/failpoints`);
//! without them a scenario that kills reports so as an error.

pub mod attrs;
pub mod bind;
pub mod boot;
pub mod crash;
pub mod nested;
pub mod nocow;
pub mod reorder;
pub mod resume;
pub mod table;
pub mod trees;

use std::collections::BTreeSet;
use std::error::Error as StdError;
use std::ffi::OsString;
use std::fmt;
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use models::PackageId;

use crate::LoopFs;
pub use table::Row;

/// Why a scenario could not run to its end (as opposed to an outcome, bad
/// or good, which it reports).
pub type Failure = Box<dyn StdError + Send + Sync>;
/// A scenario's result.
pub type Result<T, E = Failure> = std::result::Result<T, E>;

/// Adds what was being done to an error, as one line.
pub trait Context<T> {
    /// `Err(e)` becomes `Err("<what>: <e>")`.
    fn ctx(self, what: impl fmt::Display) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| format!("{what}: {e}").into())
    }
}

/// A scenario's outcome as rows of the comparison table.
pub trait Report {
    /// One or more rows; the first names the scenario.
    fn rows(&self) -> Vec<Row>;
}

/// How big the scenarios' trees are: [`Scale::quick`] for `make test`,
/// [`Scale::full`] for `make compare`.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    /// Size of each loop-mounted btrfs image (sparse).
    pub image_bytes: u64,
    /// (d) The resumed tree holds this many equal files...
    pub resume_files: u32,
    /// ... of this many bytes each...
    pub resume_file_bytes: u64,
    /// ... each fragmented to about this many extents.
    pub resume_file_extents: u64,
    /// (g) Small files in each of the box's small packages.
    pub boot_small_files: u32,
    /// (g) Size of the database file of the box's big package...
    pub boot_db_bytes: u64,
    /// ... and its extents.
    pub boot_db_extents: u64,
    /// (g) Drop the page cache before each timed boot, so neither side
    /// reads what the other left cached (it slows whatever else runs on
    /// the machine: not for the test suite).
    pub cold: bool,
}

impl Scale {
    /// Small trees, for the test suite: every scenario in seconds.
    pub fn quick() -> Scale {
        Scale {
            image_bytes: 512 << 20,
            resume_files: 10,
            resume_file_bytes: 2 << 20,
            resume_file_extents: 200,
            boot_small_files: 200,
            boot_db_bytes: 16 << 20,
            boot_db_extents: 2_000,
            cold: false,
        }
    }

    /// Trees big enough for the times to mean something, for
    /// `make compare`.
    pub fn full() -> Scale {
        Scale {
            image_bytes: 8 << 30,
            resume_files: 10,
            resume_file_bytes: 64 << 20,
            resume_file_extents: 8_000,
            boot_small_files: 5_000,
            boot_db_bytes: 1 << 30,
            boot_db_extents: 200_000,
            cold: true,
        }
    }
}

/// Upstream's baseline or ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// [`crate::upstream`].
    Upstream,
    /// `startos_core::volume` and the crates under it.
    Ours,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Upstream => "upstream",
            Side::Ours => "ours",
        })
    }
}

/// One package's install backup on both sides, so that a scenario drives
/// whichever `Side` it runs with the same calls.
struct Backups {
    theirs: crate::upstream::InstallBackup,
    ours: startos_core::volume::InstallBackup,
}

impl Backups {
    fn new(root: &Path, pkg: &str) -> Backups {
        Backups {
            theirs: crate::upstream::InstallBackup::new(root, pkg),
            ours: startos_core::volume::InstallBackup::at(root, pkg),
        }
    }

    /// Makes `<root>/<pkg>` a volume as the side's install would.
    fn ensure_volume_root(&self, side: Side, root: &Path, pkg: &str) -> Result<()> {
        match side {
            Side::Upstream => Ok(crate::upstream::ensure_volume_root(
                root,
                pkg,
                self.theirs.log(),
            )?),
            Side::Ours => block_on(startos_core::volume::ensure_volume_root_at(root, pkg))
                .ctx("ensure_volume_root"),
        }
    }

    /// Begins the update and takes the backup; whether one was taken.
    fn begin_and_snapshot(&self, side: Side) -> Result<bool> {
        match side {
            Side::Upstream => {
                self.theirs.begin()?;
                Ok(self.theirs.snapshot()?)
            }
            Side::Ours => block_on(async {
                self.ours.begin().await?;
                self.ours.snapshot().await
            })
            .ctx("begin and snapshot"),
        }
    }
}

// ------------------------------------------------------------------ child processes

const CHILD_OP_ENV: &str = "COMPARE_CHILD_OP";
const CHILD_ROOT_ENV: &str = "COMPARE_CHILD_ROOT";
const CHILD_PKG_ENV: &str = "COMPARE_CHILD_PKG";
const CHILD_CHUNK_ENV: &str = "COMPARE_CHILD_CHUNK";

/// How to start the current program again as a scenario's child: the
/// program and the arguments that make it reach [`child_main`] at once.
#[derive(Clone, Debug)]
pub struct Launcher {
    program: PathBuf,
    args: Vec<OsString>,
}

impl Launcher {
    /// `program` with `args`.
    pub fn new(program: impl Into<PathBuf>, args: &[&str]) -> Launcher {
        Launcher {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
        }
    }

    /// The running executable with `args` (a test binary needs
    /// `--exact crash_child --nocapture --test-threads=1`).
    pub fn current_exe(args: &[&str]) -> Result<Launcher> {
        let exe = std::env::current_exe().ctx("finding the current executable")?;
        Ok(Launcher::new(exe, args))
    }
}

/// What a child process does, killed at a crash site on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChildOp {
    /// [`crate::upstream::InstallBackup::restore`].
    UpstreamRestore,
    /// [`crate::upstream::boot_volume_maintenance`] with the package
    /// installed.
    UpstreamBoot,
    /// `startos_core::volume::InstallBackup::restore`.
    OursRestore,
    /// `startos_core::volume::boot_volume_maintenance_at` with the package
    /// installed, then the removal of the old tree it leaves running.
    OursBoot,
    /// `volume_migrate::Migrator::convert` with the clone method forced and
    /// a chunk size.
    OursConvertClone,
}

impl ChildOp {
    const ALL: [ChildOp; 5] = [
        ChildOp::UpstreamRestore,
        ChildOp::UpstreamBoot,
        ChildOp::OursRestore,
        ChildOp::OursBoot,
        ChildOp::OursConvertClone,
    ];

    fn name(self) -> &'static str {
        match self {
            ChildOp::UpstreamRestore => "upstream-restore",
            ChildOp::UpstreamBoot => "upstream-boot",
            ChildOp::OursRestore => "ours-restore",
            ChildOp::OursBoot => "ours-boot",
            ChildOp::OursConvertClone => "ours-convert-clone",
        }
    }
}

/// If this process was started by a scenario as its child, runs the
/// child's operation, prints how it ended, and returns true: the caller
/// then exits. Otherwise returns false at once.
///
/// The operation is expected to die at the crash site the scenario named;
/// reaching the end is reported on stdout for the scenario's error
/// message.
pub fn child_main() -> bool {
    let Ok(op) = std::env::var(CHILD_OP_ENV) else {
        return false;
    };
    let outcome = run_child(&op);
    println!("compare child: {op} ran to the end: {outcome:?}");
    true
}

fn run_child(op: &str) -> Result<String> {
    let op = ChildOp::ALL
        .into_iter()
        .find(|o| o.name() == op)
        .ok_or_else(|| format!("unknown child operation {op:?}"))?;
    let root = PathBuf::from(std::env::var_os(CHILD_ROOT_ENV).ok_or("no child root")?);
    let pkg = std::env::var(CHILD_PKG_ENV).ctx("child package")?;
    let id: PackageId = pkg.parse().ctx("child package id")?;
    let one = BTreeSet::from([id.clone()]);
    match op {
        ChildOp::UpstreamRestore => {
            crate::upstream::InstallBackup::new(&root, &pkg).restore()?;
            Ok("restored".into())
        }
        ChildOp::UpstreamBoot => {
            let r =
                crate::upstream::boot_volume_maintenance(&root, &one, &one, &mut Progress::new())?;
            Ok(format!("{r:?}"))
        }
        ChildOp::OursRestore => block_on(async {
            startos_core::volume::InstallBackup::at(&root, &pkg)
                .restore()
                .await
                .ctx("restore")
        })
        .map(|()| "restored".into()),
        ChildOp::OursBoot => block_on(async {
            let mut b = startos_core::volume::boot_volume_maintenance_at(
                &root,
                &one,
                &one,
                &mut Progress::new(),
            )
            .await
            .ctx("boot maintenance")?;
            if let Some(cleanup) = b.cleanup.take() {
                cleanup.await.ctx("cleanup task")?.ctx("cleanup")?;
            }
            Ok(format!("{b:?}"))
        }),
        ChildOp::OursConvertClone => {
            let chunk = std::env::var(CHILD_CHUNK_ENV)
                .ctx("child chunk size")?
                .parse()
                .ctx("child chunk size")?;
            let m = volume_migrate::Migrator::open(&root).ctx("opening the migrator")?;
            let r = m
                .convert(
                    &id,
                    &clone_options(chunk),
                    &mut |_: &volume_migrate::Progress| {},
                )
                .ctx("convert")?;
            Ok(format!("{r:?}"))
        }
    }
}

/// Our conversion with the clone method forced (whatever `Auto` would
/// pick), `chunk` bytes per clone call, the old tree left for later.
fn clone_options(chunk: u64) -> volume_migrate::MigrateOptions {
    volume_migrate::MigrateOptions {
        chunk_bytes: chunk,
        remove_old: false,
        method: volume_migrate::Method::Clone,
        ..Default::default()
    }
}

/// How a child run ended.
struct ChildRun {
    killed: bool,
    output: String,
}

/// Runs `op` on `pkg` under `root` in a child process that
/// `failpoint` ([`volume::FAILPOINT_ENV`]) should kill.
fn run_killed(
    launcher: &Launcher,
    op: ChildOp,
    root: &Path,
    pkg: &str,
    failpoint: &str,
    chunk: Option<u64>,
) -> Result<ChildRun> {
    let mut cmd = Command::new(&launcher.program);
    cmd.args(&launcher.args)
        .env(CHILD_OP_ENV, op.name())
        .env(CHILD_ROOT_ENV, root)
        .env(CHILD_PKG_ENV, pkg)
        .env(volume::FAILPOINT_ENV, failpoint)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    if let Some(chunk) = chunk {
        cmd.env(CHILD_CHUNK_ENV, chunk.to_string());
    }
    let out = cmd
        .output()
        .ctx(format!("starting {}", launcher.program.display()))?;
    Ok(ChildRun {
        killed: out.status.signal() == Some(libc::SIGKILL),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

/// [`run_killed`], failing unless the child died at the site.
fn kill_at(
    launcher: &Launcher,
    op: ChildOp,
    root: &Path,
    pkg: &str,
    failpoint: &str,
    chunk: Option<u64>,
) -> Result<()> {
    let run = run_killed(launcher, op, root, pkg, failpoint, chunk)?;
    if run.killed {
        return Ok(());
    }
    let tail: String = run
        .output
        .lines()
        .rev()
        .take(6)
        .collect::<Vec<_>>()
        .join(" | ");
    Err(format!(
        "{} was not killed at `{failpoint}`: are the failpoints compiled in \
         (--features volume/failpoints,volume-migrate/failpoints)? child said: {tail}",
        op.name()
    )
    .into())
}

// ------------------------------------------------------------------ shared helpers

/// Runs `fut` to its end on a fresh tokio runtime (ours is async).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    // A runtime that cannot even start is a broken machine, not an outcome.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("starting a tokio runtime")
        .block_on(fut)
}

/// Boot progress as both sides report it: the totals, and when each
/// package was reported ready (ours only: upstream has no such signal).
#[derive(Debug)]
pub struct Progress {
    start: Instant,
    /// The byte total last set.
    pub total: u64,
    /// The bytes done last set.
    pub done: u64,
    /// Each package reported ready, with when, from the progress's start.
    pub ready: Vec<(String, Duration)>,
}

impl Progress {
    /// A recorder whose clock starts now.
    pub fn new() -> Progress {
        Progress {
            start: Instant::now(),
            total: 0,
            done: 0,
            ready: Vec::new(),
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

impl startos_core::volume::BootProgress for Progress {
    fn set_total(&mut self, bytes: u64) {
        self.total = bytes;
    }

    fn set_done(&mut self, bytes: u64) {
        self.done = bytes;
    }

    fn package_ready(&mut self, pkg: &str) {
        self.ready.push((pkg.to_owned(), self.start.elapsed()));
    }
}

/// A fresh btrfs of `scale`'s size with an empty volumes root
/// `<mnt>/volumes`.
fn scratch(scale: &Scale) -> Result<(LoopFs, PathBuf)> {
    let fs = LoopFs::btrfs(scale.image_bytes).ctx("creating a loop-mounted btrfs")?;
    let root = fs.path("volumes");
    std::fs::create_dir(&root).ctx("creating the volumes root")?;
    Ok((fs, root))
}

/// Commits everything and waits for the btrfs cleaner, so a timed step
/// neither pays for the previous one's deferred work nor competes with it.
fn settle(mount_point: &Path) -> Result<()> {
    for args in [
        &["filesystem", "sync"][..],
        &["subvolume", "sync"],
        &["filesystem", "sync"],
    ] {
        crate::run(Command::new("btrfs").args(args).arg(mount_point))?;
    }
    Ok(())
}

/// The names under the volumes root, sorted.
fn root_names(root: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(root).ctx(format!("listing {}", root.display()))? {
        names.push(
            e.ctx("listing the volumes root")?
                .file_name()
                .to_string_lossy()
                .into_owned(),
        );
    }
    names.sort();
    Ok(names)
}

/// The names under the root that belong to one of `packages` (the name, or
/// the name and a dot) other than its volume and its backup: what an
/// operation or its recovery left behind.
fn leftovers(root: &Path, packages: &[&str]) -> Result<Vec<String>> {
    Ok(root_names(root)?
        .into_iter()
        .filter(|n| {
            packages.iter().any(|p| {
                n.strip_prefix(p)
                    .and_then(|rest| rest.strip_prefix('.'))
                    .is_some_and(|suffix| format!(".{suffix}") != volume::INSTALL_BACKUP_SUFFIX)
            })
        })
        .collect())
}

/// [`crate::tree_digest`] with the path in the error.
fn digest(path: &Path) -> Result<crate::TreeDigest> {
    crate::tree_digest(path).ctx(format!("digest of {}", path.display()))
}

/// Our error as one line.
fn ours_err(e: volume::Error) -> Failure {
    e.to_string().into()
}

/// `3 of 4`, `none`, `all 4`.
fn count_of(n: usize, of: usize) -> String {
    match (n, of) {
        (0, _) => "none".to_owned(),
        (n, of) if n == of => format!("all {of}"),
        (n, of) => format!("{n} of {of}"),
    }
}
