//! The flight recorder: this rank's last [`CAPACITY`] ops (op, sequence number, dtype, count,
//! algorithm, state, the peer it failed on), always on, so that when an op times out or names
//! a peer the error can say what this rank did just before, and a hung job's ranks can be
//! compared to see who stopped where (as torch's NCCL flight recorder does).
//!
//! It is a fixed ring of records of atomic words that only the thread running the op writes
//! (the one holding the communicator's turn), twice per op (start and end), as a seqlock: the
//! record's version is odd while it is rewritten, and a reader on another thread retries until
//! it reads the same even version before and after the words. No lock, no read-modify-write,
//! no allocation, no formatting, one coarse clock read each time (two lock/unlock pairs per op
//! cost 0.02–0.03 µs, a tenth of an 8-byte all-reduce); the start's reading is the caller's
//! ([`FlightRecorder::start_at`]), which the communicator shares with the backend's heartbeat.
//! Formatting happens only when something failed or someone asks.
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

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::error::{Error, ErrorKind};
use crate::wire::{Fingerprint, FP_BYTES, FP_WORDS};

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

/// Words of a record: the op's id, its encoded fingerprint, then the algorithm's name, the
/// peer, the state, and the start and end times.
const ID: usize = 0;
const FP: usize = 1;
const ALGORITHM: usize = FP + FP_WORDS;
const PEER: usize = ALGORITHM + 1;
const STATE: usize = PEER + 1;
const START: usize = STATE + 1;
const END: usize = START + 1;
const WORDS: usize = END + 1;

/// One op's record: a seqlock over atomic words (module docs).
struct Record {
    /// Odd while the writer rewrites the words; 0 until the first write.
    version: AtomicU64,
    words: [AtomicU64; WORDS],
}

/// The ring of this rank's last ops (see the module docs).
pub struct FlightRecorder {
    /// Ops started so far; op `i` lives in record `i % CAPACITY`.
    started: AtomicU64,
    records: [Record; CAPACITY],
    /// The route names a record reads back as (see [`FlightRecorder::with_names`]).
    names: Vec<&'static str>,
}

impl Default for FlightRecorder {
    fn default() -> FlightRecorder {
        FlightRecorder {
            started: AtomicU64::new(0),
            records: std::array::from_fn(|_| Record {
                version: AtomicU64::new(0),
                words: std::array::from_fn(|_| AtomicU64::new(0)),
            }),
            names: Vec::new(),
        }
    }
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder").field("started", &self.started.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

/// The id of a started op, to finish it with.
#[derive(Debug, Clone, Copy)]
pub struct FlightId(u64);

/// A name of at most 8 bytes as one word (longer ones are not recorded: read back as `?`).
///
/// Byte by byte into a register: copying a name of variable length into a buffer and loading
/// it as one word called `memcpy` and then stalled on the load (the bytes were still in the
/// store buffer), which was half of [`FlightRecorder::start`]'s samples in an 8-byte gather.
fn name_word(name: &str) -> u64 {
    if name.len() > 8 {
        return 0;
    }
    name.bytes().enumerate().fold(0, |w, (i, b)| w | (b as u64) << (8 * i))
}

/// Every error kind, in the order of [`kind_code`].
const KINDS: [ErrorKind; 11] = [
    ErrorKind::InvalidArgument,
    ErrorKind::Timeout,
    ErrorKind::PeerGone,
    ErrorKind::Mismatch,
    ErrorKind::Aborted,
    ErrorKind::Protocol,
    ErrorKind::Unsupported,
    ErrorKind::Io,
    ErrorKind::Rendezvous,
    ErrorKind::Revoked,
    ErrorKind::Suspected,
];

fn kind_code(kind: ErrorKind) -> u64 {
    match kind {
        ErrorKind::InvalidArgument => 0,
        ErrorKind::Timeout => 1,
        ErrorKind::PeerGone => 2,
        ErrorKind::Mismatch => 3,
        ErrorKind::Aborted => 4,
        ErrorKind::Protocol => 5,
        ErrorKind::Unsupported => 6,
        ErrorKind::Io => 7,
        ErrorKind::Rendezvous => 8,
        ErrorKind::Revoked => 9,
        ErrorKind::Suspected => 10,
    }
}

/// The state word: 0 running, 1 done, 2 + the kind's code failed.
fn state_word(state: FlightState) -> u64 {
    match state {
        FlightState::Running => 0,
        FlightState::Done => 1,
        FlightState::Failed(kind) => 2 + kind_code(kind),
    }
}

fn state_of(word: u64) -> FlightState {
    match word {
        0 => FlightState::Running,
        1 => FlightState::Done,
        w => FlightState::Failed(KINDS.get((w - 2) as usize).copied().unwrap_or(ErrorKind::Io)),
    }
}

impl Record {
    /// Rewrites the words `f` sets. Only the op's thread writes (module docs).
    fn write(&self, f: impl FnOnce(&[AtomicU64; WORDS])) {
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        f(&self.words);
        self.version.store((v | 1) + 1, Ordering::Release);
    }

    /// A consistent copy of the words, or `None` if never written (or the writer kept
    /// rewriting it while this thread tried).
    fn read(&self) -> Option<[u64; WORDS]> {
        for attempt in 0..10_000 {
            let v = self.version.load(Ordering::Acquire);
            if v == 0 {
                return None;
            }
            if v & 1 == 0 {
                let words = std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == v {
                    return Some(words);
                }
            }
            if attempt > 100 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        None
    }
}

/// The entry a record's words hold, if they decode; its route name is the one of `names`
/// whose word it holds, else `?`.
fn entry_of(words: &[u64; WORDS], names: &[&'static str]) -> Option<FlightEntry> {
    let mut fp = [0u8; FP_BYTES];
    for (chunk, w) in fp.chunks_exact_mut(8).zip(&words[FP..FP + FP_WORDS]) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    let fp = Fingerprint::decode(&fp).ok()?;
    let algorithm = names.iter().copied().find(|n| name_word(n) == words[ALGORITHM]).unwrap_or("?");
    let peer = (words[PEER] != u64::MAX).then_some(words[PEER] as usize);
    Some(FlightEntry { fp, algorithm, peer, state: state_of(words[STATE]), start_ns: words[START], end_ns: words[END] })
}

impl FlightRecorder {
    /// A recorder whose records read back with their route's name when it is one of `names`
    /// (the communicator passes every name a backend's route can carry; the recorder itself
    /// knows no algorithm). [`FlightRecorder::default`] knows none: every name reads as `?`.
    pub fn with_names(names: impl IntoIterator<Item = &'static str>) -> FlightRecorder {
        FlightRecorder { names: names.into_iter().collect(), ..FlightRecorder::default() }
    }

    /// Records that `fp` starts now with `algorithm` (talking to `peer`, for point-to-point).
    /// Called by the thread that runs the op, holding the communicator's turn.
    pub fn start(&self, fp: &Fingerprint, algorithm: &'static str, peer: Option<usize>) -> FlightId {
        self.start_at(fp, algorithm, peer, crate::clock::monotonic_ns())
    }

    /// [`FlightRecorder::start`] at `now` ([`crate::clock::monotonic_ns`], read by the caller,
    /// which shares the reading with the op's heartbeat: one clock read for both).
    pub fn start_at(&self, fp: &Fingerprint, algorithm: &'static str, peer: Option<usize>, now: u64) -> FlightId {
        let id = self.started.load(Ordering::Relaxed);
        let words = fp.words();
        self.records[(id % CAPACITY as u64) as usize].write(|w| {
            w[ID].store(id, Ordering::Relaxed);
            for (word, value) in w[FP..FP + FP_WORDS].iter().zip(words) {
                word.store(value, Ordering::Relaxed);
            }
            w[ALGORITHM].store(name_word(algorithm), Ordering::Relaxed);
            w[PEER].store(peer.map_or(u64::MAX, |p| p as u64), Ordering::Relaxed);
            w[STATE].store(state_word(FlightState::Running), Ordering::Relaxed);
            w[START].store(now, Ordering::Relaxed);
            w[END].store(0, Ordering::Relaxed);
        });
        self.started.store(id + 1, Ordering::Release);
        FlightId(id)
    }

    /// Records how op `id` ended (if it is still in the ring); by the thread that started it.
    pub fn finish(&self, id: FlightId, outcome: std::result::Result<(), &Error>) {
        let now = crate::clock::monotonic_ns();
        let record = &self.records[(id.0 % CAPACITY as u64) as usize];
        if record.words[ID].load(Ordering::Relaxed) != id.0 || record.version.load(Ordering::Relaxed) == 0 {
            return;
        }
        record.write(|w| {
            w[END].store(now, Ordering::Relaxed);
            let state = match outcome {
                Ok(()) => FlightState::Done,
                Err(err) => {
                    if let Some(p) = err.peer() {
                        w[PEER].store(p as u64, Ordering::Relaxed);
                    }
                    FlightState::Failed(err.kind())
                }
            };
            w[STATE].store(state_word(state), Ordering::Relaxed);
        });
    }

    /// The recorded ops, oldest first (from any thread, also while an op runs).
    pub fn entries(&self) -> Vec<FlightEntry> {
        let started = self.started.load(Ordering::Acquire);
        let first = started.saturating_sub(CAPACITY as u64);
        (first..started)
            .filter_map(|i| {
                let words = self.records[(i % CAPACITY as u64) as usize].read()?;
                // A record rewritten for a later op since `started` was read is left out.
                (words[ID] == i).then(|| entry_of(&words, &self.names)).flatten()
            })
            .collect()
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
    fn a_name_word_is_its_bytes_little_endian_and_longer_names_are_zero() {
        assert_eq!(name_word("ring"), u64::from_le_bytes(*b"ring\0\0\0\0"));
        assert_eq!(name_word("direct"), u64::from_le_bytes(*b"direct\0\0"));
        assert_eq!(name_word("12345678"), u64::from_le_bytes(*b"12345678"));
        assert_eq!(name_word("123456789"), 0);
        assert_eq!(name_word(""), 0);
        // Read back by name.
        let r = FlightRecorder::with_names(["direct", "ring"]);
        let id = r.start_at(&fp(3), "direct", None, 7);
        r.finish(id, Ok(()));
        let e = r.entries();
        assert_eq!((e[0].algorithm, e[0].start_ns, e[0].state), ("direct", 7, FlightState::Done));
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
    fn every_route_name_and_state_reads_back() {
        let names = ["ring", "rd", "star", "tree", "pairwise", "dissem", "flat", "direct", "hier", "p2p", "mpi"];
        let fr = FlightRecorder::with_names(names);
        for (i, name) in names.iter().enumerate() {
            let id = fr.start(&fp(i as u64), name, Some(i));
            match KINDS.get(i) {
                Some(kind) => fr.finish(id, Err(&Error::new(*kind, "x"))),
                None => fr.finish(id, Ok(())),
            }
        }
        let all = fr.entries();
        assert_eq!(all.iter().map(|e| e.algorithm).collect::<Vec<_>>(), names);
        for (i, e) in all.iter().enumerate() {
            let want = KINDS.get(i).map_or(FlightState::Done, |k| FlightState::Failed(*k));
            assert_eq!((e.state, e.peer, e.fp), (want, Some(i), fp(i as u64)));
        }
        assert!(KINDS.iter().enumerate().all(|(i, k)| kind_code(*k) == i as u64));
        // A name the recorder does not know reads back as `?`, not as another.
        fr.start(&fp(99), "unheard-of", None);
        assert_eq!(fr.entries().last().unwrap().algorithm, "?");
    }

    /// A reader on another thread sees whole records while the op thread rewrites them.
    #[test]
    fn readers_never_see_a_torn_record() {
        use std::sync::atomic::AtomicUsize;
        let fr = std::sync::Arc::new(FlightRecorder::default());
        let passes = std::sync::Arc::new(AtomicUsize::new(0));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (fr, passes, done) = (fr.clone(), passes.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    for e in fr.entries() {
                        // Op s is written with count s and, once finished, end_ns ≥ start_ns.
                        assert_eq!(e.fp.count, e.fp.seq, "{e:?}");
                        assert!(e.state == FlightState::Running || e.end_ns >= e.start_ns, "{e:?}");
                    }
                    passes.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // Write until the reader has read the ring 2000 times while it changed (at most 20 s).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut s = 0u64;
        while passes.load(Ordering::Relaxed) < 2000 && !reader.is_finished() && std::time::Instant::now() < deadline {
            let mut f = fp(s);
            f.count = s;
            let id = fr.start(&f, "direct", None);
            fr.finish(id, Ok(()));
            s += 1;
        }
        done.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        assert!(passes.load(Ordering::Relaxed) >= 2000, "the reader made {} passes", passes.load(Ordering::Relaxed));
    }

    #[test]
    fn errors_without_a_peer_are_left_alone() {
        let fr = FlightRecorder::default();
        let id = fr.start(&fp(0), "ring", None);
        let e = fr.annotate(id, Error::invalid("bad"), 0);
        assert_eq!(e.message(), "bad");
    }
}
