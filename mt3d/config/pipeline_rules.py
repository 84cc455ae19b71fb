"""The pipeline's layout rules: ZeRO with pipeline stages, virtual stages, the schedule and posted
transfers (``config.rules`` re-exports them: the one home of every rule, in two files)."""

from __future__ import annotations


def zero_pipeline_conflict(pp: int, zero_stage: int) -> str | None:
    """Why a ZeRO stage cannot run with ``pp`` pipeline stages (None: it can)."""
    from ..versions import running_version

    if pp > 1 and zero_stage >= 2:
        return (
            f"ZeRO stage {zero_stage} cannot be used with pipeline={pp} (DeepSpeed's pipeline engine "
            "supports stages 0-1); use zero_optimization.stage 1, or pipeline 1 for ZeRO-2/3"
        )
    if pp > 1 and zero_stage == 0:
        return (
            f"ZeRO stage 0 with pipeline > 1 hits DeepSpeed {running_version()} bugs (wrong clipping norm, "
            "bf16 resume crash); set zero_optimization.stage to 1"
        )
    return None


def virtual_stage_conflict(
    pp: int, v: int, micro_batches: int | None = None, layers: int | None = None, schedule: str = "1f1b"
) -> str | None:
    """Why ``v`` virtual stages per rank cannot run (None: they can, as far as the inputs given tell);
    the micro-batch count is the interleaved 1F1B's rule (the zero-bubble schedules run any)."""
    if v == 1:
        return None
    if pp < 2:
        return f"mt3d.parallel.virtual_stages {v} needs pipeline >= 2 (it interleaves stages)"
    if micro_batches is not None and micro_batches % pp and schedule == "1f1b":
        return (
            f"the interleaved schedule needs micro-batches per step ({micro_batches} = "
            f"gradient_accumulation_steps) to be a multiple of pipeline {pp}"
        )
    if layers is not None and layers < pp * v:
        return f"{layers} layers cannot fill pipeline {pp} x virtual_stages {v} = {pp * v} chunks"
    return None


def schedule_conflict(schedule: str, pp: int, v: int) -> str | None:
    """Why ``mt3d.parallel.schedule`` cannot run (None: it can). Micro-batches per step: "1f1b" any
    (interleaved: a multiple of pipeline, the virtual stages' rule), "zb-h1" and "zbv" any from 1
    (``pipeline.zero_bubble``'s orders run every count; the bubble needs m well above pipeline to
    shrink)."""
    from ..pipeline.zero_bubble import SCHEDULES

    if schedule not in SCHEDULES:
        return f"unknown mt3d.parallel.schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
    if schedule == "1f1b":
        return None
    if pp < 2:
        return f"mt3d.parallel.schedule {schedule!r} schedules pipeline stages: it needs pipeline >= 2"
    if v != SCHEDULES[schedule]:
        fix = ("one chunk per rank: set virtual_stages to 1" if SCHEDULES[schedule] == 1
               else "two chunks per rank in a V: set virtual_stages to 2")  # fmt: skip
        return f"mt3d.parallel.schedule {schedule!r} runs {fix}"
    return None


def p2p_conflict(p2p: bool, pp: int, micro_batches: int | None = None, schedule: str = "1f1b") -> str | None:
    """Why ``mt3d.train.overlap.p2p`` cannot run (None: it can)."""
    if not p2p:
        return None
    if pp < 2:
        return "mt3d.train.overlap.p2p overlaps pipeline transfers: it needs pipeline >= 2"
    if micro_batches is not None and micro_batches % pp and schedule == "1f1b":
        return (f"mt3d.train.overlap.p2p runs mt3d's pipeline schedule, which needs micro-batches per "
                f"step ({micro_batches} = gradient_accumulation_steps) to be a multiple of pipeline "
                f"{pp}")  # fmt: skip
    return None
