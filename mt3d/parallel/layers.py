"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Weights are initialised so that a shard equals the same slice of the unsharded weight drawn with the
same seed (``mt3d.parallel.init``): tp = 1 and tp = N start from the same model.

Split parameters carry ``tensor_model_parallel = True`` (with ``partition_dim``) so DeepSpeed's
gradient-norm code counts them on every TP rank; replicated ones are counted on TP rank 0 only.
With sequence parallelism, replicated parameters whose gradients come from a sequence shard are
marked ``sequence_parallel = True``; their gradients are summed over TP by a hook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .deferred import deferrable, deferring_function, is_deferring, is_split, weight_grad
from .fp8 import PLAIN, Gemms
from .init import BLOCK_ROWS, NoInit, NormalInit  # noqa: F401 - the layers' inits, imported from here too
from .lora import column_with_adapters, row_with_adapters
from .mappings import (
    SEQ_DIM,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    start_all_reduce,
    start_gather,
    start_reduce_scatter,
)
from .marks import (  # noqa: F401 - the marks, imported from here too
    mark_sequence_parallel,
    mark_tp,
    mark_tp_partial_grad,
    mark_vocab,
    shard_of,
)
from .state import AxisGroup


def _divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size {world}")
    return n // world


@deferring_function
class _ShardSavingLinear(torch.autograd.Function):
    """Y = all-gather(X shard over the sequence) A^T + b, keeping only the 1/tp shard of X for the
    backward (Megatron's sequence-parallel column linear; Korthikanti et al. 2022): the backward
    all-gathers X again while it computes the input gradient, then reduce-scatters that gradient
    while it computes the weight gradient, so both transfers overlap a GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, g, gemms):
        ctx.g, ctx.gemms, ctx.has_bias = g, gemms, bias is not None
        ctx.save_for_backward(x, weight)
        return gemms.gather_linear(x, weight, bias, g, SEQ_DIM)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gemms, g = ctx.gemms, ctx.g
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # deferred to W (``parallel.deferred``), the weight gradient gathers X there: B keeps the shard
        gathered = start_gather(x, g, SEQ_DIM) if need_w and not is_deferring() else None
        grad_x = None
        dy = gemms.grad_of(grad)
        if need_x:
            scatter = start_reduce_scatter(gemms.dgrad(dy, weight), g, SEQ_DIM)  # overlaps the gather

        def wgrad():  # overlaps the scatter
            rows = (gathered or start_gather(x, g, SEQ_DIM))().reshape(-1, x.shape[-1])
            return gemms.wgrad(dy, gemms.kept_of(rows))

        grad_w = weight_grad(weight, wgrad) if need_w else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if need_x:
            grad_x = scatter()
        return grad_x, grad_w, grad_b, None, None


def _save_kept(ctx, weight, kept: tuple) -> None:
    """Save ``weight`` and what the weight gradient reads of the input (``Gemms.linear``'s kept)."""
    ctx.save_for_backward(weight, *kept)


@deferring_function
class _AllReducingLinear(torch.autograd.Function):
    """Y = X A^T + b entering a TP region without sequence parallelism (Megatron's f, then the column
    linear): the backward starts the all-reduce of the input gradient as soon as that GEMM is done and
    computes the weight gradient while it runs (Megatron-LM's async tensor-parallel all-reduce),
    instead of autograd's order (both GEMMs, then the all-reduce of ``copy_to_tp``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, g, gemms):
        ctx.g, ctx.gemms, ctx.has_bias = g, gemms, bias is not None
        y, kept = gemms.linear(x, weight, bias)
        _save_kept(ctx, weight, kept)
        return y

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        gemms = ctx.gemms
        dy = gemms.grad_of(grad)
        reduced = start_all_reduce(gemms.dgrad(dy, weight), ctx.g) if ctx.needs_input_grad[0] else None
        # overlaps the all-reduce
        grad_w = weight_grad(weight, lambda: gemms.wgrad(dy, kept)) if ctx.needs_input_grad[1] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (reduced() if reduced else None), grad_w, grad_b, None, None


@deferring_function
class _Linear(torch.autograd.Function):
    """Y = X A^T + b through ``gemms`` (FP8), where the plain path is ``F.linear``: a linear outside
    the TP collectives (tp 1, a row-parallel linear before its reduction, SP's kept gathered input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms):
        ctx.gemms, ctx.has_bias = gemms, bias is not None
        y, kept = gemms.linear(x, weight, bias)
        _save_kept(ctx, weight, kept)
        return y

    @staticmethod
    def backward(ctx, grad):
        weight, *kept = ctx.saved_tensors
        gemms = ctx.gemms
        dy = gemms.grad_of(grad)
        grad_x = gemms.dgrad(dy, weight) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(weight, lambda: gemms.wgrad(dy, kept)) if ctx.needs_input_grad[1] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gemms: Gemms = PLAIN) -> torch.Tensor:  # fmt: skip
    """``x W^T + b`` on this rank's shard: ``F.linear`` itself for the plain GEMMs (bit-identical to
    what mt3d always ran), ``_Linear`` for FP8 and for a split backward (``parallel.deferred``)."""
    if gemms.fp8 is None and not is_split():
        return F.linear(x, weight, bias)
    return deferrable(_Linear)(x, weight, bias, gemms)


@deferring_function
class _RecomputedInputLinear(torch.autograd.Function):
    """z = fn(y) A^T keeping ``y`` for the backward, which recomputes ``fn(y)`` (cheap, elementwise)
    instead of keeping it: selective recompute of an MLP's activation function (its output, and for a
    gated MLP the gate's activation, are never kept)."""

    @staticmethod
    def forward(ctx, y, weight, fn, gemms):
        ctx.fn, ctx.gemms = fn, gemms
        ctx.save_for_backward(y, weight)
        with torch.no_grad():
            return gemms.linear(fn(y), weight, None)[0]

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        gemms = ctx.gemms
        with torch.enable_grad():
            y = y.detach().requires_grad_(ctx.needs_input_grad[0])
            h = ctx.fn(y)
        dy = gemms.grad_of(grad)
        kept = gemms.kept_of(h.detach().reshape(-1, h.shape[-1]))
        grad_w = weight_grad(weight, lambda: gemms.wgrad(dy, kept)) if ctx.needs_input_grad[1] else None
        grad_y = torch.autograd.grad(h, y, gemms.dgrad(dy, weight))[0] if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: AxisGroup,
                  sequence_parallel: bool, keep_gathered: bool = False,
                  gemms: Gemms = PLAIN) -> torch.Tensor:  # fmt: skip
    """Enter the TP region and apply this rank's columns of a linear: [b, s, in] (or [b, s/tp, in] with
    SP) -> [b, s, out/tp]. The backward's transfers overlap its GEMMs: with SP the input shard is
    gathered again during the input gradient and that gradient reduce-scattered during the weight
    gradient (``_ShardSavingLinear``; ``keep_gathered``: the gathered input kept instead, no
    overlap), without SP the input gradient is all-reduced during the weight gradient
    (``_AllReducingLinear``). The column-parallel linears and the vocabulary-parallel head use it;
    ``gemms``: the GEMMs (plain, or FP8: ``mt3d.parallel.fp8``)."""
    if tp.size > 1 and not (sequence_parallel and keep_gathered):
        fn = _ShardSavingLinear if sequence_parallel else _AllReducingLinear
        return deferrable(fn)(x, weight, bias, tp, gemms)
    x = gather_from_sequence(x, tp) if sequence_parallel else copy_to_tp(x, tp)
    return local_linear(x, weight, bias, gemms)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) over TP: Y_i = X A_i + b_i.

    Args:
        in_features, out_features: sizes of the unsharded layer.
        tp: the tensor-parallel group.
        bias: add a bias (split like the output).
        gather_output: all-gather Y so every rank holds all output features.
        sequence_parallel: the input is sharded over the sequence; all-gather it (reduce-scatter
            its gradient) instead of the f identity/all-reduce.
        keep_gathered: with sequence parallelism, keep the all-gathered input for the backward
            (s x in per sample) instead of its 1/tp shard gathered again there (``_ShardSavingLinear``).
        init: weight initialisation (the unsharded tensor is [out_features, in_features]).
        parts: sizes of fused outputs that are split over TP independently (e.g. (q, k, v) or
            (gate, up)); the local weight is the concatenation of each part's shard, so every
            rank holds matching slices of every part. Default: one part.
        dtype, device: of the local parameters.
        gemms: how its GEMMs run (plain, or FP8: ``mt3d.parallel.fp8``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: AxisGroup,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init: NormalInit,
        parts: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        keep_gathered: bool = False,
        gemms: Gemms = PLAIN,
    ) -> None:
        super().__init__()
        self.tp, self.gather_output, self.sequence_parallel = tp, gather_output, sequence_parallel
        self.keep_gathered, self.gemms = keep_gathered, gemms
        self.in_features, self.out_features = in_features, out_features
        self.parts = tuple(parts or (out_features,))
        if sum(self.parts) != out_features:
            raise ValueError(f"parts {self.parts} do not add up to out_features {out_features}")
        if gather_output and len(self.parts) > 1:
            raise ValueError("gather_output is not supported for fused parts")
        self.out_per_rank = sum(_divide(p, tp.size, "output features") for p in self.parts)
        inits = [init] if len(self.parts) == 1 else [init.part(i) for i in range(len(self.parts))]
        w = torch.cat(
            [ini.shard((p, in_features), 0, tp.rank, tp.size, dtype) for ini, p in zip(inits, self.parts)]
        )
        self.weight = mark_tp(nn.Parameter(w.to(device)), 0, self.parts)
        self.bias = None
        if bias:
            self.bias = mark_tp(
                nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype, device=device)), 0, self.parts
            )
        self.lora = nn.ModuleDict()  # LoRA adapters by HF module name (``mt3d.parallel.lora``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, in] (or [b, s/tp, in] with SP) -> [b, s, out/tp] (or out with gather_output)."""
        if len(self.lora):  # the adapters read the input the base reads: enter the TP region once
            x = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
            y = local_linear(x, self.weight, self.bias, self.gemms)
            y = column_with_adapters(y, x, self.lora.values())
        else:
            y = column_linear(
                x, self.weight, self.bias, self.tp, self.sequence_parallel, self.keep_gathered, self.gemms
            )
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of an input already inside the TP region (whole on every rank; its
        gradient reduced by whoever brought it there), adapters included: [.., in] -> [.., out/tp]."""
        y = local_linear(x, self.weight, self.bias, self.gemms)
        return column_with_adapters(y, x, self.lora.values()) if len(self.lora) else y

    def extra_repr(self) -> str:
        """Sizes and split shown by print(module)."""
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, sp={self.sequence_parallel}"
        )


class ReplicatedLinear(nn.Module):
    """Y = X A^T + b with A whole on every TP rank: small projections each rank computes itself (routers,
    latent attention's down projections). With sequence parallelism each rank computes on its own
    sequence shard, so the gradients are partial: summed over TP."""

    def __init__(self, in_features: int, out_features: int, *, tp: AxisGroup, bias: bool,
                 sequence_parallel: bool, init: NormalInit, dtype: torch.dtype = torch.float32,
                 device=None) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(init.rows(0, out_features, in_features, dtype).to(device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        if sequence_parallel:
            for p in self.parameters():
                mark_sequence_parallel(p, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[.., in] -> [.., out]."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) over TP: Y = sum_i X_i A_i + b.

    Args:
        in_features, out_features: sizes of the unsharded layer.
        tp: the tensor-parallel group.
        bias: add a bias after the reduction (replicated, not split).
        input_is_parallel: the input is already split over its last dimension (the usual case,
            after a ColumnParallelLinear); otherwise it is split here.
        sequence_parallel: reduce-scatter over the sequence instead of all-reducing.
        init: weight initialisation (the unsharded tensor is [out_features, in_features]).
        dtype, device: of the local parameters.
        gemms: how its GEMM runs (plain, or FP8: ``mt3d.parallel.fp8``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: AxisGroup,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init: NormalInit,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        gemms: Gemms = PLAIN,
    ) -> None:
        super().__init__()
        self.tp, self.input_is_parallel, self.sequence_parallel = tp, input_is_parallel, sequence_parallel
        self.gemms = gemms
        self.in_features, self.out_features = in_features, out_features
        _divide(in_features, tp.size, "input features")
        w = init.shard((out_features, in_features), 1, tp.rank, tp.size, dtype)
        self.weight = mark_tp(nn.Parameter(w.to(device)), 1)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            if sequence_parallel:
                mark_sequence_parallel(self.bias, tp)
        self.lora = nn.ModuleDict()  # LoRA adapters by HF module name (``mt3d.parallel.lora``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, in/tp] -> [b, s, out] (or [b, s/tp, out] with SP)."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)
        y = local_linear(x, self.weight, None, self.gemms)
        if len(self.lora):  # the adapters' shares join the base's partial product before the reduction
            y = row_with_adapters(y, x, self.lora.values())
        return self.finish(y)

    def forward_recomputing(self, y: torch.Tensor, fn) -> torch.Tensor:
        """``forward(fn(y))`` keeping ``y`` rather than ``fn(y)`` for the backward, which recomputes
        ``fn`` (an elementwise function: selective recompute). Inside a compiled block the compiler's
        partitioner already recomputes elementwise work in the backward rather than keeping it, and
        cannot trace the autograd call of ``_RecomputedInputLinear``'s backward: plain ``forward``."""
        if torch.compiler.is_compiling() or len(self.lora):  # the adapters read fn(y) too
            return self.forward(fn(y))
        return self.finish(deferrable(_RecomputedInputLinear)(y, self.weight, fn, self.gemms))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the layer's output (the reduction over TP, then the bias)."""
        y = reduce_scatter_to_sequence(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        """Sizes and split shown by print(module)."""
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, sp={self.sequence_parallel}"
        )


def pad_vocab(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of ``multiple * tp_size`` (Megatron's make-vocab-divisible-by)."""
    unit = multiple * tp_size
    return -(-vocab_size // unit) * unit


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split over TP.

    Each rank looks up the ids in its vocabulary range, zeroes the others, and the partial
    embeddings are summed over TP (reduce-scattered over the sequence with SP). Padded rows are
    zero and are never looked up.

    Args:
        vocab_size: real vocabulary size.
        hidden: embedding width.
        tp: the tensor-parallel group.
        padded_vocab_size: total rows; default ``pad_vocab(vocab_size, tp.size)``.
        sequence_parallel: return a sequence shard (reduce-scatter) instead of the full sequence.
        init: initialisation of the real rows ([vocab, hidden] unsharded).
        dtype, device: of the local parameters.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        *,
        tp: AxisGroup,
        padded_vocab_size: int | None = None,
        sequence_parallel: bool = False,
        init: NormalInit,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.vocab_size, self.hidden = vocab_size, hidden
        self.padded_vocab_size = padded_vocab_size or pad_vocab(vocab_size, tp.size)
        if self.padded_vocab_size < vocab_size:
            raise ValueError(f"padded vocab {self.padded_vocab_size} is smaller than the vocab {vocab_size}")
        per = _divide(self.padded_vocab_size, tp.size, "padded vocabulary")
        self.vocab_start, self.vocab_end = tp.rank * per, (tp.rank + 1) * per
        w = init.shard((self.padded_vocab_size, hidden), 0, tp.rank, tp.size, dtype, valid_rows=vocab_size)
        self.weight = mark_vocab(mark_tp(nn.Parameter(w.to(device)), 0), vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s, hidden] (or [b, s/tp, hidden] with SP)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (
            reduce_scatter_to_sequence(out, self.tp)
            if self.sequence_parallel
            else reduce_from_tp(out, self.tp)
        )

    def extra_repr(self) -> str:
        """Sizes and split shown by print(module)."""
        v = f"vocab={self.vocab_size} (padded {self.padded_vocab_size})"
        return f"{v}, hidden={self.hidden}, tp={self.tp.size}"
