"""``memory``: measured peak memory per rank against the planner's prediction, on CPU.

Each layout trains two steps (fp32, dropout off) of the benchmark model and of a "null" model with
the same structure but hidden size 16, in separate processes. Memory is resident set size: the
worker sets glibc's mmap threshold to 64 KiB (freed tensors go back to the OS at once) and reports
the peak RSS (``ru_maxrss``) above the RSS before the model was built. The null model's peak is
what the layout costs whatever the model (process groups, DeepSpeed set-up, the CPU backend's
first-step buffers: about 0.1-0.2 GB here); the difference is what the model costs, and is compared
with the planner's ``memory_bytes`` for the same difference. Target: within 15 %.
"""

from __future__ import annotations

import ctypes
import functools
import resource

from .common import bench_run_config, build_engine, emit, table, train_step

MODEL = dict(preset="tiny", hidden=512, layers=8, heads=8, max_seq_len=256)
NULL = dict(preset="tiny", hidden=16, layers=8, heads=4, max_seq_len=256)
BUCKET = 1_000_000  # ZeRO bucket elements, set in both the run and the prediction
SUB_GROUP = 2_000_000  # ZeRO-3 sub-group elements with NVMe: 4 pinned swap buffers of this, not of all
# tp, pp, dp, zero, recompute (True: full; "selective"), sequence parallel (True; "gathered": linear
# inputs kept whole), offload
LAYOUTS = [
    (1, 1, 1, 0, False, False, "none"),
    (1, 1, 2, 1, False, False, "none"),
    (1, 1, 2, 2, False, False, "none"),
    (1, 1, 2, 3, False, False, "none"),
    (2, 1, 1, 0, False, False, "none"),
    (2, 1, 1, 0, False, True, "none"),
    (2, 1, 1, 0, False, "gathered", "none"),  # the saving of keeping the 1/tp shards of linear inputs
    (2, 1, 1, 0, "selective", True, "none"),  # and of selective recompute
    (1, 1, 1, 0, "selective", False, "none"),
    (1, 2, 1, 1, False, False, "none"),
    (2, 2, 1, 1, True, False, "none"),
    (1, 1, 1, 0, True, False, "none"),
    (1, 1, 2, 1, False, False, "opt-cpu"),
    (1, 1, 2, 3, False, False, "opt-cpu"),
    (1, 1, 2, 3, False, False, "opt-nvme"),
]
"""Offload rows: on a CPU machine the accelerator's memory and the CPU tier are the same RAM, so the
prediction is both tiers (``memory_bytes`` total + cpu); what goes to NVMe leaves the RSS."""


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def worker(model, tp, pp, zero, recompute, sp, seq, micro, accum, offload="none", nvme=None, *, cp=1,
           tile_len=0, vocab=512, cap=None, keep_logits=False) -> dict:  # fmt: skip
    """Train two steps; return peak RSS above the pre-model baseline (bytes). ``cap``: bytes of address
    space the process may add to what it holds before the model is built (RLIMIT_AS); a run that
    needs more fails, and ``ok`` says whether it did. ``keep_logits``: DeepSpeed's own forward pass
    (``mt3d.ds.engine.release_loss_outputs`` undone)."""
    from ..config.rules import uses_pipeline_engine
    from ..ds.engine import keep_loss_outputs

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks are mmapped and returned on free

    raw = bench_run_config(model=model, tp=tp, pp=pp, seq_len=seq, micro=micro, global_batch=0, zero=zero,
                           recompute=1 if recompute is True else 0, sequence_parallel=bool(sp), vocab=vocab,
                           context=cp, tile_len=tile_len)  # fmt: skip
    rec = raw["mt3d"]["train"].setdefault("recompute", {})
    rec["gathered_sp_inputs"] = sp == "gathered"
    rec["granularity"] = "selective" if recompute == "selective" else "full"
    import torch.distributed as dist

    dp = dist.get_world_size() // (tp * pp * cp)
    raw["train_batch_size"] = micro * accum * dp
    buckets = dict(
        reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET, stage3_prefetch_bucket_size=BUCKET
    )
    raw["zero_optimization"].update(buckets, stage3_param_persistence_threshold=0)
    from ..config import Offload

    raw["zero_optimization"].update(Offload.from_label(offload, nvme).ds_keys())
    if "nvme" in offload:
        raw["zero_optimization"]["sub_group_size"] = SUB_GROUP
    from ..config import DataConfig
    from ..data.loader import build_data

    build_data(
        DataConfig(corpus="synthetic", vocab_size=vocab, seq_len=seq), 1234
    )  # corpus cached before baseline
    base, base_vm = _rss_kb(), _status_kb("VmSize")
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_AS, (base_vm * 1024 + cap, resource.RLIM_INFINITY))
    try:
        _, layout, rt, engine, data, _ = build_engine(raw)
        if keep_logits and uses_pipeline_engine(layout):
            keep_loss_outputs(engine)
        for k in range(2):
            train_step(engine, layout, rt, data, micro, k)
    except (MemoryError, RuntimeError) as e:
        if cap is None or "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        return {"ok": False, "error": str(e).splitlines()[0][:200], "stage": 0, "measured": None}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vm_added = (_status_kb("VmPeak") - base_vm) * 1024
    return {"ok": True, "measured": (peak - base) * 1024, "vm_added": vm_added, "stage": rt.state.pp.rank}


def predict(model, tp, pp, dp, zero, recompute, sp, seq, micro, accum, offload="none", *, cp=1, tile_len=0,
            vocab=512) -> dict:  # fmt: skip
    """The planner's bytes (by component) for the heaviest stage of this layout; ``rss``: what a
    CPU run holds in RAM (the accelerator's share and the CPU tier)."""
    from ..config import resolve_model
    from ..planner.costs import Layout, Precision, memory_bytes

    cfg = resolve_model(model)
    lay = Layout(tp, pp, dp, micro, accum, zero, recompute is True, bool(sp), offload=offload, cp=cp,
                 tile_len=tile_len, sp_gathered=sp == "gathered",
                 selective=recompute == "selective")  # fmt: skip
    mem = memory_bytes(cfg, vocab, seq, lay, Precision.of("fp32", zero), bucket_elems=BUCKET,
                       sub_group_size=SUB_GROUP if "nvme" in offload else None)  # fmt: skip
    return {**mem, "rss": mem["total"] + mem["cpu"]}


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can)."""
    bad = [r for r in args.rows or () if r > len(LAYOUTS)]
    if bad:
        return f"--rows {bad[0]}: there are {len(LAYOUTS)} layouts (1-{len(LAYOUTS)})"
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench memory``."""
    import tempfile

    from ..parallel.spawn import spawn

    rows = []
    chosen = [LAYOUTS[i - 1] for i in args.rows] if args.rows else LAYOUTS[: args.layouts]
    for tp, pp, dp, zero, rc, sp, off in chosen:
        with tempfile.TemporaryDirectory(prefix="mt3d-nvme-") as nvme:
            common = (tp, pp, zero, rc, sp, args.seq_len, args.micro, args.accum, off, nvme)
            run_at = functools.partial(worker, vocab=args.vocab, keep_logits=args.keep_logits)
            full = max(r["measured"] for r in spawn(run_at, tp * pp * dp, MODEL, *common, timeout=900))
            null = max(r["measured"] for r in spawn(run_at, tp * pp * dp, NULL, *common, timeout=900))
        shape = (tp, pp, dp, zero, rc, sp, args.seq_len, args.micro, args.accum, off)
        pred = predict(MODEL, *shape, vocab=args.vocab)["rss"]
        pred -= predict(NULL, *shape, vocab=args.vocab)["rss"]
        rows.append({"tp": tp, "pp": pp, "dp": dp, "zero": zero, "recompute": rc, "sp": sp, "offload": off,
                     "peak_mb": full / 1e6, "fixed_mb": null / 1e6, "measured_mb": (full - null) / 1e6,
                     "predicted_mb": pred / 1e6, "ratio": (full - null) / pred})  # fmt: skip
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    print(
        f"peak memory of the heaviest rank, fp32, CPU: {within}/{len(rows)} layouts within 15% of the planner"
    )
    print(table(rows, ["tp", "pp", "dp", "zero", "recompute", "sp", "offload", "peak_mb", "fixed_mb",
                       "measured_mb", "predicted_mb", "ratio"]))  # fmt: skip
    return emit("memory", {"rows": rows, "within_15pct": within, "model": MODEL, "seq_len": args.seq_len,
                           "vocab": args.vocab, "keep_logits": args.keep_logits})  # fmt: skip


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["tp"],
            x["pp"],
            x["dp"],
            x["zero"],
            x["recompute"],
            x["sp"],
            x.get("offload", "none"),
            _f(x["measured_mb"]),
            _f(x["predicted_mb"]),
            _f(x["ratio"]),
        ]
        for x in r["rows"]
    ]
    return [
        "tp",
        "pp",
        "dp",
        "ZeRO",
        "recompute",
        "SP",
        "offload",
        "measured MB",
        "planner MB",
        "ratio",
    ], rows
