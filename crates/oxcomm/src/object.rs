//! Object collectives: torch's `broadcast_object_list` and `all_gather_object`, for byte
//! strings and for any serde type, built on [`Communicator::broadcast`] and
//! [`Communicator::all_gather`] (so they run on every transport and backend).
//!
//! This module owns the length exchange, the padding and the (de)serialization; moving the
//! bytes is the communicator's. With the comms logger on, each call is recorded under its own
//! name (`broadcast_object`, `all_gather_object`, `broadcast_bytes`, `all_gather_bytes`) with
//! this rank's byte count (the encoded object's; DeepSpeed records 0 for `all_gather_object`),
//! beside the broadcasts and all_gathers it ran.
//!
//! # Wire
//!
//! Lengths travel first as `i64`, then the bytes. `all_gather` pads every rank's bytes to the
//! longest, as torch does, so one large object costs `size ×` its length on every rank.
//! Objects are encoded with [`postcard`] (compact, exact for every float, NaN included; not
//! self-describing), so every rank must use the same type. A length of `-1` means "this rank has
//! nothing to send" (a root without an object, or one whose object failed to serialize). Then
//! every rank returns an error naming that rank, and nobody waits for bytes that will not come.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::comm::Communicator;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};

/// The length a rank sends when it has no bytes to contribute.
const NOTHING: i64 = -1;

/// Largest object (encoded bytes) a rank accepts from a peer: 4 GiB. A longer announced length
/// is a protocol error naming the sender, before anything is allocated.
pub const MAX_OBJECT_BYTES: usize = 4 << 30;

/// Checks a length that rank `from` announced: `Ok(None)` for "nothing to send" (−1),
/// `Ok(Some(len))` for 0 ..= [`MAX_OBJECT_BYTES`], a [`ErrorKind::Protocol`] error naming
/// `from` for anything else.
pub(crate) fn check_length(len: i64, from: usize) -> Result<Option<usize>> {
    if len == NOTHING {
        return Ok(None);
    }
    match usize::try_from(len) {
        Ok(l) if l <= MAX_OBJECT_BYTES => Ok(Some(l)),
        _ => Err(Error::protocol(format!(
            "rank {from} announced an object of {len} bytes (allowed: 0 to {MAX_OBJECT_BYTES}, or -1 for none)"
        ))
        .with_peer(from)),
    }
}

impl Communicator {
    /// Copies `root`'s bytes to every rank and returns them (on `root` too). `root` passes
    /// `Some(bytes)`; the other ranks' argument is ignored (pass `None`).
    ///
    /// Two broadcasts: the length, then the bytes. Errors: [`ErrorKind::InvalidArgument`]
    /// on every rank if `root` is out of range, or if `root` passed `None` (that names the
    /// root); an allocation that fails on a receiver aborts the communicator (so every rank
    /// fails instead of waiting); any error of the broadcasts.
    ///
    /// ```
    /// let out = oxcomm::threads::run(3, |comm| {
    ///     let mine = (comm.rank() == 1).then(|| b"config v2".to_vec());
    ///     comm.broadcast_bytes(mine, 1)
    /// })
    /// .unwrap();
    /// assert!(out.iter().all(|r| r.as_deref().unwrap() == b"config v2"));
    /// ```
    pub fn broadcast_bytes(&self, bytes: Option<Vec<u8>>, root: usize) -> Result<Vec<u8>> {
        let start = self.logger().now_ns();
        let out = self.broadcast_bytes_inner("broadcast_bytes", bytes, root)?;
        self.log_op("broadcast_bytes", Some(DType::U8), out.len(), out.len() as u64, start);
        Ok(out)
    }

    /// [`Communicator::broadcast_bytes`], its errors reported under `op`.
    fn broadcast_bytes_inner(&self, op: &str, bytes: Option<Vec<u8>>, root: usize) -> Result<Vec<u8>> {
        if root >= self.size() {
            return Err(self.object_error(op, format!("root {root} out of range for a group of {}", self.size())));
        }
        let me = self.rank();
        let mut len = [match (&bytes, me == root) {
            (Some(b), true) => length_of(b.len()),
            _ => NOTHING,
        }];
        self.broadcast(&mut len, root)?;
        let checked = check_length(len[0], root).map_err(|e| {
            self.abort(e.message());
            e.with_op(op.to_string()).with_rank(self.world_rank())
        })?;
        if checked.is_none() {
            let msg =
                format!("root rank {root} had nothing to send (no object, or one that failed to serialize there)");
            return Err(self.object_error(op, msg).with_peer(root));
        }
        let mut buf = match bytes {
            Some(b) if me == root => b,
            _ => self.allocate(op, len[0], root)?,
        };
        if !buf.is_empty() {
            self.broadcast(&mut buf, root)?;
        }
        Ok(buf)
    }

    /// Gathers every rank's bytes, in rank order, on every rank.
    ///
    /// One all_gather of the lengths, then one of the bytes padded to the longest (as torch's
    /// `all_gather_object` pads to the largest object). Errors: an allocation that fails
    /// aborts the communicator; any error of the all_gathers.
    ///
    /// ```
    /// let out = oxcomm::threads::run(2, |comm| comm.all_gather_bytes(&vec![b'a'; comm.rank() + 1])).unwrap();
    /// assert_eq!(out[0].as_ref().unwrap(), &vec![b"a".to_vec(), b"aa".to_vec()]);
    /// ```
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let start = self.logger().now_ns();
        let out = self.gather_bytes_inner("all_gather_bytes", Some(bytes))?;
        self.log_op("all_gather_bytes", Some(DType::U8), bytes.len(), bytes.len() as u64, start);
        Ok(out)
    }

    /// Copies `root`'s object to every rank (torch's `broadcast_object_list` for one object).
    /// `root` passes `Some(obj)` and gets it back; the other ranks pass `None` (an object they
    /// pass is ignored and dropped).
    ///
    /// The object is encoded with postcard (see the module docs): every rank must name the
    /// same `T`. Errors: as [`Communicator::broadcast_bytes`]; if the root's object fails to
    /// serialize, the root returns that error and the others an error naming the root;
    /// [`ErrorKind::InvalidArgument`] on a rank whose bytes do not decode as `T`.
    ///
    /// ```
    /// #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    /// struct Plan { step: u64, lr: f64, layers: Vec<String> }
    ///
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let plan = (comm.rank() == 0).then(|| Plan { step: 7, lr: 1e-3, layers: vec!["fc1".into()] });
    ///     comm.broadcast_object(plan, 0)
    /// })
    /// .unwrap();
    /// assert_eq!(out[1].as_ref().unwrap().layers, ["fc1"]);
    /// ```
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(&self, obj: Option<T>, root: usize) -> Result<T> {
        let op = "broadcast_object";
        let start = self.logger().now_ns();
        if self.rank() != root {
            let bytes = self.broadcast_bytes_inner(op, None, root)?;
            let obj = self.decode(op, &bytes, root)?;
            self.log_op(op, None, 1, bytes.len() as u64, start);
            return Ok(obj);
        }
        // A root without an object tells the others there is nothing coming, then reports it.
        let Some(obj) = obj else {
            let _ = self.broadcast_bytes_inner(op, None, root);
            return Err(self.object_error(op, format!("root rank {root} passed no object")));
        };
        match postcard::to_allocvec(&obj) {
            Ok(bytes) => {
                let sent = self.broadcast_bytes_inner(op, Some(bytes), root)?;
                self.log_op(op, None, 1, sent.len() as u64, start);
                Ok(obj)
            }
            Err(e) => {
                let _ = self.broadcast_bytes_inner(op, None, root);
                Err(self.object_error(op, format!("could not serialize the object: {e}")))
            }
        }
    }

    /// Gathers every rank's object, in rank order, on every rank (torch's `all_gather_object`).
    ///
    /// Encoded as [`Communicator::broadcast_object`] is; every rank must name the same `T`.
    /// Errors: if any rank's object fails to serialize, that rank returns its cause and every
    /// other rank an error naming it; [`ErrorKind::InvalidArgument`] where a rank's bytes do not
    /// decode as `T`; any error of the all_gathers.
    ///
    /// ```
    /// let out = oxcomm::threads::run(3, |comm| comm.all_gather_object(&(comm.rank(), format!("host-{}", comm.rank()))))
    ///     .unwrap();
    /// assert_eq!(out[2].as_ref().unwrap()[1], (1, "host-1".to_string()));
    /// ```
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>> {
        let op = "all_gather_object";
        let start = self.logger().now_ns();
        match postcard::to_allocvec(obj) {
            Ok(bytes) => {
                let all = self.gather_bytes_inner(op, Some(&bytes))?;
                let objs =
                    all.iter().enumerate().map(|(from, b)| self.decode(op, b, from)).collect::<Result<Vec<T>>>()?;
                self.log_op(op, None, 1, bytes.len() as u64, start);
                Ok(objs)
            }
            Err(e) => {
                let _ = self.gather_bytes_inner(op, None);
                Err(self.object_error(op, format!("could not serialize the object: {e}")))
            }
        }
    }

    /// All-gathers `bytes` (`None`: this rank has nothing, and every rank fails naming it).
    fn gather_bytes_inner(&self, op: &str, bytes: Option<&[u8]>) -> Result<Vec<Vec<u8>>> {
        let n = self.size();
        let mut lens = vec![0i64; n];
        self.all_gather(&[bytes.map_or(NOTHING, |b| length_of(b.len()))], &mut lens)?;
        for (from, &l) in lens.iter().enumerate() {
            if let Err(e) = check_length(l, from) {
                return Err(e.with_op(op.to_string()).with_rank(self.world_rank()));
            }
        }
        if let Some(from) = lens.iter().position(|&l| l == NOTHING) {
            let missing: Vec<usize> = (0..n).filter(|&r| lens[r] == NOTHING).collect();
            let e = self
                .object_error(op, format!("rank(s) {missing:?} had no object to send (it failed to serialize there)"));
            return Err(if missing.len() == 1 { e.with_peer(from) } else { e });
        }
        let longest = lens.iter().copied().max().unwrap_or(0);
        let total = usize::try_from(longest).ok().and_then(|l| l.checked_mul(n)).ok_or_else(|| {
            self.object_error(op, format!("{n} ranks × {longest} bytes do not fit this machine's memory"))
        })?;
        let mut out = Vec::new();
        if let Err(e) = out.try_reserve_exact(total) {
            let msg = format!("cannot allocate {total} bytes for {n} padded objects: {e}");
            self.abort(&msg);
            return Err(self.object_error(op, msg));
        }
        out.resize(total, 0);
        let width = total / n.max(1);
        if width > 0 {
            let mut mine = vec![0u8; width];
            let own = bytes.unwrap_or_default();
            mine[..own.len()].copy_from_slice(own);
            self.all_gather(&mine, &mut out)?;
        }
        Ok(lens.iter().enumerate().map(|(r, &l)| out[r * width..][..l as usize].to_vec()).collect())
    }

    /// A zeroed buffer of `len` bytes (sent by `from`), or an error after aborting the
    /// communicator (so the sender does not wait for a rank that cannot receive).
    fn allocate(&self, op: &str, len: i64, from: usize) -> Result<Vec<u8>> {
        let fail = |msg: String| {
            self.abort(&msg);
            Err(self.object_error(op, msg).with_peer(from))
        };
        let Ok(len) = usize::try_from(len) else {
            return fail(format!("rank {from} announced a length of {len} bytes"));
        };
        let mut buf = Vec::new();
        if let Err(e) = buf.try_reserve_exact(len) {
            return fail(format!("cannot allocate the {len} bytes rank {from} sends: {e}"));
        }
        buf.resize(len, 0);
        Ok(buf)
    }

    fn decode<T: DeserializeOwned>(&self, op: &str, bytes: &[u8], from: usize) -> Result<T> {
        postcard::from_bytes(bytes).map_err(|e| {
            self.object_error(
                op,
                format!(
                    "the {} bytes from rank {from} do not decode as {} ({e}); every rank must pass the same type",
                    bytes.len(),
                    std::any::type_name::<T>()
                ),
            )
            .with_peer(from)
        })
    }

    fn object_error(&self, op: &str, msg: String) -> Error {
        Error::new(ErrorKind::InvalidArgument, msg).with_op(op.to_string()).with_rank(self.world_rank())
    }
}

/// A byte count as the `i64` on the wire (a `Vec` never holds more than `isize::MAX` bytes).
fn length_of(len: usize) -> i64 {
    i64::try_from(len).expect("a Vec holds at most isize::MAX bytes")
}
