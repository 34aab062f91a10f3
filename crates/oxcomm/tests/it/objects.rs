//! Object collectives (`broadcast_bytes`, `all_gather_bytes`, `broadcast_object`,
//! `all_gather_object`): every root and size, padding, exact floats, and errors that name the
//! rank at fault on every rank without a hang.

use std::collections::BTreeMap;

use oxcomm::{threads, ErrorKind};
use serde::{Deserialize, Serialize};

/// `len` bytes that depend on the rank that made them.
fn bytes(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (k * 31 + rank * 7) as u8).collect()
}

#[test]
fn broadcast_bytes_from_every_root() {
    for n in [1usize, 2, 3, 4] {
        for len in [0usize, 1, 4097, 100_000] {
            let out = threads::run(n, |comm| {
                (0..comm.size())
                    .map(|root| comm.broadcast_bytes((comm.rank() == root).then(|| bytes(root, len)), root))
                    .collect::<oxcomm::Result<Vec<_>>>()
            })
            .unwrap();
            for got in out {
                let got = got.unwrap();
                for (root, b) in got.iter().enumerate() {
                    assert_eq!(b, &bytes(root, len), "n={n} len={len} root={root}");
                }
            }
        }
    }
}

#[test]
fn all_gather_bytes_of_different_lengths() {
    // Rank r sends r·1000 bytes (rank 0 nothing): padded to the longest on the wire, cut back here.
    let out = threads::run(4, |comm| comm.all_gather_bytes(&bytes(comm.rank(), comm.rank() * 1000))).unwrap();
    for got in out {
        let got = got.unwrap();
        assert_eq!(got.len(), 4);
        for (r, b) in got.iter().enumerate() {
            assert_eq!(b, &bytes(r, r * 1000));
        }
    }
    // Everyone empty: no payload op, still one entry per rank.
    let out = threads::run(3, |comm| comm.all_gather_bytes(&[])).unwrap();
    assert!(out.into_iter().all(|r| r.unwrap() == vec![Vec::<u8>::new(); 3]));
}

#[derive(Serialize, Deserialize, PartialEq, Debug, Clone)]
struct Checkpoint {
    step: u64,
    loss: f64,
    scales: Vec<f32>,
    names: BTreeMap<String, Option<i32>>,
}

fn checkpoint(rank: usize) -> Checkpoint {
    let mut names = BTreeMap::new();
    names.insert(format!("layer{rank}"), Some(-(rank as i32)));
    names.insert("empty".into(), None);
    Checkpoint {
        step: 100 + rank as u64,
        loss: 0.1 * rank as f64,
        scales: vec![f32::NAN, -0.0, 1e-40, f32::INFINITY],
        names,
    }
}

/// NaN, −0 and subnormals survive bit for bit.
fn same(a: &Checkpoint, b: &Checkpoint) -> bool {
    let bits = |c: &Checkpoint| c.scales.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    a.step == b.step && a.loss.to_bits() == b.loss.to_bits() && bits(a) == bits(b) && a.names == b.names
}

#[test]
fn broadcast_and_all_gather_objects() {
    let out = threads::run(3, |comm| {
        let root = 2;
        let got = comm.broadcast_object((comm.rank() == root).then(|| checkpoint(root)), root)?;
        let all = comm.all_gather_object(&checkpoint(comm.rank()))?;
        Ok::<_, oxcomm::Error>((got, all))
    })
    .unwrap();
    for r in out {
        let (got, all) = r.unwrap();
        assert!(same(&got, &checkpoint(2)), "{got:?}");
        assert_eq!(all.len(), 3);
        for (rank, c) in all.iter().enumerate() {
            assert!(same(c, &checkpoint(rank)), "{c:?}");
        }
    }
}

#[test]
fn a_root_with_nothing_fails_every_rank_naming_it() {
    let out = threads::run(3, |comm| comm.broadcast_object::<String>(None, 1)).unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "rank {rank}: {e}");
        assert!(e.to_string().contains("rank 1"), "rank {rank}: {e}");
        assert_eq!(e.op(), Some("broadcast_object"));
    }
    // The communicator is still usable afterwards.
    let out = threads::run(2, |comm| {
        let _ = comm.broadcast_bytes(None, 0);
        comm.broadcast_bytes((comm.rank() == 0).then(|| b"ok".to_vec()), 0)
    })
    .unwrap();
    assert!(out.into_iter().all(|r| r.unwrap() == b"ok"));
}

#[test]
fn a_root_out_of_range_is_an_argument_error_everywhere() {
    let out = threads::run(2, |comm| comm.broadcast_bytes(Some(vec![1]), 2)).unwrap();
    for r in out {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("out of range"), "{e}");
    }
}

/// A value whose serialization fails on one rank.
struct Unserializable(bool);

impl Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 {
            Err(serde::ser::Error::custom("refused on purpose"))
        } else {
            s.serialize_u8(7)
        }
    }
}

impl<'de> Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u8::deserialize(d).map(|_| Unserializable(false))
    }
}

#[test]
fn a_rank_that_cannot_serialize_is_named_on_every_rank() {
    let out =
        threads::run(3, |comm| comm.all_gather_object(&Unserializable(comm.rank() == 1)).map(|v| v.len())).unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        if rank == 1 {
            // postcard keeps the kind of a custom serde error, not its message.
            assert!(e.to_string().contains("could not serialize"), "{e}");
        } else {
            assert_eq!(e.peer(), Some(1), "rank {rank}: {e}");
        }
    }
    let out = threads::run(2, |comm| comm.broadcast_object(Some(Unserializable(true)), 0).map(|_| ())).unwrap();
    assert!(out[0].as_ref().unwrap_err().to_string().contains("could not serialize"));
    assert_eq!(out[1].as_ref().unwrap_err().peer(), Some(0));
}

#[test]
fn bytes_that_do_not_decode_are_an_error_naming_the_sender() {
    // Rank 0 broadcasts raw bytes that are not a postcard String (an unterminated varint).
    let out = threads::run(2, |comm| {
        if comm.rank() == 0 {
            comm.broadcast_bytes(Some(vec![0xFF; 3]), 0).map(|_| String::new())
        } else {
            comm.broadcast_object::<String>(None, 0)
        }
    })
    .unwrap();
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err();
    assert_eq!((e.kind(), e.peer()), (ErrorKind::InvalidArgument, Some(0)));
    assert!(e.to_string().contains("do not decode as"), "{e}");
}

#[test]
fn a_negative_length_from_a_peer_is_a_protocol_error() {
    // Rank 2 takes part in the length exchange with a length no rank can send.
    let out = threads::run(3, |comm| {
        if comm.rank() == 2 {
            let mut lens = vec![0i64; 3];
            comm.all_gather(&[-7i64], &mut lens).map(|_| Vec::new())
        } else {
            comm.all_gather_bytes(b"abc")
        }
    })
    .unwrap();
    for r in &out[..2] {
        let e = r.as_ref().unwrap_err();
        assert_eq!((e.kind(), e.peer()), (ErrorKind::Protocol, Some(2)), "{e}");
    }
    assert!(out[2].is_ok());
}
