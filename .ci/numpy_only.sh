#!/usr/bin/env bash
# The package without torch: a fresh venv with numpy and pytest only, the package installed
# from this tree as a user would (`pip install ./crates/oxcomm-py`, which builds the wheel), then
# the tests that need no torch: `import oxcomm` loads no torch, every op on numpy arrays on 2
# ranks, and the `oxcomm` command the wheel installs (launch, bench, check). torch must not be
# importable there (OXCOMM_EXPECT_NO_TORCH=1 makes the test check it). No test may be skipped.
#
# Usage: bash .ci/numpy_only.sh   (PYTHON=python3.X to pick the interpreter; KEEP_VENV=1 keeps it)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
venv="$(mktemp -d "${TMPDIR:-/tmp}/oxcomm-numpy-only.XXXXXX")"
if [[ "${KEEP_VENV:-0}" != 1 ]]; then
    trap 'rm -rf "$venv"' EXIT
fi
start=$SECONDS

echo "== numpy-only: venv in $venv"
"$PYTHON" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check numpy pytest
echo "== numpy-only: pip install ./crates/oxcomm-py (builds the wheel)"
"$py" -m pip install -q --disable-pip-version-check ./crates/oxcomm-py

if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "torch is importable in the numpy-only venv" >&2
    exit 1
fi

echo "== numpy-only: tests"
log="$venv/pytest.log"
# Run from outside the tree, so `import oxcomm` finds the installed package, not the sources.
(cd "$venv" && PYTHONNOUSERSITE=1 OXCOMM_EXPECT_NO_TORCH=1 PATH="$venv/bin:$PATH" "$py" -m pytest -q -rs \
    -p no:cacheprovider "$OLDPWD/crates/oxcomm-py/tests/test_numpy_only.py" \
    "$OLDPWD/crates/oxcomm-py/tests/test_cli_entry.py") 2>&1 | tee "$log"
if grep -qE "[0-9]+ skipped" "$log"; then
    echo "numpy-only tests were skipped (see above)" >&2
    exit 1
fi
echo "== numpy-only: passed in $((SECONDS - start)) s"
