"""The device the CUDA tests run on, as the tests see it: CUDA where torch has it, else the fake
GPU of ``_fake_device.py``.

``target()`` (once per rank process) returns a :class:`Target`; the files of ``tests_cuda`` are
written against it only, so that the same files run on a GPU (``bench/gpu_check.sh``) and on a
CPU machine (CI), where every staged copy and in-place kernel runs late on its stream's thread.
What a test needs from a device:

- ``tensor(values)``: a device tensor that holds ``values`` once the work queued on the current
  stream so far is done: it is written by a kernel queued after a delay (so an op that does not
  wait for the caller's stream reads the marker fill, 77, instead);
- ``host(x)``: a host copy of ``x`` after the current stream's work (``x.cpu()``);
- ``stream()``, ``on(stream)``, ``synchronize()``, ``delay(seconds)`` (a kernel that takes that
  long);
- ``callback_context()``: whether a future's then-callback runs where it should (the rank's
  device current; on CUDA off the default stream), and what it saw;
- ``reference()``: a block that runs as on a machine without the device (tensors made in it with
  ``device="cpu"`` are host tensors: the reference the device run is compared with);
- ``check()``: what the fake saw go wrong outside a result (a CUDA context made on another
  device, an item that failed on a stream); nothing on CUDA.

On the fake, the rank's seed is ``OXCOMM_FAKE_SEED`` + rank (the test prints it on failure, and
``OXCOMM_FAKE_SEED=<seed>`` replays it); the device is ``fake:1`` (a rank on a GPU other than 0,
so that a thread that forgets to make it current shows).
"""

from __future__ import annotations

import contextlib
import os

import torch

from oxcomm._cuda import device as _device

#: The seed the fake device starts from (a test sets it per run; the rank is added).
SEED_ENV = "OXCOMM_FAKE_SEED"
#: The fake device's longest delay before a stream's item, in microseconds (default 300).
DELAY_ENV = "OXCOMM_FAKE_MAX_DELAY_US"

_TARGET = []


def cuda():
    """Whether the tests run on CUDA (else on the fake device)."""
    return torch.cuda.is_available()


def target():
    """This process's :class:`Target` (made on first use; the device becomes current)."""
    if not _TARGET:
        _TARGET.append(CudaTarget() if cuda() else FakeTarget())
    return _TARGET[0]


class Target:
    #: "cuda" or "fake"
    kind = ""
    #: The torch device of the device's tensors (``cpu`` on the fake: its tensors are CPU tensors).
    device = None
    seed = None

    def describe(self):
        return self.kind


class CudaTarget(Target):
    kind = "cuda"

    def __init__(self):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(self.device)

    def describe(self):
        return f"cuda ({torch.cuda.get_device_name(self.device)})"

    def tensor(self, values):
        src = values.to(self.device)
        x = torch.full_like(src, 77)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the write
        x.copy_(src)
        return x

    def host(self, x):
        return x.cpu()

    def stream(self):
        return torch.cuda.Stream(self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def synchronize(self):
        torch.cuda.synchronize(self.device)

    def delay(self, seconds=1e-3):
        torch.cuda._sleep(int(seconds * 2e9))  # cycles: ~2 GHz

    def callback_context(self):
        stream, here = torch.cuda.current_stream(), torch.cuda.current_device()
        ok = stream != torch.cuda.default_stream(self.device) and here == self.device.index
        return ok, f"device {here}, stream {stream}"

    def reference(self):
        return contextlib.nullcontext()

    def check(self):
        pass


class FakeTarget(Target):
    kind = "fake"

    def __init__(self):
        from _fake_device import FakeDevice

        rank = int(os.environ.get("RANK", "0"))
        self.seed = int(os.environ.get(SEED_ENV, "1")) * 1000 + rank
        delay = float(os.environ.get(DELAY_ENV, "300")) * 1e-6
        self.fake = FakeDevice(self.seed, max_delay=delay)
        self.device = torch.device("cpu")
        _device.use_device(self.fake)
        self.fake.use(self.fake.key_)

    def describe(self):
        return f"fake device (seed {self.seed}; replay with {SEED_ENV}={self.seed // 1000})"

    def tensor(self, values):
        values = values.clone()
        x = torch.full_like(values, 77)
        stream = self.fake.current_stream(None)
        self.fake.sleep(stream, 2e-4)
        self.fake.launch(stream, lambda: x.copy_(values))
        return x

    def host(self, x):
        return self.fake.host(x.clone())

    def stream(self):
        return self.fake.new_stream(self.fake.key_)

    def on(self, stream):
        return self.fake.use_stream(stream)

    def current_stream(self):
        return self.fake.current_stream(None)

    def synchronize(self):
        self.fake.synchronize()

    def delay(self, seconds=1e-3):
        self.fake.sleep(self.fake.current_stream(None), seconds)

    def callback_context(self):
        here = getattr(self.fake._local, "index", 0)
        return here == self.fake.index, f"device fake:{here}"

    def reference(self):
        return self.fake.suspend()

    def check(self):
        self.fake.synchronize()
        assert not self.fake.errors, f"{self.describe()}: {self.fake.errors[:3]}"
        others = {i: who for i, who in self.fake.contexts.items() if i != self.fake.index}
        assert not others, (
            f"{self.describe()}: threads made a CUDA context on device(s) other than the rank's "
            f"(fake:{self.fake.index}): {others}"
        )
