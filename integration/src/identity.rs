//! Which files kept their identity through a conversion: inode number and
//! birth time (what a copy cannot keep), and ctime (what a rename
//! changes). Upstream's issue #3858: services that record them stop
//! trusting data whose files got new ones.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, CWD, StatxFlags, statx};

/// The name of the directory a deferred cut sets aside at the top of a
/// converted volume until the cleanup: not the package's.
pub const CARVE_REST: &str = ".startos-carve-rest";

/// One entry's identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Its inode number.
    pub ino: u64,
    /// Its birth time, seconds and nanoseconds.
    pub birth: (i64, u32),
    /// Its ctime.
    pub ctime: (i64, u32),
}

/// Every entry below the top of `dir` (the top becomes a subvolume's own
/// root in a conversion), by path from `dir`, a deferred cut's rest at the
/// top ([`CARVE_REST`], or that name with a suffix where the package had
/// an entry of that name) left out. Never follows a symlink. Fails on an
/// entry without a birth time (a nested subvolume's placeholder in a
/// snapshot, or a filesystem that keeps none).
pub fn identities(dir: &Path) -> io::Result<BTreeMap<PathBuf, Identity>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let path = e?.path();
            let name = path.file_name().unwrap_or_default().as_encoded_bytes();
            if d == dir && name.starts_with(CARVE_REST.as_bytes()) {
                continue;
            }
            let x = statx(
                CWD,
                &path,
                AtFlags::SYMLINK_NOFOLLOW,
                StatxFlags::TYPE | StatxFlags::INO | StatxFlags::BTIME | StatxFlags::CTIME,
            )?;
            if x.stx_mask & StatxFlags::BTIME.bits() == 0 {
                return Err(io::Error::other(format!(
                    "{}: no birth time",
                    path.display()
                )));
            }
            if u32::from(x.stx_mode) & libc::S_IFMT == libc::S_IFDIR {
                stack.push(path.clone());
            }
            let rel = path
                .strip_prefix(dir)
                .map_err(io::Error::other)?
                .to_path_buf();
            out.insert(
                rel,
                Identity {
                    ino: x.stx_ino,
                    birth: (x.stx_btime.tv_sec, x.stx_btime.tv_nsec),
                    ctime: (x.stx_ctime.tv_sec, x.stx_ctime.tv_nsec),
                },
            );
        }
    }
    Ok(out)
}

/// How many of `before`'s entries kept their identity in `after`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    /// Entries compared.
    pub entries: usize,
    /// Found under the same path with the same inode number and birth time.
    pub inode: usize,
    /// Of those, also with the same ctime.
    pub ctime: usize,
}

impl Kept {
    /// Compares `before` with `after`.
    pub fn of(before: &BTreeMap<PathBuf, Identity>, after: &BTreeMap<PathBuf, Identity>) -> Kept {
        let mut kept = Kept {
            entries: before.len(),
            ..Kept::default()
        };
        for (path, id) in before {
            if let Some(now) = after.get(path)
                && (now.ino, now.birth) == (id.ino, id.birth)
            {
                kept.inode += 1;
                kept.ctime += usize::from(now.ctime == id.ctime);
            }
        }
        kept
    }

    /// The share kept of inode numbers and birth times, of ctimes: `1.0`
    /// for nothing compared.
    pub fn shares(&self) -> (f64, f64) {
        if self.entries == 0 {
            return (1.0, 1.0);
        }
        let n = self.entries as f64;
        (self.inode as f64 / n, self.ctime as f64 / n)
    }

    /// `100% / 98% (ctime)`.
    pub fn describe(&self) -> String {
        let (inode, ctime) = self.shares();
        format!("{:.0}% / {:.0}%", inode * 100.0, ctime * 100.0)
    }
}
