"""``overlap``: how much communication is hidden behind compute: a column-parallel linear's backward
transfers (tp 2), the data-parallel gradient reduction of a training step (dp 2), pipeline
transfers (pp 2), and a MoE layer's expert all-to-all pipelined in chunks (ep 2: ``overlap_ep``);
``--parts`` picks among them.

Under SP a column-parallel linear keeps its 1/tp input shard (``parallel/layers.py``); its backward
all-gathers that shard while it computes the input gradient, then reduce-scatters the input gradient
while it computes the weight gradient. Without SP it all-reduces the input gradient while it computes
the weight gradient. At tp 2, for each (rows, in, out) shape and both paths, this measures the
transfers (C = gather + scatter, or the all-reduce, each timed alone), the two GEMMs alone, the
backward as mt3d runs it (T_o) and the same steps one after another (T_s). Hidden fraction: (T_s -
T_o) / C, beside the schedule's prediction (each transfer hidden up to the GEMM beside it: the
planner's ``costs.tp_hidden``).

Data parallelism (``mt3d.train.overlap.grad_reduce``, ``mt3d.ds.overlap``): a ZeRO-1 step at dp 2 on
DeepSpeed's pipeline engine, once with DeepSpeed's reduction after the backward and once with the
buckets reduced during the last micro-batch's backward. C: the reduction step in the first run;
hidden: (C - what is left after the backward - how much longer the last backward took) / C, and,
noisier (two runs' step times), (step time saved) / C; beside the schedule's prediction
min(C - C_last bucket, B_last) / C (B_last: the last micro-batch's backward).

Pipeline (``mt3d.train.overlap.p2p``): pp 2 on mt3d's schedule engine (m = 4), steps alternating
between waiting for each commit's transfers and posting them ahead (a commit after each pass).
Per stage: the transfers (the rank's messages per step x half an activation-sized round trip), the
time spent waiting on them both ways, and hidden = (wait saved) / transfers; beside the schedule's
prediction: the step time posting saves in ``pipeline.schedule.simulate`` with the measured
message and pass times, over the transfers (``pp_predicted``).
"""

from __future__ import annotations

import torch

from .common import emit, median_time, table

SHAPES = ((2048, 2048, 512), (4096, 1024, 1024))
"""(rows of the gathered sequence, in features, out features per rank) measured."""


def worker(shapes, reps: int) -> list[dict]:
    """Times of the pieces and of the backward, overlapped and in series, on this rank, per shape and
    path (sequence-parallel and not)."""
    import torch.distributed as dist

    from ..ds.topology import map_ranks
    from ..parallel.state import ParallelState

    tp = ParallelState.build(map_ranks(dist.get_world_size(), tp=dist.get_world_size())).tp
    return [{"sp": sp, "rows": r, "in": i, "out": o, **_times(tp, sp, r, i, o, reps)}
            for sp in (True, False) for r, i, o in shapes]  # fmt: skip


def _times(tp, sp: bool, rows: int, fin: int, fout: int, reps: int) -> dict:
    """``gather``/``scatter`` (SP) or ``all_reduce`` (not SP) and the two GEMMs timed alone, the four
    (three) steps one after another, and the layer's backward as mt3d runs it."""
    from ..parallel.layers import ColumnParallelLinear, NormalInit
    from ..parallel.mappings import SEQ_DIM, start_all_reduce, start_gather, start_reduce_scatter

    layer = ColumnParallelLinear(fin, fout * tp.size, tp=tp, bias=False, sequence_parallel=sp,
                                 init=NormalInit(0.02, 1))  # fmt: skip
    x = torch.randn(1, rows // tp.size if sp else rows, fin, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    w, shard = layer.weight.detach(), x.detach()
    full = start_gather(shard, tp, SEQ_DIM)() if sp else shard
    dx = grad.matmul(w)

    def wgrad(gathered):
        return grad.reshape(-1, grad.shape[-1]).t().matmul(gathered.reshape(-1, fin))

    def serial():  # the same steps, each waiting for the one before
        gathered = start_gather(shard, tp, SEQ_DIM)() if sp else shard
        dgrad = grad.matmul(w)
        reduced = start_reduce_scatter(dgrad, tp, SEQ_DIM)() if sp else start_all_reduce(dgrad, tp)()
        wgrad(gathered)
        return reduced

    buffer = dx.clone()  # summed in place on every repetition: its values grow, its time does not
    pieces = {"gather": median_time(lambda: start_gather(shard, tp, SEQ_DIM)(), reps),
              "scatter": median_time(lambda: start_reduce_scatter(dx, tp, SEQ_DIM)(), reps)} if sp else {
              "all_reduce": median_time(lambda: start_all_reduce(buffer, tp)(), reps)}  # fmt: skip
    return {
        **pieces,
        "dgrad": median_time(lambda: grad.matmul(w), reps),
        "wgrad": median_time(lambda: wgrad(full), reps),
        "serial": median_time(serial, reps),
        "overlapped": median_time(lambda: y.backward(grad, retain_graph=True), reps),
    }


def tp_row(r: dict) -> dict:
    """One TP row: communication, hidden share and the schedule's prediction (the planner's
    ``tp_hidden`` with the measured times: the gather behind the input gradient, the reduce-scatter
    or all-reduce behind the weight gradient)."""
    from ..planner.costs import tp_hidden

    gather, reduce = (r["gather"], r["scatter"]) if r["sp"] else (0.0, r["all_reduce"])
    comm = gather + reduce
    predicted = tp_hidden([(r["dgrad"], r["wgrad"])], gather, reduce) / comm
    return {**r, "comm_ms": comm * 1e3, "gemms_ms": (r["dgrad"] + r["wgrad"]) * 1e3,
            "serial_ms": r["serial"] * 1e3, "overlapped_ms": r["overlapped"] * 1e3,
            "hidden": (r["serial"] - r["overlapped"]) / comm, "predicted": predicted}  # fmt: skip


DP_MODEL = dict(preset="tiny-llama", hidden=512, layers=4, heads=8, kv_heads=4, ffn=1536, max_seq_len=128)
"""The model of the data-parallel rows (~14M parameters: a reduction of tens of milliseconds on gloo)."""


def dp_worker(model: dict, overlap: bool, reps: int, bucket: int) -> dict:
    """Median step time, reduction step and last backward of one ZeRO-1 run at dp 2 (this rank)."""
    import statistics
    import time

    from deepspeed.runtime.pipe import schedule as ds_schedule

    from ..data.loader import StepBatches
    from ..ds.instructions import wrap_instructions
    from .common import bench_run_config, build_engine

    raw = bench_run_config(model=model, seq_len=128, global_batch=8, micro=2, zero=1)
    raw["mt3d"]["train"]["overlap"] = {"grad_reduce": overlap, "bucket_elements": bucket}
    _, layout, rt, engine, data, _ = build_engine(raw)
    spent = {"reduce": [], "backward": []}
    reduce = engine.allreduce_gradients

    def timed(fn, key):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[key].append(time.perf_counter() - t0)
            return out

        return run

    engine.allreduce_gradients = timed(reduce, "reduce")
    wrap_instructions(
        engine, lambda kind, fn: timed(fn, "backward") if kind is ds_schedule.BackwardPass else fn
    )
    split = dict(global_batch=layout.global_batch, micro_batch=2, grad_accum=layout.grad_accum)
    steps = []
    for k in range(reps + 1):
        it = StepBatches(data.train, **split, dp_rank=rt.state.dp.rank, start_step=k)
        t0 = time.perf_counter()
        engine.train_batch(data_iter=it)
        steps.append(time.perf_counter() - t0)
    ov = getattr(engine, "grad_reduce_overlap", None)
    total = sum(p.numel() for p in engine.module.parameters())
    last = ov.buckets[-1] if ov else None
    return {
        "step": statistics.median(steps[1:]),
        "reduce": statistics.median(spent["reduce"][1:]),
        "last_backward": statistics.median(spent["backward"][layout.grad_accum :: layout.grad_accum]),
        "buckets": len(ov.buckets) if ov else 0,
        "posted_in_backward": ov.posted_in_backward if ov else 0,
        "last_bucket_share": sum(p.numel() for p in last.params) / total if last else 0.0,
    }  # fmt: skip


def dp_row(model: dict, reps: int, bucket: int) -> dict:
    """The data-parallel row: both runs, the hidden share and the schedule's prediction."""
    from ..parallel.spawn import spawn
    from ..planner.costs import bucket_reduction_hidden

    off = spawn(dp_worker, 2, model, False, reps, bucket, timeout=900)[0]
    on = spawn(dp_worker, 2, model, True, reps, bucket, timeout=900)[0]
    comm = off["reduce"]
    predicted = bucket_reduction_hidden(comm, on["last_bucket_share"], off["last_backward"]) / comm
    return {"comm_ms": comm * 1e3, "last_backward_ms": off["last_backward"] * 1e3,
            "step_ms": off["step"] * 1e3, "overlapped_step_ms": on["step"] * 1e3,
            "reduce_after_ms": on["reduce"] * 1e3, "overlapped_last_backward_ms": on["last_backward"] * 1e3,
            "buckets": on["buckets"],
            "posted_in_backward": on["posted_in_backward"],
            "hidden": (comm - on["reduce"] - max(0.0, on["last_backward"] - off["last_backward"])) / comm,
            "hidden_by_step": (off["step"] - on["step"]) / comm, "predicted": predicted}  # fmt: skip


def pp_worker(model: dict, reps: int) -> dict:
    """Step time and time waiting for transfers on this rank at pp 2 (mt3d's schedule engine, m = 4),
    with each commit waited for (blocking) and with transfers posted ahead (async), steps alternating."""
    import statistics
    import time

    from ..data.loader import StepBatches
    from ..pipeline.schedule import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, rank_steps
    from .common import bench_run_config, build_engine

    raw = bench_run_config(model=model, pp=2, seq_len=128, global_batch=2 * PP_MICRO_BATCHES, micro=2, zero=1)
    raw["mt3d"]["train"]["overlap"] = {"p2p": True}
    _, layout, rt, engine, data, _ = build_engine(raw)
    split = dict(global_batch=layout.global_batch, micro_batch=2, grad_accum=layout.grad_accum)
    got = {False: ([], []), True: ([], [])}
    for k in range(2 * reps + 2):
        engine.async_p2p = bool(k % 2)
        it = StepBatches(data.train, **split, dp_rank=0, start_step=k)
        t0 = time.perf_counter()
        engine.train_batch(data_iter=it)
        if k >= 2:  # warm-up: one step of each
            got[engine.async_p2p][0].append(time.perf_counter() - t0)
            got[engine.async_p2p][1].append(engine.p2p_wait_s)
    ops = [o.kind for step in rank_steps(2, 1, layout.grad_accum, rt.state.pp.rank) for o in step]
    messages = sum(k in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD) for k in ops)
    return {"step": {m: statistics.median(v[0]) for m, v in got.items()},
            "wait": {m: statistics.median(v[1]) for m, v in got.items()},
            "transfers": messages * _one_way(2 * 128 * model["hidden"], rt.state.pp.rank, reps),
            "messages": messages}  # fmt: skip


def _one_way(elements: int, rank: int, reps: int) -> float:
    """Seconds one activation-sized fp32 message takes between the two stages (half a round trip)."""
    import torch.distributed as dist

    x = torch.zeros(elements)

    def round_trip():
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    round_trip()
    return median_time(round_trip, 2 * reps + 1) / 2


def pp_rows(model: dict, reps: int) -> list[dict]:
    """One row per pipeline rank: waiting for transfers, blocking vs async, and the step times; beside
    the schedule's prediction (``pp_predicted``)."""
    from ..parallel.spawn import spawn

    rows = []
    for rank, r in enumerate(spawn(pp_worker, 2, model, reps, timeout=900)):
        blocking, posted = r["wait"][False], r["wait"][True]
        rows.append({"stage": rank, "transfers_ms": r["transfers"] * 1e3, "wait_ms": blocking * 1e3,
                     "async_wait_ms": posted * 1e3, "step_ms": r["step"][False] * 1e3,
                     "async_step_ms": r["step"][True] * 1e3, "hidden": (blocking - posted) / r["transfers"],
                     "predicted": pp_predicted(r, PP_MICRO_BATCHES)})  # fmt: skip
    return rows


PP_MICRO_BATCHES = 4
"""Micro-batches per step of the pipeline rows (pp 2, v 1)."""


def pp_predicted(r: dict, m: int) -> float:
    """The share of a rank's transfer time that posting saves, from ``pipeline.schedule.simulate`` at
    pp 2, v 1 with this rank's measured figures: one message's seconds, a forward a third of the
    blocking step's time not spent waiting, a backward two thirds."""
    from ..pipeline.schedule import simulate

    message = r["transfers"] / r["messages"]
    forward = (r["step"][False] - r["wait"][False]) / (3 * m)
    step = {posted: simulate(2, 1, m, fwd_s=forward, bwd_s=2 * forward, p2p_s=message, posted=posted)
            for posted in (False, True)}  # fmt: skip
    return (step[False]["makespan"] - step[True]["makespan"]) / r["transfers"]


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench overlap``."""
    torch.set_num_threads(1)
    shapes = SHAPES[:1] if args.smoke else SHAPES
    model = dict(DP_MODEL, hidden=128, heads=4, kv_heads=2, ffn=256) if args.smoke else DP_MODEL
    record = {"tp": 2}
    if "ep" in args.parts:
        record["ep"] = _ep_part(args)
    if "tp" in args.parts:
        record["rows"] = _tp_part(shapes, args.reps)
    if "dp" in args.parts:
        record["dp"] = _dp_part(model, args)
    if "pp" in args.parts:
        record["pp"] = _pp_part(model, args.reps)
    return emit("overlap", record)


def _ep_part(args) -> list[dict]:
    from .overlap_ep import EP_COLUMNS, EP_SHAPE, ep_rows

    shape = dict(EP_SHAPE, tokens=256, hidden=128) if args.smoke else EP_SHAPE
    rows = ep_rows(args.ep_chunks, args.reps, shape)
    print(f"MoE expert all-to-all at ep 2 ({shape}, rank 0), each layer's tokens in chunks pipelined "
          "(mt3d.train.overlap.dispatch_chunks) vs the same chunks one after another: time blocked in "
          "the all-to-alls, hidden behind the routed experts")  # fmt: skip
    print(table(rows, EP_COLUMNS) + "\n")
    return rows


def _tp_part(shapes, reps: int) -> list[dict]:
    from ..parallel.spawn import spawn

    rows = [tp_row(r) for r in spawn(worker, 2, shapes, reps, timeout=900)[0]]
    print("column-parallel linear backward at tp 2 (rank 0), with sequence parallelism (sp True: the "
          "input re-gathered, its gradient reduce-scattered) and without (its gradient all-reduced): "
          "communication hidden behind the GEMMs")  # fmt: skip
    print(table(rows, ["sp", "rows", "in", "out", "comm_ms", "gemms_ms", "serial_ms", "overlapped_ms",
                       "hidden", "predicted"]))  # fmt: skip
    return rows


def _dp_part(model: dict, args) -> dict:
    dp = dp_row(model, args.reps, args.bucket_elements)
    print("\ndata-parallel gradient reduction at dp 2 (ZeRO-1, rank 0): during the last backward vs after it")
    columns = ["comm_ms", "last_backward_ms", "overlapped_last_backward_ms", "reduce_after_ms", "step_ms",
               "overlapped_step_ms", "buckets", "hidden", "hidden_by_step", "predicted"]  # fmt: skip
    print(table([dp], columns))
    return dp


def _pp_part(model: dict, reps: int) -> list[dict]:
    pp = pp_rows(model, reps)
    print("\npipeline transfers at pp 2 (mt3d's schedule, m = 4): time waiting for them per step, each "
          "exchange waited for vs posted ahead (mt3d.train.overlap.p2p)")  # fmt: skip
    columns = ["stage", "transfers_ms", "wait_ms", "async_wait_ms", "step_ms", "async_step_ms", "hidden",
               "predicted"]  # fmt: skip
    print(table(pp, columns))
    return pp
