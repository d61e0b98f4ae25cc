//! Install finalization and boot-time reconcile for package volumes.
//!
//! Policy only: every filesystem step goes through [`::volume::VolumeStore`]
//! (each of its operations is atomic under crashes), and this crate decides
//! when to take, restore and drop the install backup, recording in the state
//! database ([`Db`]) everything a boot after a crash needs to finish or undo
//! an operation.
//!
//! - [`Finalizer::install`]: stop the old service, snapshot its volume, uninit
//!   the old version and install, init and start the new one; on success mark
//!   it installed, notify, and only then drop the backup; on failure or
//!   cancel at any phase, stop the new service, restore the backup, bring the
//!   old version back and notify naming the phase.
//! - [`Finalizer::uninstall`]: soft (volume kept) or hard.
//! - [`reconcile`]: at boot, before services start, finish or undo whatever a
//!   crash left, never deleting a backup unless the live volume is known good.

mod blocking;
mod db;
#[cfg(target_os = "linux")]
mod finalize;
mod notify;
#[cfg(target_os = "linux")]
mod reconcile;
#[cfg(target_os = "linux")]
mod service;
pub mod volume;

pub use ::volume::failpoint::FAILPOINT_ENV;
pub use db::{
    Db, FileDb, InstallingInfo, Mutated, PackageDataEntry, PackageDataMap, Phase, StateInfo,
};
#[cfg(target_os = "linux")]
pub use finalize::{Finalized, Finalizer, InstallRequest, Timings, finalize_update};
pub use notify::{Cancel, Event, Notification, Notifier};
#[cfg(target_os = "linux")]
pub use reconcile::{ReconcileReport, reconcile};
#[cfg(target_os = "linux")]
pub use service::Services;
