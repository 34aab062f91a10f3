#!/usr/bin/env bash
# 2-rank loopback TCP all_reduce against the loopback TCP ceiling, in one invocation.
#
# Each round runs, back to back:
#   1. the ceiling: two sockets of one loopback connection streaming 4 MiB chunks both ways at
#      once, no collective and no reduction (`stream2` of `cargo bench -p oxcomm --bench tcp`,
#      the rate of each direction; STREAM_RUNS runs, their median);
#   2. `oxcomm bench --transport tcp --world-size 2 --op all_reduce -d f32 -o sum` from MIN to
#      MAX (×2 steps), in-place time. With 2 ranks busbw = size / time: the bytes each direction
#      of the one link carries per second, the same measure as the ceiling's;
#   3. with BASE set (another oxcomm binary, e.g. a build of the commit before a change), the
#      same all_reduce sweep with BASE, so a before/after comparison shares the rounds.
# ROUNDS rounds alternate these (the VM's speed drifts within minutes), then one table prints
# per size: the median over rounds of all_reduce busbw, of the ceiling, and their ratio (the
# target is >= 0.9 from 8 MiB), with the smallest and largest round's figure beside each.
#
#   bash bench/tcp_ceiling.sh
#   ROUNDS=5 BASE=/tmp/oxcomm-before bash bench/tcp_ceiling.sh
#
# Environment: ROUNDS (3), MIN (8M), MAX (256M), ITERS (5 timed calls per size), WARMUP (2),
# STREAM_MIB (1024 MiB per ceiling run), STREAM_RUNS (3), OXCOMM (the oxcomm binary; default
# built here, release), BASE (unset), OUT (raw output; default $CARGO_TARGET_DIR or target,
# then /tcp_ceiling). OXCOMM_TCP_* settings apply to both the ceiling and the all_reduce.
#
# A benchmark, not a test: CI does not run it. Other load on the machine changes the numbers.
set -euo pipefail

cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
MIN=${MIN:-8M}
MAX=${MAX:-256M}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
STREAM_MIB=${STREAM_MIB:-1024}
STREAM_RUNS=${STREAM_RUNS:-3}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/tcp_ceiling}
mkdir -p "$OUT"
rm -f "$OUT"/round_*.txt

if [ -z "${OXCOMM:-}" ]; then
    cargo build --release -q -p oxcomm-cli
    OXCOMM="$TARGET/release/oxcomm"
fi
OXCOMM="$(realpath "$OXCOMM")"
CEILING=$(cargo bench -q -p oxcomm --bench tcp --no-run --message-format=json 2>/dev/null |
    grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$CEILING" ] || { echo "tcp_ceiling.sh: could not build the tcp bench" >&2; exit 1; }

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# oxcomm $(git describe --always --dirty 2>/dev/null || echo '?'), kernel $(uname -r)${BASE:+, base $BASE}"

sweep() { # $1 binary, $2 output file
    "$1" bench --transport tcp --world-size 2 --op all_reduce -d f32 -o sum \
        -b "$MIN" -e "$MAX" -f 2 -n "$ITERS" -w "$WARMUP" --quiet >"$2"
}

# One ceiling run first, not counted: the first second of a run is often slower (other
# processes settling, clock ramp-up).
OXCOMM_BENCH_PARTS=stream2 OXCOMM_BENCH_STREAM_MIB=$STREAM_MIB OXCOMM_BENCH_STREAM_RUNS=1 "$CEILING" >/dev/null
for round in $(seq 1 "$ROUNDS"); do
    OXCOMM_BENCH_PARTS=stream2 OXCOMM_BENCH_STREAM_MIB=$STREAM_MIB OXCOMM_BENCH_STREAM_RUNS=$STREAM_RUNS \
        "$CEILING" >"$OUT/round_${round}_ceiling.txt"
    sweep "$OXCOMM" "$OUT/round_${round}_oxcomm.txt"
    if [ -n "${BASE:-}" ]; then
        sweep "$BASE" "$OUT/round_${round}_base.txt"
    fi
    echo "# round $round: ceiling $(grep -o 'median [0-9.]* GB/s' "$OUT/round_${round}_ceiling.txt")" >&2
done

echo "# all_reduce f32 sum in place, 2 ranks over loopback TCP, $WARMUP warm-up + $ITERS timed calls per"
echo "# size and round; busbw = size / time (GB/s = 1e9 B/s); ceiling = stream2 of the tcp bench"
echo "# ($STREAM_RUNS x $STREAM_MIB MiB both ways at once, median, per direction). Median of $ROUNDS rounds"
echo "# [smallest-largest round]; ratio = median busbw / median ceiling. Raw: $OUT"
# Input lines: "C <round> <GB/s>" (ceiling), "X|B <round> <size> <busbw> <wrong>" (oxcomm, base).
{
    for f in "$OUT"/round_*_ceiling.txt; do
        r=$(basename "$f" | cut -d_ -f2)
        sed -n 's/.*median \([0-9.]*\) GB\/s.*/C '"$r"' \1/p' "$f"
    done
    for kind in oxcomm:X base:B; do
        for f in "$OUT"/round_*_"${kind%%:*}".txt; do
            [ -e "$f" ] || continue
            r=$(basename "$f" | cut -d_ -f2)
            # A data row: $1 size, $10 in-place time (us), $13 in-place #wrong.
            awk -v k="${kind#*:}" -v r="$r" '!/^#/ && NF >= 13 { print k, r, $1, $1 / $10 / 1e3, $13 }' "$f"
        done
    done
} | awk '
    function med(list,    a, n, i, j, t) {
        n = split(list, a, " ")
        for (i = 2; i <= n; i++) { t = a[i] + 0; for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        lo = a[1]; hi = a[n]
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    $1 == "C" { ceil = ceil " " $3; next }
    { key = $1 SUBSEP $3; v[key] = v[key] " " $4; if (!($3 in seen)) { seen[$3] = 1; order[++k] = $3 }
      if ($5 != 0) wrong[$3] = 1; if ($1 == "B") hasb = 1 }
    END {
        c = med(ceil); clo = lo; chi = hi
        if (hasb) printf "%12s  %22s  %22s  %22s  %6s  %6s\n", "size(B)", "busbw [range]", "base [range]", "ceiling [range]", "ratio", "base"
        else printf "%12s  %22s  %22s  %6s\n", "size(B)", "busbw [range]", "ceiling [range]", "ratio"
        for (i = 1; i <= k; i++) {
            s = order[i]
            x = med(v["X", s]); xs = sprintf("%.3f [%.3f-%.3f]", x, lo, hi)
            cs = sprintf("%.3f [%.3f-%.3f]", c, clo, chi)
            bad = (s in wrong) ? "  WRONG VALUES" : ""
            if (hasb) {
                b = med(v["B", s]); bs = sprintf("%.3f [%.3f-%.3f]", b, lo, hi)
                printf "%12d  %22s  %22s  %22s  %6.3f  %6.3f%s\n", s, xs, bs, cs, x / c, b / c, bad
            } else printf "%12d  %22s  %22s  %6.3f%s\n", s, xs, cs, x / c, bad
        }
    }'
