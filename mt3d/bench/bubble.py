"""``bubble``: measured pipeline idle fraction per stage against (p-1)/(m+p-1).

DeepSpeed's pipeline engine runs each step as a list of instructions; the benchmark times every
instruction on every stage (by wrapping the engine's instruction table on the instance). Per stage,
busy = forward + backward compute, window = the step minus the optimizer step and gradient
reductions (which the 1F1B bubble formula does not cover), idle = 1 - busy / window. The model has
equal blocks per stage and a small vocabulary so that stages are balanced, as the formula assumes.

Reported: the mean over stages, and the idle fraction of the busiest stage (which sets the pace;
lighter stages also wait for it, which the balanced-stage formula does not count). Each stage is one
process with one thread, so the figure is only meaningful with at least p free
cores: on fewer cores stages time-share the CPU and the measured idle time shrinks.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from .common import bench_run_config, build_engine, emit, table

EXCLUDED = ("OptimizerStep", "ReduceGrads", "ReduceTiedGrads")


def _instrument(engine):
    totals: dict[str, float] = defaultdict(float)
    timed = {}
    for kind, fn in engine._INSTRUCTION_MAP.items():

        def wrapper(self, _fn=fn, _name=kind.__name__, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(self, **kw)
            finally:
                totals[_name] += time.perf_counter() - t0

        timed[kind] = wrapper
    engine._INSTRUCTION_MAP = timed  # instance attribute shadows the class table
    return totals


def worker(stages: int, micro_batches: int, steps: int, hidden: int, layers_per_stage: int) -> dict:
    """One rank: train ``steps`` steps and report this stage's busy/window times."""
    import torch.distributed as dist

    from ..data.loader import StepBatches

    model = dict(preset="tiny", hidden=hidden, layers=layers_per_stage * stages, heads=4, max_seq_len=128)
    raw = bench_run_config(
        model=model, pp=stages, global_batch=micro_batches, micro=1, seq_len=128, vocab=512
    )
    _, layout, rt, engine, data, _ = build_engine(raw)
    totals = _instrument(engine)
    idle, busy_s = [], []
    for step in range(steps + 1):
        totals.clear()
        t0 = time.perf_counter()
        engine.train_batch(
            data_iter=StepBatches(
                data.train,
                global_batch=layout.global_batch,
                micro_batch=1,
                grad_accum=layout.grad_accum,
                dp_rank=0,
                start_step=step,
            )
        )
        total = time.perf_counter() - t0
        window = total - sum(totals[k] for k in EXCLUDED)
        busy = totals["ForwardPass"] + totals["BackwardPass"]
        if step:  # the first step includes one-time shape exchanges
            idle.append(1 - busy / window)
            busy_s.append(busy)
    return {
        "stage": rt.state.pp.rank,
        "idle": statistics.median(idle),
        "busy_s": statistics.median(busy_s),
        "rank": dist.get_rank(),
    }


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench bubble``."""
    from ..parallel.spawn import spawn

    rows, out = [], []
    for p in (int(x) for x in args.stages.split(",")):
        for m in (int(x) for x in args.micro_batches.split(",")):
            res = spawn(worker, p, p, m, args.steps, args.hidden, args.layers_per_stage, timeout=1800)
            ordered = sorted(res, key=lambda r: r["stage"])
            per_stage = [r["idle"] for r in ordered]
            theory = (p - 1) / (m + p - 1)
            mean = sum(per_stage) / len(per_stage)
            # The busiest stage sets the pace; the formula assumes all stages are that busy.
            critical = max(ordered, key=lambda r: r["busy_s"])["idle"]
            row = {
                "p": p,
                "m": m,
                "theory": theory,
                "measured_mean": mean,
                "ratio": mean / theory,
                "busiest_stage": critical,
                "busiest/theory": critical / theory,
                "per_stage": " ".join(f"{x:.3f}" for x in per_stage),
            }
            rows.append(row)
            out.append({**row, "per_stage": per_stage})
    print("pipeline bubble: idle fraction of the fwd/bwd window per stage vs (p-1)/(m+p-1)")
    print(
        table(
            rows,
            ["p", "m", "theory", "measured_mean", "ratio", "busiest_stage", "busiest/theory", "per_stage"],
        )
    )
    return emit("bubble", {"rows": out, "steps": args.steps, "hidden": args.hidden})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["p"],
            x["m"],
            _f(x["theory"]),
            _f(x["measured_mean"]),
            _f(x["busiest_stage"]),
            _f(x["ratio"]),
        ]
        for x in r["rows"]
    ]
    return ["p", "m", "(p-1)/(m+p-1)", "measured mean idle", "busiest stage idle", "mean/theory"], rows
