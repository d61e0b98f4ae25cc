//! What finalization asks of a service ([`Services`]). start-core's own
//! services implement it; the integration crate's process-based services
//! (its test double) do too.

use std::future::Future;

use models::{Error, PackageId};

/// The service operations finalization and uninstall drive, in the order
/// they use them. Each must be idempotent where noted, since a rollback
/// calls them on whatever state a failure left.
pub trait Services: Send + Sync + 'static {
    /// Stops the package's service and returns only once it has stopped
    /// writing to its volume and nothing of the volume is mounted any more
    /// (so a snapshot taken next is exactly what it last wrote, and a
    /// rollback may swap the volume). Idempotent: Ok if nothing runs.
    fn stop(&self, pkg: &PackageId) -> impl Future<Output = Result<(), Error>> + Send;
    /// The installed `version`'s uninit towards `target` (`None` on
    /// uninstall). May rewrite the volume (down-migrations).
    fn uninit(
        &self,
        pkg: &PackageId,
        version: &str,
        target: Option<&str>,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Installs `version` from `s9pk`, creating the volume if it has none.
    fn install(
        &self,
        pkg: &PackageId,
        version: &str,
        s9pk: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// `version`'s init, coming from `from` (`None` for a fresh install).
    /// May rewrite the volume (migrations).
    fn init(
        &self,
        pkg: &PackageId,
        version: &str,
        from: Option<&str>,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Starts `version`. On error the service may have been started anyway:
    /// callers stop it.
    fn start(
        &self,
        pkg: &PackageId,
        version: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// The package whose running service includes the process `pid`, if
    /// any. A rollback asks it of the processes that hold a mount of the
    /// volume it must swap in another mount namespace (a dependent
    /// package's container holding a dependency mount): it stops those
    /// services first and starts them again after. The default knows no
    /// process, so such a mount makes the rollback fail, as the volume
    /// store refuses to swap a volume from under a mount.
    fn service_of(&self, pid: u32) -> Option<PackageId> {
        let _ = pid;
        None
    }
}
