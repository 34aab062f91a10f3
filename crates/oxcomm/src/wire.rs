//! Op fingerprints and their wire form.
//!
//! Every collective is described by a [`Fingerprint`] (op kind, dtype, reduce op, count, root,
//! group, sequence number, an extra word) that ranks compare before any payload is written into
//! a user buffer. Its 48-byte wire form starts with a magic number so a stream that has lost
//! its framing is detected instead of misread.

use std::fmt;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;

/// Magic number that opens every fingerprint on the wire ("OXC1").
pub(crate) const MAGIC: u32 = 0x4f58_4331;

/// Size of an encoded [`Fingerprint`].
pub(crate) const FP_BYTES: usize = 48;
/// The wire form in 64-bit words ([`Fingerprint::words`]).
pub(crate) const FP_WORDS: usize = FP_BYTES / 8;

/// The kind of an op, as it appears in fingerprints, errors and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `reduce`.
    Reduce = 2,
    /// `broadcast`.
    Broadcast = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `reduce_scatter`.
    ReduceScatter = 5,
    /// `all_to_all`.
    AllToAll = 6,
    /// `all_to_all_v`.
    AllToAllV = 7,
    /// `gather`.
    Gather = 8,
    /// `scatter`.
    Scatter = 9,
    /// A point-to-point message (`send`/`recv`).
    P2p = 10,
    /// `barrier`.
    Barrier = 11,
    /// `monitored_barrier`.
    MonitoredBarrier = 12,
    /// `new_group` / `split` (the collective part of creating a group).
    NewGroup = 13,
    /// `all_reduce_coalesced`.
    AllReduceCoalesced = 14,
    /// `all_gather_coalesced`.
    AllGatherCoalesced = 15,
    /// `agree` (the fault-tolerant consensus of [`crate::Communicator::agree`]).
    Agree = 16,
    /// `shrink` ([`crate::Communicator::shrink`]).
    Shrink = 17,
}

impl OpKind {
    const ALL: [OpKind; 17] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::AllToAllV,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::P2p,
        OpKind::Barrier,
        OpKind::MonitoredBarrier,
        OpKind::NewGroup,
        OpKind::AllReduceCoalesced,
        OpKind::AllGatherCoalesced,
        OpKind::Agree,
        OpKind::Shrink,
    ];

    /// The op's name as in torch.distributed (`all_reduce`, `send`, ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllV => "all_to_all_v",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::P2p => "send/recv",
            OpKind::Barrier => "barrier",
            OpKind::MonitoredBarrier => "monitored_barrier",
            OpKind::NewGroup => "new_group",
            OpKind::AllReduceCoalesced => "all_reduce_coalesced",
            OpKind::AllGatherCoalesced => "all_gather_coalesced",
            OpKind::Agree => "agree",
            OpKind::Shrink => "shrink",
        }
    }

    fn from_tag(tag: u8) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| *k as u8 == tag)
    }
}

/// The sequence-number bits of an op word ([`Fingerprint::op_word`]).
const OP_WORD_SEQ: u64 = (1 << 56) - 1;

/// An op word ([`Fingerprint::op_word`]) as text, `all_reduce #17`, or `None` for 0 (no op
/// yet) or a word naming no op.
pub(crate) fn describe_op_word(word: u64) -> Option<String> {
    let kind = OpKind::from_tag((word >> 56) as u8)?;
    Some(format!("{} #{}", kind.name(), word & OP_WORD_SEQ))
}

/// What a rank is about to do; ranks compare fingerprints before touching buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// The op.
    pub kind: OpKind,
    /// Element type, if the op moves data.
    pub dtype: Option<DType>,
    /// Reduce op, if the op reduces.
    pub op: Option<ReduceOp>,
    /// Root (group rank), if the op has one.
    pub root: Option<u32>,
    /// Element count (per the op's convention: the input of one rank).
    pub count: u64,
    /// Sequence number of the op in its group.
    pub seq: u64,
    /// Group id (0 for the world).
    pub group: u64,
    /// Op-specific word (tag for point-to-point, buffer count for coalesced ops).
    pub extra: u64,
}

impl Fingerprint {
    /// A fingerprint with only kind, seq and group set.
    pub fn new(kind: OpKind, seq: u64, group: u64) -> Fingerprint {
        Fingerprint { kind, dtype: None, op: None, root: None, count: 0, seq, group, extra: 0 }
    }

    /// The op word a rank publishes beside its heartbeat: the kind in the top byte, the
    /// sequence number in the 56 bits below ([`describe_op_word`] reads it back).
    pub(crate) fn op_word(&self) -> u64 {
        (self.kind as u64) << 56 | (self.seq & OP_WORD_SEQ)
    }

    /// Encodes to the 48-byte wire form.
    pub(crate) fn encode(&self) -> [u8; FP_BYTES] {
        let mut b = [0u8; FP_BYTES];
        for (chunk, w) in b.chunks_exact_mut(8).zip(self.words()) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// The wire form as its six little-endian words, built in registers: bytes 0–3 the magic,
    /// 4 the kind, 5 the dtype (0xff: none), 6 the reduce op (0xff: none), 7 whether there is a
    /// root, 8–11 the root, 12–15 zero, then count, seq, group and extra. The direct path
    /// hashes and stores these words without going through bytes (a byte-wise encode read
    /// back as words stalls on store forwarding).
    pub(crate) fn words(&self) -> [u64; FP_WORDS] {
        let tag = |t: Option<u8>| u64::from(t.unwrap_or(0xff));
        let head = u64::from(MAGIC)
            | (self.kind as u64) << 32
            | tag(self.dtype.map(|d| d as u8)) << 40
            | tag(self.op.map(|o| o as u8)) << 48
            | u64::from(self.root.is_some()) << 56;
        [head, u64::from(self.root.unwrap_or(0)), self.count, self.seq, self.group, self.extra]
    }

    /// Decodes the wire form; a wrong length, bad magic, unknown tag or a reserved byte that
    /// is not zero is a protocol error (without a peer: see [`Fingerprint::decode_from`]).
    pub(crate) fn decode(b: &[u8]) -> Result<Fingerprint> {
        if b.len() != FP_BYTES || b[0..4] != MAGIC.to_le_bytes() {
            return Err(Error::protocol(format!(
                "bad op header of {} bytes (the byte stream lost its framing, or the peer is not oxcomm)",
                b.len()
            )));
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let kind = OpKind::from_tag(b[4]).ok_or_else(|| Error::protocol(format!("unknown op kind {}", b[4])))?;
        let dtype = match b[5] {
            0xff => None,
            t => Some(DType::from_tag(t).ok_or_else(|| Error::protocol(format!("unknown dtype {t}")))?),
        };
        let op = match b[6] {
            0xff => None,
            t => Some(ReduceOp::from_tag(t).ok_or_else(|| Error::protocol(format!("unknown reduce op {t}")))?),
        };
        let root_word = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let root = match b[7] {
            0 if root_word == 0 => None,
            1 => Some(root_word),
            flag => return Err(Error::protocol(format!("bad root field ({flag}, {root_word}) in an op header"))),
        };
        if b[12..16] != [0; 4] {
            return Err(Error::protocol("reserved bytes of an op header are not zero"));
        }
        Ok(Fingerprint { kind, dtype, op, root, count: word(16), seq: word(24), group: word(32), extra: word(40) })
    }

    /// [`Fingerprint::decode`] of bytes that world rank `from` sent: an error names it (in the
    /// message and as the error's peer).
    pub(crate) fn decode_from(b: &[u8], from: usize) -> Result<Fingerprint> {
        Fingerprint::decode(b)
            .map_err(|e| Error::protocol(format!("from rank {from}: {}", e.message())).with_peer(from))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.kind.name(), self.seq)?;
        let mut parts = Vec::new();
        if let Some(d) = self.dtype {
            parts.push(format!("{d} × {}", self.count));
        }
        if let Some(op) = self.op {
            parts.push(op.name().to_string());
        }
        if let Some(root) = self.root {
            parts.push(format!("root {root}"));
        }
        if self.kind == OpKind::P2p {
            parts.push(format!("tag {}", self.extra));
        } else if self.kind == OpKind::NewGroup {
            // `extra` is a hash of the rank list (two ranks listing different ranks differ).
            parts.push(format!("{} ranks", self.count));
            if self.extra != 0 {
                parts.push(format!("rank list {:x}", self.extra));
            }
        } else if self.extra != 0 {
            parts.push(format!("{} buffers", self.extra));
        }
        if self.group != 0 {
            parts.push(format!("group {:x}", self.group));
        }
        if !parts.is_empty() {
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_display() {
        let fp = Fingerprint {
            kind: OpKind::AllReduce,
            dtype: Some(DType::F32),
            op: Some(ReduceOp::Sum),
            root: None,
            count: 1_048_576,
            seq: 17,
            group: 0,
            extra: 0,
        };
        assert_eq!(Fingerprint::decode(&fp.encode()).unwrap(), fp);
        assert_eq!(fp.to_string(), "all_reduce #17 (f32 × 1048576, sum)");
        let group = Fingerprint { kind: OpKind::NewGroup, dtype: None, op: None, count: 2, extra: 0xab, ..fp };
        assert_eq!(group.to_string(), "new_group #17 (2 ranks, rank list ab)");
        let mut bad = fp.encode();
        bad[0] ^= 1;
        assert!(Fingerprint::decode(&bad).is_err());
    }

    /// The wire bytes, spelled out: peers of other builds read them.
    #[test]
    fn the_wire_form_is_the_documented_bytes() {
        let fp = Fingerprint {
            kind: OpKind::Broadcast,
            dtype: Some(DType::BF16),
            op: None,
            root: Some(0x0102_0304),
            count: 0x1112_1314_1516_1718,
            seq: 7,
            group: 0x2122_2324_2526_2728,
            extra: u64::MAX,
        };
        let b = fp.encode();
        assert_eq!(b[0..4], MAGIC.to_le_bytes());
        assert_eq!(b[4..8], [OpKind::Broadcast as u8, DType::BF16 as u8, 0xff, 1]);
        assert_eq!(b[8..16], [4, 3, 2, 1, 0, 0, 0, 0]);
        assert_eq!(b[16..24], fp.count.to_le_bytes());
        assert_eq!(b[24..32], 7u64.to_le_bytes());
        assert_eq!(b[32..40], fp.group.to_le_bytes());
        assert_eq!(b[40..48], [0xff; 8]);
        assert_eq!(Fingerprint::decode(&b).unwrap(), fp);
        let none = Fingerprint::new(OpKind::Barrier, 0, 0).encode();
        assert_eq!(none[4..16], [OpKind::Barrier as u8, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn bad_op_headers_name_their_sender_and_reserved_bytes_are_checked() {
        let fp = Fingerprint::new(OpKind::Barrier, 3, 0);
        let mut bad = fp.encode();
        bad[0] ^= 1;
        let e = Fingerprint::decode_from(&bad, 5).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Protocol);
        assert_eq!(e.peer(), Some(5));
        assert!(e.message().contains("from rank 5"), "{e}");
        for at in [7usize, 9, 13] {
            let mut b = fp.encode();
            b[at] = 2;
            assert!(Fingerprint::decode(&b).is_err(), "byte {at}");
        }
        assert!(Fingerprint::decode(&fp.encode()[..47]).is_err());
        assert!(Fingerprint::decode(&[fp.encode().as_slice(), &[0]].concat()).is_err());
    }
}
