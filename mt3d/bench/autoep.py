"""``python -m mt3d.bench autoep``: mt3d against DeepSpeed's AutoEP on the same HF Mixtral at ep 2.

Both fine-tune the same saved model (``autoep_peer.SHAPE``: 8 experts, top-2, no aux loss) on the
same token batches (each rank its own micro-batch of 2 x 64 tokens per step), ZeRO-1, fp32, torch's
AdamW (lr 1e-3, betas 0.9/0.999, no weight decay), gradients clipped at 1, one thread per process:
mt3d with ``parallel.expert: 2`` in its own process group, AutoEP under ``torch.distributed.run`` in a
virtualenv of its own (``--venv``, built when missing: the pinned torch and DeepSpeed with
transformers 5.22.2, the newest AutoEP runs with). Runs alternate in A/B pairs (which goes first
alternates too); each run's step time is the median of its steps after ``WARMUP``; the figure is the
median over pairs of mt3d's over AutoEP's. Losses and gradient norms are printed side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..parallel.spawn import spawn
from .common import emit, table

PEER_TRANSFORMERS = "5.22.2"
"""The newest transformers the pinned DeepSpeed's AutoEP runs with: with 5.23 ``deepspeed.initialize`` fails
(its Mixtral preset calls transformers' output-recorder registry's ``get`` with a default, which 5.23's
registry does not take)."""
WARMUP = 3
"""Steps left out of each run's step time."""
MICRO, SEQ = 2, 64
PEER = Path(__file__).with_name("autoep_peer.py")


def peer_python(venv: Path) -> Path:
    """The AutoEP virtualenv's python; the virtualenv is built when it is missing (torch pinned by
    launch/constraints.txt, DeepSpeed at mt3d's pin, ``PEER_TRANSFORMERS``)."""
    from ..versions import pinned_version

    py = venv / "bin" / "python"
    if py.exists():
        return py
    constraints = Path(__file__).resolve().parents[2] / "launch" / "constraints.txt"
    print(f"building the AutoEP virtualenv {venv} (minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pin = ["-c", str(constraints)] if constraints.is_file() else []
    install = [str(py), "-m", "pip", "install", "-q", *pin]
    subprocess.run([*install, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    deepspeed = f"deepspeed=={pinned_version()}" if pinned_version() else "deepspeed"
    subprocess.run([*install, deepspeed, f"transformers=={PEER_TRANSFORMERS}"], check=True)
    return py


def token_batches(steps: int, world: int, seed: int = 4321) -> torch.Tensor:
    """[steps, world, MICRO, SEQ + 1] learnable token rows: (start + stride t) mod 512."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 512, (steps, world, MICRO, 1), generator=g)
    stride = torch.randint(1, 8, (steps, world, MICRO, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % 512


def mt3d_worker(model_dir: str, tokens: str, save_dir: str, ep: int) -> dict:
    """mt3d's run: ``model.from_hf`` at ``parallel.expert: ep``, the same optimizer and batches."""
    import time

    import torch.distributed as dist

    from ..parallel.mappings import all_reduce
    from .autoep_peer import CLIP, OPTIMIZER
    from .common import bench_run_config, build_engine

    world = dist.get_world_size()
    raw = bench_run_config(model={"from_hf": model_dir}, global_batch=MICRO * world, micro=MICRO, seq_len=SEQ,
                           save_dir=save_dir)  # fmt: skip
    raw.update(optimizer=OPTIMIZER, gradient_clipping=CLIP)
    raw["mt3d"]["parallel"]["expert"] = ep
    _, _, rt, engine, _, _ = build_engine(raw)
    batches, me = torch.load(tokens), dist.get_rank()
    steps = []
    for s in range(batches.shape[0]):
        rows = batches[s, me]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=iter([(rows[:, :-1], rows[:, 1:])]))
        dist.barrier()
        seconds = time.perf_counter() - t0
        mean = loss.detach().float().clone()
        all_reduce(mean, rt.state.ep)  # DeepSpeed averaged over its 'data' axis (dp / ep x cp)
        steps.append(
            {
                "loss": mean.item() / rt.state.ep.size,
                "grad_norm": float(engine.get_global_grad_norm()),
                "step_s": seconds,
            }
        )
    return {"steps": steps, "optimizer": type(engine.optimizer).__name__}


def run_peer(py: Path, model_dir: str, tokens: str, out: str, ep: int, world: int) -> dict:
    """AutoEP's run (``autoep_peer.py train``) on ``world`` processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        str(py),
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--master_port=29631",
        str(PEER),
        "train",
        model_dir,
        tokens,
        out,
        f"--ep={ep}",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"AutoEP's run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def check_args(args) -> str | None:
    """Bad arguments, before any process starts."""
    if args.steps <= WARMUP:
        return f"--steps must exceed the {WARMUP} warm-up steps left out of the step time"
    from .autoep_peer import SHAPE

    if SHAPE["num_local_experts"] % args.ep:
        return f"--ep {args.ep} does not divide the benchmark Mixtral's {SHAPE['num_local_experts']} experts"
    return None


def step_time(run: dict) -> float:
    """A run's median step time after the warm-up."""
    return statistics.median(s["step_s"] for s in run["steps"][WARMUP:])


def run(args) -> dict:
    """Build (or reuse) the peer virtualenv, then ``--pairs`` A/B pairs of ``--steps`` steps."""
    world = args.ep  # dp = ep: one rank per expert group, as a user at ep 2 on two processes
    py = peer_python(Path(args.venv).expanduser())
    work = Path(tempfile.mkdtemp(prefix="mt3d-autoep-"))
    model_dir, tokens = str(work / "mixtral"), str(work / "tokens.pt")
    subprocess.run(
        [str(py), str(PEER), "make", model_dir],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    torch.save(token_batches(args.steps, world), tokens)
    pairs = []
    for i in range(args.pairs):
        order = ("autoep", "mt3d") if i % 2 == 0 else ("mt3d", "autoep")
        got = {}
        for who in order:
            if who == "autoep":
                got[who] = run_peer(py, model_dir, tokens, str(work / f"peer{i}.json"), args.ep, world)
            else:
                got[who] = spawn(
                    mt3d_worker, world, model_dir, tokens, str(work / "mt3d"), args.ep, timeout=1800
                )[0]
        pairs.append(got)
        a, m = step_time(got["autoep"]), step_time(got["mt3d"])
        print(
            f"pair {i + 1}: AutoEP {a * 1e3:.1f} ms, mt3d {m * 1e3:.1f} ms a step, mt3d / AutoEP {m / a:.3f}",
            flush=True,
        )
    first = pairs[0]
    rows = [
        {
            "step": k + 1,
            "AutoEP loss": a["loss"],
            "mt3d loss": m["loss"],
            "AutoEP grad norm": a["grad_norm"],
            "mt3d grad norm": m["grad_norm"],
        }
        for k, (a, m) in enumerate(zip(first["autoep"]["steps"], first["mt3d"]["steps"], strict=True))
    ]
    print(table(rows, list(rows[0])))
    ratios = [step_time(p["mt3d"]) / step_time(p["autoep"]) for p in pairs]
    loss_gap = max(abs(r["AutoEP loss"] - r["mt3d loss"]) / r["AutoEP loss"] for r in rows)
    result = {
        "ep": args.ep,
        "world": world,
        "steps": args.steps,
        "pairs": args.pairs,
        "autoep_step_ms": [round(step_time(p["autoep"]) * 1e3, 2) for p in pairs],
        "mt3d_step_ms": [round(step_time(p["mt3d"]) * 1e3, 2) for p in pairs],
        "ratios": [round(r, 4) for r in ratios],
        "mt3d_over_autoep": round(statistics.median(ratios), 4),
        "max_relative_loss_gap": loss_gap,
        "optimizers": {"autoep": first["autoep"]["optimizer"], "mt3d": first["mt3d"]["optimizer"]},
        "peer": {"transformers": PEER_TRANSFORMERS},
    }
    print(
        f"mt3d / AutoEP step time: {result['mt3d_over_autoep']:.3f} (median of {args.pairs} A/B pairs; "
        f"losses within {loss_gap:.1e} relative)"
    )
    return emit("autoep", result)
