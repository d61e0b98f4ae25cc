//! The one way this workspace runs filesystem work off the async runtime.

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind};

/// Runs `f` off the async runtime, on tokio's blocking pool, and returns
/// what it returned. The volume crates' walks are iterative, with a
/// bounded number of descriptors at any depth, so the pool's threads
/// serve. A panic in `f` is the handle's, as with `spawn_blocking`.
pub(crate) fn spawn_walk<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> tokio::task::JoinHandle<Result<T, Error>> {
    tokio::task::spawn_blocking(f)
}

/// [`spawn_walk`], awaited. A panic in `f` becomes an `Unknown` error
/// naming it, not a panic of the caller.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    spawn_walk(f)
        .await
        .map_err(|e| Error::new(eyre!("volume task: {e}"), ErrorKind::Unknown))?
}
