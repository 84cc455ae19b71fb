"""DeepSpeed's universal checkpoints, which mt3d reshards through: its converter run in-process,
and the reshards it gets wrong, refused up front.

``ds_to_universal``'s ``main`` is called with an argparse namespace (its command-line entry point),
in the calling process: no process group needed. tests/test_checkpoint.py runs the refused reshards
past ``unsupported_reshard`` and fails when DeepSpeed starts getting them right.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ..checkpoint.manifest import CheckpointError
from . import running_version


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


def unsupported_reshard(saved: dict, target: dict) -> str | None:
    """Why mt3d refuses to move a checkpoint from layout ``saved`` to ``target`` (None: it does not).

    Layouts are dicts with tp, pp, dp and zero_stage. Measured with the pinned DeepSpeed, every reshard
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
            f"DeepSpeed {running_version()} cannot reshard ZeRO-3 states correctly: resume it in the layout "
            f"it was saved in (zero_optimization.stage=3, tensor={saved['tp']} and dp={saved['dp']}, "
            f"pipeline=1), {way}"
        )
    return (
        f"it was saved with ZeRO-{saved['zero_stage']} and DeepSpeed {running_version()} cannot load it into "
        "ZeRO-3: "
        f"resume with zero_optimization.stage 1 or 2 (any tp/pp/dp), {way}"
    )
