//! Backends: what runs a [`Communicator`](crate::Communicator)'s ops once the communicator has
//! validated them, fingerprinted them and given them their turn.
//!
//! Every op takes the same path ([`crate::comm`]): validate the arguments → build the
//! fingerprint → ask the backend for a `Route` (the algorithm, before anything is sent, so a
//! forced algorithm that does not apply fails at once) → wait for the op's turn and stamp its
//! sequence number → hand the op to the backend with an `OpEnv`. The backend owns how the op
//! moves bytes, its own fingerprint check and its byte counts; it never calls back into the
//! communicator. Ordering of sync and async ops, sequence numbers, the flight recorder, the
//! comms logger and the abort-on-first-error rule stay in [`crate::comm`].
//!
//! | backend | file | moves bytes with |
//! | --- | --- | --- |
//! | native | `native.rs` | oxcomm's links ([`crate::transport`]) and algorithms ([`crate::algorithms`]) |
//! | MPI | `mpi/` (cargo feature `mpi`, off by default) | MPI collectives on an MPI communicator per group |
//!
//! The `Backend` trait is generic over the element type, so it is not object safe; the
//! communicator holds an `AnyBackend`, a closed enum that forwards each method to its
//! variant (static dispatch, no `dyn` on the op path). Each op's signature is written once,
//! in the `backend_ops!` list below, which generates both the trait and that forwarding: adding
//! an op is one signature there plus one implementation per backend.
//!
//! Reductions reach a backend with their combiner (`Avg` as `Sum`) and hand back the buffer
//! that holds the result; the communicator divides it for `Avg`, in one place for every
//! backend ([`crate::reduce::finish_avg`] in `comm/collectives.rs`).

#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod native;
mod native_ft;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::algorithms::hierarchical::HostLayout;
use crate::algorithms::Algorithm;
use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::dtype::Element;
use crate::engine::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::ReduceOp;
use crate::transport::Transport;
use crate::wire::{Fingerprint, OpKind, FP_BYTES};
pub(crate) use native_ft::Shrunk;

/// The group an op runs in, as a backend sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupView<'a> {
    /// The group's id (0 for the world): the same on every member.
    pub id: u64,
    /// This rank within the group.
    pub rank: usize,
    /// World rank of each group rank.
    pub members: &'a [usize],
    /// How the group spans hosts, when hierarchical algorithms apply.
    pub layout: Option<&'a HostLayout>,
}

impl GroupView<'_> {
    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.members.len()
    }
}

/// How a backend will run one op, decided before the op's turn.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    /// The native algorithm (`None` on a backend that picks its own).
    pub algorithm: Option<Algorithm>,
    /// Its name in the comms log and the flight recorder.
    pub name: &'static str,
    /// Whether the native agreement phase runs first.
    pub agree: bool,
}

/// What a backend gets to run one op in its turn.
pub(crate) struct OpEnv<'a> {
    /// The op's fingerprint, with its sequence number stamped.
    pub fp: &'a Fingerprint,
    /// The group it runs in.
    pub group: GroupView<'a>,
    /// The op's deadline, counted from its first wait for a peer.
    pub timeout: Duration,
    /// Largest number of bytes one transfer moves.
    pub max_segment_bytes: usize,
    /// This rank's byte counters.
    pub stats: &'a mut LinkStats,
    /// The communicator's abort flag: a wait that sees it set gives up.
    pub cancel: &'a AtomicBool,
    /// The heartbeat lapse after which a waiting op gives up on a silent member (zero: off;
    /// see [`crate::CommConfig::suspect_after`]).
    pub suspect_after: Duration,
    /// When the op started ([`crate::clock::monotonic_ns`], the flight record's start): the
    /// op's one clock reading, which the backend stamps its heartbeat from.
    pub now_ns: u64,
    /// When the op ended, if the backend read the clock there (0: it did not): the flight
    /// record's end, so that an op reads the clock at most twice.
    pub end_ns: u64,
}

/// One point-to-point message of a batch: a 48-byte header (the fingerprint) and a payload.
pub(crate) struct P2pMsg {
    /// World rank of the peer.
    pub peer: usize,
    /// Whether this rank sends (else it receives).
    pub is_send: bool,
    /// The payload: what is sent, or where the received one lands.
    pub bytes: Vec<u8>,
    /// What the message carries (dtype, count, tag, per-pair sequence number).
    pub fp: Fingerprint,
    /// `fp` encoded, as sent.
    pub header: [u8; FP_BYTES],
    /// For a receive from any source: each world rank it may come from, with the per-pair
    /// sequence number that rank's next message carries. The backend takes the first of them
    /// whose next message carries this receive's tag and group, and sets `peer` and `fp.seq`
    /// to it ([`P2pMsg::take_sender`]); the other candidates' messages stay unread. Empty for
    /// every other message. A batch holding such a receive holds nothing else.
    pub any_of: Vec<(usize, u64)>,
}

impl P2pMsg {
    /// Whether this is a receive from any source (see [`P2pMsg::any_of`]).
    pub fn is_any_source(&self) -> bool {
        !self.any_of.is_empty()
    }

    /// For a receive from any source: whether the message whose header `got` is at the head
    /// of candidate `i`'s stream is this receive's. `Ok(false)` leaves it for another receive:
    /// another group's or another tag's message, or not a point-to-point header at all (bytes
    /// of an op that rank has already started). A message with this receive's group, tag and
    /// sequence number but another dtype or count is meant for it and does not fit: a mismatch
    /// naming the sender.
    pub fn fits_any(&self, i: usize, got: &[u8]) -> Result<bool> {
        let (peer, seq) = self.any_of[i];
        let Ok(theirs) = Fingerprint::decode_from(got, peer) else { return Ok(false) };
        if theirs.kind != self.fp.kind || theirs.group != self.fp.group || theirs.extra != self.fp.extra {
            return Ok(false);
        }
        if theirs.seq != seq {
            return Ok(false);
        }
        let mut want = self.fp;
        want.seq = seq;
        if theirs != want {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!("rank {peer} sent {theirs}, this rank expected {want} (a receive from any source)"),
            )
            .with_op(want.to_string())
            .with_peer(peer));
        }
        Ok(true)
    }

    /// Makes a receive from any source a receive from candidate `i` (its sender).
    pub fn take_sender(&mut self, i: usize) {
        let (peer, seq) = self.any_of[i];
        self.peer = peer;
        self.fp.seq = seq;
        self.header = self.fp.encode();
    }

    /// Checks the header that arrived for this receive against what it expects (dtype,
    /// count, tag, per-pair sequence number), before any payload is read.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // the native backend checks in the engine
    pub fn check_header(&self, got: &[u8]) -> Result<()> {
        Self::check_header_of(&self.fp, self.peer, got)
    }

    /// [`P2pMsg::check_header`] of a receive of `fp` from world rank `peer`.
    pub fn check_header_of(fp: &Fingerprint, peer: usize, got: &[u8]) -> Result<()> {
        let theirs = Fingerprint::decode_from(got, peer)?;
        if theirs != *fp {
            return Err(Error::new(ErrorKind::Mismatch, format!("rank {peer} sent {theirs}, this rank expected {fp}"))
                .with_op(fp.to_string())
                .with_peer(peer));
        }
        Ok(())
    }
}

/// What creating a group asks of a backend (see [`Backend::new_group`]).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))] // only MPI keeps state per group
pub(crate) struct NewGroup {
    /// The new group's id.
    pub id: u64,
    /// Index of this rank's group among the groups made by the same call (`None`: this rank
    /// joins none).
    pub color: Option<usize>,
    /// This rank's rank in its new group.
    pub key: usize,
}

/// Writes the [`Backend`] trait and [`AnyBackend`]'s forwarding impl from one list of
/// signatures, so that adding an op is one signature here plus one implementation per
/// backend. A generic method takes at most a lifetime and an element type (`<'b, T: Element>`);
/// every method takes `&self`. The forwarding is a `match` on the variant: static dispatch,
/// nothing on the op path that the backends' own methods do not do.
macro_rules! backend_ops {
    (
        $(#[$trait_attr:meta])*
        $vis:vis trait $Trait:ident {
            $(
                $(#[$attr:meta])*
                fn $name:ident $(< $($lt:lifetime,)? $T:ident: Element >)?
                    (&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;
            )*
        }
    ) => {
        $(#[$trait_attr])*
        $vis trait $Trait {
            $(
                $(#[$attr])*
                fn $name $(< $($lt,)? $T: Element >)? (&self $(, $arg: $ty)*) $(-> $ret)?;
            )*
        }

        impl $Trait for AnyBackend {
            $(
                $(#[$attr])*
                fn $name $(< $($lt,)? $T: Element >)? (&self $(, $arg: $ty)*) $(-> $ret)? {
                    match self {
                        AnyBackend::Native(b) => b.$name($($arg),*),
                        #[cfg(feature = "mpi")]
                        AnyBackend::Mpi(b) => b.$name($($arg),*),
                    }
                }
            )*
        }
    };
}

backend_ops! {
    /// The ops a backend runs. Arguments are valid when these are called (lengths, roots and
    /// counts checked by the communicator); each runs in its turn, with the fingerprint
    /// stamped. An error aborts the communicator (the communicator then calls
    /// [`Backend::close`]). Reductions get the combiner (`Avg` arrives as `Sum`): the
    /// communicator divides the buffer they return, the same way for every backend.
    pub(crate) trait Backend {
        /// The transport ops move over.
        fn transport(&self) -> Transport;
        /// Picks how `kind` runs in `group` for a buffer of `bytes` (`count` elements), honouring
        /// `forced` when it applies (an error when it does not).
        fn route(
            &self,
            kind: OpKind,
            bytes: usize,
            count: usize,
            group: &GroupView<'_>,
            forced: Option<Algorithm>,
        ) -> Result<Route>;
        /// Revokes the communicator after it aborted (`cause`: the first error, naming the peer
        /// to blame where there is one): every peer is told at once, and its ops fail. The
        /// connections stay, for [`Backend::agree`] and [`Backend::shrink`]; they close when the
        /// backend is dropped. Idempotent.
        fn revoke(&self, cause: &Error);
        /// The fault-tolerant agreement of [`crate::Communicator::agree`] among the world
        /// members of this backend: the AND of the live members' `flag`s and the failed
        /// members' world ranks, the same on every member that returns.
        fn agree(&self, env: &mut OpEnv<'_>, flag: u64) -> Result<(u64, Vec<usize>)>;
        /// The survivors' backend ([`crate::Communicator::shrink`]): agrees on the failed
        /// members, then hands the links to the survivors over to a new backend, ranks
        /// renumbered in the old order. The caller revoked the communicator first.
        fn shrink(&self, env: &mut OpEnv<'_>) -> Result<Shrunk>;
        /// The world ranks this backend knows have failed (died, or suspected).
        fn known_failed(&self) -> Vec<usize>;
        /// Whether this backend revokes, agrees and shrinks ([`ErrorKind::Unsupported`], naming
        /// what is missing, if not).
        fn fault_tolerance(&self) -> Result<()>;
        /// Whether creating a group needs an op of its own on the parent group ([`Backend::new_group`]
        /// after the members are known); otherwise agreeing on the members is enough.
        fn group_needs_op(&self) -> bool;
        /// Whether groups may be made by their members alone, without the other ranks
        /// ([`crate::Communicator::members_group`]).
        fn members_groups(&self) -> Result<()>;

        /// All-reduce of `io` with `op` (a combiner: never `Avg`); returns the buffer that holds
        /// the result (where the communicator finishes `Avg`).
        fn all_reduce<'b, T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            io: ReduceBuffers<'b, T>,
            op: ReduceOp,
        ) -> Result<&'b mut [T]>;
        /// Reduce to `root` with `op` (a combiner: never `Avg`): in place, or `input` into the
        /// root's `output` (empty at the other ranks, whose input is only read). Returns the
        /// root's result buffer (anything at the other ranks, which the communicator leaves alone).
        fn reduce<'b, T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            io: ReduceBuffers<'b, T>,
            root: usize,
            op: ReduceOp,
        ) -> Result<&'b mut [T]>;
        /// Broadcast of `root`'s `buf`.
        fn broadcast<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, buf: &mut [T], root: usize) -> Result<()>;
        /// All-gather of `io` (in place: this rank's block of the buffer is its contribution).
        fn all_gather<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, io: GatherBuffers<'_, T>) -> Result<()>;
        /// Reduce-scatter of `io` with `op` (a combiner: never `Avg`; in place, the result lands
        /// in this rank's block of the buffer); returns this rank's result block.
        fn reduce_scatter<'b, T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            io: ScatterBuffers<'b, T>,
            op: ReduceOp,
        ) -> Result<&'b mut [T]>;
        /// All-to-all with equal blocks (in place: each block of the buffer is replaced by the
        /// block from its rank).
        fn all_to_all<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, io: ExchangeBuffers<'_, T>) -> Result<()>;
        /// All-to-all with per-peer counts (each side's counts add up to its buffer's length).
        #[allow(clippy::too_many_arguments)]
        fn all_to_all_v<T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            send: &[T],
            send_counts: &[usize],
            recv: &mut [T],
            recv_counts: &[usize],
        ) -> Result<()>;
        /// Gather into the root's output: at the root `io` is an all-gather's buffers (in place:
        /// the root's block of the output is its contribution); elsewhere `Apart` with an empty
        /// output.
        fn gather<T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            io: GatherBuffers<'_, T>,
            root: usize,
        ) -> Result<()>;
        /// Scatter of the root's input: at the root `io` is a reduce-scatter's buffers (in place:
        /// the root's block stays where it is in the input); elsewhere `Apart` with an empty input.
        fn scatter<T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            io: ScatterBuffers<'_, T>,
            root: usize,
        ) -> Result<()>;
        /// Barrier.
        fn barrier(&self, env: &mut OpEnv<'_>, route: Route) -> Result<()>;
        /// Barrier that gives up after `timeout`, naming the missing ranks where it can.
        fn monitored_barrier(&self, env: &mut OpEnv<'_>, route: Route, timeout: Duration) -> Result<()>;
        /// All-reduce of several buffers as one op, with `op` (a combiner: never `Avg`).
        fn all_reduce_coalesced<T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            bufs: &mut [&mut [T]],
            op: ReduceOp,
        ) -> Result<()>;
        /// All-gather of several buffers as one op.
        fn all_gather_coalesced<T: Element>(
            &self,
            env: &mut OpEnv<'_>,
            route: Route,
            inputs: &[&[T]],
            outputs: &mut [&mut [T]],
        ) -> Result<()>;
        /// The group-creating op: agreement on the members, and the backend's own state for the
        /// new group where it keeps any.
        fn new_group(&self, env: &mut OpEnv<'_>, route: Route, new: NewGroup) -> Result<()>;
        /// A batch of point-to-point messages (world ranks), headers before payloads; `env.group`
        /// is the world.
        fn p2p(&self, env: &mut OpEnv<'_>, msgs: &mut [P2pMsg]) -> Result<()>;
    }
}

/// Every name a [`Route`] can carry (the flight recorder reads its records back with them):
/// each native algorithm's, and the routes that are not algorithms.
pub(crate) fn route_names() -> impl Iterator<Item = &'static str> {
    Algorithm::ALL.into_iter().map(Algorithm::name).chain(["p2p", "mpi", "ft"])
}

/// The buffers of a coalesced op laid end to end, in order.
pub(crate) fn concat<'a, T: Copy + 'a>(bufs: impl Iterator<Item = &'a [T]>) -> Vec<T> {
    bufs.flat_map(|b| b.iter().copied()).collect()
}

/// Copies `flat` (the buffers end to end, as [`concat`] made it) back into `bufs`.
pub(crate) fn split_back<T: Copy>(flat: &[T], bufs: &mut [&mut [T]]) {
    let mut at = 0;
    for b in bufs.iter_mut() {
        b.copy_from_slice(&flat[at..at + b.len()]);
        at += b.len();
    }
}

/// Copies an all-gather of the concatenated `inputs` (`n` blocks, one per rank) into
/// `outputs[i]`, which receives every rank's `inputs[i]` in rank order.
pub(crate) fn unpack_gathered<T: Copy>(all: &[T], inputs: &[&[T]], outputs: &mut [&mut [T]], n: usize) {
    let total: usize = inputs.iter().map(|b| b.len()).sum();
    for (p, block) in all.chunks(total.max(1)).enumerate().take(n) {
        let mut at = 0;
        for (input, out) in inputs.iter().zip(outputs.iter_mut()) {
            let k = input.len();
            out[p * k..(p + 1) * k].copy_from_slice(&block[at..at + k]);
            at += k;
        }
    }
}

/// The backend a communicator holds: one of the closed set, dispatched statically.
// One per communicator, behind its core's `Arc`: the native variant's size costs nothing,
// a box would cost every op an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyBackend {
    /// oxcomm's links and algorithms.
    Native(native::NativeBackend),
    /// MPI.
    #[cfg(feature = "mpi")]
    Mpi(mpi::MpiBackend),
}

impl std::fmt::Debug for AnyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnyBackend").field(&self.transport()).finish()
    }
}
