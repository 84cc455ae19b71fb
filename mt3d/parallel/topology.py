"""Topology-aware rank mapper: (world, hosts, tp, pp, order, NVLink islands) -> ProcessTopology.

Everything here is pure: no processes, no torch.distributed. The launcher decides which global
ranks live on which host (host 0 gets ranks 0..slots0-1, host 1 the next slots1, ...); the mapper
decides which (tp, dp, pp) coordinate each of those ranks plays, so that

* every tensor-parallel group sits inside one host, and inside one NVLink island when islands are
  given and tp fits in one;
* data-parallel groups sit inside a host when they fit (first-fit of whole groups);
* pipeline stages, the lightest traffic, are what crosses hosts.

The result is a DeepSpeed ``ProcessTopology`` (axes ``pipe``, ``data``, ``model``) whose
``mapping`` carries the placement, so DeepSpeed's PipelineModule, mt3d's ParallelState and the TP
layers all read their groups from this one object.
"""

from __future__ import annotations

import warnings

import numpy as np
from deepspeed.runtime.pipe.topology import ProcessTopology

from ..inputs import MAX_WORLD
from .hosts import Host, TopologyError, uniform_hosts

AXES = ("tp", "dp", "pp")
# mt3d axis name -> DeepSpeed axis name. DeepSpeed's "model" axis is tensor slicing.
DS_AXIS = {"tp": "model", "dp": "data", "pp": "pipe"}
DEFAULT_ORDER = "tp-dp-pp"


def parse_order(order: str) -> tuple[str, str, str]:
    """Validate an axis order such as ``"tp-dp-pp"`` (innermost first)."""
    parts = tuple(p.strip().lower() for p in order.split("-"))
    if sorted(parts) != sorted(AXES):
        raise TopologyError(f"order must be a permutation of tp-dp-pp (innermost first), got {order!r}")
    return parts  # type: ignore[return-value]


AXIS_DIM = {"pp": 0, "dp": 1, "tp": 2}  # axes of Placement.grid


class Placement:
    """Where every (tp, dp, pp) coordinate runs, as arrays (no per-rank Python objects).

    ``grid[pp, dp, tp]`` is the global rank at that coordinate; hosts hold consecutive ranks in
    order. Summaries (group counts, crossings, traffic) are vectorised over the grid, so a million
    ranks take well under a second and tens of MB.
    """

    def __init__(self, *, grid: np.ndarray, order: str, hosts: tuple[Host, ...], islands, notes=()) -> None:
        self.grid = grid
        self.pp, self.dp, self.tp = grid.shape
        self.order, self.hosts, self.islands, self.notes = order, hosts, islands, tuple(notes)
        slots = np.array([h.slots for h in hosts], dtype=np.int64)
        self.host_of = np.repeat(np.arange(len(hosts)), slots)
        self.host_start = np.concatenate(([0], np.cumsum(slots)[:-1]))
        self._coords = None

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.tp * self.pp * self.dp

    def coord(self, rank: int) -> dict[str, int]:
        """The (tp, dp, pp) coordinate of a global rank."""
        if self._coords is None:  # inverse of the grid, built on first use
            inv = np.empty(self.world, dtype=np.int64)
            inv[self.grid.ravel()] = np.arange(self.world)
            self._coords = inv
        p, rest = divmod(int(self._coords[rank]), self.dp * self.tp)
        d, t = divmod(rest, self.tp)
        return {"tp": t, "dp": d, "pp": p}

    def rank_of(self, *, tp: int, dp: int, pp: int) -> int:
        """Global rank at a (tp, dp, pp) coordinate."""
        return int(self.grid[pp, dp, tp])

    def host(self, rank: int) -> str:
        """Name of the host that runs ``rank``."""
        return self.hosts[int(self.host_of[rank])].name

    def local_rank(self, rank: int) -> int:
        """Rank's position on its host (its LOCAL_RANK under the launcher)."""
        return int(rank - self.host_start[self.host_of[rank]])

    def _axis_last(self, axis: str) -> np.ndarray:
        """The grid with ``axis`` last and the others in DeepSpeed's (pipe, data, model) order."""
        if axis not in AXIS_DIM:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        return np.moveaxis(self.grid, AXIS_DIM[axis], -1)

    def groups(self, axis: str):
        """Every group along ``axis``, in DeepSpeed's ``get_axis_comm_lists`` order (a generator)."""
        g = self._axis_last(axis)
        for row in g.reshape(-1, g.shape[-1]):
            yield row.tolist()

    def group_count(self, axis: str) -> int:
        """How many groups there are along ``axis``."""
        return self.world // self.grid.shape[AXIS_DIM[axis]]

    def _hosts_along(self, axis: str) -> np.ndarray:
        g = self._axis_last(axis)
        return self.host_of[g.reshape(-1, g.shape[-1])]

    def crossing(self, axis: str) -> int:
        """How many groups along ``axis`` span more than one host."""
        h = self._hosts_along(axis)
        return int((h.min(axis=1) != h.max(axis=1)).sum())

    def crossing_edges(self, axis: str, ring: bool) -> int:
        """Neighbouring pairs in every group (wrapping round when ``ring``) that join two hosts."""
        h = self._hosts_along(axis)
        if h.shape[1] < 2:
            return 0
        edges = int((h[:, 1:] != h[:, :-1]).sum())
        return edges + int((h[:, 0] != h[:, -1]).sum()) if ring else edges

    def island_crossing_tp(self) -> int:
        """How many TP groups span more than one NVLink island (0 when no islands were given)."""
        if not self.islands:
            return 0
        max_local = max(h.slots for h in self.hosts)
        island_of = -1 - np.arange(max_local)  # a local rank outside every island is its own island
        for i, isl in enumerate(self.islands):
            for lr in isl:
                if lr < max_local:
                    island_of[lr] = i
        ranks = self._axis_last("tp").reshape(-1, self.tp)
        hosts = self.host_of[ranks]
        key = hosts * (2 * max_local + 1) + island_of[ranks - self.host_start[hosts]]
        return int((key.min(axis=1) != key.max(axis=1)).sum())


class MappedTopology(ProcessTopology):
    """A DeepSpeed ProcessTopology whose mapping carries a ``Placement``; see ``map_ranks``.

    Axes are DeepSpeed's ``['pipe', 'data', 'model']``; ``mapping`` is rewritten with the placement.
    Extra accessors use mt3d's names (``tp``, ``dp``, ``pp``) and delegate to the placement.
    """

    def __init__(self, placement: Placement) -> None:
        pl = placement
        super().__init__(axes=["pipe", "data", "model"], dims=[pl.pp, pl.dp, pl.tp])
        self.placement = pl
        self.tp, self.pp, self.dp = pl.tp, pl.pp, pl.dp
        self.order, self.hosts = pl.order, pl.hosts
        flat = pl.grid.ravel().tolist()  # row-major over (pipe, data, model), as DeepSpeed's coordinates
        self.mapping = dict(zip(self.mapping.keys(), flat))
        self._coord_of = dict(zip(flat, self.mapping.keys()))

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
        return self.tp * self.pp * self.dp

    def coord(self, rank: int) -> dict[str, int]:
        """The (tp, dp, pp) coordinate of a global rank."""
        c = self._coord_of[rank]
        return {"tp": c.model, "dp": c.data, "pp": c.pipe}

    def rank_of(self, *, tp: int, dp: int, pp: int) -> int:
        """Global rank at a (tp, dp, pp) coordinate."""
        return self.placement.rank_of(tp=tp, dp=dp, pp=pp)

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
        """Every group along ``axis`` ('tp', 'dp' or 'pp'), each listed by its axis coordinate."""
        return list(self.placement.groups(axis))

    def crossing(self, axis: str) -> int:
        """How many groups along ``axis`` span more than one host."""
        return self.placement.crossing(axis)

    def island_crossing_tp(self) -> int:
        """How many TP groups span more than one NVLink island (0 when no islands were given)."""
        return self.placement.island_crossing_tp()


def _natural_grid(tp: int, dp: int, pp: int, order: tuple[str, str, str]) -> np.ndarray:
    """Row-major placement in ``order`` (innermost first) as grid[pp, dp, tp]."""
    dims = {"tp": tp, "dp": dp, "pp": pp}
    stride, strides = 1, {}
    for ax in order:
        strides[ax] = stride
        stride *= dims[ax]
    p = np.arange(pp)[:, None, None] * strides["pp"]
    d = np.arange(dp)[None, :, None] * strides["dp"]
    t = np.arange(tp)[None, None, :] * strides["tp"]
    return p + d + t


def _tp_chunks(
    hosts: tuple[Host, ...], tp: int, islands: tuple[tuple[int, ...], ...] | None
) -> tuple[np.ndarray, np.ndarray, dict[int, list[int]]]:
    """Carve each host into tp-sized groups of global ranks (island-local first, then host-local).

    Returns the chunks as a [chunks, tp] rank array with their host indices, in host order, and,
    per host, the ranks left over (fewer than tp) that could only join a TP group crossing hosts.
    """
    if not islands and all(h.slots % tp == 0 for h in hosts):  # the common case, vectorised
        slots = np.array([h.slots for h in hosts], dtype=np.int64)
        chunks = np.arange(int(slots.sum())).reshape(-1, tp)
        return chunks, np.repeat(np.arange(len(hosts)), slots // tp), {}
    chunks: list[list[int]] = []
    owner: list[int] = []
    leftovers: dict[int, list[int]] = {}
    start = 0
    for hi, h in enumerate(hosts):
        local_islands = [[lr for lr in isl if lr < h.slots] for isl in (islands or [tuple(range(h.slots))])]
        covered = {lr for isl in local_islands for lr in isl}
        local_islands += [[lr] for lr in range(h.slots) if lr not in covered]
        free: list[int] = []
        for isl in local_islands:
            ranks = [start + lr for lr in isl]
            while len(ranks) >= tp:
                chunks.append(ranks[:tp])
                owner.append(hi)
                ranks = ranks[tp:]
            free.extend(ranks)  # island remainders, kept in island order so pairs stay adjacent
        while len(free) >= tp:
            chunks.append(free[:tp])
            owner.append(hi)
            free = free[tp:]
        if free:
            leftovers[hi] = free
        start += h.slots
    return np.array(chunks, dtype=np.int64).reshape(-1, tp), np.array(owner, dtype=np.int64), leftovers


def _packed_grid(
    tp: int,
    dp: int,
    pp: int,
    order: tuple[str, str, str],
    hosts: tuple[Host, ...],
    islands: tuple[tuple[int, ...], ...] | None,
    allow_crossing: bool,
) -> tuple[np.ndarray, list[str]]:
    """Place whole TP groups on hosts/islands; whole groups of the next axis first-fit per host.

    A block (the TP groups forming one group along the next axis) goes to the first host with room
    for it; as every block is the same size, that is each host in turn until it is full, so the
    first-fit is computed per host, not per block. Blocks that fit no host take the remaining TP
    groups in host order (and then the ones that cross hosts).
    """
    notes: list[str] = []
    chunks, owner, leftovers = _tp_chunks(hosts, tp, islands)
    if leftovers:
        detail = ", ".join(f"{hosts[h].name} ({hosts[h].slots} slots)" for h in leftovers)
        if not allow_crossing:
            raise TopologyError(
                f"tp={tp} groups cannot all stay inside one host: {detail} not a multiple of tp; "
                "use slots that are multiples of tp, a smaller tp, or allow_crossing (--allow-crossing)"
            )
        spill = np.array(
            [r for h in sorted(leftovers) for r in leftovers[h]], dtype=np.int64
        )  # spans few hosts
        extra = spill[: len(spill) // tp * tp].reshape(-1, tp)
        chunks = np.concatenate([chunks, extra])
        owner = np.concatenate([owner, np.full(len(extra), -1)])
        notes.append(f"{len(extra)} TP group(s) cross hosts because of {detail}")
    mid, outer = order[1], order[2]
    dims = {"dp": dp, "pp": pp}
    block, n_outer = dims[mid], dims[outer]
    per_host = np.bincount(owner[owner >= 0], minlength=len(hosts))
    fits = per_host // block  # whole blocks each host takes, host after host
    first = np.concatenate(([0], np.cumsum(per_host)[:-1]))  # a host's first chunk (chunks in host order)
    taken = np.zeros(len(chunks), dtype=bool)
    hs = np.nonzero(fits)[0]
    counts = fits[hs]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.repeat(first[hs], counts) + within * block)[:n_outer]
    placed = (starts[:, None] + np.arange(block)[None, :]).reshape(-1)
    taken[placed] = True
    rest = np.nonzero(~taken)[0]  # host order, crossing chunks last
    need = (n_outer - len(starts)) * block
    blocks = np.concatenate([placed, rest[:need]]).reshape(n_outer, block)  # [outer, mid] chunk ids
    ranks = chunks[blocks]  # [outer, mid, tp]
    grid = ranks if mid == "dp" else ranks.transpose(1, 0, 2)  # -> [pp, dp, tp]
    return np.ascontiguousarray(grid), notes


def place(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    *,
    gpus_per_node: int | None = None,
    hosts: tuple[Host, ...] | list[Host] | None = None,
    order: str = DEFAULT_ORDER,
    islands: tuple[tuple[int, ...], ...] | list[list[int]] | None = None,
    allow_crossing: bool = False,
    warn: bool = True,
) -> Placement:
    """The placement of ``world_size`` ranks with tensor ``tp`` x pipeline ``pp`` (dp derived).

    Args:
        world_size: total ranks (at most ``MAX_WORLD``).
        tp, pp: tensor- and pipeline-parallel degrees; ``dp = world_size // (tp * pp)``.
        gpus_per_node: uniform node size (ignored when ``hosts`` is given; default: one host).
        hosts: per-host slots in launcher order (e.g. from ``read_hostfile``); may be uneven.
        order: axis nesting, innermost first (any permutation of ``tp-dp-pp``). With tp innermost
            (the default) TP groups are packed onto hosts and islands whatever the host sizes;
            with another order the plain row-major layout is used and must keep TP inside hosts.
        islands: NVLink islands as lists of local ranks, applied to every host.
        allow_crossing: when a TP group cannot stay inside one host, warn and minimise crossings
            instead of raising.
        warn: emit the placement's notes as warnings.
    """
    for name, v in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise TopologyError(f"{name} must be a positive integer, got {v!r}")
    if world_size > MAX_WORLD:
        raise TopologyError(f"world size {world_size} exceeds mt3d's limit of {MAX_WORLD} ranks")
    if world_size % (tp * pp):
        raise TopologyError(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
            f"pick tp and pp whose product divides {world_size}"
        )
    dp = world_size // (tp * pp)
    axes = parse_order(order)
    if hosts is None:
        hosts = uniform_hosts(world_size, gpus_per_node or world_size)
    hosts = tuple(hosts)
    total = sum(h.slots for h in hosts)
    if total != world_size:
        raise TopologyError(f"hosts provide {total} slots but world size is {world_size}; make them agree")
    isl = None
    if islands:
        isl = tuple(tuple(int(x) for x in g) for g in islands)
        flat = [x for g in isl for x in g]
        if len(flat) != len(set(flat)) or min(flat) < 0:
            raise TopologyError(f"islands must be disjoint lists of local ranks, got {isl}")

    notes: list[str] = []
    if axes[0] == "tp":
        grid, notes = _packed_grid(tp, dp, pp, axes, hosts, isl, allow_crossing)
    else:
        grid = _natural_grid(tp, dp, pp, axes)
        if isl:
            notes.append(f"islands are only used when tp is innermost; order {order} ignores them")
    pl = Placement(grid=grid, order="-".join(axes), hosts=hosts, islands=isl)
    crossing = pl.crossing("tp")
    if crossing and axes[0] != "tp":
        msg = f"order {order} puts {crossing} TP group(s) across hosts"
        if not allow_crossing:
            raise TopologyError(
                f"{msg}; put tp innermost (e.g. 'tp-dp-pp') or allow_crossing (--allow-crossing)"
            )
        notes.append(msg)
    if isl and axes[0] == "tp" and pl.island_crossing_tp():
        notes.append(
            f"{pl.island_crossing_tp()} TP group(s) span several NVLink islands (tp={tp} > island size)"
        )
    pl.notes = tuple(notes)
    if warn:
        for n in notes:
            warnings.warn(f"mt3d topology: {n}", stacklevel=3)
    return pl


def map_ranks(world_size: int, tp: int = 1, pp: int = 1, **kwargs) -> MappedTopology:
    """The rank mapping as a DeepSpeed topology (process groups, PipelineModule); arguments as
    ``place``. Builds one Python object per rank: for summaries of large worlds use ``place``."""
    return MappedTopology(place(world_size, tp, pp, **kwargs))


def uniform_crossing(world: int, gpus_per_node: int, tp: int, pp: int) -> dict[str, bool]:
    """Whether any tp, dp or pp group crosses hosts under ``place``'s default packing (order
    tp-dp-pp, uniform hosts, no islands), in O(1): the planner asks this for every candidate.

    TP groups stay inside hosts (``gpus_per_node`` is a multiple of tp). Each host takes whole DP
    groups of dp TP groups in turn; when the pp DP groups do not all fit that way, the rest are
    assembled from what the hosts have left, across hosts. Pipeline stages sit on different hosts
    as soon as there is more than one. (tests/test_topology.py checks this against ``place``.)
    """
    g = min(gpus_per_node, world)
    if g % tp:
        raise TopologyError(f"tp={tp} does not divide the {g} ranks of a host: TP groups would cross hosts")
    hosts, dp = world // g, world // (tp * pp)
    whole_per_host = (g // tp) // dp
    return {"tp": False, "dp": hosts > 1 and pp > hosts * whole_per_host, "pp": hosts > 1 and pp > 1}


__all__ = [
    "AXES",
    "AXIS_DIM",
    "DEFAULT_ORDER",
    "MAX_WORLD",
    "MappedTopology",
    "Placement",
    "TopologyError",
    "map_ranks",
    "parse_order",
    "place",
    "uniform_crossing",
]
