#!/usr/bin/env bash
# oxcomm bench (shm transport, release build) against Open MPI's MPI_Allreduce on this host:
# f32 sum all_reduce from 8 B to 256 MiB (x2 steps), 2 and 4 ranks, the same warm-up,
# iterations, timing method (mean of back-to-back calls, max over ranks) and busbw formula
# (2(n-1)/n). A benchmark, not a test: CI does not run it.
#
#   bench/vs_openmpi.sh                 # defaults below
#   RANKS="2" MAX=64M bench/vs_openmpi.sh
#
# Environment: RANKS (default "2 4"), MIN (8), MAX (256M), ITERS (20) and WARMUP (5) for sizes
# from 64 KiB, SMALL_ITERS (2000) and SMALL_WARMUP (200) below, OUT (where the raw tables go;
# default $CARGO_TARGET_DIR or target, then /vs_openmpi).
#
# Both sides use their in-place mode for the comparison (MPI_IN_PLACE; oxcomm's all_reduce is
# in place): oxcomm's out-of-place column includes a copy (see `oxcomm bench --help`), MPI's
# does not. Neither side pins ranks to cores (mpirun --bind-to none; oxcomm launch does not
# pin), so with more ranks than cores both share the cores through the scheduler. Open MPI gets
# --oversubscribe only when there are more ranks than cores (it then yields when idle instead of
# busy-polling; with it, 2 ranks on a loaded 2-core host took milliseconds per call).
# Other load on the host changes both sides' numbers a lot: check `uptime` first.
#
# The last column is oxcomm/ompi busbw for sizes >= 64 KiB (above 1 = oxcomm faster) and
# oxcomm/ompi time for smaller sizes (below 1 = oxcomm faster).
set -euo pipefail

cd "$(dirname "$0")/.."
RANKS=${RANKS:-"2 4"}
MIN=${MIN:-8}
MAX=${MAX:-256M}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
SMALL_ITERS=${SMALL_ITERS:-2000}
SMALL_WARMUP=${SMALL_WARMUP:-200}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/vs_openmpi}
mkdir -p "$OUT"

if ! command -v mpicc >/dev/null 2>&1; then
    echo "# mpicc not found: installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
fi

mpicc -O3 -march=native -o "$OUT/mpi_allreduce" bench/mpi_allreduce.c
cargo build --release -q -p oxcomm-cli
OXCOMM="$TARGET/release/oxcomm"

MPIRUN=(mpirun --bind-to none)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# $(mpirun --version 2>/dev/null | head -1); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?')"
echo "# f32 sum all_reduce, in-place, $WARMUP warm-up + $ITERS timed iterations from 64 KiB ($SMALL_WARMUP + $SMALL_ITERS below), time = mean per call (max over ranks)"

# Sizes below 64 KiB take microseconds, where 20 calls measure mostly noise: they run as a
# separate range with SMALL_ITERS calls after SMALL_WARMUP, on both sides alike.
to_bytes() { numfmt --from=iec "$1"; }
MIN_B=$(to_bytes "$MIN")
MAX_B=$(to_bytes "$MAX")
RANGES=()
if [ "$MIN_B" -lt 65536 ]; then
    SMALL_MAX=$((MAX_B < 32768 ? MAX_B : 32768))
    RANGES+=("$MIN_B $SMALL_MAX $SMALL_ITERS $SMALL_WARMUP")
fi
if [ "$MAX_B" -ge 65536 ]; then
    RANGES+=("$((MIN_B > 65536 ? MIN_B : 65536)) $MAX_B $ITERS $WARMUP")
fi

for n in $RANKS; do
    OVERSUB=()
    if [ "$n" -gt "$(nproc)" ]; then OVERSUB=(--oversubscribe); fi
    : >"$OUT/ompi_$n.txt"
    : >"$OUT/oxcomm_$n.txt"
    for range in "${RANGES[@]}"; do
        read -r lo hi iters warmup <<<"$range"
        ARGS=(-b "$lo" -e "$hi" -f 2 -n "$iters" -w "$warmup")
        "${MPIRUN[@]}" "${OVERSUB[@]}" -np "$n" "$OUT/mpi_allreduce" "${ARGS[@]}" >>"$OUT/ompi_$n.txt"
        "$OXCOMM" bench --transport shm --world-size "$n" --op all_reduce --dtype f32 --redop sum "${ARGS[@]}" \
            --quiet >>"$OUT/oxcomm_$n.txt"
    done
    echo "#"
    echo "# $n ranks (raw tables: $OUT/ompi_$n.txt, $OUT/oxcomm_$n.txt)"
    # Data lines: $1 size, $10 in-place time (us), $12 in-place busbw (GB/s), $13 in-place #wrong.
    awk -v n="$n" '
        FNR == 1 { file++ }
        /^#/ || NF < 13 { next }
        file == 1 { ot[$1] = $10; ob[$1] = $12; ow[$1] = $13; order[++k] = $1 }
        file == 2 { xt[$1] = $10; xb[$1] = $12; xw[$1] = $13 }
        END {
            printf "%12s  %12s %10s  %12s %10s  %8s %s\n", "size(B)", "ompi(us)", "busbw", "oxcomm(us)", "busbw", "ratio", "";
            for (i = 1; i <= k; i++) {
                s = order[i];
                if (!(s in xt)) continue;
                if (s >= 65536) { r = (xt[s] > 0) ? ot[s] / xt[s] : 0; kind = "busbw" }  # same size and formula: busbw ratio = time ratio inverted
                else { r = (ot[s] > 0) ? xt[s] / ot[s] : 0; kind = "time" }
                bad = (ow[s] != 0 || xw[s] != 0) ? "  WRONG VALUES" : "";
                printf "%12d  %12s %10s  %12s %10s  %8.2f %s%s\n", s, ot[s], ob[s], xt[s], xb[s], r, kind, bad;
            }
        }' "$OUT/ompi_$n.txt" "$OUT/oxcomm_$n.txt"
done
