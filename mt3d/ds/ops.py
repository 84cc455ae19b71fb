"""Workaround: a DeepSpeed op build interrupted once makes every later run hang without a word.

DeepSpeed JIT-builds its C++ ops (``cpu_adam``, ``async_io``, ``pin_memory``, the CPU accelerator's
``deepspeed_shm_comm``) through ``torch.utils.cpp_extension.load``, which guards each build
directory with a ``lock`` file (``torch.utils.file_baton.FileBaton``): created with O_EXCL, held
open for the build, removed at the end. Every process takes it on its first load, even when the
op is already built. A build killed half-way (a timeout, Ctrl-C, a preempted job) leaves the file
behind, and every later process polls for it to vanish, forever and silently (torch 2.13;
DeepSpeed's builders pass ``verbose=False``).

A lock that no live process holds open is such a leftover; ``check_op_locks`` names it and the
command that removes it before any process group exists. tests/test_offload.py checks the path
against torch's own and that torch still waits without a time limit, so this file can go when it
stops doing so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import UserError


def extensions_root() -> Path:
    """Where torch builds JIT extensions: ``$TORCH_EXTENSIONS_DIR`` as given, else
    ``<user cache>/torch_extensions/py<ver>_<cpu|cuXY|rocmXY>`` (torch's ``_get_build_directory``,
    computed without creating anything)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given is not None:
        return Path(given)
    base = get_default_build_root()
    if torch.version.hip is not None:
        acc = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        acc = "cu" + torch.version.cuda.replace(".", "")
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(base) / f"{py}_{acc}"


def ops_for(ds, on_cpu: bool) -> list[str]:
    """The DeepSpeed ops a run with this config (a ``DeepSpeedSection``) JIT-loads."""
    off = ds.offload
    ops = ["deepspeed_shm_comm"] if on_cpu else []
    if off.optimizer != "none":
        ops.append("cpu_adam")
    if ds.zero_stage == 3 and "nvme" in (off.param, off.optimizer):
        ops += ["pin_memory", "async_io"]
    return ops


def _holders(lock: Path) -> bool:
    """Whether a live process on this host has ``lock`` open (scans /proc/*/fd)."""
    target = os.path.realpath(lock)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return True
                except OSError:
                    continue
        except OSError:  # the process ended, or is not ours to read
            continue
    return False


def _unheld(locks, seen=None) -> dict[Path, int]:
    """The locks of ``locks`` that exist with no live holder, with their inode (and, when ``seen`` is
    given, the same inode as then)."""
    out = {}
    for lock in locks:
        try:
            ino = lock.stat().st_ino
        except OSError:
            continue
        if (seen is None or seen.get(lock) == ino) and not _holders(lock):
            out[lock] = ino
    return out


def stale_locks(ops: list[str], settle_s: float = 1.0) -> list[Path]:
    """Lock files of ``ops`` that no live process holds, seen twice ``settle_s`` apart (the same
    file both times): a build releasing its lock closes the file a moment before removing it, and
    every rank of a run on this host takes the lock at start-up, so one look would race them."""
    import time

    root = extensions_root()
    first = _unheld([root / op / "lock" for op in ops])
    if not first:
        return []
    time.sleep(settle_s)
    return sorted(_unheld(list(first), seen=first))


def check_op_locks(ds, on_cpu: bool) -> None:
    """Refuse to start when a DeepSpeed op's build lock is a leftover (UserError naming the fix)."""
    if not Path("/proc/self/fd").is_dir():  # no /proc: cannot tell a leftover from a live build
        return
    stale = stale_locks(ops_for(ds, on_cpu))
    if stale:
        paths = " ".join(str(p) for p in stale)
        raise UserError(
            f"stale build lock {paths} left by an interrupted DeepSpeed op build: the run would wait on it "
            f"forever; remove it (rm {paths}) and start again (the op is rebuilt on first use)"
        )
