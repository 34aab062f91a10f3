#!/usr/bin/env bash
# The fast path's cost of a change, A/B: two oxcomm binaries take turns, ROUNDS times, on the
# 8 B and 1 MiB all_reduce (f32, sum, 2 ranks over shared memory, out of place and in place),
# so load that comes and goes hits them alike. Written for issue 39 (revocation must cost a
# job that never fails nothing). A benchmark, not a test: CI does not run it.
#
#   BASE=/tmp/main/oxcomm NEW=target/release/oxcomm bash bench/ab_fast_path.sh
#
# Environment: BASE, NEW (binaries; required), ROUNDS (6), RANKS (2), N8 (50000 timed calls at
# 8 B), N1M (300 at 1 MiB). Output: per size and mode, each binary's best and median round
# (mean us per call, max over ranks) and NEW/BASE of the medians. Run it under the machine's
# lock and quote `uptime`.
set -euo pipefail
BASE=${BASE:?set BASE to the old oxcomm binary}
NEW=${NEW:?set NEW to the new oxcomm binary}
ROUNDS=${ROUNDS:-6}
RANKS=${RANKS:-2}
N8=${N8:-50000}
N1M=${N1M:-300}
echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); $ROUNDS rounds, $RANKS ranks, shm"
RES=$(mktemp)
trap 'rm -f "$RES"' EXIT
for round in $(seq 1 "$ROUNDS"); do
    for size in 8 1048576; do
        n=$N8
        if [ "$size" -gt 8 ]; then n=$N1M; fi
        for prog in base new; do
            bin=$BASE
            if [ "$prog" = new ]; then bin=$NEW; fi
            "$bin" bench --transport shm --world-size "$RANKS" --op all_reduce --dtype f32 --redop sum \
                -b "$size" -e "$size" -n "$n" -w $((n / 10)) --quiet |
                awk -v p="$prog" -v s="$size" '$1 == s {print s, p, $6, $10}' >>"$RES"
        done
    done
done
python3 - "$RES" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
print(f"{'bytes':>8} {'mode':>4} {'base best':>10} {'base med':>10} {'new best':>10} {'new med':>10} {'new/base':>9}")
for size in ("8", "1048576"):
    for col, mode in ((2, "oop"), (3, "ip")):
        b = [float(r[col]) for r in rows if r[0] == size and r[1] == "base"]
        n = [float(r[col]) for r in rows if r[0] == size and r[1] == "new"]
        mb, mn = statistics.median(b), statistics.median(n)
        print(f"{size:>8} {mode:>4} {min(b):>10.2f} {mb:>10.2f} {min(n):>10.2f} {mn:>10.2f} {mn / mb:>9.3f}")
PY
