"""Helpers shared by the training tests: tiny configs and a worker that trains in spawned ranks."""

import copy
import logging
import os

TINY_GPT = {"preset": "tiny", "hidden": 64, "layers": 4, "heads": 4, "max_seq_len": 64}
TINY_LLAMA = {"preset": "tiny-llama", "hidden": 64, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 128}
# every block option at once (no HF family has them all): each kind of parameter and TP mark
TINY_EVERY = {
    "hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32, "ffn": 96, "max_seq_len": 64,
    "position": "rope", "norm": "rmsnorm", "norm_unit_offset": True, "mlp": "geglu", "bias": True,
    "qkv_bias": True, "mlp_bias": False, "qk_norm": True, "post_norms": True, "scale_embedding": True,
    "attn_softcap": 20.0, "logit_softcap": 15.0, "query_pre_attn_scalar": 24.0, "tie_embeddings": True,
    "attention": {"window": 8, "global_every": 2},
}  # fmt: skip


def tiny_config(save_dir, *, model=None, tp=1, pp=1, steps=5, zero=1, global_batch=8, micro=2, **mt3d_train):
    """A complete run config for the tiny model on the synthetic corpus, fp32, no dropout."""
    train = {
        "steps": steps,
        "log_interval": 1,
        "eval_interval": 0,
        "eval_batches": 1,
        "save_dir": str(save_dir),
        "save_at_end": False,
        "seed": 1234,
        "progress": False,
    }
    train.update(mt3d_train)
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero},
        "mt3d": {
            "model": copy.deepcopy(model or TINY_GPT),
            "parallel": {"tensor": tp, "pipeline": pp},
            "data": {"corpus": "synthetic", "vocab_size": 512, "seq_len": 32},
            "train": train,
        },
    }


def train_worker(raw):
    """Train ``raw`` (a config dict) on the spawned ranks; rank 0 returns metrics.jsonl's records."""
    import torch.distributed as dist

    rank = dist.get_rank()
    failures = _Failures()
    logging.getLogger("mt3d").addHandler(failures)
    try:
        rc, records = train_rc_worker(raw)
    finally:
        logging.getLogger("mt3d").removeHandler(failures)
    if rc != 0:  # the rank's own traceback, so that a failure seen only in CI can be read there
        raise RuntimeError(f"run_training returned {rc} on rank {rank}:\n" + "\n".join(failures.seen))
    return records


class _Failures(logging.Handler):
    """The errors (with their tracebacks) mt3d logs during a run in this process."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(self.format(record))


def runs_worker(raws, meeting):
    """Several runs one after the other on the same ranks (each run ends its process group; the next
    starts one on a port of its own): rank 0's step records of each. Saves a spawn (processes that
    import torch and DeepSpeed) per run. Rank 0 picks each next port just before the group starts and
    leaves it in the directory ``meeting`` for the others: a port picked before the spawn could be
    taken meanwhile by the earlier runs' gloo connections."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from mt3d.parallel.spawn import free_port
    from mt3d.training.runtime import init_distributed

    out = []
    for i, raw in enumerate(raws):
        if i:
            note = Path(meeting) / f"port_{i}"
            if os.environ["RANK"] == "0":
                (Path(meeting) / f"port_{i}.tmp").write_text(str(free_port()))
                (Path(meeting) / f"port_{i}.tmp").rename(note)
            deadline = time.monotonic() + 120
            while not note.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 left no port for run {i} in {meeting}")
                time.sleep(0.05)
            os.environ["MASTER_PORT"] = note.read_text()
        if not dist.is_initialized():
            init_distributed()
        out.append(step_records(train_worker(raw) or []))
    return out if os.environ["RANK"] == "0" else None


def run_all(ranks, raws, timeout=600):
    import tempfile

    from mt3d.parallel.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="mt3d-meet-") as meeting:
        return spawn(runs_worker, ranks, raws, meeting, timeout=timeout)[0]


def run_grouped(runs, timeout=600):
    """``[(world, config)]`` -> each run's step records, in order: runs of the same world size share
    one spawn (``run_all``), the worlds in the order they first appear; a run that resumes another's
    checkpoint must come after it within its world, or in a world that appears later."""
    out = [None] * len(runs)
    for world in dict.fromkeys(w for w, _ in runs):
        which = [i for i, (w, _) in enumerate(runs) if w == world]
        for i, records in zip(which, run_all(world, [runs[i][1] for i in which], timeout), strict=True):
            out[i] = records
    return out


def step_records(records):
    """The per-step training records (not the eval ones)."""
    return [r for r in records if "loss" in r]


def train_rc_worker(raw):
    """Like train_worker but returns (exit code, rank 0's records or None) instead of raising."""
    import torch.distributed as dist

    from mt3d.config import from_dict, resolve_model, validate
    from mt3d.training.metrics import read_metrics
    from mt3d.training.session import run_training

    run = from_dict(copy.deepcopy(raw))
    cfg = resolve_model(run.mt3d.model)
    layout = validate(run, dist.get_world_size(), cfg)
    rank = dist.get_rank()
    rc = run_training(run, layout, cfg)
    path = os.path.join(run.mt3d.train.save_dir, "metrics.jsonl")
    return rc, (read_metrics(path) if rank == 0 and os.path.exists(path) else None)


def optimizer_states_worker(raw, steps=5):
    """Build ``raw``'s engine on the spawned ranks, train ``steps`` steps; return the optimizer's bytes
    on this rank (its master-weight partitions and Adam moments), their dtypes, the gradient buffer
    DeepSpeed's BF16 optimizer keeps and the weights' gradients still allocated when a step starts (the
    most of any step), the losses and the trainable parameters on this rank."""
    import torch
    import torch.distributed as dist

    from mt3d.bench.common import build_engine, train_step

    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _, layout, rt, engine, data, _ = build_engine(copy.deepcopy(raw))
    lp_grads, step = [], engine.optimizer.step

    def step_recording(*args, **kwargs):  # the weights' gradients still allocated as the step starts
        lp_grads.append(nbytes(p.grad for p in engine.module.parameters() if p.grad is not None))
        return step(*args, **kwargs)

    engine.optimizer.step = step_recording
    losses = [train_step(engine, layout, rt, data, layout.micro_batch, k) for k in range(steps)]
    inner = engine.optimizer.optimizer  # the torch optimizer over ZeRO's flat partitions
    master = [p for g in inner.param_groups for p in g["params"]]
    states = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    grads = getattr(engine.optimizer, "fp32_groups_gradients_flat", None) or []  # DeepSpeed's BF16 optimizer
    return {
        "optimizer": type(engine.optimizer).__name__,
        "grad_buffer_bytes": nbytes(grads),
        "lp_grad_bytes": max(lp_grads),
        "rank": dist.get_rank(),
        "master_bytes": nbytes(master),
        "moment_bytes": nbytes(states),
        "dtypes": sorted({str(t.dtype) for t in master + states}),
        "params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "losses": losses,
    }
