"""The DeepSpeed engine as mt3d builds it: the config DeepSpeed gets, ``deepspeed.initialize`` (or
the interleaved engine), and what mt3d patches on the engine afterwards, each with why.

* ``deepspeed_config``: DeepSpeed's dict with mt3d's necessary adjustments (explained inline);
  tests/test_checkpoint.py::test_deepspeed_fused_adam_builder_still_breaks_on_arch_suffixes watches
  the FusedAdam builder bug that makes mt3d pick torch's AdamW.
* ``guard_fp32_without_zero``: fp32 without ZeRO, where DeepSpeed clips with a norm it does not keep
  and applies non-finite gradients: ``opt.step``, ``clip_fp32_gradients`` and ``_global_grad_norm``
  are replaced (tests/test_checkpoint.py::test_nan_steps_are_skipped_without_zero_too).
* ``SafeCheckpointEngine``: DeepSpeed's checkpoint engine unpickles with ``weights_only=False``; the
  engine's loader is wrapped so every load goes through mt3d's allow-list
  (tests/test_checkpoint.py::test_deepspeed_workarounds_are_still_needed).
* ``release_loss_outputs``: the pipeline engine's last stage keeps its logits after the backward;
  they are released once the loss is computed
  (tests/test_training.py::test_the_last_stage_releases_its_logits_once_the_loss_holds_them).
* ``alone_in_zero`` / ``skip_reduction``: ZeRO-1 with no other data rank reduces nothing, yet
  DeepSpeed copies every gradient into a bucket and back (a no-op here, with contiguous gradients
  off), and checks overflow and takes the norm with kernels per gradient (one foreach norm here)
  (tests/test_training.py::test_one_data_rank_skips_deepspeeds_reduction_with_the_same_step).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ..config import DeepSpeedSection, Layout
from ..config.rules import uses_pipeline_engine
from ..parallel.axes import deepspeed_sizes
from .instructions import wrap_instructions


def deepspeed_config(
    ds: DeepSpeedSection,
    layout: Layout,
    *,
    sequence_parallel: bool,
    on_cpu: bool,
    stream_tuple: bool = False,
    overlap_grad_reduce: bool = False,
    optimizer_states: str = "fp32",
    mt3d_schedule: bool = False,
) -> dict:
    """DeepSpeed's dict for this run, with mt3d's necessary adjustments (each explained).
    ``stream_tuple``: stages pass a tuple of tensors (a sparse model's router statistics);
    ``overlap_grad_reduce``: gradients are reduced during the backward (``mt3d.ds.overlap``);
    ``optimizer_states``: ``mt3d.train.optimizer_states``; ``mt3d_schedule``: the model is an
    ``InterleavedPipeline``, run by mt3d's schedule engine (v > 1, or ``mt3d.train.overlap.p2p``)."""
    out = ds.copy()
    # mt3d prints its own progress; DeepSpeed's per-step prints would interleave with it.
    out.setdefault("steps_per_print", 10**9)
    data = deepspeed_sizes(layout.degrees)["data"]
    if data != layout.dp and uses_pipeline_engine(layout):
        # DeepSpeed's pipeline grid checks train_batch_size = micro-batch x accumulation x the size of
        # its 'data' axis, which holds dp / ep x cp ranks (mt3d.parallel.axes): each cp rank's chunks
        # of a sample count as a sample of their own, and the ep ranks count in its 'model' axis
        # (global_samples grows by global_batch x cp / ep per step).
        out["train_batch_size"] = layout.global_batch * data // layout.dp
    # mt3d owns the W&B run (metrics.WandbSink: best effort, silent once a stop signal arrived);
    # DeepSpeed's monitor would log into it with calls that raise when the launcher has already
    # killed W&B's helper during a preemption save.
    out.pop("wandb", None)
    if (sequence_parallel and layout.tp > 1) or mt3d_schedule or stream_tuple:
        # DeepSpeed's pipe/grad partitioning assumes activations identical across TP ranks, which
        # sequence shards are not (DEEPSPEED_NOTES.md), one exchange per neighbour at a time, which
        # the interleaved schedule's batched ring exchange is not, and that only the first tensor of a
        # tuple needs a gradient (engine.py asserts it), which a sparse model's router statistics do.
        pipe = out.setdefault("pipeline", {})
        pipe["pipe_partitioned"] = False
        pipe["grad_partitioned"] = False
    if (overlap_grad_reduce or layout.schedule != "1f1b") and layout.precision == "bf16":
        # The BF16 optimizer then accumulates each parameter's fp32 gradient from a hook as soon as
        # it is ready, instead of all of them after the backward: what mt3d.ds.overlap reduces, and
        # what a zero-bubble W (after the backward, before the next one clears the bf16 gradients) needs.
        out.setdefault("bf16", {})["immediate_grad_update"] = True
    if optimizer_states == "bf16":
        # bf16 master weights and moments live in DeepSpeed's ZeRO optimizers only; DeepSpeed picks
        # its BF16 optimizer instead (fp32 master, keys ignored) when gradients accumulate in fp32.
        out.setdefault("bf16", {}).update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        out.setdefault("data_types", {})["grad_accum_dtype"] = "bf16"
    if alone_in_zero(layout, overlap_grad_reduce):
        # ZeRO-1 with no other data rank: gradients are not copied into buckets (see skip_reduction)
        out.setdefault("zero_optimization", {}).setdefault("contiguous_gradients", False)
    opt = out.get("optimizer")
    if isinstance(opt, dict) and ds.optimizer_type in ("adam", "adamw"):
        offload = ds.offload.optimizer in ("cpu", "nvme")
        params = opt.setdefault("params", {})
        if not offload and "torch_adam" not in params:
            # DeepSpeed's FusedAdam is JIT-compiled on first use: ~30 s on a CPU, and on GPUs whose
            # TORCH_CUDA_ARCH_LIST names an arch-specific target such as "9.0a" (Hopper images) the
            # builder fails parsing it (ValueError: invalid literal for int(): '0a'). torch's AdamW is
            # the same update, and its fused CUDA kernel is as fast.
            params["torch_adam"] = True
            if not on_cpu:
                params.setdefault("fused", True)
    return out


def alone_in_zero(layout: Layout, overlap_grad_reduce: bool = False) -> bool:
    """ZeRO-1 on the GPUs' memory with no other data or context rank (so no expert rank either):
    the gradient reduction DeepSpeed runs each step is an exact no-op (``skip_reduction``). Not with
    ``overlap.grad_reduce``, which reduces through ZeRO-1's own buckets (``mt3d.ds.overlap``)."""
    return (layout.zero_stage == 1 and layout.offload == "none" and not overlap_grad_reduce
            and layout.degrees["dp"] * layout.degrees["cp"] == 1)  # fmt: skip


def skip_reduction(engine) -> None:
    """With one data rank, what DeepSpeed's ZeRO-1 step does per gradient, done for all at once.

    * The reduction: DeepSpeed flattens every gradient, all-reduces it over the group of one, divides
      it by 1 and copies it back (``buffered_reduce_fallback``, called per bucket when gradients are
      not contiguous, ``deepspeed_config``): a no-op; the gradients stay as the backward left them.
    * The overflow check and the gradient norm: DeepSpeed launches a max, a min and an add per
      gradient, then an fp64 copy and a norm per gradient. One foreach fp64 norm per call does both:
      a norm is finite exactly when its tensor is. At 2,195 tensors (a 64-expert MoE) these loops
      were about 11,000 kernel launches a step, and the step waited on the host (an H200 busy 315 ms
      of a 689 ms step, docs/benchmarks.md).
    The same step as DeepSpeed's: the fp64 norms only summed in another order."""
    opt = engine.optimizer
    if not hasattr(opt, "compute_grad_norm"):  # DeepSpeed's BF16 optimizer (bf16, fp32 gradient
        return  # accumulation) at ZeRO-1: it has neither ZeRO's reduction nor its checks to replace
    opt.buffered_reduce_fallback = _no_reduction
    norm_checks_overflow = opt.compute_grad_norm and (opt.dtype != torch.bfloat16 or opt.check_grad_overflow)
    if not norm_checks_overflow:
        return
    plain_norm = opt.get_grad_norm_direct

    def has_overflow(partition_gradients=True):
        # the norm below is not finite exactly when a gradient is not, and step() tests it
        return False

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return plain_norm(gradients, params, norm_type)
        return _grad_norm(opt, gradients, params)

    opt.has_overflow = has_overflow
    opt.get_grad_norm_direct = get_grad_norm_direct


def _grad_norm(opt, gradients, params) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct``'s L2 norm with one foreach fp64 norm: the same
    gradients counted (no padding, no pipeline-replicated copy, split ones on every TP rank, the others
    on TP rank 0), summed over the data and model-parallel groups, -1 when not finite."""
    import torch.distributed as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
    kept = [g.detach() for g, p in zip(grads, params)
            if not getattr(p, "ds_pipe_replicated", False)
            and (is_model_parallel_parameter(p) or opt.model_parallel_rank == 0)]  # fmt: skip
    if kept:
        total = torch.stack(torch._foreach_norm(kept, 2.0, dtype=torch.float64)).pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=opt.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
    opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total, device=opt.device)
    return total


def _no_reduction(*args, **kwargs) -> None:
    """``DeepSpeedZeroOptimizer.buffered_reduce_fallback`` with no other rank: nothing to do."""


def release_loss_outputs(engine) -> None:
    """Drop the last stage's forward output (the logits) from ``pipe_buffers['outputs']`` as soon as
    the loss is computed from it. DeepSpeed's pipeline engine keeps each forward's output there until
    the backward frees it, but the last stage's backward returns early (``super().backward(loss)``)
    without freeing it, so the logits of its last two micro-batches (its two buffers) stay alive
    beside the next forward and backward, and after the step: measured at 4096 tokens with a
    16384-token vocabulary (fp32, CPU), 537 MB of a 2.1 GB peak. The loss keeps what its backward
    needs (the cross entropy's softmax), not the logits."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    def wrap(kind, forward):
        if kind is not ds_schedule.ForwardPass:
            return forward

        def forward_pass(self, buffer_id):
            forward(self, buffer_id)
            if self.is_last_stage() and torch.is_grad_enabled():
                self.pipe_buffers["outputs"][buffer_id] = None

        return forward_pass

    wrap_instructions(engine, wrap)


def keep_loss_outputs(engine) -> None:
    """Undo ``release_loss_outputs`` on DeepSpeed's pipeline engine: DeepSpeed's own forward pass in
    place of whatever handles that instruction (wrappers of the other instructions kept; call it
    before wrapping the forward pass), what ``mt3d.bench memory --keep-logits`` and the release's test
    compare against. mt3d's schedule engine releases the logits in its own forward pass: refused."""
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from .interleaved import InterleavedPipelineEngine

    if isinstance(engine, InterleavedPipelineEngine):
        raise ValueError("mt3d's schedule engine (v > 1 or overlap.p2p) releases the logits in its own "
                         "forward pass: keep them only with DeepSpeed's pipeline engine")  # fmt: skip

    own = PipelineEngine._INSTRUCTION_MAP[ds_schedule.ForwardPass]
    wrap_instructions(engine, lambda kind, fn: own if kind is ds_schedule.ForwardPass else fn)


def guard_fp32_without_zero(engine) -> None:
    """Give DeepSpeed's fp32 path without ZeRO what its ZeRO optimizers already do.

    There DeepSpeed clips with a norm it does not keep (``get_global_grad_norm()`` is None) and
    applies non-finite gradients. mt3d computes the same TP/pipeline-aware norm with DeepSpeed's own
    ``clip_grad_norm_`` before the optimizer step, records it, and on a non-finite norm skips the
    step by setting the ``overflow`` flag DeepSpeed's engine already honours (counted in
    ``skipped_steps``, no scheduler step). Only used with pipeline = 1 (ZeRO-0 with pp > 1 is refused).
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    opt = engine.optimizer
    inner_step = opt.step
    engine.clip_fp32_gradients = lambda: None  # replaced by the clipping below

    def step(*args, **kwargs):
        params = [p for p in engine.module.parameters() if p.grad is not None]
        # DeepSpeed's clip_grad_norm_ ignores the ``ds_pipe_replicated`` mark its other norms honour
        # (copies held by several ranks: mt3d.ds.experts): the norm comes from the counted ones,
        # the clipping applies to all.
        counted = [p for p in params if not getattr(p, "ds_pipe_replicated", False)]
        norm = float(clip_grad_norm_(parameters=counted, max_norm=float("inf"), mpu=engine.mpu))
        max_norm = engine.gradient_clipping()
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm and math.isfinite(norm) else 1.0
        if coef < 1.0:  # as DeepSpeed's clip_grad_norm_
            for p in params:
                p.grad.mul_(coef)
        engine._global_grad_norm = norm
        opt.overflow = not math.isfinite(norm)
        if opt.overflow:
            opt.zero_grad(set_to_none=True)
            return None
        return inner_step(*args, **kwargs)

    opt.step = step


class SafeCheckpointEngine:
    """Wraps DeepSpeed's torch checkpoint engine so every load goes through ``safe_torch_load``."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        """DeepSpeed's CheckpointEngine.load, through the allow-list."""
        from .safe import safe_torch_load

        return safe_torch_load(path, map_location=map_location or "cpu")


def install_safe_loading(engine) -> None:
    """Make a DeepSpeed engine load its checkpoints through the allow-list."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)


def initialize(
    model: torch.nn.Module,
    param_groups: list[dict],
    config: dict,
    layout: Layout,
    mpu=None,
    state=None,
    overlap=None,
    make_optimizer=None,
):
    """``deepspeed.initialize`` (mt3d's schedule engine for an ``InterleavedPipeline``); returns the
    engine, its checkpoint loads made safe and, without ZeRO, fp32 steps guarded. ``mpu``: mt3d's
    ParallelState for the regular engine (the pipeline engine uses the module's own grid); ``state``:
    the rank's ParallelState (``mt3d.ds.experts`` when its ep group has more than one rank);
    ``overlap``: ``mt3d.train.overlap`` (``mt3d.ds.overlap`` when its grad_reduce is on).
    ``make_optimizer``: builds mt3d's own optimizer over the final groups (Muon), which DeepSpeed steps as
    a client's (under ZeRO or its bf16 optimizer: over flat partitions, whose layout ``muon.attach``
    gives it)."""
    import deepspeed

    from . import experts
    from .pipe import InterleavedPipeline

    expert_parallel = state is not None and state.ep.size > 1
    expert_zero = expert_parallel and layout.zero_stage > 0
    if expert_zero:
        param_groups = experts.expert_groups(param_groups, one_each=layout.decay_free)
    with experts.zero_optimizer(state) if expert_zero else nullcontext():
        if isinstance(model, InterleavedPipeline):  # v > 1, or overlap.p2p (training.engine.build_model)
            from .interleaved import initialize as initialize_interleaved

            engine = initialize_interleaved(
                model, param_groups, config, make_optimizer
            )  # its schedule: the model's
            # the zero-bubble programs are made for posted transfers (``pipeline.zero_bubble``)
            engine.async_p2p = (overlap is not None and overlap.p2p) or layout.schedule != "1f1b"
        else:
            from .interleaved import client

            engine, _, _, _ = deepspeed.initialize(
                model=model, config=config, mpu=mpu, **client(param_groups, make_optimizer)
            )
    if make_optimizer is not None:
        from .muon import attach

        attach(engine.optimizer)
    if expert_parallel:
        experts.install(engine, state, layout.zero_stage)
    if layout.zero_stage == 0 and layout.precision == "fp32":
        guard_fp32_without_zero(engine)
    alone = layout.degrees["dp"] * layout.degrees["cp"] == 1 and (state is None or state.edp.size == 1)
    if mpu is None and alone and layout.zero_stage == 0:
        # Without ZeRO, DeepSpeed's pipeline engine flattens, all-reduces and copies back every
        # gradient each step even when no other rank holds the same dense weights: exact no-op work,
        # skipped. Not with cp ranks (they average their chunks' gradients in DeepSpeed's data axis),
        # nor with ep ranks within dp (mt3d.ds.experts sums dense gradients over them in that step) or
        # replicas of the experts (folded over tp: edp > 1 at dp 1).
        engine.pipeline_enable_backward_allreduce = False
    if alone_in_zero(layout, overlap is not None and overlap.grad_reduce):
        skip_reduction(engine)
    if uses_pipeline_engine(layout) and not isinstance(model, InterleavedPipeline):  # that one does itself
        release_loss_outputs(engine)
    if overlap is not None and overlap.grad_reduce:
        from .overlap import install as overlap_grad_reduce

        engine.grad_reduce_overlap = overlap_grad_reduce(engine, overlap.bucket_elements, state)
    install_safe_loading(engine)
    keep_balance_biases_fp32(engine.module)
    return engine


def keep_balance_biases_fp32(module) -> None:
    """DeepSpeed casts the whole module to bf16/fp16 in ``deepspeed.initialize``, the routers' correction
    biases too (not optimizer parameters: nothing holds an fp32 copy). Their aux-loss-free updates
    (1e-3) would vanish below a bf16 ulp, so they go back to fp32 (where they were built)."""
    for p in module.parameters():
        if getattr(p, "mt3d_balance", False) and p.dtype != torch.float32:
            p.data = p.data.float()
