//! The boot benchmark's readiness rows, measured through start-core's own
//! call sites ([`integration::call_sites::boot_loads::first_boot`]), on the real-node
//! box in miniature: in both orders every package's volume exchange, load
//! start and volume calls' return are measured, in the order that boot
//! makes them. The figures themselves are the benchmark's (`make bench`,
//! section `boot`, or `--only loads --boot-small` in about half a
//! minute); this checks the path that measures them.

use integration::call_sites::boot_loads::{self as call_sites, Order};
use integration::node::{self, NodeShape};
use integration::{LoopFs, fs_or_skip};

fn boot(order: Order) -> Option<call_sites::BootLoads> {
    let shape = NodeShape::small();
    let fs = fs_or_skip!(LoopFs::btrfs(shape.image_bytes()), None);
    let root = fs.path("package-data/volumes");
    std::fs::create_dir_all(&root).unwrap();
    node::build(&root, &shape).expect("building the box");
    let bin = integration::workspace_bin("call-sites").unwrap_or_else(|e| {
        panic!("{e} (build it first: cargo build --workspace --bins --features ...)")
    });
    call_sites::seed(&bin, fs.mount_point(), &shape.packages()).expect("seeding the database");
    let loads = call_sites::first_boot(&bin, fs.mount_point(), order).expect("the first boot");
    let names: Vec<&str> = loads.packages.iter().map(|p| p.package.as_str()).collect();
    assert_eq!(names, shape.packages(), "{order:?}: every package watched");
    for p in &loads.packages {
        assert_eq!(
            p.loaded,
            Ok(true),
            "{order:?}: {} returns its service",
            p.package
        );
        let (Some(x), Some(s), Some(r)) = (p.exchanged, p.load_started, p.volumes_ready) else {
            panic!("{order:?}: {p:?}: exchange, load start and return all seen");
        };
        assert!(
            x <= s && s <= r,
            "{order:?}: {p:?}: the load after the exchange"
        );
        assert!(p.after_exchange().is_some_and(|d| d >= 0.0));
    }
    eprintln!(
        "{order:?}: per package, exchange / load start / volume calls returned (ms), lock waits: {:?}",
        loads
            .packages
            .iter()
            .map(|p| (
                &p.package,
                p.exchanged,
                p.load_started,
                p.volumes_ready,
                &p.lock_waits
            ))
            .collect::<Vec<_>>()
    );
    Some(loads)
}

fn max(it: impl Iterator<Item = Option<f64>>) -> f64 {
    it.flatten().fold(f64::MIN, f64::max)
}

fn min(it: impl Iterator<Item = Option<f64>>) -> f64 {
    it.flatten().fold(f64::MAX, f64::min)
}

#[test]
fn upstream_order_loads_every_package_after_every_exchange() {
    let Some(b) = boot(Order::Upstream) else {
        return;
    };
    let last_exchange = max(b.packages.iter().map(|p| p.exchanged));
    let first_load = min(b.packages.iter().map(|p| p.load_started));
    assert!(
        first_load >= last_exchange,
        "upstream's order: services init after the whole maintenance ({first_load} ms < {last_exchange} ms)"
    );
}

#[test]
fn the_readiness_step_loads_a_package_before_the_last_exchange() {
    let Some(b) = boot(Order::Readiness) else {
        return;
    };
    let last_exchange = max(b.packages.iter().map(|p| p.exchanged));
    let first_return = min(b.packages.iter().map(|p| p.volumes_ready));
    assert!(
        first_return < last_exchange,
        "the readiness step: a service's volume calls return while other volumes still convert ({first_return} ms >= {last_exchange} ms)"
    );
}
