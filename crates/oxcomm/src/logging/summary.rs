//! Per-(op, message size) statistics over a list of [`OpRecord`]s, DeepSpeed's summary table,
//! and the straggler breakdown.
//!
//! Everything here is a pure function of records (and, for the straggler view, of the
//! element-wise minimum latencies that the communicator obtains with an all-reduce MIN). Nothing
//! here communicates.
//!
//! # Trimmed mean
//!
//! The "avg" columns are DeepSpeed's 10 % trimmed mean (`deepspeed/utils/timer.py: trim_mean`):
//! sort a copy of the values, drop `k = round_half_even(len · 0.1)` from each end (the product
//! is computed in f64, exactly as Python computes `n * 0.1`), and average the rest; an empty list
//! gives 0. So len = 5 → k = 0, 15 → 2 (15·0.1 = 1.5000000000000002), 25 → 2 (2.5 ties to
//! even), 35 → 4. See [`trim_count`] and [`trimmed_mean`].
//!
//! # Straggler analysis
//!
//! DeepSpeed defines the straggler effect of a rank as
//! `sum(t_collectives − allreduce(t_collectives, MIN))`: for the i-th call of an (op, size) the
//! fastest rank's latency approximates the op's own cost, and the rest of this rank's latency
//! is time spent waiting for the slowest rank to arrive. The protocol, split between the
//! communicator (which communicates) and this module (which does not):
//!
//! 1. every rank takes [`Summary::straggler_input`]: `(key, bytes, latencies_ns)` for every
//!    collective (op, size), sorted by `(key, bytes)` so that ranks holding the same keys list
//!    them in the same order; point-to-point ops (send/recv) are left out, since their peers do
//!    not log the same key;
//! 2. the communicator checks that all ranks hold the same keys (e.g. all-reduce MIN and MAX of
//!    [`straggler_key_fingerprint`]) and fails with a mismatch error otherwise;
//! 3. it all-reduces MIN the lengths ([`straggler_lengths`]); histories of unequal length (a
//!    rank that reset later, or one that logged an extra call) are aligned on their **common
//!    prefix**: the first `min_len` calls of each (op, size);
//! 4. it all-reduces MIN, element-wise, the latencies truncated to those lengths, flattened into
//!    one buffer ([`straggler_flatten`]), so the analysis costs two collectives, not one per key
//!    as in DeepSpeed;
//! 5. it rebuilds the per-key lists ([`straggler_unflatten`]) and calls
//!    [`Summary::with_straggler`], which works for any subset of keys and aligns each list again
//!    on `min(len_local, len_min)`.
//!
//! Per (op, size) with aligned length `L`, the breakdown reports `count = L`,
//! `total comm lat = Σ min_i`, `total straggler = Σ (lat_i − min_i)` (saturating at 0), and the
//! trimmed means of both. DeepSpeed prints the local count; we print `L`, the number of calls
//! the other columns cover.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::record::OpRecord;
use crate::error::{Error, Result};

/// The fraction DeepSpeed trims from each end for its "avg" columns.
pub const TRIM_FRACTION: f64 = 0.1;

/// Width of every cell in the tables (DeepSpeed's `{: <20}`).
pub const CELL_WIDTH: usize = 20;

/// Header of [`Summary::table`]. DeepSpeed's last two cells are `tput_avg (Gbps)` and
/// `busbw_avg (Gbps)`; ours hold nccl-tests' algbw and busbw in GB/s.
pub const SUMMARY_HEADER: [&str; 7] = [
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "algbw_avg (GB/s)",
    "busbw_avg (GB/s)",
];

/// Header of [`StragglerSummary::table`], as DeepSpeed's.
pub const STRAGGLER_HEADER: [&str; 7] = [
    "Comm. Op",
    "Message Size",
    "Count",
    "Total comm lat(ms)",
    "Total straggler(ms)",
    "Avg comm lat(ms)",
    "Avg straggler(ms)",
];

/// One (op, size) entry of [`Summary::straggler_input`]: the op key, the message size in bytes,
/// and the latencies in ns, in call order.
pub type StragglerEntry = (String, u64, Vec<u64>);

/// Statistics of every op name, in order of first appearance (as DeepSpeed's dict).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// One entry per op key.
    pub ops: Vec<OpSummary>,
}

/// Statistics of one op key, per message size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpSummary {
    /// The op name; in debug mode followed by ` | [Caller: file:line]` when the caller is known.
    pub name: String,
    /// One entry per message size, ascending.
    pub sizes: Vec<SizeSummary>,
}

/// Statistics of one (op, message size).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizeSummary {
    /// Message size in bytes (DeepSpeed's convention, see [`OpRecord::bytes`]).
    pub bytes: u64,
    /// Number of calls.
    pub count: usize,
    /// Sum of the latencies, ms.
    pub total_latency_ms: f64,
    /// Plain mean latency, ms.
    pub mean_latency_ms: f64,
    /// Plain mean of the per-call algbw, GB/s.
    pub mean_algbw_gbps: f64,
    /// Plain mean of the per-call busbw, GB/s.
    pub mean_busbw_gbps: f64,
    /// 10 % trimmed mean latency, ms (DeepSpeed's `Avg Latency(ms)`).
    pub trimmed_latency_ms: f64,
    /// 10 % trimmed mean of the per-call algbw, GB/s (the table's `algbw_avg`).
    pub trimmed_algbw_gbps: f64,
    /// 10 % trimmed mean of the per-call busbw, GB/s (the table's `busbw_avg`).
    pub trimmed_busbw_gbps: f64,
    /// The latencies in ns, in call order (input of the straggler analysis).
    pub latencies_ns: Vec<u64>,
}

/// The straggler breakdown, in the order of the [`Summary`] it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StragglerSummary {
    /// One entry per op key that had minimum latencies.
    pub ops: Vec<StragglerOp>,
}

/// The straggler breakdown of one op key.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StragglerOp {
    /// The op key, as in [`OpSummary::name`].
    pub name: String,
    /// One row per message size, ascending.
    pub sizes: Vec<StragglerRow>,
}

/// The straggler breakdown of one (op, size), over the aligned prefix of `count` calls.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StragglerRow {
    /// Message size in bytes.
    pub bytes: u64,
    /// Calls covered: `min(local history, minimum history)`.
    pub count: usize,
    /// `Σ min_i`, ms: the op's cost without waiting.
    pub total_comm_lat_ms: f64,
    /// `Σ (lat_i − min_i)`, ms: time this rank waited for others.
    pub total_straggler_ms: f64,
    /// Trimmed mean of `min_i`, ms.
    pub avg_comm_lat_ms: f64,
    /// Trimmed mean of `lat_i − min_i`, ms.
    pub avg_straggler_ms: f64,
}

/// The number of values [`trimmed_mean`] drops from *each* end of `len` values:
/// `round_half_even(len · fraction)` in f64 as Python's `round(n * fraction)`, then capped so
/// that at least one value remains (Python would fail on an empty slice). A fraction that is
/// negative or NaN counts as 0.
pub fn trim_count(len: usize, fraction: f64) -> usize {
    if len == 0 || fraction.is_nan() || fraction <= 0.0 {
        return 0;
    }
    let k = (len as f64 * fraction).round_ties_even();
    let k = if k >= len as f64 { len } else { k as usize };
    k.min((len - 1) / 2)
}

/// DeepSpeed's `trim_mean(data, fraction)`: the mean of a sorted copy of `values` without the
/// [`trim_count`] smallest and largest; 0 for an empty slice. `values` is not reordered.
pub fn trimmed_mean(values: &[f64], fraction: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let k = trim_count(sorted.len(), fraction);
    mean(&sorted[k..sorted.len() - k])
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// DeepSpeed's `convert_size`: `"0B"` for 0, else `round(bytes / 1024^i, 2)` printed as Python
/// prints a float (shortest form, at least one decimal) and a unit from `B, KB, MB, GB, TB, PB,
/// EB` with `i = floor(log(bytes) / log(1024))` computed in f64 as Python does. Units are
/// 1024-based despite their names. Examples: 2048 → `"2.0 KB"`, 1152 → `"1.12 KB"` (ties to
/// even), 711837040 → `"678.86 MB"`, 1000 → `"1000.0 B"`.
pub fn convert_size(bytes: u64) -> String {
    const UNITS: [&str; 9] = ["B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"];
    if bytes == 0 {
        return "0B".to_string();
    }
    let b = bytes as f64;
    let i = (b.ln() / 1024f64.ln()).floor().clamp(0.0, (UNITS.len() - 1) as f64) as usize;
    let scaled = b / 1024f64.powi(i as i32);
    // `{:.2}` rounds the exact binary value half-to-even, as Python's round(x, 2) does; parsing
    // it back gives the float Python holds, and `{}` prints its shortest form as Python's repr.
    let rounded: f64 = format!("{scaled:.2}").parse().unwrap_or(scaled);
    let mut s = format!("{rounded}");
    if !s.contains('.') {
        s.push_str(".0");
    }
    format!("{s} {}", UNITS[i])
}

/// Writes `cells` each left-aligned in [`CELL_WIDTH`] characters (wider cells are not cut),
/// then a newline, as DeepSpeed's `print(f"{a: <20}{b: <20}…")`.
fn push_row(out: &mut String, cells: &[&str]) {
    for c in cells {
        let _ = write!(out, "{c:<width$}", width = CELL_WIDTH);
    }
    out.push('\n');
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl Summary {
    /// Groups `records` by op key, then by message size. The key is the op name; with
    /// `debug`, records that carry a caller get ` | [Caller: file:line]` appended (DeepSpeed's
    /// `debug` appends the caller function's name). Op keys keep the order of their first
    /// record; sizes are ascending.
    pub fn from_records(records: &[OpRecord], debug: bool) -> Summary {
        type Key = (&'static str, Option<(&'static str, u32)>);
        let mut index: HashMap<Key, usize> = HashMap::new();
        let mut groups: Vec<(Key, Vec<&OpRecord>)> = Vec::new();
        for r in records {
            let caller = if debug { r.caller.map(|l| (l.file(), l.line())) } else { None };
            let key = (r.op, caller);
            let i = *index.entry(key).or_insert_with(|| {
                groups.push((key, Vec::new()));
                groups.len() - 1
            });
            groups[i].1.push(r);
        }
        let ops = groups
            .into_iter()
            .map(|((op, caller), recs)| {
                let name = match caller {
                    Some((file, line)) => format!("{op} | [Caller: {file}:{line}]"),
                    None => op.to_string(),
                };
                let mut by_size: Vec<(u64, Vec<&OpRecord>)> = Vec::new();
                let mut size_index: HashMap<u64, usize> = HashMap::new();
                for r in recs {
                    let i = *size_index.entry(r.bytes).or_insert_with(|| {
                        by_size.push((r.bytes, Vec::new()));
                        by_size.len() - 1
                    });
                    by_size[i].1.push(r);
                }
                by_size.sort_by_key(|(b, _)| *b);
                let sizes = by_size.into_iter().map(|(bytes, recs)| SizeSummary::of(bytes, &recs)).collect();
                OpSummary { name, sizes }
            })
            .collect();
        Summary { ops }
    }

    /// Whether there is nothing to report.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The table in DeepSpeed's layout (spec §4.6): every cell, the last included, left-aligned
    /// in 20 characters; a header; then per op key a line holding just the key, followed by one
    /// row per message size: 20 spaces, [`convert_size`], count, total latency, and the trimmed
    /// means of latency, algbw and busbw, all with 2 decimals. The header, with the trailing
    /// padding shown as `·`:
    ///
    /// ```text
    /// Comm. Op            Message Size        Count               Total Latency(ms)   Avg Latency(ms)     algbw_avg (GB/s)    busbw_avg (GB/s)····
    /// all_reduce
    ///                     4.0 MB              100                 52.43               0.52                8.00                12.00···············
    /// ```
    pub fn table(&self) -> String {
        let mut out = String::new();
        push_row(&mut out, &SUMMARY_HEADER);
        for op in &self.ops {
            out.push_str(&op.name);
            out.push('\n');
            for s in &op.sizes {
                push_row(
                    &mut out,
                    &[
                        "",
                        &convert_size(s.bytes),
                        &s.count.to_string(),
                        &format!("{:.2}", s.total_latency_ms),
                        &format!("{:.2}", s.trimmed_latency_ms),
                        &format!("{:.2}", s.trimmed_algbw_gbps),
                        &format!("{:.2}", s.trimmed_busbw_gbps),
                    ],
                );
            }
        }
        out
    }

    /// The per-(op, size) latency histories of collective ops, sorted by `(key, bytes)`; see the
    /// [module docs](self) for the protocol. Point-to-point ops are left out.
    pub fn straggler_input(&self) -> Vec<StragglerEntry> {
        let mut out: Vec<StragglerEntry> = self
            .ops
            .iter()
            .filter(|op| {
                let base = op.name.split(" | ").next().unwrap_or(&op.name);
                super::record::OpKind::of(base).is_collective()
            })
            .flat_map(|op| op.sizes.iter().map(|s| (op.name.clone(), s.bytes, s.latencies_ns.clone())))
            .collect();
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        out
    }

    /// The straggler breakdown against `min_latencies`: for each (key, bytes) present both here
    /// and in `min_latencies`, the first `L = min(local len, min len)` calls are compared. Keys
    /// missing from `min_latencies` are left out. Order: as in this summary.
    pub fn with_straggler(&self, min_latencies: &[StragglerEntry]) -> StragglerSummary {
        let mins: HashMap<(&str, u64), &[u64]> =
            min_latencies.iter().map(|(k, b, v)| ((k.as_str(), *b), v.as_slice())).collect();
        let ops = self
            .ops
            .iter()
            .filter_map(|op| {
                let sizes: Vec<StragglerRow> = op
                    .sizes
                    .iter()
                    .filter_map(|s| {
                        let min = mins.get(&(op.name.as_str(), s.bytes))?;
                        Some(StragglerRow::of(s.bytes, &s.latencies_ns, min))
                    })
                    .collect();
                (!sizes.is_empty()).then(|| StragglerOp { name: op.name.clone(), sizes })
            })
            .collect();
        StragglerSummary { ops }
    }
}

impl SizeSummary {
    fn of(bytes: u64, recs: &[&OpRecord]) -> SizeSummary {
        let lat_ms: Vec<f64> = recs.iter().map(|r| r.latency_ms()).collect();
        let algbw: Vec<f64> = recs.iter().map(|r| r.algbw_gbps()).collect();
        let busbw: Vec<f64> = recs.iter().map(|r| r.busbw_gbps()).collect();
        let total_ns: u64 = recs.iter().map(|r| r.latency_ns).sum();
        SizeSummary {
            bytes,
            count: recs.len(),
            total_latency_ms: ms(total_ns),
            mean_latency_ms: mean(&lat_ms),
            mean_algbw_gbps: mean(&algbw),
            mean_busbw_gbps: mean(&busbw),
            trimmed_latency_ms: trimmed_mean(&lat_ms, TRIM_FRACTION),
            trimmed_algbw_gbps: trimmed_mean(&algbw, TRIM_FRACTION),
            trimmed_busbw_gbps: trimmed_mean(&busbw, TRIM_FRACTION),
            latencies_ns: recs.iter().map(|r| r.latency_ns).collect(),
        }
    }
}

impl StragglerRow {
    fn of(bytes: u64, local: &[u64], min: &[u64]) -> StragglerRow {
        let len = local.len().min(min.len());
        let (local, min) = (&local[..len], &min[..len]);
        let min_ms: Vec<f64> = min.iter().map(|&m| ms(m)).collect();
        let straggler_ns: Vec<u64> = local.iter().zip(min).map(|(&l, &m)| l.saturating_sub(m)).collect();
        let straggler_ms: Vec<f64> = straggler_ns.iter().map(|&s| ms(s)).collect();
        StragglerRow {
            bytes,
            count: len,
            total_comm_lat_ms: ms(min.iter().sum()),
            total_straggler_ms: ms(straggler_ns.iter().sum()),
            avg_comm_lat_ms: trimmed_mean(&min_ms, TRIM_FRACTION),
            avg_straggler_ms: trimmed_mean(&straggler_ms, TRIM_FRACTION),
        }
    }
}

impl StragglerSummary {
    /// DeepSpeed's straggler section: a line of 31 `_`, `Breakdown with straggler effect`, a
    /// line of 31 `-`, the [`STRAGGLER_HEADER`] row, then per op key its name and one row per
    /// size (20 spaces, size, count, total comm lat, total straggler, avg comm lat, avg
    /// straggler; 2 decimals), every cell left-aligned in 20 characters.
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(&"_".repeat(31));
        out.push_str("\nBreakdown with straggler effect\n");
        out.push_str(&"-".repeat(31));
        out.push('\n');
        push_row(&mut out, &STRAGGLER_HEADER);
        for op in &self.ops {
            out.push_str(&op.name);
            out.push('\n');
            for s in &op.sizes {
                push_row(
                    &mut out,
                    &[
                        "",
                        &convert_size(s.bytes),
                        &s.count.to_string(),
                        &format!("{:.2}", s.total_comm_lat_ms),
                        &format!("{:.2}", s.total_straggler_ms),
                        &format!("{:.2}", s.avg_comm_lat_ms),
                        &format!("{:.2}", s.avg_straggler_ms),
                    ],
                );
            }
        }
        out
    }
}

/// The history length of each entry, as the communicator all-reduces MIN them (step 3 of the
/// [protocol](self)).
pub fn straggler_lengths(input: &[StragglerEntry]) -> Vec<u64> {
    input.iter().map(|(_, _, v)| v.len() as u64).collect()
}

/// A 64-bit FNV-1a hash of the `(key, bytes)` list, for checking that all ranks hold the same
/// keys in the same order (step 2): equal on every rank iff (with overwhelming probability) the
/// key lists are equal.
pub fn straggler_key_fingerprint(input: &[StragglerEntry]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (k, b, _) in input {
        eat(&(k.len() as u64).to_le_bytes());
        eat(k.as_bytes());
        eat(&b.to_le_bytes());
    }
    h
}

/// Concatenates each entry's first `min_lengths[i]` latencies (step 4), the buffer the
/// communicator all-reduces MIN element-wise. Fails if `min_lengths` does not have one length
/// per entry or asks for more calls than an entry holds.
pub fn straggler_flatten(input: &[StragglerEntry], min_lengths: &[u64]) -> Result<Vec<u64>> {
    check_lengths(input, min_lengths)?;
    let mut flat = Vec::with_capacity(min_lengths.iter().sum::<u64>() as usize);
    for ((_, _, v), &l) in input.iter().zip(min_lengths) {
        flat.extend_from_slice(&v[..l as usize]);
    }
    Ok(flat)
}

/// Splits the all-reduced buffer back into entries (step 5): entry i gets `min_lengths[i]`
/// values of `flat_min`, with the key and size of `input[i]`. Fails if the lengths do not add
/// up to `flat_min.len()` or do not fit `input`.
pub fn straggler_unflatten(
    input: &[StragglerEntry],
    min_lengths: &[u64],
    flat_min: &[u64],
) -> Result<Vec<StragglerEntry>> {
    check_lengths(input, min_lengths)?;
    let total: u64 = min_lengths.iter().sum();
    if total != flat_min.len() as u64 {
        return Err(Error::invalid(format!(
            "straggler: lengths add up to {total} but the buffer holds {} values",
            flat_min.len()
        )));
    }
    let mut at = 0usize;
    Ok(input
        .iter()
        .zip(min_lengths)
        .map(|((k, b, _), &l)| {
            let v = flat_min[at..at + l as usize].to_vec();
            at += l as usize;
            (k.clone(), *b, v)
        })
        .collect())
}

fn check_lengths(input: &[StragglerEntry], min_lengths: &[u64]) -> Result<()> {
    if input.len() != min_lengths.len() {
        return Err(Error::invalid(format!(
            "straggler: {} lengths for {} (op, size) entries",
            min_lengths.len(),
            input.len()
        )));
    }
    for ((k, b, v), &l) in input.iter().zip(min_lengths) {
        if l > v.len() as u64 {
            return Err(Error::invalid(format!(
                "straggler: {k} ({b} B) asks for {l} calls but {} were logged",
                v.len()
            )));
        }
    }
    Ok(())
}
