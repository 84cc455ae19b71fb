"""mt3d: Megatron-style tensor slicing inside DeepSpeed's pipeline engine and ZeRO."""

import os as _os

from .interpreter import mend_reentrant_imports as _mend
from .versions import __version__  # noqa: F401

_mend()  # an import inside another import's lock wait must not break it (Python < 3.12)

if "DS_ACCELERATOR" not in _os.environ:
    # DeepSpeed logs a warning on every import when it has to guess the accelerator; tell it what
    # it would find. Decided without importing torch, so light commands (preprocess, topo) stay light.
    _hidden = _os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    _gpu = _os.path.exists("/dev/nvidiactl") or _os.path.exists("/dev/dxg")
    _os.environ["DS_ACCELERATOR"] = "cuda" if _gpu and not _hidden else "cpu"


def from_pretrained(path, **kwargs):
    """Load an HF directory or mt3d checkpoint for the calling rank (see ``mt3d.checkpoint.loading``).

    ``mt3d.from_pretrained("hf/llama", tp=2, pp=2)`` under a launcher with 4 ranks returns this
    rank's TP shard of its pipeline stage; with no launcher, ``tp = pp = 1``, the whole model.
    """
    from .checkpoint.loading import from_pretrained as _from_pretrained

    return _from_pretrained(path, **kwargs)
