"""How a parameter declares its tensor-parallel split and the gradient sums it needs: the marks every
layer sets and DeepSpeed, checkpoints and the sharding table read (``mt3d.model.sharding``)."""

from __future__ import annotations

import torch
from torch import nn

from .mappings import all_reduce
from .state import AxisGroup


def mark_tp(p: nn.Parameter, dim: int, parts: tuple[int, ...] | None = None) -> nn.Parameter:
    """Mark a parameter as split over TP along ``dim`` (DeepSpeed counts it on every TP rank).

    ``parts`` records fused sub-tensors (full sizes along ``dim``) that are split independently.
    """
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_parts = tuple(parts) if parts and len(parts) > 1 else None
    return p


def shard_of(full: torch.Tensor, p: nn.Parameter, rank: int, world: int) -> torch.Tensor:
    """The slice of an unsharded tensor that ``p`` holds on TP rank ``rank`` (per its marks)."""
    if not getattr(p, "tensor_model_parallel", False):
        return full
    dim = p.partition_dim
    parts = p.partition_parts or (full.shape[dim],)
    pieces = full.split(list(parts), dim=dim)
    return torch.cat([x.chunk(world, dim=dim)[rank] for x in pieces], dim=dim)


def mark_tp_partial_grad(p: nn.Parameter, tp: AxisGroup) -> nn.Parameter:
    """A replicated parameter each TP rank computes only part of the gradient of (it saw a slice of
    the sequence, or of the heads): sum the gradient over TP so every rank applies the same update."""
    p.tp_partial_grad = True
    if tp.size > 1:
        # None: a split backward's B left this weight's gradient to W (``parallel.deferred``)
        p.register_hook(lambda grad: None if grad is None else all_reduce(grad.clone(), tp))
    return p


def mark_sequence_parallel(p: nn.Parameter, tp: AxisGroup) -> nn.Parameter:
    """Sum this replicated parameter's gradient over TP (it was computed on a sequence shard)."""
    p.sequence_parallel = True
    return mark_tp_partial_grad(p, tp)


def mark_vocab(p: nn.Parameter, vocab_size: int) -> nn.Parameter:
    """Mark a vocabulary-parallel tensor: rows beyond ``vocab_size`` are padding (zero, never used)."""
    p.vocab_rows = vocab_size
    return p
