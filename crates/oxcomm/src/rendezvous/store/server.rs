//! The store's server: accepts connections, runs the handshake and serves requests, one
//! thread per connection.

#[allow(clippy::wildcard_imports)]
use super::*;

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

fn wait_deadline(field: &[u8]) -> Result<Instant> {
    let ms = u64::from_le_bytes(eight(field)?);
    Ok(Instant::now() + Duration::from_millis(ms).min(MAX_WAIT))
}
