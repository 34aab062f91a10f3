//! The cost model the planner chooses all-reduce algorithms with across hosts: each
//! algorithm's predicted time from the job's shape ([`Shape`]: hosts × ranks per host) and the
//! links' parameters ([`Network`]: alpha, the one-way time of a small message, and beta, the
//! time per byte), in the alpha-beta (Hockney) form `steps · α + bytes · β` that NCCL's tuner
//! and Open MPI's decision functions use.
//!
//! This file owns the formulas and [`best`]; [`super::plan`] asks it (with the network the
//! backend measured or was given) and `oxcomm plan` prints it. It knows nothing about links.
//!
//! # The formulas (S = bytes per rank, n = h · k ranks, h hosts of k ranks, in rank order)
//!
//! A step in which `f` ranks of a host each push `m` bytes through its link costs
//! `α + f · m · β` (the host's link is shared); a step inside a host costs `α_local + m · β_local`.
//! Ranks of a host are contiguous, so a step between ranks `d` apart crosses hosts when
//! `d ≥ k`.
//!
//! | algorithm | predicted time |
//! | --- | --- |
//! | ring | 2(n − 1) steps of S/n, each as slow as the host-crossing edge: 2(n − 1)(α + S/n · β) |
//! | rd (recursive doubling) | log2 p steps of S between ranks 2^i apart (p the largest power of two ≤ n); 2 more of S when n ≠ p |
//! | rhd (halving-doubling) | 2 · log2 p steps, of S/2, S/4, … between ranks p/2, p/4, … apart, and back; 2 more of S when n ≠ p |
//! | hier (k ≥ 2, h ≥ 2) | inside each host a ring reduce-scatter and all-gather (2(k − 1) local steps of S/k); across hosts k rings of S/k at once: 2(h − 1)(α + S/h · β), or recursive doubling of S/k when that is below 64 KiB |
//! | star | 2 steps; rank 0's link carries (n − 1) · S each way, and rank 0 handles its n − 1 messages one by one (α_local each) |
//!
//! Every algorithm but the folded recursive doubling pays the agreement phase first, one round
//! trip to rank 0: 2α. What the model leaves out: CPU time for reductions and copies, ranks that
//! share a core (measured one-way times include that), and TCP/IP headers (about 4.5% of the
//! bytes at MTU 1500). `docs/perf_many_hosts.md` checks it against the 2-16-host measurements.

use super::Algorithm;
use crate::error::{Error, Result};

/// The parameters of the links between hosts (and inside a host) that the model prices steps
/// with. All times in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// One-way time of a small message between ranks on different hosts (software included).
    pub alpha: f64,
    /// Seconds per byte through one host's link, each way (1 / bandwidth).
    pub beta: f64,
    /// One-way time of a small message between ranks of one host.
    pub alpha_local: f64,
    /// Seconds per byte between ranks of one host.
    pub beta_local: f64,
    /// A 256 KiB halving-doubling all-reduce's time over a ring's on these links, as measured
    /// when the job started (`NativeBackend::calibrate`); 1 when not measured. The planner
    /// lets halving-doubling compete with the ring above 64 KiB only where it measured
    /// clearly faster ([`HALVING_BEATS_RING`]): the model prices the two alike per byte, but
    /// on links that are the bottleneck the ring's pipelined steps keep them busier.
    pub halving_over_ring: f64,
}

/// [`Network::halving_over_ring`] at or below which halving-doubling competes with the ring
/// above 64 KiB: 10% faster at start-up. Measured by the benchmark (docs/perf_many_hosts.md),
/// 256 KiB halving-doubling took 0.57-0.81 of the ring's time on 8 hosts whose cores, not
/// their 10 Gbit/s links, set the pace (0.47-1.17 on 4), and 0.99-1.15 of it on tbf-shaped
/// 1 Gbit/s links (where the ring was up to 1.4× faster from 4 MiB); the start-up measurement
/// gave 0.87-1.04 and 0.93-1.11 there.
pub const HALVING_BEATS_RING: f64 = 0.9;

/// One-way time between hosts (µs) the planner assumes when the links were neither measured
/// nor described: a LAN's round trip through two kernels' TCP stacks, wake-ups included.
/// Env `OXCOMM_NET_ALPHA_US`.
pub const DEFAULT_ALPHA_US: f64 = 25.0;
/// Speed of each host's link (Gbit/s) the planner assumes likewise. Env `OXCOMM_NET_GBPS`.
pub const DEFAULT_GBIT_PER_S: f64 = 10.0;

impl Network {
    /// A network of `gbit_per_s` links with a one-way time of `alpha_us` µs between hosts,
    /// and shared memory inside a host (1 µs, 10 GB/s).
    pub fn new(alpha_us: f64, gbit_per_s: f64) -> Network {
        Network {
            alpha: alpha_us * 1e-6,
            beta: 8.0 / (gbit_per_s * 1e9),
            alpha_local: 1e-6,
            beta_local: 1e-10,
            halving_over_ring: 1.0,
        }
    }

    /// Whether halving-doubling measured clearly faster than the ring on these links (see
    /// [`Network::halving_over_ring`]).
    pub fn halving_beats_ring(&self) -> bool {
        self.halving_over_ring <= HALVING_BEATS_RING
    }

    /// The links' speed in Gbit/s.
    pub fn gbit_per_s(&self) -> f64 {
        8.0 / self.beta / 1e9
    }

    /// The network that `OXCOMM_NET_ALPHA_US` (one-way µs between hosts, default
    /// [`DEFAULT_ALPHA_US`]) and `OXCOMM_NET_GBPS` (Gbit/s of each host's link, default
    /// [`DEFAULT_GBIT_PER_S`]) describe, or `None` when neither is set: then a job across hosts
    /// measures its links when it starts (`OXCOMM_NET_CALIBRATE`, in `init.rs`).
    pub fn from_env() -> Result<Option<Network>> {
        Network::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Network::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Network>> {
        let read = |var: &str| -> Result<Option<f64>> {
            match get(var).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                    _ => Err(Error::invalid(format!("{var}={v:?} is not a positive number"))),
                },
            }
        };
        let (alpha, gbit) = (read("OXCOMM_NET_ALPHA_US")?, read("OXCOMM_NET_GBPS")?);
        if alpha.is_none() && gbit.is_none() {
            return Ok(None);
        }
        Ok(Some(Network::new(alpha.unwrap_or(DEFAULT_ALPHA_US), gbit.unwrap_or(DEFAULT_GBIT_PER_S))))
    }
}

impl Default for Network {
    /// [`DEFAULT_ALPHA_US`] and [`DEFAULT_GBIT_PER_S`].
    fn default() -> Network {
        Network::new(DEFAULT_ALPHA_US, DEFAULT_GBIT_PER_S)
    }
}

/// How a group sits on hosts: `hosts` hosts of `ranks_per_host` ranks each (contiguous).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Number of hosts (at least 1).
    pub hosts: usize,
    /// Ranks on each host (at least 1).
    pub ranks_per_host: usize,
}

impl Shape {
    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.hosts * self.ranks_per_host
    }
}

/// The all-reduce algorithms the planner chooses among, in the order [`best`] prefers on a
/// tie. Star is priced by [`all_reduce`] but not chosen: its root handles every message one
/// after another, which the model prices only as `α_local` each.
pub const ALL_REDUCE: [Algorithm; 4] =
    [Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Ring, Algorithm::Hierarchical];

/// Bytes up to which the inter-host phase of the hierarchical all-reduce uses recursive
/// doubling (as `hierarchical.rs` does).
const HIER_INTER_DOUBLING_BYTES: f64 = 64.0 * 1024.0;

/// The cost of one step between ranks `distance` apart in which each of those ranks moves `m`
/// bytes, `flows` ranks of a host crossing at once.
fn step(shape: Shape, net: &Network, distance: usize, m: f64, flows: usize) -> f64 {
    if shape.hosts > 1 && distance >= shape.ranks_per_host {
        net.alpha + flows as f64 * m * net.beta
    } else {
        net.alpha_local + m * net.beta_local
    }
}

/// The largest power of two ≤ `n` (n ≥ 1).
fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Predicted seconds of an all-reduce of `bytes` per rank with `algo` on `shape` over `net`,
/// agreement included when `folded` is false (recursive doubling that folds its agreement into
/// its data: see `doubling.rs`); `None` where `algo` cannot run it (hierarchical without
/// several ranks on each of several hosts, an algorithm that is not an all-reduce).
pub fn all_reduce(algo: Algorithm, shape: Shape, net: &Network, bytes: usize, folded: bool) -> Option<f64> {
    let n = shape.ranks();
    if n <= 1 {
        return Some(0.0);
    }
    let s = bytes as f64;
    let k = shape.ranks_per_host;
    let agree = if shape.hosts > 1 { 2.0 * net.alpha } else { 2.0 * net.alpha_local };
    let p = pow2_floor(n);
    // Extras fold into proxies p apart and get the result back: 2 steps of S.
    let fold = if n != p { 2.0 * step(shape, net, p, s, k.min(n - p)) } else { 0.0 };
    let t = match algo {
        Algorithm::Ring => 2.0 * (n - 1) as f64 * step(shape, net, k, s / n as f64, 1),
        Algorithm::RecursiveDoubling => {
            let rounds: f64 = (0..p.trailing_zeros()).map(|i| step(shape, net, 1 << i, s, k)).sum();
            let t = rounds + fold;
            return Some(if folded { t } else { t + agree });
        }
        Algorithm::HalvingDoubling => {
            let steps: f64 = (0..p.trailing_zeros())
                .map(|i| {
                    let distance = p >> (i + 1);
                    step(shape, net, distance, s / (2u64 << i) as f64, k)
                })
                .sum();
            2.0 * steps + fold
        }
        Algorithm::Hierarchical => {
            if shape.hosts < 2 || k < 2 {
                return None;
            }
            let h = shape.hosts;
            let intra = 2.0 * (k - 1) as f64 * (net.alpha_local + s / k as f64 * net.beta_local);
            let chunk = s / k as f64;
            let inter = if chunk < HIER_INTER_DOUBLING_BYTES {
                let hp = pow2_floor(h);
                let extra = if hp != h { 2.0 * (net.alpha + k as f64 * chunk * net.beta) } else { 0.0 };
                hp.trailing_zeros() as f64 * (net.alpha + k as f64 * chunk * net.beta) + extra
            } else {
                2.0 * (h - 1) as f64 * (net.alpha + k as f64 * chunk / h as f64 * net.beta)
            };
            intra + inter
        }
        Algorithm::Star => {
            let crossing = if shape.hosts > 1 { n - k } else { 0 };
            let local = n - 1 - crossing;
            let one_way = if crossing > 0 {
                net.alpha + crossing as f64 * s * net.beta
            } else {
                net.alpha_local + local as f64 * s * net.beta_local
            };
            // The root takes and sends its n - 1 messages one after another.
            2.0 * (one_way + (n - 1) as f64 * net.alpha_local)
        }
        _ => return None,
    };
    Some(t + agree)
}

/// The prediction of every algorithm of [`ALL_REDUCE`] that applies, in that order.
pub fn all_reduce_predictions(shape: Shape, net: &Network, bytes: usize, folded: bool) -> Vec<(Algorithm, f64)> {
    ALL_REDUCE.iter().filter_map(|&a| all_reduce(a, shape, net, bytes, folded).map(|t| (a, t))).collect()
}

/// The algorithm among `allowed` with the lowest predicted all-reduce time (the first in
/// [`ALL_REDUCE`] order on a tie), or `None` if none applies.
pub fn best(shape: Shape, net: &Network, bytes: usize, folded: bool, allowed: &[Algorithm]) -> Option<Algorithm> {
    all_reduce_predictions(shape, net, bytes, folded)
        .into_iter()
        .filter(|(a, _)| allowed.contains(a))
        .fold(None, |best: Option<(Algorithm, f64)>, (a, t)| match best {
            Some((_, bt)) if bt <= t => best,
            _ => Some((a, t)),
        })
        .map(|(a, _)| a)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GBIT: f64 = 1.0;

    fn flat(hosts: usize) -> Shape {
        Shape { hosts, ranks_per_host: 1 }
    }

    #[test]
    fn ring_and_doubling_follow_their_formulas() {
        let net = Network::new(10.0, GBIT);
        let s = 1 << 20;
        let (a, b) = (net.alpha, net.beta);
        let ring = all_reduce(Algorithm::Ring, flat(4), &net, s, false).unwrap();
        let want = 6.0 * (a + s as f64 / 4.0 * b) + 2.0 * a;
        assert!((ring - want).abs() < 1e-12, "{ring} vs {want}");
        let rd = all_reduce(Algorithm::RecursiveDoubling, flat(4), &net, s, true).unwrap();
        assert!((rd - 2.0 * (a + s as f64 * b)).abs() < 1e-12);
        let rhd = all_reduce(Algorithm::HalvingDoubling, flat(4), &net, s, false).unwrap();
        let want = 2.0 * (2.0 * a + 0.75 * s as f64 * b) + 2.0 * a;
        assert!((rhd - want).abs() < 1e-12, "{rhd} vs {want}");
        // Hierarchical needs several ranks on each of several hosts.
        assert!(all_reduce(Algorithm::Hierarchical, flat(4), &net, s, false).is_none());
        assert!(all_reduce(Algorithm::Hierarchical, Shape { hosts: 2, ranks_per_host: 4 }, &net, s, false).is_some());
        assert!(all_reduce(Algorithm::Pairwise, flat(4), &net, s, false).is_none());
    }

    #[test]
    fn small_goes_to_doubling_large_to_the_bandwidth_optimal_ones() {
        let net = Network::new(20.0, 10.0);
        let all = &ALL_REDUCE;
        for h in [2, 4, 8, 16, 64, 1024] {
            assert_eq!(best(flat(h), &net, 8, true, all), Some(Algorithm::RecursiveDoubling), "{h} hosts");
            let large = best(flat(h), &net, 256 << 20, false, all).unwrap();
            if h == 2 {
                // Two ranks: doubling's one exchange moves the ring's bytes in fewer steps.
                assert_eq!(large, Algorithm::RecursiveDoubling);
            } else {
                assert!(matches!(large, Algorithm::Ring | Algorithm::HalvingDoubling), "{h} hosts: {large}");
            }
        }
        // Many hosts, mid sizes: halving-doubling's log steps beat the ring's linear ones.
        assert_eq!(best(flat(16), &Network::new(20.0, 1.0), 256 << 10, false, all), Some(Algorithm::HalvingDoubling));
        // Several ranks per host: the hierarchical one sends the fewest bytes across.
        let shape = Shape { hosts: 4, ranks_per_host: 8 };
        assert_eq!(best(shape, &net, 64 << 20, false, all), Some(Algorithm::Hierarchical));
        // Ties go to the first in order; nothing allowed, nothing chosen.
        assert_eq!(best(flat(1), &net, 8, false, all), Some(Algorithm::RecursiveDoubling));
        assert_eq!(best(flat(4), &net, 8, false, &[]), None);
    }

    #[test]
    fn the_network_comes_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(Network::from_lookup(env(&[])).unwrap(), None);
        let n = Network::from_lookup(env(&[("OXCOMM_NET_GBPS", "100")])).unwrap().unwrap();
        assert!((n.gbit_per_s() - 100.0).abs() < 1e-9 && (n.alpha - DEFAULT_ALPHA_US * 1e-6).abs() < 1e-15);
        let n = Network::from_lookup(env(&[("OXCOMM_NET_ALPHA_US", "5")])).unwrap().unwrap();
        assert!((n.alpha - 5e-6).abs() < 1e-15);
        for bad in ["0", "-1", "fast", "inf"] {
            let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([("OXCOMM_NET_GBPS", bad)]));
            assert!(Network::from_lookup(env(pairs)).is_err(), "{bad}");
        }
    }

    #[test]
    fn extras_cost_two_more_steps() {
        let net = Network::new(10.0, GBIT);
        let s = 4096;
        let five = all_reduce(Algorithm::RecursiveDoubling, flat(5), &net, s, true).unwrap();
        let four = all_reduce(Algorithm::RecursiveDoubling, flat(4), &net, s, true).unwrap();
        assert!((five - four - 2.0 * (net.alpha + s as f64 * net.beta)).abs() < 1e-12);
    }
}
