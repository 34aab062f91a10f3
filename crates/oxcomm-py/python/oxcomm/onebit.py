"""DeepSpeed's 1-bit error-compensated all-reduce on oxcomm.

Each rank adds its worker error to the input, sends one sign bit per element plus one scale
per chunk, and keeps what the signs lost as its new worker error; the server side does the
same for its chunk. ``State`` holds both errors (DeepSpeed's layout: the worker error of the
padded length, the server error of one chunk). ``Adam`` is DeepSpeed's 1-bit Adam on one flat
float32 parameter buffer (the Rust optimizer); the torch optimizer over a model's parameters is
:class:`oxcomm.torch.OnebitAdam`.

    state = oxcomm.onebit.State(x.size, comm)
    oxcomm.onebit.all_reduce(comm, x, state)     # x: float32, in place: ≈ the mean

    opt = oxcomm.onebit.Adam(lr=1e-3, freeze_step=100)
    opt.step(comm, params, grads)                # float32 buffers of one length, params in place
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
            _buf(worker_error, "worker_error", write=False),
            _buf(server_error, "server_error", write=False),
            _world(comm),
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


class Adam:
    """DeepSpeed's 1-bit Adam on one flat float32 parameter buffer: every call averages the
    gradient exactly (in place in ``grads``) and updates ``params``, until call ``freeze_step``;
    then the variance freezes and the momentum goes through the 1-bit all-reduce (``grads`` is
    left as it is). The first call only averages and allocates. No bias correction, as in
    DeepSpeed. Collective: every rank calls ``step`` with buffers of the same length."""

    __slots__ = ("_a",)

    def __init__(self, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self._a = _native.OneBitAdam(
            float(lr), int(freeze_step), (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)
        )

    def step(self, comm, params, grads):
        """One optimizer call: ``params`` updated in place from this rank's ``grads``."""
        self._a.step(comm._c, _buf(params, "params"), _buf(grads, "grads"))

    steps = property(lambda self: self._a.step_count, doc="Optimizer calls so far.")
    frozen = property(lambda self: self._a.frozen, doc="Whether momenta are compressed now.")

    def exp_avg(self):
        """The momentum as a new float32 numpy array."""
        import numpy

        return numpy.frombuffer(self._a.exp_avg(), dtype=numpy.float32).copy()

    def exp_avg_sq(self):
        """The variance as a new float32 numpy array."""
        import numpy

        return numpy.frombuffer(self._a.exp_avg_sq(), dtype=numpy.float32).copy()
