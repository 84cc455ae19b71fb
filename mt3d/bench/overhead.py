"""``overhead``: mt3d at tp = pp = dp = 1 against a plain PyTorch loop and transformers + DeepSpeed.

All three train the same architecture on the same batches in one process, steps interleaved
(A, B, C, A, B, C, ...) so machine noise hits them alike; the figure is the ratio of median step
times. The plain loop is the floor: the same mt3d layers, ``torch.optim.AdamW``, gradient
accumulation and norm clipping, no engine. The transformers baseline is ``GPT2LMHeadModel`` of the
same shape under ``deepspeed.initialize`` with ZeRO-1.
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import bench_run_config, build_engine, emit, hf_twin, table

SIZES = {
    "tiny": dict(preset="tiny", hidden=64, layers=4, heads=4, max_seq_len=128),
    "small": dict(preset="tiny", hidden=256, layers=4, heads=8, max_seq_len=128),
}


def _plain_loop(cfg, vocab, batches, grad_accum):
    from ..model.blocks import BuildContext
    from ..model.pipeline import LossFn, StackedModel, layer_specs
    from ..parallel.state import AxisGroup

    ctx = BuildContext(tp=AxisGroup.alone("tp"), seed=1234)
    model = StackedModel(layer_specs(cfg, ctx, vocab), loss_fn=LossFn(ctx.tp, vocab))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )

    def step():
        for _ in range(grad_accum):
            x, y = next(batches)
            (model(x, y) / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _hf_deepspeed(cfg, vocab, batches, grad_accum, micro, seq_len):
    import deepspeed

    hf = hf_twin(cfg, vocab)
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(), config=ds)

    def step():
        for _ in range(grad_accum):
            x, y = next(batches)
            loss = engine(input_ids=x, labels=x).loss  # HF shifts labels itself
            engine.backward(loss)
            engine.step()

    return step


def worker(size: str, reps: int, seq_len: int, micro: int, global_batch: int, zero: int) -> dict:
    """Runs inside a one-rank process group."""
    from ..config.rules import uses_pipeline_engine

    raw = bench_run_config(
        model=SIZES[size], seq_len=seq_len, micro=micro, global_batch=global_batch, zero=zero
    )
    run, layout, rt, engine, data, cfg = build_engine(raw)
    assert uses_pipeline_engine(layout)
    vocab = cfg.vocab_size
    from ..data.loader import StepBatches

    def batches():
        return StepBatches(
            data.train, global_batch=global_batch, micro_batch=micro, grad_accum=layout.grad_accum, dp_rank=0
        )

    it_mt3d, it_plain, it_hf = batches(), batches(), batches()
    steps = {
        "mt3d": lambda: engine.train_batch(data_iter=it_mt3d),
        "plain": _plain_loop(cfg, vocab, it_plain, layout.grad_accum),
        "hf_deepspeed": _hf_deepspeed(cfg, vocab, it_hf, layout.grad_accum, micro, seq_len),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for k in steps:  # warm-up
        steps[k]()
    for _ in range(reps):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "threads": torch.get_num_threads(), "params": cfg.num_params(vocab)}


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can); checked before any process starts."""
    if args.global_batch % args.micro:
        return f"--global-batch {args.global_batch} is not a multiple of --micro {args.micro}"
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench overhead``."""
    from ..parallel.spawn import spawn

    rows, out = [], {}
    for size, zero in ((s, z) for s in args.sizes for z in args.zero):
        res = spawn(
            worker, 1, size, args.reps, args.seq_len, args.micro, args.global_batch, zero, timeout=1800
        )[0]
        med = res["median_step_s"]
        r = {
            "model": size,
            "zero": zero,
            "params": res["params"],
            "mt3d_s": med["mt3d"],
            "plain_s": med["plain"],
            "hf_ds_s": med["hf_deepspeed"],
            "mt3d/plain": med["mt3d"] / med["plain"],
            "mt3d/hf_ds": med["mt3d"] / med["hf_deepspeed"],
        }
        rows.append(r)
        out[f"{size}/zero{zero}"] = r
    print(f"step-time overhead at tp=pp=dp=1, median of {args.reps} steps (target mt3d/plain <= 1.10)")
    print(
        table(rows, ["model", "zero", "params", "mt3d_s", "plain_s", "hf_ds_s", "mt3d/plain", "mt3d/hf_ds"])
    )
    return emit("overhead", {"rows": out, "reps": args.reps, "seq_len": args.seq_len, "micro": args.micro})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            k,
            _f(v["mt3d_s"]),
            _f(v["plain_s"]),
            _f(v["hf_ds_s"]),
            _f(v["mt3d/plain"]),
            _f(v["mt3d/hf_ds"]),
        ]
        for k, v in r["rows"].items()
    ]
    return ["model/ZeRO", "mt3d s/step", "plain s/step", "HF+DS s/step", "mt3d/plain", "mt3d/HF+DS"], rows
