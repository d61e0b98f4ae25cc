//! The default conversion's background work at many packages (issue 31):
//! every package converted by a snapshot keeps every file's identity, and
//! the entries removed in all (shared cuts, rests, old trees) stay within a
//! few times the box, not once per package.

mod common;

use std::fs;
use std::path::PathBuf;

use common::box48::{PACKAGES, assert_kept, boxed, contents, spawn_stopped};
use common::cli::cli_run;
use common::{is_subvolume, root_names, uuid_of};
use integration::identity::{Kept, identities};
use integration::{LoopFs, fs_or_skip};
use volume_migrate::{Decision, MigrateOptions, Migrator, Outcome, Progress, SPLIT_DIR, ShareUse};

/// The entries removed in all, at most this many times the box's entries.
/// A split in halves sheds each entry about once per level (log2(47) is
/// under 6), a member of a share too light to split again its few
/// siblings, the dominant package's snapshot and the old trees once more
/// each; one snapshot of the parent per package shed it 47 times.
const AT_MOST_BOXES: u64 = 12;

#[test]
fn many_packages_shed_a_few_boxes_and_keep_every_identity() {
    many_packages(&|m, opts| {
        m.run(opts, &mut |_: &Progress| {}, &mut |_| {})
            .expect("the run")
    });
}

/// The same box converted as start-core's boot converts it
/// (`Migrator::convert_each`: several packages at once, each share made
/// once whichever member comes to it first, deleted once all its members
/// are done), then the cleanup: the same outcome as one at a time, every
/// member taking its share and no share cut twice.
#[test]
fn many_packages_converted_at_once_take_each_share_once() {
    many_packages(&|m, opts| {
        let planned = m
            .schedule(&m.packages().unwrap(), opts)
            .expect("the schedule");
        let done = std::sync::Mutex::new(Vec::new());
        let outcomes = m.convert_each(&planned, opts, &mut |_: &Progress| {}, &|p, _| {
            done.lock().unwrap().push(p.package.clone())
        });
        assert_eq!(done.into_inner().unwrap().len(), planned.len());
        let mut reports: Vec<_> = outcomes
            .into_iter()
            .map(|r| r.expect("each package's conversion"))
            .collect();
        let cleaned = m
            .remove_all_old(&mut |_: &Progress| {})
            .expect("the cleanup");
        for r in &mut reports {
            r.old_removed = cleaned.contains(&r.package);
        }
        reports
    });
}

/// Converts the box of [`build`] with `convert` (options: a deferred cut,
/// old trees removed) and checks what every way must leave.
fn many_packages(
    convert: &dyn Fn(&Migrator, &MigrateOptions) -> Vec<volume_migrate::PackageReport>,
) {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let (root, box_entries, before) = boxed(&fs);

    let m = Migrator::open(&root).unwrap();
    let opts = MigrateOptions {
        defer_cut: true,
        remove_old: true,
        ..MigrateOptions::default()
    };
    let reports = convert(&m, &opts);
    assert_eq!(reports.len(), PACKAGES);
    for r in &reports {
        assert_eq!(
            r.outcome,
            Outcome::Converted,
            "{}: {:?}",
            r.package,
            r.error
        );
        assert_eq!(r.decision, Some(Decision::SnapshotParent), "{}", r.package);
        assert!(r.old_removed, "{}", r.package);
    }
    // Nothing wrote the packages: every one but the dominant took its
    // share, the conversion's own changes to the parent counting for none.
    let taken = reports
        .iter()
        .filter(|r| matches!(r.share, Some(ShareUse::Taken(_))))
        .count();
    assert_eq!(taken, PACKAGES - 1, "{reports:#?}");

    for (p, (ids, data)) in &before {
        let dir = root.join(p);
        let kept = Kept::of(ids, &identities(&dir).unwrap());
        assert_eq!(
            kept.shares().0,
            1.0,
            "{p}: every entry keeps its inode and birth time"
        );
        assert_eq!(&contents(&dir), data, "{p}: contents");
        assert_eq!(
            root_names(&dir),
            ["assets", "data"],
            "{p}: nothing else left at its top"
        );
    }
    let names: Vec<_> = root_names(&root)
        .into_iter()
        .filter(|n| !n.starts_with("pkg"))
        .collect();
    assert!(
        !names.iter().any(|n| n == SPLIT_DIR),
        "the shares are gone: {names:?}"
    );

    let removed = m.entries_removed();
    eprintln!(
        "{PACKAGES} packages, {box_entries} entries: {removed} removed ({:.1} boxes)",
        removed as f64 / box_entries as f64
    );
    assert!(
        removed <= AT_MOST_BOXES * box_entries,
        "{removed} entries removed for a box of {box_entries}: over {AT_MOST_BOXES} boxes"
    );
}

/// A share whose cut fails (EIO at its second entry removed) fails no
/// package: its member is snapshotted from the parent instead, the share is
/// made again for the next member, and every package keeps every identity,
/// nothing left over (the CLI, failpoints armed).
#[test]
fn a_share_that_cannot_be_cut_fails_no_package() {
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let (root, _, before) = boxed(&fs);
    let out = std::process::Command::new(common::volume_migrate_bin())
        .arg("--root")
        .arg(&root)
        .arg("--json")
        .env(volume::FAILPOINT_ENV, "migrate.share-removed@2=eio")
        .env_remove("RUST_LOG")
        .output()
        .expect("running volume-migrate");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("snapshotting the parent instead"), "{text}");
    assert_kept(&before, &root, "");
    let names: Vec<_> = root_names(&root)
        .into_iter()
        .filter(|n| !n.starts_with("pkg"))
        .collect();
    assert!(!names.iter().any(|n| n == SPLIT_DIR), "{names:?}");
}

/// Steps inside the shares' cuts, by entries removed in the run: the top
/// share's first (it sheds the dominant package and the rest), and one
/// inside a share below it (the top share's cut is under 200 entries).
const SHARE_KILLS: &[&str] = &["migrate.share-removed@1", "migrate.share-removed@900"];

/// SIGKILL inside a share's cut, then a rerun: every package ends up its
/// subvolume with every identity and byte kept, each one converted before
/// the kill the same subvolume (not converted again), no share left, and a
/// third run has nothing to do (the CLI, failpoints armed).
#[test]
fn a_run_killed_inside_a_shares_cut_loses_nothing() {
    const { assert!(PACKAGES >= volume_migrate::SPLIT_MIN, "a box with shares") };
    for fp in SHARE_KILLS {
        let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
        let (root, _, before) = boxed(&fs);
        let when = format!("killed at `{fp}`");
        let (killed, code, out) = cli_run(&root, Some(fp));
        assert!(killed, "{when}: not killed (exit {code})\n{out}");
        let finished: Vec<(String, [u8; 16])> = before
            .keys()
            .filter(|p| is_subvolume(&root.join(p)))
            .map(|p| (p.clone(), uuid_of(&root.join(p))))
            .collect();
        assert!(
            finished.len() < PACKAGES,
            "{when}: every package converted before the kill"
        );
        let (killed, code, out) = cli_run(&root, None);
        assert!(
            !killed && code == 0,
            "{when}: the rerun failed ({code}):\n{out}"
        );
        assert_kept(&before, &root, &when);
        for (p, uuid) in &finished {
            assert_eq!(&uuid_of(&root.join(p)), uuid, "{when}: {p} converted again");
        }
        let left: Vec<_> = root_names(&root)
            .into_iter()
            .filter(|n| !n.starts_with("pkg"))
            .collect();
        assert!(left.is_empty(), "{when}: left over: {left:?}");
        let (_, code, out) = cli_run(&root, None);
        assert!(
            code == 0 && out.contains("\"converted\":0"),
            "{when}: a third run has nothing to do:\n{out}"
        );
    }
}

/// A write into a member's plain directory after the shares' snapshot of
/// the parent and before that member's conversion (a dependent's service
/// holding its volume, say) is kept: the migrator is stopped once the
/// third member has its share in hand, two packages not converted yet are
/// written (a new file in one, an existing file overwritten in place, same
/// size, in the other), and the run goes on. Both are snapshotted from the
/// parent instead of their shares, with every write and identity kept;
/// every other member still takes its share (the CLI's JSON reports).
#[test]
fn a_member_written_after_its_share_was_taken_keeps_the_write() {
    use std::io::Write;
    let fs = fs_or_skip!(LoopFs::btrfs(1 << 30));
    let (root, _, mut before) = boxed(&fs);
    let mut cmd = std::process::Command::new(common::volume_migrate_bin());
    cmd.arg("--root").arg(&root).arg("--json");
    let child = spawn_stopped(cmd, "migrate.share-taken@3");
    let plain: Vec<String> = before
        .keys()
        .filter(|p| !is_subvolume(&root.join(p)))
        .cloned()
        .collect();
    assert!(plain.len() > 3, "most packages wait: {plain:?}");
    let (added, overwritten) = (
        plain[plain.len() - 1].clone(),
        plain[plain.len() - 2].clone(),
    );
    fs::write(root.join(&added).join("data/late"), b"written late").unwrap();
    let f0 = root.join(&overwritten).join("data/f0");
    let old = fs::read(&f0).unwrap();
    let new = vec![b'X'; old.len()];
    fs::OpenOptions::new()
        .write(true)
        .open(&f0)
        .and_then(|mut f| f.write_all(&new))
        .unwrap();
    let data = &mut before.get_mut(&added).unwrap().1;
    data.insert(PathBuf::from("data/late"), b"written late".to_vec());
    let data = &mut before.get_mut(&overwritten).unwrap().1;
    data.insert(PathBuf::from("data/f0"), new);
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).expect("SIGCONT");
    let out = child
        .wait_with_output()
        .expect("waiting for volume-migrate");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    assert_kept(&before, &root, "");
    let mut taken = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["event"] != "package" {
            continue;
        }
        let (p, share) = (&v["report"]["package"], &v["report"]["share"]);
        if *p == added.as_str() || *p == overwritten.as_str() {
            let why = share["parent"]
                .as_str()
                .unwrap_or_else(|| panic!("{p}: {share}"));
            assert!(why.contains("written after transaction"), "{p}: {why}");
        } else if share["taken"].is_string() {
            taken += 1;
        }
    }
    assert_eq!(
        taken,
        PACKAGES - 3,
        "every other member took its share:\n{text}"
    );
}
