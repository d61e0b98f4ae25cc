//! Running external commands (mkfs, losetup, mount, btrfs, cp, ...) from tests.

use std::io;
use std::path::PathBuf;
use std::process::{Command, Output};

/// A binary of the workspace named `name`, beside the running executable
/// or one directory up (where cargo puts binaries relative to test
/// executables in `deps/`); the error names where it looked. `make test`
/// builds every binary first, with the same features.
pub fn workspace_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{name} not found near {}", exe.display()))
}

/// Runs `cmd` to completion, capturing stdout and stderr.
///
/// A non-zero exit (or death by signal) becomes an error whose message holds the
/// command line and its stderr, so a failing test says what went wrong instead of
/// just "exit status: 1". Stdin is closed, so a command that would prompt fails
/// instead of hanging the test run.
pub fn run(cmd: &mut Command) -> io::Result<Output> {
    let output = cmd
        .output()
        .map_err(|err| io::Error::new(err.kind(), format!("cannot start {cmd:?}: {err}")))?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(io::Error::other(format!(
            "{cmd:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        )))
    }
}

/// Runs `script` with `sh -c` and returns its stdout (lossily decoded as UTF-8).
///
/// Meant for one-liners in tests (`sh("sync")`, `sh("btrfs subvolume list /mnt")`);
/// the script is passed verbatim to the shell, so never build it from untrusted input.
pub fn sh(script: &str) -> io::Result<String> {
    let output = run(Command::new("sh").arg("-c").arg(script))?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
