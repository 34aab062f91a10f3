"""Surviving a rank's death from Python: ``Communicator.revoke``, ``is_revoked``,
``failed_ranks``, ``agree`` and ``shrink``, and the ``RevokedError`` / ``SuspectedError``
classes. Ranks are processes spawned by ``_torch_ranks.run`` (a parent-owned TCPStore on port
0, a deadline, every child killed at the end, a rank that kills itself allowed by
``may_die``); each joins with ``oxcomm.Communicator.from_store`` over shared memory."""

import os
import signal
import threading
import time
from datetime import timedelta

import pytest

import _torch_ranks

COUNT = 1 << 14

# torchft's Rust side (read when torchft is first imported) logs every quorum at INFO into
# stderr, and a failing test's report shows the captured stderr whole: tens of thousands of
# lines that push the failure itself out of a CI log's tail. Warnings only, unless set. (Not
# in a conftest.py: the rank processes put this folder first on sys.path, where a conftest
# module would shadow tests_cuda's.)
os.environ.setdefault("RUST_LOG", "warn")


def _join(timeout=60.0):
    """This rank's Communicator and the job's store (to pass times and pids between ranks)."""
    from datetime import timedelta

    import torch.distributed as dist

    import oxcomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=60)
    )
    comm = oxcomm.Communicator.from_store(dist.PrefixStore("ft", store), rank, world, timeout=timeout)
    return comm, store


def _survive(comm, orig, after, deadline_s=60.0):
    """All-reduces ``(orig rank + 1) * (step + 1)`` step after step, shrinking on every
    failure and redoing the steps that did not complete everywhere, until ``after`` steps
    have completed after the first failure. Checks every completed step's sum against the
    members it was computed over. Returns the last communicator, the original ranks of its
    members, the failed sets seen and the monotonic time of the first step completed on each
    world size."""
    import numpy as np

    import oxcomm

    me = orig[comm.rank]
    failed_sets = []
    done_at = {}
    step = 0
    since = 0
    deadline = time.monotonic() + deadline_s
    while not (failed_sets and since >= after):
        assert time.monotonic() < deadline, f"no failure seen in {deadline_s} s (step {step})"
        x = np.full(COUNT, (orig[comm.rank] + 1) * (step + 1), dtype=np.float32)
        try:
            comm.all_reduce(x)
        except oxcomm.OxcommError as e:
            assert isinstance(e, (oxcomm.PeerGoneError, oxcomm.RevokedError, oxcomm.AbortedError)), repr(e)
            old = comm
            comm = old.shrink()
            failed = old.failed_ranks()
            failed_sets.append([orig[r] for r in failed])
            orig = [o for r, o in enumerate(orig) if r not in failed]
            assert comm.size == len(orig) and orig[comm.rank] == me, (comm, orig, me)
            # A step may have completed on some survivors and failed on others: go on
            # from the earliest one any survivor has not completed.
            s = np.array([step], dtype=np.int64)
            comm.all_reduce(s, oxcomm.ReduceOp.MIN)
            step = int(s[0])
            continue
        want = sum(o + 1 for o in orig) * (step + 1)
        assert np.all(x == want), (step, orig, x[:4], want)
        done_at.setdefault(len(orig), time.monotonic())
        step += 1
        since += bool(failed_sets)
    return comm, orig, failed_sets, done_at


def case_killed_in_an_all_reduce_loop():
    """Rank 2 SIGKILLs itself from another thread while its main thread is in the loop;
    the others shrink and go on with the right sums."""
    comm, store = _join()
    world = comm.size
    orig = list(range(world))
    if comm.rank == 2:

        def die():
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.5, die).start()
        _survive(comm, orig, 1)
        raise AssertionError("rank 2 outlived its own SIGKILL")
    comm2, orig2, failed_sets, done_at = _survive(comm, orig, 50)
    assert comm.is_revoked() and not comm2.is_revoked()
    assert comm.failed_ranks() == [2]
    assert comm2.failed_ranks() == []
    killed_at = float(store.get("killed_at"))
    # The first completed step on the shrunk communicator, as wall time after the kill.
    first = done_at[world - 1] - time.monotonic() + time.time()
    return {
        "orig": orig2,
        "failed": failed_sets,
        "rank": comm2.rank,
        "size": comm2.size,
        "kill_to_op_s": round(first - killed_at, 3),
    }


def test_survivors_of_a_killed_rank_shrink_and_get_the_right_sums():
    res = _torch_ranks.run(4, "test_ft:case_killed_in_an_all_reduce_loop", timeout=120, may_die=(2,))
    assert res[2] is None
    survivors = [res[r] for r in (0, 1, 3)]
    for new_rank, r in enumerate(survivors):
        assert r["orig"] == [0, 1, 3], r
        assert r["failed"] == [[2]], r
        assert (r["rank"], r["size"]) == (new_rank, 3), r
    # Bounded generously: the figure itself is measured by bench, not asserted tight here.
    assert all(r["kill_to_op_s"] < 10.0 for r in survivors), survivors


def case_revoke():
    """Ranks 0 and 1 wait in an all-reduce that rank 2 never calls; rank 2 revokes. Their op
    fails with RevokedError naming 2; then all three agree and shrink to a working world."""
    import numpy as np

    import oxcomm

    comm, _ = _join()
    out = {}
    if comm.rank == 2:
        time.sleep(0.5)
        comm.revoke()
        comm.revoke()  # again: nothing more
    else:
        t = time.monotonic()
        with pytest.raises(oxcomm.RevokedError) as e:
            comm.all_reduce(np.ones(COUNT, dtype=np.float32))
        out["waited_s"] = time.monotonic() - t
        assert e.value.peer == 2 and e.value.kind == "revoked", e.value
        assert "revoked" in str(e.value)
    assert comm.is_revoked()
    # Every later op fails at once, the same way.
    with pytest.raises(oxcomm.RevokedError):
        comm.barrier()
    # agree still works on the revoked communicator: every rank gets the same AND.
    a = comm.agree([0b1110, 0b0111, (1 << 64) - 1][comm.rank])
    assert isinstance(a, oxcomm.Agreed) and a == (0b0110, []), a
    small = comm.shrink()
    assert (small.rank, small.size) == (comm.rank, 3) and not small.is_revoked()
    x = np.full(4, comm.rank + 1, dtype=np.float32)
    small.all_reduce(x)
    out["sum"] = x.tolist()
    return out


def test_revoke_fails_the_others_pending_op_then_agree_and_shrink_work():
    res = _torch_ranks.run(3, "test_ft:case_revoke", timeout=120)
    for r in res:
        assert r["sum"] == [6.0] * 4, res
    # Woken by the revocation, not by the 60 s deadline.
    assert res[0]["waited_s"] < 10.0 and res[1]["waited_s"] < 10.0, res


def case_agree():
    import numpy as np

    import oxcomm

    comm, store = _join()
    out = {}
    # On a healthy communicator: an AND over everyone.
    out["healthy"] = list(comm.agree(0b101 if comm.rank == 1 else 0b111))
    with pytest.raises(ValueError):
        comm.agree(-1)
    with pytest.raises(ValueError):
        comm.agree(1 << 64)
    # On a group: unsupported (agree is a call of the world).
    g = comm.group([0, 1])
    if g is not None:
        with pytest.raises(oxcomm.UnsupportedError):
            g.agree(1)
    comm.barrier()
    # After a death: the survivors agree on the value and on who failed.
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(oxcomm.OxcommError):
        comm.all_reduce(np.ones(COUNT, dtype=np.float32))
    out["after"] = list(comm.agree(0b110 if comm.rank == 0 else 0b011))
    out["failed_ranks"] = comm.failed_ranks()
    return out


def test_agree_ands_the_flags_of_the_survivors_and_names_the_failed():
    res = _torch_ranks.run(3, "test_ft:case_agree", timeout=120, may_die=(1,))
    assert res[1] is None
    for r in (res[0], res[2]):
        assert r["healthy"] == [0b101, []], res
        assert r["after"] == [0b010, [1]], res
        assert r["failed_ranks"] == [1], res


def case_frozen():
    """Rank 2 stops itself (SIGSTOP) inside the loop; with a 1 s heartbeat lapse the others
    get SuspectedError naming it, shrink it out and go on; rank 0 then resumes it (SIGCONT),
    and its op on the abandoned communicator fails with RevokedError: it completes nothing."""
    import numpy as np

    import oxcomm

    comm, store = _join()
    store.set(f"pid{comm.rank}", str(os.getpid()))
    comm.barrier()
    if comm.rank == 2:
        x = np.ones(COUNT, dtype=np.float32)
        comm.all_reduce(x)
        os.kill(os.getpid(), signal.SIGSTOP)
        # Resumed: the others have shrunk without this rank.
        with pytest.raises(oxcomm.RevokedError):
            comm.all_reduce(x)
        with pytest.raises(oxcomm.RevokedError):
            comm.shrink()
        store.set("resumed", "1")
        return {"excluded": True}
    x = np.ones(COUNT, dtype=np.float32)
    comm.all_reduce(x)
    t = time.monotonic()
    with pytest.raises((oxcomm.SuspectedError, oxcomm.RevokedError)) as e:
        comm.all_reduce(x)
    waited = time.monotonic() - t
    assert e.value.peer == 2, e.value
    kinds = type(e.value).__name__
    small = comm.shrink()
    assert comm.failed_ranks() == [2]
    x = np.ones(COUNT, dtype=np.float32)
    small.all_reduce(x)
    assert np.all(x == 2.0)
    small.barrier()
    if comm.rank == 0:
        os.kill(int(store.get("pid2")), signal.SIGCONT)
    # Stay until rank 2 has seen its revocation (our leaving would close its links).
    store.wait(["resumed"], timedelta(seconds=60))
    return {"waited_s": round(waited, 3), "error": kinds, "size": small.size}


def test_a_frozen_rank_is_suspected_shrunk_out_and_completes_nothing_when_resumed():
    env = {"OXCOMM_SUSPECT_AFTER_MS": "1000"}
    res = _torch_ranks.run(3, "test_ft:case_frozen", timeout=120, env=env)
    assert res[2] == {"excluded": True}, res
    assert "SuspectedError" in (res[0]["error"], res[1]["error"]), res
    for r in res[:2]:
        assert r["size"] == 2 and r["waited_s"] < 30.0, res


def test_the_error_classes():
    import oxcomm

    for cls in (oxcomm.RevokedError, oxcomm.SuspectedError):
        assert issubclass(cls, oxcomm.OxcommError) and issubclass(cls, RuntimeError)
    assert oxcomm.Agreed(3, [1]).flag == 3 and oxcomm.Agreed(3, [1]).failed == [1]


# ---------------------------------------------------------------------- torch


def case_torch_shrink_group():
    """init_process_group("oxcomm") on 3 ranks; rank 2 dies between all-reduces; the others
    call oxcomm.torch.shrink_group() and go on: a new default group of 2, the right sums, and
    DDP built again on it trains a step with equal parameters on both."""
    import torch
    import torch.distributed as dist

    import oxcomm
    import oxcomm.torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("oxcomm", timeout=timedelta(seconds=60))
    old = dist.distributed_c10d._get_default_group()
    t = torch.ones(8)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 8
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(oxcomm.OxcommError):
        for _ in range(100):
            dist.all_reduce(torch.ones(8))
            time.sleep(0.05)
    pg = oxcomm.torch.shrink_group()
    assert pg is not old and dist.distributed_c10d._get_default_group() is pg
    out = {"rank": dist.get_rank(), "size": dist.get_world_size()}
    t = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    # DDP holds its group: build it again on the shrunk one.
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    x = torch.full((3, 4), float(dist.get_rank() + 1))
    ddp(x).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.zeros_like(params) for _ in range(2)]
    dist.all_gather(both, params)
    out["params_equal"] = bool(torch.equal(both[0], both[1]))
    return out


def test_torch_shrink_group_goes_on_without_a_killed_rank():
    res = _torch_ranks.run(3, "test_ft:case_torch_shrink_group", timeout=180, may_die=(2,))
    assert res[2] is None
    for new_rank, r in enumerate(res[:2]):
        assert (r["rank"], r["size"]) == (new_rank, 2), res
        assert r["sum"] == [3.0] * 8 and r["params_equal"], res


def case_ddp_whose_all_reduce_fails():
    """DDP on 3 ranks; rank 2 dies between steps, so the survivors' next gradient all-reduce
    (DDP's own, through the Work's future) fails: ``backward()`` raises a RuntimeError naming
    the dead rank, as on gloo, and does not crash the process (it did: the reducer took a
    Python future's exception for its output tensors); then the survivors shrink and a DDP
    built on the new group trains."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("oxcomm", timeout=timedelta(seconds=60))
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    x = torch.ones(8, 64)
    error = None
    for step in range(100):
        if step == 5 and dist.get_rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the others are on their way into backward()
        try:
            ddp(x).sum().backward()
        except RuntimeError as e:
            error = str(e)
            break
    assert error is not None, "DDP never saw rank 2's death"
    pg = oxcomm.torch.shrink_group()
    model = torch.nn.Linear(4, 2)
    again = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    again(torch.full((3, 4), float(dist.get_rank() + 1))).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    both = [torch.zeros_like(grads) for _ in range(2)]
    dist.all_gather(both, grads)
    return {"error": error, "grads_equal": bool(torch.equal(both[0], both[1]))}


def test_ddp_whose_all_reduce_fails_raises_instead_of_crashing():
    res = _torch_ranks.run(3, "test_ft:case_ddp_whose_all_reduce_fails", timeout=180, may_die=(2,))
    assert res[2] is None
    for r in res[:2]:
        assert "rank 2" in r["error"] or "aborted" in r["error"], res
        assert r["grads_equal"], res


def case_torch_own_shrink_group():
    """torch's own dist.shrink_group on an oxcomm group: refused, naming oxcomm's, before
    anything changes (the group still works)."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401

    dist.init_process_group("oxcomm", timeout=timedelta(seconds=60))
    with pytest.raises(NotImplementedError, match="oxcomm.torch.shrink_group"):
        dist.shrink_group([1 - dist.get_rank()])
    t = torch.ones(8)
    dist.all_reduce(t)
    return t.tolist()


def test_torch_own_shrink_group_is_refused_naming_oxcomms():
    res = _torch_ranks.run(2, "test_ft:case_torch_own_shrink_group", timeout=120)
    assert res == [[2.0] * 8] * 2, res


# ---------------------------------------------------------------------- torchft


def _torchft_replica(make_pg, replica_id, lighthouse, steps, results):
    """One replica group of one rank: torchft's Manager on ``make_pg()``, a small MLP, SGD,
    ``steps`` committed steps on data seeded by (replica, step). Appends (replica, losses,
    parameters) to ``results``."""
    import torch
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = _manager(make_pg(), replica_id, lighthouse, model, opt, op_timeout=30)
    try:
        net = DistributedDataParallel(manager, model)
        optim = OptimizerWrapper(manager, opt)
        losses = []
        while manager.current_step() < steps:
            g = torch.Generator().manual_seed(1000 * replica_id + manager.current_step())
            x = torch.rand(8, 6, generator=g)
            y = torch.rand(8, 2, generator=g)
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            step = manager.current_step()
            optim.step()
            if manager.current_step() > step:
                losses.append(loss.item())
        params = [p.detach().clone() for p in model.parameters()]
        results.append((replica_id, losses, params))
    finally:
        manager.shutdown(wait=False)


def _manager(pg, replica_id, lighthouse, model, opt, op_timeout):
    """torchft's Manager of a replica group of one rank on ``pg`` (its own store, any port)."""
    import torch.distributed as dist
    from torchft import Manager

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=str(replica_id),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=op_timeout),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=30),
    )
    manager.test_store = store  # the store's server lives as long as the manager
    return manager


def _mlp():
    import torch

    g = torch.Generator().manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return model


def _torchft_run(make_pg, replicas, steps):
    """``replicas`` replica groups as threads of this process around one lighthouse; their
    results by replica id."""
    from concurrent.futures import ThreadPoolExecutor

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    results = []
    try:
        with ThreadPoolExecutor(max_workers=replicas) as ex:
            futs = [
                ex.submit(_torchft_replica, make_pg, r, lighthouse.address(), steps, results)
                for r in range(replicas)
            ]
            for f in futs:
                f.result(timeout=120)
    finally:
        lighthouse.shutdown()
    return sorted(results, key=lambda r: r[0])


def case_torchft_equal_to_gloo():
    """Two replica groups (a sum of two is the same in any order, so losses are equal bit for
    bit; with three, gloo's ring and oxcomm's add in another order and the last bits differ)."""
    import torch
    from torchft.process_group import ProcessGroupGloo

    from oxcomm.torchft import ProcessGroupOxcomm

    torch.set_num_threads(1)
    steps = 8
    gloo = _torchft_run(lambda: ProcessGroupGloo(timeout=timedelta(seconds=30)), 2, steps)
    ox = _torchft_run(lambda: ProcessGroupOxcomm(timeout=timedelta(seconds=30)), 2, steps)
    out = {"losses": [r[1] for r in ox]}
    for (rg, lg, pg), (ro, lo, po) in zip(gloo, ox):
        assert rg == ro and len(lo) == steps, (rg, ro, lo)
        assert lg == lo, (rg, lg, lo)
        assert all(torch.equal(a, b) for a, b in zip(pg, po)), rg
    for r in ox[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[2], ox[0][2]))
    return out


def test_torchft_losses_equal_to_torchft_on_gloo():
    res = _torch_ranks.run(1, "test_ft:case_torchft_equal_to_gloo", timeout=240)
    losses = res[0]["losses"]
    # The replicas train on different data, so their losses differ; training moved them.
    assert len(losses) == 2 and losses[0] != losses[1], losses


def _replica_process(backend, replica_id, lighthouse, steps, kill_at, out):
    """One replica group of one rank in this process, torchft's Manager on ``backend``'s
    group, gradients all-reduced with ``manager.allreduce`` (torchft 0.2's own DDP asserts in
    its comm hook when an all-reduce fails). With ``kill_at``, the process SIGKILLs itself at
    the first step from there that all three take, just before its all-reduce (its peers
    are inside theirs), after writing the
    time to ``out + ".killed"``. Writes the wall time of each committed step and the final
    parameters to ``out``."""
    import json

    import torch
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from oxcomm.torchft import ProcessGroupOxcomm

    torch.set_num_threads(1)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make = {"gloo": ProcessGroupGloo, "oxcomm": ProcessGroupOxcomm}[backend]
    pg = make(timeout=timedelta(seconds=5))
    manager = _manager(pg, replica_id, lighthouse, model, opt, op_timeout=5)
    optim = OptimizerWrapper(manager, opt)
    commits = []
    deadline = time.monotonic() + 120
    if kill_at is not None or replica_id != 2:
        # The first three start together, so that the first quorum has all of them.
        open(f"{out}.ready", "w").close()
        ready = [f"{os.path.dirname(out)}/{backend}{r}.json.ready" for r in range(3)]
        while not all(os.path.exists(f) for f in ready):
            assert time.monotonic() < deadline, "the other replicas did not start"
            time.sleep(0.05)
    # Each replica stops at ``steps`` once it has committed a step with all three after the
    # failure (a survivor: after one without replica 2; the replacement: once it is back),
    # so that all three stop after the same step. The replacement starts after the
    # survivors committed a step without replica 2 (``.saw_two``): one started sooner can
    # join before the survivors commit alone, and they would then wait for a step of two.
    saw_two, back = replica_id == 2, False
    while manager.current_step() < steps or not back:
        assert time.monotonic() < deadline, f"step {manager.current_step()}: no end in 120 s"
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * replica_id + step)
        x, y = torch.rand(8, 6, generator=g), torch.rand(8, 2, generator=g)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if kill_at is not None and step >= kill_at and manager.num_participants() == 3:
            with open(out + ".killed", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        for w in [manager.allreduce(p.grad) for p in model.parameters()]:
            w.wait()
        optim.step()
        if manager.current_step() > step:
            # oxcomm's group says how its last configure went: "shrink" or "rebuild".
            commits.append((time.time(), manager.num_participants(), getattr(pg, "last_configure", None)))
            if not saw_two and manager.num_participants() == 2:
                saw_two = True
                # The test starts the replacement only once both survivors wrote this, so
                # that the survivors' first commit after the kill is their own (two).
                open(out + ".saw_two", "w").close()
            back = saw_two and manager.num_participants() == 3
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    with open(out, "w") as f:
        json.dump({"commits": commits, "params": params}, f)
    manager.shutdown(wait=False)


def case_torchft_replica():
    """Run by ``test_torchft_kill_and_rejoin`` as a child: one replica (argv)."""
    import sys

    backend, replica_id, lighthouse, steps, kill_at, out = sys.argv[1:7]
    _replica_process(backend, int(replica_id), lighthouse, int(steps), None if kill_at == "-" else int(kill_at), out)


def _kill_and_rejoin(backend, tmp, steps=16, kill_at=6):
    """3 replica processes around one lighthouse; replica 2 kills itself at ``kill_at`` and
    is started again once it is dead. Returns (seconds from the kill to each survivor's next
    committed step, final parameters by replica, the path of each replica's group's last
    configure at its first commit of two after the kill and at its first commit of three
    after that: ``{replica: (path, path)}``, the survivors' only)."""
    import json
    import subprocess
    import sys

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["RUST_LOG"] = "info"  # each replica's quorums, in the log a failure shows

    def start(r, kill):
        args = [backend, str(r), lighthouse.address(), str(steps), str(kill) if kill is not None else "-"]
        code = "import sys, test_ft; test_ft.case_torchft_replica()"
        return subprocess.Popen(
            [sys.executable, "-c", code, *args, f"{tmp}/{backend}{r}.json"],
            env=env,
            cwd=here,
            stdout=subprocess.DEVNULL,
            stderr=open(f"{tmp}/{backend}{r}.log", "w"),
            start_new_session=True,
        )

    procs = [start(r, kill_at if r == 2 else None) for r in range(3)]
    deadline = time.monotonic() + 150
    try:
        assert procs[2].wait(timeout=60) == -signal.SIGKILL, open(f"{tmp}/{backend}2.log").read()[-3000:]
        while not all(os.path.exists(f"{tmp}/{backend}{r}.json.saw_two") for r in (0, 1)):
            for r in (0, 1):
                assert procs[r].poll() is None, (r, open(f"{tmp}/{backend}{r}.log").read()[-3000:])
            assert time.monotonic() < deadline, "the survivors committed no step without replica 2"
            time.sleep(0.02)
        procs[2] = start(2, None)
        for r, p in enumerate(procs):
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            assert rc == 0, (r, open(f"{tmp}/{backend}{r}.log").read()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lighthouse.shutdown()
    killed_at = float(open(f"{tmp}/{backend}2.json.killed").read())
    res = [json.load(open(f"{tmp}/{backend}{r}.json")) for r in range(3)]
    to_next, paths = [], {}
    for r in (0, 1):
        after = [(t, n, path) for t, n, path in res[r]["commits"] if t > killed_at]
        # The kill hit a step of all three; the next commit is the survivors' own.
        assert after[0][1] == 2, (r, after[:3])
        to_next.append(round(after[0][0] - killed_at, 3))
        back = next(c for c in after if c[1] == 3)
        paths[r] = (after[0][2], back[2])
    return to_next, [r["params"] for r in res], paths


@pytest.mark.parametrize("backend", ["oxcomm", "gloo"])
def test_torchft_a_killed_replica_rejoins_and_all_end_equal(backend, tmp_path):
    to_next, params, paths = _kill_and_rejoin(backend, str(tmp_path))
    print(f"{backend}: seconds from the kill to the survivors' next committed step: {to_next}; paths {paths}")
    assert params[0] == params[1] == params[2]
    assert all(t < 30 for t in to_next), to_next
    if backend == "oxcomm":
        # The survivors went on without replica 2 on their old links (shrink); with the
        # replacement back, a new communicator from the quorum's store (rebuild).
        assert paths == {0: ("shrink", "rebuild"), 1: ("shrink", "rebuild")}, paths


# ---------------------------------------------------------------------- torchft: configure's paths
# Each rank is one replica's ProcessGroupOxcomm, configured directly, as torchft's Manager
# would, with a fresh prefix of the job's store per quorum (no lighthouse: the tests choose
# the quorums).


def _tft_setup():
    """This rank, the job's store and the store address (``host:port``) configure takes."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=60))
    return rank, store, addr


def _tft_sum(pg, orig):
    """All-reduces ``orig + 1`` over ``pg``'s communicator; checks its rank and size first."""
    import numpy as np

    x = np.full(16, orig + 1, dtype=np.float32)
    pg.communicator.all_reduce(x)
    assert np.all(x == x[0]), x
    return float(x[0])


def _tft_old_op_fails(pg):
    """An all-reduce on ``pg``'s current communicator, that a peer left: the error's class."""
    import numpy as np

    import oxcomm

    try:
        pg.communicator.all_reduce(np.ones(16, dtype=np.float32))
    except oxcomm.OxcommError as e:
        return type(e).__name__
    raise AssertionError("an op on a communicator whose peer died completed")


def _tft_configure(pg, store, addr, quorum, rank, world):
    """``pg.configure`` for quorum ``quorum`` (its own store prefix) once the ``world``
    members have come to it (as torchft's quorum is formed only once each member has finished
    its step); the path it took. Checks that the communicator's rank and size are torchft's."""
    store.add(f"came_to_q{quorum}", 1)
    deadline = time.monotonic() + 60
    while store.add(f"came_to_q{quorum}", 0) < world:
        assert time.monotonic() < deadline, f"quorum {quorum}: the others did not come"
        time.sleep(0.01)
    pg.configure(f"{addr}/q{quorum}", f"replica{rank}", rank, world, quorum)
    comm = pg.communicator
    assert (comm.rank, comm.size) == (rank, world), (comm.rank, comm.size, rank, world)
    assert pg.errored() is None
    return pg.last_configure


class _FailingShrink:
    """Mixin: this member's shrink completes and then fails (an error after the survivors'
    agreement), so that its configure must fall back, and every other member's with it."""

    def _shrink(self, old):
        import oxcomm

        comm = old.shrink()
        comm.abort("test: this member's shrink fails")
        raise oxcomm.OxcommError("test: this member's shrink fails")


def case_torchft_configure_after_kills():
    """4 replicas. Rank 3 dies: the other three shrink. Then rank 2 dies and rank 1's shrink
    fails after the agreement: 0 and 1 both rebuild, in the same configure."""
    from oxcomm.torchft import ProcessGroupOxcomm

    rank, store, addr = _tft_setup()
    cls = ProcessGroupOxcomm
    if rank == 1:
        cls = type("FailingSecondShrink", (ProcessGroupOxcomm,), {"_shrink": _FailingShrink._shrink})
    pg = cls(timeout=timedelta(seconds=30))
    out = {"paths": [_tft_configure(pg, store, addr, 1, rank, 4)], "sums": [_tft_sum(pg, rank)]}
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    out["old_op"] = [_tft_old_op_fails(pg)]
    if rank == 1:
        # The first shrink (rank 3 gone) is a real one; only the second fails.
        pg._shrink = lambda old: old.shrink()
    out["paths"].append(_tft_configure(pg, store, addr, 2, rank, 3))
    out["sums"].append(_tft_sum(pg, rank))
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    out["old_op"].append(_tft_old_op_fails(pg))
    if rank == 1:
        del pg._shrink  # back to the class's: the failing one
    out["paths"].append(_tft_configure(pg, store, addr, 3, rank, 2))
    out["sums"].append(_tft_sum(pg, rank))
    return out


def test_torchft_group_shrinks_when_replicas_die_and_rebuilds_when_a_shrink_fails():
    res = _torch_ranks.run(4, "test_ft:case_torchft_configure_after_kills", timeout=180, may_die=(2, 3))
    assert res[2] is None and res[3] is None, res
    for r in (0, 1):
        assert res[r]["paths"] == ["rebuild", "shrink", "rebuild"], (r, res[r])
        # 1+2+3+4, then 1+2+3 on the shrunk communicator, then 1+2 on the rebuilt one.
        assert res[r]["sums"] == [10.0, 6.0, 3.0], (r, res[r])
        assert all(e in ("PeerGoneError", "RevokedError") for e in res[r]["old_op"]), (r, res[r])


def case_torchft_configure_frozen_replica():
    """3 replicas. Rank 2 freezes (SIGSTOP) before an all-reduce; 0 and 1 suspect it and
    shrink it out; rank 0 resumes it: its all-reduce on the old communicator fails, and the
    next quorum of all three rebuilds (rank 2's communicator is not the others')."""
    from oxcomm.torchft import ProcessGroupOxcomm

    rank, store, addr = _tft_setup()
    pg = ProcessGroupOxcomm(timeout=timedelta(seconds=30))
    out = {"paths": [_tft_configure(pg, store, addr, 1, rank, 3)], "sums": [_tft_sum(pg, rank)]}
    if rank == 2:
        store.set("frozen_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        out["resumed_op"] = _tft_old_op_fails(pg)
    else:
        out["old_op"] = _tft_old_op_fails(pg)
        out["paths"].append(_tft_configure(pg, store, addr, 2, rank, 2))
        out["sums"].append(_tft_sum(pg, rank))
        if rank == 0:
            os.kill(int(store.get("frozen_pid")), signal.SIGCONT)
    out["paths"].append(_tft_configure(pg, store, addr, 3, rank, 3))
    out["sums"].append(_tft_sum(pg, rank))
    return out


def test_torchft_group_shrinks_a_frozen_replica_out_and_it_never_completes_an_abandoned_op():
    res = _torch_ranks.run(
        3, "test_ft:case_torchft_configure_frozen_replica", timeout=180, env={"OXCOMM_SUSPECT_AFTER_MS": "500"}
    )
    for r in (0, 1):
        assert res[r]["paths"] == ["rebuild", "shrink", "rebuild"], (r, res[r])
        assert res[r]["sums"] == [6.0, 3.0, 6.0], (r, res[r])
        assert res[r]["old_op"] in ("SuspectedError", "RevokedError"), (r, res[r])
    assert res[2]["paths"] == ["rebuild", "rebuild"], res[2]
    assert res[2]["sums"] == [6.0, 6.0], res[2]
    assert res[2]["resumed_op"] == "RevokedError", res[2]


def _record(comm, rank, size, failed):
    return {"comm": comm, "rank": rank, "size": size, "failed": failed, "nonce": "0"}


@pytest.mark.parametrize(
    "records, path",
    [
        # rank 2 of 3 died, seen by one survivor: the two shrink.
        ([_record("a", 0, 3, [2]), _record("a", 1, 3, [])], "shrink"),
        # the first quorum, or a newcomer (a replacement, a replica whose configure failed)
        ([_record(None, None, None, []), _record(None, None, None, [])], "rebuild"),
        ([_record("a", 0, 3, [2]), _record("a", 1, 3, [2]), _record(None, None, None, [])], "rebuild"),
        # a frozen replica back: its old communicator is not the survivors'
        ([_record("b", 0, 2, []), _record("b", 1, 2, []), _record("a", 2, 3, [])], "rebuild"),
        # rank 2 left and nobody saw it fail: a shrink would wait for it
        ([_record("a", 0, 3, []), _record("a", 1, 3, [])], "rebuild"),
        # a member of the quorum failed on the old communicator: the shrink would leave it out
        ([_record("a", 0, 3, [1, 2]), _record("a", 1, 3, [])], "rebuild"),
        # the old ranks not in torchft's order: the shrunk ranks would not be torchft's
        ([_record("a", 1, 3, [2]), _record("a", 0, 3, [2])], "rebuild"),
        # nobody left (a quorum after a failed commit): a fresh communicator
        ([_record("a", 0, 2, []), _record("a", 1, 2, [])], "rebuild"),
    ],
)
def test_torchft_group_chooses_shrink_only_when_the_quorum_is_the_old_survivors(records, path):
    from oxcomm.torchft import _plan

    assert _plan(records)[0] == path
