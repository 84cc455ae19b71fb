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

import argparse
import hashlib
import logging
import shutil
from pathlib import Path

import torch.distributed as dist

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
from .safe import safe_torch_load

log = logging.getLogger("mt3d")


def scan(root: Path) -> int:
    """Open every .pt file under ``root`` with the allow-list loader; returns how many."""
    files = sorted(root.rglob("*.pt"))
    for f in files:
        safe_torch_load(f)
    return len(files)


def universal_dir(plan, save_dir: str | Path) -> Path:
    """Where the universal form of ``plan``'s checkpoint is cached: beside it when that directory is
    writable (every later reshard of it reuses the conversion), else in this run's save_dir."""
    import os

    beside = plan.path.parent / "universal"
    if os.access(plan.path.parent, os.W_OK):
        return beside / plan.path.name
    source = hashlib.sha1(str(plan.path.resolve()).encode()).hexdigest()[:8]
    return Path(save_dir) / "checkpoints" / "universal" / f"{plan.path.name}-{source}"


def convert(source: Path, out: Path, workers: int = 1) -> None:
    """Run DeepSpeed's ds_to_universal in-process (no process group needed)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(tmp),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    try:
        ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"converting {source} to DeepSpeed's universal format failed: {e}") from e
    (tmp.parent / "latest_universal").unlink(missing_ok=True)  # pointer the converter writes; not used
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


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


def _convert_on_rank0(plan, out: Path) -> None:
    if _usable_cache(out, plan.path, full=True):
        return
    log.info("layout changed since %s: converting it to DeepSpeed's universal format", plan.path)
    scan(plan.path)
    convert(plan.path, out)
    scan(out)
    files = describe_files(out, list_files(out))
    meta = {"universal_of": str(plan.path), "source_manifest_sha256": manifest_digest(plan.path)}
    write_manifest(out, files, meta)


def unsupported_reshard(saved: dict, target: dict) -> str | None:
    """Why mt3d refuses to move a checkpoint from layout ``saved`` to ``target`` (None: it does not).

    Layouts are dicts with tp, pp, dp and zero_stage. Measured with DeepSpeed 0.19.8, every reshard
    that involves ZeRO-3 goes wrong: a ZeRO-3 checkpoint has no module or layer files, so ZeRO 0-2
    cannot load its universal form (``assert len(self.ckpt_list) > 0``); ZeRO-3's universal loader
    looks for ZeRO-3 model files, so no ZeRO 0-2 checkpoint loads into it; it slices tensor
    parallelism only for AutoTP modules (a size mismatch at another tp); and at another dp it loads
    but training drifts from the second step on (grad norm 1.4066 instead of 1.3984 on the tiny
    model; one cause is that it copies param group 0's settings, weight decay included, into every
    group). Among ZeRO 0-2 every layout works and is tested. Refusing up front gives the way out
    instead of an assertion or a silently different run; tests/test_checkpoint.py runs the refused
    moves past this guard and fails when DeepSpeed starts getting them right.
    """
    if saved["zero_stage"] != 3 and target["zero_stage"] != 3:
        return None
    way = (
        "or export it with `mt3d export-hf` and fine-tune from that directory with model.from_hf "
        "(weights kept, optimizer state restarted)"
    )
    if saved["zero_stage"] == 3:
        return (
            f"DeepSpeed 0.19.8 cannot reshard ZeRO-3 states correctly: resume it in the layout it was saved "
            f"in (zero_optimization.stage=3, tensor={saved['tp']} and dp={saved['dp']}, pipeline=1), {way}"
        )
    return (
        f"it was saved with ZeRO-{saved['zero_stage']} and DeepSpeed 0.19.8 cannot load it into ZeRO-3: "
        f"resume with zero_optimization.stage 1 or 2 (any tp/pp/dp), {way}"
    )


def prepare(plan, run, layout, rank: int) -> tuple[Path, str]:
    """Make sure the universal form exists (rank 0 converts), enable universal loading; (load_dir, tag).

    Collective: a failure on rank 0 is raised on every rank (no rank is left waiting for it).
    """
    target = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero_stage": layout.zero_stage}
    why = unsupported_reshard(plan.meta["layout"], target)
    if why:
        raise CheckpointError(f"cannot resume {plan.path} in this layout: {why}")
    out = universal_dir(plan, run.mt3d.train.save_dir)
    error = ""
    if rank == 0:
        try:
            _convert_on_rank0(plan, out)
        except Exception as e:  # every rank must learn of it, whatever it is
            error = str(e) if isinstance(e, CheckpointError) else f"converting {plan.path} failed: {e!r}"
            log.exception("universal conversion failed")
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])
    # Rank 0 verified every byte (or just wrote it); the others check that they see the same files.
    if rank != 0 and not _usable_cache(out, plan.path, full=False):
        raise CheckpointError(
            f"universal checkpoint {out} is missing or incomplete on this host; put save_dir (and the "
            "source checkpoint) on a filesystem every host shares"
        )
    run.ds.setdefault("checkpoint", {})["load_universal"] = True
    return out.parent, out.name
