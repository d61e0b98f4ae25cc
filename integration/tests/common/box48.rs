//! The many-package box of `migrate_split.rs` and `pool.rs`: [`PACKAGES`]
//! plain package directories (one larger, the dominant one) beside a little
//! rest outside them, what a test reads of them, and a wait for a process
//! stopped at a failpoint.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use integration::LoopFs;
use integration::identity::{Identity, Kept, identities};

use super::is_subvolume;

/// Packages in the box.
pub const PACKAGES: usize = 48;
/// Files per package (in two directories, so entries are 62 a package).
pub const FILES: usize = 60;

/// A box of [`PACKAGES`] plain package directories beside a little rest
/// outside them; returns the packages' entries in all.
pub fn build(fs: &LoopFs, root: &Path) -> u64 {
    fs::write(fs.path("outside"), b"not a package").unwrap();
    let mut entries = 0;
    for i in 0..PACKAGES {
        let pkg = root.join(format!("pkg{i:02}"));
        // One package larger than the others: the dominant one.
        let files = if i == 7 { FILES * 3 } else { FILES };
        for d in ["data", "assets"] {
            fs::create_dir_all(pkg.join(d)).unwrap();
            entries += 1;
        }
        for f in 0..files {
            let dir = if f % 2 == 0 { "data" } else { "assets" };
            fs::write(pkg.join(dir).join(format!("f{f}")), format!("{i} {f}")).unwrap();
            entries += 1;
        }
    }
    entries
}

pub type Before = BTreeMap<String, (BTreeMap<PathBuf, Identity>, BTreeMap<PathBuf, Vec<u8>>)>;

pub fn contents(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    for d in ["data", "assets"] {
        for e in fs::read_dir(dir.join(d)).unwrap() {
            let e = e.unwrap();
            let rel = Path::new(d).join(e.file_name());
            out.insert(rel, fs::read(e.path()).unwrap());
        }
    }
    out
}

/// Waits until process `pid` has stopped itself (SIGSTOP at a failpoint).
fn wait_stopped(pid: u32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // The state follows the command's closing parenthesis.
        let state = stat
            .rsplit_once(')')
            .map(|(_, s)| s.trim_start().chars().next());
        match state {
            Some(Some('T')) => return,
            Some(Some('Z')) => panic!("{pid} exited before the failpoint"),
            _ if std::time::Instant::now() >= deadline => {
                panic!("{pid} never stopped at the failpoint")
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
    }
}

/// Checks every package of `before` under `root`: a subvolume now, every
/// entry keeping its inode number and birth time, every byte kept; `when`
/// (may be empty) names the case in the messages.
pub fn assert_kept(before: &Before, root: &Path, when: &str) {
    for (p, (ids, data)) in before {
        let dir = root.join(p);
        assert!(is_subvolume(&dir), "{when}: {p} not converted");
        let kept = Kept::of(ids, &identities(&dir).unwrap());
        assert_eq!(kept.shares().0, 1.0, "{when}: {p}: identities");
        assert_eq!(&contents(&dir), data, "{when}: {p}: contents");
    }
}

/// Every package's identities and contents under `root`, before a run.
pub fn before_of(root: &Path) -> Before {
    (0..PACKAGES)
        .map(|i| {
            let p = format!("pkg{i:02}");
            let dir = root.join(&p);
            (p, (identities(&dir).unwrap(), contents(&dir)))
        })
        .collect()
}

/// The box of [`build`] under `volumes` of `fs`: its root, its packages'
/// entries in all, and what every package holds before a run.
pub fn boxed(fs: &LoopFs) -> (PathBuf, u64, Before) {
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    let entries = build(fs, &root);
    let before = before_of(&root);
    (root, entries, before)
}

/// Starts `cmd` with `failpoint` armed to stop it (`<name>=stop`), its
/// output piped, and returns once it has stopped itself there.
pub fn spawn_stopped(mut cmd: std::process::Command, failpoint: &str) -> std::process::Child {
    let child = cmd
        .env(volume::FAILPOINT_ENV, format!("{failpoint}=stop"))
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting the child");
    wait_stopped(child.id());
    child
}
