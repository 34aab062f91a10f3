"""Which tensors each Communicator op reads and writes, for staging.

This module owns one table, written as one function per op: for ``Communicator.<op>`` on device
tensors (or on any tensors once the communicator has a staging queue), the tensors it stages,
whether each is read (copied out), written (copied back) or both on this rank, whether the op is
elementwise (cut into chunks), and the host call that runs it on the staged buffers. It does not
copy or wait (``staging.py`` does).

The host call is the same Communicator method on the host twin (``st.host``), so a device op
checks its arguments and names its errors as the host op does. In-place layouts (an all-gather
input that is this rank's block of the output, ``send is recv`` in an all-to-all) need no
special form here: the whole input is copied out before anything is copied back.
"""

from __future__ import annotations

from .staging import RW, R, W


def all_reduce(st, buf, op, async_op):
    return st.run(
        "all_reduce", async_op, [RW(buf)], lambda b, a: st.host.all_reduce(b[0], op, async_op=a), chunked=True
    )


def all_reduce_into(st, input, output, op, async_op):  # noqa: A002
    return st.run(
        "all_reduce_into",
        async_op,
        [R(input), W(output)],
        lambda b, a: st.host.all_reduce_into(b[0], b[1], op, async_op=a),
        chunked=True,
    )


def reduce(st, buf, root, op, async_op):
    mine = RW(buf) if st.host.rank == root else R(buf)
    return st.run("reduce", async_op, [mine], lambda b, a: st.host.reduce(b[0], root, op, async_op=a), chunked=True)


def reduce_into(st, input, output, root, op, async_op):  # noqa: A002
    out = W(output) if output is not None and st.host.rank == root else None
    return st.run(
        "reduce_into",
        async_op,
        [R(input), out],
        lambda b, a: st.host.reduce_into(b[0], b[1], root, op, async_op=a),
        chunked=True,
    )


def broadcast(st, buf, root, async_op):
    mine = R(buf) if st.host.rank == root else W(buf)
    return st.run("broadcast", async_op, [mine], lambda b, a: st.host.broadcast(b[0], root, async_op=a), chunked=True)


def all_gather(st, input, output, async_op):  # noqa: A002
    return st.run(
        "all_gather", async_op, [R(input), W(output)], lambda b, a: st.host.all_gather(b[0], b[1], async_op=a)
    )


def all_gather_in_place(st, buf, async_op):
    return st.run(
        "all_gather_in_place", async_op, [RW(buf)], lambda b, a: st.host.all_gather_in_place(b[0], async_op=a)
    )


def reduce_scatter(st, input, output, op, async_op):  # noqa: A002
    return st.run(
        "reduce_scatter",
        async_op,
        [R(input), W(output)],
        lambda b, a: st.host.reduce_scatter(b[0], b[1], op, async_op=a),
    )


def reduce_scatter_in_place(st, buf, op, async_op):
    return st.run(
        "reduce_scatter_in_place",
        async_op,
        [RW(buf)],
        lambda b, a: st.host.reduce_scatter_in_place(b[0], op, async_op=a),
    )


def all_to_all(st, send, recv, async_op):
    if send is recv:
        return all_to_all_in_place(st, recv, async_op)
    return st.run("all_to_all", async_op, [R(send), W(recv)], lambda b, a: st.host.all_to_all(b[0], b[1], async_op=a))


def all_to_all_in_place(st, buf, async_op):
    return st.run(
        "all_to_all_in_place", async_op, [RW(buf)], lambda b, a: st.host.all_to_all_in_place(b[0], async_op=a)
    )


def all_to_all_v(st, send, send_counts, recv, recv_counts, async_op):
    return st.run(
        "all_to_all_v",
        async_op,
        [R(send), W(recv)],
        lambda b, a: st.host.all_to_all_v(b[0], send_counts, b[1], recv_counts, async_op=a),
    )


def gather(st, input, output, root, async_op):  # noqa: A002
    out = W(output) if output is not None and st.host.rank == root else None
    return st.run(
        "gather", async_op, [R(input), out], lambda b, a: st.host.gather(b[0], b[1], root, async_op=a)
    )


def gather_in_place(st, buf, root, async_op):
    mine = RW(buf) if st.host.rank == root else R(buf)
    return st.run("gather_in_place", async_op, [mine], lambda b, a: st.host.gather_in_place(b[0], root, async_op=a))


def scatter(st, input, output, root, async_op):  # noqa: A002
    inp = R(input) if input is not None and st.host.rank == root else None
    return st.run(
        "scatter", async_op, [inp, W(output)], lambda b, a: st.host.scatter(b[0], b[1], root, async_op=a)
    )


def scatter_in_place(st, buf, root, async_op):
    mine = R(buf) if st.host.rank == root else W(buf)
    return st.run(
        "scatter_in_place", async_op, [mine], lambda b, a: st.host.scatter_in_place(b[0], root, async_op=a)
    )


def all_reduce_coalesced(st, bufs, op, async_op):
    return st.run(
        "all_reduce_coalesced",
        async_op,
        [RW(x) for x in bufs],
        lambda b, a: st.host.all_reduce_coalesced(b, op, async_op=a),
    )


def all_gather_coalesced(st, inputs, outputs, async_op):
    n = len(inputs)
    return st.run(
        "all_gather_coalesced",
        async_op,
        [R(x) for x in inputs] + [W(o) for o in outputs],
        lambda b, a: st.host.all_gather_coalesced(b[:n], b[n:], async_op=a),
    )


def barrier(st, async_op):
    return st.run("barrier", async_op, [], lambda _b, a: st.host.barrier(async_op=a))


# Point to point: a blocking send or receive runs as an op with no async form; isend and irecv
# start on the lane (or at once) and complete, copying a received buffer back, when waited.


def send(st, buf, dst, tag):
    st.run("send", False, [R(buf)], lambda b, _a: st.host.send(b[0], dst, tag))


def recv(st, buf, src, tag):
    """Returns the sender's rank (``src``, or the sender when ``src`` is ``None``)."""
    sender = []
    st.run("recv", False, [W(buf)], lambda b, _a: sender.append(st.host.recv(b[0], src, tag)))
    return sender[0]


def isend(st, buf, dst, tag):
    return st.run("isend", True, [R(buf)], lambda b, _a: st.host.isend(b[0], dst, tag), p2p=True)


def irecv(st, buf, src, tag):
    return st.run("irecv", True, [W(buf)], lambda b, _a: st.host.irecv(b[0], src, tag), p2p=True)
