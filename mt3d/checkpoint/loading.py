"""Models with weights from an HF directory or an mt3d checkpoint, at any tp x pp.

``open_source(path)`` recognises either kind of directory; ``load_weights(module, source, tp)``
fills a built module (a pipeline stage or a whole StackedModel) with this rank's shards;
``from_pretrained`` is the HF-style one-call API.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..model.blocks import BuildContext
from ..model.config import ModelConfig
from ..model.hf import HFError, HFReader, check_weights, config_from_hf, pieces, read_shard
from ..model.moe import expert_index
from ..model.pipeline import LossFn, StackedModel, default_stage_blocks, layer_specs, post_layers
from ..parallel.state import AxisGroup, ParallelState

log = logging.getLogger("mt3d")


@dataclass
class WeightSource:
    """Where weights come from: an HF directory or an mt3d checkpoint."""

    kind: str  # "hf" or "checkpoint"
    path: Path
    cfg: ModelConfig
    vocab: int
    tokenizer_dir: str | None
    _reader: object = None
    adapters: object = None
    """LoRA adapters merged into the weights as they are read (``mt3d.checkpoint.lora.AdapterSet``)."""
    lora_checkpoint: Path | None = None
    """The LoRA checkpoint the adapters come from (the weights are its base's: ``kind`` is "hf")."""

    def origin(self, name: str) -> str:
        """Where ``name`` comes from, for error messages."""
        if self.kind == "hf":
            return " + ".join(dict.fromkeys(p.name for p in pieces(self.cfg, name)))
        return name

    def shard(self, name: str, rank: int, world: int) -> torch.Tensor:
        """TP shard of global parameter ``name`` (with its adapters merged in, when there are)."""
        if self.kind == "hf":
            if self._reader is None:
                self._reader = HFReader(self.path)
            out = read_shard(self._reader, self.cfg, name, rank, world, self.vocab)
        else:
            out = self._reader.shard(name, rank, world)
        if self.adapters is not None:
            out = self.adapters.merged_shard(self.cfg, self.vocab, name, out, rank, world)
        return out

    def full(self, name: str) -> torch.Tensor:
        """The unsharded tensor of global parameter ``name`` (vocabulary padding removed)."""
        if self.kind == "checkpoint" and self.adapters is None:
            return self._reader.full(name)
        from ..model.sharding import from_shards, layout_of

        return from_shards([self.shard(name, 0, 1)], layout_of(self.cfg, self.vocab, name))


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def open_source(path: str | Path, verify: bool = True, adapter: str | Path | None = None,
                cfg: ModelConfig | None = None) -> WeightSource:  # fmt: skip
    """An HF model directory, or an mt3d checkpoint (a ``step_XXXXXXXX`` dir, or a run dir: its newest).
    A LoRA run's checkpoint reads as its base with the adapters merged in; ``adapter``: a PEFT adapter
    directory merged into the weights the same way. ``cfg``: the model to read an HF directory as (its
    config.json's with ``model.mtp``: the multi-token-prediction layers are read too)."""
    source = _open(path, verify, cfg)
    if adapter is not None:
        from .lora import from_peft

        if source.adapters is not None:
            raise UserError(f"{path} is a LoRA checkpoint with adapters of its own: drop --adapter")
        source.adapters = from_peft(adapter, source.cfg, source.vocab)
    return source


def _open(path: str | Path, verify: bool, cfg: ModelConfig | None = None) -> WeightSource:
    p = Path(path)
    if not p.exists():
        raise UserError(f"model not found: {p}")
    if (p / "config.json").is_file():
        cfg = cfg or config_from_hf(p)
        reader = HFReader(p)
        unused = check_weights(reader, cfg, cfg.vocab_size, str(p))
        if unused:
            log.warning("%s: %d stored tensor(s) are not part of the model config.json describes (e.g. %s): "
                        "ignored", p, len(unused), unused[0])  # fmt: skip
        return WeightSource("hf", p, cfg, cfg.vocab_size, str(p) if _has_tokenizer(p) else None, reader)
    from .manager import newest_complete
    from .reader import CheckpointReader

    if not (p / "manifest.json").is_file():
        found = newest_complete(p)
        if found is None:
            raise UserError(
                f"{p} is neither an HF model directory (config.json) nor an mt3d checkpoint or run"
            )
        p = found
    reader = CheckpointReader(p, verify=verify)
    own = p / "tokenizer"  # saved inside the checkpoint; older ones point to where the run had it
    tok = str(own) if _has_tokenizer(own) else reader.meta.get("data", {}).get("tokenizer")
    if "lora" in reader.meta:  # adapters only: the weights are its base's, with the adapters merged in
        from .lora import checked_base, from_checkpoint

        base = _open(checked_base(reader), verify)
        base.adapters, base.lora_checkpoint, base.tokenizer_dir = from_checkpoint(reader), p, tok
        return base
    return WeightSource("checkpoint", p, reader.cfg, reader.vocab, tok, reader)


def load_weights(module: nn.Module, source: WeightSource, tp: AxisGroup,
                 etp: AxisGroup | None = None) -> None:  # fmt: skip
    """Copy this rank's shard of every parameter of ``module`` from ``source`` (shapes checked): the
    routed experts' over ``etp`` (``parallel.expert_layout``; None: tp), the rest over ``tp``."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            split = etp if etp is not None and expert_index(name) is not None else tp
            try:
                shard = source.shard(name, split.rank, split.size)
            except HFError:
                raise
            except KeyError as e:
                raise UserError(f"{source.path}: no tensor for parameter {name!r} ({e})") from None
            if param.is_floating_point() and not shard.is_floating_point():
                raise UserError(
                    f"{source.path}: {name} (from {source.origin(name)}) is stored as {shard.dtype}, "
                    f"not a floating-point type: refusing to cast it into the model's {param.dtype}"
                )
            if tuple(shard.shape) != tuple(param.shape):
                raise UserError(
                    f"{source.path}: {name} (from {source.origin(name)}) has shape {tuple(shard.shape)} "
                    f"for {split.name} rank {split.rank}/{split.size}, the model expects {tuple(param.shape)}"
                )
            bad = nonfinite(shard)
            if bad:
                where = f"{source.path}: {weight_name(name)} (from {source.origin(name)})"
                raise UserError(f"{where} holds {bad}: the checkpoint is damaged or diverged; use another")
            param.copy_(shard.to(param.dtype))
    if source.kind == "hf" and source._reader is not None:
        source._reader.close()  # every weight is in place: release the files
        source._reader = None


def nonfinite(t: torch.Tensor) -> str | None:
    """How many NaN and infinite values ``t`` holds ("3 NaN and 1 inf values"), or None."""
    if not t.is_floating_point():
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} inf values" if nan or inf else None


def weight_name(name: str) -> str:
    """A parameter's name with its routed expert spelled out: ``3.mlp.experts.5.up.weight`` is expert 5
    of that block."""
    j = expert_index(name)
    return name if j is None else f"{name} (expert {j})"


def build_model(
    cfg: ModelConfig,
    vocab: int,
    state: ParallelState,
    *,
    seed: int = 1234,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    stage_blocks: list[int] | None = None,
    skip_init: bool = False,
) -> nn.Module:
    """An inference/fine-tuning model for this rank: StackedModel at pp = 1, else a pipeline stage."""
    ctx = BuildContext(tp=state.tp, seed=seed, skip_init=skip_init, cp=state.cp, ep=state.ep, etp=state.etp,
                       tpo=state.tpo)  # fmt: skip
    specs = layer_specs(cfg, ctx, vocab)
    loss = LossFn.of(cfg, state.tp, vocab)
    if state.pp.size == 1:
        model = StackedModel(specs, loss_fn=loss)
    else:
        from ..ds.pipe import Mt3dPipeline

        blocks = stage_blocks or default_stage_blocks(cfg.layers, state.pp.size)
        model = Mt3dPipeline(
            specs, topology=state.topology, loss_fn=loss, stage_blocks=blocks, post_layers=post_layers(cfg)
        )
    return model.to(device=device, dtype=dtype)


def inference_state(tp: int, pp: int, cp: int = 1, ep: int = 1) -> ParallelState:
    """Process groups for a tp x pp (x cp x ep) model: none for one rank, else from the launcher's
    ranks. ep ranks are data-parallel replicas that hold different experts (each runs the same input)."""
    import os

    import torch.distributed as dist

    from ..ds.topology import map_ranks

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    size = tp * pp * cp * ep
    if size == 1 and world == 1 and not dist.is_initialized():
        return ParallelState.single()
    if world != size:
        what = f"tp={tp} x pp={pp}" + "".join(f" x {a}={v}" for a, v in (("cp", cp), ("ep", ep)) if v > 1)
        raise UserError(f"{what} needs exactly {size} ranks; the launcher started {world}")
    if not dist.is_initialized():
        import deepspeed

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(verbose=False)
    return ParallelState.build(map_ranks(size, tp, pp, cp=cp, ep=ep))


def from_pretrained(
    path: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    state: ParallelState | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    adapter: str | Path | None = None,
) -> nn.Module:
    """Load an HF directory or mt3d checkpoint for the calling rank, ready to run (``adapter``: a PEFT
    LoRA adapter directory merged into its weights).

    Without torch.distributed (or with tp = pp = cp = 1) this is a single-process model. Under a
    launcher with ``tp * pp * cp`` ranks, each rank gets its TP shard of its pipeline stage and, with
    ``cp`` > 1, runs its chunks of every sequence (pass ``state`` to reuse existing process groups).
    The model carries ``.config`` (ModelConfig), ``.state`` (ParallelState) and ``.tokenizer_dir``.
    """
    from ..config.rules import expert_conflict

    source = open_source(path, adapter=adapter)
    cfg = source.cfg  # the main model: multi-token prediction's depths only train
    cfg = cfg if cfg.mtp is None else dataclasses.replace(cfg, mtp=None)
    cfg.check_parallel(tp, pp)
    why = expert_conflict(source.cfg.moe_spec, ep)
    if why:
        raise UserError(why.replace("parallel.expert", "--ep"))
    if state is None:
        state = ParallelState.single() if tp * pp * cp * ep == 1 else inference_state(tp, pp, cp, ep)
    model = build_model(cfg, source.vocab, state, dtype=dtype, device=device, skip_init=True)
    load_weights(model, source, state.tp, state.etp)
    model.config, model.state, model.tokenizer_dir = cfg, state, source.tokenizer_dir
    model.vocab_size = source.vocab
    return model.eval()
