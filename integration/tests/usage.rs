//! Space accounting (`volume::usage`, `VolumeStore::usage`) against the tools
//! operators trust: every figure must equal what compsize 1.5 prints for the
//! same tree, and the backup/live split must equal `btrfs filesystem du`.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::ops::ControlFlow;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use common::{MIB, bytes, pkg, subvolume_create, vol, volumes_root};
use integration::{FsKind, LoopFs, fs_or_skip, make_fragmented_file, run};
use volume::sys::{EXTENT_DATA_KEY, ItemKey, KeyRange, search};
use volume::usage::sweep;
use volume::usage::{Bytes, Usage};
use volume::{ErrorKind, VolumeStore};

/// compsize's output (`-b`, exact bytes) parsed into our type.
fn compsize(args: &[&str], path: &Path) -> Usage {
    let out = run(Command::new("compsize").arg("-b").args(args).arg(path))
        .unwrap_or_else(|e| panic!("compsize {}: {e}", path.display()));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut usage = Usage::default();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(rest) = line.strip_prefix("Processed ") {
            // "Processed 604 files, 435 regular extents (436 refs), 212 inline."
            let nums: Vec<u64> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().expect("number"))
                .collect();
            assert_eq!(nums.len(), 4, "unexpected compsize line {line:?}");
            (usage.files, usage.extents, usage.refs, usage.inline) =
                (nums[0], nums[1], nums[2], nums[3]);
            continue;
        }
        if words.len() != 5 || words[0] == "Type" {
            continue;
        }
        let b = Bytes {
            disk: words[2].parse().expect("disk bytes"),
            uncompressed: words[3].parse().expect("uncompressed bytes"),
            referenced: words[4].parse().expect("referenced bytes"),
        };
        if words[0] == "TOTAL" {
            usage.total = b;
        } else {
            usage.by_type.insert(words[0].to_owned(), b);
        }
    }
    assert!(usage.files > 1, "compsize printed no file counts:\n{text}");
    usage
}

fn write(path: &Path, data: &[u8]) {
    fs::write(path, data).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

fn set_compression(dir: &Path, algo: &str) {
    run(Command::new("btrfs")
        .args(["property", "set"])
        .arg(dir)
        .args(["compression", algo]))
    .unwrap_or_else(|e| panic!("setting {algo} on {}: {e}", dir.display()));
}

fn sync() {
    run(&mut Command::new("sync")).expect("sync");
}

/// A tree with every kind of extent compsize distinguishes: incompressible
/// and compressible data under zstd, zlib and lzo, inline files, holes,
/// preallocated space, a fragmented file, shared (reflinked) extents, and
/// partially overwritten extents. No hardlinks: compsize counts those once
/// per name, a tree sweep once per inode.
fn populate_mixed(dir: &Path) {
    for (sub, algo) in [("zstd", None), ("zlib", Some("zlib")), ("lzo", Some("lzo"))] {
        let d = dir.join(sub);
        fs::create_dir_all(&d).expect("mkdir");
        if let Some(algo) = algo {
            set_compression(&d, algo);
        }
        for i in 0..40u64 {
            write(
                &d.join(format!("random-{i}")),
                &bytes(i, (i as usize * 7919) % 300_000 + 1),
            );
            let text = format!("line {i} of a very compressible log file\n")
                .repeat(2000 + i as usize * 50);
            write(&d.join(format!("text-{i}")), text.as_bytes());
            write(
                &d.join(format!("tiny-{i}")),
                format!("tiny {i}\n").as_bytes(),
            );
        }
    }
    let sparse = File::create(dir.join("sparse")).expect("sparse");
    sparse
        .write_all_at(&bytes(7, 8192), 0)
        .expect("sparse head");
    sparse
        .write_all_at(&bytes(8, 8192), 64 * MIB / 4)
        .expect("sparse tail");
    run(Command::new("fallocate")
        .args(["-l", "3M"])
        .arg(dir.join("prealloc")))
    .expect("fallocate");
    write(&dir.join("big"), &bytes(9, 8 * MIB as usize));
    sync();
    // Partial overwrites leave extents referenced in part, so referenced
    // bytes and disk bytes diverge.
    let big = OpenOptions::new()
        .write(true)
        .open(dir.join("big"))
        .expect("open big");
    for i in 0..50u64 {
        big.write_all_at(&bytes(100 + i, 4096), (i * 37 % 2000) * 4096)
            .expect("overwrite");
    }
    drop(big);
    run(Command::new("cp")
        .arg("--reflink=always")
        .arg(dir.join("big"))
        .arg(dir.join("big.clone")))
    .expect("reflink clone");
    make_fragmented_file(&dir.join("db"), 16 * MIB, 2000, 11).expect("fragmented file");
    // Symlinks: btrfs stores each target as an inline extent, which
    // compsize (regular files only) does not count.
    fs::create_dir_all(dir.join("links")).expect("mkdir links");
    for i in 0..20 {
        std::os::unix::fs::symlink(format!("../target-{i}"), dir.join(format!("links/l{i}")))
            .expect("symlink");
    }
    sync();
}

#[test]
fn subvolume_figures_equal_compsize_for_every_compression_type() {
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        1024 * MIB,
        "compress=zstd"
    ));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open store");
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let main = store.data_dir(&app, &vol("main"));
    populate_mixed(&main);
    // A nested subvolume: compsize (without -x) walks into it, and so do we.
    subvolume_create(&main.join("nested"));
    write(&main.join("nested/inner"), &bytes(12, 300_000));
    sync();

    let ours = store.usage(&app).expect("usage");
    let ours = ours.volume.expect("the volume exists");
    let theirs = compsize(&[], &store.volume_path(&app));
    assert_eq!(ours, theirs, "ours vs compsize for the subvolume");
    for t in ["none", "zstd", "zlib", "lzo", "prealloc"] {
        assert!(
            ours.by_type.contains_key(t),
            "the tree should hold {t} extents: {ours:?}"
        );
    }
    assert!(ours.inline > 0 && ours.refs > ours.extents, "{ours:?}");
}

#[test]
fn plain_directory_figures_equal_compsize() {
    let fs = fs_or_skip!(LoopFs::with_mount_options(
        FsKind::Btrfs,
        1024 * MIB,
        "compress=zstd"
    ));
    let root = volumes_root(&fs);
    let main = root.join("plain/data/main");
    fs::create_dir_all(&main).expect("mkdir plain volume");
    populate_mixed(&main);
    std::os::unix::fs::symlink("/etc", main.join("escape")).expect("symlink");
    let store = VolumeStore::open(&root).expect("open store");
    let ours = store.usage(&pkg("plain")).expect("usage");
    let ours = ours.volume.expect("the volume exists");
    assert_eq!(
        ours,
        compsize(&[], &root.join("plain")),
        "ours vs compsize for a plain directory"
    );
}

/// `btrfs filesystem du -s --raw A B`: per path, (exclusive, set shared).
fn fi_du(paths: &[&Path]) -> BTreeMap<String, (u64, u64)> {
    let out = run(Command::new("btrfs")
        .args(["filesystem", "du", "-s", "--raw"])
        .args(paths))
    .expect("btrfs filesystem du");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (
                w[3].to_owned(),
                (
                    w[1].parse().expect("exclusive"),
                    w[2].parse().expect("set shared"),
                ),
            )
        })
        .collect()
}

#[test]
fn backup_split_equals_btrfs_filesystem_du_after_divergence() {
    // Uncompressed, and files far above the inline limit: `btrfs filesystem
    // du` counts logical lengths, which equal disk bytes only then.
    let fs = fs_or_skip!(LoopFs::btrfs(1024 * MIB));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open store");
    let app = pkg("app");
    store.create(&app, &[vol("main")]).expect("create");
    let main = store.data_dir(&app, &vol("main"));
    for i in 0..30u64 {
        write(
            &main.join(format!("f{i}")),
            &bytes(i, 64 * 1024 + i as usize * 4096),
        );
    }
    sync();
    assert!(store.snapshot(&app).expect("snapshot").created());
    let split = store.usage(&app).expect("usage").split.expect("split");
    assert_eq!(
        (split.backup_only, split.live_only),
        (0, 0),
        "a fresh snapshot shares everything"
    );

    // The live volume diverges: files deleted, added, and rewritten whole.
    for i in 0..10u64 {
        fs::remove_file(main.join(format!("f{i}"))).expect("rm");
    }
    for i in 10..15u64 {
        write(&main.join(format!("f{i}")), &bytes(1000 + i, 100 * 1024));
    }
    write(&main.join("new"), &bytes(5000, 3 * MIB as usize));
    sync();

    let u = store.usage(&app).expect("usage");
    let split = u.split.expect("split");
    let live = store.volume_path(&app);
    let backup = store.backup_path(&app);
    let du = fi_du(&[&live, &backup]);
    let (live_excl, live_shared) = du[&live.display().to_string()];
    let (backup_excl, backup_shared) = du[&backup.display().to_string()];
    assert_eq!(split.live_only, live_excl, "only in the live volume");
    assert_eq!(split.backup_only, backup_excl, "only in the backup");
    assert_eq!(split.shared, live_shared, "shared, seen from the volume");
    assert_eq!(split.shared, backup_shared, "shared, seen from the backup");
    assert!(
        split.backup_only > 0 && split.live_only > 3 * MIB,
        "{split:?}"
    );

    // What dropping frees is what the split said.
    let before = u.backup.expect("backup usage").total.disk;
    assert!(before >= split.backup_only);
    assert!(store.drop_backup(&app).expect("drop"));
    assert_eq!(store.usage(&app).expect("usage").split, None);
}

#[test]
fn extent_count_stops_early_and_is_exact_below_the_bound() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 * MIB));
    let dir = fs.path("plain");
    fs::create_dir_all(dir.join("sub")).expect("mkdir");
    let made = make_fragmented_file(&dir.join("sub/db"), 32 * MIB, 3000, 3).expect("fragment");
    write(&dir.join("small"), &bytes(1, 100_000));
    sync();
    let fd = volume::sys::open_dir_path(&dir).expect("open");
    let full = volume::usage::count_tree_extents(fd.as_fd(), u64::MAX).expect("count");
    // Items, not merged FIEMAP extents: at least as many as FIEMAP reports.
    assert!(full >= made, "tree items {full} < fiemap extents {made}");
    for limit in [0, 1, 10, 500, full - 1] {
        let n = volume::usage::count_tree_extents(fd.as_fd(), limit).expect("count");
        assert_eq!(
            n,
            limit + 1,
            "with bound {limit}, the count stops right past it"
        );
    }
    assert_eq!(
        volume::usage::count_tree_extents(fd.as_fd(), full).expect("count"),
        full,
        "at the bound the count is exact"
    );
}

#[test]
fn usage_off_btrfs_is_a_clear_error() {
    let fs = fs_or_skip!(LoopFs::ext4(128 * MIB));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).expect("open store");
    store.create(&pkg("app"), &[vol("main")]).expect("create");
    let err = store.usage(&pkg("app")).expect_err("usage needs btrfs");
    assert_eq!(err.kind, ErrorKind::InvalidRequest);
    assert!(err.to_string().contains("btrfs"), "{err}");
    let none = store.usage(&pkg("absent")).expect("usage of nothing");
    assert_eq!((none.volume, none.backup, none.split), (None, None, None));
}

/// Every item's key, as one thread reads the tree of the subvolume at `dir`.
fn keys_one_pass(dir: &File) -> Vec<ItemKey> {
    let mut keys = Vec::new();
    search(dir.as_fd(), KeyRange::all(), |key, _| {
        keys.push(key);
        ControlFlow::Continue(())
    })
    .expect("single-threaded search");
    keys
}

/// Each range's first key and keys, from a parallel sweep.
fn keys_swept(dir: &File, threads: usize) -> Vec<(ItemKey, Vec<ItemKey>)> {
    sweep::sweep(dir.as_fd(), 0, threads, Vec::new, |keys, key, _| {
        keys.push(key);
        Ok(())
    })
    .unwrap_or_else(|e| panic!("sweep on {threads} threads: {e}"))
}

#[test]
fn parallel_sweep_reads_every_item_exactly_once() {
    let fs = fs_or_skip!(LoopFs::btrfs(1024 * MIB));
    let many = fs.path("many");
    subvolume_create(&many);
    populate_mixed(&many);
    for d in 0..20 {
        let dir = many.join(format!("d{d}"));
        fs::create_dir(&dir).expect("mkdir");
        for f in 0..100 {
            write(
                &dir.join(format!("f{f}")),
                &bytes(d * 100 + f, 100 + f as usize),
            );
        }
    }
    // One fragmented file alone: the threads can only share it by offset.
    let one = fs.path("one");
    subvolume_create(&one);
    let extents = make_fragmented_file(&one.join("db"), 64 * MIB, 20_000, 3).expect("fragment");
    assert!(extents > 10_000, "only {extents} extents");
    sync();

    for tree in [&many, &one] {
        let dir = File::open(tree).expect("open tree");
        let expected = keys_one_pass(&dir);
        for threads in [1, 2, 3, 8, 32] {
            let ranges = keys_swept(&dir, threads);
            for (start, keys) in &ranges {
                assert!(
                    keys.first().is_none_or(|k| k >= start),
                    "a key before its range"
                );
            }
            // Ranges in key order, each read in key order: together, the
            // order one thread reads the tree in.
            let all: Vec<ItemKey> = ranges.into_iter().flat_map(|(_, keys)| keys).collect();
            assert_eq!(
                all.len(),
                expected.len(),
                "{} on {threads} threads: item count",
                tree.display()
            );
            assert!(all == expected, "{} on {threads} threads", tree.display());
        }
    }

    // The fragmented file's extent items were shared out by offset.
    let dir = File::open(&one).expect("open tree");
    let ranges = keys_swept(&dir, 4);
    let sharing = ranges
        .iter()
        .filter(|(_, keys)| {
            keys.iter()
                .filter(|k| k.item_type == EXTENT_DATA_KEY)
                .count()
                > 1000
        })
        .count();
    assert!(
        sharing >= 2,
        "only {sharing} ranges read the file's extents"
    );
}

/// `btrfs filesystem usage -b`: (metadata size, metadata used, global
/// reserve, device unallocated).
fn fi_usage(mnt: &Path) -> (u64, u64, u64, u64) {
    let out = run(Command::new("btrfs")
        .args(["filesystem", "usage", "-b"])
        .arg(mnt))
    .expect("btrfs filesystem usage");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let number_after = |line: &str, label: &str| -> Option<u64> {
        let rest = &line[line.find(label)? + label.len()..];
        rest.trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let (mut size, mut used, mut reserve, mut unallocated) = (None, None, None, None);
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("Metadata,") {
            size = number_after(t, "Size:");
            used = number_after(t, "Used:");
        } else if t.starts_with("Global reserve:") {
            reserve = number_after(t, "Global reserve:");
        } else if t.starts_with("Device unallocated:") {
            unallocated = number_after(t, "Device unallocated:");
        }
    }
    match (size, used, reserve, unallocated) {
        (Some(s), Some(u), Some(r), Some(a)) => (s, u, r, a),
        _ => panic!("unexpected btrfs filesystem usage output:\n{text}"),
    }
}

#[test]
fn metadata_space_equals_btrfs_filesystem_usage() {
    let fs = fs_or_skip!(LoopFs::btrfs(1024 * MIB));
    let dir = fs.path("files");
    fs::create_dir(&dir).expect("mkdir");
    for i in 0..2000u64 {
        write(&dir.join(format!("f{i}")), &bytes(i, 1500));
    }
    sync();
    let root = File::open(fs.mount_point()).expect("open mount point");
    let ours = volume::sys::metadata_space(root.as_fd()).expect("metadata space");
    let (size, used, reserve, unallocated) = fi_usage(fs.mount_point());
    assert_eq!(
        (ours.total, ours.used, ours.global_reserve, ours.unallocated),
        (size, used, reserve, unallocated),
        "ours vs btrfs filesystem usage: {ours:?}"
    );
    assert_eq!(ours.copies, 2, "single-device metadata is DUP");
    assert!(ours.used > 2000 * 1500, "inline data is metadata: {ours:?}");
    assert_eq!(
        ours.free(),
        size - used - reserve + unallocated / 2,
        "{ours:?}"
    );
}

#[test]
fn a_panicking_visitor_stops_the_sweep_and_the_panic_reaches_the_caller() {
    let fs = fs_or_skip!(LoopFs::btrfs(512 * MIB));
    let tree = fs.path("tree");
    subvolume_create(&tree);
    for i in 0..4u64 {
        write(&tree.join(format!("f{i}")), &bytes(i, 100));
    }
    sync();
    let dir = File::open(&tree).expect("open tree");
    let caller = std::thread::spawn(move || {
        sweep::sweep(
            dir.as_fd(),
            0,
            2,
            || (),
            |_, key, _| {
                assert!(key.objectid != 258, "the visitor fails on inode 258");
                Ok(())
            },
        )
        .map(|ranges| ranges.len())
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !caller.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweep must end, not wait for the dead thread"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let panic = caller
        .join()
        .expect_err("the visitor's panic must reach the caller");
    let msg = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or_default();
    assert!(msg.contains("inode 258"), "unexpected panic: {msg:?}");
}

#[test]
fn partly_written_preallocation_is_booked_as_compsize_books_it() {
    let fs = fs_or_skip!(LoopFs::btrfs(1024 * MIB));
    let tree = fs.path("tree");
    subvolume_create(&tree);
    // Writes into a preallocated extent split it into regular and prealloc
    // references to the same disk extent; compsize books its bytes under
    // the type of the first reference in key order, whichever thread of a
    // parallel sweep reads it.
    let db = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(tree.join("db"))
        .expect("create db");
    rustix::fs::fallocate(&db, rustix::fs::FallocateFlags::empty(), 0, 64 * MIB)
        .expect("fallocate");
    for i in 0..(64 * MIB / (16 << 10)) {
        db.write_all_at(&bytes(i, 4096), i * (16 << 10))
            .expect("write");
    }
    db.sync_all().expect("sync db");
    // A later file whose first reference to that extent is a prealloc one
    // (a clone of an unwritten part), among many extents of its own.
    let other = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(tree.join("other"))
        .expect("create other");
    volume::sys::ficlone_range(other.as_fd(), db.as_fd(), 4096, 12 << 10).expect("clone");
    for i in 0..2000u64 {
        other
            .write_all_at(&bytes(1000 + i, 4096), MIB + i * (8 << 10))
            .expect("write");
    }
    drop((db, other));
    sync();
    let theirs = compsize(&[], &tree);
    let dir = File::open(&tree).expect("open tree");
    for run in 0..10 {
        let (ours, _) = volume::usage::subvolume_usage(dir.as_fd()).expect("usage");
        assert_eq!(ours, theirs, "run {run}: ours vs compsize");
    }
}
