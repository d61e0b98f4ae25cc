//! `data_dir` against upstream's own formula (start-core `src/volume.rs`,
//! Start9Labs/start-technologies 48408e8c: `datadir.join(PKG_VOLUME_DIR)
//! .join(pkg_id).join("data").join(volume_id)`, the ids joined raw) for
//! every id upstream passes it.

use std::path::{Path, PathBuf};

use startos_core::volume::{PKG_VOLUME_DIR, data_dir};

/// Upstream's `DATA_DIR` (start-core `src/lib.rs`).
const DATA_DIR: &str = "/media/startos/data";

/// Upstream's `data_dir`, as it writes it, on the ids' text (its `PackageId`
/// and `VolumeId` join as `AsRef<Path>` of that text).
fn upstream_data_dir<P: AsRef<Path>>(datadir: P, pkg_id: &str, volume_id: &str) -> PathBuf {
    datadir
        .as_ref()
        .join(PKG_VOLUME_DIR)
        .join(pkg_id)
        .join("data")
        .join(volume_id)
}

/// The package ids upstream can pass: its system package id (`SYSTEM_ID`,
/// `id/mod.rs`, which its `PackageId` deserializer maps to
/// `SYSTEM_PACKAGE_ID`), `PackageId::start_os()`, the ids the 0.3.6
/// migration installs under (`migrated_id`), and its pattern's edges
/// (`^[a-z0-9]+(-[a-z0-9]+)*$`).
const PACKAGES: &[&str] = &[
    "x_system",
    "start-os",
    "nostr-rs-relay",
    "ghost-legacy",
    "synapse-legacy",
    "monerod-legacy",
    "fedimint-guardian",
    "bitcoind",
    "lnd",
    "ride-the-lightning",
    "lightning-terminal",
    "a",
    "0",
    "a-b-c",
    "x9",
    "9-a-0",
];

/// The volume ids upstream can pass: `BACKUP`, the compat `embassy` volume
/// its persistent container adds, `main`, and the pattern's edges.
const VOLUMES: &[&str] = &["BACKUP", "embassy", "main", "a", "0", "a-b-c", "x9"];

#[test]
fn data_dir_is_upstreams_for_every_id_upstream_holds() {
    for pkg in PACKAGES {
        for vol in VOLUMES {
            assert_eq!(
                data_dir(DATA_DIR, pkg, vol),
                upstream_data_dir(DATA_DIR, pkg, vol),
                "package {pkg:?}, volume {vol:?}"
            );
        }
    }
    assert_eq!(
        data_dir(DATA_DIR, "x_system", "main"),
        Path::new("/media/startos/data/package-data/volumes/x_system/data/main")
    );
}

/// What upstream's types never hold stays escaped: `PackageId::default()`
/// is the one such value upstream can build (by `Default`), and joining it
/// raw would name `volumes/data/<volume>`, inside package `data`'s root.
#[test]
fn ids_upstream_cannot_hold_are_still_one_component() {
    for bad in ["", "X_SYSTEM", "x_system2", "x-system_", "..", "a/b"] {
        let p = data_dir(DATA_DIR, bad, "main");
        assert_ne!(p, upstream_data_dir(DATA_DIR, bad, "main"), "{bad:?}");
        assert!(
            p.starts_with("/media/startos/data/package-data/volumes"),
            "{p:?}"
        );
        assert_eq!(
            p.components().count(),
            9,
            "one component for {bad:?}: {p:?}"
        );
    }
    let p = data_dir(DATA_DIR, "lnd", "x_system");
    assert_ne!(p, upstream_data_dir(DATA_DIR, "lnd", "x_system"));
}
