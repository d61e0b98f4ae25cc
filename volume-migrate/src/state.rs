//! What one package's names under the volumes root hold: the conversion's
//! state on disk, as the crate docs name it, and the one move that finishes
//! an exchange ([`settle_exchanged`]).
//!
//! Everything here is read from names and types alone, so that a run after
//! a crash at any point tells how far the last one got; the only write,
//! renaming the old directory aside, is idempotent.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::AsFd;

use models::{Error, ErrorKind, PackageId, ResultExt};
use volume::copy;
use volume::failpoint::failpoint;
use volume::layout::Names;
use volume::sys;

use crate::errors::step;

/// What `<root>/<name>` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Absent,
    Dir,
    Subvolume,
    Other,
}

impl Kind {
    /// What `<root>/<name>` is, now.
    pub fn of(root: &volume::Root, name: &OsStr) -> io::Result<Kind> {
        match sys::stat_at(root.fd(), name)? {
            None => Ok(Kind::Absent),
            Some(st) if st.is_dir() => {
                let fd = sys::open_dir_at(root.fd(), name)?;
                Ok(if sys::is_subvolume(fd.as_fd())? {
                    Kind::Subvolume
                } else {
                    Kind::Dir
                })
            }
            Some(_) => Ok(Kind::Other),
        }
    }
}

/// What one package's names hold: the conversion's state on disk.
#[derive(Debug, Clone, Copy)]
pub(crate) struct State {
    /// `<pkg>`.
    pub live: Kind,
    /// `<pkg>.migrate`: a partial clone, or the old directory after the
    /// exchange.
    pub tmp: Kind,
    /// `<pkg>.migrate-parent`: a cut in progress, or the old directory
    /// after the exchange.
    pub parent: Kind,
    /// `<pkg>.migrate-old`.
    pub old: Kind,
    /// `<pkg>.migrate-rest`, the record of a deferred cut.
    pub rest: bool,
}

impl State {
    /// Reads `pkg`'s names under `root`.
    pub fn read(root: &volume::Root, pkg: &PackageId, names: &Names) -> Result<State, Error> {
        let kind = |name: &OsString, what: &'static str| {
            Kind::of(root, name).with_ctx(|_| (ErrorKind::Filesystem, pkg.context(what)))
        };
        Ok(State {
            live: kind(&names.live, "inspecting the volume")?,
            tmp: kind(&names.migrate, "inspecting the partial copy")?,
            parent: kind(&names.migrate_parent, "inspecting the parent snapshot")?,
            old: kind(&names.migrate_old, "inspecting the old directory")?,
            rest: sys::stat_at(root.fd(), &names.migrate_rest)
                .with_ctx(|_| {
                    (
                        ErrorKind::Filesystem,
                        pkg.context("inspecting the cut's record"),
                    )
                })?
                .is_some(),
        })
    }

    /// Whether old trees wait for [`crate::Migrator::remove_old`].
    pub fn old_pending(&self) -> bool {
        self.old != Kind::Absent
            || self.rest
            || ((self.tmp == Kind::Dir || self.parent == Kind::Dir) && self.live != Kind::Dir)
    }
}

/// After the exchange, `<pkg>.migrate` (or `<pkg>.migrate-parent`) is
/// the old plain directory: move it to `<pkg>.migrate-old`. A subvolume
/// under either name beside no plain `<pkg>` is a partial copy whose
/// source is gone: removed. Returns whether an old directory was moved.
/// A crash part-way leaves a state this same call finishes.
pub(crate) fn settle_exchanged(
    root: &volume::Root,
    pkg: &PackageId,
    names: &Names,
) -> Result<bool, Error> {
    let live = Kind::of(root, &names.live).with_ctx(step(pkg, "inspecting the volume"))?;
    if live == Kind::Dir {
        return Ok(false);
    }
    let mut moved = false;
    for tmp in [&names.migrate, &names.migrate_parent] {
        match Kind::of(root, tmp).with_ctx(step(pkg, "inspecting the partial copy"))? {
            Kind::Dir => {
                if Kind::of(root, &names.migrate_old)
                    .with_ctx(step(pkg, "inspecting the old directory"))?
                    != Kind::Absent
                {
                    copy::remove_tree_at(root.fd(), &names.migrate_old, &mut |_| Ok(()))
                        .with_ctx(step(pkg, "removing an older old directory"))?;
                }
                // Not made durable: a plain `<pkg>.migrate` beside a
                // converted `<pkg>` is a state this call settles the same
                // way at the next conversion or cleanup, and btrfs commits
                // the rename before any removal in the old tree after it.
                // An fsync here is a whole commit (its transaction holds a
                // subvolume's exchange, which btrfs's log cannot record):
                // one more per package, before its service may start.
                sys::rename_noreplace(root.fd(), tmp, &names.migrate_old)
                    .with_ctx(step(pkg, "moving the old directory aside"))?;
                failpoint("migrate.old-renamed").with_ctx(step(pkg, "failpoint"))?;
                moved = true;
            }
            Kind::Subvolume => {
                // A partial copy whose source is gone or was replaced by
                // a subvolume (a volume operation since): worthless.
                copy::remove_tree_at(root.fd(), tmp, &mut |_| Ok(()))
                    .and_then(|()| sys::fsync(root.fd()))
                    .with_ctx(step(pkg, "removing a stale partial copy"))?;
            }
            Kind::Absent | Kind::Other => {}
        }
    }
    Ok(moved)
}
