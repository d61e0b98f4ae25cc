//! The one way this workspace runs filesystem work off the async runtime.

use color_eyre::eyre::eyre;
use models::{Error, ErrorKind};

/// Runs `f` off the async runtime, on a thread of its own with
/// [`volume::copy::WALK_STACK_BYTES`] of stack (started from tokio's
/// blocking pool, whose 2 MiB threads are too small for a walk of a tree
/// nested [`volume::copy::MAX_DEPTH`] levels deep), and returns what it
/// returned. A panic in `f` is the handle's, as with `spawn_blocking`.
pub(crate) fn spawn_walk<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> tokio::task::JoinHandle<Result<T, Error>> {
    tokio::task::spawn_blocking(move || {
        std::thread::Builder::new()
            .name("volume-walk".to_owned())
            .stack_size(volume::copy::WALK_STACK_BYTES)
            .spawn(f)
            .map_err(|e| {
                Error::new(
                    eyre!("starting a thread for volume work: {e}"),
                    ErrorKind::Unknown,
                )
            })?
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
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
