#!/usr/bin/env bash
# oxcomm's TCP transport between hosts, on one machine (needs root for `ip netns` and `tc`):
#
# 1. Two "hosts", each a network namespace, joined by one veth pair whose both ends are shaped
#    by tc (tbf; this kernel may lack netem) to each line rate in RATES (`unshaped`: no qdisc,
#    which shows what the CPU allows). One rank per host (`oxcomm launch --nnodes 2`),
#    `oxcomm bench --worker --op all_reduce` from MIN_LINK to MAX, f32 sum. Prints in-place
#    time, busbw and the fraction of the line rate: busbw * 8 / rate.
# 2. Loopback, 2 ranks: `oxcomm bench --transport tcp` beside torch.distributed's gloo backend
#    (bench/gloo_allreduce.py, same sizes, method and columns), and the ratio oxcomm/gloo:
#    busbw for sizes >= 1 MiB (above 1 = oxcomm faster), time for smaller ones (below 1 =
#    oxcomm faster). torch comes from PyPI into a venv (VENV) when `import torch` fails there.
#    Then the ceiling: two plain sockets streaming both ways at once over loopback.
#
# Why busbw * 8 / rate: for all_reduce nccl-tests defines busbw = algbw * 2(n-1)/n, which is
# the rate at which each rank's link carries data in a ring (each rank sends, and receives,
# 2(n-1)/n * size bytes per all_reduce). With 2 ranks busbw = size / time, exactly the bytes
# per second each direction of the one link carries; tc shapes each direction to RATE, so
# busbw * 8 / RATE (in Gbit/s) is the fraction of the line used. TCP/IP and Ethernet headers
# (66 B per 1514 B frame at MTU 1500, counted by tbf) cap it near 0.96.
#
# A benchmark, not a test: CI does not run it. Other load on the machine changes the numbers.
#
#   sudo bench/tcp_links.sh
#   RATES=1gbit MAX=64M SKIP_GLOO=1 bench/tcp_links.sh
#
# Environment: RATES ("1gbit 10gbit unshaped"), BURST (tbf burst, 128k: two 64 KiB GSO
# segments; tbf needs at least one), MIN_LINK (1K), MAX (256M), LINK_ITERS (5),
# LINK_WARMUP (1), MIN (8, loopback), ITERS (20), WARMUP (5), SKIP_GLOO (0), VENV
# ($TARGET/gloo-venv), OUT (raw tables; default $CARGO_TARGET_DIR or target, then /tcp_links),
# SKIP_RAW (0; 1 skips the raw-socket ceiling printed after the loopback table), RAW_MIB (1024).
set -euo pipefail

cd "$(dirname "$0")/.."
RATES=${RATES:-"1gbit 10gbit unshaped"}
BURST=${BURST:-128k}
MIN_LINK=${MIN_LINK:-1K}
MIN=${MIN:-8}
MAX=${MAX:-256M}
LINK_ITERS=${LINK_ITERS:-5}
LINK_WARMUP=${LINK_WARMUP:-1}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
SKIP_GLOO=${SKIP_GLOO:-0}
TARGET=${CARGO_TARGET_DIR:-target}
VENV=${VENV:-$TARGET/gloo-venv}
OUT=${OUT:-$TARGET/tcp_links}
mkdir -p "$OUT"

cargo build --release -q -p oxcomm-cli
OXCOMM="$(realpath "$TARGET/release/oxcomm")"

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# oxcomm $(git describe --always --dirty 2>/dev/null || echo '?'), kernel $(uname -r)"

# A data row of either table: $1 size, $10 in-place time (us), $13 in-place #wrong (launcher
# output carries a "[0] " prefix, stripped first). busbw is computed from size and time (the
# tables round it to 0.01 GB/s); with 2 ranks busbw = algbw = size / time.
rows() { sed 's/^\[[0-9]*\] //' "$1" | awk '!/^#/ && NF >= 13'; }

# ------------------------------------------------------------------------------------------
# 1. Two namespaces, shaped link
# ------------------------------------------------------------------------------------------
NS="oxb$$h"
cleanup() {
    for i in 0 1; do ip netns del "$NS$i" 2>/dev/null || true; done
}
trap cleanup EXIT

if [ "$(id -u)" != 0 ]; then
    echo "# SKIPPED the namespace part: needs root (ip netns, tc)"
else
    ip netns add "${NS}0"
    ip netns add "${NS}1"
    ip -n "${NS}0" link add eth0 type veth peer name eth0 netns "${NS}1"
    for i in 0 1; do
        ip -n "$NS$i" addr add "10.78.0.$((i + 1))/24" dev eth0
        ip -n "$NS$i" link set eth0 up
        ip -n "$NS$i" link set lo up
    done
    export OXCOMM_TOKEN
    OXCOMM_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    port=29400 # the namespaces are new and hold nothing else, so any port is free there
    for rate in $RATES; do
        if [ "$rate" = unshaped ]; then
            bits=0
            for i in 0 1; do ip netns exec "$NS$i" tc qdisc del dev eth0 root 2>/dev/null || true; done
        else
            bits=$(echo "$rate" | awk '{ v = $1 + 0; u = tolower($1); if (u ~ /gbit/) v *= 1e9; else if (u ~ /mbit/) v *= 1e6; print v }')
            for i in 0 1; do
                ip netns exec "$NS$i" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$BURST" latency 20ms
            done
        fi
        port=$((port + 1))
        args=(bench --worker --quiet --op all_reduce -d f32 -o sum -b "$MIN_LINK" -e "$MAX" -f 2
            -n "$LINK_ITERS" -w "$LINK_WARMUP")
        launch=(launch --nnodes 2 --master-addr 10.78.0.1 --master-port "$port" -n 1)
        ip netns exec "${NS}1" "$OXCOMM" "${launch[@]}" --node-rank 1 -- "$OXCOMM" "${args[@]}" \
            >"$OUT/link_${rate}_node1.txt" 2>&1 &
        node1=$!
        ip netns exec "${NS}0" "$OXCOMM" "${launch[@]}" --node-rank 0 -- "$OXCOMM" "${args[@]}" \
            >"$OUT/link_$rate.txt" 2>&1 || { cat "$OUT/link_$rate.txt" "$OUT/link_${rate}_node1.txt" >&2; exit 1; }
        wait "$node1"
        echo "#"
        if [ "$bits" = 0 ]; then
            echo "# 2 hosts (network namespaces), 1 rank each, veth not shaped (the CPU is the limit);"
        else
            echo "# 2 hosts (network namespaces), 1 rank each, veth shaped by tbf to $rate each way (burst $BURST:"
            echo "# a message that fits in the burst passes at full speed, so small sizes can exceed the line);"
        fi
        echo "# f32 sum all_reduce in place, $LINK_WARMUP warm-up + $LINK_ITERS timed (raw: $OUT/link_$rate.txt)"
        grep -m1 '# oxcomm bench' "$OUT/link_$rate.txt" | sed 's/^\[[0-9]*\] //'
        # busbw from the time (the table rounds it to 0.01 GB/s); 2 ranks: busbw = size / time.
        rows "$OUT/link_$rate.txt" | awk -v bits="$bits" '
            BEGIN { printf "%12s  %12s  %12s  %10s  %s\n", "size(B)", "time(us)", "busbw(GB/s)", "of line", "#wrong" }
            { bw = $1 / $10 / 1e3; line = bits > 0 ? sprintf("%10.3f", bw * 8e9 / bits) : sprintf("%10s", "-")
              printf "%12d  %12s  %12.4f  %s  %s\n", $1, $10, bw, line, $13 }'
    done
fi

# What the kernel's loopback TCP itself allows on this machine: two sockets streaming 4 MiB
# chunks both ways at once (a 2-rank ring all_reduce sends and receives at the same time), no
# collective and no reduction. A 2-rank all_reduce's busbw cannot exceed this per-direction rate.
ceiling() {
    [ "${SKIP_RAW:-0}" = 1 ] && return 0
    echo "#"
    echo "# ceiling: raw loopback TCP between two sockets (cargo bench -p oxcomm --bench tcp)"
    OXCOMM_BENCH_STREAM_MIB=${RAW_MIB:-1024} OXCOMM_BENCH_ITERS=2000 cargo bench -q -p oxcomm --bench tcp 2>/dev/null |
        grep -E '^stream' | sed 's/^/# /'
}

# ------------------------------------------------------------------------------------------
# 2. Loopback: oxcomm tcp vs gloo
# ------------------------------------------------------------------------------------------
ARGS=(-b "$MIN" -e "$MAX" -f 2 -n "$ITERS" -w "$WARMUP")
"$OXCOMM" bench --transport tcp --world-size 2 --op all_reduce -d f32 -o sum "${ARGS[@]}" --quiet \
    >"$OUT/loopback_oxcomm.txt"
if [ "$SKIP_GLOO" = 1 ]; then
    echo "#"
    echo "# loopback, 2 ranks, oxcomm tcp only (SKIP_GLOO=1); raw: $OUT/loopback_oxcomm.txt"
    rows "$OUT/loopback_oxcomm.txt" | awk '{ printf "%12d  %12s  %10.4f  %s\n", $1, $10, $1 / $10 / 1e3, $13 }'
    ceiling
    exit 0
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "# installing torch into $VENV (from PyPI; several GB)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch numpy >&2
fi
OMP_NUM_THREADS=1 "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    bench/gloo_allreduce.py "${ARGS[@]}" >"$OUT/loopback_gloo.txt" 2>"$OUT/loopback_gloo.err" ||
    { cat "$OUT/loopback_gloo.err" >&2; exit 1; }
echo "#"
echo "# loopback, 2 ranks on this host: oxcomm --transport tcp vs torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') gloo"
echo "# f32 sum all_reduce in place, $WARMUP warm-up + $ITERS timed, time = mean per call (max over ranks)"
echo "# ratio: oxcomm/gloo busbw for sizes >= 1 MiB, oxcomm/gloo time below (raw: $OUT/loopback_*.txt)"
awk '
    FNR == 1 { file++ }
    /^#/ || NF < 13 { next }
    file == 1 { gt[$1] = $10; gb[$1] = $1 / $10 / 1e3; gw[$1] = $13; order[++k] = $1 }
    file == 2 { xt[$1] = $10; xb[$1] = $1 / $10 / 1e3; xw[$1] = $13 }
    END {
        printf "%12s  %12s %10s  %12s %10s  %8s\n", "size(B)", "gloo(us)", "busbw", "oxcomm(us)", "busbw", "ratio";
        for (i = 1; i <= k; i++) {
            s = order[i];
            if (!(s in xt)) continue;
            if (s >= 1048576) { r = (gb[s] > 0) ? xb[s] / gb[s] : 0; kind = "busbw" }
            else { r = (gt[s] > 0) ? xt[s] / gt[s] : 0; kind = "time" }
            bad = (gw[s] != 0 || xw[s] != 0) ? "  WRONG VALUES" : "";
            printf "%12d  %12s %10.4f  %12s %10.4f  %8.2f %s%s\n", s, gt[s], gb[s], xt[s], xb[s], r, kind, bad;
        }
    }' "$OUT/loopback_gloo.txt" "$OUT/loopback_oxcomm.txt"

ceiling
