"""DPO training around the trainer: the reference pass and the step's figures (``mt3d.model.dpo``).

The reference (``train.dpo.reference`` "precompute") is the starting policy; "model" is a model of its
own (``reference_model``), loaded on the run's layout for one pass and freed. Before the first step
every sample of the preference data (the training and validation pairs, epoch 0: each pair once) runs
through the engine's evaluation with the loss recording each document's log-probability; with LoRA the
adapters are set aside, so the reference is the frozen base. Every rank then holds the table
(float64 per dataset document; the ranks' records merged by an all-reduce) and rank 0 writes it to
``<save_dir>/dpo_reference.pt`` with what it was computed from (the dataset and the model source). A
resumed run reads that file (or, resuming another run directory's checkpoint, that directory's, copied
into its own): it cannot recompute it (the policy has moved), and refuses a missing one or one made
from other data.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UserError
from ..model.dpo import FIGURES

REFERENCE = "dpo_reference.pt"


def _identity(trainer) -> dict:
    """What a reference table was computed from: the dataset (its tag) and the reference model (its
    weights' fingerprint where it came from an HF directory; else its name and init seed)."""
    from ..model.peft import fingerprint

    ds = trainer.data.info
    source = trainer.reference_source
    model = fingerprint(source) if source else f"{trainer.model_source} seed {trainer.train_cfg.seed}"
    return {"prefixes": [str(p) for p in ds.get("prefixes", [])], "tags": ds.get("tags", []), "model": model}


def prepare_reference(trainer, start_step: int) -> None:
    """Set the loss's reference table: computed now (a fresh run) or read back (a resumed one)."""
    loss_fn = trainer.engine.module.loss_fn
    path = Path(trainer.train_cfg.save_dir) / REFERENCE
    if start_step > 0:
        resume = trainer.train_cfg.resume
        source = Path(resume).parent.parent / REFERENCE  # a checkpoint of another run directory's
        if not path.is_file() and resume not in ("auto", "none") and source.is_file():
            path = source
        if not path.is_file():
            raise UserError(
                f"{path} is missing: a resumed DPO run reads the reference log-probabilities its first "
                "step wrote (they cannot be recomputed from the moved policy)"
            )
        held = torch.load(path, map_location="cpu", weights_only=True)
        if held["identity"] != _identity(trainer):
            raise UserError(f"{path} was computed for other data or another model ({held['identity']}); "
                            "resume with the run's own data and model")  # fmt: skip
        loss_fn.reference = held["table"]
        if path.parent != Path(trainer.train_cfg.save_dir) and trainer.rt.rank == 0:
            _write(Path(trainer.train_cfg.save_dir) / REFERENCE, held)  # for resuming this run in turn
        return
    dpo = loss_fn.dpo
    loss_fn.reference = model_table(trainer) if dpo.reference == "model" else reference_table(trainer)
    if trainer.rt.rank == 0:
        _write(path, {"table": loss_fn.reference, "identity": _identity(trainer)})


def _write(path: Path, held: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(held, tmp)
    tmp.replace(path)


@torch.no_grad()
def reference_table(trainer) -> torch.Tensor:
    """float64 [documents]: each document's log-probability under the starting policy (adapters off)."""
    from ..model.lora import adapters_disabled

    loss_fn = trainer.engine.module.loss_fn
    documents = trainer.data.info["documents"][0]
    loss_fn.recording = {}
    try:
        with adapters_disabled(trainer.engine.module):
            for samples in (trainer.data.train, trainer.data.valid):
                if samples is not None:
                    trainer.run_eval(samples, math.ceil(len(samples) / trainer.layout.global_batch))
        recorded = loss_fn.recording
    finally:
        loss_fn.recording = None
    table = torch.full((documents,), -math.inf, dtype=torch.float64, device=trainer.rt.device)
    if recorded:
        index = torch.tensor(list(recorded), dtype=torch.int64, device=trainer.rt.device)
        table[index] = torch.tensor([lp for lp, _ in recorded.values()], dtype=torch.float64,
                                    device=trainer.rt.device)  # fmt: skip
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)  # ranks that saw a document hold the same value
    return table.cpu()


@torch.no_grad()
def model_table(trainer) -> torch.Tensor:
    """float64 [documents]: each document's log-probability under ``dpo.reference_model`` (default:
    the policy's HF source), loaded on the run's process groups for this pass (``mt3d.model.inference``,
    pipeline stages one after the other) and freed."""
    from ..checkpoint.loading import from_pretrained
    from ..model.inference import document_logps

    rt, layout = trainer.rt, trainer.layout
    dtype = next(p for p in trainer.engine.module.parameters()).dtype
    model = from_pretrained(trainer.reference_source, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                            state=rt.state, dtype=dtype, device=rt.device)  # fmt: skip
    table = torch.full((trainer.data.info["documents"][0],), -math.inf, dtype=torch.float64)
    for samples in (trainer.data.train, trainer.data.valid):
        if samples is not None:
            held = 2 * torch.as_tensor(samples.doc_ids)  # the pairs it packs
            logps = document_logps(model.eval(), samples, rt.state).cpu()
            table[held], table[held + 1] = logps[held], logps[held + 1]
    del model
    return table


def dpo_figures(loss_fn, contributes: bool, device) -> dict:
    """TRL's DPO metrics of the last step (means over its pairs), the same on every rank (a collective
    over all ranks: call it everywhere). ``contributes``: this rank's loss holds the step's sums (one
    rank per data-parallel replica, as ``router_figures``)."""
    sums = loss_fn.figures.to(device, copy=True)
    if not contributes:
        sums.zero_()
    loss_fn.figures.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    pairs = max(1.0, float(sums[0]))
    return {name: float(v) / pairs for name, v in zip(FIGURES[1:], sums[1:].tolist(), strict=True)}


@contextlib.contextmanager
def evaluation_off(loss_fn):
    """While evaluating, the loss must not add the validation pairs to the training step's figures."""
    saved = loss_fn.figures.clone()
    try:
        yield
    finally:
        loss_fn.figures.copy_(saved)
