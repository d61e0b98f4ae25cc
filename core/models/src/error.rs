use std::fmt::{self, Debug, Display};

use color_eyre::eyre::{self, eyre};

use crate::{InvalidId, PackageId};

/// What went wrong, as a stable number shared with upstream start-core.
///
/// The discriminants are upstream's codes (they travel over RPC); only the
/// kinds this workspace can produce are listed, and new ones must take
/// upstream's number, never invent one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorKind {
    /// Anything not better described below.
    Unknown = 1,
    /// I/O on the data filesystem failed.
    Filesystem = 2,
    /// The thing asked for does not exist.
    NotFound = 6,
    /// Encoding state or a report failed.
    Serialization = 11,
    /// Decoding state failed.
    Deserialization = 12,
    /// The state database could not be read or written.
    Database = 29,
    /// A package or volume id does not match the id pattern.
    InvalidId = 30,
    /// The request cannot be honoured as asked (bad path, busy volume, ...).
    InvalidRequest = 38,
    /// Converting data from one layout to another failed.
    MigrationFailed = 39,
    /// A btrfs or block-level operation failed.
    DiskManagement = 48,
    /// What is on disk contradicts itself or the recorded state.
    Incoherent = 55,
    /// A wait ran out of time.
    Timeout = 71,
    /// The operation was cancelled before it finished.
    Cancelled = 73,
    /// Installing a package failed.
    InstallFailed = 76,
    /// Updating a package failed.
    UpdateFailed = 77,
}

impl ErrorKind {
    /// Upstream's human title for the kind.
    pub fn as_str(&self) -> &'static str {
        use ErrorKind::*;
        match self {
            Unknown => "Unknown Error",
            Filesystem => "Filesystem I/O Error",
            NotFound => "Not Found",
            Serialization => "Serialization Error",
            Deserialization => "Deserialization Error",
            Database => "Database Error",
            InvalidId => "Invalid ID",
            InvalidRequest => "Invalid Request",
            MigrationFailed => "Migration Failed",
            DiskManagement => "Disk Management Error",
            Incoherent => "Incoherent",
            Timeout => "Timeout Error",
            Cancelled => "Cancelled",
            InstallFailed => "Install Failed",
            UpdateFailed => "Update Failed",
        }
    }

    /// The numeric code sent over RPC.
    pub fn code(&self) -> i32 {
        *self as i32
    }
}

impl Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error every crate of the workspace returns: a kind for callers to act
/// on and a color-eyre report whose context chain says which package and path.
///
/// `Display` prints `<kind>: <context>: <cause>` on one line, which is what the
/// command-line tools show a user.
pub struct Error {
    /// The cause, with any context added on the way up.
    pub source: eyre::Report,
    /// How callers should treat it.
    pub kind: ErrorKind,
}

impl Error {
    /// Wraps any error or report with a kind.
    pub fn new<E: Into<eyre::Report>>(source: E, kind: ErrorKind) -> Self {
        Error {
            source: source.into(),
            kind,
        }
    }

    /// An error about one package, worded as [`PackageId::context`].
    pub fn for_package(pkg: &PackageId, kind: ErrorKind, what: impl Display) -> Self {
        Error::new(eyre!("{}", pkg.context(what)), kind)
    }

    /// The underlying OS error number, if the root cause is an I/O error.
    ///
    /// Lets callers tell e.g. `EXDEV` or `ENOSPC` apart without string matching.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source.chain().find_map(|e| {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                io.raw_os_error()
            } else {
                e.downcast_ref::<Error>().and_then(Error::raw_os_error)
            }
        })
    }

    /// `report` as an [`Error`]: the very one if it wraps one (so its kind
    /// and context survive a trip through `eyre`), else a new one of `kind`.
    fn from_report(report: eyre::Report, kind: ErrorKind) -> Self {
        match report.downcast::<Error>() {
            Ok(e) => e,
            Err(report) => Error::new(report, kind),
        }
    }
}

/// So that code with an error type of its own (upstream's `crate::Error`)
/// needs one `From` impl, and `?`, `eyre` and `.log_err()` take ours as
/// they take any error. `source` is `None`: `Display` already prints the
/// whole chain on one line, which a reporter walking the sources would print
/// twice.
impl std::error::Error for Error {}

impl Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:#}", self.kind.as_str(), self.source)
    }
}

impl Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {:?}", self.kind.as_str(), self.source)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::new(e, ErrorKind::Filesystem)
    }
}

impl From<InvalidId> for Error {
    fn from(e: InvalidId) -> Self {
        Error::new(e, ErrorKind::InvalidId)
    }
}

impl From<std::convert::Infallible> for Error {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}

/// The one line at `error` level, the full chain at `debug`.
fn log_error(e: &(impl Display + Debug)) {
    tracing::error!("{e}");
    tracing::debug!("{e:?}");
}

/// Upstream's helpers for turning any error into an [`Error`] on the way up.
pub trait ResultExt<T, E>
where
    Self: Sized,
{
    /// Gives the error a kind (replacing it if it already is an [`Error`]).
    fn with_kind(self, kind: ErrorKind) -> Result<T, Error>;
    /// Gives the error a kind and a line of context, computed only on failure.
    fn with_ctx<F: FnOnce(&E) -> (ErrorKind, D), D: Display + Send + Sync + 'static>(
        self,
        f: F,
    ) -> Result<T, Error>;
    /// Logs the error at `error` level and discards it.
    fn log_err(self) -> Option<T>;
}

impl<T, E> ResultExt<T, E> for Result<T, E>
where
    E: Into<eyre::Report> + Debug + Display,
{
    fn with_kind(self, kind: ErrorKind) -> Result<T, Error> {
        self.map_err(|e| Error {
            kind,
            ..Error::from_report(e.into(), kind)
        })
    }

    fn with_ctx<F: FnOnce(&E) -> (ErrorKind, D), D: Display + Send + Sync + 'static>(
        self,
        f: F,
    ) -> Result<T, Error> {
        self.map_err(|e| {
            let (kind, ctx) = f(&e);
            let inner = Error::from_report(e.into(), kind);
            Error {
                source: inner.source.wrap_err(ctx),
                kind,
            }
        })
    }

    fn log_err(self) -> Option<T> {
        self.map_err(|e| log_error(&e)).ok()
    }
}

/// Turns a missing value into an [`Error`] of the given kind.
pub trait OptionExt<T> {
    /// `None` becomes an error with `kind` and the message `msg`.
    fn or_kind(self, kind: ErrorKind, msg: impl Display) -> Result<T, Error>;
}

impl<T> OptionExt<T> for Option<T> {
    fn or_kind(self, kind: ErrorKind, msg: impl Display) -> Result<T, Error> {
        self.ok_or_else(|| Error::new(eyre!("{msg}"), kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_upstream() {
        assert_eq!(ErrorKind::Filesystem.code(), 2);
        assert_eq!(ErrorKind::NotFound.code(), 6);
        assert_eq!(ErrorKind::Database.code(), 29);
        assert_eq!(ErrorKind::InvalidId.code(), 30);
        assert_eq!(ErrorKind::InvalidRequest.code(), 38);
        assert_eq!(ErrorKind::MigrationFailed.code(), 39);
        assert_eq!(ErrorKind::DiskManagement.code(), 48);
        assert_eq!(ErrorKind::Incoherent.code(), 55);
        assert_eq!(ErrorKind::Cancelled.code(), 73);
        assert_eq!(ErrorKind::InstallFailed.code(), 76);
        assert_eq!(ErrorKind::UpdateFailed.code(), 77);
    }

    #[test]
    fn context_is_on_one_line_and_keeps_the_os_error() {
        let io = std::io::Error::from_raw_os_error(18);
        let r: Result<(), _> = Err(io);
        let e = r
            .with_ctx(|_| (ErrorKind::DiskManagement, "renaming lnd"))
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::DiskManagement);
        assert_eq!(e.raw_os_error(), Some(18));
        let line = e.to_string();
        assert!(line.starts_with("Disk Management Error: renaming lnd: "));
        assert!(!line.contains('\n'));
    }

    #[test]
    fn is_a_std_error_that_survives_a_trip_through_eyre() {
        fn assert_std<E: std::error::Error + Send + Sync + 'static>(_: &E) {}
        let io = std::io::Error::from_raw_os_error(28);
        let e = Err::<(), _>(io)
            .with_ctx(|_| (ErrorKind::DiskManagement, "package lnd: snapshot"))
            .unwrap_err();
        assert_std(&e);
        let report = eyre::Report::from(e);
        let back = Err::<(), _>(report)
            .with_ctx(|_| (ErrorKind::Filesystem, "outer"))
            .unwrap_err();
        assert_eq!(back.kind, ErrorKind::Filesystem);
        assert_eq!(back.raw_os_error(), Some(28));
        assert!(
            back.to_string()
                .starts_with("Filesystem I/O Error: outer: package lnd: snapshot: "),
            "{back}"
        );
    }

    #[test]
    fn with_kind_replaces_the_kind_of_an_error() {
        let r: Result<(), Error> = Err(Error::new(eyre!("x"), ErrorKind::Unknown));
        assert_eq!(
            r.with_kind(ErrorKind::NotFound).unwrap_err().kind,
            ErrorKind::NotFound
        );
    }
}
