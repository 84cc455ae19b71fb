"""Topology-aware rank mapper: (world, hosts, degrees, order, NVLink islands) -> Placement.

Everything here is pure: no processes, no torch.distributed, no DeepSpeed. The launcher decides
which global ranks live on which host (host 0 gets ranks 0..slots0-1, host 1 the next slots1,
...); the mapper decides which coordinate on every parallel axis (``axes.AXES``) each of those
ranks plays. Axes are placed innermost first, in the run's order (default ``tp-cp-ep-dp-pp``):

* every tensor-parallel group sits inside one host, and inside one NVLink island when islands are
  given and tp fits in one;
* then, axis after axis, whole groups are kept inside a host when they fit (first-fit of whole
  groups, host by host); what does not fit is assembled across hosts and counted as crossing;
* the outermost axis (pipeline stages, the lightest traffic) is what crosses hosts.

A ``Placement`` is a numpy grid (``axes.GRID`` order: pp, dp/ep, ep, cp, tp) of global ranks, so a
million ranks take a second or two and tens of MB. ``mt3d.ds.topology.map_ranks`` wraps it as the DeepSpeed
``ProcessTopology`` that DeepSpeed's PipelineModule, mt3d's ParallelState and the TP layers all
read their groups from (``mt3d.ds.topology``).
"""

from __future__ import annotations

import warnings

import numpy as np

from ..inputs import MAX_WORLD
from .axes import (
    AXES,
    BY_NAME,
    DEFAULT_ORDER,
    GRID,
    AxisError,
    derive_degrees,
    expert_layout,
    grid_shape,
    order_label,
)
from .axes import parse_order as _parse_axes_order
from .axes import shown as shown_axes
from .expert_layout import HOST_GROUPS, ExpertLayout, host_blocks, host_rows
from .hosts import Host, TopologyError, uniform_hosts

DS_AXES = ("pipe", "data", "model")
"""DeepSpeed's ProcessTopology axes, outermost first (each mt3d axis belongs to one: ``Axis.ds_axis``)."""


def parse_order(order: str) -> tuple[str, ...]:
    """Every axis in nesting order, innermost first (``axes.parse_order`` as a TopologyError)."""
    try:
        return _parse_axes_order(order)
    except AxisError as e:
        raise TopologyError(str(e)) from None


def grid_dims(axis: str) -> tuple[str, ...]:
    """The grid dimensions a group of ``axis`` spans, in grid order: its own, and those of the axes
    within it (a dp group spans the dp/ep and ep dimensions, ep innermost)."""
    own = {axis} | {a.name for a in AXES if a.within == axis}
    return tuple(d for d in GRID if d in own)


EXPERT_GROUPS = ("ep", "edp", "etp", "tpo")
"""Groups of the expert layout (``expert_layout.ExpertLayout``): expert parallelism, the ranks holding
the same experts, those splitting one expert, and a TP group's ranks with the same expert-TP rank."""

COMBINED = {
    "model": ("pp", "tp"),
    "dense": ("dp", "ep", "cp"),
    "edp": ("dp", "cp"),
}
"""Groups that span several axes, by grid dimensions: ``model`` holds one model replica (pipe x
tensor: what DeepSpeed sums gradient norms over), ``dense`` the ranks that average dense gradients
and partition their ZeRO states (dp x cp), ``edp`` those that hold the same experts (dp / ep x cp
before folding: expert gradients reduce and expert ZeRO states partition over it), read from the
expert layout (``EXPERT_GROUPS``) rather than these dimensions."""


class Placement:
    """Where every coordinate runs, as arrays (no per-rank Python objects).

    ``grid`` (shape ``axes.grid_shape(degrees)``, dimensions ``axes.GRID``) holds the global rank at
    each coordinate; hosts hold consecutive ranks in order. Summaries (group counts, crossings,
    traffic) are vectorised over the grid. Degrees read as attributes: ``placement.tp``.
    """

    def __init__(
        self,
        *,
        grid: np.ndarray,
        order: tuple[str, ...],
        hosts: tuple[Host, ...],
        islands,
        notes=(),
        expert: ExpertLayout | None = None,
    ) -> None:
        self.grid = grid
        sizes = dict(zip(GRID, grid.shape))
        self.degrees = {a.name: int(np.prod([sizes[d] for d in grid_dims(a.name)])) for a in AXES}
        d = self.degrees
        self.expert = expert or ExpertLayout(d["tp"], d["cp"], d["dp"], d["ep"], d["tp"])
        """The expert layout over these ranks; the grid's 'ep' dimension holds its ``grid_ep``."""
        if self.expert.grid_ep != d["ep"]:
            raise ValueError(f"grid {grid.shape} does not hold {self.expert}")
        d["ep"] = self.expert.ep
        if self.expert.etp != d["tp"]:
            d["etp"] = self.expert.etp
        self.axis_order = tuple(order)
        self.hosts, self.islands, self.notes = hosts, islands, tuple(notes)
        slots = np.array([h.slots for h in hosts], dtype=np.int64)
        self.host_of = np.repeat(np.arange(len(hosts)), slots)
        self.host_start = np.concatenate(([0], np.cumsum(slots)[:-1]))
        self._coords = None

    def __getattr__(self, name: str) -> int:
        if name in BY_NAME:  # the degree of an axis: placement.tp, placement.dp, ...
            return self.degrees[name]
        raise AttributeError(name)

    @property
    def order(self) -> str:
        """The nesting order as reports print it (axes of size 1 that are optional left out)."""
        return order_label(self.axis_order, self.degrees)

    @property
    def world(self) -> int:
        """Number of ranks."""
        return int(self.grid.size)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes reports and coordinates name (optional axes only when larger than 1)."""
        return shown_axes(self.degrees)

    @property
    def report_groups(self) -> tuple[str, ...]:
        """The shown axes' groups, a folded expert layout's etp and edp (``EXPERT_GROUPS``), and the ep
        groups' split by host where they span hosts evenly (``HOST_GROUPS``: ``expert_dispatch`` "node")."""
        split = self.degrees.get("ep", 1) > 1 and self.size("ep_rail") > 1
        return self.axes + (("etp", "edp") if self.expert.folded else ()) + (HOST_GROUPS if split else ())

    def size(self, axis: str) -> int:
        """Ranks in one group along ``axis`` (an axis, or a ``COMBINED`` or ``EXPERT_GROUPS`` group)."""
        return self.degrees[axis] if axis in self.degrees else int(self._group_rows(axis).shape[1])

    def coord(self, rank: int) -> dict[str, int]:
        """The coordinate of a global rank on every shown axis."""
        if self._coords is None:  # inverse of the grid, built on first use
            inv = np.empty(self.world, dtype=np.int64)
            inv[self.grid.ravel()] = np.arange(self.world)
            self._coords = inv
        at = dict(zip(GRID, np.unravel_index(int(self._coords[rank]), self.grid.shape)))
        out = {}
        for ax in self.axes:
            if ax == "ep":  # the expert coordinate (the grid's 'ep' dimension is only its part in dp)
                out[ax] = self._expert_coord(rank)
                continue
            index = 0
            for d in grid_dims(ax):
                index = index * self.grid.shape[GRID.index(d)] + int(at[d])
            out[ax] = index
        return out

    def _expert_coord(self, rank: int) -> int:
        if getattr(self, "_ep_of", None) is None:
            eg = self.expert.expert_grid(self.grid)
            self._ep_of = np.empty(self.world, dtype=np.int64)
            self._ep_of[eg.ravel()] = np.indices(eg.shape)[2].ravel()
        return int(self._ep_of[rank])

    def rank_of(self, **coord: int) -> int:
        """Global rank at a coordinate (axes left out are at 0)."""
        index = {d: 0 for d in GRID}
        for ax, value in coord.items():
            for d in reversed(grid_dims(ax)):  # innermost dimension first
                size = self.grid.shape[GRID.index(d)]
                value, index[d] = divmod(value, size)
        return int(self.grid[tuple(index[d] for d in GRID)])

    def host(self, rank: int) -> str:
        """Name of the host that runs ``rank``."""
        return self.hosts[int(self.host_of[rank])].name

    def local_rank(self, rank: int) -> int:
        """Rank's position on its host (its LOCAL_RANK under the launcher)."""
        return int(rank - self.host_start[self.host_of[rank]])

    def _rows(self, dims: tuple[str, ...]) -> np.ndarray:
        """[groups, group size]: the grid with ``dims`` last (grid order) and the others in order."""
        if not dims or any(d not in GRID for d in dims):
            raise ValueError(f"grid dimensions must be among {GRID}, got {dims!r}")
        idx = [GRID.index(d) for d in dims]
        rest = [i for i in range(len(GRID)) if i not in idx]
        g = self.grid.transpose(rest + idx)
        return g.reshape(-1, int(np.prod([self.grid.shape[i] for i in idx])))

    def _dims_of(self, axis: str) -> tuple[str, ...]:
        if axis in COMBINED:
            return COMBINED[axis]
        if axis not in BY_NAME:
            raise ValueError(f"axis must be one of {tuple(BY_NAME)} or {tuple(COMBINED)}, got {axis!r}")
        return grid_dims(axis)

    def _group_rows(self, axis: str) -> np.ndarray:
        """[groups, size] of ``axis``: an expert group from the expert layout, a host split of the ep
        groups (``HOST_GROUPS``), else from the grid."""
        if axis in EXPERT_GROUPS:
            return self.expert.rows(self.grid, axis)
        if axis in HOST_GROUPS:
            return host_rows(self._group_rows("ep"), self.host_of, axis)
        return self._rows(self._dims_of(axis))

    def ep_host_blocks(self) -> np.ndarray | None:
        """The ep groups split by host (``expert_layout.host_blocks``)."""
        return host_blocks(self._group_rows("ep"), self.host_of)

    def groups(self, axis: str):
        """Every group along ``axis`` (or a ``COMBINED`` or ``EXPERT_GROUPS`` group), in DeepSpeed's
        ``get_axis_comm_lists`` order, each listed by its coordinate (a generator)."""
        for row in self._group_rows(axis):
            yield row.tolist()

    def group_count(self, axis: str) -> int:
        """How many groups there are along ``axis``."""
        return self.world // self._group_rows(axis).shape[1]

    def _hosts_along(self, axis: str) -> np.ndarray:
        return self.host_of[self._group_rows(axis)]

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
        ranks = self._rows(("tp",))
        hosts = self.host_of[ranks]
        key = hosts * (2 * max_local + 1) + island_of[ranks - self.host_start[hosts]]
        return int((key.min(axis=1) != key.max(axis=1)).sum())

    def deepspeed_grid(self) -> np.ndarray:
        """The grid as DeepSpeed's ``[pipe, data, model]``: 'model' the distinct weights of a stage,
        'data' the ranks holding the same ones (``ExpertLayout.deepspeed_grid``)."""
        return self.expert.deepspeed_grid(self.grid)


def _natural_grid(shape: tuple[int, ...], order: tuple[str, ...]) -> np.ndarray:
    """Row-major placement in ``order`` (innermost first), as a grid."""
    sizes = dict(zip(GRID, shape))
    grid = np.zeros(shape, dtype=np.int64)
    stride = 1
    for ax in order:
        view = [1] * len(GRID)
        view[GRID.index(ax)] = sizes[ax]
        grid = grid + np.arange(sizes[ax], dtype=np.int64).reshape(view) * stride
        stride *= sizes[ax]
    return grid


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


def _group_units(tags: np.ndarray, size: int, n_hosts: int) -> tuple[np.ndarray, np.ndarray]:
    """Group units (host-tagged, in host order, units that already cross hosts tagged -1 and last)
    into blocks of ``size``: whole blocks of one host's units first, host after host (every block is
    the same size, so the first-fit is computed per host, not per block), then the rest in order.

    Returns the blocks as [blocks, size] unit indices and their host tags (-1: crossing), in the same
    host order.
    """
    n = len(tags)
    if size == 1:
        return np.arange(n)[:, None], tags
    per_host = np.bincount(tags[tags >= 0], minlength=n_hosts)
    fits = per_host // size
    first = np.concatenate(([0], np.cumsum(per_host)[:-1]))  # a host's first unit
    hs = np.nonzero(fits)[0]
    counts = fits[hs]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = np.repeat(first[hs], counts) + within * size
    placed = (starts[:, None] + np.arange(size)[None, :]).reshape(-1)
    taken = np.zeros(n, dtype=bool)
    taken[placed] = True
    rest = np.nonzero(~taken)[0]  # host order, crossing units last
    blocks = np.concatenate([placed, rest]).reshape(-1, size)
    new_tags = np.concatenate([np.repeat(hs, counts), np.full(len(rest) // size, -1)])
    return blocks, new_tags


def _crossing_chunks(chunks, owner, leftovers, hosts, tp, allow_crossing, notes):
    """Append the TP groups made of hosts' leftover ranks (crossing hosts), or refuse."""
    if not leftovers:
        return chunks, owner
    detail = ", ".join(f"{hosts[h].name} ({hosts[h].slots} slots)" for h in leftovers)
    if not allow_crossing:
        raise TopologyError(
            f"tp={tp} groups cannot all stay inside one host: {detail} not a multiple of tp; "
            "use slots that are multiples of tp, a smaller tp, or allow_crossing (--allow-crossing)"
        )
    spill = np.array([r for h in sorted(leftovers) for r in leftovers[h]], dtype=np.int64)  # few hosts
    extra = spill[: len(spill) // tp * tp].reshape(-1, tp)
    notes.append(f"{len(extra)} TP group(s) cross hosts because of {detail}")
    return np.concatenate([chunks, extra]), np.concatenate([owner, np.full(len(extra), -1)])


def _packed_grid(
    shape: tuple[int, ...],
    order: tuple[str, ...],
    hosts: tuple[Host, ...],
    islands: tuple[tuple[int, ...], ...] | None,
    allow_crossing: bool,
) -> tuple[np.ndarray, list[str]]:
    """Whole TP groups on hosts/islands; then, axis by axis in ``order``, whole groups of the units
    placed so far first-fit per host (``_group_units``); the outermost axis enumerates the rest."""
    notes: list[str] = []
    sizes = dict(zip(GRID, shape))
    chunks, owner, leftovers = _tp_chunks(hosts, sizes["tp"], islands)
    chunks, owner = _crossing_chunks(chunks, owner, leftovers, hosts, sizes["tp"], allow_crossing, notes)
    ranks, tags = chunks, owner  # ranks: [units, ...inner axes..., tp]
    for ax in order[1:-1]:
        blocks, tags = _group_units(tags, sizes[ax], len(hosts))
        ranks = ranks[blocks]
    # ranks: [outermost, order[-2], ..., order[1], tp] -> grid order
    nested = list(reversed(order))
    return np.ascontiguousarray(ranks.transpose([nested.index(d) for d in GRID])), notes


def _check_inputs(world_size: int, hosts, gpus_per_node, islands):
    if world_size > MAX_WORLD:
        raise TopologyError(f"world size {world_size} exceeds mt3d's limit of {MAX_WORLD} ranks")
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
        slots = max(h.slots for h in hosts)
        if max(flat) >= slots:
            raise TopologyError(
                f"islands name local rank {max(flat)}, but no host has more than {slots} ranks (local ranks "
                f"0-{slots - 1}); give the islands of one host"
            )
    return hosts, isl


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
    expert_tensor: int | None = None,
    **degrees: int,
) -> Placement:
    """The placement of ``world_size`` ranks with tensor ``tp`` x pipeline ``pp`` and any other
    configured axis by name (``cp=2``, ``ep=4``); dp is what remains (``axes.derive_degrees``).

    Args:
        world_size: total ranks (at most ``MAX_WORLD``).
        tp, pp, **degrees: degrees of the configured axes.
        gpus_per_node: uniform node size (ignored when ``hosts`` is given; default: one host).
        hosts: per-host slots in launcher order (e.g. from ``read_hostfile``); may be uneven.
        order: axis nesting, innermost first (any order of the axes; left-out axes take their
            default place). With tp innermost (the default) TP groups are packed onto hosts and
            islands whatever the host sizes, then each next axis's whole groups onto hosts; with
            another order the plain row-major layout is used and must keep TP inside hosts.
        islands: NVLink islands as lists of local ranks, applied to every host.
        allow_crossing: when a TP group cannot stay inside one host, warn and minimise crossings
            instead of raising.
        warn: emit the placement's notes as warnings.
        expert_tensor: ranks splitting each expert (etp; None: tp): the expert layout
            (``expert_layout``) folds ep over tp x cp x dp when etp is below tp or ep does not divide dp.
    """
    try:
        deg = derive_degrees(world_size, {"tp": tp, "pp": pp, **degrees}, expert_tensor=expert_tensor)
    except AxisError as e:
        raise TopologyError(str(e)) from None
    axes = parse_order(order)
    hosts, isl = _check_inputs(world_size, hosts, gpus_per_node, islands)
    shape = grid_shape(deg)
    notes: list[str] = []
    if axes[0] == "tp":
        grid, notes = _packed_grid(shape, axes, hosts, isl, allow_crossing)
    else:
        grid = _natural_grid(shape, axes)
        if isl:
            notes.append(f"islands are only used when tp is innermost; order {order} ignores them")
    pl = Placement(grid=grid, order=axes, hosts=hosts, islands=isl, expert=expert_layout(deg))
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


def uniform_crossing(world: int, gpus_per_node: int, tp: int, pp: int, **degrees: int) -> dict[str, bool]:
    """Whether any group of each shown axis crosses hosts under ``place``'s default packing (default
    order, uniform hosts, no islands), in O(axes): the planner asks this for every candidate.

    TP groups stay inside hosts (``gpus_per_node`` is a multiple of tp). Level by level, each host
    takes the whole groups it can of the units placed so far; a level crosses hosts when it has more
    groups than the hosts take whole. The outermost axis crosses as soon as there are several hosts.
    (tests/test_topology.py checks this against ``place``.)
    """
    g = min(gpus_per_node, world)
    if g % tp:
        raise TopologyError(f"tp={tp} does not divide the {g} ranks of a host: TP groups would cross hosts")
    deg = derive_degrees(world, {"tp": tp, "pp": pp, **degrees})
    sizes = dict(zip(GRID, grid_shape(deg)))
    order = parse_order(DEFAULT_ORDER)
    hosts = world // g
    cross = {"tp": False}
    whole, total = g // tp, world // tp  # units (TP groups) per host held whole, and in all
    for ax in order[1:-1]:
        blocks = total // sizes[ax]
        cross[ax] = sizes[ax] > 1 and hosts > 1 and blocks > hosts * (whole // sizes[ax])
        whole, total = whole // sizes[ax], blocks
    cross[order[-1]] = hosts > 1 and sizes[order[-1]] > 1
    # a dp group spans the dp/ep and ep dimensions: it crosses when either level does
    cross["dp"] = deg["dp"] > 1 and (cross["dp"] or cross["ep"])
    return {ax: cross[ax] for ax in shown_axes(deg)}


__all__ = ["COMBINED", "EXPERT_GROUPS", "DEFAULT_ORDER", "MAX_WORLD", "Placement", "TopologyError",
           "grid_dims", "parse_order", "place", "uniform_crossing"]  # fmt: skip
