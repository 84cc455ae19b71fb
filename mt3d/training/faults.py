"""Deliberate faults for testing recovery paths, from ``MT3D_FAULTS`` (off unless set).

Syntax: comma-separated ``kind@step:rank`` (rank ``*`` for all ranks; step ``a-b`` for a range).
Steps are numbered as in metrics.jsonl (the first step is 1):

* ``nan_grad@3:1``      rank 1 poisons one gradient with NaN during step 3
* ``sigterm@4:0``       rank 0 sends itself SIGTERM after step 4 (like a scheduler preempting it)
* ``kill_in_save@6:1``  rank 1 is SIGKILLed in the middle of writing the checkpoint of step 6
* ``fill_disk@4:0``     rank 0 fills the disk under save_dir (leaving 8 KiB) as the checkpoint of step 4
  starts: the save then fails wherever the disk runs out, as when another job eats the space

The recovery code under test is the real one; only the fault is synthetic.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

KINDS = ("nan_grad", "sigterm", "kill_in_save", "fill_disk")
FILLER = ".mt3d-fault-filler"


@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    kind: str
    first: int
    last: int
    rank: int | None  # None: every rank

    def hits(self, kind: str, step: int, rank: int) -> bool:
        """Whether this fault fires for ``kind`` at ``step`` on ``rank``."""
        return self.kind == kind and self.first <= step <= self.last and self.rank in (None, rank)


def parse(spec: str | None) -> list[Fault]:
    """Faults from the ``MT3D_FAULTS`` syntax (empty for None/'')."""
    faults = []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        try:
            kind, rest = item.split("@")
            steps, rank = rest.split(":")
            first, _, last = steps.partition("-")
            if kind not in KINDS:
                raise ValueError
            faults.append(Fault(kind, int(first), int(last or first), None if rank == "*" else int(rank)))
        except ValueError:
            raise ValueError(f"MT3D_FAULTS: cannot parse {item!r} (kind@step:rank, kinds {KINDS})") from None
    return faults


class FaultInjector:
    """Applies the planned faults at the training loop's hook points."""

    def __init__(self, rank: int, spec: str | None = None) -> None:
        self.rank = rank
        self.faults = parse(spec if spec is not None else os.environ.get("MT3D_FAULTS"))
        self._handles: list = []

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _hit(self, kind: str, step: int) -> bool:
        return any(f.hits(kind, step, self.rank) for f in self.faults)

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """Arm a NaN gradient for this step when planned."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._hit("nan_grad", step):
            p = next(p for p in model.parameters() if p.requires_grad)
            self._handles.append(p.register_hook(lambda g: g * float("nan")))

    def after_step(self, step: int) -> None:
        """Deliver a planned SIGTERM to this process."""
        if self._hit("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def in_save(self, step: int) -> None:
        """Die abruptly in the middle of a checkpoint write when planned."""
        if self._hit("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def before_save(self, step: int, directory) -> None:
        """Fill the disk under ``directory`` to 8 KiB of free space when planned."""
        if not self._hit("fill_disk", step):
            return
        import shutil

        free = shutil.disk_usage(directory).free - 8192
        with open(os.path.join(directory, FILLER), "ab") as f:
            chunk = b"\0" * (1 << 20)
            while free > 0:
                try:
                    free -= f.write(chunk[: min(len(chunk), free)])
                    f.flush()
                except OSError:
                    break
