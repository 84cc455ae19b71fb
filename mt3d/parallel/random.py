"""TP-aware random state and recompute-safe activation checkpointing.

Dropout outside tensor-parallel regions (on the replicated hidden state) must draw the same mask
on every TP rank: it uses the default generator, seeded identically across TP. Dropout inside a
TP region (on this rank's heads) must differ per TP rank: it runs under ``tracker.fork()``, which
swaps in a generator seeded with ``seed + 2718 + tp_rank`` (Megatron's offset). ``checkpoint``
records both the default and the tracker states at forward time and replays them during the
recompute, so the recomputed dropout masks equal the original ones.
"""

from __future__ import annotations

import contextlib
import random as _py_random

import numpy as np
import torch

from .mappings import SEQ_DIM, _gather, _split
from .state import AxisGroup

TP_SEED_OFFSET = 2718


def _device_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_device_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and current CUDA device) with one seed."""
    _py_random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RNGTracker:
    """Named random states swapped in by ``fork``; the TP-region state differs per TP rank."""

    def __init__(self) -> None:
        self.states: dict[str, dict] = {}

    @classmethod
    def for_tp(cls, seed: int, tp: AxisGroup) -> RNGTracker:
        """A tracker with the model-parallel state for this TP rank."""
        t = cls()
        t.add("model-parallel", seed + TP_SEED_OFFSET + tp.rank)
        return t

    def add(self, name: str, seed: int) -> None:
        """Register a state seeded with ``seed`` (on CPU and the current CUDA device)."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        outer = _device_states()
        torch.manual_seed(seed)
        self.states[name] = _device_states()
        _set_device_states(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        """Run the block with the named state; save its advance; restore the default state after."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added")
        outer = _device_states()
        _set_device_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_states()
            _set_device_states(outer)

    def get_states(self) -> dict:
        """Copy of all tracked states (for checkpoints)."""
        return {k: {d: s.clone() for d, s in v.items()} for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        """Replace all tracked states."""
        self.states = {k: {d: s.clone() for d, s in v.items()} for k, v in states.items()}


_RECOMPUTING = [0]
"""How many ``_Checkpoint`` recomputes are running (nested recompute counts each)."""


def recomputing() -> bool:
    """Whether the caller runs inside a checkpoint's recompute (a forward already counted once)."""
    return _RECOMPUTING[0] > 0


class _Checkpoint(torch.autograd.Function):
    """Run ``fn`` without keeping activations; recompute it in backward with the same RNG."""

    @staticmethod
    def forward(ctx, fn, tracker, tp, partition, rng, x, *rest):
        ctx.fn, ctx.tracker, ctx.tp, ctx.partition = fn, tracker, tp, partition
        ctx.rng = (_device_states(), tracker.get_states() if tracker is not None else None) if rng else None
        with torch.no_grad():
            out = fn(x, *rest)
        saved_x = x.detach()
        if partition:
            saved_x = _split(saved_x, tp, SEQ_DIM)  # keep 1/tp of the input; all-gathered at recompute
        ctx.x_requires_grad = x.requires_grad
        ctx.rest_requires_grad = [torch.is_tensor(r) and r.requires_grad for r in rest]
        ctx.save_for_backward(saved_x, *[r.detach() if torch.is_tensor(r) else r for r in rest])
        return out

    @staticmethod
    def backward(ctx, *grads):
        saved_x, *rest = ctx.saved_tensors
        x = _gather(saved_x, ctx.tp, SEQ_DIM) if ctx.partition else saved_x
        x = x.detach().requires_grad_(ctx.x_requires_grad)
        # non-tensor arguments (a None document map, absent rotary tables) come back as None
        rest = [
            r.detach().requires_grad_(g) if torch.is_tensor(r) else r
            for r, g in zip(rest, ctx.rest_requires_grad)
        ]
        _RECOMPUTING[0] += 1
        try:
            if ctx.rng is None:
                with torch.enable_grad():
                    out = ctx.fn(x, *rest)
            else:
                out = _recompute_with_rng(ctx, x, rest)
        finally:
            _RECOMPUTING[0] -= 1
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        rest_grads = [r.grad if g else None for r, g in zip(rest, ctx.rest_requires_grad)]
        return (None, None, None, None, None, x.grad if ctx.x_requires_grad else None, *rest_grads)


def _recompute_with_rng(ctx, x, rest):
    """``ctx.fn(x, *rest)`` again under the RNG states of the forward (then back to today's)."""
    now = (_device_states(), ctx.tracker.get_states() if ctx.tracker is not None else None)
    _set_device_states(ctx.rng[0])
    if ctx.tracker is not None:
        ctx.tracker.set_states(ctx.rng[1])
    try:
        with torch.enable_grad():
            return ctx.fn(x, *rest)
    finally:
        _set_device_states(now[0])
        if ctx.tracker is not None:
            ctx.tracker.set_states(now[1])


def checkpoint(
    fn,
    x: torch.Tensor,
    *rest,
    tracker: RNGTracker | None = None,
    tp: AxisGroup | None = None,
    partition: bool = False,
    rng: bool = True,
):
    """Activation checkpointing of ``fn(x, *rest)``, recompute-safe for dropout under ``tracker``.

    ``rng`` False: ``fn`` draws no random numbers, so the RNG states are neither saved nor restored
    (reading them stops ``torch.compile``'s trace: seven graph breaks per block otherwise).

    With ``partition`` (and a TP group of size > 1 and a sequence divisible by it) only this
    rank's sequence slice of ``x`` is kept between forward and backward, and it is all-gathered
    over TP for the recompute (Megatron's distributed saved activations). Parameters used inside
    ``fn`` receive their gradients through the recompute.
    """
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fn(x, *rest)  # nothing to save for backward (eval, or a graph that starts here)
    partition = bool(partition and tp is not None and tp.size > 1 and x.shape[SEQ_DIM] % tp.size == 0)
    if not rng and not partition and torch.compiler.is_compiling():
        # inside a compiled block: torch's own checkpoint, which the compiler traces (its recompute is
        # planned into the backward graph); _Checkpoint's backward calls autograd, which it cannot
        return torch.utils.checkpoint.checkpoint(fn, x, *rest, use_reentrant=False, preserve_rng_state=False)
    return _Checkpoint.apply(fn, tracker, tp, partition, rng, x, *rest)
