"""Multi-token prediction (``model.mtp``; DeepSeek-V3, GLM-4.5, Qwen3-Next / Qwen3.5).

Depth k (1..D) predicts token i + k + 1 at position i. Its input is the previous depth's normalised
output h^{k-1} (depth 1: the main model's final-norm output, what the LM head reads) and the embedding
of token i + k, both normalised, concatenated [embedding; hidden] and projected back to the model width
(``eh_proj``): one more transformer block (full attention, the family's MLP at that layer index), its
own final norm, and the main model's output head. The embedding and the head are the main model's
(shared, as the papers train them); the loss is ``loss_weight`` / D times the sum of the depths' cross
entropies, added to the main loss in training (DeepSeek-V3 section 2.2; Megatron-Core's convention).

Where it runs: after the LM head, on the last pipeline stage. The head returns an ``MtpPending`` (its
usual output, the normalised hidden states, its weight, the document ids of packed samples); two more
layers attach the shared embedding (a tied layer: DeepSpeed keeps the copy on the last stage in step
with stage 0's and sums their gradients) and the ``MtpLayers``. The depths' inputs and targets are data
(``mt3d.data.loader.mtp_batch``: the token ids and labels shifted by k within each document, computed
on whole sequences before context parallelism cuts them), so they travel with the labels, and
``LossFn`` runs the depths
(``MtpLayers.losses``) where it computes the loss. The depth blocks are not recomputed
(``train.recompute`` covers the main blocks).

Tensor parallelism: ``eh_proj`` is replicated (2h x h per rank; with SP each rank projects its sequence
shard and the gradient is summed over TP), the block is a normal block at layer index ``layers + k - 1``
(its init, FP8 choice and HF name follow that index), and the head is vocab-parallel as the main one.
A sparse depth block routes as the main blocks do but keeps no router statistics: it stays out of the
load-balancing and z losses (their denominators count the main sparse layers), while aux-loss-free
balancing moves its own correction bias.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import LMHead, TransformerBlock, join_stream, lm_logits, split_stream


class MtpPending:
    """What the LM head of a model with MTP returns: its usual output ``out`` (logits, tiles' inputs,
    or a ``Routed``) and what the depths need; ``LossFn`` finishes it (``MtpLayers.outputs``). A plain
    object: ZeRO-3's post-forward hook walks ``vars()`` of a module's output to keep the tensors it holds
    (the head's weight among them) gathered."""

    def __init__(self, out, hidden: torch.Tensor, documents, weight: torch.Tensor) -> None:
        self.out, self.hidden, self.weight, self.documents = out, hidden, weight, documents
        self.embed = self.mtp = None


class MtpHead(LMHead):
    """The untied LM head of a model with MTP: its logits in an ``MtpPending``."""

    def forward(self, x) -> MtpPending:
        """Hidden -> the pending head output."""
        return pending(super().forward(x), x, self.weight)


def pending(out, x, weight: torch.Tensor) -> MtpPending:
    """The head's output ``out`` of the stream ``x``, with what the depths need."""
    hidden, _, documents = split_stream(x)
    return MtpPending(out, hidden, documents, weight)


def head_output(x):
    """The head's own output of a model with or without MTP."""
    return x.out if isinstance(x, MtpPending) else x


def attach_embedding(module, head: MtpPending) -> MtpPending:
    """Forward of the tied embedding after the head: the depths embed their tokens with it."""
    head.embed = module
    return head


class MtpDepth(nn.Module):
    """One depth: the two input norms, ``eh_proj``, a transformer block and the output norm."""

    def __init__(self, cfg, ctx, k: int) -> None:
        from ..parallel.layers import ReplicatedLinear
        from .norms import make_norm

        super().__init__()
        layer = cfg.layers + k
        self.enorm, self.hnorm = make_norm(cfg, ctx), make_norm(cfg, ctx)
        init = ctx.init(layer, "mtp.eh_proj", cfg.init_std)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden, cfg.hidden, tp=ctx.tp, bias=False, init=init,
                                        sequence_parallel=ctx.sp, dtype=ctx.dtype,
                                        device=ctx.device)  # fmt: skip
        self.block = TransformerBlock(cfg, ctx, layer)
        self.norm = make_norm(cfg, ctx)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, documents) -> torch.Tensor:
        """h^{k-1} and the embedded tokens i + k ([b, s, h], sequence shards with SP) -> h^k."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, _, _ = split_stream(self.block(join_stream(x, None, documents)))  # no router statistics
        return self.norm(x)


class MtpLayers(nn.Module):
    """The D depths (``model.mtp.layers``), a layer after the head on the last stage."""

    def __init__(self, cfg, ctx) -> None:
        super().__init__()
        self.ctx, self.softcap = ctx, cfg.logit_softcap
        self.weight = cfg.mtp_spec.loss_weight
        self.depth = nn.ModuleList(MtpDepth(cfg, ctx, k) for k in range(cfg.mtp_spec.layers))

    def forward(self, head: MtpPending) -> MtpPending:
        """Attach the depths; ``LossFn`` runs them with the batch's shifted tokens."""
        head.mtp = self
        return head

    def outputs(self, head: MtpPending, ids: torch.Tensor) -> list:
        """Each depth's head output (as the main head's) for the shifted tokens ``ids`` [b, s, D]."""
        hidden, outs = head.hidden, []
        for k, depth in enumerate(self.depth):
            embedded = head.embed(ids[..., k].contiguous())
            hidden = depth(hidden, embedded, head.documents)
            outs.append(lm_logits(hidden, head.weight, self.ctx, self.softcap))
        return outs
