"""Megatron's tensor-parallel collectives as autograd functions (Shoeybi et al. 2019, Fig. 3).

Every function takes the TP ``AxisGroup`` explicitly; a group of size 1 makes each of them the
identity, so the same model code is the single-process reference. Activations are batch-first,
``[batch, seq, hidden]``: the sequence-parallel functions split and gather dimension 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import AxisGroup

SEQ_DIM = 1


# torch 2.13 renamed the tensor-in/tensor-out collectives (older names deprecated); older torch,
# as on GPU images, has only the old ones. Looked up per call so CollectiveLog can observe them.
def _all_gather_single(out, inp, group, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out, inp, group, async_op=False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def all_reduce(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Sum ``x`` over the group in place (no-op for one rank)."""
    if g.size > 1:
        dist.all_reduce(x, group=g.group)
    return x


def start_all_reduce(x: torch.Tensor, g: AxisGroup):
    """Start summing ``x`` over the group in place; returns a call that waits for the result."""
    if g.size == 1:
        return lambda: x
    work = dist.all_reduce(x, group=g.group, async_op=True)
    return lambda: (work.wait(), x)[1]


def _split(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    if g.size == 1:
        return x
    if x.shape[dim] % g.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={g.size}")
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def _gather(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    return start_gather(x, g, dim)()


def _reduce_scatter(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    return start_reduce_scatter(x, g, dim)()


def start_gather(x: torch.Tensor, g: AxisGroup, dim: int):
    """Start all-gathering ``x`` over ``g`` along ``dim``; returns a call that waits for the result
    (work placed between the two overlaps the transfer)."""
    if g.size == 1:
        return lambda: x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((g.size * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_single(out, front, group=g.group, async_op=True)
    return lambda: (work.wait(), out.movedim(0, dim).contiguous())[1]


def start_reduce_scatter(x: torch.Tensor, g: AxisGroup, dim: int):
    """Start reduce-scattering ``x`` over ``g`` along ``dim``; returns a call that waits for the result."""
    if g.size == 1:
        return lambda: x
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % g.size:
        raise ValueError(f"dimension {dim} of size {front.shape[0]} is not divisible by tp={g.size}")
    out = torch.empty((front.shape[0] // g.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter_single(out, front, group=g.group, async_op=True)
    return lambda: (work.wait(), out.movedim(0, dim).contiguous())[1]


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (entry of a TP region)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (exit of a TP region)."""

    @staticmethod
    def forward(ctx, x, g):
        return all_reduce(x.contiguous().clone() if g.size > 1 else x, g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Split the last dimension forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, -1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.g, -1), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dimension forward, split it backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather(x, g, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.g, -1), None


class _ScatterToSequence(torch.autograd.Function):
    """Split the sequence forward, all-gather it backward (enter the sequence-parallel region)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.g, SEQ_DIM), None


class _GatherFromSequence(torch.autograd.Function):
    """SP g-bar: all-gather the sequence forward, reduce-scatter the gradient backward.

    Used in front of a column-parallel linear: each TP rank's input gradient is a partial sum.
    """

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather(x, g, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.g, SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP g: reduce-scatter over the sequence forward, all-gather backward (after a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _reduce_scatter(x, g, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.g, SEQ_DIM), None


class _GatherFromSequenceReplicated(torch.autograd.Function):
    """All-gather the sequence forward, keep this rank's slice of the gradient backward.

    For leaving the SP region when every TP rank then computes the same thing on the full
    sequence (e.g. the final norm output feeding a replicated consumer).
    """

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather(x, g, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.g, SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, g) if g.size > 1 else x


def reduce_from_tp(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, g) if g.size > 1 else x


def scatter_to_tp(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; gradient all-gathered."""
    return _ScatterToTP.apply(x, g) if g.size > 1 else x


def gather_from_tp(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """All-gather the last dimension; gradient split."""
    return _GatherFromTP.apply(x, g) if g.size > 1 else x


def scatter_to_sequence(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Keep this rank's slice of the sequence; gradient all-gathered."""
    return _ScatterToSequence.apply(x, g) if g.size > 1 else x


def gather_from_sequence(x: torch.Tensor, g: AxisGroup, *, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather the sequence.

    With ``grad_is_partial`` (the consumer is tensor-parallel) the gradient is reduce-scattered;
    otherwise each rank keeps its slice of an identical gradient.
    """
    if g.size == 1:
        return x
    fn = _GatherFromSequence if grad_is_partial else _GatherFromSequenceReplicated
    return fn.apply(x, g)


def reduce_scatter_to_sequence(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Reduce-scatter over the sequence; gradient all-gathered."""
    return _ReduceScatterToSequence.apply(x, g) if g.size > 1 else x


class _AllToAllRows(torch.autograd.Function):
    """Rows of ``x`` split into consecutive blocks of ``send`` rows, block i to rank i; the result
    holds ``recv`` rows from each rank in rank order. The backward sends the gradients back (in their
    own dtype: a ``codec`` casts the forward's rows only)."""

    @staticmethod
    def forward(ctx, x, send, recv, g, codec):
        ctx.send, ctx.recv, ctx.g = send, recv, g
        if codec is None:
            return _all_to_all_rows(x, send, recv, g)
        return codec.decode(_all_to_all_rows(codec.encode(x), send, recv, g), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.recv, ctx.send, ctx.g), None, None, None, None


def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], g: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, recv, send, group=g.group)
    return out


def all_to_all_rows(
    x: torch.Tensor, send: list[int], recv: list[int], g: AxisGroup, codec=None
) -> torch.Tensor:
    """Exchange rows over the group (expert-parallel dispatch and combine): ``send[i]`` rows of ``x``
    go to rank i, ``recv[i]`` come from it; differentiable (the gradient takes the way back, as the
    identity of what arrived). ``codec`` (``fp8.DispatchRows``): the rows travel as
    ``codec.encode(x)`` and arrive as ``codec.decode(rows, width, dtype)``."""
    return _AllToAllRows.apply(x, list(send), list(recv), g, codec) if g.size > 1 else x


class _Posted:
    """The transfer in flight between ``_StartRows`` and ``_WaitRows``: its work handle and buffer,
    the forward's and then the backward's."""

    def __init__(self, send: list[int], recv: list[int], g: AxisGroup, codec=None) -> None:
        self.send, self.recv, self.g, self.codec = send, recv, g, codec
        self.work = self.buffer = self.source = self.decoded = None

    def post(self, x: torch.Tensor, send: list[int], recv: list[int], codec=None) -> torch.Tensor:
        """Post ``x``'s rows (through ``codec`` when given: the forward's); returns the receiving
        buffer, or with a codec a tensor shaped as the decoded rows will be."""
        x = x.contiguous()
        self.decoded = None
        if codec is not None:
            self.decoded = (codec, x.shape[1], x.dtype)
            x = codec.encode(x)
        self.buffer = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.work = dist.all_to_all_single(self.buffer, x, recv, send, group=self.g.group, async_op=True)
        self.source = x  # kept alive until the transfer ends
        if self.decoded is not None:
            return self.buffer.new_empty((self.buffer.shape[0], self.decoded[1]), dtype=self.decoded[2])
        return self.buffer

    def wait(self) -> torch.Tensor:
        self.work.wait()
        out, self.work, self.buffer, self.source = self.buffer, None, None, None
        if self.decoded is not None:
            codec, width, dtype = self.decoded
            out, self.decoded = codec.decode(out, width, dtype), None
        return out


class _StartRows(torch.autograd.Function):
    """Forward: post the exchange (the result's buffer, not yet filled). Backward: wait for the gradient's
    exchange that ``_WaitRows``'s backward posted."""

    @staticmethod
    def forward(ctx, x, posted):
        ctx.posted = posted
        return posted.post(x, posted.send, posted.recv, posted.codec)

    @staticmethod
    def backward(ctx, grad):  # grad: the received rows' own gradient, already on its way back
        return ctx.posted.wait(), None


class _WaitRows(torch.autograd.Function):
    """Forward: wait for the exchange ``_StartRows`` posted. Backward: post the gradient's way back."""

    @staticmethod
    def forward(ctx, buffer, posted):
        ctx.posted = posted
        return posted.wait()

    @staticmethod
    def backward(ctx, grad):
        posted = ctx.posted
        posted.post(grad, posted.recv, posted.send)
        return grad, None  # only its shape matters: _StartRows's backward returns what the transfer brings


def start_all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], g: AxisGroup, codec=None):
    """``all_to_all_rows`` posted: returns a call that waits and gives the received rows. Differentiable,
    and overlapped both ways: what runs between the start and the wait in the forward (work created
    in between) runs between the gradient's post and its wait in the backward, because autograd runs
    the later-created of two ready nodes first. ``codec`` as ``all_to_all_rows``'s (the forward only)."""
    if g.size == 1:
        return lambda: x
    posted = _Posted(list(send), list(recv), g, codec)
    buffer = _StartRows.apply(x, posted)
    return lambda: _WaitRows.apply(buffer, posted)


def all_to_all_counts(counts: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Counts [ranks, n] (row i: what this rank sends rank i) -> [ranks, n] (row i: what rank i sends
    this rank); no gradient."""
    if g.size == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=g.group)
    return out
