//! What the bench can time: [`BenchOp`] (each collective, its name, which flags apply to it,
//! which of its two modes is emulated with a copy) and [`Layout`] (the element counts of one
//! line's buffers for a requested size, following nccl-tests' conventions).
//!
//! # Sizes and counts
//!
//! `size` is the byte count of the op's full buffer as nccl-tests defines it: the tensor for
//! all_reduce, broadcast and reduce; the gathered output for all_gather and gather; the full
//! input for reduce_scatter and scatter; the whole send buffer for all_to_all. It is rounded down to a whole number
//! of elements (per rank where the op splits the buffer by rank), so a line may show fewer bytes
//! than asked for (`size 0` when the buffer cannot hold one element per rank). `count` is
//! `size` / element size. onebit_all_reduce's count is rounded down to a multiple of
//! DeepSpeed's padding granularity `n · lcm(n, 8)` ([`onebit::padded_len`]`(1, n)`), so no
//! padding is sent; quant_reduce_scatter's per-rank block is rounded down to even (the int4
//! codes pack in pairs) and its tensor's shape is `[N / E, E]` with `E` the largest power of
//! two that divides the block, at most 2048 and at most `√N` (one int4 group per row).

use oxcomm::compression::onebit;
use oxcomm::{Algorithm, DType, ReduceOp};
use serde::{Deserialize, Serialize};

/// A collective the bench can time: a name, a buffer [`Layout`], how to run each mode, and
/// how to check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    /// `all_reduce` (in place).
    AllReduce,
    /// `all_gather` (separate input and output).
    AllGather,
    /// `reduce_scatter` (separate input and output).
    ReduceScatter,
    /// `broadcast` from the root (in place).
    Broadcast,
    /// `reduce` to the root (in place).
    Reduce,
    /// `all_to_all` with equal blocks (separate send and receive buffers).
    AllToAll,
    /// `gather` to the root (separate input and, at the root, output).
    Gather,
    /// `scatter` from the root (at the root an input, everywhere an output).
    Scatter,
    /// `onebit::all_reduce`, the 1-bit compressed mean (in place, f32 only).
    OnebitAllReduce,
    /// `all_to_all_quant_reduce`, the int4 quantized reduce-scatter of the mean (returns a
    /// new vector).
    QuantReduceScatter,
}

impl BenchOp {
    /// Every op, in the order `--op all` runs them.
    pub const ALL: [BenchOp; 10] = [
        BenchOp::AllReduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllToAll,
        BenchOp::Gather,
        BenchOp::Scatter,
        BenchOp::OnebitAllReduce,
        BenchOp::QuantReduceScatter,
    ];

    /// The op's name (also its name for [`oxcomm::logging::bus_factor`]).
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::Gather => "gather",
            BenchOp::Scatter => "scatter",
            BenchOp::OnebitAllReduce => "onebit_all_reduce",
            BenchOp::QuantReduceScatter => "quant_reduce_scatter",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<BenchOp> {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        BenchOp::ALL.into_iter().find(|o| o.name() == s || o.name().replace('_', "") == s)
    }

    /// Whether the op applies the `--redop` reduction operator.
    pub(crate) fn reduces(self) -> bool {
        matches!(self, BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::Reduce)
    }

    /// Whether the op computes the mean whatever `--redop` says (the compressed ops).
    pub(crate) fn averages(self) -> bool {
        matches!(self, BenchOp::OnebitAllReduce | BenchOp::QuantReduceScatter)
    }

    /// The reduction the op applies, for the table and the files: `--redop`, `avg` for the
    /// compressed ops, `None` for ops that only move data.
    pub(crate) fn redop_name(self, redop: ReduceOp) -> Option<&'static str> {
        if self.reduces() {
            Some(redop.name())
        } else if self.averages() {
            Some(ReduceOp::Avg.name())
        } else {
            None
        }
    }

    /// Whether the op has a root.
    pub(crate) fn rooted(self) -> bool {
        matches!(self, BenchOp::Broadcast | BenchOp::Reduce | BenchOp::Gather | BenchOp::Scatter)
    }

    /// Whether the API lacks the mode (`in_place` or not), which is then emulated with a copy.
    pub(crate) fn emulated(self, in_place: bool) -> bool {
        match self {
            BenchOp::AllReduce
            | BenchOp::AllGather
            | BenchOp::ReduceScatter
            | BenchOp::AllToAll
            | BenchOp::Gather
            | BenchOp::Scatter
            | BenchOp::Reduce => false,
            BenchOp::Broadcast | BenchOp::OnebitAllReduce => !in_place,
            BenchOp::QuantReduceScatter => in_place,
        }
    }

    /// Why the op cannot run on `dtype`, if it cannot.
    pub(crate) fn rejects(self, dtype: DType) -> Option<&'static str> {
        match self {
            BenchOp::OnebitAllReduce if dtype != DType::F32 => Some("onebit_all_reduce takes f32 only"),
            BenchOp::QuantReduceScatter if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) => {
                Some("quant_reduce_scatter takes f32, f16 and bf16 only")
            }
            op if op.reduces() && dtype.is_float8() => Some("float8 types are moved, not reduced"),
            _ => None,
        }
    }

    /// The algorithms `--algorithm` may force on the op (none for the compressed ops, which
    /// are built from several collectives).
    pub(crate) fn algorithms(self) -> &'static [Algorithm] {
        use oxcomm::wire::OpKind;
        let kind = match self {
            BenchOp::AllReduce => OpKind::AllReduce,
            BenchOp::AllGather => OpKind::AllGather,
            BenchOp::ReduceScatter => OpKind::ReduceScatter,
            BenchOp::Broadcast => OpKind::Broadcast,
            BenchOp::Reduce => OpKind::Reduce,
            BenchOp::AllToAll => OpKind::AllToAll,
            BenchOp::Gather => OpKind::Gather,
            BenchOp::Scatter => OpKind::Scatter,
            BenchOp::OnebitAllReduce | BenchOp::QuantReduceScatter => return &[],
        };
        oxcomm::algorithms::plan::candidates(kind)
    }

    /// How the emulated mode works, for the block header.
    pub(crate) fn emulation_note(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "out-of-place = all_reduce_into(input, output), in-place = all_reduce(buffer)",
            BenchOp::Reduce => "out-of-place = reduce_into(input, output), in-place = reduce(buffer)",
            BenchOp::Broadcast => {
                "out-of-place = root copies input to output, then broadcast of the output (the API is in-place)"
            }
            BenchOp::AllGather => {
                "out-of-place = all_gather(input, output), in-place = all_gather_in_place(buffer) (this rank's block already in place)"
            }
            BenchOp::ReduceScatter => {
                "out-of-place = reduce_scatter(input, output), in-place = reduce_scatter_in_place(buffer) (the result lands in this rank's block)"
            }
            BenchOp::AllToAll => "out-of-place = all_to_all(send, recv), in-place = all_to_all_in_place(buffer)",
            BenchOp::Gather => {
                "out-of-place = gather(input, output), in-place = gather_in_place(buffer, root) (the root's block already in place)"
            }
            BenchOp::Scatter => {
                "out-of-place = scatter(input, output), in-place = scatter_in_place(buffer, root) (the root's block stays in its input)"
            }
            BenchOp::OnebitAllReduce => {
                "f32 mean, 1-bit compressed, state kept across iterations; out-of-place = copy input to output, then the op; bandwidth on the uncompressed bytes"
            }
            BenchOp::QuantReduceScatter => {
                "mean, int4 quantized (qgZ); the result is a new vector, copied to the output (out-of-place) or to this rank's block of the input (in-place); bandwidth on the uncompressed bytes"
            }
        }
    }

    /// The buffers of one line for a requested `size` in bytes, `n` ranks and `elem` bytes
    /// per element (nccl-tests' conventions; see the module docs).
    pub(crate) fn layout(self, size: u64, n: usize, elem: usize) -> Layout {
        let total = (size / elem as u64) as usize;
        let n = n.max(1);
        match self {
            BenchOp::AllReduce | BenchOp::Broadcast | BenchOp::Reduce => {
                Layout { input: total, output: total, block: total }
            }
            BenchOp::AllGather | BenchOp::Gather => {
                let block = total / n;
                Layout { input: block, output: block * n, block }
            }
            BenchOp::ReduceScatter | BenchOp::Scatter => {
                let block = total / n;
                Layout { input: block * n, output: block, block }
            }
            BenchOp::AllToAll => {
                let block = total / n;
                Layout { input: block * n, output: block * n, block }
            }
            BenchOp::OnebitAllReduce => {
                let grain = onebit::padded_len(1, n).unwrap_or(8 * n).max(1);
                let len = total / grain * grain;
                Layout { input: len, output: len, block: len }
            }
            BenchOp::QuantReduceScatter => {
                let block = match qgz_group(total / n / 2 * 2, n) {
                    Some(_) => total / n / 2 * 2,
                    None => 0,
                };
                Layout { input: block * n, output: block, block }
            }
        }
    }
}

/// Largest int4 group (elements per scale) the quant_reduce_scatter bench uses.
const QGZ_MAX_GROUP: usize = 2048;

/// The group size `E` of a quant_reduce_scatter tensor of `p` elements per rank on `n` ranks
/// (shape `[n·p / E, E]`): the largest power of two dividing `p`, at most [`QGZ_MAX_GROUP`]
/// and with `E² ≤ n·p`; `None` when no even `E` fits (the line is then empty).
pub(super) fn qgz_group(p: usize, n: usize) -> Option<usize> {
    if p == 0 || p % 2 != 0 {
        return None;
    }
    let total = p.checked_mul(n)?;
    let mut e = (1usize << p.trailing_zeros()).min(QGZ_MAX_GROUP);
    while e >= 2 && e.saturating_mul(e) > total {
        e /= 2;
    }
    (e >= 2).then_some(e)
}

/// Element counts of one line's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Elements of this rank's input (send) buffer.
    pub(crate) input: usize,
    /// Elements of this rank's output (receive) buffer.
    pub(crate) output: usize,
    /// Elements per rank where the op splits its buffer by rank; else the whole buffer.
    pub(crate) block: usize,
}

impl Layout {
    /// Elements of the op's full buffer as nccl-tests counts it (the table's `count`).
    pub(crate) fn full(&self) -> usize {
        self.input.max(self.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_follow_nccl_tests() {
        // 1 KiB of f32 on 4 ranks.
        assert_eq!(BenchOp::AllReduce.layout(1024, 4, 4), Layout { input: 256, output: 256, block: 256 });
        assert_eq!(BenchOp::AllGather.layout(1024, 4, 4), Layout { input: 64, output: 256, block: 64 });
        assert_eq!(BenchOp::ReduceScatter.layout(1024, 4, 4), Layout { input: 256, output: 64, block: 64 });
        assert_eq!(BenchOp::AllToAll.layout(1024, 4, 4), Layout { input: 256, output: 256, block: 64 });
        // Rounded down to whole elements per rank.
        assert_eq!(BenchOp::AllGather.layout(8, 3, 4).full(), 0);
        assert_eq!(BenchOp::ReduceScatter.layout(40, 3, 4).full(), 9);
    }
}
