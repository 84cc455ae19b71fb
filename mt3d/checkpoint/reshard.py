"""Loading a checkpoint into a different (tp, pp, dp) layout through DeepSpeed's universal format."""

from __future__ import annotations

from pathlib import Path

from .manifest import CheckpointError


def prepare(plan, run, rank: int) -> tuple[Path, str]:
    """Convert (once, cached) and point DeepSpeed at the universal checkpoint; (load_dir, tag)."""
    raise CheckpointError(
        f"{plan.path} was written with layout {plan.meta['layout']}; loading it into another layout is not "
        "implemented yet"
    )
