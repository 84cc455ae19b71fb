"""Build the model for this rank and hand it to DeepSpeed (``mt3d.ds.engine``).

With ZeRO stage 0/1 the model is an ``Mt3dPipeline`` run by DeepSpeed's pipeline engine, for any
number of stages (pp = 1 included). ZeRO-2/3 are not supported by that engine, so at pp = 1 they
use the same layers in a ``StackedModel`` under the regular engine, with ParallelState as mpu.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..config import DeepSpeedSection, Layout, TrainConfig
from ..config.rules import uses_pipeline_engine
from ..model.blocks import BuildContext
from ..model.config import ModelConfig
from ..model.pipeline import LossFn, StackedModel, default_stage_blocks, layer_specs, post_layers
from ..model.sharding import universal_info
from ..parallel.axes import expert_layout
from ..parallel.random import checkpoint
from .runtime import Runtime

log = logging.getLogger("mt3d")


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


def dispatch_context(expert_dispatch: str, rt: Runtime) -> dict:
    """The build context's share of ``parallel.expert_dispatch``: the hosts of a two-hop dispatch
    ("node"), and whether tokens go once per rank ("rank", "node") or once per expert ("assignment")."""
    return {
        "ep_hosts": rt.state.ep_hosts() if expert_dispatch == "node" else None,
        "dispatch_once": expert_dispatch != "assignment",
    }


def build_model(
    cfg: ModelConfig,
    layout: Layout,
    rt: Runtime,
    vocab_size: int,
    *,
    train: TrainConfig,
    sequence_parallel: bool = False,
    skip_init: bool = False,
    cp_exchange: str = "auto",
    expert_dispatch: str = "rank",
    packed: bool = False,
):
    """This rank's part of the model (pipeline stage or whole stacked model). ``train`` gives the seed,
    recompute, compile, FP8 and dispatch choices; ``skip_init`` leaves the weights
    uninitialised because they are loaded right after; ``packed``: the inputs are packed documents
    (ids, document ids), which every stage passes on; ``expert_dispatch``: ``parallel.expert_dispatch``.
    """
    from ..ds.pipe import InterleavedPipeline, Mt3dPipeline

    rec = train.recompute
    ctx = BuildContext(
        tp=rt.state.tp,
        seed=train.seed,
        sequence_parallel=sequence_parallel,
        tracker=rt.tracker,
        skip_init=skip_init,
        cp=rt.state.cp,
        cp_exchange=cp_exchange,
        tile_len=rec.tile_len,
        ep=rt.state.ep,
        etp=rt.state.etp,
        tpo=rt.state.tpo,
        **dispatch_context(expert_dispatch, rt),
        keep_gathered=rec.gathered_sp_inputs,
        selective=rec.granularity == "selective",
        dispatch_chunks=train.overlap.dispatch_chunks,
        **fp8_context(train.fp8, cfg.layers),
    )
    specs = layer_specs(cfg, ctx, vocab_size)
    loss_cls = LossFn
    if train.objective == "dpo":
        from ..model.dpo import DPOLoss as loss_cls
    loss_fn = loss_cls.of(cfg, rt.state.tp, vocab_size, rt.state.cp, tile_len=rec.tile_len)
    if train.objective == "dpo":
        from ..config.schema import DpoConfig

        loss_fn.dpo = train.dpo or DpoConfig()
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
            post_layers=post_layers(cfg),
        )
        if v > 1 or train.overlap.p2p or layout.schedule != "1f1b":  # mt3d's schedule engine (ds.interleaved)
            model = InterleavedPipeline(specs, virtual_stages=v, schedule=layout.schedule, **kwargs)
        else:
            model = Mt3dPipeline(specs, **kwargs)
    else:
        model = StackedModel(specs, loss_fn=loss_fn, recompute_interval=rec.interval, ckpt=ckpt).to(rt.device)
    if train.compile:
        from ..model.blocks import TransformerBlock

        for m in model.modules():
            if isinstance(m, TransformerBlock):
                m.compile()
    # saved with every checkpoint: lets DeepSpeed's universal format reshard it later
    etp = expert_layout(layout.degrees).etp if cfg.moe is not None else None
    model.universal_checkpoint_info = universal_info(cfg, layout.tp, vocab_size, etp)
    # stages pass (hidden, router statistics, document ids), each part when there is one
    model.stream_tuple = cfg.moe is not None or packed
    return model


def add_adapters(model: torch.nn.Module, lora, cfg: ModelConfig, vocab: int, rt: Runtime, seed: int,
                 fresh: bool) -> None:  # fmt: skip
    """LoRA (``mt3d.lora``): this rank's adapters on ``model``'s targeted linears, every other weight
    frozen; ``fresh``: a new run, whose adapters start from ``lora.from_adapter`` when it names one
    (a resumed run's come from its checkpoint)."""
    from ..model.lora import attach, universal_patterns
    from ..model.peft import plan, read_adapter
    from ..model.sharding import to_shard

    spec, targets = plan(lora, cfg, vocab)
    attach(model, targets, spec, rt.state.tp, seed=seed, tracker=rt.tracker)
    model.universal_checkpoint_info = universal_patterns(
        model.universal_checkpoint_info, targets, rt.state.tp.size
    )
    if fresh and lora.from_adapter:
        full = read_adapter(lora.from_adapter, targets, spec)
        params = dict(model.named_parameters())
        tp = rt.state.tp
        with torch.no_grad():
            for t in targets:
                for name, layout in zip(t.names, (t.a_layout, t.b_layout), strict=True):
                    if name in params:
                        params[name].copy_(to_shard(full[name], layout, tp.rank, tp.size))
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if rt.rank == 0:
        log.info("LoRA r=%d alpha=%g on %d modules: %d trainable parameters on rank 0", spec.r, spec.alpha,
                 len(targets), n)  # fmt: skip


def fp8_context(fp8, layers: int) -> dict:
    """``BuildContext``'s FP8 fields from ``train.fp8`` (None: off) for a model of ``layers`` blocks."""
    if fp8 is None:
        return {}
    skip = frozenset({0, layers - 1}) if fp8.exclude_first_last else frozenset()
    return {"fp8": fp8.recipe, "fp8_all_gather": fp8.all_gather, "fp8_skip": skip, "fp8_experts": fp8.experts,
            "fp8_dispatch": fp8.dispatch}  # fmt: skip


def initialize(
    ds: DeepSpeedSection,
    layout: Layout,
    rt: Runtime,
    model: torch.nn.Module,
    *,
    sequence_parallel: bool,
    train: TrainConfig,
    load_universal: bool = False,
):
    """The DeepSpeed engine of ``model`` with mt3d's parameter groups (``mt3d.ds.engine``);
    ``train``: the overlap and optimizer-state choices; ``load_universal``: the checkpoint it will
    load was converted to DeepSpeed's universal format."""
    from ..ds.engine import deepspeed_config
    from ..ds.engine import initialize as ds_initialize
    from ..ds.pipe import InterleavedPipeline

    on_cpu = rt.device.type == "cpu"
    stream_tuple = getattr(model, "stream_tuple", False)
    config = deepspeed_config(ds, layout, sequence_parallel=sequence_parallel, on_cpu=on_cpu,
                              stream_tuple=stream_tuple, overlap_grad_reduce=train.overlap.grad_reduce,
                              mt3d_schedule=isinstance(model, InterleavedPipeline),
                              optimizer_states=train.optimizer_states)  # fmt: skip
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    mpu = None if uses_pipeline_engine(layout) else rt.state
    make = None
    if ds.optimizer_type == "muon":  # mt3d's own (mt3d.training.muon), given to DeepSpeed as the client's
        from .muon import build

        params, muon = config.pop("optimizer").get("params") or {}, train.muon
        kw = {"scale": muon.scale, "ns_dtype": muon.ns_dtype} if muon else {}
        if muon and muon.qk_clip:  # the loop logs its figures (``model.qk_clip``)
            from .qk_clip import QKClip

            kw["clip"] = model.qk_clip = QKClip(model, muon.qk_clip, rt.state.dense)
        make = lambda groups: build(params, groups, model, rt.state.tp, rt.state.etp, **kw)  # noqa: E731
        config["zero_allow_untested_optimizer"] = True  # DeepSpeed's ZeRO knows only its own optimizers
    return ds_initialize(model, param_groups(model), config, layout, mpu=mpu, state=rt.state,
                         overlap=train.overlap, make_optimizer=make)  # fmt: skip
