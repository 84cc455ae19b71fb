"""``comm``: every collective of a training step, against 8*b*s*h*(t-1)/t elements per layer.

Each configuration trains one step of a model with L blocks and one with 2L blocks under
``CollectiveLog`` (which records what really goes through torch.distributed, DeepSpeed's calls
included). The difference between the two runs is exactly the blocks' traffic, so per layer and
micro-batch: calls by operation, and elements each rank moves (ring: 2(t-1)/t of the buffer for
all-reduce, (t-1)/t for all-gather and reduce-scatter), against the theory. Collectives outside the
blocks (embedding, LM head, loss, gradient reduction) are listed per step.
"""

from __future__ import annotations

from collections import Counter

from .common import bench_run_config, build_engine, emit, table


def moved(op: str, numel: int, n: int) -> float:
    """Elements one rank sends in a ring implementation of ``op`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n * numel
    if op.startswith(("all_gather", "reduce_scatter")):
        return (n - 1) / n * numel
    return float(numel)


def worker(tp: int, sp: bool, layers: int, hidden: int, seq: int, micro: int, accum: int) -> dict:
    """One step under the collective recorder; returns the TP-group collectives seen by rank 0."""
    import torch.distributed as dist

    from ..data.loader import StepBatches
    from ..parallel.commlog import CollectiveLog

    model = dict(preset="tiny", hidden=hidden, layers=layers, heads=4, max_seq_len=seq)
    raw = bench_run_config(model=model, tp=tp, seq_len=seq, micro=micro, global_batch=micro * accum,
                           sequence_parallel=sp)  # fmt: skip
    _, layout, rt, engine, data, _ = build_engine(raw)

    def step(k):
        it = StepBatches(data.train, global_batch=layout.global_batch, micro_batch=micro,
                         grad_accum=layout.grad_accum, dp_rank=0, start_step=k)  # fmt: skip
        engine.train_batch(data_iter=it)

    step(0)  # first step: shapes and buckets set up
    with CollectiveLog() as log:
        step(1)
    ranks = tuple(rt.state.tp.ranks)
    calls = [(c.op, c.numel) for c in log.calls if c.ranks == ranks and tp > 1]
    other = [(c.op, c.numel, len(c.ranks)) for c in log.calls if c.ranks != ranks]
    return {"calls": calls, "other": other, "rank": dist.get_rank()}


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench comm``."""
    from ..parallel.spawn import spawn

    rows, out = [], []
    b, s, h, m, L = args.micro, args.seq_len, args.hidden, args.accum, args.layers
    bsh = b * s * h
    for tp in (int(x) for x in args.tp.split(",")):
        for sp in (False, True):
            res = {n: spawn(worker, tp, tp, sp, n, h, s, b, m, timeout=600)[0] for n in (L, 2 * L)}
            c1, c2 = Counter(res[L]["calls"]), Counter(res[2 * L]["calls"])
            diff = c2 - c1
            per_layer = {f"{op}x{numel}": n / (L * m) for (op, numel), n in diff.items()}
            big = sum(moved(op, numel, tp) * n for (op, numel), n in diff.items() if numel == bsh) / (L * m)
            small = sum(moved(op, numel, tp) * n for (op, numel), n in diff.items() if numel != bsh) / (L * m)
            theory = 8 * bsh * (tp - 1) / tp
            row = {
                "tp": tp,
                "sp": sp,
                "calls_per_layer_per_micro": " ".join(f"{k}:{v:g}" for k, v in sorted(per_layer.items())),
                "elements_per_layer": big,
                "theory": theory,
                "ratio": big / theory,
                "norm_grad_elements": small,
            }
            rows.append(row)
            outside = {
                f"{op}x{numel}": n for (op, numel), n in (c1 - diff).items()
            }  # c1 = L layers + the rest
            out.append({**row, "per_layer": per_layer, "tp_calls_outside_blocks_per_step": outside})
    print(f"TP collectives per transformer layer and micro-batch (b={b}, s={s}, h={h}; theory 8bsh(t-1)/t)")
    print(table(rows, ["tp", "sp", "calls_per_layer_per_micro", "elements_per_layer", "theory", "ratio",
                       "norm_grad_elements"]))  # fmt: skip
    return emit("comm", {"rows": out, "b": b, "s": s, "h": h, "accum": m, "layers": L})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["tp"],
            x["sp"],
            x["calls_per_layer_per_micro"],
            _f(x["elements_per_layer"]),
            _f(x["theory"]),
            f"{x['ratio']:.2f}",
        ]
        for x in r["rows"]
    ]
    return ["tp", "SP", "calls per layer per micro-batch", "elements moved", "8bsh(t-1)/t", "ratio"], rows
