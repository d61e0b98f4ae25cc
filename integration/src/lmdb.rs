//! Real LMDB environments, written by the LMDB library itself (through
//! Meilisearch's `heed` binding) the way the seed's Monero node writes its
//! blockchain: random-key puts, many transactions, `MDB_NOSYNC` with an
//! explicit sync every few transactions (monerod's default `fast` sync mode).
//! On btrfs every transaction's copy-on-write pages land somewhere new, so the
//! `data.mdb` this builds is fragmented by the database itself, not by a
//! synthetic rewrite pattern ([`crate::make_fragmented_file`]).
//!
//! Contents are derived from the seed and a key's number alone, so
//! [`check`] needs no stored copy: key `i` is 32 bytes whose first 8 are an
//! invertible mix of `i` (so the keys land at random places in the b-tree,
//! and a key read back names its number), the other 24 and the value (64 to
//! 1024 bytes) a stream seeded from those 8. An environment built with
//! `keys` keys holds exactly keys `0..keys`; [`check`] reads every entry
//! back and fails on any other key, any wrong byte, or a missing key.
//!
//! A crash in the middle of [`build`] or [`put_keys`] leaves an environment
//! LMDB can open at its last durable transaction (unsynced ones are lost,
//! as with monerod); nothing here recovers it: callers build from scratch.

use std::io;
use std::path::Path;

use heed::types::Bytes;
use heed::{CommitOrAbort, Database, Env, EnvFlags, EnvOpenOptions};

/// The environment's data file, in the directory the environment is.
pub const DATA_FILE: &str = "data.mdb";

const KEY_BYTES: usize = 32;
const VALUE_MIN: u64 = 64;
const VALUE_MAX: u64 = 1024;
/// Odd multipliers of the key mix: each invertible modulo 2^64.
const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xBF58_476D_1CE4_E5B9;

/// How to build an environment.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Stop once `data.mdb` is at least this big.
    pub bytes: u64,
    /// Keys and values depend on it and on a key's number only.
    pub seed: u64,
    /// Random-key puts per write transaction (a block's worth).
    pub puts_per_txn: u64,
    /// Transactions between explicit syncs (`mdb_env_sync`).
    pub txns_per_sync: u64,
}

impl Spec {
    /// The seed node's database at `bytes`: 1,000 puts a transaction, a sync
    /// every 4 transactions.
    pub fn node(bytes: u64, seed: u64) -> Spec {
        Spec {
            bytes,
            seed,
            puts_per_txn: 1_000,
            txns_per_sync: 4,
        }
    }

    /// A test's: `bytes` (tens of MiB) over hundreds of transactions of 100
    /// puts, each synced.
    pub fn small(bytes: u64, seed: u64) -> Spec {
        Spec {
            bytes,
            seed,
            puts_per_txn: 100,
            txns_per_sync: 1,
        }
    }
}

/// What [`build`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Built {
    /// Keys `0..keys` are in the environment.
    pub keys: u64,
    /// Write transactions committed.
    pub txns: u64,
    /// Size of `data.mdb` afterwards.
    pub file_bytes: u64,
}

fn lmdb_err(what: &str, dir: &Path) -> impl Fn(heed::Error) -> io::Error {
    let context = format!("LMDB: {what} in {}", dir.display());
    move |e| io::Error::other(format!("{context}: {e}"))
}

/// Opens (creating if needed) the environment in `dir` with room for
/// `map_bytes`, as monerod does: `MDB_NOSYNC`, syncs explicit.
#[allow(unsafe_code)] // heed's open and flags are unsafe: see SAFETY
fn open(dir: &Path, map_bytes: u64) -> io::Result<Env> {
    let map = usize::try_from(map_bytes.next_multiple_of(1 << 20))
        .map_err(|_| io::Error::other("LMDB map size does not fit in usize"))?;
    let mut options = EnvOpenOptions::new();
    options.map_size(map).max_dbs(1);
    // SAFETY: NO_SYNC only gives up durability of unsynced transactions (we
    // sync explicitly); the map is only at risk if the file is modified
    // behind LMDB's back, and nothing else opens this environment while it
    // is open: every caller closes it ([`close`]) before touching the volume.
    unsafe {
        options.flags(EnvFlags::NO_SYNC);
        options.open(dir)
    }
    .map_err(lmdb_err("opening the environment", dir))
}

/// Closes `env` and waits until LMDB has released it, so the same path can be
/// opened again (after a restore swapped the volume under it).
fn close(env: Env) {
    env.prepare_for_closing().wait();
}

/// The unnamed database of `env`, created if absent.
fn database<'e>(env: &'e Env, dir: &Path) -> io::Result<Database<'e, Bytes, Bytes>> {
    let txn = env
        .write_txn()
        .map_err(lmdb_err("starting a transaction", dir))?;
    let db = env
        .create_databases_and_commit(txn, |opener, txn| {
            opener
                .create_database::<Bytes, Bytes>(txn, None)
                .map(CommitOrAbort::<_, ()>::Commit)
        })
        .map_err(lmdb_err("creating the database", dir))?;
    match db {
        CommitOrAbort::Commit(db) => Ok(db),
        CommitOrAbort::Abort(()) => Err(io::Error::other("LMDB: database creation aborted")),
    }
}

/// Builds a fresh environment in `dir` (which must hold none): keys `0..`
/// put in random key order, [`Spec::puts_per_txn`] a transaction, until
/// `data.mdb` reaches [`Spec::bytes`]; then syncs and closes it.
pub fn build(dir: &Path, spec: &Spec) -> io::Result<Built> {
    let (keys, txns) = write(dir, spec, 0, None)?;
    let file_bytes = std::fs::metadata(dir.join(DATA_FILE))?.len();
    Ok(Built {
        keys,
        txns,
        file_bytes,
    })
}

/// Puts keys `from..from + count` into the environment in `dir` (as
/// [`build`] does, with the same spec's batching), then syncs and closes it:
/// what a service writes after a snapshot.
pub fn put_keys(dir: &Path, spec: &Spec, from: u64, count: u64) -> io::Result<()> {
    write(dir, spec, from, Some(from + count)).map(drop)
}

/// The common loop of [`build`] and [`put_keys`]: returns the next key's
/// number and the transactions committed.
fn write(dir: &Path, spec: &Spec, from: u64, until: Option<u64>) -> io::Result<(u64, u64)> {
    let map = 2 * spec
        .bytes
        .max(std::fs::metadata(dir.join(DATA_FILE)).map_or(0, |m| m.len()));
    let env = open(dir, map + (64 << 20))?;
    let result = (|| {
        let db = database(&env, dir)?;
        let data = dir.join(DATA_FILE);
        let (mut next, mut txns) = (from, 0u64);
        let mut key = [0u8; KEY_BYTES];
        let mut value = Vec::with_capacity(VALUE_MAX as usize);
        loop {
            let done = match until {
                Some(end) => next >= end,
                None => std::fs::metadata(&data)?.len() >= spec.bytes,
            };
            if done {
                break;
            }
            let end = until.map_or(next + spec.puts_per_txn, |u| {
                u.min(next + spec.puts_per_txn)
            });
            let mut txn = env
                .write_txn()
                .map_err(lmdb_err("starting a transaction", dir))?;
            for i in next..end {
                entry(spec.seed, i, &mut key, &mut value);
                db.put(&mut txn, &key, &value)
                    .map_err(lmdb_err("putting a key", dir))?;
            }
            txn.commit().map_err(lmdb_err("committing", dir))?;
            (next, txns) = (end, txns + 1);
            if txns % spec.txns_per_sync.max(1) == 0 {
                env.force_sync().map_err(lmdb_err("syncing", dir))?;
            }
        }
        env.force_sync().map_err(lmdb_err("syncing", dir))?;
        Ok((next, txns))
    })();
    close(env);
    result
}

/// Reads back every entry of the environment in `dir` and checks that it
/// holds exactly keys `0..keys` of `seed`, each with its value. Returns the
/// bytes of keys and values read. Opens the environment without writing to
/// it (beyond LMDB's lock file) and closes it before returning.
pub fn check(dir: &Path, seed: u64, keys: u64) -> io::Result<u64> {
    let data = dir.join(DATA_FILE);
    let len = std::fs::metadata(&data)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", data.display())))?
        .len();
    let env = open(dir, len)?;
    let result = check_open(&env, dir, seed, keys);
    close(env);
    result
}

fn check_open(env: &Env, dir: &Path, seed: u64, keys: u64) -> io::Result<u64> {
    let bad = |what: String| io::Error::other(format!("LMDB in {}: {what}", dir.display()));
    let txn = env.read_txn().map_err(lmdb_err("starting a read", dir))?;
    let opened = env
        .open_databases_and_commit(txn, |opener, txn| {
            opener
                .open_database::<Bytes, Bytes>(txn, None)
                .map(CommitOrAbort::<_, ()>::Commit)
        })
        .map_err(lmdb_err("opening the database", dir))?;
    let db = match opened {
        CommitOrAbort::Commit(Some(db)) => db,
        _ => return Err(bad("no database".to_owned())),
    };
    let txn = env.read_txn().map_err(lmdb_err("starting a read", dir))?;
    let (mut seen, mut bytes) = (0u64, 0u64);
    let mut want_key = [0u8; KEY_BYTES];
    let mut want_value = Vec::with_capacity(VALUE_MAX as usize);
    for item in db.iter(&txn).map_err(lmdb_err("iterating", dir))? {
        let (key, value) = item.map_err(lmdb_err("reading an entry", dir))?;
        let Some(prefix) = key.first_chunk::<8>() else {
            return Err(bad(format!("a key of {} bytes", key.len())));
        };
        let i = unmix(seed, u64::from_be_bytes(*prefix));
        if i >= keys {
            return Err(bad(format!("key {i} present, only 0..{keys} expected")));
        }
        entry(seed, i, &mut want_key, &mut want_value);
        if key != want_key {
            return Err(bad(format!("key {i}'s bytes differ")));
        }
        if value != want_value.as_slice() {
            return Err(bad(format!("key {i}'s value differs")));
        }
        seen += 1;
        bytes += (key.len() + value.len()) as u64;
    }
    // Keys are unique and each maps to one number below `keys`: as many as
    // `keys` means every one of them.
    if seen != keys {
        return Err(bad(format!("{seen} keys, {keys} expected")));
    }
    Ok(bytes)
}

/// Key `i`'s bytes into `key` and its value into `value`.
fn entry(seed: u64, i: u64, key: &mut [u8; KEY_BYTES], value: &mut Vec<u8>) {
    let prefix = mix(seed, i);
    key[..8].copy_from_slice(&prefix.to_be_bytes());
    let mut state = prefix ^ seed.rotate_left(17) ^ 0x5851_F42D_4C95_7F2D;
    let mut next = move || {
        // splitmix64: any state, zero included, gives a full-period stream.
        state = state.wrapping_add(K1);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(K2);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for chunk in key[8..].chunks_exact_mut(8) {
        chunk.copy_from_slice(&next().to_le_bytes());
    }
    let len = VALUE_MIN + next() % (VALUE_MAX - VALUE_MIN + 1);
    value.clear();
    while (value.len() as u64) < len {
        value.extend_from_slice(&next().to_le_bytes());
    }
    value.truncate(len as usize);
}

/// `x ^ (x >> 32)`: its own inverse.
fn fold(x: u64) -> u64 {
    x ^ (x >> 32)
}

fn salt(seed: u64) -> u64 {
    seed.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ 0xA076_1D64_78BD_642F
}

/// A bijection of `u64` that scatters consecutive numbers over the key space.
fn mix(seed: u64, i: u64) -> u64 {
    fold(fold(i.wrapping_mul(K1) ^ salt(seed)).wrapping_mul(K2))
}

/// The inverse of [`mix`].
fn unmix(seed: u64, y: u64) -> u64 {
    (fold(fold(y).wrapping_mul(inverse(K2))) ^ salt(seed)).wrapping_mul(inverse(K1))
}

/// The inverse of odd `k` modulo 2^64 (Newton's iteration: each step doubles
/// the correct low bits, from 3).
const fn inverse(k: u64) -> u64 {
    let mut x = k;
    let mut step = 0;
    while step < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(k.wrapping_mul(x)));
        step += 1;
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_inverted_by_unmix() {
        for seed in [0, 1, 42] {
            for i in (0..10_000).chain([u64::MAX, u64::MAX / 3]) {
                assert_eq!(unmix(seed, mix(seed, i)), i);
            }
        }
        assert_eq!(inverse(K1).wrapping_mul(K1), 1);
        assert_eq!(inverse(K2).wrapping_mul(K2), 1);
    }

    #[test]
    fn entries_depend_on_seed_and_number_only() {
        let (mut k1, mut k2) = ([0; KEY_BYTES], [0; KEY_BYTES]);
        let (mut v1, mut v2) = (Vec::new(), Vec::new());
        entry(1, 5, &mut k1, &mut v1);
        entry(1, 5, &mut k2, &mut v2);
        assert_eq!((k1, &v1), (k2, &v2));
        entry(2, 5, &mut k2, &mut v2);
        assert_ne!(k1, k2);
        assert!((VALUE_MIN..=VALUE_MAX).contains(&(v1.len() as u64)));
    }
}
