"""The DPO loss (Rafailov et al. 2023) on packed preference pairs, with TRL's definitions.

A micro-batch's labels are ``mt3d.data.packing.packed_batch``'s for pairs: [b, s, 3], each position's
target token, its document's index in the sample and in the dataset (pair p: documents 2p, chosen,
and 2p + 1, rejected, packed one after the other in one sample). The log-probability of a completion
is the sum of its supervised tokens' log-probabilities (the vocab-parallel cross entropy, the same on
every TP rank); with context parallelism each rank sums its chunks' tokens and the sums are added
over cp (forward and backward: every rank's loss reads every rank's sum).

Per pair, with the reference's log-probabilities r (``reference``: one float per dataset document,
the starting policy's, ``mt3d.training.dpo``)::

    margin = (chosen - r_chosen) - (rejected - r_rejected)
    sigmoid: -(1 - ls) log sigmoid(beta margin) - ls log sigmoid(-beta margin)
    ipo:     (margin - 1 / (2 beta))^2, over log-probabilities averaged per completion token

averaged over the pairs of the global batch: the trainer sets ``step_weight`` to P / pairs, P the
pieces DeepSpeed averages (dp x cp ranks x micro-batches), and each piece's loss is its pairs' sum
times that weight, over cp (each cp rank holds every pair's loss). TRL's metrics (rewards/chosen,
.../rejected, .../accuracies, .../margins, logps/chosen, logps/rejected) are summed in ``figures``.

With ``recording`` set (a dict), the loss records each document's log-probability and token count
instead (the reference pass) and returns 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel.cross_entropy import IGNORE_INDEX
from ..parallel.mappings import all_reduce, copy_to_tp, reduce_from_tp
from .pipeline import LossFn

FIGURES = ("pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
"""TRL's metric names (sums over a step's pairs; ``pairs`` their count)."""


class DPOLoss(LossFn):
    """``LossFn`` for preference pairs (module docstring)."""

    def __init__(self, *args, dpo=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.dpo = dpo
        """``DpoConfig`` (set by the engine's builder)."""
        self.reference: torch.Tensor | None = None
        """float64 [documents of the dataset]: the reference's log-probability of each."""
        self.recording: dict | None = None
        self.figures = torch.zeros(len(FIGURES), dtype=torch.float64)

    def documents(self, logits, labels: torch.Tensor):
        """(log-probability sum, supervised tokens, dataset index) of every document slot [b x S] of the
        micro-batch (S = the whole sequence's length; index -1: no document there), summed over cp."""
        target, doc, source = labels.unbind(-1)
        per_token = self.per_token(logits, target)
        b, s = target.shape
        cp = self.cp.size if self.cp is not None else 1
        slots = b * s * cp
        slot = (torch.arange(b, device=doc.device)[:, None] * s * cp + doc.clamp(min=0)).view(-1)
        scored = (target != IGNORE_INDEX).view(-1)
        logp = torch.zeros(slots, dtype=per_token.dtype, device=per_token.device)
        logp = logp.index_add(0, slot[scored], -per_token.reshape(-1)[scored])
        count = torch.zeros(slots, dtype=torch.float64, device=doc.device).index_add(
            0, slot[scored], torch.ones(int(scored.sum()), dtype=torch.float64, device=doc.device)
        )
        index = torch.full((slots,), -1, dtype=torch.int64, device=doc.device)
        index = index.scatter_reduce(0, slot, source.reshape(-1), "amax")
        if cp > 1:
            logp = reduce_from_tp(copy_to_tp(logp, self.cp), self.cp)
            all_reduce(count, self.cp)
            torch.distributed.all_reduce(index, op=torch.distributed.ReduceOp.MAX, group=self.cp.group)
        return logp, count, index

    def objective(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """The DPO loss of this micro-batch's pairs (module docstring)."""
        logp, count, index = self.documents(logits, labels)
        if self.recording is not None:
            for i, lp, n in zip(index.tolist(), logp.tolist(), count.tolist(), strict=True):
                if i >= 0:
                    self.recording[i] = (lp, n)
            return logp.sum() * 0.0
        chosen = ((index >= 0) & (index % 2 == 0)).nonzero().view(-1)  # the rejected: the next slot
        pc, pr = logp[chosen], logp[chosen + 1]
        ref = self.reference.to(logp.device)
        rc, rr = ref[index[chosen]].to(logp.dtype), ref[index[chosen] + 1].to(logp.dtype)
        beta, d = self.dpo.beta, self.dpo
        if d.loss_type == "ipo":  # TRL's IPO: log-probabilities averaged over the completion's tokens
            nc, nr = count[chosen].clamp(min=1).to(logp.dtype), count[chosen + 1].clamp(min=1).to(logp.dtype)
            margin = (pc - rc) / nc - (pr - rr) / nr
            losses = (margin - 1 / (2 * beta)) ** 2
        else:
            margin = (pc - rc) - (pr - rr)
            ls = d.label_smoothing
            losses = -(1 - ls) * F.logsigmoid(beta * margin) - ls * F.logsigmoid(-beta * margin)
        cp = self.cp.size if self.cp is not None else 1
        if self.step_weight is not None:
            loss = losses.sum() * self.step_weight / cp
        else:
            loss = losses.sum() / max(1, chosen.numel())
        with torch.no_grad():
            rew_c, rew_r = beta * (pc - rc), beta * (pr - rr)
            sums = [chosen.numel(), rew_c.sum(), rew_r.sum(), (rew_c > rew_r).sum(), (rew_c - rew_r).sum(),
                    pc.sum(), pr.sum()]  # fmt: skip
            self.figures += torch.tensor([float(v) for v in sums], dtype=torch.float64)
        return loss
