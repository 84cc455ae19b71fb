"""The ``ep`` rows of ``python -m mt3d.bench overlap``: how much of a MoE layer's expert all-to-all
hides behind its routed experts when the layer's tokens go in chunks (``train.overlap.dispatch_chunks``).

One sparse MLP (no shared expert, so nothing else overlaps) at ep 2, forward and backward, for each
chunk count n: once pipelined (chunk c + 1's rows posted before chunk c's experts run, the combines
waited for at the end; the backward mirrors it) and once serial (``SparseMoE.pipelined`` False: the
same chunks, transfers and GEMMs, each transfer waited for as soon as it is posted). The time this rank
spends blocked in the layer's all-to-alls (the counts exchange included) is measured by wrapping
``torch.distributed.all_to_all_single`` around the runs: W_s serial, W_o pipelined. Hidden = (W_s -
W_o) / W_s, and from the step times (T_s - T_o) / W_s; beside the planner's prediction
(``planner.timing.dispatch_hidden``): min(W_s (1 - 1/n), E) / W_s with E = T_s - W_s, the layer's
compute measured in the serial run. n = 1 is the baseline (nothing to overlap with)."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

EP_SHAPE = dict(hidden=512, experts=8, top_k=2, expert_ffn=128, tokens=2048)
"""The layer of the ep rows: a wide hidden size and narrow experts, so that on a CPU the all-to-all
takes a share of the layer's time comparable to the experts' GEMMs, as on a GPU cluster."""


class _Blocked:
    """Seconds this process spends blocked in ``all_to_all_single``: the whole call when synchronous,
    the work's ``wait`` when posted (patched for the ``with`` block only)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed as dist

        plain = dist.all_to_all_single

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            work = plain(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return None if work is None else _TimedWork(work, self)

        dist.all_to_all_single = timed
        try:
            yield self
        finally:
            dist.all_to_all_single = plain


class _TimedWork:
    """A posted collective whose ``wait`` adds its blocked seconds to a ``_Blocked``."""

    def __init__(self, work, blocked: _Blocked) -> None:
        self.work, self.blocked = work, blocked

    def wait(self, *args):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args)
        finally:
            self.blocked.seconds += time.perf_counter() - t0


def ep_worker(shape: dict, chunk_counts: tuple, reps: int) -> list[dict]:
    """Per chunk count: median step (forward + backward) and blocked seconds, pipelined and serial."""
    import torch.distributed as dist

    from ..model.blocks import BuildContext
    from ..model.config import ModelConfig
    from ..model.moe import SparseMoE
    from ..parallel.state import AxisGroup

    h, rank, world = shape["hidden"], dist.get_rank(), dist.get_world_size()
    moe = dict(experts=shape["experts"], top_k=shape["top_k"], expert_ffn=shape["expert_ffn"])
    cfg = ModelConfig.from_dict(dict(hidden=h, layers=1, heads=4, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False, moe=moe))  # fmt: skip
    group = AxisGroup("ep", tuple(range(world)), rank, dist.new_group(list(range(world))))
    layer = SparseMoE(cfg, BuildContext(tp=AxisGroup.alone("tp"), ep=group, seed=3), 0)
    x = torch.randn(1, shape["tokens"], h, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    blocked = _Blocked()

    def step() -> tuple[float, float]:
        before, t0 = blocked.seconds, time.perf_counter()
        with blocked.counting():
            y, _ = layer(x)
            y.sum().backward()
        return time.perf_counter() - t0, blocked.seconds - before

    rows = []
    for n in chunk_counts:
        layer.chunks = n
        got = {True: [], False: []}
        for i in range(2 * reps + 2):  # alternate, the first of each a warm-up
            layer.pipelined = bool(i % 2)
            dist.barrier()
            got[layer.pipelined].append(step())
        med = {p: [statistics.median(v[1:]) for v in zip(*runs)] for p, runs in got.items()}
        rows.append({"chunks": n, "step": med[True][0], "blocked": med[True][1],
                     "serial_step": med[False][0], "serial_blocked": med[False][1]})  # fmt: skip
    return rows


def ep_rows(chunk_counts: tuple, reps: int, shape: dict | None = None) -> list[dict]:
    """One row per chunk count (rank 0's figures), with the hidden shares and the prediction."""
    from ..parallel.spawn import spawn

    shape = shape or EP_SHAPE
    rows = []
    for r in spawn(ep_worker, 2, shape, tuple(chunk_counts), reps, timeout=900)[0]:
        n, comm = r["chunks"], r["serial_blocked"]
        compute = r["serial_step"] - comm
        rows.append({"chunks": n, "tokens": shape["tokens"], "comm_ms": comm * 1e3,
                     "compute_ms": compute * 1e3, "serial_ms": r["serial_step"] * 1e3,
                     "overlapped_ms": r["step"] * 1e3, "blocked_ms": r["blocked"] * 1e3,
                     "hidden": (comm - r["blocked"]) / comm,
                     "hidden_by_step": (r["serial_step"] - r["step"]) / comm,
                     "predicted": min(comm * (1 - 1 / n), compute) / comm})  # fmt: skip
    return rows


EP_COLUMNS = ["chunks", "comm_ms", "compute_ms", "serial_ms", "overlapped_ms", "blocked_ms", "hidden",
              "hidden_by_step", "predicted"]  # fmt: skip
