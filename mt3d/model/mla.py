"""Multi-head latent attention (DeepSeek-V2/V3, transformers' ``DeepseekV3Attention``).

Keys and values come from a compressed latent: ``kv_a`` projects the hidden state to kv_lora_rank
latent columns (RMS-normalised) and qk_rope_head_dim rotary columns (one rotary key shared by every
head); ``kv_b`` expands the latent into each head's position-free key part and its value. Queries
come from the hidden state, or through their own normalised latent (``q_a``, ``q_b``) when
``q_lora_rank`` is set. Query and key heads are [position-free | rotary] (qk_nope + qk_rope wide), the
values v_head_dim wide; the kernels take the values zero-padded to the query width (cut off after),
so every attention kernel and exchange applies unchanged. The softmax scale is head_dim^-0.5 times
YaRN's mscale(factor, mscale_all_dim)^2 where the RoPE scaling gives one (DeepSeek's rule).

Tensor parallelism splits the heads: ``q``/``q_b``, ``kv_b`` column-parallel, the output row-parallel.
The down projections (``q_a``, ``kv_a``) are replicated, computed by every TP rank on its tokens (its
sequence shard with SP): what enters the TP region is the latent, not the hidden state: with SP it is
the latent that is all-gathered (kv_lora_rank + qk_rope_head_dim = 576 columns in DeepSeek-V3, against
7168 hidden ones), and its gradient reduce-scattered; without SP the latent's gradient is all-reduced
(each rank's heads give part of it).

Context parallelism moves the same latent: each cp rank gathers the compressed latent (and roped
shared key) of the whole sequence, 576 values per token, and expands it with its own ``kv_b`` heads,
where exchanging expanded keys and values would move heads x (qk + v) per token (40960 at DeepSeek-V3's
128 heads; the all-to-all of Ulysses moves q, k, v and the output, heads / cp each). The expansion is
then done cp times over (a GEMM of kv_lora_rank x heads/tp x (qk_nope + v) per token, small beside the
attention itself). Generation caches the latent, not the expanded keys and values (DeepSeek's cache).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

from ..parallel import context
from ..parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from ..parallel.mappings import copy_to_tp, gather_from_sequence
from .attention import attend
from .logit_max import LogitMax, logit_record
from .norms import RopeTables, make_norm, rope_params, rotate_half, yarn_mscale

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps."""


def softmax_scale(cfg) -> float:
    """head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a RoPE scaling that sets it."""
    scale = cfg.head_dim**-0.5
    _, sc = rope_params(cfg)
    if sc.get("rope_type", sc.get("type", "default")) != "default" and sc.get("mscale_all_dim"):
        scale *= yarn_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(RopeTables, nn.Module):
    """Causal multi-head latent attention; global layers only."""

    def __init__(self, cfg, ctx, layer: int) -> None:
        super().__init__()
        tp = ctx.tp.size
        cfg.check_parallel(tp, 1)
        spec = self.spec = cfg.mla_spec
        self.cfg, self.ctx = cfg, ctx
        self.heads = cfg.heads // tp
        self.local = False  # global layers only (RopeTables reads it)
        self.scale = softmax_scale(cfg)
        self.logit_max: LogitMax | None = None  # QK-clip's (``mt3d.training.qk_clip``)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.layers)
        common = dict(tp=ctx.tp, dtype=ctx.dtype, device=ctx.device)
        column = dict(
            bias=False, sequence_parallel=ctx.sp, keep_gathered=ctx.keep_gathered, gemms=ctx.gemms(layer)
        )
        qk = spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q = ColumnParallelLinear(cfg.hidden, cfg.heads * qk, init=ctx.init(layer, "attn.q", std),
                                          **column, **common)  # fmt: skip
        else:
            r = spec.q_lora_rank
            self.q_a = ReplicatedLinear(cfg.hidden, r, bias=cfg.qkv_bias, sequence_parallel=ctx.sp,
                                        init=ctx.init(layer, "attn.q_a", std), **common)  # fmt: skip
            self.q_a_norm = make_norm(cfg, ctx, r, LATENT_NORM_EPS)
            self.q_b = ColumnParallelLinear(r, cfg.heads * qk, init=ctx.init(layer, "attn.q_b", std),
                                            **column, **common)  # fmt: skip
        width = spec.kv_lora_rank + spec.qk_rope_head_dim
        self.kv_a = ReplicatedLinear(cfg.hidden, width, bias=cfg.qkv_bias, sequence_parallel=ctx.sp,
                                     init=ctx.init(layer, "attn.kv_a", std), **common)  # fmt: skip
        self.kv_a_norm = make_norm(cfg, ctx, spec.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b = ColumnParallelLinear(
            spec.kv_lora_rank, cfg.heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False,
            init=ctx.init(layer, "attn.kv_b", std), gemms=ctx.gemms(layer), **common,
        )  # fmt: skip
        self.out = RowParallelLinear(cfg.heads * spec.v_head_dim, cfg.hidden, bias=cfg.bias,
                                     sequence_parallel=ctx.sp, init=ctx.init(layer, "attn.out", out_std),
                                     gemms=ctx.gemms(layer), **common)  # fmt: skip

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip's row factors for head factors ``gamma`` [heads] (``mt3d.training.qk_clip``): each
        head's position-free query and key rows times sqrt(gamma), its rotary query rows times gamma;
        values and the shared rotary key unchanged."""
        spec, root = self.spec, gamma.sqrt()[:, None]
        q = torch.cat(
            [root.expand(-1, spec.qk_nope_head_dim), gamma[:, None].expand(-1, spec.qk_rope_head_dim)], 1
        )
        kv = torch.cat(
            [root.expand(-1, spec.qk_nope_head_dim), torch.ones_like(root).expand(-1, spec.v_head_dim)], 1
        )
        proj = self.q if spec.q_lora_rank is None else self.q_b
        return [(proj.weight, q.reshape(-1)), (self.kv_b.weight, kv.reshape(-1))]

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """RoPE on the rotary columns; DeepSeek's interleaved pairs are first put in rotate_half's order
        (the same permutation of queries and keys: their products are unchanged)."""
        if self.spec.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x * cos + rotate_half(x) * sin

    def forward(self, x: torch.Tensor, cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x: [b, s, h] (SP: [b, s/tp, h]) -> [b, s, h] (SP: its shard)."""
        spec, tp, cp = self.spec, self.ctx.tp, self.ctx.cp
        q = self.q(x) if spec.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x)))
        b, s, _ = q.shape
        latent, k_rot = self.kv_a(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        lat = torch.cat([self.kv_a_norm(latent), k_rot], dim=-1)
        lat = gather_from_sequence(lat, tp) if self.ctx.sp else copy_to_tp(lat, tp)  # the TP region
        past = cache.length if cache is not None else 0
        cos, sin = self.rope_tables(s, past, documents, q)
        q = q.view(b, s, self.heads, spec.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self._rotate(q_rot, cos, sin)], dim=-1)
        latent, k_rot = lat.unsqueeze(1).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        lat = torch.cat([latent, self._rotate(k_rot, cos, sin)], dim=-1)  # [b, 1, s, r + rope]
        k_start = past
        if cache is not None:  # the cache holds the latent (and the roped shared key)
            lat, _, k_start = cache.update(self, lat, lat[..., :0])
        elif self.ctx.cp_size > 1:
            lat = context.gather_sequence(lat, cp)
        latent, k_rot = lat.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        kv = self.kv_b.local(latent.squeeze(1))  # [b, t, heads/tp * (nope + v)]
        t = kv.shape[1]
        kv = kv.view(b, t, self.heads, spec.qk_nope_head_dim + spec.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.heads, -1, -1)], dim=-1)
        v = nn.functional.pad(v, (0, spec.qk_head_dim - spec.v_head_dim))
        drop = self.cfg.attention_dropout if self.training else 0.0
        record = logit_record(self, cache)
        with self.ctx.tp_region_rng() if drop > 0 else contextlib.nullcontext():
            if self.ctx.cp_size > 1 and cache is None:
                kernel = functools.partial(attend, documents=documents)
                o = context.attention(q, k, v, cp, "whole", pattern=None, scale=self.scale, softcap=None,
                                      dropout=drop, attend=kernel, record=record)  # fmt: skip
            else:
                o = attend(q, k, v, pattern=None, scale=self.scale, dropout=drop, q_start=past,
                           k_start=k_start, documents=documents, record=record)  # fmt: skip
        o = o[..., : spec.v_head_dim].transpose(1, 2).reshape(b, s, self.heads * spec.v_head_dim)
        return self.out(o)
