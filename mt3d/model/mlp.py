"""The MLP of a dense block: GELU or gated (SwiGLU, GeGLU) with the inner dimension split over TP,
tiled over the sequence (``train.recompute.tile_len``) and selectively recomputed."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from .build import BuildContext
from .config import GATED_MLPS, ModelConfig
from .tiled import tile_count, tiled


class MLP(nn.Module):
    """GELU (tanh) 2-layer MLP, or a gated one (SwiGLU: SiLU gate; GeGLU: tanh-GELU gate) whose gate
    and up projections are one fused column-parallel linear; inner dimension split over TP."""

    def __init__(
        self, cfg: ModelConfig, ctx: BuildContext, layer: int, ffn: int | None = None, name: str = "mlp"
    ) -> None:
        super().__init__()
        self.gated = cfg.mlp in GATED_MLPS
        self.tile_len = ctx.tile_len
        self.selective = ctx.selective
        self.act = F.silu if cfg.mlp == "swiglu" else functools.partial(F.gelu, approximate="tanh")
        ffn = ffn or cfg.ffn
        parts = (ffn, ffn) if self.gated else (ffn,)
        self.up = ColumnParallelLinear(
            cfg.hidden,
            sum(parts),
            tp=ctx.tp,
            bias=cfg.mlp_bias,
            sequence_parallel=ctx.sp,
            keep_gathered=ctx.keep_gathered,
            init=ctx.init(layer, f"{name}.up", cfg.init_std),
            parts=parts,
            dtype=ctx.dtype,
            device=ctx.device,
            gemms=ctx.gemms(layer),
        )
        self.down = RowParallelLinear(
            ffn,
            cfg.hidden,
            tp=ctx.tp,
            bias=cfg.mlp_bias,
            sequence_parallel=ctx.sp,
            init=ctx.init(layer, f"{name}.down", cfg.init_std / math.sqrt(2 * cfg.layers)),
            dtype=ctx.dtype,
            device=ctx.device,
            gemms=ctx.gemms(layer),
        )

    def forward(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """[b, s, h] -> [b, s, h] (sequence shards with SP); in tiles of ``tile_len`` positions (as the
        up projection sees them: all-gathered over TP with SP) unless ``whole``."""
        gathered = x.shape[1] * (self.up.tp.size if self.up.sequence_parallel else 1)
        n = 1 if whole else tile_count(gathered, self.tile_len)
        if n == 1:
            return self._mlp(x)
        names = [name for name, _ in self.named_parameters()]
        return tiled(functools.partial(_module_tile, self, names), x, list(self.parameters()), n)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        if self.selective and torch.is_grad_enabled():
            return self.down.forward_recomputing(y, self._activation)
        return self.down(self._activation(y))

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        """act(y), or act(gate) * up of a gated MLP's fused [gate | up]."""
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(y)


def _module_tile(module: nn.Module, names: list[str], x: torch.Tensor, aux, params) -> torch.Tensor:
    """``module(x, whole=True)`` computed with ``params`` in place of its parameters (a tile)."""
    return torch.func.functional_call(module, dict(zip(names, params, strict=True)), (x,), {"whole": True})
