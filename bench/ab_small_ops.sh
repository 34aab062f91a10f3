#!/usr/bin/env bash
# Small ops, A/B: an old oxcomm binary, a new one and Open MPI (bench/mpi_collectives.c) taking
# turns, op by op, for several rounds, on the 8-byte ops of issue 27 (all_reduce, broadcast,
# reduce, gather, scatter; f32, sum, root 0). Each invocation times -n back-to-back calls after
# -w warm-up calls (mean per call, max over ranks), out of place and in place, exactly as
# bench/vs_openmpi.sh does; the three programs run one after the other for each op, so load that
# comes and goes hits them alike. A benchmark, not a test: CI does not run it.
#
#   BASE=/tmp/small_base/oxcomm bench/ab_small_ops.sh          # NEW defaults to target/release
#   ROUNDS=8 RANKS="2" OPS="gather scatter" bench/ab_small_ops.sh
#
# Environment: BASE (the old binary; required), NEW (default $CARGO_TARGET_DIR or target, then
# /release/oxcomm; not rebuilt here), ROUNDS (5), RANKS ("2 4"), OPS (the five above), ITERS
# (2000), WARMUP (200), OUT (raw tables; default $TARGET/ab_small_ops). Sizes: 8 B, except
# gather and scatter on more than 2 ranks, 4 B per rank (one f32 each: 16 B on 4 ranks).
# Neither side pins ranks (mpirun --bind-to none); Open MPI gets --oversubscribe with more
# ranks than cores, as in vs_openmpi.sh. Run it under the machine's lock and quote `uptime`.
#
# Output: per (ranks, op, mode) the best and the median round of each program (µs) and the
# ratio of each oxcomm binary's best (median) to Open MPI's best (median): below 1 = faster.
set -euo pipefail

cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-target}
BASE=${BASE:?set BASE to the old oxcomm binary}
NEW=${NEW:-$TARGET/release/oxcomm}
ROUNDS=${ROUNDS:-5}
RANKS=${RANKS:-"2 4"}
OPS=${OPS:-"all_reduce broadcast reduce gather scatter"}
ITERS=${ITERS:-2000}
WARMUP=${WARMUP:-200}
OUT=${OUT:-$TARGET/ab_small_ops}
mkdir -p "$OUT"
mpicc -O3 -march=native -o "$OUT/mpi_collectives" bench/mpi_collectives.c

MPIRUN=(mpirun --bind-to none)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg) at start"
echo "# base: $BASE; new: $NEW ($(git describe --always --dirty 2>/dev/null || echo '?')); $(mpirun --version 2>/dev/null | head -1)"
echo "# $ROUNDS rounds, $WARMUP warm-up + $ITERS timed calls each, time = mean per call (max over ranks), us"

# One line per run: "ranks op program round oop ip" (the data line's $6 and $10).
RES="$OUT/results.txt"
: >"$RES"
for round in $(seq 1 "$ROUNDS"); do
    for n in $RANKS; do
        OVERSUB=()
        if [ "$n" -gt "$(nproc)" ]; then OVERSUB=(--oversubscribe); fi
        for op in $OPS; do
            size=8
            case "$op" in gather | scatter) if [ "$n" -gt 2 ]; then size=$((4 * n)); fi ;; esac
            ARGS=(-b "$size" -e "$size" -n "$ITERS" -w "$WARMUP")
            for prog in base new ompi; do
                case "$prog" in
                    base) out=$("$BASE" bench --transport shm --world-size "$n" --op "$op" --dtype f32 --redop sum --root 0 "${ARGS[@]}" --quiet) ;;
                    new) out=$("$NEW" bench --transport shm --world-size "$n" --op "$op" --dtype f32 --redop sum --root 0 "${ARGS[@]}" --quiet) ;;
                    ompi) out=$("${MPIRUN[@]}" "${OVERSUB[@]}" -np "$n" "$OUT/mpi_collectives" -o "$op" "${ARGS[@]}") ;;
                esac
                echo "$out" | awk -v n="$n" -v op="$op" -v p="$prog" -v r="$round" \
                    '!/^#/ && NF >= 13 { print n, op, p, r, $6, $10; if ($9 != 0 || $13 != 0) print "# WRONG VALUES", n, op, p > "/dev/stderr" }' >>"$RES"
            done
        done
    done
done
echo "# load average $(cut -d" " -f1-3 /proc/loadavg) at end; raw: $RES"

awk '
    function sort(a, k,   i, j, t) { for (i = 2; i <= k; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t } }
    { key = $1 SUBSEP $2; if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
      for (m = 0; m < 2; m++) { c = ++cnt[key, $3, m]; v[key, $3, m, c] = $(5 + m) } }
    END {
        printf "%5s %-10s %-4s  %13s %13s %13s  %11s %11s\n", "ranks", "op", "mode", "base", "new", "ompi", "base/ompi", "new/ompi";
        printf "%5s %-10s %-4s  %13s %13s %13s  %11s %11s\n", "", "", "", "best (med)", "best (med)", "best (med)", "best (med)", "best (med)";
        for (i = 1; i <= nk; i++) {
            key = order[i]; split(key, kk, SUBSEP);
            for (m = 0; m < 2; m++) {
                line = sprintf("%5s %-10s %-4s ", kk[1], kk[2], m ? "ip" : "oop");
                np = split("base new ompi", progs, " ");
                for (p = 1; p <= np; p++) {
                    k = cnt[key, progs[p], m]; delete a;
                    for (c = 1; c <= k; c++) a[c] = v[key, progs[p], m, c];
                    sort(a, k);
                    best[p] = a[1]; med[p] = (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2;
                    line = line sprintf(" %6.2f (%5.2f)", best[p], med[p]);
                }
                line = line " ";
                for (p = 1; p <= 2; p++)
                    line = line sprintf(" %5.2f (%4.2f)", best[3] > 0 ? best[p] / best[3] : 0, med[3] > 0 ? med[p] / med[3] : 0);
                print line;
            }
        }
    }' "$RES"
