"""What a layer needs to know to be built: the parallel groups, the initialisation and the
recompute, FP8 and context-parallel choices (``BuildContext``), passed explicitly to every layer."""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch

from ..parallel.fp8 import PLAIN, DispatchRows, Gemms, gemms_for
from ..parallel.layers import (
    NoInit,
    NormalInit,
)
from ..parallel.random import RNGTracker
from ..parallel.state import AxisGroup


@dataclass(frozen=True)
class BuildContext:
    """What a layer needs to know about parallelism and initialisation; passed explicitly.

    Attributes:
        tp: the tensor-parallel group (``AxisGroup.alone`` for the single-process model).
        seed: base seed of the weight init; every parameter's stream is derived from
            (seed, layer index, parameter name), so any layout starts from the same weights.
        sequence_parallel: shard the residual stream over the sequence between TP regions.
        tracker: TP-aware RNG for dropout inside TP regions (None: dropout uses default RNG).
        vocab_multiple: pad the vocabulary to a multiple of this times tp.
        dtype, device: of the parameters.
        skip_init: leave weights uninitialised (they are about to be loaded from a checkpoint).
        cp: the context-parallel group (None or one rank: each rank holds whole sequences).
        cp_exchange: how attention reaches the other cp ranks' tokens (``parallel.context``).
        tile_len: run the MLP and the loss over at most this many sequence positions at a time
            (``train.recompute.tile_len``; 0: whole sequences). The LM head then returns its
            (gathered) input and weight instead of logits, and ``LossFn`` projects tile by tile.
        ep: the expert-parallel group (None or one rank: every rank holds every expert).
        etp: the expert-tensor-parallel group, the ranks splitting one expert's inner dimension
            (``parallel.expert_layout``; None: tp, every expert split over the whole TP group).
        tpo: with etp smaller than tp, the ranks of a TP group with the same expert-TP rank: without
            sequence parallelism they hold the same tokens, and each routes 1/tpo of them (None: one).
        ep_hosts: with ``parallel.expert_dispatch`` "node" and an ep group across hosts, (the ep ranks
            at this rank's place on each host, the ep ranks on this host, each ep rank's host block):
            the dispatch crosses to each host once, then fans out within it (None: one hop over ep).
        keep_gathered: with sequence parallelism, column-parallel linears keep their all-gathered
            input for the backward instead of the 1/tp shard (``train.recompute.gathered_sp_inputs``).
        selective: recompute the attention core and the MLP's activation in the backward
            (``train.recompute.granularity`` selective).
        fp8: the FP8 recipe of the blocks' column- and row-parallel linears (``train.fp8``; None:
            their GEMMs in the parameters' dtype); ``fp8_all_gather``: with SP, all-gather the
            column-parallel inputs in FP8; ``fp8_skip``: block indices whose linears stay plain;
            ``fp8_experts``: the routed experts' GEMMs in FP8 too; ``fp8_dispatch``: the expert
            dispatch's rows in FP8.
        dispatch_chunks: pipeline each MoE layer's expert all-to-all over this many chunks of its
            tokens (``train.overlap.dispatch_chunks``).
        dispatch_once: under ep, send each token once to each rank holding any of its experts (False:
            once per expert it is routed to, ``parallel.expert_dispatch`` "assignment").
    """

    tp: AxisGroup
    seed: int = 1234
    sequence_parallel: bool = False
    tracker: RNGTracker | None = field(default=None, compare=False)
    vocab_multiple: int = 128
    dtype: torch.dtype = torch.float32
    device: str | None = None
    skip_init: bool = False
    cp: AxisGroup | None = None
    cp_exchange: str = "auto"
    tile_len: int = 0
    ep: AxisGroup | None = None
    etp: AxisGroup | None = None
    tpo: AxisGroup | None = None
    ep_hosts: tuple | None = None
    keep_gathered: bool = False
    selective: bool = False
    fp8: str | None = None
    fp8_all_gather: bool = False
    fp8_skip: frozenset[int] = frozenset()
    fp8_experts: bool = False
    fp8_dispatch: bool = False
    dispatch_chunks: int = 1
    dispatch_once: bool = True

    def init(self, layer: int, name: str, std: float) -> NormalInit | NoInit:
        """The init of one parameter, independent of the layout."""
        if self.skip_init:
            return NoInit()
        return NormalInit(std, (self.seed * 1_000_003 + layer * 7919 + zlib.crc32(name.encode())) % 2**61)

    def gemms(self, layer: int) -> Gemms:
        """How block ``layer``'s column- and row-parallel linears run their GEMMs."""
        if self.fp8 is None or layer in self.fp8_skip:
            return PLAIN
        return gemms_for(self.fp8, self.fp8_all_gather and self.sp)

    def expert_gemms(self, layer: int) -> Gemms:
        """How block ``layer``'s routed experts run their GEMMs (``train.fp8.experts``: the recipe's)."""
        if not self.fp8_experts or self.fp8 is None or layer in self.fp8_skip:
            return PLAIN
        return gemms_for(self.fp8)

    def dispatch_codec(self, layer: int) -> DispatchRows | None:
        """How block ``layer``'s expert dispatch carries its rows (``train.fp8.dispatch``: in the recipe's
        FP8 tiles; None: as they are)."""
        if not self.fp8_dispatch or self.fp8 is None or layer in self.fp8_skip:
            return None
        return DispatchRows(self.fp8)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually in effect (needs tp > 1)."""
        return self.sequence_parallel and self.tp.size > 1

    def tp_region_rng(self):
        """Context for random ops whose result must differ per TP rank."""
        return self.tracker.fork() if self.tracker is not None else contextlib.nullcontext()

    @property
    def cp_size(self) -> int:
        """Context-parallel degree (1: whole sequences)."""
        return self.cp.size if self.cp is not None else 1

    def positions(self, local_len: int, offset: int = 0, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens (its cp chunks; ``offset`` + arange
        without context parallelism)."""
        if self.cp_size == 1:
            return torch.arange(offset, offset + local_len, device=device)
        from ..parallel.context import local_positions

        return local_positions(self.cp, local_len, device)

    def document_positions(self, documents: torch.Tensor, local_len: int) -> torch.Tensor:
        """[b, local_len]: this rank's tokens' positions inside their documents (``documents`` [b, n]
        for the whole sequence; this rank holds ``positions(local_len)`` of it)."""
        from .documents import relative_positions

        return relative_positions(documents)[:, self.positions(local_len, 0, documents.device)]
