"""oxcomm as a torchft process group: :class:`ProcessGroupOxcomm`, a reconfigurable group
for torchft's ``Manager`` (torchft 0.2; ``pip install torchft``), the way torchft's own
``ProcessGroupGloo`` is::

    from torchft import Manager
    from oxcomm.torchft import ProcessGroupOxcomm

    manager = Manager(pg=ProcessGroupOxcomm(), min_replica_size=1, ...)

Each time the quorum changes, torchft calls :meth:`configure` with a fresh store prefix; the
group builds a new :class:`oxcomm.Communicator` there (``Communicator.from_store``: shared
memory between replicas on one host, TCP across hosts) and serves torch's calls through
oxcomm's torch backend (:class:`oxcomm.torch.ProcessGroupOxcomm`). The old communicator is
aborted first, so an op still in flight on it fails (``RevokedError`` / ``AbortedError``) and
never completes against a quorum the others have left.

A failed op revokes the communicator; :meth:`errored` then reports it, so the Manager does
not commit the step and reconfigures. What is not built: reconfiguring by
:meth:`oxcomm.Communicator.shrink` (on the links the replicas already have) instead of a new
communicator from the store: torchft's ``configure`` says only the new rank and size, not
which old ranks they were, and every member would have to take the same path.

This module imports torchft, which is not a dependency of oxcomm: import it only where
torchft is installed.
"""

from __future__ import annotations

from datetime import timedelta

from torchft.process_group import ProcessGroupWrapper

import oxcomm
from oxcomm.torch import ProcessGroupOxcomm as _TorchGroup

__all__ = ["ProcessGroupOxcomm"]


class ProcessGroupOxcomm(ProcessGroupWrapper):
    """A reconfigurable oxcomm process group for torchft's ``Manager``.

    ``timeout``: how long building the communicator (the store and the peers) and every op
    may wait; torchft's ``set_timeout`` changes it for later ops too.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store, rank, world_size):
        seconds = self._timeout.total_seconds()
        comm = oxcomm.Communicator.from_store(store, rank, world_size, timeout=seconds)
        return _TorchGroup(comm, rank, world_size)

    def getBackendName(self) -> str:
        return "torchft-oxcomm"

    @property
    def communicator(self):
        """The current :class:`oxcomm.Communicator` (``None`` before :meth:`configure` and
        after :meth:`abort`)."""
        pg = self._pg
        return None if pg is None else pg.comm

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        pg = self._pg
        if pg is not None:
            pg._set_default_timeout(timeout)

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
