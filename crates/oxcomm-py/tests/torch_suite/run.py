"""PyTorch's own distributed test suite on oxcomm and on gloo, side by side.

Runs ``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` (the
class PyTorch runs for gloo and NCCL) the way PyTorch's ``test/distributed/test_distributed_spawn.py``
does (``TestDistBackendWithSpawn``: two spawned ranks per test, ``BACKEND``, ``WORLD_SIZE`` and
``TEMP_DIR`` in the environment), once with ``BACKEND=gloo`` and once with ``BACKEND=oxcomm``, on
the CPU, and prints each backend's pass/fail/skip counts and every test that passes on gloo but
not on oxcomm, with its failure message or skip reason::

    DS_ACCELERATOR=cpu python3 crates/oxcomm-py/tests/torch_suite/run.py            # everything
    python3 crates/oxcomm-py/tests/torch_suite/run.py -k all_gather -k barrier       # name filters
    python3 crates/oxcomm-py/tests/torch_suite/run.py --subset ci --json out.json    # CI's subset

oxcomm is declared to the suite as gloo is: in every ``DistTestCases.backend_feature`` set that
holds gloo, and as an available plugin. The suite also gates tests on the backend's *name*
(``require_backend_is_available({"gloo", ...})``, ``BACKEND != "gloo"`` for timeouts, batched
p2p, futures, sparse). Those gates are opened for oxcomm by this runner, not by editing torch:
the suite module is imported with ``BACKEND=gloo`` in the environment (so its decorators see
gloo), then its module global ``BACKEND`` is replaced by :class:`_GlooAlike`, a string that
reads ``"oxcomm"`` (``init_process_group``, ``new_group`` and ``get_backend`` get oxcomm) but
compares equal to ``"gloo"`` (so the comparisons inside test bodies take gloo's branch).
``--keep-name-gates`` runs oxcomm with the suite's gates as PyTorch wrote them. Which tests
only run because of this is printed: those the suite skips by name for plain ``oxcomm``.

This file is a program, not a pytest module (pytest collects ``test_*.py`` only);
``tests/test_torch_suite.py`` runs CI's subset through it. The driver runs each backend in its
own Python process (the suite reads ``BACKEND`` at import); the ranks of every test are spawned
from that process and import this file again as ``__mp_main__``, so the setup below runs in
them too. Settings reach those processes through the environment, not argv (torch's test
utilities parse argv on import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: The backend a suite process runs (set by the driver for its child; inherited by the ranks).
_ENV_BACKEND = "OXCOMM_SUITE_BACKEND"
#: "1": keep the suite's name gates for oxcomm (see the module docs).
_ENV_KEEP_GATES = "OXCOMM_SUITE_KEEP_GATES"
#: "spawn" (PyTorch's TestDistBackendWithSpawn) or "fork" (its old TestDistBackendWithFork).
_ENV_START = "OXCOMM_SUITE_START"
#: Where each rank appends the reason it skipped a test (one JSON object a line).
_ENV_SKIPS = "OXCOMM_SUITE_SKIP_LOG"

#: Test-name patterns of the subset CI runs (``--subset ci``): collectives, groups, objects, DDP.
CI_SUBSET = [
    "test_all_reduce",
    "test_all_gather",
    "test_all_to_all",
    "test_broadcast",
    "test_reduce",
    "test_scatter",
    "test_gather",
    "test_barrier",
    "test_batch_isend_irecv",
    "test_send_recv",
    "test_isend",
    "test_irecv",
    "test_monitored_barrier",
    "group",
    "object",
    "test_ddp",
    "test_DistributedDataParallel",
    "test_coalescing",
    "test_get_future",
]


class _GlooAlike(str):
    """``"oxcomm"`` that compares (and hashes) as ``"gloo"`` too, so the suite's checks of the
    backend's name treat oxcomm as gloo, while every string made from it (``lower()``, f-strings
    through ``str()``) is plain ``"oxcomm"``."""

    def __eq__(self, other):
        return other in ("gloo", "oxcomm") if isinstance(other, str) else NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash("gloo")

    def __str__(self):
        return "oxcomm"


def _record_skips(path):
    """Make this rank append the reason of a test it skips to ``path`` (torch logs it only)."""
    import logging

    class _Handler(logging.Handler):
        def emit(self, record):
            if "skipping test" not in record.msg:
                return
            _, test, reason = record.args
            with open(path, "a") as f:
                f.write(json.dumps({"test": test, "reason": str(reason)}) + "\n")

    log = logging.getLogger("torch.testing._internal.common_distributed")
    log.setLevel(logging.INFO)
    log.addHandler(_Handler())


def _load_suite(backend, keep_gates):
    """Import the suite for ``backend`` and return the test class (TestDistBackendWithSpawn)."""
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ["BACKEND"] = backend
    if backend == "oxcomm":
        import oxcomm.torch  # noqa: F401  (registers the backend)
        from torch.testing._internal.common_distributed import DistTestCases

        for names in DistTestCases.backend_feature.values():
            if "gloo" in names:
                names.add("oxcomm")
        DistTestCases.backend_feature["plugin"].add("oxcomm")
        if not keep_gates:
            os.environ["BACKEND"] = "gloo"
    from torch.testing._internal.distributed import distributed_test as suite

    if backend == "oxcomm" and not keep_gates:
        suite.BACKEND = _GlooAlike("oxcomm")
        os.environ["BACKEND"] = "oxcomm"
    if os.environ.get(_ENV_SKIPS):
        _record_skips(os.environ[_ENV_SKIPS])

    import torch
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    fork = os.environ.get(_ENV_START) == "fork"

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if fork:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


if os.environ.get(_ENV_BACKEND):
    # In a suite process and in every rank it spawns (they import this file as __mp_main__):
    # the class must be a module global for the ranks to find it.
    TestDistBackendWithSpawn = _load_suite(os.environ[_ENV_BACKEND], os.environ.get(_ENV_KEEP_GATES) == "1")


# ---------------------------------------------------------------------- one backend's run


def _last_line(text):
    """The line of an error text that says what went wrong (the last exception line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("Process ", "exiting process", "To execute this test")):
            continue
        if ":" in ln and not ln.startswith(("File ", "^")):
            return ln[:400]
    return lines[-1][:400] if lines else ""


def _run_suite(patterns, out):
    """Run the suite's tests whose names contain any of ``patterns`` (all when empty) and write
    ``{test: {"status", "reason", "seconds"}}`` to ``out``."""
    import unittest

    cls = TestDistBackendWithSpawn
    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(cls))
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    skip_log = os.environ.get(_ENV_SKIPS)
    results = {}

    class Result(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            self._t0 = time.monotonic()
            print(f"  {test._testMethodName} ...", end=" ", flush=True)

        def _put(self, test, status, reason=""):
            name = test._testMethodName
            results[name] = {"status": status, "reason": reason, "seconds": round(time.monotonic() - self._t0, 2)}
            print(status + (f" ({reason[:160]})" if reason else ""), flush=True)

        def addSuccess(self, test):
            self._put(test, "pass")

        def addFailure(self, test, err):
            self._put(test, "fail", _last_line(self._exc_info_to_string(err, test)))

        def addError(self, test, err):
            self._put(test, "fail", _last_line(self._exc_info_to_string(err, test)))

        def addSkip(self, test, reason):
            if "look at subprocess log" in reason and skip_log and os.path.exists(skip_log):
                with open(skip_log) as f:
                    found = [json.loads(ln) for ln in f if ln.strip()]
                why = [r["reason"] for r in found if r["test"] == test._testMethodName]
                if why:
                    reason = why[-1]
            self._put(test, "skip", str(reason))

        def addExpectedFailure(self, test, err):
            self._put(test, "pass")

        def addUnexpectedSuccess(self, test):
            self._put(test, "fail", "unexpected success")

    suite = unittest.TestSuite(cls(n) for n in names)
    suite.run(Result())
    with open(out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def _static_skips(out):
    """Write ``{test: reason}`` for the tests the suite skips at import (its decorators)."""
    import unittest

    cls = TestDistBackendWithSpawn
    skips = {}
    for n in unittest.TestLoader().getTestCaseNames(cls):
        fn = getattr(cls, n)
        if getattr(fn, "__unittest_skip__", False):
            skips[n] = getattr(fn, "__unittest_skip_why__", "")
    with open(out, "w") as f:
        json.dump(skips, f, indent=1, sort_keys=True)


# ---------------------------------------------------------------------- the driver


def _child(backend, args, mode, out, keep_gates=False):
    """Run this file for one backend in its own process (``mode``: "run" or "gates")."""
    tmp = tempfile.mkdtemp(prefix=f"oxcomm-suite-{backend}-")
    env = dict(os.environ)
    env.update(
        {
            _ENV_BACKEND: backend,
            _ENV_KEEP_GATES: "1" if keep_gates else "0",
            _ENV_START: args.start,
            _ENV_SKIPS: os.path.join(tmp, "skips.jsonl"),
            "WORLD_SIZE": "2",
            "TEMP_DIR": tmp,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "DS_ACCELERATOR": env.get("DS_ACCELERATOR", "cpu"),
            "OXCOMM_SUITE_MODE": mode,
            "OXCOMM_SUITE_OUT": out,
            "OXCOMM_SUITE_PATTERNS": json.dumps(args.patterns),
        }
    )
    env.pop("MASTER_PORT", None)
    cmd = [sys.executable, os.path.abspath(__file__)]
    try:
        with open(args.log, "a") as log:
            log.write(f"==== {backend} ({mode})\n")
            log.flush()
            subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stderr=log)
    finally:
        subprocess.run(["rm", "-rf", tmp], check=False)


def compare(gloo, oxc, gated=()):
    """(rows of counts, [(test, oxcomm status, reason)] for gloo passes that oxcomm does not pass)."""

    def counts(r):
        return {s: sum(1 for v in r.values() if v["status"] == s) for s in ("pass", "fail", "skip")}

    missing = [
        (t, oxc.get(t, {}).get("status", "not run"), oxc.get(t, {}).get("reason", ""))
        for t in sorted(gloo)
        if gloo[t]["status"] == "pass" and oxc.get(t, {}).get("status") != "pass"
    ]
    return counts(gloo), counts(oxc), missing


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", dest="patterns", action="append", default=[], help="run tests whose name contains this")
    p.add_argument("--subset", choices=["all", "ci"], default="all", help="ci: collectives, groups, objects, DDP")
    p.add_argument("--backends", default="gloo,oxcomm", help="comma-separated (default gloo,oxcomm)")
    p.add_argument("--keep-name-gates", action="store_true", help="run oxcomm with the suite's gates on names")
    p.add_argument(
        "--start",
        choices=["spawn", "fork"],
        default="spawn",
        help="how each test's ranks start: spawn (as PyTorch's CI) or fork (no torch import per rank: faster)",
    )
    p.add_argument("--log", help="the ranks' output (default: a temporary file, printed at the end)")
    p.add_argument("--gloo-from", help="take gloo's results from an earlier --json report instead of running it")
    p.add_argument("--json", help="write both backends' results and the comparison here")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds for each backend's whole run")
    args = p.parse_args(argv)
    if args.log is None:
        fd, args.log = tempfile.mkstemp(prefix="oxcomm-suite-", suffix=".log")
        os.close(fd)
    if args.subset == "ci":
        args.patterns = args.patterns + CI_SUBSET
    t0 = time.monotonic()
    results, times = {}, {}
    with tempfile.TemporaryDirectory(prefix="oxcomm-suite-") as tmp:
        for backend in args.backends.split(","):
            if backend == "gloo" and args.gloo_from:
                with open(args.gloo_from) as f:
                    earlier = json.load(f)
                results["gloo"], times["gloo"] = earlier["results"]["gloo"], earlier["seconds"]["gloo"]
                continue
            print(f"== {backend}", flush=True)
            out = os.path.join(tmp, f"{backend}.json")
            t = time.monotonic()
            _child(backend, args, "run", out, args.keep_name_gates)
            times[backend] = round(time.monotonic() - t, 1)
            with open(out) as f:
                results[backend] = json.load(f)
        gated = {}
        if "oxcomm" in results and not args.keep_name_gates:
            # what the suite skips by name for plain "oxcomm" and not for gloo
            plain, as_gloo = os.path.join(tmp, "plain.json"), os.path.join(tmp, "gloo-static.json")
            _child("oxcomm", args, "gates", plain, keep_gates=True)
            _child("gloo", args, "gates", as_gloo)
            with open(plain) as f, open(as_gloo) as g:
                p_skips, g_skips = json.load(f), json.load(g)
            gated = {t: r for t, r in p_skips.items() if t not in g_skips}
    report = {"results": results, "seconds": times, "name_gated": gated, "argv": sys.argv[1:]}
    if "gloo" in results and "oxcomm" in results:
        cg, co, missing = compare(results["gloo"], results["oxcomm"])
        print(f"\n{'':8}{'gloo':>8}{'oxcomm':>8}")
        for s in ("pass", "fail", "skip"):
            print(f"{s:8}{cg[s]:>8}{co[s]:>8}")
        print(f"{'tests':8}{len(results['gloo']):>8}{len(results['oxcomm']):>8}")
        print(f"{'seconds':8}{times['gloo']:>8}{times['oxcomm']:>8}")
        gated_pass = sorted(t for t in gated if results["oxcomm"].get(t, {}).get("status") == "pass")
        print(f"\nname-gated for plain 'oxcomm', run by this runner: {len(gated)} ({len(gated_pass)} pass)")
        print(f"\ngloo passes that are not oxcomm passes: {len(missing)}")
        for t, status, reason in missing:
            print(f"  {t}: {status}: {reason}")
        report["missing"] = missing
    else:
        for b, r in results.items():
            print(b, {s: sum(1 for v in r.values() if v["status"] == s) for s in ("pass", "fail", "skip")})
    print(f"\ntotal {time.monotonic() - t0:.0f} s; the ranks' output: {args.log}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    mode = os.environ.get("OXCOMM_SUITE_MODE")
    if mode == "run":
        _run_suite(json.loads(os.environ["OXCOMM_SUITE_PATTERNS"]), os.environ["OXCOMM_SUITE_OUT"])
    elif mode == "gates":
        _static_skips(os.environ["OXCOMM_SUITE_OUT"])
    else:
        sys.exit(main())
