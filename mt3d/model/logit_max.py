"""The largest pre-softmax logit of every attention head, for QK-clip (``train.muon.qk_clip``; the
clip itself is ``mt3d.training.qk_clip``).

The logit of query i and key j is ``scale * q_i . k_j`` (before soft-capping; attention sinks are
not q.k logits and do not count), over the keys the query sees (``LocalPattern.allowed``, the causal
mask, a document's keys). No kernel mt3d runs returns it (SDPA and FlashAttention keep only the
log-sum-exp), so ``max_logits`` computes it beside the kernel from the same q, k and positions,
without autograd, a tile of queries at a time over only the keys a local pattern lets them see: one
more q.k product, about a sixth of attention's training FLOPs for global layers. ``attend`` calls it
with each call's q and k (``record``), so every path (the kernels, packed documents, every
context-parallel exchange, latent attention) is covered by the same code.
"""

from __future__ import annotations

import math

import torch

TILE_ELEMENTS = 1 << 24
"""Scores held at once by ``max_logits`` (64 MiB in fp32)."""


@torch.no_grad()
def max_logits(q, k, *, pattern, scale: float, q_start: int = 0, k_start: int = 0,
               n: int | None = None) -> torch.Tensor:  # fmt: skip
    """[hq] fp32: each query head's largest logit over the keys its queries see, for queries at
    positions ``q_start ...`` (q [b, hq, s, d]) and keys at ``k_start ...`` (k [b, hk, t, d], hq a
    multiple of hk, query head i on key head i // (hq / hk)) in a sequence of ``n`` tokens, computed in
    q's dtype. A tile of queries meets, under global causal attention, keys every query of it sees
    (taken without a mask) and its diagonal block (masked); under a local pattern only the keys within
    its reach (masked)."""
    b, hq, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    g = hq // hk
    n = q_start + s if n is None else n
    qg = q.view(b, hk, g, s, d)
    reach = None if pattern is None else pattern.history()
    # tiles of up to 256 queries, as tall as a local pattern's reach (the keys a tile meets: reach + rows)
    tall = 256 if reach is None else min(256, max(32, reach + 1))
    rows = max(1, min(tall, TILE_ELEMENTS // max(1, b * hq * t)))
    best = torch.full((hk, g), -math.inf, dtype=torch.float32, device=q.device)

    def fold(tile: torch.Tensor, keys: torch.Tensor, mask=None) -> None:
        nonlocal best
        scores = tile @ keys.transpose(-1, -2)  # [b, hk, g * rows, keys]
        if mask is not None:  # in place: the scores are this function's own
            bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
                ~mask, -math.inf
            )
            scores.view(b, hk, g, -1, keys.shape[2]).add_(bias)
        best = torch.maximum(best, scores.reshape(b, hk, g, -1).amax(dim=(0, 3)).float())

    for a in range(0, s, rows):
        e = min(s, a + rows)
        lo = 0 if reach is None else max(0, q_start + a - reach - k_start)
        hi = min(t, q_start + e - k_start)  # causal: no query sees a key after itself
        if hi <= lo:
            continue
        tile = qg[:, :, :, a:e].reshape(b, hk, g * (e - a), d)
        if reach is None:  # keys before the tile's first query: every query sees them
            free = min(hi, max(lo, q_start + a - k_start))
            if free > lo:
                fold(tile, k[:, :, lo:free])
            lo = free
        if hi > lo:
            qpos = torch.arange(q_start + a, q_start + e, device=q.device)[:, None]
            kpos = torch.arange(k_start + lo, k_start + hi, device=q.device)[None, :]
            fold(tile, k[:, :, lo:hi], (kpos <= qpos) if pattern is None else pattern.allowed(qpos, kpos, n))
    return best.reshape(hq) * scale


class LogitMax:
    """One attention layer's running maximum logit per query head on this rank (its TP heads),
    noted by every training forward (``note``, the ``record`` that ``attend`` calls) and taken by
    the clip after the optimizer step (``take``)."""

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.value: torch.Tensor | None = None

    def note(self, maxima: torch.Tensor, first: int = 0) -> None:
        """Fold ``maxima`` of heads ``first ...`` (a context-parallel all-to-all gives a rank part of
        its heads) into the running maximum."""
        if self.value is None:
            self.value = torch.full((self.heads,), -math.inf, dtype=torch.float32, device=maxima.device)
        seg = self.value.narrow(0, first, maxima.numel())
        torch.maximum(seg, maxima.float(), out=seg)

    def take(self, device=None) -> torch.Tensor:
        """The maxima since the last ``take`` (-inf for heads no query reached), and a fresh start."""
        value = self.value
        self.value = None
        if value is None:
            return torch.full((self.heads,), -math.inf, dtype=torch.float32, device=device)
        return value


def logit_record(attention: torch.nn.Module, cache=None):
    """What an attention layer's ``attend`` notes its logits' maxima into (its ``logit_max``, set by
    QK-clip): only in training forwards, never while generating."""
    watch = getattr(attention, "logit_max", None)
    return watch.note if watch is not None and attention.training and cache is None else None
