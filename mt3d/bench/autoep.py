"""``python -m mt3d.bench autoep``: mt3d against DeepSpeed's AutoEP on the same HF Mixtral at ep 2.

Both fine-tune the same saved model (``autoep_peer.SHAPE``: 8 experts, top-2, no aux loss) on the
same token batches (each rank its own micro-batch of 2 x 64 tokens per step), ZeRO-1, fp32, torch's
AdamW (lr 1e-3, betas 0.9/0.999, no weight decay), gradients clipped at 1, one thread per process:
mt3d with ``parallel.expert: 2`` in its own process group, AutoEP under ``torch.distributed.run`` in a
virtualenv of its own (``--venv``, built when missing: the pinned torch and DeepSpeed with
transformers 5.22.2, the newest AutoEP runs with). Runs alternate in A/B pairs (which goes first
alternates too); each run's step time is the median of its steps after ``WARMUP``; the figure is the
median over pairs of mt3d's over AutoEP's. Losses and gradient norms are printed side by side.

The folded row (``--folded-pairs``) is mt3d alone at world 2 ep with tp 2: each expert's inner
dimension split over the TP pair (expert_tensor 2, ep over dp, as before folding) against whole
experts with the ep group folded over tp x dp (expert_tensor 1, ep 2 ep), in A/B pairs on the same
batches, with each layout's expert GEMM shapes (``expert_gemms``).
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
from .common import emit, median_interval, table

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


def mt3d_worker(
    model_dir: str, tokens: str, save_dir: str, ep: int, tp: int = 1, etp: int | None = None,
    dispatch: str = "rank",
) -> dict:  # fmt: skip
    """mt3d's run: ``model.from_hf`` at ``parallel.expert: ep`` (``tp``, ``etp``: the tensor and expert
    tensor degrees of the folded comparison; ``dispatch``: ``parallel.expert_dispatch``), the same
    optimizer and batches (each data-parallel rank its own rows, its TP ranks the same)."""
    import time

    import torch.distributed as dist

    from ..parallel.mappings import all_reduce
    from .autoep_peer import CLIP, OPTIMIZER
    from .common import bench_run_config, build_engine

    dp = dist.get_world_size() // tp
    raw = bench_run_config(model={"from_hf": model_dir}, tp=tp, global_batch=MICRO * dp, micro=MICRO,
                           seq_len=SEQ, save_dir=save_dir)  # fmt: skip
    raw.update(optimizer=OPTIMIZER, gradient_clipping=CLIP)
    raw["mt3d"]["parallel"].update(expert=ep, expert_dispatch=dispatch)
    if etp is not None:
        raw["mt3d"]["parallel"]["expert_tensor"] = etp
    _, _, rt, engine, _, _ = build_engine(raw)
    batches, dense = torch.load(tokens), rt.state.dense
    steps = []
    for s in range(batches.shape[0]):
        rows = batches[s, rt.state.dp.rank]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=iter([(rows[:, :-1], rows[:, 1:])]))
        dist.barrier()
        seconds = time.perf_counter() - t0
        mean = loss.detach().float().clone()
        all_reduce(mean, dense)  # DeepSpeed averaged over its 'data' axis, a part of dp (or all of it)
        steps.append(
            {
                "loss": mean.item() / dense.size,
                "grad_norm": float(engine.get_global_grad_norm()),
                "step_s": seconds,
            }
        )
    once = any(getattr(m, "dedup", False) for m in engine.module.modules())  # what the layers ran
    return {"steps": steps, "optimizer": type(engine.optimizer).__name__, "dispatch_once": once}


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


def by_dispatch(pairs: list[dict], dispatch: str) -> dict:
    """mt3d at one ``parallel.expert_dispatch`` against AutoEP over the rounds: step times, ratios, their
    median and its interval."""
    ratios = [step_time(p[dispatch]) / step_time(p["autoep"]) for p in pairs]
    return {
        "mt3d_step_ms": [round(step_time(p[dispatch]) * 1e3, 2) for p in pairs],
        "ratios": [round(r, 4) for r in ratios],
        "mt3d_over_autoep": round(statistics.median(ratios), 4),
        **interval(ratios),
    }


def interval(ratios: list[float]) -> dict:
    """The median's distribution-free interval over the pairs (``common.median_interval``): a pair's
    ratio varies by about +-10% on 2 shared cores, so the median alone does not say which side of 1 the
    true one lies."""
    low, high, coverage = median_interval(ratios)
    return {"median_interval": [round(low, 4), round(high, 4)], "interval_coverage": round(coverage, 3)}


def describe(result: dict) -> str:
    """The interval as printed: ``97.7% interval 0.96-1.02``."""
    low, high = result["median_interval"]
    return f"{100 * result['interval_coverage']:.1f}% interval {low:.3f}-{high:.3f}"


def check_args(args) -> str | None:
    """Bad arguments, before any process starts."""
    if args.steps <= WARMUP:
        return f"--steps must exceed the {WARMUP} warm-up steps left out of the step time"
    if args.folded_pairs < 0:
        return "--folded-pairs must be 0 (no folded row) or more"
    from ..config.moe_rules import DISPATCHES

    wrong = [d for d in args.dispatch if d not in DISPATCHES or d == "node"]
    if wrong or not args.dispatch or len(set(args.dispatch)) < len(args.dispatch):
        given = ",".join(args.dispatch)
        return f"--dispatch takes distinct values of rank, assignment (comma-separated), got {given}"
    if args.ep < 2 and "assignment" in args.dispatch:
        return "--dispatch assignment needs --ep 2 or more (ep 1 dispatches nothing): use --dispatch rank"
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
    runs, pairs = ["autoep", *args.dispatch], []
    for i in range(args.pairs):
        got = {}
        for who in runs[i % len(runs) :] + runs[: i % len(runs)]:  # who goes first rotates
            if who == "autoep":
                got[who] = run_peer(py, model_dir, tokens, str(work / f"peer{i}.json"), args.ep, world)
            else:
                got[who] = spawn(mt3d_worker, world, model_dir, tokens, str(work / "mt3d"), args.ep, 1, None,
                                 who, timeout=1800)[0]  # fmt: skip
        pairs.append(got)
        a = step_time(got["autoep"])
        mine = ", ".join(
            f"mt3d ({d}) {step_time(got[d]) * 1e3:.1f} ms, {step_time(got[d]) / a:.3f}" for d in runs[1:]
        )
        print(f"round {i + 1}: AutoEP {a * 1e3:.1f} ms a step; {mine} of it", flush=True)
    first, main = pairs[0], args.dispatch[0]
    rows = [
        {
            "step": k + 1,
            "AutoEP loss": a["loss"],
            "mt3d loss": m["loss"],
            "AutoEP grad norm": a["grad_norm"],
            "mt3d grad norm": m["grad_norm"],
        }
        for k, (a, m) in enumerate(zip(first["autoep"]["steps"], first[main]["steps"], strict=True))
    ]
    print(table(rows, list(rows[0])))
    loss_gap = max(abs(r["AutoEP loss"] - r["mt3d loss"]) / r["AutoEP loss"] for r in rows)
    result = {
        "ep": args.ep,
        "world": world,
        "steps": args.steps,
        "pairs": args.pairs,
        "autoep_step_ms": [round(step_time(p["autoep"]) * 1e3, 2) for p in pairs],
        **by_dispatch(pairs, main),  # the first dispatch's figures, under the keys the record always had
        "max_relative_loss_gap": loss_gap,
        "optimizers": {"autoep": first["autoep"]["optimizer"], "mt3d": first[main]["optimizer"]},
        "peer": {"transformers": PEER_TRANSFORMERS},
        "dispatch": main,
        "dispatches": {d: by_dispatch(pairs, d) for d in args.dispatch},
    }
    for d, row in result["dispatches"].items():
        print(f"mt3d ({d}) / AutoEP step time: {row['mt3d_over_autoep']:.3f} (median of {args.pairs} rounds, "
              f"{describe(row)})")  # fmt: skip
    print(f"losses (mt3d {main}) within {loss_gap:.1e} relative of AutoEP's")
    if args.folded_pairs:
        result["folded"] = folded_row(model_dir, work, args)
    return emit("autoep", result)


def folded_layouts(ep: int) -> dict[str, dict] | None:
    """The folded row's two layouts at world 2 ep (tp 2): each expert split over the TP pair (etp = tp,
    today's default, ep over dp) against whole experts with ep folded over tp x dp (etp 1, 2 ep);
    None where 2 ep does not divide the experts."""
    from .autoep_peer import SHAPE

    if SHAPE["num_local_experts"] % (2 * ep):
        return None
    return {"split": dict(tp=2, ep=ep, etp=2), "whole": dict(tp=2, ep=2 * ep, etp=1)}


def expert_gemms(tp: int, ep: int, etp: int) -> dict:
    """A layout's routed-expert GEMMs per rank and micro-batch, the rows expected under uniform
    routing: each rank routes MICRO x SEQ / (tp / etp) tokens (its TP group's tokens shared out when
    experts are whole), its ep group's top-k assignments spread over the experts."""
    from .autoep_peer import SHAPE

    h, ffn, e, k = (SHAPE[n] for n in ("hidden_size", "intermediate_size", "num_local_experts",
                                        "num_experts_per_tok"))  # fmt: skip
    rows = ep * MICRO * SEQ // (tp // etp) * k // e
    inner = ffn // etp
    return {
        "experts_per_rank": e // ep,
        "rows_per_expert": rows,
        "up": f"[{rows}, {h}] x [{h}, {2 * inner}]",
        "down": f"[{rows}, {inner}] x [{inner}, {h}]",
    }


def folded_row(model_dir: str, work: Path, args) -> dict:
    """mt3d alone at world 2 ep, tp 2: experts split over TP (etp 2) against whole experts folded over
    tp x dp (etp 1), ``--folded-pairs`` A/B pairs on the same batches; step times, losses, GEMM shapes."""
    layouts = folded_layouts(args.ep)
    if layouts is None:
        print(f"folded row skipped: 2 x ep = {2 * args.ep} does not divide the experts")
        return {"skipped": "2 x ep does not divide the experts"}
    world = 2 * args.ep
    tokens = str(work / "tokens-folded.pt")
    torch.save(token_batches(args.steps, world // 2), tokens)
    pairs = []
    for i in range(args.folded_pairs):
        order = ("split", "whole") if i % 2 == 0 else ("whole", "split")
        got = {}
        for name in order:
            lay = layouts[name]
            got[name] = spawn(mt3d_worker, world, model_dir, tokens, str(work / f"mt3d-{name}"), lay["ep"],
                              lay["tp"], lay["etp"], timeout=1800)[0]  # fmt: skip
        pairs.append(got)
        a, b = step_time(got["split"]), step_time(got["whole"])
        print(f"folded pair {i + 1}: split {a * 1e3:.1f} ms, whole {b * 1e3:.1f} ms a step, whole / split "
              f"{b / a:.3f}", flush=True)  # fmt: skip
    rows = [{"layout": name, **{k: lay[k] for k in ("tp", "ep", "etp")}, **expert_gemms(**lay)}
            for name, lay in layouts.items()]  # fmt: skip
    print(table(rows, list(rows[0])))
    first = pairs[0]
    gap = max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
              for a, b in zip(first["whole"]["steps"], first["split"]["steps"], strict=True))  # fmt: skip
    ratios = [step_time(p["whole"]) / step_time(p["split"]) for p in pairs]
    out = {
        "world": world,
        "layouts": rows,
        "split_step_ms": [round(step_time(p["split"]) * 1e3, 2) for p in pairs],
        "whole_step_ms": [round(step_time(p["whole"]) * 1e3, 2) for p in pairs],
        "ratios": [round(r, 4) for r in ratios],
        "whole_over_split": round(statistics.median(ratios), 4),
        **interval(ratios),
        "max_relative_loss_gap": gap,
    }
    print(f"whole experts (etp 1) / split over tp (etp 2) step time at world {world}: "
          f"{out['whole_over_split']:.3f} (median of {len(pairs)} A/B pairs, {describe(out)}; losses within "
          f"{gap:.1e} relative)")  # fmt: skip
    return out
