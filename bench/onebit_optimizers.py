"""oxcomm's 1-bit optimizers against their exact counterparts on CPU, 2 ranks: the loss each
reaches and the bytes each rank sends per step, measured on the wire.

1. Loss: the task of crates/oxcomm-py/examples/deepspeed_train.py (a GELU MLP regressing a ReLU
   teacher, 32-64-64-4, batch 32 per rank), from one seed, in a plain loop: 1-bit Adam and
   0/1 Adam against exact data-parallel Adam (DDP + torch.optim.Adam), 200 steps, lr 3e-3;
   1-bit LAMB against exact LAMB (the same optimizer never frozen), 400 steps, lr 9e-3. The
   optimizers' settings are the example's (``make_optimizer``): 1-bit phases from a fifth of
   the run, 0/1 Adam's local phase from half. Target: within 2% of the exact loss.
2. Bytes: a GELU MLP of ``--layers`` × ``--width`` (default 4 × 1024, 4.2 M parameters), random
   data; every kind of step each optimizer takes (exact, 1-bit, 0/1 Adam's local and sync
   steps) is timed and its traffic counted. The count is the byte counter of the loopback
   interface of a network namespace private to the run (``unshare --net``; each rank gets its
   own ``OXCOMM_HOST_ID``, so oxcomm links them over TCP, not shared memory), read by rank 0
   between barriers around one step; the median over the steps of a kind, minus the median of
   the same window with no step in it (the barriers), divided by the 2 ranks (their traffic is
   symmetric). IP and TCP headers
   included: these are the bytes a link carries. Target: ≥ 25× fewer per compressed step than
   per exact step.

Needs root (``unshare --net``) and oxcomm installed (``pip install ./crates/oxcomm-py``); a
benchmark, not a test (CI does not run it). Prints a table; nothing is written.

    sudo python3 bench/onebit_optimizers.py                 # both parts (a few minutes)
    sudo python3 bench/onebit_optimizers.py --part bytes --width 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "crates", "oxcomm-py", "examples", "deepspeed_train.py")
NETNS_ENV = "OXCOMM_BENCH_PRIVATE_NETNS"


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("both", "loss", "bytes"), default="both")
    p.add_argument("--width", type=int, default=1024, help="bytes part: MLP width")
    p.add_argument("--layers", type=int, default=4, help="bytes part: MLP layers")
    p.add_argument("--batch", type=int, default=8, help="bytes part: batch per rank")
    p.add_argument("--samples", type=int, default=6, help="bytes part: steps measured per kind")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ------------------------------------------------------------------------ launcher


def launch(args):
    """Re-runs this script in a private network namespace, then as 2 ranks under torchrun."""
    if os.environ.get(NETNS_ENV) != "1":
        if os.geteuid() != 0:
            sys.exit("onebit_optimizers.py: needs root (unshare --net gives the run its own loopback to count)")
        env = dict(os.environ, **{NETNS_ENV: "1"})
        os.execvpe("unshare", ["unshare", "--net", sys.executable, *sys.argv], env)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    parts = ("loss", "bytes") if args.part == "both" else (args.part,)
    for part in parts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [os.path.abspath(__file__), "--worker", "--part", part, "--width", str(args.width)]
        cmd += ["--layers", str(args.layers), "--batch", str(args.batch), "--samples", str(args.samples)]
        subprocess.run(cmd, env=env, check=True, timeout=1800)


# ------------------------------------------------------------------------ ranks


def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("deepspeed_train", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def loss_part(ex):
    import torch
    import torch.distributed as dist

    runs = (
        ("exact Adam", "adam", 200, None),
        ("1-bit Adam", "onebit", 200, None),
        ("0/1 Adam", "zoadam", 200, None),
        ("exact LAMB", "lamb", 400, 10**9),
        ("1-bit LAMB", "lamb", 400, None),
    )
    losses = {}
    for label, name, steps, freeze in runs:
        model = ex.make_model(seed=0)
        opt = ex.make_optimizer(name, model.parameters(), steps, freeze)
        net = torch.nn.parallel.DistributedDataParallel(model) if name == "adam" else model
        data = ex.make_data(dist.get_rank())
        start = time.perf_counter()
        for step in range(steps):
            x, y = ex.batch(data, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        losses[label] = (ex.evaluate(model), steps, (time.perf_counter() - start) / steps * 1e3)
    if dist.get_rank() == 0:
        print("# loss on held-out data (examples/deepspeed_train.py's task, 2 ranks, same seed)")
        for label, (loss, steps, ms) in losses.items():
            ref = losses["exact LAMB" if "LAMB" in label else "exact Adam"][0]
            vs = f"{loss / ref - 1:+6.1%} vs exact"
            print(f"  {label:<11} {steps:4d} steps  loss {loss:.5f}  ({vs})  {ms:6.2f} ms/step")


def lo_tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def bytes_part(ex, args):
    import torch
    import torch.distributed as dist

    import oxcomm.torch

    rank = dist.get_rank()
    world = dist.get_world_size()

    def model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        return torch.nn.Sequential(*layers[:-1])

    def window(work):
        dist.barrier()
        before = lo_tx_bytes()
        t = time.perf_counter()
        work()
        dist.barrier()
        return lo_tx_bytes() - before, time.perf_counter() - t

    empty = statistics.median(window(lambda: None)[0] for _ in range(9))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    warm = 6
    n = args.samples
    configs = (
        ("exact Adam", lambda ps: torch.optim.Adam(ps, lr=1e-4), True),
        ("1-bit Adam", lambda ps: oxcomm.torch.OnebitAdam(ps, lr=1e-4, freeze_step=warm), False),
        ("exact LAMB", lambda ps: oxcomm.torch.OnebitLamb(ps, lr=1e-3, freeze_step=10**9), False),
        ("1-bit LAMB", lambda ps: oxcomm.torch.OnebitLamb(ps, lr=1e-3, freeze_step=warm), False),
        (
            "0/1 Adam",
            lambda ps: oxcomm.torch.ZeroOneAdam(
                ps,
                lr=1e-4,
                var_freeze_step=warm + 2 * n,
                var_update_scaler=2,
                local_step_scaler=n,
                local_step_clipper=4,
            ),
            False,
        ),
    )
    table = {}
    params = None
    for label, make, ddp in configs:
        m = model()
        params = sum(p.numel() for p in m.parameters())
        net = torch.nn.parallel.DistributedDataParallel(m) if ddp else m
        opt = make(net.parameters() if ddp else m.parameters())
        kinds = {}
        for step in range(warm + 4 * n + 8):
            kind = step_kind(opt)

            def one():
                opt.zero_grad(set_to_none=False)
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()

            sent, secs = window(one)
            if step >= 1:  # step 1 only allocates
                kinds.setdefault(kind, []).append((sent, secs))
        table[label] = {k: v[-n:] for k, v in kinds.items()}
    if rank != 0:
        return
    exact = statistics.median(s for s, _ in table["exact Adam"]["exact"]) - empty
    print(
        f"# bytes each rank sends per step (loopback of a private netns, TCP, {world} ranks): MLP "
        f"{args.layers} x {args.width} ({params / 1e6:.1f} M params), median of {n} steps of each kind, "
        f"barriers' {empty / world:.0f} B removed"
    )
    for label, kinds in table.items():
        for kind, samples in kinds.items():
            sent = (statistics.median(s for s, _ in samples) - empty) / world
            ms = statistics.median(t for _, t in samples) * 1e3
            # under 1 KiB: acknowledgements and timing noise around a step that sends no payload
            ratio = f"{exact / world / sent:7.1f}x fewer than exact Adam's" if sent >= 1024 else f"{'no payload':^30}"
            print(f"  {label:<11} {kind:<6} {sent:12,.0f} B  {ratio}  ({ms:7.1f} ms/step)")


def step_kind(opt):
    """What the optimizer's next step sends: exact, 1-bit, or for 0/1 Adam local / sync."""
    import oxcomm.torch

    if not isinstance(opt, (oxcomm.torch.OnebitAdam, oxcomm.torch.OnebitLamb, oxcomm.torch.ZeroOneAdam)):
        return "exact"
    if isinstance(opt, oxcomm.torch.ZeroOneAdam) and opt.frozen:
        return "sync" if (opt.steps + 1) % opt.local_step_interval == 0 else "local"
    return "exact" if opt.exact_next() else "1-bit"


def worker(args):
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.set_num_threads(1)
    # one "host" per rank: oxcomm then links the ranks over TCP (through the counted loopback)
    os.environ["OXCOMM_HOST_ID"] = f"onebit-bench-rank-{os.environ['RANK']}"
    dist.init_process_group("oxcomm")
    assert oxcomm.torch.communicator().transport == "tcp", oxcomm.torch.communicator().transport
    ex = example()
    if args.part == "loss":
        loss_part(ex)
    else:
        bytes_part(ex, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    a = parse()
    worker(a) if a.worker else launch(a)
