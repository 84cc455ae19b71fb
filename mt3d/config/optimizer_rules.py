"""Rules of the optimizer choices mt3d builds itself (Muon: ``mt3d.training.muon``), read through
``rules``."""

from __future__ import annotations

NS_METHODS = ("gram", "standard")
"""DeepSpeed's ``ns_method`` values: "standard" iterates on X; "gram" on the small Gram matrix X X^T
(the same polynomial, fewer FLOPs when the matrix is wide)."""
SCALES = ("deepspeed", "match_rms")
NS_DTYPES = ("fp32", "bf16")
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "muon_lr")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "adam_lr")


def muon_conflict(ds, train, stage: int, precision: str) -> str | None:
    """Why ``"optimizer": {"type": "Muon"}`` cannot run here (None: it can, or another optimizer)."""
    if ds.optimizer_type != "muon":
        return "mt3d.train.muon is set but the optimizer is not Muon" if train.muon is not None else None
    params, muon = ds.optimizer_params, train.muon
    unknown = sorted(set(params) - set(MUON_KEYS) - set(ADAM_KEYS))
    if unknown:
        keys = ", ".join(sorted(set(MUON_KEYS) | set(ADAM_KEYS)))
        return f"optimizer.params.{unknown[0]} is not a Muon key (Muon takes {keys})"
    if params.get("ns_method", "gram") not in NS_METHODS:
        return f"optimizer.params.ns_method must be one of {', '.join(NS_METHODS)}: got {params['ns_method']}"
    if not 0 <= params.get("momentum", 0.95) < 1:
        return f"optimizer.params.momentum must be in [0, 1), got {params['momentum']}"
    for key in ("lr", "muon_lr", "adam_lr"):
        if key in params and not params[key] > 0:
            return f"optimizer.params.{key} must be positive, got {params[key]}"
    if muon is not None and muon.scale not in SCALES:
        return f"mt3d.train.muon.scale must be one of {', '.join(SCALES)}, got {muon.scale!r}"
    if muon is not None and muon.ns_dtype not in NS_DTYPES:
        return f"mt3d.train.muon.ns_dtype must be one of {', '.join(NS_DTYPES)}, got {muon.ns_dtype!r}"
    if muon is not None and muon.qk_clip is not None and not muon.qk_clip > 0:
        return f"mt3d.train.muon.qk_clip must be a positive number (tau, e.g. 100), got {muon.qk_clip!r}"
    why = muon_layout_conflict(stage, precision, ds.offload.label)
    if why:
        return why
    if train.optimizer_states != "fp32":
        return "mt3d.train.optimizer_states applies to DeepSpeed's optimizers, not Muon: drop it"
    return None


def qk_clip_conflict(muon, model, lora) -> str | None:
    """Why QK-clip (``train.muon.qk_clip``) cannot run on ``model`` (None: it can, or it is off)."""
    if muon is None or muon.qk_clip is None:
        return None
    if lora is not None:
        return "mt3d.train.muon.qk_clip scales the query and key weights, which mt3d.lora freezes: drop one"
    if model.qk_norm:
        return (
            "mt3d.train.muon.qk_clip cannot bound this model's logits: its q/k norms (model.qk_norm) undo "
            "any scale of the query and key weights (and already bound the logits); drop qk_clip"
        )
    return None


def muon_layout_conflict(stage: int, precision: str, offload: str) -> str | None:
    """Why Muon cannot run at ZeRO ``stage``, ``precision`` and offload ``offload`` (an ``Offload``
    label; None: it can): the one rule ``mt3d train`` and the planner (``planner.muon``) apply."""
    if stage > 2 or precision == "fp16" or (precision == "bf16" and stage == 0) or offload != "none":
        return (
            f"mt3d runs Muon with ZeRO stage 0-2 in fp32 or stage 1-2 in bf16, without offload (this run: "
            f"stage {stage}, {precision}, offload {offload}): ZeRO-3 and offloaded optimizers step "
            "parameters no rank holds whole"
        )
    return None


def optimizer_resume_conflict(saved: str, now: str) -> str | None:
    """Why a checkpoint written with optimizer type ``saved`` cannot resume this run (``now``; None: it
    can): Muon's states and Adam's differ."""
    saved, now = saved or "none", now or "none"
    if (saved.lower() == "muon") != (now.lower() == "muon"):
        return (
            f"the checkpoint was trained with optimizer {saved} and this run uses {now}, whose states "
            f"differ (Muon keeps one momentum per weight, Adam two moments): resume with optimizer.type "
            f"{saved}, or export it with `mt3d export-hf` and continue from that directory with model.from_hf"
        )
    return None
