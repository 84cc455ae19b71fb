"""Weight initialisation that does not depend on the sharding: a shard equals the same slice of the
unsharded weight drawn with the same seed. The full tensor is defined block by block (``BLOCK_ROWS``
rows per block, each from its own seeded generator), and a rank draws only the blocks its shard
touches: tp = 1 and tp = N start from the same model, and no rank ever holds more than one block
beyond its shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ROWS = 64


@dataclass(frozen=True)
class NormalInit:
    """N(0, std) initialisation, reproducible per ``seed`` whatever the sharding."""

    std: float
    seed: int

    def part(self, index: int) -> NormalInit:
        """The init of part ``index`` of a fused weight (an independent stream per part)."""
        return NormalInit(self.std, _mix(self.seed, 1_000_003 + index))

    def rows(self, start: int, stop: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the full weight (``cols`` wide), drawn block by block."""
        parts = []
        first, last = start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS
        for b in range(first, last + 1):
            gen = torch.Generator().manual_seed(_mix(self.seed, b))
            block = torch.empty(BLOCK_ROWS, cols, dtype=torch.float32).normal_(0.0, self.std, generator=gen)
            lo, hi = (
                max(start, b * BLOCK_ROWS) - b * BLOCK_ROWS,
                min(stop, (b + 1) * BLOCK_ROWS) - b * BLOCK_ROWS,
            )
            parts.append(block[lo:hi])
        return torch.cat(parts).to(dtype)

    def shard(
        self,
        full_shape: tuple[int, int],
        dim: int,
        rank: int,
        world: int,
        dtype: torch.dtype,
        valid_rows=None,
    ) -> torch.Tensor:
        """This rank's shard (along ``dim``) of the full ``full_shape`` weight.

        ``valid_rows`` (for padded vocabularies) zeroes rows at or beyond that index.
        """
        rows, cols = full_shape
        if dim == 0:
            per = rows // world
            lo, hi = rank * per, (rank + 1) * per
            out = self.rows(lo, hi, cols, dtype)
            if valid_rows is not None:
                out[max(0, valid_rows - lo) :] = 0
            return out
        per = cols // world
        out = torch.empty(rows, per, dtype=dtype)
        for start in range(0, rows, BLOCK_ROWS):
            stop = min(rows, start + BLOCK_ROWS)
            out[start:stop] = self.rows(start, stop, cols, dtype)[:, rank * per : (rank + 1) * per]
        return out


@dataclass(frozen=True)
class NoInit:
    """Uninitialised weights (padded vocabulary rows still zero): for models about to be loaded."""

    std: float = 0.0
    seed: int = 0

    def part(self, index: int) -> NoInit:
        """Same for every fused part."""
        return self

    def rows(self, start: int, stop: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """Empty rows."""
        return torch.empty(stop - start, cols, dtype=dtype)

    def shard(self, full_shape, dim, rank, world, dtype, valid_rows=None) -> torch.Tensor:
        """An empty shard (zero beyond ``valid_rows``)."""
        rows, cols = full_shape
        shape = (rows // world, cols) if dim == 0 else (rows, cols // world)
        out = torch.empty(shape, dtype=dtype)
        if valid_rows is not None:
            out[max(0, valid_rows - rank * shape[0]) :] = 0
        return out


def _mix(seed: int, block: int) -> int:
    """A 63-bit seed for one block, decorrelated from neighbouring (seed, block) pairs."""
    x = (seed * 0x9E3779B97F4A7C15 + block * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & (2**63 - 1)
