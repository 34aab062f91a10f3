//! TCP transport, for ranks on different hosts (or on one host when shared memory is off).
//!
//! This module owns connecting one authenticated TCP connection per pair of ranks
//! ([`TcpEndpoint`], [`connect_mesh`]), choosing the address to bind ([`choose_bind_ip`]), and
//! the [`TcpLink`] / [`TcpDoorbell`] that implement the [transport contract](crate::transport)
//! over those connections. It knows nothing about collectives, and finds peers only through
//! the addresses its caller hands it (or a [`Store`]).
//!
//! # Setup
//!
//! 1. Every rank calls [`TcpEndpoint::listen`] on the address it wants to be reached at (port
//!    0: the OS picks) and publishes [`TcpEndpoint::local_addr`], e.g. through the store.
//! 2. Every rank calls [`TcpEndpoint::connect`] with the other ranks' addresses. A rank
//!    connects to every *higher* rank and accepts a connection from every *lower* rank (on a
//!    thread, at the same time), identifying each by the handshake, not by its address.
//! 3. [`TcpEndpoint::into_parts`] hands out the links and the doorbell.
//!
//! [`connect_mesh`] does all three through a [`Store`], under keys `tcp/{job}/addr/{rank}`.
//!
//! # Wire
//!
//! Each connection opens with the mutual HMAC-SHA256 challenge-response of
//! `handshake.rs` over the job's shared secret, binding the job id, world size and both
//! ranks. A connection that fails it (wrong token, other job, garbage, silence past the
//! handshake timeout) is dropped with a `warn` on target `oxcomm::tcp`; the listener keeps
//! accepting until every expected peer has arrived or the deadline passes, so a stray client
//! cannot disturb a job. At most 64 handshakes run at once; one more connection cuts off the
//! oldest, and a connector whose handshake was cut off (or reset) retries until its deadline,
//! so a flood of silent connections cannot lock a real peer out. A peer refused before it
//! proved the token is told only "not this job", never this side's job id, world or rank. After the handshake the stream carries data frames, each a 24-byte
//! header (magic `OXTF`, version, tag, sequence number, length ≤ [`MAX_FRAME_BYTES`], check
//! word; see `frame.rs`) followed by a piece of payload. The receiver checks every header, so a
//! desynchronised or hostile peer is reported as [`ErrorKind::Protocol`], never misread, and
//! nothing a peer sends makes this side allocate.
//!
//! # Data path
//!
//! Sockets are non-blocking with `TCP_NODELAY` and (by default) 4 MiB socket buffers. There are
//! no I/O threads: a rank's own calls move bytes between its buffers and the kernel.
//! `try_send` is one `sendmsg(MSG_DONTWAIT | MSG_NOSIGNAL)` gathering a header and the payload
//! (a small message is one syscall and one TCP segment); `try_recv` reads large pieces straight
//! into the caller's buffer and headers and small pieces through a 64 KiB staging buffer per
//! link, allocated once; a read that ends a frame takes the next frame's header into the
//! stage in the same `recvmsg`, so a stream of large frames passes no payload through the
//! stage. Nothing is allocated per message.
//!
//! Every receive call, and every send call that could not take all its bytes, registers
//! *interest* (readable or writable) on its socket (a caller may wait for more after partial
//! progress, so "could not move a byte" is not enough). [`TcpDoorbell::wait`] polls exactly the sockets with interest, plus a wake-up pipe
//! for [`TcpDoorbell::ring`], and clears the interest of each socket it saw ready (one-shot),
//! so bytes that nobody waits for yet never make a waiter spin. Readiness is level-triggered,
//! so a peer that moved between the failed call and the poll is never missed. This needs no
//! thread hand-off on either side, which keeps small-message latency at about one loopback
//! round of the kernel, and lets a rank send and receive on all its links at once (the
//! progress engine interleaves the calls). A rank's links and its doorbell are meant to be
//! driven by one thread at a time (as the communicator does): a link registering interest on
//! one thread while the doorbell clears it on another could lose that one wake-up, which a
//! deadline-bounded wait then turns into a delay, not a hang.
//!
//! # Faults
//!
//! A peer whose process dies or whose link is dropped closes (or resets) its connections; the
//! next call on the link, or [`Link::check_peer`], reports [`ErrorKind::PeerGone`] naming it,
//! after the bytes it sent are read. A *silent* peer (cable cut, frozen host) is noticed only
//! by the communicator's deadline: no call here blocks on the data path. Dropping a link shuts
//! its connection down.
//!
//! # Not guaranteed
//!
//! Data frames are not encrypted or authenticated: the handshake keeps strangers out, but an
//! attacker on the path can read or alter bytes. IPv6 works where the OS supports it; interface
//! lookup by name prefers IPv4.
//!
//! Over 600 lines because the endpoint is one protocol: listening, connecting with retries,
//! accepting under a flood and the set-up watch share the handshake's state and its limits; the
//! link is in `link.rs`, frames in `frame.rs`, the handshake in `handshake.rs`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use super::{Doorbell, Link};
use crate::error::{Error, ErrorKind, Result};
use crate::rendezvous::Store;

mod frame;
mod handshake;
mod link;
mod mesh;

pub use frame::{
    encode_raw as encode_frame_header, FRAME_MAGIC, FRAME_VERSION, HEADER_BYTES, MAX_FRAME_BYTES, TAG_DATA,
};
pub use link::{TcpDoorbell, TcpLink};
pub use mesh::{address_key, choose_bind_ip, connect_mesh, connect_mesh_with, connect_peers_with};

pub(crate) use frame::{decode as decode_frame_header, decode_abort};
use handshake::Identity;
pub(crate) use handshake::{decode_hello, read_msg_with};
use link::Shared;

/// Longest accepted job id, in bytes.
pub const MAX_JOB_BYTES: usize = handshake::MAX_JOB_BYTES;

/// Most handshakes one listener runs at once; a connection beyond it cuts off the oldest.
const MAX_PENDING_HANDSHAKES: usize = 64;

/// How long the listener polls before looking at finished handshakes again.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// How often a set-up wait outside the store (accepting, retrying a connect) asks the store
/// whether the job has failed ([`TcpEndpoint::connect_published`]): one store round trip.
const SETUP_WATCH_INTERVAL: Duration = Duration::from_millis(50);

/// Settings of the TCP transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// `SO_SNDBUF` and `SO_RCVBUF` of each connection; 0 leaves the kernel's defaults (and
    /// its autotuning). Env `OXCOMM_TCP_BUFFER_BYTES`; default 4 MiB.
    pub socket_buffer_bytes: usize,
    /// Largest payload of one data frame, 1 ..= [`MAX_FRAME_BYTES`]. Env
    /// `OXCOMM_TCP_FRAME_BYTES`; default 4 MiB.
    pub frame_bytes: usize,
    /// How long a doorbell wait polls without sleeping before it sleeps in `poll(2)`, while
    /// this host has a core for every runnable task (see `spin_loaded`). Env
    /// `OXCOMM_TCP_SPIN_US` (µs); default 50 µs (a wake-up from `poll(2)` costs 10-30 µs, more
    /// than an 8-byte message takes to cross a LAN; 0 never spins).
    pub spin: Duration,
    /// Spin even when this host's runnable tasks outnumber its cores (read from
    /// `/proc/loadavg` every 10 ms), where a spinning waiter takes the core from the rank it
    /// waits for. Env `OXCOMM_TCP_SPIN_LOADED` (0 or 1); default 0.
    pub spin_loaded: bool,
    /// How long the acceptor gives one incoming connection to complete its handshake.
    /// Env `OXCOMM_TCP_HANDSHAKE_MS`; default 10 s.
    pub handshake_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> TcpConfig {
        TcpConfig {
            socket_buffer_bytes: 4 << 20,
            frame_bytes: 4 << 20,
            spin: Duration::from_micros(50),
            spin_loaded: false,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl TcpConfig {
    /// The defaults, overridden by `OXCOMM_TCP_BUFFER_BYTES`, `OXCOMM_TCP_FRAME_BYTES`,
    /// `OXCOMM_TCP_SPIN_US`, `OXCOMM_TCP_SPIN_LOADED` and `OXCOMM_TCP_HANDSHAKE_MS` where set.
    pub fn from_env() -> Result<TcpConfig> {
        TcpConfig::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`TcpConfig::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
        let mut c = TcpConfig::default();
        let parse = |var: &str| -> Result<Option<u64>> {
            match get(var).filter(|v| !v.trim().is_empty()) {
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| Error::invalid(format!("{var}={v:?} is not a non-negative integer"))),
                None => Ok(None),
            }
        };
        if let Some(b) = parse("OXCOMM_TCP_BUFFER_BYTES")? {
            c.socket_buffer_bytes = usize::try_from(b).unwrap_or(usize::MAX);
        }
        if let Some(b) = parse("OXCOMM_TCP_FRAME_BYTES")? {
            c.frame_bytes = usize::try_from(b).unwrap_or(usize::MAX);
        }
        if let Some(us) = parse("OXCOMM_TCP_SPIN_US")? {
            c.spin = Duration::from_micros(us);
        }
        match parse("OXCOMM_TCP_SPIN_LOADED")? {
            None => {}
            Some(v @ (0 | 1)) => c.spin_loaded = v == 1,
            Some(v) => return Err(Error::invalid(format!("OXCOMM_TCP_SPIN_LOADED={v} must be 0 or 1"))),
        }
        if let Some(ms) = parse("OXCOMM_TCP_HANDSHAKE_MS")? {
            c.handshake_timeout = Duration::from_millis(ms);
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if !(1..=MAX_FRAME_BYTES).contains(&self.frame_bytes) {
            return Err(Error::invalid(format!(
                "TCP frame size {} must be 1 to {MAX_FRAME_BYTES} bytes",
                self.frame_bytes
            )));
        }
        if self.socket_buffer_bytes > (1 << 30) {
            return Err(Error::invalid(format!("TCP socket buffer size {} is above 1 GiB", self.socket_buffer_bytes)));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::invalid("TCP handshake timeout must be positive"));
        }
        Ok(())
    }
}

/// One rank's TCP transport during setup: its listener and the links formed so far. See the
/// [module docs](self) for the sequence.
pub struct TcpEndpoint {
    rank: usize,
    world: usize,
    job: String,
    token: Vec<u8>,
    config: TcpConfig,
    listener: TcpListener,
    links: Vec<Option<TcpLink>>,
    /// Made at `listen` so that handing out the parts cannot fail.
    bell: TcpDoorbell,
}

impl std::fmt::Debug for TcpEndpoint {
    /// Never prints the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEndpoint")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("job", &self.job)
            .field("local_addr", &self.listener.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl TcpEndpoint {
    /// Binds a listener on `bind_ip`, port 0, for rank `rank` of `world` in job `job` (1 to
    /// [`MAX_JOB_BYTES`] bytes), with the job's shared secret `token`, and the default
    /// [`TcpConfig`].
    pub fn listen(bind_ip: IpAddr, rank: usize, world: usize, token: &[u8], job: &str) -> Result<TcpEndpoint> {
        TcpEndpoint::listen_with(bind_ip, rank, world, token, job, &TcpConfig::default())
    }

    /// [`TcpEndpoint::listen`] with given settings.
    pub fn listen_with(
        bind_ip: IpAddr,
        rank: usize,
        world: usize,
        token: &[u8],
        job: &str,
        config: &TcpConfig,
    ) -> Result<TcpEndpoint> {
        config.validate()?;
        if rank >= world || u32::try_from(world).is_err() {
            return Err(Error::invalid(format!("rank {rank} is not below world size {world} (at most 2^32 - 1)")));
        }
        if job.is_empty() || job.len() > MAX_JOB_BYTES {
            return Err(Error::invalid(format!("job id of {} bytes must have 1 to {MAX_JOB_BYTES}", job.len())));
        }
        if token.is_empty() {
            tracing::warn!(target: "oxcomm::tcp", rank, "empty job token: the TCP handshake authenticates nothing");
        }
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| Error::io(format!("binding a TCP listener on {bind_ip}"), e).with_rank(rank))?;
        if config.socket_buffer_bytes > 0 {
            // Accepted sockets inherit these, before the connection's window is negotiated.
            set_buffers(&listener, config.socket_buffer_bytes);
        }
        let addr = listener.local_addr().map_err(|e| Error::io("reading the listener's address", e))?;
        tracing::debug!(target: "oxcomm::tcp", rank, world, %addr, "listening");
        Ok(TcpEndpoint {
            rank,
            world,
            job: job.to_string(),
            token: token.to_vec(),
            config: config.clone(),
            listener,
            links: (0..world).map(|_| None).collect(),
            bell: TcpDoorbell::new(config.spin, config.spin_loaded).map_err(|e| e.with_rank(rank))?,
        })
    }

    /// The address peers connect to (publish it; the port is the one the OS picked).
    pub fn local_addr(&self) -> SocketAddr {
        // The listener is bound; getsockname cannot fail on it short of a kernel bug, and the
        // unspecified address tells the caller something is off rather than panicking.
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world size.
    pub fn world(&self) -> usize {
        self.world
    }

    fn identity(&self) -> Identity<'_> {
        Identity { token: &self.token, job: &self.job, world: self.world, rank: self.rank }
    }

    /// Forms one connection with each rank in `peers`: connects to those above this rank (at
    /// the address given, retrying refused connections until `deadline`) and, at the same
    /// time, accepts those below it (their addresses are not used: accepted peers are known
    /// by their handshake). Fails with [`ErrorKind::Timeout`] naming a missing rank at
    /// `deadline`, [`ErrorKind::Rendezvous`] if a peer refused this rank's handshake or could
    /// not prove it knows the token, and [`ErrorKind::InvalidArgument`] for a bad peer list.
    /// Connections that fail their handshake on the accepting side are dropped and logged,
    /// not returned. May be called more than once, with different peers.
    pub fn connect(&mut self, peers: &[(usize, SocketAddr)], deadline: Instant) -> Result<()> {
        self.connect_with(peers, deadline, None)
    }

    /// [`TcpEndpoint::connect`] to peers whose listeners were up when their addresses were
    /// published (the store's set-up: [`connect_peers_with`]): a refused connection then means
    /// the peer has exited, and fails at once with [`ErrorKind::PeerGone`] naming it instead of
    /// being retried until `deadline`. `watch` runs between waits (every
    /// 50 ms); its error (another rank's published failure) ends the
    /// connect.
    pub fn connect_published(
        &mut self,
        peers: &[(usize, SocketAddr)],
        deadline: Instant,
        watch: &(dyn Fn() -> Result<()> + Sync),
    ) -> Result<()> {
        self.connect_with(peers, deadline, Some(watch))
    }

    fn connect_with(
        &mut self,
        peers: &[(usize, SocketAddr)],
        deadline: Instant,
        watch: Option<&(dyn Fn() -> Result<()> + Sync)>,
    ) -> Result<()> {
        let mut seen = vec![false; self.world];
        for &(p, _) in peers {
            if p >= self.world || p == self.rank {
                return Err(
                    Error::invalid(format!("peer {p} must be another rank below {}", self.world)).with_rank(self.rank)
                );
            }
            if std::mem::replace(&mut seen[p], true) || self.links[p].is_some() {
                return Err(Error::invalid(format!("peer {p} listed twice or already connected")).with_rank(self.rank));
            }
        }
        let lower: Vec<usize> = peers.iter().map(|&(p, _)| p).filter(|&p| p < self.rank).collect();
        let higher: Vec<(usize, SocketAddr)> = peers.iter().copied().filter(|&(p, _)| p > self.rank).collect();
        let stop = AtomicBool::new(false);
        let (accepted, connected) = std::thread::scope(|s| {
            let acceptor = (!lower.is_empty()).then(|| {
                std::thread::Builder::new()
                    .name(format!("oxcomm-tcp-accept-{}", self.rank))
                    .spawn_scoped(s, || self.accept_lower(&lower, deadline, &stop, watch))
            });
            let mut connected = Vec::with_capacity(higher.len());
            let mut result = Ok(());
            for &(p, addr) in &higher {
                match self.connect_one(p, addr, deadline, watch) {
                    Ok(stream) => connected.push((p, stream)),
                    Err(e) => {
                        result = Err(e.with_peer(p).with_rank(self.rank));
                        break;
                    }
                }
            }
            if result.is_err() {
                stop.store(true, Ordering::SeqCst);
            }
            let accepted = match acceptor {
                None => Ok(Vec::new()),
                Some(Err(e)) => Err(Error::io("spawning the TCP acceptor thread", e).with_rank(self.rank)),
                Some(Ok(h)) => h.join().unwrap_or_else(|_| {
                    Err(Error::new(ErrorKind::Io, "the TCP acceptor thread panicked").with_rank(self.rank))
                }),
            };
            (accepted, result.map(|()| connected))
        });
        let connected = connected?;
        let accepted = accepted?;
        for (p, stream) in connected.into_iter().chain(accepted) {
            configure(&stream, &self.config).map_err(|e| e.with_peer(p).with_rank(self.rank))?;
            tracing::debug!(target: "oxcomm::tcp", rank = self.rank, peer = p,
                local = ?stream.local_addr().ok(), remote = ?stream.peer_addr().ok(), "connected");
            self.links[p] = Some(TcpLink::new(self.rank, p, self.world, Shared::new(stream), self.config.frame_bytes));
        }
        Ok(())
    }

    /// Connects to rank `peer` at `addr` and runs the connector's handshake. A connection
    /// that the peer drops before the handshake ends (its listener cut it off under a flood of
    /// strangers, or it reset) is retried with backoff until `deadline`; a refusal, a bad
    /// proof or a protocol error is not.
    ///
    /// With a `watch` (the peer's listener is known to have been up), a refusal means the peer
    /// has exited: [`ErrorKind::PeerGone`] at once; `watch` runs before every retry.
    fn connect_one(
        &self,
        peer: usize,
        addr: SocketAddr,
        deadline: Instant,
        watch: Option<&(dyn Fn() -> Result<()> + Sync)>,
    ) -> Result<TcpStream> {
        let mut backoff = Duration::from_millis(5);
        let mut tries = 0u32;
        loop {
            tries += 1;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("timed out connecting to rank {peer} at {addr} ({tries} tries)"),
                ));
            }
            let retry = |what: &dyn std::fmt::Display, backoff: &mut Duration| {
                tracing::debug!(target: "oxcomm::tcp", rank = self.rank, peer, %addr, error = %what, tries, "retrying connect");
                std::thread::sleep((*backoff).min(deadline.saturating_duration_since(Instant::now())));
                *backoff = (*backoff * 2).min(Duration::from_millis(200));
            };
            if let Some(watch) = watch {
                watch()?;
            }
            let mut stream = match TcpStream::connect_timeout(&addr, (deadline - now).min(Duration::from_secs(5))) {
                Ok(s) => s,
                Err(e) if watch.is_some() && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    return Err(Error::new(
                        ErrorKind::PeerGone,
                        format!("rank {peer} refused a connection at {addr}, where it had published its listener: it has exited"),
                    ));
                }
                Err(e) if retry_connect(&e) => {
                    retry(&e, &mut backoff);
                    continue;
                }
                Err(e) => return Err(Error::io(format!("connecting to rank {peer} at {addr}"), e)),
            };
            let _ = stream.set_nodelay(true);
            match handshake::connector(&mut stream, self.identity(), peer, deadline) {
                Ok(()) => return Ok(stream),
                Err(e) if matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Io) && Instant::now() < deadline => {
                    retry(&e, &mut backoff);
                }
                Err(e) => {
                    return Err(Error::new(e.kind(), format!("handshake with rank {peer} at {addr}: {}", e.message())))
                }
            }
        }
    }

    /// Accepts connections until every rank in `expected` has completed a handshake, `stop`
    /// is set, or `deadline` passes. Each handshake runs on its own thread, so a silent or
    /// slow client delays nobody; when this returns, handshakes still running are cut off.
    fn accept_lower(
        &self,
        expected: &[usize],
        deadline: Instant,
        stop: &AtomicBool,
        watch: Option<&(dyn Fn() -> Result<()> + Sync)>,
    ) -> Result<Vec<(usize, TcpStream)>> {
        let mut watched = Instant::now();
        let rank = self.rank;
        self.listener.set_nonblocking(true).map_err(|e| Error::io("setting the listener non-blocking", e))?;
        let mut got: HashMap<usize, TcpStream> = HashMap::new();
        let mut pending: HashMap<u64, TcpStream> = HashMap::new();
        let mut next_id = 0u64;
        let (tx, rx) = mpsc::channel::<(u64, SocketAddr, Result<(usize, TcpStream)>)>();
        let me = self.identity();
        let handshake_timeout = self.config.handshake_timeout;
        let result = std::thread::scope(|s| {
            let result = loop {
                while let Ok((id, from, res)) = rx.try_recv() {
                    pending.remove(&id);
                    match res {
                        Ok((p, stream)) if expected.contains(&p) && !got.contains_key(&p) => {
                            got.insert(p, stream);
                        }
                        Ok((p, _)) => {
                            tracing::warn!(target: "oxcomm::tcp", rank, peer = p, %from,
                                "dropped an authenticated connection from a rank that is not expected here (or a duplicate)");
                        }
                        Err(e) => {
                            tracing::warn!(target: "oxcomm::tcp", rank, %from, error = %e,
                                "dropped a connection that failed the handshake");
                        }
                    }
                }
                if got.len() == expected.len() {
                    break Ok(());
                }
                if stop.load(Ordering::SeqCst) {
                    break Err(Error::new(ErrorKind::Aborted, "stopped accepting: connecting to a higher rank failed"));
                }
                let now = Instant::now();
                if let Some(watch) = watch.filter(|_| now >= watched + SETUP_WATCH_INTERVAL) {
                    watched = now;
                    if let Err(e) = watch() {
                        break Err(e);
                    }
                }
                if now >= deadline {
                    let missing: Vec<usize> = expected.iter().copied().filter(|p| !got.contains_key(p)).collect();
                    let first = missing.first().copied().unwrap_or(0);
                    break Err(Error::new(
                        ErrorKind::Timeout,
                        format!("timed out waiting for rank(s) {missing:?} to connect to this rank"),
                    )
                    .with_peer(first));
                }
                let mut fds = [PollFd::new(&self.listener, PollFlags::IN)];
                let wait = (deadline - now).min(ACCEPT_POLL);
                let ts = Timespec { tv_sec: 0, tv_nsec: i64::from(wait.subsec_nanos()) };
                let _ = poll(&mut fds, Some(&ts));
                loop {
                    match self.listener.accept() {
                        Ok((stream, from)) => {
                            if pending.len() >= MAX_PENDING_HANDSHAKES {
                                // Evict the oldest unauthenticated connection rather than
                                // refuse the newest: a flood of silent connections cannot
                                // hold the door shut against a real peer, whose handshake
                                // takes milliseconds (and whose connector retries if it is
                                // the one evicted).
                                if let Some(oldest) = pending.keys().min().copied() {
                                    if let Some(c) = pending.remove(&oldest) {
                                        let _ = c.shutdown(std::net::Shutdown::Both);
                                    }
                                }
                                tracing::warn!(target: "oxcomm::tcp", rank, %from,
                                    "too many handshakes in progress: cut off the oldest");
                            }
                            let clone = match stream.set_nonblocking(false).and_then(|()| stream.try_clone()) {
                                Ok(c) => c,
                                Err(e) => {
                                    tracing::warn!(target: "oxcomm::tcp", rank, %from, error = %e, "dropped a connection");
                                    continue;
                                }
                            };
                            let id = next_id;
                            next_id += 1;
                            pending.insert(id, clone);
                            let tx = tx.clone();
                            let until = deadline.min(Instant::now() + handshake_timeout);
                            let spawned = std::thread::Builder::new()
                                .name(format!("oxcomm-tcp-hs-{rank}"))
                                .spawn_scoped(s, move || {
                                    let mut stream = stream;
                                    let _ = stream.set_nodelay(true);
                                    let res = handshake::acceptor(&mut stream, me, until).map(|p| (p, stream));
                                    let _ = tx.send((id, from, res));
                                });
                            if let Err(e) = spawned {
                                tracing::warn!(target: "oxcomm::tcp", rank, %from, error = %e,
                                    "dropped a connection: cannot spawn its handshake thread");
                                if let Some(c) = pending.remove(&id) {
                                    let _ = c.shutdown(std::net::Shutdown::Both);
                                }
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            // Per-connection failures (ECONNABORTED, EMFILE ...): log, go on.
                            tracing::warn!(target: "oxcomm::tcp", rank, error = %e, "accept failed");
                            break;
                        }
                    }
                }
            };
            // Cut off handshakes still running so their threads end now.
            for (_, c) in pending.drain() {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
            result
        });
        let _ = self.listener.set_nonblocking(false);
        // Results that arrived while the scope ended are dropped (their sockets close).
        drop(rx);
        result.map_err(|e| e.with_rank(rank))?;
        Ok(got.into_iter().collect())
    }

    /// The links indexed by world rank (`None` for this rank and unconnected ranks), and this
    /// rank's doorbell. The listener is closed.
    #[allow(clippy::type_complexity)] // the shape every transport hands to the communicator
    pub fn into_parts(self) -> (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>) {
        let (links, bell) = self.into_tcp_parts();
        let links = links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect();
        (links, bell)
    }

    /// As [`TcpEndpoint::into_parts`], with the concrete types.
    pub fn into_tcp_parts(self) -> (Vec<Option<TcpLink>>, Arc<TcpDoorbell>) {
        let mut bell = self.bell;
        bell.set_links(self.links.iter().flatten().map(|l| l.shared().clone()).collect());
        (self.links, Arc::new(bell))
    }
}

/// Whether a failed connect is worth retrying before the deadline (the peer may not be
/// listening yet, or its backlog is full).
fn retry_connect(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(e.kind(), K::ConnectionRefused | K::ConnectionReset | K::TimedOut | K::WouldBlock | K::Interrupted)
}

fn set_buffers(fd: &impl std::os::fd::AsFd, bytes: usize) {
    // The kernel caps these at net.core.{w,r}mem_max; a refusal leaves its defaults, which
    // still work, only slower.
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(fd, bytes);
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(fd, bytes);
}

/// Readies an authenticated socket for the data path.
fn configure(stream: &TcpStream, config: &TcpConfig) -> Result<()> {
    let err = |e| Error::io("configuring a TCP connection", e);
    stream.set_nodelay(true).map_err(err)?;
    if config.socket_buffer_bytes > 0 {
        set_buffers(stream, config.socket_buffer_bytes);
    }
    stream.set_read_timeout(None).map_err(err)?;
    stream.set_write_timeout(None).map_err(err)?;
    stream.set_nonblocking(true).map_err(err)?;
    Ok(())
}
