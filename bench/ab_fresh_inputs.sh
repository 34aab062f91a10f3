#!/usr/bin/env bash
# Interleaved A/B of oxcomm builds against Open MPI with fresh inputs (2 ranks): each round runs
# Open MPI's bench/mpi_collectives.c -F, then every oxcomm binary given (`oxcomm bench
# --fresh-inputs`), op after op, under the shared machine lock; then prints, per op and size,
# the median over rounds of each one's time (mean of the calls, or P50=1: the median call) and
# Open MPI's time / its time (= busbw ratio; above 1 oxcomm is faster). Used for
# docs/perf_fresh_inputs.md. A benchmark, not a test.
#
#   ROUNDS=6 bash bench/ab_fresh_inputs.sh /tmp/ab target-a/release/oxcomm target-b/release/oxcomm
#
# Environment: ROUNDS (2), OPS (all_gather broadcast all_to_all gather scatter), MIN (64K),
# MAX (1M), ITERS (200), WARMUP (20), P50 (0), LOCK (/tmp/machine.lock; flock's lock file).
set -euo pipefail
OUTD=$1
shift
ROUNDS=${ROUNDS:-2}
OPS=${OPS:-"all_gather broadcast all_to_all gather scatter"}
MIN=${MIN:-64K} MAX=${MAX:-1M} ITERS=${ITERS:-200} WARMUP=${WARMUP:-20}
LOCK=${LOCK:-/tmp/machine.lock}
ARGS=(-b "$(numfmt --from=iec "$MIN")" -e "$(numfmt --from=iec "$MAX")" -f 2 -n "$ITERS" -w "$WARMUP")
mkdir -p "$OUTD"
mpicc -O3 -march=native -o "$OUTD/mpi_collectives" "$(dirname "$0")/mpi_collectives.c"
MPIRUN=(mpirun --bind-to none -np 2)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

round() {
    for op in $OPS; do
        "${MPIRUN[@]}" "$OUTD/mpi_collectives" -o "$op" "${ARGS[@]}" -F >>"$OUTD/ompi_$op.txt"
        local i=0
        for b in "$@"; do
            i=$((i + 1))
            "$b" bench --transport shm --world-size 2 --op "$op" --dtype f32 --redop sum --root 0 "${ARGS[@]}" \
                --fresh-inputs --quiet >>"$OUTD/b${i}_$op.txt"
        done
    done
}

for r in $(seq 1 "$ROUNDS"); do
    echo "# round $r: load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%T)" | tee -a "$OUTD/load.txt"
    exec 9>"$LOCK"
    flock 9
    round "$@"
    flock -u 9
done

# Data lines: $1 size, $6 / $10 mean time out of place / in place, $14 / $15 their p50.
for op in $OPS; do
    echo "## $op: us, Open MPI then each binary (Open MPI's time / its time)"
    files=("$OUTD/ompi_$op.txt")
    for i in $(seq 1 $#); do files+=("$OUTD/b${i}_$op.txt"); done
    awk -v nb=$# -v P50="${P50:-0}" '
        FNR == 1 { f++ }
        /^#/ || NF < 13 { next }
        {
            for (m = 0; m < 2; m++) { k = f SUBSEP $1 SUBSEP m; c[k]++; v[k, c[k]] = P50 ? $(14 + m) : $(6 + 4 * m) }
            if (!($1 in seen)) { seen[$1] = 1; order[++ns] = $1 }
        }
        function med(k,    n, i, j, a, t) {
            n = c[k]
            for (i = 1; i <= n; i++) a[i] = v[k, i]
            for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
            return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
        }
        END {
            for (i = 1; i <= ns; i++) {
                s = order[i]; line = sprintf("%9d", s)
                for (m = 0; m < 2; m++) {
                    o = med(1 SUBSEP s SUBSEP m); line = line sprintf(" | %s %7.2f", m ? "ip" : "oop", o)
                    for (b = 1; b <= nb; b++) { x = med((b + 1) SUBSEP s SUBSEP m); line = line sprintf(" %7.2f(%.2f)", x, o / x) }
                }
                print line
            }
        }' "${files[@]}"
done
