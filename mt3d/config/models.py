"""The model section of a run config (a preset with overrides, an HF directory, or dimensions) as
a ModelConfig."""

from __future__ import annotations

from ..model.config import ModelConfig, ModelConfigError
from .errors import ConfigError

MODEL_KEYS = {"preset", "from_hf"}


def _with_preset_family(cfg: dict) -> ModelConfig:
    """A preset's family is a default: when the overrides leave it unable to express the model (a
    GPT preset given kv_heads, say), the family is inferred from the options instead."""
    from ..model.families import get_family

    try:
        return ModelConfig.from_dict(cfg)
    except ModelConfigError:
        free = {**get_family(cfg["family"]).defaults, **cfg}
        free.pop("family")
        return ModelConfig.from_dict(free)  # raises again if the problem was not the family


def with_mtp(cfg: ModelConfig, mtp, src) -> ModelConfig:
    """An HF model with ``model.mtp`` (its checkpoint must hold that many MTP layers)."""
    import dataclasses

    from ..model.families import get_family

    out = dataclasses.replace(cfg, mtp=mtp)  # checks the spec and the family's format
    held = get_family(out.family).mtp_count(out.extra.get("hf_config") or {})
    if held < out.mtp_spec.layers:
        asked = out.mtp_spec.layers
        raise ConfigError(f"mt3d.model.mtp: {src} holds {held} multi-token-prediction layers, "
                          f"model.mtp.layers asks {asked}; lower it or drop model.mtp")  # fmt: skip
    return out


def resolve_model(section: dict) -> ModelConfig:
    """The ModelConfig named by the model section (preset + overrides, HF dir, or dimensions)."""
    from ..presets import PRESETS, get_preset

    section = dict(section)
    try:
        if "from_hf" in section:
            from ..model.hf import config_from_hf

            src, mtp = section.pop("from_hf"), section.pop("mtp", None)
            if section:
                raise ConfigError(f"mt3d.model.from_hf takes no other keys but mtp, got {sorted(section)}")
            cfg = config_from_hf(src)
            return cfg if mtp is None else with_mtp(cfg, mtp, src)
        base = section.pop("preset", None)
        if base is not None:
            get_preset(base)  # a clear error for unknown names
            # Start from the preset's own fields, not its derived ones: an overridden hidden size
            # must re-derive ffn / head_dim / kv_heads unless those are given too.
            cfg = {"name": base, **PRESETS[base], **section}
            if "family" in section:
                return ModelConfig.from_dict(cfg)
            return _with_preset_family(cfg)
        if not section:
            raise ConfigError("mt3d.model is empty: give a preset, from_hf or dimensions")
        return ModelConfig.from_dict({"name": "custom", **section})
    except ModelConfigError as e:
        raise ConfigError(f"mt3d.model: {e}") from None
    except TypeError as e:
        raise ConfigError(f"mt3d.model: {e}") from None
