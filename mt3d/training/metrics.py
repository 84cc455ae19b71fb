"""Throughput, FLOPs, MFU, memory, and where metrics go (stdout, metrics.jsonl, W&B).

MFU counts model FLOPs (no recompute) per FORMULAS.md against the device's dense peak: the
detected GPU's dense bf16 figure, a configured number, or on CPU a matmul measured at start-up.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from pathlib import Path

import torch

log = logging.getLogger("mt3d")


def measure_cpu_tflops(seconds: float = 0.3, n: int = 512) -> float:
    """fp32 matmul TFLOP/s of this process with its current thread count (a stand-in CPU peak)."""
    g = torch.Generator().manual_seed(0)  # never touch the training RNG streams
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm-up
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def device_peak_tflops(configured: float | None) -> tuple[float, str]:
    """(peak TFLOP/s, where it came from) for MFU."""
    if configured:
        return float(configured), "configured"
    if torch.cuda.is_available():
        from ..planner.hardware import dense_peak_tflops

        name = torch.cuda.get_device_name()
        peak = dense_peak_tflops(name)
        if peak is not None:
            return peak, f"{name} dense bf16"
        return float("nan"), f"{name} (unknown peak; set mt3d.train.peak_tflops)"
    return measure_cpu_tflops(), "measured CPU fp32 matmul"


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated (GPU) or peak resident set size (CPU), in GB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def step_figures(
    *, tokens: int, seconds: float, flops_per_token: float, world: int, peak_tflops: float
) -> dict:
    """tokens/s, model TFLOP/s per device and MFU of one step."""
    tps = tokens / seconds
    tflops = flops_per_token * tps / world / 1e12
    mfu = tflops / peak_tflops if peak_tflops and not math.isnan(peak_tflops) else float("nan")
    return {"tokens_per_s": tps, "tflops_per_gpu": tflops, "mfu": mfu}


def router_figures(loss_fn, contributes: bool, device) -> dict:
    """A sparse model's router figures for one training step, the same on every rank (a collective over
    all ranks: call it everywhere). ``contributes``: this rank's ``loss_fn`` holds the step's router
    log (one rank per data-parallel replica: TP and cp rank 0 of the last pipeline stage). Figures:
    the load-balancing and z losses (means over micro-batches), tokens per expert max / mean (summed
    over micro-batches, layers and data-parallel ranks: 1.0 is perfect balance) and the (token, slot)
    assignments dropped by the capacity limit."""
    import torch.distributed as dist

    log = loss_fn.router_log if contributes else []
    experts = loss_fn.moe.experts
    totals = torch.zeros(experts + 4, dtype=torch.float64, device=device)
    for entry in log:  # tensor adds on the device: no host round trip per micro-batch
        totals[: experts + 1] += entry["counts"].to(device=device, dtype=torch.float64)
        totals[experts + 1] += entry["aux"].to(device=device, dtype=torch.float64)
        totals[experts + 2] += entry["z"].to(device=device, dtype=torch.float64)
        totals[experts + 3] += 1
    loss_fn.router_log.clear()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    counts, n = totals[:experts], max(1.0, float(totals[experts + 3]))
    return {
        "moe_aux_loss": float(totals[experts + 1]) / n,
        "moe_z_loss": float(totals[experts + 2]) / n,
        "expert_load_max_over_mean": float(counts.max() / counts.mean().clamp(min=1e-9)),
        "dropped_tokens": int(totals[experts]),
    }


def mtp_figures(loss_fn, contributes: bool, device, depths: int) -> dict:
    """Multi-token prediction's losses for one training step (a collective over all ranks): each depth's
    cross entropy, averaged over micro-batches and data-parallel and cp ranks (``contributes``: this
    rank's ``loss_fn`` holds some: TP rank 0 of the loss's stage). ``mtp_loss`` is their mean."""
    import torch.distributed as dist

    totals = torch.zeros(depths + 1, dtype=torch.float64, device=device)
    for entry in loss_fn.mtp_log if contributes else []:
        totals[:depths] += entry.to(device=device, dtype=torch.float64)
        totals[depths] += 1
    loss_fn.mtp_log.clear()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    per = (totals[:depths] / totals[depths].clamp(min=1)).tolist()
    return {"mtp_loss": sum(per) / depths, **{f"mtp_loss_{k + 1}": v for k, v in enumerate(per)}}


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


class MetricsLog:
    """Append-only ``metrics.jsonl`` (one JSON object per line, flushed each time) plus W&B."""

    def __init__(self, path: Path, wandb_run=None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self.wandb = wandb_run

    def write(self, record: dict, wandb_step: int | None = None) -> None:
        """Write one record; also to W&B (prefixed ``mt3d/``) at ``wandb_step`` when a run is open."""
        record = {k: _clean(v) for k, v in record.items()}
        self._f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            numeric = {
                f"mt3d/{k}": v for k, v in record.items() if isinstance(v, int | float) and v is not None
            }
            self.wandb.log(numeric, step=wandb_step)

    def close(self) -> None:
        """Close the file (W&B is finished by its owner)."""
        self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl. A torn last line (a run killed while writing) is ignored;
    anything else that is not one JSON object with an integer ``step`` is refused with file:line."""
    from ..errors import UserError
    from ..inputs import read_text

    lines = read_text(path, "metrics file").splitlines()
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                continue
            raise UserError(f"{path}:{lineno}: not a JSON record (a corrupt metrics file)") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError(f"{path}:{lineno}: a metrics record must be an object with an integer 'step'")
        out.append(record)
    return out


def start_wandb(wb: dict, run_name: str, mode: str, save_dir: Path, config: dict, stopping=None):
    """Open the W&B run on rank 0 (``WandbSink``), or None when W&B is not enabled: ``wb`` is the
    config's ``wandb`` section (DeepSpeed's keys: enabled, project, group, team).

    Offline unless the user configured otherwise (WANDB_MODE in the environment wins). mt3d logs
    every figure itself; DeepSpeed's own W&B monitor is switched off (``mt3d.ds.engine.deepspeed_config``).
    """
    if not wb.get("enabled"):
        return None
    os.environ.setdefault("WANDB_MODE", mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    save_dir.mkdir(parents=True, exist_ok=True)
    import wandb

    run = wandb.init(
        project=wb.get("project", "mt3d"),
        group=wb.get("group"),
        entity=wb.get("team"),
        name=run_name,
        config=config,
        dir=str(save_dir),
    )
    return WandbSink(run, stopping)


class WandbSink:
    """A W&B run used best-effort: metrics.jsonl is the record, W&B a view of it.

    W&B talks to a helper process (``wandb-core``). The ``deepspeed`` launcher, on SIGTERM,
    terminates every descendant of its workers, that helper included, while the workers are
    still saving their preemption checkpoint; a ``wandb.log`` then raises ConnectionResetError.
    So every call here is non-fatal (the first failure is reported once and W&B is switched off
    for the rest of the run), and once ``stopping()`` is true no call is made at all.
    """

    def __init__(self, run, stopping=None) -> None:
        self.run = run
        self.stopping = stopping or (lambda: False)
        self.failed = False

    def _call(self, what: str, fn, *args, quiet: bool = False, **kwargs) -> None:
        if self.failed or self.stopping():
            return
        # W&B's own debug logger writes into the run directory; on a full disk each of its records
        # would print a "--- Logging error ---" traceback (logging.raiseExceptions) amid mt3d's one line.
        raising, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - W&B is never worth a run
            self.failed = True
            if quiet:
                return
            log.warning("W&B %s failed (%s: %s); W&B is off for the rest of the run, metrics.jsonl continues",
                        what, type(e).__name__, e)  # fmt: skip
        finally:
            logging.raiseExceptions = raising

    def log(self, data: dict, step: int | None = None) -> None:
        """wandb.log."""
        self._call("log", self.run.log, data, step=step)

    def abandon(self) -> None:
        """Finish a failed run's W&B run quietly and switch W&B off (nothing more is logged): the run's
        own error is the one line to read, also when W&B cannot finish either (a full disk)."""
        self._call("finish", self.run.finish, exit_code=1, quiet=True)
        self.failed = True

    def finish(self, summary: dict | None = None) -> None:
        """Update the run summary and finish the run (skipped while stopping: the files stay offline)."""
        if summary:
            self._call("summary", self.run.summary.update, summary)
        self._call("finish", self.run.finish)
