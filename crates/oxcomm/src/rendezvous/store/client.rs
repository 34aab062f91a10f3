//! The store's client: connects (with back-off), runs the handshake and sends one request at
//! a time.

#[allow(clippy::wildcard_imports)]
use super::*;

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
