"""Norms and rotary position embeddings: RMSNorm (and LayerNorm by configuration), q/k head norms,
RoPE tables with the scalings HF families declare."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.layers import (
    mark_sequence_parallel,
    mark_tp_partial_grad,
)
from .build import BuildContext
from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019); with ``unit_offset`` x / rms(x) * (1 + weight),
    weights starting at 0 (Gemma, which also applies the scale before casting back)."""

    def __init__(self, hidden: int, eps: float, unit_offset: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        init = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(init(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension, computing in fp32 (or fp64 for fp64 inputs)."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)
        return self.weight * y.to(x.dtype)


def make_norm(cfg: ModelConfig, ctx: BuildContext) -> nn.Module:
    """The configured norm over the residual stream; marked sequence-parallel when SP is on."""
    if cfg.norm == "rmsnorm":
        norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_unit_offset, dtype=ctx.dtype, device=ctx.device)
    else:
        norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, dtype=ctx.dtype, device=ctx.device)
    if ctx.sp:
        for p in norm.parameters():
            mark_sequence_parallel(p, ctx.tp)
    return norm


def make_head_norm(cfg: ModelConfig, ctx: BuildContext) -> RMSNorm:
    """An RMSNorm over one attention head (Qwen3's q/k norm). Every TP rank applies the same weight
    to its own heads, so each holds part of the gradient: summed over TP (SP or not)."""
    norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset, dtype=ctx.dtype, device=ctx.device)
    mark_tp_partial_grad(norm.weight, ctx.tp)
    return norm


def rope_inv_freq(cfg: ModelConfig, seq_len: int) -> torch.Tensor:
    """RoPE inverse frequencies, with HF-compatible 'linear', 'dynamic' and 'llama3' scaling."""
    d = cfg.head_dim
    base = cfg.rope_theta
    sc = dict(cfg.rope_scaling or {})
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "dynamic" and seq_len > cfg.max_seq_len:
        f = sc["factor"]
        base = base * ((f * seq_len / cfg.max_seq_len) - (f - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        f, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, dynamic, llama3)")
    return inv.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension (the HF/Llama RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, seq_len: int, dtype) -> tuple:
    """cos/sin tables [s, head_dim] for positions [s]; [b, 1, s, head_dim] for per-sample positions
    [b, s] (packed documents), which broadcast over the heads of [b, heads, s, head_dim]."""
    inv = rope_inv_freq(cfg, seq_len).to(positions.device)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:
        emb = emb.unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
