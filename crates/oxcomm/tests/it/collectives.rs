//! The `CollectiveTester`: every collective × world sizes × counts × dtypes × ops ×
//! algorithms × segment sizes, with inputs whose results are exact, so every algorithm must
//! match the scalar reference bit for bit. Set `OXCOMM_TEST_FILTER=substring` to run only the
//! cases whose label contains it.

use half::{bf16, f16};
use oxcomm::dtype::{Bool, Complex128, Complex64, F8E4M3Fn, F8E4M3Fnuz, F8E5M2Fnuz, F8E8M0Fnu, F8E5M2};
use oxcomm::reduce::{scalar, ReduceOp};
use oxcomm::{threads, Algorithm, CommConfig, Communicator, DType, Element, OpOptions};

/// Dispatches a dtype value to a generic call.
macro_rules! with_dtype {
    ($d:expr, $f:ident ( $($arg:expr),* )) => {
        match $d {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::Bool => $f::<Bool>($($arg),*),
            DType::I16 => $f::<i16>($($arg),*),
            DType::U16 => $f::<u16>($($arg),*),
            DType::U32 => $f::<u32>($($arg),*),
            DType::U64 => $f::<u64>($($arg),*),
            DType::C64 => $f::<Complex64>($($arg),*),
            DType::C128 => $f::<Complex128>($($arg),*),
            DType::F8E4M3Fn => $f::<F8E4M3Fn>($($arg),*),
            DType::F8E5M2 => $f::<F8E5M2>($($arg),*),
            DType::F8E4M3Fnuz => $f::<F8E4M3Fnuz>($($arg),*),
            DType::F8E5M2Fnuz => $f::<F8E5M2Fnuz>($($arg),*),
            DType::F8E8M0Fnu => $f::<F8E8M0Fnu>($($arg),*),
        }
    };
}

/// The dtypes of the first matrix (the ones that ran before bool, the 16-bit and unsigned
/// integers, complex and float8 came; `tests/it/dtypes.rs` runs those on a smaller matrix).
pub const BASE_DTYPES: [DType; 8] =
    [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I32, DType::I64];

/// The input of `rank` at element `i` for `op`: small integers, so every sum, product, min
/// and max is exact in every dtype (products stay ≤ 256, sums ≤ 8 × 5). Complex inputs get a
/// small imaginary part too (in {-1, 0, 1} for products, so they stay exact Gaussian
/// integers), bools are false at about a third of the elements.
pub fn input<T: Element>(rank: usize, i: usize, op: ReduceOp) -> T {
    if T::DTYPE == DType::Bool {
        return T::from_f64(((rank * 7 + i * 5) % 3 != 0) as u8 as f64);
    }
    let v = match op {
        ReduceOp::Prod => {
            if (rank + i) % 3 == 0 {
                2
            } else {
                1
            }
        }
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => (rank * 37 + i * 11) % 64,
        _ => ((rank + 1) * 3 + i * 7) % 5 + 1 + (i % 2) * rank,
    };
    let mut x = T::from_f64(v as f64);
    let im = match op {
        ReduceOp::Prod => ((rank * 5 + i * 3) % 3) as f64 - 1.0,
        _ => ((rank * 5 + i * 3) % 7) as f64,
    };
    match T::DTYPE {
        DType::C64 => bytemuck::cast_mut::<T, Complex64>(&mut x).im = im as f32,
        DType::C128 => bytemuck::cast_mut::<T, Complex128>(&mut x).im = im,
        _ => {}
    }
    x
}

fn inputs<T: Element>(rank: usize, count: usize, op: ReduceOp) -> Vec<T> {
    (0..count).map(|i| input(rank, i, op)).collect()
}

/// The reference result: ranks' inputs reduced in rank order with the scalar kernel.
pub fn expected<T: Element>(size: usize, count: usize, op: ReduceOp) -> Vec<T> {
    let mut acc = inputs::<T>(0, count, op);
    for r in 1..size {
        scalar::reduce_into(&mut acc, &inputs::<T>(r, count, op), op);
    }
    if op == ReduceOp::Avg && size > 1 {
        scalar::divide(&mut acc, size);
    }
    acc
}

fn same<T: Element>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| bytemuck::bytes_of(x) == bytemuck::bytes_of(y))
}

/// Builder over the matrix; each `run_*` goes over every configured case.
#[derive(Clone)]
pub struct CollectiveTester {
    worlds: Vec<usize>,
    counts: Vec<usize>,
    dtypes: Vec<DType>,
    segments: Vec<usize>,
    /// When set, thread ranks are placed on these simulated hosts (one world per layout)
    /// instead of running `worlds`.
    layouts: Vec<Vec<usize>>,
    /// Whether `worlds` run over TCP links on loopback instead of in-process links.
    tcp: bool,
    filter: Option<String>,
}

impl CollectiveTester {
    pub fn new() -> Self {
        CollectiveTester {
            worlds: vec![1, 2, 3, 4, 5, 7, 8],
            counts: vec![0, 1, 7, 1000, 65537],
            dtypes: BASE_DTYPES.to_vec(),
            segments: vec![1 << 20, 64],
            layouts: Vec::new(),
            tcp: false,
            filter: std::env::var("OXCOMM_TEST_FILTER").ok(),
        }
    }

    pub fn worlds(mut self, w: &[usize]) -> Self {
        self.worlds = w.to_vec();
        self
    }

    pub fn counts(mut self, c: &[usize]) -> Self {
        self.counts = c.to_vec();
        self
    }

    pub fn segments(mut self, s: &[usize]) -> Self {
        self.segments = s.to_vec();
        self
    }

    pub fn dtypes(mut self, d: &[DType]) -> Self {
        self.dtypes = d.to_vec();
        self
    }

    /// Runs each case on thread ranks placed on simulated hosts: `layouts[i][r]` is the host
    /// of rank `r` in world `i` (see `threads::run_on_hosts`).
    pub fn layouts(mut self, l: &[&[usize]]) -> Self {
        self.layouts = l.iter().map(|h| h.to_vec()).collect();
        self
    }

    /// Runs each world's ranks over TCP links on loopback (threads of this process), where
    /// the small all-reduce folds its agreement into its data.
    #[cfg(unix)]
    pub fn over_tcp(mut self) -> Self {
        self.tcp = true;
        self
    }

    fn wants(&self, label: &str) -> bool {
        self.filter.as_ref().is_none_or(|f| label.contains(f.as_str()))
    }

    /// Cases for one rank; big counts only for a few dtypes and ops to keep the suite short.
    fn cases(&self, ops_of: impl Fn(DType) -> Vec<ReduceOp>) -> Vec<(usize, DType, ReduceOp, usize)> {
        let mut v = Vec::new();
        for &count in &self.counts {
            for &d in &self.dtypes {
                for op in ops_of(d) {
                    for &seg in &self.segments {
                        let big = count > 10_000;
                        if big
                            && !(matches!(d, DType::F32 | DType::BF16 | DType::I64)
                                && matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Avg))
                        {
                            continue;
                        }
                        // Tiny segments on big buffers cost time without covering more code.
                        if big && seg < 4096 && d != DType::F32 {
                            continue;
                        }
                        v.push((count, d, op, seg));
                    }
                }
            }
        }
        v
    }

    fn each_world(&self, f: impl Fn(Communicator) -> Vec<String> + Sync) {
        let config = CommConfig { timeout: std::time::Duration::from_secs(60), ..CommConfig::default() };
        let worlds: Vec<(String, Vec<usize>)> = if self.layouts.is_empty() {
            self.worlds.iter().map(|&n| (format!("world {n}"), vec![0; n])).collect()
        } else {
            self.layouts.iter().map(|h| (format!("hosts {h:?}"), h.clone())).collect()
        };
        for (name, hosts) in worlds {
            #[cfg(unix)]
            if self.tcp {
                let failures: Vec<String> =
                    crate::tcp::run_on_tcp(hosts.len(), config.clone(), &f).into_iter().flatten().collect();
                assert!(failures.is_empty(), "{name} over TCP: {} failing cases, first: {:#?}", failures.len(), {
                    &failures[..failures.len().min(5)]
                });
                continue;
            }
            let failures = if self.layouts.is_empty() {
                threads::run_with(hosts.len(), config.clone(), &f)
            } else {
                threads::run_on_hosts(&hosts, config.clone(), &f)
            }
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let failures: Vec<String> = failures.into_iter().flatten().collect();
            assert!(
                failures.is_empty(),
                "{name}: {} failing cases, first: {:#?}",
                failures.len(),
                &failures[..failures.len().min(5)]
            );
        }
    }

    /// Runs the all_reduce cases on one rank; returns the failures.
    pub fn rank_all_reduce(&self, comm: &Communicator) -> Vec<String> {
        let cases = self.cases(|d| ReduceOp::ALL.into_iter().filter(|o| o.fits(d)).collect());
        let comm = comm.clone();
        let mut bad = Vec::new();
        for &(count, d, op, seg) in &cases {
            for algo in [
                Algorithm::Ring,
                Algorithm::RecursiveDoubling,
                Algorithm::HalvingDoubling,
                Algorithm::Star,
                Algorithm::ShmDirect,
                Algorithm::Hierarchical,
            ] {
                if algo == Algorithm::ShmDirect && comm.transport() != oxcomm::Transport::Shm {
                    continue;
                }
                if algo == Algorithm::Hierarchical && comm.host_layout().is_none() {
                    continue;
                }
                let label = format!("all_reduce n={} {d} {op} count={count} {algo} seg={seg}", comm.size());
                if !self.wants(&label) {
                    continue;
                }
                let opts = OpOptions { algorithm: Some(algo), max_segment_bytes: Some(seg), ..Default::default() };
                if let Err(e) = with_dtype!(d, all_reduce_case(&comm, count, op, &opts)) {
                    bad.push(format!("{label}: {e}"));
                }
            }
        }
        bad
    }

    pub fn run_all_reduce(&self) {
        self.each_world(|comm| self.rank_all_reduce(&comm));
    }

    /// Runs the rooted cases on one rank; returns the failures.
    pub fn rank_rooted(&self, comm: &Communicator) -> Vec<String> {
        let cases = self.cases(|d| {
            ReduceOp::ALL
                .into_iter()
                .filter(|o| o.fits(d) && matches!(o, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max | ReduceOp::BXor))
                .collect()
        });
        let comm = comm.clone();
        let mut bad = Vec::new();
        for &(count, d, op, seg) in &cases {
            let n = comm.size();
            let roots: Vec<usize> = if n <= 4 { (0..n).collect() } else { vec![0, n / 2, n - 1] };
            for root in roots {
                let label = format!("rooted n={} {d} {op} count={count} root={root} seg={seg}", comm.size());
                if !self.wants(&label) {
                    continue;
                }
                let opts = OpOptions { max_segment_bytes: Some(seg), ..Default::default() };
                if let Err(e) = with_dtype!(d, rooted_case(&comm, count, op, root, &opts)) {
                    bad.push(format!("{label}: {e}"));
                }
            }
        }
        bad
    }

    pub fn run_rooted(&self) {
        self.each_world(|comm| self.rank_rooted(&comm));
    }

    /// Runs the gather_scatter cases on one rank; returns the failures.
    pub fn rank_gather_scatter(&self, comm: &Communicator) -> Vec<String> {
        let cases = self.cases(|_| vec![ReduceOp::Sum]);
        let comm = comm.clone();
        let mut bad = Vec::new();
        for &(count, d, _, seg) in &cases {
            let label = format!("gather/scatter/all_gather/all_to_all n={} {d} count={count} seg={seg}", comm.size());
            if !self.wants(&label) {
                continue;
            }
            let opts = OpOptions { max_segment_bytes: Some(seg), ..Default::default() };
            if let Err(e) = with_dtype!(d, movement_case(&comm, count, &opts)) {
                bad.push(format!("{label}: {e}"));
            }
        }
        bad
    }

    pub fn run_gather_scatter(&self) {
        self.each_world(|comm| self.rank_gather_scatter(&comm));
    }

    /// Runs `case` on one rank for every case of `cases` whose label `label(d, op, count)`
    /// (completed with the algorithm and segment size) the filter wants, with every algorithm
    /// that can run all_gather and reduce_scatter on `comm` forced (direct on shm, hierarchical
    /// when the world spans hosts evenly), so each one the planner may pick is tested; returns
    /// the failures.
    fn rank_block_op(
        &self,
        comm: &Communicator,
        cases: &[(usize, DType, ReduceOp, usize)],
        label: impl Fn(DType, ReduceOp, usize) -> String,
        case: impl Fn(DType, ReduceOp, usize, &OpOptions) -> Result<(), String>,
    ) -> Vec<String> {
        let mut algos = vec![Algorithm::Ring];
        if comm.transport() == oxcomm::Transport::Shm {
            algos.push(Algorithm::ShmDirect);
        }
        if comm.host_layout().is_some() {
            algos.push(Algorithm::Hierarchical);
        }
        let mut bad = Vec::new();
        for &(count, d, op, seg) in cases {
            for &algo in &algos {
                // The direct path has no segments.
                if algo == Algorithm::ShmDirect && seg < 4096 {
                    continue;
                }
                let label = format!("{} {algo} seg={seg}", label(d, op, count));
                if !self.wants(&label) {
                    continue;
                }
                let opts = OpOptions { algorithm: Some(algo), max_segment_bytes: Some(seg), ..Default::default() };
                if let Err(e) = case(d, op, count, &opts) {
                    bad.push(format!("{label}: {e}"));
                }
            }
        }
        bad
    }

    /// Runs the all_gather cases on one rank (every algorithm, out of place and in place);
    /// returns the failures.
    pub fn rank_all_gather(&self, comm: &Communicator) -> Vec<String> {
        let cases = self.cases(|_| vec![ReduceOp::Sum]);
        self.rank_block_op(
            comm,
            &cases,
            |d, _, count| format!("all_gather n={} {d} block={count}", comm.size()),
            |d, _, count, opts| with_dtype!(d, all_gather_case(comm, count, opts)),
        )
    }

    pub fn run_all_gather(&self) {
        self.each_world(|comm| self.rank_all_gather(&comm));
    }

    /// Runs the reduce_scatter cases on one rank (every algorithm, out of place and in
    /// place); returns the failures. Blocks above 10 000 elements only where the direct path
    /// runs (on threads they add minutes and no code).
    pub fn rank_reduce_scatter(&self, comm: &Communicator) -> Vec<String> {
        let mut cases = self.cases(|d| ReduceOp::ALL.into_iter().filter(|o| o.fits(d)).collect());
        cases.retain(|c| c.0 <= 10_000 || comm.transport() == oxcomm::Transport::Shm);
        self.rank_block_op(
            comm,
            &cases,
            |d, op, count| format!("reduce_scatter n={} {d} {op} block={count}", comm.size()),
            |d, op, count, opts| with_dtype!(d, reduce_scatter_case(comm, count, op, opts)),
        )
    }

    pub fn run_reduce_scatter(&self) {
        self.each_world(|comm| self.rank_reduce_scatter(&comm));
    }
}

fn check<T: Element>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if same(got, want) {
        Ok(())
    } else {
        let i = got.iter().zip(want).position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b)).unwrap_or(0);
        Err(format!(
            "{what}: wrong at {i}: got {:?}, want {:?} (len {} vs {})",
            got.get(i),
            want.get(i),
            got.len(),
            want.len()
        ))
    }
}

fn all_reduce_case<T: Element>(
    comm: &Communicator,
    count: usize,
    op: ReduceOp,
    opts: &OpOptions,
) -> Result<(), String> {
    let mut buf = inputs::<T>(comm.rank(), count, op);
    comm.all_reduce_with(&mut buf, op, opts).map_err(|e| e.to_string())?;
    let want = expected::<T>(comm.size(), count, op);
    check("all_reduce", &buf, &want)?;
    // Once more with even ranks out of place (into an output full of garbage) and odd ranks
    // in place, in the same op.
    let input = inputs::<T>(comm.rank(), count, op);
    if comm.rank() % 2 == 0 {
        let mut output = vec![T::from_f64(77.0); count];
        comm.all_reduce_into_with(&input, &mut output, op, opts).map_err(|e| e.to_string())?;
        check("all_reduce_into (input untouched)", &input, &inputs::<T>(comm.rank(), count, op))?;
        check("all_reduce_into", &output, &want)
    } else {
        let mut buf = input;
        comm.all_reduce_with(&mut buf, op, opts).map_err(|e| e.to_string())?;
        check("all_reduce beside all_reduce_into", &buf, &want)
    }
}

/// The algorithms of `algos` that can run on `comm`: the direct one only over shm.
fn runnable(comm: &Communicator, algos: &[Algorithm]) -> Vec<Algorithm> {
    algos.iter().copied().filter(|a| *a != Algorithm::ShmDirect || comm.transport() == oxcomm::Transport::Shm).collect()
}

/// `opts` forcing `algo`.
fn forcing(opts: &OpOptions, algo: Algorithm) -> OpOptions {
    OpOptions { algorithm: Some(algo), ..opts.clone() }
}

fn rooted_case<T: Element>(
    comm: &Communicator,
    count: usize,
    op: ReduceOp,
    root: usize,
    opts: &OpOptions,
) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    for algo in runnable(comm, &[Algorithm::BinomialTree, Algorithm::ShmDirect]) {
        let mut buf = inputs::<T>(r, count, op);
        comm.reduce_with(&mut buf, root, op, &forcing(opts, algo)).map_err(|e| format!("reduce {algo}: {e}"))?;
        if r == root {
            check(&format!("reduce {algo}"), &buf, &expected::<T>(n, count, op))?;
        } else {
            check(&format!("reduce {algo} (non-root unchanged)"), &buf, &inputs::<T>(r, count, op))?;
        }
        // Out of place into garbage, the root's input left as it was; odd ranks in place in the same op.
        let input = inputs::<T>(r, count, op);
        let mut out = vec![T::from_f64(77.0); count];
        let res = if r % 2 == 1 && r != root {
            let mut buf = input.clone();
            comm.reduce_with(&mut buf, root, op, &forcing(opts, algo))
        } else {
            comm.reduce_into_with(&input, (r == root).then_some(&mut out[..]), root, op, &forcing(opts, algo))
        };
        res.map_err(|e| format!("reduce_into {algo}: {e}"))?;
        check(&format!("reduce_into {algo} (input untouched)"), &input, &inputs::<T>(r, count, op))?;
        if r == root {
            check(&format!("reduce_into {algo}"), &out, &expected::<T>(n, count, op))?;
        }
    }
    let mut b = if r == root { inputs::<T>(root + 100, count, op) } else { vec![T::default(); count] };
    comm.broadcast_with(&mut b, root, opts).map_err(|e| e.to_string())?;
    check("broadcast", &b, &inputs::<T>(root + 100, count, op))
}

fn movement_case<T: Element>(comm: &Communicator, count: usize, opts: &OpOptions) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let op = ReduceOp::Sum;
    let mine = inputs::<T>(r, count, op);
    let all: Vec<T> = (0..n).flat_map(|p| inputs::<T>(p, count, op)).collect();
    // all_gather
    let mut out = vec![T::default(); n * count];
    comm.all_gather_with(&mine, &mut out, opts).map_err(|e| e.to_string())?;
    check("all_gather", &out, &all)?;
    // gather and scatter at every root, with every algorithm that runs them
    for algo in runnable(comm, &[Algorithm::Flat, Algorithm::ShmDirect]) {
        let opts = &forcing(opts, algo);
        for root in 0..n {
            let mut g = vec![T::default(); n * count];
            comm.gather_with(&mine, (r == root).then_some(&mut g[..]), root, opts)
                .map_err(|e| format!("gather {algo} root={root}: {e}"))?;
            if r == root {
                check(&format!("gather {algo} root={root}"), &g, &all)?;
            }
            let mut s = vec![T::default(); count];
            comm.scatter_with((r == root).then_some(&all[..]), &mut s, root, opts)
                .map_err(|e| format!("scatter {algo} root={root}: {e}"))?;
            check(&format!("scatter {algo} root={root}"), &s, &mine)?;
            // In place at the root; the others mix both forms in the same op.
            let garbage = T::from_f64(77.0);
            let mut g = if r == root { vec![garbage; n * count] } else { mine.clone() };
            if r == root {
                g[r * count..(r + 1) * count].copy_from_slice(&mine);
            }
            let res = if r == root || r % 2 == 0 {
                comm.gather_in_place_with(&mut g, root, opts)
            } else {
                comm.gather_with(&mine, None, root, opts)
            };
            res.map_err(|e| format!("gather_in_place {algo} root={root}: {e}"))?;
            let want = if r == root { &all[..] } else { &mine[..] };
            check(&format!("gather_in_place {algo} root={root}"), &g, want)?;
            let mut s = if r == root { all.clone() } else { vec![garbage; count] };
            let res = if r == root || r % 2 == 0 {
                comm.scatter_in_place_with(&mut s, root, opts)
            } else {
                comm.scatter_with(None, &mut s, root, opts)
            };
            res.map_err(|e| format!("scatter_in_place {algo} root={root}: {e}"))?;
            let want = if r == root { &all[..] } else { &mine[..] };
            check(&format!("scatter_in_place {algo} root={root}"), &s, want)?;
        }
    }
    for algo in runnable(comm, &[Algorithm::Pairwise, Algorithm::ShmDirect]) {
        let opts = &forcing(opts, algo);
        // all_to_all: block p of rank r's send is input(r*n + p)
        let send: Vec<T> = (0..n).flat_map(|p| inputs::<T>(r * n + p, count, op)).collect();
        let mut recv = vec![T::default(); n * count];
        comm.all_to_all_with(&send, &mut recv, opts).map_err(|e| format!("all_to_all {algo}: {e}"))?;
        let want: Vec<T> = (0..n).flat_map(|p| inputs::<T>(p * n + r, count, op)).collect();
        check(&format!("all_to_all {algo}"), &recv, &want)?;
        // Even ranks in place, odd ranks apart, in the same op.
        let mut buf = send.clone();
        let res = if r % 2 == 0 {
            comm.all_to_all_in_place_with(&mut buf, opts)
        } else {
            comm.all_to_all_with(&send, &mut buf, opts)
        };
        res.map_err(|e| format!("all_to_all_in_place {algo}: {e}"))?;
        check(&format!("all_to_all_in_place {algo}"), &buf, &want)?;
        // all_to_all_v with uneven counts: rank a sends (a + b) % 3 * count/2 elements to b
        // (zeros included); then only rank 0 sends much, to the last rank (one big pair).
        let uneven = |a: usize, b: usize| (a + b) % 3 * (count / 2);
        let big_pair = |a: usize, b: usize| if (a, b) == (0, n - 1) { 2 * count + 1 } else { a * b % 2 };
        for (what, len) in [("uneven", &uneven as &dyn Fn(usize, usize) -> usize), ("big pair", &big_pair)] {
            let send_counts: Vec<usize> = (0..n).map(|p| len(r, p)).collect();
            let recv_counts: Vec<usize> = (0..n).map(|p| len(p, r)).collect();
            let send: Vec<T> = (0..n).flat_map(|p| inputs::<T>(r * n + p, len(r, p), op)).collect();
            let mut recv = vec![T::default(); recv_counts.iter().sum()];
            comm.all_to_all_v_with(&send, &send_counts, &mut recv, &recv_counts, opts)
                .map_err(|e| format!("all_to_all_v {what} {algo}: {e}"))?;
            let want: Vec<T> = (0..n).flat_map(|p| inputs::<T>(p * n + r, len(p, r), op)).collect();
            check(&format!("all_to_all_v {what} {algo}"), &recv, &want)?;
        }
    }
    Ok(())
}

/// All-gather out of place (into garbage), then once more with even ranks in place and odd
/// ranks out of place in the same op.
fn all_gather_case<T: Element>(comm: &Communicator, block: usize, opts: &OpOptions) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let op = ReduceOp::Sum;
    let mine = inputs::<T>(r, block, op);
    let all: Vec<T> = (0..n).flat_map(|p| inputs::<T>(p, block, op)).collect();
    let mut out = vec![T::from_f64(77.0); n * block];
    comm.all_gather_with(&mine, &mut out, opts).map_err(|e| e.to_string())?;
    check("all_gather", &out, &all)?;
    check("all_gather (input untouched)", &mine, &inputs::<T>(r, block, op))?;
    if r % 2 == 0 {
        let mut buf = vec![T::from_f64(77.0); n * block];
        buf[r * block..(r + 1) * block].copy_from_slice(&mine);
        comm.all_gather_in_place_with(&mut buf, opts).map_err(|e| e.to_string())?;
        check("all_gather_in_place", &buf, &all)
    } else {
        let mut out = vec![T::from_f64(77.0); n * block];
        comm.all_gather_with(&mine, &mut out, opts).map_err(|e| e.to_string())?;
        check("all_gather beside all_gather_in_place", &out, &all)
    }
}

/// Reduce-scatter out of place (into garbage), then once more with even ranks in place and
/// odd ranks out of place in the same op.
fn reduce_scatter_case<T: Element>(
    comm: &Communicator,
    block: usize,
    op: ReduceOp,
    opts: &OpOptions,
) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let input = inputs::<T>(r, block * n, op);
    let mut out = vec![T::from_f64(77.0); block];
    comm.reduce_scatter_with(&input, &mut out, op, opts).map_err(|e| e.to_string())?;
    let full = expected::<T>(n, block * n, op);
    let want = &full[r * block..(r + 1) * block];
    check("reduce_scatter", &out, want)?;
    check("reduce_scatter (input untouched)", &input, &inputs::<T>(r, block * n, op))?;
    if r % 2 == 0 {
        let mut buf = input;
        comm.reduce_scatter_in_place_with(&mut buf, op, opts).map_err(|e| e.to_string())?;
        check("reduce_scatter_in_place", &buf[r * block..(r + 1) * block], want)
    } else {
        let mut out = vec![T::from_f64(77.0); block];
        comm.reduce_scatter_with(&input, &mut out, op, opts).map_err(|e| e.to_string())?;
        check("reduce_scatter beside reduce_scatter_in_place", &out, want)
    }
}

#[test]
fn all_reduce_matrix_small_worlds() {
    CollectiveTester::new().worlds(&[1, 2, 3]).run_all_reduce();
}

#[test]
fn all_reduce_matrix_4_5() {
    CollectiveTester::new().worlds(&[4, 5]).run_all_reduce();
}

#[test]
fn all_reduce_matrix_7_8() {
    CollectiveTester::new().worlds(&[7, 8]).run_all_reduce();
}

/// Over TCP, where recursive doubling folds its agreement into its data (issue 40), every
/// all-reduce algorithm (halving-doubling among them) on exact data; 3, 5 and 6 ranks have
/// extras that fold into proxies.
#[cfg(unix)]
#[test]
fn all_reduce_matrix_over_tcp() {
    CollectiveTester::new()
        .worlds(&[2, 3, 4, 5, 6])
        .counts(&[0, 1, 7, 1000, 20_000])
        .dtypes(&[DType::F32, DType::I64, DType::U8, DType::BF16])
        .over_tcp()
        .run_all_reduce();
}

#[test]
fn rooted_matrix() {
    CollectiveTester::new().run_rooted();
}

#[test]
fn movement_matrix() {
    CollectiveTester::new().run_gather_scatter();
}

#[test]
fn all_gather_matrix() {
    CollectiveTester::new().run_all_gather();
}

#[test]
fn reduce_scatter_matrix() {
    CollectiveTester::new().run_reduce_scatter();
}

/// Thread ranks on simulated hosts: the planner picks the hierarchical algorithms for
/// all_gather, reduce_scatter and broadcast, and all_reduce runs them forced (all_gather and
/// reduce_scatter also run every algorithm forced); uneven layouts
/// fall back to the flat ones. Every result is exact.
#[test]
fn hierarchical_matrix() {
    let layouts: &[&[usize]] = &[&[0, 0, 1, 1], &[4, 9, 4, 9, 4, 9], &[0, 0, 0, 1, 1, 1, 2, 2, 2], &[0, 0, 1]];
    let t = CollectiveTester::new().layouts(layouts).dtypes(&[DType::F32, DType::BF16, DType::I32, DType::U8]);
    t.clone().run_all_reduce();
    t.clone().run_rooted();
    t.clone().run_gather_scatter();
    t.clone().run_all_gather();
    t.run_reduce_scatter();
}

#[test]
fn hierarchical_plan_and_layout() {
    let hosts = [0usize, 0, 1, 1];
    let out = threads::run_on_hosts(&hosts, CommConfig::default(), |comm| {
        let layout = comm.host_layout().cloned();
        let forced = OpOptions { algorithm: Some(Algorithm::Hierarchical), ..Default::default() };
        // A sub-group inside one host has no hierarchy: forcing it is an argument error.
        let pair = comm.split(Some(comm.rank() as u32 / 2), 0).unwrap().unwrap();
        let mut b = vec![1.0f32; 4];
        let err = pair.all_reduce_with(&mut b, ReduceOp::Sum, &forced).unwrap_err();
        // A cross-host sub-group with one rank per host has none either.
        let across = comm.split(Some(comm.rank() as u32 % 2), 0).unwrap().unwrap();
        (comm.hosts(), layout.map(|l| (l.num_hosts(), l.ranks_per_host())), err.kind(), across.host_layout().is_none())
    })
    .unwrap();
    for (hosts, layout, kind, flat) in out {
        assert_eq!(hosts, vec![0, 0, 1, 1]);
        assert_eq!(layout, Some((2, 2)));
        assert_eq!(kind, oxcomm::ErrorKind::InvalidArgument);
        assert!(flat);
    }
}

#[test]
fn all_reduce_into_rejects_unequal_lengths_before_sending() {
    let out = threads::run(2, |comm| {
        let mut short = vec![0.0f32; 3];
        let err = comm.all_reduce_into(&[1.0f32; 4], &mut short, ReduceOp::Sum).unwrap_err();
        // Nothing was sent: the next op still pairs up.
        let mut ok = [comm.rank() as f32; 2];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        (err.kind(), err.to_string(), short, ok)
    })
    .unwrap();
    for (kind, msg, short, ok) in out {
        assert_eq!(kind, oxcomm::ErrorKind::InvalidArgument);
        assert!(msg.contains("all_reduce") && msg.contains("must be equal"), "{msg}");
        assert_eq!((short, ok), (vec![0.0; 3], [1.0; 2]));
    }
}

#[test]
fn in_place_all_to_all_gather_scatter_reject_ragged_buffers_before_sending() {
    let out = threads::run(2, |comm| {
        let mut ragged = vec![1.0f32; 3];
        let all_to_all = comm.all_to_all_in_place(&mut ragged).unwrap_err();
        // Only the root's buffer holds every block (a non-root's is its own block, any
        // length), so only the root can tell: it alone calls here.
        let me = comm.rank();
        let gather = (me == 0).then(|| comm.gather_in_place(&mut ragged, 0));
        let scatter = (me == 1).then(|| comm.scatter_in_place(&mut ragged, 1));
        // Nothing was sent: the next op still pairs up.
        let mut ok = [me as f32; 2];
        comm.all_to_all_in_place(&mut ok).unwrap();
        (all_to_all, gather.and_then(Result::err), scatter.and_then(Result::err), ok)
    })
    .unwrap();
    let (r0, r1) = (&out[0], &out[1]);
    for e in [&r0.0, &r1.0, r0.1.as_ref().unwrap(), r1.2.as_ref().unwrap()] {
        assert_eq!(e.kind(), oxcomm::ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("multiple of the group size"), "{e}");
    }
    assert_eq!(r0.3, [0.0, 1.0]);
    assert_eq!(r1.3, [0.0, 1.0]);
}

#[test]
fn in_place_all_gather_and_reduce_scatter_reject_ragged_buffers_before_sending() {
    let out = threads::run(2, |comm| {
        let mut ragged = vec![1.0f32; 3];
        let gather = comm.all_gather_in_place(&mut ragged).unwrap_err();
        let scatter = comm.reduce_scatter_in_place(&mut ragged, ReduceOp::Sum).unwrap_err();
        // Nothing was sent: the next op still pairs up.
        let mut ok = [comm.rank() as f32; 2];
        comm.reduce_scatter_in_place(&mut ok, ReduceOp::Sum).unwrap();
        (gather, scatter, ragged, ok[comm.rank()])
    })
    .unwrap();
    for (gather, scatter, ragged, ok) in out {
        for (e, op) in [(gather, "all_gather"), (scatter, "reduce_scatter")] {
            assert_eq!(e.kind(), oxcomm::ErrorKind::InvalidArgument);
            assert!(e.to_string().contains(op) && e.to_string().contains("multiple of the group size"), "{e}");
        }
        assert_eq!((ragged, ok), (vec![1.0; 3], 1.0));
    }
}

/// Issue 15: async ops take any owned buffer (here `Box<[T]>` and a caller's wrapper) and
/// cover gather, scatter, all_to_all_v and the coalesced ops; results are exact.
#[test]
fn async_ops_take_any_owned_buffer() {
    struct Wrapped(Vec<i32>);
    impl AsRef<[i32]> for Wrapped {
        fn as_ref(&self) -> &[i32] {
            &self.0
        }
    }
    impl AsMut<[i32]> for Wrapped {
        fn as_mut(&mut self) -> &mut [i32] {
            &mut self.0
        }
    }
    let n = 3;
    let out = threads::run(n, |comm| {
        let r = comm.rank() as i32;
        let me = comm.rank();
        let summed = comm.all_reduce_async(vec![r; 4].into_boxed_slice(), ReduceOp::Sum);
        let bcast = comm.broadcast_async(Wrapped(vec![r; 2]), 1);
        let gathered = comm.all_gather_into_async(Wrapped(vec![r]), vec![0; n]);
        let root_out = (me == 0).then(|| vec![0; 2 * n].into_boxed_slice());
        let gather = comm.gather_async(vec![r, r], root_out, 0);
        let root_in = (me == 2).then(|| Wrapped((0..n as i32).collect()));
        let scatter = comm.scatter_async(root_in, vec![-1], 2);
        // Rank p sends p + 1 elements to every rank.
        let (send_counts, recv_counts) = (vec![me + 1; n], (1..=n).collect::<Vec<_>>());
        let a2av = comm.all_to_all_v_async(vec![r; (me + 1) * n], send_counts, vec![0; n * (n + 1) / 2], recv_counts);
        let coalesced = comm.all_reduce_coalesced_async(vec![vec![r; 1], vec![1; 3]], ReduceOp::Sum);
        let ag_coalesced = comm.all_gather_coalesced_async(vec![vec![r], vec![r, r]], vec![vec![0; n], vec![0; 2 * n]]);
        let sent = comm.isend(vec![r; 2].into_boxed_slice(), (me + 1) % n, 7);
        let received = comm.irecv(Wrapped(vec![0; 2]), (me + n - 1) % n, 7);
        assert_eq!(&*summed.wait()?, &[3; 4]);
        assert_eq!(bcast.wait()?.0, vec![1; 2]);
        assert_eq!(gathered.wait()?.1, vec![0, 1, 2]);
        let (_, root_out) = gather.wait()?;
        if me == 0 {
            assert_eq!(&*root_out.expect("root"), &[0, 0, 1, 1, 2, 2]);
        }
        assert_eq!(scatter.wait()?.1, vec![r]);
        assert_eq!(a2av.wait()?.1, vec![0, 1, 1, 2, 2, 2]);
        assert_eq!(coalesced.wait()?, vec![vec![3], vec![3; 3]]);
        assert_eq!(ag_coalesced.wait()?.1, vec![vec![0, 1, 2], vec![0, 0, 1, 1, 2, 2]]);
        assert_eq!(&*sent.wait()?, &[r; 2]);
        assert_eq!(received.wait()?.0, vec![(r + n as i32 - 1) % n as i32; 2]);
        Ok::<_, oxcomm::Error>(())
    })
    .unwrap();
    for r in out {
        r.unwrap();
    }
}

/// `Avg` is finished by the communicator, once, for every reduction (the backend reduces with
/// the combiner): all_reduce in place and apart, reduce at the root only (the others' buffers
/// unchanged), reduce_scatter in place and apart, and all_reduce_coalesced on every buffer.
#[test]
fn avg_is_finished_once_by_every_reduction() {
    let n = 4;
    let out = threads::run(n, |comm| {
        let me = comm.rank();
        // Rank r contributes 4·(r + 1): the sum is 40, the average 10.
        let mine = 4 * (me as i32 + 1);
        let avg = ReduceOp::Avg;
        let mut buf = vec![mine; 6];
        comm.all_reduce(&mut buf, avg)?;
        assert_eq!(buf, vec![10; 6]);
        let mut out = vec![0; 6];
        comm.all_reduce_into(&[mine; 6], &mut out, avg)?;
        assert_eq!(out, vec![10; 6]);
        let mut buf = vec![mine; 3];
        comm.reduce(&mut buf, 1, avg)?;
        assert_eq!(buf, vec![if me == 1 { 10 } else { mine }; 3]);
        let mut root_out = vec![0; 3];
        comm.reduce_into(&[mine; 3], (me == 2).then_some(&mut root_out[..]), 2, avg)?;
        assert_eq!(root_out, vec![if me == 2 { 10 } else { 0 }; 3]);
        let mut block = vec![0; 2];
        comm.reduce_scatter(&vec![mine; 2 * n], &mut block, avg)?;
        assert_eq!(block, vec![10; 2]);
        let mut whole = vec![mine; 2 * n];
        comm.reduce_scatter_in_place(&mut whole, avg)?;
        assert_eq!(whole[2 * me..2 * me + 2], [10, 10]);
        let (mut a, mut b) = (vec![mine; 5], vec![2 * mine; 1]);
        comm.all_reduce_coalesced(&mut [&mut a[..], &mut b[..]], avg)?;
        assert_eq!((a, b), (vec![10; 5], vec![20]));
        let mut f = vec![mine as f32 / 8.0; 9];
        comm.all_reduce(&mut f, avg)?;
        assert_eq!(f, vec![1.25; 9]);
        Ok::<_, oxcomm::Error>(())
    })
    .unwrap();
    for r in out {
        r.unwrap();
    }
}
