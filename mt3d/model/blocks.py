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

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import context
from ..parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_linear,
    mark_sequence_parallel,
    mark_tp,
    mark_vocab,
    pad_vocab,
)
from ..parallel.mappings import copy_to_tp, gather_from_sequence
from ..parallel.random import checkpoint
from .attention import attend
from .build import BuildContext  # noqa: F401 - the name layers and callers import from here
from .config import ModelConfig
from .logit_max import LogitMax, logit_record
from .mlp import MLP  # noqa: F401
from .norms import (  # noqa: F401
    RMSNorm,
    RopeTables,
    make_head_norm,
    make_norm,
    rope_cos_sin,
    rope_inv_freq,
    rotate,
)


class Attention(RopeTables, nn.Module):
    """Causal self-attention, global or local (``cfg.patterns[layer]``); heads and KV groups split
    over TP (QKV column-, output row-parallel). Optional q/k head norms and score soft-capping."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer: int) -> None:
        super().__init__()
        tp = ctx.tp.size
        cfg.check_parallel(tp, 1)
        self.cfg, self.ctx = cfg, ctx
        self.heads, self.kv_heads, self.head_dim = cfg.heads // tp, cfg.kv_heads // tp, cfg.head_dim
        self.pattern = cfg.patterns[layer] if layer < cfg.layers else None  # MTP's blocks: global
        self.local = self.pattern is not None  # its RoPE: cfg.rope_local where set (Gemma 3)
        spec = cfg.attention or {}
        self.block, self.kernel = spec.get("block"), spec.get("kernel", "auto")
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.gated = cfg.attn_output_gate  # each head's query, then its output gate (Qwen3-Next)
        self.q_width = cfg.q_size * (2 if self.gated else 1)
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.qkv = ColumnParallelLinear(
            cfg.hidden,
            self.q_width + 2 * cfg.kv_size,
            tp=ctx.tp,
            bias=cfg.qkv_bias,
            sequence_parallel=ctx.sp,
            keep_gathered=ctx.keep_gathered,
            init=ctx.init(layer, "attn.qkv", cfg.init_std),
            parts=(self.q_width, cfg.kv_size, cfg.kv_size),
            dtype=ctx.dtype,
            device=ctx.device,
            gemms=ctx.gemms(layer),
        )
        if cfg.qk_norm:
            self.q_norm = make_head_norm(cfg, ctx, self.heads)
            self.k_norm = make_head_norm(cfg, ctx, self.kv_heads)
        self.logit_max: LogitMax | None = None
        """Set by QK-clip (``mt3d.training.qk_clip``): every training forward notes its logits' maxima."""
        self.sinks = None
        if cfg.attn_sinks:  # one logit per query head, split over TP with the heads
            lo = ctx.tp.rank * self.heads
            w = ctx.init(layer, "attn.sinks", cfg.init_std).rows(lo, lo + self.heads, 1, ctx.dtype).view(-1)
            self.sinks = mark_tp(nn.Parameter(w.to(ctx.device)), 0)
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

    def qk_rows(self, gamma: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip's factor of every row of the fused q/k/v weight (and bias) for head factors ``gamma``
        [heads] (``mt3d.training.qk_clip``): a key head shared by a group times sqrt of the group's
        smallest, each query head the rest of its own; values unchanged."""
        group, hd = self.heads // self.kv_heads, self.head_dim
        shared = gamma.view(self.kv_heads, group).amin(dim=1).sqrt()
        q = (gamma / shared.repeat_interleave(group)).repeat_interleave(hd)
        if self.gated:  # each head's gate rows follow its query rows, unscaled
            q = torch.stack([q.view(self.heads, hd), torch.ones_like(q).view(self.heads, hd)], 1).view(-1)
        k = shared.repeat_interleave(hd)
        rows = torch.cat([q, k, torch.ones_like(k)])
        return [(p, rows) for p in (self.qkv.weight, self.qkv.bias) if p is not None]

    def cp_kind(self, local_len: int) -> str:
        """This layer's context-parallel exchange for ``local_len`` local tokens (two chunks)."""
        return context.exchange_for(
            self.ctx.cp_exchange, self.pattern, local_len // 2, self.heads, self.kv_heads, self.ctx.cp_size
        )

    def forward(self, x: torch.Tensor, cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x: [b, s, h] (SP: [b, s/tp, h]); ``cache`` (generation) holds past keys/values; ``documents``
        [b, n]: packed samples' document index of every position (``mt3d.model.documents``)."""
        qkv = self.qkv(x)
        past = cache.length if cache is not None else 0
        # the rotary tables are built (and cached on the module) outside the recomputed core
        tables = self.rope_tables(qkv.shape[1], past, documents, qkv)
        if self.ctx.selective and cache is None:  # keep qkv only; the core runs again in the backward
            rng = self.cfg.attention_dropout > 0 and self.training  # the core's only random draw
            o = checkpoint(
                self._core, qkv, *tables, documents, tracker=self.ctx.tracker, tp=self.ctx.tp, rng=rng
            )
        else:
            o = self._core(qkv, *tables, documents, cache=cache)
        return self.out(o)

    def _core(self, qkv: torch.Tensor, cos=None, sin=None, documents=None, cache=None) -> torch.Tensor:
        """[b, s, (q + 2 kv) / tp] -> the attention output [b, s, q / tp] (positions, q/k norms, the
        exchange over cp, the kernel); ``cos``, ``sin``: the rotary tables of these positions;
        ``documents``: as ``forward``'s."""
        b, s, _ = qkv.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = qkv.split([self.q_width // self.ctx.tp.size, kv, kv], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(b, s, self.heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = q.reshape(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        past = cache.length if cache is not None else 0
        if self.cfg.position == "rope":
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_start = past
        if cache is not None:
            k, v, k_start = cache.update(self, k, v, self.pattern)
        drop = self.cfg.attention_dropout if self.training else 0.0
        kernel = functools.partial(attend, block=self.block, kernel=self.kernel, documents=documents)
        record = logit_record(self, cache)
        with self.ctx.tp_region_rng() if drop > 0 else contextlib.nullcontext():
            if self.ctx.cp_size > 1 and cache is None:
                o = context.attention(
                    q, k, v, self.ctx.cp, self.cp_kind(s), pattern=self.pattern, scale=self.scale,
                    softcap=self.cfg.attn_softcap, dropout=drop, attend=kernel, sinks=self.sinks,
                    record=record,
                )  # fmt: skip
            else:
                o = kernel(q, k, v, pattern=self.pattern, scale=self.scale, softcap=self.cfg.attn_softcap,
                           dropout=drop, q_start=past, k_start=k_start, sinks=self.sinks,
                           record=record)  # fmt: skip
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return o if gate is None else o * torch.sigmoid(gate.reshape(b, s, -1))


def split_stream(x) -> tuple[torch.Tensor, tuple | None, torch.Tensor | None]:
    """(hidden states, router statistics or None, document ids or None) of a residual stream: the
    hidden tensor, or a tuple of it, a sparse model's (stats_f, stats_i) (``mt3d.model.moe``) and
    packed samples' document ids [b, n] (``mt3d.model.documents``), in that order."""
    if not isinstance(x, tuple):
        return x, None, None
    if len(x) == 2:
        return x[0], None, x[1]
    return x[0], (x[1], x[2]), (x[3] if len(x) == 4 else None)


def join_stream(x: torch.Tensor, stats: tuple | None, documents: torch.Tensor | None = None):
    """The inverse of ``split_stream``."""
    rest = (*(stats or ()), *(() if documents is None else (documents,)))
    return (x, *rest) if rest else x


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))); with ``post_norms`` each
    branch output is normalised again before it joins the residual stream (Gemma 2). A sparse layer
    (``cfg.is_sparse``) has a mixture-of-experts MLP (``mt3d.model.moe``)."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, layer: int) -> None:
        super().__init__()
        self.ctx, self.layer = ctx, layer
        self.p = cfg.hidden_dropout
        self.norm1 = make_norm(cfg, ctx)
        if cfg.is_linear(layer):  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
            from .gdn import GatedDeltaNet

            self.attn = GatedDeltaNet(cfg.gdn_spec, cfg, ctx, layer)
        elif cfg.mla is not None:  # multi-head latent attention (DeepSeek-V2/V3)
            from .mla import LatentAttention

            self.attn = LatentAttention(cfg, ctx, layer)
        else:
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
        x, stats, docs = split_stream(x)
        a = self.attn(self.norm1(x), cache, docs)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = x + self._drop(a)
        if self.sparse:
            m, stats = self.mlp(self.norm2(x), stats)
        else:
            m = self.mlp(self.norm2(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return join_stream(x + self._drop(m), stats, docs)


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

    def forward(self, ids):
        """[b, s] ids -> [b, s, h] ([b, s/tp, h] with SP); packed samples' (ids, documents) ->
        (hidden, documents)."""
        if isinstance(ids, tuple):
            ids, documents = ids
            return self.embed(ids), documents
        return self.embed(ids)

    def logits(self, x):
        """Hidden states -> this rank's vocabulary slice of the logits [b, s, V_pad/tp]."""
        return lm_logits(x, self.weight, self.ctx, self.softcap)


def lm_logits(x, weight: torch.Tensor, ctx: BuildContext, softcap: float | None = None):
    """Vocab-parallel output projection (the input gradient is summed over TP), optionally
    soft-capped (``project``). With ``ctx.tile_len`` the projection is left to the loss, which runs
    it tile by tile: the result is then the pair (gathered hidden states, weight). A sparse model's
    stream gives a ``moe.Routed`` holding that result and the router statistics."""
    x, stats, _ = split_stream(x)
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

    def forward(self, x, offset: int = 0):
        """Hidden [b, s', h] (s' = s/tp with SP) -> same shape; a sparse model's stream starts its
        router statistics here (``moe.start_stats``); packed samples' document ids pass along."""
        x, _, documents = split_stream(x)
        x = self._embed(x, offset, documents)
        stats = None
        if self.moe is not None:
            from .moe import start_stats

            stats = start_stats(self.moe, x)
        return join_stream(x, stats, documents)

    def _embed(self, x: torch.Tensor, offset: int, documents: torch.Tensor | None = None) -> torch.Tensor:
        if self.scale is not None:  # rounded to the activation dtype first, as Gemma does
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        if self.pos is not None:
            s = x.shape[1]
            tp = self.ctx.tp.size if self.ctx.sp else 1
            # Bounds from Python ints (reading positions back would stop the host every micro-batch):
            # documents and context-parallel chunks place tokens below the whole sequence's length.
            last = offset + s * tp * self.ctx.cp_size - 1
            if last >= self.pos.shape[0]:
                raise ValueError(f"sequence of {last + 1} tokens exceeds max_seq_len {self.pos.shape[0]}")
            if self.ctx.cp_size == 1 and documents is None:  # contiguous: a slice of the table
                start = offset + (self.ctx.tp.rank * s if tp > 1 else 0)
                x = x + self.pos[start : start + s]
            else:
                if documents is not None:  # positions restart at every document
                    pos = self.ctx.document_positions(documents, s * tp)
                else:
                    pos = self.ctx.positions(s * tp, offset, x.device)
                if tp > 1:  # this rank's sequence shard of its tokens
                    pos = pos[..., self.ctx.tp.rank * s : (self.ctx.tp.rank + 1) * s]
                x = x + self.pos[pos]
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
        """Normalise the residual stream (router statistics and document ids pass through)."""
        x, stats, documents = split_stream(x)
        return join_stream(self.norm(x), stats, documents)


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
