//! One rank's sweep of the plan: allocate the buffers once at the largest size, then for
//! every op, size and mode run a [`Case`] (timed, then checked when `-c 1`), and hand each
//! finished line to rank 0's sink ([`Sink`]). The same code runs on a thread rank, a spawned
//! worker and a rank of an MPI job; where the lines go is the caller's business
//! ([`super::workers`]).

use anyhow::Context;
use oxcomm::compression::host_groups::HostGroups;
use oxcomm::compression::onebit::OneBitState;
use oxcomm::{Communicator, DType, OpOptions};

use super::cases::{BenchElement, BenchOp, Buffers, Case, Pattern};
use super::plan::BenchPlan;
use super::report::{Line, Measured};

/// What rank 0 does with each finished line.
pub(super) type Sink<'a> = &'a (dyn Fn(&Line) -> anyhow::Result<()> + Sync);

/// Runs every line on this rank; rank 0 hands each finished line to `sink`.
pub(super) fn rank_main(comm: &Communicator, plan: &BenchPlan, sink: Option<Sink<'_>>) -> anyhow::Result<()> {
    match plan.dtype {
        DType::F32 => rank_typed::<f32>(comm, plan, sink),
        DType::F64 => rank_typed::<f64>(comm, plan, sink),
        DType::F16 => rank_typed::<half::f16>(comm, plan, sink),
        DType::BF16 => rank_typed::<half::bf16>(comm, plan, sink),
        DType::I8 => rank_typed::<i8>(comm, plan, sink),
        DType::U8 => rank_typed::<u8>(comm, plan, sink),
        DType::I32 => rank_typed::<i32>(comm, plan, sink),
        DType::I64 => rank_typed::<i64>(comm, plan, sink),
        DType::Bool => rank_typed::<oxcomm::dtype::Bool>(comm, plan, sink),
        DType::I16 => rank_typed::<i16>(comm, plan, sink),
        DType::U16 => rank_typed::<u16>(comm, plan, sink),
        DType::U32 => rank_typed::<u32>(comm, plan, sink),
        DType::U64 => rank_typed::<u64>(comm, plan, sink),
        DType::C64 => rank_typed::<oxcomm::dtype::Complex64>(comm, plan, sink),
        DType::C128 => rank_typed::<oxcomm::dtype::Complex128>(comm, plan, sink),
        DType::F8E4M3Fn => rank_typed::<oxcomm::dtype::F8E4M3Fn>(comm, plan, sink),
        DType::F8E5M2 => rank_typed::<oxcomm::dtype::F8E5M2>(comm, plan, sink),
        DType::F8E4M3Fnuz => rank_typed::<oxcomm::dtype::F8E4M3Fnuz>(comm, plan, sink),
        DType::F8E5M2Fnuz => rank_typed::<oxcomm::dtype::F8E5M2Fnuz>(comm, plan, sink),
        DType::F8E8M0Fnu => rank_typed::<oxcomm::dtype::F8E8M0Fnu>(comm, plan, sink),
    }
}

fn rank_typed<T: BenchElement>(comm: &Communicator, plan: &BenchPlan, sink: Option<Sink<'_>>) -> anyhow::Result<()> {
    let n = comm.size();
    let elem = std::mem::size_of::<T>();
    let max_elems = (plan.max_bytes / elem as u64) as usize;
    let mut bufs = Buffers::<T>::new(max_elems)?;
    let pattern = Pattern::new(plan.redop, plan.dtype, n);
    let groups = match plan.ranks_per_host {
        Some(k) if plan.ops.contains(&BenchOp::QuantReduceScatter) => {
            Some(HostGroups::uniform(comm, k).context("building the host groups of --ranks-per-host")?)
        }
        None if plan.ops.contains(&BenchOp::QuantReduceScatter) => {
            HostGroups::from_topology(comm).context("building the host groups of the job's hosts")?
        }
        _ => None,
    };
    for &op in &plan.ops {
        let opts = OpOptions { algorithm: plan.algorithm_for(op), ..OpOptions::default() };
        for &size in &plan.sizes {
            let layout = op.layout(size, n, elem);
            bufs.onebit = match op {
                BenchOp::OnebitAllReduce => Some(OneBitState::new(layout.input, n)?),
                _ => None,
            };
            let mut measure = |in_place: bool| -> anyhow::Result<Measured> {
                let case = Case {
                    comm,
                    op,
                    in_place,
                    layout,
                    redop: plan.redop,
                    root: plan.root,
                    opts: &opts,
                    groups: groups.as_ref(),
                };
                let what =
                    || format!("{} of {} B ({})", op.name(), size, if in_place { "in-place" } else { "out-of-place" });
                let timed = case.time(&mut bufs, plan.warmup, plan.iters, plan.fresh_inputs).with_context(what)?;
                let wrong = if plan.check && (!op.reduces() || pattern.unsupported().is_none()) {
                    Some(case.check(&mut bufs, &pattern).with_context(what)?)
                } else {
                    None
                };
                Ok(Measured {
                    time_us: timed.mean_us,
                    median_us: timed.median_us,
                    wrong,
                    wire_bytes: timed.wire_bytes,
                    ran: timed.ran,
                })
            };
            let out_of_place = measure(false)?;
            let in_place = measure(true)?;
            if let Some(sink) = sink {
                let full = layout.full() as u64;
                sink(&Line { op, size_bytes: full * elem as u64, count: full, out_of_place, in_place })?;
            }
        }
    }
    comm.barrier().context("final barrier")?;
    Ok(())
}
