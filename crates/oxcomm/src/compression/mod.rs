//! Communication-saving collectives and the pure kernels they are built from.
//!
//! [`pack`] turns f32 signs into bits and back (the 1-bit error-compensated all-reduce of
//! DeepSpeed's 1-bit Adam/LAMB, spec §2); [`quant`] quantizes groups of floats to int8/int4
//! and back (ZeRO++ qgZ, spec §3.4–3.6). These two own the wire formats and the arithmetic;
//! they never communicate, allocate per call or know about ranks.
//!
//! The communicating layer on top is written only against the public [`crate::Communicator`]
//! API, so it runs on every transport and backend: [`onebit`] is the 1-bit all-reduce and
//! 1-bit Adam; [`coalesced`] is DeepSpeed's `reduce_scatter_coalesced` (spec §3.1); [`qgz`] is
//! the ZeRO++ quantized reduce-scatter (spec §3.2–3.3) over the [`host_groups`] it needs.

pub mod coalesced;
pub mod host_groups;
pub mod onebit;
pub mod pack;
pub mod qgz;
pub mod quant;

/// An [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) error of `op` on this
/// rank (raised before anything is sent).
fn arg_error(comm: &crate::Communicator, op: &str, msg: String) -> crate::Error {
    crate::Error::invalid(msg).with_op(op).with_rank(comm.world_rank())
}
