"""What ``mt3d plan`` prints and writes: the ranked table, the components of one layout (``--explain``),
why nothing fits, notes on interleaving and offload, and the best layout as a run config
(``--write-config``)."""

from __future__ import annotations

import json
import re

from ..config import Offload, overlap_conflict, p2p_conflict
from ..config.rules import overlap_moe_conflict
from ..errors import UserError
from .choices import DISPATCH_CHUNKS
from .search import recompute_mode

TIME_PARTS = ("compute_s", "bubble_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "dp_comm_s",
              "offload_s", "optimizer_s")  # fmt: skip


MEMORY_PARTS = ("model_states", "activations", "buckets", "end_of_step")


def explain(row: dict) -> str:
    """The time and memory components of one planned layout (``mt3d plan --explain``): what the step
    time and the memory per GPU are the sums of."""
    axes = ("tp", "cp", "ep", "pp", "dp")
    etp = f" etp {_etp(row)}" if _etp(row) != "-" else ""
    degrees = " ".join(f"{k} {row[k]}" for k in axes) + etp + f" v {row['virtual_stages']}"
    lines = [
        f"layout: {degrees}, micro-batch {row['micro_batch']} x {row['grad_accum']}, "
        f"ZeRO {row['zero_stage']}, offload {row['offload']}, "
        f"recompute {recompute_mode(row)}, "
        f"SP {'on' if row['sequence_parallel'] else 'off'}",
        *([schedule_note(row)] if row["pp"] > 1 else []),
        f"step time {row['step_time_s']:.4g} s =",
    ]
    for part in TIME_PARTS:
        share = row[part] / row["step_time_s"] if row["step_time_s"] else 0.0
        lines.append(f"  {part[:-2].replace('_', ' '):<12} {row[part]:10.4g} s  {share:6.1%}")
        if part == "ep_comm_s" and row.get("ep_hidden_s"):
            chunks = row.get("dispatch_chunks", 1)
            behind = f"the experts, {chunks} chunks a layer" if chunks > 1 else "the shared expert"
            lines[-1] += f"  (after {row['ep_hidden_s']:.4g} s hidden behind {behind})"
        if part == "ep_comm_s" and row.get("ep_hosts"):
            lines.append(f"  {'':<12} expert_dispatch node: ep groups on {row['ep_hosts']} hosts x "
                         f"{row['ep_per_host']}, each token crossing to a host once")  # fmt: skip
    lines.append(f"memory {row['memory_gb']:.2f} GB per GPU =")
    for part in MEMORY_PARTS:
        lines.append(f"  {part.replace('_', ' '):<12} {row['memory'][part]:10.3f} GB")
    off = row["memory"]
    lines.append(f"  (off the GPU: CPU {off['cpu']:.3f} GB, NVMe {off['nvme']:.3f} GB per GPU)")
    return "\n".join(lines)


REPLAYED = 256
"""Largest pipeline x micro-batches whose schedule ``schedule_note`` replays (seconds beyond)."""


def schedule_note(row: dict) -> str:
    """The pipeline schedule of a layout, its modelled bubble, and the simulator's replay of its
    orders at equal pass times (``pipeline.zero_bubble``; small enough sizes only)."""
    from ..pipeline import zero_bubble

    schedule, p, m, v = row.get("schedule", "1f1b"), row["pp"], row["grad_accum"], row["virtual_stages"]
    share = zero_bubble.bubble_share(schedule, p, m, v)
    name = "interleaved 1F1B" if schedule == "1f1b" and v > 1 else schedule
    line = f"schedule {name}: bubble {share:.3f} x compute (idle {share / (1 + share):.1%} of the step)"
    if p * m > REPLAYED or (schedule == "1f1b" and v > 1):
        return line
    idle = zero_bubble.replay(schedule, p, m)["idle"]
    return line + f"; simulated at equal passes: idle {sum(idle) / p:.1%} (mean over ranks)"


def compute_model(result: dict) -> str:
    """How the plan timed compute: a constant fraction of peak, or the GEMM shape model."""
    if result["efficiency"] is not None:
        return f"compute efficiency {result['efficiency']:.0%}"
    ceiling = result.get("gemm_tflops")
    if not ceiling:
        return "compute efficiency 50% (no GEMM calibration for this device)"
    fp8 = result.get("fp8")
    if fp8:
        return (f"compute from GEMM shapes (ceiling {ceiling:g} TFLOP/s; the blocks' linears in FP8 {fp8} at "
                f"{result['gemm_tflops_fp8']:g}, MFU against the bf16 peak)")  # fmt: skip
    return f"compute from GEMM shapes (ceiling {ceiling:g} TFLOP/s)"


def explain_infeasible(result: dict) -> str:
    """One line on why nothing fits: the reasons of the candidates that got furthest (memory, then the
    batch and schedule rules, then the degrees themselves)."""
    rejected = result["rejected"]
    if not rejected:
        return (f"no feasible layout: no layout of {result['gpus']} GPUs has the pinned degrees "
                "(--tensor, --pipeline, --data, --context, --expert; dp: what the rest leave)")  # fmt: skip
    evaluated = [r for r in rejected if "memory_gb" in r]
    too_big = [r for r in evaluated if r["reason"].startswith("needs ")]
    rules = [r for r in evaluated if not r["reason"].startswith("needs ")]
    if rules:  # some layouts fit on the GPUs but break a rule: that rule binds, not a size
        counts = {}
        for r in rules:
            counts[r["reason"]] = counts.get(r["reason"], 0) + 1
        reason = max(counts, key=counts.get)
        best = min((r for r in rules if r["reason"] == reason), key=lambda r: r["memory_gb"])
        what = "overflow an offload tier" if reason.startswith("offload needs") else "break a rule"
        return (
            f"no feasible layout: the layouts that fit on the GPUs {what}: {reason} (e.g. {_described(best)})"
        )
    if too_big:
        best = min(too_big, key=lambda r: r["memory_gb"])
        return (
            f"no feasible layout: the smallest needs {best['memory_gb']:.1f} GB per GPU "
            f"({_described(best)}); use more GPUs, a larger device, or a smaller model/batch"
        )
    scheduled = [r for r in rejected if "micro_batch" in r]
    batch = [r for r in scheduled if r["reason"].startswith("global batch")]
    if batch and len(batch) == len(scheduled):
        least = min(r["dp"] for r in batch)
        # context parallelism takes GPUs off dp without touching the batch: offer it when none was tried
        cp = ", try context parallelism (--context)" if all(r.get("cp", 1) == 1 for r in batch) else ""
        return (
            f"no feasible layout: the global batch {result['global_batch']} cannot be split over the data "
            f"parallelism of any layout the model and nodes allow (dp >= {least}); raise --global-batch to "
            f"a multiple of {least}{cp}, or use fewer GPUs"
        )
    reasons = sorted({r["reason"] for r in (scheduled or rejected)})[:3]
    return "no feasible layout: " + "; ".join(reasons)


def _described(row: dict) -> str:
    """A planned layout in a few words: its degrees, ZeRO stage, recompute mode and offload."""
    off = f", offload {row['offload']}" if row.get("offload", "none") != "none" else ""
    return (f"tp {row['tp']} cp {row['cp']} pp {row['pp']} dp {row['dp']}, ZeRO {row['zero_stage']}, "
            f"recompute {recompute_mode(row)}{off}")  # fmt: skip


def interleaving_note(feasible: list[dict]) -> str:
    """Whether interleaving (v > 1) wins, against the best v = 1 layout with the same degrees."""
    best = feasible[0]
    if best.get("schedule", "1f1b") != "1f1b":
        return f"virtual stages: {best['virtual_stages']}, the {best['schedule']} schedule's own (--schedule)"
    if best["virtual_stages"] == 1:
        return "virtual stages: no interleaved layout beats the best 1F1B one"
    same = lambda r: all(r[k] == best[k] for k in ("tp", "cp", "pp", "dp", "micro_batch", "zero_stage"))  # noqa: E731
    plain = next((r for r in feasible if r["virtual_stages"] == 1 and same(r)), None)
    if plain is None:
        return f"virtual stages: v = {best['virtual_stages']} wins (no 1F1B layout with these degrees fits)"
    gain = plain["step_time_s"] / best["step_time_s"] - 1
    return (
        f"virtual stages: v = {best['virtual_stages']} wins by {gain:.1%} over 1F1B with the same degrees "
        f"(bubble {best['bubble_s'] / best['step_time_s']:.1%} vs "
        f"{plain['bubble_s'] / plain['step_time_s']:.1%}, "
        f"{best['memory_gb'] - plain['memory_gb']:+.1f} GB)"
    )


def offload_note(feasible: list[dict], smallest_on_gpus: float | None) -> str:
    """Whether the best layout offloads, and if so why: nothing fits on the GPUs without it."""
    best = feasible[0]
    if best["offload"] == "none":
        return "offload: not needed (the best layout keeps every model state on the GPUs)"
    plain = [r for r in feasible if r["offload"] == "none"]
    where = (
        f"GPU {best['memory_gb']:.1f} GB, CPU {best['cpu_gb_per_node']:.0f} GB and NVMe "
        f"{best['nvme_gb_per_node']:.0f} GB per node"
    )
    if plain:
        return (
            f"offload: {best['offload']} wins ({where}); the best layout without offload takes "
            f"{plain[0]['step_time_s'] / best['step_time_s']:.2f}x as long"
        )
    why = f" (the smallest needs {smallest_on_gpus:.1f} GB per GPU)" if smallest_on_gpus else ""
    return (
        f"offload: nothing fits in GPU memory without it{why}; ZeRO-3 with {best['offload']} offload "
        f"fits: {where}"
    )


def _etp(row: dict) -> str:
    """A planned layout's expert-tensor degree (tp unless folded; "-" without expert parallelism)."""
    if row.get("etp") is None:
        return str(row["tp"]) if row.get("ep", 1) > 1 else "-"
    return str(row["etp"])


def format_plan(result: dict, top: int = 10) -> str:
    """Human-readable table of the best layouts and a summary of the rejections."""
    lines = [
        f"{result['model']} ({result['params'] / 1e9:.2f}B params) on {result['gpus']} x {result['device']} "
        f"({result['gpus_per_node']}/node), global batch {result['global_batch']} x {result['seq_len']} "
        f"tokens, {result['precision']}, " + compute_model(result),
        "",
        f"{'tp':>3} {'cp':>3} {'ep':>3} {'etp':>3} {'pp':>3} {'v':>2} {'dp':>5} {'mb':>3} {'acc':>5} "
        f"{'zero':>4} {'offload':>8} {'rc':>3} "
        f"{'sp':>3} {'GPU GB':>8} {'CPU GB/n':>9} {'NVMe GB/n':>10} {'step s':>9} {'TFLOP/s':>8} {'MFU':>6}  "
        "bubble/tp/cp/ep/pp/dp/offload share",
    ]
    attn = result.get("attention") or {}
    if attn.get("tile_fraction", 1.0) < 1.0:
        lines.insert(
            1,
            f"local attention: the layers visit {attn['tile_fraction']:.1%} of dense causal attention's "
            f"{attn['tile']}x{attn['tile']} tiles: attention speedup bound "
            f"{attn['attention_speedup_bound']:.2f}x",
        )
    for r in result["feasible"][:top]:
        shares = ("bubble_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "dp_comm_s", "offload_s")
        parts = [r[k] / r["step_time_s"] for k in shares]
        lines.append(
            f"{r['tp']:>3} {r['cp']:>3} {r['ep']:>3} {_etp(r):>3} {r['pp']:>3} {r['virtual_stages']:>2} "
            f"{r['dp']:>5} "
            f"{r['micro_batch']:>3} "
            f"{r['grad_accum']:>5} {r['zero_stage']:>4} {r['offload']:>8} "
            f"{recompute_mode(r)[0]:>3} {'yn'[not r['sequence_parallel']]:>3} "
            f"{r['memory_gb']:>8.1f} {r['cpu_gb_per_node']:>9.0f} {r['nvme_gb_per_node']:>10.0f} "
            f"{r['step_time_s']:>9.3f} {r['tflops_per_gpu']:>8.1f} {r['mfu']:>6.1%}  "
            + "/".join(f"{x:.0%}" for x in parts)
        )
    if not result["feasible"]:
        lines.append(explain_infeasible(result))
    else:
        lines.append(interleaving_note(result["feasible"]))
        lines.append(offload_note(result["feasible"], result.get("smallest_without_offload_gb")))
    lines.append("")
    counts: dict[str, int] = {}
    for r in result["rejected"]:
        # one line per kind of reason: the numbers in it (stages, sizes) would split the count
        key = (
            "exceeds the device memory"
            if r["reason"].startswith("needs ")
            else re.sub(r"\d+", "N", r["reason"])
        )
        counts[key] = counts.get(key, 0) + 1
    lines.append(f"rejected: {result['rejected_total']} candidates; most common reasons:")
    for reason, n in sorted(counts.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"  {n:>6}  {reason}")
    return "\n".join(lines)


def write_config(result: dict, path: str, cfg_section: dict, cfg=None, data: dict | None = None) -> dict:
    """A ds_configs-style JSON for the best layout (DeepSpeed keys + mt3d section), checked as
    ``mt3d train --check`` would check it on the planned cluster before it is written (``cfg``: the
    model, resolved from ``cfg_section`` when not given; ``data``: the run config's data section, kept
    when the plan was made from one)."""
    if not result["feasible"]:
        raise UserError(explain_infeasible(result))
    best = result["feasible"][0]
    if cfg is None:
        from ..config import resolve_model

        cfg = resolve_model(cfg_section)
    conf = _config_of(result, best, cfg_section, data, cfg)
    _check_written(conf, result["gpus"], cfg, cfg_section)
    with open(path, "w") as f:
        json.dump(conf, f, indent=2)
    return conf


def _check_written(conf: dict, gpus: int, cfg, cfg_section: dict) -> None:
    """Refuse a config that ``mt3d train --check`` would refuse on the planned cluster."""
    from ..config import ConfigError, from_dict, resolve_model, validate

    try:
        run = from_dict(json.loads(json.dumps(conf)))
        validate(run, gpus, cfg if cfg is not None else resolve_model(cfg_section), here=False)
    except ConfigError as e:
        raise UserError(f"--write-config: mt3d train would refuse the best layout's config: {e}") from None


def _overlaps(result: dict, best: dict, cfg) -> dict:
    """``mt3d.train.overlap``'s keys for what the plan's step time assumed, where mt3d runs it (tp:
    always)."""
    overlap, asked = {}, result.get("overlap", ())
    overlap_rule = overlap_conflict(True, best["zero_stage"], best.get("ep", 1),
                                    Offload.from_label(best["offload"]), result["precision"])  # fmt: skip
    moe_rule = overlap_moe_conflict(True, best["pp"]) if cfg.moe is not None else None
    if "dp" in asked and overlap_rule is None and moe_rule is None:
        overlap["grad_reduce"] = True
    if (
        "pp" in asked
        and best.get("schedule", "1f1b") == "1f1b"
        and p2p_conflict(True, best["pp"], best["grad_accum"]) is None
    ):
        overlap["p2p"] = True
    if "ep" in asked and best.get("ep", 1) > 1 and cfg.moe is not None:
        overlap["dispatch_chunks"] = DISPATCH_CHUNKS
    return overlap


def _config_of(result: dict, best: dict, cfg_section: dict, data: dict | None, cfg) -> dict:
    """The written config's dict (``write_config``)."""
    conf = {
        "train_batch_size": result["global_batch"],
        "train_micro_batch_size_per_gpu": best["micro_batch"],
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": result["precision"] == "bf16"},
        # fp16: dynamic loss scaling (loss_scale 0), DeepSpeed's defaults made explicit so users can tune them
        "fp16": {
            "enabled": result["precision"] == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "zero_optimization": {
            "stage": best["zero_stage"],
            # a placeholder nvme_path: mt3d refuses to start until it names a writable local NVMe directory
            **Offload.from_label(best["offload"], "/local_nvme/mt3d").ds_keys(),
        },
        "wandb": {"enabled": True, "project": "mt3d"},
        "mt3d": {
            "model": cfg_section,
            "parallel": {
                "tensor": best["tp"],
                "context": best["cp"],
                "pipeline": best["pp"],
                "virtual_stages": best["virtual_stages"],
                "schedule": best.get("schedule", "1f1b"),
                "sequence_parallel": best["sequence_parallel"],
                "expert": best.get("ep", 1),
                **({"expert_tensor": best["etp"]} if best.get("etp") is not None else {}),
                **({"expert_dispatch": "node"} if best.get("ep_hosts") else {}),
            },
            "data": {**(data or {"corpus": "builtin"}), "seq_len": result["seq_len"]},
            "train": {
                "steps": 1000,
                "recompute": {
                    "interval": 1 if best["recompute"] else 0,
                    "granularity": "selective" if best.get("selective") else "full",
                },
                "resume": "auto",
            },
        },
    }
    if result.get("optimizer") == "muon":  # Muon's usual rates; AdamW's on the rest
        muon = {"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95, "betas": [0.9, 0.95], "weight_decay": 0.1}
        conf["optimizer"] = {"type": "Muon", "params": muon}
    if result.get("fp8"):
        conf["mt3d"]["train"]["fp8"] = {"recipe": result["fp8"]}
        if result.get("fp8_dispatch") and best.get("ep", 1) > 1:
            conf["mt3d"]["train"]["fp8"]["dispatch"] = True
    states = result.get("optimizer_states", "fp32")
    if states != "fp32":  # what the plan's memory assumed; refused at start-up where it cannot run
        conf["mt3d"]["train"]["optimizer_states"] = states
    if result.get("grad_dtype") == "fp32" and result["precision"] != "fp32":  # DeepSpeed's BF16 optimizer
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
    overlap = _overlaps(result, best, cfg)
    if overlap:
        conf["mt3d"]["train"]["overlap"] = overlap
    model_vocab = getattr(cfg, "vocab_size", None) if cfg is not None else None
    if not model_vocab and conf["mt3d"]["data"].get("corpus", "builtin") != "indexed" and result.get("vocab"):
        conf["mt3d"]["data"]["vocab_size"] = result["vocab"]  # the vocabulary the plan was sized for
    return conf
