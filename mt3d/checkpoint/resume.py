"""Choosing, verifying and restoring the checkpoint a run resumes from.

``plan_resume`` (before ``deepspeed.initialize``) picks the checkpoint (``resume: auto`` = the
newest complete one in save_dir, never one without a valid manifest) and decides whether the
layout changed. ``verify_everywhere`` checks every file's sha256 against the manifest, each rank
hashing a share, before any tensor is used. ``restore`` loads the engine state (model, optimizer,
scheduler, loss scaler, counters) and this rank's random state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..config import Layout
from ..model.config import ModelConfig
from .manager import checkpoints_dir, complete_checkpoints, newest_complete
from .manifest import CheckpointError, check_sizes, read_manifest, verify_files
from .rng import load_rng

log = logging.getLogger("mt3d")

ARCH_KEYS = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn",
    "head_dim",
    "position",
    "norm",
    "mlp",
    "bias",
    "tie_embeddings",
)


@dataclass
class ResumePlan:
    """The checkpoint to resume from and how."""

    path: Path
    meta: dict
    manifest: dict

    @property
    def step(self) -> int:
        """The step the checkpoint was written after."""
        return int(self.meta["step"])

    def layout_changed(self, layout: Layout) -> bool:
        """Whether the saved (tp, pp, dp, zero stage) differ from ``layout``."""
        saved = self.meta["layout"]
        now = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero_stage": layout.zero_stage}
        return any(saved[k] != now[k] for k in now)


def find_checkpoint(resume: str, save_dir: str | Path) -> Path | None:
    """The checkpoint named by a ``train.resume`` value (None: start from scratch)."""
    if resume == "none":
        return None
    if resume == "auto":
        found = newest_complete(save_dir)
        if found is None:
            root = checkpoints_dir(save_dir)
            bad = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
            if bad:
                log.warning(
                    "resume auto: no complete checkpoint in %s (incomplete: %s); starting fresh", root, bad
                )
        return found
    p = Path(resume)
    if (p / "manifest.json").is_file() or p.name.startswith("step_"):
        check_sizes(p, read_manifest(p))
        return p
    found = complete_checkpoints(checkpoints_dir(p))
    if not found:
        raise CheckpointError(f"resume: no complete checkpoint in {p}")
    return found[-1]


def plan_resume(resume: str, save_dir: str | Path, model: ModelConfig) -> ResumePlan | None:
    """Pick the checkpoint to resume from and check it is for this model."""
    path = find_checkpoint(resume, save_dir)
    if path is None:
        return None
    manifest = read_manifest(path)
    meta = manifest["meta"]
    saved = meta["model"]
    now = model.to_dict()
    diff = [k for k in ARCH_KEYS if saved.get(k) != now.get(k)]
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)} vs config {now.get(k)}" for k in diff)
        raise CheckpointError(f"{path} is for a different model ({detail})")
    return ResumePlan(path, meta, manifest)


def verify_everywhere(plan: ResumePlan) -> None:
    """sha256 of every file against the manifest (each rank a share); raises on every rank alike."""
    names = sorted(plan.manifest["files"])
    rank, world = dist.get_rank(), dist.get_world_size()
    error = ""
    try:
        verify_files(plan.path, plan.manifest, names[rank::world])
    except CheckpointError as e:
        error = str(e)
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def restore(engine, plan: ResumePlan, load_dir: Path, tag: str, tracker) -> dict:
    """Load engine state from ``load_dir/tag`` and this rank's RNG; returns DeepSpeed's client state."""
    path, client = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {load_dir / tag}")
    if not load_rng(plan.path, dist.get_rank(), tracker):
        log.info(
            "no saved random state for rank %d (layout changed?): keeping the seeded one", dist.get_rank()
        )
    return client or {}
