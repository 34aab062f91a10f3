"""The stacks built on torch.distributed, on CPU, equal to gloo (issue 29, item 5): FSDP2
(``fully_shard`` over ``init_device_mesh("cpu", (2,))``), DTensor redistribution, functional
collectives, ``new_subgroups`` and ``split_group``, and DeepSpeed ZeRO stages 1, 2 and 3.

Each test runs the same seeded rank program (a ``case_*`` below) twice, as a 2-rank job on
``"oxcomm"`` and as one on ``"gloo"`` (``STACKS_BACKEND``), and requires every value the ranks
return to be equal up to summation order (``assert_close`` at ``RTOL``/``ATOL``). The oxcomm
run must print no ``[c10d]`` warning (the rendezvous used to log two per 50 ms poll).
"""

from __future__ import annotations

import pytest

import _torch_ranks

torch = pytest.importorskip("torch")

WORLD = 2
RTOL, ATOL = 1e-5, 1e-6
DEADLINE = 300
DS_DEADLINE = 600  # DeepSpeed's start-up is 10-20 s per rank on a loaded 2-core machine


# ------------------------------------------------------------------------------- in the ranks


def _init():
    """The default group on the job's backend, one thread per rank, seed 0."""
    import torch.distributed as dist

    import _stacks_ranks
    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(_stacks_ranks.backend())
    assert dist.get_backend() == _stacks_ranks.backend()
    return dist.get_rank(), dist.get_world_size()


def _run_case(body):
    """``body()`` -> {name: tensor}, run with stderr watched; the values as JSON lists."""
    import torch.distributed as dist

    import _stacks_ranks

    with _stacks_ranks.Stderr() as err:
        values = body()
        dist.barrier()
    return {
        "values": {k: [list(v.shape), v.detach().double().reshape(-1).tolist()] for k, v in values.items()},
        "c10d": err.c10d,
    }


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def _batches(rank, steps, n=6):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)) for _ in range(steps)]


def case_fsdp2():
    """FSDP2: each Linear and the root sharded over a 1-D CPU mesh, 4 Adam steps, the full
    parameters (all-gathered DTensors) and the losses."""

    def body():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rank, _ = _init()
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out = {}
        for step, (x, y) in enumerate(_batches(rank, 4)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            out[f"loss{step}"] = loss.detach().reshape(1)
        for name, p in model.named_parameters():
            out[name] = p.full_tensor()
        return out

    return _run_case(body)


def case_dtensor():
    """distribute_tensor and redistribute: Shard->Replicate (even and uneven), Replicate->Shard,
    Partial->Replicate, Partial->Shard, Shard(0)->Shard(1); each checked against the exact
    answer here and against gloo in pytest."""

    def body():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        rank, n = _init()
        mesh = init_device_mesh("cpu", (WORLD,))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(6, 5, generator=gen)
        odd = torch.randn(7, 3, generator=gen)
        out = {}
        full = distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
        assert torch.equal(full, x)
        out["shard0_to_replicate"] = full
        full = distribute_tensor(odd, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
        assert torch.equal(full, odd)
        out["uneven_shard0_to_replicate"] = full
        part = distribute_tensor(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()
        assert torch.equal(part, x.tensor_split(n, dim=1)[rank])
        out["replicate_to_shard1"] = part
        t01 = distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).to_local()
        assert torch.equal(t01, x.tensor_split(n, dim=1)[rank])
        out["shard0_to_shard1"] = t01
        mine = torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + rank))
        every = [torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
        total = sum(every[1:], every[0])
        summed = DTensor.from_local(mine, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        torch.testing.assert_close(summed, total, rtol=RTOL, atol=ATOL)
        out["partial_to_replicate"] = summed
        scattered = DTensor.from_local(mine, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
        torch.testing.assert_close(scattered, total.tensor_split(n, dim=0)[rank], rtol=RTOL, atol=ATOL)
        out["partial_to_shard0"] = scattered
        # a DTensor op: matmul of a row-sharded and a replicated tensor, gathered
        w = distribute_tensor(torch.randn(5, 4, generator=gen), mesh, [Replicate()])
        prod = (distribute_tensor(x, mesh, [Shard(0)]) @ w).full_tensor()
        out["matmul"] = prod
        return out

    return _run_case(body)


def case_functional():
    """torch.distributed._functional_collectives: all_reduce (sum, max, avg), all_gather_tensor,
    reduce_scatter_tensor, all_to_all_single (even and uneven splits), on the world group and
    on a mesh."""

    def body():
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh

        rank, n = _init()
        mesh = init_device_mesh("cpu", (WORLD,))
        world = dist.group.WORLD
        gen = torch.Generator().manual_seed(20 + rank)
        t = torch.randn(12, 3, generator=gen)
        out = {}
        out["all_reduce_sum"] = funcol.wait_tensor(funcol.all_reduce(t, "sum", world))
        out["all_reduce_max"] = funcol.wait_tensor(funcol.all_reduce(t, "max", mesh))
        out["all_reduce_avg"] = funcol.wait_tensor(funcol.all_reduce(t, "avg", world))
        out["all_gather_tensor"] = funcol.wait_tensor(funcol.all_gather_tensor(t, 0, world))
        out["all_gather_tensor_dim1"] = funcol.wait_tensor(funcol.all_gather_tensor(t, 1, mesh))
        out["reduce_scatter_tensor"] = funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", 0, world))
        out["all_to_all_even"] = funcol.wait_tensor(funcol.all_to_all_single(t, None, None, world))
        # rank r sends r + 1 + k rows to rank k: uneven in both directions
        send = [rank + 1 + k for k in range(n)]
        recv = [r + 1 + rank for r in range(n)]
        src = torch.randn(sum(send), 3, generator=gen)
        got = funcol.wait_tensor(funcol.all_to_all_single(src, recv, send, world))
        assert list(got.shape) == [sum(recv), 3], got.shape
        out["all_to_all_uneven"] = got
        ref = torch.zeros_like(t)
        ref.copy_(t)
        dist.all_reduce(ref)
        torch.testing.assert_close(out["all_reduce_sum"], ref, rtol=0, atol=0)
        return out

    return _run_case(body)


def case_subgroups():
    """new_subgroups (group sizes 1 and 2), new_subgroups_by_enumeration, and split_group
    (into singletons and into the whole world): an all_reduce and an all_gather on each."""

    def body():
        import torch.distributed as dist

        rank, n = _init()
        out = {}
        t = torch.arange(6, dtype=torch.float32) + 10 * rank

        def use(name, group):
            size = dist.get_world_size(group)
            s = t.clone()
            dist.all_reduce(s, group=group)
            parts = [torch.zeros_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            out[f"{name}_all_reduce"] = s
            out[f"{name}_all_gather"] = torch.stack(parts)

        mine, _ = dist.new_subgroups(group_size=1)
        assert dist.get_world_size(mine) == 1
        use("new_subgroups_1", mine)
        mine, _ = dist.new_subgroups(group_size=2)
        assert dist.get_world_size(mine) == 2
        use("new_subgroups_2", mine)
        mine, _ = dist.new_subgroups_by_enumeration([[1], [0]])
        assert dist.get_process_group_ranks(mine) == [rank]
        use("by_enumeration", mine)
        single = dist.split_group(split_ranks=[[0], [1]])
        assert single is not None and dist.get_world_size(single) == 1
        use("split_singletons", single)
        whole = dist.split_group(split_ranks=[list(range(n))])
        assert dist.get_world_size(whole) == n
        use("split_world", whole)
        return out

    return _run_case(body)


def case_zero():
    """DeepSpeed ZeRO stages 1, 2 and 3, one after the other in this process: a fresh model from
    seed 0, a client Adam, 3 steps of 2-rank data parallelism, then the full parameters."""
    import _stacks_ranks

    with _stacks_ranks.Stderr() as err:
        import deepspeed
        import torch.distributed as dist

        import oxcomm.deepspeed  # noqa: F401  (registers "oxcomm"; wraps DeepSpeed's TorchBackend)

        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend=_stacks_ranks.backend(), verbose=False)
        assert dist.get_backend() == _stacks_ranks.backend()
        rank = dist.get_rank()
        values = {}
        for stage in (1, 2, 3):
            config = {
                "train_micro_batch_size_per_gpu": 6,
                "train_batch_size": 6 * WORLD,
                "steps_per_print": 10**9,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": stage},
            }
            model = _model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            assert engine.zero_optimization_stage() == stage
            assert type(engine.optimizer).__name__.startswith("DeepSpeedZeroOptimizer"), type(engine.optimizer)
            for step, (x, y) in enumerate(_batches(rank, 3)):
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                values[f"zero{stage}/loss{step}"] = loss.detach().reshape(1)
            params = list(engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
                for name, p in params:
                    values[f"zero{stage}/{name}"] = p.detach().clone()
            if hasattr(engine, "destroy"):
                engine.destroy()
            dist.barrier()
    return {
        "values": {k: [list(v.shape), v.double().reshape(-1).tolist()] for k, v in values.items()},
        "c10d": err.c10d,
    }


# ------------------------------------------------------------------------------- in pytest


def _job(case, backend, timeout):
    return _torch_ranks.run(WORLD, f"test_stacks:{case}", timeout=timeout, env={"STACKS_BACKEND": backend})


def _both(case, timeout=DEADLINE):
    """(oxcomm's results, gloo's) of ``case``, each a list per rank; oxcomm's run printed no
    c10d warning."""
    ox = _job(case, "oxcomm", timeout)
    gl = _job(case, "gloo", timeout)
    for r, res in enumerate(ox):
        assert not res["c10d"], f"{case}: rank {r} on oxcomm printed c10d warnings:\n" + "\n".join(res["c10d"])
    return ox, gl


def _equal(ox, gl, prefix=""):
    """Every value of every rank, oxcomm against gloo, up to summation order."""
    checked = 0
    for r, (a, b) in enumerate(zip(ox, gl)):
        names = sorted(k for k in b["values"] if k.startswith(prefix))
        assert names, f"rank {r}: nothing named {prefix}* returned"
        assert sorted(k for k in a["values"] if k.startswith(prefix)) == names
        for name in names:
            (shape_a, va), (shape_b, vb) = a["values"][name], b["values"][name]
            assert shape_a == shape_b, f"rank {r} {name}: shape {shape_a} on oxcomm, {shape_b} on gloo"
            torch.testing.assert_close(
                torch.tensor(va, dtype=torch.float64),
                torch.tensor(vb, dtype=torch.float64),
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, r=r, name=name: f"rank {r} {name}: oxcomm vs gloo: {m}",
            )
            checked += 1
    return checked


def test_fsdp2_trains_equal_to_gloo():
    ox, gl = _both("case_fsdp2")
    assert _equal(ox, gl) >= WORLD * 10
    # the replicated full parameters agree across ranks, too
    assert ox[0]["values"]["0.weight"] == ox[1]["values"]["0.weight"]


def test_dtensor_redistribute_equal_to_gloo():
    ox, gl = _both("case_dtensor")
    _equal(ox, gl)


def test_functional_collectives_equal_to_gloo():
    ox, gl = _both("case_functional")
    _equal(ox, gl)


def test_new_subgroups_and_split_group_equal_to_gloo():
    ox, gl = _both("case_subgroups")
    _equal(ox, gl)


@pytest.fixture(scope="module")
def zero_runs():
    pytest.importorskip("deepspeed")
    return _both("case_zero", timeout=DS_DEADLINE)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_equal_to_gloo(zero_runs, stage):
    ox, gl = zero_runs
    assert _equal(ox, gl, prefix=f"zero{stage}/") >= WORLD * 6
