use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An id that failed validation; carries the offending text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidId(pub String);

impl fmt::Display for InvalidId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid id {:?}: must match ^[a-z0-9]+(-[a-z0-9]+)*$",
            self.0
        )
    }
}

impl std::error::Error for InvalidId {}

/// `^[a-z0-9]+(-[a-z0-9]+)*$`, checked by hand so the crate needs no regex engine.
///
/// The rule matters beyond cosmetics: an id can hold neither `.` nor `/`, so
/// `<pkg>.install-backup` and every other suffixed name the volume store uses
/// can never be a package, and an id can never escape its parent directory.
fn is_valid_id(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A package id, validated as upstream does. Serialized as a plain string.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PackageId(String);

impl PackageId {
    /// The id as text; always a valid id.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `package <id>: <what>`, the one form every crate's error context and
    /// log line about a package takes.
    pub fn context(&self, what: impl fmt::Display) -> String {
        format!("package {self}: {what}")
    }
}

impl FromStr for PackageId {
    type Err = InvalidId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if is_valid_id(s) {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidId(s.to_owned()))
        }
    }
}

impl TryFrom<String> for PackageId {
    type Error = InvalidId;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        if is_valid_id(&s) {
            Ok(Self(s))
        } else {
            Err(InvalidId(s))
        }
    }
}

impl fmt::Display for PackageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Deref for PackageId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for PackageId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for PackageId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<Path> for PackageId {
    fn as_ref(&self) -> &Path {
        Path::new(&self.0)
    }
}

impl Serialize for PackageId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for PackageId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Self::try_from(s).map_err(serde::de::Error::custom)
    }
}

/// A volume id: an id as for packages, or the literal `BACKUP` (upstream's
/// volume for backup targets). Serialized as a plain string.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum VolumeId {
    /// The literal `BACKUP`.
    Backup,
    /// Any other volume, validated like a package id.
    Custom(PackageId),
}

impl VolumeId {
    /// The id as text, `BACKUP` for [`VolumeId::Backup`].
    pub fn as_str(&self) -> &str {
        match self {
            VolumeId::Backup => "BACKUP",
            VolumeId::Custom(id) => id.as_str(),
        }
    }
}

impl FromStr for VolumeId {
    type Err = InvalidId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "BACKUP" => Ok(VolumeId::Backup),
            s => s.parse().map(VolumeId::Custom),
        }
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for VolumeId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<Path> for VolumeId {
    fn as_ref(&self) -> &Path {
        Path::new(self.as_str())
    }
}

impl Serialize for VolumeId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for VolumeId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_ids_follow_the_upstream_pattern() {
        for ok in ["a", "bitcoind", "lnd-2", "a-b-c", "0", "x9"] {
            assert!(ok.parse::<PackageId>().is_ok(), "{ok} should be valid");
        }
        for bad in [
            "", "-a", "a-", "a--b", "A", "a.b", "a/b", "..", "a b", "é", "a_b",
        ] {
            assert!(
                bad.parse::<PackageId>().is_err(),
                "{bad:?} should be invalid"
            );
        }
    }

    #[test]
    fn volume_ids_accept_backup_literal_only_in_upper_case() {
        assert_eq!("BACKUP".parse::<VolumeId>(), Ok(VolumeId::Backup));
        assert!("main".parse::<VolumeId>().is_ok());
        assert!("Backup".parse::<VolumeId>().is_err());
        assert!("BACKUPS".parse::<VolumeId>().is_err());
    }

    #[test]
    fn ids_serialize_as_plain_strings() {
        let id: PackageId = "lnd".parse().unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"lnd\"");
        assert_eq!(
            serde_json::to_string(&VolumeId::Backup).unwrap(),
            "\"BACKUP\""
        );
        assert!(serde_json::from_str::<PackageId>("\"no.dots\"").is_err());
        let v: VolumeId = serde_json::from_str("\"main\"").unwrap();
        assert_eq!(v.as_str(), "main");
    }
}
