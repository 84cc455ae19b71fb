"""Run a function on N local processes with torch.distributed initialised (tests and benchmarks).

``spawn(fn, world_size, *args)`` starts one process per rank (gloo on CPU, NCCL when there are
enough GPUs), initialises DeepSpeed's communication layer in each, calls ``fn(*args)`` and returns
the per-rank results. A failure in any rank raises ``WorkerError`` carrying that rank's traceback;
a run longer than ``timeout`` seconds is killed and raises too. Processes fork from a forkserver
that has already imported torch and DeepSpeed, so a rank starts in well under a second.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PRELOAD = ["torch", "torch.distributed", "deepspeed", "mt3d.parallel.layers"]


class WorkerError(RuntimeError):
    """A rank raised, died, or the whole run timed out."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, else gloo."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _pack(obj: Any) -> bytes:
    # torch's multiprocessing pickler would pass tensors as shared-memory handles owned by the
    # sending process, which is gone by the time the parent reads them: send plain bytes.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # our own children's results


def _worker(rank, world_size, port, backend, timeout, env, fn, args, results) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
    )
    os.environ.update(env)
    ok = False
    try:
        import deepspeed
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout), verbose=False)
        out = fn(*args)
        results.put((rank, "ok", _pack(out)))
        ok = True
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if ok:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    backend: str | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks; return the list of per-rank return values.

    ``fn`` and ``args`` must be picklable (a module-level function). ``env`` is added to each
    rank's environment.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    backend = backend or pick_backend(world_size)
    port = free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, timeout, dict(env or {}), fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    first_error_at = None
    while len(out) + len(errors) < world_size:
        now = time.monotonic()
        if first_error_at is not None and now > first_error_at + 5:
            break  # the other ranks are most likely stuck in a collective with the failed one
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(out) - set(errors))
            raise WorkerError(f"timed out after {timeout:.0f}s; ranks {missing} did not finish")
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [
                i
                for i, p in enumerate(procs)
                if not p.is_alive() and p.exitcode not in (0, None) and i not in errors
            ]
            for i in dead:
                if i not in out:
                    errors[i] = f"process exited with code {procs[i].exitcode} without reporting"
                    first_error_at = first_error_at or time.monotonic()
            continue
        if status == "ok":
            out[rank] = _unpack(payload)
        else:
            errors[rank] = payload
            first_error_at = first_error_at or time.monotonic()
    if errors:
        for i, p in enumerate(procs):
            p.join(timeout=0.5)
            if p.exitcode not in (0, None) and i not in out and i not in errors:
                errors[i] = f"process exited with code {p.exitcode} without reporting"
        # A rank that died silently is the likeliest cause; otherwise the first to report (the
        # others typically fail in a collective with it).
        silent = [i for i, e in errors.items() if e.startswith("process exited")]
        rank = silent[0] if silent else next(iter(errors))
        others = f" (ranks failing: {sorted(errors)})" if len(errors) > 1 else ""
        raise WorkerError(f"rank {rank} failed{others}:\n{errors[rank]}")
    for p in procs:
        p.join(timeout=30)
    return [out[r] for r in range(world_size)]
