//! Converting the packages of a schedule several at a time
//! ([`Migrator::convert_each`]).
//!
//! A conversion by snapshot spends most of its time waiting for
//! transaction commits: the snapshot's own, the one before its exchange
//! and the one after, and for a share's member the one before its check
//! (the `split` module), 10-40 ms each on a small VM, with little work in
//! between. A commit is the filesystem's, not the package's: it carries
//! every change made before it, whoever made it, and a caller that asks
//! while one is running waits for that one and at most the next. One at a
//! time, 150 packages wait for some 500 commits in a row; [`WORKERS`] at
//! once share each round of them.
//!
//! Nothing else changes. Each package is converted by
//! [`Migrator::convert_planned`] under its own lock, so what a crash
//! leaves is each package's own state (the crate docs), for several
//! packages at once; packages start in the schedule's order (the dominant
//! package first, a share's members together) and are reported as each is
//! done. Two things the order decided one at a time are decided here
//! instead: a share is made once, by whichever member comes to it first
//! while the others wait on its lock ([`crate::split::source`]), and it is
//! deleted once every member of it has finished, not when the last one in
//! the schedule's order has (with several at once, it may finish first).
//!
//! Only conversions by snapshot run at once, each waiting mostly on
//! commits. The clones after them in the schedule run one at a time, in
//! order: a clone reads and writes O(its extents), and several at once
//! would only interleave their I/O and add up their memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use models::Error;

use crate::decide::Decision;
use crate::migrate::Migrator;
use crate::options::MigrateOptions;
use crate::report::{PackageReport, Planned};
use crate::{Progress, split};

/// How many conversions by snapshot run at once: enough that every
/// commit carries several packages' steps (each waits on three or four),
/// few enough that the share cuts running beside them (CPU and metadata
/// I/O) do not crowd out the dominant package's steps on a two-core box.
pub const WORKERS: usize = 6;

/// One package's outcome, as [`Migrator::convert_planned`] returns it.
pub type Converted = Result<PackageReport, Error>;

impl Migrator {
    /// Converts every package of `planned` (a schedule, in its order, as
    /// [`Migrator::schedule`] made it): those to be converted by a
    /// snapshot up to [`WORKERS`] at once, started in order, then the
    /// others one at a time, in order (the module docs). `sink` gets each
    /// package's progress and `on_done` its outcome as soon as it is done,
    /// from the thread that converted it. Returns the outcomes in
    /// `planned`'s order. A failing package does not stop the others.
    ///
    /// A crash leaves each package started and not done in its own crash
    /// state, as a crash in [`Migrator::convert_planned`] does, and the
    /// shares made so far, which the next schedule or the cleanup deletes.
    pub fn convert_each(
        &self,
        planned: &[Planned],
        opts: &MigrateOptions,
        sink: &(dyn Fn(&Planned, &Progress) + Sync),
        on_done: &(dyn Fn(&Planned, &Converted) + Sync),
    ) -> Vec<Converted> {
        let at_once = planned
            .iter()
            .take_while(|p| p.decision == Some(Decision::SnapshotParent))
            .count();
        let (first, then) = planned.split_at(at_once);
        let mut out = self.convert_at_once(first, opts, sink, on_done);
        for p in then {
            let r = self.convert_planned(p, opts, &mut |pr: &Progress| sink(p, pr));
            on_done(p, &r);
            out.push(r);
        }
        out
    }

    /// [`Migrator::convert_each`]'s packages to be converted by a
    /// snapshot, [`WORKERS`] at once; the caller's thread is one of them,
    /// so a thread that cannot be started only means fewer at once.
    fn convert_at_once(
        &self,
        planned: &[Planned],
        opts: &MigrateOptions,
        sink: &(dyn Fn(&Planned, &Progress) + Sync),
        on_done: &(dyn Fn(&Planned, &Converted) + Sync),
    ) -> Vec<Converted> {
        let members = Members::of(planned);
        let next = AtomicUsize::new(0);
        let slots: Vec<Mutex<Option<Converted>>> =
            planned.iter().map(|_| Mutex::new(None)).collect();
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = planned.get(i) else { break };
                // Deleted here once every member is done, not by the last
                // in order (the module docs).
                let own = Planned {
                    drop_shares: Vec::new(),
                    ..p.clone()
                };
                let r = self.convert_planned(&own, opts, &mut |pr: &Progress| sink(p, pr));
                on_done(p, &r);
                members.done(self, p);
                *slots[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
            }
        };
        std::thread::scope(|scope| {
            for k in 1..WORKERS.min(planned.len()) {
                let started = std::thread::Builder::new()
                    .name(format!("volume-migrate-{k}"))
                    .spawn_scoped(scope, work);
                if let Err(e) = started {
                    tracing::warn!(error = %e, "starting a conversion thread: fewer conversions at once");
                    break;
                }
            }
            work();
        });
        slots
            .into_iter()
            .map(|s| {
                s.into_inner()
                    .unwrap_or_else(PoisonError::into_inner)
                    .unwrap_or_else(|| {
                        Err(Error::new(
                            color_eyre::eyre::eyre!(
                                "a conversion thread stopped before its package"
                            ),
                            models::ErrorKind::Unknown,
                        ))
                    })
            })
            .collect()
    }
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
