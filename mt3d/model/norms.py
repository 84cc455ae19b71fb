"""Norms and rotary position embeddings: RMSNorm (and LayerNorm by configuration), q/k head norms,
RoPE tables with the scalings HF families declare."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.layers import (
    mark_sequence_parallel,
    mark_tp,
    mark_tp_partial_grad,
)
from ..parallel.mappings import copy_to_tp, reduce_from_tp
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


def make_norm(
    cfg: ModelConfig, ctx: BuildContext, width: int | None = None, eps: float | None = None
) -> nn.Module:
    """The configured norm over the residual stream (or another ``width`` of replicated activations that
    SP shards the same way: latent attention's latents); marked sequence-parallel when SP is on."""
    width, eps = width or cfg.hidden, cfg.norm_eps if eps is None else eps
    if cfg.norm == "rmsnorm":
        norm = RMSNorm(width, eps, cfg.norm_unit_offset, dtype=ctx.dtype, device=ctx.device)
    else:
        norm = nn.LayerNorm(width, eps=eps, dtype=ctx.dtype, device=ctx.device)
    if ctx.sp:
        for p in norm.parameters():
            mark_sequence_parallel(p, ctx.tp)
    return norm


class HeadsRMSNorm(nn.Module):
    """One RMSNorm over all the heads of q (or of k) at once (MiniMax-M2's q/k norms, ``qk_norm`` "all"):
    x [..., heads, head_dim] divided by the root mean square over every head's dims, times a weight per
    dimension. The heads and the weight are split over TP, so each rank's sum of squares is added over
    TP, forward and backward (every rank's scale reads every rank's sum)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp, dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.tp, self.shape = eps, tp, (heads, head_dim)
        self.width = heads * head_dim * tp.size
        self.weight = mark_tp(nn.Parameter(torch.ones(heads * head_dim, dtype=dtype, device=device)), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., heads / tp, head_dim], this rank's heads; computed in fp32 (fp64 for fp64 inputs)."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = xf.pow(2).sum(dim=(-2, -1))
        if self.tp.size > 1:  # the sum over TP's backward is a sum over TP too: every rank's scale reads it
            squares = reduce_from_tp(copy_to_tp(squares, self.tp), self.tp)
        y = xf * torch.rsqrt(squares / self.width + self.eps)[..., None, None]
        return self.weight.view(self.shape) * y.to(x.dtype)


def make_head_norm(cfg: ModelConfig, ctx: BuildContext, heads: int) -> nn.Module:
    """The q (or k) norm of an attention layer whose rank holds ``heads`` heads: per head (Qwen3's, every
    TP rank applying the same weight to its own heads, so each holds part of the gradient: summed over
    TP, SP or not), or over all heads (``qk_norm`` "all": ``HeadsRMSNorm``)."""
    if cfg.qk_norm == "all":
        return HeadsRMSNorm(heads, cfg.head_dim, cfg.norm_eps, ctx.tp, dtype=ctx.dtype, device=ctx.device)
    norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_unit_offset, dtype=ctx.dtype, device=ctx.device)
    mark_tp_partial_grad(norm.weight, ctx.tp)
    return norm


def rope_params(cfg: ModelConfig, local: bool = False) -> tuple[float, dict]:
    """(base, scaling dict) of the global layers, or of the local ones (``cfg.rope_local`` when set)."""
    if local and cfg.rope_local is not None:
        sc = dict(cfg.rope_local)
        return float(sc.pop("rope_theta", cfg.rope_theta)), sc
    return cfg.rope_theta, dict(cfg.rope_scaling or {})


def rope_inv_freq(cfg: ModelConfig, seq_len: int, local: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies, with HF-compatible 'linear', 'dynamic' and 'llama3' scaling; ``local``:
    a local layer's (``rope_params``)."""
    d = cfg.rotary_dim
    base, sc = rope_params(cfg, local)
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
    elif kind == "yarn":
        inv = _yarn_inv_freq(
            inv, base, d, sc, sc.get("factor") or cfg.max_seq_len / sc["original_max_position_embeddings"]
        )
    elif kind == "longrope":  # the long factors once the sequence outgrows the pretraining length
        long = seq_len > sc["original_max_position_embeddings"]
        factors = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv = inv / factors
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return inv.float()


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
"""The RoPE scalings mt3d computes, as transformers' ``modeling_rope_utils`` defines them."""


def _yarn_inv_freq(inv: torch.Tensor, base: float, d: int, sc: dict, factor: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023): each frequency interpolated by ``factor`` or kept (extrapolated),
    with a linear ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
    pretraining length (bounds floored/ceiled unless ``truncate`` is false)."""
    old = sc["original_max_position_embeddings"]
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).double()
    keep = 1 - ramp  # 1: extrapolated (high frequencies), 0: interpolated
    return inv / factor * (1 - keep) + inv * keep


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """The factor YaRN and longrope put on cos and sin (1 for the other scalings): ``attention_factor``
    when given; YaRN's 0.1 ln(factor) + 1 (with DeepSeek's mscale / mscale_all_dim ratio when both are
    given); longrope's sqrt(1 + ln(factor) / ln(original length))."""
    _, sc = rope_params(cfg, local)
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    old = sc["original_max_position_embeddings"]
    factor = sc.get("factor") or cfg.max_seq_len / old
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return yarn_mscale(factor, sc["mscale"]) / yarn_mscale(factor, sc["mscale_all_dim"])
    return yarn_mscale(factor)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention temperature for a scaling ``factor``: 0.1 m ln(factor) + 1 (1 when not scaled)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension (the HF/Llama RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` [..., head_dim] with tables [..., d]: the first d dims rotated (rotate-half pairs),
    the rest passed through (``ModelConfig.rotary_fraction``; d = head_dim: all of them)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :d], x[..., d:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)


def rope_cos_sin(
    cfg: ModelConfig, positions: torch.Tensor, seq_len: int | None, dtype, local: bool = False
) -> tuple:
    """cos/sin tables [s, head_dim] for positions [s]; [b, 1, s, head_dim] for per-sample positions
    [b, s] (packed documents), which broadcast over the heads of [b, heads, s, head_dim]; ``local``: a
    local layer's tables (``rope_params``). ``seq_len`` None: the largest position + 1 (packed documents:
    the longest document, as transformers picks dynamic and longrope frequencies from position ids),
    read only by the scalings that depend on it."""
    if seq_len is None:
        sc = rope_params(cfg, local)[1]
        kind = sc.get("rope_type", sc.get("type", "default"))
        seq_len = int(positions.max()) + 1 if kind in ("dynamic", "longrope") else 0
    inv = rope_inv_freq(cfg, seq_len, local).to(positions.device)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:
        emb = emb.unsqueeze(1)
    scale = rope_attention_factor(cfg, local)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTables:
    """What an attention layer needs of RoPE (with ``cfg``, ``ctx`` and ``local``, its layer type)."""

    def rope_tables(self, s: int, past: int, documents, like: torch.Tensor) -> tuple:
        """(cos, sin) of these ``s`` positions (after ``past`` cached ones; packed documents: restarting at
        each), or (None, None) without RoPE. Training sees the same (length, device, dtype) every step:
        the tables are built once and kept on the module rather than on the host in every layer of
        every micro-batch (a host-device copy each time)."""
        if self.cfg.position != "rope":
            return None, None
        if documents is not None:  # positions restart at every document
            pos = self.ctx.document_positions(documents, s)
            return rope_cos_sin(self.cfg, pos, None, like.dtype, self.local)
        key = (past, s, like.device, like.dtype)
        if getattr(self, "_rope_key", None) != key:
            pos = self.ctx.positions(s, past, like.device)
            self._rope_tables = rope_cos_sin(
                self.cfg, pos, past + s * self.ctx.cp_size, like.dtype, self.local
            )
            self._rope_key = key
        return self._rope_tables
