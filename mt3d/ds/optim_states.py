"""Optimizer states that DeepSpeed's optimizers cannot read from one another (a workaround)."""

from __future__ import annotations


def accept_adam_states_across_implementations(engine) -> None:
    """Register ``optimizer_state_across_implementations`` on the engine's base optimizer."""
    base = getattr(engine, "basic_optimizer", None)
    if base is not None:
        base.register_load_state_dict_pre_hook(optimizer_state_across_implementations)


def optimizer_state_across_implementations(optimizer, state_dict: dict) -> dict:
    """Workaround (the pinned DeepSpeed, torch 2.13): let Adam states move between torch's AdamW and
    DeepSpeedCPUAdam, which DeepSpeed picks by whether the optimizer is offloaded.

    ``Optimizer.load_state_dict`` takes the saved ``param_groups`` whole. torch's AdamW fills its
    own missing keys (``__setstate__``) and turns integer steps into tensors, so a CPU-offloaded
    checkpoint resumes without offload; DeepSpeedCPUAdam does neither and fails in its first step
    with ``KeyError: 'bias_correction'`` (and would get tensor steps). Registered as a load pre-hook
    on the engine's base optimizer (``accept_adam_states_across_implementations``);
    tests/test_offload.py notices when DeepSpeedCPUAdam stops needing it.
    """
    for group in state_dict.get("param_groups", []):
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":
        for st in state_dict.get("state", {}).values():
            if "step" in st and hasattr(st["step"], "item"):
                st["step"] = int(st["step"].item())
    return state_dict
