"""Reading mt3d checkpoints without DeepSpeed: model weights at any TP size, for export and inference.

A checkpoint written by the pipeline engine holds one file per layer and TP rank
(``layer_XX-model_YY-model_states.pt``); the regular engine (ZeRO-2 at pp = 1) writes
``mp_rank_YY_model_states.pt`` with the whole module. Under ZeRO-3 DeepSpeed saves empty module
tensors: the weights exist only as the fp32 master partitions in
``zero_pp_rank_D_mp_rank_YY_optim_states.pt``, one per data-parallel rank D, each the
concatenation of that rank's ceil(numel / dp) slice of every parameter (in the order of
``param_shapes`` in the model-states file); they are stitched back here. Either way ``full(name)``
returns the unsharded tensor and ``shard(name, rank, world)`` any TP slice of it. Files are
checked against the manifest before they are used, and unpickled with ``weights_only=True``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from ..ds.safe import safe_torch_load
from ..model.config import ModelConfig
from ..model.moe import expert_index
from ..model.sharding import from_shards, layout_of, named_as, split_name, to_shard
from ..parallel.axes import expert_layout
from .manifest import CheckpointError, check_sizes, read_manifest, verify_files


class CheckpointReader:
    """Unsharded weights of an mt3d checkpoint directory (``.../checkpoints/step_XXXXXXXX``)."""

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {self.dir}")
        self.manifest = read_manifest(self.dir)
        check_sizes(self.dir, self.manifest)
        self.verified = False
        meta = self.manifest["meta"]
        self.meta = meta
        try:
            self.cfg = ModelConfig.from_dict(meta["model"])
            self.vocab = int(meta["vocab_size"])
            self.tp = int(meta["layout"]["tp"])
            self.dp = int(meta["layout"]["dp"])
            self.ep = int(meta["layout"].get("ep", 1))
            self.experts = expert_layout(meta["layout"])
            self.zero3 = int(meta["layout"].get("zero_stage", 0)) == 3
            self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                meta.get("precision"), torch.float32
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{self.dir}/manifest.json does not describe an mt3d training checkpoint "
                f"({e!r} missing or invalid)"
            ) from None
        self.files = self.manifest["files"]
        if verify:  # only the files weights are read from (ZeRO-3: its optimizer states, swap files)
            prefixes = (
                ("zero_pp_rank_", "nvme_index/", "offloaded_tensors/")
                if self.zero3
                else ("layer_", "mp_rank_")
            )
            weights = [n for n in sorted(self.files) if n.startswith(prefixes) and "/exp_avg" not in n]
            verify_files(self.dir, self.manifest, weights)
            self.verified = True
        self.pipeline_files = any(n.startswith("layer_") for n in self.manifest["files"])

    @lru_cache(maxsize=8)  # noqa: B019 - a reader lives as long as one export / load
    def _layer(self, layer: int, model_rank: int) -> dict:
        name = f"layer_{layer:02d}-model_{model_rank:02d}-model_states.pt"
        return self._load(name, f" (checkpoint written with tp={self.tp}, ep={self.ep}?)")

    def _model_rank(self, local: str, tp_rank: int) -> int:
        """The 'model' coordinate whose files hold ``local`` (a layer's parameter) for ``tp_rank`` (of tp,
        or of etp for a routed expert's): ep ranks count in DeepSpeed's 'model' axis
        (``mt3d.ds.experts``), each holding experts / ep of every sparse layer at
        ``ExpertLayout.model_rank`` (e x tp + tp_rank before folding); dense weights are held by every
        ep rank, read from the first. The regular engine's module files (ZeRO-2) are numbered alike."""
        j = expert_index(local)
        if j is None:
            return tp_rank
        return self.experts.model_rank(j // (self.cfg.moe_spec.experts // self.ep), tp_rank)

    def _shards(self, name: str) -> int:
        """How many ranks split parameter ``name``: etp for a routed expert's, else tp."""
        return self.experts.etp if expert_index(split_name(name)[1]) is not None else self.tp

    def _load(self, name: str, hint: str = "") -> dict:
        """One file of the checkpoint, which must be listed in its manifest."""
        if name not in self.manifest["files"]:
            raise CheckpointError(f"{self.dir / name} is missing{hint}")
        return safe_torch_load(self.dir / name)

    def _zero3_module(self, tp_rank: int) -> dict:
        """TP rank ``tp_rank``'s module weights stitched from every DP rank's ZeRO-3 fp32 partitions
        (sub-groups in order; NVMe-swapped ones from their swap files, ``mt3d.ds.nvme``)."""
        from ..ds.nvme import swapped_flats

        shapes = self._load(f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt").get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"{self.dir}: ZeRO-3 parameter shapes are missing from its model states")
        flats = []
        for d in range(self.dp):
            name = f"zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_optim_states.pt"
            groups = self._load(name)["optimizer_state_dict"]["fp32_flat_groups"]
            flats.append(
                torch.cat([g.reshape(-1) for g in swapped_flats(self.dir, name, groups, self.files)])
            )
        state, offset = {}, 0
        for group_shapes in shapes:  # each rank's partitions, group after group, parameter after parameter
            for pname, shape in group_shapes.items():
                numel = int(torch.Size(shape).numel())
                part = -(-numel // self.dp)
                pieces = [f[offset : offset + part] for f in flats]
                if any(p.numel() != part for p in pieces):
                    raise CheckpointError(f"{self.dir}: ZeRO-3 partitions end before {pname!r}; truncated?")
                state[pname] = torch.cat(pieces)[:numel].detach().view(shape).to(self.dtype)
                offset += part
        return state

    @lru_cache(maxsize=8)  # noqa: B019
    def _module(self, tp_rank: int) -> dict:
        if self.zero3:
            return self._zero3_module(tp_rank)
        name = f"mp_rank_{tp_rank:02d}_model_states.pt"
        state = self._load(name).get("module")
        if not state:
            raise CheckpointError(f"{self.dir / name} holds no module weights")
        return state

    def _local(self, name: str, tp_rank: int) -> torch.Tensor:
        layer, local = split_name(name)
        if self.pipeline_files:
            state = self._layer(layer, self._model_rank(local, tp_rank))
            key = local
        else:
            state, key = self._module(self._model_rank(local, tp_rank)), name
        if key not in state:
            raise CheckpointError(f"{self.dir}: parameter {name!r} not found in the checkpoint")
        return state[key]

    def full(self, name: str) -> torch.Tensor:
        """The unsharded tensor of global parameter ``name`` (vocabulary padding removed; the word
        embedding by either of its names, ``sharding.named_as``)."""
        name = named_as(self.cfg, name)
        layout = layout_of(self.cfg, self.vocab, name)
        return from_shards([self._local(name, r) for r in range(self._shards(name))], layout)

    def shard(self, name: str, rank: int, world: int) -> torch.Tensor:
        """TP rank ``rank`` of ``world``'s shard of ``name`` (any world size: resharded on the fly)."""
        name = named_as(self.cfg, name)
        return to_shard(self.full(name), layout_of(self.cfg, self.vocab, name), rank, world)
