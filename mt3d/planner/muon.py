"""Muon in the planner (``mt3d plan --optimizer muon``; the optimizer is ``mt3d.training.muon``): its
states and its Newton-Schulz time.

States: one fp32 momentum per orthogonalised weight (4 bytes) instead of Adam's two moments (8); the
rest keeps AdamW's. Time: five quintic steps per HF matrix of m x n (m <= n), each X X^T (2 m^2 n),
its square (2 m^3) and the product with X (2 m^2 n): 5 (4 m^2 n + 2 m^3) FLOPs, at the device's GEMM
rate. Every TP rank orthogonalises its stage's matrices whole; with ZeRO the data-parallel ranks share
them (each the weights its partition overlaps), the experts' over the ranks holding the same experts;
ep ranks hold experts / ep. The all-gathers that assemble the matrices (4 bytes a weight over tp, and
over the data-parallel ranks under ZeRO) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..model.config import ModelConfig
from ..model.moe_spec import expert_index
from ..model.sharding import cache_key, orthogonalized, role_of, sharding_table, split_name

NS_STEPS = 5
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class MuonCost:
    """What Muon changes for one model."""

    fraction: float
    """Share of the parameters Muon updates (the blocks' matrices less routers and gates)."""
    dense_flops: float
    """Newton-Schulz FLOPs of the whole model's non-expert matrices, per step."""
    expert_flops: float
    """... of every routed expert's matrices."""


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of orthogonalising one rows x cols matrix (module docstring)."""
    m, n = sorted((rows, cols))
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def hf_matrices(cfg: ModelConfig, vocab: int) -> list[tuple[int, int, bool]]:
    """(rows, cols, routed expert's) of every matrix Muon orthogonalises on its own: the blocks' (and
    multi-token prediction's blocks') weights (``sharding.orthogonalized``), fused ones split into their
    parts."""
    out = []
    for name, spec in sharding_table(cfg, vocab).items():
        layer, local = split_name(name)
        role = role_of(cfg, layer)
        if role == "mtp":  # multi-token prediction's depths: their blocks take Muon, eh_proj AdamW
            role, local = ("block", local.split(".block.", 1)[1]) if ".block." in local else (role, local)
        if role != "block" or not spec.optimized or not orthogonalized(local, len(spec.shape)):
            continue
        rows, cols = spec.shape
        dim = spec.layout.dim or 0
        for part in spec.layout.parts or (spec.shape[dim],):
            out.append(((part, cols) if dim == 0 else (rows, part)) + (expert_index(name) is not None,))
    return out


_COSTS: dict[tuple[str, int], MuonCost] = {}


def muon_cost(cfg: ModelConfig, vocab: int) -> MuonCost:
    """``MuonCost`` of ``cfg`` (kept per shape: the planner asks for every candidate)."""
    key = (cache_key(cfg), vocab)
    if key not in _COSTS:
        mats = hf_matrices(cfg, vocab)
        dense = sum(ns_flops(r, c) for r, c, e in mats if not e)
        experts = sum(ns_flops(r, c) for r, c, e in mats if e)
        _COSTS[key] = MuonCost(sum(r * c for r, c, _ in mats) / cfg.num_params(vocab), dense, experts)
    return _COSTS[key]


def muon_precision(prec, cost: MuonCost):
    """``Precision`` with Muon's optimizer states: one momentum instead of two moments on its share."""
    return replace(prec, optim=prec.optim * (1 - cost.fraction / 2))


def muon_seconds(cfg: ModelConfig, vocab: int, lay, device, gemm_fraction: float | None,
                 fallback_tflops: float) -> float:  # fmt: skip
    """Newton-Schulz seconds of one step on the heaviest rank (module docstring), at the device's
    GEMM rate (``fallback_tflops`` without a GEMM calibration)."""
    from .compute import GEMM_FRACTION

    cost = muon_cost(cfg, vocab)
    dense = cost.dense_flops / lay.pp / (lay.dense if lay.zero_stage else 1)
    experts = cost.expert_flops / lay.pp / lay.ep / (lay.data if lay.zero_stage else 1)
    rate = fallback_tflops
    if device is not None and device.gemm_tflops:
        rate = device.gemm_tflops * (gemm_fraction or GEMM_FRACTION)
    return (dense + experts) / (rate * 1e12)


def muon_conflict(lay, precision: str) -> str | None:
    """Why mt3d would refuse Muon at this candidate (``config.optimizer_rules.muon_layout_conflict``)."""
    from ..config.optimizer_rules import muon_layout_conflict

    return muon_layout_conflict(lay.zero_stage, precision, lay.offload)
