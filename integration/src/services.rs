//! A process-based implementation of start-core's [`Services`]
//! ([`ProcessServices`]), the test double the tests, the bench and the demo
//! run installs with: each service is a process that keeps writing into its
//! volume like a database until stopped.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId, ResultExt, VolumeId};
use startos_core::{Phase, Services};
use volume::VolumeStore;

/// The volume every [`ProcessServices`] service writes to.
pub const MAIN_VOLUME: &str = "main";
/// The random-write file of a process service (4 MiB, written 4 KiB at a time).
pub const DB_FILE: &str = "db.bin";
/// The sequence log of a process service: one little-endian u64 per write,
/// appended after the matching `db.bin` write.
pub const SEQ_FILE: &str = "seq.log";
const DB_BLOCKS: u64 = 1024;
const BLOCK: usize = 4096;

struct Running {
    child: tokio::process::Child,
    /// The child's pid, kept: `Child::id` forgets it once waited for.
    pid: Option<u32>,
}

/// Process-based [`Services`]: each running service is a child process of
/// the `startos-core-service` binary ([`service_main`]) writing random 4 KiB
/// blocks into `data/main/db.bin` and appending their sequence numbers to
/// `data/main/seq.log` until SIGTERM, when it syncs both, writes its last
/// sequence number to `<run_dir>/<pkg>.report` and exits.
///
/// `uninit`, `install` and `init` write into the volume (as migrations
/// would), so a rollback that forgot anything shows in a digest. A fault set
/// with [`ProcessServices::fail_at`] makes the phase do its writes and then
/// fail (a failing `start` starts the process first).
///
/// A service polls its parent pid and exits if this process dies, as a
/// reboot after a crash would stop it; `<run_dir>/<pkg>.pid` names it so a
/// test can make sure it is gone. Stop returns once the process has
/// exited, which is when it can no longer write. A service given
/// dependencies ([`ProcessServices::mount_dependency`]) runs in a mount
/// namespace of its own holding a bind mount of each dependency's volume,
/// as a container does; the mounts go with the process.
pub struct ProcessServices {
    volumes_root: PathBuf,
    run_dir: PathBuf,
    program: PathBuf,
    running: Mutex<HashMap<PackageId, Running>>,
    faults: Mutex<HashMap<PackageId, Phase>>,
    delays: Mutex<HashMap<Phase, Duration>>,
    reports: Mutex<HashMap<PackageId, u64>>,
    dependencies: Mutex<HashMap<PackageId, Vec<PackageId>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Poisoning only says another thread panicked; the maps stay usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ProcessServices {
    /// Services for the volumes under `volumes_root`, keeping pid and report
    /// files in `run_dir` (created), running `program` (the
    /// `startos-core-service` binary, see [`ProcessServices::locate_program`]).
    pub fn new(
        volumes_root: impl Into<PathBuf>,
        run_dir: impl Into<PathBuf>,
        program: impl Into<PathBuf>,
    ) -> Result<Self, Error> {
        let run_dir = run_dir.into();
        std::fs::create_dir_all(&run_dir).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("creating {}", run_dir.display()),
            )
        })?;
        Ok(ProcessServices {
            volumes_root: volumes_root.into(),
            run_dir,
            program: program.into(),
            running: Mutex::new(HashMap::new()),
            faults: Mutex::new(HashMap::new()),
            delays: Mutex::new(HashMap::new()),
            reports: Mutex::new(HashMap::new()),
            dependencies: Mutex::new(HashMap::new()),
        })
    }

    /// The `startos-core-service` binary: `$STARTOS_CORE_SERVICE_BIN`, else
    /// beside the running executable or one directory up (where cargo puts
    /// binaries relative to test executables in `deps/`).
    pub fn locate_program() -> Result<PathBuf, Error> {
        if let Some(p) = std::env::var_os("STARTOS_CORE_SERVICE_BIN") {
            return Ok(PathBuf::from(p));
        }
        crate::workspace_bin("startos-core-service").map_err(|e| {
            Error::new(
                eyre!(
                    "{e}; build it with `cargo build -p startos-core --bins` or set \
                     STARTOS_CORE_SERVICE_BIN"
                ),
                ErrorKind::NotFound,
            )
        })
    }

    /// Makes `pkg`'s next `phase` fail (after doing its writes). One-shot.
    pub fn fail_at(&self, pkg: &PackageId, phase: Phase) {
        lock(&self.faults).insert(pkg.clone(), phase);
    }

    /// Makes `pkg`'s service, from its next start on, run in a mount
    /// namespace of its own in which `dep`'s `data/main` is bind-mounted at
    /// [`ProcessServices::dependency_mount`], as a container holds a
    /// dependency's volume.
    pub fn mount_dependency(&self, pkg: &PackageId, dep: &PackageId) {
        lock(&self.dependencies)
            .entry(pkg.clone())
            .or_default()
            .push(dep.clone());
    }

    /// Where `pkg`'s service sees `dep`'s volume, in its own mount
    /// namespace: `<run_dir>/<pkg>.deps/<dep>`.
    pub fn dependency_mount(&self, pkg: &PackageId, dep: &PackageId) -> PathBuf {
        self.run_dir.join(format!("{pkg}.deps")).join(dep.as_str())
    }

    /// Makes every `phase` take `delay` longer (to see parallelism).
    pub fn delay(&self, phase: Phase, delay: Duration) {
        lock(&self.delays).insert(phase, delay);
    }

    /// The last sequence number `pkg`'s service reported when it was last
    /// stopped, if it was.
    pub fn last_report(&self, pkg: &PackageId) -> Option<u64> {
        lock(&self.reports).get(pkg).copied()
    }

    /// Whether `pkg`'s service process is running.
    pub fn is_running(&self, pkg: &PackageId) -> bool {
        lock(&self.running).contains_key(pkg)
    }

    /// `<run_dir>/<pkg>.pid`, the pid of the running service.
    pub fn pid_path(&self, pkg: &PackageId) -> PathBuf {
        self.run_dir.join(format!("{pkg}.pid"))
    }

    fn report_path(&self, pkg: &PackageId) -> PathBuf {
        self.run_dir.join(format!("{pkg}.report"))
    }

    fn data_dir(&self, pkg: &PackageId) -> PathBuf {
        self.volumes_root.join(pkg.as_str()).join("data")
    }

    async fn phase_hook(&self, pkg: &PackageId, phase: Phase) -> bool {
        let delay = lock(&self.delays).get(&phase).copied();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let mut faults = lock(&self.faults);
        if faults.get(pkg) == Some(&phase) {
            faults.remove(pkg);
            true
        } else {
            false
        }
    }

    fn injected(pkg: &PackageId, phase: Phase) -> Error {
        Error::for_package(
            pkg,
            ErrorKind::InstallFailed,
            format!("injected failure in {phase}"),
        )
    }

    /// Writes `name` = `content` into `data/main` and rewrites `db.bin`'s
    /// first block, as a migration would. Synced, so a crash right after
    /// leaves it on disk.
    async fn migrate(&self, pkg: &PackageId, name: String, content: String) -> Result<(), Error> {
        let dir = self.data_dir(pkg);
        let p = pkg.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            let main = dir.join(MAIN_VOLUME);
            let mut f = std::fs::File::create(main.join(&name))?;
            f.write_all(content.as_bytes())?;
            f.sync_all()?;
            let db = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(false)
                .open(main.join(DB_FILE))?;
            let mut block = content.into_bytes();
            block.resize(BLOCK, b'#');
            db.write_all_at(&block, 0)?;
            db.sync_all()?;
            std::fs::write(dir.join(".version"), name.as_bytes())?;
            std::fs::File::open(&dir)?.sync_all()
        })
        .await
        .map_err(|e| Error::new(eyre!("{e}"), ErrorKind::Unknown))?
        .with_ctx(|_| (ErrorKind::Filesystem, p.context("writing into the volume")))
    }

    #[allow(unsafe_code)] // libc calls to set up a service process
    async fn spawn(&self, pkg: &PackageId, version: &str) -> Result<(), Error> {
        if self.is_running(pkg) {
            return Ok(());
        }
        let dir = self.data_dir(pkg).join(MAIN_VOLUME);
        let report = self.report_path(pkg);
        let _ = std::fs::remove_file(&report);
        // Its own log rather than our stdout/stderr: a service outliving a
        // crashed parent must not hold the parent's pipes open.
        let log =
            std::fs::File::create(self.run_dir.join(format!("{pkg}.log"))).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("creating the service log"),
                )
            })?;
        let log2 = log.try_clone().with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                pkg.context("creating the service log"),
            )
        })?;
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.arg(&dir)
            .arg(&report)
            .arg(version)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(false);
        let binds = self.dependency_binds(pkg)?;
        if !binds.is_empty() {
            // SAFETY: between fork and exec the closure makes only raw
            // system calls on strings built beforehand: no allocation, no
            // lock.
            unsafe {
                cmd.pre_exec(move || enter_own_mount_namespace(&binds));
            }
        }
        let child = cmd.spawn().with_ctx(|_| {
            (
                ErrorKind::Unknown,
                pkg.context(format!("spawning {}", self.program.display())),
            )
        })?;
        let pid = child.id();
        if let Some(pid) = pid {
            std::fs::write(self.pid_path(pkg), pid.to_string())
                .with_ctx(|_| (ErrorKind::Filesystem, pkg.context("writing the pid file")))?;
        }
        lock(&self.running).insert(pkg.clone(), Running { child, pid });
        Ok(())
    }

    /// What `pkg`'s service bind-mounts in its own namespace: each
    /// dependency's `data/main`, checked to be reached beneath the volumes
    /// root through no symlink (a dependency could have put one there);
    /// targets created. The mount itself goes by path, in the child, after
    /// the check: an fd opened here belongs to this namespace's mount and
    /// cannot be bound in another. A test double, not a container runtime:
    /// the window between the two is not closed.
    fn dependency_binds(&self, pkg: &PackageId) -> Result<Vec<(CString, CString)>, Error> {
        let deps = lock(&self.dependencies)
            .get(pkg)
            .cloned()
            .unwrap_or_default();
        let root = volume::sys::open_dir_path(&self.volumes_root).with_ctx(|_| {
            (
                ErrorKind::Filesystem,
                format!("opening {}", self.volumes_root.display()),
            )
        })?;
        let mut binds = Vec::with_capacity(deps.len());
        for dep in deps {
            let rel = Path::new(dep.as_str()).join("data").join(MAIN_VOLUME);
            volume::sys::open_beneath(root.as_fd(), &rel).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context(format!(
                        "opening {dep}'s volume {} without a symlink",
                        rel.display()
                    )),
                )
            })?;
            let target = self.dependency_mount(pkg, &dep);
            std::fs::create_dir_all(&target).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context(format!("creating {}", target.display())),
                )
            })?;
            let c = |p: &Path| {
                CString::new(p.as_os_str().as_bytes()).with_ctx(|_| {
                    (
                        ErrorKind::InvalidRequest,
                        pkg.context(format!("a NUL byte in {}", p.display())),
                    )
                })
            };
            binds.push((c(&self.volumes_root.join(&rel))?, c(&target)?));
        }
        Ok(binds)
    }
}

/// In a child before exec: a mount namespace of its own, private so that
/// nothing propagates back, with each (source, target) bind-mounted.
#[allow(unsafe_code)] // libc calls to set up a service process
fn enter_own_mount_namespace(binds: &[(CString, CString)]) -> std::io::Result<()> {
    // SAFETY: plain system calls on NUL-terminated strings that outlive them.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0
            || libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        for (source, target) in binds {
            if libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

impl Services for ProcessServices {
    #[tracing::instrument(skip_all, fields(package = %pkg))]
    async fn stop(&self, pkg: &PackageId) -> Result<(), Error> {
        let Some(mut r) = lock(&self.running).remove(pkg) else {
            return Ok(());
        };
        if let Some(pid) = r
            .child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let status = match tokio::time::timeout(Duration::from_secs(10), r.child.wait()).await {
            Ok(s) => s,
            Err(_) => {
                tracing::warn!(package = %pkg, "service ignored SIGTERM for 10 s; killing it");
                let _ = r.child.start_kill();
                r.child.wait().await
            }
        }
        .with_ctx(|_| (ErrorKind::Unknown, pkg.context("waiting for the service")))?;
        let _ = std::fs::remove_file(self.pid_path(pkg));
        let report = std::fs::read_to_string(self.report_path(pkg))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        if let Some(seq) = report {
            lock(&self.reports).insert(pkg.clone(), seq);
        }
        tracing::info!(package = %pkg, %status, ?report, "service stopped");
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(package = %pkg))]
    async fn uninit(
        &self,
        pkg: &PackageId,
        version: &str,
        target: Option<&str>,
    ) -> Result<(), Error> {
        let fail = self.phase_hook(pkg, Phase::Uninit).await;
        let target = target.unwrap_or("none");
        self.migrate(
            pkg,
            format!("uninit-{version}-to-{target}"),
            format!("down-migrated from {version} for {target}\n"),
        )
        .await?;
        if fail {
            return Err(Self::injected(pkg, Phase::Uninit));
        }
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(package = %pkg))]
    async fn install(&self, pkg: &PackageId, version: &str, s9pk: &str) -> Result<(), Error> {
        let fail = self.phase_hook(pkg, Phase::Install).await;
        let root = self.volumes_root.clone();
        let p = pkg.clone();
        tokio::task::spawn_blocking(move || {
            let main: VolumeId = MAIN_VOLUME.parse()?;
            VolumeStore::open_without_recovery(root)?.create(&p, &[main])
        })
        .await
        .map_err(|e| Error::new(eyre!("{e}"), ErrorKind::Unknown))??;
        self.migrate(
            pkg,
            format!("installed-{version}"),
            format!("installed {version} from {s9pk}\n"),
        )
        .await?;
        if fail {
            return Err(Self::injected(pkg, Phase::Install));
        }
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(package = %pkg))]
    async fn init(&self, pkg: &PackageId, version: &str, from: Option<&str>) -> Result<(), Error> {
        let fail = self.phase_hook(pkg, Phase::Init).await;
        let from = from.unwrap_or("fresh");
        self.migrate(
            pkg,
            format!("init-{version}-from-{from}"),
            format!("migrated to {version} from {from}\n"),
        )
        .await?;
        if fail {
            return Err(Self::injected(pkg, Phase::Init));
        }
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(package = %pkg))]
    async fn start(&self, pkg: &PackageId, version: &str) -> Result<(), Error> {
        let fail = self.phase_hook(pkg, Phase::Start).await;
        self.spawn(pkg, version).await?;
        if fail {
            return Err(Self::injected(pkg, Phase::Start));
        }
        Ok(())
    }

    fn service_of(&self, pid: u32) -> Option<PackageId> {
        lock(&self.running)
            .iter()
            .find(|(_, r)| r.pid == Some(pid))
            .map(|(p, _)| p.clone())
    }
}

static TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    TERM.store(true, Ordering::SeqCst);
}

/// The last record of a `seq.log` (the last sequence number a service wrote),
/// or `None` for an empty or missing log.
pub fn last_sequence(seq_log: &Path) -> std::io::Result<Option<u64>> {
    let mut f = match std::fs::File::open(seq_log) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    if len < 8 {
        return Ok(None);
    }
    f.seek(SeekFrom::Start(len - len % 8 - 8))?;
    let mut b = [0u8; 8];
    f.read_exact(&mut b)?;
    Ok(Some(u64::from_le_bytes(b)))
}

/// The body of the `startos-core-service` binary: `<dir> <report> <version>`.
///
/// Until SIGTERM: write a 4 KiB block derived from the sequence number at a
/// pseudo-random offset of `<dir>/db.bin`, then append the number to
/// `<dir>/seq.log`; every 64 writes fsync both. On SIGTERM: finish the
/// current write, fsync both, write the last number to `<report>` (fsynced)
/// and exit 0. If the parent dies (a crash of the process that started it),
/// exit at once with status 3 and no report, as a reboot would cut it off.
#[allow(unsafe_code)] // libc calls to set up a service process
pub fn service_main(args: &[std::ffi::OsString]) -> std::io::Result<()> {
    let [dir, report, version] = args else {
        return Err(std::io::Error::other(
            "usage: startos-core-service <dir> <report> <version>",
        ));
    };
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
    }
    let parent = rustix::process::getppid();
    let dir = Path::new(dir);
    let db = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(dir.join(DB_FILE))?;
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(SEQ_FILE))?;
    let mut seq = last_sequence(&dir.join(SEQ_FILE))?.unwrap_or(0);
    let tag = version.to_string_lossy().into_owned();
    let mut block = vec![0u8; BLOCK];
    while !TERM.load(Ordering::SeqCst) {
        if rustix::process::getppid() != parent {
            std::process::exit(3);
        }
        seq += 1;
        let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for chunk in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        block[..tag.len().min(64)].copy_from_slice(&tag.as_bytes()[..tag.len().min(64)]);
        let offset = (seq.wrapping_mul(2_654_435_761) % DB_BLOCKS) * BLOCK as u64;
        db.write_all_at(&block, offset)?;
        log.write_all(&seq.to_le_bytes())?;
        if seq % 64 == 0 {
            db.sync_data()?;
            log.sync_data()?;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    db.sync_all()?;
    log.sync_all()?;
    let mut r = std::fs::File::create(report)?;
    writeln!(r, "{seq}")?;
    r.sync_all()?;
    Ok(())
}
