#!/usr/bin/env bash
# oxcomm bench (shm transport, release build) against Intel oneCCL and Open MPI, all_reduce only
# (f32, sum), 2 ranks, 8 B and 8 KiB to 2 MiB (x2 steps), out of place and in place, the three
# programs interleaved ROUNDS times in one invocation. A benchmark, not a test: CI does not run it.
#
#   bench/vs_oneccl.sh                 # defaults below
#   ROUNDS=5 bench/vs_oneccl.sh
#
# Environment: ROUNDS (default 3), OUT (where the raw tables go; default $CARGO_TARGET_DIR or
# target, then /vs_oneccl), ONECCL_ENV (oneCCL's env.sh; default: shared/peers/oneccl/env.sh in
# the nearest folder above this repository that has one), OXCOMM (an oxcomm binary to time instead
# of building this tree's release one: for A/B runs of two builds).
#
# The programs:
# - oneCCL: `ccl_allreduce` (shared/peers/oneccl/ccl_allreduce.cpp, built by that folder's
#   setup.sh) in the fastest configuration found on the 2-core VM (shared/peers/oneccl/README.md):
#   Intel MPI over shared memory as its transport, its `direct` algorithm up to 512 KiB and
#   `nreduce` above, ranks pinned to cores 0 and 1 (I_MPI_PIN). Skipped, with a message, when
#   oneCCL is not set up here.
# - Open MPI: bench/mpi_collectives.c -o all_reduce (as bench/vs_openmpi.sh builds and runs it,
#   mpirun --bind-to none).
# - oxcomm: `oxcomm bench --op all_reduce --world-size 2` (processes over shared memory, not
#   pinned).
#
# How the comparison is kept fair: all three time the same thing, per size and mode: a barrier,
# W warm-up calls, a barrier, then N calls back to back timed as a whole; time = mean per call
# on each rank, then the maximum over ranks (read each program's header: ccl_allreduce's
# README says median, its source times the mean; mpi_collectives and oxcomm bench also print a
# median column, which this script does not use). W + N is fixed in ccl_allreduce (200 + 2000
# below 64 KiB, 5 + 20 from 64 KiB), so the other two run with the same counts. Same sizes (the
# whole buffer), same busbw formula (algbw * 2(n-1)/n). Per size and mode the table shows the
# best (lowest) mean over the ROUNDS rounds, for every program alike: the run least disturbed
# by the host's other load, which on a 2-core VM is the one figure that repeats.
#
# Ratio columns: oxcomm's busbw / the peer's (= the peer's time / oxcomm's; above 1 = oxcomm
# faster), at every size. The summary line gives each mode's worst ratio over 8 KiB-2 MiB.
# Other load on the host changes every number a lot: check `uptime` first.
#
# PLACEMENT=1 tags every round with where the host placed the two vCPUs: bench/floor_cma.c
# (built here) measures a cache line's round trip between two pinned processes before and after
# the round; below 60 ns they share a core ("smt"), below 180 ns they are near ("near"), else far
# apart ("far"; docs/perf_far_cores.md). The 2-core test VM moves between the three within
# minutes, and far apart every program slows down (oxcomm's mid all_reduce by 1.3-1.8x, oneCCL's
# by ~1.2x). A round whose two probes disagree is left out, and the table is printed once per
# placement seen, from that placement's rounds alone (ROUNDS=100 kept 62 near and 5 far rounds in
# one run: far spells are often shorter than a round).
set -euo pipefail

cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
PLACEMENT=${PLACEMENT:-0}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=${OUT:-$TARGET/vs_oneccl}
N=2
mkdir -p "$OUT"

# oneCCL's environment: the first shared/peers/oneccl/env.sh above the repository.
if [ -z "${ONECCL_ENV:-}" ]; then
    dir=$(pwd)
    while [ "$dir" != / ]; do
        dir=$(dirname "$dir")
        if [ -f "$dir/shared/peers/oneccl/env.sh" ]; then
            ONECCL_ENV="$dir/shared/peers/oneccl/env.sh"
            break
        fi
    done
fi
HAVE_CCL=0
if [ -n "${ONECCL_ENV:-}" ] && [ -f "$ONECCL_ENV" ]; then
    # The env file sets ONECCL_DIR (and puts Intel MPI's mpirun first on PATH: only in subshells).
    CCL_DIR=$(bash -c 'source "$1" && echo "$ONECCL_DIR"' _ "$ONECCL_ENV")
    if [ -x "$CCL_DIR/ccl_allreduce" ]; then HAVE_CCL=1; fi
fi
if [ "$HAVE_CCL" = 0 ]; then
    echo "# oneCCL skipped: no shared/peers/oneccl/env.sh above this repository (or ONECCL_ENV), or no" >&2
    echo "# \$ONECCL_DIR/ccl_allreduce: run shared/peers/oneccl/setup.sh (see its README.md) to set it up" >&2
fi

if ! command -v mpicc >/dev/null 2>&1; then
    echo "# mpicc not found: installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
fi
mpicc -O3 -march=native -o "$OUT/mpi_collectives" bench/mpi_collectives.c
if [ -z "${OXCOMM:-}" ]; then
    cargo build --release -q -p oxcomm-cli
    OXCOMM="$TARGET/release/oxcomm"
fi
MPIRUN=(mpirun --bind-to none)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

echo "# host: $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# $(mpirun --version 2>/dev/null | head -1); oxcomm $OXCOMM ($(git describe --always --dirty 2>/dev/null || echo '?'))"
echo "# all_reduce f32 sum, $N ranks; 200 + 2000 calls below 64 KiB, 5 + 20 from 64 KiB; time = mean per call (max over ranks), best of $ROUNDS interleaved rounds"

# ccl_allreduce: one run per mode (it picks its own iteration counts by size).
run_ccl() { # $1: extra flag (--oop or nothing)
    # shellcheck disable=SC1090
    (
        source "$ONECCL_ENV"
        export I_MPI_PIN=1 I_MPI_PIN_PROCESSOR_LIST=0,1 CCL_ATL_TRANSPORT=mpi
        export "CCL_ALLREDUCE=direct:0-524288;nreduce:524289-max" CCL_ALLREDUCE_NREDUCE_SEGMENT_SIZE=1048576
        mpirun -n "$N" "$ONECCL_DIR/ccl_allreduce" -b 8 -e 2M -f 2 "$@" 2>>"$OUT/ccl.err"
    ) || echo "# oneCCL run failed (round $round${1:+, $1}): see $OUT/ccl.err" >&2
}

# The vCPUs' placement now (PLACEMENT=1): smt, near or far.
if [ "$PLACEMENT" = 1 ]; then gcc -O2 -o "$OUT/floor_cma" bench/floor_cma.c; fi
placement() {
    MODES=none "$OUT/floor_cma" 1 | sed -n 's/.*round trip between the two processes: \([0-9]*\) ns.*/\1/p' |
        awk '{ print ($1 < 60) ? "smt" : ($1 < 180) ? "near" : "far" }'
}

: >"$OUT/ccl.txt"
: >"$OUT/ccl.err"
: >"$OUT/ompi.txt"
: >"$OUT/oxcomm.txt"
: >"$OUT/placement.txt"
for round in $(seq "$ROUNDS"); do
    if [ "$PLACEMENT" = 1 ]; then before=$(placement); fi
    if [ "$HAVE_CCL" = 1 ]; then
        run_ccl --oop | sed "s/^/$round /" >>"$OUT/ccl.txt"
        run_ccl | sed "s/^/$round /" >>"$OUT/ccl.txt"
    fi
    for range in "8 32K 2000 200" "64K 2M 20 5"; do
        read -r lo hi iters warmup <<<"$range"
        ARGS=(-b "$lo" -e "$hi" -f 2 -n "$iters" -w "$warmup")
        "${MPIRUN[@]}" -np "$N" "$OUT/mpi_collectives" -o all_reduce "${ARGS[@]}" | sed "s/^/$round /" >>"$OUT/ompi.txt"
        "$OXCOMM" bench --transport shm --world-size "$N" --op all_reduce --dtype f32 --redop sum "${ARGS[@]}" \
            --quiet | sed "s/^/$round /" >>"$OUT/oxcomm.txt"
    done
    if [ "$PLACEMENT" = 1 ]; then echo "$round $before $(placement)" >>"$OUT/placement.txt"; fi
done

echo "# raw tables (each line prefixed with its round): $OUT/ccl.txt, $OUT/ompi.txt, $OUT/oxcomm.txt"
table() { # $1: the folder of the three raw tables
# ccl lines: round op nranks size count time_us algbw busbw (op allreduce_oop or allreduce).
# ompi/oxcomm data lines: round, then $1 size ... $6 oop time, $9 oop #wrong, $10 ip time, $13 ip #wrong.
awk -v n="$N" '
    # By file name, not by order: a skipped oneCCL leaves its file empty.
    FNR == 1 { who = (FILENAME ~ /(^|\/)ccl\.txt$/) ? "ccl" : (FILENAME ~ /(^|\/)ompi\.txt$/) ? "ompi" : "ox" }
    function keep(s) { return s == 8 || (s >= 8192 && s <= 2097152) }
    function best(a, k, t) { if (!((k) in a) || t < a[k]) a[k] = t }
    who == "ccl" && $2 ~ /^allreduce/ && keep($4) { best(t, "ccl" SUBSEP $4 SUBSEP ($2 == "allreduce_oop" ? 0 : 1), $6); sizes[$4] = 1 }
    who != "ccl" && $2 !~ /^#/ && NF >= 14 && keep($2) {
        best(t, who SUBSEP $2 SUBSEP 0, $7); best(t, who SUBSEP $2 SUBSEP 1, $11); sizes[$2] = 1;
        if ($10 != 0 && $10 != "N/A" || $14 != 0 && $14 != "N/A") wrong[$2] = 1
    }
    function bw(s, x) { return (x > 0) ? s / x * 2 * (n - 1) / n / 1e3 : 0 }
    function cell(who, s, m) { return ((who, s, m) in t) ? sprintf("%8.2f %6.2f", t[who, s, m], bw(s, t[who, s, m])) : sprintf("%8s %6s", "-", "-") }
    function ratio(s, m, peer) {
        if (!((peer, s, m) in t) || !(("ox", s, m) in t)) return "     -";
        r = t[peer, s, m] / t["ox", s, m];
        if (s >= 8192 && r < worst[peer, m]) worst[peer, m] = r;
        return sprintf("%5.2fx", r)
    }
    END {
        for (s in sizes) order[++k] = s + 0;
        for (i = 2; i <= k; i++) for (j = i; j > 1 && order[j - 1] > order[j]; j--) { x = order[j]; order[j] = order[j - 1]; order[j - 1] = x }
        for (m = 0; m < 2; m++) { worst["ccl", m] = worst["ompi", m] = 1e9 }
        for (m = 0; m < 2; m++) {
            printf "#\n# %s: time (us) and busbw (GB/s) per program; ratios = oxcomm busbw / peer busbw\n", m ? "in place" : "out of place";
            printf "%9s  %15s  %15s  %15s  %7s %7s\n", "size(B)", "oneCCL", "Open MPI", "oxcomm", "/oneCCL", "/ompi";
            for (i = 1; i <= k; i++) {
                s = order[i];
                line = sprintf("%9d  %s  %s  %s  %7s %7s", s, cell("ccl", s, m), cell("ompi", s, m), cell("ox", s, m), ratio(s, m, "ccl"), ratio(s, m, "ompi"));
                print line ((s in wrong) ? "  WRONG VALUES" : "");
            }
        }
        for (p in worst) if (worst[p] == 1e9) worst[p] = "-"; else worst[p] = sprintf("%.2f", worst[p]);
        printf "# summary, worst busbw ratio over 8 KiB-2 MiB: oxcomm/oneCCL %s (out of place), %s (in place); oxcomm/ompi %s, %s\n", worst["ccl", 0], worst["ccl", 1], worst["ompi", 0], worst["ompi", 1];
    }' "$1/ccl.txt" "$1/ompi.txt" "$1/oxcomm.txt"
}

if [ "$PLACEMENT" != 1 ]; then
    table "$OUT"
    exit 0
fi
echo "# placement per round (before, after): $OUT/placement.txt; rounds whose two probes differ are left out"
for place in smt near far; do
    rounds=$(awk -v p="$place" '$2 == p && $3 == p { printf "%s ", $1 }' "$OUT/placement.txt")
    if [ -z "$rounds" ]; then continue; fi
    mkdir -p "$OUT/$place"
    for f in ccl ompi oxcomm; do
        awk -v keep="$rounds" 'BEGIN { split(keep, r, " "); for (i in r) want[r[i]] = 1 } $1 in want' "$OUT/$f.txt" >"$OUT/$place/$f.txt"
    done
    echo "#"
    echo "# ===== vCPUs $place: $(echo "$rounds" | wc -w) rounds ($rounds)"
    table "$OUT/$place"
done
