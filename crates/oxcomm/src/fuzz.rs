//! Fuzz entry points: every decoder of a peer's bytes, callable on an arbitrary byte slice.
//! Hidden from the docs and not a stable API: it exists so that `tests/it/fuzz.rs` (and any
//! external fuzzer) can drive the real decoders without a socket.
//!
//! Each target takes any bytes, returns whether they decoded, and must never panic, allocate
//! more than [`ALLOC_BOUND`] at once, or take time beyond linear in the input. Socket reads
//! are replaced by a reader over the slice that fails when the bytes run out (as a peer that
//! hangs up would). [`seeds`] gives well-formed messages of each target, made with the
//! crate's own encoders, which the mutation fuzzer starts from (beside the corpus files in
//! `tests/fuzz_corpus/`).

use crate::algorithms::star;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::rendezvous::{store, store_wire};
use crate::transport::tcp;
use crate::wire::{Fingerprint, OpKind};

/// The largest single allocation any target may make for one input: the store's 64 KiB read
/// chunk plus slack (every other decoder allocates at most 1 KiB or a multiple of the group
/// size it was given).
pub const ALLOC_BOUND: usize = 80 << 10;

/// Key and value limits the store target runs with (the server's defaults are larger; the
/// decoder reads values in 64 KiB chunks either way).
const STORE_KEY: usize = 1024;
const STORE_VALUE: usize = 1 << 20;

/// A fuzz target: any bytes in, whether they decoded out.
pub type Target = fn(&[u8]) -> bool;

/// The fuzz targets by name: (name, decoder).
pub const TARGETS: [(&str, Target); 6] = [
    ("fingerprint", fingerprint),
    ("verdict", verdict),
    ("tcp_frame", tcp_frame),
    ("tcp_handshake", tcp_handshake),
    ("store_frame", store_frame),
    ("object_length", object_length),
];

/// A reader over `bytes` that fills whole buffers or fails like a peer that hung up.
fn reader<'a>(bytes: &'a [u8]) -> impl FnMut(&mut [u8]) -> Result<()> + 'a {
    let mut at = 0;
    move |buf: &mut [u8]| {
        let end = at + buf.len();
        if end > bytes.len() {
            return Err(Error::protocol("input ended"));
        }
        buf.copy_from_slice(&bytes[at..end]);
        at = end;
        Ok(())
    }
}

/// An op header (48 bytes) as rank 0 and the p2p path decode it.
pub fn fingerprint(b: &[u8]) -> bool {
    Fingerprint::decode(b).is_ok()
}

/// A verdict as a non-root rank decodes it: byte 0 picks the group size (2 to 65), byte 1
/// this rank, then the 64-byte verdict and, for "missing", the list of ranks.
pub fn verdict(b: &[u8]) -> bool {
    if b.len() < 2 {
        return false;
    }
    let n = 2 + usize::from(b[0] % 64);
    let me = 1 + usize::from(b[1]) % (n - 1);
    let rest = &b[2..];
    let (head, tail) = rest.split_at(rest.len().min(star::VERDICT_BYTES));
    match star::decode_verdict(head, n, me) {
        Ok(star::Verdict::Missing { count, .. }) => {
            // The receiver allocates 8 × count for the list: bounded by the group size.
            assert!(count < n, "a verdict count above the group size passed the decoder");
            tail.get(..8 * count).is_some_and(|t| star::decode_missing(t, n, me).is_ok())
        }
        Ok(_) => true,
        Err(_) => false,
    }
}

/// A TCP data-frame header (24 bytes, expecting sequence number 0), and an abort frame's
/// culprit word in a world of 16.
pub fn tcp_frame(b: &[u8]) -> bool {
    let Some(h) = b.get(..tcp::HEADER_BYTES) else { return false };
    let h: &[u8; tcp::HEADER_BYTES] = h.try_into().unwrap_or_else(|_| unreachable!());
    match tcp::decode_frame_header(h, 0) {
        Ok(f) if f.abort => tcp::decode_abort(f.len, 16).is_ok(),
        Ok(_) => true,
        Err(_) => false,
    }
}

/// A sequence of TCP handshake messages (header, body), each HELLO body decoded.
pub fn tcp_handshake(b: &[u8]) -> bool {
    let mut read = reader(b);
    let mut ok = false;
    for _ in 0..4 {
        match tcp::read_msg_with(&mut read) {
            Ok((1, body)) => ok = tcp::decode_hello(&body).is_ok(),
            Ok(_) => ok = true,
            Err(_) => return ok,
        }
    }
    ok
}

/// A store frame: a request as the server reads it (header, shape, fields, field checks), or
/// an answer as a client reads it.
pub fn store_frame(b: &[u8]) -> bool {
    let Some(h) = b.get(..store_wire::HEADER_LEN) else { return false };
    let Ok(header) = store_wire::decode_header(h.try_into().unwrap_or_else(|_| unreachable!())) else {
        return false;
    };
    let mut read = reader(&b[store_wire::HEADER_LEN..]);
    if let Ok(limit) = store::request_shape(header, STORE_KEY, STORE_VALUE) {
        return match store_wire::read_fields_with(&mut read, header.count, &limit) {
            Ok(fields) => store::check_request_fields(header.code, &fields).is_ok(),
            Err(_) => false,
        };
    }
    // Not a request: an answer, as a client reads it.
    let Ok(limit) = store::answer_shape(header) else { return false };
    match store_wire::read_fields_with(&mut read, header.count, &limit) {
        Ok(fields) => {
            let _ = store::answer(header.code, fields);
            true
        }
        Err(_) => false,
    }
}

/// Lengths announced by the ranks of an object collective (8 bytes each, up to 64).
pub fn object_length(b: &[u8]) -> bool {
    b.chunks_exact(8).take(64).enumerate().all(|(from, c)| {
        let len = i64::from_le_bytes(c.try_into().unwrap_or_else(|_| unreachable!()));
        crate::object::check_length(len, from).is_ok()
    })
}

/// Well-formed inputs of target `name` (empty for an unknown name).
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    let fp = Fingerprint {
        kind: OpKind::AllReduce,
        dtype: Some(DType::F32),
        op: Some(ReduceOp::Sum),
        root: None,
        count: 1 << 20,
        seq: 17,
        group: 0,
        extra: 0,
    };
    let rooted = Fingerprint { kind: OpKind::Broadcast, op: None, root: Some(2), ..fp };
    let with_group = |n: u8, me: u8, v: &[u8], tail: &[u8]| [&[n - 2, me - 1][..], v, tail].concat();
    match name {
        "fingerprint" => vec![fp.encode().to_vec(), rooted.encode().to_vec()],
        "verdict" => vec![
            with_group(2, 1, &star::verdict(star::OK, 0, &fp), &[]),
            with_group(6, 2, &star::verdict(star::MISMATCH, 3, &rooted), &[]),
            with_group(
                6,
                2,
                &star::verdict(star::MISSING, 2, &fp),
                &[&1u64.to_le_bytes()[..], &5u64.to_le_bytes()].concat(),
            ),
        ],
        "tcp_frame" => {
            let abort = (3u32 << 3) | 2;
            vec![
                tcp::encode_frame_header(tcp::TAG_DATA, 0, 4096).to_vec(),
                tcp::encode_frame_header(2, 0, abort).to_vec(),
            ]
        }
        "tcp_handshake" => {
            let msg = |code: u8, body: &[u8]| {
                let mut m = b"OXTH\x01".to_vec();
                m.push(code);
                m.extend_from_slice(&(body.len() as u16).to_le_bytes());
                m.extend_from_slice(body);
                m
            };
            let mut hello = vec![7u8; 32];
            for w in [4u32, 1, 3] {
                hello.extend_from_slice(&w.to_le_bytes());
            }
            hello.extend_from_slice(&3u16.to_le_bytes());
            hello.extend_from_slice(b"job");
            vec![msg(1, &hello), [msg(2, &[9; 32]), msg(4, &[5; 32])].concat(), msg(5, b"not this job")]
        }
        "store_frame" => vec![
            store_wire::encode(store_wire::SET, &[b"key", b"value"]),
            store_wire::encode(store_wire::GET, &[b"rank/3", &1000u64.to_le_bytes()]),
            store_wire::encode(store_wire::WAIT, &[&50u64.to_le_bytes(), b"a", b"b"]),
            store_wire::encode(store_wire::COMPARE_SET, &[b"k", b"new", b"old"]),
            store_wire::encode(store_wire::ADD, &[b"counter", &(-3i64).to_le_bytes()]),
            store_wire::encode(store_wire::OK, &[b"value"]),
            store_wire::encode(store_wire::ERROR, &[&[2], b"timed out"]),
        ],
        "object_length" => vec![[12i64, -1, 0, 4096].iter().flat_map(|l| l.to_le_bytes()).collect()],
        _ => Vec::new(),
    }
}
