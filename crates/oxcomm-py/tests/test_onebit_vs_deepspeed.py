"""oxcomm's 1-bit optimizers step for step against DeepSpeed 0.19.4's, the last release that had
them: the same seeded model and data on 2 ranks, 40 steps with the freeze at step 10, and every
parameter compared after every step (at most 1e-5 relative to the tensor's largest value).

DeepSpeed's optimizers are read from its source distribution (``deepspeed==0.19.4`` on PyPI;
``test.sh`` downloads it with ``pip download`` into ``target/reference/``, or
``OXCOMM_DEEPSPEED_0194`` names the tarball) and loaded as modules of their own: the
installed DeepSpeed (0.19.8, which removed them) serves their imports and stays as it is. Both
run their compressed all-reduce through :class:`oxcomm.deepspeed.CompressedBackend` (DeepSpeed's
``compressed_allreduce`` convention; 0.19.8 has no compressed backend of its own), so what is
compared is the optimizers' arithmetic and state. DeepSpeed's engine is stood in for by what the
optimizers read of it: its ``enable_backward_allreduce`` flag (while set, the gradients are
averaged over the ranks before the step, as the engine's backward does) and ``local_rank``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tarfile
import types

import pytest

import _torch_ranks

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TARBALL = os.environ.get("OXCOMM_DEEPSPEED_0194") or os.path.join(ROOT, "target", "reference", "deepspeed-0.19.4.tar.gz")
FETCH = (
    "python3 -m pip download --no-deps --no-binary :all: deepspeed==0.19.4 -d target/reference "
    "(test.sh does it)"
)

STEPS, FREEZE = 40, 10
TOLERANCE = 1e-5


def _reference_module(name):
    """DeepSpeed 0.19.4's ``deepspeed/runtime/fp16/onebit/<name>.py`` as module ``ds0194_<name>``."""
    with tarfile.open(TARBALL) as tar:
        source = tar.extractfile(f"deepspeed-0.19.4/deepspeed/runtime/fp16/onebit/{name}.py").read()
    spec = importlib.util.spec_from_loader(f"ds0194_{name}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"deepspeed-0.19.4/deepspeed/runtime/fp16/onebit/{name}.py", "exec"), module.__dict__)
    return module


def _compressed_backend_module():
    """``deepspeed.runtime.comm.compressed`` as 0.19.4's optimizers import it (0.19.8 removed
    it): its ``CompressedBackend(mpu)`` is oxcomm's."""
    import oxcomm.deepspeed

    module = types.ModuleType("deepspeed.runtime.comm.compressed")
    module.CompressedBackend = lambda mpu=None: oxcomm.deepspeed.CompressedBackend(mpu)
    return module


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24), torch.nn.GELU(), torch.nn.Linear(24, 3)
    )


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 12, generator=g)
    return x, torch.sin(x[:, :3] * 2) + 0.1 * torch.randn(16, 3, generator=g)


def _optimizers(name, ref_params, our_params, engine):
    import oxcomm.optim

    lr = {"adam": 1e-2, "lamb": 2e-2, "zoadam": 2e-3}[name]
    common = dict(lr=lr, weight_decay=0.01)
    if name == "adam":
        ref = _reference_module("adam").OnebitAdam(
            ref_params, deepspeed=engine, freeze_step=FREEZE, comm_backend_name="compressed", **common
        )
        ours = oxcomm.optim.OnebitAdam(our_params, freeze_step=FREEZE, **common)
    elif name == "lamb":
        ref = _reference_module("lamb").OnebitLamb(
            ref_params, deepspeed=engine, freeze_step=FREEZE, comm_backend_name="compressed", **common
        )
        ours = oxcomm.optim.OnebitLamb(our_params, freeze_step=FREEZE, **common)
    else:
        zo = dict(var_freeze_step=FREEZE, var_update_scaler=2, local_step_scaler=8, local_step_clipper=4)
        ref = _reference_module("zoadam").ZeroOneAdam(
            ref_params, deepspeed=engine, comm_backend_name="compressed", **zo, **common
        )
        ours = oxcomm.optim.ZeroOneAdam(our_params, **zo, **common)
    return ref, ours


def _rank_case(name):
    """In a rank: ``name``'s two optimizers side by side; per step, the largest relative
    difference of any parameter tensor."""
    import torch
    import torch.distributed as dist

    import oxcomm.deepspeed  # noqa: F401  (registers "oxcomm" and DeepSpeed's glue)

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="oxcomm")
    sys.modules["deepspeed.runtime.comm.compressed"] = _compressed_backend_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    ref_model, our_model = _model(0), _model(0)
    engine = types.SimpleNamespace(mpu=None, local_rank=rank, enable_backward_allreduce=True)
    ref, ours = _optimizers(name, list(ref_model.parameters()), list(our_model.parameters()), engine)
    worst = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        for model in (ref_model, our_model):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        if engine.enable_backward_allreduce:
            # DeepSpeed's engine averages the gradients in backward while the optimizer lets it
            for p in ref_model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(n)
        ref.step()
        ours.step()
        diff = 0.0
        for a, b in zip(our_model.parameters(), ref_model.parameters()):
            a, b = a.detach(), b.detach()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                diff = float("inf")  # a run that diverged compares nothing
                break
            scale = b.abs().max().item() or 1.0
            diff = max(diff, (a - b).abs().max().item() / scale)
        worst.append(diff)
    return worst


def case_adam():
    return _rank_case("adam")


def case_lamb():
    return _rank_case("lamb")


def case_zoadam():
    return _rank_case("zoadam")


@pytest.mark.parametrize("name", ["adam", "lamb", "zoadam"])
def test_step_for_step_with_deepspeed_0_19_4(name):
    assert os.path.exists(TARBALL), f"DeepSpeed 0.19.4's source distribution is missing: {TARBALL}; {FETCH}"
    res = _torch_ranks.run(2, f"test_onebit_vs_deepspeed:case_{name}", timeout=300)
    for rank, worst in enumerate(res):
        assert len(worst) == STEPS, worst
        bad = [(step + 1, d) for step, d in enumerate(worst) if not d <= TOLERANCE]
        assert not bad, f"rank {rank}: {name} departs from DeepSpeed 0.19.4 at (step, relative difference) {bad[:8]}"
