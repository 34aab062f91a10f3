//! Sub-groups: [`Communicator::new_group`], [`Communicator::split`] and
//! [`Communicator::members_group`]. A group shares its parent's core (links, turns, abort);
//! it has its own id, members and sequence numbers.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Communicator, Group, OpOptions};
use crate::backend::{Backend, NewGroup};
use crate::error::Result;
use crate::wire::{Fingerprint, OpKind};

impl Communicator {
    /// Creates a sub-group of the listed group ranks. Collective: every rank of this group
    /// must call it with the same list. Returns `None` on ranks outside the new group. Group
    /// ranks follow the order of `ranks`.
    #[track_caller]
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let mut fp = self.fingerprint(OpKind::NewGroup);
        fp.count = ranks.len() as u64;
        let mut h = DefaultHasher::new();
        ranks.hash(&mut h);
        fp.extra = h.finish();
        self.check_rank_list(&fp, ranks)?;
        if ranks.is_empty() {
            return Err(self.arg_error(&fp, "a group needs at least one rank"));
        }
        let me = ranks.iter().position(|&r| r == self.rank());
        let new = |seq: u64| NewGroup {
            id: self.subgroup_id(ranks, fp.extra, seq),
            color: me.map(|_| 0),
            key: me.unwrap_or(0),
        };
        let opts = OpOptions::default();
        let route = self.route(&fp, &opts, 0, 0)?;
        let id = self.run_op(fp, &opts, route, |b, env| {
            let new = new(env.fp.seq + 1);
            b.new_group(env, route, new).map(|()| new.id)
        })?;
        Ok(self.subgroup(ranks, id))
    }

    /// Splits the group by `color` (ranks passing `None` join no group), ordering each new
    /// group by `key` then by current rank, as `MPI_Comm_split`. Collective.
    #[track_caller]
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * self.size()];
        self.all_gather(&mine, &mut all)?;
        let ranks: Vec<usize> = match color {
            None => Vec::new(),
            Some(color) => {
                let mut members: Vec<(i64, usize)> = all
                    .chunks(2)
                    .enumerate()
                    .filter(|(_, ck)| ck[0] == i64::from(color))
                    .map(|(r, ck)| (ck[1], r))
                    .collect();
                members.sort();
                members.into_iter().map(|(_, r)| r).collect()
            }
        };
        let salt = 0x5eed_0000_0000 ^ u64::from(color.unwrap_or(0));
        let mut seq = self.group.seq.load(Ordering::SeqCst);
        if self.core.backend.group_needs_op() {
            // The backend makes its side of every new group in one op: each rank passes the
            // index of its color among the colors present, and its rank in its new group.
            let mut colors: Vec<i64> = all.chunks(2).map(|ck| ck[0]).filter(|&c| c >= 0).collect();
            colors.sort();
            colors.dedup();
            let index = color.map(|c| colors.iter().position(|&k| k == i64::from(c)).unwrap_or(0));
            let key = ranks.iter().position(|&r| r == self.rank()).unwrap_or(0);
            let fp = self.fingerprint(OpKind::NewGroup);
            let opts = OpOptions::default();
            let route = self.route(&fp, &opts, 0, 0)?;
            seq = self.run_op(fp, &opts, route, |b, env| {
                let seq = env.fp.seq + 1;
                b.new_group(env, route, NewGroup { id: self.subgroup_id(&ranks, salt, seq), color: index, key })
                    .map(|()| seq)
            })?;
        }
        if color.is_none() {
            return Ok(None);
        }
        Ok(self.subgroup(&ranks, self.subgroup_id(&ranks, salt, seq)))
    }

    /// A sub-group of the listed group ranks over this communicator's links, made without
    /// any communication: only the members call it (ranks outside the list get `None`, as
    /// from [`Communicator::new_group`]). Every member must pass the same list, and members
    /// must make their groups of one rank list in the same order (as torch requires of
    /// `new_group`), because the group's identity is the list and how many groups of that
    /// list this rank made before. Use it where a framework creates a group on its members
    /// only; [`Communicator::new_group`] checks the list across ranks instead.
    ///
    /// ```
    /// use oxcomm::{threads, ReduceOp};
    ///
    /// let out = threads::run(3, |comm| {
    ///     if comm.rank() == 1 {
    ///         return Ok(0.0); // not a member: takes no part
    ///     }
    ///     let g = comm.members_group(&[0, 2])?.expect("a member");
    ///     let mut v = [comm.rank() as f32];
    ///     g.all_reduce(&mut v, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>(v[0])
    /// })?;
    /// assert_eq!(out.into_iter().map(|r| r.unwrap()).collect::<Vec<_>>(), vec![2.0, 0.0, 2.0]);
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn members_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let mut fp = self.fingerprint(OpKind::NewGroup);
        fp.count = ranks.len() as u64;
        let seen = self.check_rank_list(&fp, ranks)?;
        if !seen[self.rank()] {
            return Ok(None);
        }
        self.core.backend.members_groups().map_err(|e| e.with_rank(self.core.world_rank))?;
        let world: Vec<usize> = ranks.iter().map(|r| self.group.members[*r]).collect();
        let nth = {
            let mut made = self.core.member_groups.lock().unwrap_or_else(|e| e.into_inner());
            let n = made.entry(world.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let mut h = DefaultHasher::new();
        ("members_group", &world, nth).hash(&mut h);
        let id = h.finish() | 1;
        let me = ranks.iter().position(|r| *r == self.rank()).expect("checked above");
        Ok(Some(Communicator { core: self.core.clone(), group: Arc::new(Group::new(id, world, me, &self.core.hosts)) }))
    }

    /// Checks a list of group ranks (in range, no repeats); returns which ranks it holds.
    fn check_rank_list(&self, fp: &Fingerprint, ranks: &[usize]) -> Result<Vec<bool>> {
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(self.arg_error(fp, format!("rank {r} out of range for a group of {}", self.size())));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(self.arg_error(fp, format!("rank {r} listed twice")));
            }
        }
        Ok(seen)
    }

    /// The id of the sub-group of `ranks` made by an op salted `salt`, when this group's
    /// next sequence number is `seq`: the same on every member.
    fn subgroup_id(&self, ranks: &[usize], salt: u64, seq: u64) -> u64 {
        let mut h = DefaultHasher::new();
        (self.group.id, seq, salt, ranks).hash(&mut h);
        h.finish() | 1
    }

    /// The sub-group of `ranks` with id `id` (`None` on ranks outside it).
    fn subgroup(&self, ranks: &[usize], id: u64) -> Option<Communicator> {
        let me = ranks.iter().position(|r| *r == self.rank())?;
        let members = ranks.iter().map(|r| self.group.members[*r]).collect();
        Some(Communicator { core: self.core.clone(), group: Arc::new(Group::new(id, members, me, &self.core.hosts)) })
    }
}
