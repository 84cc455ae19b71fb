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

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from deepspeed.runtime.pipe.topology import ProcessTopology

from ..errors import UserError
from ..inputs import MAX_WORLD

AXES = ("tp", "dp", "pp")
# mt3d axis name -> DeepSpeed axis name. DeepSpeed's "model" axis is tensor slicing.
DS_AXIS = {"tp": "model", "dp": "data", "pp": "pipe"}
DEFAULT_ORDER = "tp-dp-pp"


class TopologyError(UserError):
    """A layout that cannot be built as asked; the message names the fix."""


@dataclass(frozen=True)
class Host:
    """One machine of the job: its name and how many ranks (GPUs) the launcher puts on it."""

    name: str
    slots: int


def uniform_hosts(world_size: int, gpus_per_node: int) -> tuple[Host, ...]:
    """Hosts ``node0, node1, ...`` of ``gpus_per_node`` ranks each, holding ``world_size`` ranks."""
    if gpus_per_node <= 0:
        raise TopologyError(f"gpus_per_node must be positive, got {gpus_per_node}")
    if world_size <= gpus_per_node:
        return (Host("node0", world_size),)
    if world_size % gpus_per_node:
        raise TopologyError(
            f"world size {world_size} is not a multiple of gpus_per_node {gpus_per_node}; "
            "describe uneven nodes with a hostfile (--hostfile)"
        )
    return tuple(Host(f"node{i}", gpus_per_node) for i in range(world_size // gpus_per_node))


def parse_hostfile(text: str, source: str = "hostfile") -> tuple[Host, ...]:
    """Parse a DeepSpeed hostfile (``hostname slots=N`` per line, ``#`` comments)."""
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not m:
            raise TopologyError(f"{source}:{lineno}: expected 'hostname slots=N', got {raw.strip()!r}")
        name, slots = m.group(1), int(m.group(2))
        if slots <= 0:
            raise TopologyError(f"{source}:{lineno}: slots must be positive for host {name}")
        if any(h.name == name for h in hosts):
            raise TopologyError(f"{source}:{lineno}: host {name} is listed twice")
        hosts.append(Host(name, slots))
    if not hosts:
        raise TopologyError(f"{source}: no hosts found (expected lines like 'worker-0 slots=8')")
    return tuple(hosts)


def read_hostfile(path: str | Path) -> tuple[Host, ...]:
    """Read and parse a DeepSpeed hostfile from disk."""
    p = Path(path)
    if not p.is_file():
        raise TopologyError(f"hostfile not found: {p}")
    return parse_hostfile(p.read_text(), source=str(p))


def parse_islands(spec: str) -> tuple[tuple[int, ...], ...]:
    """Parse NVLink islands written as local ranks, e.g. ``"0,1;2,3;4,5;6,7"``."""
    try:
        islands = tuple(tuple(int(x) for x in part.split(",")) for part in spec.split(";") if part.strip())
    except ValueError:
        raise TopologyError(f"islands must look like '0,1;2,3' (local ranks), got {spec!r}") from None
    if not islands:
        raise TopologyError(f"no islands in {spec!r}")
    return islands


def parse_nvidia_smi_topo(text: str) -> tuple[tuple[int, ...], ...]:
    """NVLink islands from ``nvidia-smi topo -m`` output: GPUs joined by ``NV#`` links.

    Islands are the connected components of the NVLink graph, each sorted, ordered by their
    first GPU. A GPU without NVLink is an island of its own.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next(
        (ln for ln in lines if re.match(r"\s+GPU\d+", ln) or ln.lstrip().startswith("GPU0\t")), None
    )
    if header is None:
        raise TopologyError("not 'nvidia-smi topo -m' output: no header line with GPU0 GPU1 ...")
    cols = [c for c in header.split() if re.fullmatch(r"GPU\d+", c)]
    n = len(cols)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen_rows = 0
    for ln in lines:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]) or ln is header:
            continue
        i = int(cells[0][3:])
        if i >= n or len(cells) < n + 1:
            raise TopologyError(f"malformed row in nvidia-smi topo output: {ln.strip()!r}")
        seen_rows += 1
        for j, link in enumerate(cells[1 : n + 1]):
            if link.startswith("NV"):
                parent[find(i)] = find(j)
    if seen_rows != n:
        raise TopologyError(f"nvidia-smi topo output has {n} GPU columns but {seen_rows} GPU rows")
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    return tuple(sorted(tuple(c) for c in comps.values()))


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


@dataclass(frozen=True)
class TrafficModel:
    """Per-step communication sizes of a transformer, for the cross-host estimate (FORMULAS.md)."""

    layers: int
    hidden: int
    seq_len: int
    micro_batch: int
    micro_batches: int
    params: int
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq_len", "micro_batch", "micro_batches", "bytes_per_element"):
            if getattr(self, name) <= 0:
                label = "micro-batches per step (--grad-accum)" if name == "micro_batches" else name
                raise TopologyError(f"{label} must be positive, got {getattr(self, name)}")


def _placement(topo) -> Placement:
    return topo.placement if isinstance(topo, MappedTopology) else topo


def cross_host_bytes(topo: MappedTopology | Placement, model: TrafficModel) -> dict[str, float]:
    """Estimated bytes per training step that cross host boundaries, per axis and in total.

    TP: 4 all-reduces of b*s*h per layer per micro-batch (2 forward, 2 backward); DP: one
    all-reduce (or ZeRO reduce-scatter + all-gather, same bytes) of the Psi/(tp*pp) gradient per
    step; ring all-reduce sends 2(n-1)/n of the buffer over each ring edge. PP: b*s*h forward and
    b*s*h backward per micro-batch over each stage boundary that joins two hosts.
    """
    pl = _placement(topo)
    e = model.bytes_per_element
    act = model.micro_batch * model.seq_len * model.hidden * e

    def ring(axis: str, buffer_bytes: float, calls: float) -> float:
        n = pl.grid.shape[AXIS_DIM[axis]]
        return pl.crossing_edges(axis, ring=True) * 2 * (n - 1) / n * buffer_bytes * calls if n > 1 else 0.0

    out = {
        "tp": ring("tp", act, 4 * model.layers / pl.pp * model.micro_batches),
        "dp": ring("dp", model.params / (pl.tp * pl.pp) * e, 1),
        "pp": 2 * act * model.micro_batches * pl.crossing_edges("pp", ring=False),
    }
    out["total"] = out["tp"] + out["dp"] + out["pp"]
    return out


def summary(topo: MappedTopology | Placement, traffic: TrafficModel | None = None) -> dict:
    """Everything of the ``mt3d topo --json`` report except the per-rank and per-group listings."""
    pl = _placement(topo)
    report = {
        "world_size": pl.world,
        "tp": pl.tp,
        "pp": pl.pp,
        "dp": pl.dp,
        "order": pl.order,
        "hosts": [{"name": h.name, "slots": h.slots} for h in pl.hosts],
        "crossing": {ax: pl.crossing(ax) for ax in AXES},
        "island_crossing": {"tp": pl.island_crossing_tp()},
        "notes": list(pl.notes),
    }
    if traffic is not None:
        report["cross_host_bytes_per_step"] = cross_host_bytes(pl, traffic)
    return report


def rank_rows(topo: MappedTopology | Placement, limit: int | None = None):
    """The per-rank rows of the report, one at a time (``limit``: only the first ones)."""
    pl = _placement(topo)
    for r in range(pl.world if limit is None else min(limit, pl.world)):
        yield {"rank": r, "host": pl.host(r), "local_rank": pl.local_rank(r), **pl.coord(r)}


def describe(topo: MappedTopology | Placement, traffic: TrafficModel | None = None) -> dict:
    """The machine-readable report of a mapping (the ``mt3d topo --json`` contract), in memory."""
    pl = _placement(topo)
    report = summary(pl, traffic)
    report["ranks"] = list(rank_rows(pl))
    report["groups"] = {ax: list(pl.groups(ax)) for ax in AXES}
    return report


def write_report_json(topo: MappedTopology | Placement, traffic: TrafficModel | None, out) -> None:
    """Stream ``describe``'s JSON to ``out`` row by row (bounded memory for any world size)."""
    pl = _placement(topo)
    head = summary(pl, traffic)
    out.write(json.dumps(head)[:-1] + ', "ranks": [')
    for i, row in enumerate(rank_rows(pl)):
        out.write((", " if i else "") + json.dumps(row))
    out.write('], "groups": {')
    for a, ax in enumerate(AXES):
        out.write((", " if a else "") + f'"{ax}": [')
        for i, g in enumerate(pl.groups(ax)):
            out.write((", " if i else "") + json.dumps(g))
        out.write("]")
    out.write("}}\n")


def human_bytes(n: float) -> str:
    """Format a byte count with binary units (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"  # pragma: no cover


def _short(group: list[int], keep: int = 8) -> str:
    """A group as a list, the middle elided when it is long."""
    if len(group) <= keep:
        return str(group)
    return "[" + ", ".join(map(str, group[: keep - 2])) + f", ..., {group[-1]}] ({len(group)} ranks)"


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


def format_report(
    topo: MappedTopology | Placement, traffic: TrafficModel | None = None, max_rows: int = 64
) -> str:
    """Human-readable summary of a mapping: the first ranks and groups, crossings, traffic."""
    pl = _placement(topo)
    report = summary(pl, traffic)
    lines = [
        f"world {report['world_size']} = tp {report['tp']} x dp {report['dp']} x pp {report['pp']}"
        f"   order {report['order']} (innermost first)   hosts {len(report['hosts'])}",
        "",
        f"{'rank':>6} {'host':<16} {'local':>5} {'tp':>4} {'dp':>4} {'pp':>4}",
    ]
    for r in rank_rows(pl, max_rows):
        lines.append(
            f"{r['rank']:>6} {r['host']:<16} {r['local_rank']:>5} {r['tp']:>4} {r['dp']:>4} {r['pp']:>4}"
        )
    if pl.world > max_rows:
        lines.append(f"   ... {pl.world - max_rows} more ranks (use --json for all)")
    lines.append("")
    for ax in AXES:
        count = pl.group_count(ax)
        first = [g for _, g in zip(range(8), pl.groups(ax))]
        shown = "  ".join(_short(g) for g in first) + ("  ..." if count > 8 else "")
        lines.append(f"{ax} groups ({count} of size {pl.grid.shape[AXIS_DIM[ax]]}): {shown}")
    lines.append("")
    cross = report["crossing"]
    lines.append(
        "groups crossing hosts: " + ", ".join(f"{ax} {cross[ax]}/{pl.group_count(ax)}" for ax in AXES)
    )
    if report["island_crossing"]["tp"]:
        lines.append(f"TP groups spanning several NVLink islands: {report['island_crossing']['tp']}")
    if "cross_host_bytes_per_step" in report:
        b = report["cross_host_bytes_per_step"]
        lines.append(
            "estimated bytes crossing hosts per step: "
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in b.items())
        )
    for n in report["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "Host",
    "MAX_WORLD",
    "MappedTopology",
    "Placement",
    "TopologyError",
    "TrafficModel",
    "cross_host_bytes",
    "describe",
    "format_report",
    "map_ranks",
    "parse_hostfile",
    "parse_islands",
    "parse_nvidia_smi_topo",
    "parse_order",
    "place",
    "rank_rows",
    "read_hostfile",
    "summary",
    "uniform_crossing",
    "uniform_hosts",
    "write_report_json",
]
