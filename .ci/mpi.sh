#!/usr/bin/env bash
# The MPI backend's tests (feature `mpi`): installs Open MPI and libclang (rsmpi's bindings are
# generated with bindgen), then runs the `mpi` test binary, which starts itself under
# `mpirun -n 2` and `mpirun -n 4` and ends with an "N passed, M failed" line.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

echo "== MPI: install Open MPI and libclang"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq openmpi-bin libopenmpi-dev libclang-dev clang >/dev/null
mpirun --version | head -n 1

echo "== MPI: clippy (feature mpi)"
cargo clippy -p oxcomm --lib --examples --test mpi --features mpi -- -D warnings

echo "== MPI: tests under mpirun -n 2 and -n 4"
cargo test -p oxcomm --features mpi --test mpi
