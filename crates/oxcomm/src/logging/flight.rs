//! The flight recorder: this rank's last [`CAPACITY`] ops (op, sequence number, dtype, count,
//! algorithm, state, the peer it failed on), always on, so that when an op times out or names
//! a peer the error can say what this rank did just before, and a hung job's ranks can be
//! compared to see who stopped where (as torch's NCCL flight recorder does).
//!
//! It is a fixed ring of small `Copy` records behind one mutex that only the op's own thread
//! takes, twice per op (start and end): no allocation, no formatting, one coarse clock read
//! each time. Formatting happens only when something failed or someone asks.
//!
//! What it gives:
//! * [`FlightRecorder::annotate`]: the error of a failed op that timed out or names a peer gets
//!   the last [`IN_ERRORS`] records appended (`…; last ops on rank 0: barrier #4 done,
//!   all_gather #5 (f32 × 4) timed out waiting for rank 1`);
//! * with `OXCOMM_FLIGHT_RECORDER=<prefix>` set (default: unset), that failure also writes the
//!   whole ring as JSON Lines to the file `<prefix><rank>` (torch's
//!   `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` convention), one object per op, oldest first:
//!   `{"rank":0,"seq":5,"op":"all_gather","group":0,"dtype":"f32","count":4,"algorithm":"ring",
//!   "state":"failed","error":"timed out","peer":1,"start_ns":…,"duration_ns":…}`
//!   (`start_ns` is the host's coarse monotonic clock, `peer` and `error` are null unless
//!   the op failed naming one; `state` is `running`, `done` or `failed`);
//! * [`FlightRecorder::to_jsonl`] on demand (`Communicator::flight_record`), also while an op
//!   hangs, since the ring is not behind the op's lock.
//!
//! It knows nothing about transports; the communicator calls it around every op.

use std::sync::Mutex;

use crate::error::{Error, ErrorKind};
use crate::wire::Fingerprint;

/// Number of ops kept.
pub const CAPACITY: usize = 64;
/// Number of ops appended to an error.
pub const IN_ERRORS: usize = 8;
/// Env prefix of the file a failure writes the ring to (`<prefix><rank>`); unset: no file.
pub const FILE_ENV: &str = "OXCOMM_FLIGHT_RECORDER";

/// Where an op is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlightState {
    /// Started, not finished (the op in progress, or one that unwound without a result).
    Running,
    /// Finished successfully.
    Done,
    /// Failed with this kind of error.
    Failed(ErrorKind),
}

/// One op as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlightEntry {
    /// The op (kind, dtype, count, group, sequence number).
    pub fp: Fingerprint,
    /// The algorithm that ran it.
    pub algorithm: &'static str,
    /// The peer: the one a point-to-point op talks to, or the one a failure names.
    pub peer: Option<usize>,
    /// Where the op is.
    pub state: FlightState,
    /// When it started (host coarse monotonic clock, ns).
    pub start_ns: u64,
    /// When it ended (0 while running).
    pub end_ns: u64,
}

struct Ring {
    entries: [Option<FlightEntry>; CAPACITY],
    /// Ops started so far; op `i` lives at `i % CAPACITY`.
    started: u64,
}

/// The ring of this rank's last ops (see the module docs).
pub struct FlightRecorder {
    ring: Mutex<Ring>,
}

impl Default for FlightRecorder {
    fn default() -> FlightRecorder {
        FlightRecorder { ring: Mutex::new(Ring { entries: [None; CAPACITY], started: 0 }) }
    }
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder").field("started", &self.lock().started).finish_non_exhaustive()
    }
}

/// The id of a started op, to finish it with.
#[derive(Debug, Clone, Copy)]
pub struct FlightId(u64);

impl FlightRecorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `fp` starts now with `algorithm` (talking to `peer`, for point-to-point).
    pub fn start(&self, fp: &Fingerprint, algorithm: &'static str, peer: Option<usize>) -> FlightId {
        let now = crate::transport::monotonic_ns();
        let mut ring = self.lock();
        let id = ring.started;
        ring.started += 1;
        ring.entries[(id % CAPACITY as u64) as usize] =
            Some(FlightEntry { fp: *fp, algorithm, peer, state: FlightState::Running, start_ns: now, end_ns: 0 });
        FlightId(id)
    }

    /// Records how op `id` ended (if it is still in the ring).
    pub fn finish(&self, id: FlightId, outcome: std::result::Result<(), &Error>) {
        let now = crate::transport::monotonic_ns();
        let mut ring = self.lock();
        if ring.started - id.0 > CAPACITY as u64 {
            return;
        }
        if let Some(e) = &mut ring.entries[(id.0 % CAPACITY as u64) as usize] {
            e.end_ns = now;
            match outcome {
                Ok(()) => e.state = FlightState::Done,
                Err(err) => {
                    e.state = FlightState::Failed(err.kind());
                    e.peer = err.peer().or(e.peer);
                }
            }
        }
    }

    /// The recorded ops, oldest first.
    pub fn entries(&self) -> Vec<FlightEntry> {
        let ring = self.lock();
        let first = ring.started.saturating_sub(CAPACITY as u64);
        (first..ring.started).filter_map(|i| ring.entries[(i % CAPACITY as u64) as usize]).collect()
    }

    /// Finishes op `id` with its error `err` and, if it timed out or names a peer, appends the
    /// last [`IN_ERRORS`] ops to the error and writes the ring to `OXCOMM_FLIGHT_RECORDER`'s
    /// file, if set, for world rank `rank`.
    pub fn annotate(&self, id: FlightId, err: Error, rank: usize) -> Error {
        self.finish(id, Err(&err));
        if err.kind() != ErrorKind::Timeout && err.peer().is_none() {
            return err;
        }
        let entries = self.entries();
        let recent = &entries[entries.len().saturating_sub(IN_ERRORS)..];
        let list: Vec<String> = recent.iter().map(describe).collect();
        let mut msg = format!("{}; last ops on rank {rank}: {}", err.message(), list.join(", "));
        if let Some(path) = write_file(rank, &entries) {
            msg.push_str(&format!(" (all {} in {path})", entries.len()));
        }
        rebuild(&err, msg)
    }

    /// The ring as JSON Lines for world rank `rank` (see the module docs).
    pub fn to_jsonl(&self, rank: usize) -> String {
        jsonl(rank, &self.entries())
    }
}

/// `err` with message `msg` (same kind, rank, peer, op).
fn rebuild(err: &Error, msg: String) -> Error {
    let mut e = Error::new(err.kind(), msg);
    if let Some(p) = err.peer() {
        e = e.with_peer(p);
    }
    if let Some(r) = err.rank() {
        e = e.with_rank(r);
    }
    if let Some(op) = err.op() {
        e = e.with_op(op);
    }
    e
}

/// One entry in an error: `all_gather #5 (f32 × 4) timed out waiting for rank 1`.
fn describe(e: &FlightEntry) -> String {
    match e.state {
        FlightState::Running => format!("{} running", e.fp),
        FlightState::Done => format!("{} done", e.fp),
        FlightState::Failed(kind) => match e.peer {
            Some(p) => format!("{} {} (rank {p})", e.fp, kind.as_str()),
            None => format!("{} {}", e.fp, kind.as_str()),
        },
    }
}

fn jsonl(rank: usize, entries: &[FlightEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        let (state, error) = match e.state {
            FlightState::Running => ("running", None),
            FlightState::Done => ("done", None),
            FlightState::Failed(k) => ("failed", Some(k.as_str())),
        };
        let opt = |v: Option<String>| v.unwrap_or_else(|| "null".to_string());
        out.push_str(&format!(
            "{{\"rank\":{rank},\"seq\":{},\"op\":\"{}\",\"group\":{},\"dtype\":{},\"count\":{},\"algorithm\":\"{}\",\
             \"state\":\"{state}\",\"error\":{},\"peer\":{},\"start_ns\":{},\"duration_ns\":{}}}\n",
            e.fp.seq,
            e.fp.kind.name(),
            e.fp.group,
            opt(e.fp.dtype.map(|d| format!("\"{d}\""))),
            e.fp.count,
            e.algorithm,
            opt(error.map(|k| format!("\"{k}\""))),
            opt(e.peer.map(|p| p.to_string())),
            e.start_ns,
            e.end_ns.saturating_sub(e.start_ns),
        ));
    }
    out
}

/// Writes `entries` to `<OXCOMM_FLIGHT_RECORDER><rank>` if the variable is set; the path
/// written, or `None` (unset, or the write failed: reported through `tracing`).
fn write_file(rank: usize, entries: &[FlightEntry]) -> Option<String> {
    let prefix = std::env::var(FILE_ENV).ok().filter(|p| !p.is_empty())?;
    let path = format!("{prefix}{rank}");
    match std::fs::write(&path, jsonl(rank, entries)) {
        Ok(()) => Some(path),
        Err(e) => {
            tracing::warn!(target: "oxcomm::flight", rank, path, error = %e, "could not write the flight record");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::OpKind;

    fn fp(seq: u64) -> Fingerprint {
        let mut f = Fingerprint::new(OpKind::AllGather, seq, 0);
        f.dtype = Some(crate::DType::F32);
        f.count = 4;
        f
    }

    #[test]
    fn keeps_the_last_ops_and_names_the_failure() {
        let fr = FlightRecorder::default();
        for s in 0..100 {
            let id = fr.start(&fp(s), "ring", None);
            fr.finish(id, Ok(()));
        }
        let id = fr.start(&fp(100), "ring", None);
        let all = fr.entries();
        assert_eq!(all.len(), CAPACITY);
        assert_eq!(all[0].fp.seq, 100 - CAPACITY as u64 + 1);
        assert_eq!(all.last().unwrap().state, FlightState::Running);
        let err = Error::new(ErrorKind::Timeout, "timed out waiting for rank 1").with_peer(1).with_rank(0);
        let e = fr.annotate(id, err, 0);
        assert_eq!((e.kind(), e.peer(), e.rank()), (ErrorKind::Timeout, Some(1), Some(0)));
        assert!(e.message().contains("last ops on rank 0: all_gather #93"), "{e}");
        assert!(e.message().ends_with("all_gather #100 (f32 × 4) timed out (rank 1)"), "{e}");
        let last = fr.to_jsonl(0).lines().last().unwrap().to_string();
        assert!(last.contains("\"seq\":100,\"op\":\"all_gather\"") && last.contains("\"peer\":1"), "{last}");
        // An old id whose slot was reused is ignored.
        fr.finish(FlightId(0), Ok(()));
        assert_eq!(fr.entries().last().unwrap().state, FlightState::Failed(ErrorKind::Timeout));
    }

    #[test]
    fn errors_without_a_peer_are_left_alone() {
        let fr = FlightRecorder::default();
        let id = fr.start(&fp(0), "ring", None);
        let e = fr.annotate(id, Error::invalid("bad"), 0);
        assert_eq!(e.message(), "bad");
    }
}
