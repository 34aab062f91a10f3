#!/usr/bin/env bash
# Mixed jobs across a slow link: 2 hosts (network namespaces) of 2 ranks each, joined by a veth
# shaped by tc tbf to RATE (default 1gbit). Inside a host the ranks use shared memory, across
# hosts TCP. For all_reduce, reduce_scatter and all_gather (f32, MIN..MAX) it runs, in one
# invocation, the flat ring (--algorithm ring) and the planner's choice (hierarchical for
# these jobs) and prints both times and the speed-up; then small messages (8 B - 64 KiB) with
# shm inside each host against TCP for every link. Needs root (ip netns, tc). A benchmark, not
# a test: CI does not run it.
#
#   sudo bash bench/hierarchical.sh            RATE=10gbit MIN=1M MAX=16M bash bench/hierarchical.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1gbit}
MIN=${MIN:-1M}
MAX=${MAX:-64M}
ITERS=${ITERS:-3}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/hierarchical}
mkdir -p "$OUT"
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, tc)" >&2; exit 1; }

cargo build --release -q -p oxcomm-cli
OXCOMM="$(realpath "$TARGET/release/oxcomm")"
source bench/two_hosts.sh
two_hosts "oxh$$h" 10.77.0 "$RATE"

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?')"
echo "# 2 hosts (network namespaces) x 2 ranks, shm inside a host, TCP across; veth shaped to $RATE each way"
echo "# f32 sum, in place, $ITERS timed + 1 warm-up per size"
port=29600
run() { # name, extra bench args...
    local name=$1
    shift
    port=$((port + 1))
    on_two_hosts "$name" 2 "$port" -- --quiet --op all_reduce,reduce_scatter,all_gather -d f32 -b "$MIN" -e "$MAX" \
        -f 4 -n "$ITERS" -w 1 --json "$OUT/$name.json" "$@"
}
run flat --algorithm ring
run planned

# Small messages: the same 4 ranks with shm inside each host (the default) against TCP for every
# link (OXCOMM_TRANSPORT=tcp), in the same invocation.
small() { # name
    port=$((port + 1))
    on_two_hosts "$1" 2 "$port" -- --quiet --op all_reduce,broadcast -d f32 -b 8 -e 64K -f 8 -n 200 -w 20 \
        --json "$OUT/$1.json"
}
small small_mixed
OXCOMM_TRANSPORT=tcp small small_tcp
python3 - "$OUT" <<'PY'
import json, os, sys
def load(name):
    rows = [json.loads(l) for l in open(os.path.join(sys.argv[1], name + ".json")) if l.strip()]
    return {(r["op"], r["size_bytes"]): r for r in rows if r["in_place"]}
flat, planned = load("flat"), load("planned")
print(f"{'op':>15} {'size(B)':>10} {'transport':>9} {'ring(ms)':>10} {'planned(ms)':>12} {'busbw ring':>11} {'busbw plan':>11} {'speed-up':>9} {'wrong':>6}")
for key in sorted(flat):
    f, p = flat[key], planned.get(key)
    if p is None:
        continue
    print(f"{key[0]:>15} {key[1]:>10} {p['transport']:>9} {f['time_us']/1e3:10.2f} {p['time_us']/1e3:12.2f} "
          f"{f['busbw_gbps']:11.3f} {p['busbw_gbps']:11.3f} {f['time_us']/p['time_us']:8.2f}x {f['wrong']+p['wrong']:>6}")
print("#\n# small messages, all_reduce and broadcast in place, 20 warm-up + 200 timed: shm+tcp vs tcp everywhere")
mixed, tcp = load("small_mixed"), load("small_tcp")
print(f"{'op':>15} {'size(B)':>10} {'shm+tcp(us)':>12} {'tcp(us)':>10} {'ratio':>7}")
for key in sorted(mixed):
    m, t = mixed[key], tcp.get(key)
    if t is None:
        continue
    print(f"{key[0]:>15} {key[1]:>10} {m['time_us']:12.1f} {t['time_us']:10.1f} {m['time_us']/t['time_us']:7.2f}")
PY
