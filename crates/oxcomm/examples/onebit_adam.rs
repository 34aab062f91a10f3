//! Data-parallel training of a 2-layer MLP on 4 thread ranks, with exact Adam and with 1-bit
//! Adam (`oxcomm::compression::onebit::Adam`), side by side.
//!
//! The data is generated (no files): Gaussian inputs labelled ±1 by the sign of a small random
//! "teacher" MLP, with 5% of the labels flipped; every rank draws a fresh batch each step from
//! its own seeded stream and measures the loss on its own 1024 held-out samples. The student
//! is `logit = w2 · relu(W1 x + b1) + b2` trained on the logistic loss. Both runs see the same
//! batches; exact Adam is the same optimizer with the freeze step never reached. β2 defaults
//! to 0.99 (not DeepSpeed's 0.999) so that the variance has settled by the freeze step of a
//! run this short: with 0.999 and an early freeze, the frozen (not bias-corrected) variance
//! is still far too small and 1-bit Adam takes much larger steps than exact Adam.
//!
//! ```text
//! cargo run --release -p oxcomm --example onebit_adam
//! cargo run --release -p oxcomm --example onebit_adam -- --steps 1200 --freeze 400 --every 100
//! ```
//!
//! Flags (all optional): `--steps N` optimizer calls (default 800), `--freeze N` 1-bit Adam's
//! freeze step (default 300), `--lr X` (default 0.002), `--beta2 X` (default 0.99), `--batch N` samples per rank per step
//! (default 32), `--hidden N` hidden width (default 512), `--every N` print period (default
//! 50).

use std::process::ExitCode;
use std::time::Instant;

use oxcomm::compression::onebit::Adam;
use oxcomm::{threads, ReduceOp};

const RANKS: usize = 4;
const INPUTS: usize = 32;
/// Held-out samples per rank the loss is measured on.
const EVAL_PER_RANK: usize = 1024;

struct Args {
    steps: usize,
    freeze: u64,
    lr: f32,
    beta2: f32,
    batch: usize,
    hidden: usize,
    every: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { steps: 800, freeze: 300, lr: 2e-3, beta2: 0.99, batch: 32, hidden: 512, every: 50 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--steps" => a.steps = value.parse().map_err(|e| bad(&e))?,
            "--freeze" => a.freeze = value.parse().map_err(|e| bad(&e))?,
            "--lr" => a.lr = value.parse().map_err(|e| bad(&e))?,
            "--beta2" => a.beta2 = value.parse().map_err(|e| bad(&e))?,
            "--batch" => a.batch = value.parse().map_err(|e| bad(&e))?,
            "--hidden" => a.hidden = value.parse().map_err(|e| bad(&e))?,
            "--every" => a.every = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag} (see the example's docs)")),
        }
    }
    if a.steps == 0 || a.batch == 0 || a.hidden == 0 || a.every == 0 {
        return Err("--steps, --batch, --hidden and --every must be positive".into());
    }
    Ok(a)
}

/// splitmix64: deterministic data without a crate.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// `Σ a[k]·b[k]` with 8 independent sums, so that the compiler can vectorize it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `logit = w2 · relu(W1 x + b1) + b2`, parameters flat as `[W1 (h × d), b1, w2, b2]`.
struct Mlp {
    d: usize,
    h: usize,
}

impl Mlp {
    fn len(&self) -> usize {
        self.h * self.d + 2 * self.h + 1
    }

    fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = Rng(seed);
        let mut p = vec![0f32; self.len()];
        let (w1, rest) = p.split_at_mut(self.h * self.d);
        w1.iter_mut().for_each(|w| *w = rng.normal() / (self.d as f32).sqrt());
        rest[self.h..2 * self.h].iter_mut().for_each(|w| *w = rng.normal() / (self.h as f32).sqrt());
        p
    }

    fn forward(&self, p: &[f32], x: &[f32], act: &mut [f32]) -> f32 {
        let (w1, rest) = p.split_at(self.h * self.d);
        let (b1, rest) = rest.split_at(self.h);
        let (w2, b2) = rest.split_at(self.h);
        let mut z = b2[0];
        for (j, (row, a)) in w1.chunks_exact(self.d).zip(act.iter_mut()).enumerate() {
            let pre = b1[j] + dot(row, x);
            *a = pre.max(0.0);
            z += w2[j] * *a;
        }
        z
    }

    /// Mean logistic loss (labels ±1); adds its gradient to `grad` if given.
    fn loss(&self, p: &[f32], xs: &[f32], ys: &[f32], mut grad: Option<&mut [f32]>) -> f32 {
        let (d, h) = (self.d, self.h);
        let w2 = &p[h * d + h..h * d + 2 * h];
        let mut act = vec![0f32; h];
        let mut total = 0f64;
        for (x, &y) in xs.chunks_exact(d).zip(ys) {
            let yz = y * self.forward(p, x, &mut act);
            total += f64::from(if yz > 0.0 { (-yz).exp().ln_1p() } else { -yz + yz.exp().ln_1p() });
            if let Some(g) = grad.as_deref_mut() {
                let dz = -y / (1.0 + yz.exp()) / ys.len() as f32;
                let (gw1, rest) = g.split_at_mut(h * d);
                let (gb1, rest) = rest.split_at_mut(h);
                let (gw2, gb2) = rest.split_at_mut(h);
                gb2[0] += dz;
                for (j, row) in gw1.chunks_exact_mut(d).enumerate() {
                    gw2[j] += dz * act[j];
                    let dpre = if act[j] > 0.0 { dz * w2[j] } else { 0.0 };
                    gb1[j] += dpre;
                    row.iter_mut().zip(x).for_each(|(g, x)| *g += dpre * x);
                }
            }
        }
        (total / ys.len() as f64) as f32
    }
}

/// Draws `count` samples: inputs and ±1 labels from the teacher, 5% flipped.
fn samples(count: usize, rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    let teacher = Mlp { d: INPUTS, h: 8 };
    let tp = teacher.init(77);
    let mut act = vec![0f32; teacher.h];
    let xs: Vec<f32> = (0..count * INPUTS).map(|_| rng.normal()).collect();
    let ys = xs
        .chunks_exact(INPUTS)
        .map(|x| {
            let y = if teacher.forward(&tp, x, &mut act) >= 0.0 { 1.0 } else { -1.0 };
            if rng.uniform() < 0.05 {
                -y
            } else {
                y
            }
        })
        .collect();
    (xs, ys)
}

/// What one training run reports (rank 0's view; all ranks hold the same parameters).
struct Run {
    /// `(step, mean training loss over the whole data set)` every `every` steps and at the end.
    curve: Vec<(usize, f32)>,
    /// Bytes rank 0 sent in each optimizer call.
    bytes: Vec<u64>,
    /// The first call that compressed (if any).
    first_compressed: Option<usize>,
}

fn train(args: &Args, mlp: &Mlp, freeze: u64) -> oxcomm::Result<Run> {
    let runs = threads::run(RANKS, |comm| -> oxcomm::Result<Run> {
        let (xs, ys) = samples(EVAL_PER_RANK, &mut Rng(1000 + comm.rank() as u64));
        let mut stream = Rng(2000 + comm.rank() as u64);
        let mut params = mlp.init(1);
        let mut adam = Adam::new(args.lr, freeze);
        adam.betas.1 = args.beta2;
        let mut grads = vec![0f32; mlp.len()];
        let mut run = Run { curve: Vec::new(), bytes: Vec::with_capacity(args.steps), first_compressed: None };
        let record = |step: usize, params: &[f32], run: &mut Run| -> oxcomm::Result<()> {
            let mut loss = [mlp.loss(params, &xs, &ys, None)];
            comm.all_reduce(&mut loss, ReduceOp::Avg)?;
            run.curve.push((step, loss[0]));
            Ok(())
        };
        record(0, &params, &mut run)?;
        for t in 0..args.steps {
            let (bx, by) = samples(args.batch, &mut stream);
            grads.fill(0.0);
            mlp.loss(&params, &bx, &by, Some(&mut grads));
            let before = comm.stats().bytes_sent;
            adam.step(&comm, &mut params, &mut grads)?;
            run.bytes.push(comm.stats().bytes_sent - before);
            if adam.is_compressing() && run.first_compressed.is_none() && adam.onebit_state().is_some() {
                run.first_compressed = Some(t + 1);
            }
            if (t + 1) % args.every == 0 || t + 1 == args.steps {
                record(t + 1, &params, &mut run)?;
            }
        }
        Ok(run)
    })?;
    runs.into_iter().next().expect("4 ranks")
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("onebit_adam: {e}");
            return ExitCode::from(2);
        }
    };
    let mlp = Mlp { d: INPUTS, h: args.hidden };
    println!(
        "2-layer MLP ({} → {} → 1, {} parameters), {RANKS} thread ranks, fresh batches of {}/rank, loss on {} held-out samples, \
         lr {}, {} steps; 1-bit Adam freezes at step {}",
        INPUTS,
        args.hidden,
        mlp.len(),
        args.batch,
        EVAL_PER_RANK * RANKS,
        args.lr,
        args.steps,
        args.freeze
    );
    let start = Instant::now();
    let result = train(&args, &mlp, u64::MAX).and_then(|exact| Ok((exact, train(&args, &mlp, args.freeze)?)));
    let (exact, onebit) = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("onebit_adam: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("\n{:>6}  {:>12}  {:>12}", "step", "exact Adam", "1-bit Adam");
    for ((step, a), (_, b)) in exact.curve.iter().zip(&onebit.curve) {
        let mark = if *step as u64 == args.freeze { "  ← freeze" } else { "" };
        println!("{step:>6}  {a:>12.5}  {b:>12.5}{mark}");
    }
    let exact_step = *exact.bytes.last().expect("at least one step");
    println!("\nbytes sent per step by rank 0:");
    println!("  exact all-reduce step:        {exact_step:>9} B");
    if let Some(first) = onebit.first_compressed {
        let compressed = onebit.bytes[first - 1];
        println!(
            "  1-bit compressed step:        {compressed:>9} B  ({:.1}× fewer; from step {first})",
            exact_step as f64 / compressed as f64
        );
        let total_exact: u64 = exact.bytes.iter().sum();
        let total_onebit: u64 = onebit.bytes.iter().sum();
        println!(
            "  whole run: exact {total_exact} B, 1-bit {total_onebit} B ({:.1}× fewer)",
            total_exact as f64 / total_onebit as f64
        );
    } else {
        println!("  (1-bit Adam never compressed: raise --steps above --freeze)");
    }
    let (a, b) = (exact.curve.last().expect("curve").1, onebit.curve.last().expect("curve").1);
    println!(
        "\nfinal loss: exact {a:.5}, 1-bit {b:.5}, ratio 1-bit/exact {:.4} ({:+.2}%)",
        b / a,
        (b / a - 1.0) * 100.0
    );
    println!("wall time {:.1} s", start.elapsed().as_secs_f64());
    ExitCode::SUCCESS
}
