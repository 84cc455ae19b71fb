"""LoRA adapters sharded like the linear they adapt (Hu et al. 2021): ``y = base(x) + s B A dropout(x)``
with ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023), A ``[r, in]`` drawn
N(0, 1/(3 in)) (the variance of PEFT's default kaiming-uniform A) and B ``[out, r]`` zero, so training
starts from the base model's function.

How each adapter is split over TP follows its base, so an adapted linear makes the collectives of
the base and no other per layer in the forward:

* column-parallel base (q/k/v, gate/up, GPT-2's c_attn/c_fc): A whole on every rank, B split by
  output like the base's rows (per fused part). The adapter reads the same input the base does (the
  all-gathered sequence under SP) and its output lands in this rank's output columns; the input
  gradient of both joins the base's one all-reduce (reduce-scatter under SP). A's gradient is a
  partial sum on each TP rank (each rank's B slice): summed over TP by a hook (``mark_tp_partial_grad``).
* row-parallel base (o, down, GPT-2's c_proj): A split by input like the base's columns, B whole.
  ``x_i A_i^T B^T`` is this rank's share of the adapter's output, added to the base's partial product
  *before* the one all-reduce (reduce-scatter under SP) that sums both. B's gradient is a partial sum
  over TP, summed by a hook.

A fused mt3d linear (q/k/v, gate/up) carries one adapter per HF module, as PEFT has them: each
covers a run of the base's fused parts (``parts``; GPT-2's c_attn covers all three).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .init import NoInit, NormalInit
from .marks import mark_tp, mark_tp_partial_grad
from .state import AxisGroup


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's hyper-parameters (PEFT's meanings)."""

    r: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    @property
    def scale(self) -> float:
        """The factor on ``B A x``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class Adapter(nn.Module):
    """One HF module's LoRA adapter on a column- or row-parallel base linear.

    Args:
        spec: r, alpha, dropout, rslora.
        column: the base is column-parallel (else row-parallel).
        in_features: the base's unsharded input width.
        parts: the unsharded output widths of the base's fused parts this adapter covers.
        offset: where its output starts in this rank's output columns (column-parallel bases).
        tp: the tensor-parallel group; ``init``: A's initialisation (B starts at zero).
        tracker_fork: context for random draws that must differ per TP rank (row bases' dropout).
    """

    def __init__(self, spec: LoraSpec, *, column: bool, in_features: int, parts: tuple[int, ...],
                 offset: int, tp: AxisGroup, init: NormalInit | NoInit, dtype: torch.dtype = torch.float32,
                 device=None, tracker_fork=None) -> None:  # fmt: skip
        super().__init__()
        self.spec, self.column, self.tp, self.offset = spec, column, tp, offset
        self.parts = tuple(parts)
        self.tracker_fork = tracker_fork
        r, out = spec.r, sum(self.parts)
        if column:
            a = init.shard((r, in_features), 0, 0, 1, dtype)  # whole
            self.A = mark_tp_partial_grad(nn.Parameter(a.to(dtype=dtype, device=device)), tp)
            local = sum(p // tp.size for p in self.parts)
            self.B = mark_tp(nn.Parameter(torch.zeros(local, r, dtype=dtype, device=device)), 0, self.parts)
            self.width = local
        else:
            a = init.shard((r, in_features), 1, tp.rank, tp.size, dtype)
            self.A = mark_tp(nn.Parameter(a.to(device)), 1)
            self.B = mark_tp_partial_grad(nn.Parameter(torch.zeros(out, r, dtype=dtype, device=device)), tp)
            self.width = out
        self.A.lora, self.B.lora = "A", "B"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``s B A dropout(x)``: this rank's output columns (column base) or its share of the sum (row
        base) for ``x`` as the base's local GEMM reads it."""
        p = self.spec.dropout
        if p > 0 and self.training:
            if self.column or self.tracker_fork is None:  # replicated input: the same mask on every rank
                x = F.dropout(x, p, True)
            else:  # each rank holds different input columns
                with self.tracker_fork():
                    x = F.dropout(x, p, True)
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype)) * self.spec.scale

    def extra_repr(self) -> str:
        """r, alpha and the split shown by print(module)."""
        kind = "column" if self.column else "row"
        return f"r={self.spec.r}, alpha={self.spec.alpha}, {kind}, parts={self.parts}"


def column_with_adapters(y: torch.Tensor, x: torch.Tensor, adapters) -> torch.Tensor:
    """The column base's local output ``y`` [.., out/tp] plus each adapter's output in its columns
    (``x``: the input the base's GEMM read)."""
    pieces, at = [], 0
    for ad in sorted(adapters, key=lambda a: a.offset):
        if ad.offset > at:
            pieces.append(y.new_zeros(*y.shape[:-1], ad.offset - at))
        pieces.append(ad(x))
        at = ad.offset + ad.width
    if at < y.shape[-1]:
        pieces.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - at))
    return y + torch.cat(pieces, dim=-1)


def row_with_adapters(y: torch.Tensor, x: torch.Tensor, adapters) -> torch.Tensor:
    """The row base's partial product ``y`` plus the adapters' shares (before the reduction over TP)."""
    for ad in adapters:
        y = y + ad(x)
    return y


def is_adapter_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a LoRA A or B."""
    return getattr(p, "lora", None) is not None
