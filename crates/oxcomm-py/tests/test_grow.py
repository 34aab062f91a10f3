"""Growing back from Python: ``Communicator.grow``, ``Communicator.join_from_store`` and
``oxcomm.join()`` (issue 39). A job that lost a rank shrinks, then grows back to its size while
a replacement process joins it through the store the ranks met at; under
``oxcomm launch --on-failure restart`` the launcher starts the replacement and it calls
``oxcomm.join()``.

Multi-process cases run on ``_torch_ranks.run`` (a parent-owned TCPStore on port 0, a
deadline, every child killed at the end) or under the installed ``oxcomm`` script
(``_cli_script``, its process group killed on the deadline); the argument checks and the
timeouts run in this process on a ``torch.distributed.HashStore``."""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist

import _cli_script
import _torch_ranks
import oxcomm

WORLD = 3


def _store():
    """This rank's client of the job's store (``_torch_ranks`` serves it), under a prefix."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=60)
    )
    return dist.PrefixStore("grow", store), store


def case_shrink_then_grow_with_a_replacement():
    """Ranks 0..2 meet with ``from_store``; rank 2 SIGKILLs itself; 0 and 1 shrink, then grow
    back to 3 while process 3, a replacement started as a newcomer, joins with
    ``join_from_store`` once rank 2 is gone. Every rank of the grown communicator checks an
    all-reduce, and the members get the step from rank 0 by a broadcast."""
    prefixed, store = _store()
    me = int(os.environ["RANK"])
    out = {}
    if me == WORLD:
        # The replacement: starts only once rank 2 is going away.
        store.wait(["killed"], timedelta(seconds=60))
        t = time.monotonic()
        comm = oxcomm.Communicator.join_from_store(prefixed, timeout=60.0)
        out["join_s"] = round(time.monotonic() - t, 3)
        out["timeout"] = comm.timeout
        step = np.zeros(1, dtype=np.int64)
        comm.broadcast(step, 0)
        out["step"] = int(step[0])
    else:
        comm = oxcomm.Communicator.from_store(prefixed, me, WORLD, timeout=60.0)
        comm.barrier()
        if me == 2:
            store.set("killed", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(oxcomm.OxcommError):
            # Fails once rank 2's death is seen (it never calls this).
            comm.all_reduce(np.ones(1024, dtype=np.float32))
        small = comm.shrink()
        assert (small.rank, small.size) == (me, 2), small
        assert comm.failed_ranks() == [2]
        comm = small.grow(WORLD)
        out["members"] = comm.members
        step = np.array([41 if me == 0 else -1], dtype=np.int64)
        comm.broadcast(step, 0)
        out["step"] = int(step[0])
        # The shrunk communicator stays usable beside the grown one.
        x = np.ones(4, dtype=np.float32)
        small.all_reduce(x)
        out["small_sum"] = x.tolist()
    out["rank"], out["size"] = comm.rank, comm.size
    out["failed"] = comm.failed_ranks()
    x = np.full(1024, comm.rank + 1, dtype=np.float32)
    comm.all_reduce(x)
    out["sum"] = sorted(set(x.tolist()))
    comm.barrier()
    return out


def test_survivors_grow_back_with_a_replacement_that_joins_from_the_store():
    res = _torch_ranks.run(WORLD + 1, "test_grow:case_shrink_then_grow_with_a_replacement", timeout=180, may_die=(2,))
    assert res[2] is None
    ranks = {0: res[0], 1: res[1], 2: res[3]}
    for rank, r in ranks.items():
        assert (r["rank"], r["size"]) == (rank, WORLD), res
        assert r["sum"] == [6.0], res  # 1 + 2 + 3 over the grown communicator
        assert r["step"] == 41, res
        assert r["failed"] == [], res
    for r in (res[0], res[1]):
        assert r["small_sum"] == [2.0] * 4, res
        assert r["members"] == [0, 1, 2], res
    assert res[3]["timeout"] == 60.0, res


def _world_of_one(timeout=30.0):
    """A communicator of one rank met through a fresh in-process store, and the store."""
    store = dist.HashStore()
    return oxcomm.Communicator.from_store(store, 0, 1, timeout=timeout), store


def _grow_keys(store):
    """The grow protocol's keys of the store's job that exist (none before a grow)."""
    job = store.get("oxcomm/py/job").decode()
    keys = [f"oxcomm/{job}/grow/{k}" for k in ("latest", "1", "1/closed")]
    return [k for k in keys if store.check([k])]


def test_grow_times_out_naming_the_newcomer_that_never_came():
    comm, store = _world_of_one()
    comm.timeout = 2.0
    t = time.monotonic()
    with pytest.raises(oxcomm.TimeoutError) as e:
        comm.grow(3)
    waited = time.monotonic() - t
    assert e.value.kind == "timeout" and e.value.peer == 1, e.value
    assert "newcomer rank 1" in str(e.value) and "[1, 2]" in str(e.value), e.value
    assert 1.5 < waited < 20.0, waited
    # The generation is closed (a late newcomer does not claim a rank in it), and the
    # communicator that tried to grow still works.
    assert [k.rsplit("/grow/", 1)[1] for k in _grow_keys(store)] == ["latest", "1", "1/closed"]
    x = np.full(4, 5.0, dtype=np.float32)
    comm.all_reduce(x)
    assert x.tolist() == [5.0] * 4

    # A newcomer that comes after joins the next grow (generation 2), not the closed one.
    joined = {}

    def newcomer():
        try:
            c = oxcomm.Communicator.join_from_store(store, timeout=60.0)
            y = np.full(4, 10.0, dtype=np.float32)
            c.all_reduce(y)
            joined["out"] = (c.rank, c.size, y.tolist())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            joined["error"] = exc

    th = threading.Thread(target=newcomer, daemon=True)
    th.start()
    comm.timeout = 60.0
    grown = comm.grow(2)
    y = np.full(4, 1.0, dtype=np.float32)
    grown.all_reduce(y)
    th.join(60)
    assert not th.is_alive() and "error" not in joined, joined
    assert (grown.rank, grown.size, y.tolist()) == (0, 2, [11.0] * 4)
    assert joined["out"] == (1, 2, [11.0] * 4), joined
    assert store.get(f"oxcomm/{store.get('oxcomm/py/job').decode()}/grow/latest") == b"2"


def test_a_newcomer_with_no_grow_to_join_times_out_having_claimed_nothing():
    comm, store = _world_of_one()
    t = time.monotonic()
    with pytest.raises(oxcomm.TimeoutError) as e:
        oxcomm.Communicator.join_from_store(store, timeout=1.5)
    assert time.monotonic() - t < 20.0
    assert "no grow with a free rank opened" in str(e.value), e.value
    job = store.get("oxcomm/py/job").decode()
    assert not store.check([f"oxcomm/{job}/grow/1/claimed"])
    # At a store where no job met at all: says so.
    with pytest.raises(oxcomm.TimeoutError) as e:
        oxcomm.Communicator.join_from_store(dist.HashStore(), timeout=0.5)
    assert "no job met at this store" in str(e.value), e.value
    del comm


def test_bad_grows_are_refused_before_anything_is_sent():
    comm, store = _world_of_one()
    t = time.monotonic()
    with pytest.raises(oxcomm.InvalidArgumentError) as e:
        comm.grow(0)
    assert "fewer than the communicator's 1" in str(e.value), e.value
    with pytest.raises(ValueError):
        comm.grow(-1)
    # A group is not a world: it cannot grow.
    with pytest.raises(oxcomm.UnsupportedError):
        comm.group([0]).grow(2)
    assert time.monotonic() - t < 5.0
    assert _grow_keys(store) == []  # nothing was written for the newcomers
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            oxcomm.Communicator.join_from_store(store, timeout=bad)
    with pytest.raises(ValueError):
        oxcomm.Communicator.join_from_store(store, transport="carrier-pigeon")
    # A grow to the same size needs nobody and gives a working communicator.
    same = comm.grow(1)
    x = np.full(2, 3, dtype=np.int64)
    same.all_reduce(x)
    assert (same.size, x.tolist()) == (1, [3, 3])


def test_join_on_the_mpi_backend_is_unsupported(monkeypatch):
    monkeypatch.setenv("OXCOMM_BACKEND", "mpi")
    with pytest.raises(oxcomm.UnsupportedError):
        oxcomm.join()


# The example `examples/grow_back.py` under `oxcomm launch --on-failure restart`: rank 2 exits
# with status 17 at step 30 of 100; the others shrink and grow back to 3; the replacement the
# launcher starts calls oxcomm.join() and gets the step to go on from. Every completed step's
# sum is checked against the communicator's size.
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "grow_back.py")


def _launch(*flags, timeout_s):
    env = dict(os.environ, OXCOMM_TIMEOUT=str(timeout_s), FT_DIE_RANK="2", FT_DIE_AT="30", FT_STEPS="100")
    args = ["launch", "-n", str(WORLD), "--on-failure", "restart", *flags, "--", sys.executable, EXAMPLE]
    return _cli_script.run(args, timeout=180, env=env)


def test_join_under_launch_on_failure_restart_brings_the_job_back_to_full_size():
    res = _launch(timeout_s=30)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "rank 2 exited with status 17; starting a replacement" in res.stderr, res.stderr
    assert "joined as rank 2 of 3 at step" in res.stderr, res.stderr
    # The launcher prefixes each line with "[rank] ".
    done = sorted(ln.split("DONE ", 1)[1] for ln in res.stdout.splitlines() if "DONE " in ln)
    assert done == [f"rank={r} size=3 steps=100" for r in range(WORLD)], f"{res.stdout}\n{res.stderr}"


def test_without_a_replacement_the_survivors_grow_times_out_naming_the_rank():
    res = _launch("--max-restarts", "0", timeout_s=3)
    assert res.returncode != 0, f"{res.stdout}\n{res.stderr}"
    assert "no restarts left" in res.stderr, res.stderr
    assert "waiting for newcomer rank 2" in res.stderr, res.stderr
