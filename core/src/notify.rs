//! Notifications to the user, and cancellation of an install.

use std::sync::Arc;
use std::time::Instant;

use models::{ErrorKind, PackageId};

use crate::db::Phase;

/// What happened to a package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `version` is installed and running.
    Installed {
        /// The new version.
        version: String,
    },
    /// The install or update failed (or was cancelled) in `phase` and was
    /// rolled back: the volume is as the old version left it, unless
    /// `message` says there was no backup to restore (none could be taken,
    /// or the one taken was gone when the rollback ran), which it always
    /// does when so.
    Failed {
        /// The phase that failed.
        phase: Phase,
        /// `InstallFailed`, `UpdateFailed`, `Cancelled`, or `Incoherent` if
        /// the rollback itself failed (then a boot's reconcile finishes it).
        kind: ErrorKind,
        /// One line for the user.
        message: String,
        /// The version running again, if there was one.
        rolled_back_to: Option<String>,
    },
    /// The package was uninstalled; with `soft`, its volume was kept.
    Removed {
        /// Whether the volume was kept.
        soft: bool,
    },
}

/// One notification, timestamped when it was sent.
#[derive(Debug, Clone)]
pub struct Notification {
    /// The package.
    pub package: PackageId,
    /// When it was sent.
    pub at: Instant,
    /// What happened.
    pub event: Event,
}

/// Where notifications go. `notify` must not block: it is called on the
/// install's path.
pub trait Notifier: Send + Sync + 'static {
    /// Delivers one notification.
    fn notify(&self, n: Notification);
}

impl Notifier for tokio::sync::mpsc::UnboundedSender<Notification> {
    fn notify(&self, n: Notification) {
        // A closed receiver means nobody listens any more: nothing to do.
        let _ = self.send(n);
    }
}

/// Cancels an install: the finalizer checks it before each phase and races
/// it against each service phase, then rolls back. Clones share the flag.
#[derive(Clone, Debug)]
pub struct Cancel(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Cancel {
    fn default() -> Self {
        Cancel(Arc::new(tokio::sync::watch::channel(false).0))
    }
}

impl Cancel {
    /// A token nobody has cancelled yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels; idempotent.
    pub fn cancel(&self) {
        self.0.send_replace(true);
    }

    /// Whether [`Cancel::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once cancelled.
    pub async fn cancelled(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in self, so wait_for cannot see a closed channel.
        let _ = rx.wait_for(|c| *c).await;
    }
}
