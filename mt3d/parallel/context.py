"""Context parallelism: each sample's sequence split over the ranks of a cp group.

Layout, load-balanced for causal attention (as Megatron-Core and torchtitan): a sequence of n
tokens is cut into 2 cp chunks of c = n / (2 cp); cp rank i holds chunks i and 2cp-1-i, one after
the other (its 2c local tokens), so every rank holds as many early (cheap) queries as late
(expensive) ones and does the same attention work. Everything outside attention is position-wise
and runs on the local tokens unchanged; positions (RoPE, learned) come from the chunks' global
offsets (``local_positions``).

Attention sees the other ranks' tokens through one of three exchanges, chosen per layer
(``exchange``):

* ``alltoall`` (Ulysses): DeepSpeed's ``DistributedAttention`` trades the local sequence of every
  head for the whole sequence of heads / cp heads (one all-to-all each for q, k, v and the output);
  each rank then attends over the whole sequence with any pattern. Needs (heads / tp) divisible by
  cp; fewer key/value heads than cp are repeated up to cp first.
* ``allgather``: every rank gathers the keys and values of the whole sequence (the fewer key/value
  heads, as Llama 3 does; the backward reduce-scatters their gradients) and attends its own queries,
  each chunk against the keys up to its end. Any head count.
* ``halo`` (local layers): a query at position p needs keys from p - (W d - 1) on only, so each
  chunk receives the W d - 1 keys (and values) before its first position from the rank holding the
  previous chunk, whatever n is. Used when the halo fits in one chunk.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .mappings import _gather, _reduce_scatter
from .state import AxisGroup

SEQ = 2
"""Sequence dimension of attention tensors ([batch, heads, sequence, head_dim])."""
EXCHANGES = ("auto", "alltoall", "allgather")
"""``parallel.context_exchange`` values: auto (halo for local layers whose window fits a chunk,
all-to-all for the others when the heads divide, else all-gather), or one kind for every layer
(local layers still use the halo when it applies)."""


def chunk_starts(rank: int, cp: int, c: int) -> tuple[int, int]:
    """Global start of the two chunks cp rank ``rank`` holds (chunk size ``c``)."""
    return rank * c, (2 * cp - 1 - rank) * c


def local_positions(cp: AxisGroup, local_len: int, device=None) -> torch.Tensor:
    """Global positions of a rank's ``local_len`` tokens (its two chunks)."""
    c = local_len // 2
    a, b = chunk_starts(cp.rank, cp.size, c)
    return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])


def split_sequence(x: torch.Tensor, cp: AxisGroup, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a whole sequence along ``dim`` (no gradient: for inputs and labels)."""
    if cp.size == 1:
        return x
    n = x.shape[dim]
    if n % (2 * cp.size):
        raise ValueError(f"a sequence of {n} tokens cannot be cut into 2 x cp = {2 * cp.size} chunks")
    c = n // (2 * cp.size)
    a, b = chunk_starts(cp.rank, cp.size, c)
    return torch.cat([x.narrow(dim, a, c), x.narrow(dim, b, c)], dim=dim)


def _order(cp: int) -> list[int]:
    """For each global chunk j, its index in the rank-ordered gather (rank r's halves at 2r, 2r+1)."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


class _GatherSequence(torch.autograd.Function):
    """All-gather the sequence over cp in global order forward; reduce-scatter back to the owners'
    chunks backward (each rank's gradient of the whole sequence is partial)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        chunks = _gather(x, g, SEQ).chunk(2 * g.size, dim=SEQ)  # rank order: r0a r0b r1a r1b ...
        return torch.cat([chunks[i] for i in _order(g.size)], dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.g
        pieces = grad.chunk(2 * g.size, dim=SEQ)  # global order
        by_rank = [None] * (2 * g.size)
        for j, i in enumerate(_order(g.size)):
            by_rank[i] = pieces[j]
        return _reduce_scatter(torch.cat(by_rank, dim=SEQ), g, SEQ), None


def gather_sequence(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, h, 2c, d] local -> [b, h, n, d], the whole sequence in global order."""
    return _GatherSequence.apply(x, cp) if cp.size > 1 else x


def _exchange(cp: AxisGroup, sends: list, recvs: list) -> None:
    """Post point-to-point sends ``(tensor, group rank)`` and receives together, then wait."""
    # torch's own isend/irecv objects: P2POp refuses any other callable, such as a wrapper that
    # CollectiveLog puts in their place on torch.distributed (it records batch_isend_irecv instead).
    ops = [dist.P2POp(c10d.isend, t.contiguous(), cp.ranks[r], group=cp.group) for t, r in sends]
    ops += [dist.P2POp(c10d.irecv, t, cp.ranks[r], group=cp.group) for t, r in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Halo(torch.autograd.Function):
    """The ``h`` positions before each of this rank's chunks, from the rank that holds the previous
    chunk (rank i: chunk i's halo from rank i-1's first chunk; chunk 2cp-1-i's from rank i+1's second,
    or from its own first chunk on the last rank). Backward: each halo's gradient goes back to its
    owner and is added to its chunk's tail."""

    @staticmethod
    def forward(ctx, x, g, h):
        ctx.g, ctx.h, ctx.shape = g, h, tuple(x.shape)
        r, cp, c = g.rank, g.size, x.shape[SEQ] // 2
        tail_a, tail_b = x.narrow(SEQ, c - h, h), x.narrow(SEQ, 2 * c - h, h)
        shape = list(x.shape)
        shape[SEQ] = h
        halo_a = x.new_empty(shape) if r > 0 else x.new_empty(0)
        halo_b = x.new_empty(shape) if r < cp - 1 else tail_a.clone()
        sends = ([(tail_a, r + 1)] if r < cp - 1 else []) + ([(tail_b, r - 1)] if r > 0 else [])
        recvs = ([(halo_a, r - 1)] if r > 0 else []) + ([(halo_b, r + 1)] if r < cp - 1 else [])
        _exchange(g, sends, recvs)
        return halo_a, halo_b

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        g, h = ctx.g, ctx.h
        r, cp = g.rank, g.size
        grad_a = grad_a.contiguous() if r > 0 else None
        shape = list(grad_b.shape)
        from_next = grad_b.new_zeros(shape) if r < cp - 1 else grad_b  # for my first chunk's tail
        from_prev = grad_b.new_zeros(shape) if r > 0 else None  # for my second chunk's tail
        sends = ([(grad_a, r - 1)] if r > 0 else []) + ([(grad_b, r + 1)] if r < cp - 1 else [])
        recvs = ([(from_next, r + 1)] if r < cp - 1 else []) + ([(from_prev, r - 1)] if r > 0 else [])
        _exchange(g, sends, recvs)
        grad = torch.zeros(ctx.shape, dtype=grad_b.dtype, device=grad_b.device)
        c = ctx.shape[SEQ] // 2
        grad.narrow(SEQ, c - h, h).add_(from_next)
        if from_prev is not None:
            grad.narrow(SEQ, 2 * c - h, h).add_(from_prev)
        return grad, None, None


def halo(x: torch.Tensor, cp: AxisGroup, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``h`` positions before chunk 1, the ``h`` before chunk 2) of a local [b, heads, 2c, d]
    tensor; the first is empty on rank 0 (its chunk starts the sequence)."""
    return _Halo.apply(x, cp, h)


def _ulysses_local(pattern, scale, softcap, dropout, cp: int, attend, sinks=None, record=None):
    """The attention DeepSpeed's DistributedAttention runs on each rank after its all-to-all:
    [b, n, heads/cp, d] over the whole sequence, whose chunks arrive in rank order (rank r's two
    chunks at 2r, 2r+1): put in global order, attend, put back. ``sinks``: this rank's heads' sinks;
    ``record``: ``attend``'s, already told which heads these are."""
    order = _order(cp)
    back = [order.index(i) for i in range(2 * cp)]

    def local(q, k, v):
        def reorder(x, perm):
            chunks = x.chunk(2 * cp, dim=1)
            return torch.cat([chunks[i] for i in perm], dim=1)

        q, k, v = (reorder(t, order).transpose(1, 2) for t in (q, k, v))
        out = attend(q, k, v, pattern=pattern, scale=scale, softcap=softcap, dropout=dropout, sinks=sinks,
                     record=record)  # fmt: skip
        return reorder(out.transpose(1, 2), back)

    return local


def ulysses(q, k, v, cp: AxisGroup, *, pattern, scale, softcap, dropout, attend, sinks=None,
            record=None) -> torch.Tensor:  # fmt: skip
    """All-to-all attention with DeepSpeed's ``DistributedAttention``: q/k/v [b, heads, 2c, d] local
    -> output [b, heads, 2c, d]. Key/value heads fewer than cp are repeated up to cp first (their
    gradients sum back), so that every rank holds one. ``sinks`` [heads]: the all-to-all gives cp rank
    r the r-th 1/cp of the heads, and with them their sinks; ``record(maxima, first)``: their logits'
    maxima, noted from head ``first`` on."""
    from deepspeed.sequence.layer import DistributedAttention

    hq, hk = q.shape[1], k.shape[1]
    if hk < cp.size:
        k, v = (t.repeat_interleave(cp.size // hk, dim=1) for t in (k, v))
    if sinks is not None:
        sinks = sinks.chunk(cp.size)[cp.rank]
    if record is not None:
        record = functools.partial(record, first=cp.rank * (hq // cp.size))
    dist_attn = DistributedAttention(
        _ulysses_local(pattern, scale, softcap, dropout, cp.size, attend, sinks, record),
        cp.group,
        scatter_idx=2,
        gather_idx=1,
    )
    out = dist_attn(*(t.transpose(1, 2) for t in (q, k, v)), batch_dim_idx=0)
    assert out.shape[2] == hq
    return out.transpose(1, 2)


def exchange_for(requested: str, pattern, chunk: int, heads: int, kv_heads: int, cp: int) -> str:
    """The exchange a layer uses: the halo for a local layer whose W d - 1 keys fit in one chunk;
    otherwise ``requested`` (auto: all-to-all when the heads divide over cp, else all-gather)."""
    if pattern is not None and pattern.history() <= chunk:
        return "halo"
    if requested != "auto":
        return requested
    return "alltoall" if ulysses_heads_ok(heads, kv_heads, cp) else "allgather"


def ulysses_heads_ok(heads: int, kv_heads: int, cp: int) -> bool:
    """Whether the all-to-all can split these (per-TP-rank) heads over cp ranks: query heads divide,
    and key/value heads divide or are fewer and divide cp (then repeated up to cp)."""
    return heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)


def attention(q, k, v, cp: AxisGroup, kind: str, *, pattern, scale, softcap, dropout, attend,
              sinks=None, record=None) -> torch.Tensor:  # fmt: skip
    """Attention of this rank's queries (q/k/v [b, heads, 2c, d], positions as ``local_positions``,
    RoPE already applied) over the whole sequence, by exchange ``kind``; ``attend`` is
    ``model.attention.attend``. Kind "whole": k and v already hold the whole sequence in global order
    (latent attention gathers its compressed latent and expands it: ``mt3d.model.mla``). ``sinks``
    [heads]: attention sinks, which join each query's softmax once (every kind calls ``attend`` once per
    query: no chunk's partial softmax is merged). ``record``: ``attend``'s (QK-clip's logit maxima)."""
    if kind == "alltoall":
        return ulysses(
            q, k, v, cp, pattern=pattern, scale=scale, softcap=softcap, dropout=dropout, attend=attend,
            sinks=sinks, record=record,
        )  # fmt: skip
    c = q.shape[SEQ] // 2
    n = 2 * cp.size * c
    starts = chunk_starts(cp.rank, cp.size, c)
    if kind == "halo":
        h = pattern.history()
        before = [halo(k, cp, h), halo(v, cp, h)] if h else None
        keys = []
        for i, start in enumerate(starts):
            own_k, own_v = (t.narrow(SEQ, i * c, c) for t in (k, v))
            if before and before[0][i].numel():
                own_k = torch.cat([before[0][i], own_k], dim=SEQ)
                own_v = torch.cat([before[1][i], own_v], dim=SEQ)
            keys.append((own_k, own_v, start + c - own_k.shape[SEQ]))
    else:  # allgather (or "whole": k/v already hold the whole sequence): each chunk's queries against
        # every key up to its end
        whole_k, whole_v = (k, v) if kind == "whole" else (gather_sequence(k, cp), gather_sequence(v, cp))
        keys = [(whole_k.narrow(SEQ, 0, s + c), whole_v.narrow(SEQ, 0, s + c), 0) for s in starts]
    outs = [
        attend(
            q.narrow(SEQ, i * c, c),
            kk,
            vv,
            pattern=pattern,
            scale=scale,
            softcap=softcap,
            dropout=dropout,
            q_start=starts[i],
            k_start=k0,
            n=n,
            sinks=sinks,
            record=record,
        )  # fmt: skip
        for i, (kk, vv, k0) in enumerate(keys)
    ]
    return torch.cat(outs, dim=SEQ)
