//! Work over a list spread across threads: each item done once, taken in
//! order by whichever thread is free, the results in the list's order.
//!
//! The boot's recovery ([`crate::VolumeStore::recover_all`]) and the
//! conversion of many packages (volume-migrate's pool: each package's
//! weighing, then its conversion) are chains of waits (cold reads, a
//! package's lock, transaction commits) with little work between them, so
//! they overlap on more threads than cores, each thread taking the next
//! item as it is free rather than a fixed share (one slow item holds one
//! thread, not the items queued behind it in a share).
//!
//! What a worker reports (a conversion's progress) reaches the calling
//! thread, which does nothing else meanwhile, so whatever receives it need
//! be neither `Send` nor `Sync`. Nothing here touches the disk: a crash
//! leaves whatever each item's own work leaves.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};

/// What [`at_once`] calls on each item: the item, and where the worker's
/// messages go (to the calling thread).
pub type Work<'w, T, M, R> = dyn Fn(&T, &mut dyn FnMut(M)) -> R + Sync + 'w;

/// Calls `work` on each of `items`, on up to `threads` threads of their
/// own (named `<name>-<k>`), each taking the next item not yet taken; what
/// a worker passes to its `report` reaches `on_message` on the calling
/// thread, in the order that worker sent it. Returns the results in
/// `items`' order.
///
/// With fewer than two threads, or where none can be started, the calling
/// thread does it all, each message passed on as it is sent; a thread that
/// cannot be started leaves its share to those that were. A panic in
/// `work` fails its item only: the thread goes on taking the rest, on the
/// calling thread as on a worker, and once every item is done the panic
/// is resumed here with its own payload (the first one, if several).
pub fn at_once<T: Sync, R: Send, M: Send>(
    items: &[T],
    threads: usize,
    name: &str,
    work: &Work<'_, T, M, R>,
    on_message: &mut dyn FnMut(M),
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    let panicked: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
    let each = |report: &mut dyn FnMut(M)| {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let (Some(item), Some(slot)) = (items.get(i), slots.get(i)) else {
                break;
            };
            // Caught so that the panic fails this item alone, whichever
            // thread runs it, and reaches the caller with its own message
            // (std's scope would replace it with its own).
            match std::panic::catch_unwind(AssertUnwindSafe(|| work(item, report))) {
                Ok(r) => *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(r),
                Err(p) => {
                    let mut first = panicked.lock().unwrap_or_else(PoisonError::into_inner);
                    first.get_or_insert(p);
                }
            }
        }
    };
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<M>();
        let mut started = 0;
        let wanted = if threads > 1 {
            threads.min(items.len())
        } else {
            0
        };
        for k in 0..wanted {
            let tx = tx.clone();
            let each = &each;
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{k}"))
                .spawn_scoped(scope, move || {
                    each(&mut |m: M| {
                        // The caller gone (its thread panicked): nobody
                        // listens, and the work still goes on.
                        let _ = tx.send(m);
                    })
                });
            match thread {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "starting a thread: fewer items at once");
                    break;
                }
            }
        }
        drop(tx);
        // Until every thread is done and has dropped its sender.
        for m in rx {
            on_message(m);
        }
        if started == 0 {
            each(on_message);
        }
    });
    if let Some(p) = panicked
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        std::panic::resume_unwind(p);
    }
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(PoisonError::into_inner))
        .collect::<Option<Vec<R>>>()
        .unwrap_or_else(|| unreachable!("every item's slot is filled once its threads are done"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_item_once_the_results_in_order_whatever_the_threads() {
        let items: Vec<u32> = (0..100).collect();
        for threads in [0, 1, 2, 7, 100, 1000] {
            let calls = AtomicUsize::new(0);
            let got = at_once(
                &items,
                threads,
                "test",
                &|i: &u32, _: &mut dyn FnMut(())| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    i * 2
                },
                &mut |()| {},
            );
            assert_eq!(
                got,
                items.iter().map(|i| i * 2).collect::<Vec<_>>(),
                "{threads}"
            );
            assert_eq!(calls.load(Ordering::Relaxed), items.len(), "{threads}");
        }
        let none: Vec<u32> = at_once(
            &[],
            4,
            "test",
            &|i: &u32, _: &mut dyn FnMut(())| *i,
            &mut |()| {},
        );
        assert!(none.is_empty());
    }

    #[test]
    fn several_threads_work_at_once_and_their_messages_reach_the_caller() {
        let items: Vec<u32> = (0..8).collect();
        let caller = std::thread::current().id();
        let in_work = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let mut seen = Vec::new();
        at_once(
            &items,
            4,
            "test",
            &|i: &u32, report: &mut dyn FnMut(u32)| {
                let now = in_work.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(20));
                report(*i);
                in_work.fetch_sub(1, Ordering::SeqCst);
            },
            &mut |m: u32| {
                assert_eq!(std::thread::current().id(), caller);
                seen.push(m);
            },
        );
        assert!(most.load(Ordering::SeqCst) > 1, "one item at a time");
        assert_eq!(
            seen.iter().copied().collect::<HashSet<_>>(),
            items.into_iter().collect()
        );
    }

    /// Whatever thread it panicked on, the caller's (one thread) or a
    /// worker's: every other item done, then the panic resumed with its
    /// own payload (std's scope would replace it with "a scoped thread
    /// panicked").
    #[test]
    fn a_panic_leaves_the_rest_done_and_surfaces_with_its_own_message() {
        let items: Vec<u32> = (0..20).collect();
        for threads in [1, 3] {
            let done = AtomicUsize::new(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                at_once(
                    &items,
                    threads,
                    "test",
                    &|i: &u32, _: &mut dyn FnMut(())| {
                        if *i == 0 {
                            panic!("item 0");
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    },
                    &mut |()| {},
                )
            }));
            let payload = r.expect_err("the panic surfaces");
            assert_eq!(
                payload.downcast_ref::<&str>().copied(),
                Some("item 0"),
                "{threads} threads: the payload"
            );
            assert_eq!(
                done.load(Ordering::Relaxed),
                items.len() - 1,
                "{threads} threads: the other items"
            );
        }
    }

    /// Every message reaches the caller, each worker's in the order it
    /// sent them, with one thread (the caller's own) as with several.
    #[test]
    fn each_workers_messages_reach_the_caller_in_order() {
        let items: Vec<u32> = (0..16).collect();
        for threads in [0, 1, 4] {
            let caller = std::thread::current().id();
            let mut seen: Vec<(u32, u32)> = Vec::new();
            at_once(
                &items,
                threads,
                "test",
                &|i: &u32, report: &mut dyn FnMut((u32, u32))| {
                    for k in 0..5 {
                        report((*i, k));
                        std::thread::yield_now();
                    }
                },
                &mut |m: (u32, u32)| {
                    assert_eq!(std::thread::current().id(), caller);
                    seen.push(m);
                },
            );
            assert_eq!(seen.len(), items.len() * 5, "{threads} threads");
            for i in &items {
                let of_i: Vec<u32> = seen
                    .iter()
                    .filter(|(j, _)| j == i)
                    .map(|(_, k)| *k)
                    .collect();
                assert_eq!(of_i, [0, 1, 2, 3, 4], "{threads} threads: item {i}");
            }
        }
    }
}
