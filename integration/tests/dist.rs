//! What `make dist` builds is what an OS image takes: static binaries that
//! need nothing from the host. `make test` runs `make dist` first; this
//! checks the x86_64 result is statically linked, matches its checksum, and
//! creates, snapshots and restores a volume on a loop-mounted btrfs.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use integration::{LoopFs, fs_or_skip, run, skip_or_fail};

use integration::dist::{STATIC_TARGET as TARGET, dist_dir};

/// The binary `name` of the x86_64 dist, or `None` (after skipping, or a
/// panic under CI) if `make dist` has not run.
fn dist_bin(name: &str) -> Option<PathBuf> {
    let bin = integration::dist::dist_bin(name);
    if bin.is_file() {
        Some(bin)
    } else {
        skip_or_fail(&format!("{} is missing: run `make dist`", bin.display()));
        None
    }
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_dist_binaries_are_static_and_match_their_checksums() {
    let mut bins = Vec::new();
    for name in ["startos-volume", "volume-migrate"] {
        let Some(bin) = dist_bin(name) else { return };
        let file = stdout_of(Command::new("file").arg("-b").arg(&bin));
        assert!(
            file.contains("statically linked") || file.contains("static-pie linked"),
            "{}: {file}",
            bin.display()
        );
        assert!(!file.contains("interpreter"), "{}: {file}", bin.display());
        bins.push(bin);
    }
    let sums = fs::read_to_string(dist_dir().join("SHA256SUMS")).expect("dist/SHA256SUMS");
    for bin in &bins {
        let rel = format!(
            "{TARGET}/{}",
            bin.file_name().unwrap_or_default().to_string_lossy()
        );
        let line = sums
            .lines()
            .find(|l| l.ends_with(&format!("  {rel}")))
            .unwrap_or_else(|| panic!("SHA256SUMS has no line for {rel}:\n{sums}"));
        let sum = stdout_of(Command::new("sha256sum").arg(bin));
        assert_eq!(
            line.split_whitespace().next(),
            sum.split_whitespace().next(),
            "{rel}"
        );
    }
}

#[test]
fn the_static_startos_volume_snapshots_and_restores_on_btrfs() {
    let Some(bin) = dist_bin("startos-volume") else {
        return;
    };
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = fs.path("volumes");
    fs::create_dir_all(&root).unwrap();
    let tool = |args: &[&str]| {
        let mut cmd = Command::new(&bin);
        cmd.arg("--root").arg(&root).args(args);
        run(&mut cmd).unwrap_or_else(|e| panic!("startos-volume {args:?}: {e}"));
    };
    tool(&["create", "app", "main"]);
    let data = root.join("app/data/main");
    fs::create_dir_all(&data).unwrap();
    fs::write(data.join("db"), b"before the update").unwrap();
    tool(&["snapshot", "app"]);
    fs::write(data.join("db"), b"after a failed update").unwrap();
    tool(&["restore", "app"]);
    assert_eq!(fs::read(data.join("db")).unwrap(), b"before the update");
    assert!(!root.join("app.install-backup").exists());
}
