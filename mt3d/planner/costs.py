"""Closed-form memory and time of one training layout (FORMULAS.md), in three homes: ``layout``
(the candidate, its precision, its model states), ``memory`` (bytes per GPU) and ``timing`` (seconds
per step). Re-exported here, the name callers use."""

from .layout import Layout, Precision, model_state_bytes, stage_params
from .memory import (
    DEEPSPEED_ALLREDUCE_ELEMENTS,
    bf16_optimizer_gradient_bytes,
    cp_gathered_bytes,
    in_flight_blocks,
    korthikanti_layer_bytes,
    korthikanti_working_bytes,
    logit_bytes,
    memory_bytes,
    mlp_inner_elements,
    mt3d_layer_bytes,
    overlaps_reduction,
    posts_p2p,
    reduction_bytes,
    runs_bf16_optimizer,
)
from .timing import (
    CPU_ADAM_ELEMENTS_PER_CORE_S,
    ZERO3_OVERLAP,
    _tp_seconds,
    bucket_reduction_hidden,
    dp_hidden,
    ep_bytes,
    pp_posted_seconds,
    step_time,
    tp_comm_hidden,
    tp_hidden,
)

__all__ = [
    "CPU_ADAM_ELEMENTS_PER_CORE_S", "DEEPSPEED_ALLREDUCE_ELEMENTS", "Layout", "Precision", "ZERO3_OVERLAP",
    "_tp_seconds", "bf16_optimizer_gradient_bytes", "bucket_reduction_hidden", "cp_gathered_bytes",
    "dp_hidden", "ep_bytes", "in_flight_blocks", "korthikanti_layer_bytes", "korthikanti_working_bytes",
    "logit_bytes", "memory_bytes", "mlp_inner_elements", "model_state_bytes", "mt3d_layer_bytes",
    "overlaps_reduction", "posts_p2p", "pp_posted_seconds", "reduction_bytes", "runs_bf16_optimizer",
    "stage_params", "step_time", "tp_comm_hidden", "tp_hidden",
]  # fmt: skip
