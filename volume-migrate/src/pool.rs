//! Converting the packages of a schedule several at a time
//! ([`Migrator::convert_each`]).
//!
//! A conversion by snapshot spends most of its time waiting for
//! transaction commits: the snapshot's own, the one after its exchange,
//! and for a share's member the one before its check (the `split`
//! module), 10-40 ms each on a small VM, with little work in between. A
//! commit is the filesystem's, not the package's: it carries
//! every change made before it, whoever made it, and a caller that asks
//! while one is running waits for that one and at most the next. One at a
//! time, 150 packages wait for some 450 commits in a row; [`WORKERS`] at
//! once share each round of them.
//!
//! Nothing else changes. Each package is converted by
//! [`Migrator::convert_planned`] under its own lock, so what a crash
//! leaves is each package's own state (the crate docs), for several
//! packages at once; packages start in the schedule's order (a share's
//! members together) and are reported as each is done. With shares, the
//! dominant package goes first and alone, ready before any share's cut
//! takes the cores and fills the commits it waits on (so too where light
//! packages are cloned). Two things the order decided one at a time are
//! decided here
//! instead: a share is made once, by whichever member comes to it first
//! while the others wait on its lock ([`crate::split::source`]), and it is
//! deleted once every member of it has finished, not when the last one in
//! the schedule's order has (with several at once, it may finish first).
//!
//! Only conversions by snapshot run at once, each waiting mostly on
//! commits, and the clones of light packages in their place (the `split`
//! module's `light_clones`: a few dozen entries each, one commit). The
//! other clones after them in the schedule run one at a time, in order: a
//! clone reads and writes O(its extents), and several at once would only
//! interleave their I/O and add up their memory.

use std::any::Any;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, PoisonError};

use models::{Error, ErrorKind};

use crate::migrate::Migrator;
use crate::options::MigrateOptions;
use crate::report::{PackageReport, Planned};
use crate::{Progress, ProgressSink, split};

/// How many packages are converted (or weighed) at once: each waits
/// mostly on commits, cold reads and the mount tables' reads (one read of
/// every namespace's table serves the conversions that asked before it
/// began), so many more threads than cores. Measured at 150 packages (the
/// boxes bench, the dominant package alone first, through the call sites,
/// each service's container a namespace of its own), 2026-12-07: the last
/// light package's load after 0.72-0.85 s with 24 (five runs), 0.75-0.77 s
/// with 36, 0.94-1.09 s with 12; the heavy ones' within the same 1.1-1.4 s
/// each way. An older build: 3.65-3.74 s with 12 against 4.69-6.16 s with
/// 6. The cost: more commit starts at once, and this kernel now and then
/// leaves one waiting for its wake-up, asked for again 25 ms late
/// ([`volume::sys::COMMIT_START_NUDGE`]): 1-5 asks a boxes run with 24,
/// 0-4 with 12, none forced.
pub const WORKERS: usize = 24;

/// Descriptors one conversion (or weighing) at once is allowed for: its
/// volume's and its target's, each walk's [`volume::walk::FD_BUDGET`], a
/// lock's, a commit's. A hostile review's probe (150 packages, each light
/// one ten directories deep) saw 246-396 open at the peak for 24
/// conversions with one copy helper each, 363-505 with three (a machine
/// of more cores): 10-21 a conversion.
pub const DESCRIPTORS_EACH: usize = 24;

/// How many of `most` conversions (or weighings) to run at once so that
/// they fit in the descriptors this process may still open: its soft
/// `RLIMIT_NOFILE` less those open now, [`DESCRIPTORS_EACH`] each; at
/// least one. A service manager's default soft limit is 1024, and the
/// process converting (start-core) holds descriptors of its own; a
/// conversion that runs out fails its package ("Too many open files").
/// Where the count cannot be read, `most`, and a warning says so.
pub(crate) fn workers_within(most: usize) -> usize {
    let (soft, _) = volume::sys::nofile_limit();
    let open = match volume::sys::open_descriptors() {
        Ok(n) => n as u64,
        Err(e) => {
            tracing::warn!(error = %e, "counting this process's open descriptors: {most} conversions at once, whatever the limit");
            return most;
        }
    };
    let fit = soft.saturating_sub(open) / DESCRIPTORS_EACH as u64;
    let n = most.min(usize::try_from(fit).unwrap_or(usize::MAX)).max(1);
    if n < most {
        tracing::info!(
            "{n} conversions at once, not {most}: {open} of {soft} descriptors open (RLIMIT_NOFILE)"
        );
    }
    n
}

/// One package's outcome, as [`Migrator::convert_planned`] returns it.
pub type Converted = Result<PackageReport, Error>;

impl Migrator {
    /// Converts every package of `planned` (a schedule, in its order, as
    /// [`Migrator::schedule`] made it): those to be converted by a
    /// snapshot up to [`WORKERS`] at once, started in order, then the
    /// others one at a time, in order (the module docs). `sink` gets every
    /// package's progress, on the caller's thread; `on_done` each
    /// package's outcome as soon as it is done, from the thread that
    /// converted it. Returns the outcomes in `planned`'s order. A failing
    /// package does not stop the others.
    ///
    /// A crash leaves each package started and not done in its own crash
    /// state, as a crash in [`Migrator::convert_planned`] does, and the
    /// shares made so far, which the next schedule or the cleanup deletes.
    pub fn convert_each(
        &self,
        planned: &[Planned],
        opts: &MigrateOptions,
        sink: &mut dyn ProgressSink,
        on_done: &(dyn Fn(&Planned, &Converted) + Sync),
    ) -> Vec<Converted> {
        let snapshots = planned.iter().take_while(|p| p.scheduled()).count();
        let (first, then) = planned.split_at(snapshots);
        // Without shares (a node's few packages), one at a time: measured
        // at 8, the services were ready sooner so (the boxes bench). With
        // them, the dominant package (the schedule's first, a snapshot of
        // the parent itself) goes alone: the share cuts the others start
        // with would take the cores and fill the commits it waits on.
        // Light packages cloned in their place wait on commits mostly:
        // at once too, each commit serving several.
        let together = first.iter().any(|p| !p.shares.is_empty() || p.is_light());
        let workers = if together { workers_within(WORKERS) } else { 1 };
        let alone = usize::from(
            together
                && first
                    .first()
                    .is_some_and(|p| p.shares.is_empty() && !p.is_light()),
        );
        let (dominant, first) = first.split_at(alone);
        // A panic fails its package only: the others go on (and in the
        // pool, its shares are still counted done).
        let one = |p: &Planned, sink: &mut dyn ProgressSink| {
            let r =
                std::panic::catch_unwind(AssertUnwindSafe(|| self.convert_planned(p, opts, sink)))
                    .unwrap_or_else(|panic| Err(panicked(p, panic.as_ref())));
            on_done(p, &r);
            r
        };
        let mut out = Vec::with_capacity(planned.len());
        for p in dominant {
            out.push(one(p, sink));
        }
        let members = Members::of(first);
        out.extend(at_once(
            first,
            workers,
            sink,
            &|p: &Planned, sink: &mut dyn ProgressSink| {
                // Deleted once every member is done, not by the last in order
                // (the module docs).
                let own = Planned {
                    drop_shares: Vec::new(),
                    ..p.clone()
                };
                let r = one(&own, sink);
                members.done(self, p);
                r
            },
        ));
        for p in then {
            out.push(one(p, sink));
        }
        out
    }
}

/// Calls `work` on each of `items`, up to `workers` at once on threads of
/// their own, taken in order ([`volume::at_once::at_once`]); what they
/// report to their sink reaches `sink` on the caller's thread. Returns the
/// results in `items`' order. One worker, or where no thread can be
/// started: the caller's thread does it all.
pub(crate) fn at_once<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    sink: &mut dyn ProgressSink,
    work: &(dyn Fn(&T, &mut dyn ProgressSink) -> R + Sync),
) -> Vec<R> {
    volume::at_once::at_once(
        items,
        workers,
        "volume-migrate",
        &|item: &T, report: &mut dyn FnMut(Progress)| {
            work(item, &mut |p: &Progress| report(p.clone()))
        },
        &mut |p: Progress| sink.progress(&p),
    )
}

/// The error of a conversion of `p` that panicked with `panic`; its lock
/// was released on the way out, and the next run finds its state as a
/// crash there leaves it.
fn panicked(p: &Planned, panic: &(dyn Any + Send)) -> Error {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    Error::for_package(
        &p.package,
        ErrorKind::Unknown,
        format!("converting the volume panicked: {what}"),
    )
}

/// How many members of each share are not done yet.
struct Members(Mutex<HashMap<String, usize>>);

impl Members {
    fn of(planned: &[Planned]) -> Members {
        let mut left = HashMap::new();
        for s in planned.iter().flat_map(|p| &p.shares) {
            *left.entry(s.id.clone()).or_insert(0) += 1;
        }
        Members(Mutex::new(left))
    }

    /// `p` is done, whatever became of it: the shares it was the last
    /// member of to finish serve no one now, and are deleted.
    fn done(&self, migrator: &Migrator, p: &Planned) {
        let unused: Vec<String> = {
            let mut left = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            p.shares
                .iter()
                .filter(|s| {
                    left.get_mut(&s.id).is_some_and(|n| {
                        *n -= 1;
                        *n == 0
                    })
                })
                .map(|s| s.id.clone())
                .collect()
        };
        if let Err(e) = split::drop_shares(migrator.root_fd(), &unused) {
            tracing::warn!(package = %p.package, error = %e, "deleting the shared cuts it was the last member of");
        }
    }
}
