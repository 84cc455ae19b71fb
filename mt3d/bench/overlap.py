"""``overlap``: how much of a sequence-parallel linear's backward communication is hidden behind its GEMMs.

Under SP a column-parallel linear keeps its 1/tp input shard (``parallel/layers.py``); its backward
all-gathers that shard while it computes the input gradient, then reduce-scatters the input gradient
while it computes the weight gradient. At tp 2, for each (rows, in, out) shape, this measures the
two transfers (C = gather + scatter, each timed alone), the two GEMMs alone, the backward as mt3d
runs it (T_o) and the same four steps one after another (T_s). Hidden fraction: (T_s - T_o) / C, beside the
schedule's prediction (min(gather, dgrad) + min(scatter, wgrad)) / C. Data-parallel gradient
reductions and pipeline transfers are not overlapped in mt3d (DeepSpeed's pipeline engine runs them
as separate schedule steps): their hidden share is 0 by construction and is not measured here.
"""

from __future__ import annotations

import torch

from .common import emit, median_time, table

SHAPES = ((2048, 2048, 512), (4096, 1024, 1024))
"""(rows of the gathered sequence, in features, out features per rank) measured."""


def worker(shapes, reps: int) -> list[dict]:
    """Times of the pieces and of the backward, overlapped and in series, on this rank, per shape."""
    import torch.distributed as dist

    from ..parallel.state import ParallelState
    from ..parallel.topology import map_ranks

    tp = ParallelState.build(map_ranks(dist.get_world_size(), tp=dist.get_world_size())).tp
    return [{"rows": r, "in": i, "out": o, **_times(tp, r, i, o, reps)} for r, i, o in shapes]


def _times(tp, rows: int, fin: int, fout: int, reps: int) -> dict:
    from ..parallel.layers import ColumnParallelLinear, NormalInit
    from ..parallel.mappings import SEQ_DIM, start_gather, start_reduce_scatter

    layer = ColumnParallelLinear(fin, fout * tp.size, tp=tp, bias=False, sequence_parallel=True,
                                 init=NormalInit(0.02, 1))  # fmt: skip
    x = torch.randn(1, rows // tp.size, fin, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    w, shard = layer.weight.detach(), x.detach()
    full = start_gather(shard, tp, SEQ_DIM)()
    dx = grad.matmul(w)

    def wgrad(gathered):
        return grad.reshape(-1, grad.shape[-1]).t().matmul(gathered.reshape(-1, fin))

    def serial():  # the same four steps, each waiting for the one before
        gathered = start_gather(shard, tp, SEQ_DIM)()
        scattered = start_reduce_scatter(grad.matmul(w), tp, SEQ_DIM)()
        wgrad(gathered)
        return scattered

    return {
        "gather": median_time(lambda: start_gather(shard, tp, SEQ_DIM)(), reps),
        "scatter": median_time(lambda: start_reduce_scatter(dx, tp, SEQ_DIM)(), reps),
        "dgrad": median_time(lambda: grad.matmul(w), reps),
        "wgrad": median_time(lambda: wgrad(full), reps),
        "serial": median_time(serial, reps),
        "overlapped": median_time(lambda: y.backward(grad, retain_graph=True), reps),
    }


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench overlap``."""
    from ..parallel.spawn import spawn

    torch.set_num_threads(1)
    rows = []
    for r in spawn(worker, 2, SHAPES, args.reps, timeout=900)[0]:
        comm = r["gather"] + r["scatter"]
        hidden = (r["serial"] - r["overlapped"]) / comm
        predicted = (min(r["gather"], r["dgrad"]) + min(r["scatter"], r["wgrad"])) / comm
        rows.append({**r, "comm_ms": comm * 1e3, "gemms_ms": (r["dgrad"] + r["wgrad"]) * 1e3,
                     "serial_ms": r["serial"] * 1e3, "overlapped_ms": r["overlapped"] * 1e3,
                     "hidden": hidden, "predicted": predicted})  # fmt: skip
    print("SP column-parallel linear backward at tp 2 (rank 0): communication hidden behind the GEMMs")
    print(table(rows, ["rows", "in", "out", "comm_ms", "gemms_ms", "serial_ms", "overlapped_ms", "hidden",
                       "predicted"]))  # fmt: skip
    print("data-parallel and pipeline transfers: not overlapped in mt3d (hidden 0)")
    return emit("overlap", {"tp": 2, "rows": rows, "dp_hidden": 0.0, "pp_hidden": 0.0})
