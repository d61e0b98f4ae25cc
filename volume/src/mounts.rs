//! What is mounted from inside a volume, read from `/proc/self/mountinfo`.
//!
//! A rollback or a delete must not run while a container (or another
//! package) still has a bind mount of the volume: that mount keeps pointing
//! at the old subvolume, so the service would go on writing into data that is
//! about to vanish.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// One line of mountinfo, the fields we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MountEntry {
    /// `major:minor` of the filesystem.
    pub dev: String,
    /// Path inside the filesystem that is mounted.
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

pub(crate) fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split(' ');
            let _id = f.next()?;
            let _parent = f.next()?;
            let dev = f.next()?.to_owned();
            let root = unescape(f.next()?);
            let mount_point = unescape(f.next()?);
            Some(MountEntry {
                dev,
                root,
                mount_point,
            })
        })
        .collect()
}

/// Mount points that expose something inside `path` (an absolute path with
/// no symlinks): mounts on top of it or below it, and bind mounts anywhere
/// whose source lies inside it.
pub(crate) fn mounts_inside(entries: &[MountEntry], path: &Path) -> Vec<PathBuf> {
    // The mount that holds `path` tells us its filesystem and where `path`
    // sits inside that filesystem, which is what a bind mount's root shows.
    let holder = entries
        .iter()
        .filter(|e| path.starts_with(&e.mount_point))
        .max_by_key(|e| e.mount_point.as_os_str().len());
    let inner = holder.and_then(|h| {
        let rel = path.strip_prefix(&h.mount_point).ok()?;
        Some((h.dev.as_str(), h.root.join(rel)))
    });
    entries
        .iter()
        .filter(|e| {
            e.mount_point.starts_with(path)
                || inner
                    .as_ref()
                    .is_some_and(|(dev, p)| e.dev == *dev && e.root.starts_with(p))
        })
        .map(|e| e.mount_point.clone())
        .collect()
}

/// Reads this process's mount table and returns what is mounted from inside
/// `path`.
///
/// Used before any step that would leave such a mount pointing at data that
/// is about to be replaced (a rollback, a delete, a conversion).
pub fn active_mounts_inside(path: &Path) -> io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(mounts_inside(&parse_mountinfo(&text), path))
}

/// Reads this process's mount table and returns the mount points strictly
/// below `path` (an absolute path with no symlinks): each hides what lies
/// under it in `path`'s filesystem from anything that walks the tree.
pub fn mount_points_below(path: &Path) -> io::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_mountinfo(&text)
        .into_iter()
        .filter(|e| e.mount_point != path && e.mount_point.starts_with(path))
        .map(|e| e.mount_point)
        .collect())
}

/// Formats mount points for a one-line error.
pub fn describe(mounts: &[PathBuf]) -> String {
    mounts
        .iter()
        .map(|m| String::from_utf8_lossy(m.as_os_str().as_bytes()).into_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 0:21 / / rw - ext4 /dev/vda rw
40 22 0:45 / /media/startos/data rw,relatime - btrfs /dev/loop0 rw
41 22 0:45 /package-data/volumes/lnd/data/main /var/lib/lxc/lnd/rootfs/data rw - btrfs /dev/loop0 rw
42 22 0:45 /package-data/volumes/lnd-tools/data/main /mnt/other rw - btrfs /dev/loop0 rw
43 40 0:50 / /media/startos/data/package-data/volumes/bitcoind/data/main/tmp rw - tmpfs tmpfs rw
44 22 0:46 /package-data/volumes/lnd/data/main /mnt/unrelated rw - btrfs /dev/loop1 rw
45 22 0:45 / /mnt/with\\040space rw - btrfs /dev/loop0 rw
";

    #[test]
    fn finds_bind_mounts_from_inside_and_mounts_on_top() {
        let e = parse_mountinfo(SAMPLE);
        let vols = Path::new("/media/startos/data/package-data/volumes");
        assert_eq!(
            mounts_inside(&e, &vols.join("lnd")),
            vec![PathBuf::from("/var/lib/lxc/lnd/rootfs/data")],
            "a bind mount of lnd counts, lnd-tools and another filesystem do not"
        );
        assert_eq!(
            mounts_inside(&e, &vols.join("bitcoind")),
            vec![vols.join("bitcoind/data/main/tmp")]
        );
        assert!(mounts_inside(&e, &vols.join("electrs")).is_empty());
    }

    #[test]
    fn unescapes_octal() {
        let e = parse_mountinfo(SAMPLE);
        assert_eq!(e[6].mount_point, PathBuf::from("/mnt/with space"));
    }
}
