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


def steps_as_their_optimizer_keeps_them(engine) -> None:
    """Workaround (the pinned DeepSpeed, torch 2.13): after a universal load, give every optimizer
    state's ``step`` the type its optimizer steps with.

    DeepSpeed's universal loader sets ``state["step"]`` to whatever the converted checkpoint holds:
    an int from DeepSpeedCPUAdam (an optimizer-offloaded run), a tensor from torch's Adam. torch's
    Adam then fails in its first step ("state_steps argument must contain a list of singleton
    tensors"), so a CPU-offloaded checkpoint could not be resharded into a run without offload.
    torch keeps a float32 scalar tensor (on the parameter's device when fused or capturable, else
    on the CPU); DeepSpeedCPUAdam an int. tests/test_offload.py notices when DeepSpeed converts."""
    import torch

    opt = getattr(engine, "basic_optimizer", None)
    if opt is None:
        return
    as_int = type(opt).__name__ == "DeepSpeedCPUAdam"
    for group in opt.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = opt.state.get(p)
            if not st or "step" not in st:
                continue
            step = st["step"]
            if as_int:
                st["step"] = int(step.item()) if torch.is_tensor(step) else int(step)
            elif not torch.is_tensor(step):
                device = p.device if on_device else "cpu"
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
