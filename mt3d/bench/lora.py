"""``python -m mt3d.bench lora``: the optimizer and gradient bytes of a LoRA step against a full
fine-tune of the same model, measured on the engine after a step, beside the planner's prediction
(``mt3d plan --lora R``: ``planner.memory.memory_bytes`` with ``lora_rank``).

Measured: the optimizer's fp32 master weights and Adam moments (its flat partitions and state) and
the weights' gradients as the step starts, on one process (fp32, ZeRO-1, dp 1). Predicted: the
planner's model states minus the weights themselves (the frozen base's and the adapters').
"""

from __future__ import annotations

from ..parallel.spawn import spawn
from .common import bench_run_config, emit, table


def measure_worker(raw: dict) -> dict:
    """One step of ``raw``'s engine: the optimizer's bytes and the gradients' as the step starts."""
    import torch

    from .common import build_engine, train_step

    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _, layout, rt, engine, data, cfg = build_engine(raw)
    grads, step = [], engine.optimizer.step

    def recording(*args, **kwargs):  # the weights' gradients and ZeRO's reduced partitions of them
        held = [p.grad for p in engine.module.parameters() if p.grad is not None]
        for group in (getattr(engine.optimizer, "averaged_gradients", None) or {}).values():
            held += [g for g in group if g is not None]
        grads.append(nbytes(held))
        return step(*args, **kwargs)

    engine.optimizer.step = recording
    train_step(engine, layout, rt, data, layout.micro_batch, 0)
    inner = engine.optimizer.optimizer
    master = [p for g in inner.param_groups for p in g["params"]]
    states = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    return {
        "optimizer": nbytes(master) + nbytes(states),
        "grads": max(grads),
        "weights": nbytes(engine.module.parameters()),
        "trainable": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "cfg": cfg.to_dict(),
        "vocab": cfg.vocab_size,
    }


def predicted(cfg_dict: dict, vocab: int, seq_len: int, micro: int, lora_rank: int) -> float:
    """The planner's optimizer + gradient bytes of this run (model states less the weights)."""
    from ..model.config import ModelConfig
    from ..planner.layout import Layout, Precision, lora_stage_params, stage_params
    from ..planner.memory import memory_bytes

    cfg = ModelConfig.from_dict(cfg_dict)
    lay = Layout(
        tp=1,
        pp=1,
        dp=1,
        micro_batch=micro,
        grad_accum=1,
        zero_stage=1,
        recompute=False,
        sequence_parallel=False,
    )
    prec = Precision.of("fp32", 1)
    mem = memory_bytes(cfg, vocab, seq_len, lay, prec, lora_rank=lora_rank)
    weights = stage_params(cfg, vocab, 1, 1) + (lora_stage_params(cfg, lora_rank, 1, 1) if lora_rank else 0)
    return mem["model_states"] - weights * prec.param


def run(args) -> None:
    """Full fine-tune vs LoRA: measured bytes beside the planner's."""
    model = {"preset": "tiny-llama", "hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 4,
             "ffn": 2 * args.hidden}  # fmt: skip
    rows = []
    for name, lora in (
        ("full", None),
        (f"lora r={args.rank}", {"r": args.rank, "target_modules": "all-linear"}),
    ):
        raw = bench_run_config(model=model, global_batch=2, micro=2, seq_len=64)
        if lora:
            raw["mt3d"]["lora"] = lora
        got = spawn(measure_worker, 1, raw, timeout=900)[0]
        measured = got["optimizer"] + got["grads"]
        want = predicted(got["cfg"], got["vocab"], 64, 2, args.rank if lora else 0)
        rows.append({"run": name, "trainable": got["trainable"], "optimizer_MB": got["optimizer"] / 1e6,
                     "grads_MB": got["grads"] / 1e6, "measured_MB": measured / 1e6,
                     "predicted_MB": want / 1e6, "measured/predicted": measured / want})  # fmt: skip
    rows.append({"run": "lora / full", "measured_MB": rows[1]["measured_MB"] / rows[0]["measured_MB"],
                 "predicted_MB": rows[1]["predicted_MB"] / rows[0]["predicted_MB"]})  # fmt: skip
    cols = [
        "run",
        "trainable",
        "optimizer_MB",
        "grads_MB",
        "measured_MB",
        "predicted_MB",
        "measured/predicted",
    ]
    print(table(rows, cols))
    emit("lora", {"rows": rows})
