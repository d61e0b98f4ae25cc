//! Helpers shared by the `core_*.rs` tests: a loop-mounted btrfs with a volumes
//! root, a state database, process-based services wrapped in a [`Probe`] that
//! records what the volume looked like at each service call, and a finalizer.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration::services::ProcessServices;
use integration::{LoopFs, TreeDigest, fs_or_skip};
use startos_core::{
    Cancel, FileDb, Finalizer, Notification, PackageDataEntry, Phase, Services, StateInfo,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use volume::{Error, PackageId};

use crate::common::{BTRFS_SIZE, digest, pkg};

pub type Fin = Finalizer<FileDb, Probe, UnboundedSender<Notification>>;

/// One btrfs filesystem with `volumes/`, `run/` and `state.json`.
pub struct Env {
    pub fs: LoopFs,
    pub root: PathBuf,
    pub run: PathBuf,
    pub db_path: PathBuf,
}

pub fn env() -> Option<Env> {
    env_on(LoopFs::btrfs(BTRFS_SIZE))
}

/// An environment on ext4, where no install backup can be taken.
pub fn env_ext4() -> Option<Env> {
    env_on(LoopFs::ext4(128 << 20))
}

fn env_on(fs: std::io::Result<LoopFs>) -> Option<Env> {
    let fs = fs_or_skip!(fs, None);
    let root = crate::common::volumes_root(&fs);
    // Outside the volumes root, as upstream keeps its database elsewhere.
    let run = fs.path("run");
    std::fs::create_dir_all(&run).expect("mkdir run");
    let db_path = fs.path("state.json");
    Some(Env {
        fs,
        root,
        run,
        db_path,
    })
}

impl Env {
    pub fn services(&self) -> ProcessServices {
        let program = ProcessServices::locate_program().expect("startos-core-service binary");
        ProcessServices::new(&self.root, &self.run, program).expect("services")
    }

    /// A finalizer over a freshly opened database, and its notifications.
    pub fn finalizer(&self) -> (Arc<Fin>, UnboundedReceiver<Notification>) {
        let db = FileDb::open(&self.db_path).expect("open db");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let probe = Probe::new(self.services(), &self.root);
        (
            Arc::new(Finalizer::new(
                db,
                Arc::new(probe),
                Arc::new(tx),
                &self.root,
            )),
            rx,
        )
    }

    pub fn volume(&self, p: &str) -> PathBuf {
        self.root.join(p)
    }

    pub fn backup(&self, p: &str) -> PathBuf {
        self.root.join(format!("{p}.install-backup"))
    }
}

/// A service call, with when it ran.
#[derive(Debug, Clone)]
pub struct Call {
    pub package: PackageId,
    pub op: &'static str,
    pub version: String,
    pub start: Instant,
    pub end: Instant,
}

/// [`ProcessServices`] plus records: the volume's digest right after each stop
/// and right before each start, the last sequence number in the backup when the
/// old version's uninit runs, every call with its time span, and an optional
/// cancel fired when a chosen phase is about to run.
pub struct Probe {
    pub inner: ProcessServices,
    root: PathBuf,
    /// Every stop's digest, in order (the update's stop of the old version, then
    /// the rollback's stop of the new one).
    pub after_stop: Mutex<HashMap<PackageId, Vec<TreeDigest>>>,
    pub before_start: Mutex<HashMap<(PackageId, String), TreeDigest>>,
    pub backup_seq_at_uninit: Mutex<HashMap<PackageId, Option<u64>>>,
    pub calls: Mutex<Vec<Call>>,
    pub cancel_at: Mutex<HashMap<PackageId, (Phase, Cancel)>>,
    /// A phase at which the package's install backup is dropped from under
    /// the install, as `startos-volume drop` run meanwhile would.
    pub drop_backup_at: Mutex<HashMap<PackageId, Phase>>,
}

impl Probe {
    pub fn new(inner: ProcessServices, root: &Path) -> Self {
        Probe {
            inner,
            root: root.to_owned(),
            after_stop: Mutex::default(),
            before_start: Mutex::default(),
            backup_seq_at_uninit: Mutex::default(),
            calls: Mutex::default(),
            cancel_at: Mutex::default(),
            drop_backup_at: Mutex::default(),
        }
    }

    /// Cancels `c` just before `pkg`'s `phase` runs (for `Snapshot`: right
    /// after the stop).
    pub fn cancel_at(&self, p: &PackageId, phase: Phase, c: Cancel) {
        self.cancel_at.lock().unwrap().insert(p.clone(), (phase, c));
    }

    fn maybe_cancel(&self, p: &PackageId, phase: Phase) {
        let mut m = self.cancel_at.lock().unwrap();
        if m.get(p).is_some_and(|(ph, _)| *ph == phase) {
            let (_, c) = m.remove(p).unwrap();
            c.cancel();
        }
        drop(m);
        let mut d = self.drop_backup_at.lock().unwrap();
        if d.get(p) == Some(&phase) {
            d.remove(p);
            drop(d);
            let dropped = volume::VolumeStore::open_without_recovery(&self.root)
                .and_then(|s| s.drop_backup(p))
                .unwrap_or_else(|e| panic!("dropping {p}'s backup at {phase}: {e}"));
            assert!(dropped, "{p} had no backup to drop at {phase}");
        }
    }

    fn digest_of(&self, p: &PackageId) -> Option<TreeDigest> {
        let v = self.root.join(p.as_str());
        v.exists().then(|| digest(&v))
    }

    async fn timed(
        &self,
        p: &PackageId,
        op: &'static str,
        version: &str,
        f: impl Future<Output = Result<(), Error>>,
    ) -> Result<(), Error> {
        let start = Instant::now();
        let r = f.await;
        self.calls.lock().unwrap().push(Call {
            package: p.clone(),
            op,
            version: version.to_owned(),
            start,
            end: Instant::now(),
        });
        r
    }

    /// The digest after the first stop of `p` since the last call, and forgets
    /// the rest.
    pub fn take_first_stop(&self, p: &PackageId) -> TreeDigest {
        let v = self
            .after_stop
            .lock()
            .unwrap()
            .remove(p)
            .unwrap_or_default();
        v.into_iter()
            .next()
            .unwrap_or_else(|| panic!("{p} was never stopped with a volume"))
    }

    pub fn calls(&self, op: &str) -> Vec<Call> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.op == op)
            .cloned()
            .collect()
    }
}

impl Services for Probe {
    fn stop(&self, p: &PackageId) -> impl Future<Output = Result<(), Error>> + Send {
        self.maybe_cancel(p, Phase::Stop);
        async move {
            self.inner.stop(p).await?;
            if let Some(d) = self.digest_of(p) {
                self.after_stop
                    .lock()
                    .unwrap()
                    .entry(p.clone())
                    .or_default()
                    .push(d);
            }
            self.maybe_cancel(p, Phase::Snapshot);
            Ok(())
        }
    }

    fn uninit(
        &self,
        p: &PackageId,
        version: &str,
        target: Option<&str>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.maybe_cancel(p, Phase::Uninit);
        let seq_log = self
            .root
            .join(format!("{p}.install-backup"))
            .join("data/main")
            .join(integration::services::SEQ_FILE);
        let seq =
            integration::services::last_sequence(&seq_log).expect("reading the backup's seq.log");
        self.backup_seq_at_uninit
            .lock()
            .unwrap()
            .insert(p.clone(), seq);
        self.timed(p, "uninit", version, self.inner.uninit(p, version, target))
    }

    fn install(
        &self,
        p: &PackageId,
        version: &str,
        s9pk: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.maybe_cancel(p, Phase::Install);
        self.timed(p, "install", version, self.inner.install(p, version, s9pk))
    }

    fn init(
        &self,
        p: &PackageId,
        version: &str,
        from: Option<&str>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.maybe_cancel(p, Phase::Init);
        self.timed(p, "init", version, self.inner.init(p, version, from))
    }

    fn start(
        &self,
        p: &PackageId,
        version: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.maybe_cancel(p, Phase::Start);
        if let Some(d) = self.digest_of(p) {
            self.before_start
                .lock()
                .unwrap()
                .insert((p.clone(), version.to_owned()), d);
        }
        self.timed(p, "start", version, self.inner.start(p, version))
    }

    fn service_of(&self, pid: u32) -> Option<PackageId> {
        self.inner.service_of(pid)
    }
}

pub fn req(p: &str, version: &str) -> startos_core::InstallRequest {
    startos_core::InstallRequest {
        package: pkg(p),
        version: version.to_owned(),
        s9pk: format!("/s9pk/{p}-{version}.s9pk"),
    }
}

/// Fresh-installs `p` at `version`, lets it write for `run`, and waits for the
/// (absent) backup drop.
pub async fn install_running(fin: &Fin, p: &str, version: &str, run: Duration) {
    let f = fin
        .install(&req(p, version), &Cancel::new())
        .await
        .unwrap_or_else(|e| panic!("installing {p} {version}: {e}"));
    assert!(
        !f.backup_drop.await.unwrap().unwrap(),
        "fresh install: no backup"
    );
    tokio::time::sleep(run).await;
}

pub async fn entry(fin: &Fin, p: &str) -> Option<PackageDataEntry> {
    use startos_core::Db;
    fin.db().peek().await.get(p).cloned()
}

#[track_caller]
pub fn assert_installed(e: Option<PackageDataEntry>, version: &str, when: &str) {
    let e = e.unwrap_or_else(|| panic!("{when}: no state entry"));
    assert_eq!(e.state_info, StateInfo::Installed, "{when}: state");
    assert_eq!(e.version.as_deref(), Some(version), "{when}: version");
}

/// Waits until the process in `pidfile` (a service of a killed process) is
/// gone, killing it first: a reboot after a crash would not leave it running.
#[allow(unsafe_code)] // kill of our own child
pub fn reap_orphan(pidfile: &Path) {
    let Ok(text) = std::fs::read_to_string(pidfile) else {
        return;
    };
    let Ok(pid) = text.trim().parse::<i32>() else {
        return;
    };
    // SAFETY: plain syscall; the pid is one of our own service processes.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => break,
            Ok(s)
                if s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z')) =>
            {
                break;
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    let _ = std::fs::remove_file(pidfile);
}

/// Installs `name` at 1.0 in this process, lets it write, stops it: the data
/// every crash before the commit must come back to.
pub async fn installed_and_stopped(env: &Env, name: &str) -> TreeDigest {
    let (fin, _rx) = env.finalizer();
    install_running(&fin, name, "1.0", Duration::from_millis(100)).await;
    use startos_core::Services;
    fin.services().stop(&pkg(name)).await.unwrap();
    digest(&env.volume(&pkg(name)))
}

/// Boot: reconcile with a fresh database handle; it must be idempotent.
pub async fn boot(env: &Env) -> Arc<Fin> {
    let (fin, _rx) = env.finalizer();
    let r = startos_core::reconcile(&**fin.db(), &env.root)
        .await
        .expect("reconcile");
    eprintln!(
        "reconcile: {:?}; needs attention: {:?}",
        r.actions, r.needs_attention
    );
    let again = startos_core::reconcile(&**fin.db(), &env.root)
        .await
        .expect("second reconcile");
    assert!(
        again.is_noop(),
        "a second reconcile must do nothing: {again:?}"
    );
    fin
}
