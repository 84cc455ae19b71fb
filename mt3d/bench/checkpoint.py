"""``checkpoint``: save and load time and bytes of mt3d's checkpoints beside the raw disk write speed.

For each model size, one rank trains one step (so optimizer states exist), then: a save through
mt3d's Checkpointer (DeepSpeed's files, fsync, sha256 manifest, atomic rename), and a resume-style
load (manifest verification, then DeepSpeed's load). In the same run the same number of bytes is
written with plain ``write`` + ``fsync`` to the same directory: the raw speed. Ratios: checkpoint
MB/s over raw MB/s, and the share of the save spent hashing/committing.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .common import bench_run_config, build_engine, emit, table

SIZES = {
    "tiny": dict(preset="tiny", hidden=64, layers=4, heads=4, max_seq_len=128),
    "100m": dict(preset="gpt2-small"),
    "1b": dict(preset="gpt3-1.3b"),
}


def raw_write(path: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` of incompressible data and fsync it."""
    block = os.urandom(min(chunk, max(nbytes, 1)))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def worker(size: str, root: str) -> dict:
    """One rank: a step, a timed save, a timed load, and the raw write of the same byte count."""
    import torch

    from ..checkpoint.manager import Checkpointer
    from ..checkpoint.manifest import read_manifest, verify_everywhere
    from ..data.loader import StepBatches

    raw = bench_run_config(
        model=SIZES[size],
        seq_len=64,
        micro=1,
        global_batch=1,
        save_dir=root,
        bf16=torch.cuda.is_available(),
        vocab=512,
    )
    run, layout, rt, engine, data, cfg = build_engine(raw, fast_init=True)
    engine.train_batch(
        data_iter=StepBatches(data.train, global_batch=1, micro_batch=1, grad_accum=1, dp_rank=0)
    )
    ckpt = Checkpointer(
        engine,
        root,
        meta=lambda: {"model": cfg.to_dict(), "layout": {}, "vocab_size": 512},
        client_state=lambda step: {},
        tracker=rt.tracker,
    )
    t0 = time.perf_counter()
    orig = engine.save_checkpoint
    ds_time = {}

    def timed_save(*a, **k):
        s = time.perf_counter()
        r = orig(*a, **k)
        ds_time["s"] = time.perf_counter() - s
        return r

    engine.save_checkpoint = timed_save
    path = ckpt.save(1)
    save_s = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    t0 = time.perf_counter()
    verify_everywhere(path, read_manifest(path))
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.load_checkpoint(str(path.parent), tag=path.name)
    load_s = time.perf_counter() - t0 + verify_s
    raw_s = raw_write(Path(root) / "raw.bin", nbytes)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "params": cfg.num_params(512),
        "bytes": nbytes,
        "save_s": save_s,
        "deepspeed_save_s": ds_time["s"],
        "load_s": load_s,
        "verify_s": verify_s,
        "raw_write_s": raw_s,
    }


def check_args(args) -> str | None:
    """Where the benchmark writes must be writable (a one-line error otherwise, before any work)."""
    from ..config.preflight import writable_dir

    if args.dir is not None:
        writable_dir(args.dir, "--dir")
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench checkpoint``."""
    from ..parallel.spawn import spawn

    rows = []
    for size in args.sizes:
        root = str(Path(args.dir) / f"mt3d-ckpt-bench-{size}")
        r = spawn(worker, 1, size, root, timeout=1800)[0]
        gb = r["bytes"] / 1e9
        rows.append(
            {
                "model": size,
                "params": r["params"],
                "gb": gb,
                "save_s": r["save_s"],
                "commit_share": 1 - r["deepspeed_save_s"] / r["save_s"],
                "load_s": r["load_s"],
                "raw_write_gbps": gb / r["raw_write_s"],
                "save_gbps": gb / r["save_s"],
                "save/raw": r["raw_write_s"] / r["save_s"],
                "load_gbps": gb / r["load_s"],
            }
        )
    print("checkpoint save/load (one rank) against a plain write+fsync of the same bytes in the same run")
    print(
        table(
            rows,
            [
                "model",
                "params",
                "gb",
                "save_s",
                "commit_share",
                "load_s",
                "raw_write_gbps",
                "save_gbps",
                "save/raw",
                "load_gbps",
            ],
        )
    )
    return emit("checkpoint", {"rows": rows})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["model"],
            _f(x["gb"]),
            _f(x["save_s"]),
            _f(x["load_s"]),
            _f(x["raw_write_gbps"]),
            _f(x["save_gbps"]),
            _f(x["save/raw"]),
        ]
        for x in r["rows"]
    ]
    return ["model", "GB", "save s", "load s", "raw write GB/s", "save GB/s", "save/raw"], rows
