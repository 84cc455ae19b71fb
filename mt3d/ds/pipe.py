"""DeepSpeed's ``PipelineModule`` as mt3d runs it: stages cut by explicit block counts, mt3d's own
recompute, and virtual stages (PTD-P's interleaved schedule).

Overrides of DeepSpeed internals (``_partition_layers``, ``_build``, ``_set_bounds``,
``_synchronize_tied_weights``, ``allreduce_tied_weight_gradients``), watched by
tests/test_interleaved.py, tests/test_training.py and tests/test_lora.py:

* ``Mt3dPipeline``: DeepSpeed's partition methods balance by type or parameters; mt3d cuts by
  explicit block counts so that uneven first/last stages can be configured. Activation
  checkpointing is done by mt3d rather than by DeepSpeed's interval mechanism: runs of up to
  ``recompute_interval`` consecutive blocks are checkpointed on every stage (the embedding and head
  never are), with mt3d's TP-aware, recompute-safe ``checkpoint``. The tied-weight broadcast runs
  without autograd (DeepSpeed's records a graph torch then warns about on every backward).
* ``InterleavedPipeline``: a stage that holds v non-contiguous chunks of layers. Virtual stage j
  holds the j-th block of layers (``stage_bounds`` over p * v per-chunk block counts, the embedding
  on virtual stage 0 and the head on virtual stage p v - 1), on the (rank, chunk) its ``placement``
  gives (``pipeline.zero_bubble.stages``): PTD-P's ring (j = c * p + r: chunk c of rank r), or
  ZB-V's V (rank r holds stages r and 2p - 1 - r; the head then sits on rank 0 beside the
  embedding, so a tied embedding is one module there, and its gradient needs no sum over stages).
  A rank builds each of its chunks with DeepSpeed's own ``_build`` (modules named by global layer
  index, the tied embedding shared as at v = 1) and exposes one at a time (``activate_chunk``) to
  ``forward``, DeepSpeed's checkpoint writer and its loader, so parameter names and checkpoint
  files (``layer_XX-model_YY``) are the same as at v = 1, whatever v: checkpoints reshard across
  (tp, pp, v).

The PipelineModule receives the topology from the rank mapper, so its grid and mt3d's
ParallelState describe the same groups.
"""

from __future__ import annotations

import logging

import torch
from deepspeed.runtime.pipe.module import PipelineModule

from ..model.pipeline import POST_LAYERS, LossFn, run_layers, stage_bounds
from ..parallel.random import checkpoint
from ..pipeline import zero_bubble

log = logging.getLogger("mt3d")


class Mt3dPipeline(PipelineModule):
    """DeepSpeed PipelineModule with mt3d's block-based partitioning and recompute."""

    def __init__(
        self,
        specs: list,
        *,
        topology,
        loss_fn: LossFn,
        stage_blocks: list[int],
        recompute_interval: int = 0,
        ckpt=None,
        post_layers: int = POST_LAYERS,
    ) -> None:
        self._stage_blocks = list(stage_blocks)
        self._post = post_layers  # layers after the last block (``model.pipeline.post_layers``)
        self.recompute_interval = recompute_interval
        self._ckpt = ckpt or checkpoint
        super().__init__(
            layers=specs,
            topology=topology,
            loss_fn=loss_fn,
            partition_method="mt3d-blocks",
            activation_checkpoint_interval=0,
        )

    def _partition_layers(self, method="mt3d-blocks"):
        # DeepSpeed's methods balance by type or parameters; mt3d cuts by explicit block counts so
        # uneven first/last stages can be configured.
        self.parts = stage_bounds(self._stage_blocks, self._post)
        if len(self.parts) != self.num_stages + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage_blocks {self._stage_blocks} do not fit {len(self._layer_specs)} layers")
        stage = self._topo.get_coord(self.global_rank).pipe
        if self.global_rank == 0:
            log.info("pipeline stages (blocks per stage): %s", self._stage_blocks)
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied embedding in place with autograd recording; torch then warns
        # on every backward that c10d::broadcast_ has no autograd kernel. The copy needs no graph.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def allreduce_tied_weight_gradients(self):
        """DeepSpeed's sum of the tied embedding's gradient over the stages that share it, skipped
        when that weight is frozen (LoRA: ``mt3d.model.lora``), where DeepSpeed would all-reduce its
        ``grad`` of None (tests/test_lora.py watches the upstream call)."""
        frozen = all(not w.requires_grad for w, _ in self.get_tied_weights_and_groups())
        if not frozen:
            super().allreduce_tied_weight_gradients()

    def train(self, mode: bool = True):
        """``nn.Module.train``, skipped when every module is in ``mode`` already: DeepSpeed's pipeline
        engine calls it at every ``train_batch``, and torch sets ``training`` on every submodule through
        ``nn.Module.__setattr__`` (0.3-0.6 ms of a 17 ms step's CPU time on the 2-layer Mixtral of
        ``python -m mt3d.bench autoep``: its 70 modules)."""
        if isinstance(mode, bool) and all(m.training == mode for m in self.modules()):
            return self
        return super().train(mode)

    def forward(self, forward_input):
        """Run this stage's layers (recomputing blocks in runs of ``recompute_interval``)."""
        self.micro_offset += 1
        return run_layers(self.forward_funcs, forward_input, self.recompute_interval, self._ckpt)


class InterleavedPipeline(Mt3dPipeline):
    """``Mt3dPipeline`` with ``virtual_stages`` chunks per rank; ``stage_blocks`` has p * v entries."""

    def __init__(self, specs: list, *, virtual_stages: int, schedule: str = "1f1b", **kwargs) -> None:
        self.virtual_stages = virtual_stages
        self.schedule = schedule
        """``mt3d.parallel.schedule``: "zbv" places the chunks as a V, any other as a ring."""
        super().__init__(specs, **kwargs)

    def _partition_layers(self, method="mt3d-blocks"):
        p, v = self.num_stages, self.virtual_stages
        self.placement = zero_bubble.stages(self.schedule, p, v)
        """(pipeline rank, chunk) of each virtual stage."""
        self.parts = stage_bounds(self._stage_blocks, self._post)
        if len(self.parts) != p * v + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage_blocks {self._stage_blocks} do not fit {p} stages x {v} chunks")
        if len(self.placement) != p * v:
            raise ValueError(f"{self.schedule} places {len(self.placement)} chunks, not {p} x {v}")
        rank = self._topo.get_coord(self.global_rank).pipe
        mine = sorted((c, j) for j, (r, c) in enumerate(self.placement) if r == rank)
        self.chunk_bounds = [(self.parts[j], self.parts[j + 1]) for _, j in mine]
        self._set_bounds(*self.chunk_bounds[0])

    def stage_owner(self, layer_idx):
        """The pipeline rank whose chunk holds ``layer_idx``."""
        for j in range(len(self.parts) - 1):
            if self.parts[j] <= layer_idx < self.parts[j + 1]:
                return self.placement[j][0]
        raise RuntimeError(f"layer {layer_idx} is outside {self.parts}")

    def _build(self):
        self.chunk_funcs = []
        for bounds in self.chunk_bounds:
            self._set_bounds(*bounds)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int) -> None:
        """Expose chunk ``chunk``'s layers to ``forward`` and to DeepSpeed's save and load."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self._set_bounds(*self.chunk_bounds[chunk])

    def save_state_dict(self, *args, **kwargs):
        """One ``layer_XX`` file per layer of every chunk (global layer indices)."""
        for c in range(self.virtual_stages):
            self.activate_chunk(c)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args, **kwargs):
        """Load every chunk's layers (each call re-synchronises the tied weights; harmless)."""
        for c in range(self.virtual_stages):
            self.activate_chunk(c)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)
