"""Models no HF family can express (any combination of block options): trained and checkpointed
like any other, but with no transformers architecture to load from or export to."""

from __future__ import annotations

from ..options import BLOCK_OPTIONS
from .base import _REGISTRY, Family, HFError, register


@register
class Custom(Family):
    """The family of configs that match no other (tried last by ``infer_family``)."""

    name = "custom"
    architecture = "no transformers architecture"
    model_types = ()
    infer_rank = 1000
    any_pattern = True
    variable = frozenset(BLOCK_OPTIONS)
    mtp_format = "any"  # trained; no checkpoint form

    def _none(self, *args, **kwargs):
        names = ", ".join(sorted(f.name for f in _REGISTRY.values() if f.model_types))
        raise HFError(
            f"this model's block options match no HF family ({names}), so it has no transformers "
            "form; set mt3d.model.family to see which option stands in the way"
        )

    config_kwargs = hf_config = pieces = _none
