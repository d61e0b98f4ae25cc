//! The one way this workspace runs filesystem work off the async runtime.

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind};

/// Runs `f` on tokio's blocking pool and returns what it returned. A panic
/// in `f` becomes an `Unknown` error naming it, not a panic of the caller.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(eyre!("volume task: {e}"), ErrorKind::Unknown))?
}
