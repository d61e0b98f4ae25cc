//! Package state for this workspace's own finalizer ([`crate::Finalizer`])
//! and boot reconcile ([`crate::reconcile`]), shaped like upstream's
//! patch-db document, behind the narrow [`Db`] trait they need, with a
//! durable embedded implementation ([`FileDb`]: `imbl` maps, atomic replace
//! and fsync).
//!
//! # Not a patch-db adapter
//!
//! Upstream keeps its own state code: its service map and service load
//! read and write patch-db themselves, and what they take from this
//! workspace is the `volume` module ([`crate::volume`]; see
//! `docs/upstream.md`). No adapter from this trait to patch-db is offered
//! or claimed: patch-db's `mutate` takes a closure that must be
//! `UnwindSafe` and works on the whole model, and writing this crate's
//! entry back would have to keep every field of upstream's own (manifest,
//! status, hosts, tasks), which this type does not carry. The finalizer
//! here is the reference for the order upstream's flow should follow
//! (`docs/upstream.md` lists the changes), tested end to end on its own
//! state store.

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use color_eyre::eyre::eyre;
use imbl::OrdMap;
use models::{Error, ErrorKind, PackageId, ResultExt};
use serde::{Deserialize, Serialize};

/// The phase of an install or update, in the order finalization runs them.
///
/// Recorded in the state so that a failure notification and a boot after a
/// crash can say how far it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Phase {
    /// Stopping the old service (it must have stopped writing before the snapshot).
    Stop,
    /// Taking the install backup of the stopped volume.
    Snapshot,
    /// The old version's uninit for the new target version (may migrate data).
    Uninit,
    /// Installing the new version.
    Install,
    /// The new version's init (may migrate data).
    Init,
    /// Starting the new version.
    Start,
}

impl Phase {
    /// All phases, in order.
    pub const ALL: [Phase; 6] = [
        Phase::Stop,
        Phase::Snapshot,
        Phase::Uninit,
        Phase::Install,
        Phase::Init,
        Phase::Start,
    ];

    /// The phase's name as serialized (`stop`, `snapshot`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            Phase::Stop => "stop",
            Phase::Snapshot => "snapshot",
            Phase::Uninit => "uninit",
            Phase::Install => "install",
            Phase::Init => "init",
            Phase::Start => "start",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an install or update in flight recorded for recovery.
///
/// Written before the first step that changes anything (stopping the old
/// service), and again once the backup exists, so that after a crash the
/// state alone says whether the volume predates the install and whether a
/// backup was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstallingInfo {
    /// The version being installed.
    pub new_version: String,
    /// The last phase entered.
    pub phase: Phase,
    /// Whether the package had a volume before this install (an update, or a
    /// reinstall over a soft uninstall). If not, a failed install may delete
    /// the volume it created: there is nothing older to keep.
    pub had_volume: bool,
    /// Whether an install backup was taken. With `true` and no backup on
    /// disk, a rollback already completed.
    pub backup_taken: bool,
}

/// A package's state, upstream's `stateInfo` (serde tag `state`, camelCase).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
pub enum StateInfo {
    /// A fresh install (no installed version; the volume may be left from a
    /// soft uninstall) in flight.
    #[serde(rename_all = "camelCase")]
    Installing {
        /// What recovery needs.
        installing_info: InstallingInfo,
    },
    /// An update of the installed version ([`PackageDataEntry::version`]) in flight.
    #[serde(rename_all = "camelCase")]
    Updating {
        /// What recovery needs.
        installing_info: InstallingInfo,
    },
    /// Installed and consistent: the live volume belongs to
    /// [`PackageDataEntry::version`].
    Installed,
    /// An uninstall in flight.
    #[serde(rename_all = "camelCase")]
    Removing {
        /// A soft uninstall keeps the volume for a later reinstall; a hard
        /// one deletes it.
        soft: bool,
    },
    /// A restore from a backup target in flight (upstream's; finalization
    /// never writes it).
    Restoring,
}

impl StateInfo {
    /// The tag as serialized, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            StateInfo::Installing { .. } => "installing",
            StateInfo::Updating { .. } => "updating",
            StateInfo::Installed => "installed",
            StateInfo::Removing { .. } => "removing",
            StateInfo::Restoring => "restoring",
        }
    }
}

/// One package's entry under `packageData`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PackageDataEntry {
    /// Where the package is in its life cycle.
    pub state_info: StateInfo,
    /// The installed version (the old one during an update); `None` during a
    /// fresh install.
    pub version: Option<String>,
    /// The package archive of [`PackageDataEntry::version`] (or of the
    /// version being installed, during a fresh install).
    pub s9pk: String,
}

/// `packageData`: every package's entry, by id. An `imbl` map, so a
/// [`Db::peek`] is an O(1) clone that later mutations never change.
pub type PackageDataMap = OrdMap<PackageId, PackageDataEntry>;

/// The result of a [`Db::mutate`], upstream's `MutateResult`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mutated<T> {
    /// What the closure returned.
    pub result: T,
    /// The revision that holds the change (unchanged if the closure changed
    /// nothing).
    pub revision: u64,
}

/// The narrow slice of patch-db finalization and reconcile use: read the
/// whole `packageData` document, or change it with a synchronous closure.
///
/// Invariants: a `mutate` is atomic and durable when it returns `Ok` (after a
/// crash, a later reader sees either the document before it or after it,
/// never a mix); mutations are serialized; the closure does no I/O and may
/// run once only; if it returns `Err`, nothing changes.
pub trait Db: Send + Sync + 'static {
    /// A consistent snapshot of `packageData`.
    fn peek(&self) -> impl Future<Output = PackageDataMap> + Send;
    /// Applies `f` to the document and persists the result.
    fn mutate<T, F>(&self, f: F) -> impl Future<Output = Result<Mutated<T>, Error>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&mut PackageDataMap) -> Result<T, Error> + Send + 'static;
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    revision: u64,
    package_data: PackageDataMap,
}

/// A durable embedded [`Db`]: one JSON file replaced atomically on each
/// change.
///
/// A mutation writes `<file>.tmp`, fsyncs it, renames it over `<file>` and
/// fsyncs the directory, so a crash at any instant leaves the old document or
/// the new one, never a torn file; a `.tmp` left by a crash is ignored and
/// overwritten. Reads are served from memory.
pub struct FileDb {
    path: PathBuf,
    current: RwLock<(PackageDataMap, u64)>,
    write: tokio::sync::Mutex<()>,
}

fn db_err(path: &Path, what: &str) -> impl FnOnce(&std::io::Error) -> (ErrorKind, String) {
    let msg = format!("state database {}: {what}", path.display());
    move |_| (ErrorKind::Database, msg)
}

impl FileDb {
    /// Opens the database at `path`, creating an empty one if it does not
    /// exist (its directory must).
    pub fn open(path: impl Into<PathBuf>) -> Result<Arc<Self>, Error> {
        let path = path.into();
        let doc = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Document>(&bytes).with_ctx(|_| {
                (
                    ErrorKind::Deserialization,
                    format!("state database {}: decoding", path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Document {
                revision: 0,
                package_data: PackageDataMap::new(),
            },
            Err(e) => return Err(e).with_ctx(db_err(&path, "reading")),
        };
        Ok(Arc::new(FileDb {
            path,
            current: RwLock::new((doc.package_data, doc.revision)),
            write: tokio::sync::Mutex::new(()),
        }))
    }

    /// The file the document lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current revision (0 for a new database).
    pub fn revision(&self) -> u64 {
        self.read().1
    }

    fn read(&self) -> (PackageDataMap, u64) {
        // A poisoned lock only means a panic elsewhere while holding it; the
        // value inside is always a whole committed document.
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn persist(path: &Path, bytes: &[u8]) -> Result<(), Error> {
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).with_ctx(db_err(&tmp, "creating"))?;
        f.write_all(bytes).with_ctx(db_err(&tmp, "writing"))?;
        f.sync_all().with_ctx(db_err(&tmp, "fsync"))?;
        drop(f);
        std::fs::rename(&tmp, path).with_ctx(db_err(path, "renaming the new version in"))?;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_ctx(db_err(path, "fsync of its directory"))
    }
}

impl Db for FileDb {
    async fn peek(&self) -> PackageDataMap {
        self.read().0
    }

    async fn mutate<T, F>(&self, f: F) -> Result<Mutated<T>, Error>
    where
        T: Send + 'static,
        F: FnOnce(&mut PackageDataMap) -> Result<T, Error> + Send + 'static,
    {
        let _writer = self.write.lock().await;
        let (mut map, revision) = self.read();
        let before = map.clone();
        let result = f(&mut map)?;
        // Entry by entry, not the maps' `==`: imbl's before 7.0.2 skipped
        // pointer-shared nodes and missed a changed entry beside them (its
        // issue #161), which here dropped a state change unwritten once a
        // document had some 150 packages (the I/O-error sweep found it: an
        // update's `installed` record never reached the file).
        if map.len() == before.len() && map.iter().eq(before.iter()) {
            return Ok(Mutated { result, revision });
        }
        let revision = revision + 1;
        let bytes = serde_json::to_vec_pretty(&Document {
            revision,
            package_data: map.clone(),
        })
        .with_kind(ErrorKind::Serialization)?;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || Self::persist(&path, &bytes))
            .await
            .map_err(|e| Error::new(eyre!("state database writer: {e}"), ErrorKind::Database))??;
        match self.current.write() {
            Ok(mut g) => *g = (map, revision),
            Err(p) => *p.into_inner() = (map, revision),
        }
        Ok(Mutated { result, revision })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: StateInfo) -> PackageDataEntry {
        PackageDataEntry {
            state_info: state,
            version: Some("1.0".into()),
            s9pk: "/x.s9pk".into(),
        }
    }

    /// A change to one entry of a document read back from its file is
    /// written, whatever the document's size: with imbl 6.1's map equality
    /// it was lost at 185 entries (and at 157 in the sweep's shape).
    #[tokio::test]
    async fn a_change_to_one_entry_of_a_large_document_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        for n in [17usize, 157, 185, 213, 400] {
            let _ = std::fs::remove_file(&path);
            let db = FileDb::open(&path).unwrap();
            let ids: Vec<PackageId> = (0..n).map(|i| format!("u{i}").parse().unwrap()).collect();
            let all = ids.clone();
            db.mutate(move |m| {
                for id in all {
                    m.insert(id, entry(StateInfo::Installed));
                }
                Ok(())
            })
            .await
            .unwrap();
            drop(db);
            let db = FileDb::open(&path).unwrap();
            let last = ids[n - 1].clone();
            let changed = last.clone();
            db.mutate(move |m| {
                if let Some(e) = m.get_mut(&changed) {
                    e.version = Some("2.0".into());
                }
                Ok(())
            })
            .await
            .unwrap();
            let reread = FileDb::open(&path).unwrap();
            let got = reread
                .peek()
                .await
                .get(&last)
                .and_then(|e| e.version.clone());
            assert_eq!(got.as_deref(), Some("2.0"), "{n} entries");
        }
    }

    #[tokio::test]
    async fn mutations_are_durable_and_numbered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let db = FileDb::open(&path).unwrap();
        let id: PackageId = "lnd".parse().unwrap();
        let m = db
            .mutate({
                let id = id.clone();
                move |d| {
                    d.insert(id, entry(StateInfo::Installed));
                    Ok(7)
                }
            })
            .await
            .unwrap();
        assert_eq!(
            m,
            Mutated {
                result: 7,
                revision: 1
            }
        );
        let snap = db.peek().await;
        // A failed closure changes nothing.
        let e = db
            .mutate(|d| {
                d.clear();
                Err::<(), _>(Error::new(eyre!("no"), ErrorKind::Unknown))
            })
            .await;
        assert!(e.is_err());
        // A no-op keeps the revision.
        assert_eq!(db.mutate(|_| Ok(())).await.unwrap().revision, 1);
        let reopened = FileDb::open(&path).unwrap();
        assert_eq!(reopened.peek().await, snap);
        assert_eq!(reopened.revision(), 1);
        assert!(!path.with_extension("tmp").exists());
    }

    #[test]
    fn state_serializes_like_upstream() {
        let e = entry(StateInfo::Updating {
            installing_info: InstallingInfo {
                new_version: "2.0".into(),
                phase: Phase::Uninit,
                had_volume: true,
                backup_taken: true,
            },
        });
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["stateInfo"]["state"], "updating");
        assert_eq!(v["stateInfo"]["installingInfo"]["phase"], "uninit");
        assert_eq!(v["stateInfo"]["installingInfo"]["backupTaken"], true);
        let r = serde_json::to_value(entry(StateInfo::Removing { soft: true })).unwrap();
        assert_eq!(
            r["stateInfo"],
            serde_json::json!({"state": "removing", "soft": true})
        );
    }

    #[test]
    fn a_torn_tmp_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        std::fs::write(path.with_extension("tmp"), b"{\"revis").unwrap();
        let db = FileDb::open(&path).unwrap();
        assert_eq!(db.revision(), 0);
    }
}
