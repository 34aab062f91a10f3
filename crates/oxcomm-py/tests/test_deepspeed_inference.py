"""DeepSpeed's CPU hot path on oxcomm (issue 29, item 7): after ``import oxcomm.deepspeed``
and ``init_distributed(dist_backend="oxcomm")``, ``deepspeed.comm.inference_all_reduce`` runs
on the oxcomm process group, DeepSpeed's shared-memory op is neither built nor initialized,
no ``/dev/shm/deepspeed_allreduce_buffer_*`` segment of the job exists, and the run prints no
``[c10d]`` warning. A control job with the wrapper off shows that the same checks see
DeepSpeed's op when it does run (and removes the segments that job made).

The ranks set ``LOCAL_SIZE`` (as DeepSpeed's launcher does): DeepSpeed's op creates its
segment only when it sees every rank on one host.
"""

from __future__ import annotations

import glob
import os
import sys

import pytest

import _torch_ranks

pytest.importorskip("deepspeed")

DS_DEADLINE = 600  # DeepSpeed's start-up is 10-20 s per rank on a loaded 2-core machine
SEGMENT = "deepspeed_allreduce_buffer_"


def _segments(port):
    """This job's DeepSpeed shm segments: DeepSpeed names them
    ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``."""
    return sorted(glob.glob(f"/dev/shm/{SEGMENT}{os.getuid()}_*_{port}_*"))


# ------------------------------------------------------------------------------- in the ranks


def case_inference_all_reduce():
    """inference_all_reduce of f32, bf16 and f16 (and on a subgroup) through deepspeed.comm:
    exact sums, each one seen by the oxcomm backend's allreduce and by the comms logger."""
    import torch

    import _stacks_ranks

    with _stacks_ranks.Stderr() as err:
        patched = os.environ.get("DS_TEST_PATCH", "1") == "1"
        if patched:
            import oxcomm.deepspeed  # noqa: F401  (wraps DeepSpeed's TorchBackend)
        import importlib

        import deepspeed
        import torch.distributed as dist
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        if not patched:  # the control: mark DeepSpeed as wrapped so that oxcomm.torch leaves it alone
            importlib.import_module("deepspeed.comm.torch").TorchBackend._oxcomm_patched = True
        import oxcomm.torch  # noqa: F401  (registers "oxcomm"; wraps DeepSpeed when imported after it)
        from oxcomm.torch.process_group import ProcessGroupOxcomm
        torch.set_num_threads(1)
        loads = []
        original_load = ShareMemCommBuilder.load

        def load(self, *a, **k):
            loads.append(self.NAME)
            return original_load(self, *a, **k)

        ShareMemCommBuilder.load = load
        calls = []
        original_allreduce = ProcessGroupOxcomm.allreduce

        def allreduce(self, tensors, opts=None):
            calls.append(tensors[0].dtype)
            return original_allreduce(self, tensors, opts)

        ProcessGroupOxcomm.allreduce = allreduce

        deepspeed.init_distributed(dist_backend="oxcomm", verbose=False)
        ds = deepspeed.comm
        ds.configure(enabled=True, prof_all=True, verbose=False)
        cdb = sys.modules["deepspeed.comm.comm"].cdb
        assert dist.get_backend() == "oxcomm"
        rank, n = ds.get_rank(), ds.get_world_size()
        calls.clear()
        results = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = (torch.arange(257, dtype=torch.float32) % 17 + rank).to(dtype)
            ds.inference_all_reduce(t)
            want = (torch.arange(257, dtype=torch.float32) % 17 * n + sum(range(n))).to(dtype)
            assert torch.equal(t, want), (dtype, t[:8], want[:8])
            results[str(dtype)] = True
        sub = ds.new_group(ranks=list(range(n)))
        t = torch.ones(5)
        ds.inference_all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((5,), float(n)))
        logged = dict(getattr(ds.comms_logger, "comms_dict", {}))
        segments = _segments(os.environ["MASTER_PORT"])
        ds_op = hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
        out = {
            "port": os.environ["MASTER_PORT"],
            "shm_op_built": bool(loads) or cdb.shm_comm_op is not None,
            "shm_op_registered": ds_op,
            "shm_modules": [m for m in sys.modules if "shm_comm" in m],
            "oxcomm_allreduces": [str(d) for d in calls],
            "logged": sorted(logged),
            "segments_during_job": segments,
        }
        ds.barrier()
    out["c10d"] = err.c10d
    return out


# ------------------------------------------------------------------------------- in pytest


def _run(patched):
    env = {"LOCAL_SIZE": "2", "DS_TEST_PATCH": "1" if patched else "0"}
    return _torch_ranks.run(2, "test_deepspeed_inference:case_inference_all_reduce", timeout=DS_DEADLINE, env=env)


def test_inference_all_reduce_runs_on_oxcomm_without_deepspeeds_shm_op():
    res = _run(patched=True)
    port = res[0]["port"]
    left = _segments(port)
    for r, out in enumerate(res):
        assert not out["shm_op_built"], f"rank {r}: DeepSpeed built its shm op"
        assert not out["shm_op_registered"], f"rank {r}: torch.ops.deepspeed.inference_all_reduce_ is registered"
        assert not out["shm_modules"], f"rank {r}: {out['shm_modules']} loaded"
        # f32, bf16, f16 on the world group, then f32 on the subgroup: all on oxcomm
        assert out["oxcomm_allreduces"] == ["torch.float32", "torch.bfloat16", "torch.float16", "torch.float32"], out
        assert any("all_reduce" in name for name in out["logged"]), f"rank {r}: comms logger saw {out['logged']}"
        assert not out["segments_during_job"], f"rank {r}: {out['segments_during_job']}"
        assert not out["c10d"], f"rank {r} printed c10d warnings:\n" + "\n".join(out["c10d"])
    assert not left, f"the job left {left} in /dev/shm"


def test_control_without_the_wrapper_deepspeed_uses_its_shm_op():
    """The checks above see DeepSpeed's op when it runs: with the wrapper off, DeepSpeed builds
    and initializes it, makes its segments and (with AVX2) takes f32 off the process group."""
    res = _run(patched=False)
    try:
        assert all(out["shm_op_built"] and out["shm_op_registered"] for out in res), res
        assert res[0]["segments_during_job"], "DeepSpeed's op made no segment: LOCAL_SIZE not seen?"
        if _avx2():
            assert all(out["oxcomm_allreduces"][:1] != ["torch.float32"] for out in res), res
    finally:
        # this job's own segments only (named by its MASTER_PORT), which DeepSpeed leaves behind
        for path in _segments(res[0]["port"]):
            os.unlink(path)


def _avx2():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2 " in f.read()
    except OSError:
        return False
