//! The update-finalization workload: a package whose service is stopped is
//! updated through `startos_core::Finalizer`, with a state file on the same
//! disk, by services that do nothing but the new version's data migration.
//!
//! The migration is deterministic (fixed contents and times), so the tree
//! it leaves can be compared with the one a later retry leaves.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use models::{Error, ErrorKind, PackageId, ResultExt};
use startos_core::{Cancel, FileDb, Finalizer, InstallRequest, Services};

/// The version installed before the update.
pub const OLD_VERSION: &str = "1.0.0";
/// The version the update installs.
pub const NEW_VERSION: &str = "2.0.0";

/// The archive name of `version` (only recorded in the state).
pub fn s9pk(pkg: &PackageId, version: &str) -> String {
    format!("/media/startos/data/package-data/archive/{pkg}-{version}.s9pk")
}

/// Sets `path`'s times without following a symlink: access `sec`, modify
/// `sec` and `nsec` (a nonzero `nsec` shows a copy keeps nanoseconds).
pub fn set_mtime(path: &Path, sec: i64, nsec: i64) -> io::Result<()> {
    let t = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: sec,
            tv_nsec: 0,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: sec,
            tv_nsec: nsec as _,
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &t,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(io::Error::from)
}

/// The new version's data migration of the volume at `volume`: a new file,
/// a rewritten one, a removed one, every time it touches set to a fixed
/// value, each file fsynced as a database would.
pub fn migrate(volume: &Path) -> io::Result<()> {
    let main = volume.join("data/main");
    let write = |p: PathBuf, data: &[u8]| -> io::Result<()> {
        let f = fs::File::create(&p)?;
        io::Write::write_all(&mut &f, data)?;
        f.sync_all()?;
        set_mtime(&p, 1_750_000_000, 500)
    };
    write(main.join("schema"), b"2\n")?;
    write(main.join("config.toml"), b"[server]\nport = 8443\n")?;
    match fs::remove_file(volume.join("data/other/notes")) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    for d in ["data/main", "data/other"] {
        set_mtime(&volume.join(d), 1_750_000_100, 500)?;
    }
    fs::File::open(&main)?.sync_all()?;
    fs::File::open(volume.join("data/other"))?.sync_all()
}

/// Services of packages that are already stopped: stop, uninit, install and
/// start do nothing; init from [`OLD_VERSION`] to [`NEW_VERSION`] runs
/// [`migrate`] on the volume under `volumes_root`.
pub struct StoppedServices {
    /// The volumes root.
    pub volumes_root: PathBuf,
}

impl Services for StoppedServices {
    async fn stop(&self, _: &PackageId) -> Result<(), Error> {
        Ok(())
    }

    async fn uninit(&self, _: &PackageId, _: &str, _: Option<&str>) -> Result<(), Error> {
        Ok(())
    }

    async fn install(&self, _: &PackageId, _: &str, _: &str) -> Result<(), Error> {
        Ok(())
    }

    async fn init(&self, pkg: &PackageId, version: &str, from: Option<&str>) -> Result<(), Error> {
        if version == NEW_VERSION && from == Some(OLD_VERSION) {
            let volume = self.volumes_root.join(pkg.as_str());
            migrate(&volume).with_ctx(|_| {
                (
                    ErrorKind::Filesystem,
                    pkg.context("migrating the volume to the new version"),
                )
            })?;
        }
        Ok(())
    }

    async fn start(&self, _: &PackageId, _: &str) -> Result<(), Error> {
        Ok(())
    }
}

/// Updates `pkg` under `volumes_root` to [`NEW_VERSION`], its state in the
/// file `db`, and waits for the backup drop that follows the notification.
/// Returns whether a backup was dropped.
pub async fn update(volumes_root: &Path, db: &Path, pkg: &PackageId) -> Result<bool, Error> {
    let db = FileDb::open(db)?;
    let services = Arc::new(StoppedServices {
        volumes_root: volumes_root.to_owned(),
    });
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let fin = Finalizer::new(db, services, Arc::new(tx), volumes_root);
    let req = InstallRequest {
        package: pkg.clone(),
        version: NEW_VERSION.to_owned(),
        s9pk: s9pk(pkg, NEW_VERSION),
    };
    let done = fin.install(&req, &Cancel::new()).await?;
    done.backup_drop.await.map_err(|e| {
        Error::new(
            color_eyre::eyre::eyre!("the backup drop task: {e}"),
            ErrorKind::Unknown,
        )
    })?
}
