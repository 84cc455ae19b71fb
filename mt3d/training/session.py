"""One training session from a validated config: set-up, train, save, tear down."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from ..checkpoint import reshard, resume
from ..checkpoint.manager import Checkpointer, claim_save_dir
from ..checkpoint.rng import rng_key
from ..config import DataConfig, Layout, RunConfig
from ..data.loader import build_data
from ..ds.safe import only_safe_loads
from ..errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_FAILED, EXIT_PREEMPTED, UserError
from ..inputs import env_int
from ..model.config import ModelConfig
from ..versions import __version__
from .engine import build_model, initialize
from .faults import FaultInjector
from .logs import deepspeed_output
from .loop import Trainer
from .metrics import start_wandb
from .runtime import setup
from .signals import Preemption

log = logging.getLogger("mt3d")
__all__ = ["EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_FAILED", "EXIT_PREEMPTED", "run_training"]


def lora_facts(run: RunConfig, cfg: ModelConfig, vocab: int) -> dict | None:
    """What a LoRA run's checkpoints record of its adapters and base (None: no LoRA): the spec, the
    targets as configured, the base's path and fingerprint (``mt3d.model.peft``)."""
    lora = run.mt3d.lora
    if lora is None:
        return None
    from ..model.lora import trainable_count
    from ..model.peft import fingerprint, plan

    spec, targets = plan(lora, cfg, vocab)
    base = cfg.extra.get("hf_path")
    target_modules = lora.target_modules
    if target_modules is None:  # from the adapter
        from ..model.peft import read_config

        target_modules = read_config(lora.from_adapter)["target_modules"]
    return {
        "r": spec.r, "alpha": spec.alpha, "dropout": spec.dropout, "rslora": spec.rslora,
        "target_modules": target_modules, "modules": len(targets),
        "parameters": trainable_count(targets, spec),
        "base": str(Path(base).resolve()) if base else None,
        "fingerprint": fingerprint(base) if base else f"{cfg.name}:seed={run.mt3d.train.seed}",
    }  # fmt: skip


def checkpoint_meta(run: RunConfig, layout: Layout, cfg: ModelConfig, vocab: int, data_info: dict,
                    lora: dict | None = None):  # fmt: skip
    """What a checkpoint records about the run that wrote it (for resume, reshard and export)."""

    def meta() -> dict:
        return {
            "mt3d_version": __version__,
            "layout": layout.saved(),
            "stage_layers": run.mt3d.parallel.stage_layers,
            "model": cfg.to_dict(),
            "vocab_size": vocab,
            "seq_len": run.mt3d.data.seq_len,
            "global_batch": layout.global_batch,
            "micro_batch": layout.micro_batch,
            "precision": layout.precision,
            "data": {
                "corpus": run.mt3d.data.corpus,
                "tokenizer": data_info.get("tokenizer_dir"),
                **{k: data_info[k] for k in resume.DATA_FACTS if k in data_info},
            },
            "config": run.to_dict(),
            **({"lora": lora} if lora else {}),
        }

    return meta


def write_run_info(save_dir: Path, run: RunConfig, layout: Layout, cfg: ModelConfig, data_info: dict) -> None:
    """``<save_dir>/run.json``: the resolved config, layout (every axis shown), model and corpus facts."""
    info = {
        "config": run.to_dict(),
        "layout": layout.describe(),
        "model": cfg.to_dict(),
        "data": data_info,
    }
    (save_dir / "run.json").write_text(json.dumps(info, indent=1, default=str))


def prepare_data(data_cfg: DataConfig, seed: int, cfg: ModelConfig, pairs: bool = False):
    """Build the corpus and fix the vocabulary size; returns (data bundle, vocab size)."""
    hf_path = cfg.extra.get("hf_path")
    if hf_path and data_cfg.tokenizer is None and data_cfg.corpus == "builtin":
        if (Path(hf_path) / "tokenizer.json").is_file():
            data_cfg.tokenizer = hf_path  # fine-tuning: the model's own tokenizer
    data = build_data(data_cfg, seed, pairs=pairs)
    vocab = data.tokenizer.vocab_size
    if cfg.vocab_size is None:
        cfg.vocab_size = vocab
    elif cfg.vocab_size < vocab:
        raise UserError(f"model vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab}")
    data.info["tokenizer_dir"] = data.tokenizer.path
    return data, cfg.vocab_size


def build_engine(run: RunConfig, layout: Layout, rt, cfg: ModelConfig, vocab: int, plan=None,
                 fast_init: bool = False, packed: bool = False):  # fmt: skip
    """Model (HF weights when fine-tuning), DeepSpeed engine, and the resumed state when resuming;
    returns (engine, first step). ``packed``: the data are packed documents (``build_model``).
    ``fast_init`` (benchmarks) draws the weights with one ``normal_`` per tensor on the model's device
    instead of mt3d's layout-independent CPU init (minutes for 1B parameters)."""
    hf_path = cfg.extra.get("hf_path")
    load_dir, tag = None, None
    same_layout = plan is None or not plan.layout_changed(layout)
    if plan is not None:
        from ..config.optimizer_rules import optimizer_resume_conflict
        from ..errors import CheckpointError

        saved = str(((plan.meta.get("config") or {}).get("optimizer") or {}).get("type", ""))
        why = optimizer_resume_conflict(saved, run.deepspeed.optimizer_type)
        if why:
            raise CheckpointError(f"cannot resume {plan.path}: {why}")
        convert = plan.check_offload(layout)
        load_dir, tag = plan.path.parent, plan.path.name
        if convert:  # NVMe-offloaded optimizer states into a run without: an ordinary checkpoint copy
            from ..checkpoint.reshard import convert_for_resume

            load_dir, tag = convert_for_resume(plan, run.mt3d.train.save_dir, rt.rank)
        if not same_layout:
            load_dir, tag = reshard.prepare(plan, layout, run.mt3d.train.save_dir, rt.rank)
    sp = run.mt3d.parallel.sequence_parallel
    lora = run.mt3d.lora  # a LoRA checkpoint holds the adapters only: the base is read again on resume
    model = build_model(cfg, layout, rt, vocab, train=run.mt3d.train, sequence_parallel=sp,
                        skip_init=bool(hf_path) or (plan is not None and lora is None) or fast_init,
                        cp_exchange=run.mt3d.parallel.context_exchange,
                        expert_dispatch=run.mt3d.parallel.expert_dispatch, packed=packed)  # fmt: skip
    if fast_init:
        import torch

        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    if hf_path and (plan is None or lora is not None):
        from ..checkpoint.loading import load_weights, open_source

        load_weights(model, open_source(hf_path, cfg=cfg if cfg.mtp is not None else None), rt.state.tp,
                     rt.state.etp)  # fmt: skip
    if lora is not None:
        from .engine import add_adapters

        add_adapters(model, lora, cfg, vocab, rt, run.mt3d.train.seed, fresh=plan is None)
    engine = initialize(
        run.deepspeed,
        layout,
        rt,
        model,
        sequence_parallel=sp,
        load_universal=not same_layout,
        train=run.mt3d.train,
    )
    start = 0
    if plan is not None:
        resume.restore(engine, plan, load_dir, tag, rt, same_layout)
        start = plan.step
        if rt.rank == 0:
            log.info("resumed from %s at step %d", plan.path, start)
    return engine, start


def run_training(run: RunConfig, layout: Layout, cfg: ModelConfig, verbose: bool = False) -> int:
    """Train on this rank; returns the exit code (0, or EXIT_PREEMPTED / EXIT_DIVERGED after saving).

    Every pickle read during the run (DeepSpeed's loaders included) goes through mt3d's allow-list
    (``safe.only_safe_loads``); DeepSpeed's set-up output goes to the run's log unless ``verbose``.
    """
    rank = env_int("RANK", 0)  # until process groups exist
    preemption = Preemption().install()
    try:
        with only_safe_loads():
            return _train(run, layout, cfg, preemption, verbose)
    except UserError as e:  # bad input (config, data, checkpoint): one line, no traceback
        # Every rank says it: an input problem can be local to one host (a missing file there).
        print(f"mt3d train: error on rank {rank}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # one line for people, the traceback for the log
        log.exception("training failed on rank %d", rank)
        print(f"mt3d train: error on rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED  # the launcher stops the other ranks
    finally:
        preemption.uninstall()


def _train(run: RunConfig, layout: Layout, cfg: ModelConfig, preemption: Preemption, verbose: bool) -> int:
    save_dir = Path(run.mt3d.train.save_dir)
    with deepspeed_output(save_dir, verbose):
        rt = setup(run.mt3d.parallel, run.mt3d.train.seed)
        lock = claim_save_dir(save_dir, rt.rank, run.mt3d.train.overwrite)  # noqa: F841 - held for the run
        data, vocab = prepare_data(run.mt3d.data, run.mt3d.train.seed, cfg,
                                   pairs=run.mt3d.train.objective == "dpo")  # fmt: skip
        facts = {"global_batch": layout.global_batch, "seq_len": run.mt3d.data.seq_len}
        lora = lora_facts(run, cfg, vocab)
        plan = resume.plan_resume(run.mt3d.train.resume, save_dir, cfg, facts, data.info, lora)
        wandb_run = _open_run(run, layout, cfg, data.info, vocab, preemption) if rt.rank == 0 else None
        try:
            engine, start = build_engine(run, layout, rt, cfg, vocab, plan, packed=data.info["packed"])
        except BaseException:
            _abandon(wandb_run)
            raise
    faults = FaultInjector(rt.rank)
    checkpointer = Checkpointer(
        engine,
        save_dir,
        meta=checkpoint_meta(run, layout, cfg, vocab, data.info, lora),
        client_state=lambda step: {"mt3d": {"step": step}},
        keep_last=run.mt3d.train.keep_last,
        tracker=rt.tracker,
        rng_key=rng_key(rt.state),
        tokenizer_dir=data.info.get("tokenizer_dir"),
        faults=faults,
    )
    trainer = Trainer(
        run.mt3d.train, layout, rt, engine, data, cfg, vocab, run.mt3d.data.seq_len, wandb_run=wandb_run,
        start_step=start, checkpointer=checkpointer, preemption=preemption, faults=faults,
        adapters=lora["parameters"] if lora else None,
    )  # fmt: skip
    try:
        summary = trainer.train()
    except BaseException:
        _abandon(wandb_run)
        raise
    if rt.rank == 0:
        report(summary, data.info, wandb_run)
    dist.barrier()  # without it rank 0 can abort at exit while others still finish (DEEPSPEED_NOTES.md)
    dist.destroy_process_group()
    return {"done": 0, "preempted": EXIT_PREEMPTED, "diverged": EXIT_DIVERGED}[summary["status"]]


def _open_run(run: RunConfig, layout: Layout, cfg: ModelConfig, data_info: dict, vocab: int, preemption):
    """Rank 0: the W&B run (or None), run.json and the opening log lines."""
    save_dir = Path(run.mt3d.train.save_dir)
    name = run.mt3d.train.run_name or save_dir.name
    wandb_run = start_wandb(
        run.deepspeed.wandb,
        name,
        run.mt3d.train.wandb_mode,
        save_dir,
        run.to_dict(),
        lambda: preemption.requested,
    )
    write_run_info(save_dir, run, layout, cfg, data_info)
    log.info("model %s: %.2fM parameters, vocab %d", cfg.name, cfg.num_params(vocab) / 1e6, vocab)
    if "entropy_floor" in data_info:
        log.info("synthetic corpus: entropy floor %.4f nats/token", data_info["entropy_floor"])
    return wandb_run


def _abandon(wandb_run) -> None:
    """Close the W&B run of a failed run quietly (its files may be on the disk that just filled up)."""
    if wandb_run is not None:
        wandb_run.abandon()


def report(summary: dict, data_info: dict, wandb_run) -> None:
    """Rank 0's closing line (and W&B summary)."""
    floor = data_info.get("entropy_floor")
    ev = summary["eval_loss"]
    extra = f" (entropy floor {floor:.4f})" if floor is not None and ev is not None else ""
    log.info(
        "%s: step %d, train loss %.4f, eval loss %s%s",
        summary["status"],
        summary["step"],
        summary["loss"],
        "n/a" if ev is None else f"{ev:.4f}",
        extra,
    )
    if wandb_run is not None:
        wandb_run.finish({k: v for k, v in summary.items() if v is not None})
