//! Upstream's own call sites, run: the `call-sites` runner of
//! `fixtures/upstream-call-sites` drives start-core's `ServiceMap::install`,
//! `Service::load` (its Installing and Updating arms, its undo), the
//! uninstall `cleanup`, the dependency `mount` effect, the 0.3.6
//! migration's `post_up` and `cleanup_and_initialize` as upstream writes
//! them, with stand-ins that run (a state store on the data directory, a
//! real container process per service holding its bind mounts, the
//! notifications), on a loop-mounted btrfs seen at upstream's
//! `/media/startos/data`. Each run of the runner is one boot of the box;
//! a SIGKILL at a failpoint then the next run is a crash and a reboot.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use common::MIB;
use integration::call_sites::{self, Ended, Run};
use integration::{LoopFs, fs_or_skip};
use serde_json::{Value, json};

/// A box: its data directory (on a loop-mounted btrfs), driven through
/// the runner ([`integration::call_sites::Box_`]).
struct Box_ {
    fs: std::sync::Arc<LoopFs>,
    inner: call_sites::Box_,
}

impl std::ops::Deref for Box_ {
    type Target = call_sites::Box_;
    fn deref(&self) -> &call_sites::Box_ {
        &self.inner
    }
}

impl Box_ {
    fn new(size: u64) -> Option<Box_> {
        let fs = fs_or_skip!(LoopFs::btrfs(size), None);
        let bin = integration::workspace_bin("call-sites").unwrap_or_else(|e| {
            panic!("{e} (build it first: cargo build --workspace --bins --features ...)")
        });
        let data = fs.mount_point().to_owned();
        Some(Box_ {
            fs: std::sync::Arc::new(fs),
            inner: call_sites::Box_ { bin, data },
        })
    }

    /// Another box on the same filesystem: its data directory `name`, a
    /// plain directory or a subvolume of its own.
    fn beside(&self, name: &str, subvolume: bool) -> Box_ {
        let data = self.fs.path(name);
        if subvolume {
            common::subvolume_create(&data);
        } else {
            fs::create_dir_all(&data).unwrap();
        }
        Box_ {
            fs: self.fs.clone(),
            inner: call_sites::Box_ {
                bin: self.inner.bin.clone(),
                data,
            },
        }
    }

    /// The version the package's init last wrote into its main volume.
    fn data_version(&self, id: &str) -> Option<String> {
        fs::read_to_string(self.main(id).join("version")).ok()
    }

    /// Runs `steps` as one boot of the box, killed or not; kills whatever
    /// the run left (its containers) before returning.
    fn run_any(&self, steps: &[Value]) -> Ended {
        self.inner.run(steps).unwrap_or_else(|e| panic!("{e}"))
    }

    fn run(&self, steps: &[Value]) -> Run {
        self.inner
            .completed(steps)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `steps`, each of which must succeed.
    #[track_caller]
    fn run_ok(&self, steps: &[Value]) -> Run {
        let run = self.run(steps);
        assert!(run.ok(), "steps failed: {:?}\n{}", run.steps, run.stderr);
        run
    }
}

fn boot() -> Value {
    json!("boot")
}

fn install(id: &str, version: &str) -> Value {
    json!({"install": {"id": id, "version": version}})
}

fn install_failing(id: &str, version: &str, fail: &str) -> Value {
    json!({"install": {"id": id, "version": version, "fail": fail}})
}

/// A dependent whose container mounts `dep`'s main volume read-only and
/// writable (two `mount` effects).
fn install_dependent(id: &str, version: &str, dep: &str) -> Value {
    let mount = |readonly| json!({"package_id": dep, "volume_id": "main", "subpath": null, "readonly": readonly});
    json!({"install": {"id": id, "version": version, "dependencies": [mount(true), mount(false)]}})
}

fn uninstall(id: &str, soft: bool) -> Value {
    json!({"uninstall": {"id": id, "soft": soft}})
}

fn arm(failpoint: &str) -> Value {
    json!({"arm": {"failpoint": failpoint}})
}

const SIZE: u64 = 512 * MIB;

#[test]
fn install_update_and_each_failed_update_through_the_undo_arm() {
    let Some(b) = Box_::new(SIZE) else { return };
    let run = b.run_ok(&[boot(), install("app", "1"), install("app", "2")]);
    assert_eq!(run.installed("app").as_deref(), Some("2"));
    assert_eq!(run.running.get("app").map(String::as_str), Some("2"));
    assert_eq!(b.data_version("app").as_deref(), Some("2"));
    assert!(
        b.main("app").join("data-1").exists(),
        "the update kept v1's data"
    );
    assert!(
        fs::read_to_string(b.main("app").join("app.log")).is_ok_and(|l| l.contains("app ")),
        "the container wrote through its bind mount"
    );
    assert_eq!(b.names("app"), ["app"], "no backup or temporary left");

    // Each phase an update can fail at: the download, a cancel, the new
    // version's init (after it wrote into the volume). Each is undone
    // through `Service::load`'s Updating arm: v2's data back, v2 running.
    for (version, fail) in [("3", "download"), ("4", "cancel"), ("5", "init")] {
        let run = b.run(&[boot(), install_failing("app", version, fail)]);
        assert!(run.steps[0].is_none(), "{fail}: boot: {:?}", run.steps);
        assert!(run.steps[1].is_some(), "{fail}: the update must fail");
        assert_eq!(
            run.loads("app").last(),
            Some(&("Undo".to_owned(), Ok(true))),
            "{fail}: the undo arm loads the old version: {:?}",
            run.loads("app")
        );
        assert!(
            run.notifications("app").iter().any(|n| n.contains(fail)),
            "{fail}: the user is told: {:?}",
            run.notifications("app")
        );
        assert_eq!(run.installed("app").as_deref(), Some("2"), "{fail}");
        assert_eq!(
            run.running.get("app").map(String::as_str),
            Some("2"),
            "{fail}"
        );
        assert_eq!(b.data_version("app").as_deref(), Some("2"), "{fail}");
        assert!(
            !b.main("app").join(format!("data-{version}")).exists(),
            "{fail}: the failed version's data was rolled back"
        );
        assert_eq!(b.names("app"), ["app"], "{fail}: no name left");
    }
}

/// A failed snapshot is an error here where upstream's returns `false`
/// (docs/upstream.md): through `ServiceMap::install`, the update stops
/// before anything changed, the quiesced old service comes back through
/// the undo arm, and the user is told.
#[test]
fn a_failed_snapshot_brings_the_old_service_back_and_tells_the_user() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[boot(), install("app", "1")]);
    let run = b.run(&[boot(), arm("snapshot.created=eio"), install("app", "2")]);
    assert!(run.steps[2].is_some(), "the update fails: {:?}", run.steps);
    assert!(
        run.notifications("app")
            .iter()
            .any(|n| n.contains("service.install.failed")),
        "the user is told: {:?}",
        run.notifications("app")
    );
    assert_eq!(
        run.loads("app").last(),
        Some(&("Undo".to_owned(), Ok(true))),
        "{}",
        run.stderr
    );
    assert_eq!(
        run.running.get("app").map(String::as_str),
        Some("1"),
        "the old service is back"
    );
    assert_eq!(run.installed("app").as_deref(), Some("1"));
    assert_eq!(b.data_version("app").as_deref(), Some("1"));
    assert_eq!(b.names("app"), ["app"]);
}

#[test]
fn an_update_crashed_after_its_snapshot_is_undone_at_the_next_boot() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[boot(), install("app", "1")]);
    // The new version's init fails again at the boot's retry: the boot's
    // `Service::load` (Retry) falls through to its undo arm.
    let killed = b.run_any(&[
        boot(),
        arm("snapshot.created"),
        install_failing("app", "2", "init"),
    ]);
    assert!(
        matches!(killed, Ended::Killed(_)),
        "snapshot.created not reached"
    );
    let run = b.run_ok(&[boot()]);
    assert_eq!(
        run.loads("app"),
        [("Retry".to_owned(), Ok(true))],
        "{}",
        run.stderr
    );
    assert_eq!(run.installed("app").as_deref(), Some("1"));
    assert_eq!(b.data_version("app").as_deref(), Some("1"));
    assert_eq!(b.names("app"), ["app"]);
}

#[test]
fn hard_and_soft_uninstall_then_reinstall_after_a_reboot() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[boot(), install("kept", "1"), install("gone", "1")]);
    fs::write(b.main("kept").join("precious"), "user data").unwrap();
    fs::write(b.main("gone").join("precious"), "user data").unwrap();
    let run = b.run_ok(&[boot(), uninstall("kept", true), uninstall("gone", false)]);
    assert!(run.db.is_empty(), "both left the database: {:?}", run.db);
    assert!(run.running.is_empty());
    assert!(
        b.main("kept").join("precious").exists(),
        "a soft uninstall keeps the volume"
    );
    assert_eq!(
        b.names("gone"),
        Vec::<String>::new(),
        "a hard uninstall leaves no name"
    );

    let run = b.run_ok(&[boot(), install("kept", "2"), install("gone", "2")]);
    assert_eq!(run.installed("kept").as_deref(), Some("2"));
    assert_eq!(run.installed("gone").as_deref(), Some("2"));
    assert!(
        b.main("kept").join("precious").exists(),
        "a reinstall finds kept data"
    );
    assert!(
        !b.main("gone").join("precious").exists() && !b.main("gone").join("data-1").exists(),
        "a hard uninstall's data never comes back"
    );
}

#[test]
fn a_hard_uninstall_after_a_failed_rollback_does_not_come_back() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[boot(), install("app", "1")]);
    // The rollback's restore fails (an I/O error in it): upstream's
    // `report_failed_rollback` aborts the load, the backup stays.
    let run = b.run(&[
        boot(),
        arm("restore.recorded=eio"),
        install_failing("app", "2", "init"),
    ]);
    assert!(
        run.notifications("app")
            .iter()
            .any(|n| n.contains("rollback-failed")),
        "the failed rollback is told: {:?}\n{}",
        run.notifications("app"),
        run.stderr
    );
    let run = b.run_ok(&[boot(), uninstall("app", false)]);
    assert!(run.db.is_empty());
    b.run_ok(&[boot()]);
    assert_eq!(
        b.names("app"),
        Vec::<String>::new(),
        "a hard uninstall removes every name of the package, at the boot sweep too"
    );
    b.run_ok(&[boot(), install("app", "3")]);
    assert!(
        !b.main("app").join("data-1").exists(),
        "the reinstall finds none of the uninstalled data"
    );
}

/// Whether `path` is the top of a btrfs subvolume (inode 256).
fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).is_ok_and(|m| m.ino() == 256)
}

/// A volume's content as a package sees it, without what its container
/// appended since (`<id>.log`) or the directory times that changed.
fn content(b: &Box_, id: &str) -> integration::TreeDigest {
    common::digest(&b.main(id))
        .without(format!("{id}.log"))
        .ignore_dir_mtimes()
}

#[test]
fn first_boot_of_a_real_node_box_every_load_returns() {
    let shape = integration::node::NodeShape::small();
    let Some(b) = Box_::new(shape.image_bytes()) else {
        return;
    };
    fs::create_dir_all(b.volumes()).unwrap();
    integration::node::build(&b.volumes(), &shape).expect("building the box");
    let before: BTreeMap<&str, _> = shape
        .packages()
        .into_iter()
        .map(|p| (p, content(&b, p)))
        .collect();
    let seeds: Vec<Value> = shape
        .packages()
        .iter()
        .map(|p| json!({"seed": {"id": p, "version": "1"}}))
        .collect();
    b.run_ok(&seeds);

    let run = b.run_ok(&[boot()]);
    let ready = run.first_ms("volumes_ready");
    for (p, digest) in &before {
        assert_eq!(
            run.loads(p),
            [("Retry".to_owned(), Ok(true))],
            "{p}: its Service::load returns its service\n{}",
            run.stderr
        );
        assert_eq!(run.running.get(*p).map(String::as_str), Some("1"), "{p}");
        assert!(is_subvolume(&b.volumes().join(p)), "{p}: converted");
        common::assert_same(digest, &content(&b, p), p);
        assert!(ready.contains_key(*p), "{p}: its volume calls returned");
    }
    // The readiness the services see: from boot start to each load's
    // volume calls returning (`ensure_volume_root` and the data_dir checks).
    eprintln!("volume calls returned (ms from boot start): {ready:?}");
}

/// Fifty files in `legacy`'s main volume, a plain directory as 0.3.5 left
/// it; returns where they are and their digest.
fn legacy_files(b: &Box_) -> (PathBuf, integration::TreeDigest) {
    let files = b.main("legacy").join("files");
    fs::create_dir_all(&files).unwrap();
    for i in 0..50u64 {
        fs::write(files.join(format!("{i:03}")), common::bytes(i, 3000)).unwrap();
    }
    let digest = common::digest(&files);
    (files, digest)
}

#[test]
fn the_0_3_6_migration_converts_then_installs() {
    let Some(b) = Box_::new(SIZE) else { return };
    let (files, before) = legacy_files(&b);
    let run = b.run_ok(&[
        boot(),
        json!({"migrate036": {"packages": [["legacy", "1"]]}}),
        install("legacy", "2"),
    ]);
    assert!(
        run.notifications("legacy").is_empty(),
        "{:?}",
        run.notifications("legacy")
    );
    assert!(
        is_subvolume(&b.volumes().join("legacy")),
        "converted to a subvolume"
    );
    common::assert_same(&before, &common::digest(&files), "the migrated data");
    assert_eq!(run.installed("legacy").as_deref(), Some("2"));
    assert_eq!(b.data_version("legacy").as_deref(), Some("2"));
    assert_eq!(b.names("legacy"), ["legacy"]);
}

/// A box with no volumes root yet (a new one, its data directory never
/// holding a package): its boot and first install go on, the install
/// creating the root and the package's volume, a subvolume, as upstream's
/// `begin` and `ensure_volume_root` create them; in upstream's order and
/// the reordered one.
#[test]
fn the_first_install_on_a_box_with_no_volumes_root_creates_it() {
    let Some(fs) = Box_::new(SIZE) else { return };
    for order in [call_sites::Order::Upstream, call_sites::Order::Reordered] {
        let b = fs.beside(&format!("{order:?}"), true);
        let run = b.run_ok(&[
            order.step(),
            json!("no_volumes_root"),
            boot(),
            install("app", "1"),
        ]);
        assert_eq!(run.installed("app").as_deref(), Some("1"), "{order:?}");
        assert!(is_subvolume(&b.volumes().join("app")), "{order:?}");
        assert_eq!(b.data_version("app").as_deref(), Some("1"), "{order:?}");
        assert_eq!(b.names("app"), ["app"], "{order:?}");
    }
}

/// A conversion that succeeded, then a failure removing the old directory
/// after it (EIO at the removal's first entry): the migration goes on to
/// install the package on its data, the old tree left as
/// `legacy.migrate-old`, which the next boot's cleanup removes.
#[test]
fn the_0_3_6_migration_installs_when_removing_the_old_tree_fails() {
    let Some(b) = Box_::new(SIZE) else { return };
    let (files, before) = legacy_files(&b);
    let run = b.run_ok(&[
        boot(),
        arm("migrate.remove=eio"),
        json!({"migrate036": {"packages": [["legacy", "1"]]}}),
        arm(""),
    ]);
    assert!(
        run.notifications("legacy").is_empty(),
        "{:?}",
        run.notifications("legacy")
    );
    assert_eq!(run.installed("legacy").as_deref(), Some("1"));
    assert!(is_subvolume(&b.volumes().join("legacy")), "converted");
    common::assert_same(&before, &common::digest(&files), "the migrated data");
    assert!(
        b.volumes().join("legacy.migrate-old").is_dir(),
        "the failpoint was reached: the old tree is left"
    );
    assert!(
        run.stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains("removing the old directory failed")),
        "the failed removal is a warning\n{}",
        run.stderr
    );
    // The cleanup runs in the idle I/O class: each further boot resumes it.
    for _ in 0..5 {
        b.run_ok(&[boot(), json!({"wait": {"ms": 500}})]);
        if b.names("legacy") == ["legacy"] {
            break;
        }
    }
    assert_eq!(b.names("legacy"), ["legacy"], "the next boot's cleanup");
    common::assert_same(&before, &common::digest(&files), "after the cleanup");
}

/// The trees kept under a name of `id` other than its volume (at that
/// name or one level in it, as `<id>.held/<n>`) with `file` in their main
/// volume directory.
fn held_with(b: &Box_, id: &str, file: &str) -> Vec<PathBuf> {
    let has = |tree: &Path| tree.join("data/main").join(file).exists();
    let mut found = Vec::new();
    for name in b.names(id).into_iter().filter(|n| n != id) {
        let top = b.volumes().join(name);
        if has(&top) {
            found.push(top.clone());
        }
        for entry in fs::read_dir(&top).into_iter().flatten().flatten() {
            if has(&entry.path()) {
                found.push(entry.path());
            }
        }
    }
    found
}

#[test]
fn rollback_while_a_dependent_holds_a_read_only_and_a_writable_mount() {
    let Some(b) = Box_::new(SIZE) else { return };
    let run = b.run(&[
        boot(),
        install("lnd", "1"),
        install_dependent("wallet", "1", "lnd"),
        install_failing("lnd", "2", "init"),
    ]);
    assert!(
        run.steps[..3].iter().all(Option::is_none),
        "{:?}",
        run.steps
    );
    assert_eq!(
        run.loads("lnd").last(),
        Some(&("Undo".to_owned(), Ok(true))),
        "the rollback under the dependent's mounts succeeds: {:?}\n{}",
        run.loads("lnd"),
        run.stderr
    );
    assert_eq!(run.running.get("lnd").map(String::as_str), Some("1"));
    assert_eq!(run.running.get("wallet").map(String::as_str), Some("1"));
    assert_eq!(b.data_version("lnd").as_deref(), Some("1"));
    assert!(
        !b.main("lnd").join("data-2").exists(),
        "the restored volume is v1's"
    );
    assert!(
        run.stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains("/media/startos/containers/wallet")),
        "a warning names the holders (their mount points)\n{}",
        run.stderr
    );
    assert!(
        !held_with(&b, "lnd", "wallet.log").is_empty(),
        "what the dependent wrote through its mount is kept under a name of lnd: {:?}",
        b.names("lnd")
    );
    // Nothing holds it any more: the boot sweep reclaims it.
    b.run_ok(&[boot()]);
    assert_eq!(b.names("lnd"), ["lnd"]);
}

#[test]
fn uninstall_with_a_dependent_hard_and_soft() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[
        boot(),
        install("soft", "1"),
        install_dependent("wallet-a", "1", "soft"),
        install("hard", "1"),
        install_dependent("wallet-b", "1", "hard"),
    ]);
    let run = b.run(&[boot(), uninstall("soft", true), uninstall("hard", false)]);
    assert!(run.steps[1].is_none(), "soft: {:?}", run.steps);
    assert!(
        run.steps[2].is_none(),
        "a dependent's mount never makes an uninstall fail: {:?}\n{}",
        run.steps,
        run.stderr
    );
    assert!(!run.db.contains_key("soft") && !run.db.contains_key("hard"));
    assert!(
        b.main("soft").join("data-1").exists(),
        "a soft uninstall keeps the volume"
    );
    assert!(
        !b.volumes().join("hard").exists(),
        "the hard-uninstalled volume is gone from its path"
    );
    // The dependents are stopped with the run; the next boot reclaims
    // what they held: no name of the hard-uninstalled package is left.
    let run = b.run_ok(&[boot()]);
    assert_eq!(b.names("hard"), Vec::<String>::new());
    assert_eq!(
        run.running.len(),
        2,
        "both dependents run: {:?}",
        run.running
    );
}

/// The failpoints of the volume store (`failpoint("..")` in
/// `volume/src`): every step of a snapshot, restore, create, drop and
/// delete. The finalizer's own (core's `finalize`) are not on these flows'
/// path, the conversion's (volume-migrate) only on the first boot's.
fn store_failpoints() -> Vec<String> {
    failpoints_in("volume/src")
}

/// The failpoints named in the sources under `dir` (of the workspace),
/// read from them so a new one is swept too. Each is armed at its first
/// hit.
fn failpoints_in(dir: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
    let mut names = std::collections::BTreeSet::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = fs::read_to_string(&path).unwrap();
                for part in text.split("failpoint(\"").skip(1) {
                    if let Some((name, _)) = part.split_once('"') {
                        names.insert(name.to_owned());
                    }
                }
            }
        }
    }
    assert!(names.len() >= 10, "the failpoints of {dir}: {names:?}");
    names.into_iter().collect()
}

/// A flow whose every failpoint is swept. A fresh install reaches none
/// of the store's (no volume to snapshot, `ensure` makes one in place), so
/// the install swept is the one over a soft-uninstalled package's kept
/// volume, whose data must survive.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Flow {
    Reinstall,
    Update,
    Rollback,
    HardUninstall,
}

impl Flow {
    fn setup(self, id: &str) -> Vec<Value> {
        match self {
            Flow::Reinstall => vec![install(id, "1"), uninstall(id, true)],
            _ => vec![install(id, "1")],
        }
    }

    fn op(self, id: &str) -> Value {
        match self {
            Flow::Reinstall => install(id, "2"),
            Flow::Update => install(id, "2"),
            Flow::Rollback => install_failing(id, "2", "init"),
            Flow::HardUninstall => uninstall(id, false),
        }
    }

    /// What `id` may be after the crash and the reboot: the old version
    /// with the old data or the new with the new, nothing lost, no name
    /// but its volume (and a backup an `Installed` package may keep until
    /// its next `begin`, as upstream's own flow leaves one). `Ok(Some(_))`
    /// names an outcome upstream's own flow makes (`UPSTREAM_OUTCOMES`).
    fn check(
        self,
        b: &Box_,
        run: &Run,
        id: &str,
        fp: &str,
    ) -> Result<Option<&'static str>, String> {
        let installed = run.installed(id);
        if run.db.contains_key(id) && installed.is_none() {
            return Err(format!("{fp}: left {:?}", run.db[id]));
        }
        let names = b.names(id);
        let stray: Vec<&String> = names
            .iter()
            .filter(|n| *n != id && **n != format!("{id}.install-backup"))
            .collect();
        if !stray.is_empty() {
            return Err(format!("{fp}: stray names {stray:?}"));
        }
        if run.running.get(id) != installed.as_ref() {
            return Err(format!(
                "{fp}: running {:?}, installed {installed:?}",
                run.running.get(id)
            ));
        }
        let data = b.data_version(id);
        let has = |v: &str| b.main(id).join(format!("data-{v}")).exists();
        let backup = names.contains(&format!("{id}.install-backup"));
        let ok = match (self, installed.as_deref()) {
            // Undone, the kept volume (with v1's data) stays as it was.
            (Flow::Reinstall, None) => names == [id] && has("1") && !has("2"),
            (Flow::HardUninstall, None) => names.is_empty() || (names == [id] && has("1")),
            (_, Some("1")) if data.as_deref() == Some("1") && has("1") && !has("2") => true,
            // The failed init's data left on v1: the undo committed
            // `Installed` before its restore (a crash before the restore's
            // exchange), or the crash came before the snapshot completed.
            (Flow::Rollback, Some("1")) if has("1") && has("2") => {
                let before_exchange = ["restore.copied", "restore.recorded"];
                let before_snapshot = ["snapshot.created", "snapshot.frozen"];
                if backup && before_exchange.contains(&fp) {
                    return Ok(Some(UPSTREAM_OUTCOMES[0]));
                }
                if !backup && before_snapshot.contains(&fp) {
                    return Ok(Some(UPSTREAM_OUTCOMES[1]));
                }
                false
            }
            (Flow::Update | Flow::Reinstall, Some("2")) => {
                data.as_deref() == Some("2") && has("1") && has("2")
            }
            _ => false,
        };
        if ok {
            Ok(None)
        } else {
            Err(format!(
                "{fp}: installed {installed:?}, data version {data:?}, data-1 {}, data-2 {}, names {names:?}",
                has("1"),
                has("2")
            ))
        }
    }
}

/// What upstream's own `Service::load` leaves after a crash inside a
/// failed update's rollback, which no volume backend can change
/// (`docs/upstream.md`, "What start-core's flow should change"): the
/// version is the old one, the volume holds the failed init's writes
/// beside the old data, and
/// - its undo committed `Installed` before its restore, so a crash inside
///   the restore, undone by recovery, boots the old version on that data,
///   the backup (the old data, whole) kept beside it;
/// - a crash before the snapshot completed leaves no backup, and the
///   boot's Retry runs the new version's init again with no rollback point.
const UPSTREAM_OUTCOMES: [&str; 2] = [
    "old version on the failed init's data, backup kept (Installed committed before restore)",
    "old version on the failed init's data, no backup (the Retry re-ran init without a snapshot)",
];

/// Every store failpoint inside `flow`, a package each: SIGKILL there,
/// then the next run's boot (maintenance and loads) and a last boot; each
/// boot's every `Service::load` returns, and each package is whole.
fn sweep_flow(flow: Flow) {
    let Some(b) = Box_::new(SIZE) else { return };
    let fps = store_failpoints();
    let ids: Vec<String> = (0..fps.len()).map(|i| format!("p{i}")).collect();
    let setup: Vec<Value> = std::iter::once(boot())
        .chain(ids.iter().flat_map(|id| flow.setup(id)))
        .collect();
    b.run_ok(&setup);
    let mut reached = Vec::new();
    let mut problems = Vec::new();
    let mut upstream = Vec::new();
    for (fp, id) in fps.iter().zip(&ids) {
        match b.run_any(&[boot(), arm(fp), flow.op(id)]) {
            Ended::Killed(run) | Ended::Completed(run) if run.steps.first() != Some(&None) => {
                problems.push(format!(
                    "{fp}: the boot failed: {:?}\n{}",
                    run.steps, run.stderr
                ));
            }
            Ended::Killed(run) => {
                reached.push(fp.clone());
                let failed: Vec<_> = run
                    .events
                    .iter()
                    .filter_map(|e| e.get("load"))
                    .filter(|l| !l["error"].is_null())
                    .collect();
                if !failed.is_empty() {
                    problems.push(format!("{fp}: a boot's load failed: {failed:?}"));
                }
            }
            Ended::Completed(_) => {}
        }
    }
    let run = b.run_ok(&[boot()]);
    for (fp, id) in fps.iter().zip(&ids) {
        if let Some((_, Err(e))) = run.loads(id).first() {
            problems.push(format!("{fp}: the reboot's load of {id} failed: {e}"));
        }
        match flow.check(&b, &run, id, fp) {
            Ok(Some(outcome)) => upstream.push(format!("{fp}: {outcome}")),
            Ok(None) => {}
            Err(e) => problems.push(e),
        }
    }
    eprintln!(
        "{flow:?}: {} failpoints reached: {reached:?}",
        reached.len()
    );
    eprintln!("{flow:?}: upstream's own flow: {upstream:?}");
    assert!(
        reached.len() >= 2,
        "{flow:?}: too few failpoints reached: {reached:?}"
    );
    assert!(
        problems.is_empty(),
        "{flow:?}:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn sigkill_at_each_failpoint_of_a_reinstall_over_kept_data_then_reboot() {
    sweep_flow(Flow::Reinstall);
}

#[test]
fn sigkill_at_each_failpoint_of_an_update_then_reboot() {
    sweep_flow(Flow::Update);
}

#[test]
fn sigkill_at_each_failpoint_of_a_rollback_then_reboot() {
    sweep_flow(Flow::Rollback);
}

#[test]
fn sigkill_at_each_failpoint_of_a_hard_uninstall_then_reboot() {
    sweep_flow(Flow::HardUninstall);
}

/// Builds, under box `b`, the plain-directory volumes of `ids` as the
/// previous system left them; returns their content.
fn plain_volumes<'a>(b: &Box_, ids: &[&'a str]) -> BTreeMap<&'a str, integration::TreeDigest> {
    for (i, id) in ids.iter().enumerate() {
        let dir = b.main(id).join("files");
        fs::create_dir_all(&dir).unwrap();
        for f in 0..(3 + 4 * i as u64) {
            let len = 4096 + 512 * f as usize;
            fs::write(
                dir.join(format!("{f:03}")),
                common::bytes(f * 31 + i as u64, len),
            )
            .unwrap();
        }
    }
    ids.iter().map(|id| (*id, content(b, id))).collect()
}

/// The first boot of a box of plain-directory volumes (as the previous
/// system left them), through the readiness step, with a SIGKILL at each
/// failpoint of the conversion (volume-migrate) it reaches: armed before
/// the boot, so it fires in the boot's maintenance or in the background
/// cleanup after it. A box a failpoint, each a data directory of the same
/// filesystem: first one whose data directory is a subvolume of its own
/// (little else in the parent: the conversion snapshots it and cuts the
/// snapshot down), and if the failpoint was not reached there, one on the
/// top-level subvolume beside the other boxes (too much else: it clones).
/// The next boot then finds every volume converted, whole, every load
/// returning, no name left once its cleanup ran.
#[test]
fn sigkill_at_each_failpoint_of_a_first_boot_then_reboot() {
    let Some(fs) = Box_::new(SIZE) else { return };
    let ids = ["alpha", "beta", "gamma"];
    let mut reached = Vec::new();
    let mut problems = Vec::new();
    for (k, fp) in failpoints_in("volume-migrate/src").iter().enumerate() {
        for subvolume in [true, false] {
            let b = fs.beside(&format!("box{k}-{subvolume}"), subvolume);
            let before = plain_volumes(&b, &ids);
            let mut steps: Vec<Value> = ids
                .iter()
                .map(|id| json!({"seed": {"id": id, "version": "1"}}))
                .collect();
            steps.extend([arm(fp), boot(), json!({"wait": {"ms": 300}})]);
            let Ended::Killed(run) = b.run_any(&steps) else {
                continue;
            };
            reached.push(fp.clone());
            for l in run.events.iter().filter_map(|e| e.get("load")) {
                if !l["error"].is_null() {
                    problems.push(format!("{fp}: a load failed: {l}"));
                }
            }
            let run = b.run_ok(&[boot(), json!({"wait": {"ms": 500}})]);
            // The cleanup runs in the idle I/O class, which other I/O may
            // hold back: each further boot resumes it.
            for _ in 0..5 {
                if ids.iter().all(|id| b.names(id) == [*id]) {
                    break;
                }
                b.run_ok(&[boot(), json!({"wait": {"ms": 1000}})]);
            }
            for (id, digest) in &before {
                if run.loads(id) != [("Retry".to_owned(), Ok(true))] {
                    problems.push(format!("{fp}: {id}: load {:?}", run.loads(id)));
                }
                if !is_subvolume(&b.volumes().join(id)) {
                    problems.push(format!("{fp}: {id}: not converted"));
                }
                let diff = digest.diff(&content(&b, id));
                if !diff.is_empty() {
                    problems.push(format!("{fp}: {id}: content changed: {diff:?}"));
                }
                if b.names(id) != [*id] {
                    problems.push(format!("{fp}: {id}: names {:?}", b.names(id)));
                }
            }
            break;
        }
    }
    eprintln!(
        "first boot: {} failpoints reached: {reached:?}",
        reached.len()
    );
    assert!(
        reached.len() >= 3,
        "too few failpoints reached: {reached:?}"
    );
    assert!(
        problems.is_empty(),
        "first boot:\n  {}",
        problems.join("\n  ")
    );
}

/// With the readiness step, a dependent's load waits until the dependency
/// whose volume its container mounts is converted. Loaded at once, its
/// mount of the dependency's plain directory, made while that directory
/// was cloned, made the clone's exchange refuse the dependency (the mount
/// would go on showing the old tree): a plain directory at every boot,
/// its clone redone each time.
#[test]
fn a_dependent_loads_once_the_volume_it_mounts_is_converted() {
    let Some(b) = Box_::new(SIZE) else { return };
    b.run_ok(&[
        boot(),
        install("dep", "1"),
        install_dependent("app", "1", "dep"),
    ]);
    // `dep` back to the plain directory of a box that has not booted since
    // its conversion to btrfs, with a nested subvolume (so it is cloned,
    // not snapshotted) and enough files for the clone to take a while.
    let vol = b.volumes().join("dep");
    let aside = b.fs.path("dep-aside");
    let cp = |from: &Path, to: &Path| {
        integration::run(
            std::process::Command::new("cp")
                .args(["-a", "--reflink=always"])
                .arg(from)
                .arg(to),
        )
        .unwrap_or_else(|e| panic!("cp: {e}"))
    };
    cp(&vol, &aside);
    integration::run(
        std::process::Command::new("btrfs")
            .args(["subvolume", "delete"])
            .arg(&vol),
    )
    .unwrap_or_else(|e| panic!("btrfs subvolume delete: {e}"));
    cp(&aside, &vol);
    assert!(!is_subvolume(&vol), "dep is a plain directory again");
    common::subvolume_create(&b.main("dep").join("nested"));
    let bulk = b.main("dep").join("bulk");
    fs::create_dir_all(&bulk).unwrap();
    for i in 0..5000 {
        fs::write(bulk.join(format!("{i:05}")), i.to_string()).unwrap();
    }
    let run = b.run_ok(&[boot()]);
    assert!(
        is_subvolume(&vol),
        "dep converted at the boot, its dependent loaded after: names {:?}\n{}",
        b.names("dep"),
        run.stderr
    );
    assert!(
        !b.names("dep").iter().any(|n| n == "dep.migrate"),
        "no clone left half done: {:?}",
        b.names("dep")
    );
    assert_eq!(run.running.get("app").map(String::as_str), Some("1"));
    assert_eq!(run.running.get("dep").map(String::as_str), Some("1"));
    assert_eq!(
        fs::read_to_string(b.main("dep").join("bulk/04999"))
            .ok()
            .as_deref(),
        Some("4999")
    );
}
