//! The handshake that opens every TCP link: mutual HMAC-SHA256 challenge-response with the
//! job's shared secret, binding job id, world size and both ranks, before any data.
//!
//! This file owns the handshake messages and both sides of the exchange on a blocking socket
//! with a deadline. It knows nothing about listeners, link state or frames.
//!
//! # Messages
//!
//! Each message is an 8-byte header — magic `OXTH`, version [`VERSION`], code, body length
//! (u16 LE, at most [`MAX_BODY`], checked before reading the body) — and a body:
//!
//! ```text
//! connector → acceptor  HELLO      nonce_c[32] world:u32 from:u32 to:u32 job_len:u16 job
//! acceptor  → connector CHALLENGE  nonce_a[32]                     (or REJECT reason)
//! connector → acceptor  PROOF      HMAC(token, "oxcomm-tcp-v1/connector" ‖ nonce_a ‖ nonce_c ‖ hello)
//! acceptor  → connector WELCOME    HMAC(token, "oxcomm-tcp-v1/acceptor"  ‖ nonce_c ‖ nonce_a ‖ hello)
//!                                                                  (or REJECT reason)
//! ```
//!
//! `hello` is the HELLO body, so the job, world size and both ranks are authenticated along
//! with the fresh nonces of both sides; the two proofs carry different labels and cannot be
//! replayed for each other or taken from the rendezvous store's handshake. The acceptor checks
//! job, world and its own rank before it challenges, and the proof before it welcomes; the
//! connector accepts the link only after checking the acceptor's proof. Proofs are compared in
//! constant time.

use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, ErrorKind, Result};
use crate::rendezvous::store_wire::{io_error, read_exact_by, write_by};

/// First four bytes of every handshake message.
const MAGIC: [u8; 4] = *b"OXTH";
/// Handshake version; a peer with another version is refused.
pub(crate) const VERSION: u8 = 1;
/// Bytes of a handshake message header.
const HEADER_LEN: usize = 8;
/// Largest handshake body either side accepts.
pub(crate) const MAX_BODY: usize = 1024;
/// Bytes of a nonce and of a proof.
const NONCE_LEN: usize = 32;
/// Longest job id, in bytes.
pub(crate) const MAX_JOB_BYTES: usize = 256;

const HELLO: u8 = 1;
const CHALLENGE: u8 = 2;
const PROOF: u8 = 3;
const WELCOME: u8 = 4;
const REJECT: u8 = 5;

/// What an unauthenticated peer is told when its HELLO does not match this side.
const UNMATCHED: &str = "not this job: the job id, world size or ranks of the HELLO do not match this rank's";

const CONNECTOR_LABEL: &[u8] = b"oxcomm-tcp-v1/connector";
const ACCEPTOR_LABEL: &[u8] = b"oxcomm-tcp-v1/acceptor";

/// Who this side is.
#[derive(Clone, Copy)]
pub(crate) struct Identity<'a> {
    pub(crate) token: &'a [u8],
    pub(crate) job: &'a str,
    pub(crate) world: usize,
    pub(crate) rank: usize,
}

/// What a HELLO says.
#[derive(Debug, PartialEq, Eq)]
struct Hello {
    nonce: [u8; NONCE_LEN],
    world: u32,
    from: u32,
    to: u32,
    job: Vec<u8>,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(NONCE_LEN + 14 + self.job.len());
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b.extend_from_slice(&(self.job.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.job);
        b
    }

    fn decode(b: &[u8]) -> Result<Hello> {
        let short = || Error::protocol(format!("handshake HELLO of {} bytes is malformed", b.len()));
        if b.len() < NONCE_LEN + 14 {
            return Err(short());
        }
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let job_len = usize::from(u16::from_le_bytes([b[NONCE_LEN + 12], b[NONCE_LEN + 13]]));
        if b.len() != NONCE_LEN + 14 + job_len {
            return Err(short());
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[..NONCE_LEN]);
        Ok(Hello {
            nonce,
            world: u32_at(NONCE_LEN),
            from: u32_at(NONCE_LEN + 4),
            to: u32_at(NONCE_LEN + 8),
            job: b[NONCE_LEN + 14..].to_vec(),
        })
    }
}

fn mac(token: &[u8], label: &[u8], first: &[u8], second: &[u8], hello: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!());
    m.update(label);
    m.update(first);
    m.update(second);
    m.update(hello);
    m
}

fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| Error::new(ErrorKind::Io, format!("the OS random source failed: {e}")))?;
    Ok(n)
}

/// Runs the connector's side: this rank (`me.rank`) proves itself to rank `peer` and checks
/// that `peer` knows the token too. Errors: [`ErrorKind::Rendezvous`] when refused or when the
/// peer's proof is wrong, [`ErrorKind::Protocol`] for bytes that are not this handshake,
/// [`ErrorKind::Timeout`] at `deadline`, [`ErrorKind::PeerGone`] if the peer hangs up.
pub(crate) fn connector(stream: &mut TcpStream, me: Identity<'_>, peer: usize, deadline: Instant) -> Result<()> {
    let hello = Hello {
        nonce: nonce()?,
        world: me.world as u32,
        from: me.rank as u32,
        to: peer as u32,
        job: me.job.as_bytes().to_vec(),
    };
    let hello_bytes = hello.encode();
    write_msg(stream, HELLO, &hello_bytes, deadline)?;
    let challenge = read_msg(stream, deadline)?;
    let theirs = match challenge {
        (CHALLENGE, body) if body.len() == NONCE_LEN => body,
        (REJECT, reason) => return Err(refused(&reason)),
        (code, body) => return Err(unexpected("CHALLENGE", code, body.len())),
    };
    let proof = mac(me.token, CONNECTOR_LABEL, &theirs, &hello.nonce, &hello_bytes).finalize().into_bytes();
    write_msg(stream, PROOF, &proof, deadline)?;
    match read_msg(stream, deadline)? {
        (WELCOME, body) => {
            if mac(me.token, ACCEPTOR_LABEL, &hello.nonce, &theirs, &hello_bytes).verify_slice(&body).is_err() {
                return Err(Error::new(
                    ErrorKind::Rendezvous,
                    "the peer could not prove that it knows the job's token (wrong OXCOMM_TOKEN, or not a rank \
                     of this job)",
                ));
            }
            Ok(())
        }
        (REJECT, reason) => Err(refused(&reason)),
        (code, body) => Err(unexpected("WELCOME", code, body.len())),
    }
}

/// Runs the acceptor's side; returns the connector's rank once it proved it knows the token
/// and names this job, world and rank. Refusals are sent to the peer (best effort) and
/// returned as errors of kind [`ErrorKind::Rendezvous`]; the caller decides whether the rank
/// is one it still expects.
pub(crate) fn acceptor(stream: &mut TcpStream, me: Identity<'_>, deadline: Instant) -> Result<usize> {
    let hello_bytes = match read_msg(stream, deadline)? {
        (HELLO, body) => body,
        (code, body) => return Err(unexpected("HELLO", code, body.len())),
    };
    let hello = Hello::decode(&hello_bytes)?;
    let refusal = if hello.job != me.job.as_bytes() {
        Some(format!(
            "job {:?} is not this job ({:?})",
            String::from_utf8_lossy(&hello.job[..hello.job.len().min(64)]),
            me.job
        ))
    } else if hello.world as usize != me.world {
        Some(format!("world size {} is not this job's {}", hello.world, me.world))
    } else if hello.to as usize != me.rank {
        Some(format!("it asked for rank {} but this is rank {}", hello.to, me.rank))
    } else if hello.from as usize >= me.world || hello.from as usize == me.rank {
        Some(format!("its rank {} is not another rank below {}", hello.from, me.world))
    } else {
        None
    };
    if let Some(reason) = refusal {
        // The peer has proved nothing yet: it learns that it was refused, not this side's job
        // id, world size or rank (those stay in this side's error and log).
        let _ = write_msg(stream, REJECT, UNMATCHED.as_bytes(), deadline);
        return Err(Error::new(ErrorKind::Rendezvous, format!("refused a connection: {reason}")));
    }
    let ours = nonce()?;
    write_msg(stream, CHALLENGE, &ours, deadline)?;
    let proof = match read_msg(stream, deadline)? {
        (PROOF, body) => body,
        (code, body) => return Err(unexpected("PROOF", code, body.len())),
    };
    if mac(me.token, CONNECTOR_LABEL, &ours, &hello.nonce, &hello_bytes).verify_slice(&proof).is_err() {
        let reason = "authentication failed (wrong token)";
        let _ = write_msg(stream, REJECT, reason.as_bytes(), deadline);
        return Err(Error::new(
            ErrorKind::Rendezvous,
            format!("refused a connection claiming rank {}: {reason}", hello.from),
        ));
    }
    let welcome = mac(me.token, ACCEPTOR_LABEL, &hello.nonce, &ours, &hello_bytes).finalize().into_bytes();
    write_msg(stream, WELCOME, &welcome, deadline)?;
    Ok(hello.from as usize)
}

fn refused(reason: &[u8]) -> Error {
    let reason = String::from_utf8_lossy(&reason[..reason.len().min(256)]).into_owned();
    Error::new(ErrorKind::Rendezvous, format!("the peer refused the handshake: {reason}"))
}

fn unexpected(wanted: &str, code: u8, len: usize) -> Error {
    Error::protocol(format!("expected a handshake {wanted}, got message code {code} with {len} bytes"))
}

fn write_msg(stream: &mut TcpStream, code: u8, body: &[u8], deadline: Instant) -> Result<()> {
    debug_assert!(body.len() <= MAX_BODY);
    let mut msg = Vec::with_capacity(HEADER_LEN + body.len());
    msg.extend_from_slice(&MAGIC);
    msg.push(VERSION);
    msg.push(code);
    msg.extend_from_slice(&(body.len() as u16).to_le_bytes());
    msg.extend_from_slice(body);
    write_by(stream, &msg, deadline)
}

fn read_msg(stream: &mut TcpStream, deadline: Instant) -> Result<(u8, Vec<u8>)> {
    read_msg_with(&mut |buf: &mut [u8]| {
        read_exact_by(stream, buf, Some(deadline)).map_err(|e| io_error("reading a handshake message", e))
    })
}

/// Reads one handshake message through `read` (which fills its whole buffer or fails),
/// checking magic, version and the body bound before the body is allocated.
pub(crate) fn read_msg_with(read: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<(u8, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    read(&mut header)?;
    if header[..4] != MAGIC {
        return Err(Error::protocol(format!(
            "bad handshake magic {:02x?} (expected {:02x?}): not an oxcomm TCP peer",
            &header[..4],
            MAGIC
        )));
    }
    if header[4] != VERSION {
        return Err(Error::protocol(format!("handshake version {} (this side speaks {VERSION})", header[4])));
    }
    let len = usize::from(u16::from_le_bytes([header[6], header[7]]));
    if len > MAX_BODY {
        return Err(Error::protocol(format!("handshake message of {len} bytes (limit {MAX_BODY})")));
    }
    let mut body = vec![0u8; len];
    read(&mut body)?;
    Ok((header[5], body))
}

/// Decodes a HELLO body (for the fuzz targets): whether it is well formed.
pub(crate) fn decode_hello(b: &[u8]) -> Result<()> {
    Hello::decode(b).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        (c, a)
    }

    fn id<'a>(token: &'a [u8], rank: usize) -> Identity<'a> {
        Identity { token, job: "job", world: 4, rank }
    }

    #[test]
    fn hello_round_trips() {
        let h = Hello { nonce: [7; 32], world: 4, from: 1, to: 3, job: b"abc".to_vec() };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&h.encode()[..40]).is_err());
    }

    #[test]
    fn both_sides_agree_with_the_same_token() {
        let (mut c, mut a) = pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = std::thread::spawn(move || acceptor(&mut a, id(b"k", 3), deadline));
        connector(&mut c, id(b"k", 1), 3, deadline).unwrap();
        assert_eq!(t.join().unwrap().unwrap(), 1);
    }

    #[test]
    fn wrong_token_is_refused_on_both_sides() {
        let (mut c, mut a) = pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = std::thread::spawn(move || acceptor(&mut a, id(b"k", 3), deadline));
        let err = connector(&mut c, id(b"x", 1), 3, deadline).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Rendezvous, "{err}");
        assert!(err.message().contains("wrong token"), "{err}");
        let err = t.join().unwrap().unwrap_err();
        assert!(err.message().contains("wrong token"), "{err}");
    }

    #[test]
    fn wrong_rank_or_job_is_refused_before_the_challenge() {
        let (mut c, mut a) = pair();
        let deadline = Instant::now() + Duration::from_secs(10);
        let t = std::thread::spawn(move || acceptor(&mut a, id(b"k", 2), deadline));
        let err = connector(&mut c, id(b"k", 1), 3, deadline).unwrap_err();
        assert!(err.message().contains("not this job"), "{err}");
        assert!(!err.message().contains("rank 2"), "the refusal leaks the acceptor's rank: {err}");
        let err = t.join().unwrap().unwrap_err();
        assert!(err.message().contains("asked for rank 3"), "{err}");

        let (mut c, mut a) = pair();
        let t = std::thread::spawn(move || acceptor(&mut a, id(b"k", 3), deadline));
        let other = Identity { job: "other", ..id(b"k", 1) };
        let err = connector(&mut c, other, 3, deadline).unwrap_err();
        assert!(err.message().contains("not this job"), "{err}");
        t.join().unwrap().unwrap_err();
    }

    #[test]
    fn garbage_is_a_protocol_error_and_silence_times_out() {
        let (mut c, mut a) = pair();
        c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let err = acceptor(&mut a, id(b"k", 3), Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol);
        let (_c, mut a) = pair();
        let err = acceptor(&mut a, id(b"k", 3), Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    }
}
