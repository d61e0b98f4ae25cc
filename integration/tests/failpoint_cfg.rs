//! The crash and fault sites arm only in a build that sets `--cfg
//! startos_failpoints` (this workspace's `.cargo/config.toml` does): a
//! workspace that unifies the crates' `failpoints` feature alone, as
//! start-core's could, builds binaries that read no failpoint or fault
//! variable. Shown by building `startos-volume` with the feature but without
//! the cfg (`CARGO_ENCODED_RUSTFLAGS` empty, which overrides the config) and
//! running it with both variables set, beside this workspace's own build of
//! the same tool, which they stop.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::sweep::bin;
use common::*;
use integration::{LoopFs, fs_or_skip};
use volume::FAILPOINT_ENV;
use volume::sys::fault::FAULT_ENV;

/// `startos-volume`, built with the `failpoints` feature and no cfg, in a
/// target directory of its own under the workspace's (kept between runs,
/// so only the first build pays for the crate's dependencies).
fn built_without_the_cfg() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf();
    let target = workspace.join("target").join("failpoints-without-cfg");
    let out = Command::new(env!("CARGO"))
        .current_dir(&workspace)
        .args(["build", "-p", "volume", "--bin", "startos-volume"])
        .args(["--features", "volume/failpoints,volume/cli"])
        .arg("--target-dir")
        .arg(&target)
        .env("CARGO_ENCODED_RUSTFLAGS", "")
        .output()
        .expect("running cargo");
    assert!(
        out.status.success(),
        "building startos-volume without the cfg: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("debug").join("startos-volume")
}

fn create(tool: &Path, root: &Path, pkg: &str) -> Output {
    Command::new(tool)
        .arg("--root")
        .arg(root)
        .args(["create", pkg, "main"])
        // Every system call fails, and the create dies at its first step.
        .env(FAULT_ENV, "1+:eio")
        .env(FAILPOINT_ENV, "create.made")
        .output()
        .expect("running startos-volume")
}

#[test]
fn the_feature_without_the_cfg_arms_nothing() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let root = volumes_root(&fs);

    // This workspace's build: the variables stop it.
    let armed = create(&bin("startos-volume"), &root, "armed");
    assert!(
        !armed.status.success(),
        "the armed build must fail: {armed:?}"
    );
    assert!(!root.join("armed").exists());

    // The feature alone: the same command succeeds, as a production binary
    // must whatever its environment holds.
    let tool = built_without_the_cfg();
    let inert = create(&tool, &root, "inert");
    assert!(
        inert.status.success(),
        "the feature alone armed a site: {}",
        String::from_utf8_lossy(&inert.stderr)
    );
    assert!(root.join("inert/data/main").is_dir());
}
