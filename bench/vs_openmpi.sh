#!/usr/bin/env bash
# oxcomm bench (shm transport, release build) against Open MPI's collectives on this host, op by
# op: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, gather and scatter
# (f32, sum where the op reduces, root 0), from 8 B to 256 MiB (x2 steps), 2 and 4 ranks; the
# same warm-up, iterations, timing method (mean of back-to-back calls, max over ranks), size
# convention and busbw formula on both sides (bench/mpi_collectives.c, `oxcomm bench --help`).
# A benchmark, not a test: CI does not run it.
#
#   bench/vs_openmpi.sh                          # defaults below
#   RANKS="2" OPS="all_gather all_to_all" MAX=64M bench/vs_openmpi.sh
#
# Environment: RANKS (default "2 4"), OPS (default: the eight above), MIN (8), MAX (256M),
# ITERS (20) and WARMUP (5) for sizes from 64 KiB, SMALL_ITERS (2000) and SMALL_WARMUP (200)
# below, OUT (where the raw tables go; default $CARGO_TARGET_DIR or target, then /vs_openmpi),
# FRESH (1: every op's inputs are rewritten before it, untimed, followed by a barrier, on both
# sides: `oxcomm bench --fresh-inputs`, `mpi_collectives -F`; default 0, nccl-tests' unchanged
# buffers, which a single-copy transport such as Open MPI's CMA path may read from its cache).
#
# Both modes are compared: out-of-place (separate buffers) and in-place (MPI_IN_PLACE; oxcomm's
# in-place API). Where an API lacks a mode, both sides emulate it the same way (broadcast
# out-of-place: a copy at the root first; see the two programs' headers). Neither side pins
# ranks to cores (mpirun --bind-to none; oxcomm launch does not pin), so with more ranks than
# cores both share the cores through the scheduler. Open MPI gets --oversubscribe only when
# there are more ranks than cores (it then yields when idle instead of busy-polling; with it,
# 2 ranks on a loaded 2-core host took milliseconds per call).
# Other load on the host changes both sides' numbers a lot: check `uptime` first.
#
# Each ratio is oxcomm/ompi busbw for sizes >= 64 KiB (above 1 = oxcomm faster) and time
# oxcomm/ompi for smaller sizes (below 1 = oxcomm faster). The summary line of each table gives
# each mode's worst ratio from 64 KiB and from 16 MiB, and the smallest size's time ratio.
set -euo pipefail

cd "$(dirname "$0")/.."
RANKS=${RANKS:-"2 4"}
OPS=${OPS:-"all_reduce all_gather reduce_scatter broadcast reduce all_to_all gather scatter"}
MIN=${MIN:-8}
MAX=${MAX:-256M}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
SMALL_ITERS=${SMALL_ITERS:-2000}
SMALL_WARMUP=${SMALL_WARMUP:-200}
FRESH=${FRESH:-0}
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

mpicc -O3 -march=native -o "$OUT/mpi_collectives" bench/mpi_collectives.c
cargo build --release -q -p oxcomm-cli
OXCOMM="$TARGET/release/oxcomm"

MPIRUN=(mpirun --bind-to none)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# $(mpirun --version 2>/dev/null | head -1); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?')"
echo "# f32 (sum where the op reduces, root 0), $WARMUP warm-up + $ITERS timed iterations from 64 KiB ($SMALL_WARMUP + $SMALL_ITERS below), time = mean per call (max over ranks)"
if [ "$FRESH" = 1 ]; then
    echo "# FRESH=1: each call's inputs rewritten just before it, then a barrier (both untimed); time = mean of the calls alone"
fi

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
    for op in $OPS; do
        : >"$OUT/ompi_${op}_$n.txt"
        : >"$OUT/oxcomm_${op}_$n.txt"
        for range in "${RANGES[@]}"; do
            read -r lo hi iters warmup <<<"$range"
            ARGS=(-b "$lo" -e "$hi" -f 2 -n "$iters" -w "$warmup")
            MPI_FRESH=() OX_FRESH=()
            if [ "$FRESH" = 1 ]; then MPI_FRESH=(-F) OX_FRESH=(--fresh-inputs); fi
            "${MPIRUN[@]}" "${OVERSUB[@]}" -np "$n" "$OUT/mpi_collectives" -o "$op" "${ARGS[@]}" "${MPI_FRESH[@]}" \
                >>"$OUT/ompi_${op}_$n.txt"
            "$OXCOMM" bench --transport shm --world-size "$n" --op "$op" --dtype f32 --redop sum --root 0 "${ARGS[@]}" \
                "${OX_FRESH[@]}" --quiet >>"$OUT/oxcomm_${op}_$n.txt"
        done
        echo "#"
        echo "# $op, $n ranks (raw tables: $OUT/ompi_${op}_$n.txt, $OUT/oxcomm_${op}_$n.txt)"
        # Data lines: $1 size, $6/$8/$9 out-of-place time (us)/busbw (GB/s)/#wrong, $10/$12/$13 in-place.
        awk '
            FNR == 1 { file++ }
            /^#/ || NF < 13 { next }
            file == 1 { for (m = 0; m < 2; m++) { ot[$1, m] = $(6 + 4 * m); ob[$1, m] = $(8 + 4 * m); ow[$1, m] = $(9 + 4 * m) }; order[++k] = $1 }
            file == 2 { for (m = 0; m < 2; m++) { xt[$1, m] = $(6 + 4 * m); xb[$1, m] = $(8 + 4 * m); xw[$1, m] = $(9 + 4 * m) } }
            function ratio(s, m) {
                if (s >= 65536) return (xt[s, m] > 0) ? ot[s, m] / xt[s, m] : 0  # same size and formula: busbw ratio = time ratio inverted
                return (ot[s, m] > 0) ? xt[s, m] / ot[s, m] : 0
            }
            END {
                printf "%12s  %10s %10s %7s  %10s %10s %7s\n", "", "out-of-place", "", "", "in-place", "", "";
                printf "%12s  %10s %10s %7s  %10s %10s %7s\n", "size(B)", "ompi", "oxcomm", "ratio", "ompi", "oxcomm", "ratio";
                for (m = 0; m < 2; m++) { worst[m] = worst16[m] = 1e9; small[m] = "-" }
                for (i = 1; i <= k; i++) {
                    s = order[i];
                    if (!((s, 0) in xt) || s == 0) continue;
                    line = sprintf("%12d", s); bad = "";
                    for (m = 0; m < 2; m++) {
                        r = ratio(s, m);
                        if (s >= 65536) {
                            line = line sprintf("  %10s %10s %6.2fx", ob[s, m], xb[s, m], r);
                            if (r < worst[m]) worst[m] = r;
                            if (s >= 16777216 && r < worst16[m]) worst16[m] = r;
                        } else {
                            line = line sprintf("  %8sus %8sus %6.2ft", ot[s, m], xt[s, m], r);
                            if (small[m] == "-") small[m] = sprintf("%.2f", r);
                        }
                        if (ow[s, m] != 0 || xw[s, m] != 0) bad = "  WRONG VALUES";
                    }
                    print line bad;
                }
                # "-" where the run had no size in the range.
                for (m = 0; m < 2; m++) {
                    worst[m] = (worst[m] == 1e9) ? "-" : sprintf("%.2f", worst[m]);
                    worst16[m] = (worst16[m] == 1e9) ? "-" : sprintf("%.2f", worst16[m]);
                }
                printf "# summary: busbw ratio >= 64 KiB: worst %s (out-of-place), %s (in-place); >= 16 MiB: worst %s, %s; smallest size time ratio %s, %s\n", worst[0], worst[1], worst16[0], worst16[1], small[0], small[1];
            }' "$OUT/ompi_${op}_$n.txt" "$OUT/oxcomm_${op}_$n.txt"
    done
done
