"""Saving checkpoints that are never half-visible, and finding the newest complete one.

Layout: ``<save_dir>/checkpoints/step_XXXXXXXX/`` (DeepSpeed's files + ``manifest.json``) and
``<save_dir>/checkpoints/latest`` (the newest complete tag, replaced atomically). Each save goes to
``step_XXXXXXXX.tmp``; after every rank has fsynced and hashed its share of the files, rank 0
writes the manifest, renames the directory into place, then updates ``latest``. DeepSpeed's own
``latest`` file is not used: it is written before the other ranks finish (DEEPSPEED_NOTES.md).

A run resumed from an older checkpoint starts a new history: when it saves step S, complete
checkpoints of steps >= S from the abandoned history are moved (never deleted) to
``checkpoints/superseded/``, so ``resume: auto`` can never jump back onto the abandoned branch.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from ..ds.nvme import write_swap_index
from .manifest import (
    CheckpointError,
    check_sizes,
    describe_files,
    fsync_dir,
    list_files,
    read_manifest,
    write_manifest,
)
from .rng import save_rng

log = logging.getLogger("mt3d")

TAG_RE = re.compile(r"^step_(\d{8})$")
LATEST = "latest"
SUPERSEDED = "superseded"
TOKENIZER = "tokenizer"  # the run's tokenizer files inside each checkpoint
DERIVED = ("universal", "converted")
"""Folders beside the checkpoints that hold forms derived from one (``checkpoint.reshard.derived_dir``):
removed with their source when it is rotated away or superseded."""


def has_frozen(module) -> bool:
    """Whether ``module`` has frozen weights (a LoRA base): checkpoints then hold only the trained ones,
    and the frozen ones are read again from where the run took them (``meta["lora"]["base"]``). Routers'
    correction biases (trained outside the gradient, ``moe.balance_experts``) are not frozen weights."""
    return any(not p.requires_grad and not getattr(p, "mt3d_balance", False) for p in module.parameters())


def tag_for(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step_{step:08d}"


def checkpoints_dir(save_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(save_dir) / "checkpoints"


_REPORTED: set[str] = set()


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints under ``root`` whose manifest exists and whose files have their sizes, oldest first.

    A directory without a manifest is a save that was interrupted (expected after a crash: silent);
    one whose manifest names a missing or truncated file is damaged and is reported, once per process.
    """
    found = []
    if not root.is_dir():
        return found
    for d in sorted(root.iterdir()):
        if not (d.is_dir() and TAG_RE.match(d.name)):
            continue
        try:
            check_sizes(d, read_manifest(d))
        except CheckpointError as e:
            if (d / "manifest.json").is_file() and str(d) not in _REPORTED:
                _REPORTED.add(str(d))
                log.error("skipping damaged checkpoint %s: %s", d.name, e)
            continue
        found.append(d)
    return found


def newest_complete(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (None if there is none)."""
    found = complete_checkpoints(checkpoints_dir(save_dir))
    return found[-1] if found else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def supersede(root: Path, step: int) -> list[Path]:
    """Move checkpoints of steps >= ``step`` to ``root/superseded/<tag>-<n>``; returns their new paths."""
    moved = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        m = TAG_RE.match(d.name)
        if not (d.is_dir() and m and int(m.group(1)) >= step):
            continue
        dest_root = root / SUPERSEDED
        dest_root.mkdir(exist_ok=True)
        n = 0
        while (dest_root / f"{d.name}-{n}").exists():
            n += 1
        dest = dest_root / f"{d.name}-{n}"
        os.replace(d, dest)
        _remove_derived(root, d.name)  # made from the old content
        moved.append(dest)
    if moved:
        fsync_dir(root)
        log.warning(
            "saving step %d after resuming from an older checkpoint: moved %s to %s (delete when unneeded)",
            step,
            ", ".join(p.name for p in moved),
            root / SUPERSEDED,
        )
    return moved


def rotate(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints (never the newest); returns deleted."""
    if keep_last <= 0:
        return []
    complete = complete_checkpoints(root)
    doomed = complete[: max(0, len(complete) - keep_last)]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
        _remove_derived(root, d.name)
    return doomed


def _remove_derived(root: Path, tag: str) -> None:
    """Delete what was derived from checkpoint ``tag`` (its universal form, its NVMe-converted copy)."""
    for kind in DERIVED:
        shutil.rmtree(root / kind / tag, ignore_errors=True)


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, device) holding ``path``, from /proc/self/mounts ('?' when unknown)."""
    best = ("?", "?")
    try:
        resolved = str(path.resolve())
        for line in Path("/proc/self/mounts").read_text().splitlines():
            device, mount = line.split()[:2]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(
                best[0]
            ):
                best = (mount, device)
    except OSError:
        pass
    return best


WRITE_ERRORS = (
    "PytorchStreamWriter",
    "unexpected pos",
    "No space left",
    "Disk quota exceeded",
    "file write failed",
    "basic_ios::clear",  # torch.save's stream failing as the file is closed (the last bytes flushed)
    "iostream error",
)


def is_write_error(e: BaseException, tmp: Path) -> bool:
    """Whether ``e`` came from writing files (torch.save reports a full disk as a RuntimeError)."""
    if isinstance(e, OSError):
        return True
    return any(w in str(e) for w in WRITE_ERRORS)


def write_failure(e: BaseException, tmp: Path, rank: int) -> str:
    """One line for a save that failed while writing: a full disk is named as such (torch.save
    reports it as 'unexpected pos ...'), and the incomplete directory is removed by rank 0 (other
    ranks may still be writing into it: they report it; it is never loaded, and the next save or
    run removes it)."""
    free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else None
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
    full = full or (free is not None and free < 64 * 2**20)
    mount, device = _mount_of(tmp.parent)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    left = (
        f"removed {tmp}"
        if not tmp.exists()
        else f"{tmp} is incomplete (never loaded; the next save removes it)"
    )
    why = f"no space left on {mount} ({device})" if full else f"writing failed ({type(e).__name__}: {e})"
    return f"saving {tmp.name[:-4]} failed: {why}; the previous checkpoints are intact, {left}"


def on_rank0(rank: int, what: str, work) -> None:
    """Run ``work()`` on rank 0 and raise its failure, as a CheckpointError naming ``what``, on every
    rank (collective: no rank is left waiting for rank 0)."""
    error = ""
    if rank == 0:
        try:
            work()
        except Exception as e:  # every rank must learn of it, whatever it is
            error = str(e) if isinstance(e, CheckpointError) else f"{what} failed: {e!r}"
            log.exception("%s failed", what)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


LOCK = ".mt3d-run.lock"
REPLACED = "replaced"


def claim_save_dir(save_dir: str | Path, rank: int, overwrite: bool):
    """Rank 0 holds ``<save_dir>/.mt3d-run.lock`` for the whole run, so two runs never write one save_dir
    at once (the second is refused, on every rank); with ``overwrite`` the previous run's checkpoints
    and metrics are moved to ``replaced/<n>/`` first. Collective. Returns the open lock file (keep it)."""
    import fcntl

    root = Path(save_dir)
    held: list = []

    def claim() -> None:
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / LOCK, "a+")  # noqa: SIM115 - held open (locked) until the process ends
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            owner = f.read().strip() or "another process"
            f.close()
            raise CheckpointError(
                f"save_dir {root} is in use by another run ({owner} holds {root / LOCK}): wait for it to end "
                "or choose another save_dir"
            ) from None
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        f.flush()
        held.append(f)
        if overwrite:
            _set_aside(root)

    on_rank0(rank, f"claiming save_dir {root}", claim)
    return held[0] if held else None


def _set_aside(root: Path) -> None:
    """Move a previous run's checkpoints and metrics to ``replaced/<n>/`` (nothing is deleted)."""
    moving = [root / n for n in ("checkpoints", "metrics.jsonl", "run.json") if (root / n).exists()]
    if not moving:
        return
    n = 0
    while (root / REPLACED / str(n)).exists():
        n += 1
    dest = root / REPLACED / str(n)
    dest.mkdir(parents=True)
    for p in moving:
        os.replace(p, dest / p.name)
    log.warning("overwrite: moved the previous run's %s to %s", ", ".join(p.name for p in moving), dest)


class Checkpointer:
    """Saves the engine (plus mt3d's client state) crash-safely; every rank calls ``save``.

    ``client_state`` is a callable returning the extra state to store (step, data position, RNG).
    """

    def __init__(
        self,
        engine,
        save_dir: str | Path,
        *,
        meta,
        client_state,
        keep_last: int = 0,
        tracker=None,
        rng_key: str | None = None,
        tokenizer_dir: str | None = None,
        faults=None,
    ) -> None:
        self.engine = engine
        self.root = checkpoints_dir(save_dir)
        self.meta = meta
        self.client_state = client_state
        self.keep_last = keep_last
        self.tracker = tracker
        self.rng_key = rng_key  # default: by global rank (single-layout tools)
        self.tokenizer_dir = tokenizer_dir  # copied into every checkpoint: it travels with the weights
        self.faults = faults

    def save(self, step: int) -> Path:
        """Write checkpoint ``step``; returns its final directory."""
        rank, world = dist.get_rank(), dist.get_world_size()
        tag = tag_for(step)
        final, tmp = self.root / tag, self.root / f"{tag}.tmp"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        if self.faults:
            self.faults.before_save(step, self.root)
        dist.barrier()
        try:
            self.engine.save_checkpoint(
                str(self.root),
                tag=tmp.name,
                client_state=self.client_state(step),
                save_latest=False,
                exclude_frozen_parameters=has_frozen(self.engine.module),
            )
            save_rng(tmp, self.rng_key or f"rank_{rank:05d}", self.tracker)
            write_swap_index(self.engine, tmp)
            if rank == 0 and self.tokenizer_dir:
                from ..data.tokenizer import copy_tokenizer

                copy_tokenizer(self.tokenizer_dir, tmp / TOKENIZER)
            if self.faults:
                self.faults.in_save(step)
            dist.barrier()  # every rank's files exist
            names = list_files(tmp)
            mine = describe_files(tmp, names[rank::world])  # fsync + hash this rank's share
        except (OSError, RuntimeError) as e:
            if not is_write_error(e, tmp):
                raise  # e.g. a peer died during the save's collectives: not a disk problem
            raise CheckpointError(write_failure(e, tmp, rank)) from e
        shares: list = [None] * world
        dist.all_gather_object(shares, mine)
        if rank == 0:
            files = {k: v for share in shares for k, v in share.items()}
            write_manifest(tmp, files, {**self.meta(), "step": step, "tag": tag})
            supersede(self.root, step)  # this step (re-saved) and later ones of an abandoned history
            os.replace(tmp, final)
            fsync_dir(self.root)
            _write_atomic(self.root / LATEST, tag + "\n")
            rotate(self.root, self.keep_last)
        dist.barrier()
        return final
