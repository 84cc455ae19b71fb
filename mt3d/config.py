"""The run configuration: one JSON file holding DeepSpeed's keys plus an ``"mt3d"`` section.

DeepSpeed reads the whole file and ignores ``"mt3d"``; mt3d reads its section into the typed
dataclasses below. Every field has a docstring; unknown keys are errors with a "did you mean"
hint; ``--set a.b.c=value`` overrides any key (DeepSpeed's too) before validation. ``validate``
checks everything that can be checked before a process group exists.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .model.config import ModelConfig, ModelConfigError


class ConfigError(UserError):
    """A configuration that cannot run; the message is one actionable line."""


# --- sections ------------------------------------------------------------------------------
@dataclass
class RecomputeConfig:
    """Activation checkpointing (recompute) of transformer blocks."""

    interval: int = 0
    """Checkpoint every run of this many consecutive blocks (0: off; 1: every block)."""
    partition_activations: bool = False
    """Keep only 1/tp of each checkpointed input (sequence slice), all-gathered for the recompute."""


@dataclass
class ParallelConfig:
    """How the model is split: tensor x pipeline (data parallel is what remains)."""

    tensor: int = 1
    """Tensor-parallel degree tp (heads, KV groups and MLP split over tp ranks)."""
    pipeline: int = 1
    """Pipeline stages pp (DeepSpeed's 1F1B pipeline engine)."""
    order: str = "tp-dp-pp"
    """Rank nesting, innermost first; tp innermost keeps TP groups inside hosts."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP regions (needs tp > 1 to have an effect)."""
    stage_layers: list[int] | None = None
    """Transformer blocks per pipeline stage, e.g. [5, 6, 6, 5] (default: as even as possible); with
    virtual stages, per chunk in virtual-stage order (pipeline x virtual_stages entries)."""
    virtual_stages: int = 1
    """Chunks of layers per pipeline rank (PTD-P's interleaved 1F1B): rank r holds virtual stages
    r, r + pipeline, ...; the bubble shrinks by this factor for as many times the point-to-point
    traffic. Needs pipeline >= 2 and micro-batches per step a multiple of pipeline. 1: DeepSpeed's
    own schedule, unchanged."""
    hostfile: str | None = None
    """Hostfile describing the hosts (default: discovered from the launcher's local ranks)."""
    islands: str | None = None
    """NVLink islands as local ranks, e.g. '0,1;2,3' (default: each host is one island)."""
    allow_crossing: bool = False
    """Allow TP groups across hosts when hosts cannot hold whole TP groups (slow; warns)."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = "builtin"
    """'builtin' (English text from the Python installation), 'synthetic' (stochastic grammar with
    a known entropy floor), or 'indexed' (preprocessed .bin/.idx prefixes in ``prefixes``)."""
    seq_len: int = 128
    """Tokens per training sample (the model sees seq_len, predicts seq_len)."""
    prefixes: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (P for P.bin + P.idx) for corpus 'indexed'."""
    weights: list[float] | None = None
    """Blend weights of ``prefixes`` (default: proportional to their sizes)."""
    tokenizer: str | None = None
    """HF tokenizer directory (required for 'indexed'; builtin/synthetic make their own)."""
    split: list[float] = field(default_factory=lambda: [98.0, 1.0, 1.0])
    """Train/valid/test split of the documents, as relative weights."""
    vocab_size: int = 2048
    """Vocabulary of the tokenizer trained for the builtin corpus."""
    cache_dir: str | None = None
    """Where built corpora, tokenizers and sample indices are cached (default ~/.cache/mt3d)."""
    seed: int | None = None
    """Seed of the sample order (default: train.seed)."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 100
    """Optimizer steps to run (global batches)."""
    seed: int = 1234
    """Seed of the weight init, dropout and data order."""
    log_interval: int = 10
    """Print a log line (and write metrics.jsonl) every this many steps."""
    eval_interval: int = 0
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Global batches per evaluation (0: no evaluation)."""
    save_interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    save_dir: str = "runs/default"
    """Run directory: checkpoints, metrics.jsonl, W&B files."""
    save_at_end: bool = True
    """Save a checkpoint when training ends."""
    resume: str = "none"
    """'none', 'auto' (newest complete checkpoint in save_dir) or a checkpoint directory."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (0: keep all); the newest complete one is never deleted."""
    max_bad_steps: int = 5
    """Stop (after saving the last good state) after this many consecutive non-finite steps."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation checkpointing."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU (default: the detected GPU's dense bf16 peak; on CPU a
    matmul measured at start-up)."""
    run_name: str | None = None
    """W&B run name (default: the save_dir's name)."""
    wandb_mode: str = "offline"
    """W&B mode when enabled: 'offline' (default, no network), 'online' or 'disabled'.
    The WANDB_MODE environment variable wins when set."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    compile: bool = False
    """torch.compile each transformer block (fuses elementwise work on GPUs; first steps are slower)."""


@dataclass
class Mt3dConfig:
    """The "mt3d" section of the run config."""

    model: dict = field(default_factory=lambda: {"preset": "tiny"})
    """A preset name, {"preset": name, <overrides>}, {"from_hf": dir}, or explicit dimensions."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data source."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""


@dataclass
class RunConfig:
    """A whole run: DeepSpeed's dict (without "mt3d") and mt3d's typed section."""

    ds: dict
    mt3d: Mt3dConfig
    path: str | None = None

    def to_dict(self) -> dict:
        """The full JSON-able config (DeepSpeed keys + mt3d section)."""
        return {**self.ds, "mt3d": _to_plain(self.mt3d)}

    @property
    def precision(self) -> str:
        """bf16, fp16 or fp32, from DeepSpeed's ``bf16``/``fp16`` sections."""
        for name in ("bf16", "fp16"):
            if (self.ds.get(name) or {}).get("enabled"):
                return name
        return "fp32"


# --- loading -------------------------------------------------------------------------------
def _to_plain(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    return obj


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _build(cls: type, raw: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a dict, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown key '{where}.{key}'{hint}")
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{where}.{key}")
            continue
        if not _type_ok(value, tp):
            raise ConfigError(
                f"'{where}.{key}' must be {_type_name(tp)}, got {json.dumps(value)} ({type(value).__name__})"
            )
        kwargs[key] = float(value) if tp is float else value
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (['a', 'b', 'c'], value); the value is JSON when it parses, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key.path=value, got {text!r}")
    key, value = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set has an empty key in {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return path, parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of ``raw`` with each ``key.path=value`` applied (intermediate objects created)."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, key in enumerate(path[:-1]):
            nxt = node.get(key)
            if nxt is None:
                nxt = node[key] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text}: '{'.'.join(path[: i + 1])}' is not an object")
            node = nxt
        node[path[-1]] = value
    return out


def from_dict(raw: dict, path: str | None = None) -> RunConfig:
    """Split a full config dict into DeepSpeed's part and the typed mt3d section."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    ds = {k: v for k, v in raw.items() if k != "mt3d"}
    section = raw.get("mt3d", {})
    if isinstance(section, dict) and isinstance(section.get("model"), str):
        section = {**section, "model": {"preset": section["model"]}}
    return RunConfig(ds=ds, mt3d=_build(Mt3dConfig, section, "mt3d"), path=path)


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a JSON config file, apply ``--set`` overrides, and parse it (not yet validated)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    return from_dict(apply_overrides(raw, overrides or []), path=str(p))


# --- validation ----------------------------------------------------------------------------
MODEL_KEYS = {"preset", "from_hf"}


def _with_preset_family(cfg: dict) -> ModelConfig:
    """A preset's family is a default: when the overrides leave it unable to express the model (a
    GPT preset given kv_heads, say), the family is inferred from the options instead."""
    from .model.families import get_family

    try:
        return ModelConfig.from_dict(cfg)
    except ModelConfigError:
        free = {**get_family(cfg["family"]).defaults, **cfg}
        free.pop("family")
        return ModelConfig.from_dict(free)  # raises again if the problem was not the family


def resolve_model(section: dict) -> ModelConfig:
    """The ModelConfig named by the model section (preset + overrides, HF dir, or dimensions)."""
    from .presets import get_preset

    section = dict(section)
    try:
        if "from_hf" in section:
            from .model.hf import config_from_hf

            src = section.pop("from_hf")
            if section:
                raise ConfigError(f"mt3d.model.from_hf takes no other keys, got {sorted(section)}")
            return config_from_hf(src)
        base = section.pop("preset", None)
        if base is not None:
            from .presets import PRESETS

            get_preset(base)  # a clear error for unknown names
            # Start from the preset's own fields, not its derived ones: an overridden hidden size
            # must re-derive ffn / head_dim / kv_heads unless those are given too.
            cfg = {"name": base, **PRESETS[base], **section}
            if "family" in section:
                return ModelConfig.from_dict(cfg)
            return _with_preset_family(cfg)
        if not section:
            raise ConfigError("mt3d.model is empty: give a preset, from_hf or dimensions")
        return ModelConfig.from_dict({"name": "custom", **section})
    except ModelConfigError as e:
        raise ConfigError(f"mt3d.model: {e}") from None
    except TypeError as e:
        raise ConfigError(f"mt3d.model: {e}") from None


@dataclass
class Layout:
    """Degrees and batch sizes after validation."""

    world: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    zero_stage: int
    virtual_stages: int = 1
    stage_blocks: tuple[int, ...] | None = None
    """Blocks per (virtual) stage in virtual-stage order, when the model is known."""
    offload: str = "none"
    """Where ZeRO keeps parameters and optimizer states (``Offload.label``)."""

    def saved(self) -> dict:
        """The layout as checkpoints record it (what a resume compares)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "zero_stage": self.zero_stage,
            "virtual_stages": self.virtual_stages,
            "stage_blocks": list(self.stage_blocks) if self.stage_blocks else None,
            "offload": self.offload,
        }


# DeepSpeed sections that must be JSON objects (a scalar there fails deep inside DeepSpeed)
DS_SECTIONS = (
    "fp16", "bf16", "optimizer", "scheduler", "zero_optimization", "pipeline", "checkpoint", "wandb",
    "tensorboard", "csv_monitor", "activation_checkpointing", "flops_profiler", "comms_logger", "aio",
)  # fmt: skip


def _check_sections(ds: dict) -> None:
    for key in DS_SECTIONS:
        value = ds.get(key)
        if value is not None and not isinstance(value, dict):
            example = {"optimizer": "optimizer.type=AdamW", "scheduler": "scheduler.type=WarmupLR"}.get(
                key, f"{key}.enabled=true"
            )
            raise ConfigError(f"'{key}' must be a JSON object, got {json.dumps(value)}; e.g. --set {example}")
    for key in ("fp16", "bf16"):
        enabled = (ds.get(key) or {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"'{key}.enabled' must be true or false, got {json.dumps(enabled)}")


class _DataParallelOf:
    """The one mpu method DeepSpeedConfig asks (when process groups already exist)."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        """The data-parallel size of the run."""
        return self.dp


def _deepspeed_preflight(ds: dict, micro: int, accum: int, dp: int) -> None:
    """Let DeepSpeed parse the config now, before any process group, so that what it rejects is one
    line here instead of a traceback on every rank later. Without process groups DeepSpeed assumes
    one rank, so the batch keys are given for one (mt3d checked them for the real dp already)."""
    import logging

    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(ds)
    ranks = dp if dist.is_initialized() else 1  # DeepSpeed then asks the mpu for dp
    probe.update(train_batch_size=micro * accum * ranks, train_micro_batch_size_per_gpu=micro,
                 gradient_accumulation_steps=accum)  # fmt: skip
    probe.pop("mt3d", None)
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    try:
        DeepSpeedConfig(probe, mpu=_DataParallelOf(dp))
    except (ValueError, TypeError, AttributeError, AssertionError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        detail = " ".join(str(e).split())[:300] if "validation error" in first else first
        raise ConfigError(f"DeepSpeed rejects the config: {detail}") from None
    finally:
        ds_logger.setLevel(level)


# --- layout rules shared with the planner (mt3d.planner.search) --------------------------------
def zero_pipeline_conflict(pp: int, zero_stage: int) -> str | None:
    """Why a ZeRO stage cannot run with ``pp`` pipeline stages (None: it can)."""
    if pp > 1 and zero_stage >= 2:
        return (
            f"ZeRO stage {zero_stage} cannot be used with pipeline={pp} (DeepSpeed's pipeline engine "
            "supports stages 0-1); use zero_optimization.stage 1, or pipeline 1 for ZeRO-2/3"
        )
    if pp > 1 and zero_stage == 0:
        return (
            "ZeRO stage 0 with pipeline > 1 hits DeepSpeed 0.19.8 bugs (wrong clipping norm, bf16 resume "
            "crash); set zero_optimization.stage to 1"
        )
    return None


def virtual_stage_conflict(
    pp: int, v: int, micro_batches: int | None = None, layers: int | None = None
) -> str | None:
    """Why ``v`` virtual stages per rank cannot run (None: they can, as far as the inputs given tell)."""
    if v == 1:
        return None
    if pp < 2:
        return f"mt3d.parallel.virtual_stages {v} needs pipeline >= 2 (it interleaves stages)"
    if micro_batches is not None and micro_batches % pp:
        return (
            f"the interleaved schedule needs micro-batches per step ({micro_batches} = "
            f"gradient_accumulation_steps) to be a multiple of pipeline {pp}"
        )
    if layers is not None and layers < pp * v:
        return f"{layers} layers cannot fill pipeline {pp} x virtual_stages {v} = {pp * v} chunks"
    return None


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
NVME_SUB_GROUP_SIZE = int(1e8)
"""``sub_group_size`` mt3d writes for NVMe offload: DeepSpeed pins 4 swap buffers of this many fp32
elements per rank (its default 1e9 pins 16 GB per rank)."""


@dataclass(frozen=True)
class Offload:
    """Where ZeRO keeps parameters and optimizer states (DeepSpeed's ``zero_optimization.offload_param``
    and ``offload_optimizer``): ``none`` (the accelerator), ``cpu`` or ``nvme`` (ZeRO-Infinity)."""

    param: str = "none"
    optimizer: str = "none"
    param_path: str | None = None
    optimizer_path: str | None = None

    @classmethod
    def of(cls, ds: dict) -> Offload:
        """The offload keys of a DeepSpeed config (absent keys: no offload)."""
        zero = ds.get("zero_optimization") or {}
        found = {}
        for key in ("param", "optimizer"):
            section = zero.get(f"offload_{key}") or {}
            if not isinstance(section, dict):
                raise ConfigError(
                    f"zero_optimization.offload_{key} must be a JSON object, e.g. {{'device': 'cpu'}}"
                )
            device = section.get("device", "none") or "none"
            if device not in OFFLOAD_DEVICES:
                raise ConfigError(
                    f"zero_optimization.offload_{key}.device must be one of {', '.join(OFFLOAD_DEVICES)}, "
                    f"got {device!r}"
                )
            found[key] = device
            found[f"{key}_path"] = section.get("nvme_path")
        return cls(**found)

    @property
    def any(self) -> bool:
        """Whether anything is offloaded."""
        return self.param != "none" or self.optimizer != "none"

    @property
    def label(self) -> str:
        """Short name: none, opt-cpu, opt-nvme, cpu (both), nvme (both), or param/optimizer devices."""
        if self.param == self.optimizer:
            return self.param
        if self.param == "none":
            return f"opt-{self.optimizer}"
        return f"param-{self.param}/opt-{self.optimizer}"

    def ds_keys(self) -> dict:
        """The ``zero_optimization`` keys that ask DeepSpeed for this offload."""
        keys = {}
        for key in ("param", "optimizer"):
            device = getattr(self, key)
            if device != "none":
                section = {"device": device, "pin_memory": True}
                if device == "nvme":
                    section["nvme_path"] = getattr(self, f"{key}_path")
                keys[f"offload_{key}"] = section
        if "nvme" in (self.param, self.optimizer):
            keys["sub_group_size"] = NVME_SUB_GROUP_SIZE
        return keys

    @classmethod
    def from_label(cls, label: str, path: str | None = None) -> Offload:
        """Inverse of ``label`` for the planner's options (none, opt-cpu, opt-nvme, cpu, nvme)."""
        if label.startswith("opt-"):
            dev = label[4:]
            return cls("none", dev, None, path if dev == "nvme" else None)
        return cls(label, label, path if label == "nvme" else None, path if label == "nvme" else None)


def offload_conflict(zero_stage: int, pp: int, off: Offload) -> str | None:
    """Why this offload cannot run with ZeRO ``zero_stage`` and ``pp`` stages (None: it can).

    DeepSpeed 0.19.8 itself accepts some of these and then ignores them: parameter offload below
    ZeRO-3, and NVMe optimizer offload below ZeRO-3 (which it runs as CPU offload)."""
    if not off.any:
        return None
    if zero_stage == 0:
        return (
            "offloading needs ZeRO (zero_optimization.stage 1-3); stage 0 has nothing partitioned to offload"
        )
    if off.param != "none" and zero_stage != 3:
        return (
            f"zero_optimization.offload_param needs ZeRO stage 3 (DeepSpeed ignores it at stage "
            f"{zero_stage}); ZeRO-3 needs pipeline 1. Offload the optimizer only (offload_optimizer) at 1/2"
        )
    if off.optimizer == "nvme" and zero_stage != 3:
        return (
            f"offload_optimizer.device nvme needs ZeRO stage 3 (DeepSpeed 0.19.8 runs it as cpu at stage "
            f"{zero_stage}); use device cpu, or stage 3 with pipeline 1"
        )
    for key in ("param", "optimizer"):
        if getattr(off, key) == "nvme" and not getattr(off, f"{key}_path"):
            return (
                f"zero_optimization.offload_{key}.device nvme needs nvme_path (a directory on a local NVMe "
                "disk)"
            )
    return None


def optimizer_device(label: str) -> str:
    """The optimizer's device in an ``Offload.label`` (none, cpu, nvme)."""
    return label.rsplit("opt-", 1)[1] if "opt-" in label else label


def offload_resume_conflict(saved: str, now: str, layout_changed: bool) -> str | None:
    """Why a checkpoint saved with offload ``saved`` cannot resume with offload ``now`` (labels).

    Parameters and optimizer states on the CPU are saved in the same files as without offload, so
    those resume either way. DeepSpeed 0.19.8 saves NVMe-offloaded optimizer states as a copy of the
    swap files (``offloaded_tensors/rank*``) and leaves empty tensors in ``*_optim_states.pt``; it
    restores them only into the same NVMe layout, and reads nothing else then. mt3d converts such a
    checkpoint for a run without NVMe optimizer offload at the same layout
    (``checkpoint.nvme_states.convert_for_resume``); the other direction is refused."""
    was, will = optimizer_device(saved), optimizer_device(now)
    if "nvme" not in (was, will) or (was == will and not layout_changed):
        return None
    if was == "nvme" and not layout_changed:
        return None  # converted on resume
    if was == will:
        return (
            "a checkpoint with NVMe-offloaded optimizer states resumes only at the layout it was saved "
            "with (DeepSpeed keeps them as per-rank swap files); for another layout, export-hf and start "
            "from those weights (model.from_hf)"
        )
    if was == "nvme":
        return (
            "a checkpoint with NVMe-offloaded optimizer states resumes only at the layout it was saved "
            "with; for another layout, export-hf and start from those weights (model.from_hf)"
        )
    return (
        f"the checkpoint's optimizer states were saved with offload {saved!r} and this run uses {now!r}: "
        "an NVMe run of DeepSpeed 0.19.8 reads optimizer states only from swap files an NVMe run saved; "
        "keep the checkpoint's offload_optimizer device, or export-hf and start the NVMe run from those "
        "weights (model.from_hf: fresh optimizer states)"
    )


def _zero_stage(ds: dict) -> int:
    z = ds.get("zero_optimization", {})
    if not isinstance(z, dict):
        raise ConfigError("zero_optimization must be a JSON object")
    stage = z.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage


def _batches(ds: dict, dp: int) -> tuple[int, int, int]:
    gb = ds.get("train_batch_size")
    mb = ds.get("train_micro_batch_size_per_gpu")
    ga = ds.get("gradient_accumulation_steps")
    for name, v in (
        ("train_batch_size", gb),
        ("train_micro_batch_size_per_gpu", mb),
        ("gradient_accumulation_steps", ga),
    ):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if mb is None and gb is not None and ga is not None:
        if gb % (ga * dp):
            raise ConfigError(
                f"train_batch_size {gb} is not divisible by gradient_accumulation_steps*dp = {ga}*{dp}"
            )
        mb = gb // (ga * dp)
    mb = mb or 1
    if ga is None:
        if gb is None:
            ga = 1
        elif gb % (mb * dp):
            raise ConfigError(
                f"train_batch_size {gb} is not divisible by micro-batch*dp = {mb}*{dp}; "
                f"use a multiple of {mb * dp}"
            )
        else:
            ga = gb // (mb * dp)
    if gb is None:
        gb = mb * ga * dp
    if mb * ga * dp != gb:
        raise ConfigError(
            f"train_batch_size {gb} != micro-batch {mb} x gradient_accumulation_steps {ga} x dp {dp}; "
            "fix one of them (or drop gradient_accumulation_steps to derive it)"
        )
    return mb, ga, gb


def fp16_supported() -> bool:
    """Whether DeepSpeed can train in fp16 here (any CUDA GPU, or a CPU with fp16 support in oneDNN)."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def _check_mapping(par: ParallelConfig, world_size: int) -> None:
    """The rank-mapping keys (order, islands, hostfile) parse, and a hostfile's hosts fit the world."""
    from .parallel.hosts import parse_islands, read_hostfile
    from .parallel.topology import TopologyError, map_ranks, parse_order

    try:
        parse_order(par.order)
        islands = parse_islands(par.islands) if par.islands else None
        if par.hostfile:
            map_ranks(
                world_size,
                par.tensor,
                par.pipeline,
                hosts=read_hostfile(par.hostfile),
                order=par.order,
                islands=islands,
                allow_crossing=par.allow_crossing,
            )
    except TopologyError as e:
        raise ConfigError(f"mt3d.parallel: {e}") from None


def _check_train(train: TrainConfig) -> None:
    bounds = {
        "steps": 0,
        "log_interval": 1,
        "eval_interval": 0,
        "eval_batches": 0,
        "save_interval": 0,
        "keep_last": 0,
        "max_bad_steps": 1,
    }
    for key, low in bounds.items():
        if getattr(train, key) < low:
            raise ConfigError(f"mt3d.train.{key} must be >= {low}, got {getattr(train, key)}")
    if train.eval_interval > 0 and train.eval_batches == 0:
        raise ConfigError("mt3d.train.eval_interval > 0 needs eval_batches >= 1 (or set eval_interval 0)")
    if train.peak_tflops is not None and train.peak_tflops <= 0:
        raise ConfigError(f"mt3d.train.peak_tflops must be positive, got {train.peak_tflops}")


def _check_data(data: DataConfig) -> None:
    if len(data.split) != 3 or min(data.split) < 0 or data.split[0] <= 0 or data.split[1] <= 0:
        raise ConfigError(
            f"mt3d.data.split must be 3 non-negative weights (train, valid, test) with train and valid "
            f"> 0, got {data.split}"
        )
    if data.weights is not None and (min(data.weights, default=0) < 0 or sum(data.weights) <= 0):
        raise ConfigError(f"mt3d.data.weights must be non-negative and not all zero, got {data.weights}")
    if data.corpus == "builtin" and data.tokenizer is None and data.vocab_size < 257:
        raise ConfigError(
            f"mt3d.data.vocab_size must be > 256 for the builtin corpus's BPE, got {data.vocab_size}"
        )
    if data.corpus == "synthetic" and data.vocab_size < 8:
        raise ConfigError(
            f"mt3d.data.vocab_size must be >= 8 for the synthetic corpus, got {data.vocab_size}"
        )


def validate(run: RunConfig, world_size: int, model: ModelConfig | None = None) -> Layout:
    """Check the run against ``world_size`` ranks before any process group exists; fill batch keys."""
    par, data, train = run.mt3d.parallel, run.mt3d.data, run.mt3d.train
    tp, pp = par.tensor, par.pipeline
    _check_sections(run.ds)
    for name, v in (("parallel.tensor", tp), ("parallel.pipeline", pp), ("data.seq_len", data.seq_len)):
        if v <= 0:
            raise ConfigError(f"mt3d.{name} must be positive, got {v}")
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor*pipeline = {tp}*{pp}; "
            f"launch a multiple of {tp * pp} processes or change mt3d.parallel"
        )
    dp = world_size // (tp * pp)
    _check_mapping(par, world_size)
    stage = _zero_stage(run.ds)
    v = par.virtual_stages
    if v < 1:
        raise ConfigError(f"mt3d.parallel.virtual_stages must be >= 1, got {v}")
    why = virtual_stage_conflict(pp, v)
    if why:
        raise ConfigError(why)
    why = zero_pipeline_conflict(pp, stage) or offload_conflict(stage, pp, Offload.of(run.ds))
    if why:
        raise ConfigError(why)
    if par.sequence_parallel and tp > 1 and data.seq_len % tp:
        raise ConfigError(f"sequence parallelism needs seq_len ({data.seq_len}) divisible by tp ({tp})")
    if model is not None:
        try:
            model.check_parallel(tp, pp)
        except ModelConfigError as e:
            raise ConfigError(str(e)) from None
        if model.position_limit is not None and data.seq_len > model.position_limit:
            raise ConfigError(
                f"data.seq_len {data.seq_len} exceeds the model's max_seq_len {model.position_limit}"
            )
        chunks = pp * par.virtual_stages
        if par.stage_layers is not None:
            what = f"{pp} stages" if par.virtual_stages == 1 else f"{pp} x {par.virtual_stages} chunks"
            if len(par.stage_layers) != chunks or sum(par.stage_layers) != model.layers:
                raise ConfigError(
                    f"parallel.stage_layers {par.stage_layers} must list {what} adding up to "
                    f"{model.layers} layers"
                )
            if min(par.stage_layers) < 1:
                raise ConfigError("parallel.stage_layers: every stage needs at least one block")
        elif model.layers < chunks:
            raise ConfigError(
                f"{model.layers} layers cannot fill pipeline {pp} x virtual_stages {par.virtual_stages} = "
                f"{chunks} chunks of at least one block; use fewer stages or chunks"
            )
    _check_train(train)
    _check_data(data)
    if train.resume not in ("none", "auto") and not Path(train.resume).exists():
        raise ConfigError(f"mt3d.train.resume: checkpoint not found: {train.resume}")
    if train.wandb_mode not in ("offline", "online", "disabled"):
        raise ConfigError(
            f"mt3d.train.wandb_mode must be offline, online or disabled, got {train.wandb_mode!r}"
        )
    if data.corpus not in ("builtin", "synthetic", "indexed"):
        raise ConfigError(f"mt3d.data.corpus must be builtin, synthetic or indexed, got {data.corpus!r}")
    if data.corpus == "indexed":
        if not data.prefixes:
            raise ConfigError("mt3d.data.prefixes is empty: corpus 'indexed' needs .bin/.idx prefixes")
        for pre in data.prefixes:
            for ext in (".bin", ".idx"):
                if not Path(pre + ext).is_file():
                    raise ConfigError(
                        f"mt3d.data.prefixes: {pre + ext} not found (run 'mt3d preprocess' first)"
                    )
        if data.tokenizer is None or not Path(data.tokenizer).is_dir():
            raise ConfigError(f"mt3d.data.tokenizer: tokenizer directory not found: {data.tokenizer}")
        if data.weights is not None and len(data.weights) != len(data.prefixes):
            raise ConfigError("mt3d.data.weights must have one weight per prefix")
    if (run.ds.get("fp16") or {}).get("enabled") and not fp16_supported():
        raise ConfigError(
            "fp16 is not supported on this device (DeepSpeed's CPU accelerator needs AVX512-FP16/AMX); "
            "use bf16.enabled or fp32, or run on a GPU"
        )
    mb, ga, gb = _batches(run.ds, dp)
    run.ds.update(train_batch_size=gb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    why = virtual_stage_conflict(pp, v, micro_batches=ga)
    if why:
        raise ConfigError(why + "; change train_batch_size or train_micro_batch_size_per_gpu")
    _check_paths(train, data)
    _deepspeed_preflight(run.ds, mb, ga, dp)
    blocks = None
    if model is not None:
        from .model.pipeline import default_stage_blocks

        blocks = tuple(par.stage_layers or default_stage_blocks(model.layers, pp * v))
    return Layout(world_size, tp, pp, dp, mb, ga, gb, stage, v, blocks, Offload.of(run.ds).label)


def _writable_dir(path: str | Path, what: str) -> None:
    """``path`` is, or can become, a directory this process can write (probed with a real file)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} {p} exists and is not a directory")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {p}: {existing} is not a directory")
    probe = existing / f".mt3d-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{what} {p} is not writable ({e.strerror} in {existing}); choose another"
        ) from None


def _check_paths(train: TrainConfig, data: DataConfig) -> None:
    """Where the run writes must be writable before any process group exists."""
    _writable_dir(train.save_dir, "mt3d.train.save_dir")
    if data.cache_dir:
        _writable_dir(data.cache_dir, "mt3d.data.cache_dir")
