#!/usr/bin/env bash
# Miri and loom over the shared-memory transport's unsafe code (issue 28, item 6).
#
#   bash bench/miri.sh          # both
#   bash bench/miri.sh miri     # only Miri: the ring, the segment layout and header checks, the
#                               # doorbell (futex protocol), on heap memory, no syscalls
#   bash bench/miri.sh loom     # only the loom model of the doorbell's no-lost-wake-up ordering
#
# Miri needs a nightly toolchain with the miri and rust-src components:
#   rustup toolchain install nightly --component miri,rust-src
# Tests that need a syscall Miri cannot run (mmap, shm_open, process_vm_readv, pidfd) are
# `#[cfg_attr(miri, ignore)]` or outside the filter; loop counts are scaled down under cfg(miri).
# loom is a dev-dependency only under cfg(loom); its build goes to target/loom so it does not
# evict the ordinary build. Each step prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"

if [[ "$what" == all || "$what" == miri ]]; then
    echo "== miri: transport::shm (ring, segment, futex, endpoint checks)"
    # -Zmiri-disable-isolation is not needed: the tests read only the monotonic clock.
    time cargo +nightly miri test -p oxcomm --lib transport::shm
fi

if [[ "$what" == all || "$what" == loom ]]; then
    echo "== loom: the doorbell model (transport::shm::futex::loom_model)"
    time RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p oxcomm --lib --release loom
fi
