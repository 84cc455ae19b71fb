"""mt3d: Megatron-style tensor slicing inside DeepSpeed's pipeline engine and ZeRO."""

import os as _os

__version__ = "0.1.0"

if "DS_ACCELERATOR" not in _os.environ:
    # DeepSpeed logs a warning on every import when it has to guess the accelerator; tell it
    # what it would find anyway (cuda when a GPU is visible, otherwise cpu with gloo).
    import torch as _torch

    _os.environ["DS_ACCELERATOR"] = "cuda" if _torch.cuda.is_available() else "cpu"
