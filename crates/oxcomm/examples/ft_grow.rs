//! A training loop that survives a rank's death: shrink and go on, or grow back to full size
//! with a replacement. Run it under the launcher:
//!
//! ```sh
//! cargo build --release --example ft_grow
//! FT_DIE_RANK=2 oxcomm launch -n 4 --on-failure restart -- target/release/examples/ft_grow
//! FT_DIE_RANK=2 oxcomm launch -n 4 --on-failure continue -- target/release/examples/ft_grow
//! ```
//!
//! Each step all-reduces `[1.0; 4]` (sum) and checks that every element equals the
//! communicator's size. Rank `FT_DIE_RANK` (none by default) exits with status 17 at step
//! `FT_DIE_AT` (50). On an error the others shrink (`Communicator::shrink`); when the launcher
//! restarts failed ranks (it sets `OXCOMM_ON_FAILURE=restart`) they also grow back to the
//! job's size (`Communicator::grow`), and the replacement, started with `OXCOMM_JOIN=1`, joins
//! them (`oxcomm::join`). Then rank 0 broadcasts the step to go on from: the application's
//! state (here only the step) is the application's to send. At the end each rank prints
//! `DONE rank=<r> size=<n> steps=<s>`. `FT_STEPS` (200) steps in all.

use oxcomm::{Communicator, ReduceOp};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// After a failed step: a communicator to go on with, and the step to go on from.
fn recover(comm: &Communicator, full_size: usize, step: u64) -> oxcomm::Result<(Communicator, u64)> {
    let small = comm.shrink()?;
    eprintln!("step {step}: going on without ranks {:?} ({} left)", comm.failed_ranks(), small.size());
    let restart = std::env::var("OXCOMM_ON_FAILURE").is_ok_and(|v| v == "restart");
    let next = if restart { small.grow(full_size)? } else { small };
    let mut at = [step];
    next.broadcast(&mut at, 0)?;
    Ok((next, at[0]))
}

pub fn main() -> oxcomm::Result<()> {
    let joining = std::env::var(oxcomm::grow::ENV_JOIN).is_ok_and(|v| v != "0");
    let (steps, die_at) = (env_u64("FT_STEPS", 200), env_u64("FT_DIE_AT", 50));
    let die_rank = std::env::var("FT_DIE_RANK").ok().and_then(|v| v.parse::<usize>().ok());
    let (mut comm, mut step) = if joining {
        let comm = oxcomm::join()?;
        let mut at = [0u64];
        comm.broadcast(&mut at, 0)?;
        eprintln!("joined as rank {} of {} at step {}", comm.rank(), comm.size(), at[0]);
        (comm, at[0])
    } else {
        (oxcomm::init()?, 0)
    };
    let full_size = comm.size();
    let first_rank = comm.rank();
    while step < steps {
        if !joining && Some(first_rank) == die_rank && step == die_at {
            eprintln!("rank {first_rank}: dying at step {step}");
            std::process::exit(17);
        }
        let mut v = [1.0f32; 4];
        match comm.all_reduce(&mut v, ReduceOp::Sum) {
            Ok(()) => {
                assert_eq!(v, [comm.size() as f32; 4], "rank {}: wrong sum at step {step}", comm.rank());
                step += 1;
            }
            Err(e) => {
                eprintln!("step {step}: {e}");
                (comm, step) = recover(&comm, full_size, step)?;
            }
        }
    }
    comm.barrier()?;
    println!("DONE rank={} size={} steps={step}", comm.rank(), comm.size());
    Ok(())
}
