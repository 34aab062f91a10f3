//! Mutation fuzzing of every decoder of a peer's bytes (`oxcomm::fuzz`, issue 16 item 8).
//!
//! Starts from the well-formed seeds of each target plus the corpus files in
//! `tests/fuzz_corpus/<target>/`, and feeds the decoder mutated copies (bit flips, byte
//! sets to interesting values, interesting little-endian words written over fields,
//! insertions, deletions, truncations, splices of two inputs), keeping every input that the
//! decoder accepts as a new seed. Checks for each input: no panic, no single allocation above
//! `oxcomm::fuzz::ALLOC_BOUND`, and a bounded time.
//!
//! Each run starts with a deterministic stage (every interesting value written at every offset
//! and width of every starting input), then mutates at random.
//!
//! By default each target runs for about 2 s (part of `cargo test`). A long run:
//! `OXCOMM_FUZZ_EXECS=10000000 cargo test --release -p oxcomm --test it fuzz -- --nocapture`
//! (figures are printed per target). `OXCOMM_FUZZ_SEED` changes the random stream.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The system allocator, recording the largest single allocation of threads that ask.
struct Watching;

thread_local! {
    static WATCH: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    if WATCH.try_with(Cell::get).unwrap_or(false) {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    }
}

// SAFETY: every call is forwarded unchanged to `System`; the bookkeeping touches only
// thread-local `Cell`s with const initialisers, which never allocate.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as for `dealloc`; `new_size` is the caller's, per the contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Watching = Watching;

/// xorshift64*: deterministic, fast, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 14] =
    [0, 1, 2, 7, 0x7f, 0xff, 0x100, 0xffff, 1 << 31, u32::MAX as u64, 1 << 40, 1 << 61, i64::MAX as u64, u64::MAX];

/// Longest input the mutator builds.
const MAX_INPUT: usize = 4096;

fn mutate(rng: &mut Rng, pool: &[Vec<u8>], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&pool[rng.below(pool.len())]);
    for _ in 0..1 + rng.below(4) {
        let len = out.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            2 if len > 0 => {
                // An interesting word over a field, at an aligned or any offset.
                let w = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let width = [1usize, 2, 4, 8][rng.below(4)];
                let at = if rng.below(2) == 0 { rng.below(len) / width * width } else { rng.below(len) };
                for (k, b) in w.iter().take(width).enumerate() {
                    if let Some(x) = out.get_mut(at + k) {
                        *x = *b;
                    }
                }
            }
            3 if len < MAX_INPUT => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let fill = rng.next() as u8;
                out.splice(at..at, std::iter::repeat_n(fill, n));
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = (1 + rng.below(16)).min(len - at);
                out.drain(at..at + n);
            }
            5 if len > 0 => out.truncate(rng.below(len)),
            6 => {
                let other = &pool[rng.below(pool.len())];
                let at = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
                out.truncate(MAX_INPUT);
            }
            _ => {
                let at = rng.below(len + 1);
                let b = rng.next().to_le_bytes();
                out.splice(at..at, b.iter().copied().take(1 + rng.below(8)));
                out.truncate(MAX_INPUT);
            }
        }
    }
}

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus").join(target)
}

struct Figures {
    execs: u64,
    accepted: u64,
    elapsed: Duration,
    slowest: Duration,
    largest_alloc: usize,
    pool: usize,
}

/// Runs `decode` on mutated inputs until `execs` runs or `budget` passes.
fn run_target(name: &str, decode: oxcomm::fuzz::Target, execs: u64, budget: Duration, seed: u64) -> Figures {
    let mut pool = oxcomm::fuzz::seeds(name);
    assert!(!pool.is_empty(), "{name}: no seeds");
    if let Ok(dir) = std::fs::read_dir(corpus_dir(name)) {
        for entry in dir.flatten() {
            if let Ok(bytes) = std::fs::read(entry.path()) {
                pool.push(bytes);
            }
        }
    }
    let mut rng =
        Rng(seed ^ name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)));
    let mut input = Vec::with_capacity(MAX_INPUT + 64);
    let (mut done, mut accepted, mut slowest) = (0u64, 0u64, Duration::ZERO);
    let start = Instant::now();
    LARGEST.with(|l| l.set(0));
    // Every seed first, as is.
    let seeds = pool.clone();
    for s in &seeds {
        WATCH.with(|w| w.set(true));
        let ok = decode(s);
        WATCH.with(|w| w.set(false));
        assert!(ok, "{name}: a well-formed seed of {} bytes is refused: {s:02x?}", s.len());
    }
    // Deterministic stage (as AFL's): every interesting value at every offset and width of
    // every starting input, then random mutation.
    let mut planned: Vec<Vec<u8>> = Vec::new();
    for s in &seeds {
        for at in 0..s.len() {
            for width in [1usize, 2, 4, 8] {
                for v in INTERESTING {
                    let mut m = s.clone();
                    for (k, b) in v.to_le_bytes().iter().take(width).enumerate() {
                        if let Some(x) = m.get_mut(at + k) {
                            *x = *b;
                        }
                    }
                    planned.push(m);
                }
            }
        }
    }
    while done < execs {
        match planned.pop() {
            Some(p) => input = p,
            None => mutate(&mut rng, &pool, &mut input),
        }
        // Timing every input costs two clock reads; sample one in 64 (and all of the first).
        let timed = done % 64 == 0;
        let t0 = timed.then(Instant::now);
        WATCH.with(|w| w.set(true));
        let result = std::panic::catch_unwind(|| decode(&input));
        WATCH.with(|w| w.set(false));
        let ok = match result {
            Ok(ok) => ok,
            Err(_) => panic!("{name}: the decoder panicked on {} bytes: {input:02x?}", input.len()),
        };
        if let Some(t0) = t0 {
            slowest = slowest.max(t0.elapsed());
            if start.elapsed() >= budget {
                done += 1;
                break;
            }
        }
        if ok {
            accepted += 1;
            if pool.len() < 4096 && rng.below(64) == 0 {
                pool.push(input.clone());
            }
        }
        done += 1;
    }
    let largest_alloc = LARGEST.with(Cell::get);
    Figures { execs: done, accepted, elapsed: start.elapsed(), slowest, largest_alloc, pool: pool.len() }
}

#[test]
fn every_decoder_of_peer_bytes_survives_mutated_input() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let (execs, budget) = match env("OXCOMM_FUZZ_EXECS") {
        Some(n) => (n, Duration::from_secs(3600)),
        None => (u64::MAX, Duration::from_secs(2)),
    };
    let seed = env("OXCOMM_FUZZ_SEED").unwrap_or(0x0c0f_fee5_eed5_1e55);
    if std::env::var_os("OXCOMM_FUZZ_WRITE_SEEDS").is_some() {
        // Regenerates the seed files of the corpus from the crate's encoders.
        for (name, _) in oxcomm::fuzz::TARGETS {
            std::fs::create_dir_all(corpus_dir(name)).unwrap();
            for (i, s) in oxcomm::fuzz::seeds(name).iter().enumerate() {
                std::fs::write(corpus_dir(name).join(format!("seed-{i}.bin")), s).unwrap();
            }
        }
    }
    for (name, decode) in oxcomm::fuzz::TARGETS {
        let f = run_target(name, decode, execs, budget, seed);
        println!(
            "fuzz {name}: {} execs in {:.1?} ({:.0}/s), {} accepted, pool {}, largest allocation {} B, slowest sampled input {:?}",
            f.execs,
            f.elapsed,
            f.execs as f64 / f.elapsed.as_secs_f64(),
            f.accepted,
            f.pool,
            f.largest_alloc,
            f.slowest
        );
        assert!(f.largest_alloc <= oxcomm::fuzz::ALLOC_BOUND, "{name}: allocated {} bytes at once", f.largest_alloc);
        // Generous: a loaded machine may preempt any one input; a decoder that is not linear
        // in its (≤ 4 KiB) input would show here.
        assert!(f.slowest < Duration::from_secs(1), "{name}: one input took {:?}", f.slowest);
        assert!(f.execs >= 1000, "{name}: only {} execs", f.execs);
    }
}
