//! Start-core's volume module on btrfs subvolumes: what start-core calls.
//!
//! [`volume`] is the drop-in for upstream's `src/volume.rs` (the same names
//! and call shapes, on [`::volume::VolumeStore`] and
//! [`::volume_migrate::Migrator`]), wired in by the lines
//! `docs/upstream.md` quotes. The order of install finalization (stop,
//! snapshot, install, then drop or restore) is not a second start-core
//! kept here: it is six marked edits to start-core's own
//! `ServiceMap::install`, `Service::load` and `Service::install`, which
//! the fixture
//! (`fixtures/upstream-call-sites`) builds and runs beside upstream's
//! unedited call sites, and which the tests kill at every step.
//!
//! Every filesystem step goes through [`::volume::VolumeStore`], each of
//! whose operations is atomic under crashes; this crate holds no state of
//! its own, so a crash in the middle of any call leaves what the store's
//! recovery finishes or undoes at the package's next operation or boot.

mod blocking;
pub mod volume;

pub use ::volume::failpoint::FAILPOINT_ENV;
