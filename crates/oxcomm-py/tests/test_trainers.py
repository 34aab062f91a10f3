"""Training frameworks on oxcomm, as the README's "With Lightning, accelerate, transformers,
torchft" shows them: a few steps of the same seeded model and data on 2 CPU ranks with each, once on
oxcomm and once on gloo, and the losses must be equal, bit for bit.

- Lightning: ``DDPStrategy(process_group_backend="oxcomm")``, the backend named only as a
  string (the wheel's entry point registers it: no oxcomm import in the rank);
- accelerate and the transformers ``Trainer``: they initialise gloo themselves on CPU, so the
  rank initialises the group first (``init_process_group("oxcomm")``) and they take it;
- torchft: its reconfigurable ``ProcessGroupWrapper`` with ``_create_pg`` returning oxcomm's
  group on a communicator built from the quorum's store (one replica group per rank; the
  lighthouse runs in pytest).

Each ``case_*`` runs in the ranks (``_torch_ranks.run``), its backend from ``OXCOMM_TEST_BACKEND``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

import _torch_ranks

pytest.importorskip("torch")

# torchft's quorum logs (INFO) would fill a failing test's report: see test_ft.py.
os.environ.setdefault("RUST_LOG", "warn")

STEPS = 6


def _backend():
    return os.environ["OXCOMM_TEST_BACKEND"]


def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(n=96):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


# ------------------------------------------------------------------ Lightning


def case_lightning():
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    assert "oxcomm" not in sys.modules
    torch.set_num_threads(1)
    losses = []

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend=_backend()),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), loader)
    import torch.distributed as dist

    return {"backend": dist.get_backend(), "losses": losses}


# ------------------------------------------------------------------ accelerate


def case_accelerate():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(_backend())  # accelerate would pick gloo on CPU: the group first
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for step, (xb, yb) in enumerate(loader):
        if step == STEPS:
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"backend": dist.get_backend(), "losses": losses, "procs": acc.num_processes}


# ------------------------------------------------------------------ transformers' Trainer


def case_transformers():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(_backend())  # the Trainer would pick gloo on CPU: the group first
    from transformers import Trainer, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = _data()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=STEPS,
            learning_rate=0.1,
            lr_scheduler_type="constant",
            optim="sgd",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=Model(), args=args, train_dataset=Data())
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"backend": dist.get_backend(), "losses": losses, "world": args.world_size}


# ------------------------------------------------------------------ torchft


def case_torchft():
    """One replica group per rank (torchft's fault-tolerant DDP): the replicas' gradients are
    averaged by the Manager over a reconfigurable process group, torchft's ``ProcessGroupGloo``
    or the same few lines around oxcomm's group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.process_group import ProcessGroupWrapper

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timeout = timedelta(seconds=60)

    class ProcessGroupOxcomm(ProcessGroupWrapper):
        """torchft's reconfigurable group on oxcomm: a new communicator per quorum."""

        def _create_pg(self, store, rank, world_size):
            import oxcomm
            import oxcomm.torch

            comm = oxcomm.Communicator.from_store(store, rank, world_size, timeout=self._timeout.total_seconds())
            return oxcomm.torch.ProcessGroupOxcomm(comm, rank, world_size)

        def getBackendName(self):
            return "torchft-oxcomm"

    pg = ProcessGroupGloo(timeout=timeout) if _backend() == "gloo" else ProcessGroupOxcomm(timeout=timeout)
    model = _net()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"replica{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        use_async_quorum=False,
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    losses = []
    for step in range(STEPS):
        at = (step * 2 + rank) * 8
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[at : at + 8]), y[at : at + 8])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    manager.shutdown()
    return {"backend": _backend(), "losses": losses, "params": params}


# ------------------------------------------------------------------ in pytest


def _both(case, env=None):
    runs = {}
    for backend in ("gloo", "oxcomm"):
        extra = env() if env else {}
        runs[backend] = _torch_ranks.run(
            2,
            f"test_trainers:{case}",
            timeout=300,
            env={"OXCOMM_TEST_BACKEND": backend, "TORCHELASTIC_RUN_ID": "t", **extra.get("env", {})},
        )
        extra.get("close", lambda: None)()
    for backend, res in runs.items():
        for r in res:
            assert r["backend"] == backend, r
            assert len(r["losses"]) == STEPS, r
    assert runs["oxcomm"] == [dict(r, backend="oxcomm") for r in runs["gloo"]], runs
    return runs


def test_lightning_trains_on_oxcomm_as_on_gloo():
    pytest.importorskip("lightning")
    _both("case_lightning")


def test_accelerate_trains_on_oxcomm_as_on_gloo():
    pytest.importorskip("accelerate")
    runs = _both("case_accelerate")
    assert runs["oxcomm"][0]["procs"] == 2


def test_transformers_trainer_trains_on_oxcomm_as_on_gloo():
    pytest.importorskip("transformers")
    runs = _both("case_transformers")
    assert runs["oxcomm"][0]["world"] == 2


def test_torchft_trains_on_oxcomm_as_on_gloo():
    pytest.importorskip("torchft")

    def lighthouse():
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2)
        return {"env": {"TORCHFT_LIGHTHOUSE": server.address()}, "close": server.shutdown}

    runs = _both("case_torchft", lighthouse)
    assert runs["oxcomm"][0]["params"] == runs["oxcomm"][1]["params"]  # the replicas agree
