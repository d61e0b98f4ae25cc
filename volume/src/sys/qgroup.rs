//! btrfs quota groups (qgroups): what the quota tree says of the
//! filesystem's quotas and of one qgroup (its limit, the groups it is a
//! member of), and the ioctls that change them (BTRFS_IOC_QGROUP_LIMIT,
//! BTRFS_IOC_QGROUP_ASSIGN, BTRFS_IOC_QUOTA_CTL), with the
//! `struct btrfs_qgroup_inherit` a new subvolume or snapshot is given
//! (see [`super::subvolume::create_snapshot_with`]).
//!
//! Everything is read from the quota tree (tree 8) with TREE_SEARCH_V2:
//! its status item `(0, QGROUP_STATUS, 0)`, one limit item `(0,
//! QGROUP_LIMIT, qgroupid)` per qgroup and one relation item each way
//! `(member, QGROUP_RELATION, group)`, `(group, QGROUP_RELATION, member)`
//! per membership. A filesystem without quotas has no quota tree, and the
//! search says so with ENOENT: [`quota_status`] is then one ioctl and
//! nothing more, the only price such a filesystem pays.
//!
//! Constants mirror `linux/btrfs.h` and `linux/btrfs_tree.h` (6.7+ for the
//! simple-quota ones); `integration/tests/quota.rs` checks each against
//! what the kernel and btrfs-progs write and read, and
//! `volume/tests/sys_primitives.rs` the inherit on both backends. Nothing here is
//! written to disk but by the kernel: a crash leaves each change applied
//! or not, as its transaction committed or not.

use std::io;
use std::ops::ControlFlow;
use std::os::fd::BorrowedFd;

use rustix::ioctl::{Opcode, Setter, Updater, opcode};

use super::ioctl::{BTRFS_IOCTL_MAGIC, ensure_btrfs, malformed};
use super::search::{ItemKey, KeyRange, Searcher};

/// `BTRFS_QUOTA_TREE_OBJECTID`: the tree holding the qgroup items.
const QUOTA_TREE: u64 = 8;
/// `BTRFS_QGROUP_STATUS_KEY`: the one status item, `(0, STATUS, 0)`.
const QGROUP_STATUS_KEY: u8 = 240;
/// `BTRFS_QGROUP_INFO_KEY`: usage, `(0, INFO, qgroupid)`.
const QGROUP_INFO_KEY: u8 = 242;
/// `BTRFS_QGROUP_LIMIT_KEY`: limits, `(0, LIMIT, qgroupid)`.
const QGROUP_LIMIT_KEY: u8 = 244;
/// `BTRFS_QGROUP_RELATION_KEY`: `(member, RELATION, group)` and back.
const QGROUP_RELATION_KEY: u8 = 246;
/// `flags` in `struct btrfs_qgroup_status_item`.
const STATUS_FLAGS: usize = 16;
/// `BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT`: the numbers need a rescan.
const STATUS_INCONSISTENT: u64 = 1 << 2;
/// `BTRFS_QGROUP_STATUS_FLAG_RESCAN`: a rescan is under way.
const STATUS_RESCAN: u64 = 1 << 1;
/// `BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE` (6.7+): simple quotas.
const STATUS_SIMPLE_MODE: u64 = 1 << 3;
/// `BTRFS_QGROUP_LEVEL_SHIFT`: a qgroup id is `level << 48 | id`.
pub const QGROUP_LEVEL_SHIFT: u32 = 48;
/// `BTRFS_QGROUP_LIMIT_MAX_RFER`, and the three after it: the limit
/// flags [`set_qgroup_limit`] sets or clears one by one.
pub const LIMIT_MAX_RFER: u64 = 1 << 0;
/// `BTRFS_QGROUP_LIMIT_MAX_EXCL`.
pub const LIMIT_MAX_EXCL: u64 = 1 << 1;
/// `BTRFS_QGROUP_LIMIT_RSV_RFER`.
pub const LIMIT_RSV_RFER: u64 = 1 << 2;
/// `BTRFS_QGROUP_LIMIT_RSV_EXCL`.
pub const LIMIT_RSV_EXCL: u64 = 1 << 3;
/// The value BTRFS_IOC_QGROUP_LIMIT reads as "clear this limit".
const CLEAR_VALUE: u64 = u64::MAX;
/// `BTRFS_QUOTA_CTL_ENABLE`.
const QUOTA_CTL_ENABLE: u64 = 1;
/// `BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA` (6.7+).
const QUOTA_CTL_ENABLE_SIMPLE: u64 = 4;
/// The kernel refuses an inherit larger than a page (`PAGE_SIZE`, 4 KiB
/// on every architecture StartOS runs on).
#[cfg_attr(feature = "btrfsutil", allow(dead_code))] // laid out by the native backend only
const INHERIT_MAX_BYTES: usize = 4096;

/// `struct btrfs_qgroup_limit`, in the limit ioctl's args.
#[repr(C)]
#[derive(Clone, Copy)]
struct LimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}
const _: () = assert!(std::mem::size_of::<LimitArgs>() == 48);

/// `struct btrfs_ioctl_qgroup_assign_args`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AssignArgs {
    assign: u64,
    src: u64,
    dst: u64,
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
#[derive(Clone, Copy)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

const QUOTA_CTL: Opcode = opcode::read_write::<QuotaCtlArgs>(BTRFS_IOCTL_MAGIC, 40);
const QGROUP_ASSIGN: Opcode = opcode::write::<AssignArgs>(BTRFS_IOCTL_MAGIC, 41);
/// `_IOR` in `linux/btrfs.h`, although the kernel only reads the args.
const QGROUP_LIMIT: Opcode = opcode::read::<LimitArgs>(BTRFS_IOCTL_MAGIC, 43);

/// Which accounting the filesystem's quotas use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    /// Full qgroups (`btrfs quota enable`): every extent's referencing
    /// subvolumes are walked at each commit.
    Full,
    /// Simple quotas (6.7+, BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA): each
    /// extent is charged to the subvolume that allocated it.
    Simple,
}

/// The quota tree's status item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaStatus {
    /// The accounting in use.
    pub mode: QuotaMode,
    /// `BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT`: the kernel knows its
    /// numbers are wrong until a rescan (as of the last commit: the item
    /// is written by each commit).
    pub inconsistent: bool,
    /// A rescan is under way.
    pub rescanning: bool,
}

/// A qgroup's limits, `struct btrfs_qgroup_limit_item`. The default is
/// no limit at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QgroupLimit {
    /// `BTRFS_QGROUP_LIMIT_*`: which of the values below hold.
    pub flags: u64,
    /// Most bytes the qgroup may reference.
    pub max_rfer: u64,
    /// Most bytes it may hold exclusively.
    pub max_excl: u64,
    /// Reserved referenced bytes.
    pub rsv_rfer: u64,
    /// Reserved exclusive bytes.
    pub rsv_excl: u64,
}

/// A qgroup's usage, `struct btrfs_qgroup_info_item`, as of the last
/// commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QgroupUsage {
    /// Bytes referenced.
    pub rfer: u64,
    /// Bytes held by this qgroup alone.
    pub excl: u64,
}

/// The `struct btrfs_qgroup_inherit` a new subvolume or snapshot is
/// created with (BTRFS_SUBVOL_QGROUP_INHERIT): the groups it joins, in
/// the same transaction that creates it. Given one, even empty, the
/// kernel adds the new subvolume to exactly these groups (and, for simple
/// quotas, no longer to those of the subvolume it is created in).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QgroupInherit {
    /// Level 1 and higher qgroup ids.
    pub groups: Vec<u64>,
}

impl QgroupInherit {
    /// The struct as the kernel reads it: flags, num_qgroups,
    /// num_ref_copies, num_excl_copies, the limit (unused: no
    /// BTRFS_QGROUP_INHERIT_SET_LIMITS, which a full-quota snapshot would
    /// override with its source's limit anyway), then the group ids.
    /// E2BIG past the kernel's one-page bound.
    #[cfg_attr(feature = "btrfsutil", allow(dead_code))]
    pub(super) fn to_words(&self) -> io::Result<Vec<u64>> {
        let mut words = vec![0u64; 9];
        words[1] = self.groups.len() as u64;
        words.extend_from_slice(&self.groups);
        if words.len() * 8 > INHERIT_MAX_BYTES {
            return Err(io::Error::from_raw_os_error(libc::E2BIG));
        }
        Ok(words)
    }
}

/// The level of qgroup `id` (0 for a subvolume's own).
pub fn qgroup_level(id: u64) -> u16 {
    (id >> QGROUP_LEVEL_SHIFT) as u16
}

/// A searcher for the quota tree, whose calls the trace names apart.
fn quota_searcher() -> Searcher {
    Searcher::default().named("ioctl TREE_SEARCH_V2 quota tree")
}

/// The items of the quota tree keyed `(objectid, item_type, offset)` for
/// every offset in `offsets`.
fn items(
    fd: BorrowedFd<'_>,
    objectid: u64,
    item_type: u8,
    offsets: (u64, u64),
    mut visit: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut failed = None;
    let range = KeyRange {
        min: ItemKey {
            objectid,
            item_type,
            offset: offsets.0,
        },
        max: ItemKey {
            objectid,
            item_type,
            offset: offsets.1,
        },
    };
    quota_searcher().search_tree(fd, QUOTA_TREE, range, |key, body| {
        // The range bounds all three fields; checked all the same.
        if key.objectid != objectid || key.item_type != item_type {
            return ControlFlow::Continue(());
        }
        match visit(key.offset, body) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    failed.map_or(Ok(()), Err)
}

/// The little-endian u64 at `at` of an item body, or a parse error
/// naming the item.
fn le64(body: &[u8], at: usize, item: &str) -> io::Result<u64> {
    body.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| malformed(&format!("{item} item of {} bytes", body.len())))
}

/// Whether quotas are on for the filesystem holding `fd`, and how: one
/// TREE_SEARCH_V2 of the quota tree's status item. `None` when quotas are
/// off (the kernel has no quota tree: ENOENT). Needs CAP_SYS_ADMIN;
/// ENOTTY off btrfs.
pub fn quota_status(fd: BorrowedFd<'_>) -> io::Result<Option<QuotaStatus>> {
    let mut flags = None;
    let read = items(fd, 0, QGROUP_STATUS_KEY, (0, 0), |_, body| {
        flags = Some(le64(body, STATUS_FLAGS, "qgroup status")?);
        Ok(())
    });
    match read {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        other => other?,
    }
    // A quota tree without its status item is not one the kernel wrote.
    let flags = flags.ok_or_else(|| malformed("a quota tree without its status item"))?;
    Ok(Some(QuotaStatus {
        mode: match flags & STATUS_SIMPLE_MODE {
            0 => QuotaMode::Full,
            _ => QuotaMode::Simple,
        },
        inconsistent: flags & STATUS_INCONSISTENT != 0,
        rescanning: flags & STATUS_RESCAN != 0,
    }))
}

/// The limits of qgroup `qgroupid`: `None` if the quota tree has no limit
/// item for it (no such qgroup). ENOENT if quotas are off.
pub fn qgroup_limit(fd: BorrowedFd<'_>, qgroupid: u64) -> io::Result<Option<QgroupLimit>> {
    let mut limit = None;
    items(fd, 0, QGROUP_LIMIT_KEY, (qgroupid, qgroupid), |_, body| {
        let at = |n: usize| le64(body, n * 8, "qgroup limit");
        limit = Some(QgroupLimit {
            flags: at(0)?,
            max_rfer: at(1)?,
            max_excl: at(2)?,
            rsv_rfer: at(3)?,
            rsv_excl: at(4)?,
        });
        Ok(())
    })?;
    Ok(limit)
}

/// The usage of qgroup `qgroupid` as of the last commit: `None` if there
/// is no such qgroup. ENOENT if quotas are off.
pub fn qgroup_usage(fd: BorrowedFd<'_>, qgroupid: u64) -> io::Result<Option<QgroupUsage>> {
    let mut usage = None;
    items(fd, 0, QGROUP_INFO_KEY, (qgroupid, qgroupid), |_, body| {
        // generation, rfer, rfer_cmpr, excl, excl_cmpr.
        usage = Some(QgroupUsage {
            rfer: le64(body, 8, "qgroup info")?,
            excl: le64(body, 24, "qgroup info")?,
        });
        Ok(())
    })?;
    Ok(usage)
}

/// The groups qgroup `qgroupid` is a direct member of (each of a higher
/// level), in id order. ENOENT if quotas are off.
pub fn qgroup_parents(fd: BorrowedFd<'_>, qgroupid: u64) -> io::Result<Vec<u64>> {
    let mut parents = Vec::new();
    // Relation items go both ways: from a member, those above it.
    let above = (qgroupid | ((1 << QGROUP_LEVEL_SHIFT) - 1)).saturating_add(1);
    items(
        fd,
        qgroupid,
        QGROUP_RELATION_KEY,
        (above, u64::MAX),
        |group, _| {
            parents.push(group);
            Ok(())
        },
    )?;
    Ok(parents)
}

/// Sets the limits of qgroup `qgroupid` to exactly `limit`
/// (BTRFS_IOC_QGROUP_LIMIT): each of max_rfer, max_excl, rsv_rfer and
/// rsv_excl set if its flag is in `limit.flags`, cleared otherwise. The
/// kernel has no way to clear the other flags (the `*_CMPR` ones), which
/// are only ever added. Takes effect in the running transaction, durable
/// with its commit. ENOENT for no such qgroup, ENOTCONN if quotas are off.
pub fn set_qgroup_limit(fd: BorrowedFd<'_>, qgroupid: u64, limit: &QgroupLimit) -> io::Result<()> {
    ensure_btrfs(fd)?;
    let each = [
        LIMIT_MAX_RFER,
        LIMIT_MAX_EXCL,
        LIMIT_RSV_RFER,
        LIMIT_RSV_EXCL,
    ];
    let value = |flag: u64, v: u64| {
        if limit.flags & flag != 0 {
            v
        } else {
            CLEAR_VALUE
        }
    };
    let mut args = LimitArgs {
        qgroupid,
        flags: limit.flags | each.iter().fold(0, |a, f| a | f),
        max_rfer: value(LIMIT_MAX_RFER, limit.max_rfer),
        max_excl: value(LIMIT_MAX_EXCL, limit.max_excl),
        rsv_rfer: value(LIMIT_RSV_RFER, limit.rsv_rfer),
        rsv_excl: value(LIMIT_RSV_EXCL, limit.rsv_excl),
    };
    super::fault::check("ioctl QGROUP_LIMIT")?;
    // SAFETY: QGROUP_LIMIT takes a `struct btrfs_ioctl_qgroup_limit_args`,
    // which LimitArgs matches in size and layout; the kernel reads it.
    unsafe { rustix::ioctl::ioctl(fd, Updater::<QGROUP_LIMIT, LimitArgs>::new(&mut args)) }?;
    Ok(())
}

/// Makes qgroup `member` a member of `group` (`assign`), or no longer
/// (BTRFS_IOC_QGROUP_ASSIGN). With full quotas the kernel carries the
/// member's numbers up at once only when it holds all its bytes alone;
/// otherwise it marks the quotas inconsistent until a rescan. EEXIST or
/// ENOENT when already so.
pub fn assign_qgroup(fd: BorrowedFd<'_>, member: u64, group: u64, assign: bool) -> io::Result<()> {
    ensure_btrfs(fd)?;
    let args = AssignArgs {
        assign: u64::from(assign),
        src: member,
        dst: group,
    };
    super::fault::check("ioctl QGROUP_ASSIGN")?;
    // SAFETY: QGROUP_ASSIGN is _IOW with a `struct
    // btrfs_ioctl_qgroup_assign_args`, which AssignArgs matches; the kernel
    // reads it. A positive return (a rescan advised) is not an error.
    unsafe { rustix::ioctl::ioctl(fd, Setter::<QGROUP_ASSIGN, AssignArgs>::new(args)) }?;
    Ok(())
}

/// Turns quotas on for the filesystem holding `fd` (BTRFS_IOC_QUOTA_CTL),
/// full or simple (6.7+; btrfs-progs before 6.7 cannot): for tests and
/// tools, never called by the volume operations.
pub fn enable_quotas(fd: BorrowedFd<'_>, mode: QuotaMode) -> io::Result<()> {
    ensure_btrfs(fd)?;
    let mut args = QuotaCtlArgs {
        cmd: match mode {
            QuotaMode::Full => QUOTA_CTL_ENABLE,
            QuotaMode::Simple => QUOTA_CTL_ENABLE_SIMPLE,
        },
        status: 0,
    };
    super::fault::check("ioctl QUOTA_CTL")?;
    // SAFETY: QUOTA_CTL is _IOWR with a `struct btrfs_ioctl_quota_ctl_args`,
    // which QuotaCtlArgs matches.
    unsafe { rustix::ioctl::ioctl(fd, Updater::<QUOTA_CTL, QuotaCtlArgs>::new(&mut args)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inherit_is_laid_out_as_the_kernel_reads_it() {
        let words = QgroupInherit {
            groups: vec![1 << 48 | 100, 2 << 48 | 1],
        }
        .to_words()
        .expect("fits");
        assert_eq!(words.len(), 9 + 2);
        assert_eq!(words[1], 2, "num_qgroups");
        assert_eq!(&words[9..], &[1 << 48 | 100, 2 << 48 | 1]);
        assert_eq!(QgroupInherit::default().to_words().expect("fits").len(), 9);
        let many = QgroupInherit {
            groups: vec![1 << 48; 504],
        };
        assert_eq!(
            many.to_words().err().and_then(|e| e.raw_os_error()),
            Some(libc::E2BIG)
        );
    }

    #[test]
    fn levels_come_from_the_top_sixteen_bits() {
        assert_eq!(qgroup_level(256), 0);
        assert_eq!(qgroup_level(1 << 48 | 100), 1);
        assert_eq!(qgroup_level(u64::MAX), u16::MAX);
    }
}
