"""Per-rank random state in checkpoints: python, numpy, torch (CPU and CUDA) and the TP tracker.

Each rank writes ``rng/pp<P>_dp<D>_tp<T>.safetensors`` (with its cp and ep coordinates too when those
axes are used), named by its coordinates in the layout rather than its global rank (a different rank
order or hostfile with the same degrees maps ranks to other coordinates, and the streams belong to
the coordinates): the torch generator states as uint8
tensors and the python/numpy states as JSON in the file's metadata. Nothing here is pickled.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from ..parallel.random import RNGTracker
from ..parallel.state import ParallelState


def rng_key(state: ParallelState) -> str:
    """The name of this rank's random state: its coordinates, outermost axis first, on every axis the
    layout shows (``pp000_dp00000_tp000`` for three axes; cp and ep join when above 1)."""
    from ..parallel.axes import BY_NAME

    coord = state.coordinate()
    return "_".join(f"{ax}{coord[ax]:0{BY_NAME[ax].digits}d}" for ax in reversed(list(coord)))


def rng_path(ckpt_dir: Path, key: str) -> Path:
    """Where the random state named ``key`` lives in a checkpoint."""
    return Path(ckpt_dir) / "rng" / f"{key}.safetensors"


def save_rng(ckpt_dir: Path, key: str, tracker: RNGTracker | None) -> Path:
    """Write this rank's random state into ``ckpt_dir``."""
    from safetensors.torch import save_file

    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch.cuda"] = torch.cuda.get_rng_state()
    for name, states in (tracker.get_states() if tracker else {}).items():
        for device, state in states.items():
            tensors[f"tracker.{name}.{device}"] = state
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": json.dumps([py[0], list(py[1]), py[2]]),
        "numpy": json.dumps([np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]]),
    }
    path = rng_path(ckpt_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def load_rng(ckpt_dir: Path, key: str, tracker: RNGTracker | None) -> bool:
    """Restore the random state named ``key``; False when the checkpoint has none by that name."""
    from safetensors import safe_open

    path = rng_path(ckpt_dir, key)
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch.cpu"])
    if "torch.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch.cuda"])
    version, state, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    if tracker is not None:
        states: dict[str, dict] = {}
        for key, value in tensors.items():
            if key.startswith("tracker."):
                _, tname, device = key.split(".", 2)
                states.setdefault(tname, {})[device] = value
        if states:
            tracker.set_states(states)
    return True
