#!/usr/bin/env bash
# The compressed collectives across a slow link: 2 hosts (network namespaces) joined by a veth
# shaped by tc tbf to RATE (default 1gbit), 64 MiB f32, in one invocation:
#   1. 1 rank per host: all_reduce vs onebit_all_reduce (issue 5);
#   2. 2 ranks per host: reduce_scatter vs quant_reduce_scatter --ranks-per-host 2 (issue 6).
# Prints oxcomm bench's rows (time in µs, busbw on the uncompressed bytes, wire bytes) and the
# speed-up of each compressed op over its exact one. Needs root (ip netns, tc). A benchmark,
# not a test: CI does not run it.
#
#   sudo bash bench/compressed_links.sh            RATE=10gbit SIZE=16M bash bench/compressed_links.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1gbit}
SIZE=${SIZE:-64M}
ITERS=${ITERS:-3}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/compressed_links}
mkdir -p "$OUT"
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, tc)" >&2; exit 1; }

cargo build --release -q -p oxcomm-cli
OXCOMM="$(realpath "$TARGET/release/oxcomm")"
source bench/two_hosts.sh
two_hosts "oxq$$h" 10.79.0 "$RATE"

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?')"
echo "# 2 hosts (network namespaces), veth shaped to $RATE each way, f32, $SIZE, $ITERS timed + 1 warm-up"
port=29500
run() { # name, ranks per host, ops, extra args...
    local name=$1 nproc=$2 ops=$3
    shift 3
    port=$((port + 1))
    on_two_hosts "$name" "$nproc" "$port" -- --quiet --op "$ops" -d f32 -b "$SIZE" -e "$SIZE" -n "$ITERS" -w 1 \
        --json "$OUT/$name.json" "$@"
    # One line per op: in-place time, busbw, wire bytes, wrong.
    python3 - "$OUT/$name.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ip = {r["op"]: r for r in rows if r["in_place"]}
for op, r in ip.items():
    print(f"  {op:>22}  world {r['world_size']}  {r['time_us']/1000:10.1f} ms  busbw {r['busbw_gbps']:6.3f} GB/s  wire {r.get('wire_bytes', 0):>12} B  wrong {r['wrong']}")
ops = list(ip)
if len(ops) == 2:
    exact, comp = ops
    print(f"  speed-up {comp} over {exact}: {ip[exact]['time_us'] / ip[comp]['time_us']:.1f}x")
PY
}
echo "# 1 rank per host"
run onebit 1 all_reduce,onebit_all_reduce
echo "# 2 ranks per host (qgZ: inside each host, then across)"
run qgz 2 reduce_scatter,quant_reduce_scatter --ranks-per-host 2
