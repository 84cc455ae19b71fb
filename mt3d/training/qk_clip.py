"""QK-clip (MuonClip, Kimi K2; ``"mt3d": {"train": {"muon": {"qk_clip": tau}}}``): after each optimizer
step, every attention head whose largest pre-softmax logit in the step exceeded tau has its query and
key weights scaled so that, on the same inputs, that logit would have been tau.

The maxima: every training forward notes each head's largest logit (``mt3d.model.logit_max``, computed
beside whichever kernel and context-parallel exchange runs); the clip takes the step's and reduces them
(max) over the data- and context-parallel replicas of the layer (``state.dense``). TP ranks own their
heads and pipeline stages their layers, so nothing else is reduced.

The factor of head h is ``g_h = min(1, tau / max_h)``; how each layer applies it is its ``qk_rows``
(``mt3d.model.blocks.Attention``, ``mt3d.model.mla.LatentAttention``):

* multi-head attention: q and k rows of the head times ``sqrt(g_h)`` each (Kimi K2's rule);
* grouped-query attention, whose key head is shared by a group of query heads: the key head times
  ``sqrt(k)`` with ``k`` the smallest ``g`` of its group, each query head times ``g_h / sqrt(k)``, so
  every head's logits scale by exactly its own ``g_h`` (heads under tau keep theirs), and a group of
  one is the rule above;
* latent attention: the head's position-free query and key rows (``q``/``q_b``, ``kv_b``) times
  ``sqrt(g_h)``, its rotary query rows times ``g_h``; the rotary key, shared by all heads, is left
  alone (Kimi K2's rule).

Biases of the scaled rows scale with them. The weights scaled are the optimizer's master weights
(``Muon._clip``: the parameters themselves, or their place in ZeRO's and the bf16 optimizer's flat
fp32 partitions), right after each is stepped, so the model's copies follow exactly. Models whose q/k
norms undo such a scale, and LoRA's frozen bases, are refused (``rules.qk_clip_conflict``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..model.logit_max import LogitMax
from ..parallel.state import AxisGroup


class QKClip:
    """The clip of one rank's attention layers (``model``'s modules with ``qk_rows``) at ``tau``."""

    def __init__(self, model: torch.nn.Module, tau: float, dense: AxisGroup) -> None:
        self.tau, self.dense = float(tau), dense
        self.layers = [m for m in model.modules() if hasattr(m, "qk_rows")]
        for m in self.layers:
            m.logit_max = LogitMax(m.heads)
        self.maxima: torch.Tensor | None = None
        """The last step's maxima of this rank's heads (layer by layer), reduced over the replicas."""

    def row_scales(self) -> dict[int, torch.Tensor]:
        """Take the step's maxima (a collective over ``dense``) and return ``id(weight)`` -> the factor
        of each of its rows, for the weights of every layer with a head over tau."""
        if not self.layers:
            return {}
        device = next(self.layers[0].parameters()).device
        maxima = torch.cat([m.logit_max.take(device) for m in self.layers])
        if self.dense.size > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dense.group)
        self.maxima = maxima
        over = maxima > self.tau
        gamma = torch.where(over, self.tau / maxima.where(over, torch.ones_like(maxima)), 1.0)
        rows: dict[int, torch.Tensor] = {}
        for m, g in zip(self.layers, gamma.split([m.heads for m in self.layers]), strict=True):
            if bool((g < 1).any()):
                rows.update((id(p), r) for p, r in m.qk_rows(g))
        return rows

    def figures(self, device) -> dict:
        """The last step's largest logit over the model and how many heads were clipped (a collective
        over all ranks: call it everywhere)."""
        maxima = self.maxima if self.maxima is not None else torch.zeros(0, device=device)
        top = torch.tensor([maxima.max().item() if maxima.numel() else -math.inf], device=device)
        owner = self.dense.rank == 0  # replicas hold the same heads: count them once
        clipped = torch.tensor([int((maxima > self.tau).sum()) if owner else 0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            dist.all_reduce(clipped)
        return {"attn_logit_max": float(top), "qk_clipped_heads": int(clipped)}
