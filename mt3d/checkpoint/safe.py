"""Unpickling checkpoints safely: ``weights_only=True`` plus an explicit allow-list.

Every ``.pt`` file mt3d reads, its own and DeepSpeed's, goes through ``safe_torch_load``: tensors,
containers and primitive values load; a small list of DeepSpeed classes that its optimizer states
contain (loss scalers) are allowed by name; anything else, in particular a payload that would run
code on load, is refused with the file named.

DeepSpeed 0.19.8's own checkpoint engine loads with ``weights_only=False`` (DEEPSPEED_NOTES.md);
``SafeCheckpointEngine`` replaces it on the engines mt3d builds, and ``only_safe_loads`` routes every
other ``torch.load`` (the universal-checkpoint loaders and converter) through the same check.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path

import torch

from .manifest import CheckpointError


def allowed_globals() -> list:
    """Classes a DeepSpeed checkpoint may contain besides tensors and containers (plain data
    holders: loss-scaler settings, the ZeRO stage enum, a parameter fragment's address, the
    shape of a fused tensor's parts in universal checkpoints)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, LossScalerBase
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScalerBase, LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, SubparamShape]


_REAL_LOAD = torch.load  # before only_safe_loads can replace it


def safe_torch_load(path: str | Path, map_location="cpu"):
    """``torch.load`` restricted to tensors, containers and the allow-list."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return _REAL_LOAD(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.findall(r"GLOBAL ([\w\.]+)", str(e)) or ["an unsupported object"]
        raise CheckpointError(
            f"{path} contains a pickled object outside mt3d's allow-list ({found[0]}); refusing to load it "
            "(a tampered or foreign checkpoint: restore it from a trusted copy)"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(
            f"{path} cannot be read ({str(e).splitlines()[0]}); the file is corrupt"
        ) from None


@contextlib.contextmanager
def only_safe_loads():
    """While open, every ``torch.load`` in this process goes through ``safe_torch_load``.

    DeepSpeed 0.19.8 reads universal checkpoints (``load_hp_checkpoint_state``, the optimizer's
    ``zero/optimizer_state.pt``) and runs its converter with ``torch.load(weights_only=False)``
    outside its checkpoint engine, so ``SafeCheckpointEngine`` alone does not cover them; they all
    look ``torch.load`` up when they call it. A training run holds this for its whole length: mt3d
    never needs to unpickle anything but tensors, containers and the allow-list, whatever a
    manifest says about the file. ``weights_only``/``mmap`` arguments are ignored (always safe).
    """

    def load(f, map_location=None, *args, **kwargs):
        return safe_torch_load(f, map_location=map_location or "cpu")

    previous, torch.load = torch.load, load
    try:
        yield
    finally:
        torch.load = previous


class SafeCheckpointEngine:
    """Wraps DeepSpeed's torch checkpoint engine so every load goes through ``safe_torch_load``."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        """DeepSpeed's CheckpointEngine.load, through the allow-list."""
        return safe_torch_load(path, map_location=map_location or "cpu")


def install(engine) -> None:
    """Make a DeepSpeed engine load its checkpoints through the allow-list."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
