"""Every call form torch's process group accepts, turned into one normal form with its checks.

This module owns what a c10d call's arguments mean, and the contract on them: gloo's. torch's
``ProcessGroup`` takes each call in several forms (a tensor list and an options object; a
tensor list or one tensor with ``op=``/``root=``/``timeout=``; keyword arguments), chosen by
pybind11 from the types of the arguments. A Python group is handed the arguments as typed, so
:func:`bind` picks the form the way pybind11 does (the first whose parameters take every
argument; else ``TypeError`` listing the forms, as torch's), and each call's ``normal_*``
function turns it into the one form the ops take (the list form and a filled options object)
and makes gloo's checks on it, on this rank, before anything is sent. A bad argument raises
the exception class gloo raises for it (``RuntimeError``; ``NotImplementedError`` for an empty
tensor list; ``TypeError`` for a form torch has not) through oxcomm's
:class:`~oxcomm.InvalidArgumentError` (a ``RuntimeError`` and a ``ValueError``) and its
subclasses, with a message naming the rank, the call and the argument.

Where oxcomm takes more than gloo (mixed dtypes in a coalesced all-reduce, ``PREMUL_SUM``,
``AVG``), the README's torch section lists it. This module does not lay tensors out for an op
(:mod:`.layout`), issue ops (:mod:`.issue`) or run them (:mod:`.ops`).
"""

from __future__ import annotations

import operator
from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm
from oxcomm import _native
from oxcomm._cuda import device as _dev

# torch's ReduceOp.RedOpType name -> oxcomm's ReduceOp name.
_OPS = {
    "SUM": "SUM",
    "AVG": "AVG",
    "PRODUCT": "PROD",
    "MIN": "MIN",
    "MAX": "MAX",
    "BAND": "BAND",
    "BOR": "BOR",
    "BXOR": "BXOR",
}

_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM
_STRIDED = torch.strided


def _fast_ops():
    """{hash of a torch ReduceOp: index of oxcomm's op in ``_native.REDUCE_OPS``} for the plain
    ops: torch hashes a ReduceOp by its kind (one int per RedOpType), so the blocking
    all_reduce reads the op with one getter and one hash instead of comparisons through
    pybind. Built from torch's own objects; empty (every op takes the general path) if this
    torch hashes two kinds alike or PREMUL_SUM like a plain one."""
    try:
        kinds = {name: hash(dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, name))) for name in _OPS}
        premul = hash(dist._make_nccl_premul_sum(1.0))
    except Exception:  # noqa: BLE001 - a torch without these: no fast ops
        return {}
    if len(set(kinds.values())) != len(kinds) or premul in kinds.values():
        return {}
    return {h: _native.REDUCE_OPS.index(_OPS[name].lower()) for name, h in kinds.items()}


_FAST_OPS = _fast_ops()


_op_cache = {}


def _reduce_op(op, call):
    """oxcomm's ReduceOp for a torch ReduceOp (or RedOpType), or NotImplementedError."""
    kind = getattr(op, "op", op)
    hit = _op_cache.get(kind)
    if hit is not None:
        return hit
    name = getattr(kind, "name", str(kind).rsplit(".", 1)[-1])
    if name not in _OPS:
        raise NotImplementedError(
            f"oxcomm: {call} with ReduceOp.{name} is not supported (oxcomm reduces with {', '.join(_OPS)})"
        )
    _op_cache[kind] = found = getattr(oxcomm.ReduceOp, _OPS[name])
    return found


def _premul_factor(op):
    """The factor of a ``PREMUL_SUM`` op (``dist._make_nccl_premul_sum(factor)``: a number or a
    one-element tensor), or None for any other op.

    NCCL's premul-sum is ``sum_i(factor_i * x_i)``: the calls that take it scale their input by
    the factor (in place where the input is overwritten by the result anyway, else a scaled
    copy) and sum."""
    if getattr(op, "op", op) != _PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        raise NotImplementedError("oxcomm: ReduceOp.PREMUL_SUM whose factor this torch does not expose")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"oxcomm: PREMUL_SUM takes a one-element factor tensor, got {factor.numel()} elements")
        return factor.reshape(())
    return factor


def _scaled(t, factor, in_place):
    """``t`` times a premul factor: ``t`` itself scaled when ``in_place``, else a new tensor."""
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t.device)
    return t.mul_(factor) if in_place else t * factor


def _timeout(opts):
    """The op's timeout in seconds, or None when torch left it unset (negative)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return None


def _on_device(call, *tensors):
    """Whether the call's tensors are device (CUDA) tensors; an invalid argument naming the
    call when some are and some are not."""
    owned = [_dev.owns(t) for t in tensors if t is not None]
    if not any(owned):
        return False
    if not all(owned):
        where = sorted({str(t.device) for t in tensors if t is not None})
        raise oxcomm.InvalidArgumentError(
            f"oxcomm: {call}: tensors on {', '.join(where)} in one call; pass all of them on one device"
        )
    return True


# ------------------------------------------------------------------------------ errors


class NoTensorsError(oxcomm.InvalidArgumentError, NotImplementedError):
    """A call given an empty tensor list (torch's dispatcher raises ``NotImplementedError``
    for it on gloo: there is no tensor to pick a kernel by)."""


def _bad(pg, call, what, cls=oxcomm.InvalidArgumentError):
    """The exception for a bad argument of ``call`` on this rank (raised by the caller)."""
    e = cls(f"rank {pg.rank()}: {call}: {what}")
    e.rank, e.op, e.kind = pg.rank(), call, "invalid_argument"
    return e


# ------------------------------------------------------------------------------ forms

_REQUIRED = object()


def _is_seq(v):
    return isinstance(v, (list, tuple))


def _is_int(v):
    if isinstance(v, (float, complex, str, torch.Tensor)):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


_KINDS = {
    "Tensor": lambda v: isinstance(v, torch.Tensor),
    "list[Tensor]": lambda v: _is_seq(v) and all(isinstance(t, torch.Tensor) for t in v),
    "list[list[Tensor]]": lambda v: _is_seq(v) and all(_is_seq(x) and all(isinstance(t, torch.Tensor) for t in x) for x in v),
    "int": _is_int,
    "list[int]": lambda v: _is_seq(v) and all(_is_int(x) for x in v),
    "ReduceOp": lambda v: isinstance(v, (dist.ReduceOp, dist.ReduceOp.RedOpType)),
    "timedelta | None": lambda v: v is None or isinstance(v, timedelta),
    "bool": lambda v: isinstance(v, bool),
}


def _p(name, kind, default=_REQUIRED):
    return (name, kind, default)


_c10d = torch._C._distributed_c10d
_SUM = dist.ReduceOp.SUM
_TIMEOUT = _p("timeout", "timedelta | None", None)

#: Every form of each call, in pybind11's order (torch's ProcessGroup bindings). A kind is a
#: key of ``_KINDS`` or an options class (its default a fresh instance).
FORMS = {
    "allreduce": (
        (_p("tensors", "list[Tensor]"), _p("opts", dist.AllreduceOptions)),
        (_p("tensors", "list[Tensor]"), _p("op", "ReduceOp", _SUM), _TIMEOUT),
        (_p("tensor", "Tensor"), _p("op", "ReduceOp", _SUM), _TIMEOUT),
    ),
    "allreduce_coalesced": ((_p("tensors", "list[Tensor]"), _p("opts", dist.AllreduceCoalescedOptions)),),
    "broadcast": (
        (_p("tensors", "list[Tensor]"), _p("opts", dist.BroadcastOptions)),
        (_p("tensor", "Tensor"), _p("root", "int"), _TIMEOUT),
    ),
    "reduce": (
        (_p("tensors", "list[Tensor]"), _p("opts", dist.ReduceOptions)),
        (_p("tensor", "Tensor"), _p("root", "int"), _p("op", "ReduceOp", _SUM), _TIMEOUT),
    ),
    "allgather": (
        (_p("output_tensors", "list[list[Tensor]]"), _p("input_tensors", "list[Tensor]"), _p("opts", _c10d.AllgatherOptions)),
        (_p("output_tensors", "list[Tensor]"), _p("input_tensor", "Tensor"), _TIMEOUT),
    ),
    "_allgather_base": ((_p("output", "Tensor"), _p("input", "Tensor"), _p("opts", _c10d.AllgatherOptions)),),
    "allgather_coalesced": (
        (_p("output_lists", "list[list[Tensor]]"), _p("input_list", "list[Tensor]"), _p("opts", _c10d.AllgatherOptions)),
    ),
    "allgather_into_tensor_coalesced": (
        (_p("outputs", "list[Tensor]"), _p("inputs", "list[Tensor]"), _p("opts", _c10d.AllgatherOptions)),
    ),
    "gather": (
        (_p("output_tensors", "list[list[Tensor]]"), _p("input_tensors", "list[Tensor]"), _p("opts", dist.GatherOptions)),
        (_p("output_tensors", "list[Tensor]"), _p("input_tensor", "Tensor"), _p("root", "int"), _TIMEOUT),
    ),
    "scatter": (
        (_p("output_tensors", "list[Tensor]"), _p("input_tensors", "list[list[Tensor]]"), _p("opts", dist.ScatterOptions)),
        (_p("output_tensor", "Tensor"), _p("input_tensors", "list[Tensor]"), _p("root", "int"), _TIMEOUT),
    ),
    "reduce_scatter": (
        (_p("output_tensors", "list[Tensor]"), _p("input_tensors", "list[list[Tensor]]"), _p("opts", dist.ReduceScatterOptions)),
        (_p("output", "Tensor"), _p("input", "list[Tensor]"), _p("op", "ReduceOp", _SUM), _TIMEOUT),
    ),
    "_reduce_scatter_base": (
        (_p("outputTensor", "Tensor"), _p("inputTensor", "Tensor"), _p("opts", dist.ReduceScatterOptions)),
    ),
    "reduce_scatter_tensor_coalesced": (
        (_p("outputs", "list[Tensor]"), _p("inputs", "list[Tensor]"), _p("opts", dist.ReduceScatterOptions)),
    ),
    "alltoall_base": (
        (
            _p("output", "Tensor"),
            _p("input", "Tensor"),
            _p("output_split_sizes", "list[int]"),
            _p("input_split_sizes", "list[int]"),
            _p("opts", dist.AllToAllOptions),
        ),
        (
            _p("output", "Tensor"),
            _p("input", "Tensor"),
            _p("output_split_sizes", "list[int]"),
            _p("input_split_sizes", "list[int]"),
            _TIMEOUT,
        ),
    ),
    "alltoall": ((_p("output_tensors", "list[Tensor]"), _p("input_tensors", "list[Tensor]"), _p("opts", dist.AllToAllOptions)),),
    "send": ((_p("tensors", "list[Tensor]"), _p("dstRank", "int"), _p("tag", "int", 0)),),
    "recv": ((_p("tensors", "list[Tensor]"), _p("srcRank", "int"), _p("tag", "int", 0)),),
    "recv_anysource": ((_p("arg0", "list[Tensor]"), _p("arg1", "int", 0)),),
    "barrier": ((_p("opts", dist.BarrierOptions),), (_TIMEOUT,)),
}


def _takes(kind, value):
    if isinstance(kind, type):
        return isinstance(value, kind)
    return _KINDS[kind](value)


_TENSOR = torch.Tensor
_NO_FAST = (None, None, None)


def _try(form, args, kwargs):
    if len(args) > len(form):
        return None
    names = [name for name, _, _ in form]
    if any(k not in names for k in kwargs):
        return None
    got = {}
    for (name, kind, default), value in zip(form, args):
        if name in kwargs or not _takes(kind, value):
            return None
        got[name] = value
    for name, kind, default in form[len(args) :]:
        if name in kwargs:
            if not _takes(kind, kwargs[name]):
                return None
            got[name] = kwargs[name]
        elif isinstance(kind, type):
            got[name] = kind()  # an options object: torch's default is a fresh one
        elif default is _REQUIRED:
            return None
        else:
            got[name] = default
    return got


def _kind_name(kind):
    return kind.__name__ if isinstance(kind, type) else kind


def bind(call, args, kwargs):
    """(index of the form, {parameter: value}) of the first form of ``call`` that takes
    ``args`` and ``kwargs``, as pybind11 picks; ``TypeError`` (torch's words) if none does."""
    forms = FORMS[call]
    if not kwargs and len(args) == 2:
        # The form torch.distributed's own functions call (a list of plain tensors and the
        # options object), checked first and inline: it is every small op's cost.
        (name0, kind0, _), (name1, kind1, _) = forms[0][:2] if len(forms[0]) == 2 else (_NO_FAST, _NO_FAST)
        ts, opts = args
        if (
            kind0 == "list[Tensor]"
            and opts.__class__ is kind1
            and ts.__class__ is list
            and all(t.__class__ is _TENSOR for t in ts)
        ):
            return 0, {name0: ts, name1: opts}
    for k, form in enumerate(forms):
        got = _try(form, args, kwargs)
        if got is not None:
            return k, got
    lines = [
        f"    {k + 1}. {call}(self, " + ", ".join(f"{n}: {_kind_name(t)}" for n, t, _ in form) + ")"
        for k, form in enumerate(forms)
    ]
    given = ", ".join([type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()])
    raise TypeError(
        f"{call}(): incompatible function arguments. The following argument types are supported:\n"
        + "\n".join(lines)
        + f"\n\nInvoked with: {given}"
    )


def _with(opts, timeout=None, **fields):
    for k, v in fields.items():
        setattr(opts, k, v)
    if timeout is not None:
        opts.timeout = timeout
    return opts


def _root(pg, call, root):
    root = operator.index(root)
    if not 0 <= root < pg.comm.world_size:
        raise _bad(pg, call, f"invalid root rank: {root} (the group has ranks 0 to {pg.size() - 1})")
    return root


# ------------------------------------------------------------------------------ checks


def _describe(t):
    return f"{t.dtype} {tuple(t.shape)}{'' if t.layout == torch.strided else ' ' + str(t.layout)}"


def _non_empty(pg, call, tensors, what="tensors"):
    if not tensors:
        raise _bad(pg, call, f"{what} is an empty list: no tensor to work on", NoTensorsError)


def _alike(pg, call, tensors, what, like=None, sizes=True):
    """Every tensor of ``tensors`` has ``like``'s dtype, layout, device (and size when
    ``sizes``); ``like`` defaults to the first (gloo's "invalid tensor type/size at index")."""
    if like is None:
        if len(tensors) == 1:
            return  # nothing to compare the first with (the common call: one tensor)
        like = tensors[0]
    for k, t in enumerate(tensors):
        if t.dtype != like.dtype or t.layout != like.layout or t.device != like.device:
            raise _bad(pg, call, f"invalid tensor type at {what}[{k}]: {_describe(t)}, expected {_describe(like)}")
        if sizes and t.shape != like.shape:
            raise _bad(pg, call, f"invalid tensor size at {what}[{k}]: {_describe(t)}, expected {_describe(like)}")


def _one(pg, call, tensors, what):
    if len(tensors) != 1:
        if not tensors:
            raise _bad(pg, call, f"{what} is an empty list: no tensor to work on", NoTensorsError)
        raise _bad(pg, call, f"{what} must hold a single tensor, got {len(tensors)}")
    return tensors[0]


def _dense(pg, call, tensors, what):
    for k, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise _bad(pg, call, f"{what}[{k}] is a {t.layout} tensor; this call takes dense (strided) tensors")


# ------------------------------------------------------------------------------ normal forms
#
# Each returns the call's arguments in the list form with a filled options object, checked.


def allreduce(pg, args, kwargs):
    form, a = bind("allreduce", args, kwargs)
    if form == 0:
        tensors, opts = list(a["tensors"]), a["opts"]
    else:
        tensors = [a["tensor"]] if form == 2 else list(a["tensors"])
        opts = _with(dist.AllreduceOptions(), a["timeout"], reduceOp=a["op"])
    check_allreduce(pg, "allreduce", tensors)
    return tensors, opts


def check_allreduce(pg, call, tensors):
    _non_empty(pg, call, tensors)
    _alike(pg, call, tensors, "tensors")


def allreduce_coalesced(pg, args, kwargs):
    _, a = bind("allreduce_coalesced", args, kwargs)
    tensors = list(a["tensors"])
    _non_empty(pg, "allreduce_coalesced", tensors)
    _dense(pg, "allreduce_coalesced", tensors, "tensors")
    like = tensors[0]
    for k, t in enumerate(tensors):
        if t.device != like.device:
            raise _bad(pg, "allreduce_coalesced", f"tensors[{k}] is on {t.device}, tensors[0] on {like.device}")
    return tensors, a["opts"]


def broadcast(pg, args, kwargs):
    form, a = bind("broadcast", args, kwargs)
    if form == 0:
        tensors, opts = list(a["tensors"]), a["opts"]
    else:
        tensors = [a["tensor"]]
        opts = _with(dist.BroadcastOptions(), a["timeout"], rootRank=operator.index(a["root"]))
    _non_empty(pg, "broadcast", tensors)
    _root(pg, "broadcast", opts.rootRank)
    if not 0 <= opts.rootTensor < len(tensors):
        raise _bad(pg, "broadcast", f"invalid root tensor: {opts.rootTensor} (of {len(tensors)} tensors)")
    _dense(pg, "broadcast", tensors, "tensors")
    _alike(pg, "broadcast", tensors, "tensors")
    return tensors, opts


def reduce(pg, args, kwargs):
    form, a = bind("reduce", args, kwargs)
    if form == 0:
        tensors, opts = list(a["tensors"]), a["opts"]
    else:
        tensors = [a["tensor"]]
        opts = _with(dist.ReduceOptions(), a["timeout"], rootRank=operator.index(a["root"]), reduceOp=a["op"])
    _one(pg, "reduce", tensors, "tensors")
    _root(pg, "reduce", opts.rootRank)
    _dense(pg, "reduce", tensors, "tensors")
    return tensors, opts


def allgather(pg, args, kwargs):
    """(output lists, inputs, opts): ``output_lists[j]`` holds size × len(inputs) tensors
    (rank-major: rank r's input i at ``r * len(inputs) + i``), as gloo's."""
    form, a = bind("allgather", args, kwargs)
    if form == 0:
        outputs, inputs, opts = [list(o) for o in a["output_tensors"]], list(a["input_tensors"]), a["opts"]
    else:
        outputs, inputs = [list(a["output_tensors"])], [a["input_tensor"]]
        opts = _with(_c10d.AllgatherOptions(), a["timeout"])
    call = "allgather"
    _non_empty(pg, call, inputs, "input_tensors")
    _dense(pg, call, inputs, "input_tensors")
    _alike(pg, call, inputs, "input_tensors")
    if len(outputs) != len(inputs):
        raise _bad(pg, call, f"{len(outputs)} output lists for {len(inputs)} input tensors (one list per input)")
    want = pg.size() * len(inputs)
    for j, outs in enumerate(outputs):
        if len(outs) != want:
            raise _bad(pg, call, f"invalid output tensor list at index {j}: {len(outs)} tensors, expected {want}")
        _alike(pg, call, outs, f"output_tensors[{j}]", like=inputs[0])
    return outputs, inputs, opts


def allgather_base(pg, args, kwargs, call="_allgather_base"):
    _, a = bind("_allgather_base", args, kwargs)
    output, inp = a["output"], a["input"]
    _one_per_rank(pg, call, output, "output", inp, "input")
    return output, inp, a["opts"]


def _one_per_rank(pg, call, whole, whole_name, part, part_name):
    """The checks of a flat ``_base`` call: ``whole`` holds one ``part`` per rank."""
    _dense(pg, call, [whole, part], f"({whole_name}, {part_name})")
    _alike(pg, call, [whole], whole_name, like=part, sizes=False)
    if whole.numel() != part.numel() * pg.size():
        raise _bad(
            pg,
            call,
            f"{whole_name} of {whole.numel()} elements for an {part_name} of {part.numel()} in a group of {pg.size()}",
        )


def allgather_coalesced(pg, args, kwargs):
    _, a = bind("allgather_coalesced", args, kwargs)
    return [list(o) for o in a["output_lists"]], list(a["input_list"]), a["opts"]


def allgather_into_tensor_coalesced(pg, args, kwargs):
    _, a = bind("allgather_into_tensor_coalesced", args, kwargs)
    return list(a["outputs"]), list(a["inputs"]), a["opts"]


def gather(pg, args, kwargs):
    """(outputs, input, opts): ``outputs`` the root's size tensors, [] on other ranks."""
    form, a = bind("gather", args, kwargs)
    call = "gather"
    if form == 0:
        outputs, inputs, opts = [list(o) for o in a["output_tensors"]], list(a["input_tensors"]), a["opts"]
    else:
        outputs, inputs = [list(a["output_tensors"])], [a["input_tensor"]]
        opts = _with(dist.GatherOptions(), a["timeout"], rootRank=operator.index(a["root"]))
        if pg.rank() != opts.rootRank and not outputs[0]:
            outputs = []
    root = _root(pg, call, opts.rootRank)
    inp = _one(pg, call, inputs, "input_tensors")
    _dense(pg, call, inputs, "input_tensors")
    return _at_root(pg, call, outputs, "output_tensors", inp, root), inp, opts


def scatter(pg, args, kwargs):
    """(output, inputs, opts): ``inputs`` the root's size tensors, [] on other ranks."""
    form, a = bind("scatter", args, kwargs)
    call = "scatter"
    if form == 0:
        outputs, inputs, opts = list(a["output_tensors"]), [list(i) for i in a["input_tensors"]], a["opts"]
    else:
        outputs, inputs = [a["output_tensor"]], [list(a["input_tensors"])]
        opts = _with(dist.ScatterOptions(), a["timeout"], rootRank=operator.index(a["root"]))
        if pg.rank() != opts.rootRank and not inputs[0]:
            inputs = []
    root = _root(pg, call, opts.rootRank)
    out = _one(pg, call, outputs, "output_tensors")
    _dense(pg, call, outputs, "output_tensors")
    return out, _at_root(pg, call, inputs, "input_tensors", out, root), opts


def _at_root(pg, call, lists, what, like, root):
    """The root's side of a gather or scatter: ``lists`` holds one list of size tensors like
    ``like`` on the root (returned), and nothing on the other ranks ([] returned)."""
    if pg.rank() != root:
        if lists:
            raise _bad(pg, call, f"rank {pg.rank()} is not the root ({root}): {what} must be empty here")
        return []
    ts = _one(pg, call, lists, what)
    if len(ts) != pg.size():
        raise _bad(pg, call, f"{what}[0] holds {len(ts)} tensors, expected {pg.size()} (the group size)")
    _alike(pg, call, ts, f"{what}[0]", like=like)
    return ts


def reduce_scatter(pg, args, kwargs):
    """(output, inputs, opts): ``inputs[r]`` is reduced into rank r's output; sizes may differ
    from rank to rank (as gloo's), the output's is this rank's input's."""
    form, a = bind("reduce_scatter", args, kwargs)
    call = "reduce_scatter"
    if form == 0:
        outputs, inputs, opts = list(a["output_tensors"]), [list(i) for i in a["input_tensors"]], a["opts"]
    else:
        outputs, inputs = [a["output"]], [list(a["input"])]
        opts = _with(dist.ReduceScatterOptions(), a["timeout"], reduceOp=a["op"])
    out = _one(pg, call, outputs, "output_tensors")
    ins = _one(pg, call, inputs, "input_tensors")
    if len(ins) != pg.size():
        raise _bad(pg, call, f"input_tensors[0] holds {len(ins)} tensors, expected {pg.size()} (the group size)")
    _dense(pg, call, [out, *ins], "tensors")
    _alike(pg, call, ins, "input_tensors[0]", like=out, sizes=False)
    if ins[pg.rank()].shape != out.shape:
        raise _bad(
            pg,
            call,
            f"invalid tensor size: output {_describe(out)}, but input_tensors[0][{pg.rank()}] (this rank's block) "
            f"is {_describe(ins[pg.rank()])}",
        )
    return out, ins, opts


def reduce_scatter_base(pg, args, kwargs, call="_reduce_scatter_base"):
    _, a = bind("_reduce_scatter_base", args, kwargs)
    output, inp = a["outputTensor"], a["inputTensor"]
    _one_per_rank(pg, call, inp, "input", output, "output")
    return output, inp, a["opts"]


def reduce_scatter_tensor_coalesced(pg, args, kwargs):
    _, a = bind("reduce_scatter_tensor_coalesced", args, kwargs)
    return list(a["outputs"]), list(a["inputs"]), a["opts"]


def alltoall_base(pg, args, kwargs):
    form, a = bind("alltoall_base", args, kwargs)
    opts = a["opts"] if form == 0 else _with(dist.AllToAllOptions(), a["timeout"])
    out_splits = [operator.index(s) for s in a["output_split_sizes"]]
    in_splits = [operator.index(s) for s in a["input_split_sizes"]]
    return a["output"], a["input"], out_splits, in_splits, opts


def alltoall(pg, args, kwargs):
    _, a = bind("alltoall", args, kwargs)
    return list(a["output_tensors"]), list(a["input_tensors"]), a["opts"]


def p2p(pg, call, args, kwargs):
    """(tensor, peer, tag) of ``send``/``recv`` (peer None: ``recv_anysource``)."""
    _, a = bind(call, args, kwargs)
    if call == "recv_anysource":
        tensors, peer, tag = a["arg0"], None, a["arg1"]
    else:
        tensors, tag = a["tensors"], a["tag"]
        peer = operator.index(a["dstRank" if call == "send" else "srcRank"])
        if not 0 <= peer < pg.size():
            raise _bad(pg, call, f"invalid {'destination' if call == 'send' else 'source'} rank: {peer}")
    t = _one(pg, call, list(tensors), "tensors")
    _dense(pg, call, [t], "tensors")
    return t, peer, operator.index(tag)


def barrier(pg, args, kwargs):
    form, a = bind("barrier", args, kwargs)
    return a["opts"] if form == 0 else _with(dist.BarrierOptions(), a["timeout"])
