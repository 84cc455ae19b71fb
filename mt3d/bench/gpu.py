"""``gpu``: single-GPU training throughput and MFU, beside transformers + DeepSpeed and the matmul peak.

For gpt3-1.3b, llama-1b and a 1.7B Qwen3-MoE in bf16 at sequence 2048 on one GPU: mt3d (the
pipeline engine at tp = pp = dp = 1, optionally with compiled blocks) and ``transformers``
(GPT2LMHeadModel / LlamaForCausalLM / Qwen3MoeForCausalLM of the same shape, SDPA attention, its
experts' default grouped GEMMs) under ``deepspeed.initialize``, both with
DeepSpeed bf16, ZeRO-1 and torch's fused AdamW, the same micro-batch and random tokens. Reported:
tokens/s, model TFLOP/s (FORMULAS.md, identical counting for both), MFU against the dense bf16
peak of the device (989 TFLOP/s on H100/H200) and against the bf16 matmul peak measured in the
same run. Each mt3d row stands beside the planner's step time and GPU memory for its layout (on a
device the planner knows by name). ``--offload opt-cpu`` adds a row per model with ZeRO-Offload of
the optimizer to the CPU (DeepSpeedCPUAdam), whose peak GPU memory and step time the planner predicts
too. ``--smoke`` runs the same code on the CPU with tiny shapes (tests).
"""

from __future__ import annotations

import time

import torch

from .common import emit, hf_twin, table

MODELS = {
    "gpt3-1.3b": {"preset": "gpt3-1.3b"},
    "llama-1b": {"preset": "llama-1b"},
    # Qwen3-MoE's shape at 1.7B parameters, 0.31B active: 64 experts of 512, top 8, on every layer
    "qwen3-moe-1.7b": {"preset": "qwen3-30b-a3b", "hidden": 1024, "layers": 16, "heads": 16, "kv_heads": 4,
                       "head_dim": 64, "vocab_size": 32000, "max_seq_len": 2048,
                       "moe": {"experts": 64, "top_k": 8, "expert_ffn": 512}},
}  # fmt: skip
SMOKE = {
    "gpt3-1.3b": {"preset": "gpt3-1.3b", "hidden": 64, "layers": 2, "heads": 4, "vocab_size": 512},
    "llama-1b": {
        "preset": "llama-1b",
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 128,
        "vocab_size": 512,
    },
    "qwen3-moe-1.7b": {"preset": "qwen3-30b-a3b", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
                       "head_dim": 16, "vocab_size": 512, "max_seq_len": 64,
                       "moe": {"experts": 8, "top_k": 2, "expert_ffn": 32}},
}  # fmt: skip


def matmul_peak(device: str, n: int, reps: int) -> float:
    """Measured TFLOP/s of an n x n x n matmul (bf16 on GPU, fp32 on CPU), mean of ``reps`` after warm-up."""
    from .gemm import time_gemm

    return time_gemm(n, n, n, device, reps)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class RandomTokens:
    """Uniform random samples of seq_len + 1 tokens (throughput does not depend on the text)."""

    def __init__(self, vocab: int, seq_len: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g).numpy()


def _ds_config(micro: int, accum: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-4,
                "betas": [0.9, 0.95],
                "weight_decay": 0.1,
                "torch_adam": True,
                "fused": torch.cuda.is_available(),
            },
        },
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def _time_steps(step, steps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


RECOMPUTE_KEYS = {"none": {}, "full": {"interval": 1}, "selective": {"granularity": "selective"}}
"""``train.recompute`` of each recompute mode the benchmark can measure (``--recompute``)."""


def mt3d_worker(model: dict, seq: int, micro: int, accum: int, steps: int, warmup: int, compile_blocks: bool,
                recompute: str = "none", offload: str = "none", fp8: str | None = None,
                profile: bool = False):  # fmt: skip
    """Seconds per step of mt3d at tp = pp = dp = 1 (inside a one-rank process group); ``offload``: a
    planner label (opt-cpu: the optimizer on the CPU, DeepSpeedCPUAdam); ``fp8``: a ``train.fp8``
    recipe; ``profile``: also the top kernels of one more step (``kernel_table``)."""
    from ..config import Offload, from_dict, resolve_model, validate
    from ..data.loader import StepBatches
    from ..train import preflight
    from ..training.runtime import setup
    from ..training.session import build_engine

    raw = {
        **_ds_config(micro, accum),
        "mt3d": {
            "model": model,
            "data": {"seq_len": seq, "corpus": "synthetic"},
            "train": {"compile": compile_blocks, "recompute": RECOMPUTE_KEYS[recompute]},
        },
    }
    if fp8:
        raw["mt3d"]["train"]["fp8"] = {"recipe": fp8}
    if offload != "none":  # DeepSpeed's CPU Adam steps the offloaded states (torch's fused AdamW cannot)
        raw["optimizer"]["params"] = {k: v for k, v in raw["optimizer"]["params"].items()
                                      if k not in ("torch_adam", "fused")}  # fmt: skip
        raw["zero_optimization"].update(Offload.from_label(offload).ds_keys())
    run = from_dict(raw)
    cfg = resolve_model(run.mt3d.model)
    layout = validate(run, 1, cfg)
    preflight(run, layout, cfg)
    rt = setup(run.mt3d.parallel, run.mt3d.train.seed)
    # random weights drawn on the device: the CPU init of 1B weights takes minutes
    engine, _ = build_engine(run, layout, rt, cfg, cfg.vocab_size, fast_init=True)
    data = RandomTokens(cfg.vocab_size, seq)
    k = iter(range(10**9))

    def step():
        it = StepBatches(
            data,
            global_batch=micro * accum,
            micro_batch=micro,
            grad_accum=accum,
            dp_rank=0,
            start_step=next(k),
            device=rt.device,
        )
        engine.train_batch(data_iter=it)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seconds = _time_steps(step, steps, warmup, dev)
    mem = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return {
        "seconds": seconds,
        "flops_per_token": cfg.flops_per_token(seq, cfg.vocab_size),
        "peak_mem_gb": mem,
        "params": cfg.num_params(),
        "kernels": kernel_table(step, dev) if profile else None,
    }


def kernel_table(step, device: str, top: int = 25) -> str:
    """The ``top`` kernels (or CPU ops) of one ``step`` by their own time, as torch's profiler prints them."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    cuda_keys = ("self_device_time_total", "self_cuda_time_total")
    keys = cuda_keys if device == "cuda" else ("self_cpu_time_total",)
    for key in keys:  # torch renamed the CUDA column to "device" (older builds know one name only)
        try:
            return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return prof.key_averages().table(row_limit=top, max_name_column_width=60)


def hf_worker(name: str, model: dict, seq: int, micro: int, accum: int, steps: int, warmup: int):
    """Seconds per step of the same architecture in transformers under deepspeed.initialize."""
    import deepspeed

    from ..config import resolve_model

    cfg = resolve_model(model)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_device(dev)  # built (and initialised) on the device
    hf = hf_twin(cfg)
    torch.set_default_device("cpu")
    engine, _, _, _ = deepspeed.initialize(
        model=hf, model_parameters=hf.parameters(), config=_ds_config(micro, accum)
    )
    data = RandomTokens(cfg.vocab_size, seq)
    k = iter(range(10**9))

    def step():
        for _ in range(accum):
            i = next(k)
            x = torch.stack([torch.from_numpy(data[i * micro + j][:-1]) for j in range(micro)]).to(
                engine.device
            )
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()

    seconds = _time_steps(step, steps, warmup, dev)
    mem = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return {
        "seconds": seconds,
        "peak_mem_gb": mem,
        "flops_per_token": cfg.flops_per_token(seq, cfg.vocab_size),
    }


PRESETS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"))
"""Planner presets by a substring of ``torch.cuda.get_device_name()``."""


def predicted(model: dict, seq: int, micro: int, accum: int, recompute: str, smoke: bool,
              offload: str = "none", fp8: str | None = None) -> dict:  # fmt: skip
    """The planner's step time and GPU memory (GB) for one mt3d row (one GPU, ZeRO-1, bf16), on the
    preset of the GPU at hand (an H200, H100 or A100 by name; None on other devices and in smoke
    mode)."""
    if smoke or not torch.cuda.is_available():
        return {"predicted_s": None, "predicted_gb": None}
    from ..config import resolve_model
    from ..planner.costs import Layout, Precision, memory_bytes, step_time
    from ..planner.hardware import get_device
    from ..planner.search import Cluster, bandwidths

    name = torch.cuda.get_device_name().lower()
    preset = next((p for key, p in PRESETS if key in name), None)
    if preset is None:
        return {"predicted_s": None, "predicted_gb": None}
    cfg, dev = resolve_model(model), get_device(preset)
    lay = Layout(1, 1, 1, micro, accum, 1, recompute == "full", False, selective=recompute == "selective",
                 offload=offload)  # fmt: skip
    t = step_time(cfg, cfg.vocab_size, seq, micro * accum, lay, peak_tflops=dev.peak_tflops, efficiency=None,
                  bw=bandwidths(Cluster(1, 1, dev), 1, 1), device=dev, fp8=fp8)  # fmt: skip
    mem = memory_bytes(cfg, cfg.vocab_size, seq, lay, Precision.of("bf16", 1))
    return {"predicted_s": t["step_time_s"], "predicted_gb": mem["total"] / 1e9}


def _rows(name: str, results: dict, tokens: int, dense_peak: float, measured_peak: float) -> list[dict]:
    """One table row per framework measured on model ``name``."""
    fpt = next(iter(results.values()))["flops_per_token"]
    hf = results.get("transformers+deepspeed")
    hf_tps = tokens / hf["seconds"] if hf else None
    rows = []
    for label, res in results.items():
        tps = tokens / res["seconds"]
        tflops = fpt * tps / 1e12
        rows.append({
            "model": name,
            "framework": label,
            "tokens_per_s": tps,
            "tflops": tflops,
            "mfu_dense": tflops / dense_peak,
            "of_measured_peak": tflops / measured_peak,
            "vs_transformers": tps / hf_tps if hf_tps else None,
            "peak_mem_gb": res.get("peak_mem_gb"),
            "step_s": res["seconds"],
            "planner_s": res.get("predicted_s"),
            "planner_gb": res.get("predicted_gb"),
        })  # fmt: skip
    return rows


def row_runs(args, smoke: bool) -> list[tuple]:
    """The mt3d rows of one model: (label, compiled, recompute, offload, fp8 recipe). Compiled blocks at
    recompute none only (the MFU row) unless only compiled rows are asked for, the recompute modes
    without compiling, FP8 rows compiled when the benchmark compiles, one uncompiled row per offload."""
    modes = getattr(args, "recompute", None) or ("none",)
    variants = [("mt3d", False)] + ([("mt3d+compile", True)] if args.compile and not smoke else [])
    if getattr(args, "compile_only", False) and not smoke:
        variants = [("mt3d+compile", True)]
    runs = [(label if mode == "none" else f"{label} recompute={mode}", comp, mode, "none", None)
            for label, comp in variants for mode in modes
            if not comp or mode == "none" or len(variants) == 1]  # fmt: skip
    label, comp = variants[-1]
    runs += [(f"{label} fp8={r}", comp, "none", "none", r) for r in getattr(args, "fp8", ())]
    offloads = getattr(args, "offload", None) or ()
    return runs + [(f"mt3d offload={off}", False, "none", off, None) for off in offloads if off != "none"]


def _row(what: str, worker, *argv) -> dict | None:
    """One measured row in a process of its own; a row that fails (out of memory, a compiler error) is
    said in one line and the others still run (a GPU record has one call to get them all)."""
    from ..parallel.spawn import WorkerError, spawn

    try:
        return spawn(worker, 1, *argv, timeout=1500)[0]
    except WorkerError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1:]
        print(f"{what}: FAILED: {last[0] if last else e}", flush=True)
        return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench gpu``."""

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no GPU here: run with --smoke for the CPU check of this benchmark")
        return emit("gpu", {"skipped": "no GPU"})
    smoke = args.smoke or not cuda
    device = "cuda" if cuda else "cpu"
    models = {k: v for k, v in (SMOKE if smoke else MODELS).items() if k in getattr(args, "models", MODELS)}
    seq = 32 if smoke else args.seq_len
    micro, accum = (2, 1) if smoke else (args.micro, args.accum)
    steps, warmup = (2, 1) if smoke else (args.steps, args.warmup)
    measured_peak = matmul_peak(device, 256 if smoke else 8192, 3 if smoke else 10)
    from ..training.metrics import device_peak_tflops

    dense_peak, source = device_peak_tflops(None) if cuda else (measured_peak, "measured CPU fp32 matmul")
    rows = []
    for name, model in models.items():
        results = {}
        for i, (key, comp, mode, off, fp8) in enumerate(row_runs(args, smoke)):
            prof = bool(getattr(args, "profile", False)) and i == 0
            argv = (model, seq, micro, accum, steps, warmup, comp, mode, off, fp8, prof)
            got = _row(f"{name} {key}", mt3d_worker, *argv)
            if got is None:
                continue
            results[key] = {**got, **predicted(model, seq, micro, accum, mode, smoke, off, fp8)}
            if results[key].get("kernels"):
                print(f"{name} {key}: one step's top kernels\n{results[key].pop('kernels')}", flush=True)
            print(f"{name} {key}: {results[key]['seconds']:.4f} s per step", flush=True)
        if not getattr(args, "no_hf", False):
            got = _row(f"{name} transformers", hf_worker, name, model, seq, micro, accum, steps, warmup)
            if got is not None:
                results["transformers+deepspeed"] = got
        if results:
            rows += _rows(name, results, micro * accum * seq, dense_peak, measured_peak)
    gpu = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    print(
        f"{gpu}: dense peak {dense_peak:.0f} TFLOP/s ({source}), measured matmul peak "
        f"{measured_peak:.0f} TFLOP/s; seq {seq}, micro {micro} x accum {accum}"
    )
    print(
        table(
            rows,
            [
                "model",
                "framework",
                "tokens_per_s",
                "tflops",
                "mfu_dense",
                "of_measured_peak",
                "vs_transformers",
                "peak_mem_gb",
                "step_s",
                "planner_s",
                "planner_gb",
            ],
        )
    )
    return emit(
        "gpu",
        {
            "device": gpu,
            "dense_peak": dense_peak,
            "measured_peak": measured_peak,
            "seq_len": seq,
            "micro": micro,
            "accum": accum,
            "rows": rows,
            "smoke": smoke,
        },
    )


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["model"],
            x["framework"],
            _f(x["tokens_per_s"]),
            _f(x["tflops"]),
            _f(x["mfu_dense"], True),
            _f(x["vs_transformers"]),
        ]
        for x in r.get("rows", [])
    ]
    return ["model", "framework", "tokens/s", "TFLOP/s", "MFU (dense)", "vs transformers"], rows
