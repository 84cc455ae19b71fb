"""``bubble``: measured pipeline idle fraction per stage against (p-1)/(v m + p - 1).

v = 1 is DeepSpeed's 1F1B schedule, v > 1 mt3d's interleaved one (v chunks per stage, the same
model cut into p v chunks): its bubble is (p-1)/(v m) of the ideal time, i.e. (p-1)/(v m + p - 1)
of the total for uniform chunks. ``--schedules zb-h1,zbv`` adds the zero-bubble schedules
(``mt3d.pipeline.zero_bubble``, run by mt3d's engine with the backward split into B and W): their
"theory" is the schedule replayed at the paper's unit pass times (F = B = W, free transfers), and
"predicted" every schedule's programs run by the simulator at the pass times measured in the same
run (each rank's and chunk's forward, input-gradient and weight-gradient seconds; 1F1B's backward is
both halves) with free transfers, which is what the measured idle is held against; the
difference is mostly transfer time (``p2p_wait_s``: the seconds per step mt3d's engine waited inside
passes for posted transfers; DeepSpeed's 1F1B waits inside its send and receive instructions).

DeepSpeed's pipeline engine runs each step as a list of instructions; the benchmark times every
instruction on every stage (by wrapping the engine's instruction table on the instance). Per stage,
busy = forward + backward compute, window = the step minus the optimizer step and gradient
reductions (which the 1F1B bubble formula does not cover), idle = 1 - busy / window (busy includes
the W passes of a split backward, and excludes the waits for posted transfers that mt3d's engine
makes inside a pass, right before it reads what it received). The model has
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
    from torch.profiler import record_function

    from ..ds.instructions import wrap_instructions

    totals: dict[str, float] = defaultdict(float)

    def timed(kind, fn):
        def wrapper(self, _fn=fn, _name=kind.__name__, **kw):
            t0, w0 = time.perf_counter(), getattr(self, "p2p_wait_s", 0.0)
            try:
                with record_function(_name):  # named in a profile (``activation_peak``); cheap without
                    return _fn(self, **kw)
            finally:  # mt3d's engine waits for posted transfers inside a pass: that is idle, not busy
                waited = getattr(self, "p2p_wait_s", 0.0) - w0
                took = time.perf_counter() - t0 - waited
                totals[_name] += took
                totals[f"{_name}@{kw.get('chunk', 0)}"] += took  # DeepSpeed's own passes: chunk 0
                totals["p2p_wait"] += waited

        return wrapper

    wrap_instructions(engine, timed)
    return totals


PASSES = {"fwd": "ForwardPass", "bwd": "BackwardPass", "wgt": "WeightPass"}


def activation_peak(train_step) -> int:
    """Bytes allocated at the peak of one step's forward and backward passes above what was held when
    it started: ``train_step()`` runs under torch's profiler with its memory events (every CPU tensor
    allocation and free, whoever makes it) summed in time order up to the optimizer step (named by
    ``_instrument``), so the optimizer's own buffers are left out. What the passes keep for their
    backward (and a split backward for W), the received activations and gradients, and the
    temporaries of the largest pass."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step()
    events = prof.events()
    stop = min((e.time_range.start for e in events if e.name in EXCLUDED), default=float("inf"))
    held = peak = 0
    for _, used in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events
                          if e.self_cpu_memory_usage and e.time_range.start < stop):  # fmt: skip
        held += used
        peak = max(peak, held)
    return peak


def worker(stages: int, micro_batches: int, steps: int, hidden: int, layers_per_stage: int, v: int = 1,
           schedule: str = "1f1b", memory: bool = False) -> dict:  # fmt: skip
    """One rank: train ``steps`` steps and report this stage's busy/window times and its seconds of
    forward, backward (B) and weight-gradient (W) passes per micro-batch; with ``memory`` one step
    more under the profiler for its activation peak (``activation_peak``; not timed)."""
    import torch.distributed as dist

    from ..data.loader import StepBatches

    model = dict(preset="tiny", hidden=hidden, layers=layers_per_stage * stages, heads=4, max_seq_len=128)
    raw = bench_run_config(
        model=model, pp=stages, global_batch=micro_batches, micro=1, seq_len=128, vocab=512
    )
    raw["mt3d"]["parallel"].update(virtual_stages=v, schedule=schedule)
    _, layout, rt, engine, data, _ = build_engine(raw)
    totals = _instrument(engine)
    idle, busy_s, window_s = [], [], []
    passes: dict[str, list[float]] = {k: [] for k in PASSES}
    chunks = {(key, c): [] for key in PASSES for c in range(v)}  # one pass's seconds per chunk

    def train(step):
        batches = StepBatches(data.train, global_batch=layout.global_batch, micro_batch=1,
                              grad_accum=layout.grad_accum, dp_rank=0, start_step=step)  # fmt: skip
        engine.train_batch(data_iter=batches)

    for step in range(steps + 1):
        totals.clear()
        t0 = time.perf_counter()
        train(step)
        total = time.perf_counter() - t0
        window = total - sum(totals[k] for k in EXCLUDED)
        busy = sum(totals[k] for k in PASSES.values())
        if step:  # the first step includes one-time shape exchanges
            idle.append(1 - busy / window)
            busy_s.append(busy)
            window_s.append(window)
            for key, kind in PASSES.items():
                passes[key].append(totals[kind] / micro_batches)
            passes.setdefault("p2p_wait", []).append(totals["p2p_wait"])
            for key, c in chunks:
                chunks[(key, c)].append(totals[f"{PASSES[key]}@{c}"] / micro_batches)
    peak = activation_peak(lambda: train(steps + 1)) if memory else None
    return {
        "stage": rt.state.pp.rank,
        "activation_peak": peak,
        "idle": statistics.median(idle),
        "busy_s": statistics.median(busy_s),
        "window_s": statistics.median(window_s),
        "rank": dist.get_rank(),
        **{f"{key}_s": statistics.median(times) for key, times in passes.items()},
        "chunk_s": {key: {c: statistics.median(chunks[(key, c)]) for c in range(v)} for key in PASSES},
    }


def runs(args) -> list[tuple[str, int]]:
    """(schedule, virtual stages) of each measured run at one (p, m): 1F1B at every ``--virtual``, a
    zero-bubble schedule at its own chunks per rank."""
    from ..pipeline.zero_bubble import SCHEDULES

    out = []
    for schedule in args.schedules:
        vs = args.virtual if schedule == "1f1b" else (SCHEDULES[schedule],)
        out += [(schedule, v) for v in vs]
    return out


def predicted(schedule: str, v: int, p: int, m: int, ordered: list[dict]) -> float | None:
    """Mean idle fraction the simulator gives this schedule's programs at the pass times measured,
    each (rank, chunk)'s own (the stages differ: the embedding, the head and the loss); None for
    interleaved 1F1B, whose programs the zero-bubble module does not make."""
    from ..pipeline import zero_bubble

    if schedule == "1f1b" and v > 1:
        return None
    per_pass = {k: {(r["stage"], c): t for r in ordered for c, t in r["chunk_s"][k].items()} for k in PASSES}
    return statistics.fmean(zero_bubble.simulate(schedule, p, m, per_pass=per_pass)["idle"])


def theory_of(schedule: str, v: int, p: int, m: int) -> float:
    """(p-1)/(v m+p-1) for 1F1B; a zero-bubble schedule's replay at unit pass times (the paper's)."""
    from ..pipeline import zero_bubble

    if schedule == "1f1b":
        return (p - 1) / (v * m + p - 1)
    return statistics.fmean(zero_bubble.replay(schedule, p, m)["idle"])


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can): the 4-head blocks need the width, and the
    interleaved schedule micro-batches a multiple of the stages and whole blocks per chunk."""
    if args.hidden % 4:
        return f"--hidden {args.hidden} is not divisible by the benchmark's 4 heads"
    if "zbv" in args.schedules and args.layers_per_stage % 2:
        return f"--schedules zbv needs --layers-per-stage ({args.layers_per_stage}) even: two chunks per rank"
    if any(p < 2 for p in args.stages) and set(args.schedules) - {"1f1b"}:
        return "--schedules zb-h1/zbv schedule pipeline stages: give --stages of 2 or more"
    for v in (v for v in args.virtual if v > 1 and "1f1b" in args.schedules):
        if args.layers_per_stage % v:
            return f"--virtual {v} needs --layers-per-stage ({args.layers_per_stage}) divisible by it"
        bad = [(p, m) for p in args.stages for m in args.micro_batches if m % p]
        if bad:
            return f"--virtual {v} needs micro-batches a multiple of the stages: {bad[0][1]} over {bad[0][0]}"
    return None


COLUMNS = ("schedule", "p", "m", "v", "theory", "predicted", "measured_mean", "ratio", "busiest_stage",
           "busiest/theory", "step_s", "p2p_wait_s", "speedup", "ideal_speedup", "busy_vs_v1",
           "per_stage")  # fmt: skip
"""The printed table's columns (``--memory`` adds each rank's activation peak and its ratio)."""


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench bubble``."""
    from ..parallel.spawn import spawn

    rows, out = [], []
    for p in args.stages:
        for m in args.micro_batches:
            for schedule, v in runs(args):
                if schedule == "1f1b" and v > 1 and (m % p or args.layers_per_stage % v):
                    continue  # the interleaved schedule needs m = k p and whole blocks per chunk
                res = spawn(worker, p, p, m, args.steps, args.hidden, args.layers_per_stage, v, schedule,
                            args.memory, timeout=1800)  # fmt: skip
                ordered = sorted(res, key=lambda r: r["stage"])
                per_stage = [r["idle"] for r in ordered]
                theory = theory_of(schedule, v, p, m)
                mean = sum(per_stage) / len(per_stage)
                # The busiest stage sets the pace; the formula assumes all stages are that busy.
                critical = max(ordered, key=lambda r: r["busy_s"])["idle"]
                # The step (fwd/bwd window, slowest stage) against the same (p, m) at v = 1, beside the
                # ideal (m + p - 1) / (m + (p - 1) / v): this one includes v times the p2p messages.
                window = max(r["window_s"] for r in ordered)
                busy = sum(r["busy_s"] for r in ordered)
                here = {"step_s": window, "busy_s": busy}
                plain = ("1f1b", p, m, 1)  # DeepSpeed's 1F1B at the same (p, m)
                base = next((x for x in out if (x["schedule"], x["p"], x["m"], x["v"]) == plain), None)
                base = here if (schedule, p, m, v) == plain else base
                row = {
                    "schedule": schedule,
                    "p": p,
                    "m": m,
                    "v": v,
                    "theory": theory,
                    "predicted": predicted(schedule, v, p, m, ordered),
                    "measured_mean": mean,
                    "ratio": mean / theory,
                    "busiest_stage": critical,
                    "busiest/theory": critical / theory,
                    "step_s": window,
                    "busy_s": busy,
                    # per rank and step: mt3d's engine's waits inside passes for posted transfers
                    "p2p_wait_s": statistics.fmean(r["p2p_wait_s"] for r in ordered),
                    "pass_s": {k: statistics.fmean(r[f"{k}_s"] for r in ordered) for k in PASSES},
                    "speedup": base["step_s"] / window if base else None,
                    "ideal_speedup": (m + p - 1) / (m + (p - 1) / v) if schedule == "1f1b" else None,
                    # compute summed over stages, against v = 1: what cutting stages into chunks costs
                    "busy_vs_v1": busy / base["busy_s"] if base else None,
                    "per_stage": " ".join(f"{x:.3f}" for x in per_stage),
                }
                if args.memory:  # MB per rank at the peak of the passes, and the largest against 1F1B's
                    peaks = [r["activation_peak"] / 1e6 for r in ordered]
                    here["act_peak_max_mb"] = row["act_peak_max_mb"] = max(peaks)
                    row["act_peak_mb"] = " ".join(f"{x:.1f}" for x in peaks)
                    row["act_peak_vs_1f1b"] = max(peaks) / base["act_peak_max_mb"] if base else None
                rows.append(row)
                out.append({**row, "per_stage": per_stage,
                            **({"act_peak_mb": peaks} if args.memory else {})})  # fmt: skip
    print("pipeline bubble: idle fraction of the fwd/bwd window per stage vs (p-1)/(v m + p - 1) (1F1B), the")
    print("replay at unit pass times (zero-bubble), and the simulator at the measured pass times (predicted)")
    print(table(rows, [*COLUMNS, *(["act_peak_mb", "act_peak_vs_1f1b"] if args.memory else [])]))
    return emit("bubble", {"rows": out, "steps": args.steps, "hidden": args.hidden})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x.get("schedule", "1f1b"),
            x["p"],
            x["m"],
            x.get("v", 1),
            _f(x["theory"]),
            _f(x["predicted"]) if x.get("predicted") is not None else "",
            _f(x["measured_mean"]),
            _f(x["busiest_stage"]),
            _f(x["ratio"]),
            _f(x["speedup"]) if x.get("speedup") else "",
            _f(x["ideal_speedup"]) if x.get("ideal_speedup") else "",
        ]
        for x in r["rows"]
    ]
    heads = ["schedule", "p", "m", "v", "theory", "predicted", "measured mean idle", "busiest stage idle",
             "mean/theory"]  # fmt: skip
    return heads + ["step speedup vs v=1", "ideal (m+p-1)/(m+(p-1)/v)"], rows
