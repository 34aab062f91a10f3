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
//! | 5      | tag     | the frame's kind: [`TAG_DATA`], `TAG_ABORT`, [`TAG_MARK`], [`TAG_CTRL`], [`TAG_BEAT`] (others are rejected) |
//! | 6..8   | flags   | 0 (reserved)                                                   |
//! | 8..16  | seq     | frame sequence number of this direction, from 0, +1 per frame  |
//! | 16..20 | len     | payload bytes that follow, 1 ..= [`MAX_FRAME_BYTES`] (a mark: the epoch; an abort: the cause) |
//! | 20..24 | check   | `!(w0 ^ w1 ^ w2 ^ w3 ^ w4)` over the five u32 words before it   |
//!
//! The payload is an arbitrary piece of the link's byte stream: frames do not mark message
//! boundaries (the layers above frame their own messages) and a frame's payload may be
//! written by several `try_send` calls. The tag is the frame's kind, not a point-to-point
//! tag: those travel in the communicator's own message headers.
//!
//! The frames of fault tolerance (`backend/native_ft.rs`) travel between data frames: a *mark*
//! (no payload; `len` is an epoch: every data frame before it belongs to the epochs before,
//! see `Link::end_epoch`), a *control* frame (a whole control message of 1 ..=
//! `MAX_CTRL_BYTES` bytes, `Link::send_ctrl`) and a *heartbeat* (8 bytes: the op word of
//! the op the sender waits in, `Link::beat`).

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
/// Frame kind: the sender's byte stream of the epochs before `len` ends here (no payload).
pub const TAG_MARK: u8 = 3;
/// Frame kind: one control message (the payload, 1 ..= `MAX_CTRL_BYTES` bytes).
pub const TAG_CTRL: u8 = 4;
/// Frame kind: a heartbeat; the payload is the 8-byte op word of the sender's op.
pub const TAG_BEAT: u8 = 5;
/// Payload bytes of a heartbeat frame.
pub(crate) const BEAT_BYTES: usize = 8;
/// Largest payload a frame may announce (16 MiB). Checked when the header arrives; nothing is
/// allocated from a header in any case (payload is read straight into the caller's buffer).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// A decoded, checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Sequence number of the frame in its direction.
    pub(crate) seq: u64,
    /// Payload bytes that follow (for an abort frame: the encoded cause; for a mark: the
    /// epoch).
    pub(crate) len: u32,
    /// Whether this is an abort frame.
    pub(crate) abort: bool,
    /// The frame's kind (`TAG_*`).
    pub(crate) tag: u8,
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
    if !matches!(b[5], TAG_DATA | TAG_ABORT | TAG_MARK | TAG_CTRL | TAG_BEAT) {
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
    let tag = b[5];
    match tag {
        TAG_ABORT => return Ok(FrameHeader { seq, len, abort: true, tag }),
        TAG_MARK => return Ok(FrameHeader { seq, len, abort: false, tag }),
        TAG_CTRL if len == 0 || len as usize > crate::transport::MAX_CTRL_BYTES => {
            return Err(Error::protocol(format!(
                "control frame {seq} announces {len} bytes (allowed: 1 to {})",
                crate::transport::MAX_CTRL_BYTES
            )))
        }
        TAG_BEAT if len as usize != BEAT_BYTES => {
            return Err(Error::protocol(format!("heartbeat frame {seq} announces {len} bytes (must be {BEAT_BYTES})")))
        }
        TAG_CTRL | TAG_BEAT => return Ok(FrameHeader { seq, len, abort: false, tag }),
        _ => {}
    }
    if len == 0 || len as usize > MAX_FRAME_BYTES {
        return Err(Error::protocol(format!(
            "frame {seq} announces {len} payload bytes (allowed: 1 to {MAX_FRAME_BYTES})"
        )));
    }
    Ok(FrameHeader { seq, len, abort: false, tag })
}

/// Decodes the word of an abort frame (`culprit << 3 | code`) sent over a link of a world of
/// `world` ranks: the culprit must be a rank of the world and the code one that
/// `transport::cause_code` writes.
pub(crate) fn decode_abort(word: u32, world: usize) -> Result<(usize, crate::error::ErrorKind)> {
    let (culprit, code) = ((word >> 3) as usize, word & 7);
    let max = crate::transport::MAX_CAUSE_CODE;
    if culprit >= world || code > max {
        return Err(Error::protocol(format!(
            "abort frame names rank {culprit} with cause code {code} (world of {world}, codes 0 to {max})"
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
        assert_eq!(decode(&h, 7).unwrap(), FrameHeader { seq: 7, len: 4096, abort: false, tag: TAG_DATA });
        let a = encode_raw(TAG_ABORT, 8, 3 << 3 | 1);
        assert_eq!(decode(&a, 8).unwrap(), FrameHeader { seq: 8, len: 25, abort: true, tag: TAG_ABORT });
        let m = encode_raw(TAG_MARK, 9, 0);
        assert_eq!(decode(&m, 9).unwrap(), FrameHeader { seq: 9, len: 0, abort: false, tag: TAG_MARK });
        assert!(decode(&encode_raw(TAG_CTRL, 0, 0), 0).is_err());
        assert!(decode(&encode_raw(TAG_CTRL, 0, 1 << 20), 0).is_err());
        assert!(decode(&encode_raw(TAG_BEAT, 0, 7), 0).is_err());
        assert_eq!(decode(&encode_raw(TAG_BEAT, 0, 8), 0).unwrap().tag, TAG_BEAT);
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
