//! Mismatches, deadlines and aborts.
