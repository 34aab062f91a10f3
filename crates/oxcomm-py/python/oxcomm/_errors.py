"""oxcomm's exceptions: one base class and a subclass per kind of failure.

Every exception carries ``rank`` (this rank), ``peer`` (the rank it names, or ``None``),
``op`` (the op and its sequence number, e.g. ``"all_reduce #17 (f32 x 1048576, sum)"``) and
``kind``; ``str(e)`` is oxcomm's whole message.
"""

import builtins

__all__ = [
    "OxcommError",
    "TimeoutError",
    "PeerGoneError",
    "MismatchError",
    "InvalidArgumentError",
    "ProtocolError",
    "AbortedError",
    "UnsupportedError",
    "RendezvousError",
    "IoError",
    "RevokedError",
    "SuspectedError",
]


class OxcommError(RuntimeError):
    """Base class of every error oxcomm raises from an op."""

    rank = None
    peer = None
    op = None
    kind = "other"


class TimeoutError(OxcommError, builtins.TimeoutError):  # noqa: A001 - oxcomm.TimeoutError on purpose
    """A deadline passed while waiting for a peer that is still there (or silent)."""


class PeerGoneError(OxcommError, ConnectionError):
    """A peer is gone: its process died or its connection closed."""


class MismatchError(OxcommError):
    """Ranks called different collectives (op, dtype, count, root or sequence differ)."""


class InvalidArgumentError(OxcommError, ValueError):
    """An argument was rejected before anything was sent."""


class ProtocolError(OxcommError):
    """A peer sent bytes that do not follow the protocol."""


class AbortedError(OxcommError):
    """The communicator was aborted by an earlier error (the message carries it)."""


class UnsupportedError(OxcommError, NotImplementedError):
    """The feature is not built for this backend or configuration."""


class RendezvousError(OxcommError):
    """Finding the other ranks failed."""


class IoError(OxcommError, OSError):
    """An operating-system call failed."""


class RevokedError(OxcommError):
    """The communicator was revoked (``revoke()`` on some rank, or a failure inside an op):
    every op of it fails on every member, naming who revoked it (``peer``). ``agree()`` and
    ``shrink()`` still work; a rank the survivors left out gets this from them too."""


class SuspectedError(OxcommError):
    """A peer showed no sign of life inside oxcomm for the heartbeat lapse
    (``OXCOMM_SUSPECT_AFTER_MS``) while an op waited for it; ``peer`` names it. The
    communicator is revoked; ``shrink()`` leaves the peer out."""
