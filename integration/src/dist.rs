//! Where the static binaries are: `make dist`'s output, and the power-cut
//! workload built for the same target (`make test` builds both first).

use std::path::{Path, PathBuf};

/// The target `make dist` always builds, and the power-cut guest runs.
pub const STATIC_TARGET: &str = "x86_64-unknown-linux-musl";

/// `dist/` at the workspace's top, or `DIST_DIR` as `make dist` was given it.
pub fn dist_dir() -> PathBuf {
    match std::env::var_os("DIST_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist"),
    }
}

/// `name` as `make dist` ships it for [`STATIC_TARGET`].
pub fn dist_bin(name: &str) -> PathBuf {
    dist_dir().join(STATIC_TARGET).join(name)
}

/// The workspace binary `name` built with `--release --target`
/// [`STATIC_TARGET`], in the cargo target directory whose `tmp` is
/// `target_tmpdir` (a test's `CARGO_TARGET_TMPDIR`).
pub fn static_workspace_bin(target_tmpdir: &Path, name: &str) -> PathBuf {
    target_tmpdir
        .parent()
        .unwrap_or(target_tmpdir)
        .join(STATIC_TARGET)
        .join("release")
        .join(name)
}
