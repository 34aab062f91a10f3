//! Growing back (issue 39): a replacement rank joins a running job through the store, so a
//! job that shrank ([`Communicator::shrink`]) returns to its size. Every member of the world
//! communicator calls [`Communicator::grow`]; each newcomer calls [`Init::join`] (or
//! [`Init::join_with_store`], or [`crate::join()`] under `oxcomm launch --on-failure restart`).
//! Members keep their ranks, in order; newcomers take the ranks after them.
//!
//! This module owns the grow protocol in the store. It does not move links: the grown
//! communicator is met exactly as [`Init::connect_with_store`] meets a world (host exchange,
//! then shared memory and TCP links), under a job id of its own per generation, so it has
//! links of its own; the members' existing links are not reused. Nor does it move state:
//! what a newcomer must know (the step, the weights) the application sends it on the grown
//! communicator (a broadcast from rank 0).
//!
//! # The store protocol
//!
//! A *generation* is one grow of a world's lineage (the world that [`Init::connect`] made, and
//! every communicator shrunk or grown from it): the g-th grow opens generation g. Every member
//! knows g (its world counts the grows it came from), a newcomer learns it from the store.
//! Under `oxcomm/{job}/grow/`, where `{job}` is the lineage's job id:
//!
//! | key | written by | value |
//! | --- | --- | --- |
//! | `latest` | the members' rank 0, when it opens a generation | the newest generation opened |
//! | `{g}` | the same, just before | `"{members} {new size}"` |
//! | `{g}/claimed` | each newcomer ([`Store::add`]) | slot k (1, 2, …): rank members + k − 1 |
//! | `{g}/joined/{rank}` | the newcomer that claimed `rank` | `1` |
//! | `{g}/closed` | every member, when its grow ends (done or failed) | `1` |
//!
//! A newcomer starts at the latest generation (1 when none is open yet), waits for its key,
//! and claims a slot unless the generation is closed or full; otherwise it moves on to the
//! next one. The members wait for every newcomer's `joined` key; then all meet under job id
//! `{job}g{g}`. A member whose newcomers never come times out naming the first missing rank
//! (the same on every member); a newcomer for whom no grow opens times out saying so, having
//! claimed nothing.

use std::sync::Arc;
use std::time::Instant;

use crate::comm::Communicator;
use crate::error::{Error, ErrorKind, Result};
use crate::init::Init;
use crate::rendezvous::{PrefixStore, Store};

/// Environment variable: set (to anything but `0`) by `oxcomm launch --on-failure restart` for
/// a replacement rank, which then calls [`crate::join()`] instead of [`crate::init()`]. oxcomm
/// itself does not read it: the program decides (it must also receive the job's state).
pub const ENV_JOIN: &str = "OXCOMM_JOIN";

/// Store key (under the grow prefix) of the newest generation opened.
const LATEST: &str = "latest";

/// How a world met, kept on its core ([`Communicator::set_origin`]) for a later grow.
pub(crate) struct Origin {
    /// The settings it met with; `job` is the lineage's job id (the grow keys' namespace).
    pub(crate) init: Init,
    /// The store it met at.
    pub(crate) store: Arc<dyn Store>,
    /// How many grows the lineage had done when this world was made.
    pub(crate) generation: u64,
}

/// The grow keys of the lineage `job`.
fn grow_store(job: &str, store: Arc<dyn Store>) -> PrefixStore<Arc<dyn Store>> {
    PrefixStore::new(format!("oxcomm/{job}/grow"), store)
}

/// The job id of generation `g` of the lineage `job`.
fn generation_job(job: &str, g: u64) -> String {
    format!("{job}g{g}")
}

impl Communicator {
    /// Grows this world communicator back to `new_size` ranks: the members keep their ranks
    /// (in order) and `new_size - size()` newcomers, each calling [`Init::join`], take the
    /// ranks after them. Collective over every member; returns the grown communicator, with
    /// links of its own (this one stays usable, and is kept alive by the grown one). Waits at
    /// most the communicator's timeout for the newcomers: one that never comes makes every
    /// member's grow fail with [`ErrorKind::Timeout`] naming its rank ([`Error::peer`]).
    ///
    /// Only a world met through a store can grow ([`crate::init()`], [`Init::connect`],
    /// [`Init::connect_with_store`], and communicators shrunk or grown from one): the store
    /// must outlive the ranks that failed (the launcher's, or a framework's; not one served
    /// by a rank that died). Errors before anything is sent: `new_size` below `size()`
    /// ([`ErrorKind::InvalidArgument`]); a group, the MPI backend, or a world met without a
    /// store, such as [`crate::threads::run`]'s ([`ErrorKind::Unsupported`]).
    ///
    /// ```no_run
    /// # fn step(c: &oxcomm::Communicator) -> oxcomm::Result<()> { Ok(()) }
    /// let mut comm = oxcomm::init()?;
    /// let size = comm.size();
    /// if let Err(e) = step(&comm) {
    ///     eprintln!("{e}: going on without {:?}", comm.failed_ranks());
    ///     comm = comm.shrink()?;
    ///     comm = comm.grow(size)?; // a replacement calls oxcomm::join()
    /// }
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn grow(&self, new_size: usize) -> Result<Communicator> {
        self.check_world("grow")?;
        let (me, size) = (self.rank(), self.size());
        if new_size < size {
            return Err(Error::invalid(format!(
                "grow to {new_size} ranks: fewer than the communicator's {size} (use shrink to leave ranks out)"
            ))
            .with_rank(me));
        }
        if new_size > i32::MAX as usize {
            return Err(Error::invalid(format!("grow to {new_size} ranks: too many")).with_rank(me));
        }
        let origin = self.origin().and_then(|o| o.downcast::<Origin>().ok()).ok_or_else(|| {
            Error::unsupported(
                "grow on a world that met without a store (threads::run, or links given by hand): \
                 only a world made by init, Init::connect or Init::connect_with_store can meet newcomers",
            )
            .with_rank(me)
        })?;
        let g = origin.generation + 1;
        // Generation g is used up, whatever comes of it: a newcomer skips it once it is
        // closed, so a grow tried again on this communicator (after a timeout) opens g + 1.
        self.set_origin(Arc::new(Origin { init: origin.init.clone(), store: origin.store.clone(), generation: g }));
        let keys = grow_store(&origin.init.job, origin.store.clone());
        let what = format!("grow to {new_size} ranks (generation {g})");
        if me == 0 {
            keys.set(&g.to_string(), format!("{size} {new_size}").as_bytes())
                .and_then(|()| keys.set(LATEST, g.to_string().as_bytes()))
                .map_err(|e| e.with_rank(me).with_op(what.clone()))?;
        }
        let deadline = Instant::now() + self.timeout();
        if let Err(e) = wait_newcomers(&keys, g, size, new_size, deadline, self.timeout()) {
            let _ = keys.set(&format!("{g}/closed"), b"1");
            return Err(e.with_rank(me).with_op(what));
        }
        let mut init = origin.init.clone();
        init.rank = me;
        init.world_size = new_size;
        init.job = generation_job(&origin.init.job, g);
        init.pin_to_core = false; // this rank was placed when its world was made
        init.config = self.config().clone();
        init.config.timeout = self.timeout();
        let grown = init.connect_with_store(origin.store.clone()).and_then(|c| c.barrier().map(|()| c));
        // Late newcomers must not claim a slot in a generation that has ended.
        let _ = keys.set(&format!("{g}/closed"), b"1");
        let grown = grown.map_err(|e| e.with_rank(me).with_op(what))?;
        grown.set_origin(Arc::new(Origin { init: origin.init.clone(), store: origin.store.clone(), generation: g }));
        grown.keep_alive(vec![Box::new(self.clone())]);
        tracing::info!(target: "oxcomm::init", rank = me, size, new_size, generation = g, "grown");
        Ok(grown)
    }
}

impl Init {
    /// Joins a running job as a newcomer of its next [`Communicator::grow`]: connects to the
    /// store at `store_addr` (never serves it), waits for the members to open a grow (at most
    /// `config.timeout`), takes a free rank in it and meets the members. `rank` and
    /// `world_size` are not used (the store says both); the job id, token, transport and
    /// host settings are, as in [`Init::connect`]. A join counts as a connect for the job id
    /// (`<job>-<n>`): a replacement process that joins first joins the lineage of the job's
    /// first communicator, as the rank it replaces connected it first.
    ///
    /// Fails with [`ErrorKind::Timeout`] when no grow with a free rank opens in time (having
    /// claimed nothing), or when a member does not arrive.
    pub fn join(mut self) -> Result<Communicator> {
        self.job = crate::init::next_job(&self.job);
        let deadline = Instant::now() + self.config.timeout;
        let client = crate::rendezvous::StoreClient::connect(self.store_addr, &self.token, deadline)?;
        self.join_with_store(Arc::new(client))
    }

    /// [`Init::join`] through an existing store; `job` must be the members' world's job id
    /// (what their [`Init::connect_with_store`] used).
    pub fn join_with_store(&self, store: Arc<dyn Store>) -> Result<Communicator> {
        crate::transport::shm::validate_job(&self.job)?;
        let keys = grow_store(&self.job, store.clone());
        let deadline = Instant::now() + self.config.timeout;
        let (g, members, new_size, slot) = claim(&keys, deadline, self.config.timeout)?;
        let rank = members + slot;
        keys.set(&format!("{g}/joined/{rank}"), b"1")?;
        let mut init = self.clone();
        init.rank = rank;
        init.world_size = new_size;
        init.job = generation_job(&self.job, g);
        let what = format!("join as rank {rank} of {new_size} (generation {g})");
        let grown = init
            .connect_with_store(store.clone())
            .and_then(|c| c.barrier().map(|()| c))
            .map_err(|e| e.with_rank(rank).with_op(what))?;
        grown.set_origin(Arc::new(Origin { init: self.clone(), store, generation: g }));
        tracing::info!(target: "oxcomm::init", rank, new_size, generation = g, "joined");
        Ok(grown)
    }
}

/// Waits for a generation with a free rank and claims one; returns the generation, its
/// members, its new size and the slot claimed (0-based).
fn claim(
    keys: &PrefixStore<Arc<dyn Store>>,
    deadline: Instant,
    timeout: std::time::Duration,
) -> Result<(u64, usize, usize, usize)> {
    let mut g = match keys.try_get(LATEST)? {
        Some(v) => parse_generation(&v)?,
        None => 1,
    };
    loop {
        let key = g.to_string();
        match keys.wait(&[&key], deadline) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Timeout => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "no grow with a free rank opened within {timeout:?} (waited for generation {g}; \
                         the members call Communicator::grow)"
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
        let (members, new_size) = parse_sizes(&keys.get(&key, deadline)?)?;
        if keys.try_get(&format!("{g}/closed"))?.is_none() {
            let k = keys.add(&format!("{g}/claimed"), 1)?;
            if k >= 1 && (k as u64) <= (new_size - members) as u64 {
                return Ok((g, members, new_size, k as usize - 1));
            }
        }
        g = g.checked_add(1).ok_or_else(|| Error::protocol("grow: generation counter overflow"))?;
    }
}

/// Waits until every newcomer of generation `g` (ranks `members .. new_size`) has claimed its
/// rank; on the deadline, a [`ErrorKind::Timeout`] naming the first missing one.
fn wait_newcomers(
    keys: &PrefixStore<Arc<dyn Store>>,
    g: u64,
    members: usize,
    new_size: usize,
    deadline: Instant,
    timeout: std::time::Duration,
) -> Result<()> {
    let joined: Vec<String> = (members..new_size).map(|r| format!("{g}/joined/{r}")).collect();
    let joined: Vec<&str> = joined.iter().map(String::as_str).collect();
    match keys.wait(&joined, deadline) {
        Err(e) if e.kind() == ErrorKind::Timeout => {
            let mut missing = Vec::new();
            for r in members..new_size {
                if keys.try_get(&format!("{g}/joined/{r}"))?.is_none() {
                    missing.push(r);
                }
            }
            let first = missing.first().copied().unwrap_or(members);
            Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "timed out after {timeout:?} waiting for newcomer rank {first} (missing: {missing:?}; \
                     a replacement process calls oxcomm::join or Init::join)"
                ),
            )
            .with_peer(first))
        }
        other => other,
    }
}

/// A generation number from the store (a peer's bytes: checked).
fn parse_generation(v: &[u8]) -> Result<u64> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|g| *g >= 1)
        .ok_or_else(|| Error::protocol(format!("grow: a malformed generation in the store: {:?}", lossy(v))))
}

/// `"{members} {new size}"` from the store, checked: 1 ≤ members ≤ new size ≤ i32::MAX.
fn parse_sizes(v: &[u8]) -> Result<(usize, usize)> {
    let parsed = std::str::from_utf8(v).ok().and_then(|s| {
        let (a, b) = s.split_once(' ')?;
        Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?))
    });
    match parsed {
        Some((m, n)) if m >= 1 && m <= n && n <= i32::MAX as usize => Ok((m, n)),
        _ => Err(Error::protocol(format!("grow: malformed sizes in the store: {:?}", lossy(v)))),
    }
}

fn lossy(v: &[u8]) -> String {
    String::from_utf8_lossy(&v[..v.len().min(64)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_values_are_checked() {
        assert_eq!(parse_sizes(b"3 4").unwrap(), (3, 4));
        for bad in [&b"4 3"[..], b"0 2", b"3", b"a b", b"3 99999999999", b""] {
            assert_eq!(parse_sizes(bad).unwrap_err().kind(), ErrorKind::Protocol, "{bad:?}");
        }
        assert_eq!(parse_generation(b"7").unwrap(), 7);
        assert!(parse_generation(b"0").is_err());
        assert!(parse_generation(b"-1").is_err());
    }
}
