"""DeepSpeed's part of a run config: the one home of its raw keys.

mt3d reads DeepSpeed's keys only through ``DeepSpeedSection``, a read-only view with typed
accessors (precision, ZeRO stage, offload, batch keys, clipping, W&B), and checks the section
before any process group exists: sections that must be objects, and DeepSpeed's own parser
(``deepspeed_preflight``), so that what DeepSpeed would reject is one line instead of a traceback
on every rank.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from types import MappingProxyType

from .errors import ConfigError

# DeepSpeed sections that must be JSON objects (a scalar there fails deep inside DeepSpeed)
SECTIONS = (
    "fp16", "bf16", "optimizer", "scheduler", "zero_optimization", "pipeline", "checkpoint", "wandb",
    "tensorboard", "csv_monitor", "activation_checkpointing", "flops_profiler", "comms_logger", "aio",
)  # fmt: skip
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
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


class DeepSpeedSection:
    """A read-only view of a run's DeepSpeed keys (everything but "mt3d"), with typed accessors."""

    def __init__(self, ds: dict) -> None:
        self._ds = ds

    @property
    def raw(self) -> MappingProxyType:
        """The keys as given (read-only; ``copy()`` for a dict DeepSpeed may change)."""
        return MappingProxyType(self._ds)

    def copy(self) -> dict:
        """A deep copy of the keys, to hand to DeepSpeed."""
        return copy.deepcopy(self._ds)

    def section(self, name: str) -> dict:
        """A DeepSpeed section (``{}`` when absent), as a copy."""
        return copy.deepcopy(self._ds.get(name) or {})

    @property
    def precision(self) -> str:
        """bf16, fp16 or fp32, from DeepSpeed's ``bf16``/``fp16`` sections."""
        for name in ("bf16", "fp16"):
            if (self._ds.get(name) or {}).get("enabled"):
                return name
        return "fp32"

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage`` (0 when absent); anything else than 0-3 is refused."""
        z = self._ds.get("zero_optimization", {})
        if not isinstance(z, dict):
            raise ConfigError("zero_optimization must be a JSON object")
        stage = z.get("stage", 0)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
        return stage

    @property
    def offload(self) -> Offload:
        """Where ZeRO keeps parameters and optimizer states."""
        return Offload.of(self._ds)

    def batch_keys(self) -> dict[str, int | None]:
        """The three batch keys as given (None: absent)."""
        return {k: self._ds.get(k) for k in BATCH_KEYS}

    @property
    def gradient_clipping(self) -> float:
        """``gradient_clipping`` (0: none)."""
        return float(self._ds.get("gradient_clipping") or 0.0)

    @property
    def decay_free(self) -> bool:
        """Whether the optimizer's ``weight_decay`` is given as 0 (absent: the optimizer class's default,
        which differs between DeepSpeed's optimizers)."""
        decay = ((self._ds.get("optimizer") or {}).get("params") or {}).get("weight_decay")
        return isinstance(decay, int | float) and not isinstance(decay, bool) and decay == 0

    @property
    def optimizer_type(self) -> str:
        """The optimizer's ``type``, lower case ('' when DeepSpeed's section has none)."""
        return str((self._ds.get("optimizer") or {}).get("type", "")).lower()

    @property
    def optimizer_params(self) -> dict:
        """The optimizer's ``params`` ({} when none are given)."""
        return dict((self._ds.get("optimizer") or {}).get("params") or {})

    @property
    def wandb(self) -> dict:
        """DeepSpeed's ``wandb`` section (mt3d runs the W&B sink itself from it)."""
        return self.section("wandb")


def check_sections(ds: dict) -> None:
    """Sections that must be JSON objects are, and ``fp16``/``bf16`` ``enabled`` are booleans."""
    for key in SECTIONS:
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


def deepspeed_preflight(ds: dict, micro: int, accum: int, dp: int) -> None:
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
