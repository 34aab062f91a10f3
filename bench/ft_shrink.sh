#!/usr/bin/env bash
# Kill-to-go-on time (issue 39): RANKS ranks run 8-byte all_reduces; the last one is SIGKILLed
# (it kills itself after FT_OPS ops, stamping CLOCK_MONOTONIC first), or with MODE=freeze
# SIGSTOPped; the survivors find out (a death through the link, a freeze through the heartbeat
# lapse), shrink (Communicator::shrink) and complete one all_reduce on the shrunk communicator.
# Prints, per round, the time from the death to the slowest survivor's first completed op there
# (and each survivor's), the time from the death to the slowest survivor's error (the op that
# found the death, before the shrink) and the failed set each reported, then the medians and the
# worst round.
# With MODE=freeze the frozen rank is resumed once the survivors are done and must find itself
# left out (its next op fails). Targets (issue 39): kill <= 200 ms on shm, <= 1 s over TCP;
# freeze <= the heartbeat lapse + 1 s. A benchmark, not a test: CI does not run it.
#
#   bash bench/ft_shrink.sh                         # 4 ranks, one host (shm), kill, 10 rounds
#   HOSTS=2 bash bench/ft_shrink.sh                 # 2 hosts x 2 ranks: network namespaces, TCP
#   MODE=freeze HOSTS=2 ROUNDS=5 bash bench/ft_shrink.sh
#
# Environment: ROUNDS (10), RANKS (4), HOSTS (1, or 2: two network namespaces joined by a veth
# pair shaped to RATE, 10gbit; needs root; the victim is on the second host), MODE (kill |
# freeze), SUSPECT_MS (the heartbeat lapse for MODE=freeze, 1000), FT_OPS (ops before the
# fault, 2000), OXCOMM_TRANSPORT (unset: shm within a host, TCP across), BIN (default:
# target/release/examples/ft_shrink, built here). Run it under the machine's lock
# (/work/bin/quiet here) and quote `uptime`.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-target}
ROUNDS=${ROUNDS:-10}
RANKS=${RANKS:-4}
HOSTS=${HOSTS:-1}
MODE=${MODE:-kill}
SUSPECT_MS=${SUSPECT_MS:-1000}
BIN=${BIN:-$TARGET/release/examples/ft_shrink}
case "$MODE" in kill | freeze) ;; *) echo "MODE must be kill or freeze, not $MODE" >&2; exit 2 ;; esac
case "$HOSTS" in 1 | 2) ;; *) echo "HOSTS must be 1 or 2, not $HOSTS" >&2; exit 2 ;; esac
if [ $((RANKS % HOSTS)) -ne 0 ]; then echo "RANKS ($RANKS) must be a multiple of HOSTS ($HOSTS)" >&2; exit 2; fi
if [ "$BIN" = "$TARGET/release/examples/ft_shrink" ]; then
    cargo build --release -p oxcomm --example ft_shrink >&2
fi
WORK=$(mktemp -d)
ADDR=127.0.0.1
if [ "$HOSTS" = 2 ]; then
    [ "$(id -u)" = 0 ] || { echo "HOSTS=2 needs root (ip netns, tc)" >&2; exit 1; }
    # shellcheck source=bench/two_hosts.sh
    source bench/two_hosts.sh
    two_hosts "oxft$$h" 10.77.$((RANDOM % 200 + 20)) "${RATE:-10gbit}"
    trap 'for i in 0 1; do ip netns del "$TWO_HOSTS_NS$i" 2>/dev/null || true; done; rm -rf "$WORK"' EXIT
    ADDR=$TWO_HOSTS_NET.1
else
    trap 'rm -rf "$WORK"' EXIT
    OXCOMM_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
fi
PER_HOST=$((RANKS / HOSTS))
VICTIM=$((RANKS - 1))
EXTRA=()
if [ "$MODE" = freeze ]; then EXTRA=(OXCOMM_SUSPECT_AFTER_MS="$SUSPECT_MS" FT_MODE=freeze FT_LINGER_MS=3000); fi
echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); $RANKS ranks on $HOSTS host(s), $MODE," \
    "transport ${OXCOMM_TRANSPORT:-shm within a host, tcp across}"
# Runs rank $1 on its host (a namespace when HOSTS=2).
on_host() {
    local r=$1 host=$(($1 / PER_HOST))
    local run=()
    if [ "$HOSTS" = 2 ]; then run=(ip netns exec "$TWO_HOSTS_NS$host"); fi
    "${run[@]}" env RANK="$r" WORLD_SIZE="$RANKS" LOCAL_RANK=$((r % PER_HOST)) LOCAL_WORLD_SIZE="$PER_HOST" \
        MASTER_ADDR="$ADDR" MASTER_PORT="$PORT" OXCOMM_TOKEN="$OXCOMM_TOKEN" OXCOMM_TIMEOUT=30 "${EXTRA[@]}" \
        timeout 60 "$BIN" >"$WORK/$r.out" 2>"$WORK/$r.err"
}
# Resumes the frozen victim once every survivor has printed DONE_NS (at most 40 s).
resume_victim() {
    local r
    for _ in $(seq 1 400); do
        local done_all=1
        for r in $(seq 0 $((RANKS - 2))); do grep -q '^DONE_NS' "$WORK/$r.out" 2>/dev/null || done_all=0; done
        if [ "$done_all" = 1 ]; then break; fi
        sleep 0.1
    done
    kill -CONT "$(awk '/^PID/ {print $2}' "$WORK/$VICTIM.out")" 2>/dev/null || true
}
results=()
errors=()
for round in $(seq 1 "$ROUNDS"); do
    # A port free on every host: on HOSTS=2 the namespaces have their own port space.
    PORT=$((20000 + RANDOM % 20000))
    pids=()
    for r in $(seq 0 $((RANKS - 1))); do
        on_host "$r" 2>/dev/null &
        pids+=($!)
    done
    if [ "$MODE" = freeze ]; then resume_victim; fi
    for p in "${pids[@]}"; do { wait "$p" || true; } 2>/dev/null; done
    kill_ns=$(awk '/^KILL_NS/ {print $2}' "$WORK/$VICTIM.out")
    line=$(for r in $(seq 0 $((RANKS - 2))); do
        awk -v k="$kill_ns" -v r="$r" '/^DONE_NS/ {printf "r%d=%.1f ", r, ($2 - k) / 1e6; found=1} END {if (!found) printf "r%d=FAILED ", r}' "$WORK/$r.out"
    done)
    worst=$(echo "$line" | tr ' ' '\n' | awk -F= '/=/ {if ($2 == "FAILED") {print "FAILED"; exit} if ($2 > m) m = $2} END {if (m != "") print m}' | tail -1)
    err_worst=$(for r in $(seq 0 $((RANKS - 2))); do awk -v k="$kill_ns" '/^ERROR_NS/ {printf "%.1f\n", ($2 - k) / 1e6}' "$WORK/$r.out"; done |
        sort -g | tail -1)
    sets=$(grep -h -o 'failed=\[[0-9, ]*\]' "$WORK"/*.out | sort -u | tr '\n' ' ')
    resumed=""
    if [ "$MODE" = freeze ]; then
        resumed="resumed: $(grep -h -o '^LEFT_OUT [A-Za-z]*\|^COMPLETED' "$WORK/$VICTIM.out" || echo 'nothing')"
    fi
    echo "round $round: worst ${worst} ms ($line) error ${err_worst:-?} ms $sets$resumed"
    if [ "$worst" = FAILED ] || [ "$(echo "$sets" | wc -w)" != 1 ] || [[ "$resumed" == *COMPLETED* ]] ||
        [[ "$resumed" == *nothing* ]]; then
        for r in $(seq 0 $((RANKS - 1))); do echo "--- rank $r"; cat "$WORK/$r.out" "$WORK/$r.err"; done
        exit 1
    fi
    results+=("$worst")
    if [ -n "${err_worst:-}" ]; then errors+=("$err_worst"); fi
done
median() { sort -g | awk -v what="$1" '{a[NR] = $1} END {if (NR) printf "median of %s: %.1f ms, worst of all: %.1f ms (%d rounds)\n", what, (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2), a[NR], NR}'; }
printf '%s\n' "${results[@]}" | median worst
if [ "${#errors[@]}" -gt 0 ]; then printf '%s\n' "${errors[@]}" | median "worst error (kill -> survivors' error)"; fi
