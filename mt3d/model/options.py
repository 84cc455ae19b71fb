"""The model floor's base: its error and the block options (a leaf the config, the families and the
MoE layer all read, so none of them imports another for it)."""

from __future__ import annotations

from ..errors import UserError


class ModelConfigError(UserError):
    """An architecture that cannot be built (or cannot be split as asked)."""


GATED_MLPS = ("swiglu", "geglu")
"""MLPs with a gate and an up projection (fused as one column-parallel linear)."""


# Fields that shape the block (as opposed to sizes, dropout and init): a family fixes some of them
# and lets its HF config set others (``Family.check``).
BLOCK_OPTIONS = (
    "position",
    "norm",
    "mlp",
    "bias",
    "qkv_bias",
    "mlp_bias",
    "qk_norm",
    "rotary_fraction",
    "norm_unit_offset",
    "scale_embedding",
    "post_norms",
    "attn_softcap",
    "logit_softcap",
    "query_pre_attn_scalar",
    "attn_sinks",
    "attention",
    "mla",
    "tie_embeddings",
    "moe",
    "linear_attention",
    "attn_output_gate",
)


def option_fields(cls, d, option: str, required: tuple[str, ...], error=ModelConfigError) -> dict:
    """The keyword arguments of dataclass ``cls`` that the ``model.<option>`` object ``d`` gives, after the
    checks every such option shares (an object, no unknown key, the required keys): one-line errors
    naming the key."""
    from dataclasses import fields

    if not isinstance(d, dict):
        raise error(f"model.{option} must be an object, got {d!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise error(f"unknown model.{option} keys {unknown}; valid keys: {sorted(names)}")
    for key in required:
        if key not in d:
            raise error(f"model.{option} needs {key!r}")
    return dict(d)
