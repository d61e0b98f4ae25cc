//! Quota-managed boxes: a volume's qgroup limit and its memberships of
//! higher-level qgroups, carried to every tree that takes its place or
//! copies it.
//!
//! btrfs ties a qgroup to a subvolume, not to a name: a restore's
//! replacement, a backup and a conversion's new subvolume are new
//! subvolumes with new qgroups. Left to itself the kernel gives a snapshot
//! its source's limit with full qgroups and none with simple quotas, adds
//! it to no group with full qgroups (and then marks the quotas
//! inconsistent whenever the source is a member of one) and, with simple
//! quotas, to the groups of the subvolume it is created in, not its
//! source's. So every snapshot made here passes an inherit naming its
//! source's groups ([`QuotaCarry::inherit`]), and a tree that becomes the
//! volume is given the limit before it does ([`QuotaCarry::apply`]).
//!
//! What is carried is the source's as the operation reads it: for a
//! restore, the live volume's (an administrator's change since the backup
//! stays), for a backup the live volume's groups, for a conversion the
//! subvolume the plain directory sat in (every byte of the directory was
//! that subvolume's, and counted against its limit and its groups, so the
//! new subvolume gets the same limit and joins the same groups; the
//! parent's own level-0 limit no longer covers the data moved out of it,
//! which only a level-1 group can bound across subvolumes).
//!
//! A filesystem without quotas pays one TREE_SEARCH_V2 of the quota tree
//! per operation ([`QuotaCarry::check`], answered ENOENT) and nothing
//! else.
//!
//! Crash safety: the inherit takes effect in the transaction that creates
//! the snapshot; the limit (BTRFS_IOC_QGROUP_LIMIT) in the running
//! transaction, before the commit that precedes the tree's exchange into
//! the volume's name, so no committed state shows the volume under its
//! name without its limit. A crash before that commit leaves only the
//! temporary tree, which recovery deletes, as it would without quotas.

use std::io;
use std::os::fd::BorrowedFd;

use crate::sys::{self, QgroupInherit, QgroupLimit, QuotaStatus};

/// The qgroup settings of one subvolume, to give to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaCarry {
    /// The quota tree's status when read.
    pub status: QuotaStatus,
    /// The source subvolume's id, which is its qgroup's.
    pub source: u64,
    /// Its limit (no flags: none).
    pub limit: QgroupLimit,
    /// The groups it is a direct member of, in id order.
    pub groups: Vec<u64>,
}

/// Quotas are secondary to the data they count: an error reading or
/// carrying them (a quota tree that cannot be read, a qgroup that
/// vanished) is logged, naming `what`, and the operation goes on as on a
/// filesystem without quotas, so a restore, a backup or a conversion never
/// fails for a qgroup. What is lost is the limit or the memberships of
/// that one tree, which the warning says.
pub fn or_warn<T>(what: impl std::fmt::Display, r: io::Result<Option<T>>) -> Option<T> {
    r.unwrap_or_else(|e| {
        tracing::warn!("{what}: qgroup limit and groups not carried: {e}");
        None
    })
}

/// Whether `e` says the quota tree is gone: quotas were turned off.
fn quotas_gone(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOENT)
}

/// `limit` with the values its flags do not hold zeroed, as the kernel
/// keeps them once cleared: two limits compare equal when they bound the
/// same things by the same amounts.
fn normalized(limit: QgroupLimit) -> QgroupLimit {
    let keep = |flag: u64, v: u64| if limit.flags & flag != 0 { v } else { 0 };
    QgroupLimit {
        flags: limit.flags,
        max_rfer: keep(sys::LIMIT_MAX_RFER, limit.max_rfer),
        max_excl: keep(sys::LIMIT_MAX_EXCL, limit.max_excl),
        rsv_rfer: keep(sys::LIMIT_RSV_RFER, limit.rsv_rfer),
        rsv_excl: keep(sys::LIMIT_RSV_EXCL, limit.rsv_excl),
    }
}

impl QuotaCarry {
    /// Whether quotas are on for the filesystem holding `fd`: the one
    /// check every operation makes, one TREE_SEARCH_V2 (ENOENT, `None`,
    /// when quotas are off). Needs CAP_SYS_ADMIN.
    pub fn check(fd: BorrowedFd<'_>) -> io::Result<Option<QuotaStatus>> {
        sys::quota_status(fd)
    }

    /// What the subvolume holding `source` (a subvolume's root, or any
    /// directory in it) carries, once [`QuotaCarry::check`] said quotas
    /// are on: its id (GET_SUBVOL_INFO), limit and groups (two searches).
    /// `None` if quotas were turned off meanwhile.
    pub fn of(status: QuotaStatus, source: BorrowedFd<'_>) -> io::Result<Option<QuotaCarry>> {
        let id = sys::subvolume_info(source)?.id;
        let read = sys::qgroup_limit(source, id)
            .and_then(|limit| Ok((limit, sys::qgroup_parents(source, id)?)));
        match read {
            Ok((limit, groups)) => Ok(Some(QuotaCarry {
                status,
                source: id,
                limit: normalized(limit.unwrap_or_default()),
                groups,
            })),
            Err(e) if quotas_gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// [`QuotaCarry::check`], then [`QuotaCarry::of`] `source`.
    pub fn read(source: BorrowedFd<'_>) -> io::Result<Option<QuotaCarry>> {
        match Self::check(source)? {
            Some(status) => Self::of(status, source),
            None => Ok(None),
        }
    }

    /// The inherit a snapshot or subvolume standing for the source is
    /// created with: exactly the source's groups (none included: with
    /// simple quotas an empty inherit keeps the kernel from adding the
    /// groups of the subvolume it is created in).
    pub fn inherit(&self) -> QgroupInherit {
        QgroupInherit {
            groups: self.groups.clone(),
        }
    }

    /// [`QuotaCarry::inherit`] of an optional carry: `None` (no inherit
    /// passed, nothing changed) without quotas.
    pub fn inherit_of(carry: Option<&QuotaCarry>) -> Option<QgroupInherit> {
        carry.map(QuotaCarry::inherit)
    }

    /// Gives the subvolume open as `fd` the carried limit and makes its
    /// qgroup a member of exactly the carried groups, changing only what
    /// differs (a tree made with [`QuotaCarry::inherit`] has the groups
    /// already: with full quotas a membership added afterwards to a tree
    /// sharing its extents marks the quotas inconsistent). The changes are
    /// in the running transaction: the caller's next commit makes them
    /// durable. Quotas turned off meanwhile: nothing to do.
    pub fn apply(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        match self.apply_to(fd) {
            Err(e) if quotas_gone(&e) => Ok(()),
            other => other,
        }
    }

    fn apply_to(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        let id = sys::subvolume_info(fd)?.id;
        let limit = normalized(sys::qgroup_limit(fd, id)?.unwrap_or_default());
        if limit != self.limit {
            sys::set_qgroup_limit(fd, id, &self.limit)?;
        }
        let groups = sys::qgroup_parents(fd, id)?;
        for g in self.groups.iter().filter(|g| !groups.contains(g)) {
            sys::assign_qgroup(fd, id, *g, true)?;
        }
        for g in groups.iter().filter(|g| !self.groups.contains(g)) {
            sys::assign_qgroup(fd, id, *g, false)?;
        }
        Ok(())
    }
}
