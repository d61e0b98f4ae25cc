//! Where there is no btrfs (start-cli builds start-core for macOS): plain
//! directories, no backups, nothing to convert, as upstream's own code
//! there.

use std::collections::BTreeSet;
use std::path::Path;

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind, PackageId};

fn io(what: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::new(eyre!("{}: {e}", what.display()), ErrorKind::Filesystem)
}

pub(super) fn exists(_: &Path, _: &PackageId) -> Result<bool, Error> {
    Ok(false)
}

pub(super) fn begin(_: &Path, _: &PackageId) -> Result<(), Error> {
    Ok(())
}

pub(super) fn is_fresh(_: &Path, _: &PackageId) -> Result<bool, Error> {
    Ok(false)
}

pub(super) fn snapshot(_: &Path, _: &PackageId) -> Result<volume::SnapshotOutcome, Error> {
    Ok(volume::SnapshotOutcome::Skipped {
        reason: "btrfs subvolumes need Linux".to_owned(),
    })
}

pub(super) fn restore(_: &Path, _: &PackageId) -> Result<volume::RestoreOutcome, Error> {
    Ok(volume::RestoreOutcome {
        restored: false,
        held: None,
        unfinished: None,
    })
}

pub(super) fn resolve_pending(_: &Path, _: &PackageId) -> Result<(), Error> {
    Ok(())
}

pub(super) fn remove(_: &Path, _: &PackageId) -> Result<(), Error> {
    Ok(())
}

pub(super) fn sync(_: &Path, _: &PackageId) -> Result<(), Error> {
    Ok(())
}

pub(super) fn ensure(root: &Path, pkg: &PackageId) -> Result<(), Error> {
    let path = root.join(pkg.as_str());
    std::fs::create_dir_all(&path).map_err(io(&path))
}

pub(super) fn delete_tree(_: &Path, path: &Path) -> Result<(), Error> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(path)(e)),
        _ => Ok(()),
    }
}

pub(super) fn convert(_: &Path, _: &PackageId) -> Result<(), Error> {
    Ok(())
}

pub(super) fn cleanup(_: &Path) -> Result<Vec<PackageId>, Error> {
    Ok(Vec::new())
}

#[allow(clippy::type_complexity)]
pub(super) fn boot(
    _: &Path,
    installed: &BTreeSet<String>,
    _: &BTreeSet<String>,
    tx: &tokio::sync::mpsc::UnboundedSender<super::BootEvent>,
) -> Result<(Vec<volume::Recovery>, Vec<(PackageId, Error)>, bool), Error> {
    let _ = tx.send(super::BootEvent::Total(0));
    let _ = tx.send(super::BootEvent::Done(0));
    for pkg in installed
        .iter()
        .filter_map(|id| id.parse::<PackageId>().ok())
    {
        let _ = tx.send(super::BootEvent::Ready(pkg));
    }
    Ok((Vec::new(), Vec::new(), false))
}
