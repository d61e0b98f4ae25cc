//! The record of a deferred cut: which directory at the top of a converted
//! volume holds what the cut did not remove yet.
//!
//! A cut with [`crate::carve::Removal::Deferred`] moves everything but the
//! package into one directory at the top of the new subvolume, so that the
//! exchange need not wait for its removal. `<pkg>.migrate-rest`, a record
//! in the volumes root written before the exchange, names that directory
//! and holds its identity (inode number and birth time): only a directory
//! with both is ever removed for it, so no tree a package or an operator
//! put there under that name is. The top of a volume is not what a
//! package's container sees (it mounts `data/<id>` and `assets/<id>`
//! below it), and the directory is root's, mode 0700.
//!
//! The record also holds the immutable and append-only flags the cut gave
//! the volume's root: the directory's own removal must lift them for a
//! moment, and a crash in that moment must not leave them off for good.
//!
//! Crash states: a record beside a plain `<pkg>` belongs to a cut that did
//! not reach the exchange (its snapshot is deleted with it); beside the
//! subvolume `<pkg>`, the directory it names is removed entry by entry,
//! then the record. A record whose directory is gone is removed. An install
//! backup taken before the removal holds the directory too, so the record
//! stays while one does: a restore of it brings the directory back, and
//! the next removal takes it away again.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::BorrowedFd;

use volume::record::{self, Identity};
use volume::sys::InodeFlags;

/// What the record says: the directory's name at the top of `<pkg>`, and
/// its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RestRecord {
    /// The directory's name (ASCII, from [`crate::carve`]).
    pub name: OsString,
    /// Its identity when the cut made it.
    pub identity: Identity,
    /// The immutable and append-only flags of the volume's root after the
    /// cut (no other flag: the others are never lifted).
    pub root_stuck: InodeFlags,
}

impl RestRecord {
    /// The record's text: the name, the root's flags in hexadecimal,
    /// [`Identity::encode`], separated by spaces.
    fn encode(&self) -> String {
        format!(
            "{} {:x} {}",
            self.name.to_string_lossy(),
            self.root_stuck.bits(),
            self.identity.encode()
        )
    }

    /// Parses [`RestRecord::encode`]'s text; `None` for anything else, or a
    /// name that is not a plain ASCII entry name.
    fn decode(text: &str) -> Option<RestRecord> {
        let (name, rest) = text.split_once(' ')?;
        let (flags, identity) = rest.split_once(' ')?;
        let root_stuck = InodeFlags::from_bits_retain(u32::from_str_radix(flags, 16).ok()?);
        if !(InodeFlags::IMMUTABLE | InodeFlags::APPEND).contains(root_stuck) {
            return None;
        }
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
        if !plain {
            return None;
        }
        Some(RestRecord {
            name: OsString::from(name),
            identity: Identity::decode(identity)?,
            root_stuck,
        })
    }

    /// Writes the record `record_name` in `root` (which must not have one).
    /// Not durable by itself: a symlink, metadata of the exchange's
    /// transaction or an earlier one, so durable with the exchange.
    pub fn write(&self, root: BorrowedFd<'_>, record_name: &OsStr) -> io::Result<()> {
        record::write(root, record_name, &self.encode())
    }

    /// The record `record_name` in `root`, if there is one. One that does
    /// not parse is an `InvalidData` error naming it: nothing is removed
    /// on its word.
    pub fn read(root: BorrowedFd<'_>, record_name: &OsStr) -> io::Result<Option<RestRecord>> {
        let Some(text) = record::read(root, record_name)? else {
            return Ok(None);
        };
        RestRecord::decode(&text).map(Some).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is not a deferred cut's record: {text:?}",
                    record_name.to_string_lossy()
                ),
            )
        })
    }

    /// Whether the directory this record names is in `dir` (the volume or
    /// its backup, open), with the same identity.
    pub fn is_in(&self, dir: BorrowedFd<'_>) -> io::Result<bool> {
        Ok(Identity::of_entry(dir, &self.name)? == Some(self.identity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_what_it_encodes_and_nothing_else() {
        let r = RestRecord {
            name: OsString::from(".startos-carve-rest.2"),
            identity: Identity::decode("directory 300 1733000000.000000005").expect("identity"),
            root_stuck: InodeFlags::IMMUTABLE,
        };
        assert_eq!(RestRecord::decode(&r.encode()), Some(r.clone()));
        let none = RestRecord {
            root_stuck: InodeFlags::empty(),
            ..r
        };
        assert_eq!(RestRecord::decode(&none.encode()), Some(none));
        for bad in [
            "",
            ".startos-carve-rest",
            "../x directory 300 1.5",
            "a/b directory 300 1.5",
            ". directory 300 1.5",
            "x directory nope",
            "x directory 300 1.5",
            "x 0 directory nope",
            "x zz directory 300 1.5",
            // NOCOW (0x800000) is not a flag the removal lifts.
            "x 800000 directory 300 1.5",
        ] {
            assert_eq!(RestRecord::decode(bad), None, "{bad:?}");
        }
    }
}
