"""Record every torch.distributed collective a block of code issues (for tests and benchmarks).

``CollectiveLog`` wraps the torch.distributed entry points for the duration of a ``with`` block
and records, per call, the operation, element count, bytes and group ranks. It observes mt3d's
own collectives and DeepSpeed's (which go through torch.distributed too), so counts come from
what really ran, not from what the code meant to run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

# op name -> positional index of the tensor (or tensor list) that is the collective's full buffer:
# the all-reduced tensor, the gathered output, the reduce-scattered input. A ring moves
# (n-1)/n of that buffer per rank for all-gather / reduce-scatter and 2(n-1)/n for all-reduce.
_OPS = {
    "all_reduce": 0,
    "broadcast": 0,
    "reduce": 0,
    "all_gather_single": 0,
    "all_gather_into_tensor": 0,
    "reduce_scatter_single": 1,
    "reduce_scatter_tensor": 1,
    "all_gather": 0,
    "reduce_scatter": 1,
    "send": 0,
    "recv": 0,
    "isend": 0,
    "irecv": 0,
    "all_to_all_single": 1,
    "barrier": None,
    "batch_isend_irecv": "p2p",
}
"""``batch_isend_irecv`` is recorded as one ``isend`` or ``irecv`` per ``P2POp`` in its list (its ops
hold torch's own isend/irecv, which P2POp insists on, so wrapping those does not see them)."""


@dataclass(frozen=True)
class Collective:
    """One recorded call."""

    op: str
    numel: int
    bytes: int
    ranks: tuple[int, ...]
    sends: tuple[int, ...] = ()
    """For ``all_to_all_single``: the elements sent to each member of ``ranks`` (this rank's own share
    included), from its input split sizes."""


_TENSOR_KWARGS = {
    0: ("tensor", "output_tensor", "output", "tensor_list"),
    1: ("input_tensor", "input", "input_list", "tensor"),
}


def _message(args, kwargs, index):
    if index is None:
        return 0, 0
    if len(args) > index:
        t = args[index]
    else:
        t = next((kwargs[k] for k in _TENSOR_KWARGS[index] if k in kwargs), None)
    tensors = t if isinstance(t, list) else [t]
    tensors = [x for x in tensors if torch.is_tensor(x)]
    return sum(x.numel() for x in tensors), sum(x.numel() * x.element_size() for x in tensors)


def _a2a_sends(args, kwargs, members: int) -> tuple[int, ...]:
    """Elements an ``all_to_all_single(output, input, output_split_sizes, input_split_sizes)`` sends to
    each member: its input's rows split as given (evenly without sizes)."""
    t = args[1] if len(args) > 1 else kwargs.get("input")
    splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
    if not torch.is_tensor(t) or t.dim() == 0:
        return ()
    row = t[0].numel() if t.shape[0] else 0
    splits = list(splits) if splits else [t.shape[0] // members] * members
    return tuple(int(n) * row for n in splits)


class CollectiveLog:
    """Context manager: ``with CollectiveLog() as log: ...`` then inspect ``log.calls``."""

    def __init__(self) -> None:
        self.calls: list[Collective] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveLog:
        for name, index in _OPS.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig
            setattr(dist, name, self._wrap(name, index, orig))
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        self._saved.clear()

    def _wrap(self, name, index, orig):
        if index == "p2p":
            return self._wrap_batch(orig)

        @functools.wraps(orig)
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = (
                tuple(dist.get_process_group_ranks(group))
                if group is not None
                else tuple(range(dist.get_world_size()))
            )
            numel, nbytes = _message(args, kwargs, index)
            sends = _a2a_sends(args, kwargs, len(ranks)) if name == "all_to_all_single" else ()
            self.calls.append(Collective(name, numel, nbytes, ranks, sends))
            return orig(*args, **kwargs)

        return recorded

    def _wrap_batch(self, orig):
        from torch.distributed import distributed_c10d as c10d

        @functools.wraps(orig)
        def recorded(ops, *args, **kwargs):
            for op in ops:
                name = "isend" if op.op is c10d.isend else "irecv"
                ranks = tuple(dist.get_process_group_ranks(op.group))
                self.calls.append(
                    Collective(name, op.tensor.numel(), op.tensor.numel() * op.tensor.element_size(), ranks)
                )
            return orig(ops, *args, **kwargs)

        return recorded

    def select(self, op: str | None = None, ranks: tuple[int, ...] | None = None) -> list[Collective]:
        """Calls matching an op name (exact) and/or a group."""
        return [
            c for c in self.calls if (op is None or c.op == op) and (ranks is None or c.ranks == tuple(ranks))
        ]
