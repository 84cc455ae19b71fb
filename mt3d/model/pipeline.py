"""The model as a DeepSpeed PipelineModule (and, for pp = 1 without the pipeline engine, a plain module).

Layer list: word embedding, positions/dropout, ``layers`` transformer blocks, final norm, LM head.
With tied embeddings the first and last entries are one ``TiedLayerSpec`` ("embed"), so DeepSpeed
shares it between the first and last stage and all-reduces its gradient. Stages are cut by
transformer blocks (``stage_blocks``; the embedding goes with stage 0 and the head with the last
stage). Only the hidden-state tensor crosses stage boundaries. The PipelineModule receives the
topology from the rank mapper, so its grid and mt3d's ParallelState describe the same groups.

Activation checkpointing is done here rather than by DeepSpeed's interval mechanism: runs of up to
``recompute_interval`` consecutive blocks are checkpointed on every stage (the embedding and head
never are), with mt3d's TP-aware, recompute-safe ``checkpoint``.
"""

from __future__ import annotations

import functools
import logging

import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ..parallel.cross_entropy import mean_loss, vocab_parallel_cross_entropy
from ..parallel.random import checkpoint
from ..parallel.state import AxisGroup
from .blocks import BuildContext, FinalNorm, LMHead, PositionsAndDropout, TransformerBlock, WordEmbedding
from .config import ModelConfig

log = logging.getLogger("mt3d")

PRE_LAYERS = 2  # word embedding, positions/dropout
POST_LAYERS = 2  # final norm, head


def tied_logits(module: WordEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Forward of the tied embedding when it serves as the LM head."""
    return module.logits(x)


def layer_specs(cfg: ModelConfig, ctx: BuildContext, vocab_size: int) -> list:
    """The model as a list of DeepSpeed layer specs (built lazily, only on the owning stage)."""
    specs: list = []
    if cfg.tie_embeddings:
        specs.append(
            TiedLayerSpec("embed", WordEmbedding, cfg, ctx, vocab_size, tied_weight_attr=["embed.weight"])
        )
    else:
        specs.append(LayerSpec(WordEmbedding, cfg, ctx, vocab_size))
    specs.append(LayerSpec(PositionsAndDropout, cfg, ctx))
    specs += [LayerSpec(TransformerBlock, cfg, ctx, i) for i in range(cfg.layers)]
    specs.append(LayerSpec(FinalNorm, cfg, ctx))
    if cfg.tie_embeddings:
        specs.append(
            TiedLayerSpec(
                "embed",
                WordEmbedding,
                cfg,
                ctx,
                vocab_size,
                forward_fn=tied_logits,
                tied_weight_attr=["embed.weight"],
            )
        )
    else:
        specs.append(LayerSpec(LMHead, cfg, ctx, vocab_size))
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


def stage_bounds(stage_blocks: list[int]) -> list[int]:
    """Layer-index boundaries of each stage in the ``layer_specs`` list (len = stages + 1)."""
    parts = [0]
    last = len(stage_blocks) - 1
    for s, n in enumerate(stage_blocks):
        parts.append(parts[-1] + n + (PRE_LAYERS if s == 0 else 0) + (POST_LAYERS if s == last else 0))
    return parts


class LossFn:
    """Mean vocab-parallel cross entropy over the non-ignored tokens of a micro-batch."""

    def __init__(self, tp: AxisGroup, vocab_size: int) -> None:
        self.tp, self.vocab_size = tp, vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scalar loss (identical on every TP rank)."""
        return mean_loss(vocab_parallel_cross_entropy(logits, labels, self.tp, self.vocab_size), labels)


def run_layers(funcs, x: torch.Tensor, interval: int, ckpt) -> torch.Tensor:
    """Apply ``funcs`` in order, checkpointing runs of up to ``interval`` transformer blocks."""
    i = 0
    while i < len(funcs):
        if interval > 0 and isinstance(funcs[i], TransformerBlock) and torch.is_grad_enabled():
            j = i
            while j < len(funcs) and j - i < interval and isinstance(funcs[j], TransformerBlock):
                j += 1
            chunk = funcs[i:j]
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


class Mt3dPipeline(PipelineModule):
    """DeepSpeed PipelineModule with mt3d's block-based partitioning and recompute."""

    def __init__(
        self,
        specs: list,
        *,
        topology,
        loss_fn: LossFn,
        stage_blocks: list[int],
        recompute_interval: int = 0,
        ckpt=None,
    ) -> None:
        self._stage_blocks = list(stage_blocks)
        self.recompute_interval = recompute_interval
        self._ckpt = ckpt or checkpoint
        super().__init__(
            layers=specs,
            topology=topology,
            loss_fn=loss_fn,
            partition_method="mt3d-blocks",
            activation_checkpoint_interval=0,
        )

    def _partition_layers(self, method="mt3d-blocks"):
        # DeepSpeed's methods balance by type or parameters; mt3d cuts by explicit block counts so
        # uneven first/last stages can be configured.
        self.parts = stage_bounds(self._stage_blocks)
        if len(self.parts) != self.num_stages + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage_blocks {self._stage_blocks} do not fit {len(self._layer_specs)} layers")
        stage = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            log.info("pipeline stages (blocks per stage): %s", self._stage_blocks)
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied embedding in place with autograd recording; torch then warns
        # on every backward that c10d::broadcast_ has no autograd kernel. The copy needs no graph.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def forward(self, forward_input):
        """Run this stage's layers (recomputing blocks in runs of ``recompute_interval``)."""
        self.micro_offset += 1
        return run_layers(self.forward_funcs, forward_input, self.recompute_interval, self._ckpt)


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
        return self.loss_fn(logits, labels) if labels is not None else logits
