//! The data-frame header of a TCP link: 24 bytes in front of every segment of payload.
//!
//! This file owns the header's layout, its encoding and its checks. It does no I/O and knows
//! nothing about sockets; [`super::link`] decides when a header is written or expected.
//!
//! # Layout (little-endian)
//!
//! | bytes  | field   | value                                                          |
//! | ------ | ------- | -------------------------------------------------------------- |
//! | 0..4   | magic   | `OXTF`                                                         |
//! | 4      | version | [`FRAME_VERSION`]                                              |
//! | 5      | tag     | the frame's kind: [`TAG_DATA`] (others are reserved, rejected) |
//! | 6..8   | flags   | 0 (reserved)                                                   |
//! | 8..16  | seq     | frame sequence number of this direction, from 0, +1 per frame  |
//! | 16..20 | len     | payload bytes that follow, 1 ..= [`MAX_FRAME_BYTES`]           |
//! | 20..24 | check   | `!(w0 ^ w1 ^ w2 ^ w3 ^ w4)` over the five u32 words before it   |
//!
//! The payload is an arbitrary piece of the link's byte stream: frames do not mark message
//! boundaries (the layers above frame their own messages) and a frame's payload may be
//! written by several `try_send` calls. The tag is the frame's kind, not a point-to-point
//! tag: those travel in the communicator's own message headers.

use crate::error::{Error, Result};

/// Bytes in a frame header.
pub const HEADER_BYTES: usize = 24;
/// First four bytes of every frame header.
pub const FRAME_MAGIC: [u8; 4] = *b"OXTF";
/// Version of the frame layout; a header of another version is a protocol error.
pub const FRAME_VERSION: u8 = 1;
/// Tag of a frame carrying link payload.
pub const TAG_DATA: u8 = 1;
/// Frame kind: the sender aborted; the length field carries the culprit rank and the kind of
/// failure (`rank << 3 | code`, see `transport::cause_code`), and no payload follows.
pub const TAG_ABORT: u8 = 2;
/// Largest payload a frame may announce (16 MiB). Checked when the header arrives; nothing is
/// allocated from a header in any case (payload is read straight into the caller's buffer).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// A decoded, checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Sequence number of the frame in its direction.
    pub(crate) seq: u64,
    /// Payload bytes that follow (for an abort frame: the encoded cause).
    pub(crate) len: u32,
    /// Whether this is an abort frame.
    pub(crate) abort: bool,
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn check_word(b: &[u8; HEADER_BYTES]) -> u32 {
    !(word(b, 0) ^ word(b, 4) ^ word(b, 8) ^ word(b, 12) ^ word(b, 16))
}

/// Encodes the header of data frame `seq` with `len` payload bytes (`1..=MAX_FRAME_BYTES`,
/// which the caller guarantees).
pub(crate) fn encode(seq: u64, len: u32) -> [u8; HEADER_BYTES] {
    debug_assert!(len >= 1 && len as usize <= MAX_FRAME_BYTES);
    let mut b = [0u8; HEADER_BYTES];
    b[0..4].copy_from_slice(&FRAME_MAGIC);
    b[4] = FRAME_VERSION;
    b[5] = TAG_DATA;
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b[16..20].copy_from_slice(&len.to_le_bytes());
    let check = check_word(&b);
    b[20..24].copy_from_slice(&check.to_le_bytes());
    b
}

/// Decodes a header and checks every field against what this side expects: magic, version,
/// tag, flags, check word, the sequence number `expected_seq` and the length bound.
pub(crate) fn decode(b: &[u8; HEADER_BYTES], expected_seq: u64) -> Result<FrameHeader> {
    if b[0..4] != FRAME_MAGIC {
        return Err(Error::protocol(format!(
            "bad frame magic {:02x?} (expected {:02x?}): the stream is corrupt or not an oxcomm peer",
            &b[0..4],
            FRAME_MAGIC
        )));
    }
    if b[4] != FRAME_VERSION {
        return Err(Error::protocol(format!("frame version {} (this side speaks {FRAME_VERSION})", b[4])));
    }
    if word(b, 20) != check_word(b) {
        return Err(Error::protocol("frame header check word does not match: the stream is corrupt"));
    }
    if b[5] != TAG_DATA && b[5] != TAG_ABORT {
        return Err(Error::protocol(format!("unknown frame tag {}", b[5])));
    }
    if b[6] != 0 || b[7] != 0 {
        return Err(Error::protocol(format!(
            "frame flags {:#06x} set (reserved, must be 0)",
            u16::from_le_bytes([b[6], b[7]])
        )));
    }
    let seq = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
    if seq != expected_seq {
        return Err(Error::protocol(format!("frame sequence number {seq}, expected {expected_seq}")));
    }
    let len = word(b, 16);
    if b[5] == TAG_ABORT {
        return Ok(FrameHeader { seq, len, abort: true });
    }
    if len == 0 || len as usize > MAX_FRAME_BYTES {
        return Err(Error::protocol(format!(
            "frame {seq} announces {len} payload bytes (allowed: 1 to {MAX_FRAME_BYTES})"
        )));
    }
    Ok(FrameHeader { seq, len, abort: false })
}

/// Decodes the word of an abort frame (`culprit << 3 | code`) sent over a link of a world of
/// `world` ranks: the culprit must be a rank of the world and the code one that
/// `transport::cause_code` writes.
pub(crate) fn decode_abort(word: u32, world: usize) -> Result<(usize, crate::error::ErrorKind)> {
    let (culprit, code) = ((word >> 3) as usize, word & 7);
    if culprit >= world || code > 4 {
        return Err(Error::protocol(format!(
            "abort frame names rank {culprit} with cause code {code} (world of {world}, codes 0 to 4)"
        )));
    }
    Ok((culprit, crate::transport::cause_kind(code)))
}

/// Encodes a header with arbitrary fields (and a correct check word), for tests that need a
/// peer breaking the protocol.
#[doc(hidden)]
pub fn encode_raw(tag: u8, seq: u64, len: u32) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..4].copy_from_slice(&FRAME_MAGIC);
    b[4] = FRAME_VERSION;
    b[5] = tag;
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b[16..20].copy_from_slice(&len.to_le_bytes());
    let check = check_word(&b);
    b[20..24].copy_from_slice(&check.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn round_trips() {
        let h = encode(7, 4096);
        assert_eq!(decode(&h, 7).unwrap(), FrameHeader { seq: 7, len: 4096, abort: false });
        let a = encode_raw(TAG_ABORT, 8, 3 << 3 | 1);
        assert_eq!(decode(&a, 8).unwrap(), FrameHeader { seq: 8, len: 25, abort: true });
        assert_eq!(&h[0..4], b"OXTF");
    }

    #[test]
    fn rejects_every_bad_field() {
        let good = encode(3, 10);
        let bad = |mutate: &dyn Fn(&mut [u8; HEADER_BYTES]), expect: &str| {
            let mut h = good;
            mutate(&mut h);
            let err = decode(&h, 3).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Protocol);
            assert!(err.message().contains(expect), "{err} should mention {expect:?}");
        };
        bad(&|h| h[0] = b'X', "magic");
        bad(&|h| h[4] = 9, "version 9");
        bad(&|h| h[12] ^= 1, "check word");
        assert!(decode(&good, 4).unwrap_err().message().contains("expected 4"));
        let too_long = encode_raw(TAG_DATA, 3, MAX_FRAME_BYTES as u32 + 1);
        assert!(decode(&too_long, 3).unwrap_err().message().contains("announces"));
        let empty = encode_raw(TAG_DATA, 3, 0);
        assert!(decode(&empty, 3).is_err());
        let tag = encode_raw(9, 3, 1);
        assert!(decode(&tag, 3).unwrap_err().message().contains("tag 9"));
    }
}
