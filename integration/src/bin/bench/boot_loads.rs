//! The `boot` section's readiness where a service waits: the first boot of
//! the same box, run through start-core's own call sites (the
//! `call-sites` runner of `fixtures/upstream-call-sites`,
//! [`integration::call_sites::boot_loads`]), each package's time from the boot's start
//! to the return of its `Service::load` volume calls (`ensure_volume_root`,
//! the `data_dir` checks), beside its volume's exchange, with the boot's
//! background cleanup running. Two ways, each on a fresh box:
//!
//! - the readiness step (`cleanup_and_initialize_when_ready`): each package
//!   loaded as its volume is reported ready;
//! - upstream's order (`cleanup_and_initialize`): every load after the whole
//!   maintenance. This is upstream's order on our drop-in, not upstream's
//!   conversion protocol, whose rows ([`integration::upstream`]) the
//!   section keeps.
//!
//! A load that waited for its package's lock while its volume calls ran
//! (the runner's watch samples `/proc/locks` every millisecond) waited on
//! the background cleanup's removal of that package's old tree: nothing
//! else takes a package's lock at a boot once it is exchanged.

use std::fs;

use integration::LoopFs;
use integration::call_sites::boot_loads::{self as call_sites, BootLoads, Order, PackageLoad};
use integration::node::{self, NodeShape};
use serde::Serialize;

use crate::Verdict;
use crate::common::{Result, fmt_count, fmt_duration, settle};

/// The longest from a volume's exchange to the return of its load's
/// volume calls (issue 28): 50 ms.
pub const AFTER_EXCHANGE_AT_MOST_MS: f64 = 50.0;

/// Both ways on one box size.
#[derive(Serialize)]
pub struct Fixture {
    /// The readiness step.
    pub readiness: BootLoads,
    /// Upstream's order on the drop-in.
    pub upstream: BootLoads,
}

/// The box on a fresh filesystem, its packages in the runner's database,
/// settled and out of the page cache; boots it once in `order`.
fn boot(shape: &NodeShape, order: Order) -> Result<BootLoads> {
    let bin = integration::workspace_bin("call-sites").map_err(|e| {
        format!(
            "{e}: build it first (cargo build --release -p upstream-call-sites --bin call-sites)"
        )
    })?;
    let fs = LoopFs::btrfs(shape.image_bytes())?;
    let root = fs.path("package-data/volumes");
    fs::create_dir_all(&root)?;
    node::build(&root, shape)?;
    call_sites::seed(&bin, fs.mount_point(), &shape.packages())?;
    settle(fs.mount_point())?;
    crate::drop_caches()?;
    let loads = call_sites::first_boot(&bin, fs.mount_point(), order)?;
    if let Some(p) = loads.packages.iter().find(|p| p.loaded != Ok(true)) {
        return Err(format!("{:?}: {}'s load: {:?}", order, p.package, p.loaded).into());
    }
    fs.close()?;
    Ok(loads)
}

/// Both ways on `shape`, each on its own fresh box.
pub fn run(shape: &NodeShape) -> Result<Fixture> {
    eprintln!("boot: through the call sites: the readiness step");
    let readiness = boot(shape, Order::Readiness)?;
    eprintln!("boot: through the call sites: upstream's order");
    let upstream = boot(shape, Order::Upstream)?;
    Ok(Fixture {
        readiness,
        upstream,
    })
}

fn ms(t: Option<f64>) -> String {
    t.map_or("-".to_owned(), |t| {
        fmt_duration(std::time::Duration::from_secs_f64(t.max(0.0) / 1000.0))
    })
}

/// The longest after-exchange figure, and whose.
fn longest_after_exchange(b: &BootLoads) -> Option<(&PackageLoad, f64)> {
    b.packages
        .iter()
        .filter_map(|p| Some((p, p.after_exchange()?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// The packages whose load waited for its lock, and how long in all.
fn waits(b: &BootLoads) -> Vec<(&str, f64)> {
    b.packages
        .iter()
        .filter(|p| !p.lock_waits.is_empty())
        .map(|p| (p.package.as_str(), p.waited()))
        .collect()
}

fn fmt_waits(w: &[(&str, f64)]) -> String {
    if w.is_empty() {
        return "none".to_owned();
    }
    w.iter()
        .map(|(p, t)| format!("{p} {}", ms(Some(*t))))
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_way(title: &str, b: &BootLoads) {
    println!("      {title}:");
    println!(
        "        {:<13} {:>19}  {:>10}  {:>14}  {:>14}  {:>10}  waited for its lock during its calls",
        "package", "exchange", "load called", "calls returned", "after exchange", "calls took",
    );
    let mut rows: Vec<&PackageLoad> = b.packages.iter().collect();
    rows.sort_by(|a, b| {
        a.volumes_ready
            .unwrap_or(f64::MAX)
            .total_cmp(&b.volumes_ready.unwrap_or(f64::MAX))
    });
    for p in rows {
        let held = p.held_after_exchange.map_or(String::new(), |[_, to]| {
            format!(" (lock last seen held at {})", ms(Some(to)))
        });
        println!(
            "        {:<13} {:>19}  {:>10}  {:>14}  {:>14}  {:>10}  {}{held}",
            p.package,
            format!("{} - {}", ms(p.exchanged), ms(p.exchanged_seen)),
            ms(p.load_started),
            ms(p.volumes_ready),
            ms(p.after_exchange()),
            ms(p.calls()),
            if p.lock_waits.is_empty() {
                "no".to_owned()
            } else {
                ms(Some(p.waited()))
            },
        );
    }
}

/// Prints the rows of one box size: `events_all_ready`, the section's own
/// time until every package was reported ready (ours), in seconds.
pub fn print(extents: u64, f: &Fixture, events_all_ready: f64) {
    let last = |b: &BootLoads| {
        b.packages
            .iter()
            .filter_map(|p| p.volumes_ready)
            .fold(0.0, f64::max)
    };
    println!(
        "    {:>11} extents, through start-core's call sites (fixtures/upstream-call-sites' runner, times from the boot's start; each exchange between two samples of the runner's watch, \"after exchange\" from the earlier):",
        fmt_count(extents)
    );
    print_way(
        "the readiness step (cleanup_and_initialize_when_ready)",
        &f.readiness,
    );
    print_way(
        "upstream's order on the drop-in (cleanup_and_initialize: every load after the whole maintenance)",
        &f.upstream,
    );
    println!(
        "      every service's Service::load volume calls returned: readiness step {}, upstream's order {}; the events above (package_ready of boot_volume_maintenance_at, ours): all ready at {}",
        ms(Some(last(&f.readiness))),
        ms(Some(last(&f.upstream))),
        ms(Some(events_all_ready * 1000.0)),
    );
}

/// The targets, over every box size: `(extents, fixture)`.
pub fn verdicts(cases: &[(u64, &Fixture)]) -> Vec<Verdict> {
    let within = cases.iter().all(|(_, f)| {
        longest_after_exchange(&f.readiness).is_some_and(|(_, t)| t <= AFTER_EXCHANGE_AT_MOST_MS)
            && f.readiness
                .packages
                .iter()
                .all(|p| p.after_exchange().is_some())
    });
    let detail = cases
        .iter()
        .map(|(x, f)| match longest_after_exchange(&f.readiness) {
            Some((p, t)) => format!(
                "{} extents: longest {} ({})",
                fmt_count(*x),
                ms(Some(t)),
                p.package
            ),
            None => format!("{} extents: not measured", fmt_count(*x)),
        })
        .collect::<Vec<_>>()
        .join(", ");
    let no_wait = cases
        .iter()
        .all(|(_, f)| waits(&f.readiness).is_empty() && waits(&f.upstream).is_empty());
    let wait_detail = cases
        .iter()
        .map(|(x, f)| {
            format!(
                "{} extents: readiness step {}; upstream's order {}",
                fmt_count(*x),
                fmt_waits(&waits(&f.readiness)),
                fmt_waits(&waits(&f.upstream))
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    vec![
        Verdict::new(
            format!(
                "boot (call sites, readiness step): each package's Service::load volume calls return within {} of its volume's exchange",
                ms(Some(AFTER_EXCHANGE_AT_MOST_MS))
            ),
            within,
            detail,
        ),
        Verdict::new(
            "boot (call sites, both orders): no load's volume calls wait for a package lock (the background removal)"
                .to_owned(),
            no_wait,
            wait_detail,
        ),
    ]
}

/// The `loads` section alone: both ways at each box size, with no other
/// way and no event rows (`--boot-small`: the test suite's box, about half
/// a minute).
pub fn run_section(shapes: &[NodeShape]) -> Result<Vec<(u64, Fixture)>> {
    shapes
        .iter()
        .map(|s| Ok((s.monerod_extents, run(s)?)))
        .collect()
}

/// Prints the `loads` section.
pub fn print_section(cases: &[(u64, Fixture)]) {
    println!(
        "loads: the first boot of a box shaped like the field reports', through start-core's call sites"
    );
    for (x, f) in cases {
        println!(
            "    {:>11} extents, times from the boot's start:",
            fmt_count(*x)
        );
        print_way(
            "the readiness step (cleanup_and_initialize_when_ready)",
            &f.readiness,
        );
        print_way(
            "upstream's order on the drop-in (cleanup_and_initialize: every load after the whole maintenance)",
            &f.upstream,
        );
    }
    let refs: Vec<(u64, &Fixture)> = cases.iter().map(|(x, f)| (*x, f)).collect();
    for v in verdicts(&refs) {
        v.print();
    }
}
