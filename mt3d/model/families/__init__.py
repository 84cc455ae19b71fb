"""Model families as plug-ins: every module in this package registers one ``Family``.

Adding a family means adding its module here (and a preset and a test); the registry finds it by
importing every module of the package. Everything outside the package asks the registry:
``get_family(cfg.family)``, ``family_for_hf(config_dict)``, ``infer_family(cfg)``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from ..options import ModelConfigError
from .base import _REGISTRY, Family, HFError, Piece, register

if TYPE_CHECKING:
    from ..config import ModelConfig

_LOADED = False


def _load() -> dict[str, Family]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in pkgutil.iter_modules(__path__):
            if mod.name != "base":
                importlib.import_module(f"{__name__}.{mod.name}")
    return _REGISTRY


def families() -> list[Family]:
    """Every registered family, in the order ``infer_family`` tries them."""
    return sorted(_load().values(), key=lambda f: (f.infer_rank, f.name))


def get_family(name: str) -> Family:
    """The family registered as ``name``."""
    registry = _load()
    if name not in registry:
        raise ModelConfigError(f"unknown model family {name!r} (known: {', '.join(sorted(registry))})")
    return registry[name]


def family_for_hf(hf: dict, where: str) -> Family:
    """The family reading an HF config (``Family.reads``: by ``model_type``); unsupported architectures
    are refused."""
    kind = hf.get("model_type")
    for fam in families():
        if fam.reads(hf):
            return fam
    arch = ", ".join(hf.get("architectures") or []) or kind
    names = ", ".join(f"{f.architecture} ({f.model_types[0]})" for f in families() if f.model_types)
    raise HFError(f"{where}: unsupported architecture {arch!r}; supported: {names}")


def infer_family(cfg: ModelConfig) -> str:
    """The first family (by ``infer_rank``) able to express ``cfg``; 'custom' when none can."""
    for fam in families():
        try:
            fam.check(cfg)
        except ModelConfigError:
            continue
        return fam.name
    return "custom"


__all__ = [
    "Family",
    "HFError",
    "Piece",
    "families",
    "family_for_hf",
    "get_family",
    "infer_family",
    "register",
]
