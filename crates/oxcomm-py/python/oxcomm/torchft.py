"""oxcomm as a torchft process group: :class:`ProcessGroupOxcomm`, a reconfigurable group
for torchft's ``Manager`` (torchft 0.2; ``pip install torchft``), the way torchft's own
``ProcessGroupGloo`` is::

    from torchft import Manager
    from oxcomm.torchft import ProcessGroupOxcomm

    manager = Manager(pg=ProcessGroupOxcomm(), min_replica_size=1, ...)

Each time the quorum changes, torchft calls :meth:`ProcessGroupOxcomm.configure` with a fresh
store prefix, the replica's new rank and the new world size. The old communicator is aborted
first, so an op still in flight on it fails (``RevokedError`` / ``AbortedError``) on every
member and never completes against a quorum the others have left. Then the group takes one
of two paths, the same on every member of the new quorum:

* **shrink**: when the new quorum is the old communicator's members less some that failed
  (a replica died or was suspected, nobody new came), the members call
  :meth:`oxcomm.Communicator.shrink` on the old communicator: a communicator of the survivors
  on the links they already have (no new connection, no shared-memory setup). Its ops run
  over those links (the shrunk communicator has no direct shared-memory path), until the next
  rebuild.
* **rebuild**: otherwise (the first quorum, a newcomer such as a replacement or a frozen
  replica back, a replica that left without any member seeing it fail), a new communicator
  from the quorum's store (``Communicator.from_store``: shared memory between replicas on one
  host, TCP across hosts).

How the members agree on the path: each one publishes in the quorum's store the identity of
its old communicator (an id that every member of one communicator holds alike, made at its
creation from the store address and every member's random nonce), its old rank and size and
the members it knows failed (``failed_ranks()``), then reads every member's. They shrink iff
all hold the same old communicator, their old ranks run in the order of their new ranks
(torchft orders replicas by replica id, and shrink keeps the old order: the shrunk ranks are
then torchft's), some old member is missing and the missing ones are exactly those someone
saw fail (so the shrink waits for no live member). After the shrink each member publishes
whether it got the rank and size torchft gave it; if any did not (a member was left out by
the survivors' agreement, an error), every member drops the shrunk communicator and
rebuilds from the store, in the same configure. A member that dies meanwhile makes the
others' store reads time out: configure raises, torchft skips the step and forms the next
quorum, and that one rebuilds (a member whose configure failed has no old communicator).

A replica that was only frozen (SIGSTOP, a long pause) while the others shrank it out finds
its op on the old communicator failing with ``RevokedError`` when it resumes (never
completing from bytes the others left), and its next quorum, with the others back, rebuilds:
its old communicator is not theirs. :attr:`ProcessGroupOxcomm.last_configure` says which path
the last configure took.

A failed op revokes the communicator; :meth:`ProcessGroupOxcomm.errored` then reports it, so
the Manager does not commit the step and reconfigures.

This module imports torchft, which is not a dependency of oxcomm: import it only where
torchft is installed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import timedelta
from typing import Optional

from torchft.process_group import ProcessGroupWrapper, create_store_client

import oxcomm
from oxcomm.torch import ProcessGroupOxcomm as _TorchGroup

__all__ = ["ProcessGroupOxcomm"]

_log = logging.getLogger(__name__)

# The keys this module writes in the quorum's store prefix (``from_store`` uses others).
_MEMBER_KEY = "oxcomm_torchft/member/"
_SHRUNK_KEY = "oxcomm_torchft/shrunk/"


def _plan(records: list[dict]) -> tuple[str, str]:
    """``("shrink" | "rebuild", why)`` from every new member's record, in new rank order:
    ``{"comm": old communicator id or None, "rank": old rank, "size": old size, "failed":
    old ranks it knows failed}``. Every member reads the same records, so every member
    returns the same."""
    ids = {r["comm"] for r in records}
    if None in ids:
        return "rebuild", "a member has no communicator (new, or its last configure failed)"
    if len(ids) != 1:
        return "rebuild", "the members come from different communicators"
    size = records[0]["size"]
    ranks = [r["rank"] for r in records]
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        return "rebuild", f"the old ranks {ranks} are not in the new order"
    missing = set(range(size)) - set(ranks)
    if not missing:
        return "rebuild", "nobody left the communicator"
    failed = set().union(*(r["failed"] for r in records))
    if failed & set(ranks):
        return "rebuild", f"old ranks {sorted(failed & set(ranks))} are in the quorum but failed on the old communicator"
    if missing != failed:
        return "rebuild", f"old ranks {sorted(missing - failed)} left but no member saw them fail"
    return "shrink", f"old ranks {sorted(missing)} failed"


class ProcessGroupOxcomm(ProcessGroupWrapper):
    """A reconfigurable oxcomm process group for torchft's ``Manager``.

    ``timeout``: how long configuring (the store and the peers) and every op may wait;
    torchft's ``set_timeout`` changes it for later ops too.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._comm_id: Optional[str] = None
        self._last_configure: Optional[str] = None

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[list[int]] = None,
    ) -> None:
        """torchft's call on each quorum change: shrinks the old communicator or builds a new
        one (the module docs say which, and how every member takes the same path). Raises when
        a member of the quorum does not answer within the timeout; the group then has no
        communicator, and the next configure rebuilds."""
        self._replica_id = replica_id
        self._quorum_id = quorum_id
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._rank = rank
        self._global_ranks = global_ranks
        old_pg, old_id = self._pg, self._comm_id
        old = None if old_pg is None else old_pg.comm
        self._pg, self._comm_id, self._last_configure = None, None, None
        if old is not None:
            old.abort("torchft reconfigures the group")
        store = create_store_client(store_addr, timeout=self._timeout)
        mine = {
            "comm": old_id if old is not None else None,
            "rank": None if old is None else old.rank,
            "size": None if old is None else old.size,
            "failed": [] if old is None else old.failed_ranks(),
            "nonce": os.urandom(8).hex(),
        }
        store.set(_MEMBER_KEY + str(rank), json.dumps(mine))
        records = [json.loads(store.get(_MEMBER_KEY + str(r))) for r in range(world_size)]
        comm_id = hashlib.sha256(json.dumps([store_addr] + [r["nonce"] for r in records]).encode()).hexdigest()
        path, why = _plan(records)
        comm = None
        if path == "shrink":
            comm = self._shrink_to(old, rank, world_size)
            store.set(_SHRUNK_KEY + str(rank), b"1" if comm is not None else b"0")
            if not all(store.get(_SHRUNK_KEY + str(r)) == b"1" for r in range(world_size)):
                if comm is not None:
                    comm.abort("torchft: a member's shrink failed; rebuilding")
                comm, path, why = None, "rebuild", "a member's shrink failed"
        _log.info("oxcomm torchft: quorum %s, rank %d of %d: %s (%s)", quorum_id, rank, world_size, path, why)
        del old, old_pg  # the links the shrunk communicator does not use close with the old one
        if comm is None:
            comm = oxcomm.Communicator.from_store(store, rank, world_size, timeout=self._timeout.total_seconds())
        self._pg = _TorchGroup(comm, rank, world_size)
        self._comm_id, self._last_configure = comm_id, path

    def _shrink_to(self, old, rank: int, world_size: int):
        """The old communicator shrunk to the survivors when that gives torchft's ``rank`` and
        ``world_size``; ``None`` otherwise (the survivors' agreement left out a member of the
        quorum, or the shrink failed here)."""
        try:
            comm = self._shrink(old)
        except oxcomm.OxcommError as e:
            _log.warning("oxcomm torchft: the shrink failed: %s", e)
            return None
        if (comm.rank, comm.size) != (rank, world_size):
            _log.warning(
                "oxcomm torchft: the shrink gave rank %d of %d, torchft's quorum %d of %d",
                comm.rank, comm.size, rank, world_size,
            )
            comm.abort("torchft: the shrunk communicator is not torchft's quorum")
            return None
        return comm

    def _shrink(self, old):
        """``old.shrink()`` (a method so that a test can make one member's shrink fail)."""
        return old.shrink()

    def getBackendName(self) -> str:
        return "torchft-oxcomm"

    @property
    def communicator(self):
        """The current :class:`oxcomm.Communicator` (``None`` before :meth:`configure` and
        after :meth:`abort`)."""
        pg = self._pg
        return None if pg is None else pg.comm

    @property
    def last_configure(self) -> Optional[str]:
        """The path the last :meth:`configure` took: ``"shrink"`` (the old communicator shrunk
        to the survivors) or ``"rebuild"`` (a new communicator from the quorum's store);
        ``None`` before the first and after one that raised."""
        return self._last_configure

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        pg = self._pg
        if pg is not None:
            pg._set_default_timeout(timeout)

    def abort(self, errored: bool = True) -> None:
        super().abort(errored)
        self._comm_id = None

    def errored(self):
        """The error that revoked the communicator (an op failed on some rank: a peer died,
        was suspected, or revoked it), or ``None``: torchft does not commit a step while it is
        set, and reconfigures."""
        comm = self.communicator
        if comm is None or not comm.is_revoked():
            return None
        failed = comm.failed_ranks()
        err = oxcomm.RevokedError(
            f"oxcomm: the communicator of replica {self._replica_id} was revoked"
            + (f" (failed ranks {failed})" if failed else "")
        )
        err.kind = "revoked"
        return err
