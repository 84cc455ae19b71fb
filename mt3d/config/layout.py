"""The validated layout of a run, and ``validate``: every check that can run before a process
group exists, in the order a user would fix them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ModelConfig, ModelConfigError
from . import preflight, rules
from .deepspeed import check_sections, deepspeed_preflight
from .errors import ConfigError
from .schema import ParallelConfig, RunConfig


@dataclass
class Layout:
    """Degrees and batch sizes after validation; an axis's degree reads as an attribute (``layout.tp``)."""

    world: int
    degrees: dict[str, int]
    """Every axis's degree (``mt3d.parallel.axes.AXES``), dp derived."""
    micro_batch: int
    grad_accum: int
    global_batch: int
    zero_stage: int
    virtual_stages: int = 1
    stage_blocks: tuple[int, ...] | None = None
    """Blocks per (virtual) stage in virtual-stage order, when the model is known."""
    offload: str = "none"
    """Where ZeRO keeps parameters and optimizer states (``Offload.label``)."""
    precision: str = field(default="fp32")
    """bf16, fp16 or fp32."""
    decay_free: bool = False
    """The optimizer's weight decay is 0 (``DeepSpeedSection.decay_free``): under expert parallelism with
    ZeRO the dense weights then take one optimizer group, the experts one (``PARAM_GROUPS``)."""
    notes: tuple[str, ...] = ()
    """Warnings about the config: settings that do nothing in this layout (``mt3d train`` prints them)."""
    schedule: str = "1f1b"
    """The pipeline schedule (``mt3d.parallel.schedule``); not in ``saved``: a run resumes under any."""

    def __getattr__(self, name: str) -> int:
        degrees = self.__dict__.get("degrees")
        if degrees is not None and name in degrees:
            return degrees[name]
        raise AttributeError(name)

    def shown_degrees(self) -> dict[str, int]:
        """The degrees of the axes reports name (optional axes only when above 1), and the expert-tensor
        degree ``etp`` when it differs from tp (``parallel.expert_layout``)."""
        from ..parallel.axes import shown

        etp = {"etp": self.degrees["etp"]} if "etp" in self.degrees else {}
        return {a: self.degrees[a] for a in shown(self.degrees)} | etp

    def saved(self) -> dict:
        """The layout as checkpoints record it (what a resume compares); under expert parallelism with
        ZeRO also what dense optimizer states are partitioned over (``mt3d.ds.experts``)."""
        out = {
            **self.shown_degrees(),
            "zero_stage": self.zero_stage,
            "virtual_stages": self.virtual_stages,
            "stage_blocks": list(self.stage_blocks) if self.stage_blocks else None,
            "offload": self.offload,
        }
        if self.degrees.get("ep", 1) > 1 and self.zero_stage > 0:
            out["dense_partition"] = DENSE_PARTITION
            out["param_groups"] = self.param_groups
        return out

    @property
    def param_groups(self) -> str:
        """How the optimizer groups a rank's parameters under expert parallelism with ZeRO, as checkpoints
        record it (``PARAM_GROUPS``; ``mt3d.ds.experts.expert_groups``)."""
        return PARAM_GROUPS[self.decay_free]

    def describe(self) -> dict:
        """Everything, flat (run.json)."""
        batch = {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "global_batch": self.global_batch,
        }
        return {"world": self.world, **self.saved(), **batch, "precision": self.precision}

    def headline(self) -> str:
        """``world 8 = tp 2 x pp 2 x dp 2``: the configured axes shown, then dp (what remains)."""
        shown = self.shown_degrees()
        order = [a for a in shown if a not in ("dp", "etp")] + ["dp"]
        folded = f" (experts: ep {shown['ep']} x etp {shown['etp']} folded)" if "etp" in shown else ""
        return f"world {self.world} = " + " x ".join(f"{a} {shown[a]}" for a in order) + folded


PARAM_GROUPS = {False: "by weight decay", True: "one dense, one expert"}
"""Optimizer groups under expert parallelism with ZeRO: dense and experts each split by weight decay
(matrices decay, norms and biases not), or, with weight decay 0, one group each (a step holds a group's
Adam call, weight all-gather and copy back: 0.95 of the step time at ep 2 in ``python -m mt3d.bench
autoep``'s model). Checkpoints from before it was recorded hold groups by weight decay."""

DENSE_PARTITION = "dp x cp"
"""What ZeRO partitions dense optimizer states over under expert parallelism, as checkpoints record
it; checkpoints from before it was recorded partitioned them over dp / ep x cp
(``mt3d.ds.universal`` converts either)."""


def _check_mapping(par: ParallelConfig, world: int) -> None:
    """The rank-mapping keys (order, islands, hostfile) parse, and a hostfile's hosts fit the world."""
    from ..parallel.hosts import parse_islands, read_hostfile
    from ..parallel.topology import TopologyError, parse_order, place

    try:
        parse_order(par.order)
        islands = parse_islands(par.islands) if par.islands else None
        if par.hostfile:
            place(world, hosts=read_hostfile(par.hostfile), order=par.order, islands=islands,
                  allow_crossing=par.allow_crossing, warn=False, expert_tensor=par.expert_tensor,
                  **par.degrees())  # fmt: skip
    except TopologyError as e:
        raise ConfigError(f"mt3d.parallel: {e}") from None


def _check_schedule(run: RunConfig, degrees: dict[str, int], stage: int) -> None:
    """Virtual stages, ZeRO with the pipeline, offload, sequence parallelism."""
    par, pp, v = run.mt3d.parallel, degrees["pp"], run.mt3d.parallel.virtual_stages
    if v < 1:
        raise ConfigError(f"mt3d.parallel.virtual_stages must be >= 1, got {v}")
    why = (
        rules.schedule_conflict(par.schedule, pp, v)
        or rules.virtual_stage_conflict(pp, v, schedule=par.schedule)
        or rules.zero_pipeline_conflict(pp, stage)
        or rules.offload_conflict(stage, run.deepspeed.offload)
        or rules.tiles_conflict(run.mt3d.train.recompute.tile_len, stage)
        or rules.p2p_conflict(run.mt3d.train.overlap.p2p, pp)
        or rules.optimizer_states_conflict(
            run.mt3d.train.optimizer_states, run.precision, stage, run.deepspeed.offload, run.ds
        )
        or rules.overlap_conflict(
            run.mt3d.train.overlap.grad_reduce, stage, degrees["ep"], run.deepspeed.offload, run.precision
        )
        or rules.fp8_conflict(run.mt3d.train.fp8, run.precision)
        or rules.objective_conflict(run.mt3d.train, run.mt3d.model)
        or rules.muon_conflict(run.deepspeed, run.mt3d.train, stage, run.precision)
        or rules.grad_accum_conflict(
            str((run.ds.get("data_types") or {}).get("grad_accum_dtype") or ""),
            run.precision,
            stage,
            run.deepspeed.offload,
        )  # fmt: skip
    )
    if why:
        raise ConfigError(why)
    tp, seq = degrees["tp"], run.mt3d.data.seq_len
    if par.sequence_parallel and tp > 1 and seq % tp:
        raise ConfigError(f"sequence parallelism needs seq_len ({seq}) divisible by tp ({tp})")
    why = rules.context_conflict(par, degrees, seq, stage)
    if why:
        raise ConfigError(why)


def _check_model(model: ModelConfig, par: ParallelConfig, degrees: dict[str, int], seq_len: int) -> None:
    """The model splits over the degrees and fits the sequence; stage_layers fill the chunks."""
    pp, v = degrees["pp"], par.virtual_stages
    try:
        model.check_parallel(degrees["tp"], pp)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    if model.position_limit is not None and seq_len > model.position_limit:
        raise ConfigError(f"data.seq_len {seq_len} exceeds the model's max_seq_len {model.position_limit}")
    why = rules.expert_conflict(model.moe_spec, degrees["ep"])
    if why:
        raise ConfigError(why)
    chunks = pp * v
    if par.stage_layers is not None:
        what = f"{pp} stages" if v == 1 else f"{pp} x {v} chunks"
        if len(par.stage_layers) != chunks or sum(par.stage_layers) != model.layers:
            raise ConfigError(
                f"parallel.stage_layers {par.stage_layers} must list {what} adding up to "
                f"{model.layers} layers"
            )
        if min(par.stage_layers) < 1:
            raise ConfigError("parallel.stage_layers: every stage needs at least one block")
    elif model.layers < chunks:
        raise ConfigError(
            f"{model.layers} layers cannot fill pipeline {pp} x virtual_stages {v} = "
            f"{chunks} chunks of at least one block; use fewer stages or chunks"
        )


def _check_lora(lora, model: ModelConfig | None, stage: int, here: bool) -> None:
    """LoRA's settings and targets against the model (``mt3d.model.peft.plan``), and with ``here`` the
    starting adapter's tensors against the targets: no base weight is read."""
    if stage == 3:
        raise ConfigError(
            "mt3d.lora with ZeRO-3 is not supported: the frozen base has no optimizer states "
            "to partition and the adapters' are small; use zero_optimization.stage 1 or 2"
        )
    if model is None:
        return
    from ..model.peft import plan, read_adapter

    spec, targets = plan(lora, model, model.vocab_size or 128)
    if here and lora.from_adapter:
        read_adapter(lora.from_adapter, targets, spec)


def validate(run: RunConfig, world_size: int, model: ModelConfig | None = None, here: bool = True) -> Layout:
    """Check the run against ``world_size`` ranks before any process group exists; fill batch keys.
    ``here`` False skips what depends on this machine (input files, the device's precisions, a
    writable save_dir): the check of a config written for another cluster (``mt3d plan``)."""
    par, data, train, ds = run.mt3d.parallel, run.mt3d.data, run.mt3d.train, run.deepspeed
    check_sections(run.ds)
    rules.check_data(data, evaluates=train.eval_batches > 0)
    degrees = rules.degrees_for(par, world_size)
    _check_mapping(par, world_size)
    stage = ds.zero_stage
    _check_schedule(run, degrees, stage)
    if model is not None:
        _check_model(model, par, degrees, data.seq_len)
    chunks = train.overlap.dispatch_chunks
    why = rules.chunks_conflict(chunks, degrees["ep"], model) or rules.dispatch_conflict(
        par.expert_dispatch, degrees["ep"], model, chunks
    )
    if why:
        raise ConfigError(why)
    if model is not None:
        why = rules.context_conflict(par, degrees, data.seq_len, stage, model) or rules.folding_conflict(
            model.moe_spec, degrees, stage, data.seq_len, par.sequence_parallel
        )
        if why is None and model.moe is not None:
            why = rules.moe_conflict(stage, degrees["ep"]) or rules.overlap_moe_conflict(
                train.overlap.grad_reduce, degrees["pp"]
            )
        if why:
            raise ConfigError(why)
    rules.check_train(train)
    why = model is not None and rules.qk_clip_conflict(train.muon, model, run.mt3d.lora)
    if why:
        raise ConfigError(why)
    if model is not None and model.mtp is not None and run.mt3d.lora is not None:
        raise ConfigError("model.mtp does not combine with mt3d.lora (its depths train whole): drop one")
    if run.mt3d.lora is not None:
        _check_lora(run.mt3d.lora, model, stage, here)
    if here:
        preflight.check_inputs(train, data, model.extra.get("hf_path") if model is not None else None)
        preflight.check_device(ds.precision, fp8=train.fp8 is not None)
    mb, ga, gb = rules.batch_split(ds.batch_keys(), degrees["dp"])
    if model is not None and train.fp8 is not None:
        why = rules.fp8_cover_conflict(train.fp8, model.layers) or rules.fp8_shape_conflict(
            model,
            degrees["tp"],
            mb * data.seq_len // degrees["cp"],
            train.fp8.recipe,
            train.fp8.experts,
            degrees.get("etp", degrees["tp"]),
            train.fp8.dispatch,
        )
        if why:
            raise ConfigError(why)
    run.ds.update(train_batch_size=gb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    why = rules.virtual_stage_conflict(
        degrees["pp"], par.virtual_stages, micro_batches=ga, schedule=par.schedule
    ) or rules.p2p_conflict(train.overlap.p2p, degrees["pp"], ga, par.schedule)
    if why:
        raise ConfigError(why + "; change train_batch_size or train_micro_batch_size_per_gpu")
    if here:
        preflight.check_outputs(train, data)
    deepspeed_preflight(run.ds, mb, ga, degrees["dp"])
    blocks = None
    if model is not None:
        from ..model.pipeline import default_stage_blocks

        blocks = tuple(
            par.stage_layers or default_stage_blocks(model.layers, degrees["pp"] * par.virtual_stages)
        )
    notes = tuple(rules.fp8_notes(train.fp8, par.sequence_parallel, degrees["tp"], degrees.get("ep", 1)))
    return Layout(world_size, degrees, mb, ga, gb, stage, par.virtual_stages, blocks, ds.offload.label,
                  ds.precision, ds.decay_free, notes, par.schedule)  # fmt: skip
