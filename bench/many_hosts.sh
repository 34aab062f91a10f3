#!/usr/bin/env bash
# all_reduce across H hosts on one machine, against Open MPI over TCP, gloo and the alpha-beta
# floor. Needs root (ip netns, tc). A benchmark, not a test: CI does not run it (it takes minutes).
#
# Each host is a network namespace with one veth into a bridge (in a namespace of its own, the
# "switch"); both directions of every host's link are shaped by tc tbf to RATE (this kernel has
# no netem: no added delay). One rank per host. For every H in HOSTS and RATE in RATES it runs,
# with the same sizes, warm-up and iterations (f32 sum, in place, the in-place column of each
# program's table):
#
#   oxcomm   `oxcomm launch --nnodes H` + `oxcomm bench --worker` (the planner's choice), and
#            once per algorithm in ALGOS forced with --algorithm (the planner's check)
#   ompi     bench/mpi_collectives.c under mpirun over TCP (btl tcp,self; its daemons started
#            in each namespace by an rsh agent this script writes). Each "host" has one slot, so
#            Open MPI polls without yielding; with more hosts than this machine has cores it is
#            run both ways (mpi_yield_when_idle 0 and 1: polling starved the rank waited for at
#            4 hosts on 2 cores, 5 ms per 8 B op; yielding crawled at 8) and each cell keeps the
#            faster. A run that fails or overruns OMPI_DEADLINE is left out with a note.
#   gloo     bench/gloo_allreduce.py, torch.distributed's gloo backend (env:// rendezvous)
#   floor    alpha-beta: alpha = one-way time of an 8-byte TCP ping-pong between two hosts on
#            the shaped link (bench/tcp_pingpong.c, median), beta = 1 / RATE; the better of ring,
#            2(H-1)·alpha + 2(H-1)/H·S·beta, and recursive doubling, log2(H)·(alpha + S·beta)
#            (two more steps of each when H is not a power of two). TCP/IP headers (~4.5% at
#            MTU 1500) are not in it, so large sizes cannot quite reach it.
#
# After each oxcomm run it prints (to stderr) how many TCP segments the hosts retransmitted.
# Then it prints one table per rate: per size and H, each program's time, the algorithm the
# planner ran (`pick`, from oxcomm's JSON; `?` from an older binary), the best forced
# algorithm, and oxcomm's ratios to Open MPI, to the floor and to the best forced algorithm.
# Everything it made (namespaces, processes in them, the bridge) is removed on any exit.
#
#   sudo bash bench/many_hosts.sh                       # HOSTS="2 4 8 16" RATES="1gbit 10gbit"
#   HOSTS=4 RATES=1gbit RANGES="64K 1M 40 4" PEERS=ompi ALGOS="ring rd" bash bench/many_hosts.sh
#
# Environment: HOSTS ("2 4 8 16"), RATES ("1gbit 10gbit"), RANGES (sizes as "MIN MAX ITERS
# WARMUP" groups separated by ';', factor 4 within a group; default "8 8 1000 100;64K 1M 40 4;4M
# 64M 3 1"), PEERS ("ompi gloo": which peers run; "" for none), GLOO_MAX (largest size gloo runs, 64K: each
# gloo rank is a torch process), ALGOS ("ring rd": forced oxcomm algorithms; "" for none),
# BURST (tbf burst, 128k), DEADLINE (seconds each program run may take, 300), OMPI_DEADLINE (120),
# OMPI_YIELD (auto: "0 1" above this machine's core count, else 0; or "0", "1", "0 1"), OUT (raw
# tables; default $CARGO_TARGET_DIR or target, then /many_hosts), PYTHON (python3, with torch),
# TABLE_ONLY (1: run nothing, print the tables of an earlier run's $OUT/runs.tsv),
# OXCOMM_ENV (extra VAR=value words for the oxcomm ranks, e.g. OXCOMM_TCP_SPIN_US=0), OXCOMM_BIN
# (an oxcomm binary to run instead of building this checkout's), OXCOMM_BASE (another oxcomm
# binary, e.g. an older commit's, run beside it with the planner's choice: column "base").
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-"2 4 8 16"}
RATES=${RATES:-"1gbit 10gbit"}
RANGES=${RANGES:-"8 8 1000 100;64K 1M 40 4;4M 64M 3 1"}
PEERS=${PEERS-"ompi gloo"}
GLOO_MAX=${GLOO_MAX:-64K}
ALGOS=${ALGOS-"ring rd"}
BURST=${BURST:-128k}
DEADLINE=${DEADLINE:-300}
OMPI_DEADLINE=${OMPI_DEADLINE:-120}
OMPI_YIELD=${OMPI_YIELD:-auto}
PYTHON=${PYTHON:-python3}
OXCOMM_ENV=${OXCOMM_ENV:-}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/many_hosts}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, tc)" >&2; exit 1; }

NS="oxm$$h"   # host namespaces ${NS}0 .. ; the switch is ${NS}sw
NET=10.83.0   # host i is $NET.(i+1)
made=()       # namespaces made so far

cleanup() {
    local ns pid
    for ns in "${made[@]}"; do
        # Every process left in our namespaces is one this script started (a rank, a daemon).
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    done
    for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    made=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------
if [ -n "${OXCOMM_BIN:-}" ]; then
    OXCOMM=$(realpath "$OXCOMM_BIN")
else
    cargo build --release -q -p oxcomm-cli
    OXCOMM="$(realpath "$TARGET/release/oxcomm")"
fi
cc -O2 -o "$OUT/tcp_pingpong" bench/tcp_pingpong.c
if [[ " $PEERS " == *" ompi "* ]]; then
    if ! command -v mpicc >/dev/null 2>&1; then
        echo "# mpicc not found: installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
    fi
    mpicc -O3 -march=native -o "$OUT/mpi_collectives" bench/mpi_collectives.c
    # mpirun starts a daemon per host with this agent: "HOST COMMAND..." -> the host's namespace.
    cat >"$OUT/netns_agent.sh" <<EOF
#!/usr/bin/env bash
host=\$1; shift
exec ip netns exec "$NS\$(( \${host##*.} - 1 ))" bash -c "\$*"
EOF
    chmod +x "$OUT/netns_agent.sh"
fi
if [[ " $PEERS " == *" gloo "* ]]; then
    "$PYTHON" -c "import torch.distributed" || { echo "PYTHON=$PYTHON cannot import torch (gloo)" >&2; exit 1; }
fi

to_bytes() { numfmt --from=iec "$1"; }
GLOO_MAX_B=$(to_bytes "$GLOO_MAX")

# ---------------------------------------------------------------------------------------------
# Hosts
# ---------------------------------------------------------------------------------------------
make_hosts() { # H
    local h=$1 i
    ip netns add "${NS}sw"
    made+=("${NS}sw")
    ip -n "${NS}sw" link add br0 type bridge
    ip -n "${NS}sw" link set br0 up
    for ((i = 0; i < h; i++)); do
        ip netns add "$NS$i"
        made+=("$NS$i")
        ip -n "$NS$i" link add eth0 type veth peer name p$i netns "${NS}sw"
        ip -n "${NS}sw" link set "p$i" master br0
        ip -n "${NS}sw" link set "p$i" up
        ip -n "$NS$i" addr add "$NET.$((i + 1))/24" dev eth0
        ip -n "$NS$i" link set eth0 up
        ip -n "$NS$i" link set lo up
    done
}

shape() { # H RATE: both directions of every host's link
    local h=$1 rate=$2 i
    for ((i = 0; i < h; i++)); do
        ip netns exec "$NS$i" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$BURST" latency 20ms
        ip netns exec "${NS}sw" tc qdisc replace dev "p$i" root tbf rate "$rate" burst "$BURST" latency 20ms
    done
}

port=29700
next_port() { port=$((port + 1)); }

# Runs one program per host; host 0's output is $OUT/NAME.txt, host i's NAME_node$i.txt.
on_hosts() { # H NAME CMD... (@I@ in a word of CMD stands for the host's index)
    local h=$1 name=$2 i pids=() bad=0
    shift 2
    for ((i = h - 1; i >= 0; i--)); do
        local file="$OUT/$name.txt" cmd=("${@//@I@/$i}")
        [ "$i" = 0 ] || file="$OUT/${name}_node$i.txt"
        ip netns exec "$NS$i" timeout "$DEADLINE" "${cmd[@]}" >"$file" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || bad=1; done
    if [ "$bad" = 1 ]; then
        echo "# $name failed:" >&2
        tail -n 20 "$OUT/$name"*.txt >&2
        exit 1
    fi
}

# TCP segments the H hosts have retransmitted so far (each namespace's /proc/net/snmp): a run
# that loses packets in the tbf queues shows it here.
retransmits() { # H
    local h=$1 i sum=0 n
    for ((i = 0; i < h; i++)); do
        n=$(ip netns exec "$NS$i" awk '/^Tcp:/ { if (col) { print $col; exit } for (c = 1; c <= NF; c++) if ($c == "RetransSegs") col = c }' /proc/net/snmp)
        sum=$((sum + ${n:-0}))
    done
    echo "$sum"
}

run_oxcomm() { # H NAME MIN MAX ITERS WARMUP [ALGO [BINARY]]
    local h=$1 name=$2 min=$3 max=$4 iters=$5 warmup=$6 algo=${7:-} bin=${8:-$OXCOMM}
    next_port
    local extra="" before
    [ -z "$algo" ] || extra="--algorithm $algo"
    before=$(retransmits "$h")
    on_hosts "$h" "$name" env OXCOMM_TOKEN="$OXCOMM_TOKEN" $OXCOMM_ENV "$bin" launch --nnodes "$h" --node-rank @I@ \
        --master-addr "$NET.1" --master-port "$port" -n 1 -- "$bin" bench --worker --quiet --op all_reduce \
        -d f32 -o sum -b "$min" -e "$max" -f 4 -n "$iters" -w "$warmup" --json "$OUT/$name.json" $extra
    echo "# $name: $(($(retransmits "$h") - before)) TCP segments retransmitted" >&2
}

run_ompi() { # H NAME MIN MAX ITERS WARMUP YIELD -> 0 if it ran, 1 if it failed or overran
    local h=$1 name=$2 min=$3 max=$4 iters=$5 warmup=$6 yield=$7 i
    : >"$OUT/hostfile"
    for ((i = 0; i < h; i++)); do echo "$NET.$((i + 1)) slots=1" >>"$OUT/hostfile"; done
    ip netns exec "${NS}0" timeout "$OMPI_DEADLINE" mpirun --allow-run-as-root --hostfile "$OUT/hostfile" -n "$h" \
        --mca mpi_yield_when_idle "$yield" --bind-to none --mca plm_rsh_agent "$OUT/netns_agent.sh" \
        --mca plm_rsh_no_tree_spawn 1 --mca btl tcp,self --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
        "$OUT/mpi_collectives" -o all_reduce -b "$min" -e "$max" -f 4 -n "$iters" -w "$warmup" \
        >"$OUT/$name.txt" 2>&1 && return 0
    echo "# Open MPI (mpi_yield_when_idle $yield) failed or took over ${OMPI_DEADLINE}s at H=$h, $min..$max: left out" >&2
    return 1
}

run_gloo() { # H NAME MIN MAX ITERS WARMUP
    local h=$1 name=$2 min=$3 max=$4 iters=$5 warmup=$6
    next_port
    on_hosts "$h" "$name" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 MASTER_ADDR="$NET.1" MASTER_PORT="$port" \
        RANK=@I@ LOCAL_RANK=0 WORLD_SIZE="$h" LOCAL_WORLD_SIZE=1 "$PYTHON" bench/gloo_allreduce.py \
        -b "$min" -e "$max" -f 4 -n "$iters" -w "$warmup"
}

alpha() { # -> one-way µs between host 0 and host 1
    next_port
    ip netns exec "${NS}1" timeout 60 "$OUT/tcp_pingpong" server "$port" >/dev/null 2>&1 &
    local server=$!
    local line
    line=$(ip netns exec "${NS}0" timeout 60 "$OUT/tcp_pingpong" client "$NET.2" "$port" 4000)
    wait "$server" || true
    echo "$line" | awk '{ print $2 }'
}

# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------
export OXCOMM_TOKEN
OXCOMM_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
if [ "${TABLE_ONLY:-0}" = 1 ]; then HOSTS=""; fi
if [ "${TABLE_ONLY:-0}" != 1 ]; then
    echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); oxcomm $(git describe --always --dirty 2>/dev/null || echo '?'); $(mpirun --version 2>/dev/null | head -1 || true)"
    echo "# H hosts (network namespaces on a bridge), 1 rank each, every link tbf-shaped both ways (burst $BURST); all_reduce f32 sum in place"
    echo "# ranges (min max iters warm-up): $RANGES; peers: $PEERS (gloo up to $GLOO_MAX); forced oxcomm algorithms: ${ALGOS:-none}${OXCOMM_ENV:+; oxcomm env: $OXCOMM_ENV}"
fi
[ "${TABLE_ONLY:-0}" = 1 ] || : >"$OUT/runs.tsv" # rate H alpha_us program file
for h in $HOSTS; do
    cleanup
    make_hosts "$h"
    for rate in $RATES; do
        shape "$h" "$rate"
        a=$(alpha)
        tag="${rate}_h$h"
        IFS=';' read -ra groups <<<"$RANGES"
        g=0
        for group in "${groups[@]}"; do
            read -r min max iters warmup <<<"$group"
            g=$((g + 1))
            run_oxcomm "$h" "ox_${tag}_$g" "$min" "$max" "$iters" "$warmup"
            printf '%s\t%s\t%s\toxcomm\t%s\n' "$rate" "$h" "$a" "$OUT/ox_${tag}_$g.json" >>"$OUT/runs.tsv"
            if [ -n "${OXCOMM_BASE:-}" ]; then
                run_oxcomm "$h" "base_${tag}_$g" "$min" "$max" "$iters" "$warmup" "" "$(realpath "$OXCOMM_BASE")"
                printf '%s\t%s\t%s\tbase\t%s\n' "$rate" "$h" "$a" "$OUT/base_${tag}_$g.json" >>"$OUT/runs.tsv"
            fi
            for algo in $ALGOS; do
                run_oxcomm "$h" "ox_${algo}_${tag}_$g" "$min" "$max" "$iters" "$warmup" "$algo"
                printf '%s\t%s\t%s\t%s\t%s\n' "$rate" "$h" "$a" "$algo" "$OUT/ox_${algo}_${tag}_$g.json" >>"$OUT/runs.tsv"
            done
            if [[ " $PEERS " == *" ompi "* ]]; then
                yields=$OMPI_YIELD
                [ "$yields" != auto ] || { [ "$h" -le "$(nproc)" ] && yields=0 || yields="0 1"; }
                for y in $yields; do
                    if run_ompi "$h" "ompi_y${y}_${tag}_$g" "$min" "$max" "$iters" "$warmup" "$y"; then
                        printf '%s\t%s\t%s\tompi\t%s\n' "$rate" "$h" "$a" "$OUT/ompi_y${y}_${tag}_$g.txt" >>"$OUT/runs.tsv"
                    fi
                done
            fi
            if [[ " $PEERS " == *" gloo "* ]] && [ "$(to_bytes "$min")" -le "$GLOO_MAX_B" ]; then
                gmax=$max
                [ "$(to_bytes "$max")" -le "$GLOO_MAX_B" ] || gmax=$GLOO_MAX
                run_gloo "$h" "gloo_${tag}_$g" "$min" "$gmax" "$iters" "$warmup"
                printf '%s\t%s\t%s\tgloo\t%s\n' "$rate" "$h" "$a" "$OUT/gloo_${tag}_$g.txt" >>"$OUT/runs.tsv"
            fi
        done
    done
done
cleanup

"$PYTHON" - "$OUT/runs.tsv" <<'PY'
import json, math, sys
from collections import defaultdict

def rate_bits(rate):
    r = rate.lower()
    for unit, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(unit):
            return float(r[: -len(unit)]) * mul
    return float(r)

def floor_us(h, size, alpha_us, rate):
    beta_us = 8 / rate_bits(rate) * 1e6  # µs per byte
    ring = 2 * (h - 1) * alpha_us + 2 * (h - 1) / h * size * beta_us
    p = 1 << (h.bit_length() - 1)
    steps = int(math.log2(p)) + (2 if p != h else 0)
    rd = steps * (alpha_us + size * beta_us)
    return min(ring, rd)

def table_rows(path):
    """size -> (in-place time µs, wrong, algorithm run) of oxcomm's JSON or a peer's text table."""
    out = {}
    if path.endswith(".json"):
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                if r["in_place"]:
                    out[r["size_bytes"]] = (r["time_us"], r["wrong"], r.get("ran"))
        return out
    for line in open(path):
        f = line.split()
        if line.startswith("#") or len(f) < 13 or not f[0].isdigit():
            continue
        out[int(f[0])] = (float(f[9]), int(f[12]) if f[12].isdigit() else 0, None)
    return out

cells = defaultdict(dict)  # (rate, h, size) -> program -> time
picks = {}  # (rate, h, size) -> the algorithm the planner ran (oxcomm's JSON "ran")
alphas = {}
for line in open(sys.argv[1]):
    rate, h, a, prog, path = line.rstrip("\n").split("\t")
    h = int(h)
    alphas[(rate, h)] = float(a)
    for size, (t, wrong, ran) in table_rows(path).items():
        if wrong:
            print(f"# WRONG VALUES: {prog} H={h} {rate} {size} B: {wrong}")
        if prog == "oxcomm" and ran:
            picks[(rate, h, size)] = ran
        cell = cells[(rate, h, size)]
        cell[prog] = min(t, cell.get(prog, t))  # a program run twice (Open MPI's two modes): the faster

peers = ("ompi", "gloo", "base")
for rate in dict.fromkeys(k[0] for k in cells):
    hs = sorted({k[1] for k in cells if k[0] == rate})
    print(f"#\n# {rate}: alpha (one-way 8 B ping-pong, µs): " + ", ".join(f"H={h} {alphas[(rate, h)]:.1f}" for h in hs))
    print(f"{'size(B)':>9} {'H':>3} {'oxcomm':>9} {'pick':>6} {'best forced':>16} {'ompi':>9} {'gloo':>9} {'floor':>9}"
          f" {'ox/ompi':>8} {'ox/floor':>8} {'ox/best':>8} {'base':>9} {'ox/base':>8}")
    worst = defaultdict(float)
    for size in sorted({k[2] for k in cells if k[0] == rate}):
        for h in hs:
            c = cells.get((rate, h, size))
            if not c or "oxcomm" not in c:
                continue
            ox = c["oxcomm"]
            fl = floor_us(h, size, alphas[(rate, h)], rate)
            forced = {p: t for p, t in c.items() if p not in peers and p != "oxcomm"}
            best = min(forced.items(), key=lambda kv: kv[1]) if forced else None
            fmt = lambda t: f"{t:9.1f}" if t is not None else f"{'-':>9}"
            ratio = lambda a, b: f"{a / b:8.2f}" if b else f"{'-':>8}"
            best_s = f"{best[1]:.1f} {best[0]}" if best else "-"
            print(f"{size:>9} {h:>3} {fmt(ox)} {picks.get((rate, h, size), '?'):>6} {best_s:>16} {fmt(c.get('ompi'))} {fmt(c.get('gloo'))} {fmt(fl)}"
                  f" {ratio(ox, c.get('ompi'))} {ratio(ox, fl)} {ratio(ox, best[1] if best else None)}"
                  f" {fmt(c.get('base'))} {ratio(ox, c.get('base'))}")
            if best:
                worst["planner (ox/best forced)"] = max(worst["planner (ox/best forced)"], ox / best[1])
            if "ompi" in c:
                worst["ox/ompi"] = max(worst["ox/ompi"], ox / c["ompi"])
            worst["ox/floor"] = max(worst["ox/floor"], ox / fl)
    print("# worst: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
PY
