"""The model floor's base: its error and the block options (a leaf the config, the families and the
MoE layer all read, so none of them imports another for it)."""

from __future__ import annotations

from ..errors import UserError


class ModelConfigError(UserError):
    """An architecture that cannot be built (or cannot be split as asked)."""


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
)
