"""Transformer math: norms, RoPE, attention, MLP, blocks, embeddings and the LM head.

Written once for every family (the options are ModelConfig fields; attention kernels and masks live
in ``attention.py``) with tensor parallelism injected through
a ``BuildContext``: with a one-rank TP group every layer is the plain single-process model, which
is the reference the parallel runs are compared against. Activations are ``[batch, seq, hidden]``;
with sequence parallelism the residual stream between blocks is a sequence shard
``[batch, seq/tp, hidden]``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import context
from ..parallel.fp8 import PLAIN, Gemms, gemms_for
from ..parallel.layers import (
    ColumnParallelLinear,
    NoInit,
    NormalInit,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_linear,
    mark_sequence_parallel,
    mark_tp,
    mark_tp_partial_grad,
    mark_vocab,
    pad_vocab,
)
from ..parallel.mappings import copy_to_tp, gather_from_sequence
from ..parallel.random import RNGTracker, checkpoint
from ..parallel.state import AxisGroup
from .attention import attend
from .config import GATED_MLPS, ModelConfig
from .tiled import tile_count, tiled


@dataclass(frozen=True)
class BuildContext:
    """What a layer needs to know about parallelism and initialisation; passed explicitly.

    Attributes:
        tp: the tensor-parallel group (``AxisGroup.alone`` for the single-process model).
        seed: base seed of the weight init; every parameter's stream is derived from
            (seed, layer index, parameter name), so any layout starts from the same weights.
        sequence_parallel: shard the residual stream over the sequence between TP regions.
        tracker: TP-aware RNG for dropout inside TP regions (None: dropout uses default RNG).
        vocab_multiple: pad the vocabulary to a multiple of this times tp.
        dtype, device: of the parameters.
        skip_init: leave weights uninitialised (they are about to be loaded from a checkpoint).
        cp: the context-parallel group (None or one rank: each rank holds whole sequences).
        cp_exchange: how attention reaches the other cp ranks' tokens (``parallel.context``).
        tile_len: run the MLP and the loss over at most this many sequence positions at a time
            (``train.recompute.tile_len``; 0: whole sequences). The LM head then returns its
            (gathered) input and weight instead of logits, and ``LossFn`` projects tile by tile.
        ep: the expert-parallel group (None or one rank: every rank holds every expert).
        keep_gathered: with sequence parallelism, column-parallel linears keep their all-gathered
            input for the backward instead of the 1/tp shard (``train.recompute.gathered_sp_inputs``).
        selective: recompute the attention core and the MLP's activation in the backward
            (``train.recompute.granularity`` selective).
        fp8: the FP8 recipe of the blocks' column- and row-parallel linears (``train.fp8``; None:
            their GEMMs in the parameters' dtype); ``fp8_all_gather``: with SP, all-gather the
            column-parallel inputs in FP8; ``fp8_skip``: block indices whose linears stay plain.
    """

    tp: AxisGroup
    seed: int = 1234
    sequence_parallel: bool = False
    tracker: RNGTracker | None = field(default=None, compare=False)
    vocab_multiple: int = 128
    dtype: torch.dtype = torch.float32
    device: str | None = None
    skip_init: bool = False
    cp: AxisGroup | None = None
    cp_exchange: str = "auto"
    tile_len: int = 0
    ep: AxisGroup | None = None
    keep_gathered: bool = False
    selective: bool = False
    fp8: str | None = None
    fp8_all_gather: bool = False
    fp8_skip: frozenset[int] = frozenset()

    def init(self, layer: int, name: str, std: float) -> NormalInit | NoInit:
        """The init of one parameter, independent of the layout."""
        if self.skip_init:
            return NoInit()
        return NormalInit(std, (self.seed * 1_000_003 + layer * 7919 + zlib.crc32(name.encode())) % 2**61)

    def gemms(self, layer: int) -> Gemms:
        """How block ``layer``'s column- and row-parallel linears run their GEMMs."""
        if self.fp8 is None or layer in self.fp8_skip:
            return PLAIN
        return gemms_for(self.fp8, self.fp8_all_gather and self.sp)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually in effect (needs tp > 1)."""
        return self.sequence_parallel and self.tp.size > 1

    def tp_region_rng(self):
        """Context for random ops whose result must differ per TP rank."""
        return self.tracker.fork() if self.tracker is not None else contextlib.nullcontext()

    @property
    def cp_size(self) -> int:
        """Context-parallel degree (1: whole sequences)."""
        return self.cp.size if self.cp is not None else 1

    def positions(self, local_len: int, offset: int = 0, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens (its cp chunks; ``offset`` + arange
        without context parallelism)."""
        if self.cp_size == 1:
            return torch.arange(offset, offset + local_len, device=device)
        from ..parallel.context import local_positions

        return local_positions(self.cp, local_len, device)


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
    """cos/sin tables [s, head_dim] for the given positions."""
    inv = rope_inv_freq(cfg, seq_len).to(positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Causal self-attention, global or local (``cfg.patterns[layer]``); heads and KV groups split
    over TP (QKV column-, output row-parallel). Optional q/k head norms and score soft-capping."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer: int) -> None:
        super().__init__()
        tp = ctx.tp.size
        cfg.check_parallel(tp, 1)
        self.cfg, self.ctx = cfg, ctx
        self.heads, self.kv_heads, self.head_dim = cfg.heads // tp, cfg.kv_heads // tp, cfg.head_dim
        self.pattern = cfg.patterns[layer]
        spec = cfg.attention or {}
        self.block, self.kernel = spec.get("block"), spec.get("kernel", "auto")
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.qkv = ColumnParallelLinear(
            cfg.hidden,
            cfg.q_size + 2 * cfg.kv_size,
            tp=ctx.tp,
            bias=cfg.qkv_bias,
            sequence_parallel=ctx.sp,
            keep_gathered=ctx.keep_gathered,
            init=ctx.init(layer, "attn.qkv", cfg.init_std),
            parts=(cfg.q_size, cfg.kv_size, cfg.kv_size),
            dtype=ctx.dtype,
            device=ctx.device,
            gemms=ctx.gemms(layer),
        )
        if cfg.qk_norm:
            self.q_norm, self.k_norm = make_head_norm(cfg, ctx), make_head_norm(cfg, ctx)
        self.out = RowParallelLinear(
            cfg.q_size,
            cfg.hidden,
            tp=ctx.tp,
            bias=cfg.bias,
            sequence_parallel=ctx.sp,
            init=ctx.init(layer, "attn.out", out_std),
            dtype=ctx.dtype,
            device=ctx.device,
            gemms=ctx.gemms(layer),
        )

    def _rope(self, past: int, s: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Training sees the same (length, device, dtype) every step: build the tables once rather
        # than on the host in every layer of every micro-batch (a host-device copy each time).
        key = (past, s, like.device, like.dtype)
        if getattr(self, "_rope_key", None) != key:
            pos = self.ctx.positions(s, past, like.device)
            self._rope_tables = rope_cos_sin(self.cfg, pos, past + s * self.ctx.cp_size, like.dtype)
            self._rope_key = key
        return self._rope_tables

    def cp_kind(self, local_len: int) -> str:
        """This layer's context-parallel exchange for ``local_len`` local tokens (two chunks)."""
        return context.exchange_for(
            self.ctx.cp_exchange, self.pattern, local_len // 2, self.heads, self.kv_heads, self.ctx.cp_size
        )

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """x: [b, s, h] (SP: [b, s/tp, h]); ``cache`` (generation) holds past keys/values."""
        qkv = self.qkv(x)
        past = cache.length if cache is not None else 0
        # the rotary tables are built (and cached on the module) outside the recomputed core
        tables = self._rope(past, qkv.shape[1], qkv) if self.cfg.position == "rope" else ()
        if self.ctx.selective and cache is None:  # keep qkv only; the core runs again in the backward
            rng = self.cfg.attention_dropout > 0 and self.training  # the core's only random draw
            o = checkpoint(self._core, qkv, *tables, tracker=self.ctx.tracker, tp=self.ctx.tp, rng=rng)
        else:
            o = self._core(qkv, *tables, cache=cache)
        return self.out(o)

    def _core(self, qkv: torch.Tensor, cos=None, sin=None, cache=None) -> torch.Tensor:
        """[b, s, (q + 2 kv) / tp] -> the attention output [b, s, q / tp] (positions, q/k norms, the
        exchange over cp, the kernel); ``cos``, ``sin``: the rotary tables of these positions."""
        b, s, _ = qkv.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = qkv.split([self.heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        past = cache.length if cache is not None else 0
        if self.cfg.position == "rope":
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        k_start = past
        if cache is not None:
            k, v, k_start = cache.update(self, k, v, self.pattern)
        drop = self.cfg.attention_dropout if self.training else 0.0
        kernel = functools.partial(attend, block=self.block, kernel=self.kernel)
        with self.ctx.tp_region_rng() if drop > 0 else contextlib.nullcontext():
            if self.ctx.cp_size > 1 and cache is None:
                o = context.attention(
                    q, k, v, self.ctx.cp, self.cp_kind(s), pattern=self.pattern, scale=self.scale,
                    softcap=self.cfg.attn_softcap, dropout=drop, attend=kernel,
                )  # fmt: skip
            else:
                o = kernel(q, k, v, pattern=self.pattern, scale=self.scale, softcap=self.cfg.attn_softcap,
                           dropout=drop, q_start=past, k_start=k_start)  # fmt: skip
        return o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)


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


def split_stream(x) -> tuple[torch.Tensor, tuple | None]:
    """(hidden states, router statistics or None) of a residual stream: a sparse model's stream is the
    tuple (hidden, stats_f, stats_i) (``mt3d.model.moe``), a dense model's the hidden tensor."""
    return (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, None)


def join_stream(x: torch.Tensor, stats: tuple | None):
    """The inverse of ``split_stream``."""
    return x if stats is None else (x, *stats)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))); with ``post_norms`` each
    branch output is normalised again before it joins the residual stream (Gemma 2). A sparse layer
    (``cfg.is_sparse``) has a mixture-of-experts MLP (``mt3d.model.moe``)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer: int) -> None:
        super().__init__()
        self.ctx, self.layer = ctx, layer
        self.p = cfg.hidden_dropout
        self.norm1 = make_norm(cfg, ctx)
        self.attn = Attention(cfg, ctx, layer)
        self.norm2 = make_norm(cfg, ctx)
        self.sparse = cfg.is_sparse(layer)
        if self.sparse:
            from .moe import SparseMoE

            self.mlp = SparseMoE(cfg, ctx, layer)
        else:
            self.mlp = MLP(cfg, ctx, layer)
        self.post_attn_norm = make_norm(cfg, ctx) if cfg.post_norms else None
        self.post_mlp_norm = make_norm(cfg, ctx) if cfg.post_norms else None

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        # Replicated stream: same mask on every TP rank (default RNG). With SP each rank holds
        # different positions, so it draws from its own TP-rank stream instead.
        with self.ctx.tp_region_rng() if self.ctx.sp else contextlib.nullcontext():
            return F.dropout(x, self.p, True)

    def forward(self, x, cache=None):
        """[b, s, h] -> [b, s, h] (sequence shards with SP); a sparse model's stream carries its router
        statistics along (``split_stream``)."""
        x, stats = split_stream(x)
        a = self.attn(self.norm1(x), cache)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + self._drop(a)
        if self.sparse:
            m, stats = self.mlp(self.norm2(x), stats)
        else:
            m = self.mlp(self.norm2(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return join_stream(x + self._drop(m), stats)


class WordEmbedding(nn.Module):
    """Vocab-parallel token embedding; also the tied LM head (``logits``)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, vocab_size: int) -> None:
        super().__init__()
        self.ctx, self.softcap = ctx, cfg.logit_softcap
        self.vocab_size = vocab_size
        self.embed = VocabParallelEmbedding(
            vocab_size,
            cfg.hidden,
            tp=ctx.tp,
            padded_vocab_size=pad_vocab(vocab_size, ctx.tp.size, ctx.vocab_multiple),
            sequence_parallel=ctx.sp,
            init=ctx.init(-1, "embed.word", cfg.init_std),
            dtype=ctx.dtype,
            device=ctx.device,
        )

    @property
    def weight(self) -> nn.Parameter:
        """The [V_pad/tp, h] shard."""
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [b, s, h] ([b, s/tp, h] with SP)."""
        return self.embed(ids)

    def logits(self, x):
        """Hidden states -> this rank's vocabulary slice of the logits [b, s, V_pad/tp]."""
        return lm_logits(x, self.weight, self.ctx, self.softcap)


def lm_logits(x, weight: torch.Tensor, ctx: BuildContext, softcap: float | None = None):
    """Vocab-parallel output projection (the input gradient is summed over TP), optionally
    soft-capped (``project``). With ``ctx.tile_len`` the projection is left to the loss, which runs
    it tile by tile: the result is then the pair (gathered hidden states, weight). A sparse model's
    stream gives a ``moe.Routed`` holding that result and the router statistics."""
    x, stats = split_stream(x)
    if ctx.tile_len > 0:  # the loss projects each tile of the gathered hidden states
        out = (gather_from_sequence(x, ctx.tp) if ctx.sp else copy_to_tp(x, ctx.tp), weight)
    else:
        out = cap(column_linear(x, weight, None, ctx.tp, ctx.sp), softcap)
    if stats is None:
        return out
    from .moe import Routed

    return Routed(out, *stats)


def project(x: torch.Tensor, weight: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """This rank's vocabulary slice of the logits of hidden states already in the TP region, soft-capped
    when ``softcap`` is set (``cap``)."""
    return cap(F.linear(x, weight), softcap)


def cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (elementwise, so each rank caps its own slice), or the logits as they
    are without a ``softcap``."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


class PositionsAndDropout(nn.Module):
    """After the word embedding: the sqrt(hidden) scale (Gemma), learned positions (GPT-2) and
    embedding dropout."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.ctx, self.p = ctx, cfg.hidden_dropout
        self.moe = cfg.moe_spec
        self.scale = cfg.hidden**0.5 if cfg.scale_embedding else None
        self.pos = None
        if cfg.position == "learned":
            w = ctx.init(-1, "embed.pos", cfg.init_std).rows(0, cfg.max_seq_len, cfg.hidden, ctx.dtype)
            self.pos = nn.Parameter(w.to(ctx.device))
            if ctx.sp:  # each rank adds the rows of its own positions: partial gradients
                mark_sequence_parallel(self.pos, ctx.tp)

    def forward(self, x: torch.Tensor, offset: int = 0):
        """Hidden [b, s', h] (s' = s/tp with SP) -> same shape; a sparse model's stream starts its
        router statistics here (``moe.start_stats``)."""
        x = self._embed(x, offset)
        if self.moe is None:
            return x
        from .moe import start_stats

        return (x, *start_stats(self.moe, x))

    def _embed(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        if self.scale is not None:  # rounded to the activation dtype first, as Gemma does
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if self.pos is not None:
            s = x.shape[1]
            tp = self.ctx.tp.size if self.ctx.sp else 1
            pos = self.ctx.positions(s * tp, offset, x.device)
            if tp > 1:  # this rank's sequence shard of its tokens
                pos = pos[self.ctx.tp.rank * s : (self.ctx.tp.rank + 1) * s]
            if int(pos.max()) >= self.pos.shape[0]:
                raise ValueError(
                    f"sequence of {int(pos.max()) + 1} tokens exceeds max_seq_len {self.pos.shape[0]}"
                )
            x = x + (self.pos[pos] if self.ctx.cp_size > 1 else self.pos[int(pos[0]) : int(pos[0]) + s])
        if self.training and self.p > 0:
            with self.ctx.tp_region_rng() if self.ctx.sp else contextlib.nullcontext():
                x = F.dropout(x, self.p, True)
        return x


class LMHead(nn.Module):
    """Untied output projection, vocabulary split over TP (padded rows zero)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, vocab_size: int) -> None:
        super().__init__()
        self.ctx, self.softcap = ctx, cfg.logit_softcap
        padded = pad_vocab(vocab_size, ctx.tp.size, ctx.vocab_multiple)
        w = ctx.init(-1, "lm_head", cfg.init_std).shard(
            (padded, cfg.hidden), 0, ctx.tp.rank, ctx.tp.size, ctx.dtype, valid_rows=vocab_size
        )
        self.weight = mark_vocab(mark_tp(nn.Parameter(w.to(ctx.device)), 0), vocab_size)

    def forward(self, x):
        """Hidden -> local logits [b, s, V_pad/tp]."""
        return lm_logits(x, self.weight, self.ctx, self.softcap)


class FinalNorm(nn.Module):
    """The norm after the last block."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.norm = make_norm(cfg, ctx)

    def forward(self, x):
        """Normalise the residual stream (router statistics pass through)."""
        x, stats = split_stream(x)
        return join_stream(self.norm(x), stats)


__all__ = [
    "Attention",
    "BuildContext",
    "FinalNorm",
    "LMHead",
    "MLP",
    "PositionsAndDropout",
    "RMSNorm",
    "TransformerBlock",
    "WordEmbedding",
    "join_stream",
    "lm_logits",
    "project",
    "split_stream",
    "make_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]
