"""Shared pieces of the benchmarks: building a tiny engine in-process, reporting results."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

import torch


def machine() -> dict:
    """Where the figures were measured."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def emit(name: str, result: dict) -> dict:
    """Print the benchmark's one-line JSON record (``BENCH {...}``) and return it."""
    record = {"bench": name, **result, "machine": machine()}
    print("BENCH " + json.dumps(record, default=float), flush=True)
    return record


def table(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width text table of ``rows`` (dicts) over ``columns``."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    for r in rows:
        lines.append("  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
    return "\n".join(lines)


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the distribution-free interval for the median of ``values`` (order
    statistics x_(k) and x_(n+1-k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2),
    and the probability it holds the true median (at least ``confidence`` where n allows; with fewer
    than 6 values the whole range, at its own coverage)."""
    xs, n = sorted(values), len(values)
    cdf = [sum(math.comb(n, j) for j in range(i + 1)) / 2**n for i in range(n)]  # P(B <= i)
    k = max([1] + [i + 1 for i in range(n // 2) if cdf[i] <= (1 - confidence) / 2])
    return xs[k - 1], xs[n - k], 1 - 2 * cdf[k - 1]


def median_time(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_run_config(
    *,
    model: dict,
    tp: int = 1,
    pp: int = 1,
    global_batch: int = 8,
    micro: int = 2,
    seq_len: int = 64,
    zero: int = 1,
    save_dir: str = "/tmp/mt3d-bench",
    bf16: bool = False,
    corpus: str = "synthetic",
    vocab: int = 512,
    recompute: int = 0,
    sequence_parallel: bool = False,
    torch_adam_fused: bool = False,
    context: int = 1,
    exchange: str = "auto",
    tile_len: int = 0,
) -> dict:
    """A run config dict for benchmark engines (synthetic data, no eval, no saving)."""
    params = {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    if torch_adam_fused:
        params.update(torch_adam=True, fused=True)
    raw = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero},
        "mt3d": {
            "model": model,
            "parallel": {
                "tensor": tp,
                "pipeline": pp,
                "sequence_parallel": sequence_parallel,
                "context": context,
                "context_exchange": exchange,
            },  # fmt: skip
            "data": {"corpus": corpus, "vocab_size": vocab, "seq_len": seq_len},
            "train": {
                "steps": 0,
                "save_dir": save_dir,
                "save_at_end": False,
                "eval_batches": 0,
                "progress": False,
                "recompute": {"interval": recompute, "tile_len": tile_len},
            },
        },
    }
    if bf16:
        raw["bf16"] = {"enabled": True}
    return raw


def build_engine(raw: dict, fast_init: bool = False):
    """Inside an initialised process group: (run, layout, runtime, engine, data, model config), set up
    as ``mt3d train`` does (validation, preflight, the vocabulary check, safe loading).

    ``fast_init`` draws the weights with one ``normal_`` per tensor on the model's device instead of
    mt3d's layout-independent CPU init (minutes for 1B parameters; benchmarks do not need it).
    """
    import torch.distributed as dist

    from ..config import from_dict, resolve_model, validate
    from ..train import preflight
    from ..training import session
    from ..training.runtime import setup

    run = from_dict(raw)
    cfg = resolve_model(run.mt3d.model)
    layout = validate(run, dist.get_world_size(), cfg)
    preflight(run, layout, cfg)
    rt = setup(run.mt3d.parallel, run.mt3d.train.seed)
    data, vocab = session.prepare_data(run.mt3d.data, run.mt3d.train.seed, cfg)
    packed = data.info["packed"]
    engine, _ = session.build_engine(run, layout, rt, cfg, vocab, fast_init=fast_init, packed=packed)
    return run, layout, rt, engine, data, cfg


def train_step(engine, layout, rt, data, micro: int, k: int) -> float:
    """Train step ``k`` of ``build_engine``'s engine; its loss (the regular engine's: this rank's mean
    over the micro-batches, which it runs one by one)."""
    from ..data.loader import StepBatches

    split = dict(global_batch=layout.global_batch, micro_batch=micro, grad_accum=layout.grad_accum)
    it = StepBatches(data.train, **split, dp_rank=rt.state.dp.rank, start_step=k, cp=rt.state.cp)
    if layout.zero_stage < 2:
        return float(engine.train_batch(data_iter=it))
    losses = []
    for _ in range(layout.grad_accum):  # the regular engine (ZeRO-2/3): micro-batches by hand
        x, y = next(it)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return sum(losses) / len(losses)


def hf_twin(cfg, vocab: int | None = None):
    """The transformers model (GPT2LMHeadModel / LlamaForCausalLM, SDPA attention) with the same shape
    as ``cfg``, from the same config mapping ``mt3d export-hf`` writes; built on the default device."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.hf import hf_config_dict

    d = hf_config_dict(replace(cfg, extra={}), vocab or cfg.vocab_size, None)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
