//! Named crash sites for the crash-safety tests, shared by every crate of
//! the workspace.
//!
//! A test names a site in [`FAILPOINT_ENV`]; when the process reaches it,
//! it dies by SIGKILL, as a crash or `kill -9` would: no destructor, no
//! unwinding, no flush. Two extensions, for sites that repeat or that
//! should fail rather than die:
//! - `name@N` fires on the N-th hit of `name` in this process (1 if absent);
//! - a trailing `=ERRNO` (`enospc`, `eio`, `erofs`, `eperm`, `emfile`)
//!   makes the site return that error instead, so a test can check what a
//!   failed step leaves on disk;
//! - a trailing `=stop` makes the process stop itself there (SIGSTOP), so
//!   a test can change the world at that step (mount something, say) and
//!   let it go on with SIGCONT;
//! - several sites, separated by commas, each act as above (make one step
//!   fail, then kill the process in what undoes it).
//!
//! Without the `failpoints` feature nothing fires and every site is free.
//! The feature alone arms nothing either: a site fires only in a build
//! that also sets `--cfg startos_failpoints`, which this workspace's
//! `.cargo/config.toml` sets for its own tests. Cargo unifies features
//! across a workspace, so a crate of start-core's that turned the feature
//! on would otherwise turn it on for start-core's production binaries, and
//! an environment variable would kill them; a cfg is set by whoever builds,
//! never by a dependency.

use std::io;

/// Environment variable naming the failpoint at which to die or fail.
pub const FAILPOINT_ENV: &str = "STARTOS_VOLUME_FAILPOINT";

/// With the `failpoints` feature and `--cfg startos_failpoints`, SIGKILLs
/// the process (or, for `...=ERRNO`, returns that error; for `...=stop`,
/// stops until continued) when [`FAILPOINT_ENV`] names this hit of `name`.
/// Without both, does nothing.
#[inline]
pub fn failpoint(name: &str) -> io::Result<()> {
    #[cfg(all(feature = "failpoints", startos_failpoints, target_os = "linux"))]
    {
        use std::collections::HashMap;
        use std::sync::Mutex;
        static HITS: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);
        let Some(spec) = std::env::var_os(FAILPOINT_ENV) else {
            return Ok(());
        };
        let spec = spec.to_string_lossy().into_owned();
        // Several sites, comma-separated: the first that names this one.
        /// What a site does when it fires.
        enum Act {
            Kill,
            Fail(i32),
            Stop,
        }
        let Some((site, act)) = spec.split(',').find_map(|one| {
            let (site, act) = match one.rsplit_once('=') {
                Some((s, "stop")) => (s, Act::Stop),
                Some((s, errno)) => match crate::sys::fault::parse_errno(errno) {
                    Some(e) => (s, Act::Fail(e)),
                    None => (one, Act::Kill),
                },
                None => (one, Act::Kill),
            };
            let bare = site.split_once('@').map_or(site, |(s, _)| s);
            (bare == name).then_some((site, act))
        }) else {
            return Ok(());
        };
        let nth = match site.split_once('@') {
            Some((_, n)) => n.parse::<u64>().unwrap_or(1),
            None => 1,
        };
        let hit = {
            let mut guard = HITS.lock().unwrap_or_else(|p| p.into_inner());
            let hits = guard.get_or_insert_with(HashMap::new);
            let n = hits.entry(name.to_owned()).or_insert(0);
            *n += 1;
            *n
        };
        if hit != nth {
            return Ok(());
        }
        match act {
            Act::Fail(errno) => Err(io::Error::from_raw_os_error(errno)),
            Act::Stop => {
                crate::sys::stop_self();
                Ok(())
            }
            Act::Kill => {
                crate::sys::kill_self();
                std::process::abort();
            }
        }
    }
    #[cfg(not(all(feature = "failpoints", startos_failpoints, target_os = "linux")))]
    {
        let _ = name;
        Ok(())
    }
}
