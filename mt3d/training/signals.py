"""Preemption: SIGTERM/SIGINT ask every rank to checkpoint at the next step boundary and exit.

A signal may reach only some ranks (or reach them at different steps), so after each step the
ranks agree with one tiny all-reduce: if any rank was signalled, all of them stop after the same
step. A second SIGINT interrupts immediately.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class Preemption:
    """Records SIGTERM/SIGINT; ``agreed`` is True on every rank once any rank got one."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def install(self) -> Preemption:
        """Install the handlers (main thread only)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts for real
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, device) -> bool:
        """Collective: whether any rank has been asked to stop."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
