"""How long ``dist.all_reduce`` of a device tensor holds the host, through "oxcomm" and through
gloo's CUDA path, 8 B to 64 MiB, 2 ranks.

    python3 bench/gpu_runahead.py                    # on a GPU machine (cuda:0 shared by the ranks)
    python3 bench/gpu_runahead.py --device fake      # the logic, on the tests' fake device (CPU)

NCCL's ``all_reduce`` returns once the op is ordered on the caller's current stream: the host runs
ahead of the device. A staged op cannot: its copy out must wait for the work queued on the stream
before it, the host collective for that copy, and the caller's stream can only be made to wait
for an event that has been recorded (the last copy back's), so a blocking call holds the host until
the caller's stream has drained up to the call and the host collective ran. This measures it. Per
size, each column the median of ``--repeat`` calls, in ms of host time from the call to its return:

  queued   the call made right after ``--queued`` ms of device work on the current stream (a
           sleep kernel): what a training step's all-reduce costs the host behind its backward
  idle     the call on an idle stream
  async    ``async_op=True``'s return (it only queues the op), then ``wait()``'s (``wait`` returns
           once the caller's stream waits for the result: no host wait on the device either way)

for ``oxcomm`` (the default group) and ``gloo`` (a gloo group on the same CUDA tensors; not on the
fake device, which gloo cannot read). The last lines sum up: the host hold of a blocking call behind
queued work, against the queued time. See docs/gpu.md ("Host run-ahead") for what it decides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "crates", "oxcomm-py", "tests")
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20]
ROWS = "@@runahead@@ "


def child(args):
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    if args.device == "fake":
        sys.path.insert(0, TESTS)
        from _on_device import target

        tg = target()
        delay, sync, device = tg.delay, tg.synchronize, None
        make = lambda n: tg.tensor(torch.ones(n))  # noqa: E731
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        delay = lambda s: torch.cuda._sleep(int(s * 2e9))  # noqa: E731  (cycles: ~2 GHz)
        sync = torch.cuda.synchronize
        make = lambda n: torch.ones(n, device=device)  # noqa: E731
    torch.set_num_threads(1)
    dist.init_process_group("oxcomm", timeout=timedelta(seconds=120))
    groups = {"oxcomm": None}
    if args.device == "cuda":
        groups["gloo"] = dist.new_group(backend="gloo")
    rows = []
    for size in SIZES:
        n = max(1, size // 4)
        x = make(n)
        row = {"bytes": n * 4}
        for name, g in groups.items():
            for label, queued in (("queued", args.queued / 1e3), ("idle", 0.0)):
                times = []
                for _ in range(args.repeat + 1):
                    sync()
                    dist.barrier(group=g)
                    if queued:
                        delay(queued)
                    t0 = time.perf_counter()
                    dist.all_reduce(x, group=g)
                    times.append(time.perf_counter() - t0)
                sync()
                row[f"{name} {label}"] = statistics.median(times[1:]) * 1e3
            calls, waits = [], []
            for _ in range(args.repeat + 1):
                sync()
                dist.barrier(group=g)
                delay(args.queued / 1e3)
                t0 = time.perf_counter()
                w = dist.all_reduce(x, group=g, async_op=True)
                t1 = time.perf_counter()
                w.wait()
                t2 = time.perf_counter()
                calls.append(t1 - t0)
                waits.append(t2 - t1)
            sync()
            row[f"{name} async"] = statistics.median(calls[1:]) * 1e3
            row[f"{name} wait"] = statistics.median(waits[1:]) * 1e3
        rows.append(row)
    dist.barrier()
    if dist.get_rank() == 0:
        print(ROWS + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def report(rows, args):
    names = [k.split(" ")[0] for k in rows[0] if k.endswith(" idle")]
    print(f"# gpu_runahead on {args.device}: host ms per dist.all_reduce call, 2 ranks, median of {args.repeat}; "
          f"'queued': behind {args.queued:g} ms of device work on the current stream")
    head = f"{'bytes':>10}"
    for name in names:
        head += f" {name + ' queued':>14} {name + ' idle':>12} {name + ' async':>13} {name + ' wait':>12}"
    print(head)
    for r in rows:
        line = f"{r['bytes']:>10}"
        for name in names:
            line += f" {r[name + ' queued']:14.3f} {r[name + ' idle']:12.3f} {r[name + ' async']:13.3f} {r[name + ' wait']:12.3f}"
        print(line)
    for name in names:
        held = [r[f"{name} queued"] for r in rows]
        print(
            f"gpu_runahead: {name} on {args.device}: a blocking all_reduce behind {args.queued:g} ms of queued work "
            f"holds the host {min(held):.1f}-{max(held):.1f} ms (8 B-64 MiB); async_op=True returns in "
            f"{min(r[name + ' async'] for r in rows):.3f}-{max(r[name + ' async'] for r in rows):.3f} ms"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "fake"), default="cuda")
    p.add_argument("--queued", type=float, default=20.0, help="ms of device work queued before the call")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import gpu_ranks

    rows = gpu_ranks.start(__file__, args, child, 2, ROWS)
    if isinstance(rows, int):
        return rows
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
