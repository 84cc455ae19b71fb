"""Context parallelism for Gated DeltaNet layers (``mt3d.model.gdn``): each cp rank holds two chunks
of the sequence (``mt3d.parallel.context``'s load-balanced order) and the scan runs over all 2 cp chunks
in sequence order.

The state after a chunk is linear in the state before it: S_end = M S_start + N, with M (key_head_dim
x key_head_dim per value head) the product of the chunk's decays and delta-rule factors and N the end
state from zero. So each rank computes, for its two chunks, the outputs and the end state from a zero
start (N) and M (the same rule from the identity with zero values); the ranks all-gather every chunk's
(M, N) (key_head_dim x (key_head_dim + value_head_dim) per value head and chunk: the exchange's
volume), each rank runs the 2 cp-step prefix S_j+1 = M_j S_j + N_j to get its chunks' incoming states,
and runs its chunks again from them. The all-gather's backward reduce-scatters, so every rank's
gradient reaches the chunks whose states it read. The short convolution takes the conv_kernel - 1
tokens before each chunk from the rank that holds them (``context.halo``).

Packed documents: a chunk whose first document started before it continues the incoming state (its
first document's tokens only; the convolution's halo is cut to that document); a chunk where a document
starts passes on the state of its last document from zero (M = 0).

Load balance: the scan's work is the same for every chunk (unlike causal attention's), so the zigzag
order neither helps nor hurts it; it is kept for the attention layers of the same model.
"""

from __future__ import annotations

import torch

from ..parallel.context import chunk_starts, gather_sequence, halo
from .documents import document_spans


def _runs(documents, row: int, start: int, c: int) -> tuple[list[tuple[int, int]], bool]:
    """The document runs (lo, hi) of sample ``row`` inside the chunk at ``start`` (local offsets), and
    whether its first run continues a document from before the chunk."""
    if documents is None:
        return [(0, c)], start > 0
    spans = [(a, e, doc) for a, e, doc in document_spans(documents)[row] if a < start + c and e > start]
    runs = [(max(a, start) - start, min(e, start + c) - start) for a, e, _ in spans]
    return runs, spans[0][0] < start and spans[0][2] >= 0


def context_mix(layer, mixed, g, beta, documents, cp) -> torch.Tensor:
    """The rank's two chunks ``mixed`` [b, 2c, conv channels] (``g``, ``beta`` [b, 2c, value heads])
    through ``layer``'s convolution and delta rule in sequence order over the cp ranks: [b, 2c, value
    heads, value_head_dim]. ``documents`` [b, n]: the whole sequence's document index (or None)."""
    b, t, _ = mixed.shape
    c, taps = t // 2, layer.spec.conv_kernel
    starts = chunk_starts(cp.rank, cp.size, c)
    halos = halo(mixed.unsqueeze(1), cp, taps - 1) if taps > 1 else (None, None)
    firsts, maps = {}, []  # (row, chunk) -> the first run, redone from the incoming state; per chunk (M, N)
    outs = [[None] * 2 for _ in range(b)]
    for i, start in enumerate(starts):
        ms, ns = [], []
        for r in range(b):
            runs, cont = _runs(documents, r, start, c)
            outs[r][i], m = [], None
            for n, (lo, hi) in enumerate(runs):
                piece = (mixed[r : r + 1, i * c + lo : i * c + hi], g[r : r + 1, i * c + lo : i * c + hi],
                         beta[r : r + 1, i * c + lo : i * c + hi])  # fmt: skip
                prefix = _prefix(halos[i], documents, r, start, taps) if n == 0 and cont else None
                o, final, *rest = layer.run(*piece, prefix, transition=n == 0 and cont and len(runs) == 1)
                outs[r][i].append(o)
                if n == 0 and cont:
                    firsts[r, i] = (*piece, prefix)
                    m = rest[0] if rest else None
            ms.append(m if m is not None else final.new_zeros(*final.shape[:-1], final.shape[-2]))
            ns.append(final)
        maps.append(torch.cat([torch.cat(ms), torch.cat(ns)], dim=-1))  # [b, heads, dk, dk + dv]
    incoming = _incoming(maps, cp, layer.spec.key_head_dim)
    for (r, i), (x, gg, bb, prefix) in firsts.items():
        j = starts[i] // c  # the chunk's place in the sequence
        outs[r][i][0] = layer.run(x, gg, bb, prefix, state=incoming[j][r : r + 1])[0]
    return torch.cat([torch.cat([p for i in range(2) for p in outs[r][i]], dim=1) for r in range(b)])


def _prefix(h, documents, row: int, start: int, taps: int):
    """The convolution's halo for a chunk continuing a document: the taps - 1 tokens before it, those of
    another document zeroed (the convolution's zero padding at a document's start)."""
    if h is None or h.numel() == 0:
        return None
    x = h[row : row + 1, 0]  # [1, taps - 1, channels]
    if documents is None:
        return x
    same = documents[row, start - taps + 1 : start] == documents[row, start]
    return x * same.to(x.dtype)[None, :, None]


def _incoming(maps: list[torch.Tensor], cp, dk: int) -> list[torch.Tensor]:
    """Every chunk's incoming state [b, heads, dk, dv] in sequence order, from the two local chunks' (M,
    N) [b, heads, dk, dk + dv] all-gathered over cp."""
    b, h, _, width = maps[0].shape
    local = torch.stack([x.reshape(b, h, -1) for x in maps], dim=2)  # [b, h, 2, dk (dk + dv)]
    every = gather_sequence(local, cp).view(b, h, 2 * cp.size, dk, width)
    state = torch.zeros(b, h, dk, width - dk, dtype=every.dtype, device=every.device)
    out = []
    for j in range(2 * cp.size):
        out.append(state)
        state = every[:, :, j, :, :dk] @ state + every[:, :, j, :, dk:]
    return out
