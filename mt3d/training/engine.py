"""Build the model for this rank and hand it to ``deepspeed.initialize``.

With ZeRO stage 0/1 the model is an ``Mt3dPipeline`` run by DeepSpeed's pipeline engine, for any
number of stages (pp = 1 included). ZeRO-2/3 are not supported by that engine, so at pp = 1 they
use the same layers in a ``StackedModel`` under the regular engine, with ParallelState as mpu.
"""

from __future__ import annotations

import copy
import functools
import logging

import torch

from ..config import Layout, RunConfig
from ..model.blocks import BuildContext
from ..model.config import ModelConfig
from ..model.pipeline import LossFn, Mt3dPipeline, StackedModel, default_stage_blocks, layer_specs
from ..model.sharding import universal_info
from ..parallel.random import checkpoint
from .runtime import Runtime

log = logging.getLogger("mt3d")


def deepspeed_config(run: RunConfig, layout: Layout, on_cpu: bool) -> dict:
    """DeepSpeed's dict for this run, with mt3d's necessary adjustments (each explained)."""
    ds = copy.deepcopy(run.ds)
    # mt3d prints its own progress; DeepSpeed's per-step prints would interleave with it.
    ds.setdefault("steps_per_print", 10**9)
    # mt3d owns the W&B run (metrics.WandbSink: best effort, silent once a stop signal arrived);
    # DeepSpeed's monitor would log into it with calls that raise when the launcher has already
    # killed W&B's helper during a preemption save.
    ds.pop("wandb", None)
    if (run.mt3d.parallel.sequence_parallel and layout.tp > 1) or layout.virtual_stages > 1:
        # DeepSpeed's pipe/grad partitioning assumes activations identical across TP ranks, which
        # sequence shards are not (DEEPSPEED_NOTES.md), and one exchange per neighbour at a time,
        # which the interleaved schedule's batched ring exchange is not.
        pipe = ds.setdefault("pipeline", {})
        pipe["pipe_partitioned"] = False
        pipe["grad_partitioned"] = False
    opt = ds.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") in (
            "cpu",
            "nvme",
        )
        params = opt.setdefault("params", {})
        if not offload and "torch_adam" not in params:
            # DeepSpeed's FusedAdam is JIT-compiled on first use: ~30 s on a CPU, and on GPUs whose
            # TORCH_CUDA_ARCH_LIST names an arch-specific target such as "9.0a" (Hopper images) the
            # 0.19.8 builder fails parsing it (ValueError: invalid literal for int(): '0a'). torch's
            # AdamW is the same update, and its fused CUDA kernel is as fast.
            params["torch_adam"] = True
            if not on_cpu:
                params.setdefault("fused", True)
    return ds


def param_groups(model: torch.nn.Module, weight_decay: float | None = None) -> list[dict]:
    """Weight decay on matrices only: norm weights and biases are excluded (as Megatron)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    return [g for g in groups if g["params"]]


def uses_pipeline_engine(layout: Layout) -> bool:
    """DeepSpeed's pipeline engine for ZeRO 0/1; the regular engine for ZeRO-2/3 (pp must be 1)."""
    return layout.zero_stage < 2


def build_model(
    run: RunConfig, layout: Layout, rt: Runtime, cfg: ModelConfig, vocab_size: int, skip_init: bool = False
):
    """This rank's part of the model (pipeline stage or whole stacked model).

    ``skip_init`` leaves the weights uninitialised because they are loaded right after.
    """
    rec = run.mt3d.train.recompute
    ctx = BuildContext(
        tp=rt.state.tp,
        seed=run.mt3d.train.seed,
        sequence_parallel=run.mt3d.parallel.sequence_parallel,
        tracker=rt.tracker,
        skip_init=skip_init,
    )
    specs = layer_specs(cfg, ctx, vocab_size)
    loss_fn = LossFn(rt.state.tp, vocab_size)
    ckpt = functools.partial(
        checkpoint, tracker=rt.tracker, tp=rt.state.tp, partition=rec.partition_activations
    )
    if uses_pipeline_engine(layout):
        v = layout.virtual_stages
        blocks = list(layout.stage_blocks or default_stage_blocks(cfg.layers, layout.pp * v))
        kwargs = dict(
            topology=rt.topology,
            loss_fn=loss_fn,
            stage_blocks=blocks,
            recompute_interval=rec.interval,
            ckpt=ckpt,
        )
        if v > 1:
            from ..pipeline.module import InterleavedPipeline

            model = InterleavedPipeline(specs, virtual_stages=v, **kwargs)
        else:
            model = Mt3dPipeline(specs, **kwargs)
    else:
        model = StackedModel(specs, loss_fn=loss_fn, recompute_interval=rec.interval, ckpt=ckpt).to(rt.device)
    if run.mt3d.train.compile:
        from ..model.blocks import TransformerBlock

        for m in model.modules():
            if isinstance(m, TransformerBlock):
                m.compile()
    # saved with every checkpoint: lets DeepSpeed's universal format reshard it later
    model.universal_checkpoint_info = universal_info(cfg, layout.tp, vocab_size)
    return model


def guard_fp32_without_zero(engine) -> None:
    """Give DeepSpeed's fp32 path without ZeRO what its ZeRO optimizers already do.

    There DeepSpeed clips with a norm it does not keep (``get_global_grad_norm()`` is None) and
    applies non-finite gradients. mt3d computes the same TP/pipeline-aware norm with DeepSpeed's own
    ``clip_grad_norm_`` before the optimizer step, records it, and on a non-finite norm skips the
    step by setting the ``overflow`` flag DeepSpeed's engine already honours (counted in
    ``skipped_steps``, no scheduler step). Only used with pipeline = 1 (ZeRO-0 with pp > 1 is refused).
    """
    import math

    from deepspeed.runtime.utils import clip_grad_norm_

    opt = engine.optimizer
    inner_step = opt.step
    engine.clip_fp32_gradients = lambda: None  # replaced by the clipping below

    def step(*args, **kwargs):
        params = [p for p in engine.module.parameters() if p.grad is not None]
        max_norm = engine.gradient_clipping() or float("inf")
        norm = float(clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=engine.mpu))
        engine._global_grad_norm = norm
        opt.overflow = not math.isfinite(norm)
        if opt.overflow:
            opt.zero_grad(set_to_none=True)
            return None
        return inner_step(*args, **kwargs)

    opt.step = step


def initialize(run: RunConfig, layout: Layout, rt: Runtime, model: torch.nn.Module):
    """``deepspeed.initialize`` with mt3d's parameter groups; returns the engine."""
    import deepspeed

    ds = deepspeed_config(run, layout, on_cpu=rt.device.type == "cpu")
    if layout.virtual_stages > 1:
        from ..pipeline.engine import initialize as initialize_interleaved

        engine = initialize_interleaved(model, param_groups(model), ds)
    else:
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model),
            config=ds,
            mpu=None if uses_pipeline_engine(layout) else rt.state,
        )
    precision16 = (ds.get("bf16") or {}).get("enabled") or (ds.get("fp16") or {}).get("enabled")
    if layout.zero_stage == 0 and not precision16:
        guard_fp32_without_zero(engine)
    if uses_pipeline_engine(layout) and layout.dp == 1 and layout.zero_stage == 0:
        # Without ZeRO, DeepSpeed's pipeline engine flattens, all-reduces and copies back every
        # gradient each step even over a one-rank data-parallel group: exact no-op work, skipped.
        engine.pipeline_enable_backward_allreduce = False
    return engine
