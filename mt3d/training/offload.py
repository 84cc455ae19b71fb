"""Start-up checks of ZeRO-Offload / ZeRO-Infinity's surroundings, before any process group.

The rules of which offload runs with which ZeRO stage are ``config.rules.offload_conflict``; what is
checked here is the machine: an NVMe directory that exists (or can be made), takes writes with
O_DIRECT (DeepSpeed's aio opens its swap files that way; tmpfs refuses) and has room for the
predicted swap files of every rank of this node (``planner.offload.tier_bytes``), and libaio for
DeepSpeed's ``async_io`` op. Without these DeepSpeed fails deep inside ``deepspeed.initialize``
(after JIT-building other ops for minutes) with "Unable to JIT load the async_io op ... None".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import ConfigError, Layout, Offload, writable_dir
from ..inputs import env_int
from ..model.config import ModelConfig
from ..planner.report import human_bytes

LIBAIO_HELP = (
    "NVMe offload needs libaio for DeepSpeed's async_io op: apt-get install libaio-dev "
    "(dnf install libaio-devel), or point CFLAGS/LDFLAGS at a libaio built from source"
)


def nvme_bytes_per_rank(off: Offload, layout: Layout, model: ModelConfig, vocab: int) -> dict[str, float]:
    """Predicted swap-file bytes of one rank on NVMe, for parameters and for the optimizer
    (planner's ZeRO-Infinity accounting)."""
    from ..planner.costs import Precision, stage_params
    from ..planner.offload import tier_bytes

    params = stage_params(model, model.vocab_size or vocab, layout.tp, layout.pp)
    prec = Precision.of(layout.precision, layout.zero_stage)
    total = tier_bytes(params, layout.dp, layout.zero_stage, prec, layout.offload)["nvme"]
    param = prec.param * params / layout.dp if off.param == "nvme" else 0.0
    return {"param": param, "optimizer": total - param}


def _o_direct_probe(directory: Path) -> str | None:
    """None if a file in ``directory`` can be opened with O_DIRECT, else the OS's reason."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    probe = directory / f".mt3d-odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | flag, 0o600)
        os.close(fd)
        return None
    except OSError as e:
        return e.strerror or str(e)
    finally:
        probe.unlink(missing_ok=True)


def libaio_available() -> bool:
    """Whether DeepSpeed's async_io op can be built here (it compiles a probe against -laio)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def check_offload(
    off: Offload, layout: Layout, model: ModelConfig, vocab: int, local_ranks: int | None = None
) -> None:
    """Refuse an NVMe offload this machine cannot run (ConfigError: one line naming the fix); ``vocab``
    counts when the model leaves its vocabulary to the data."""
    need = nvme_bytes_per_rank(off, layout, model, vocab)
    per_path: dict[str, float] = {}
    for key in ("param", "optimizer"):
        if getattr(off, key) == "nvme":
            path = str(getattr(off, f"{key}_path"))
            per_path[path] = per_path.get(path, 0.0) + need[key]
    if not per_path:
        return
    # ranks of this node: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE
    ranks = local_ranks or env_int("LOCAL_WORLD_SIZE", None) or env_int("LOCAL_SIZE", None) or layout.world
    for path, per_rank in sorted(per_path.items()):
        writable_dir(path, "zero_optimization nvme_path")
        existing = Path(path)
        while not existing.exists():
            existing = existing.parent
        why = _o_direct_probe(existing)
        if why:
            raise ConfigError(
                f"nvme_path {path} does not take O_DIRECT writes ({why}), which DeepSpeed's aio needs: put it"
                " on a local disk (ext4/xfs), not tmpfs or a network filesystem"
            )
        free = shutil.disk_usage(existing).free
        total = per_rank * ranks
        if free < total:
            raise ConfigError(
                f"nvme_path {path} has {human_bytes(free)} free; the swap files of {ranks} ranks need "
                f"about {human_bytes(total)}: free space, or use a larger disk"
            )
    if not libaio_available():
        raise ConfigError(LIBAIO_HELP)
