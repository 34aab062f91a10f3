//! One rank of `oxcomm check`: runs each check over every dtype and count, agrees with the
//! other ranks on each case's verdict, and returns rank 0's view of the outcomes. The ops the
//! bench times are run by [`crate::bench::cases::Case`]; the others by [`super::verify`].

use oxcomm::compression::onebit;
use oxcomm::{Communicator, DType, OpOptions, ReduceOp};

use crate::bench::cases::{BenchElement, BenchOp, Buffers, Case, Layout, Pattern};

use super::verify::{all_to_all_v, gather, reduce_scatter_coalesced, scatter, send_recv};
use super::{Check, Outcome, COUNTS, DTYPES, SMALL};

/// Longest failure message one rank contributes to the agreement after a case.
const MESSAGE_BYTES: usize = 240;

/// Runs `checks` on this rank; every rank returns rank 0's view of the outcomes.
pub(super) fn run_checks(comm: &Communicator, checks: &[Check], inject: Option<&str>) -> anyhow::Result<Vec<Outcome>> {
    let mut out = Vec::new();
    for check in checks {
        let name = check.name();
        let corrupt = comm.rank() == 0 && inject.is_some_and(|op| name.starts_with(op));
        let mut outcome = Outcome { name, cases: 0, failed: 0, first: None };
        for dtype in DTYPES {
            for count in COUNTS {
                let cases = match dtype {
                    DType::F32 => typed::<f32>(comm, *check, count, corrupt),
                    DType::BF16 => typed::<half::bf16>(comm, *check, count, corrupt),
                    DType::I32 => typed::<i32>(comm, *check, count, corrupt),
                    DType::U8 => typed::<u8>(comm, *check, count, corrupt),
                    _ => Ok(Vec::new()),
                };
                let cases = match cases {
                    Ok(c) => c,
                    Err(e) => vec![(format!("{dtype} × {count}"), Err(oxcomm::Error::invalid(format!("{e:#}"))))],
                };
                for (what, result) in cases {
                    outcome.cases += 1;
                    if let Some(msg) = agree(comm, &what, result) {
                        outcome.failed += 1;
                        outcome.first.get_or_insert(msg);
                    }
                }
            }
        }
        out.push(outcome);
    }
    Ok(out)
}

/// Every rank's verdict on one case, agreed: `None` when it passed everywhere, else the first
/// failing rank's message (this rank's own when the communicator cannot agree any more).
fn agree(comm: &Communicator, what: &str, result: oxcomm::Result<u64>) -> Option<String> {
    let mine = match &result {
        Ok(0) => String::new(),
        Ok(w) => format!("{what}: {w} wrong elements on rank {}", comm.rank()),
        Err(e) => format!("{what}: {e}"),
    };
    let mut buf = [0u8; MESSAGE_BYTES];
    let bytes = mine.as_bytes();
    let len = bytes.len().min(MESSAGE_BYTES);
    buf[..len].copy_from_slice(&bytes[..len]);
    let mut all = vec![0u8; MESSAGE_BYTES * comm.size()];
    match comm.all_gather(&buf, &mut all) {
        Ok(()) => all.chunks(MESSAGE_BYTES).find(|m| m[0] != 0).map(|m| {
            let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
            String::from_utf8_lossy(&m[..end]).into_owned()
        }),
        Err(e) if mine.is_empty() => Some(format!("{what}: the ranks cannot agree on the result: {e}")),
        Err(_) => Some(mine),
    }
}

/// The cases of one check at one dtype and count: (what, wrong elements on this rank or the
/// error).
type Cases = Vec<(String, oxcomm::Result<u64>)>;

fn typed<T: BenchElement>(comm: &Communicator, check: Check, count: usize, corrupt: bool) -> anyhow::Result<Cases> {
    let n = comm.size();
    let what = |extra: &str| format!("{} × {count}{extra}", T::DTYPE);
    let timeout = OpOptions::default();
    match check {
        Check::Bench(op, algorithm) => {
            if op == BenchOp::OnebitAllReduce && T::DTYPE != DType::F32
                || op == BenchOp::QuantReduceScatter && !T::DTYPE.is_float()
            {
                return Ok(Vec::new());
            }
            let count = match op {
                BenchOp::OnebitAllReduce => {
                    let grain = onebit::padded_len(1, n)?;
                    count.div_ceil(grain) * grain
                }
                BenchOp::QuantReduceScatter => count.div_ceil(2) * 2,
                _ => count,
            };
            let layout = match op {
                BenchOp::AllReduce | BenchOp::Reduce | BenchOp::Broadcast | BenchOp::OnebitAllReduce => {
                    Layout { input: count, output: count, block: count }
                }
                BenchOp::AllGather | BenchOp::Gather => Layout { input: count, output: count * n, block: count },
                BenchOp::ReduceScatter | BenchOp::QuantReduceScatter | BenchOp::Scatter => {
                    Layout { input: count * n, output: count, block: count }
                }
                BenchOp::AllToAll => Layout { input: count * n, output: count * n, block: count },
            };
            let mut bufs = Buffers::<T>::new(layout.input.max(layout.output))?;
            let opts = OpOptions { algorithm, ..timeout };
            let redops: &[ReduceOp] = match op {
                BenchOp::AllReduce if algorithm.is_none() && count <= SMALL => {
                    &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod]
                }
                _ => &[ReduceOp::Sum],
            };
            let mut out = Vec::new();
            for &redop in redops {
                let pattern = Pattern::new(redop, T::DTYPE, n);
                if op.reduces() && pattern.unsupported().is_some() {
                    continue;
                }
                for in_place in [false, true] {
                    let root = n - 1;
                    let case = Case { comm, op, in_place, layout, redop, root, opts: &opts, groups: None };
                    let mode = if in_place { "in-place" } else { "out-of-place" };
                    let label = if op.reduces() { format!(", {redop}, {mode}") } else { format!(", {mode}") };
                    let spoil = corrupt && layout.full() > 0;
                    out.push((what(&label), case.check_local(&mut bufs, &pattern, spoil)));
                }
            }
            Ok(out)
        }
        Check::Barrier(algorithm) => {
            // One barrier per dtype and count is plenty; the count is not used.
            let opts = OpOptions { algorithm, ..timeout };
            Ok(vec![(what(""), comm.barrier_with(&opts).map(|()| 0))])
        }
        Check::AllToAllV => Ok(vec![(what(""), all_to_all_v::<T>(comm, count, corrupt))]),
        Check::Gather => Ok(vec![(what(""), gather::<T>(comm, count, corrupt))]),
        Check::Scatter => Ok(vec![(what(""), scatter::<T>(comm, count, corrupt))]),
        Check::SendRecv => {
            if n < 2 {
                return Ok(Vec::new());
            }
            Ok(vec![(what(""), send_recv::<T>(comm, count, corrupt))])
        }
        Check::ReduceScatterCoalesced => Ok(vec![(what(""), reduce_scatter_coalesced::<T>(comm, count, corrupt))]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::selected;
    use oxcomm::Transport;

    #[test]
    fn threads_world_3_passes_and_an_injected_failure_is_seen() {
        let only = |f: &str| selected(Transport::Threads, &[f.to_string()]);
        let gather = only("gather");
        let outcomes = oxcomm::threads::run(3, |comm| run_checks(&comm, &gather, Some("gather"))).unwrap();
        // The filter also selects the bench's gather (`gather/auto`, `gather/flat`).
        let o = outcomes[0].as_ref().unwrap().iter().find(|o| o.name == "gather").unwrap();
        assert!(o.failed > 0 && o.first.as_deref().unwrap().contains("wrong"), "{o:?}");
        let rsc = only("reduce_scatter_coalesced");
        let outcomes = oxcomm::threads::run(3, |comm| run_checks(&comm, &rsc, None)).unwrap();
        let o = &outcomes[0].as_ref().unwrap()[0];
        assert_eq!((o.failed, o.cases), (0, 20), "{o:?}");
    }
}
