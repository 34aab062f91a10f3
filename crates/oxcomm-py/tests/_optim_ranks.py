"""What the ranks of ``test_optimizers.py`` (and ``tests_cuda/test_cuda_optimizers.py``) run: the
three 1-bit optimizers of :mod:`oxcomm.optim` trained on the example model of
``examples/deepspeed_train.py`` in a plain loop, under DDP, as DeepSpeed's client optimizer,
resumed from a state dict, and on degenerate parameters.

Each ``case_*`` function runs in every rank (spawned by ``_torch_ranks.run``) and returns a
JSON-serialisable value; the assertions that compare ranks are the test's. ``train`` is the one
training loop all cases share, so the runs they compare differ only in what the case varies.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os

import torch
import torch.distributed as dist

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

#: The optimizers' names in results (their settings: :func:`make_optimizer`, with phases short
#: enough that every one is crossed: warm-up, compressed, 0/1 Adam's doubling variance interval
#: and local-step interval).
NAMES = ("onebit_adam", "onebit_lamb", "zero_one_adam")


def example():
    """``examples/deepspeed_train.py`` as a module (its model, data, learning rates)."""
    spec = importlib.util.spec_from_file_location("deepspeed_train", os.path.join(EXAMPLES, "deepspeed_train.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def device():
    """Where the parameters live: ``OXCOMM_TEST_DEVICE``, else CPU; ``target`` (tests_cuda) is
    the device of ``_on_device.target()``: CUDA, or the fake device (whose tensors are CPU ones)."""
    name = os.environ.get("OXCOMM_TEST_DEVICE", "cpu")
    if name == "target":
        from _on_device import target

        return target().device
    return torch.device(name)


def host_run():
    """The block in which a "cpu" run makes host tensors (on the fake device, the reference)."""
    if os.environ.get("OXCOMM_TEST_DEVICE") == "target":
        from _on_device import target

        return target().reference()
    import contextlib

    return contextlib.nullcontext()


def init(backend="oxcomm"):
    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    dist.init_process_group(backend)


#: Steps of the plain-loop comparison: LAMB's coefficients need longer to settle before they
#: freeze (at 200 steps 1-bit LAMB ends 15% above exact LAMB at its lr, 7% below at 0.02).
STEPS = {"adam": 200, "onebit_adam": 200, "zero_one_adam": 200, "onebit_lamb": 400, "exact_lamb": 400}


def scaled(steps):
    """``steps`` divided by ``OXCOMM_TEST_STEPS_DIVISOR`` (default 1), at least 40 (shorter, 1-bit
    Adam freezes too early and diverges, on every device): tests_cuda shortens the runs on the
    fake device, whose torch ops cost several times the CPU's."""
    return max(40, steps // int(os.environ.get("OXCOMM_TEST_STEPS_DIVISOR", "1")))


def make_model(seed=0):
    """The example's student MLP (GELU: see the example's docs)."""
    return example().make_model(seed)


def make_optimizer(name, params, steps, lr=None, **kw):
    """``name``'s optimizer with phases scaled to a run of ``steps`` steps: 1-bit Adam and LAMB
    freeze at a fifth; 0/1 Adam's variance phase ends at half (with β2 = 0.999 a shorter one
    leaves variances too small for 1-bit gradients and local steps, and the run diverges), its
    variance interval doubles every 16 variance steps (4 below 200 steps) and its local-step
    interval every tenth of the run, up to 4. ``exact_lamb`` is 1-bit LAMB that never freezes
    (exact LAMB: the reference of 1-bit LAMB)."""
    from oxcomm.optim import OnebitAdam, OnebitLamb, ZeroOneAdam

    ex = example()
    freeze = max(2, steps // 5)
    if name == "onebit_adam":
        return OnebitAdam(params, lr=lr or ex.LR, freeze_step=freeze, **kw)
    if name == "onebit_lamb":
        return OnebitLamb(params, lr=lr or ex.LAMB_LR, freeze_step=freeze, **kw)
    if name == "exact_lamb":
        return OnebitLamb(params, lr=lr or ex.LAMB_LR, freeze_step=10**9, **kw)
    if name == "zero_one_adam":
        return ZeroOneAdam(
            params,
            lr=lr or ex.LR,
            var_freeze_step=steps // 2,
            var_update_scaler=16 if steps >= 200 else 4,
            local_step_scaler=max(1, steps // 10),
            local_step_clipper=4,
            **kw,
        )
    raise ValueError(name)


def digest(tensors):
    """A hash of the tensors' bytes: equal on two ranks iff the tensors are bit-identical."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(ex, model, opt, steps, *, net=None, start=0, engine=None, data=None, device="cpu"):
    """``steps`` steps from step ``start`` on this rank's shard (``batch(data, step)``)."""
    net = net or model
    data = data or ex.make_data(dist.get_rank())
    for step in range(start, start + steps):
        x, y = ex.batch(data, step)
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(net(x), y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()


# ------------------------------------------------------------------------ plain loop vs exact


def case_plain_loop():
    """Each optimizer in a plain loop against its exact counterpart from the same seed, for
    ``STEPS[name]`` steps: the held-out loss of each run, and a digest of the parameters (0/1
    Adam's run ends on a sync step), which the test compares across ranks. On :func:`device`."""
    init()
    ex = example()
    dev, out = device(), {}
    for name in ("adam",) + NAMES + ("exact_lamb",):
        steps = scaled(STEPS[name])
        model = make_model(seed=0).to(dev)
        net = None
        if name == "adam":
            net = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.Adam(net.parameters(), lr=ex.LR)
        elif name == "zero_one_adam":
            # identical_sync: every rank the same parameters after a sync (DeepSpeed's running
            # sum leaves each rank off by its own rounding: test_onebit_vs_deepspeed.py)
            opt = make_optimizer(name, model.parameters(), steps, identical_sync=True)
        else:
            opt = make_optimizer(name, model.parameters(), steps)
        train(ex, model, opt, steps, net=net, device=dev)
        out[name] = {"loss": ex.evaluate(model.cpu()), "params": digest(model.parameters())}
        if name == "zero_one_adam":
            assert opt.frozen and opt.local_step_interval == 4 and steps % 4 == 0, vars(opt)
    return out


# ------------------------------------------------------------------------ DDP


def case_ddp():
    """Each optimizer under DDP with its comm hook against the same optimizer in a plain loop:
    the parameters must be bit-identical (the hook averages exactly the steps the optimizer
    would, and sends nothing on the others); so must those of a plain loop whose optimizer is
    given the :class:`oxcomm.Communicator` instead of the torch group. Returns the steps on which
    the hook communicated, per optimizer. On :func:`device`."""
    import oxcomm.torch

    init()
    ex = example()
    steps, dev, out = scaled(40), device(), {}
    for name in NAMES:
        plain = make_model(seed=0).to(dev)
        train(ex, plain, make_optimizer(name, plain.parameters(), steps), steps, device=dev)
        model = make_model(seed=0).to(dev)
        opt = make_optimizer(name, model.parameters(), steps)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        averaged = []
        hook = opt.ddp_comm_hook

        def counting_hook(state, bucket, hook=hook, opt=opt, averaged=averaged):
            if opt.exact_next():
                averaged.append(opt.steps + 1)
            return hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        train(ex, model, opt, steps, net=ddp, device=dev)
        same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
        # and with the group given as the oxcomm.Communicator behind the default group
        direct = make_model(seed=0).to(dev)
        opt = make_optimizer(name, direct.parameters(), steps, group=oxcomm.torch.communicator())
        train(ex, direct, opt, steps, device=dev)
        comm_same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), direct.parameters()))
        out[name] = {"same": same, "communicator_same": comm_same, "averaged_steps": sorted(set(averaged))}
    return out


# ------------------------------------------------------------------------ DeepSpeed


def case_deepspeed():
    """Each optimizer as DeepSpeed's client optimizer (``bind_engine``) against the same
    optimizer in a plain loop: parameters bit-identical, and the engine's backward all-reduce
    switched on exactly before the exact steps."""
    import deepspeed

    import oxcomm.deepspeed

    torch.set_num_threads(1)
    oxcomm.deepspeed.init_distributed(verbose=False)
    ex = example()
    steps, out = 40, {}
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": ex.MICRO_BATCH,
        "train_batch_size": ex.MICRO_BATCH * world,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    for name in NAMES:
        plain = make_model(seed=0)
        ref = make_optimizer(name, plain.parameters(), steps)
        exact_steps = []
        data = ex.make_data(dist.get_rank())
        for step in range(steps):
            if ref.exact_next():
                exact_steps.append(step + 1)
            train(ex, plain, ref, 1, start=step, data=data)
        model = make_model(seed=0)
        opt = make_optimizer(name, model.parameters(), steps)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        opt.bind_engine(engine)
        on = []
        for step in range(steps):
            if engine.enable_backward_allreduce:
                on.append(step + 1)
            train(ex, model, opt, 1, start=step, engine=engine, data=data)
        same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), engine.module.parameters()))
        out[name] = {"same": same, "engine_on": on, "exact": exact_steps}
    return out


# ------------------------------------------------------------------------ state dict


def case_resume():
    """Each optimizer saved (``torch.save`` of ``state_dict()``) after ``k`` steps and loaded into
    a new model and optimizer, for ``k`` in the exact phase and in the compressed phase (for 0/1
    Adam between two sync steps), against a run that was never interrupted: the parameters and
    a digest of the whole state must be bit-identical."""
    init()
    ex = example()
    steps, out = 40, {}
    for name in NAMES:
        whole = make_model(seed=0)
        opt = make_optimizer(name, whole.parameters(), steps)
        train(ex, whole, opt, steps)
        for k in (5, 31):
            first = make_model(seed=0)
            opt1 = make_optimizer(name, first.parameters(), steps)
            train(ex, first, opt1, k)
            blob = io.BytesIO()
            torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, blob)
            mid = (opt1.steps, getattr(opt1, "local_step_interval", None))
            del first, opt1
            blob.seek(0)
            saved = torch.load(blob, weights_only=False)
            second = make_model(seed=1)  # other weights: the load must restore them
            second.load_state_dict(saved["model"])
            opt2 = make_optimizer(name, second.parameters(), steps)
            opt2.load_state_dict(saved["opt"])
            train(ex, second, opt2, steps - k, start=k)
            same = all(torch.equal(a, b) for a, b in zip(whole.parameters(), second.parameters()))
            out[f"{name}@{k}"] = {"same": same, "state": _state_digest(opt2) == _state_digest(opt), "mid": mid}
    return out


def _state_digest(opt):
    ts = []
    for st in opt.state.values():
        for k in sorted(st):
            v = st[k]
            ts.append(v if isinstance(v, torch.Tensor) else torch.tensor([float(v)], dtype=torch.float64))
    return digest(ts)


# ------------------------------------------------------------------------ degenerate parameters


def case_degenerate():
    """Each optimizer on a model with an empty parameter, a zero parameter whose gradient is
    always zero, a non-zero one whose gradient is always zero, and a group with lr = 0, with
    weight decay, through every phase: every parameter stays finite, the zero one stays zero
    and the lr = 0 group does not move (DeepSpeed's 1-bit LAMB turned the first compressed step
    into NaN here, its 0/1 Adam the first sync of the lr = 0 group). Also: a float64 parameter
    is refused with an error naming the rank and the optimizer."""
    init()
    steps, out = 40, {}
    for name in NAMES:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(16, 8))
        empty = torch.nn.Parameter(torch.empty(0))
        zero = torch.nn.Parameter(torch.zeros(24))
        dead = torch.nn.Parameter(torch.randn(24))
        still = torch.nn.Parameter(torch.randn(8))
        still0 = still.detach().clone()
        groups = [{"params": [w, empty, zero, dead]}, {"params": [still], "lr": 0.0}]
        opt = make_optimizer(name, groups, steps, lr=1e-2, weight_decay=0.01)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            x = torch.randn(4, 16, generator=gen)
            loss = (x @ w).pow(2).mean() + (still * x[0, :8]).sum() + (zero * 0).sum() + (dead * 0).sum() + empty.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        finite = all(bool(torch.isfinite(p).all()) for p in (w, zero, dead, still))
        out[name] = {
            "finite": finite,
            "zero_stays_zero": bool((zero == 0).all()),
            "lr0_still": torch.equal(still, still0),
            "frozen": bool(opt.frozen),
        }
        bad = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        opt = make_optimizer(name, [bad], steps)
        bad.grad = torch.ones_like(bad)
        try:
            opt.step()
            out[name]["float64"] = None
        except TypeError as e:
            out[name]["float64"] = str(e)
    return out


# ------------------------------------------------------------------------ a device against CPU


def case_device_vs_cpu():
    """Each optimizer on parameters on :func:`device` (``OXCOMM_TEST_DEVICE``: CUDA or the fake
    device in tests_cuda, shared by the ranks; ``cpu`` in the CPU twin) against the same
    optimizer on CPU parameters. Both runs compute their gradients on a CPU copy of their own
    parameters, so that only the optimizers' arithmetic differs: elementwise kernels round alike
    on both devices (IEEE add, mul, div, sqrt), reductions (LAMB's norms, the 1-bit all-reduce's
    scales) sum in another order. Returns per optimizer the largest relative difference of a
    parameter tensor (norm of the difference over the norm), that of the held-out loss, whether
    all stayed finite, and whether the optimizer's state is on the device (staged by oxcomm)."""
    from oxcomm._cuda import device as _dev

    init()
    ex = example()
    steps, out = 40, {}
    dev = device()
    for name in NAMES:
        with host_run():
            pc, lc, _ = _device_vs_cpu_run(ex, name, steps, torch.device("cpu"))
        pd, ld, opt = _device_vs_cpu_run(ex, name, steps, dev)
        rel = max((a - b).norm().item() / max(b.norm().item(), 1e-30) for a, b in zip(pd, pc))
        exp_avg = next(iter(opt.state.values()))["exp_avg"]
        out[name] = {
            "param_rel": rel,
            "loss_rel": abs(ld - lc) / lc,
            "finite": all(bool(torch.isfinite(t).all()) for t in pd),
            "device": str(exp_avg.device),
            "on_device": _dev.owns(exp_avg),
        }
    return out


def _device_vs_cpu_run(ex, name, steps, where):
    """One run of :func:`case_device_vs_cpu`: (parameters, held-out loss, optimizer)."""
    model = make_model(seed=0).to(where)
    shadow = make_model(seed=0)
    opt = make_optimizer(name, model.parameters(), steps)
    data = ex.make_data(dist.get_rank())
    for step in range(steps):
        with torch.no_grad():
            for s, p in zip(shadow.parameters(), model.parameters()):
                s.copy_(p.cpu())
        x, y = ex.batch(data, step)
        shadow.zero_grad()
        torch.nn.functional.mse_loss(shadow(x), y).backward()
        for s, p in zip(shadow.parameters(), model.parameters()):
            p.grad = s.grad.to(where)
        opt.step()
    params = [p.detach().cpu() for p in model.parameters()]
    return params, ex.evaluate(model.cpu()), opt
