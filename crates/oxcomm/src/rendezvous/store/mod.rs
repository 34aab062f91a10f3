//! The TCP key-value store: a [`StoreServer`] that one rank (or the launcher) runs, and the
//! [`StoreClient`] every rank connects with. Both sides prove they hold the job's shared
//! secret (`OXCOMM_TOKEN`) before any key is read or written.
//!
//! This module owns sockets, threads, the handshake and the request loop: `server.rs` the
//! accepting and serving side, `client.rs` the connecting side, this file what both share. What each op means
//! lives in the shared table (`memory.rs`); frame encoding in `store_wire.rs`. It knows nothing
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

mod client;
mod server;

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::memory::{fmt_duration, Limits, Table};
use super::store_wire::{self as wire, Header, NONCE_LEN};
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

pub use client::StoreClient;
pub(crate) use client::{answer, answer_shape};
pub(crate) use server::{check_request_fields, request_shape};
pub use server::{StoreServer, StoreServerBuilder};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one still holds valid data.
    m.lock().unwrap_or_else(|e| e.into_inner())
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

fn eight(bytes: &[u8]) -> Result<[u8; 8]> {
    bytes.try_into().map_err(|_| Error::protocol(format!("expected an 8-byte integer, got {} bytes", bytes.len())))
}
