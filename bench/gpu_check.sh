#!/usr/bin/env bash
# The device check: oxcomm on CUDA tensors, on a GPU machine that has Python, torch and pytest
# but no Rust and no network (the workplace's H100/H200: Python 3.12, torch 2.11).
#
#   bash bench/gpu_check.sh --prepare      # here, on the CPU machine: builds the wheel into
#                                          # target/gpu_check/ (abi3, so any CPython >= 3.9 loads it)
#   bash bench/gpu_check.sh                # there, from the repo root, with target/gpu_check/ carried
#
# What it runs, each step under its own deadline (the whole check is sized for 8 minutes):
#   1. the CUDA tests (crates/oxcomm-py/tests_cuda: every op on CUDA tensors with 2 and 3 ranks
#      sharing the GPU against the same op on CPU tensors, the 1-bit all-reduce and the three
#      optimizers on CUDA against their CPU runs, a DDP step), with pytest;
#   2. bench/gpu_allreduce.py: CUDA all_reduce through "oxcomm" vs gloo's, 2 ranks on one GPU,
#      and against oxcomm's host all-reduce plus the two PCIe copies, with its CUDA IPC mode;
#   3. bench/gpu_onebit_pack.py: the 1-bit pack/unpack kernels against a device-to-device copy
#      and cupy.packbits.
# It prints every step's output, then `N passed, M failed, K skipped` (the CUDA tests, plus one
# check per benchmark that ran to completion; pytest prints each skip's reason). With $OUT set
# (the device tool's output folder) the whole log is also written to $OUT/gpu_check.log.
#
# Settings (seconds unless said): PYTHON (default python3), TESTS_TIMEOUT (240),
# ALLREDUCE_TIMEOUT (150), PACK_TIMEOUT (60), MAX_BYTES (the all-reduce benchmark's largest
# size, 256M). The deadlines add up to 7.5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=target/gpu_check
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    maturin build --release --quiet -m crates/oxcomm-py/Cargo.toml -o "$WHEELS"
    ls -l "$WHEELS"
    echo "carry $WHEELS to the GPU machine and run: bash bench/gpu_check.sh"
    exit 0
fi

LOG=$(mktemp)
if [ -n "${OUT:-}" ]; then LOG="$OUT/gpu_check.log"; fi
exec > >(tee "$LOG") 2>&1

wheel=$(ls "$WHEELS"/oxcomm-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
    echo "no wheel in $WHEELS: run 'bash bench/gpu_check.sh --prepare' on the build machine and carry $WHEELS"
    echo "0 passed, 1 failed"
    exit 1
fi

# The wheel unpacked into a private folder (no pip, no network, nothing installed system-wide).
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

echo "# oxcomm device check, $(date -u +%Y-%m-%dT%H:%MZ), wheel $(basename "$wheel")"
"$PYTHON" - <<'EOF'
import platform, torch, oxcomm
print(f"# python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"# device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; {torch.cuda.device_count()} visible")
else:
    print("# CUDA is not available here: every CUDA test will be skipped")
print(f"# oxcomm from {oxcomm.__file__}")
EOF

passed=0
failed=0
skipped=0

# limited SECONDS COMMAND...: runs COMMAND in its own process group and, past SECONDS, ends the
# whole group (the ranks a test or benchmark spawned too, which timeout(1) would leave on the
# GPU), TERM first, KILL 5 s later. Returns COMMAND's status (124 when it was ended).
limited() {
    local seconds=$1
    shift
    setsid "$@" &
    local pid=$!
    (
        sleep "$seconds"
        kill -TERM -- "-$pid" 2>/dev/null && echo "(ended after ${seconds}s)" && sleep 5 && kill -KILL -- "-$pid" 2>/dev/null
    ) &
    local watchdog=$!
    wait "$pid"
    local rc=$?
    kill "$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
    if kill -0 -- "-$pid" 2>/dev/null; then
        kill -KILL -- "-$pid" 2>/dev/null
        rc=124
    fi
    return "$rc"
}

echo
echo "== 1. CUDA tests (crates/oxcomm-py/tests_cuda)"
PYTEST_LOG="$SITE/pytest.log"
limited "${TESTS_TIMEOUT:-240}" "$PYTHON" -m pytest -q -rs -p no:cacheprovider crates/oxcomm-py/tests_cuda \
    >"$PYTEST_LOG" 2>&1
rc=$?
cat "$PYTEST_LOG"
# pytest's closing line, e.g. "12 passed, 1 failed, 2 skipped in 80.1s". A skip is reported
# beside the counts with its reason above (-rs): e.g. NCCL refuses two ranks on one GPU.
count() { grep -oE "[0-9]+ $1" "$PYTEST_LOG" | tail -1 | grep -oE "^[0-9]+" || echo 0; }
tp=$(count passed)
tf=$(($(count failed) + $(count "errors?")))
skipped=$(count skipped)
passed=$((passed + tp))
failed=$((failed + tf))
if [ "$rc" -ne 0 ] && [ "$tf" -eq 0 ]; then
    failed=$((failed + 1))
    echo "(the test run ended with status $rc)"
fi

bench() { # title, command...
    local title=$1
    shift
    echo
    echo "== $title"
    if limited "${BENCH_TIMEOUT:-90}" "$@"; then
        passed=$((passed + 1))
    else
        echo "(failed or timed out: status $?)"
        failed=$((failed + 1))
    fi
}

# Its own --timeout fires first and kills its ranks: timeout(1) would kill only the parent and
# leave the ranks on the GPU during step 3.
BENCH_TIMEOUT=${ALLREDUCE_TIMEOUT:-150} bench \
    "2. CUDA all_reduce: oxcomm vs gloo, and vs host all-reduce + two copies; CUDA IPC vs staging (2 ranks, one GPU)" \
    "$PYTHON" bench/gpu_allreduce.py --device cuda --ipc --maxbytes "${MAX_BYTES:-256M}" \
    --timeout $((${ALLREDUCE_TIMEOUT:-150} - 10))
BENCH_TIMEOUT=${PACK_TIMEOUT:-60} bench "3. 1-bit pack/unpack kernels vs device copy and cupy.packbits" \
    "$PYTHON" bench/gpu_onebit_pack.py --device cuda

echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
