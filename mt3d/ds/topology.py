"""The rank mapper's placement as DeepSpeed's ``ProcessTopology``.

DeepSpeed's ``PipelineModule`` and its ``PipelineParallelGrid`` build their groups from a
``ProcessTopology`` whose ``mapping`` (coordinate -> global rank) they read everywhere; a subclass
that rewrites ``mapping`` places ranks arbitrarily (checked: it trains, DEEPSPEED_NOTES.md). Its
axes are DeepSpeed's three, ``['pipe', 'data', 'model']``: every mt3d axis counts in one of them
(``Axis.ds_axis``): cp inside 'data' (its ranks hold the same weights; the pipeline engine reduces
gradients and partitions ZeRO states over its 'data' groups), ep inside 'model' (ep ranks hold
different experts, so each writes its own checkpoint files; ``mt3d.ds.experts``).
tests/test_topology.py checks the mapping against DeepSpeed's own topology class.
"""

from __future__ import annotations

from deepspeed.runtime.pipe.topology import ProcessTopology

from ..parallel.axes import BY_NAME
from ..parallel.topology import DS_AXES, Placement, place


class MappedTopology(ProcessTopology):
    """A DeepSpeed ProcessTopology whose mapping carries a ``Placement``; see ``map_ranks``.

    Extra accessors use mt3d's axis names (``tp``, ``dp``, ``pp``, ...: degrees as attributes,
    ``groups('dp')``) and delegate to the placement.
    """

    def __init__(self, placement: Placement) -> None:
        ds = placement.deepspeed_grid()
        super().__init__(axes=list(DS_AXES), dims=list(ds.shape))
        self.placement = placement
        self.hosts = placement.hosts
        flat = ds.ravel().tolist()  # row-major over (pipe, data, model), as DeepSpeed's coordinates
        self.mapping = dict(zip(self.mapping.keys(), flat))
        self._coord_of = dict(zip(flat, self.mapping.keys()))

    def __getattr__(self, name: str):
        if name in BY_NAME:  # an axis's degree: topology.tp
            return self.placement.degrees[name]
        raise AttributeError(name)

    @property
    def order(self) -> str:
        """The nesting order as reports print it."""
        return self.placement.order

    @property
    def notes(self) -> tuple[str, ...]:
        """Warnings about the placement (groups that cross hosts or islands)."""
        return self.placement.notes

    @property
    def islands(self):
        """NVLink islands (local ranks) the placement was made for."""
        return self.placement.islands

    @islands.setter
    def islands(self, value) -> None:
        """Set the islands (``mt3d topo --islands`` on a placement made without them)."""
        self.placement.islands = value

    # DeepSpeed's get_coord scans the whole mapping per call; this is the same answer in O(1).
    def get_coord(self, rank):
        """The ProcessCoord of ``rank`` (DeepSpeed's API, by dictionary lookup)."""
        try:
            return self._coord_of[rank]
        except KeyError:
            raise ValueError(f"rank {rank} not found in topology.") from None

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.placement.world

    def coord(self, rank: int) -> dict[str, int]:
        """mt3d's coordinate of a global rank (every shown axis)."""
        return self.placement.coord(rank)

    def rank_of(self, **coord: int) -> int:
        """Global rank at a coordinate."""
        return self.placement.rank_of(**coord)

    def host_index(self, rank: int) -> int:
        """Index into ``hosts`` of the host that runs ``rank``."""
        return int(self.placement.host_of[rank])

    def host(self, rank: int) -> str:
        """Name of the host that runs ``rank``."""
        return self.placement.host(rank)

    def local_rank(self, rank: int) -> int:
        """Rank's position on its host (its LOCAL_RANK under the launcher)."""
        return self.placement.local_rank(rank)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (an axis name or a combined group), by coordinate."""
        return list(self.placement.groups(axis))

    def crossing(self, axis: str) -> int:
        """How many groups along ``axis`` span more than one host."""
        return self.placement.crossing(axis)

    def island_crossing_tp(self) -> int:
        """How many TP groups span more than one NVLink island (0 when no islands were given)."""
        return self.placement.island_crossing_tp()


def map_ranks(world_size: int, tp: int = 1, pp: int = 1, **kwargs) -> MappedTopology:
    """The rank mapping as a DeepSpeed topology (process groups, PipelineModule); arguments as
    ``mt3d.parallel.topology.place``. Builds one Python object per rank: for summaries of large worlds
    use ``place``."""
    return MappedTopology(place(world_size, tp, pp, **kwargs))
