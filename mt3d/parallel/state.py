"""ParallelState: the process groups of one rank, built once from one MappedTopology.

It is handed explicitly to whoever needs a group (layers, loss, training loop); nothing here is a
module-level global. Groups are made for every axis of ``axes.AXES`` and for the combined groups
reductions need (``topology.COMBINED``): ``model`` (pipe x tensor: one model replica), ``dense``
(dp x cp: dense gradients and ZeRO partitions) and ``edp`` (the ranks holding the same experts,
``expert_layout``: expert gradients and ZeRO partitions). An optional axis of size 1 gets no process
group (its ``AxisGroup`` is the rank alone), and a combined group equal to another reuses it, so a
three-axis run makes exactly the groups it always made.

It also satisfies DeepSpeed's ``mpu`` contract (read in DeepSpeed's ``utils/groups.py`` and engine),
including the ``get_tensor_model_parallel_group`` that DeepSpeed's own PipelineParallelGrid lacks
and the sequence hooks its engine reads to average gradients over data x sequence parallelism.
Naming follows DeepSpeed: ``get_model_parallel_*`` is the pipe x tensor group (what DeepSpeed sums
gradient norms over); ``get_tensor_model_parallel_*`` and ``get_slice_parallel_*`` are the TP group;
DeepSpeed's "sequence parallel" is context parallelism (Ulysses), not Megatron's sequence
parallelism inside TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .axes import AXES
from .expert_layout import HOST_GROUPS
from .topology import COMBINED, place

ALWAYS = ("tp", "dp", "pp", "model", "edp")
"""Groups made even for one rank: DeepSpeed's mpu contract hands them out (None would mean world), and
under ep the experts' ZeRO group (``mt3d.ds.experts``; without ep it is ``dense``, see ``REUSE``)."""
REUSE = {"dense": ("cp", "dp"), "edp": ("ep", "dense")}
"""A combined group equals another when an axis is 1: dense is dp without cp, edp is dense without ep."""


@dataclass(frozen=True)
class AxisGroup:
    """One group along one axis, seen from the calling rank.

    ``group`` is a real process group whenever torch.distributed is initialised and the group has
    more than one rank (or is one of ``ALWAYS``); it is ``None`` only for a group of one rank, where
    no collective is ever issued (every collective in ``mappings`` returns early for size 1).
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    group: Any

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @classmethod
    def alone(cls, name: str, global_rank: int = 0) -> AxisGroup:
        """A one-rank group (no communication), for single-process references."""
        return cls(name=name, ranks=(global_rank,), rank=0, group=None)


GROUPS = (*(a.name for a in AXES), *COMBINED, "etp", "tpo", *HOST_GROUPS)
"""Every group a rank has: the axes', the combined ones, the expert layout's expert-TP group and the
TP ranks sharing an expert-TP rank (``topology.EXPERT_GROUPS``; the tp group and one rank before
folding), and the ep group split by host (``topology.HOST_GROUPS``; the ep group and one rank while
it stays on one host)."""


class ParallelState:
    """Ranks, sizes and process groups of the calling rank on every axis (``state.tp``, ``state.cp``,
    ...) and the combined groups (``state.model``, ``state.dense``, ``state.edp``)."""

    def __init__(self, topology, global_rank: int, groups: dict[str, AxisGroup]) -> None:
        missing = [g for g in GROUPS if g not in groups]
        if missing:
            raise ValueError(f"ParallelState needs every group; missing {missing}")
        self.topology = topology
        self.global_rank = global_rank
        self.groups = dict(groups)

    def __getattr__(self, name: str) -> AxisGroup:
        groups = self.__dict__.get("groups")
        if groups is not None and name in groups:
            return groups[name]
        raise AttributeError(name)

    @classmethod
    def build(cls, topology) -> ParallelState:
        """Create every group of the topology (a collective: all ranks must call it, same order)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelState.build needs torch.distributed initialised (use ParallelState.single)"
            )
        world, me = dist.get_world_size(), dist.get_rank()
        if world != topology.world:
            raise RuntimeError(
                f"topology is for {topology.world} ranks but {world} processes were launched; "
                "launch as many processes as the degrees multiply to, or change the degrees"
            )
        mine: dict[str, AxisGroup] = {}
        for name in GROUPS:
            mine[name] = _my_group(topology.placement, name, me, mine)
        return cls(topology, me, mine)

    @classmethod
    def single(cls) -> ParallelState:
        """State of a single-process run (every axis 1, no torch.distributed); its topology is the
        one-rank placement itself (nothing pipelines, so no DeepSpeed topology is needed)."""
        return cls(place(1), 0, {g: AxisGroup.alone(g) for g in GROUPS})

    # --- convenience -------------------------------------------------------------------
    def ep_hosts(self) -> tuple | None:
        """(ep_rail, ep_node, the host block of each ep rank in ep order) when this rank's ep group spans
        hosts evenly (``Placement.ep_host_blocks``; ``model.build.BuildContext.ep_hosts``), else None."""
        if self.groups["ep_rail"].size == 1:
            return None
        mine = next(b for b in self.placement.ep_host_blocks() if self.global_rank in b)  # [hosts, ranks]
        block = {int(r): j for j, ranks in enumerate(mine) for r in ranks}  # the rails' host order
        return (
            self.groups["ep_rail"],
            self.groups["ep_node"],
            tuple(block[r] for r in self.groups["ep"].ranks),
        )

    @property
    def placement(self):
        """The rank placement (``mt3d.parallel.topology.Placement``) the groups were built from."""
        return getattr(self.topology, "placement", self.topology)

    @property
    def stage(self) -> int:
        """Pipeline stage of this rank."""
        return self.pp.rank

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0."""
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.pp.rank == self.pp.size - 1

    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on every axis the layout shows."""
        return self.topology.coord(self.global_rank)

    def __repr__(self) -> str:
        parts = ", ".join(f"{a}={self.groups[a].rank}/{self.groups[a].size}" for a in self.placement.axes)
        return f"ParallelState(rank={self.global_rank}, {parts})"

    # --- DeepSpeed mpu contract ------------------------------------------------------------
    def get_global_rank(self) -> int:
        """This process's global rank."""
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        """Position in the data-parallel group."""
        return self.dp.rank

    def get_data_parallel_world_size(self) -> int:
        """Data-parallel degree dp."""
        return self.dp.size

    def get_data_parallel_group(self):
        """The data-parallel process group."""
        return self.dp.group

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of the data-parallel group."""
        return list(self.dp.ranks)

    def get_model_parallel_rank(self) -> int:
        """Position in the pipe x tensor group (one model replica; DeepSpeed's meaning)."""
        return self.model.rank

    def get_model_parallel_world_size(self) -> int:
        """Ranks holding one model replica (pp * tp)."""
        return self.model.size

    def get_model_parallel_group(self):
        """The pipe x tensor group DeepSpeed sums gradient norms over."""
        return self.model.group

    def get_tensor_model_parallel_rank(self) -> int:
        """Position in the tensor-parallel group."""
        return self.tp.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        """Tensor-parallel degree tp."""
        return self.tp.size

    def get_tensor_model_parallel_group(self):
        """The tensor-parallel process group (missing from DeepSpeed's own grid)."""
        return self.tp.group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this group."""
        return self.tp.ranks[0]

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_pipe_parallel_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.pp.rank

    def get_pipe_parallel_world_size(self) -> int:
        """Pipeline stages pp."""
        return self.pp.size

    def get_pipe_parallel_group(self):
        """The pipeline process group (one rank per stage)."""
        return self.pp.group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    # DeepSpeed's engine and ZeRO read these (utils/groups.py) to partition ZeRO states and reduce
    # gradients over data x sequence parallelism, and divide by the sequence size: gradients are
    # summed over cp and averaged over dp.
    def get_sequence_parallel_world_size(self) -> int:
        """Context-parallel degree cp (DeepSpeed's "sequence parallel" is Ulysses)."""
        return self.cp.size

    def get_sequence_parallel_rank(self) -> int:
        """Position in the context-parallel group."""
        return self.cp.rank

    def get_sequence_parallel_group(self):
        """The context-parallel process group (DeepSpeed asks for it only when cp > 1)."""
        return self.cp.group

    def get_sequence_data_parallel_world_size(self) -> int:
        """Ranks that average dense gradients: dp x cp."""
        return self.dense.size

    def get_sequence_data_parallel_rank(self) -> int:
        """Position in the dp x cp group."""
        return self.dense.rank

    def get_sequence_data_parallel_group(self):
        """The dp x cp group ZeRO partitions over and dense gradients are reduced over."""
        return self.dense.group


def _my_group(placement, name: str, me: int, made: dict[str, AxisGroup]) -> AxisGroup:
    """This rank's group ``name``, creating every group of that kind (collectively) if needed."""
    if name in REUSE and not (name == "edp" and placement.expert.folded):  # folded: edp is not dense's
        axis, same = REUSE[name]
        if placement.degrees[axis] == 1:
            return AxisGroup(name, made[same].ranks, made[same].rank, made[same].group)
    if name == "etp" and placement.expert.etp == placement.degrees["tp"]:  # the TP group itself
        return AxisGroup(name, made["tp"].ranks, made["tp"].rank, made["tp"].group)
    if name == "ep_node" and placement.size(name) == placement.size("ep"):  # the ep group on one host
        return AxisGroup(name, made["ep"].ranks, made["ep"].rank, made["ep"].group)
    lists = [sorted(g) for g in placement.groups(name)] if name == "model" else list(placement.groups(name))
    if len(lists[0]) == 1 and name not in ALWAYS:
        return AxisGroup.alone(name, me)
    found = None
    for ranks in lists:
        group = dist.new_group(ranks=ranks)  # collective over the world: every rank makes every group
        if me in ranks:
            found = AxisGroup(name, tuple(ranks), ranks.index(me), group)
    assert found is not None, f"rank {me} is in no {name} group"
    return found
