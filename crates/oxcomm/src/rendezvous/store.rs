//! The TCP key-value store: a [`StoreServer`] that one rank (or the launcher) runs, and the
//! [`StoreClient`] every rank connects with. Both sides prove they hold the job's shared
//! secret (`OXCOMM_TOKEN`) before any key is read or written.
//!
//! This file owns sockets, threads, the handshake and the request loop. What each op means
//! lives in the shared table (`memory.rs`); frame encoding in `wire.rs`. It knows nothing
//! about collectives or transports.
//!
//! # Security
//!
//! The server binds exactly the address it is given (`127.0.0.1:0` stays on loopback). Each
//! connection starts with a mutual challenge-response over HMAC-SHA256 keyed by the token, so
//! the secret never crosses the wire, a client never talks to a store that does not know the
//! token, and the server drops clients that do not. Proofs are compared in constant time.
//! What is *not* provided: confidentiality (keys and values travel in clear text) and
//! protection against an attacker who can alter traffic after the handshake. Treat the store
//! as a way to exchange addresses, not secrets.
//!
//! # Threads and robustness
//!
//! The server accepts on one thread and serves each connection on its own thread, so a slow
//! or silent client stalls only itself. The handshake must finish within
//! [`HANDSHAKE_TIMEOUT`] and, once a frame has started, the rest of it must arrive within
//! [`FRAME_TIMEOUT`]; otherwise the connection is dropped. An authenticated client may stay
//! idle between requests for as long as it likes. A connection that sends bad magic, a wrong
//! proof, an unknown op or a length over the limits is dropped and logged (`tracing` target
//! `oxcomm::store`); other connections are not affected. Every length is checked before
//! anything is allocated for it.
//!
//! # Wire format (version 1)
//!
//! All integers are little-endian. Every message is one frame:
//!
//! ```text
//! frame  = magic "OXST" (4 bytes) | version u8 = 1 | code u8 | count u16 | count × field
//! field  = len u32 | len bytes
//! ```
//!
//! Handshake (client → server, server → client, ...):
//!
//! ```text
//! HELLO     0x01  [client_nonce (32)]
//! CHALLENGE 0x02  [server_nonce (32), HMAC(token, client_nonce ‖ server_nonce ‖ "oxcomm-store-v1/server")]
//! PROOF     0x03  [HMAC(token, server_nonce ‖ client_nonce ‖ "oxcomm-store-v1/client")]
//! WELCOME   0x04  []            or   REJECT 0x05 [reason]
//! ```
//!
//! Requests (one at a time per connection; each gets one response):
//!
//! ```text
//! SET 0x10 [key, value]          GET 0x11 [key, timeout_ms u64]     TRY_GET 0x12 [key]
//! WAIT 0x13 [timeout_ms u64, key, key, ...]    ADD 0x14 [key, delta i64]    DELETE 0x15 [key]
//! COMPARE_SET 0x16 [key, new] (expect absent) or [key, new, expected]
//! ```
//!
//! Responses:
//!
//! ```text
//! OK 0x20     GET, COMPARE_SET: [value]   TRY_GET: [] or [value]   ADD: [i64]
//!             DELETE: [u8 0 or 1]         SET, WAIT: []
//! ERROR 0x21  [kind u8, message]   kind: 1 invalid argument, 2 timeout, 3 peer gone,
//!                                        4 protocol, 5 rendezvous
//! ```
//!
//! Keys are UTF-8, at most [`MAX_KEY_LEN`] bytes; values at most [`MAX_VALUE_LEN`].

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::memory::{fmt_duration, Limits, Table};
use super::wire::{self, Header, NONCE_LEN};
use super::{random_bytes, Store, MAX_KEY_LEN, MAX_VALUE_LEN, MAX_WAIT_KEYS};
use crate::error::{Error, ErrorKind, Result};

/// How long a new connection has to complete the handshake before the server drops it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the rest of a frame may take to arrive once its first byte has (server side);
/// also bounds the server's writes of one response.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(60);

/// Most connections a server serves at once; further ones are dropped at accept.
pub const MAX_CONNECTIONS: usize = 8192;

/// Default bound on a client's non-waiting ops (set, try_get, add, delete, compare_set), and
/// the grace a waiting op allows past its deadline for the server's answer.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Stack size of the server's per-connection threads.
const CONN_STACK: usize = 256 << 10;

/// First back-off between connection attempts to a store that is not listening yet; doubles
/// up to [`CONNECT_BACKOFF_MAX`].
const CONNECT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const CONNECT_BACKOFF_MAX: Duration = Duration::from_millis(250);

/// Longest timeout a waiting request may carry (larger ones are clamped), so server-side
/// deadline arithmetic cannot overflow.
const MAX_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

const LOG: &str = "oxcomm::store";

/// `base + d`, saturating (at [`MAX_WAIT`] past `base`) instead of panicking for huge
/// timeouts configured by the caller.
fn after(base: Instant, d: Duration) -> Instant {
    base.checked_add(d).or_else(|| base.checked_add(MAX_WAIT)).unwrap_or(base)
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// Configures a [`StoreServer`]; made by [`StoreServer::builder`].
#[derive(Clone)]
pub struct StoreServerBuilder {
    token: Vec<u8>,
    handshake_timeout: Duration,
    frame_timeout: Duration,
    limits: Limits,
    max_connections: usize,
}

impl fmt::Debug for StoreServerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServerBuilder")
            .field("token", &"<redacted>")
            .field("handshake_timeout", &self.handshake_timeout)
            .field("frame_timeout", &self.frame_timeout)
            .field("limits", &self.limits)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl StoreServerBuilder {
    /// Time a new connection has to finish the handshake (default [`HANDSHAKE_TIMEOUT`]).
    pub fn handshake_timeout(mut self, timeout: Duration) -> StoreServerBuilder {
        self.handshake_timeout = timeout;
        self
    }

    /// Time the rest of a frame has once it started (default [`FRAME_TIMEOUT`]).
    pub fn frame_timeout(mut self, timeout: Duration) -> StoreServerBuilder {
        self.frame_timeout = timeout;
        self
    }

    /// Longest key accepted, at most (and by default) [`MAX_KEY_LEN`].
    pub fn max_key_len(mut self, bytes: usize) -> StoreServerBuilder {
        self.limits.max_key_len = bytes.min(MAX_KEY_LEN);
        self
    }

    /// Longest value accepted, at most (and by default) [`MAX_VALUE_LEN`].
    pub fn max_value_len(mut self, bytes: usize) -> StoreServerBuilder {
        self.limits.max_value_len = bytes.min(MAX_VALUE_LEN);
        self
    }

    /// Most connections served at once (default [`MAX_CONNECTIONS`]).
    pub fn max_connections(mut self, n: usize) -> StoreServerBuilder {
        self.max_connections = n;
        self
    }

    /// Binds exactly `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and
    /// starts serving in background threads.
    pub fn bind(self, addr: SocketAddr) -> Result<StoreServer> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::io(format_args!("binding the store to {addr}"), e))?;
        let local_addr = listener.local_addr().map_err(|e| Error::io("reading the store's bound address", e))?;
        let shared = Arc::new(Shared {
            table: Table::new(self.limits),
            token: self.token,
            handshake_timeout: self.handshake_timeout,
            frame_timeout: self.frame_timeout,
            limits: self.limits,
            max_connections: self.max_connections,
            conns: Mutex::new(Conns::default()),
            closing: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("oxcomm-store-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| Error::io("starting the store's accept thread", e))?;
        tracing::debug!(target: LOG, %local_addr, "store listening");
        Ok(StoreServer { local_addr, shared, accept: Mutex::new(Some(accept)) })
    }
}

/// A TCP key-value store server. Serves until [`StoreServer::shutdown`] or drop.
///
/// ```
/// use std::time::{Duration, Instant};
/// use oxcomm::rendezvous::{Store, StoreClient, StoreServer};
///
/// let token = b"job secret";
/// let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), token)?;
/// let deadline = Instant::now() + Duration::from_secs(5);
/// let client = StoreClient::connect(server.local_addr(), token, deadline)?;
/// client.set("rank0/addr", b"10.0.0.1:7000")?;
/// assert_eq!(client.get("rank0/addr", deadline)?, b"10.0.0.1:7000");
/// # Ok::<(), oxcomm::Error>(())
/// ```
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer").field("local_addr", &self.local_addr).finish_non_exhaustive()
    }
}

impl StoreServer {
    /// A builder with the default timeouts and limits, for the secret `token`.
    pub fn builder(token: &[u8]) -> StoreServerBuilder {
        StoreServerBuilder {
            token: token.to_vec(),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            frame_timeout: FRAME_TIMEOUT,
            limits: Limits::default(),
            max_connections: MAX_CONNECTIONS,
        }
    }

    /// Binds exactly `addr` with the defaults: `StoreServer::builder(token).bind(addr)`.
    pub fn bind(addr: SocketAddr, token: &[u8]) -> Result<StoreServer> {
        StoreServer::builder(token).bind(addr)
    }

    /// The address actually bound (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops serving: closes every connection, fails pending waits on the server side (their
    /// clients see [`ErrorKind::PeerGone`]) and stops accepting. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        let Some(accept) = lock(&self.accept).take() else {
            return;
        };
        {
            let mut conns = lock(&self.shared.conns);
            self.shared.closing.store(true, Ordering::SeqCst);
            for stream in conns.live.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            conns.live.clear();
        }
        self.shared.table.close();
        // Wake the accept thread, which then sees `closing` and returns.
        let wake = match self.local_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), self.local_addr.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv6Addr::LOCALHOST.into(), self.local_addr.port())
            }
            _ => self.local_addr,
        };
        match TcpStream::connect_timeout(&wake, Duration::from_secs(1)) {
            Ok(_) => {
                let _ = accept.join();
            }
            Err(e) => tracing::warn!(
                target: LOG,
                addr = %self.local_addr,
                "could not wake the accept thread ({e}); it stops at the next connection"
            ),
        }
        tracing::debug!(target: LOG, addr = %self.local_addr, "store shut down");
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Shared {
    table: Table,
    token: Vec<u8>,
    handshake_timeout: Duration,
    frame_timeout: Duration,
    limits: Limits,
    max_connections: usize,
    /// Live connections, so shutdown can close them; `closing` is set under this lock.
    conns: Mutex<Conns>,
    closing: AtomicBool,
    next_id: AtomicU64,
}

#[derive(Default)]
struct Conns {
    live: HashMap<u64, TcpStream>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one still holds valid data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for incoming in listener.incoming() {
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        match incoming {
            Ok(stream) => start_connection(&shared, stream),
            Err(e) => {
                tracing::warn!(target: LOG, "accept failed: {e}");
                // E.g. out of file descriptors: back off instead of spinning on the error.
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn start_connection(shared: &Arc<Shared>, stream: TcpStream) {
    let peer = stream.peer_addr().map_or_else(|_| "<unknown>".to_owned(), |a| a.to_string());
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    {
        let mut conns = lock(&shared.conns);
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        if conns.live.len() >= shared.max_connections {
            tracing::warn!(
                target: LOG,
                %peer,
                "dropping connection: already serving {} (the limit)",
                conns.live.len()
            );
            return;
        }
        match stream.try_clone() {
            Ok(clone) => {
                conns.live.insert(id, clone);
            }
            Err(e) => {
                tracing::warn!(target: LOG, %peer, "dropping connection: {e}");
                return;
            }
        }
    }
    let conn_shared = Arc::clone(shared);
    let conn_peer = peer.clone();
    let spawned =
        std::thread::Builder::new().name("oxcomm-store-conn".into()).stack_size(CONN_STACK).spawn(move || {
            serve(&conn_shared, stream, &conn_peer);
            lock(&conn_shared.conns).live.remove(&id);
        });
    if let Err(e) = spawned {
        tracing::warn!(target: LOG, %peer, "dropping connection: cannot start a thread: {e}");
        lock(&shared.conns).live.remove(&id);
    }
}

/// Serves one connection: handshake, then requests until the client leaves or errs.
fn serve(shared: &Shared, mut stream: TcpStream, peer: &str) {
    let _ = stream.set_nodelay(true);
    let handshake_deadline = after(Instant::now(), shared.handshake_timeout);
    if let Err(e) = server_handshake(shared, &mut stream, handshake_deadline) {
        if !shared.closing.load(Ordering::SeqCst) {
            tracing::warn!(target: LOG, %peer, "dropping connection during handshake: {e}");
        }
        return;
    }
    tracing::debug!(target: LOG, %peer, "client authenticated");
    loop {
        let header = match wire::read_header(&mut stream, None) {
            Ok(header) => header,
            Err(e) if e.kind() == ErrorKind::PeerGone || shared.closing.load(Ordering::SeqCst) => {
                tracing::debug!(target: LOG, %peer, "client left");
                return;
            }
            Err(e) => {
                tracing::warn!(target: LOG, %peer, "dropping connection: {e}");
                return;
            }
        };
        let response = match handle_request(shared, &mut stream, header) {
            Ok(response) => response,
            Err(e) => {
                if !shared.closing.load(Ordering::SeqCst) {
                    tracing::warn!(target: LOG, %peer, "dropping connection: {e}");
                }
                return;
            }
        };
        let deadline = after(Instant::now(), shared.frame_timeout);
        if let Err(e) = wire::write_by(&mut stream, &response, deadline) {
            tracing::debug!(target: LOG, %peer, "dropping connection: {e}");
            return;
        }
    }
}

fn server_handshake(shared: &Shared, stream: &mut TcpStream, deadline: Instant) -> Result<()> {
    let header = wire::read_header(stream, Some(deadline))?;
    expect(header, wire::HELLO, 1, "HELLO")?;
    let client_nonce = read_exact_field(stream, NONCE_LEN, deadline, "client nonce")?;

    let mut server_nonce = [0u8; NONCE_LEN];
    random_bytes(&mut server_nonce)?;
    let proof = wire::server_proof(&shared.token, &client_nonce, &server_nonce);
    let challenge = wire::encode(wire::CHALLENGE, &[&server_nonce, &proof]);
    wire::write_by(stream, &challenge, deadline)?;

    let header = wire::read_header(stream, Some(deadline))?;
    expect(header, wire::PROOF, 1, "PROOF")?;
    let client_proof = read_exact_field(stream, NONCE_LEN, deadline, "client proof")?;
    if !wire::verify_client(&shared.token, &server_nonce, &client_nonce, &client_proof) {
        let reason = b"wrong or missing OXCOMM_TOKEN: the client's proof does not match";
        let _ = wire::write_by(stream, &wire::encode(wire::REJECT, &[reason]), deadline);
        return Err(Error::new(ErrorKind::Rendezvous, "client failed authentication (wrong or missing OXCOMM_TOKEN)"));
    }
    wire::write_by(stream, &wire::encode(wire::WELCOME, &[]), deadline)
}

fn expect(header: Header, code: u8, count: usize, name: &str) -> Result<()> {
    if header.code != code || header.count != count {
        return Err(Error::protocol(format!(
            "expected {name} (code {code:#04x}, {count} fields), got code {:#04x} with {} fields",
            header.code, header.count
        )));
    }
    Ok(())
}

fn read_exact_field(stream: &mut TcpStream, len: usize, deadline: Instant, what: &str) -> Result<Vec<u8>> {
    let mut fields = wire::read_fields(stream, 1, |_| len, deadline)?;
    let field = fields.pop().unwrap_or_default();
    if field.len() != len {
        return Err(Error::protocol(format!("{what} has {} bytes, expected {len}", field.len())));
    }
    Ok(field)
}

/// Reads the body of one request and runs it. `Err` means the connection must be dropped
/// (protocol violation or I/O failure); an op that fails is answered with an `ERROR` frame.
fn handle_request(shared: &Shared, stream: &mut TcpStream, header: Header) -> Result<Vec<u8>> {
    let (k, v) = (shared.limits.max_key_len, shared.limits.max_value_len);
    let limit = request_shape(header, k, v)?;
    let code = header.code;
    let deadline = after(Instant::now(), shared.frame_timeout);
    let fields = wire::read_fields(stream, header.count, limit, deadline)?;

    let table = &shared.table;
    let result = match code {
        wire::SET => table.set(key(&fields[0])?, &fields[1]).map(|()| vec![]),
        wire::GET => {
            let deadline = wait_deadline(&fields[1])?;
            table.get(key(&fields[0])?, deadline).map(|v| vec![v])
        }
        wire::TRY_GET => table.try_get(key(&fields[0])?).map(|v| v.into_iter().collect()),
        wire::WAIT => {
            let deadline = wait_deadline(&fields[0])?;
            let keys = fields[1..].iter().map(|f| key(f)).collect::<Result<Vec<_>>>()?;
            table.wait(&keys, deadline).map(|()| vec![])
        }
        wire::ADD => {
            let delta = i64::from_le_bytes(eight(&fields[1])?);
            table.add(key(&fields[0])?, delta).map(|n| vec![n.to_le_bytes().to_vec()])
        }
        wire::DELETE => table.delete(key(&fields[0])?).map(|existed| vec![vec![u8::from(existed)]]),
        _ => {
            let expected = fields.get(2).map(Vec::as_slice);
            table.compare_set(key(&fields[0])?, expected, &fields[1]).map(|v| vec![v])
        }
    };
    Ok(match result {
        Ok(out) => {
            let out: Vec<&[u8]> = out.iter().map(Vec::as_slice).collect();
            wire::encode(wire::OK, &out)
        }
        Err(e) => wire::encode(wire::ERROR, &[&[wire::kind_code(e.kind())], e.message().as_bytes()]),
    })
}

/// Checks a request header's code and field count, and returns the byte limit of each of its
/// fields (`k` for keys, `v` for values), before any field is read.
pub(crate) fn request_shape(header: Header, k: usize, v: usize) -> Result<impl Fn(usize) -> usize> {
    let count_ok = match header.code {
        wire::SET | wire::GET | wire::ADD => header.count == 2,
        wire::TRY_GET | wire::DELETE => header.count == 1,
        wire::WAIT => (1..=MAX_WAIT_KEYS + 1).contains(&header.count),
        wire::COMPARE_SET => (2..=3).contains(&header.count),
        code => return Err(Error::protocol(format!("unknown request code {code:#04x}"))),
    };
    if !count_ok {
        return Err(Error::protocol(format!("request code {:#04x} with {} fields", header.code, header.count)));
    }
    let code = header.code;
    Ok(move |i: usize| match (code, i) {
        (wire::WAIT, 0) => 8,
        (wire::WAIT, _) => k,
        (_, 0) => k,
        (wire::GET | wire::ADD, 1) => 8,
        _ => v,
    })
}

/// Checks the fields of a request the way [`handle_request`] reads them (keys are UTF-8,
/// integers 8 bytes), without running it: for the fuzz targets.
pub(crate) fn check_request_fields(code: u8, fields: &[Vec<u8>]) -> Result<()> {
    match code {
        wire::WAIT => {
            eight(&fields[0])?;
            fields[1..].iter().try_for_each(|f| key(f).map(|_| ()))
        }
        wire::GET | wire::ADD => {
            eight(&fields[1])?;
            key(&fields[0]).map(|_| ())
        }
        _ => key(&fields[0]).map(|_| ()),
    }
}

fn key(bytes: &[u8]) -> Result<&str> {
    std::str::from_utf8(bytes).map_err(|_| Error::protocol("store key is not UTF-8"))
}

fn eight(bytes: &[u8]) -> Result<[u8; 8]> {
    bytes.try_into().map_err(|_| Error::protocol(format!("expected an 8-byte integer, got {} bytes", bytes.len())))
}

fn wait_deadline(field: &[u8]) -> Result<Instant> {
    let ms = u64::from_le_bytes(eight(field)?);
    Ok(Instant::now() + Duration::from_millis(ms).min(MAX_WAIT))
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// A connection to a [`StoreServer`], authenticated both ways.
///
/// `StoreClient` is `Send + Sync` and all ops take `&self`, but one connection carries one
/// request at a time: ops from several threads are serialized, and a thread blocked in
/// [`Store::get`] or [`Store::wait`] holds the connection until its answer comes. Give each
/// thread that waits its own client.
///
/// After an I/O error or a timeout while reading an answer the connection is in an unknown
/// state; every later op fails with the same kind of error. An op that the server answers with
/// an error (a wait that timed out, a counter that is not a number) leaves it usable.
pub struct StoreClient {
    addr: SocketAddr,
    op_timeout: Duration,
    conn: Mutex<Conn>,
}

struct Conn {
    stream: TcpStream,
    broken: Option<Error>,
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("op_timeout", &self.op_timeout)
            .finish_non_exhaustive()
    }
}

impl StoreClient {
    /// Connects to the store at `addr` and runs the handshake with `token`, all before
    /// `deadline`. A refused connection is retried (with back-off up to 250 ms) until the
    /// deadline, since the server may start after its clients.
    ///
    /// Errors: [`ErrorKind::Timeout`] when the deadline passes, [`ErrorKind::Rendezvous`]
    /// when either side's proof does not match (a wrong or missing `OXCOMM_TOKEN`, or not our
    /// job's store), [`ErrorKind::Protocol`] when the peer does not speak this protocol.
    pub fn connect(addr: SocketAddr, token: &[u8], deadline: Instant) -> Result<StoreClient> {
        let start = Instant::now();
        let mut backoff = CONNECT_BACKOFF_MIN;
        let mut stream = loop {
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {} connecting to the store at {addr} (nothing accepted)",
                        fmt_duration(now - start)
                    ),
                ));
            }
            match TcpStream::connect_timeout(&addr, left) {
                Ok(stream) => break stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::WouldBlock
                    ) =>
                {
                    tracing::trace!(target: LOG, %addr, "store not reachable yet: {e}");
                    std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
                    backoff = (backoff * 2).min(CONNECT_BACKOFF_MAX);
                }
                Err(e) => return Err(Error::io(format_args!("connecting to the store at {addr}"), e)),
            }
        };
        let _ = stream.set_nodelay(true);
        client_handshake(&mut stream, token, deadline)
            .map_err(|e| Error::new(e.kind(), format!("store at {addr}: {}", e.message())))?;
        tracing::debug!(target: LOG, %addr, "connected to store");
        Ok(StoreClient { addr, op_timeout: DEFAULT_OP_TIMEOUT, conn: Mutex::new(Conn { stream, broken: None }) })
    }

    /// Sets the bound on non-waiting ops and the grace past a waiting op's deadline (default
    /// [`DEFAULT_OP_TIMEOUT`]).
    pub fn with_op_timeout(mut self, timeout: Duration) -> StoreClient {
        self.op_timeout = timeout;
        self
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one request and reads its answer; `answer_by` bounds the wait for the answer.
    fn call(&self, code: u8, fields: &[&[u8]], answer_by: Instant) -> Result<Vec<Vec<u8>>> {
        let mut conn = lock(&self.conn);
        if let Some(e) = &conn.broken {
            return Err(Error::new(
                e.kind(),
                format!("store connection unusable after an earlier error: {}", e.message()),
            ));
        }
        let frame = wire::encode(code, fields);
        let stream = &mut conn.stream;
        let exchange = wire::write_by(stream, &frame, after(Instant::now(), self.op_timeout))
            .and_then(|()| read_answer(stream, answer_by));
        match exchange {
            Ok(Ok(fields)) => Ok(fields),
            Ok(Err(op_error)) => Err(op_error),
            Err(e) => {
                let e = Error::new(e.kind(), format!("store at {}: {}", self.addr, e.message()));
                conn.broken = Some(e.clone());
                Err(e)
            }
        }
    }

    fn check_key(key: &str) -> Result<()> {
        Limits::default().check_key(key)
    }

    fn check_value(key: &str, value: &[u8]) -> Result<()> {
        Limits::default().check_value(key, value)
    }

    fn op_deadline(&self) -> Instant {
        after(Instant::now(), self.op_timeout)
    }
}

/// Reads one answer: `Ok(Ok(fields))` for `OK`, `Ok(Err(_))` for an `ERROR` the server sent
/// (connection still fine), `Err(_)` when the connection failed.
fn read_answer(stream: &mut TcpStream, deadline: Instant) -> Result<Result<Vec<Vec<u8>>>> {
    let header = wire::read_header(stream, Some(deadline))?;
    let limit = answer_shape(header)?;
    let fields = wire::read_fields(stream, header.count, limit, deadline)?;
    Ok(answer(header.code, fields))
}

/// Checks an answer header (`OK` with 0 or 1 fields, `ERROR` with 2) and returns the byte
/// limit of each field, before any field is read.
pub(crate) fn answer_shape(header: Header) -> Result<impl Fn(usize) -> usize> {
    let error = match (header.code, header.count) {
        (wire::OK, 0..=1) => false,
        (wire::ERROR, 2) => true,
        (code, count) => {
            return Err(Error::protocol(format!("unexpected answer code {code:#04x} with {count} fields")))
        }
    };
    Ok(move |i: usize| match (error, i) {
        (false, _) => MAX_VALUE_LEN,
        (true, 0) => 1,
        (true, _) => wire::MAX_MESSAGE_LEN,
    })
}

/// The answer that `fields` of a checked answer header `code` make.
pub(crate) fn answer(code: u8, mut fields: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
    if code != wire::ERROR {
        return Ok(fields);
    }
    let message = fields.pop().unwrap_or_default();
    let kind = wire::code_kind(fields.first().and_then(|f| f.first()).copied().unwrap_or(0));
    Err(Error::new(kind, String::from_utf8_lossy(&message)))
}

fn client_handshake(stream: &mut TcpStream, token: &[u8], deadline: Instant) -> Result<()> {
    let mut client_nonce = [0u8; NONCE_LEN];
    random_bytes(&mut client_nonce)?;
    wire::write_by(stream, &wire::encode(wire::HELLO, &[&client_nonce]), deadline)?;

    let header = wire::read_header(stream, Some(deadline))?;
    if header.code == wire::REJECT {
        return Err(rejected(stream, header, deadline));
    }
    expect(header, wire::CHALLENGE, 2, "CHALLENGE")?;
    let fields = wire::read_fields(stream, 2, |_| NONCE_LEN, deadline)?;
    let (server_nonce, server_proof) = (&fields[0], &fields[1]);
    if server_nonce.len() != NONCE_LEN || !wire::verify_server(token, &client_nonce, server_nonce, server_proof) {
        return Err(Error::new(
            ErrorKind::Rendezvous,
            "the store could not prove it knows our secret: wrong or missing OXCOMM_TOKEN \
             (on this rank or on the store), or this is not our job's store",
        ));
    }
    let proof = wire::client_proof(token, server_nonce, &client_nonce);
    wire::write_by(stream, &wire::encode(wire::PROOF, &[&proof]), deadline)?;

    let header = wire::read_header(stream, Some(deadline))?;
    if header.code == wire::REJECT {
        return Err(rejected(stream, header, deadline));
    }
    expect(header, wire::WELCOME, 0, "WELCOME")
}

fn rejected(stream: &mut TcpStream, header: Header, deadline: Instant) -> Error {
    let reason = if header.count == 1 {
        wire::read_fields(stream, 1, |_| wire::MAX_MESSAGE_LEN, deadline)
            .map(|f| String::from_utf8_lossy(&f[0]).into_owned())
            .unwrap_or_default()
    } else {
        String::new()
    };
    Error::new(ErrorKind::Rendezvous, format!("the store rejected us: {reason} (wrong or missing OXCOMM_TOKEN)"))
}

/// Milliseconds left until `deadline`, rounded up, for a waiting request.
fn millis_until(deadline: Instant) -> [u8; 8] {
    let left = deadline.saturating_duration_since(Instant::now());
    let ms = left.as_micros().div_ceil(1000);
    u64::try_from(ms).unwrap_or(u64::MAX).to_le_bytes()
}

fn single(mut fields: Vec<Vec<u8>>, op: &str) -> Result<Vec<u8>> {
    match fields.len() {
        1 => Ok(fields.pop().unwrap_or_default()),
        n => Err(Error::protocol(format!("{op} answer has {n} fields, expected 1"))),
    }
}

impl Store for StoreClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Self::check_key(key)?;
        Self::check_value(key, value)?;
        self.call(wire::SET, &[key.as_bytes(), value], self.op_deadline()).map(drop)
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        Self::check_key(key)?;
        let ms = millis_until(deadline);
        let fields = self.call(wire::GET, &[key.as_bytes(), &ms], after(deadline, self.op_timeout))?;
        single(fields, "GET")
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Self::check_key(key)?;
        let mut fields = self.call(wire::TRY_GET, &[key.as_bytes()], self.op_deadline())?;
        Ok(fields.pop())
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        if keys.len() > MAX_WAIT_KEYS {
            return Err(Error::invalid(format!("wait on {} keys; at most {MAX_WAIT_KEYS} per call", keys.len())));
        }
        for key in keys {
            Self::check_key(key)?;
        }
        let ms = millis_until(deadline);
        let mut fields: Vec<&[u8]> = Vec::with_capacity(keys.len() + 1);
        fields.push(&ms);
        fields.extend(keys.iter().map(|k| k.as_bytes()));
        self.call(wire::WAIT, &fields, after(deadline, self.op_timeout)).map(drop)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Self::check_key(key)?;
        let fields = self.call(wire::ADD, &[key.as_bytes(), &delta.to_le_bytes()], self.op_deadline())?;
        Ok(i64::from_le_bytes(eight(&single(fields, "ADD")?)?))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Self::check_key(key)?;
        let fields = self.call(wire::DELETE, &[key.as_bytes()], self.op_deadline())?;
        Ok(single(fields, "DELETE")? != [0])
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        Self::check_key(key)?;
        Self::check_value(key, new)?;
        let mut fields: Vec<&[u8]> = vec![key.as_bytes(), new];
        if let Some(expected) = expected {
            Self::check_value(key, expected)?;
            fields.push(expected);
        }
        let answer = self.call(wire::COMPARE_SET, &fields, self.op_deadline())?;
        single(answer, "COMPARE_SET")
    }
}
