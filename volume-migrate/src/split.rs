//! Sharing the cut among the packages: which snapshot each package's volume
//! is taken of, so that the background work stays bounded at any package
//! count.
//!
//! A package keeps every file's identity only if its volume is a snapshot
//! of the parent subvolume (or of a snapshot of it), and a snapshot holds
//! every tree its source held when it was taken; a tree leaves a subvolume
//! only entry by entry. Snapshotting the parent once per package therefore
//! makes each of n snapshots shed the whole box: about n times the box in
//! the background (150 packages: 195 s, against 5.88 s for cloning them).
//!
//! So the packages share cuts. A *share* is a snapshot of the parent, or of
//! the share above it, cut down (entry by entry, at once) to a set of
//! packages; a package's volume is then a snapshot of the smallest share
//! holding it, which sheds only that share's other members. The shares form
//! a binary tree over the packages, split by weight (what removing each
//! package's tree from a snapshot costs, [`crate::cost`]), so that a
//! package's entries are shed once per level of the tree above it: about
//! log2(n) times for a light package, fewer for a heavy one, which a split
//! by weight leaves near the top. The dominant package (the heaviest by the
//! count) is no member: its volume is a snapshot of the parent itself,
//! taken first, ready in milliseconds; the top share sheds it, and the rest
//! of the parent outside the packages, once for everyone else. Below the
//! top share, the heavy trees go out first: the heavy packages (those past
//! [`HEAVY_US`], whose weight the count only bounds) part from the light
//! ones, so that the light ones' share sheds every heavy tree once and no
//! level below it sheds one again; the halves by weight start below that.
//!
//! Light packages beside heavy ones are cloned instead ([`light_clones`]):
//! whatever holds the heavy trees, a light package's snapshot either sheds
//! them in the background (of the parent: the whole box for its few dozen
//! entries) or waits for a share's cut of them before its service may
//! start, and neither is within the bounds (0.2x upstream's wait,
//! 2x its work) at 8, 30 or 150 packages; a clone copies only its own
//! entries, at the cost of their identity, and the report names each with
//! why. What is left to snapshot is the heavy packages (and those between
//! [`LIGHT_US`] and the cap): from [`SPLIT_MIN`] on, no more than
//! [`PARENT_SNAPSHOTS_MAX`] are each a snapshot of the parent, ready in
//! milliseconds; more, and they share cuts as follows. Below it every
//! heavy package is a snapshot of the parent however many there are
//! ([`PARENT_SNAPSHOTS_MAX`] bounds the light ones kept), each ready in
//! milliseconds but past the bound on the work from five on (the
//! boxes bench's ten packages of 2,000 files: 4.3x upstream's work; a
//! known gap, see the README's boxes section).
//!
//! What a member waits for is the cut of every share above it that is not
//! made yet: the share's first member makes it, and the members after it in
//! the schedule's order (the tree's, depth first, the heavier half first:
//! its share sheds the lighter) find it made. With several members
//! converted at once ([`crate::Migrator::convert_each`]), whichever comes
//! to a share first makes it under the share's lock ([`ShareLocks`]) while
//! the others wait for it. Nothing of a package's own
//! tree is counted past [`HEAVY_US`] of cutting, so weighing costs at most
//! that per package; a package past it is heavy, weighed as that much.
//!
//! Shares trade readiness for the total, so they are made only where the
//! total is out of proportion: from [`SPLIT_MIN`] packages on. Below it
//! each package is snapshotted from the parent, heaviest first (the
//! dominant package ready first), every service ready in milliseconds: the per-package way sheds n - 1 boxes,
//! all at idle priority after every service has started, while shares
//! shed about log2(n) + 2 (the levels, the dominant package's snapshot,
//! the old trees) but make every light package wait for the cuts above
//! it, at least the top share's, which sheds the dominant package and the
//! rest whatever n is (the 8-package node box, 500,000 extents: the last
//! package ready after 863 ms with shares, 165 ms without, for 1.54x
//! upstream's work instead of 2.53x). [`SPLIT_MIN`] is the first count at
//! which the per-package way sheds two and a half times the boxes the
//! shares do (15 against 6, at 16); the factor is a judgement, the
//! project's order of priorities (readiness, then the total): a box of a
//! node's size keeps its readiness for up to about twice the shedding,
//! which no service waits for, and past it the wait buys a bounded total
//! (150 packages: 195 s of shedding the per-package way).
//!
//! What a share holds of a member is its tree when the top share's
//! snapshot of the parent was taken, and the member's own conversion comes
//! later, under its own lock, while the services of the packages converted
//! before it run: a dependent's container may hold a writable mount of the
//! member's plain directory. So the member's conversion first asks the
//! filesystem whether anything beneath that directory changed since
//! ([`member_written`]): with every dirty page and inode update committed,
//! each inode of the parent whose item was written in a transaction after
//! the one that took the top share's snapshot (its `otransid`) is looked
//! up in the share and climbed to its root; the first change made beneath
//! the member after the snapshot changed an inode beneath it then, so one
//! found beneath it there (or a file with several names) means written,
//! and what the conversion itself changed (renames and exchanges in the
//! volumes root, other members' directories, records) lies outside the
//! member's tree. Written, or the check failed: the member is snapshotted
//! from the parent instead, as below [`SPLIT_MIN`], which holds the write
//! (the report's [`crate::ShareUse`]). A write after the check is lost as
//! one after a snapshot of the parent would be, in a window a little longer:
//! from the check's commit, not the snapshot, to the exchange, so it also
//! spans the mount tables' read before the member's snapshot. A writer then
//! has no mount that read would show (one refuses the conversion), only a
//! descriptor kept past its unmount. The cost is one commit a member; a read that
//! updates an access time counts as a change (relatime: the first read
//! after a change), falling back for nothing lost.
//!
//! Crash safety: the shares live in one directory of the volumes root,
//! [`SPLIT_DIR`] (a name no package id has: ids hold no dot), each made
//! under `<id>.tmp` and renamed to `<id>` once cut, so a share under its
//! name is whole. Everything there is scratch: a schedule that plans shares
//! deletes what an earlier run left there first, a package's conversion
//! deletes the shares it was the last member of (with several at once,
//! the last of them to finish does), and the cleanup
//! ([`crate::Migrator::remove_all_old`]) deletes whatever is left. A crash
//! anywhere leaves at most shares there, which nothing reads but a run
//! that made them; the packages' own states are the crate's (a share is
//! only ever snapshotted into `<pkg>.migrate-parent`, as the parent is).
//! A share that cannot be made (an error, no space) fails no package: it
//! is snapshotted from the parent instead, shedding more.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use models::PackageId;
use serde::Serialize;
use volume::copy;
use volume::sys;

use crate::carve;
use crate::cost::Cost;
use crate::shed::COMMIT_EVERY;

/// The directory of the volumes root that holds the shares.
pub const SPLIT_DIR: &str = ".migrate-split";

/// How much cutting a package's tree is counted before it is taken as
/// heavy: 50 ms by [`crate::cost`] (about 860 entries, or 16,000 extent
/// items). The count of a light package is whole; weighing every package
/// costs at most this much counting each, before any service may start.
pub const HEAVY_US: u64 = 50_000;

/// How much cutting a package's tree is counted below [`SPLIT_MIN`], where
/// the count only orders the packages (the dominant one first): 5 ms by
/// [`crate::cost`] (about 86 entries or 1,600 extent items), a tenth of
/// [`HEAVY_US`]. With the full cap, 15 packages of a 40,000-extent file
/// each, cold, had the first service wait 240-262 ms instead of about 40.
pub const ORDER_US: u64 = 5_000;

/// The fewest packages converted by a snapshot for which shares are made:
/// the first count at which the per-package way sheds two and a half times
/// the boxes the shares do (n - 1 against log2(n) + 2), so that the wait
/// the shares' cuts put on the light packages buys a bounded total; a box
/// below it (a node's few services: the node box has 8) keeps every
/// service ready in milliseconds, each package snapshotted from the
/// parent (the module docs).
pub const SPLIT_MIN: usize = 16;

/// The most packages snapshotted from the parent itself in a box with a
/// heavy package: from [`SPLIT_MIN`] on, past it they share cuts; below
/// it, the light packages fill up to it (`light_clones`) but every heavy
/// package is snapshotted, however many (the module docs). Each such
/// snapshot sheds the whole box but its own package in the background.
/// Against upstream's two boxes of work (a clone and a removal of each
/// package), k of them and the old trees' removal measured about
/// (1 + 0.6 k) / 2 (a box's shedding costs about 0.6 of its clone; the
/// node box: 2.82x with its 8 packages so, 1.46x with 3): four keep the
/// issue's bound of 2x with a margin, five would not.
pub const PARENT_SNAPSHOTS_MAX: usize = 4;

/// How much cutting a light package's tree costs at most: [`ORDER_US`]
/// (about 86 entries or 1,600 extent items). Its clone costs about as
/// much; its snapshot, in a box with a heavy package, sheds that package.
pub const LIGHT_US: u64 = ORDER_US;

/// Whether the `snapshots` packages left to snapshot of a box of
/// `packages` (the light ones cloned, [`light_clones`]) share cuts: from
/// [`SPLIT_MIN`] packages on, unless they are no more than
/// [`PARENT_SNAPSHOTS_MAX`] and the parent's `rest` outside the packages,
/// which each of them would shed, stays within `rest_max` over them all
/// (the bound deciding sets, `REST_MAX_US`): each is then a snapshot of
/// the parent, ready in milliseconds, the shedding bounded as below
/// [`SPLIT_MIN`]. (Deciding bounded the rest over the two snapshots of the
/// parent shares take.) Pure.
pub(crate) fn shared(packages: usize, snapshots: usize, rest: &Cost, rest_max: u64) -> bool {
    let over = rest.at_least || rest.micros.saturating_mul(snapshots as u64) > rest_max;
    packages >= SPLIT_MIN && (snapshots > PARENT_SNAPSHOTS_MAX || over)
}

/// The light packages of `weighed` (each with what cutting its tree costs,
/// counted up to the cap) to clone rather than snapshot, by name; pure.
///
/// A package's identity is kept only by a snapshot, and a snapshot holds
/// the whole box: in a box holding a heavy package (one past the cap),
/// each light package's snapshot either sheds the heavy trees in the
/// background (of the parent: the whole box for a few dozen entries of its
/// own; the node box, every package so: 2.82x upstream's work) or waits
/// for a share cut of them (the light packages' share sheds every heavy
/// tree before the first light service may start: 863 ms at 8 packages,
/// about 1.5 s at 150, where the bound is 0.2x upstream's 2.8-3.7
/// s). Neither is within the bounds, so those light packages are
/// cloned and named in the report with why ([`crate::CloneReason::Light`]):
/// a clone copies its own few entries, the tree's identity is lost. From
/// [`SPLIT_MIN`] on, every light package; below it, the lightest beyond
/// the [`PARENT_SNAPSHOTS_MAX`] packages snapshotted from the parent,
/// heaviest first, so that a box of a few packages keeps every identity.
/// No heavy package: none (each snapshot sheds only light trees).
pub(crate) fn light_clones(weighed: &[Weighed]) -> Vec<PackageId> {
    if !weighed.iter().any(|(_, c)| c.at_least) {
        return Vec::new();
    }
    let mut light: Vec<&Weighed> = weighed
        .iter()
        .filter(|(_, c)| !c.at_least && c.micros <= LIGHT_US)
        .collect();
    light.sort_by(|a, b| b.1.micros.cmp(&a.1.micros).then_with(|| a.0.cmp(&b.0)));
    let snapshotted = match weighed.len() >= SPLIT_MIN {
        true => 0,
        false => PARENT_SNAPSHOTS_MAX.saturating_sub(weighed.len() - light.len()),
    };
    let mut out: Vec<PackageId> = light
        .into_iter()
        .skip(snapshotted)
        .map(|(p, _)| p.clone())
        .collect();
    out.sort();
    out
}

/// A package and what cutting its tree out of a snapshot costs.
pub(crate) type Weighed = (PackageId, Cost);

/// What a share's snapshot costs before any cut, by the same measure as
/// [`crate::cost`]: a transaction commit, 11-50 ms here.
pub const SNAPSHOT_US: u64 = 20_000;

/// A share: a snapshot of the parent, or of the share before it in a
/// package's path, cut down to its members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Share {
    /// Its name in [`SPLIT_DIR`]: `s` for the top share, then one digit a
    /// level (`s0`, `s01`): the path from the top.
    pub id: String,
    /// The packages it keeps.
    pub members: Vec<PackageId>,
}

/// Where one package's snapshot comes from, in the schedule's order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Placed {
    /// The shares from the top down to the one its volume is a snapshot
    /// of; empty: the parent itself.
    pub shares: Vec<Share>,
    /// The shares to delete once this package is converted: it is the last
    /// of their members in the schedule's order.
    pub drop: Vec<String>,
    /// What its conversion sheds or cuts: its snapshot's other members (or
    /// for the parent's, every other package and `rest`), and the shares
    /// it makes on the way.
    pub cost: Cost,
}

/// The schedule's order of `weighed` (each package with what cutting its
/// tree costs, counted up to [`HEAVY_US`]) and where each one's snapshot
/// comes from; `rest`: what the parent holds outside them (with the
/// trees of the packages cloned instead, [`light_clones`]); `shares`:
/// whether to make shares ([`shared`]). Pure.
pub(crate) fn layout(
    weighed: &[(PackageId, Cost)],
    rest: Cost,
    shares: bool,
) -> Vec<(PackageId, Placed)> {
    let total = weighed.iter().fold(rest, |acc, (_, c)| plus(acc, *c));
    let mut sorted: Vec<(PackageId, Cost)> = weighed.to_vec();
    sorted.sort_by(|a, b| rank(&b.1).cmp(&rank(&a.1)).then_with(|| a.0.cmp(&b.0)));
    // A share of one member sheds what its snapshot of the parent would.
    if !shares || weighed.len() < 3 {
        // Each a snapshot of the parent, heaviest first: the dominant
        // package ready first.
        return sorted
            .iter()
            .map(|(p, c)| {
                let cost = minus(total, *c);
                (
                    p.clone(),
                    Placed {
                        cost,
                        ..Placed::default()
                    },
                )
            })
            .collect();
    }
    let (dominant, dom_cost) = sorted.remove(0);
    let mut out = vec![(
        dominant,
        Placed {
            cost: minus(total, dom_cost),
            ..Placed::default()
        },
    )];
    // The top share sheds the dominant package and the rest, once. Below
    // it the heavy packages (those whose count stopped: their weight is
    // a lower bound) part from the light ones first, so that the light
    // ones' share sheds every heavy tree once; the heavy ones' share, which
    // sheds only the light ones, comes first.
    let top_cut = plus(dom_cost, rest);
    let (heavy, light): (Vec<Weighed>, Vec<Weighed>) =
        sorted.iter().cloned().partition(|(_, c)| c.at_least);
    let split = match heavy.is_empty() || light.is_empty() {
        true => halves(&sorted),
        false => (heavy, light),
    };
    tree(&sorted, split, "s", &mut Vec::new(), top_cut, &mut out);
    out
}

/// The order of weights, heaviest first: those past the cap (where what
/// was counted past it is the count's granularity, not weight), the one
/// with the most extent items counted first (a database, the service a
/// node's owner waits on); then the others by weight (ties by name, the
/// caller's).
fn rank(c: &Cost) -> (bool, u64) {
    (c.at_least, if c.at_least { c.extents } else { c.micros })
}

/// Places the members of the share `id` (heaviest first), whose own cut
/// costs `cut`, below the shares of `path`, parted into `split` (the first
/// part placed first).
fn tree(
    members: &[Weighed],
    split: (Vec<Weighed>, Vec<Weighed>),
    id: &str,
    path: &mut Vec<Share>,
    cut: Cost,
    out: &mut Vec<(PackageId, Placed)>,
) {
    path.push(Share {
        id: id.to_owned(),
        members: members.iter().map(|(p, _)| p.clone()).collect(),
    });
    let first = out.len();
    let weight = members
        .iter()
        .fold(Cost::default(), |a, (_, c)| plus(a, *c));
    let (first_part, second_part) = split;
    let mut made = Some(cut);
    for (i, half) in [first_part, second_part].into_iter().enumerate() {
        match half.as_slice() {
            [] => {}
            // One member, or too light to be worth a share of its own
            // (one member never is): each member is a snapshot of this
            // share, shedding the part's others.
            _ if !worth_a_share(&half) => {
                for (p, c) in &half {
                    let cost = minus(weight, *c);
                    let cost = made.take().map_or(cost, |m| plus(cost, m));
                    out.push((
                        p.clone(),
                        Placed {
                            shares: path.clone(),
                            drop: Vec::new(),
                            cost,
                        },
                    ));
                }
            }
            _ => {
                let sub = half.iter().fold(Cost::default(), |a, (_, c)| plus(a, *c));
                let child_cut = minus(weight, sub);
                let before = out.len();
                let parts = halves(&half);
                tree(&half, parts, &format!("{id}{i}"), path, child_cut, out);
                if let Some(m) = made.take()
                    && let Some((_, p)) = out.get_mut(before)
                {
                    p.cost = plus(p.cost, m);
                }
            }
        }
    }
    if out.len() > first
        && let Some((_, last)) = out.last_mut()
    {
        last.drop.push(id.to_owned());
    }
    path.pop();
}

/// Whether the `members` of one part of a share are worth a share of
/// their own: it costs a snapshot ([`SNAPSHOT_US`]) and the cut of the
/// part's sibling, and halves what each member's snapshot sheds below it,
/// so below about `(m/2 - 1) x weight > 2 x SNAPSHOT_US` its members are
/// each a snapshot of the share above, shedding the whole of it.
fn worth_a_share(members: &[Weighed]) -> bool {
    let m = members.len() as u64;
    let weight: u64 = members.iter().map(|(_, c)| c.micros).sum();
    (m / 2).saturating_sub(1).saturating_mul(weight) > 2 * SNAPSHOT_US
}

/// Splits `members` (heaviest first) into two halves of about equal
/// weight, each heaviest first: the heavier half first.
fn halves(members: &[Weighed]) -> (Vec<Weighed>, Vec<Weighed>) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut wa, mut wb) = (0u64, 0u64);
    for m in members {
        // Each into the lighter half so far; the first into `a`.
        if wa <= wb {
            wa += m.1.micros.max(1);
            a.push(m.clone());
        } else {
            wb += m.1.micros.max(1);
            b.push(m.clone());
        }
    }
    if wa >= wb { (a, b) } else { (b, a) }
}

/// `a` and `b` together.
pub(crate) fn plus(a: Cost, b: Cost) -> Cost {
    Cost {
        entries: a.entries + b.entries,
        extents: a.extents + b.extents,
        micros: a.micros + b.micros,
        at_least: a.at_least || b.at_least,
    }
}

/// `a` without `b` (a part of it); a lower bound where `a` was.
fn minus(a: Cost, b: Cost) -> Cost {
    Cost {
        entries: a.entries.saturating_sub(b.entries),
        extents: a.extents.saturating_sub(b.extents),
        micros: a.micros.saturating_sub(b.micros),
        at_least: a.at_least,
    }
}

/// The snapshot a package of `shares` (root first) is to be taken of: the
/// last share, made now if it is not yet, and each above it that is not,
/// with the transaction whose commit took the top share's snapshot of the
/// parent (its `otransid`: what every share holds of the packages is the
/// parent as that commit left it; see [`member_written`]); `parent` is the
/// parent subvolume's root, `volumes` the volumes root's path in it.
/// `on_removed` is called after each entry a cut removes. An error leaves
/// at most a `<id>.tmp` share half cut, which the next making of that
/// share or the cleanup deletes (it is deleted at once where it can be).
/// No shares: the parent itself, and 0. Each share is looked for, and
/// made, under its lock in `locks`: members converted at once (the
/// `pool` module) make each share once, the others waiting for it.
pub(crate) fn source(
    root: BorrowedFd<'_>,
    parent: BorrowedFd<'_>,
    volumes: &Path,
    shares: &[Share],
    locks: &ShareLocks,
    on_removed: &mut dyn FnMut() -> io::Result<()>,
) -> io::Result<(OwnedFd, u64)> {
    let mut src = parent.try_clone_to_owned()?;
    let mut taken = 0;
    if shares.is_empty() {
        return Ok((src, taken));
    }
    let dir = split_dir(root)?;
    for (i, share) in shares.iter().enumerate() {
        let lock = locks.of(&share.id);
        let _making = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let name = OsString::from(&share.id);
        if sys::stat_at(dir.as_fd(), &name)?.is_some() {
            src = sys::open_dir_at(dir.as_fd(), &name)?;
            if i == 0 {
                taken = sys::subvolume_info(src.as_fd())?.created_transid;
            }
            continue;
        }
        let tmp = OsString::from(format!("{}.tmp", share.id));
        copy::remove_tree_at(dir.as_fd(), &tmp, &mut |_| Ok(()))?;
        sys::snapshot(src.as_fd(), dir.as_fd(), &tmp)?;
        let fd = sys::open_dir_at(dir.as_fd(), &tmp)?;
        let keep: HashSet<&OsStr> = share
            .members
            .iter()
            .map(|p| OsStr::new(p.as_str()))
            .collect();
        // Metadata committed every so many entries, as the cleanup does
        // (the `shed` module): what the cut copied is freed as it goes.
        let cut = carve::cut_to(fd.as_fd(), volumes, &|n| keep.contains(n), &mut |n| {
            if n % COMMIT_EVERY == 0 {
                sys::commit_metadata(fd.as_fd())?;
            }
            on_removed()
        })
        .and_then(|()| sys::rename_noreplace(dir.as_fd(), &tmp, &name));
        if let Err(e) = cut {
            // Half cut: of no use, and holding what it copied.
            drop(fd);
            let _ = copy::remove_tree_at(dir.as_fd(), &tmp, &mut |_| Ok(()));
            return Err(e);
        }
        if i == 0 {
            taken = sys::subvolume_info(fd.as_fd())?.created_transid;
        }
        src = fd;
    }
    Ok((src, taken))
}

/// One lock a share, taken to look for it and to make it (see [`source`]):
/// a share is `<id>.tmp` until cut, and two members making it at once
/// would each delete the other's.
#[derive(Debug, Default)]
pub(crate) struct ShareLocks(Mutex<HashMap<String, Arc<Mutex<()>>>>);

impl ShareLocks {
    /// The lock of share `id`.
    fn of(&self, id: &str) -> Arc<Mutex<()>> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(all.entry(id.to_owned()).or_default())
    }
}

/// How many inodes of the parent changed since the top share's snapshot
/// [`member_written`] looks at one by one; past it, the check is not made
/// (an error: the parent is snapshotted instead). The conversion's own
/// changes are a few per package.
pub(crate) const CHANGED_MAX: usize = 4096;

/// Whether anything beneath a member's directory (inode `member` of the
/// parent subvolume open as `parent`) may have changed since the commit of
/// transaction `taken` took the top share's snapshot of the parent; the
/// member's tree in `share` (its last share) is the parent's as of that
/// commit. Returns the first inode found changed, if any.
///
/// The rule, from what the filesystem orders: every dirty page and
/// delayed inode update of the filesystem is committed first, so every
/// change made to the member's plain directory before this call has
/// written the inode item of the file it changed, or of the directory a
/// name was added to or removed from, in a transaction after `taken` (a
/// snapshot holds its source as the commit that took it left it, every
/// later change is in a later transaction). The first change made beneath
/// the member after the snapshot changed an inode that was beneath it
/// then, so it is in `share` beneath the same directory: each inode of
/// the parent written after `taken` is looked up in `share` and climbed to
/// its root ([`sys::inode_beneath`]), and one beneath the member (or a file
/// with several names there) is a change. What the conversion itself
/// changed since (renames in the volumes root, other members' directories
/// exchanged, records, shares) lies outside the member's tree and counts
/// for nothing. Under the member's lock, a change after this call is lost
/// as one after a snapshot of the parent would be (the exchange's window,
/// here from this call's commit; see the module docs).
/// Needs CAP_SYS_ADMIN; an error means the check could not be made.
pub(crate) fn member_written(
    parent: BorrowedFd<'_>,
    share: BorrowedFd<'_>,
    member: u64,
    taken: u64,
) -> io::Result<Option<u64>> {
    // Dirty data too, not only metadata: an overwrite in the same clock
    // tick as an earlier one writes no new times, only, once written out,
    // its extents and its inode item.
    sys::commit(parent)?;
    let mut changed: Vec<u64> = sys::inodes_written_since(parent, taken + 1)?
        .into_iter()
        .collect();
    if changed.len() > CHANGED_MAX {
        return Err(io::Error::other(format!(
            "{} inodes of the parent changed since, more than {CHANGED_MAX} to look at",
            changed.len()
        )));
    }
    changed.sort_unstable();
    for ino in changed {
        if sys::inode_beneath(share, ino, member)? == Some(true) {
            return Ok(Some(ino));
        }
    }
    Ok(None)
}

/// [`SPLIT_DIR`] in the volumes root open as `root`, made (mode 0700) if
/// absent.
fn split_dir(root: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    match sys::mkdir_at(root, OsStr::new(SPLIT_DIR), 0o700) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    sys::open_dir_at(root, OsStr::new(SPLIT_DIR))
}

/// Deletes the shares `ids` (O(1) each: a subvolume's delete; the kernel
/// frees what its cut made its own in the background).
pub(crate) fn drop_shares(root: BorrowedFd<'_>, ids: &[String]) -> io::Result<()> {
    if ids.is_empty() || sys::stat_at(root, OsStr::new(SPLIT_DIR))?.is_none() {
        return Ok(());
    }
    let dir = sys::open_dir_at(root, OsStr::new(SPLIT_DIR))?;
    for id in ids {
        copy::remove_tree_at(dir.as_fd(), OsStr::new(id), &mut |_| Ok(()))?;
    }
    Ok(())
}

/// Deletes [`SPLIT_DIR`] and every share in it: all scratch (see the
/// module docs).
pub(crate) fn wipe(root: BorrowedFd<'_>) -> io::Result<()> {
    copy::remove_tree_at(root, OsStr::new(SPLIT_DIR), &mut |_| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str, micros: u64, at_least: bool) -> (PackageId, Cost) {
        (
            name.parse().unwrap(),
            Cost {
                entries: micros / 58,
                extents: 0,
                micros,
                at_least,
            },
        )
    }

    /// Each package's entries are shed about log2(n) times (plus its
    /// share's few other members), not n: the sum over the packages of the
    /// cost the layout gives them.
    #[test]
    fn sixty_equal_packages_shed_about_log_n_boxes() {
        let weighed: Vec<_> = (0..60)
            .map(|i| w(&format!("p{i:02}"), 3500, false))
            .collect();
        let placed = layout(&weighed, Cost::default(), weighed.len() >= SPLIT_MIN);
        assert_eq!(placed.len(), 60);
        let total: u64 = placed.iter().map(|(_, p)| p.cost.micros).sum();
        // 60 entries each, about: the box is 210,000; one snapshot of the
        // parent each shed 59 boxes. Here: four levels of shares, the
        // members of a share of five or fewer shedding each other, the
        // dominant package's snapshot of the parent.
        assert!(total <= 11 * 210_000, "{total}");
        assert!(placed[0].1.shares.is_empty());
        assert!(placed[1..].iter().all(|(_, p)| !p.shares.is_empty()));
        // Every share is dropped exactly once, by its last member.
        let mut dropped: Vec<&String> = placed.iter().flat_map(|(_, p)| &p.drop).collect();
        let n = dropped.len();
        dropped.sort();
        dropped.dedup();
        assert_eq!(n, dropped.len());
        let made: HashSet<&String> = placed
            .iter()
            .flat_map(|(_, p)| p.shares.iter().map(|s| &s.id))
            .collect();
        assert_eq!(made.len(), n);
    }

    /// The heavy packages part from the light ones below the top share:
    /// the light ones' share is made once, without any heavy tree, and the
    /// heavy ones come first.
    #[test]
    fn heavy_trees_go_out_first() {
        let mut weighed: Vec<_> = (0..20)
            .map(|i| w(&format!("l{i:02}"), 2000, false))
            .collect();
        for i in 0..4 {
            weighed.push(w(&format!("h{i}"), 50_000, true));
        }
        let placed = layout(&weighed, Cost::default(), weighed.len() >= SPLIT_MIN);
        assert!(placed[0].0.as_str().starts_with('h'));
        let heavy: Vec<_> = placed[1..4].iter().map(|(p, _)| p.as_str()).collect();
        assert!(heavy.iter().all(|p| p.starts_with('h')), "{heavy:?}");
        for (p, at) in &placed[4..] {
            assert!(p.as_str().starts_with('l'));
            let light = &at.shares[1];
            assert_eq!(light.members.len(), 20, "{p}: {light:?}");
            assert!(
                at.shares[1..]
                    .iter()
                    .all(|s| s.members.iter().all(|m| m.as_str().starts_with('l')))
            );
        }
    }

    /// The heaviest is snapshotted from the parent, first; the others'
    /// members keep their shares' order (a share's members consecutive).
    #[test]
    fn the_dominant_goes_first_from_the_parent() {
        let mut weighed: Vec<_> = (0..SPLIT_MIN - 1)
            .map(|i| w(&format!("a{i:02}"), 10 + i as u64, false))
            .collect();
        weighed.insert(1, w("b", 50_000, true));
        let placed = layout(&weighed, Cost::default(), weighed.len() >= SPLIT_MIN);
        assert_eq!(placed[0].0.as_str(), "b");
        assert!(placed[0].1.shares.is_empty());
        for (_, p) in &placed[1..] {
            assert_eq!(p.shares[0].id, "s");
        }
    }

    /// Below [`SPLIT_MIN`] (a node's box) no share is made, whatever the
    /// weights: every package is a snapshot of the parent, heaviest first
    /// (then by name), shedding everything else.
    #[test]
    fn a_small_box_makes_no_share() {
        let mut weighed: Vec<_> = (0..SPLIT_MIN - 2)
            .map(|i| w(&format!("a{i:02}"), 2000, false))
            .collect();
        weighed.push(w("b", 50_000, true));
        let placed = layout(&weighed, w("rest", 100, false).1, false);
        let names: Vec<_> = placed.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names[0], "b", "the heaviest first");
        let mut sorted = names[1..].to_vec();
        sorted.sort_unstable();
        assert_eq!(names[1..], sorted, "then by name");
        let total = 2000 * (SPLIT_MIN as u64 - 2) + 50_000 + 100;
        for (p, at) in &placed {
            assert!(at.shares.is_empty() && at.drop.is_empty(), "{p}: {at:?}");
            let own = if p.as_str() == "b" { 50_000 } else { 2000 };
            assert_eq!(at.cost.micros, total - own, "{p}");
        }
    }

    /// In a box holding a heavy package, the light ones are cloned: every
    /// one from [`SPLIT_MIN`] packages on; below it, those beyond the
    /// [`PARENT_SNAPSHOTS_MAX`] snapshots of the parent (the heaviest
    /// kept), so that a box of a few packages keeps every identity.
    #[test]
    fn light_packages_beside_heavy_ones_are_cloned() {
        let node: Vec<_> = ["monerod", "bitcoind", "electrs"]
            .iter()
            .map(|p| w(p, ORDER_US, true))
            .chain((0..5).map(|i| w(&format!("small{i}"), 2000 + i, false)))
            .collect();
        let names = |v: Vec<PackageId>| v.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        // The node box: three heavy, the heaviest light one snapshotted too.
        assert_eq!(PARENT_SNAPSHOTS_MAX, 4);
        assert_eq!(
            names(light_clones(&node)),
            ["small0", "small1", "small2", "small3"]
        );
        // Two heavy packages: the two heaviest light ones snapshotted too.
        assert_eq!(
            names(light_clones(&node[1..])),
            ["small0", "small1", "small2"]
        );
        // A few packages: every identity kept.
        assert!(light_clones(&node[..4]).is_empty());
        assert!(light_clones(&[node[0].clone(), node[3].clone(), node[4].clone()]).is_empty());
        // No heavy package: nothing to shed but light trees.
        assert!(light_clones(&node[3..]).is_empty());
        // A package past LIGHT_US but not heavy is never cloned.
        let mut mid = node.clone();
        mid.push(w("mid", LIGHT_US + 1, false));
        assert!(!light_clones(&mid).iter().any(|p| p.as_str() == "mid"));
        let many: Vec<_> = (0..5)
            .map(|i| w(&format!("heavy{i}"), HEAVY_US, true))
            .chain((0..145).map(|i| w(&format!("small{i:03}"), 2400, false)))
            .collect();
        let cloned = light_clones(&many);
        assert_eq!(cloned.len(), 145);
        assert!(cloned.iter().all(|p| p.as_str().starts_with("small")));
    }

    /// The packages left to snapshot from a box of [`SPLIT_MIN`] or more
    /// share cuts if they are more than [`PARENT_SNAPSHOTS_MAX`], and are
    /// each a snapshot of the parent if not.
    #[test]
    fn the_heavy_ones_left_share_cuts_past_the_bound() {
        let heavy: Vec<_> = (0..PARENT_SNAPSHOTS_MAX + 2)
            .map(|i| w(&format!("heavy{i}"), HEAVY_US, true))
            .collect();
        let n = heavy.len();
        const MAX: u64 = 2_000_000;
        assert!(shared(150, n, &Cost::default(), MAX));
        let placed = layout(&heavy, Cost::default(), true);
        assert!(placed[0].1.shares.is_empty());
        assert!(placed[1..].iter().all(|(_, p)| p.shares[0].id == "s"));
        let few = PARENT_SNAPSHOTS_MAX;
        assert!(!shared(30, few, &Cost::default(), MAX));
        assert!(!shared(SPLIT_MIN - 1, n, &Cost::default(), MAX));
        let few = layout(&heavy[..few], Cost::default(), false);
        assert_eq!(few.len(), PARENT_SNAPSHOTS_MAX);
        assert!(few.iter().all(|(_, p)| p.shares.is_empty()));
        // A rest each of the few would shed past the bound: shares.
        let rest = w("rest", MAX / 3, false).1;
        assert!(shared(30, PARENT_SNAPSHOTS_MAX, &rest, MAX));
        assert!(!shared(30, 2, &rest, MAX));
    }
}
