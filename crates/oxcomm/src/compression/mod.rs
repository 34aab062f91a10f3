//! Communication-saving collectives and the pure kernels they are built from.
//!
//! [`pack`] turns f32 signs into bits and back (the 1-bit error-compensated all-reduce of
//! DeepSpeed's 1-bit Adam/LAMB, spec §2); [`quant`] quantizes groups of floats to int8/int4
//! and back (ZeRO++ qgZ, spec §3.4–3.6). These two own the wire formats and the arithmetic;
//! they never communicate, allocate per call or know about ranks. [`coalesced`] is the
//! communicating layer on top: DeepSpeed's `reduce_scatter_coalesced` and the qgZ quantized
//! reduce-scatter (spec §3.1–3.3).

pub mod coalesced;
//! and back (ZeRO++ qgZ, spec §3.4–3.6). These modules own the wire formats and the arithmetic;
//! they never communicate, allocate per call or know about ranks. [`onebit`] is the exception
//! that uses them: the 1-bit all-reduce and 1-bit Adam over the public `Communicator` API.

pub mod onebit;
pub mod pack;
pub mod quant;
