"""Vocab-parallel cross entropy: the loss over logits split by vocabulary across TP ranks.

No rank ever holds the full-vocabulary logits: each reduces its own slice and three small
all-reduces over TP (max, sum of exponentials, target logit) give the exact loss. Logit columns
at or beyond ``vocab_size`` (vocabulary padding) are excluded. Targets equal to ``ignore_index``
get zero loss and zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mappings import all_reduce
from .state import AxisGroup

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss over a vocab-split logits tensor; backward is softmax minus one-hot."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index):
        per = logits.shape[-1]
        start = tp.rank * per
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax is computed in at least fp32
        padded = torch.arange(start, start + per, device=logits.device) >= vocab_size
        if padded.any():
            logits = logits.masked_fill(padded, float("-inf"))
        # The max is only a shift for stability; any value common to all ranks is exact.
        shift = logits.max(dim=-1).values
        if tp.size > 1:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=tp.group)
        exp = torch.exp(logits - shift.unsqueeze(-1))
        sum_exp = all_reduce(exp.sum(dim=-1), tp)

        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < per) & ~ignored
        idx = local_t.clamp(0, per - 1).unsqueeze(-1)
        target_logit = torch.where(mine, torch.gather(logits, -1, idx).squeeze(-1) - shift, 0.0)
        target_logit = all_reduce(target_logit, tp)

        loss = torch.log(sum_exp) - target_logit
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: AxisGroup,
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token cross entropy (at least fp32) of this rank's logits slice vs ``target``.

    ``logits`` is [..., V_pad/tp], ``target`` [...]. ``vocab_size`` is the real vocabulary:
    padded columns never count. Ignored targets give 0.
    The gradient returned to ``logits`` has the logits' dtype.
    """
    if tp.size > 1:
        return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, ignore_index)
    if logits.is_cuda or logits.dtype in (torch.float16, torch.bfloat16):
        return _WholeVocabCrossEntropy.apply(logits, target, vocab_size, ignore_index)
    # fp32 (or fp64) off the GPU: there is no copy to avoid and nothing compiled, and torch's fused
    # kernels are cheaper than the own function's eager steps (0.4-0.7 ms of a 30 ms step's CPU in
    # ``mt3d.bench autoep``, measured in alternating steps of one run)
    flat = logits[..., :vocab_size].reshape(-1, vocab_size)
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index, reduction="none").view(
        target.shape
    )


class _WholeVocabCrossEntropy(torch.autograd.Function):
    """Per-token loss over the whole vocabulary (tp 1, on a GPU or of half logits) in at least fp32,
    keeping no fp32 copy of the logits:
    the forward saves the logits as they are and one log-sum-exp per token, the backward rebuilds
    softmax minus one-hot from them. On a GPU both halves run compiled, each one pass over the
    logits (eager, a bf16 step of gpt3-1.3b spent about 23 ms in fp32 copies, log-softmax and its
    backward over its 16 x 2048 x 50,304 logits)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index):
        loss, lse = _kernel(_ce_forward, logits)(logits, target, vocab_size, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.vocab, ctx.ignore = vocab_size, ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad = _kernel(_ce_backward, logits)(logits, target, lse, grad_loss, ctx.vocab, ctx.ignore)
        return grad, None, None, None


def _ce_forward(logits, target, vocab_size: int, ignore_index: int):
    """(loss, log-sum-exp) per token over the first ``vocab_size`` columns, in fp32."""
    x = _wide(logits[..., :vocab_size])
    lse = torch.logsumexp(x, dim=-1)
    ignored = target == ignore_index
    picked = x.gather(-1, torch.where(ignored, 0, target).unsqueeze(-1)).squeeze(-1)
    return torch.where(ignored, 0.0, lse - picked), lse


def _ce_backward(logits, target, lse, grad_loss, vocab_size: int, ignore_index: int):
    """d loss / d logits: (softmax - one-hot) x the loss's gradient, 0 on padded columns and ignored
    targets, in the logits' dtype."""
    cols = torch.arange(logits.shape[-1], device=logits.device)
    p = torch.exp(_wide(logits) - lse.unsqueeze(-1)).masked_fill(cols >= vocab_size, 0.0)
    hit = (cols == target.unsqueeze(-1)).to(p.dtype)
    scale = torch.where(target == ignore_index, 0.0, grad_loss.to(p.dtype)).unsqueeze(-1)
    return ((p - hit) * scale).to(logits.dtype)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (half types upcast; fp64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


_COMPILED: dict = {}


def _kernel(fn, logits: torch.Tensor):
    """``fn`` compiled for CUDA tensors (fused into one pass over the logits), as is elsewhere."""
    if not logits.is_cuda:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def mean_loss(
    per_token: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean over the tokens that are not ignored (0 when all are)."""
    count = (target != ignore_index).sum().clamp(min=1)
    return per_token.sum() / count
