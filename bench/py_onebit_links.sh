#!/usr/bin/env bash
# oxcomm's 1-bit optimizers over a slow link against exact Adam on gloo: 2 hosts (network
# namespaces, one rank each) joined by a veth shaped by tc tbf to RATE (default 1gbit), training
# an MLP of about 25 M parameters (WIDTH 2048 x LAYERS 6, GELU, batch 8). Every run trains WARMUP
# untimed steps (the 1-bit optimizers' exact warm-up: they freeze at step WARMUP - 2) then STEPS
# timed ones, from the same seed, so the losses printed are comparable. Prints the time per step of
#   1. oxcomm.torch.OnebitAdam on backend "oxcomm" (1-bit compressed momenta after the warm-up),
#   2. oxcomm.torch.OnebitLamb on "oxcomm" (the same phases),
#   3. oxcomm.torch.ZeroOneAdam on "oxcomm" (local steps, synchronized every 1, 2, then 4 steps),
#   4. exact data-parallel Adam (DDP + torch.optim.Adam) on "gloo",
#   5. the same exact Adam on "oxcomm",
# and the speed-up of 1, 2 and 3 over 4. Reuses bench/two_hosts.sh's namespace set-up (as
# compressed_links.sh does). Needs root (ip netns, tc) and `pip install ./crates/oxcomm-py`.
# A benchmark, not a test: CI does not run it.
#
#   sudo bash bench/py_onebit_links.sh          RATE=10gbit STEPS=3 WARMUP=12 WIDTH=512 bash bench/py_onebit_links.sh
#   ONLY="onebit adam_gloo" bash bench/py_onebit_links.sh     (a subset of the runs, by name)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1gbit}
WIDTH=${WIDTH:-2048}
LAYERS=${LAYERS:-6}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-32}
DEADLINE=${DEADLINE:-1200}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/py_onebit_links}
mkdir -p "$OUT"
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, tc)" >&2; exit 1; }
python3 -c "import oxcomm.torch" || { echo "oxcomm is not installed: pip install ./crates/oxcomm-py" >&2; exit 1; }

source bench/two_hosts.sh
two_hosts "oxp$$h" 10.79.1 "$RATE"

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?')"
echo "# 2 hosts (network namespaces), veth shaped to $RATE each way, MLP $LAYERS x $WIDTH, $WARMUP warm-up + $STEPS timed steps"
port=29600
run() { # name, optimizer, backend
    local name=$1 optimizer=$2 backend=$3
    local args=(--optimizer "$optimizer" --backend "$backend" --width "$WIDTH" --layers "$LAYERS"
        --steps "$STEPS" --warmup "$WARMUP" --freeze-step $((WARMUP > 4 ? WARMUP - 2 : 2)))
    local rdzv=(--nnodes 2 --nproc-per-node 1 --master-addr "$TWO_HOSTS_NET.1" --master-port "$port")
    ip netns exec "${TWO_HOSTS_NS}1" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 timeout "$DEADLINE" \
        python3 -m torch.distributed.run "${rdzv[@]}" --node-rank 1 bench/py_onebit_step.py "${args[@]}" \
        >"$OUT/${name}_node1.txt" 2>&1 &
    local node1=$!
    ip netns exec "${TWO_HOSTS_NS}0" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 timeout "$DEADLINE" \
        python3 -m torch.distributed.run "${rdzv[@]}" --node-rank 0 bench/py_onebit_step.py "${args[@]}" \
        >"$OUT/$name.txt" 2>&1 || { cat "$OUT/$name.txt" "$OUT/${name}_node1.txt" >&2; exit 1; }
    wait "$node1" || { cat "$OUT/${name}_node1.txt" >&2; exit 1; }
    grep -E "ms/step" "$OUT/$name.txt" | tail -1
}
ONLY=${ONLY:-onebit lamb zoadam adam_gloo adam_oxcomm}
declare -A line
for name in $ONLY; do
    port=$((port + 1)) # run() runs in a subshell: a fresh port per run, counted here
    case $name in
    onebit | lamb | zoadam) line[$name]=$(run "$name" "$name" oxcomm) ;;
    adam_gloo) line[$name]=$(run adam_gloo adam gloo) ;;
    adam_oxcomm) line[$name]=$(run adam_oxcomm adam oxcomm) ;;
    *) echo "unknown run $name (onebit lamb zoadam adam_gloo adam_oxcomm)" >&2; exit 2 ;;
    esac
    echo "  ${line[$name]}"
done
median() { sed -E 's/.*median +([0-9.]+) ms.*/\1/' <<<"$1"; }
if [ -n "${line[adam_gloo]:-}" ]; then
    for name in onebit lamb zoadam; do
        [ -n "${line[$name]:-}" ] || continue
        python3 -c "import sys; print(f'  speed-up of {sys.argv[1]} (oxcomm) over exact Adam (gloo): {float(sys.argv[3]) / float(sys.argv[2]):.1f}x')" \
            "$name" "$(median "${line[$name]}")" "$(median "${line[adam_gloo]}")"
    done
fi
