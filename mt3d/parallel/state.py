"""ParallelState: the process groups of one rank, built once from one MappedTopology.

It is handed explicitly to whoever needs a group (layers, loss, training loop); nothing here is a
module-level global. It also satisfies DeepSpeed's ``mpu`` contract, including the
``get_tensor_model_parallel_group`` that DeepSpeed's own PipelineParallelGrid lacks.

Naming follows DeepSpeed's grid: ``get_model_parallel_*`` is the pipe x tensor group (all ranks
that hold one model replica: what DeepSpeed sums gradient norms over); ``get_tensor_model_parallel_*``
and ``get_slice_parallel_*`` are the TP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .topology import MappedTopology, map_ranks


@dataclass(frozen=True)
class AxisGroup:
    """One group along one axis, seen from the calling rank.

    ``group`` is a real process group whenever torch.distributed is initialised; it is ``None``
    only in a single-process run (``ParallelState.single``), where size is 1 and no collective is
    ever issued.
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


class ParallelState:
    """Ranks, sizes and process groups of the calling rank for tp, dp, pp (and pipe x tp)."""

    def __init__(
        self,
        topology: MappedTopology,
        global_rank: int,
        tp: AxisGroup,
        dp: AxisGroup,
        pp: AxisGroup,
        model: AxisGroup,
    ) -> None:
        self.topology = topology
        self.global_rank = global_rank
        self.tp, self.dp, self.pp, self.model = tp, dp, pp, model

    @classmethod
    def build(cls, topology: MappedTopology) -> ParallelState:
        """Create every group of the topology (a collective: all ranks must call it, same order)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelState.build needs torch.distributed initialised (use ParallelState.single)"
            )
        world, me = dist.get_world_size(), dist.get_rank()
        if world != topology.world:
            raise RuntimeError(
                f"topology is for {topology.world} ranks but {world} processes were launched; "
                "launch tp*pp*dp processes or change the degrees"
            )
        mine: dict[str, AxisGroup] = {}
        replica_groups = [sorted(topology.get_axis_list("data", d)) for d in range(topology.dp)]
        for axis, lists in (
            ("tp", topology.groups("tp")),
            ("dp", topology.groups("dp")),
            ("pp", topology.groups("pp")),
            ("model", replica_groups),
        ):
            for ranks in lists:
                # new_group is collective over the world: every rank creates every group.
                group = dist.new_group(ranks=ranks)
                if me in ranks:
                    mine[axis] = AxisGroup(axis, tuple(ranks), ranks.index(me), group)
        return cls(topology, me, mine["tp"], mine["dp"], mine["pp"], mine["model"])

    @classmethod
    def single(cls) -> ParallelState:
        """State of a single-process run (tp = pp = dp = 1, no torch.distributed)."""
        topo = map_ranks(1)
        return cls(topo, 0, *(AxisGroup.alone(a) for a in ("tp", "dp", "pp", "model")))

    # --- convenience -------------------------------------------------------------------
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

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.global_rank}, tp={self.tp.rank}/{self.tp.size}, "
            f"dp={self.dp.rank}/{self.dp.size}, pp={self.pp.rank}/{self.pp.size})"
        )

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
