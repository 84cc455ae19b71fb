"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5 (transformers'
``Qwen3NextGatedDeltaNet``), heads split over tensor parallelism.

Per value head, a state S (key_head_dim x value_head_dim) is carried along the sequence. Token t
decays it by exp(g_t) and writes its value with the delta rule (the part the state already predicts
for its key is replaced, at rate beta_t), and reads it with its query::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

with q and k L2-normalised per head (q also times key_head_dim^-0.5), beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias). q, k, v first pass a short causal depthwise convolution
(``conv_kernel`` taps, SiLU); the output is normalised per head and gated by SiLU(z) (``GatedRMSNorm``)
before the output projection. Key heads are fewer than value heads: each key head serves
value_heads / key_heads consecutive value heads.

``gated_delta_rule`` computes the recurrence in chunks (default 64 tokens): inside a chunk the updates
are solved at once as a unit lower-triangular system (the WY form of a product of Householder-like
factors: T = I + strictly_lower((beta k) k^T * decay gaps)), so only one state update per chunk is
sequential. It takes and returns the state, so a sequence can be continued (generation, context
parallelism).

Layout and tensor parallelism: ``in_qkvz`` holds, per key head, [q, k, v of its value heads, z of its
value heads] (HF's ``in_proj_qkvz``), and ``in_ba`` per key head [b, a of its value heads]
(``in_proj_ba``), so a contiguous split of their rows over tp gives each rank whole key heads with their
value heads: both are column-parallel without parts. The convolution's channels are [q of all heads, k
of all heads, v of all heads] (three parts split each), ``dt_bias`` and ``A_log`` one per value head;
the gated norm's weight (value_head_dim) is shared by every head, its gradient summed over tp; the
output projection is row-parallel. tp must divide the key heads.

Packed documents (``documents``): the convolution window and the state restart at every document
start, so a packed sequence equals its documents run one at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.fp8 import PLAIN
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_tp
from ..parallel.marks import mark_tp_partial_grad
from .options import ModelConfigError, option_fields

LINEAR, FULL = "linear_attention", "full_attention"
"""HF's ``layer_types`` names."""
CHUNK = 64
"""Tokens per chunk of ``gated_delta_rule`` (the fla kernels' and transformers' size)."""


@dataclass(frozen=True)
class GdnSpec:
    """A Gated DeltaNet layer's shape (HF's ``linear_*`` keys)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    fused: bool = True
    """Qwen3-Next's projections (``in_qkvz`` and ``in_ba``, laid out per key head); False: Qwen3.5's
    (``in_qkv`` [q, k, v of all heads], ``in_z``, ``in_b``, ``in_a``)."""
    full_every: int | None = None
    """Every full_every-th block keeps full attention (HF's ``full_attention_interval``: 4)."""
    layer_types: tuple[str, ...] | None = None
    """Per block, HF's 'linear_attention' or 'full_attention' (instead of ``full_every``)."""

    @classmethod
    def parse(cls, d: dict) -> GdnSpec:
        """``model.linear_attention`` (one-line errors naming the key)."""
        kw = option_fields(
            cls, d, "linear_attention", ("key_heads", "value_heads", "key_head_dim", "value_head_dim")
        )
        if kw.get("layer_types") is not None:
            kw["layer_types"] = tuple(kw["layer_types"])
        spec = cls(**kw)
        spec.check()
        return spec

    def parallel_conflict(self, tp: int, cp: int = 1, seq_len: int | None = None) -> str | None:
        """Why these layers cannot run at tensor parallelism ``tp`` and context parallelism ``cp`` on
        sequences of ``seq_len`` (None: they can): the one rule ``mt3d train`` and the planner apply."""
        if self.key_heads % tp:
            return f"tensor parallelism {tp} must divide the linear-attention key heads ({self.key_heads})"
        if cp > 1 and seq_len is not None and seq_len // (2 * cp) < self.conv_kernel - 1:
            return (
                f"context parallelism {cp} cuts {seq_len} tokens into chunks of {seq_len // (2 * cp)}, "
                f"shorter than the linear attention's convolution reads ({self.conv_kernel - 1} tokens "
                "before each): use a lower cp or longer sequences"
            )
        return None

    def params(self, hidden: int) -> int:
        """Parameters of one layer: the projections, the convolution, A_log, dt_bias, the gated norm."""
        qkvz, ba, conv = (
            2 * self.key_dim + 2 * self.value_dim,
            2 * self.value_heads,
            2 * self.key_dim + self.value_dim,
        )
        return (
            hidden * (qkvz + ba)
            + conv * self.conv_kernel
            + 2 * self.value_heads
            + self.value_head_dim
            + (self.value_dim * hidden)
        )

    def weight_flops(self, hidden: int) -> float:
        """Forward FLOPs per token of the layer's projections and convolution."""
        qkvz, ba, conv = (
            2 * self.key_dim + 2 * self.value_dim,
            2 * self.value_heads,
            2 * self.key_dim + self.value_dim,
        )
        return 2 * (hidden * (qkvz + ba) + self.value_dim * hidden + conv * self.conv_kernel)

    def core_flops(self, chunk: int = CHUNK) -> float:
        """Forward FLOPs per token of ``gated_delta_rule`` per the products it computes, per value head:
        (beta k) k^T and q k^T over its chunk (2 C dk), the two triangular solves (C (dk + dv) / 2), the
        chunk's outputs over its keys (C dv), and three products with the state (3 dk dv)."""
        dk, dv, c = self.key_head_dim, self.value_head_dim, chunk
        return self.value_heads * 2 * (2 * c * dk + c * (dk + dv) / 2 + c * dv + 3 * dk * dv)

    def widths(self, tp: int = 1) -> tuple[float, float]:
        """(input, output) widths of one TP rank's projections per token (``ModelConfig.attn_widths``):
        q, k, v, z, beta and a in, the values out."""
        return (2 * self.key_dim + 2 * self.value_dim + 2 * self.value_heads) / tp, self.value_dim / tp

    def activation_width(self, tp: int = 1, chunk: int = CHUNK) -> float:
        """Per token, the elements one TP rank keeps for the backward (``ModelConfig.attn_activation_width``)
        in mt3d's torch path, counted off its saved tensors: the q/k/v/z projection's output (2 kd + 2 vd),
        the convolution's input, pre-activation and output (2 kd + vd each), beta and the decay (3 per
        value head) and q/k's norms (2 per key head); per value head inside the chunked rule five chunk-
        wide matrices, ten dk- and three dv-wide tensors and the chunk states (dk dv / C); five vd-wide
        tensors in the gated norm and the output projection's input. Held against saved-tensor hooks on
        ten shapes: -16% to +5% (tests/test_gdn.py)."""
        kh, vh = self.key_heads / tp, self.value_heads / tp
        dk, dv, c = self.key_head_dim, self.value_head_dim, chunk
        kd, vd = kh * dk, vh * dv
        projections = 2 * kd + 2 * vd + 3 * (2 * kd + vd) + 3 * vh + 2 * kh
        return projections + vh * (5 * c + 10 * dk + 3 * dv + dk * dv / c) + 5 * vd

    def linear(self, layer: int) -> bool:
        """Whether block ``layer`` is a Gated DeltaNet layer (else full attention)."""
        if self.layer_types is not None:
            return self.layer_types[layer] == LINEAR
        return self.full_every is None or (layer + 1) % self.full_every != 0

    def check_layers(self, layers: int) -> None:
        """Raise ModelConfigError when the layer pattern does not fit ``layers`` blocks."""
        kinds = self.layer_types
        if kinds is not None and (len(kinds) != layers or set(kinds) - {LINEAR, FULL}):
            raise ModelConfigError(
                f"model.linear_attention.layer_types must list {layers} of {LINEAR!r} / {FULL!r}, got "
                f"{list(kinds)}"
            )

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.value_heads // self.key_heads

    @property
    def key_dim(self) -> int:
        """Query (and key) channels of all heads."""
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Value channels of all heads."""
        return self.value_heads * self.value_head_dim

    def check(self, tp: int = 1) -> None:
        """Raise ModelConfigError when the shape cannot run (at ``tp``)."""
        if not isinstance(self.fused, bool):
            raise ModelConfigError(f"model.linear_attention.fused must be true or false, got {self.fused!r}")
        if self.full_every is not None and self.layer_types is not None:
            raise ModelConfigError("model.linear_attention: give full_every or layer_types, not both")
        for key in (
            "key_heads",
            "value_heads",
            "key_head_dim",
            "value_head_dim",
            "conv_kernel",
            "full_every",
        ):
            value = getattr(self, key)
            if value is None and key == "full_every":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(
                    f"model.linear_attention.{key} must be a positive integer, got {value!r}"
                )
        if self.value_heads % self.key_heads:
            raise ModelConfigError(
                f"model.linear_attention.value_heads {self.value_heads} must be a multiple of key_heads "
                f"{self.key_heads}"
            )
        why = self.parallel_conflict(tp)
        if why:
            raise ModelConfigError(why)


def per_kind(cfg, full, linear):
    """A per-block figure of ``cfg`` averaged over its blocks: ``full`` for attention blocks and
    ``linear(gdn_spec)`` for Gated DeltaNet ones (a number or a tuple of numbers)."""
    spec = cfg.gdn_spec
    if spec is None:
        return full
    share = cfg.linear_blocks / cfg.layers
    other = linear(spec)
    if isinstance(full, tuple):
        return tuple((1 - share) * a + share * b for a, b in zip(full, other, strict=True))
    return (1 - share) * full + share * other


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' form)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """The gated delta rule over a sequence in fp32 (fp64 inputs in fp64): q, k [b, h, t, dk] (normalised
    and scaled), v [b, h, t, dv], g (log decay, <= 0) and beta [b, h, t]; ``state`` [b, h, dk, dv] the
    state before the first token (None: zeros). Returns the outputs [b, h, t, dv] and the state after the
    last token."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    f = torch.promote_types(q.dtype, torch.float32)
    pad = (-t) % chunk  # padded tokens write nothing (beta 0) and decay nothing (g 0)
    q, k, v = (F.pad(x.to(f), (0, 0, 0, pad)).view(b, h, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x.to(f), (0, pad)).view(b, h, -1, chunk) for x in (g, beta))
    decay = g.cumsum(-1)  # log decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gaps = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, -math.inf).exp()
    kb = k * beta[..., None]
    # the chunk's updates at once: T u = beta v, T w = beta k exp(decay), T unit lower triangular
    system = (kb @ k.transpose(-1, -2) * gaps).tril(-1) + torch.eye(chunk, dtype=f, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * gaps  # each query over its chunk's keys up to itself
    q_in = q * decay.exp()[..., None]  # reading the state of the chunk's start
    k_out = k * (decay[..., -1:] - decay).exp()[..., None]  # writing the state of the chunk's end
    fade = decay[..., -1].exp()[..., None, None]
    s = torch.zeros(b, h, dk, dv, dtype=f, device=q.device) if state is None else state.to(f)
    outs = []
    for i in range(q.shape[2]):
        fresh = u[:, :, i] - w[:, :, i] @ s  # what the chunk writes, less what the state already predicts
        outs.append(q_in[:, :, i] @ s + inner[:, :, i] @ fresh)
        s = s * fade[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ fresh
    out = torch.stack(outs, dim=2).view(b, h, -1, dv)[:, :, :t]
    return out, s


def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution with SiLU: x [b, t, c], weight [c, 1, taps] -> [b, t, c]."""
    taps = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, padding=taps - 1, groups=x.shape[2])
    return F.silu(y[..., : x.shape[1]]).transpose(1, 2).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight shared by all heads), then times SiLU(z) (HF's
    ``Qwen3NextRMSNormGated``: the norm in fp32, the weight applied in the input's dtype)."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z [..., dim]."""
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * y.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (module docstring) in place of attention: [b, s, h] -> [b, s, h] (with
    sequence parallelism the rank's sequence shard in and out)."""

    def __init__(self, spec: GdnSpec, cfg, ctx, layer: int) -> None:
        super().__init__()
        tp = ctx.tp.size
        spec.check(tp)
        self.spec, self.ctx = spec, ctx
        self.key_heads, self.value_heads = spec.key_heads // tp, spec.value_heads // tp
        # train.fp8 reaches the q/k/v/z projections and the output (rules.fp8_shape_conflict checks their
        # widths); beta's and the decay's, a few columns per value head, stay in the parameters' dtype
        common = dict(tp=ctx.tp, dtype=ctx.dtype, device=ctx.device, gemms=ctx.gemms(layer))
        std = cfg.init_std
        parts = (spec.key_dim, spec.key_dim, spec.value_dim)

        def column(name: str, width: int, split=None, gemms=common["gemms"]) -> ColumnParallelLinear:
            init = ctx.init(layer, f"gdn.{name}", std)
            return ColumnParallelLinear(cfg.hidden, width, bias=False, sequence_parallel=ctx.sp,
                                        keep_gathered=ctx.keep_gathered, init=init, parts=split,
                                        **{**common, "gemms": gemms})  # fmt: skip

        if spec.fused:  # per key head: [q, k, v, z] and [b, a] of its value heads (rows split contiguously)
            self.in_qkvz = column("qkvz", 2 * spec.key_dim + 2 * spec.value_dim)
            self.in_ba = column("ba", 2 * spec.value_heads, gemms=PLAIN)
        else:
            self.in_qkv, self.in_z = column("qkv", sum(parts), parts), column("z", spec.value_dim)
            self.in_qkv.weight.one_matrix = True  # one HF matrix (Muon's unit); the parts are TP's split
            self.in_b, self.in_a = (
                column("b", spec.value_heads, gemms=PLAIN),
                column("a", spec.value_heads, gemms=PLAIN),
            )
        init = ctx.init(layer, "gdn.conv", spec.conv_kernel**-0.5)
        r = ctx.tp.rank
        conv = [init.part(i).rows(r * n // tp, (r + 1) * n // tp, spec.conv_kernel, ctx.dtype)
                for i, n in enumerate(parts)]  # fmt: skip
        self.conv = mark_tp(
            nn.Parameter(torch.cat(conv).unsqueeze(1).to(ctx.device)), 0, parts
        )  # HF's [c, 1, taps]
        heads = slice(ctx.tp.rank * self.value_heads, (ctx.tp.rank + 1) * self.value_heads)
        a = torch.log(1 + 15 * (torch.arange(spec.value_heads) + 0.5) / spec.value_heads)  # A in (1, 16)
        self.A_log = mark_tp(nn.Parameter(a[heads].to(ctx.dtype).to(ctx.device)), 0)
        self.dt_bias = mark_tp(
            nn.Parameter(torch.ones(self.value_heads, dtype=ctx.dtype, device=ctx.device)), 0
        )
        self.norm = GatedRMSNorm(spec.value_head_dim, cfg.norm_eps, ctx.dtype, ctx.device)
        mark_tp_partial_grad(self.norm.weight, ctx.tp)
        self.out = RowParallelLinear(
            spec.value_dim, cfg.hidden, bias=False, sequence_parallel=ctx.sp,
            init=ctx.init(layer, "gdn.out", std / math.sqrt(2 * cfg.layers)), **common,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] (SP: [b, s / tp, h]); ``documents`` [b, s]: packed samples' document index of every
        position; ``cache`` (generation, ``inference.KVCache``): continue from the cached convolution tail
        and state, and cache them again."""
        spec, vh = self.spec, self.value_heads
        mixed, z, beta, a = self._project(x)
        b, s, _ = mixed.shape
        beta = beta.reshape(b, s, vh).sigmoid()
        f = torch.promote_types(a.dtype, torch.float32)  # fp32 as transformers (fp64 kept)
        g = -self.A_log.to(f).exp() * F.softplus(a.reshape(b, s, vh).to(f) + self.dt_bias)
        if cache is not None:
            o = cache.step(self, lambda tail, state: self._continue(mixed, g, beta, tail, state))
        elif self.ctx.cp_size > 1:
            from .gdn_context import context_mix

            o = context_mix(self, mixed, g, beta, documents, self.ctx.cp)
        elif documents is None:  # the whole batch at once
            o = self.run(mixed, g, beta)[0]
        else:
            spans = _spans(documents)
            outs = [self.run(mixed[i : i + 1, lo:hi], g[i : i + 1, lo:hi], beta[i : i + 1, lo:hi])[0]
                    for i, lo, hi in spans]  # fmt: skip
            o = outs[0] if len(outs) == 1 else _join(outs, spans, b)
        o = self.norm(o.view(b, s, vh, spec.value_head_dim), z.reshape(b, s, vh, spec.value_head_dim))
        return self.out(o.reshape(b, s, -1))

    def _project(self, x: torch.Tensor):
        """(q, k, v of all the rank's heads [b, s, conv channels], z, b, a), from either layout."""
        spec, kh = self.spec, self.key_heads
        if not spec.fused:
            return self.in_qkv(x), self.in_z(x), self.in_b(x), self.in_a(x)
        qkvz, ba = self.in_qkvz(x), self.in_ba(x)
        b, s, _ = qkvz.shape
        q, k, v, z = qkvz.view(b, s, kh, -1).split(
            [spec.key_head_dim] * 2 + [spec.group * spec.value_head_dim] * 2, -1
        )
        beta, a = ba.view(b, s, kh, 2 * spec.group).split([spec.group] * 2, dim=-1)
        return torch.cat([t.reshape(b, s, -1) for t in (q, k, v)], dim=-1), z, beta, a

    def _continue(self, mixed, g, beta, tail, state):
        """Generation: the rows [b, t, channels] from their cached convolution tails and states (None: the
        sequences start here); returns (outputs, the new tails, the new states)."""
        keep = self.spec.conv_kernel - 1
        o, final = self.run(mixed, g, beta, tail, state)
        seen = mixed if tail is None else torch.cat([tail, mixed], dim=1)
        padded = F.pad(seen, (0, 0, max(0, keep - seen.shape[1]), 0))  # zeros: the conv's own padding
        return o, padded[:, padded.shape[1] - keep :], final

    def run(self, mixed, g, beta, prefix=None, state=None, transition: bool = False):
        """Tokens [b, t, conv channels] (each row one document or sequence) through the convolution
        (after ``prefix`` [b, p, channels]: the rows' tokens before them, which only feed the
        convolution) and the delta rule from ``state`` [b, value heads, dk, dv] (None: zeros). Returns
        (the outputs [b, t, value heads, dv], the state after the last token, and with ``transition`` the
        linear map M of the state through these tokens [b, value heads, dk, dk]: final = M state + final
        from zero)."""
        spec, kh, vh = self.spec, self.key_heads, self.value_heads
        b, t = mixed.shape[:2]
        conv = short_conv(mixed if prefix is None else torch.cat([prefix, mixed], dim=1), self.conv)[:, -t:]
        q, k, v = conv.split([kh * spec.key_head_dim] * 2 + [vh * spec.value_head_dim], -1)
        f = torch.promote_types(conv.dtype, torch.float32)  # as the rule: fp32, fp64 kept
        q, k = (l2_normalize(x.to(f).view(b, t, kh, -1)).repeat_interleave(spec.group, 2) for x in (q, k))
        q = q * spec.key_head_dim**-0.5
        heads = lambda x: x.transpose(1, 2)  # noqa: E731 - [b, t, h, d] -> [b, h, t, d]
        q, k, v, g, beta = heads(q), heads(k), heads(v.view(b, t, vh, -1)), heads(g), heads(beta)
        o, final = gated_delta_rule(q, k, v, g, beta, state)
        out = (o.transpose(1, 2).to(mixed.dtype), final)
        if transition:  # the state is linear in its start: from I with zero values, the end is M
            eye = torch.eye(spec.key_head_dim, dtype=final.dtype, device=final.device).expand(b, vh, -1, -1)
            out += (gated_delta_rule(q, k, torch.zeros_like(k), g, beta, eye)[1],)
        return out


def _spans(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """(sample, start, end) of every document run, padding (-1) included (its rows are never read)."""
    from .documents import document_spans

    return [(i, lo, hi) for i, row in enumerate(document_spans(documents)) for lo, hi, _ in row]


def _join(outs: list[torch.Tensor], spans, b: int) -> torch.Tensor:
    """The documents' outputs back into [b, s, ...] order (spans are in sample, then position, order)."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
    for o, (i, _, _) in zip(outs, spans, strict=True):
        rows[i].append(o)
    return torch.cat([torch.cat(r, dim=1) for r in rows], dim=0)
