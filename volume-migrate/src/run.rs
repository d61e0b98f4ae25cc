//! A whole run ([`Migrator::run`]): every package in the order of the
//! schedule, each reported as soon as it is done so that its service can
//! start, then the old trees. Each package is converted, and its old trees
//! removed, under its own lock, so a crash between packages leaves the
//! finished ones converted and the next run resumes with the next.

use std::time::Instant;

use models::Error;

use crate::ProgressSink;
use crate::migrate::Migrator;
use crate::options::MigrateOptions;
use crate::report::{Outcome, PackageReport, ReportError};

impl Migrator {
    /// Converts every package of [`Migrator::packages`] in the order of
    /// [`Migrator::schedule`], calling `on_done` with each report as soon as
    /// that package is done (so its service can start), then, with
    /// `opts.remove_old`, removes the old trees. A failing package does not
    /// stop the others: its report says why. Fails only if the root cannot
    /// be read or the schedule cannot be made. The entries it passes over
    /// are not warned of here: the caller says them once
    /// ([`Migrator::packages`] or [`Migrator::skipped`]).
    pub fn run(
        &self,
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
        on_done: &mut dyn FnMut(&PackageReport),
    ) -> Result<Vec<PackageReport>, Error> {
        let mut reports = Vec::new();
        for planned in self.schedule_for(&self.listing()?.0, opts, false, !opts.dry_run)? {
            let started = Instant::now();
            let report = self
                .convert_planned(&planned, opts, sink)
                .unwrap_or_else(|e| {
                    PackageReport::failed(planned.package.clone(), started.elapsed(), &e)
                });
            on_done(&report);
            reports.push(report);
        }
        if !opts.dry_run
            && let Err(e) = crate::split::wipe(self.root_fd())
        {
            tracing::warn!(error = %e, "deleting the shared cuts left");
        }
        if opts.remove_old && !opts.dry_run {
            for r in &mut reports {
                if r.outcome == Outcome::Failed {
                    continue;
                }
                match self.remove_old(&r.package, sink) {
                    Ok(found) => r.old_removed |= found,
                    Err(e) => {
                        r.outcome = Outcome::Failed;
                        r.error = Some(ReportError::from(&e));
                    }
                }
            }
        }
        Ok(reports)
    }
}
