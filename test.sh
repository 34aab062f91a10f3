#!/usr/bin/env bash
# Every test of the workspace, from a fresh clone, with nothing run before it (the README's test
# command; CI runs it too, after fmt, clippy and doc):
#   1. installs what the Python tests use (the pins CI uses) and the package from this checkout;
#   2. cargo test --workspace (Rust: library, CLI, multi-host tests in network namespaces when root);
#   3. the Python tests (numpy, torch.distributed, DeepSpeed, PyTorch's own distributed suite
#      on gloo and oxcomm, the `oxcomm` command the wheel installs, the type stubs);
#   4. the CUDA tests (crates/oxcomm-py/tests_cuda): on a machine without CUDA on the fake device
#      of tests/_fake_device.py (streams that run late on threads of their own), with the seeds
#      of OXCOMM_FAKE_SEEDS (default 1,2; a failure names its seed); on a GPU, on CUDA;
#   5. the numpy-only install: `import oxcomm` and every numpy op in a venv without torch.
# The pytest log goes to $OXCOMM_PYTEST_LOG (default target/pytest.log), so CI can refuse skips.
set -euo pipefail
cd "$(dirname "$0")"
PIP=(python3 -m pip install -q --disable-pip-version-check)

echo "== Python: what the tests use, and the package built from this checkout  [$(date +%T)]"
# torch's Linux wheel from PyPI is the CUDA build (~5 GB with its libraries); it runs on CPU.
"${PIP[@]}" "torch==2.15.0" numpy "deepspeed==0.19.8" pytest expecttest mypy "maturin>=1.5,<2"
# The training frameworks tests/test_trainers.py runs on oxcomm and gloo (torch stays at its pin).
"${PIP[@]}" "torch==2.15.0" "lightning==2.6.6" "accelerate==1.15.0" "transformers==5.23.0" "torchft==0.2.0"
"${PIP[@]}" ./crates/oxcomm-py
# DeepSpeed 0.19.4's source: its 1-bit optimizers are the reference of oxcomm's
# (tests/test_onebit_vs_deepspeed.py reads them from the tarball; the installed DeepSpeed stays).
python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "deepspeed==0.19.4" -d target/reference

echo "== cargo test --workspace  [$(date +%T)]"
cargo test --workspace

echo "== Python tests  [$(date +%T)]"
LOG=${OXCOMM_PYTEST_LOG:-target/pytest.log}
mkdir -p "$(dirname "$LOG")"
DS_ACCELERATOR=cpu python3 -m pytest -q -rs -p no:cacheprovider --durations=15 crates/oxcomm-py/tests 2>&1 | tee "$LOG"

echo "== CUDA tests (crates/oxcomm-py/tests_cuda; without CUDA, on the fake device)  [$(date +%T)]"
DS_ACCELERATOR=cpu python3 -m pytest -q -rs -p no:cacheprovider crates/oxcomm-py/tests_cuda 2>&1 | tee -a "$LOG"

echo "== numpy only (no torch in the environment)  [$(date +%T)]"
bash .ci/numpy_only.sh
