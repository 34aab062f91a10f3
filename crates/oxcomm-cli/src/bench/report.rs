//! The report of `oxcomm bench`: what rank 0 hands on per finished line ([`Line`]), and
//! [`Report`], which prints the nccl-tests style table (header, one block per op, one line per
//! size, footer), moves the progress bar, and writes the JSON Lines and CSV files and the plot
//! of `--plot` (drawing belongs to [`crate::plot`]). It runs wherever the table is printed:
//! the front end, or rank 0 of a job started by someone else.
//!
//! # Sizes, counts, bandwidth
//!
//! `size` is the byte count of the op's full buffer as nccl-tests defines it: the tensor for
//! all_reduce, broadcast and reduce; the gathered output for all_gather; the full input for
//! reduce_scatter; the whole send buffer for all_to_all. It is rounded down to a whole number
//! of elements (per rank where the op splits the buffer by rank), so a line may show fewer bytes
//! than asked for (`size 0` when the buffer cannot hold one element per rank). `count` is
//! `size` / element size. `algbw = size / time` in GB/s (10⁹ bytes), `busbw = algbw ×`
//! [`oxcomm::logging::bus_factor`] (2(n−1)/n all_reduce; (n−1)/n all_gather, reduce_scatter,
//! all_to_all; 1 broadcast, reduce).
//!
//!
//! # Output
//!
//! Lines starting with `#` are headers and notes; every other line is one size. The report
//! ends with `# Out of bounds values : N OK` (or `FAILED`, and exit status 1), and
//! `# Avg bus bandwidth : X`, the mean busbw of all measurements (both modes, all ops), as in
//! nccl-tests.
//!
//! `--json FILE` writes one JSON object per line per (op, size, mode) with the fields `op`,
//! `dtype`, `redop` (`null` for ops that do not reduce), `root` (`null` unless rooted),
//! `world_size`, `transport`, `algorithm` (`auto` unless forced), `size_bytes`, `count`,
//! `in_place`, `emulated`, `iters`, `warmup_iters`, `fresh_inputs` (`--fresh-inputs`),
//! `time_us`, `median_us`, `algbw_gbps`, `busbw_gbps`, `wrong` (`null` when not checked),
//! `wire_bytes`, `ran` (the algorithm rank 0's last timed op ran, from its flight recorder:
//! what the planner chose where `algorithm` is `auto`; `null` for the ops built from others).
//! `--csv FILE` writes the same columns with a header row.
//!
//! `--plot FILE.svg` or `FILE.png` draws busbw and latency against size for every op and mode
//! after the run; `--compare A.json B.json … --plot FILE` draws the rows of earlier `--json`
//! files instead of running anything (see [`crate::plot`]).

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::cases::{human, BenchOp, Pattern};
use super::plan::BenchPlan;

/// One table line: one op and size, both modes. What rank 0 sends to the front end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Line {
    pub(super) op: BenchOp,
    pub(super) size_bytes: u64,
    pub(super) count: u64,
    pub(super) out_of_place: Measured,
    pub(super) in_place: Measured,
}

/// One mode of one line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Measured {
    /// Mean time per op (max over ranks), µs.
    pub(super) time_us: f64,
    /// Median time per op (max over ranks), µs.
    pub(super) median_us: f64,
    /// Wrong elements summed over ranks; `None` when not checked.
    pub(super) wrong: Option<u64>,
    /// Bytes one rank handed to its links per op (timed iterations), max over ranks.
    pub(super) wire_bytes: u64,
    /// The algorithm rank 0's last timed op ran (`None` for the composite ops).
    pub(super) ran: Option<String>,
}

/// One row of the JSON and CSV outputs.
#[derive(Debug, Serialize)]
struct Row<'a> {
    op: &'a str,
    dtype: &'a str,
    redop: Option<&'a str>,
    root: Option<usize>,
    world_size: usize,
    transport: &'a str,
    algorithm: &'a str,
    size_bytes: u64,
    count: u64,
    in_place: bool,
    emulated: bool,
    iters: usize,
    warmup_iters: usize,
    fresh_inputs: bool,
    time_us: f64,
    median_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    wrong: Option<u64>,
    wire_bytes: u64,
    ran: Option<&'a str>,
}

const CSV_HEADER: &str = "op,dtype,redop,root,world_size,transport,algorithm,size_bytes,count,in_place,emulated,\
                          iters,warmup_iters,fresh_inputs,time_us,median_us,algbw_gbps,busbw_gbps,wrong,wire_bytes,ran";

impl Row<'_> {
    fn csv(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.6},{:.6},{},{},{}",
            self.op,
            self.dtype,
            opt(self.redop.map(str::to_string)),
            opt(self.root.map(|r| r.to_string())),
            self.world_size,
            self.transport,
            self.algorithm,
            self.size_bytes,
            self.count,
            self.in_place,
            self.emulated,
            self.iters,
            self.warmup_iters,
            self.fresh_inputs,
            self.time_us,
            self.median_us,
            self.algbw_gbps,
            self.busbw_gbps,
            opt(self.wrong.map(|w| w.to_string())),
            self.wire_bytes,
            self.ran.unwrap_or_default(),
        )
    }
}

/// Prints the table and writes the files as lines arrive.
pub(super) struct Report {
    plan: BenchPlan,
    world: usize,
    transport: String,
    bar: ProgressBar,
    json: Option<BufWriter<File>>,
    csv: Option<BufWriter<File>>,
    current_op: Option<BenchOp>,
    busbw_sum: f64,
    busbw_count: usize,
    wrong: u64,
    unchecked: bool,
    /// Table lines printed so far.
    lines_done: usize,
    /// What `--plot` draws, one point per row.
    points: Vec<crate::plot::Point>,
}

impl Report {
    /// Opens the output files and prints the header. `transport`: its name for the header and
    /// the files (the communicator's, or the flag's). `links`: what the planner knows of the
    /// links between hosts (`Communicator::links_model`), printed when known. `progress`:
    /// whether a bar may be drawn (still hidden with --quiet or when stderr is not a terminal).
    pub(super) fn create(
        plan: &BenchPlan,
        world: usize,
        transport: impl std::fmt::Display,
        links: Option<oxcomm::algorithms::cost::Network>,
        progress: bool,
    ) -> anyhow::Result<Report> {
        let open = |p: &PathBuf| -> anyhow::Result<BufWriter<File>> {
            Ok(BufWriter::new(File::create(p).with_context(|| format!("cannot create {}", p.display()))?))
        };
        let json = plan.json.as_ref().map(open).transpose()?;
        let mut csv = plan.csv.as_ref().map(open).transpose()?;
        if let Some(f) = csv.as_mut() {
            writeln!(f, "{CSV_HEADER}")?;
        }
        let total = (plan.ops.len() * plan.sizes.len()) as u64;
        let bar = if progress && !plan.quiet && std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        let report = Report {
            plan: plan.clone(),
            world,
            transport: transport.to_string(),
            bar,
            json,
            csv,
            current_op: None,
            busbw_sum: 0.0,
            busbw_count: 0,
            wrong: 0,
            unchecked: !plan.check,
            lines_done: 0,
            points: Vec::new(),
        };
        let mut header = report.header();
        if let Some(net) = links {
            header.push_str(&format!(
                "# links (the planner's model): one-way {:.1} us, {:.3} Gbit/s; halving-doubling / ring at 256 KiB {:.2}{}\n",
                net.alpha * 1e6,
                net.gbit_per_s(),
                net.halving_over_ring,
                if net.halving_beats_ring() { " (both compete above 64 KiB)" } else { " (the ring above 64 KiB)" }
            ));
        }
        report.print(&header)?;
        report.bar.set_message(report.next_label());
        Ok(report)
    }

    fn header(&self) -> String {
        let p = &self.plan;
        let mut h = String::new();
        let _ = writeln!(
            h,
            "# oxcomm bench  ranks: {}  transport: {}  dtype: {}  minBytes: {}  maxBytes: {}  step: {}(factor)  warmup iters: {}  iters: {}  validation: {}",
            self.world,
            self.transport,
            p.dtype,
            p.min_bytes,
            p.max_bytes,
            p.step,
            p.warmup,
            p.iters,
            u8::from(p.check)
        );
        if p.fresh_inputs {
            let _ = writeln!(
                h,
                "# time: mean of {} ops, each after rewriting the inputs and a barrier (untimed), max over ranks; p50: median of the per-op times, max over ranks",
                p.iters
            );
        } else {
            let _ = writeln!(
                h,
                "# time: mean of {} back-to-back ops, max over ranks; p50: median of the per-op times, max over ranks",
                p.iters
            );
        }
        if let Some(a) = p.algorithm {
            let skipped: Vec<&str> =
                p.ops.iter().filter(|o| p.algorithm_for(**o).is_none()).map(|o| o.name()).collect();
            if skipped.is_empty() {
                let _ = writeln!(h, "# algorithm: {a}");
            } else {
                let _ =
                    writeln!(h, "# algorithm: {a} (not applicable to {}: they use their default)", skipped.join(", "));
            }
        }
        for (op, why) in &p.skipped {
            let _ = writeln!(h, "# {} not run: {why} (--dtype {})", op.name(), p.dtype);
        }
        if let Some(k) = p.ranks_per_host.filter(|_| p.ops.contains(&BenchOp::QuantReduceScatter)) {
            let _ = writeln!(h, "# quant_reduce_scatter: {k} ranks per host, {} hosts", self.world / k.max(1));
        }
        if p.check && p.ops.iter().any(|o| o.reduces()) {
            if let Some(why) = Pattern::new(p.redop, p.dtype, self.world).unsupported() {
                let _ = writeln!(h, "# check: {why}; reducing ops are not checked");
            }
        }
        h
    }

    fn block_header(&self, op: BenchOp) -> String {
        let mut h = String::new();
        let _ = writeln!(h, "#");
        let _ = writeln!(h, "# Collective: {}  ({})", op.name(), op.emulation_note());
        let _ = writeln!(h, "#{:51}{:^35}{:^35}{:^20}", "", "out-of-place", "in-place", "median");
        let cols = |a: &str, b: &str, c: &str, d: &str, e: &str| format!("#{a:>11}  {b:>12}  {c:>8}  {d:>6}  {e:>6}");
        let block = |t: &str, a: &str, b: &str, w: &str| format!("  {t:>9}  {a:>6}  {b:>6}  {w:>6}");
        let _ = writeln!(
            h,
            "{}{}{}  {:>9} {:>9}  {:>11}",
            cols("size", "count", "type", "redop", "root"),
            block("time", "algbw", "busbw", "#wrong"),
            block("time", "algbw", "busbw", "#wrong"),
            "oop_p50",
            "ip_p50",
            "wire"
        );
        let _ = writeln!(
            h,
            "{}{}{}  {:>9} {:>9}  {:>11}",
            cols("(B)", "(elements)", "", "", ""),
            block("(us)", "(GB/s)", "(GB/s)", ""),
            block("(us)", "(GB/s)", "(GB/s)", ""),
            "(us)",
            "(us)",
            "(B)"
        );
        h
    }

    fn print(&self, text: &str) -> anyhow::Result<()> {
        let mut result = Ok(());
        self.bar.suspend(|| {
            let mut out = std::io::stdout().lock();
            result = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        });
        result.context("writing to stdout")
    }

    pub(super) fn line(&mut self, line: &Line) -> anyhow::Result<()> {
        if self.current_op != Some(line.op) {
            self.current_op = Some(line.op);
            self.print(&self.block_header(line.op))?;
        }
        let p = &self.plan;
        let n = self.world;
        let factor = oxcomm::logging::bus_factor(line.op.name(), n);
        let bw = |m: &Measured| {
            let algbw = if m.time_us > 0.0 { line.size_bytes as f64 / m.time_us / 1e3 } else { 0.0 };
            (algbw, algbw * factor)
        };
        let redop = line.op.redop_name(p.redop).unwrap_or("none");
        let root = if line.op.rooted() { p.root as i64 } else { -1 };
        let mut text =
            format!("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}", line.size_bytes, line.count, p.dtype.name(), redop, root);
        let algorithm = p.algorithm_for(line.op).map(|a| a.name()).unwrap_or("auto");
        for (m, in_place) in [(&line.out_of_place, false), (&line.in_place, true)] {
            let (algbw, busbw) = bw(m);
            let wrong = m.wrong.map(|w| w.to_string()).unwrap_or_else(|| "N/A".into());
            let _ = write!(text, "  {:>9}  {:6.2}  {:6.2}  {:>6}", fmt_us(m.time_us), algbw, busbw, wrong);
            self.busbw_sum += busbw;
            self.busbw_count += 1;
            match m.wrong {
                Some(w) => self.wrong += w,
                None => self.unchecked = true,
            }
            let row = Row {
                op: line.op.name(),
                dtype: p.dtype.name(),
                redop: line.op.redop_name(p.redop),
                root: line.op.rooted().then_some(p.root),
                world_size: n,
                transport: &self.transport,
                algorithm,
                size_bytes: line.size_bytes,
                count: line.count,
                in_place,
                emulated: line.op.emulated(in_place),
                iters: p.iters,
                warmup_iters: p.warmup,
                fresh_inputs: p.fresh_inputs,
                time_us: m.time_us,
                median_us: m.median_us,
                algbw_gbps: algbw,
                busbw_gbps: busbw,
                wrong: m.wrong,
                wire_bytes: m.wire_bytes,
                ran: m.ran.as_deref(),
            };
            self.points.push(crate::plot::Point {
                op: line.op.name().to_string(),
                in_place,
                size_bytes: line.size_bytes,
                time_us: m.time_us,
                busbw_gbps: busbw,
                transport: self.transport.clone(),
                world_size: n,
                dtype: p.dtype.name().to_string(),
            });
            if let Some(f) = self.json.as_mut() {
                serde_json::to_writer(&mut *f, &row)?;
                writeln!(f)?;
            }
            if let Some(f) = self.csv.as_mut() {
                writeln!(f, "{}", row.csv())?;
            }
        }
        let wire = line.out_of_place.wire_bytes.max(line.in_place.wire_bytes);
        let _ = writeln!(
            text,
            "  {:>9} {:>9}  {:>11}",
            fmt_us(line.out_of_place.median_us),
            fmt_us(line.in_place.median_us),
            wire
        );
        self.print(&text)?;
        self.lines_done += 1;
        self.bar.set_message(self.next_label());
        self.bar.inc(1);
        Ok(())
    }

    /// What runs next, for the progress bar: the op and the requested size.
    fn next_label(&self) -> String {
        let sizes = &self.plan.sizes;
        let op = self.plan.ops.get(self.lines_done / sizes.len().max(1));
        match (op, sizes.get(self.lines_done % sizes.len().max(1))) {
            (Some(op), Some(size)) => format!("{} {}", op.name(), human(*size)),
            _ => String::new(),
        }
    }

    /// Prints the footer and flushes the files: exit status 0, or an error when values were
    /// wrong.
    pub(super) fn finish(mut self) -> anyhow::Result<i32> {
        self.bar.finish_and_clear();
        self.flush_files()?;
        let avg = if self.busbw_count > 0 { self.busbw_sum / self.busbw_count as f64 } else { 0.0 };
        let verdict = if self.wrong > 0 {
            format!("{} FAILED", self.wrong)
        } else if !self.plan.check {
            "N/A (not checked: -c 0)".to_string()
        } else if self.unchecked {
            "0 OK (some ops not checked)".to_string()
        } else {
            "0 OK".to_string()
        };
        self.print(&format!("# Out of bounds values : {verdict}\n# Avg bus bandwidth : {avg:.6}\n#\n"))?;
        if let Some(path) = &self.plan.plot {
            let title = crate::plot::title_of(&self.points);
            crate::plot::draw(&crate::plot::series(&self.points, None), &title, path)?;
            self.print(&format!("# plot: {}\n", path.display()))?;
        }
        if self.wrong > 0 {
            bail!("{} wrong values (see the #wrong columns)", self.wrong);
        }
        Ok(0)
    }

    /// Ends a failed run: clears the bar and keeps what the files already hold.
    pub(super) fn abandon(mut self) {
        self.bar.finish_and_clear();
        let _ = self.flush_files();
    }

    fn flush_files(&mut self) -> anyhow::Result<()> {
        for f in [self.json.as_mut(), self.csv.as_mut()].into_iter().flatten() {
            f.flush().context("writing the output file")?;
        }
        Ok(())
    }
}

/// A time in µs as nccl-tests prints it: 2 decimals below 100, 1 below 10000, else none.
fn fmt_us(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_like_nccl_tests() {
        assert_eq!(fmt_us(12.345), "12.35");
        assert_eq!(fmt_us(123.45), "123.5");
        assert_eq!(fmt_us(12345.6), "12346");
    }
}
