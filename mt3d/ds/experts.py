"""Expert parallelism inside DeepSpeed's pipeline engine.

Why not DeepSpeed's own MoE path: the engine switches to it (``has_moe_layers``) only when the model
holds ``deepspeed.moe.layer.MoE`` (or AutoEP) modules, and then saves and loads checkpoints in the
native MoE layout (whole-module ``mp_rank`` files plus per-expert files found by the
``deepspeed_moe.experts.deepspeed_experts.N`` names of its own module), which the pipeline engine's
per-layer files and mt3d's experts (named by global index, split over TP) do not follow. Its router
is also not transformers' (``mt3d.model.moe``). So mt3d counts the ep ranks in DeepSpeed's 'model'
axis (``parallel.axes``): every (tp, ep) rank writes its own layer files and optimizer partitions,
and DeepSpeed reduces gradients and partitions ZeRO states over 'data' = dp / ep x cp, which is
exactly the expert-data-parallel group for expert weights. What DeepSpeed then does not know is done
here, once per step and once at start-up:

* gradients (``reduce_over_experts``, right before DeepSpeed's own reduction): dense gradients are summed
  over the ep group and every gradient divided by ep, so DeepSpeed's average over dp / ep x cp
  becomes the average over dp x cp for dense weights and the sum over ep groups' tokens / (dp x cp)
  for experts (each expert already received its gradient from every ep rank's tokens through the
  all-to-all's backward);
* norms (``count_dense_once``): dense weights are held by every ep rank; on ep ranks > 0 they carry
  DeepSpeed's ``ds_pipe_replicated`` mark (meant for tied weights held by several stages: "counted
  once"), which every DeepSpeed norm honours, and experts are marked model-parallel so they count on
  every rank, except an expert tensor TP does not split (gpt-oss's down bias), counted on TP rank 0
  (``tp_copy`` on the others);
* the reported loss is averaged over ep in the training loop (DeepSpeed averages over its 'data');
* resharding (``tp_slices``): DeepSpeed's universal loader slices TP-split states by the grid's
  'model' rank and size, which count ep ranks too; the load runs with mt3d's tp group instead.

The cost against DeepSpeed-MoE's layout: ZeRO-1 partitions dense optimizer states over dp / ep x cp
instead of dp x cp (the planner's memory model counts it), and dense gradients take a second
all-reduce over ep (the same bytes as one over dp, in two hops).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist


def is_expert(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` belongs to a routed expert (``mt3d.model.moe.Expert`` marks them)."""
    return bool(getattr(p, "mt3d_expert", False))


def count_dense_once(module: torch.nn.Module, ep_rank: int) -> None:
    """Mark parameters so DeepSpeed's gradient norms count dense weights once over ep (see above)."""
    for p in module.parameters():
        if is_expert(p) and getattr(p, "tp_copy", False):
            p.ds_pipe_replicated = True  # TP rank 0 holds the same tensor and counts it
        elif is_expert(p):
            p.model_parallel = True  # distinct on every (tp, ep) rank: always counted
        elif ep_rank > 0:
            p.ds_pipe_replicated = True  # only set, never cleared: tied weights keep their mark


def gradient_pairs(engine) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, the gradient tensor DeepSpeed is about to reduce) for every trainable parameter:
    the BF16 optimizer accumulates into its own fp32 buffers, the others into ``p.grad``."""
    opt = engine.optimizer
    if hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_gradients"):
        return [
            (p, g)
            for ps, gs in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True)
            for p, g in zip(ps, gs, strict=True)
        ]
    return [(p, p.grad) for p in engine.module.parameters() if p.requires_grad and p.grad is not None]


@torch.no_grad()
def reduce_over_experts(pairs, ep) -> None:
    """Sum dense gradients over the ep group, divide every gradient by ep (see above)."""
    dense = [g for p, g in pairs if not is_expert(p)]
    if dense:
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat, group=ep.group)
        offset = 0
        for g in dense:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for _, g in pairs:
        g.div_(ep.size)


def install(engine, ep) -> None:
    """Make ``engine`` (DeepSpeed's pipeline engine or mt3d's interleaved one) train expert-parallel
    over ``ep`` (an ``AxisGroup``): the norm marks, and the reduction over ep run right before the
    engine's own. The schedule's reduce step (``_exec_reduce_grads``) is dispatched from a class-level
    table, so what is wrapped is what it calls on the instance: ``allreduce_gradients``, or
    ``_bf16_reduce_grads`` with the BF16 optimizer."""
    count_dense_once(engine.module, ep.rank)
    for name in ("allreduce_gradients", "_bf16_reduce_grads"):
        inner = getattr(engine, name)

        def wrapped(*args, _inner=inner, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                reduce_over_experts(gradient_pairs(engine), ep)
            return _inner(*args, **kwargs)

        setattr(engine, name, wrapped)


def loading(engine, state, universal: bool):
    """The context a checkpoint load of ``engine`` runs in (``tp_slices`` for a universal load at ep > 1)."""
    return tp_slices(engine, state.tp) if universal and state.ep.size > 1 else nullcontext()


@contextmanager
def tp_slices(engine, tp):
    """DeepSpeed's pipeline grid reports its whole 'model' axis (tp x ep ranks) as the tensor-slicing
    group; its universal loader slices TP-split states by that rank and size. While this is open the
    grid (``engine.mpu``) answers with mt3d's tp group (``tp``: an ``AxisGroup``) instead."""
    grid = engine.mpu
    names = {
        "get_slice_parallel_rank": tp.rank,
        "get_tensor_model_parallel_rank": tp.rank,
        "get_slice_parallel_world_size": tp.size,
        "get_tensor_model_parallel_world_size": tp.size,
    }
    for name, value in names.items():
        setattr(grid, name, lambda value=value: value)
    try:
        yield
    finally:
        for name in names:
            delattr(grid, name)


__all__ = ["count_dense_once", "gradient_pairs", "install", "is_expert", "loading",
           "reduce_over_experts", "tp_slices"]  # fmt: skip
