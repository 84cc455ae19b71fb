"""The model as DeepSpeed layer specs, run by a pipeline module (``mt3d.ds.pipe``) or, without the
pipeline engine, as one plain module (``StackedModel``).

Layer list: word embedding, positions/dropout, ``layers`` transformer blocks, final norm, LM head.
With tied embeddings the first and last entries are one ``TiedLayerSpec`` ("embed"), so DeepSpeed
shares it between the first and last stage and all-reduces its gradient. Stages are cut by
transformer blocks (``stage_blocks``; the embedding goes with stage 0 and the head with the last
stage). Only the hidden-state tensor crosses stage boundaries. ``run_layers`` applies a stage's
layers, checkpointing runs of up to ``recompute_interval`` consecutive blocks (the embedding and head
never are) with mt3d's TP-aware, recompute-safe ``checkpoint``.
"""

from __future__ import annotations

import functools
import logging

import torch
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from torch import nn

from ..parallel.cross_entropy import IGNORE_INDEX, mean_loss, vocab_parallel_cross_entropy
from ..parallel.mappings import all_reduce, copy_to_tp, reduce_from_tp
from ..parallel.random import checkpoint
from ..parallel.state import AxisGroup
from .blocks import (
    BuildContext,
    FinalNorm,
    LMHead,
    PositionsAndDropout,
    TransformerBlock,
    WordEmbedding,
    project,
)
from .config import ModelConfig
from .moe import Routed, router_losses
from .mtp import MtpHead, MtpLayers, MtpPending, attach_embedding, head_output, pending
from .tiled import tile_count, tiled

log = logging.getLogger("mt3d")

PRE_LAYERS = 2  # word embedding, positions/dropout
POST_LAYERS = 2  # final norm, head


def tied_logits(module: WordEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Forward of the tied embedding when it serves as the LM head."""
    return module.logits(x)


def tied_logits_mtp(module: WordEmbedding, x) -> MtpPending:
    """``tied_logits`` of a model with multi-token prediction (``mt3d.model.mtp``)."""
    return pending(module.logits(x), x, module.weight)


def post_layers(cfg: ModelConfig) -> int:
    """Layers after the last block: the final norm and the head, then with ``model.mtp`` the shared
    embedding and the depths (``mt3d.model.mtp``)."""
    return POST_LAYERS + (2 if cfg.mtp is not None else 0)


def layer_specs(cfg: ModelConfig, ctx: BuildContext, vocab_size: int) -> list:
    """The model as a list of DeepSpeed layer specs (built lazily, only on the owning stage)."""
    specs: list = []
    if cfg.tie_embeddings or cfg.mtp is not None:  # with MTP the last stage embeds too
        specs.append(
            TiedLayerSpec("embed", WordEmbedding, cfg, ctx, vocab_size, tied_weight_attr=["embed.weight"])
        )
    else:
        specs.append(LayerSpec(WordEmbedding, cfg, ctx, vocab_size))
    specs.append(LayerSpec(PositionsAndDropout, cfg, ctx))
    specs += [LayerSpec(TransformerBlock, cfg, ctx, i) for i in range(cfg.layers)]
    specs.append(LayerSpec(FinalNorm, cfg, ctx))
    mtp = cfg.mtp is not None
    tied = functools.partial(TiedLayerSpec, "embed", WordEmbedding, cfg, ctx, vocab_size,
                             tied_weight_attr=["embed.weight"])  # fmt: skip
    if cfg.tie_embeddings:
        specs.append(tied(forward_fn=tied_logits_mtp if mtp else tied_logits))
    else:
        specs.append(LayerSpec(MtpHead if mtp else LMHead, cfg, ctx, vocab_size))
    if mtp:
        specs += [tied(forward_fn=attach_embedding), LayerSpec(MtpLayers, cfg, ctx)]
    return specs


def default_stage_blocks(layers: int, stages: int) -> list[int]:
    """Blocks per stage as even as possible; extra blocks go to middle stages first.

    The first stage also holds the embedding and the last the LM head, so they get the
    remainder last.
    """
    base, extra = divmod(layers, stages)
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 1 else [0]
    counts = [base] * stages
    for s in order[:extra]:
        counts[s] += 1
    return counts


def stage_bounds(stage_blocks: list[int], post: int = POST_LAYERS) -> list[int]:
    """Layer-index boundaries of each stage in the ``layer_specs`` list (len = stages + 1); ``post``
    layers after the last block (``post_layers``)."""
    parts = [0]
    last = len(stage_blocks) - 1
    for s, n in enumerate(stage_blocks):
        parts.append(parts[-1] + n + (PRE_LAYERS if s == 0 else 0) + (post if s == last else 0))
    return parts


class LossFn:
    """Mean vocab-parallel cross entropy over the non-ignored tokens of a micro-batch.

    With context parallelism each rank holds some tokens of every sample: its loss is its share of the
    micro-batch's token-weighted mean (its sum over the tokens of all cp ranks), times cp, because
    DeepSpeed's pipeline engine averages gradients and losses over dp x cp (its 'data' groups): the
    mean over the cp ranks is the loss of cp = 1.

    The head's output is this rank's logits, or, when the model was built with ``tile_len``, the pair
    (hidden states, head weight): the projection, soft-capping and cross entropy then run
    ``tile_len`` positions at a time (``mt3d.model.tiled``), so the logits never exist whole.

    Packed data (``mt3d.data.packing``) is normalised over the whole global batch instead: the trainer
    sets ``step_weight`` to P / N before each batch, N the supervised targets of the global batch and
    P the pieces DeepSpeed averages (dp x cp ranks x gradient-accumulation micro-batches), and each
    piece's loss is its sum of per-token losses times that weight. The average of the pieces is then
    the sum over every supervised token of the global batch over their number, however they fall into
    micro-batches and cp chunks (a mean of micro-batch means would weigh a short sample's tokens more);
    N = 0 gives 0, never NaN.
    """

    def __init__(
        self,
        tp: AxisGroup,
        vocab_size: int,
        cp: AxisGroup | None = None,
        *,
        softcap: float | None = None,
        tile_len: int = 0,
        moe=None,
        sparse_layers: int = 0,
    ) -> None:
        self.tp, self.vocab_size, self.cp = tp, vocab_size, cp
        self.softcap, self.tile_len = softcap, tile_len
        self.moe, self.sparse_layers = moe, sparse_layers
        self.step_weight: float | None = None
        """P / N of the current global batch of packed data (class docstring); None: per micro-batch."""
        self.router_log: list[dict] = []
        """Per training micro-batch of a sparse model: aux, z, tokens per expert, dropped (metrics)."""
        self.mtp_log: list[torch.Tensor] = []
        """Per training micro-batch of a model with MTP: each depth's loss (metrics)."""

    @classmethod
    def of(
        cls, cfg: ModelConfig, tp: AxisGroup, vocab_size: int, cp: AxisGroup | None = None, tile_len: int = 0
    ):
        """The loss of model ``cfg`` (its logit soft-cap, its router losses when it is sparse)."""
        return cls(tp, vocab_size, cp, softcap=cfg.logit_softcap, tile_len=tile_len, moe=cfg.moe_spec,
                   sparse_layers=cfg.sparse_layers)  # fmt: skip

    def per_token(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy of every position [b, s] (at least fp32)."""
        if not isinstance(outputs, tuple):
            return vocab_parallel_cross_entropy(outputs, labels, self.tp, self.vocab_size)
        hidden, weight = outputs

        def tile(x: torch.Tensor, target: torch.Tensor, params) -> torch.Tensor:
            logits = project(x, params[0], self.softcap)
            return vocab_parallel_cross_entropy(logits, target, self.tp, self.vocab_size)

        return tiled(tile, hidden, [weight], tile_count(hidden.shape[1], self.tile_len), aux=labels)

    def __call__(self, logits, labels) -> torch.Tensor:
        """Scalar loss (identical on every TP rank). A sparse model's training loss adds the router's
        load-balancing and z losses (``mt3d.model.moe``), a model with multi-token prediction its depths'
        (``mt3d.model.mtp``: ``labels`` is then (labels, the depths' ids, their labels)); evaluation
        reports the language-model loss."""
        pending = logits if isinstance(logits, MtpPending) else None
        depths = None
        if isinstance(labels, tuple):
            labels, *depths = labels
        loss = self._main(head_output(logits), labels)
        if pending is None or not torch.is_grad_enabled():
            return loss
        if depths is None:
            raise RuntimeError("a model with model.mtp trains on (labels, the depths' ids, their labels): "
                               "build its batches with StepBatches(mtp=D)")  # fmt: skip
        outs = pending.mtp.outputs(pending, depths[0])
        per = [self.objective(out, depths[1][..., k].contiguous()) for k, out in enumerate(outs)]
        self.mtp_log.append(torch.stack([p.detach() for p in per]))
        return loss + pending.mtp.weight / len(per) * sum(per)

    def _main(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """The language-model loss, plus a sparse model's router losses in training."""
        routed = logits if isinstance(logits, Routed) else None
        if routed is not None:
            logits = routed.out
        loss = self.objective(logits, labels)
        if routed is None or not torch.is_grad_enabled():
            return loss
        tokens = labels.shape[0] * labels.shape[1]
        if self.cp is not None and self.cp.size > 1:
            routed, tokens = self._whole_sequence(routed), tokens * self.cp.size
        aux, z = router_losses(self.moe, routed, tokens, self.sparse_layers)
        counts = routed.stats_i.detach()
        self.router_log.append({"aux": aux.detach(), "z": z.detach(), "counts": counts})
        return loss + self.moe.aux_loss_coef * aux + self.moe.z_loss_coef * z

    def objective(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """The language-model loss of this rank's logits (or tiles' inputs) against ``labels``."""
        per_token = self.per_token(logits, labels)
        if self.step_weight is not None:
            loss = per_token.sum() * self.step_weight
        elif self.cp is None or self.cp.size == 1:
            loss = mean_loss(per_token, labels)
        else:
            count = (labels != IGNORE_INDEX).sum().float()
            all_reduce(count, self.cp)
            loss = per_token.sum() * self.cp.size / count.clamp(min=1)
        return loss

    def _whole_sequence(self, routed: Routed) -> Routed:
        """Router statistics summed over the cp ranks (each scored its chunks of the sequences). The
        sum's backward is a sum too: every cp rank's loss holds the whole aux loss, and DeepSpeed
        averages their gradients over cp, so each rank's probabilities must receive cp times its
        loss's gradient (the sum of all ranks') for the average to be the aux loss's gradient."""
        stats_f = copy_to_tp(reduce_from_tp(routed.stats_f, self.cp), self.cp)
        stats_i = all_reduce(routed.stats_i.clone(), self.cp)
        return Routed(routed.out, stats_f, stats_i)


def run_layers(funcs, x: torch.Tensor, interval: int, ckpt) -> torch.Tensor:
    """Apply ``funcs`` in order, checkpointing runs of up to ``interval`` transformer blocks."""
    i = 0
    while i < len(funcs):
        if interval > 0 and isinstance(funcs[i], TransformerBlock) and torch.is_grad_enabled():
            j = i
            while j < len(funcs) and j - i < interval and isinstance(funcs[j], TransformerBlock):
                j += 1
            chunk = funcs[i:j]
            if isinstance(x, tuple):  # a sparse model's stream: the router statistics are inputs too
                x = ckpt(functools.partial(_chain_stream, chunk), *x)
            else:
                x = ckpt(functools.partial(_chain, chunk), x)
            i = j
        else:
            x = funcs[i](x)
            i += 1
    return x


def _chain(funcs, x):
    for f in funcs:
        x = f(x)
    return x


def _chain_stream(funcs, *stream):
    return _chain(funcs, tuple(stream))


class StackedModel(nn.Module):
    """All layers in one module (no pipeline engine): ZeRO-2/3 at pp = 1, evaluation, generation.

    Parameter names match ``Mt3dPipeline`` at pp = 1 (``<layer index>.…`` and
    ``tied_modules.embed.…``), so both load the same state dicts.
    """

    def __init__(self, specs: list, *, loss_fn: LossFn | None = None, recompute_interval: int = 0, ckpt=None):
        super().__init__()
        self.loss_fn = loss_fn
        self.recompute_interval = recompute_interval
        self._ckpt = ckpt or checkpoint
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: list = []
        for idx, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.forward_funcs.append(
                    functools.partial(spec.forward_fn, module) if spec.forward_fn else module
                )
            else:
                module = spec.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (this rank's vocabulary slice), or the mean loss when ``labels`` are given."""
        logits = run_layers(self.forward_funcs, ids, self.recompute_interval, self._ckpt)
        if labels is not None:
            return self.loss_fn(logits, labels)
        logits = head_output(logits)
        return logits.out if isinstance(logits, Routed) else logits
