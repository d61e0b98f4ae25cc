//! `startos-volume` and `volume-migrate` against a hostile package and an
//! unlucky operator, on loop-mounted btrfs: names a package plants inside
//! its volume, full filesystems (data, metadata, 97%), a step that fails
//! half-way, stray entries in the volumes root, ids too long for NAME_MAX,
//! a root that is the top of a filesystem, nested subvolumes through backup
//! and restore, and a mount held in another mount namespace.
//!
//! The promise checked throughout: every command either succeeds or exits
//! non-zero with one line on stderr, and then each package's contents are
//! intact and no name is left that the next command would act on.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::cli::*;
use common::*;
use integration::{LoopFs, TreeDigest, fs_or_skip, run};
use volume::{SnapshotOutcome, VolumeKind, VolumeStore};

/// A binary of the workspace, beside this test's own directory (`make test`
/// builds every binary first, with the same features), or in
/// `$HOSTILE_BIN_DIR` (to run these tests against another build).
fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("HOSTILE_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    integration::workspace_bin(name).unwrap_or_else(|e| panic!("{e}; run `make test`"))
}

/// Runs `startos-volume --root <root> <args>` with `env` set.
fn volume_cli(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin("startos-volume"));
    cmd.arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG");
    cmd.env_remove(volume::FAILPOINT_ENV);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null())
        .output()
        .expect("running startos-volume")
}

fn migrate_cli(root: &Path, args: &[&str]) -> Output {
    Command::new(bin("volume-migrate"))
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove(volume::FAILPOINT_ENV)
        .stdin(Stdio::null())
        .output()
        .expect("running volume-migrate")
}

// ---------------------------------------------------------------- planted names

/// The item of the issue this closes: a package plants the old completion
/// marker at the top of its volume, an update takes its backup, the data
/// changes, and the restore must still put the backup back (the old code
/// took the live volume for a finished rollback and dropped the backup).
#[test]
fn a_marker_planted_at_the_top_of_the_volume_decides_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    must_succeed(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        "create",
    );
    fs::write(root.join("app/data/main/state"), b"before the update").unwrap();
    fs::write(root.join("app/.startos-rollback-complete"), b"0 0 0 0\n").unwrap();
    must_succeed(&volume_cli(&root, &["snapshot", "app"], &[]), "snapshot");
    let backup = digest(&root.join("app.install-backup"));
    fs::write(root.join("app/data/main/state"), b"after a failed update").unwrap();
    // And again after the snapshot, as the service can at any time.
    fs::write(root.join("app/.startos-rollback-complete"), b"0 0 0 0\n").unwrap();
    let out = must_succeed(&volume_cli(&root, &["restore", "app"], &[]), "restore");
    assert!(out.starts_with("restored "), "{out}");
    assert_eq!(
        fs::read(root.join("app/data/main/state")).unwrap(),
        b"before the update"
    );
    assert_same(&backup, &digest(&root.join("app")), "the restored volume");
    Expect::of(&root, "app").check(&root, "app", "after the restore");
}

/// Every name the crates use, for a package and as bare markers.
fn crate_names(pkg: &str) -> Vec<String> {
    let mut names: Vec<String> = volume::layout::SUFFIXES
        .iter()
        .map(|s| format!("{pkg}{s}"))
        .collect();
    names.push(pkg.to_owned());
    names.push(".startos-rollback-complete".to_owned());
    names
}

/// Plants `name` in `dir` as `kind`: a file holding what a record of ours
/// would (the live volume's own identity, say), a directory, or a symlink
/// out of the volume.
fn plant(dir: &Path, name: &str, kind: &str, forged: &str) {
    let path = dir.join(name);
    match kind {
        "file" => fs::write(&path, forged).unwrap(),
        "dir" => {
            fs::create_dir_all(&path).unwrap();
            fs::write(path.join("inside"), forged).unwrap();
        }
        "symlink" => symlink(forged, &path).unwrap(),
        other => unreachable!("{other}"),
    }
}

/// For every name the crates use, planted inside the volume (at its top and
/// below, as a file, a directory, or a symlink whose target reads like one
/// of our records), a snapshot, restore, recovery and delete do exactly
/// what they do without it.
#[test]
fn every_name_the_crates_use_planted_in_a_volume_changes_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    let app = pkg("app");
    let mut cases = 0;
    for name in crate_names("app") {
        for place in ["", "data/main"] {
            for kind in ["file", "dir", "symlink"] {
                let when = format!("{name:?} planted as a {kind} at {place:?}");
                store.create(&app, &[vol("main")]).unwrap();
                populate_volume(&store.volume_path(&app), true);
                let live = store.volume_path(&app);
                // What a record would hold: the live volume's own identity.
                let uuid = volume::sys::subvolume_info(std::os::fd::AsFd::as_fd(
                    &fs::File::open(&live).unwrap(),
                ))
                .unwrap()
                .uuid;
                let forged = format!(
                    "subvolume {}",
                    uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
                );
                plant(&live.join(place), &name, kind, &forged);
                assert_eq!(store.snapshot(&app).unwrap(), SnapshotOutcome::Snapshot);
                let backup = digest(&store.backup_path(&app));
                modify_volume(&live, true);
                assert!(
                    store.recover_all().unwrap().is_empty(),
                    "{when}: recovery must find nothing to do"
                );
                assert!(store.restore(&app).unwrap(), "{when}: restore");
                assert_same(&backup, &digest(&live), &format!("{when}: restored"));
                Expect::of(&root, "app").check(&root, "app", &when);
                assert!(store.recover_all().unwrap().is_empty(), "{when}");
                assert_eq!(store.snapshot(&app).unwrap(), SnapshotOutcome::Snapshot);
                assert!(store.delete(&app).unwrap(), "{when}: delete");
                assert!(
                    root_names(&root).is_empty(),
                    "{when}: {:?}",
                    root_names(&root)
                );
                assert!(package_subvolumes(&fs, "app").is_empty(), "{when}");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, crate_names("app").len() * 6);
}

// ---------------------------------------------------------------- failed steps

/// Everything below `root`: the root's own times change whenever a name is
/// made and removed in it, which is no package's data.
fn tree_below(root: &Path) -> TreeDigest {
    let mut d = digest(root);
    if let Some(top) = d.entries_mut().get_mut(&Vec::new()) {
        top.mtime = None;
    }
    d
}

/// A package with nested subvolumes, a backup, then changed data.
fn app_with_backup(root: &Path) {
    let store = VolumeStore::open(root).unwrap();
    let app = pkg("app");
    store.create(&app, &[vol("main")]).unwrap();
    populate_volume(&store.volume_path(&app), true);
    assert_eq!(store.snapshot(&app).unwrap(), SnapshotOutcome::Snapshot);
    modify_volume(&store.volume_path(&app), true);
}

/// Each step of a restore fails with ENOSPC in turn: before the exchange
/// the disk is left exactly as it was; after it (the commit point) the next
/// command finishes the restore. Either way the service's later writes are
/// never thrown away by a later command.
#[test]
fn a_restore_failing_at_any_step_leaves_the_disk_as_before_or_finishes_later() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    app_with_backup(&root);
    for (step, committed) in [
        ("restore.copied", false),
        ("restore.recorded", false),
        ("restore.exchanged", true),
        ("restore.replaced-moved", true),
        ("drop.renamed", true),
        ("restore.backup-dropped", true),
    ] {
        let before = Expect::of(&root, "app");
        let whole = tree_below(&root);
        let spec = format!("{step}=enospc");
        let out = volume_cli(
            &root,
            &["restore", "app"],
            &[(volume::FAILPOINT_ENV, &spec)],
        );
        must_fail(&out, &format!("restore failing at {step}"), "No space left");
        if !committed {
            assert_same(&whole, &tree_below(&root), &format!("failed at {step}"));
            before.check(&root, "app", &format!("after failing at {step}"));
            // The service goes on writing; the next command must keep it.
            fs::write(root.join("app/data/main/after-the-failure"), step).unwrap();
            let out = volume_cli(&root, &["snapshot", "app"], &[]);
            must_fail(&out, "a snapshot over the backup", "already exists");
            assert_eq!(
                fs::read(root.join("app/data/main/after-the-failure")).unwrap(),
                step.as_bytes(),
                "{step}: the next command threw away what the service wrote"
            );
            fs::remove_file(root.join("app/data/main/after-the-failure")).unwrap();
        } else {
            must_succeed(&volume_cli(&root, &["recover", "app"], &[]), "recover");
            Expect {
                live: before.backup.clone(),
                backup: None,
            }
            .check(&root, "app", &format!("failed at {step}, then recovered"));
            // A new backup and a change, for the next step.
            must_succeed(&volume_cli(&root, &["snapshot", "app"], &[]), "snapshot");
            modify_volume(&root.join("app"), false);
        }
    }
}

/// The same for a snapshot (plain or reflink) and a delete: a failed
/// snapshot leaves no backup and no `.tmp`; a delete fails before its
/// commit point with nothing changed.
#[test]
fn a_snapshot_or_delete_failing_half_way_leaves_nothing_half_made() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    store.create(&pkg("app"), &[vol("main")]).unwrap();
    populate_volume(&root.join("app"), true);
    // A read-only nested subvolume, so the snapshot writes its record.
    let ro = root.join("app/data/main/frozen");
    subvolume_create(&ro);
    fs::write(ro.join("f"), b"frozen").unwrap();
    run(Command::new("btrfs")
        .args(["property", "set", "-ts"])
        .arg(&ro)
        .args(["ro", "true"]))
    .unwrap();
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    populate_volume(&root.join("plain"), false);
    for (pkg, step) in [
        ("app", "snapshot.created"),
        ("app", "snapshot.frozen"),
        ("plain", "snapshot.created"),
    ] {
        let before = Expect::of(&root, pkg);
        let out = volume_cli(
            &root,
            &["snapshot", pkg],
            &[(volume::FAILPOINT_ENV, &format!("{step}=enospc"))],
        );
        must_fail(
            &out,
            &format!("snapshot of {pkg} failing at {step}"),
            "No space left",
        );
        before.check(&root, pkg, &format!("snapshot of {pkg} failing at {step}"));
    }
    must_succeed(&volume_cli(&root, &["snapshot", "app"], &[]), "snapshot");
    let before = Expect::of(&root, "app");
    let out = volume_cli(
        &root,
        &["delete", "app"],
        &[(volume::FAILPOINT_ENV, "delete.renamed=enospc")],
    );
    must_fail(&out, "delete failing after its rename", "No space left");
    // Past the commit point: the next command finishes the delete.
    let _ = before;
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(
        package_names(&root, "app").is_empty(),
        "{:?}",
        root_names(&root)
    );
    assert!(package_subvolumes(&fs, "app").is_empty());
}

/// The undo of a failed restore, itself failing or killed half-way, never
/// swaps a half-deleted copy in: the record goes before the copy, so the
/// next command finds garbage and the backup (with its read-only nested
/// subvolume) as it was.
#[test]
fn the_undo_of_a_failed_restore_killed_or_failing_half_way_keeps_the_backup() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    app_with_backup(&root);
    let frozen = root.join("app/data/main/nested/frozen");
    subvolume_create(&frozen);
    fs::write(frozen.join("f"), b"frozen").unwrap();
    set_read_only(&frozen);
    let store = VolumeStore::open(&root).unwrap();
    store.drop_backup(&pkg("app")).unwrap();
    assert_eq!(
        store.snapshot(&pkg("app")).unwrap(),
        SnapshotOutcome::Snapshot
    );
    fs::write(root.join("app/data/main/after-the-backup"), b"changed").unwrap();
    let before = Expect::of(&root, "app");
    for (spec, killed) in [
        ("restore.recorded=enospc,delete-entry.writable", true),
        (
            "restore.recorded=enospc,delete-entry.writable=enospc",
            false,
        ),
    ] {
        let out = volume_cli(&root, &["restore", "app"], &[(volume::FAILPOINT_ENV, spec)]);
        if killed {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{spec}: {out:?}");
        } else {
            must_fail(&out, spec, "failed too");
        }
        must_succeed(&volume_cli(&root, &["list"], &[]), "list after the undo");
        before.check(&root, "app", spec);
        assert!(
            is_read_only(&root.join("app.install-backup/data/main/nested/frozen")),
            "{spec}: the backup's nested subvolume must stay read-only"
        );
    }
    // And the backup still restores, flags and all.
    must_succeed(&volume_cli(&root, &["restore", "app"], &[]), "restore");
    assert_same(
        before.backup.as_ref().unwrap(),
        &digest(&root.join("app")),
        "restored",
    );
    assert!(is_read_only(&root.join("app/data/main/nested/frozen")));
}

/// What an earlier version's reflink restore could leave, cut short: its
/// backup moved to `<pkg>.rollback`, no backup, no record. That may be the
/// only copy of the backup's data: never deleted, refused with one line.
#[test]
fn a_rollback_copy_with_no_record_and_no_backup_is_never_deleted() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("app/data/main")).unwrap();
    fs::write(root.join("app/data/main/state"), b"current").unwrap();
    fs::create_dir_all(root.join("app.rollback/data/main")).unwrap();
    fs::write(root.join("app.rollback/data/main/state"), b"pre-update").unwrap();
    let before = tree_below(&root);
    for args in [
        &["recover", "app"][..],
        &["snapshot", "app"],
        &["restore", "app"],
    ] {
        must_fail(&volume_cli(&root, args, &[]), &format!("{args:?}"), "only");
        assert_same(&before, &tree_below(&root), &format!("{args:?}"));
    }
}

/// Non-directories under the names of a package's trees (a file `app.delete`,
/// a FIFO `app.replaced`, ...) are no state of ours: nothing acts on them,
/// the package's commands refuse with one line naming them, and the rest of
/// the root goes on.
#[test]
fn a_stray_file_under_a_transient_name_drives_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    app_with_backup(&root);
    must_succeed(
        &volume_cli(&root, &["create", "other", "main"], &[]),
        "create",
    );
    for suffix in [
        ".delete",
        ".replaced",
        ".rollback",
        ".install-backup.tmp",
        ".install-backup.drop",
        ".install-backup.ro",
        ".restore-old",
        ".convert-old",
    ] {
        let stray = root.join(format!("app{suffix}"));
        if suffix == ".replaced" {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                &stray,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(0o644),
                0,
            )
            .unwrap();
        } else {
            fs::write(&stray, b"not ours").unwrap();
        }
        let before = Expect::of(&root, "app");
        let out = volume_cli(&root, &["--json", "list"], &[]);
        let listed = must_succeed(&out, &format!("list beside {suffix}"));
        assert!(listed.contains("\"other\""), "{listed}");
        // A command that must look at the stray refuses, naming it (with a
        // backup there, a snapshot is refused anyway: a drop reads the
        // backup's read-only record).
        let op = if suffix == ".install-backup.ro" {
            "drop"
        } else {
            "snapshot"
        };
        must_fail(
            &volume_cli(&root, &[op, "app"], &[]),
            &format!("{op} beside {suffix}"),
            &format!("app{suffix}"),
        );
        must_succeed(
            &volume_cli(&root, &["snapshot", "other"], &[]),
            "other's snapshot",
        );
        must_succeed(&volume_cli(&root, &["drop", "other"], &[]), "other's drop");
        // Nothing of app's changed, the stray included.
        assert_same(
            before.live.as_ref().unwrap(),
            &digest(&root.join("app")),
            suffix,
        );
        assert_same(
            before.backup.as_ref().unwrap(),
            &digest(&root.join("app.install-backup")),
            suffix,
        );
        assert!(
            fs::symlink_metadata(&stray).is_ok(),
            "{suffix}: the stray is gone"
        );
        fs::remove_file(&stray).unwrap();
    }
}

/// A reflink restore cut short after its exchange, then volume-migrate: the
/// conversion finishes the restore first (converting the recorded volume
/// would change the identity its recovery goes by and strand it).
#[test]
fn volume_migrate_finishes_an_interrupted_restore_before_converting() {
    use std::os::unix::process::ExitStatusExt;
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    populate_volume(&root.join("plain"), false);
    must_succeed(
        &volume_cli(&root, &["snapshot", "plain"], &[]),
        "reflink snapshot",
    );
    let backup = digest(&root.join("plain.install-backup"));
    modify_volume(&root.join("plain"), false);
    let out = volume_cli(
        &root,
        &["restore", "plain"],
        &[(volume::FAILPOINT_ENV, "restore.exchanged")],
    );
    assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{out:?}");
    must_succeed(&migrate_cli(&root, &[]), "volume-migrate");
    for args in [
        &["recover", "plain"][..],
        &["snapshot", "plain"],
        &["drop", "plain"],
    ] {
        must_succeed(
            &volume_cli(&root, args, &[]),
            &format!("{args:?} after the conversion"),
        );
    }
    assert_same(
        &common::rich::expected_after(&backup),
        &digest(&root.join("plain")),
        "the restored volume, converted",
    );
    assert_eq!(root_names(&root), ["plain"]);
}

/// More read-only nested subvolumes than a symlink's target could list: the
/// backup still records every one, and the restore gives each back
/// read-only.
#[test]
fn hundreds_of_read_only_nested_subvolumes_are_backed_up_and_restored() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    store.create(&pkg("app"), &[vol("main")]).unwrap();
    let snaps = root.join("app/data/main/snapshots");
    fs::create_dir_all(&snaps).unwrap();
    let dir = volume::sys::open_dir_path(&snaps).unwrap();
    const N: usize = 600;
    for i in 0..N {
        let name = std::ffi::OsString::from(format!("s{i:04}"));
        volume::sys::create_subvolume(std::os::fd::AsFd::as_fd(&dir), &name).unwrap();
        let sub = volume::sys::open_dir_at(std::os::fd::AsFd::as_fd(&dir), &name).unwrap();
        volume::sys::set_read_only(std::os::fd::AsFd::as_fd(&sub), true).unwrap();
    }
    let before = digest(&root.join("app"));
    assert_eq!(
        store.snapshot(&pkg("app")).unwrap(),
        SnapshotOutcome::Snapshot
    );
    fs::write(root.join("app/data/main/after"), b"x").unwrap();
    assert!(store.restore(&pkg("app")).unwrap());
    assert_same(&before, &digest(&root.join("app")), "restored");
    for i in [0, N / 2, N - 1] {
        assert!(
            is_read_only(&snaps.join(format!("s{i:04}"))),
            "s{i:04} must come back read-only"
        );
    }
}

// ---------------------------------------------------------------- full filesystems

/// How to fill a filesystem.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Data to 97% of the filesystem.
    Data97,
    /// Data until ENOSPC.
    Data100,
    /// Data, then empty files with large xattrs until ENOSPC: metadata full.
    Metadata,
}

fn fill(fs: &LoopFs, how: Fill) {
    use std::io::Write;
    let filler = fs.path("filler");
    let mut f = fs::File::create(&filler).unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    let limit = match how {
        Fill::Data97 => {
            let st = rustix::fs::statvfs(fs.mount_point()).unwrap();
            let total = st.f_blocks * st.f_frsize;
            let used = (st.f_blocks - st.f_bfree) * st.f_frsize;
            (total * 97 / 100).saturating_sub(used)
        }
        Fill::Data100 | Fill::Metadata => u64::MAX,
    };
    let mut written = 0u64;
    while written < limit {
        let n = chunk.len().min((limit - written) as usize);
        match f.write_all(&chunk[..n]) {
            Ok(()) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling: {e}"),
        }
    }
    // Delayed allocation may only fail at writeback.
    let _ = f.sync_all();
    drop(f);
    rustix::fs::sync();
    if let Fill::Metadata = how {
        let dir = fs.path("xattrs");
        fs::create_dir_all(&dir).unwrap();
        let value = vec![b'x'; 3900];
        for i in 0.. {
            let p = dir.join(format!("f{i}"));
            if fs::File::create(&p).is_err() {
                break;
            }
            if rustix::fs::setxattr(&p, "user.fill", &value, rustix::fs::XattrFlags::empty())
                .is_err()
            {
                break;
            }
        }
        rustix::fs::sync();
    }
}

/// Packages for a full filesystem: `app` (nested subvolumes, a backup, then
/// changes), `two` (a backup, no nested subvolume), `plain` (a plain
/// directory, not yet converted).
fn packages_to_fill(root: &Path) {
    app_with_backup(root);
    let store = VolumeStore::open(root).unwrap();
    store.create(&pkg("two"), &[vol("main")]).unwrap();
    populate_volume(&root.join("two"), false);
    store.snapshot(&pkg("two")).unwrap();
    fs::write(root.join("two/data/main/config.toml"), b"changed\n").unwrap();
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    populate_volume(&root.join("plain"), false);
}

/// Runs every command on a filled filesystem: each succeeds or fails with
/// one line, and afterwards every package is intact and has no leftover
/// name. Returns which commands succeeded.
fn commands_on_a_full_filesystem(how: Fill) -> Option<BTreeMap<String, bool>> {
    let fs = fs_or_skip!(LoopFs::btrfs(256 * MIB), None);
    let root = volumes_root(&fs);
    packages_to_fill(&root);
    fill(&fs, how);
    let mut expect: BTreeMap<&str, Expect> = ["app", "two", "plain"]
        .into_iter()
        .map(|p| (p, Expect::of(&root, p)))
        .collect();
    let mut outcome = BTreeMap::new();
    let steps: &[(&str, &[&str])] = &[
        ("usage", &["usage", "app"]),
        ("list", &["list"]),
        ("recover", &["recover"]),
        ("snapshot-plain", &["snapshot", "plain"]),
        ("drop-plain", &["drop", "plain"]),
        ("restore-two", &["restore", "two"]),
        ("snapshot-two", &["snapshot", "two"]),
        ("drop-two", &["drop", "two"]),
        ("restore-app", &["restore", "app"]),
        ("create", &["create", "fresh", "main"]),
        ("delete-two", &["delete", "two"]),
        ("drop-app", &["drop", "app"]),
        ("delete-app", &["delete", "app"]),
    ];
    for (name, args) in steps {
        let when = format!("{how:?}: {args:?}");
        let out = volume_cli(&root, args, &[]);
        let ok = succeeded_or_one_line(&out, &when);
        outcome.insert(name.to_string(), ok);
        if ok {
            // What a success changed.
            match *name {
                "restore-two" | "restore-app" => {
                    let p = &args[1];
                    let e = expect.get_mut(p).unwrap();
                    *e = Expect {
                        live: e.backup.take(),
                        backup: None,
                    };
                }
                "snapshot-plain" | "snapshot-two" | "drop-plain" | "drop-two" | "drop-app"
                | "delete-two" | "delete-app" => {
                    let p = args[1];
                    expect.insert(p, Expect::of(&root, p));
                }
                _ => {}
            }
        }
        for (p, e) in &expect {
            e.check(&root, p, &when);
        }
        match *name {
            "snapshot-plain" | "snapshot-two" if ok => {
                let p = args[1];
                assert!(
                    expect[p].backup.is_none()
                        || expect[p].backup.as_ref() == expect[p].live.as_ref(),
                    "{when}: a backup must be the volume"
                );
            }
            "delete-two" | "delete-app" if ok => {
                let p = args[1];
                assert!(
                    expect[p].live.is_none() && expect[p].backup.is_none(),
                    "{when}"
                );
            }
            "create" if !ok => {
                assert!(package_names(&root, "fresh").is_empty(), "{when}");
            }
            _ => {}
        }
    }
    // volume-migrate: the dry run and the run, on the plain directory.
    let before = Expect::of(&root, "plain");
    let out = migrate_cli(&root, &["--dry-run"]);
    outcome.insert(
        "migrate-dry-run".into(),
        succeeded_or_one_line(&out, "dry run"),
    );
    let out = migrate_cli(&root, &[]);
    let migrated = succeeded_or_one_line(&out, &format!("{how:?}: volume-migrate"));
    outcome.insert("migrate".into(), migrated);
    let live = root.join("plain");
    let want = before.live.as_ref().unwrap();
    let want = if migrated {
        common::rich::expected_after(want)
    } else {
        want.clone()
    };
    assert_same(
        &want,
        &digest(&live),
        &format!("{how:?}: plain after volume-migrate"),
    );
    assert!(
        root_names(&root).iter().all(|n| !n.contains(".migrate")),
        "{how:?}: volume-migrate left {:?}",
        root_names(&root)
    );
    Some(outcome)
}

#[test]
fn with_data_full_every_command_works() {
    let Some(outcome) = commands_on_a_full_filesystem(Fill::Data100) else {
        return;
    };
    // A snapshot, a restore, a drop and a delete need metadata space only.
    for (step, ok) in &outcome {
        assert!(ok, "with data full, {step} must succeed: {outcome:?}");
    }
}

#[test]
fn at_97_percent_every_command_works() {
    let Some(outcome) = commands_on_a_full_filesystem(Fill::Data97) else {
        return;
    };
    for (step, ok) in &outcome {
        assert!(ok, "at 97%, {step} must succeed: {outcome:?}");
    }
}

#[test]
fn with_metadata_full_what_frees_space_still_works() {
    let Some(outcome) = commands_on_a_full_filesystem(Fill::Metadata) else {
        return;
    };
    eprintln!("with metadata full: {outcome:?}");
    // Nothing takes a lock file on the data filesystem any more, and
    // deleting a subvolume may use the global reserve: reading, and
    // dropping or deleting what has no nested subvolume, must work.
    for step in [
        "usage",
        "list",
        "recover",
        "drop-two",
        "delete-two",
        "migrate-dry-run",
    ] {
        assert!(
            outcome[step],
            "with metadata full, {step} must succeed: {outcome:?}"
        );
    }
}

// ---------------------------------------------------------------- stray entries

/// A file, a symlink and a FIFO under valid package names in the volumes
/// root: `list` and `volume-migrate` skip them and go on; `delete` and the
/// other commands refuse them; they stay as they were.
#[test]
fn stray_entries_in_the_root_are_skipped_or_refused_and_left_alone() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    must_succeed(
        &volume_cli(&root, &["create", "app", "main"], &[]),
        "create",
    );
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    fs::write(root.join("plain/data/main/f"), b"plain").unwrap();
    fs::write(root.join("notes"), b"the operator's notes").unwrap();
    symlink("/etc", root.join("link")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("pipe"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let check_strays = |when: &str| {
        assert_eq!(
            fs::read(root.join("notes")).unwrap(),
            b"the operator's notes",
            "{when}"
        );
        assert_eq!(
            fs::read_link(root.join("link")).unwrap(),
            Path::new("/etc"),
            "{when}"
        );
        assert!(
            fs::symlink_metadata(root.join("pipe"))
                .unwrap()
                .file_type()
                .is_fifo(),
            "{when}"
        );
    };

    let out = volume_cli(&root, &["--json", "list"], &[]);
    let listed: serde_json::Value =
        serde_json::from_str(&must_succeed(&out, "list")).expect("list --json");
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["package"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["app", "plain"]);
    let warned = text(&out.stderr);
    for stray in ["notes", "link", "pipe"] {
        assert!(
            warned.contains(stray),
            "list must say it skipped {stray}: {warned}"
        );
    }

    let out = migrate_cli(&root, &["--dry-run"]);
    let said = must_succeed(&out, "volume-migrate --dry-run");
    assert!(!said.contains("leftovers"), "{said}");
    for stray in ["notes", "link", "pipe"] {
        assert!(
            !said.contains(stray),
            "the dry run must not plan {stray}: {said}"
        );
    }
    must_succeed(&migrate_cli(&root, &[]), "volume-migrate");
    assert_eq!(
        VolumeStore::open(&root).unwrap().list().unwrap()[1].volume,
        Some(VolumeKind::Subvolume),
        "plain was converted all the same"
    );
    for (op, stray, what) in [
        ("delete", "notes", "a regular file"),
        ("delete", "link", "a symlink"),
        ("delete", "pipe", "a FIFO"),
        ("snapshot", "notes", "a regular file"),
        ("usage", "pipe", "a FIFO"),
        ("restore", "link", "a symlink"),
    ] {
        let out = volume_cli(&root, &[op, stray], &[]);
        must_fail(
            &out,
            &format!("{op} {stray}"),
            &format!("is {what}, not a package volume"),
        );
        check_strays(&format!("after {op} {stray}"));
    }
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    check_strays("at the end");
}

// ---------------------------------------------------------------- ids, locks

/// Ids whose longest derived name would not fit NAME_MAX are invalid ids,
/// refused before anything is made; the longest valid one works throughout.
#[test]
fn ids_too_long_for_their_names_are_invalid_and_the_longest_valid_one_works() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for len in [236, 240, 255] {
        let id = "a".repeat(len);
        for args in [
            vec!["create", id.as_str(), "main"],
            vec!["snapshot", id.as_str()],
            vec!["delete", id.as_str()],
        ] {
            let out = volume_cli(&root, &args, &[]);
            let err = must_fail(
                &out,
                &format!("{} of a {len}-character id", args[0]),
                "at most 235",
            );
            assert!(err.contains("Invalid ID"), "{err}");
        }
        assert!(root_names(&root).is_empty(), "{:?}", root_names(&root));
        assert!(!lock_path(&root, &id).exists(), "no lock for an invalid id");
    }
    let id = "b".repeat(235);
    for args in [
        vec!["create", id.as_str(), "main"],
        vec!["snapshot", id.as_str()],
        vec!["restore", id.as_str()],
        vec!["snapshot", id.as_str()],
        vec!["drop", id.as_str()],
        vec!["delete", id.as_str()],
    ] {
        must_succeed(
            &volume_cli(&root, &args, &[]),
            &format!("{} of a 235-character id", args[0]),
        );
    }
    assert!(root_names(&root).is_empty(), "{:?}", root_names(&root));
}

/// With `--root` at the very top of a filesystem, among the operator's own
/// files, no command leaves anything beside the volumes: no lock file, even
/// for a package that does not exist.
#[test]
fn no_command_leaves_a_lock_file_beside_the_volumes() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = fs.mount_point().to_path_buf();
    fs::write(root.join("operator-notes.txt"), b"mine").unwrap();
    let before = root_names(&root);
    let r = &root;
    must_succeed(&volume_cli(r, &["create", "app", "main"], &[]), "create");
    for args in [
        &["snapshot", "app"][..],
        &["usage", "app"],
        &["list"],
        &["restore", "app"],
        &["snapshot", "app"],
        &["drop", "app"],
        &["recover"],
        &["recover", "app"],
    ] {
        must_succeed(&volume_cli(r, args, &[]), &format!("{args:?}"));
        let extra: Vec<String> = root_names(r)
            .into_iter()
            .filter(|n| !before.contains(n) && n != "app" && n != "app.install-backup")
            .collect();
        assert!(extra.is_empty(), "after {args:?}: {extra:?}");
    }
    for op in ["snapshot", "restore", "drop", "delete", "usage", "recover"] {
        must_fail(
            &volume_cli(r, &[op, "ghost"], &[]),
            op,
            "no volume for ghost",
        );
        assert!(
            !lock_path(r, "ghost").exists(),
            "{op} made a lock for ghost"
        );
    }
    must_succeed(&volume_cli(r, &["delete", "app"], &[]), "delete");
    assert_eq!(root_names(r), before);
}

// ---------------------------------------------------------------- nested subvolumes

fn set_read_only(path: &Path) {
    run(Command::new("btrfs")
        .args(["property", "set", "-ts"])
        .arg(path)
        .args(["ro", "true"]))
    .unwrap_or_else(|e| panic!("making {} read-only: {e}", path.display()));
}

/// A volume with a writable and a read-only nested subvolume: the backup
/// keeps both as subvolumes, and the restore gives each back with its own
/// read-only flag, for a subvolume volume (a snapshot backup) and for a
/// plain directory (a reflink backup).
#[test]
fn nested_subvolumes_keep_their_kind_and_read_only_flag_through_backup_and_restore() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    let store = VolumeStore::open(&root).unwrap();
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    store.create(&pkg("subvol"), &[vol("main")]).unwrap();
    for (p, backup) in [("subvol", "snapshot"), ("plain", "reflink")] {
        let live = root.join(p);
        populate_volume(&live, true);
        let frozen = live.join("data/main/frozen");
        subvolume_create(&frozen);
        fs::write(frozen.join("archive"), b"sealed").unwrap();
        set_read_only(&frozen);
        let at_backup = digest(&live);
        let outcome = store.snapshot(&pkg(p)).unwrap();
        assert!(outcome.created(), "{p}: {outcome:?}");
        let b = store.backup_path(&pkg(p));
        for nested in [
            "data/main/nested",
            "data/main/nested/deeper/inner",
            "data/main/frozen",
        ] {
            assert_eq!(
                digest(&b).get(nested).map(|e| e.subvolume),
                Some(integration::Subvolume::Root),
                "{p} ({backup}): {nested} must be a subvolume in the backup"
            );
        }
        assert!(
            is_read_only(&b.join("data/main/frozen")),
            "{p}: frozen, in the backup"
        );
        modify_volume(&live, true);
        assert!(store.restore(&pkg(p)).unwrap());
        assert_same(&at_backup, &digest(&live), &format!("{p} restored"));
        assert!(
            is_read_only(&live.join("data/main/frozen")),
            "{p} ({backup}): the read-only nested subvolume must come back read-only"
        );
        for writable in ["data/main/nested", "data/main/nested/deeper/inner"] {
            assert!(
                !is_read_only(&live.join(writable)),
                "{p} ({backup}): {writable} must come back writable"
            );
            assert_writable(&live.join(writable));
        }
        Expect::of(&root, p).check(&root, p, &format!("{p} after the restore"));
        assert!(store.delete(&pkg(p)).unwrap());
        assert!(package_subvolumes(&fs, p).is_empty(), "{p}");
    }
}

// ---------------------------------------------------------------- mount namespaces

/// A bind mount of the volume that only another mount namespace holds
/// never stops a restore or a delete: each goes on, keeps the tree the
/// mount shows under `app.held` while it is mounted, and names the process
/// and the mount point on one line (a mount point with a newline in its
/// name included); once the process is gone, recovery deletes what it kept.
#[test]
fn a_bind_mount_held_in_another_mount_namespace_never_blocks_restore_or_delete() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    app_with_backup(&root);
    let target = fs.path("container-root/data");
    let holder = NsHolder::bind(&root.join("app/data/main"), &target);
    assert!(
        !integration::is_mounted(&target).unwrap(),
        "the mount must be invisible in this namespace"
    );
    let store = VolumeStore::open(&root).unwrap();
    let uses = store.mount_uses(&pkg("app")).unwrap();
    assert!(
        uses.iter().any(|u| !u.own_namespace
            && u.pids.contains(&holder.pid())
            && u.mount_point == target
            && u.command == "sleep"),
        "{uses:?}"
    );
    // A mount point with a newline in its name (a package can mount
    // inside its own namespace) still makes one line.
    let odd = fs.path("odd\nname");
    let second = NsHolder::bind(&root.join("app/data/main"), &odd);
    let replaced = digest(&root.join("app"));
    let out = volume_cli(&root, &["restore", "app"], &[]);
    must_succeed(&out, "restore under the mounts");
    let warned = text(&out.stderr);
    assert_eq!(warned.lines().count(), 1, "one line: {warned:?}");
    for needle in [
        format!("pid {} (sleep)", holder.pid()),
        target.display().to_string(),
        "odd\\nname".to_owned(),
        "app.held/1".to_owned(),
    ] {
        assert!(warned.contains(&needle), "{needle}: {warned}");
    }
    assert_same(&replaced, &digest(&root.join("app.held/1")), "kept whole");
    let restored = digest(&root.join("app"));
    drop(second);
    // The restored volume, mounted again by the container, then deleted.
    let again = NsHolder::bind(&root.join("app/data/main"), &fs.path("container-2/data"));
    let out = volume_cli(&root, &["delete", "app"], &[]);
    must_succeed(&out, "delete under the mount");
    assert!(text(&out.stderr).contains(&format!("pid {}", again.pid())));
    assert_same(&restored, &digest(&root.join("app.held/2")), "kept whole");
    assert_eq!(root_names(&root), ["app.held"]);
    drop(again);
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(!root.join("app.held/2").exists(), "unmounted: deleted");
    assert!(root.join("app.held/1").exists(), "still mounted: kept");
    drop(holder);
    must_succeed(&volume_cli(&root, &["recover"], &[]), "recover");
    assert!(root_names(&root).is_empty());
}

// ---------------------------------------------------------------- volume-migrate on a small full disk

/// A 1 GiB filesystem filled to 97%: the reserve scales with the filesystem,
/// so the conversion goes through; and a refusal (forced here with a
/// reserve larger than what is free) gives the dry run's figures.
#[test]
fn volume_migrate_converts_on_a_small_filesystem_at_97_percent() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let root = volumes_root(&fs);
    fs::create_dir_all(root.join("plain/data/main")).unwrap();
    populate_volume(&root.join("plain"), false);
    for i in 0..30 {
        fs::write(root.join(format!("plain/data/main/f{i}")), bytes(i, 9000)).unwrap();
    }
    fill(&fs, Fill::Data97);
    let before = digest(&root.join("plain"));
    let out = migrate_cli(&root, &["--dry-run", "--json"]);
    let lines: Vec<serde_json::Value> = must_succeed(&out, "dry run")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let plan = lines
        .iter()
        .find(|l| l["package"] == "plain")
        .unwrap_or_else(|| panic!("no plan for plain: {lines:?}"));
    let summary = lines.iter().find(|l| l["event"] == "summary").unwrap();
    assert_eq!(summary["enough_space"], true, "{summary}");
    let reserve = summary["metadata_reserve"].as_u64().unwrap();
    assert!(
        reserve < 64 << 20,
        "the reserve must scale down on 1 GiB: {reserve}"
    );
    let m = volume_migrate::Migrator::open(&root).unwrap();
    let est = m.plan().unwrap()[0].estimate.unwrap();
    assert!(
        plan.to_string().contains(&est.entries.to_string()),
        "{plan}"
    );
    let out = migrate_cli(&root, &[]);
    must_succeed(&out, "volume-migrate");
    assert_same(
        &common::rich::expected_after(&before),
        &digest(&root.join("plain")),
        "converted",
    );
    assert!(root_names(&root).iter().all(|n| !n.contains(".migrate")));
}

/// A delete past its commit point (`<pkg>.delete`, as a crash just after it
/// leaves it), then the metadata space full: recovery, which moves such a
/// tree into the trash (a rename and maybe a new directory, both needing
/// metadata space), deletes it in place instead, in one step, which frees
/// space; before, every recovery of the package failed ("No space left on
/// device"), and so every operation of it.
#[test]
fn with_metadata_full_a_pending_delete_is_still_finished() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 * MIB));
    let root = volumes_root(&fs);
    packages_to_fill(&root);
    fs::rename(root.join("two"), root.join("two.delete")).unwrap();
    fill(&fs, Fill::Metadata);
    let out = volume_cli(&root, &["recover"], &[]);
    assert!(
        out.status.success(),
        "recover on a full filesystem: {}",
        text(&out.stderr)
    );
    assert!(
        !root.join("two.delete").exists(),
        "the pending delete is finished"
    );
}

/// A `<pkg>.migrate` no run of ours leaves (here a symlink out of the
/// root) beside a plain directory: the run refuses the package, and the dry
/// run now says it would, instead of promising its conversion; nothing is
/// followed or changed either way, and the other package converts.
#[test]
fn the_dry_run_refuses_a_stray_migrate_name_as_the_run_does() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["ok", "odd"] {
        fs::create_dir_all(root.join(p).join("data/main")).unwrap();
        fs::write(root.join(p).join("data/main/file"), p).unwrap();
    }
    let outside = fs.path("outside");
    fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("odd.migrate")).unwrap();
    let before = digest(&root);
    let out = migrate_cli(&root, &["--dry-run"]);
    let said = text(&out.stdout);
    assert!(
        said.contains("would refuse odd: ") && said.contains("neither a partial copy"),
        "{said}\n{}",
        text(&out.stderr)
    );
    assert!(said.contains("would convert ok"), "{said}");
    assert_same(&before, &digest(&root), "after the dry run");
    let out = migrate_cli(&root, &[]);
    assert!(!out.status.success(), "the run refuses odd");
    assert!(
        text(&out.stderr).contains("neither a partial copy"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing followed"
    );
    let store = VolumeStore::open(&root).unwrap();
    assert_eq!(
        store.info(&pkg("ok")).unwrap().volume,
        Some(VolumeKind::Subvolume),
        "the other package converts"
    );
}

/// `startos-volume --json` that fails before printing anything (a missing
/// root, an invalid id) prints one JSON object on stdout with the error and
/// its kind, beside the one line on stderr: a caller reading stdout never
/// gets nothing.
#[test]
fn json_failures_are_json_on_stdout() {
    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for (args, kind) in [
        (&["--json", "list"][..], None),
        (&["--json", "snapshot", "Bad_Id"][..], Some("Invalid ID")),
    ] {
        let dir = if kind.is_none() {
            root.join("missing")
        } else {
            root.clone()
        };
        let out = volume_cli(&dir, args, &[]);
        assert!(!out.status.success(), "{args:?}");
        let said: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is no JSON ({e}): {}", text(&out.stdout)));
        assert!(said["error"].is_string(), "{args:?}: {said}");
        assert!(said["code"].is_i64(), "{args:?}: {said}");
        if let Some(k) = kind {
            assert_eq!(said["kind"], k, "{args:?}: {said}");
        }
        assert_eq!(text(&out.stderr).lines().count(), 1, "{args:?}");
    }
}
