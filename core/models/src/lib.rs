//! Shared vocabulary of the workspace: package and volume ids, and the error
//! type every crate returns.
//!
//! Upstream start-core kept these in a separate `models` crate until late 2025;
//! names, numeric error codes and the `ResultExt` helpers match it so that code
//! written against this crate drops into start-core with a `use` change.

mod error;
mod id;

pub use error::{Error, ErrorKind, OptionExt, ResultExt};
pub use id::{InvalidId, PackageId, VolumeId};
