"""A backward split in two for zero-bubble schedules (Qi et al. 2024): B, the input gradient, now; W,
the weight gradients of the linears, later.

``split_backward(True)`` (a process-wide switch, set by the engine of a zero-bubble schedule) routes
every linear through mt3d's own autograd functions (``parallel.layers``; the plain ``F.linear`` path
has no W of its own to hold back). A backward run inside ``deferring(queue)`` is then B: each linear
returns its input gradient and puts its weight-gradient GEMM, with what it reads (the output's
gradient and the input rows it kept), in ``queue``; ``queue.run()`` is W: it computes them and hands
them to autograd on the weights themselves (``torch.autograd.backward(weights, grads)``), so they
accumulate through the same ``AccumulateGrad`` nodes and every hook DeepSpeed or mt3d registered on
a weight fires as in a plain backward. Biases, norms, embeddings and adapters keep their gradients
in B (small GEMVs or elementwise work; the paper defers only the linears' GEMMs). Outside
``deferring`` the same functions compute both at once, as without the switch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_split = False
_queue: WeightGrads | None = None


def deferring_function(fn: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Declare an autograd function whose backward may leave its weight gradient to W (``weight_grad``):
    call it through ``deferrable``."""
    fn.outside_trace = torch._dynamo.disable(fn.apply)
    return fn


def deferrable(fn: type[torch.autograd.Function]) -> Callable:
    """How to call ``fn`` (a ``deferring_function``): under a split backward outside torch.compile's
    trace (a graph break around it; the code between such calls still compiles), because a compiled
    backward is traced ahead of time, with no B running, so its weight gradients would be computed in
    B and never reach W (tests/test_zero_bubble.py); without the split ``fn.apply`` (blocks trace
    whole)."""
    return fn.outside_trace if _split else fn.apply


def split_backward(on: bool) -> None:
    """Route linears through functions whose weight gradient can be deferred (from the next forward)."""
    global _split
    _split = bool(on)


def is_split() -> bool:
    """Whether linears run the deferrable functions (``split_backward``)."""
    return _split


class WeightGrads:
    """The weight gradients B left for W, in the order B reached them."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        self.held: set[int] = set()
        """ids of the weights with a gradient queued here (``waits_for_w``)."""

    def __len__(self) -> int:
        return len(self.items)

    def run(self) -> None:
        """W: compute every queued weight gradient and accumulate it into its weight through autograd."""
        items, self.items = self.items, []
        self.held = set()
        weights, grads = [], []
        with torch.no_grad():  # as inside the backward that queued them
            for weight, compute in items:
                weights.append(weight)
                grads.append(compute())
        if weights:
            torch.autograd.backward(weights, grads)


@contextmanager
def deferring(queue: WeightGrads) -> Iterator[WeightGrads]:
    """Run a backward as B: the linears' weight gradients go to ``queue`` (``WeightGrads.run``: W)."""
    global _queue
    saved, _queue = _queue, queue
    try:
        yield queue
    finally:
        _queue = saved


def is_deferring() -> bool:
    """Whether a backward running now is B (inside ``deferring``)."""
    return _queue is not None


def weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """``compute()`` now, or queued for W inside ``deferring`` (then None: autograd accumulates nothing
    into ``weight`` in B)."""
    if _queue is None:
        return compute()
    _queue.items.append((weight, compute))
    _queue.held.add(id(weight))
    return None


def waits_for_w(weight: torch.Tensor) -> bool:
    """Whether the B running now left (part of) ``weight``'s gradient to W: autograd still runs its
    accumulation (and the hooks after it) in B, with nothing or only the rest to add."""
    return _queue is not None and id(weight) in _queue.held
