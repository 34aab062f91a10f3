#!/usr/bin/env bash
# Kill-to-go-on time (issue 39): 4 ranks over shared memory run 8-byte all_reduces; the last one
# is SIGKILLed (it kills itself after FT_OPS ops, stamping CLOCK_MONOTONIC first); the survivors
# find out, shrink (Communicator::shrink) and complete one all_reduce on the shrunk
# communicator. Prints, per round, the time from the death to the slowest survivor's first
# completed op there (and each survivor's), then the median and the worst round. Target
# (issue 39): <= 200 ms on shm. A benchmark, not a test: CI does not run it.
#
#   bash bench/ft_shrink.sh                 # builds the example (release), 10 rounds
#   ROUNDS=20 RANKS=4 bash bench/ft_shrink.sh
#
# Environment: ROUNDS (10), RANKS (4), FT_OPS (ops before the kill, 2000), OXCOMM_TRANSPORT
# (unset: shm), BIN (default: target/release/examples/ft_shrink, built here). Run it under the
# machine's lock (/work/bin/quiet here) and quote `uptime`.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-target}
ROUNDS=${ROUNDS:-10}
RANKS=${RANKS:-4}
BIN=${BIN:-$TARGET/release/examples/ft_shrink}
if [ "$BIN" = "$TARGET/release/examples/ft_shrink" ]; then
    cargo build --release -p oxcomm --example ft_shrink >&2
fi
TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); $RANKS ranks, transport ${OXCOMM_TRANSPORT:-shm}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
results=()
for round in $(seq 1 "$ROUNDS"); do
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    pids=()
    for r in $(seq 0 $((RANKS - 1))); do
        RANK=$r WORLD_SIZE=$RANKS LOCAL_RANK=$r LOCAL_WORLD_SIZE=$RANKS MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
            OXCOMM_TOKEN=$TOKEN OXCOMM_TIMEOUT=30 timeout 60 "$BIN" >"$WORK/$r.out" 2>"$WORK/$r.err" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do { wait "$p" || true; } 2>/dev/null; done
    kill_ns=$(awk '/^KILL_NS/ {print $2}' "$WORK/$((RANKS - 1)).out")
    line=$(for r in $(seq 0 $((RANKS - 2))); do
        awk -v k="$kill_ns" -v r="$r" '/^DONE_NS/ {printf "r%d=%.1f ", r, ($2 - k) / 1e6; found=1} END {if (!found) printf "r%d=FAILED ", r}' "$WORK/$r.out"
    done)
    worst=$(echo "$line" | tr ' ' '\n' | awk -F= '/=/ {if ($2 == "FAILED") {print "FAILED"; exit} if ($2 > m) m = $2} END {if (m != "") print m}' | tail -1)
    echo "round $round: worst ${worst} ms ($line) $(grep -h -o 'failed=\[[0-9, ]*\]' "$WORK"/*.out | sort -u | tr '\n' ' ')"
    if [ "$worst" = FAILED ]; then
        for r in $(seq 0 $((RANKS - 1))); do echo "--- rank $r"; cat "$WORK/$r.out" "$WORK/$r.err"; done
        exit 1
    fi
    results+=("$worst")
done
printf '%s\n' "${results[@]}" | sort -g | awk '{a[NR] = $1} END {printf "median of worst: %.1f ms, worst of all: %.1f ms (%d rounds)\n", (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2), a[NR], NR}'
