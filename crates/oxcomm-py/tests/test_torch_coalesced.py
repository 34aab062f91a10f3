"""torch's coalesced calls on the "oxcomm" backend run as oxcomm's coalesced ops, not as loops
of single ops: ``all_gather_coalesced``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
under ``_coalescing_manager`` (torch hands them to the group as one ``*_coalesced`` call),
``all_reduce`` under it (``allreduce_coalesced``), and ``batch_isend_irecv`` (the group's
``_start_coalescing``/``_end_coalescing``). Each result is compared exactly with gloo's in the
same job, and the communicator's flight recorder must show one native op (or one batch) per
call and dtype: a call that looped over single ops would show one per tensor.

The ``case_*`` functions run in the ranks (``_torch_ranks.run``), ``test_*`` in pytest.
"""

from __future__ import annotations

import json

import pytest

import _torch_ranks

pytest.importorskip("torch")


def _ops_since(comm, seen):
    """[(op, dtype, count)] of the communicator's ops (its flight recorder) that are not in
    ``seen`` (an earlier answer's second item), and the set of ops recorded now. (A batch of
    point-to-point ops is one entry, "send/recv", numbered per pair, not per op.)"""
    entries = [json.loads(ln) for ln in comm.flight_record().splitlines() if ln.strip()]
    keys = {(e["seq"], e["op"], e["start_ns"]) for e in entries}
    new = [(e["op"], e["dtype"], e["count"]) for e in entries if (e["seq"], e["op"], e["start_ns"]) not in seen]
    return new, keys


def case_coalesced():
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    import oxcomm.torch
    from test_torch_backend import _data, _groups, _same

    ox, gl = _groups()
    comm = oxcomm.torch.communicator(ox)
    rank, n = dist.get_rank(), dist.get_world_size()
    _, seq = _ops_since(comm, set())
    seen = {}

    def native(name):
        nonlocal seq
        new, seq = _ops_since(comm, seq)
        seen[name] = new
        return new

    shapes = [(3,), (2, 5), (0,), (7,)]

    # all_gather_coalesced: output_lists[r][j] is rank r's inputs[j] (torch wants one dtype)
    def gather_lists(group, async_op):
        ins = [_data(torch.float32, torch.Size(s).numel(), rank, j).view(s) for j, s in enumerate(shapes)]
        outs = [[torch.full(t.shape, -9, dtype=t.dtype) for t in ins] for _ in range(n)]
        w = dist.all_gather_coalesced(outs, ins, group=group, async_op=async_op)
        if async_op:
            w.wait()
        return [t for per_rank in outs for t in per_rank]

    for a in (False, True):
        _same(f"all_gather_coalesced async={a}", gather_lists(ox, a), gather_lists(gl, a))
        ops = native(f"all_gather_coalesced async={a}")
        assert [o[0] for o in ops] == ["all_gather_coalesced"], ops

    # all_gather_into_tensor / reduce_scatter_tensor / all_reduce under the coalescing manager
    def under_manager(group, what, async_op):
        ins = [_data(torch.float32, 4 * n * (j + 1), rank, j) for j in range(3)]
        if what == "all_gather_into_tensor":
            outs = [torch.full((t.numel() * n,), -9.0) for t in ins]
        elif what == "reduce_scatter_tensor":
            outs = [torch.full((t.numel() // n,), -9.0) for t in ins]
        else:
            outs = ins
        with _coalescing_manager(group=group, async_ops=async_op) as cm:
            for i, o in zip(ins, outs):
                if what == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(o, i, group=group)
                elif what == "reduce_scatter_tensor":
                    dist.reduce_scatter_tensor(o, i, group=group)
                else:
                    dist.all_reduce(i, group=group)
        if async_op:
            cm.wait()
        return outs

    want_op = {
        "all_gather_into_tensor": "all_gather_coalesced",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce_coalesced",
    }
    for what, op in want_op.items():
        for a in (False, True):
            _same(f"{what} coalesced async={a}", under_manager(ox, what, a), under_manager(gl, what, a))
            ops = native(f"{what} async={a}")
            assert [o[0] for o in ops] == [op], (what, ops)

    # batch_isend_irecv: the group's coalescing region, so all of it is one native batch
    def batch(group):
        peer = (rank + 1) % n, (rank - 1) % n
        sends = [_data(torch.float32, 5 + j, rank, j) for j in range(3)]
        recvs = [torch.full((5 + j,), -9.0) for j in range(3)]
        ops = [dist.P2POp(dist.isend, t, peer[0], group=group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer[1], group=group) for t in recvs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return recvs

    pg = ox if ox is not None else dist.distributed_c10d._get_default_group()
    assert pg.supports_coalescing
    # Count the coalescing regions torch opens on oxcomm: torch 2.15 opens one for the batch;
    # torch 2.11's batch_isend_irecv does so only for a group whose type is exactly
    # ProcessGroup and issues the ops one by one otherwise (correct too, as many native
    # batches: the results are compared with gloo's all the same).
    from oxcomm.torch import issue as _pg

    opened = []
    start = _pg._Issuer._start_coalescing
    _pg._Issuer._start_coalescing = lambda self, device=None: (opened.append(1), start(self, device))[1]
    try:
        _same("batch_isend_irecv", batch(ox), batch(gl))
    finally:
        _pg._Issuer._start_coalescing = start
    ops = native("batch_isend_irecv")
    if opened:
        assert [o[0] for o in ops] == ["send/recv"], ops
    else:
        assert torch.__version__ < "2.15", "torch 2.15 opens a coalescing region for batch_isend_irecv"

    dist.destroy_process_group()
    return {k: [list(o) for o in v] for k, v in seen.items()}


def test_coalesced_calls_are_one_native_op_each_and_match_gloo():
    res = _torch_ranks.run(2, "test_torch_coalesced:case_coalesced", timeout=240)
    assert res[0] and res[0].keys() == res[1].keys()


def test_coalesced_calls_3_ranks():
    res = _torch_ranks.run(3, "test_torch_coalesced:case_coalesced", timeout=360)
    assert len(res) == 3
