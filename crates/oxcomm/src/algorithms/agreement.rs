//! The fault-tolerance protocol's messages ([`Ctrl`]) and its agreement ([`Agreement`]): the
//! consensus of [`crate::Communicator::agree`] (ULFM's `MPIX_Comm_agree`) among the members of
//! a communicator that may be losing ranks.
//!
//! This file does no I/O: the backend (`backend/native_ft.rs`) carries the messages over the
//! links' control channels and feeds in the failures its detector finds; here they are a
//! state machine, so that every interleaving can be tested without processes.
//!
//! # What it guarantees
//!
//! Every member that returns (all but the failed) returns the same [`Value`]: the bitwise AND
//! of the flags of every member outside its failed set, and that failed set, even when
//! members fail while it runs (the failed set then holds those the coordinator knew of when it
//! proposed; a member that fails later is in no one's set and the next op finds it). A member
//! that others have declared failed (a frozen one that comes back) does not return a value: it
//! learns that it was left out.
//!
//! # How (a coordinator, replaced when it fails)
//!
//! Vocabulary: *live* is a member this member has not been told failed; the *coordinator* is
//! the lowest live member. Failures are only ever added, and each member passes on every one
//! it learns (a [`Ctrl::Failed`] to every other member), so every member ends up with every
//! other's knowledge; a member ignores whatever a failed member sends.
//!
//! 1. Each member sends the coordinator a *contribution*: its flag, the failures it knows and
//!    the proposal it has locked, if any.
//! 2. The coordinator, once it holds a contribution from every live member, proposes: the
//!    locked value of the highest *ballot* (coordinator, then round) among them if there is
//!    one, otherwise the AND of their flags with its failed set. It locks its proposal and
//!    sends it to every live member, which locks it (unless it holds a higher ballot) and
//!    acknowledges.
//! 3. With every live member's acknowledgement, the coordinator decides and tells everyone;
//!    a member that decides tells everyone too, so a decision reaches every live member even
//!    when the coordinator fails halfway through telling them. A member that fails while the
//!    coordinator waits for acknowledgements of a value of its own makes it propose again
//!    (the next round), with that member in the failed set: the members that return then
//!    leave out every member that died before the decision, when it can be known.
//!
//! A coordinator that fails is replaced by the next lowest live member, to which every member
//! sends its contribution again. A decided value was locked by every member live at the time,
//! so every later coordinator finds it among the contributions and proposes it again:
//! decisions never differ. Cost with no failure: `3 (n − 1)` messages from or to the
//! coordinator, plus `n − 1` decisions passed on by each member (`n²` messages of a few
//! dozen bytes; a communicator of a thousand ranks sends a million, once).
//!
//! Liveness rests on the failure detector: a coordinator that stops answering without dying
//! is replaced once the backend suspects it (its heartbeat lapse); its deadline bounds the
//! whole agreement.

use crate::error::{Error, Result};
use crate::transport::MAX_CTRL_BYTES;

/// What is agreed on: the AND of the flags of every member outside `failed`, and `failed`
/// (group ranks, ascending).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value {
    pub flag: u64,
    pub failed: Vec<u32>,
}

/// One message of an agreement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AgreeMsg {
    /// To coordinator `coord`: the sender's flag, the failures it knows and its locked
    /// proposal (its ballot and value).
    Contribute { coord: u32, flag: u64, failed: Vec<u32>, locked: Option<(Ballot, Value)> },
    /// A coordinator's proposal: lock `value` under `ballot` and acknowledge.
    Propose { ballot: Ballot, value: Value },
    /// To the coordinator of `ballot`: its proposal is locked here.
    Ack { ballot: Ballot },
    /// `value` is decided.
    Decide { value: Value },
}

/// Which proposal a lock holds: a coordinator's `round`-th proposal. Ordered by coordinator,
/// then round: the later of two proposals is the higher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ballot {
    pub coord: u32,
    pub round: u32,
}

/// A control message between the members of one communicator (over the control channel of
/// their links; see `Link::send_ctrl`). Every one carries the epoch of the links it belongs
/// to: what arrives from another epoch is stale and ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ctrl {
    /// The communicator is revoked. `culprit` is the rank to blame when a fault revoked it
    /// (with `code`, a `transport::cause_code`), or the rank that revoked it on purpose
    /// (`code` of `Revoked`); `origin` is the rank that revoked first (a revocation passed on
    /// keeps it), `op` the op `origin` ran when it failed (`all_reduce #17 (f32 × 1024)`, or
    /// empty) and `reason` says why, in words.
    Revoke { epoch: u32, origin: u32, culprit: Option<u32>, code: u8, op: String, reason: String },
    /// Group rank `rank` has failed (died, or suspected after its heartbeat lapsed).
    Failed { epoch: u32, rank: u32 },
    /// A message of the `instance`-th agreement of the epoch.
    Agree { epoch: u32, instance: u32, msg: AgreeMsg },
}

/// First bytes of every control message ("OXFT").
const MAGIC: [u8; 4] = *b"OXFT";
/// Longest `reason` a revoke message carries (longer ones are cut).
const MAX_REASON: usize = 1024;

const K_REVOKE: u8 = 1;
const K_FAILED: u8 = 2;
const K_CONTRIBUTE: u8 = 3;
const K_PROPOSE: u8 = 4;
const K_ACK: u8 = 5;
const K_DECIDE: u8 = 6;

impl Ctrl {
    /// The wire form: the magic, a kind byte, the epoch, then the kind's fields, little-endian
    /// (a failed set: its length as `u32`, then each rank as `u32`). An error if it would not
    /// fit in one control message (a failed set of more than a thousand ranks).
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&MAGIC);
        let put32 = |b: &mut Vec<u8>, v: u32| b.extend_from_slice(&v.to_le_bytes());
        let put64 = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
        let put_set = |b: &mut Vec<u8>, set: &[u32]| {
            b.extend_from_slice(&(set.len() as u32).to_le_bytes());
            for r in set {
                b.extend_from_slice(&r.to_le_bytes());
            }
        };
        let put_value = |b: &mut Vec<u8>, v: &Value| {
            put64(b, v.flag);
            put_set(b, &v.failed);
        };
        match self {
            Ctrl::Revoke { epoch, origin, culprit, code, op, reason } => {
                b.push(K_REVOKE);
                put32(&mut b, *epoch);
                put32(&mut b, *origin);
                put32(&mut b, culprit.map_or(u32::MAX, |c| c));
                b.push(*code);
                for text in [op, reason] {
                    let mut cut = text.len().min(MAX_REASON);
                    while !text.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    put32(&mut b, cut as u32);
                    b.extend_from_slice(&text.as_bytes()[..cut]);
                }
            }
            Ctrl::Failed { epoch, rank } => {
                b.push(K_FAILED);
                put32(&mut b, *epoch);
                put32(&mut b, *rank);
            }
            Ctrl::Agree { epoch, instance, msg } => {
                let kind = match msg {
                    AgreeMsg::Contribute { .. } => K_CONTRIBUTE,
                    AgreeMsg::Propose { .. } => K_PROPOSE,
                    AgreeMsg::Ack { .. } => K_ACK,
                    AgreeMsg::Decide { .. } => K_DECIDE,
                };
                b.push(kind);
                put32(&mut b, *epoch);
                put32(&mut b, *instance);
                match msg {
                    AgreeMsg::Contribute { coord, flag, failed, locked } => {
                        put32(&mut b, *coord);
                        put64(&mut b, *flag);
                        put_set(&mut b, failed);
                        match locked {
                            None => b.push(0),
                            Some((ballot, v)) => {
                                b.push(1);
                                put32(&mut b, ballot.coord);
                                put32(&mut b, ballot.round);
                                put_value(&mut b, v);
                            }
                        }
                    }
                    AgreeMsg::Propose { ballot, value } => {
                        put32(&mut b, ballot.coord);
                        put32(&mut b, ballot.round);
                        put_value(&mut b, value);
                    }
                    AgreeMsg::Ack { ballot } => {
                        put32(&mut b, ballot.coord);
                        put32(&mut b, ballot.round);
                    }
                    AgreeMsg::Decide { value } => put_value(&mut b, value),
                }
            }
        }
        if b.len() > MAX_CTRL_BYTES {
            return Err(Error::unsupported(format!(
                "a control message of {} bytes (more failed ranks than one message holds)",
                b.len()
            )));
        }
        Ok(b)
    }

    /// The epoch of an encoded message, read before the rest (whose ranks are checked against
    /// the group of that epoch, which a message of another epoch may not be).
    pub(crate) fn epoch_of(b: &[u8]) -> Result<u32> {
        let mut r = Reader { b, at: 0, n: 0 };
        if r.take(4)? != MAGIC {
            return Err(Error::protocol("a control message without its magic"));
        }
        r.u8()?;
        r.u32()
    }

    /// Decodes a message from a member of a group of `n` ranks, checking everything: every
    /// rank it names is below `n`, every length fits, nothing is left over. A peer's bytes are
    /// a stranger's: nothing is allocated beyond what the message's own length allows.
    pub(crate) fn decode(b: &[u8], n: usize) -> Result<Ctrl> {
        let mut r = Reader { b, at: 0, n };
        if r.take(4)? != MAGIC {
            return Err(Error::protocol("a control message without its magic"));
        }
        let kind = r.u8()?;
        let epoch = r.u32()?;
        let msg = match kind {
            K_REVOKE => {
                let origin = r.rank()?;
                let culprit = match r.u32()? {
                    u32::MAX => None,
                    c => Some(r.rank_value(c)?),
                };
                let code = r.u8()?;
                if u32::from(code) > crate::transport::MAX_CAUSE_CODE {
                    return Err(Error::protocol(format!("a revoke message with cause code {code}")));
                }
                let mut text = || -> Result<String> {
                    let len = r.u32()? as usize;
                    if len > MAX_REASON {
                        return Err(Error::protocol(format!("a revoke message with a text of {len} bytes")));
                    }
                    Ok(String::from_utf8_lossy(r.take(len)?).into_owned())
                };
                let op = text()?;
                let reason = text()?;
                Ctrl::Revoke { epoch, origin, culprit, code, op, reason }
            }
            K_FAILED => Ctrl::Failed { epoch, rank: r.rank()? },
            K_CONTRIBUTE | K_PROPOSE | K_ACK | K_DECIDE => {
                let instance = r.u32()?;
                let msg = match kind {
                    K_CONTRIBUTE => {
                        let coord = r.rank()?;
                        let flag = r.u64()?;
                        let failed = r.set()?;
                        let locked = match r.u8()? {
                            0 => None,
                            1 => Some((r.ballot()?, r.value()?)),
                            x => return Err(Error::protocol(format!("a contribution with lock byte {x}"))),
                        };
                        AgreeMsg::Contribute { coord, flag, failed, locked }
                    }
                    K_PROPOSE => AgreeMsg::Propose { ballot: r.ballot()?, value: r.value()? },
                    K_ACK => AgreeMsg::Ack { ballot: r.ballot()? },
                    _ => AgreeMsg::Decide { value: r.value()? },
                };
                Ctrl::Agree { epoch, instance, msg }
            }
            k => return Err(Error::protocol(format!("a control message of unknown kind {k}"))),
        };
        if r.at != b.len() {
            return Err(Error::protocol(format!("{} bytes after a control message", b.len() - r.at)));
        }
        Ok(msg)
    }
}

/// Reads a control message's fields, each checked against what is left.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    n: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(len).filter(|e| *e <= self.b.len());
        let end = end.ok_or_else(|| Error::protocol("a control message cut short"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn rank_value(&self, r: u32) -> Result<u32> {
        if (r as usize) < self.n {
            Ok(r)
        } else {
            Err(Error::protocol(format!("a control message names rank {r} of a group of {}", self.n)))
        }
    }

    fn rank(&mut self) -> Result<u32> {
        let r = self.u32()?;
        self.rank_value(r)
    }

    /// A failed set: ascending ranks, each below `n`.
    fn set(&mut self) -> Result<Vec<u32>> {
        let len = self.u32()? as usize;
        if len > self.n || len.saturating_mul(4) > self.b.len() - self.at {
            return Err(Error::protocol(format!("a control message with a set of {len} ranks")));
        }
        let mut set = Vec::with_capacity(len);
        for _ in 0..len {
            let r = self.rank()?;
            if set.last().is_some_and(|l| *l >= r) {
                return Err(Error::protocol("a control message with a set out of order"));
            }
            set.push(r);
        }
        Ok(set)
    }

    fn ballot(&mut self) -> Result<Ballot> {
        Ok(Ballot { coord: self.rank()?, round: self.u32()? })
    }

    fn value(&mut self) -> Result<Value> {
        Ok(Value { flag: self.u64()?, failed: self.set()? })
    }
}

/// Where an [`Agreement`] stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Still running.
    Running,
    /// Decided.
    Decided(Value),
    /// Group rank `by` (the first to say so) declared this member failed: it is left out.
    LeftOut { by: u32 },
}

/// A member's contribution to the agreement, as its coordinator holds it: its flag and the
/// proposal it found locked, if any.
type Contribution = (u64, Option<(Ballot, Value)>);

/// One member's side of one agreement; see the [module docs](self). Drive it with
/// [`Agreement::message`] and [`Agreement::failed`], send what [`Agreement::take_out`] and
/// [`Agreement::take_failures`] give, until [`Agreement::outcome`] is no longer running.
#[derive(Debug)]
pub(crate) struct Agreement {
    me: usize,
    flag: u64,
    failed: Vec<bool>,
    /// The lowest live member.
    coord: usize,
    locked: Option<(Ballot, Value)>,
    outcome: Outcome,
    /// As coordinator: each member's contribution (its flag and locked proposal).
    contributions: Vec<Option<Contribution>>,
    /// As coordinator: the proposal sent (its ballot, and whether the value is this
    /// coordinator's own AND rather than a value found locked), and who acknowledged it.
    proposed: Option<(Ballot, Value, bool)>,
    acks: Vec<bool>,
    /// Messages to send, in order: (group rank, message).
    out: Vec<(usize, AgreeMsg)>,
    /// Failures learnt and not yet passed on.
    news: Vec<u32>,
}

impl Agreement {
    /// Member `me` of `n`, contributing `flag`, already knowing `failed` (group ranks).
    pub(crate) fn new(me: usize, n: usize, flag: u64, failed: &[usize]) -> Agreement {
        let mut a = Agreement {
            me,
            flag,
            failed: vec![false; n],
            coord: 0,
            locked: None,
            outcome: Outcome::Running,
            contributions: vec![None; n],
            proposed: None,
            acks: vec![false; n],
            out: Vec::new(),
            news: Vec::new(),
        };
        for &r in failed.iter().filter(|&&r| r < n && r != me) {
            a.failed[r] = true;
            a.news.push(r as u32);
        }
        a.coord = a.lowest_live();
        a.contribute();
        a
    }

    /// Where it stands.
    pub(crate) fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// The current coordinator (for errors: whom the agreement waits for).
    pub(crate) fn coordinator(&self) -> usize {
        self.coord
    }

    /// Whether member `r` is known to have failed.
    pub(crate) fn is_failed(&self, r: usize) -> bool {
        self.failed.get(r).copied().unwrap_or(true)
    }

    /// Messages to send, in order, each to a group rank.
    pub(crate) fn take_out(&mut self) -> Vec<(usize, AgreeMsg)> {
        std::mem::take(&mut self.out)
    }

    /// Failures learnt since the last call, to pass on to every other member (including the
    /// failed one: a frozen member that comes back learns that it was left out).
    pub(crate) fn take_failures(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.news)
    }

    fn lowest_live(&self) -> usize {
        (0..self.failed.len()).find(|&r| !self.failed[r]).unwrap_or(self.me)
    }

    fn failed_set(&self) -> Vec<u32> {
        (0..self.failed.len()).filter(|&r| self.failed[r]).map(|r| r as u32).collect()
    }

    fn live_others(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.failed.len()).filter(move |&r| r != self.me && !self.failed[r])
    }

    fn running(&self) -> bool {
        self.outcome == Outcome::Running
    }

    /// Sends (or, as coordinator, records) this member's contribution to the coordinator.
    fn contribute(&mut self) {
        if !self.running() {
            return;
        }
        if self.coord == self.me {
            self.contributions[self.me] = Some((self.flag, self.locked.clone()));
            self.progress();
        } else {
            let msg = AgreeMsg::Contribute {
                coord: self.coord as u32,
                flag: self.flag,
                failed: self.failed_set(),
                locked: self.locked.clone(),
            };
            self.out.push((self.coord, msg));
        }
    }

    /// Member `r` failed (the detector found it, or a [`Ctrl::Failed`] said so; `by` is who
    /// said so, `None` for this member's own detector).
    pub(crate) fn failed(&mut self, r: usize, by: Option<usize>) {
        if r == self.me {
            if self.running() {
                self.outcome = Outcome::LeftOut { by: by.unwrap_or(self.me) as u32 };
            }
            return;
        }
        if r >= self.failed.len() || self.failed[r] {
            return;
        }
        self.failed[r] = true;
        self.news.push(r as u32);
        if !self.running() {
            return;
        }
        let coord = self.lowest_live();
        if coord != self.coord {
            self.coord = coord;
            self.contribute();
        } else if self.coord == self.me {
            self.progress();
        }
    }

    /// A message from member `from`.
    pub(crate) fn message(&mut self, from: usize, msg: AgreeMsg) {
        if from >= self.failed.len() || self.failed[from] || from == self.me {
            return;
        }
        match msg {
            AgreeMsg::Decide { value } => self.decide(value),
            _ if !self.running() => {}
            AgreeMsg::Contribute { coord, flag, failed, locked } => {
                for r in failed {
                    self.failed(r as usize, Some(from));
                }
                if !self.running() || self.failed[from] {
                    return;
                }
                if coord as usize == self.me {
                    self.contributions[from] = Some((flag, locked));
                    // A contribution can make this member the coordinator (it names the
                    // failure of the lower ones): `failed` above contributed its own then.
                    if self.coord == self.me {
                        self.progress();
                    }
                }
            }
            AgreeMsg::Propose { ballot, value } => {
                if (ballot.coord as usize) < self.coord || self.locked.as_ref().is_some_and(|(b, _)| *b > ballot) {
                    return; // stale
                }
                self.locked = Some((ballot, value));
                self.out.push((ballot.coord as usize, AgreeMsg::Ack { ballot }));
            }
            AgreeMsg::Ack { ballot } => {
                if self.proposed.as_ref().is_some_and(|(b, _, _)| *b == ballot) {
                    self.acks[from] = true;
                    self.progress();
                }
            }
        }
    }

    /// As coordinator: proposes once every live member contributed; decides once every live
    /// member acknowledged.
    fn progress(&mut self) {
        if !self.running() || self.coord != self.me {
            return;
        }
        if self.proposed.is_none() {
            if self.live_others().any(|r| self.contributions[r].is_none()) {
                return;
            }
            if self.contributions[self.me].is_none() {
                self.contributions[self.me] = Some((self.flag, self.locked.clone()));
            }
            let live: Vec<usize> = (0..self.failed.len()).filter(|&r| !self.failed[r]).collect();
            let locked = live
                .iter()
                .filter_map(|&r| self.contributions[r].as_ref().and_then(|(_, l)| l.clone()))
                .max_by_key(|(b, _)| *b);
            match locked {
                Some((_, v)) => self.propose(0, v, false),
                None => {
                    let value = self.fresh_value();
                    self.propose(0, value, true);
                }
            }
        } else if let Some((ballot, value, true)) = &self.proposed {
            // A member failed since this coordinator proposed its own value: propose again
            // with it in the failed set (nobody can have decided the old one: that needs
            // every live member's acknowledgement, and this coordinator has not decided).
            if value.failed != self.failed_set() {
                let round = ballot.round + 1;
                let value = self.fresh_value();
                self.propose(round, value, true);
                return self.progress();
            }
        }
        if self.live_others().all(|r| self.acks[r]) {
            let (_, value, _) = self.proposed.clone().expect("proposed above");
            self.decide(value);
        }
    }

    /// The AND of the live members' contributed flags, with the failed set.
    fn fresh_value(&self) -> Value {
        let live = (0..self.failed.len()).filter(|&r| !self.failed[r]);
        let flag = live.map(|r| self.contributions[r].as_ref().map_or(!0, |(f, _)| *f)).fold(!0, |a, f| a & f);
        Value { flag, failed: self.failed_set() }
    }

    /// As coordinator: locks `value` under this coordinator's `round` and sends it to every
    /// live member (`fresh`: the value is this coordinator's own AND).
    fn propose(&mut self, round: u32, value: Value, fresh: bool) {
        let ballot = Ballot { coord: self.me as u32, round };
        self.locked = Some((ballot, value.clone()));
        self.acks = vec![false; self.failed.len()];
        let others: Vec<usize> = self.live_others().collect();
        for r in others {
            self.out.push((r, AgreeMsg::Propose { ballot, value: value.clone() }));
        }
        self.proposed = Some((ballot, value, fresh));
    }

    /// Decides `value` (once) and tells every other live member.
    fn decide(&mut self, value: Value) {
        if !self.running() {
            return;
        }
        if value.failed.contains(&(self.me as u32)) {
            // Decided without this member: it was left out (by the coordinator's view).
            self.outcome = Outcome::LeftOut { by: self.coord as u32 };
            return;
        }
        let others: Vec<usize> = self.live_others().collect();
        for r in others {
            self.out.push((r, AgreeMsg::Decide { value: value.clone() }));
        }
        self.outcome = Outcome::Decided(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// `n` members exchanging messages through FIFO channels, delivered in the order the
    /// test's choices pick among the non-empty channels; a kill `(at, r, d)` kills member `r`
    /// at step `at` (what it sent is still delivered, unless a receiver already knows it
    /// failed), and member `m`'s detector finds it `d + m` steps later.
    struct Sim {
        members: Vec<Agreement>,
        dead: Vec<bool>,
        chans: Vec<Vec<VecDeque<Ctrl>>>,
        /// (step, dead member, member whose detector finds it then).
        pending_detect: Vec<(usize, usize, usize)>,
    }

    impl Sim {
        fn new(flags: &[u64]) -> Sim {
            let n = flags.len();
            let members = (0..n).map(|r| Agreement::new(r, n, flags[r], &[])).collect();
            Sim {
                members,
                dead: vec![false; n],
                chans: (0..n).map(|_| (0..n).map(|_| VecDeque::new()).collect()).collect(),
                pending_detect: Vec::new(),
            }
        }

        fn pump_out(&mut self) {
            let n = self.members.len();
            for r in 0..n {
                if self.dead[r] {
                    continue;
                }
                for f in self.members[r].take_failures() {
                    for p in (0..n).filter(|&p| p != r) {
                        self.chans[r][p].push_back(Ctrl::Failed { epoch: 0, rank: f });
                    }
                }
                for (to, msg) in self.members[r].take_out() {
                    // Every message goes through its wire form.
                    let m = Ctrl::Agree { epoch: 0, instance: 0, msg };
                    let m = Ctrl::decode(&m.encode().unwrap(), n).unwrap();
                    self.chans[r][to].push_back(m);
                }
            }
        }

        fn deliver(&mut self, from: usize, to: usize) {
            let Some(m) = self.chans[from][to].pop_front() else { return };
            if self.dead[to] {
                return;
            }
            match m {
                Ctrl::Failed { rank, .. } => self.members[to].failed(rank as usize, Some(from)),
                Ctrl::Agree { msg, .. } => self.members[to].message(from, msg),
                Ctrl::Revoke { .. } => {}
            }
        }

        fn kill(&mut self, r: usize, detect_after: usize, step: usize) {
            if self.dead[r] {
                return;
            }
            self.dead[r] = true;
            for m in 0..self.members.len() {
                self.pending_detect.push((step + detect_after + m, r, m));
            }
        }

        fn detect(&mut self, step: usize) {
            let due: Vec<(usize, usize)> =
                self.pending_detect.iter().filter(|(at, _, _)| *at <= step).map(|(_, r, m)| (*r, *m)).collect();
            self.pending_detect.retain(|(at, _, _)| *at > step);
            for (r, m) in due {
                if !self.dead[m] {
                    self.members[m].failed(r, None);
                }
            }
        }

        /// Runs until every live member is done (or nothing moves for long); returns the
        /// outcomes.
        fn run(&mut self, choices: &[usize], kills: &[(usize, usize, usize)]) -> Vec<Outcome> {
            let n = self.members.len();
            let mut step = 0;
            let mut idle = 0;
            loop {
                self.pump_out();
                for &(at, r, detect) in kills {
                    if at == step {
                        self.kill(r, detect, step);
                    }
                }
                self.detect(step);
                self.pump_out();
                let ready: Vec<(usize, usize)> = (0..n)
                    .flat_map(|a| (0..n).map(move |b| (a, b)))
                    .filter(|&(a, b)| !self.chans[a][b].is_empty())
                    .collect();
                let all_done = (0..n).all(|r| self.dead[r] || *self.members[r].outcome() != Outcome::Running);
                if all_done && self.pending_detect.is_empty() {
                    break;
                }
                if ready.is_empty() {
                    idle += 1;
                    if idle > 10_000 {
                        panic!("stuck: {:?}", self.members.iter().map(|m| m.outcome()).collect::<Vec<_>>());
                    }
                } else {
                    let (a, b) = ready[choices.get(step).copied().unwrap_or(0) % ready.len()];
                    self.deliver(a, b);
                }
                step += 1;
            }
            self.members.iter().map(|m| m.outcome().clone()).collect()
        }
    }

    fn decided(outcomes: &[Outcome], dead: &[bool]) -> Vec<Value> {
        outcomes
            .iter()
            .zip(dead)
            .filter(|(_, d)| !**d)
            .map(|(o, _)| match o {
                Outcome::Decided(v) => v.clone(),
                other => panic!("a live member ended {other:?}"),
            })
            .collect()
    }

    #[test]
    fn without_failures_everyone_gets_the_and_of_all_flags() {
        let mut sim = Sim::new(&[0b1111, 0b0111, 0b1101, 0b0101]);
        let out = sim.run(&[], &[]);
        for v in decided(&out, &sim.dead) {
            assert_eq!(v, Value { flag: 0b0101, failed: vec![] });
        }
    }

    #[test]
    fn a_lone_member_decides_its_own_flag() {
        let mut a = Agreement::new(0, 1, 7, &[]);
        assert_eq!(a.outcome(), &Outcome::Decided(Value { flag: 7, failed: vec![] }));
        assert!(a.take_out().is_empty());
    }

    #[test]
    fn known_failures_are_left_out_of_the_and_and_reported() {
        let n = 3;
        let mut ms: Vec<Agreement> = (0..n).map(|r| Agreement::new(r, n, if r == 0 { 0 } else { 1 }, &[0])).collect();
        // Rank 1 coordinates; rank 2 contributes to it.
        let out2 = ms[2].take_out();
        assert_eq!(out2.len(), 1);
        assert_eq!(out2[0].0, 1);
        ms[1].message(2, out2[0].1.clone());
        let props = ms[1].take_out();
        ms[2].message(1, props[0].1.clone());
        let ack = ms[2].take_out();
        ms[1].message(2, ack[0].1.clone());
        assert_eq!(ms[1].outcome(), &Outcome::Decided(Value { flag: 1, failed: vec![0] }));
        assert_eq!(ms[1].take_failures(), vec![0]);
    }

    #[test]
    fn the_coordinator_dying_after_deciding_for_some_keeps_the_decision() {
        // Rank 0 proposes, gets every ack, decides, tells only rank 1, dies; rank 2 must
        // decide the same value through rank 1 (who passes the decision on) or rank 1's
        // coordination (which finds the value locked).
        let n = 3;
        let mut ms: Vec<Agreement> = (0..n).map(|r| Agreement::new(r, n, 1 << r | 1, &[])).collect();
        for r in 1..n {
            for (to, m) in ms[r].take_out() {
                ms[to].message(r, m);
            }
        }
        let props = ms[0].take_out();
        for (to, m) in props {
            ms[to].message(0, m);
        }
        for r in 1..n {
            for (to, m) in ms[r].take_out() {
                ms[to].message(r, m);
            }
        }
        let Outcome::Decided(v) = ms[0].outcome().clone() else { panic!("rank 0 decided") };
        let decides = ms[0].take_out();
        let to1 = decides.iter().find(|(to, _)| *to == 1).unwrap().1.clone();
        ms[1].message(0, to1);
        // Rank 0 dies; rank 2 detects it before hearing from rank 1.
        ms[2].failed(0, None);
        ms[1].failed(0, None);
        for _ in 0..4 {
            for r in 1..n {
                for (to, m) in ms[r].take_out() {
                    if to != 0 {
                        ms[to].message(r, m);
                    }
                }
            }
        }
        assert_eq!(ms[1].outcome(), &Outcome::Decided(v.clone()));
        assert_eq!(ms[2].outcome(), &Outcome::Decided(v));
    }

    #[test]
    fn a_value_decided_by_members_that_then_died_is_the_one_survivors_decide() {
        // Rank 0 coordinates, gets every ack, decides, tells rank 2 only and dies; rank 2
        // decides and dies before its news reaches anyone. Ranks 1 and 3 must still decide
        // what 0 and 2 decided (it is locked at both), not a fresh AND without them.
        let n = 4;
        let mut ms: Vec<Agreement> = (0..n).map(|r| Agreement::new(r, n, 0b11, &[])).collect();
        for r in 1..n {
            for (to, m) in ms[r].take_out() {
                ms[to].message(r, m);
            }
        }
        for (to, m) in ms[0].take_out() {
            ms[to].message(0, m);
        }
        for r in 1..n {
            for (to, m) in ms[r].take_out() {
                ms[to].message(r, m);
            }
        }
        let Outcome::Decided(v) = ms[0].outcome().clone() else { panic!("rank 0 decided") };
        let to2 = ms[0].take_out().into_iter().find(|(to, _)| *to == 2).unwrap().1;
        ms[2].message(0, to2);
        assert_eq!(ms[2].outcome(), &Outcome::Decided(v.clone()));
        ms[2].take_out(); // lost with rank 2
        for r in [1, 3] {
            ms[r].failed(0, None);
            ms[r].failed(2, None);
        }
        for _ in 0..4 {
            for r in [1, 3] {
                ms[r].take_failures();
                for (to, m) in ms[r].take_out() {
                    if to == 1 || to == 3 {
                        ms[to].message(r, m);
                    }
                }
            }
        }
        assert_eq!(ms[1].outcome(), &Outcome::Decided(v.clone()));
        assert_eq!(ms[3].outcome(), &Outcome::Decided(v));
    }

    #[test]
    fn a_member_declared_failed_learns_it_was_left_out() {
        let mut a = Agreement::new(2, 4, 1, &[]);
        a.failed(2, Some(1));
        assert_eq!(a.outcome(), &Outcome::LeftOut { by: 1 });
        let mut b = Agreement::new(2, 3, 1, &[]);
        b.message(0, AgreeMsg::Decide { value: Value { flag: 1, failed: vec![2] } });
        assert!(matches!(b.outcome(), Outcome::LeftOut { .. }));
    }

    #[test]
    fn every_message_round_trips_and_garbage_is_refused() {
        let v = Value { flag: 0xdead_beef, failed: vec![1, 3] };
        let msgs = [
            Ctrl::Revoke {
                epoch: 3,
                origin: 1,
                culprit: Some(2),
                code: 2,
                op: "barrier #3".into(),
                reason: "lost rank 2".into(),
            },
            Ctrl::Revoke { epoch: 0, origin: 0, culprit: None, code: 0, op: String::new(), reason: String::new() },
            Ctrl::Failed { epoch: 1, rank: 3 },
            Ctrl::Agree {
                epoch: 1,
                instance: 7,
                msg: AgreeMsg::Contribute {
                    coord: 0,
                    flag: 5,
                    failed: vec![2],
                    locked: Some((Ballot { coord: 1, round: 2 }, v.clone())),
                },
            },
            Ctrl::Agree {
                epoch: 1,
                instance: 7,
                msg: AgreeMsg::Propose { ballot: Ballot { coord: 1, round: 0 }, value: v.clone() },
            },
            Ctrl::Agree { epoch: 1, instance: 7, msg: AgreeMsg::Ack { ballot: Ballot { coord: 1, round: 3 } } },
            Ctrl::Agree { epoch: 1, instance: 7, msg: AgreeMsg::Decide { value: v } },
        ];
        for m in msgs {
            let b = m.encode().unwrap();
            assert_eq!(Ctrl::decode(&b, 4).unwrap(), m);
            // Every prefix is refused; so is a trailing byte.
            for cut in 0..b.len() {
                assert!(Ctrl::decode(&b[..cut], 4).is_err(), "{m:?} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Ctrl::decode(&long, 4).is_err());
        }
        // Ranks beyond the group, sets out of order.
        let far = Ctrl::Failed { epoch: 0, rank: 9 }.encode().unwrap();
        assert!(Ctrl::decode(&far, 4).unwrap_err().message().contains("rank 9"));
        let far_origin =
            Ctrl::Revoke { epoch: 0, origin: 7, culprit: None, code: 0, op: String::new(), reason: String::new() };
        assert!(Ctrl::decode(&far_origin.encode().unwrap(), 4).unwrap_err().message().contains("rank 7"));
        let unordered = Ctrl::Agree {
            epoch: 0,
            instance: 0,
            msg: AgreeMsg::Decide { value: Value { flag: 0, failed: vec![2, 1] } },
        };
        assert!(Ctrl::decode(&unordered.encode().unwrap(), 4).is_err());
        let huge = Ctrl::Revoke {
            epoch: 0,
            origin: 3,
            culprit: None,
            code: 0,
            op: "x".repeat(2000),
            reason: "é".repeat(4000),
        };
        assert!(huge.encode().unwrap().len() < MAX_CTRL_BYTES);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 512 }))]
        /// Any delivery order, up to two members killed at any moment (detected a little
        /// later, their last messages possibly undelivered): every live member decides, all
        /// the same value (as did every member that decided before it died), whose failed set holds only dead members and whose flag is the AND
        /// of the flags of the members outside it.
        #[test]
        fn survivors_always_agree(
            flags in proptest::collection::vec(0u64..16, 2..7),
            choices in proptest::collection::vec(0usize..1000, 0..400),
            kills in proptest::collection::vec((0usize..60, 0usize..7, 0usize..20), 0..3),
        ) {
            let n = flags.len();
            let kills: Vec<(usize, usize, usize)> =
                kills.into_iter().map(|(at, r, d)| (at, r % n, d)).collect();
            // Keep at least one member alive.
            let mut victims: Vec<usize> = kills.iter().map(|k| k.1).collect();
            victims.sort();
            victims.dedup();
            prop_assume!(victims.len() < n);
            let mut sim = Sim::new(&flags);
            let out = sim.run(&choices, &kills);
            let values = decided(&out, &sim.dead);
            for v in &values {
                prop_assert_eq!(v, &values[0]);
            }
            // Uniform: a member that decided and died after decided the same.
            for o in &out {
                if let Outcome::Decided(v) = o {
                    prop_assert_eq!(v, &values[0]);
                }
            }
            let v = &values[0];
            for &f in &v.failed {
                prop_assert!(sim.dead[f as usize], "rank {} declared failed while alive", f);
            }
            let and = (0..n).filter(|r| !v.failed.contains(&(*r as u32))).fold(!0u64, |a, r| a & flags[r]);
            prop_assert_eq!(v.flag, and);
        }
    }
}
