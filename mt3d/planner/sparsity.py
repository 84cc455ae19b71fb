"""The speed-of-light model of local attention (Hassani et al. 2025, "Generalized Neighborhood
Attention"): which KV tiles each query tile must visit, and the best speedup any tiled kernel can
reach over dense attention for a pattern.

A tiled attention kernel (FlashAttention, FlexAttention, NATTEN's FNA, mt3d's block-local path)
processes [T_Q x T_KV] tiles of the score matrix; a tile with at least one allowed (query, key)
pair must be computed in full, a tile with none is skipped. So a kernel's work is at best the
number of *visited* tiles, and

    speedup bound = tiles dense causal attention visits / tiles the pattern visits.

Dilation is modelled as kernels run it: the d dilation groups are permuted into d contiguous
sequences (n_g = ceil((n - g) / d) tokens each) and tiled separately; the dense baseline is tiled
in the original order.

A pattern is *perfectly block-sparse* when every visited tile is full (all of its pairs allowed):
then the bound equals the FLOP ratio of the tiles. For the non-causal GNA family that happens when
the tiles divide the window and the stride in the right way (GNA's condition: T_Q | s and T_KV | W
with the window starts aligned to T_KV; s = 1 is never block-sparse unless T = 1). A *causal*
pattern can never be: the tiles on the diagonal hold pairs with key > query, which are masked, and
every query attends to itself, so each query tile visits at least one partially masked tile. The
useful causal statement is "block-sparse off the diagonal": for 1-D causal patterns with d = 1 this
holds iff T_Q | s, T_KV | s, T_KV | W and (s | n or T_KV | n) (the last, partial stride group's
leader is the last token; ``causal_block_sparse``), and is checked here by counting.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TileReport:
    """Tile and pair counts of one pattern at one length and tile shape."""

    n: int
    window: int
    stride: int
    dilation: int
    tile_q: int
    tile_kv: int
    causal: bool
    tiles_visited: int
    tiles_dense: int
    full_tiles: int
    pairs: int
    pairs_dense: int

    @property
    def bound(self) -> float:
        """Best speedup of a tiled kernel over dense attention: tiles_dense / tiles_visited."""
        return self.tiles_dense / self.tiles_visited

    @property
    def flop_fraction(self) -> float:
        """Allowed pairs / dense pairs (the FLOP sparsity)."""
        return self.pairs / self.pairs_dense

    @property
    def tile_fraction(self) -> float:
        """Visited tiles / dense tiles."""
        return self.tiles_visited / self.tiles_dense

    @property
    def perfectly_block_sparse(self) -> bool:
        """Every visited tile is full (never true for causal patterns: see the module docstring)."""
        return self.full_tiles == self.tiles_visited

    def as_dict(self) -> dict:
        """Fields and derived figures, JSON-able."""
        return {
            **asdict(self),
            "bound": self.bound,
            "flop_fraction": self.flop_fraction,
            "tile_fraction": self.tile_fraction,
            "perfectly_block_sparse": self.perfectly_block_sparse,
        }


def key_ranges(n_g: int, window: int, stride: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per query of one dilation group (indices 0..n_g-1): first and last key (inclusive).

    Causal (NATTEN's na1d, is_causal): the stride group's leader L = min(floor(i/s)*s + s - 1,
    n_g - 1) anchors the window: keys max(L - W + 1, 0) .. i. Non-causal: the leader is the group's
    centre floor(i/s)*s + s//2 (clipped to n_g - 1), shifted inside the sequence so that every query
    sees exactly W keys: [c - W//2, c + W//2 - (W + 1) % 2] with c clamped to the borders.
    """
    i = np.arange(n_g)
    if causal:
        lead = np.minimum((i // stride) * stride + stride - 1, n_g - 1)
        return np.maximum(lead - window + 1, 0), i
    left, right = window // 2, window // 2 + window % 2 - 1
    centre = np.minimum((i // stride) * stride + stride // 2, n_g - 1)
    centre = np.clip(centre, left, max(n_g - 1 - right, left))
    return centre - left, np.minimum(centre + right, n_g - 1)


def _group_tiles(start, end, tile_q, tile_kv):
    """Visited and full tiles of one contiguous problem whose query i sees keys start[i]..end[i]."""
    n = len(start)
    visited = full = 0
    for q0 in range(0, n, tile_q):
        s, e = start[q0 : q0 + tile_q], end[q0 : q0 + tile_q]
        rows = len(s)
        first, last = int(s.min()) // tile_kv, int(e.max()) // tile_kv
        for t in range(first, last + 1):
            k0, k1 = t * tile_kv, min((t + 1) * tile_kv, n) - 1
            overlap = np.clip(np.minimum(e, k1) - np.maximum(s, k0) + 1, 0, None)
            if overlap.any():
                visited += 1
                full += int(overlap.sum()) == rows * (k1 - k0 + 1)
    return visited, full


def tiles(
    n: int,
    window: int,
    stride: int = 1,
    dilation: int = 1,
    tile_q: int = 128,
    tile_kv: int = 128,
    causal=True,
) -> TileReport:
    """Count the tiles a pattern visits (and how many are full) against dense attention."""
    if not 1 <= stride <= window or dilation < 1 or window < 1 or n < 1:
        raise ValueError(f"need 1 <= stride <= window and dilation >= 1, got {window}, {stride}, {dilation}")
    visited = full = pairs = 0
    for g in range(min(dilation, n)):
        n_g = -(-(n - g) // dilation)
        start, end = key_ranges(n_g, window, stride, causal)
        pairs += int((end - start + 1).sum())
        v, f = _group_tiles(start, end, tile_q, tile_kv)
        visited, full = visited + v, full + f
    qt = -(-n // tile_q)
    if causal:  # query tile r reaches key tile floor((last query of r) / T_KV)
        last = np.minimum((np.arange(qt) + 1) * tile_q, n) - 1
        dense = int((last // tile_kv + 1).sum())
        pairs_dense = n * (n + 1) // 2
    else:
        dense, pairs_dense = qt * -(-n // tile_kv), n * n
    return TileReport(
        n, window, stride, dilation, tile_q, tile_kv, causal, visited, dense, full, pairs, pairs_dense
    )


def causal_block_sparse(n: int, window: int, stride: int, tile_q: int, tile_kv: int) -> bool:
    """Closed form: a 1-D causal pattern (dilation 1) is block-sparse off the diagonal, i.e. every
    visited tile that holds no (query < key) pair is full (tests check it against ``tiles``)."""
    aligned = stride % tile_q == 0 and math.gcd(stride, window) % tile_kv == 0
    return aligned and (n % stride == 0 or n % tile_kv == 0)


def off_diagonal_full(report: TileReport) -> bool:
    """Whether every visited tile off the diagonal is full, by counting (dilation 1, causal)."""
    n, tq, tkv = report.n, report.tile_q, report.tile_kv
    start, end = key_ranges(n, report.window, report.stride, True)
    for q0 in range(0, n, tq):
        s, e = start[q0 : q0 + tq], end[q0 : q0 + tq]
        for t in range(int(s.min()) // tkv, q0 // tkv):  # tiles wholly left of the diagonal
            k0, k1 = t * tkv, (t + 1) * tkv - 1
            overlap = np.clip(np.minimum(e, k1) - np.maximum(s, k0) + 1, 0, None)
            if overlap.any() and int(overlap.sum()) != len(s) * tkv:
                return False
    return True


@functools.lru_cache(maxsize=256)
def _fraction(n: int, window: int, stride: int, dilation: int, tile: int) -> float:
    return tiles(n, window, stride, dilation, tile, tile).tile_fraction


def attention_speedup(cfg, seq_len: int, tile: int = 128) -> dict:
    """Per-model figures for the planner: the fraction of dense causal attention tiles the model's
    layers visit (averaged over layers, global layers visiting all; the tiles of GPU attention
    kernels by default) and the resulting bound on the attention speedup."""
    fractions = [
        1.0 if p is None else _fraction(seq_len, min(p.window, seq_len), p.stride, p.dilation, tile)
        for p in cfg.patterns
    ]
    mean = sum(fractions) / len(fractions)
    return {"tile_fraction": mean, "attention_speedup_bound": 1 / mean, "tile": tile}
