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
    if muon is not None and muon.qk_clip is not None:
        why = "must be positive" if not muon.qk_clip > 0 else "(MuonClip) is not built yet; drop it"
        return f"mt3d.train.muon.qk_clip {why}"
    if stage > 0 or precision != "fp32" or ds.offload.any:
        return (
            f"Muon orthogonalises whole matrices, which ZeRO's and DeepSpeed's bf16 optimizer's flat "
            f"partitions split: mt3d runs it with ZeRO stage 0 in fp32 without offload so far (this run: "
            f"stage {stage}, {precision}, offload {ds.offload.label})"
        )
    if train.optimizer_states != "fp32":
        return "mt3d.train.optimizer_states applies to DeepSpeed's optimizers, not Muon: drop it"
    return None
