"""DeepSpeed's 1-bit error-compensated all-reduce on oxcomm.

Each rank adds its worker error to the input, sends one sign bit per element plus one scale
per chunk, and keeps what the signs lost as its new worker error; the server side does the
same for its chunk. ``State`` holds both errors (DeepSpeed's layout: the worker error of the
padded length, the server error of one chunk). The torch optimizer is
:class:`oxcomm.torch.OnebitAdam`.

    state = oxcomm.onebit.State(x.size, comm)
    oxcomm.onebit.all_reduce(comm, x, state)     # x: float32, in place: ≈ the mean
"""

from . import _native
from ._buffers import buffer as _buf


def _world(comm_or_size):
    return comm_or_size if isinstance(comm_or_size, int) else comm_or_size.size


class State:
    """The error feedback of a 1-bit all-reduce over buffers of up to ``numel`` float32s."""

    __slots__ = ("_s",)

    def __init__(self, numel, comm, *, _native_state=None):
        self._s = _native_state if _native_state is not None else _native.OneBitState(int(numel), _world(comm))

    @staticmethod
    def from_errors(worker_error, server_error, comm):
        """A state holding copies of DeepSpeed-style error buffers (float32)."""
        s = _native.OneBitState.from_errors(
            _buf(worker_error, "worker_error", write=False), _buf(server_error, "server_error", write=False), _world(comm)
        )
        return State(0, comm, _native_state=s)

    padded_len = property(lambda self: self._s.padded_len, doc="The padded buffer length (a multiple of 8 × size).")
    chunk_len = property(lambda self: self._s.chunk_len, doc="One rank's chunk (the server error's length).")

    def errors_into(self, worker_out, server_out):
        """Copies the errors into float32 buffers of ``padded_len`` and ``chunk_len``."""
        self._s.errors_into(_buf(worker_out, "worker_out"), _buf(server_out, "server_out"))

    def worker_error(self):
        """The worker error as a new float32 numpy array."""
        import numpy

        return numpy.frombuffer(self._s.worker_error(), dtype=numpy.float32).copy()

    def server_error(self):
        """The server error as a new float32 numpy array."""
        import numpy

        return numpy.frombuffer(self._s.server_error(), dtype=numpy.float32).copy()

    def reset(self):
        self._s.reset()


def all_reduce(comm, buf, state):
    """The 1-bit all-reduce of ``buf`` (float32, at most ``state.padded_len`` elements) in place."""
    _native.onebit_all_reduce(comm._c, _buf(buf, "buf"), state._s)
