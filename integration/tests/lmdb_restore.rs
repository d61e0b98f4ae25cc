//! The seed's database through start-core's drop-in: a real LMDB environment
//! (written by the LMDB library with random-key puts over hundreds of
//! transactions, `integration::lmdb`), snapshotted, written to, and
//! restored with `startos_core::volume::InstallBackup`; then every key is
//! read back and checked against what it held at the snapshot.

mod common;

use std::path::PathBuf;

use common::*;
use integration::lmdb::{self, Spec};
use integration::{LoopFs, extent_count, fs_or_skip};
use startos_core::volume::{InstallBackup, ensure_volume_root_at};

/// The environment's size: tens of MiB, so the test takes seconds.
const ENV_BYTES: u64 = 24 * MIB;
/// Keys a failed update writes after the snapshot.
const LATER_KEYS: u64 = 3_000;
const SEED: u64 = 7;

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

#[tokio::test]
async fn restore_brings_back_every_key_of_a_real_lmdb_environment() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    ensure_volume_root_at(&root, "monerod")
        .await
        .expect("creating monerod's volume");
    let env: PathBuf = root.join("monerod/data/main");
    std::fs::create_dir_all(&env).unwrap();
    let spec = Spec::small(ENV_BYTES, SEED);

    let built = blocking({
        let env = env.clone();
        move || lmdb::build(&env, &spec)
    })
    .await
    .expect("building the environment");
    assert!(
        built.txns >= 100,
        "hundreds of transactions expected: {built:?}"
    );
    // Fragmented by LMDB's own copy-on-write commits, not by us.
    let extents = extent_count(&env.join(lmdb::DATA_FILE)).unwrap();
    eprintln!("built {built:?}: {extents} extents");
    assert!(
        extents * 4 >= built.file_bytes / 4096,
        "{extents} extents in {built:?}: LMDB's commits should fragment data.mdb"
    );

    let ib = InstallBackup::at(&root, "monerod");
    ib.begin().await.expect("begin");
    assert!(ib.snapshot().await.expect("snapshot"), "no backup taken");

    // The failed update writes more keys, over many transactions.
    let after = blocking({
        let env = env.clone();
        move || {
            lmdb::put_keys(&env, &spec, built.keys, LATER_KEYS)?;
            lmdb::check(&env, SEED, built.keys + LATER_KEYS)
        }
    })
    .await;
    after.expect("the later keys should be in the live environment");

    ib.restore().await.expect("restore");

    // Exactly the keys at the snapshot, every byte: the later ones gone.
    let restored = blocking({
        let env = env.clone();
        move || lmdb::check(&env, SEED, built.keys)
    })
    .await;
    restored.unwrap_or_else(|e| panic!("after the restore ({built:?}): {e}"));
    assert!(!ib.exists().await, "the restore consumes the backup");
    ib.remove().await.expect("remove");
}

#[test]
fn a_missing_or_extra_key_fails_the_check() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let env = fs.path("env");
    std::fs::create_dir(&env).unwrap();
    let spec = Spec::small(2 * MIB, SEED);
    let built = lmdb::build(&env, &spec).expect("build");
    lmdb::check(&env, SEED, built.keys).expect("the keys as built");
    assert!(
        lmdb::check(&env, SEED, built.keys + 1).is_err(),
        "one missing"
    );
    assert!(
        lmdb::check(&env, SEED, built.keys - 1).is_err(),
        "one extra"
    );
    assert!(
        lmdb::check(&env, SEED + 1, built.keys).is_err(),
        "another seed"
    );
}
