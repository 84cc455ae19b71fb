"""The run configuration: one JSON file holding DeepSpeed's keys plus an ``"mt3d"`` section.

DeepSpeed reads the whole file and ignores ``"mt3d"``; mt3d reads its section into typed
dataclasses. Split by concern:

* ``schema``: the dataclasses (a docstring under every field) and their parsing;
* ``overrides``: reading the file and ``--set a.b.c=value`` overrides (DeepSpeed's keys too);
* ``models``: the model section as a ModelConfig;
* ``deepspeed``: the one home of DeepSpeed's raw keys (a typed read-only view, DeepSpeed's own
  parser run as a preflight);
* ``rules``: layout rules shared with the planner and with resumes;
* ``preflight``: files, directories and the device;
* ``layout``: ``validate`` (everything that can be checked before a process group exists) and the
  ``Layout`` it returns.
"""

from .deepspeed import NVME_SUB_GROUP_SIZE, OFFLOAD_DEVICES, DeepSpeedSection, Offload
from .errors import ConfigError
from .layout import Layout, validate
from .models import MODEL_KEYS, resolve_model
from .overrides import apply_overrides, load, parse_override
from .preflight import fp16_supported, writable_dir
from .rules import (
    context_sequence_conflict,
    context_zero_conflict,
    degrees_for,
    expert_conflict,
    folding_conflict,
    grad_accum_conflict,
    moe_conflict,
    offload_conflict,
    offload_resume_conflict,
    optimizer_device,
    optimizer_states_conflict,
    overlap_conflict,
    p2p_conflict,
    virtual_stage_conflict,
    zero_pipeline_conflict,
)
from .schema import (
    DataConfig,
    Mt3dConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
    from_dict,
)

__all__ = [
    "MODEL_KEYS",
    "NVME_SUB_GROUP_SIZE",
    "OFFLOAD_DEVICES",
    "ConfigError",
    "DataConfig",
    "DeepSpeedSection",
    "Layout",
    "Mt3dConfig",
    "Offload",
    "ParallelConfig",
    "RecomputeConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "context_sequence_conflict",
    "context_zero_conflict",
    "expert_conflict",
    "folding_conflict",
    "grad_accum_conflict",
    "moe_conflict",
    "degrees_for",
    "fp16_supported",
    "from_dict",
    "load",
    "offload_conflict",
    "offload_resume_conflict",
    "optimizer_device",
    "optimizer_states_conflict",
    "overlap_conflict",
    "p2p_conflict",
    "parse_override",
    "resolve_model",
    "validate",
    "virtual_stage_conflict",
    "writable_dir",
    "zero_pipeline_conflict",
]
