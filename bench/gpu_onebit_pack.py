"""The 1-bit all-reduce's device kernels against the device's copy bandwidth and cupy.packbits.

For each size, on one device, in one run:

* ``copy``: ``dst.copy_(src)`` of the float32 tensor (the device-to-device copy bandwidth);
* ``pack``: :func:`oxcomm._onebit_kernels.pack_signs` (float32 → one sign bit per element),
  as the torch ops and as the Triton kernel (on CUDA, where Triton imports);
* ``unpack``: :func:`oxcomm._onebit_kernels.unpack_scaled` (sign bits → ``±scale`` float32),
  likewise (the torch ops: ``select`` on CUDA, ``flip`` on CPU);
* ``cupy``: ``cupy.packbits`` on the same tensor as DeepSpeed's ``NcclBackend`` called it
  (``packbits(x.sign().add(1).bool())``, the torch ops included) and bare on a bool array,
  when cupy is importable (a line says so otherwise);
* ``call``: one whole ``CompressedAllreduce`` call (worker step, all-to-all, server step,
  all-gather, unpack) on one rank: an oxcomm communicator of one rank, so the collectives are
  local copies and the time is the kernels' plus the staging's (on CUDA: the device-to-host
  and host-to-device copies of the packed rows); ``torch ms``, where Triton runs, is the same
  call with ``OXCOMM_ONEBIT_KERNELS=torch`` (the torch ops only).

Throughputs are GB/s of float32 elements (4 bytes each, the tensor's size over the time:
what ``pack`` reads, what ``unpack`` writes, what ``copy`` copies), medians over ``--repeat``
timed runs after two untimed ones, timed with CUDA events on CUDA. The target: pack and
unpack (the kernels a call uses: Triton's on CUDA where it runs) at ≥ 40% of the copy's
figure, and faster than cupy.packbits.

    python bench/gpu_onebit_pack.py --device cuda          # on the GPU machine
    python bench/gpu_onebit_pack.py --device cpu --sizes 1M  # smoke test anywhere

The ``pack_tr``/``unpk_tr`` columns ask for Triton's kernels by name, so a Triton that does not
compile is an error, never torch ops timed under Triton's name; the line before the last says
what the whole call's default kernels ran (``oxcomm._onebit_kernels.report()``). The last line
sums up the largest size with the kernels a call uses: ``gpu_onebit_pack:
<device> <n> elements (kernels): copy X GB/s, pack Y GB/s (P% of copy), unpack Z GB/s (Q% of copy),
cupy.packbits W GB/s ..., call T ms``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse_count(text):
    """``4096``, ``64K``, ``16M``, ``1G`` (powers of 1024) → an int."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def timer(device):
    """A function timing ``fn`` ``repeat`` times (after two untimed runs); median seconds."""
    import torch

    def run(fn, repeat):
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def cupy_packbits(x):
    """Functions timing cupy.packbits as DeepSpeed used it, or the reason there are none."""
    import torch

    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any failure to import means "not available"
        return None, f"cupy is not importable here ({type(e).__name__}: {e}); no cupy.packbits figure"
    if x.device.type != "cuda":
        return None, "cupy.packbits runs on CUDA tensors only; no figure on this device"

    def deepspeed_style():
        # NcclBackend: cupy.packbits(buffer_m.sign_().add_(1).bool()) through DLPack (as
        # uint8 0/1: packbits packs non-zero elements as 1, and every cupy takes uint8)
        return cupy.packbits(cupy.from_dlpack(x.sign().add_(1).bool().view(torch.uint8)))

    try:
        bools = cupy.from_dlpack(x.sign().add_(1).bool().view(torch.uint8))
        got = cupy.asnumpy(deepspeed_style())
    except Exception as e:  # noqa: BLE001 - a cupy that cannot take the tensor: say so
        return None, f"cupy.packbits failed here ({type(e).__name__}: {e}); no cupy figure"

    def bare():
        return cupy.packbits(bools)

    return (deepspeed_style, bare, got), None


def one_rank_call(device, numel):
    """A whole CompressedAllreduce call on a one-rank oxcomm communicator (device kernels)."""
    import torch
    import torch.distributed as dist

    import oxcomm
    from oxcomm import onebit_torch

    comm = oxcomm.Communicator.from_store(dist.HashStore(), 0, 1, timeout=60)
    ar = onebit_torch.CompressedAllreduce(comm)
    # CPU tensors on oxcomm take the Rust path; time the device kernels there too
    ar._transports["cpu"] = onebit_torch._Staged(onebit_torch._OxcommBytes(comm))
    n_padded = onebit_torch.padded_len(numel, 1)
    x = torch.randn(numel, device=device)
    we, se = torch.zeros(n_padded, device=device), torch.zeros(n_padded, device=device)
    return lambda: ar(x, we, se)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--sizes", default="64K,1M,16M,64M", help="float32 elements per tensor (K, M, G: powers of 1024)")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()

    import torch

    from oxcomm import _onebit_kernels as kernels

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke test: one core, no OpenMP waits on a shared machine
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_onebit_pack: CUDA is not available here (try --device cpu)")
    sizes = [parse_count(s) for s in args.sizes.split(",") if s.strip()]
    for numel in sizes:
        if numel <= 0 or numel % 8:
            raise SystemExit(f"gpu_onebit_pack: --sizes: {numel} is not a positive multiple of 8")
    time_it = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    triton_ok = device.type == "cuda" and kernels._triton_module(required=False) is not None
    torch_unpack = "select" if device.type == "cuda" else "flip"
    print(f"# gpu_onebit_pack on {name}, torch {torch.__version__}; GB/s of float32 elements, median of {args.repeat}")
    if device.type == "cuda" and not triton_ok:
        print(f"# Triton is not available here ({kernels._triton['failed']}): torch ops only")
    print(
        f"{'elements':>10} {'copy':>8} {'pack':>8} {'pack_tr':>8} {'unpack':>8} {'unpk_tr':>8} "
        f"{'cupy_ds':>8} {'cupy':>8} {'call ms':>9} {'torch ms':>9}"
    )
    cupy_note = None
    last = None
    fmt = lambda v: f"{v:8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
    for numel in sizes:
        gen = torch.Generator(device=device).manual_seed(numel)
        x = torch.randn(numel, device=device, generator=gen)
        dst = torch.empty_like(x)
        packed = kernels.pack_signs(x, method="torch")
        out = torch.empty_like(x).view(1, -1)
        scale = torch.tensor(0.5, device=device)
        rows = packed.view(1, -1)
        gbs = lambda seconds: 4 * numel / seconds / 1e9  # noqa: E731
        copy = gbs(time_it(lambda: dst.copy_(x), args.repeat))
        pack = gbs(time_it(lambda: kernels.pack_signs(x, method="torch"), args.repeat))
        unpack = gbs(time_it(lambda: kernels.unpack_scaled(rows, scale, out=out, method=torch_unpack), args.repeat))
        pack_tr = unpack_tr = None
        if triton_ok:
            if not torch.equal(kernels.pack_signs(x, method="triton"), packed):
                raise SystemExit("gpu_onebit_pack: the Triton and torch pack kernels give other bytes")
            want = kernels.unpack_scaled(rows, scale, method=torch_unpack)
            if not torch.equal(kernels.unpack_scaled(rows, scale, method="triton").view(torch.int32), want.view(torch.int32)):
                raise SystemExit("gpu_onebit_pack: the Triton and torch unpack kernels give other bits")
            pack_tr = gbs(time_it(lambda: kernels.pack_signs(x, method="triton"), args.repeat))
            unpack_tr = gbs(time_it(lambda: kernels.unpack_scaled(rows, scale, out=out, method="triton"), args.repeat))
        # the kernels' bits are checked here too: unpacking what was packed gives ±scale
        back = kernels.unpack_scaled(rows, scale).view(-1)
        if not torch.equal(back < 0, x < 0):
            raise SystemExit("gpu_onebit_pack: unpack(pack(x)) has other signs than x")
        cupy_fns, note = cupy_packbits(x)
        cupy_ds = cupy_bare = None
        if cupy_fns is not None:
            ds_fn, bare_fn, got = cupy_fns
            if got.tobytes() != packed.cpu().numpy().tobytes():
                raise SystemExit("gpu_onebit_pack: cupy.packbits gives other bytes than pack_signs")
            cupy_ds = gbs(time_it(ds_fn, args.repeat))
            cupy_bare = gbs(time_it(bare_fn, args.repeat))
        else:
            cupy_note = note
        call = time_it(one_rank_call(device, numel), max(3, args.repeat // 2)) * 1e3
        ran = kernels.report()  # what the call's default kernels ran (Triton, or its fallback)
        call_torch = None
        if triton_ok:  # the same call with the torch ops only, to show what the fused kernels save
            os.environ[kernels.KERNELS_ENV] = "torch"
            try:
                call_torch = time_it(one_rank_call(device, numel), max(3, args.repeat // 2)) * 1e3
            finally:
                del os.environ[kernels.KERNELS_ENV]
        print(
            f"{numel:>10} {copy:8.1f} {pack:8.1f} {fmt(pack_tr)} {unpack:8.1f} {fmt(unpack_tr)} "
            f"{fmt(cupy_ds)} {fmt(cupy_bare)} {call:9.3f} {f'{call_torch:9.3f}' if call_torch is not None else f'{chr(45):>9}'}",
            flush=True,
        )
        last = (numel, copy, pack_tr or pack, unpack_tr or unpack, cupy_ds, cupy_bare, call, call_torch)
    if cupy_note:
        print(f"# {cupy_note}")
    numel, copy, pack, unpack, cupy_ds, cupy_bare, call, call_torch = last
    cupy_text = (
        f"cupy.packbits {cupy_ds:.1f} GB/s as DeepSpeed called it ({cupy_bare:.1f} bare)"
        if cupy_ds is not None
        else "cupy.packbits not measured"
    )
    fell_back = {k: v for k, v in ran.items() if v != "triton"}
    used = "torch ops" if not triton_ok else "Triton" if not fell_back else f"Triton, except {fell_back}"
    if device.type == "cuda":
        print(f"# kernels the call ran: {ran}")
    print(
        f"gpu_onebit_pack: {device.type} {numel} elements ({used}): copy {copy:.1f} GB/s, pack {pack:.1f} GB/s "
        f"({100 * pack / copy:.0f}% of copy), unpack {unpack:.1f} GB/s ({100 * unpack / copy:.0f}% of copy), "
        f"{cupy_text}, call {call:.3f} ms" + (f" ({call_torch:.3f} ms with torch ops only)" if call_torch else "")
    )


if __name__ == "__main__":
    main()
