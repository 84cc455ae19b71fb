"""Sequence tiles: the MLP and the vocabulary-parallel loss computed a tile of positions at a time, so
that at long sequences neither the MLP's [b, s, ffn/tp] intermediate nor the [b, s, V/tp] logits
exist whole (ALST's tiling, Bekman et al. 2025). Each tile's intermediates are freed as soon as its
output is written; the backward recomputes one tile at a time and backpropagates it.

Why not DeepSpeed's own (``deepspeed.runtime.sequence_parallel.ulysses_sp``, in the pinned version):

* ``TiledMLP`` flattens its input to [tokens, hidden] for the recompute in the backward; mt3d's
  column- and row-parallel linears with sequence parallelism gather and reduce-scatter along the
  sequence dimension of [b, s, h] (``parallel.mappings.SEQ_DIM``), so a flattened tile would gather the
  wrong dimension. It also accumulates the weight gradients into ``.grad`` during the backward, once
  per tile, which ZeRO-2's per-parameter gradient hooks would reduce once per tile.
* ``TiledFusedLogitsLoss`` runs the backward inside the forward with an incoming gradient of 1 and
  hands the stored gradient back later: DeepSpeed's pipeline engine scales the loss (1 / micro-batches,
  the fp16 loss scale) before its backward, and that scale would never reach the weights. Its loss
  function also sees whole-vocabulary logits, not mt3d's vocabulary-parallel slices.

Here a tile is a slice of dimension 1 (the sequence) of a [b, s, ...] tensor, so with sequence
parallelism every TP rank cuts its shard into the same number of tiles and the collectives inside a
tile (all-gather, reduce-scatter, the loss's all-reduces) pair up across the TP group: the MLP is
per position, so which positions share a tile does not matter. Gradients of the parameters are
summed over the tiles and returned by the autograd function, so they reach ``.grad`` once, as for
an untiled layer (gradient hooks see one gradient).
"""

from __future__ import annotations

import math

import torch


def tile_count(positions: int, tile_len: int) -> int:
    """Tiles of at most ``tile_len`` positions (0: one tile)."""
    return 1 if tile_len <= 0 else max(1, math.ceil(positions / tile_len))


class _Tiled(torch.autograd.Function):
    """``fn(x, aux, params)`` over ``tiles`` slices of x's (and aux's) dimension 1, concatenated back."""

    @staticmethod
    def forward(ctx, fn, tiles, aux, x, *params):
        ctx.fn, ctx.tiles = fn, tiles
        ctx.save_for_backward(x, aux, *params)
        with torch.no_grad():
            return torch.cat([fn(xt, at, params) for xt, at in _tiles(tiles, x, aux)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, aux, *params = ctx.saved_tensors
        # Gradients are taken with respect to detached aliases of the parameters: a hook on a
        # parameter (mt3d's TP all-reduce of partial gradients, ZeRO's reduction) must see the sum
        # over the tiles once, when autograd hands it the gradient this function returns.
        leaves = [p.detach().requires_grad_(p.requires_grad) for p in params]
        wanted = [p for p in leaves if p.requires_grad]
        grad_x = torch.empty_like(x) if x.requires_grad else None
        sums: list = [None] * len(wanted)
        start = 0
        for (xt, at), gt in zip(_tiles(ctx.tiles, x, aux), grad.tensor_split(ctx.tiles, dim=1), strict=True):
            xt = xt.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(xt, at, leaves)
            got = torch.autograd.grad(out, ([xt] if x.requires_grad else []) + wanted, gt, allow_unused=True)
            if x.requires_grad:
                grad_x[:, start : start + xt.shape[1]] = got[0]
                got = got[1:]
            sums = [s if g is None else g if s is None else s.add_(g) for s, g in zip(sums, got, strict=True)]
            start += xt.shape[1]
        by_leaf = iter(sums)
        return None, None, None, grad_x, *(next(by_leaf) if p.requires_grad else None for p in leaves)


def _tiles(tiles: int, x: torch.Tensor, aux: torch.Tensor | None) -> list:
    xs = x.tensor_split(tiles, dim=1)
    if aux is None:
        return [(t, None) for t in xs]
    return list(zip(xs, aux.tensor_split(tiles, dim=1), strict=True))


def tiled(fn, x: torch.Tensor, params: list[torch.Tensor], tiles: int, aux: torch.Tensor | None = None):
    """``fn(x, aux, params)``, independent per position along dimension 1, computed in ``tiles``
    slices, each recomputed in the backward. ``params`` are every tensor ``fn`` differentiates besides
    x, and fn must compute with the ones it is given (in the backward: aliases without hooks);
    ``aux`` (labels, no gradient) is cut like x, or None."""
    if tiles <= 1:
        return fn(x, aux, params)
    return _Tiled.apply(fn, tiles, aux, x, *params)
