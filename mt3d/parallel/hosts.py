"""The cluster a job runs on, as the rank mapper reads it: hosts and their slots (a DeepSpeed
hostfile, or uniform nodes) and NVLink islands (written out, or read from ``nvidia-smi topo -m``).

Parsing only; where ranks go is ``topology.place``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..inputs import read_text


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
    return parse_hostfile(read_text(p, "hostfile"), source=str(p))


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
