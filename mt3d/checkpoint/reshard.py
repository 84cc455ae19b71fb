"""Loading a checkpoint into a different (tp, pp, dp) layout, through DeepSpeed's universal format.

The checkpoint carries ``universal_checkpoint_info`` (``mt3d.model.sharding.universal_info``): the
patterns DeepSpeed's ``ds_to_universal`` needs to merge TP shards of every parameter, its fp32
master copy and Adam moments. The conversion runs once, on rank 0, into
``<checkpoints>/universal/<tag>/`` beside the source and is reused afterwards. The conversion
gets its own manifest (written last; sizes and sha256 of every file, plus the sha256 of the source
checkpoint's manifest): a cache that is incomplete, corrupt, or was made from a since re-saved
source is converted again, and every use verifies it like a checkpoint. DeepSpeed then loads it
with ``checkpoint.load_universal``.

DeepSpeed's converter and universal loader unpickle with ``weights_only=False``; every ``.pt`` file
they read (the source checkpoint's and the converted ones) is first opened with mt3d's allow-list
loader, so a file carrying anything but tensors and plain data is refused before DeepSpeed sees it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..ds import universal
from ..ds.safe import safe_torch_load
from .manager import on_rank0
from .manifest import (
    CheckpointError,
    check_sizes,
    describe_files,
    list_files,
    manifest_digest,
    read_manifest,
    verify_files,
    write_manifest,
)

log = logging.getLogger("mt3d")


def scan(root: Path) -> int:
    """Open every .pt file under ``root`` with the allow-list loader; returns how many."""
    files = sorted(root.rglob("*.pt"))
    for f in files:
        safe_torch_load(f)
    return len(files)


def derived_dir(plan, save_dir: str | Path, kind: str = "universal") -> Path:
    """Where a form derived from ``plan``'s checkpoint (``kind``: one of ``manager.DERIVED``, the
    universal form or the NVMe-converted copy) is kept: beside it when that directory is writable
    (every later resume of it reuses the work; rotation removes it with its source), else in this
    run's save_dir (a read-only mount)."""
    import os

    if os.access(plan.path.parent, os.W_OK):
        return plan.path.parent / kind / plan.path.name
    source = hashlib.sha1(str(plan.path.resolve()).encode()).hexdigest()[:8]
    return Path(save_dir) / "checkpoints" / kind / f"{plan.path.name}-{source}"


def _usable_cache(out: Path, source: Path, full: bool) -> bool:
    """Whether ``out`` is a complete conversion of ``source`` as it is now (``full``: sha256 too)."""
    try:
        manifest = read_manifest(out)
        check_sizes(out, manifest)
        if manifest["meta"].get("source_manifest_sha256") != manifest_digest(source):
            return False  # made from an older content of the same step (re-saved since)
        if full:
            verify_files(out, manifest, sorted(manifest["files"]))
    except CheckpointError as e:
        if out.exists():
            log.warning("universal cache %s is unusable (%s): converting again", out, e)
        return False
    return True


def folded_reshard_conflict(saved: dict, target: dict) -> str | None:
    """Why a checkpoint cannot move to ``target``'s layout because of a folded expert layout (None: it
    can). Any checkpoint converts to the universal form, folded ones too (``universal._convert_folded``),
    and loads at a folded layout whose experts are whole (expert_tensor 1: their full shape, unsliced)
    or split over all of tp (as before folding); DeepSpeed's universal loader slices by the TP group,
    so not at experts split over part of it (1 < expert_tensor < tensor)."""
    from ..parallel.axes import expert_layout

    layout = expert_layout(target)
    if not 1 < layout.etp < layout.tp:
        return None
    return (
        f"resharding into expert_tensor {layout.etp} with tensor {layout.tp} (experts split over part of "
        "the TP group) is not supported: resume at expert_tensor 1 or "
        f"{layout.tp}, then change it with `mt3d export-hf` and model.from_hf (weights kept, optimizer "
        "state restarted)"
    )


def _convert_on_rank0(plan, out: Path) -> None:
    if _usable_cache(out, plan.path, full=True):
        return
    log.info("layout changed since %s: converting it to DeepSpeed's universal format", plan.path)
    scan(plan.path)
    universal.convert(plan.path, out, layout=plan.meta["layout"])
    scan(out)
    files = describe_files(out, list_files(out))
    meta = {"universal_of": str(plan.path), "source_manifest_sha256": manifest_digest(plan.path)}
    write_manifest(out, files, meta)


def prepare(plan, layout, save_dir: str | Path, rank: int) -> tuple[Path, str]:
    """Make sure the universal form exists (rank 0 converts); (load_dir, tag) for DeepSpeed's universal
    loading (``checkpoint.load_universal``).

    Collective: a failure on rank 0 is raised on every rank (no rank is left waiting for it).
    """
    target = {**layout.shown_degrees(), "zero_stage": layout.zero_stage}
    why = folded_reshard_conflict(plan.meta["layout"], target) or universal.unsupported_reshard(
        plan.meta["layout"], target
    )
    if why:
        raise CheckpointError(f"cannot resume {plan.path} in this layout: {why}")
    out = derived_dir(plan, save_dir, "universal")
    on_rank0(
        rank, f"converting {plan.path} to DeepSpeed's universal format", lambda: _convert_on_rank0(plan, out)
    )
    # Rank 0 verified every byte (or just wrote it); the others check that they see the same files.
    if rank != 0 and not _usable_cache(out, plan.path, full=False):
        raise CheckpointError(
            f"universal checkpoint {out} is missing or incomplete on this host; put save_dir (and the "
            "source checkpoint) on a filesystem every host shares"
        )
    return out.parent, out.name


def convert_for_resume(plan, save_dir: str | Path, rank: int) -> tuple[Path, str]:
    """A copy of ``plan``'s checkpoint whose ``*_optim_states.pt`` hold what DeepSpeed kept in NVMe
    swap files (fp32 weights, Adam moments and step of every swapped sub-group), so that a run without
    NVMe optimizer offload at the same layout loads it the ordinary way. Written once by rank 0 into
    ``checkpoints/converted/<tag>`` beside the source (in this run's save_dir when the source is on a
    read-only mount); files other than the optimizer states are hard links (copies across
    filesystems). Returns (load_dir, tag). Collective: a failure is raised on every rank."""
    import os
    import shutil

    import torch
    import torch.distributed as dist

    from ..ds.nvme import INDEX, converted_optimizer_states

    src, files = plan.path, plan.manifest["files"]
    dest = derived_dir(plan, save_dir, "converted")

    def convert() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for name in files:
            if name.startswith(("offloaded_tensors/", f"{INDEX}/")) or name.endswith("_optim_states.pt"):
                continue
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / name, dest / name)
            except OSError:  # another filesystem
                shutil.copy2(src / name, dest / name)
        for name in sorted(n for n in files if n.endswith("_optim_states.pt")):
            torch.save(converted_optimizer_states(src, name, files, plan.step), dest / name)

    on_rank0(rank, f"converting the NVMe optimizer states of {src}", convert)
    dist.barrier()
    return dest.parent, dest.name
