#!/usr/bin/env bash
# The device check: oxcomm on CUDA tensors, on a GPU machine that has Python, torch and pytest
# but no Rust and no network (the workplace's H100/H200: Python 3.12, torch 2.11).
#
#   bash bench/gpu_check.sh --prepare      # here, on the build machine: builds the wheel into
#                                          # target/gpu_check/ (abi3, so any CPython >= 3.9 loads it)
#   bash bench/gpu_check.sh                # there, from the repo root, with target/gpu_check/ carried
#
# It passes only if everything ran on the GPU and passed: it exits non-zero on a missing
# prerequisite (it names each one), no CUDA, a failed or timed-out step, a test that failed, a
# skipped test whose reason is not in the allow-list below (printed at the start), and a Triton
# kernel that did not compile or launch (step 2 forces Triton: OXCOMM_ONEBIT_KERNELS=triton, and
# the log lists the kernels that ran as Triton's). Steps, each under its own deadline (together
# they fit in 8 minutes; at a deadline every process the step started is killed, the test ranks
# too, which run in their own sessions: each process of a step carries a token in its
# environment, and the check kills every process that carries it):
#   1. the CUDA tests (crates/oxcomm-py/tests_cuda, on CUDA: every op with 2 and 3 ranks sharing
#      the GPU against the host op, the regression tests of issue 37, DDP with comm hooks, the
#      1-bit all-reduce and the three optimizers against their CPU runs), with pytest;
#   2. the 1-bit kernels with Triton forced: bench/gpu_onebit_pack.py (pack/unpack against a
#      device copy and cupy.packbits; any Triton failure is an error) and the kernels' report;
#   3. bench/gpu_allreduce.py: CUDA all_reduce through "oxcomm" vs gloo's, 2 ranks on one GPU, with
#      its parts (host all-reduce, the two PCIe copies) and CUDA IPC against staging;
#   4. bench/gpu_runahead.py: how long a blocking all_reduce holds the host, oxcomm vs gloo.
# Output folder: $OUT (the device tool's) or target/gpu_check/out. In it: gpu_check.log (the whole
# log, written in full before the script exits), tests.xml (pytest's JUnit report) and tests.txt
# (one line per test: PASSED/FAILED/ERROR/SKIPPED <test> [: reason], and whether a skip is allowed).
#
# Settings (seconds unless said): PYTHON (default python3), TESTS_TIMEOUT (270), PACK_TIMEOUT (45),
# ALLREDUCE_TIMEOUT (100), RUNAHEAD_TIMEOUT (55), MAX_BYTES (the all-reduce benchmark's largest
# size, 256M). For checking this script's own logic (tests/test_gpu_check.py), none of which can
# make the check pass: GPU_CHECK_USE_INSTALLED=1 uses the oxcomm that Python imports instead of
# the wheel; GPU_CHECK_WITHOUT_CUDA=1 runs the steps on a machine without CUDA (the CUDA tests then
# run on the fake device, and the check fails, saying that no GPU ran it); GPU_CHECK_STEPS runs
# only the steps listed ("1 3"; the check fails unless all four ran).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=target/gpu_check
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-$WHEELS/out}

if [ "${1:-}" = "--prepare" ]; then
    set -e
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    maturin build --release --quiet -m crates/oxcomm-py/Cargo.toml -o "$WHEELS"
    ls -l "$WHEELS"
    echo "carry $WHEELS to the GPU machine and run: bash bench/gpu_check.sh"
    exit 0
fi

# Skips that do not fail the check, each with the reason pytest reports (a substring of it).
ALLOWED_SKIPS=(
    "NCCL refuses 2 ranks on one GPU"                  # test_native_group_2_ranks, one GPU only
    "cannot host a Python backend beside gloo's"       # the mixed-spec DDP case, on a torch without it
)

mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"

failed=0
note_fail() {
    failed=$((failed + 1))
    echo "FAIL: $*"
}

step1() {
    echo "== 1. CUDA tests (crates/oxcomm-py/tests_cuda)"
    step "${TESTS_TIMEOUT:-270}" "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/tests.xml" \
        crates/oxcomm-py/tests_cuda
    local rc=$?
    if ! tests_verdict; then
        note_fail "the CUDA tests (see $OUT_DIR/tests.txt)"
    elif [ "$rc" -ne 0 ]; then
        note_fail "the CUDA tests' run ended with status $rc"
    else
        return 0
    fi
    return 1
}

step2() {
    echo "== 2. 1-bit kernels, Triton forced (OXCOMM_ONEBIT_KERNELS=triton): pack/unpack vs device copy and cupy.packbits"
    OXCOMM_ONEBIT_KERNELS=triton step "${PACK_TIMEOUT:-45}" "$PYTHON" bench/gpu_onebit_pack.py --device "$DEVICE" ||
        { note_fail "the 1-bit kernels with Triton forced"; return 1; }
}

step3() {
    echo "== 3. CUDA all_reduce: oxcomm vs gloo, and vs host all-reduce + two copies; CUDA IPC vs staging (2 ranks, one GPU)"
    # Its own --timeout fires first and kills its ranks; the step's deadline is the backstop.
    local t=${ALLREDUCE_TIMEOUT:-100}
    step "$t" "$PYTHON" bench/gpu_allreduce.py --device "$DEVICE" --ipc --maxbytes "${MAX_BYTES:-256M}" \
        --timeout $((t - 10)) || { note_fail "the all_reduce benchmark"; return 1; }
}

step4() {
    echo "== 4. host run-ahead: how long a blocking all_reduce holds the host, oxcomm vs gloo"
    local t=${RUNAHEAD_TIMEOUT:-55}
    step "$t" "$PYTHON" bench/gpu_runahead.py --device "$RUNAHEAD_DEVICE" --repeat 3 --timeout $((t - 5)) ||
        { note_fail "the run-ahead benchmark"; return 1; }
}

main() {
    local passed=0

    echo "# oxcomm device check, $(date -u +%Y-%m-%dT%H:%MZ); output in $OUT_DIR"
    echo "# allowed skips (a skip for any other reason fails the check):"
    for reason in "${ALLOWED_SKIPS[@]}"; do echo "#   - $reason"; done

    echo
    echo "== 0. prerequisites"
    local site=""
    if [ "${GPU_CHECK_USE_INSTALLED:-0}" != "1" ]; then
        local wheel
        wheel=$(ls "$WHEELS"/oxcomm-*.whl 2>/dev/null | head -1)
        if [ -z "$wheel" ]; then
            echo "missing: the wheel: run 'bash bench/gpu_check.sh --prepare' on the build machine and carry $WHEELS"
            return 1
        fi
        # The wheel unpacked into a private folder (no pip, no network, nothing installed system-wide).
        site=$(mktemp -d)
        "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$site"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        echo "wheel: $(basename "$wheel")"
    fi
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
    # What the steps need, each named when missing (Triton compiles its launcher with a C
    # compiler against the Python headers, on the first launch of a kernel).
    if ! "$PYTHON" - <<'EOF'; then
import importlib, os, platform, shutil, sys, sysconfig
missing = []
for mod in ("pytest", "numpy", "torch", "triton", "oxcomm"):
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        missing.append(f"the Python module {mod} ({type(e).__name__}: {e})")
cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
if not cc:
    missing.append("a C compiler (cc, gcc or clang; $CC): Triton builds its launcher with it")
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
if not os.path.exists(header):
    missing.append(f"the Python headers ({header}; e.g. the python3-dev package): Triton's launcher includes them")
print(f"python {platform.python_version()}, C compiler {cc or '-'}, Python.h {'found' if os.path.exists(header) else 'missing'}")
if "torch" not in " ".join(missing):
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; {torch.cuda.device_count()} visible")
    elif os.environ.get("GPU_CHECK_WITHOUT_CUDA") == "1":
        print("CUDA is not available here: GPU_CHECK_WITHOUT_CUDA=1, the steps run without it (this check will fail)")
    else:
        missing.append("CUDA: torch.cuda.is_available() is False (this is not a GPU machine, or its driver is not reachable)")
if "oxcomm" not in " ".join(missing):
    import oxcomm
    print(f"oxcomm from {oxcomm.__file__}")
for m in missing:
    print(f"missing: {m}")
sys.exit(1 if missing else 0)
EOF
        echo "prerequisites missing (above): nothing was run"
        return 1
    fi

    local steps=" ${GPU_CHECK_STEPS:-1 2 3 4} " n
    if [ "$steps" != " 1 2 3 4 " ]; then
        note_fail "only steps$steps were asked for (GPU_CHECK_STEPS)"
    fi
    for n in 1 2 3 4; do
        if [[ $steps == *" $n "* ]]; then
            echo
            if "step$n"; then passed=$((passed + 1)); fi
        fi
    done

    [ -n "$site" ] && rm -rf "$site"
    echo
    if [ "$DEVICE" != "cuda" ]; then
        note_fail "no GPU ran this check (GPU_CHECK_WITHOUT_CUDA=1): it proves the script, not oxcomm on CUDA"
    fi
    echo "gpu_check: $passed steps passed, $failed failed"
    [ "$failed" -eq 0 ]
}

# step SECONDS COMMAND...: runs COMMAND in its own session with a token in its environment that
# every process it starts inherits (the test ranks too, though they start sessions of their own);
# past SECONDS, and whatever happened once COMMAND ends, every process carrying the token is
# killed (TERM, then KILL 5 s later). Returns COMMAND's status (124 when it was ended).
step() {
    local seconds=$1
    shift
    local token="gpu-check-$$-$RANDOM-$SECONDS"
    OXCOMM_GPU_CHECK_STEP=$token setsid "$@" &
    local pid=$!
    local start=$SECONDS rc
    while kill -0 "$pid" 2>/dev/null; do
        if [ $((SECONDS - start)) -ge "$seconds" ]; then
            echo "(deadline: ended after ${seconds}s)"
            kill_token "$token" TERM
            sleep 5
            kill_token "$token" KILL
            wait "$pid" 2>/dev/null
            return 124
        fi
        sleep 1
    done
    wait "$pid"
    rc=$?
    local left
    left=$(kill_token "$token" KILL)
    if [ -n "$left" ]; then
        echo "(killed processes the step left behind: $left)"
    fi
    return "$rc"
}

# kill_token TOKEN SIGNAL: signals every process whose environment holds the step's token;
# prints their pids.
kill_token() {
    local token=$1 sig=$2 p pids=""
    for p in /proc/[0-9]*; do
        if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qx "OXCOMM_GPU_CHECK_STEP=$token"; then
            kill -"$sig" "${p#/proc/}" 2>/dev/null && pids="$pids ${p#/proc/}"
        fi
    done
    echo "${pids# }"
}

# tests_verdict: tests.txt from tests.xml, one line per test; fails on a failure or error, on a
# skip whose reason is not allowed, and on no tests at all.
tests_verdict() {
    "$PYTHON" - "$OUT_DIR/tests.xml" "$OUT_DIR/tests.txt" "${ALLOWED_SKIPS[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET

xml_path, txt_path, allowed = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    root = ET.parse(xml_path).getroot()
except (OSError, ET.ParseError) as e:
    open(txt_path, "w").write(f"no test report ({e}): the test run did not finish\n")
    print(f"no test report ({type(e).__name__}): the test run did not finish")
    sys.exit(1)
lines, counts, bad = [], {}, 0
for case in root.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    outcome, why = "PASSED", ""
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}[tag]
            why = (el.get("message") or "").replace("\n", " ")[:300]
            break
    if outcome == "SKIPPED":
        ok = any(a in why for a in allowed)
        outcome = "SKIPPED (allowed)" if ok else "SKIPPED (not allowed)"
        bad += not ok
    elif outcome != "PASSED":
        bad += 1
    counts[outcome] = counts.get(outcome, 0) + 1
    lines.append(f"{outcome} {name}" + (f": {why}" if why else ""))
open(txt_path, "w").write("\n".join(lines) + "\n")
print("\n".join(l for l in lines if not l.startswith("PASSED")) or "(every test passed)")
print("tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" (one line per test in {txt_path})")
sys.exit(1 if bad or not lines else 0)
EOF
}

if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    DEVICE=cuda RUNAHEAD_DEVICE=cuda
else
    DEVICE=cpu RUNAHEAD_DEVICE=fake
fi
# The log is written by this shell's own pipe, which the script waits for before it exits: the
# closing counts are in the file when the exit status is.
main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
