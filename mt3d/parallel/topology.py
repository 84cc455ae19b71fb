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

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from deepspeed.runtime.pipe.topology import ProcessTopology

from ..errors import UserError

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


class MappedTopology(ProcessTopology):
    """A DeepSpeed ProcessTopology whose mapping places ranks on hosts; see ``map_ranks``.

    Axes are DeepSpeed's ``['pipe', 'data', 'model']``; ``mapping`` is rewritten with the placement.
    Extra accessors use mt3d's names (``tp``, ``dp``, ``pp``).
    """

    def __init__(
        self,
        *,
        tp: int,
        pp: int,
        dp: int,
        order: str,
        hosts: tuple[Host, ...],
        islands: tuple[tuple[int, ...], ...] | None,
        placement: dict[tuple[int, int, int], int],
        notes: tuple[str, ...] = (),
    ) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[pp, dp, tp])
        self.tp, self.pp, self.dp = tp, pp, dp
        self.order = order
        self.hosts = hosts
        self.islands = islands
        self.notes = notes
        self.mapping = {self.ProcessCoord(pipe=p, data=d, model=t): r for (t, d, p), r in placement.items()}
        self._coord_of = {r: c for c, r in self.mapping.items()}
        self._host_of: list[int] = []
        for hi, h in enumerate(hosts):
            self._host_of.extend([hi] * h.slots)

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
        return self.mapping[self.ProcessCoord(pipe=pp, data=dp, model=tp)]

    def host_index(self, rank: int) -> int:
        """Index into ``hosts`` of the host that runs ``rank``."""
        return self._host_of[rank]

    def host(self, rank: int) -> str:
        """Name of the host that runs ``rank``."""
        return self.hosts[self._host_of[rank]].name

    def local_rank(self, rank: int) -> int:
        """Rank's position on its host (its LOCAL_RANK under the launcher)."""
        hi = self._host_of[rank]
        return rank - sum(h.slots for h in self.hosts[:hi])

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ('tp', 'dp' or 'pp'), each listed by its axis coordinate."""
        if axis not in DS_AXIS:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        return self.get_axis_comm_lists(DS_AXIS[axis])

    def crossing(self, axis: str) -> int:
        """How many groups along ``axis`` span more than one host."""
        return sum(len({self._host_of[r] for r in g}) > 1 for g in self.groups(axis))

    def island_crossing_tp(self) -> int:
        """How many TP groups span more than one NVLink island (0 when no islands were given)."""
        if not self.islands:
            return 0
        island_of = {lr: i for i, isl in enumerate(self.islands) for lr in isl}
        count = 0
        for g in self.groups("tp"):
            keys = {(self._host_of[r], island_of.get(self.local_rank(r), -1 - self.local_rank(r))) for r in g}
            count += len(keys) > 1
        return count


def _natural_placement(tp: int, dp: int, pp: int, order: tuple[str, str, str]) -> dict:
    """Row-major placement in ``order`` (innermost first): coord (tp, dp, pp) -> rank."""
    dims = {"tp": tp, "dp": dp, "pp": pp}
    stride, strides = 1, {}
    for ax in order:
        strides[ax] = stride
        stride *= dims[ax]
    return {
        (t, d, p): t * strides["tp"] + d * strides["dp"] + p * strides["pp"]
        for t in range(tp)
        for d in range(dp)
        for p in range(pp)
    }


def _tp_chunks(
    hosts: tuple[Host, ...], tp: int, islands: tuple[tuple[int, ...], ...] | None
) -> tuple[list[tuple[int, list[int]]], dict[int, list[int]]]:
    """Carve each host into tp-sized lists of global ranks (island-local first, then host-local).

    Returns the chunks as ``(host_index, ranks)`` in host order and, per host, the ranks left over
    (fewer than tp) that could only join a TP group crossing hosts.
    """
    chunks: list[tuple[int, list[int]]] = []
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
                chunks.append((hi, ranks[:tp]))
                ranks = ranks[tp:]
            free.extend(ranks)  # island remainders, kept in island order so pairs stay adjacent
        while len(free) >= tp:
            chunks.append((hi, free[:tp]))
            free = free[tp:]
        if free:
            leftovers[hi] = free
        start += h.slots
    return chunks, leftovers


def _packed_placement(
    tp: int,
    dp: int,
    pp: int,
    order: tuple[str, str, str],
    hosts: tuple[Host, ...],
    islands: tuple[tuple[int, ...], ...] | None,
    allow_crossing: bool,
) -> tuple[dict, list[str]]:
    """Place whole TP groups on hosts/islands; whole groups of the next axis first-fit per host."""
    notes: list[str] = []
    chunks, leftovers = _tp_chunks(hosts, tp, islands)
    if leftovers:
        detail = ", ".join(f"{hosts[h].name} ({hosts[h].slots} slots)" for h in leftovers)
        if not allow_crossing:
            raise TopologyError(
                f"tp={tp} groups cannot all stay inside one host: {detail} not a multiple of tp; "
                "use slots that are multiples of tp, a smaller tp, or allow_crossing (--allow-crossing)"
            )
        spill = [r for h in sorted(leftovers) for r in leftovers[h]]  # host order: spans few hosts
        for i in range(0, len(spill), tp):
            chunks.append((-1, spill[i : i + tp]))
        notes.append(f"{len(spill) // tp} TP group(s) cross hosts because of {detail}")

    mid, outer = order[1], order[2]
    dims = {"dp": dp, "pp": pp}
    block = dims[mid]  # TP groups that form one group along the next axis
    # Unit u = (mid index, outer index); blocks of `block` consecutive units share the outer index.
    free_by_host: dict[int, list[list[int]]] = {}
    for hi, ranks in chunks:
        free_by_host.setdefault(hi, []).append(ranks)
    assignment: dict[tuple[int, int], list[int]] = {}
    deferred: list[int] = []
    for o in range(dims[outer]):
        host = next(
            (h for h in sorted(k for k in free_by_host if k >= 0) if len(free_by_host[h]) >= block), None
        )
        if host is None:
            deferred.append(o)
            continue
        for m in range(block):
            assignment[(m, o)] = free_by_host[host].pop(0)
    rest = [c for h in sorted(free_by_host, key=lambda k: (k < 0, k)) for c in free_by_host[h]]
    for o in deferred:
        for m in range(block):
            assignment[(m, o)] = rest.pop(0)

    placement = {}
    for (m, o), ranks in assignment.items():
        for t, r in enumerate(ranks):
            d, p = (m, o) if mid == "dp" else (o, m)
            placement[(t, d, p)] = r
    return placement, notes


def map_ranks(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    *,
    gpus_per_node: int | None = None,
    hosts: tuple[Host, ...] | list[Host] | None = None,
    order: str = DEFAULT_ORDER,
    islands: tuple[tuple[int, ...], ...] | list[list[int]] | None = None,
    allow_crossing: bool = False,
) -> MappedTopology:
    """Build the rank mapping for ``world_size`` ranks with tensor ``tp`` x pipeline ``pp`` (dp derived).

    Args:
        world_size: total ranks.
        tp, pp: tensor- and pipeline-parallel degrees; ``dp = world_size // (tp * pp)``.
        gpus_per_node: uniform node size (ignored when ``hosts`` is given; default: one host).
        hosts: per-host slots in launcher order (e.g. from ``read_hostfile``); may be uneven.
        order: axis nesting, innermost first (any permutation of ``tp-dp-pp``). With tp innermost
            (the default) TP groups are packed onto hosts and islands whatever the host sizes;
            with another order the plain row-major layout is used and must keep TP inside hosts.
        islands: NVLink islands as lists of local ranks, applied to every host.
        allow_crossing: when a TP group cannot stay inside one host, warn and minimise crossings
            instead of raising.
    """
    for name, v in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v <= 0:
            raise TopologyError(f"{name} must be a positive integer, got {v!r}")
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
        placement, notes = _packed_placement(tp, dp, pp, axes, hosts, isl, allow_crossing)
    else:
        placement = _natural_placement(tp, dp, pp, axes)
        if isl:
            notes.append(f"islands are only used when tp is innermost; order {order} ignores them")
    topo = MappedTopology(
        tp=tp, pp=pp, dp=dp, order="-".join(axes), hosts=hosts, islands=isl, placement=placement, notes=()
    )
    crossing = topo.crossing("tp")
    if crossing and axes[0] != "tp":
        msg = f"order {order} puts {crossing} TP group(s) across hosts"
        if not allow_crossing:
            raise TopologyError(
                f"{msg}; put tp innermost (e.g. 'tp-dp-pp') or allow_crossing (--allow-crossing)"
            )
        notes.append(msg)
    if isl and axes[0] == "tp" and topo.island_crossing_tp():
        notes.append(
            f"{topo.island_crossing_tp()} TP group(s) span several NVLink islands (tp={tp} > island size)"
        )
    topo.notes = tuple(notes)
    for n in notes:
        warnings.warn(f"mt3d topology: {n}", stacklevel=2)
    return topo


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


def _ring_crossing_edges(group: list[int], topo: MappedTopology) -> int:
    """Edges of a ring over ``group`` (in group order, wrapping) that join different hosts."""
    if len(group) < 2:
        return 0
    hosts = [topo.host_index(r) for r in group]
    return sum(hosts[i] != hosts[(i + 1) % len(hosts)] for i in range(len(hosts)))


def cross_host_bytes(topo: MappedTopology, model: TrafficModel) -> dict[str, float]:
    """Estimated bytes per training step that cross host boundaries, per axis and in total.

    TP: 4 all-reduces of b*s*h per layer per micro-batch (2 forward, 2 backward); DP: one
    all-reduce (or ZeRO reduce-scatter + all-gather, same bytes) of the Psi/(tp*pp) gradient per
    step; ring all-reduce sends 2(n-1)/n of the buffer over each ring edge. PP: b*s*h forward and
    b*s*h backward per micro-batch over each stage boundary that joins two hosts.
    """
    e = model.bytes_per_element
    act = model.micro_batch * model.seq_len * model.hidden * e
    layers_per_stage = model.layers / topo.pp

    def ring(groups: list[list[int]], buffer_bytes: float, calls: float) -> float:
        total = 0.0
        for g in groups:
            n = len(g)
            total += _ring_crossing_edges(g, topo) * 2 * (n - 1) / n * buffer_bytes * calls
        return total

    out = {
        "tp": ring(topo.groups("tp"), act, 4 * layers_per_stage * model.micro_batches),
        "dp": ring(topo.groups("dp"), model.params / (topo.tp * topo.pp) * e, 1),
        "pp": sum(
            2 * act * model.micro_batches
            for g in topo.groups("pp")
            for a, b in zip(g, g[1:])
            if topo.host_index(a) != topo.host_index(b)
        ),
    }
    out["total"] = out["tp"] + out["dp"] + out["pp"]
    return out


def describe(topo: MappedTopology, traffic: TrafficModel | None = None) -> dict:
    """The machine-readable report of a mapping (the ``mt3d topo --json`` contract)."""
    report = {
        "world_size": topo.world,
        "tp": topo.tp,
        "pp": topo.pp,
        "dp": topo.dp,
        "order": topo.order,
        "hosts": [{"name": h.name, "slots": h.slots} for h in topo.hosts],
        "ranks": [
            {"rank": r, "host": topo.host(r), "local_rank": topo.local_rank(r), **topo.coord(r)}
            for r in range(topo.world)
        ],
        "groups": {ax: topo.groups(ax) for ax in AXES},
        "crossing": {ax: topo.crossing(ax) for ax in AXES},
        "island_crossing": {"tp": topo.island_crossing_tp()},
        "notes": list(topo.notes),
    }
    if traffic is not None:
        report["cross_host_bytes_per_step"] = cross_host_bytes(topo, traffic)
    return report


def human_bytes(n: float) -> str:
    """Format a byte count with binary units (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"  # pragma: no cover


def format_report(report: dict, max_rows: int = 64) -> str:
    """Human-readable table of a ``describe`` report (long listings are truncated)."""
    lines = [
        f"world {report['world_size']} = tp {report['tp']} x dp {report['dp']} x pp {report['pp']}"
        f"   order {report['order']} (innermost first)   hosts {len(report['hosts'])}",
        "",
        f"{'rank':>6} {'host':<16} {'local':>5} {'tp':>4} {'dp':>4} {'pp':>4}",
    ]
    rows = report["ranks"]
    for r in rows[:max_rows]:
        lines.append(
            f"{r['rank']:>6} {r['host']:<16} {r['local_rank']:>5} {r['tp']:>4} {r['dp']:>4} {r['pp']:>4}"
        )
    if len(rows) > max_rows:
        lines.append(f"   ... {len(rows) - max_rows} more ranks (use --json for all)")
    lines.append("")
    for ax in AXES:
        groups = report["groups"][ax]
        shown = "  ".join(str(g) for g in groups[:8]) + ("  ..." if len(groups) > 8 else "")
        lines.append(f"{ax} groups ({len(groups)} of size {len(groups[0])}): {shown}")
    lines.append("")
    cross = report["crossing"]
    lines.append(
        "groups crossing hosts: " + ", ".join(f"{ax} {cross[ax]}/{len(report['groups'][ax])}" for ax in AXES)
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
    "MappedTopology",
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
    "read_hostfile",
    "uniform_hosts",
]
