"""Expert parallelism inside DeepSpeed's pipeline engine and its ZeRO optimizers.

Why not DeepSpeed's own MoE path: the engine switches to it (``has_moe_layers``) only when the model
holds ``deepspeed.moe.layer.MoE`` (or AutoEP) modules, and then saves and loads checkpoints in the
native MoE layout (whole-module ``mp_rank`` files plus per-expert files found by the
``deepspeed_moe.experts.deepspeed_experts.N`` names of its own module), which the pipeline engine's
per-layer files and mt3d's experts (named by global index, split over TP) do not follow. Its router
is also not transformers' (``mt3d.model.moe``). So mt3d counts the ep ranks in DeepSpeed's 'model'
axis (``parallel.axes``): every (tp, ep) rank writes its own layer files and optimizer partitions,
and the engine's 'data' axis is dp / ep x cp, the ranks holding the same experts (``state.edp``).
Folded (``parallel.expert_layout``) the 'model' axis is lcm(tp, etp x ep) ranks and 'data' the rest of
the stage: ranks holding the same dense shard and the same experts, fewer than ``state.edp``.

With ZeRO 1-2 (``zero_optimizer``): DeepSpeed's ZeRO optimizer does have parameter groups with their
own data-parallel group ('moe' groups); the engine hands it its MoE groups only on its MoE path, so
mt3d builds it with them (``expert_groups``): dense weights partitioned over all dp x cp ranks
(``state.dense``), experts over the dp / ep x cp ranks that hold them, gradients reduced once over
each (DeepSpeed divides both by dp x cp: the mean over every rank's tokens, which an expert's
gradient already sums over its ep group through the all-to-all's backward), gradient norms summed
over dp x cp and over pipe x tp (``state`` as its mpu: the grid's 'model' axis holds ep ranks too),
and the BF16 optimizer (which has no MoE path without the engine's) replaced by it. Each rank then
writes its own optimizer file, named by its dp x cp rank (``save_zero_checkpoint``), and reads it
back (``zero_checkpoint_names``).

Without ZeRO (``reduce_over_experts``, right before DeepSpeed's own reduction over 'data'): dense
gradients are summed over the ep group and every gradient divided by ep, so DeepSpeed's average over
dp / ep x cp becomes the average over dp x cp; dense weights on ep ranks > 0 carry DeepSpeed's
``ds_pipe_replicated`` mark (meant for tied weights held by several stages: "counted once"), which
DeepSpeed's ZeRO and BF16 norms honour (its ``clip_grad_norm_``, which does not, gets only the
unmarked ones: ``ds.engine.guard_fp32_without_zero``). A folded layout (``parallel.expert_layout``)
reduces in place of DeepSpeed (``reduce_folded``: dense over dp x cp, experts over edp) and marks the
copies on DeepSpeed's 'model' axis the same way (``count_dense_once``).

Either way experts are marked model-parallel so norms count them on every rank (folded without ZeRO:
on the first etp x ep ranks of the 'model' axis, the others hold copies), except an expert tensor TP
does not split (gpt-oss's down bias), counted on TP rank 0 (``tp_copy`` on the others);
the reported loss is averaged over ep in the training loop (DeepSpeed averages over its 'data'); and
resharding (``tp_slices``): DeepSpeed's universal loader slices TP-split states by the grid's 'model'
rank and size, which count ep ranks too; the load runs with mt3d's tp group instead.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist


def is_expert(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` belongs to a routed expert (``mt3d.model.moe.Expert`` marks them)."""
    return bool(getattr(p, "mt3d_expert", False))


PARTITION_RANKS = "mt3d_partition_ranks"
"""The key under which an optimizer file of ``ExpertZeroOptimizer`` records its rank in each parameter
group's ZeRO group (dense: dp x cp, experts: edp): the order of its fragments when a folded checkpoint
is converted to the universal form (``universal._convert_folded``), whose file names give neither."""

COORDINATE = "mt3d_coordinate"
"""The key under which an optimizer file of ``ExpertZeroOptimizer`` records its rank's pipeline stage
and DeepSpeed 'model' coordinate (``zero_checkpoint_names``)."""

EXPERT_GROUP = "mt3d_experts"
"""The name of the expert parameter groups (DeepSpeed's ``group['name']``, the key of its
expert-data-parallel group dictionary): one name at every ep, so a resharded run's groups match."""


def count_dense_once(module: torch.nn.Module, model_rank: int, tp: int, expert_ranks: int,
                     partitioned: bool) -> None:  # fmt: skip
    """Mark parameters so DeepSpeed's gradient norms count each once (see above). ``model_rank``: the
    rank's coordinate on DeepSpeed's 'model' axis (L = lcm(tp, etp x ep) ranks: ``ExpertLayout``), whose
    ranks hold the same dense TP shard every ``tp`` places and the same experts every ``expert_ranks`` =
    etp x ep places (before folding L = tp x ep, so dense weights repeat on ep ranks > 0 and experts
    never); ``partitioned``: ZeRO partitions the states, so each rank's share is distinct."""
    for p in module.parameters():
        if is_expert(p) and getattr(p, "tp_copy", False):
            p.ds_pipe_replicated = True  # TP rank 0 holds the same tensor and counts it
        elif is_expert(p):
            p.model_parallel = True  # distinct on every (etp, ep) rank: counted once among them
            if model_rank >= expert_ranks and not partitioned:
                p.ds_pipe_replicated = True
        elif model_rank >= tp and not partitioned:
            p.ds_pipe_replicated = True  # only set, never cleared: tied weights keep their mark


def expert_groups(groups: list[dict], one_each: bool = False) -> list[dict]:
    """``groups`` (mt3d's optimizer parameter groups) with the experts in groups of their own, after
    the dense ones and with the same settings, marked as DeepSpeed's ZeRO optimizer recognises them
    ('moe' groups of ``EXPERT_GROUP``; ``zero_optimizer`` marks their parameters). Dense first: DeepSpeed's
    universal loader pairs a run's groups with the checkpoint's by position
    (``mt3d.ds.universal.pad_param_groups``). ``one_each``: the weight decay is 0, so the groups by decay
    differ in nothing; one dense group and one expert group (``mt3d.config.layout.PARAM_GROUPS``)."""
    if one_each:
        groups = [{"params": [p for g in groups for p in g["params"]], "weight_decay": 0.0}]
    dense, experts = [], []
    for g in groups:
        mine = [p for p in g["params"] if is_expert(p)]
        rest = [p for p in g["params"] if not is_expert(p)]
        if rest:
            dense.append({**g, "params": rest})
        if mine:
            experts.append({**g, "params": mine, "moe": True, "name": EXPERT_GROUP})
    return dense + experts


@contextmanager
def zero_optimizer(state):
    """While open, DeepSpeed's engine builds its ZeRO 1-2 optimizer over mt3d's groups (see above):
    dense states over ``state.dense``, expert groups over ``state.edp``, norms over ``state``'s
    pipe x tp; bf16 with ZeRO-1 takes the same optimizer instead of the BF16 one; the start-up
    broadcast sends dense weights over ``state.dense`` and experts over ``state.edp`` (the regular
    engine's would send rank 0's experts to every ep rank). ``state``: the rank's ``ParallelState``."""
    from deepspeed.runtime import engine as ds_engine

    built, check = ds_engine.DeepSpeedZeroOptimizer, ds_engine.DeepSpeedEngine._do_optimizer_sanity_check
    broadcast = ds_engine.DeepSpeedEngine._broadcast_model

    def build(optimizer, *args, **kwargs):
        # DeepSpeed's mark of an expert parameter, set only now: the engine's start-up broadcast reads
        # it too, and would look for the group in DeepSpeed's own registry
        moe = [group for group in optimizer.param_groups if group.get("moe")]
        for p in (p for group in moe for p in group["params"]):
            p.allreduce, p.group_name = False, EXPERT_GROUP
        kwargs.update(dp_process_group=state.dense.group, has_moe_layers=bool(moe), mpu=state)
        if moe:  # none when the experts are frozen (LoRA): every trainable weight is dense
            kwargs.update(
                expert_parallel_group={EXPERT_GROUP: state.ep.group},
                expert_data_parallel_group={EXPERT_GROUP: state.edp.group},
            )
        return expert_zero_optimizer()(optimizer, *args, **kwargs)

    def sanity_check(self, basic_optimizer):
        kind = check(self, basic_optimizer)
        return ds_engine.ZERO_OPTIMIZATION if kind == ds_engine.BFLOAT16 else kind

    def broadcast_model(self):
        for p in self.module.parameters():
            group = state.edp if is_expert(p) else state.dense
            if group.size > 1:
                dist.broadcast(p.data, src=group.ranks[0], group=group.group)

    ds_engine.DeepSpeedZeroOptimizer = build
    ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = sanity_check
    ds_engine.DeepSpeedEngine._broadcast_model = broadcast_model
    try:
        yield
    finally:
        ds_engine.DeepSpeedZeroOptimizer = built
        ds_engine.DeepSpeedEngine._do_optimizer_sanity_check = check
        ds_engine.DeepSpeedEngine._broadcast_model = broadcast


@functools.cache
def expert_zero_optimizer():
    """DeepSpeed's ZeRO 1-2 optimizer with the gradient norm of all its groups reduced at once.

    DeepSpeed reduces each group's squared norm over the ZeRO group and again over pipe x tp, then
    averages each expert group's over its own ranks (which hold the same value already): 2 n + e
    latency-bound collectives per step for n groups, e of them experts'. Under ep mt3d has a group
    more than a model without experts (experts apart from dense weights), so this is where ep's step
    pays for them: at ep 2 on 2 CPU processes mt3d's step went from 1.085 of DeepSpeed AutoEP's to
    1.02-1.06 with this (``python -m mt3d.bench autoep``, docs/benchmarks.md). Here the same squares
    (DeepSpeed's marks honoured: ``ds_pipe_replicated`` skipped, weights not split over TP counted
    on TP rank 0) are summed per group, all groups in one tensor reduced once over dp x cp and once
    over pipe x tp, then combined as DeepSpeed combines them.
    CPU offload (norms computed in its own pass) keeps DeepSpeed's."""
    from deepspeed.runtime.utils import (
        combine_grad_norm_groups,
        is_model_parallel_parameter,
        mask_nan_or_inf_with_val_inplace,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.utils import get_norm_dtype

    class ExpertZeroOptimizer(DeepSpeedZeroOptimizer):
        def state_dict(self):
            """DeepSpeed's, with this rank's ZeRO rank in each group's ZeRO group (``PARTITION_RANKS``)."""
            state = super().state_dict()
            state[PARTITION_RANKS] = [dist.get_rank(group=g) for g in self.real_dp_process_group]
            state[COORDINATE] = getattr(self, "mt3d_coordinate", None)
            return state

        def scaled_global_norm(self, norm_type=2):
            groups = range(len(self.bit16_groups))
            muon = any(self._muon_update_lacks_loss_scale(i) for i in groups)
            if self.cpu_offload or norm_type != 2 or muon:
                return super().scaled_global_norm(norm_type)
            squares = []
            for i in groups:
                grads = [g for g in self.averaged_gradients[i] if not getattr(g, "_zero_padding", False)]
                counted = [
                    g.detach().to(get_norm_dtype())
                    for g, p in zip(grads, self.params_in_partition[i])
                    if not getattr(p, "ds_pipe_replicated", False)
                    and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
                ]
                norms = torch._foreach_norm(counted, 2) if counted else []  # one call, as clip_grad_norm_'s
                squares.append(torch.stack(norms).pow(2).sum().float() if norms else torch.zeros(()))
            total = torch.stack([s.to(squares[0].device) for s in squares])
            dist.all_reduce(total, group=self.dp_process_group)
            model = self.model_parallel_group
            if model is not None and dist.get_world_size(model) > 1:
                dist.all_reduce(total, group=model)
            norms = total.sqrt()
            mask_nan_or_inf_with_val_inplace(norms, device=self.device)
            return combine_grad_norm_groups(list(norms), norm_type=2)

    return ExpertZeroOptimizer


def grid_coordinate(state) -> tuple[int, int, int]:
    """This rank's (pipe, data, model) coordinate in DeepSpeed's pipeline grid
    (``Placement.deepspeed_grid``)."""
    grid = state.placement.deepspeed_grid()  # [pipe, data, model]: the global rank at each coordinate
    pipe, data, model = (int(c[0]) for c in (grid == state.global_rank).nonzero())
    return pipe, data, model


def zero_checkpoint_names(engine, state) -> None:
    """With ``zero_optimizer``, every rank writes its optimizer file (DeepSpeed's engine lets only the
    ranks whose dp x cp rank equals their 'data' rank write), named by its dp x cp rank, and reads
    that one back: the engine lists names up to its 'data' size, not dp x cp.

    The regular engine (ZeRO-2) names its files by mt3d's pipe x tp rank and lets dp x cp rank 0 alone
    write the module: under ep the ranks at 'data' coordinate 0 of the pipeline grid write theirs (their
    dense TP shard and their experts), named by their 'model' coordinate (e * tp + t before folding,
    the position mod lcm(tp, etp ep) after: ``ExpertLayout.deepspeed_grid``), among that many model
    ranks (``mp_world_size``: DeepSpeed's loader merges files when there are more than its model
    ranks, and checks their count against the saved one)."""
    engine.save_zero_checkpoint = True
    dense_size = state.dense.size

    def names(load_dir, tag, bf16_mode):
        return engine._get_mp_rank_zero_checkpoint_names(
            load_dir=load_dir,
            tag=tag,
            mp_rank=engine.checkpoint_mp_rank,
            dp_world_size=dense_size,
            bf16_mode=bf16_mode,
        )

    engine._get_all_zero_checkpoint_names = names
    from deepspeed.runtime.pipe.engine import PipelineEngine

    pipe, data, model = grid_coordinate(state)
    # what the optimizer file's number does not say under every rank order (the pipeline engine numbers
    # it by the rank's place among its 'data' coordinate's ranks): read by universal._convert_folded
    engine.optimizer.mt3d_coordinate = {"pipe": pipe, "model": model}
    if isinstance(engine, PipelineEngine):
        return
    engine.checkpoint_mp_rank = model
    engine.save_non_zero_checkpoint = data == 0
    # the module files' count (the grid's 'model' axis), which DeepSpeed's loader checks
    engine.mp_world_size = state.placement.expert.model_ranks


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


def _sum_flat(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` (an ``AxisGroup``) in one flat all-reduce, in place."""
    if not grads or group.size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def reduce_over_experts(pairs, ep) -> None:
    """Sum dense gradients over the ep group, divide every gradient by ep (see above)."""
    _sum_flat([g for p, g in pairs if not is_expert(p)], ep)
    for _, g in pairs:
        g.div_(ep.size)


@torch.no_grad()
def reduce_folded(pairs, state) -> None:
    """A folded layout's whole reduction without ZeRO (DeepSpeed's over its 'data' axis is skipped: those
    ranks hold the same dense shard and experts, but dense weights repeat over more ranks than that):
    dense gradients summed over dp x cp (``state.dense``), experts' over their replicas (``state.edp``),
    all divided by dp x cp, DeepSpeed's mean over every rank's tokens (as with ZeRO, see above)."""
    _sum_flat([g for p, g in pairs if not is_expert(p)], state.dense)
    _sum_flat([g for p, g in pairs if is_expert(p)], state.edp)
    for _, g in pairs:
        g.div_(state.dense.size)


def install(engine, state, zero_stage: int) -> None:
    """Make ``engine`` (DeepSpeed's pipeline engine, mt3d's interleaved one, or at ZeRO-2 the regular
    one, built inside ``zero_optimizer`` when ``zero_stage`` > 0) train expert-parallel over
    ``state.ep``: the norm marks, and with ZeRO its checkpoint names, else the reduction over ep run
    right before the engine's own (folded: in place of it, ``reduce_folded``). The schedule's reduce
    step (``_exec_reduce_grads``) is dispatched from a class-level table, so what is wrapped is what it
    calls on the instance: ``allreduce_gradients``, or ``_bf16_reduce_grads`` with the BF16 optimizer."""
    ep, layout = state.ep, state.placement.expert
    model_rank = grid_coordinate(state)[2]
    count_dense_once(engine.module, model_rank, layout.tp, layout.etp * layout.ep, partitioned=zero_stage > 0)
    if zero_stage > 0:
        zero_checkpoint_names(engine, state)
        return
    for name in ("allreduce_gradients", "_bf16_reduce_grads"):
        inner = getattr(engine, name)

        def wrapped(*args, _inner=inner, **kwargs):
            if not engine.is_gradient_accumulation_boundary():
                return _inner(*args, **kwargs)
            if layout.folded:
                return reduce_folded(gradient_pairs(engine), state)
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


__all__ = ["EXPERT_GROUP", "count_dense_once", "expert_groups", "gradient_pairs", "install",
           "grid_coordinate", "is_expert", "loading", "reduce_folded", "reduce_over_experts", "tp_slices",
           "zero_checkpoint_names", "zero_optimizer"]  # fmt: skip
