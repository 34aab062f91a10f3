//! Frames and handshake proofs of the TCP store protocol (the layout is documented in
//! [`super::store`]). Pure encoding, bounded decoding and deadline-aware socket reads; it knows
//! nothing about what the ops mean.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, ErrorKind, Result};

/// First four bytes of every frame.
pub(crate) const MAGIC: [u8; 4] = *b"OXST";
/// Protocol version; a peer with another version is refused.
pub(crate) const VERSION: u8 = 1;
/// Bytes in a frame header: magic, version, code, field count.
pub(crate) const HEADER_LEN: usize = 8;
/// Bytes in a handshake nonce and in an HMAC-SHA256 proof.
pub(crate) const NONCE_LEN: usize = 32;
/// Longest error message or reject reason a peer may send.
pub(crate) const MAX_MESSAGE_LEN: usize = 16 << 10;
/// Field bytes are read in pieces of this size, so a peer that announces a long field but
/// sends little makes us allocate little.
const READ_CHUNK: usize = 64 << 10;

// Frame codes: handshake.
pub(crate) const HELLO: u8 = 0x01;
pub(crate) const CHALLENGE: u8 = 0x02;
pub(crate) const PROOF: u8 = 0x03;
pub(crate) const WELCOME: u8 = 0x04;
pub(crate) const REJECT: u8 = 0x05;
// Frame codes: requests.
pub(crate) const SET: u8 = 0x10;
pub(crate) const GET: u8 = 0x11;
pub(crate) const TRY_GET: u8 = 0x12;
pub(crate) const WAIT: u8 = 0x13;
pub(crate) const ADD: u8 = 0x14;
pub(crate) const DELETE: u8 = 0x15;
pub(crate) const COMPARE_SET: u8 = 0x16;
// Frame codes: responses.
pub(crate) const OK: u8 = 0x20;
pub(crate) const ERROR: u8 = 0x21;

/// Domain-separation labels: the two proofs can never be replayed for each other.
const CLIENT_LABEL: &[u8] = b"oxcomm-store-v1/client";
const SERVER_LABEL: &[u8] = b"oxcomm-store-v1/server";

/// A decoded frame header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) code: u8,
    pub(crate) count: usize,
}

/// Encodes a frame of `code` with `fields`.
pub(crate) fn encode(code: u8, fields: &[&[u8]]) -> Vec<u8> {
    let body: usize = fields.iter().map(|f| 4 + f.len()).sum();
    let mut out = Vec::with_capacity(HEADER_LEN + body);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(code);
    // Callers never pass more than MAX_WAIT_KEYS + 1 fields, which fits in u16.
    out.extend_from_slice(&(fields.len() as u16).to_le_bytes());
    for field in fields {
        out.extend_from_slice(&(field.len() as u32).to_le_bytes());
        out.extend_from_slice(field);
    }
    out
}

/// Decodes and checks a header (magic and version).
pub(crate) fn decode_header(bytes: &[u8; HEADER_LEN]) -> Result<Header> {
    if bytes[..4] != MAGIC {
        return Err(Error::protocol(format!(
            "bad magic {:02x?} (expected {:02x?}): not an oxcomm store peer",
            &bytes[..4],
            MAGIC
        )));
    }
    if bytes[4] != VERSION {
        return Err(Error::protocol(format!("protocol version {} (this side speaks {VERSION})", bytes[4])));
    }
    Ok(Header { code: bytes[5], count: usize::from(u16::from_le_bytes([bytes[6], bytes[7]])) })
}

/// Reads one header; `deadline` `None` waits as long as the connection is open.
pub(crate) fn read_header(stream: &mut TcpStream, deadline: Option<Instant>) -> Result<Header> {
    let mut bytes = [0u8; HEADER_LEN];
    read_exact_by(stream, &mut bytes, deadline).map_err(|e| io_error("reading a frame", e))?;
    decode_header(&bytes)
}

/// Reads the `count` fields that follow a header; `limit(i)` bounds field `i` and is checked
/// before anything is allocated for it.
pub(crate) fn read_fields(
    stream: &mut TcpStream,
    count: usize,
    limit: impl Fn(usize) -> usize,
    deadline: Instant,
) -> Result<Vec<Vec<u8>>> {
    read_fields_with(
        &mut |buf: &mut [u8]| read_exact_by(stream, buf, Some(deadline)).map_err(|e| io_error("reading a frame", e)),
        count,
        &limit,
    )
}

/// [`read_fields`] through `read` (which fills its whole buffer or fails): the decoder
/// itself, without the socket (the fuzz targets drive it from a byte slice).
pub(crate) fn read_fields_with(
    read: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    count: usize,
    limit: &dyn Fn(usize) -> usize,
) -> Result<Vec<Vec<u8>>> {
    let mut fields = Vec::with_capacity(count.min(64));
    for i in 0..count {
        let mut len = [0u8; 4];
        read(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        let max = limit(i);
        if len > max {
            return Err(Error::protocol(format!(
                "frame field {i} announces {len} bytes, more than the limit of {max}"
            )));
        }
        let mut field = Vec::with_capacity(len.min(READ_CHUNK));
        while field.len() < len {
            let start = field.len();
            let end = len.min(start + READ_CHUNK);
            field.resize(end, 0);
            read(&mut field[start..end])?;
        }
        fields.push(field);
    }
    Ok(fields)
}

/// Writes all of `bytes` before `deadline`.
pub(crate) fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        let result = remaining(deadline)
            .and_then(|t| stream.set_write_timeout(Some(t)))
            .and_then(|()| stream.write(&bytes[written..]));
        match result {
            Ok(0) => return Err(io_error("writing a frame", io::ErrorKind::WriteZero.into())),
            Ok(n) => written += n,
            Err(e) if retryable(&e) => continue,
            Err(e) => return Err(io_error("writing a frame", e)),
        }
    }
    Ok(())
}

/// Fills `buf`, waiting at most until `deadline` (`None`: no limit).
pub(crate) fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let timeout = deadline.map(remaining).transpose()?;
        stream.set_read_timeout(timeout)?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if retryable(&e) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Time left until `deadline`, or a `TimedOut` error when none is.
pub(crate) fn remaining(deadline: Instant) -> io::Result<std::time::Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(io::ErrorKind::TimedOut.into());
    }
    Ok(deadline - now)
}

/// Interrupted reads are retried; socket timeouts are retried too and end at the deadline
/// check, so an early wake-up never ends a wait before its time.
pub(crate) fn retryable(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

pub(crate) fn io_error(what: &str, err: io::Error) -> Error {
    if err.kind() == io::ErrorKind::UnexpectedEof {
        return Error::new(ErrorKind::PeerGone, format!("{what}: the other side closed the connection"));
    }
    Error::io(what, err)
}

fn mac(token: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!())
}

/// The proof a client sends: HMAC(token, server_nonce ‖ client_nonce ‖ client label).
pub(crate) fn client_proof(token: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    let mut m = mac(token);
    m.update(server_nonce);
    m.update(client_nonce);
    m.update(CLIENT_LABEL);
    m.finalize().into_bytes().to_vec()
}

/// The proof a server sends: HMAC(token, client_nonce ‖ server_nonce ‖ server label).
pub(crate) fn server_proof(token: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    let mut m = mac(token);
    m.update(client_nonce);
    m.update(server_nonce);
    m.update(SERVER_LABEL);
    m.finalize().into_bytes().to_vec()
}

/// Checks a client proof in constant time.
pub(crate) fn verify_client(token: &[u8], server_nonce: &[u8], client_nonce: &[u8], proof: &[u8]) -> bool {
    let mut m = mac(token);
    m.update(server_nonce);
    m.update(client_nonce);
    m.update(CLIENT_LABEL);
    m.verify_slice(proof).is_ok()
}

/// Checks a server proof in constant time.
pub(crate) fn verify_server(token: &[u8], client_nonce: &[u8], server_nonce: &[u8], proof: &[u8]) -> bool {
    let mut m = mac(token);
    m.update(client_nonce);
    m.update(server_nonce);
    m.update(SERVER_LABEL);
    m.verify_slice(proof).is_ok()
}

/// Wire code of an error kind carried in an `ERROR` response.
pub(crate) fn kind_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::InvalidArgument => 1,
        ErrorKind::Timeout => 2,
        ErrorKind::PeerGone => 3,
        ErrorKind::Protocol => 4,
        ErrorKind::Rendezvous => 5,
        _ => 0,
    }
}

/// Error kind of a wire code (unknown codes read as [`ErrorKind::Io`]).
pub(crate) fn code_kind(code: u8) -> ErrorKind {
    match code {
        1 => ErrorKind::InvalidArgument,
        2 => ErrorKind::Timeout,
        3 => ErrorKind::PeerGone,
        4 => ErrorKind::Protocol,
        5 => ErrorKind::Rendezvous,
        _ => ErrorKind::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let frame = encode(SET, &[b"k", b"value"]);
        let header = decode_header(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((header.code, header.count), (SET, 2));
        assert_eq!(&frame[HEADER_LEN..HEADER_LEN + 4], &1u32.to_le_bytes());

        let err = decode_header(b"GET / HT").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol);
        let mut other_version = frame[..HEADER_LEN].to_vec();
        other_version[4] = 9;
        let err = decode_header(other_version[..].try_into().unwrap()).unwrap_err();
        assert!(err.message().contains("version 9"), "{err}");
    }

    #[test]
    fn proofs_are_bound_to_token_nonces_and_direction() {
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        let c = client_proof(b"secret", &sn, &cn);
        assert!(verify_client(b"secret", &sn, &cn, &c));
        assert!(!verify_client(b"other", &sn, &cn, &c));
        assert!(!verify_client(b"secret", &cn, &sn, &c));
        let s = server_proof(b"secret", &cn, &sn);
        assert_ne!(c, s);
        assert!(verify_server(b"secret", &cn, &sn, &s));
        assert!(!verify_server(b"secret", &cn, &sn, &c));
        assert!(!verify_server(b"secret", &cn, &sn, &s[..31]));
    }
}
