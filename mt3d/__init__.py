"""mt3d: Megatron-style tensor slicing inside DeepSpeed's pipeline engine and ZeRO."""

import os as _os

__version__ = "0.1.0"

if "DS_ACCELERATOR" not in _os.environ:
    # DeepSpeed logs a warning on every import when it has to guess the accelerator; tell it what
    # it would find. Decided without importing torch, so light commands (preprocess, topo) stay light.
    _hidden = _os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    _gpu = _os.path.exists("/dev/nvidiactl") or _os.path.exists("/dev/dxg")
    _os.environ["DS_ACCELERATOR"] = "cuda" if _gpu and not _hidden else "cpu"
