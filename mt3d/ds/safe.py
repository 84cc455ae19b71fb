"""Unpickling checkpoints safely: ``weights_only=True`` plus an explicit allow-list.

Every ``.pt`` file mt3d reads, its own and DeepSpeed's, goes through ``safe_torch_load``: tensors,
containers and primitive values load; a small list of DeepSpeed classes that its optimizer states
contain (loss scalers) are allowed by name; anything else, in particular a payload that would run
code on load, is refused with the file named.

DeepSpeed's own checkpoint engine loads with ``weights_only=False`` (DEEPSPEED_NOTES.md);
``mt3d.ds.engine.SafeCheckpointEngine`` replaces it on the engines mt3d builds, and
``only_safe_loads`` routes every other ``torch.load`` (the universal-checkpoint loaders and
converter) through the same check.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path

import torch

from ..errors import CheckpointError
from .pickles import allowed_globals

_REAL_LOAD = torch.load  # before only_safe_loads can replace it


def safe_torch_load(path: str | Path, map_location="cpu", mmap: bool = False):
    """``torch.load`` restricted to tensors, containers and the allow-list; ``mmap``: map the tensors'
    storage instead of reading it (shapes and names cost only the file's index)."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return _REAL_LOAD(path, map_location=map_location, weights_only=True, mmap=mmap)
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

    DeepSpeed reads universal checkpoints (``load_hp_checkpoint_state``, the optimizer's
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
