//! Records: the small facts the store keeps beside a package's trees.
//!
//! A record is a symlink in the volumes root whose target carries a short
//! value. It is never followed, only read with `readlinkat`. A symlink suits
//! a record because:
//! - `symlinkat` creates the name with its whole target in one step, so a
//!   crash leaves either no record or all of it, never a torn one;
//! - on btrfs the target is stored in the metadata tree, so writing a record
//!   needs no data space, and works on a filesystem whose data is full
//!   (writing even a byte of file data there fails with ENOSPC);
//! - it sits in the volumes root, which no package can write to, so nothing
//!   a package puts in its volume can forge one.
//!
//! The identity of a complete rollback copy ([`Identity`], under
//! `<pkg>.rollback.id`) is such a record. The read-only nested subvolumes
//! of a backup, a set of any size, are a *set record* (`write_set`, under
//! `<pkg>.install-backup.ro`): a directory of empty files named by the
//! ids, equally metadata-only and equally out of a package's reach.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io;
use std::os::fd::BorrowedFd;

use crate::sys;

/// The longest value a record holds: far below any filesystem's limit on a
/// symlink target (btrfs takes about 3.9 KiB, the page size less headers).
pub const MAX_RECORD: usize = 2048;

/// Writes the record `name` in `root` holding `value`, which must be new
/// (EEXIST otherwise). Not yet durable: callers commit or fsync `root`.
pub fn write(root: BorrowedFd<'_>, name: &OsStr, value: &str) -> io::Result<()> {
    if value.is_empty() || value.len() > MAX_RECORD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a record holds 1 to {MAX_RECORD} bytes, not {}",
                value.len()
            ),
        ));
    }
    sys::symlink_at(root, name, value.as_bytes())
}

/// The record `name` in `root`: `None` if absent. A name that is not a
/// symlink is no record of ours: an `InvalidData` error naming it.
pub fn read(root: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<String>> {
    match sys::read_link_at(root, name) {
        Ok(Some(target)) => Ok(Some(String::from_utf8_lossy(&target).into_owned())),
        Ok(None) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not a symlink, so not a record this crate wrote; move it away",
                name.to_string_lossy()
            ),
        )),
        Err(e) => Err(e),
    }
}

/// Removes the record `name`, absent or not.
pub fn remove(root: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    sys::unlink_if_exists(root, name)
}

/// Which tree an entry of the root is, whatever its name: what a rollback
/// record holds, so that recovery can tell the two sides of the exchange
/// apart without reading anything inside either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// A subvolume, by its UUID (never reused).
    Subvolume([u8; 16]),
    /// A plain directory, by its inode number and birth time (an inode
    /// number alone can be reused once the inode is deleted; both together
    /// are not, in practice).
    Directory {
        /// Inode number, in the root's subvolume.
        ino: u64,
        /// Birth time (seconds, nanoseconds), where the filesystem keeps one.
        birth: Option<(i64, i64)>,
    },
}

impl Identity {
    /// The identity of the directory open as `dir`.
    pub fn of(dir: BorrowedFd<'_>) -> io::Result<Identity> {
        if sys::is_subvolume(dir)? {
            return Ok(Identity::Subvolume(sys::subvolume_info(dir)?.uuid));
        }
        Ok(Identity::Directory {
            ino: sys::stat(dir)?.ino,
            birth: sys::birth_time(dir)?,
        })
    }

    /// The identity of the entry `name` of `root`, if it is a directory.
    pub fn of_entry(root: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<Identity>> {
        match sys::stat_at(root, name)? {
            Some(st) if st.is_dir() => {
                let fd = sys::open_dir_at(root, name)?;
                Identity::of(std::os::fd::AsFd::as_fd(&fd)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The record's text: `subvolume <uuid>` or `directory <ino> <sec>.<nsec>`
    /// (`-` for no birth time).
    pub fn encode(&self) -> String {
        match self {
            Identity::Subvolume(uuid) => {
                let mut s = String::from("subvolume ");
                for b in uuid {
                    let _ = write!(s, "{b:02x}");
                }
                s
            }
            Identity::Directory { ino, birth } => match birth {
                Some((sec, nsec)) => format!("directory {ino} {sec}.{nsec:09}"),
                None => format!("directory {ino} -"),
            },
        }
    }

    /// Parses [`Identity::encode`]'s text; `None` for anything else.
    pub fn decode(text: &str) -> Option<Identity> {
        let mut words = text.split(' ');
        let identity = match words.next()? {
            "subvolume" => {
                let hex = words.next()?;
                if hex.len() != 32 {
                    return None;
                }
                let mut uuid = [0u8; 16];
                for (i, b) in uuid.iter_mut().enumerate() {
                    *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
                }
                Identity::Subvolume(uuid)
            }
            "directory" => {
                let ino = words.next()?.parse().ok()?;
                let birth = match words.next()? {
                    "-" => None,
                    t => {
                        let (sec, nsec) = t.split_once('.')?;
                        Some((sec.parse().ok()?, nsec.parse().ok()?))
                    }
                };
                Identity::Directory { ino, birth }
            }
            _ => return None,
        };
        words.next().is_none().then_some(identity)
    }
}

/// Writes the set record `name` in `root`: a new directory holding one
/// empty file per id, named by it. Unbounded, and needing metadata space
/// only; not atomic, so it is only ever written where it counts once
/// something else is published after it (a backup's read-only record is
/// complete before the backup gets its name, and garbage without one).
pub(crate) fn write_set(root: BorrowedFd<'_>, name: &OsStr, ids: &BTreeSet<u64>) -> io::Result<()> {
    sys::mkdir_at(root, name, 0o700)?;
    let dir = sys::open_dir_at(root, name)?;
    for id in ids {
        sys::touch_at(
            std::os::fd::AsFd::as_fd(&dir),
            OsStr::new(&id.to_string()),
            0o600,
        )?;
    }
    sys::fsync(std::os::fd::AsFd::as_fd(&dir))
}

/// The set record `name` in `root`: `None` if absent; `InvalidData` for an
/// entry in it that is no id.
pub(crate) fn read_set(root: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<BTreeSet<u64>>> {
    let dir = match sys::stat_at(root, name)? {
        None => return Ok(None),
        Some(_) => sys::open_dir_at(root, name)?,
    };
    let mut ids = BTreeSet::new();
    for (entry, _, _) in sys::read_dir_names(std::os::fd::AsFd::as_fd(&dir))? {
        let id = entry.to_str().and_then(|e| e.parse().ok()).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{:?} in {} is no subvolume id",
                    entry,
                    name.to_string_lossy()
                ),
            )
        })?;
        ids.insert(id);
    }
    Ok(Some(ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_and_junk_is_refused() {
        for id in [
            Identity::Subvolume([0xab; 16]),
            Identity::Directory {
                ino: 257,
                birth: Some((1_700_000_000, 5)),
            },
            Identity::Directory {
                ino: 1 << 40,
                birth: None,
            },
        ] {
            assert_eq!(Identity::decode(&id.encode()), Some(id), "{}", id.encode());
        }
        for junk in [
            "",
            "subvolume",
            "subvolume abc",
            "subvolume zz00000000000000000000000000000",
            "directory 12",
            "directory x -",
            "directory 12 - extra",
            "complete",
        ] {
            assert_eq!(Identity::decode(junk), None, "{junk:?}");
        }
    }
}
