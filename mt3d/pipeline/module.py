"""A pipeline stage that holds v non-contiguous chunks of layers (PTD-P's virtual stages).

Virtual stage j = c * p + r (chunk c of rank r) holds the j-th block of layers: ``stage_bounds``
over p * v per-chunk block counts, the embedding on virtual stage 0 and the head on virtual stage
p v - 1. A rank builds each of its chunks with DeepSpeed's own ``_build`` (modules named by global
layer index, the tied embedding shared as today) and exposes one at a time (``activate_chunk``) to
``forward``, DeepSpeed's checkpoint writer and its loader, so parameter names and checkpoint files
(``layer_XX-model_YY``) are the same as at v = 1, whatever v: checkpoints reshard across (tp, pp, v).
"""

from __future__ import annotations

from ..model.pipeline import Mt3dPipeline, stage_bounds


class InterleavedPipeline(Mt3dPipeline):
    """``Mt3dPipeline`` with ``virtual_stages`` chunks per rank; ``stage_blocks`` has p * v entries."""

    def __init__(self, specs: list, *, virtual_stages: int, **kwargs) -> None:
        self.virtual_stages = virtual_stages
        super().__init__(specs, **kwargs)

    def _partition_layers(self, method="mt3d-blocks"):
        p, v = self.num_stages, self.virtual_stages
        self.parts = stage_bounds(self._stage_blocks)
        if len(self.parts) != p * v + 1 or self.parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage_blocks {self._stage_blocks} do not fit {p} stages x {v} chunks")
        rank = self._topo.get_coord(self.global_rank).pipe
        self.chunk_bounds = [(self.parts[c * p + rank], self.parts[c * p + rank + 1]) for c in range(v)]
        self._set_bounds(*self.chunk_bounds[0])

    def stage_owner(self, layer_idx):
        """The pipeline rank whose chunk holds ``layer_idx``."""
        for j in range(len(self.parts) - 1):
            if self.parts[j] <= layer_idx < self.parts[j + 1]:
                return j % self.num_stages
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
