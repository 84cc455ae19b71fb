"""The report of ``mt3d topo``: a placement's groups, host crossings and cross-host traffic, as
text or as one JSON object streamed row by row (bounded memory for any world size)."""

from __future__ import annotations

import json

from ..parallel.topology import Placement
from .traffic import TrafficModel, cross_host_bytes


def _placement(topo) -> Placement:
    """The placement of a ``Placement`` or of a DeepSpeed topology wrapping one."""
    return getattr(topo, "placement", topo)


def summary(topo, traffic: TrafficModel | None = None) -> dict:
    """Everything of the ``mt3d topo --json`` report except the per-rank and per-group listings;
    ``topo``: a ``Placement`` or a ``MappedTopology``. Axes of size 1 that are optional (cp, ep) are
    left out, so three-axis reports read as before they existed."""
    pl = _placement(topo)
    report = {
        "world_size": pl.world,
        **{ax: pl.size(ax) for ax in pl.axes},
        "order": pl.order,
        "hosts": [{"name": h.name, "slots": h.slots} for h in pl.hosts],
        "crossing": {ax: pl.crossing(ax) for ax in pl.report_groups},
        "island_crossing": {"tp": pl.island_crossing_tp()},
        "notes": list(pl.notes),
    }
    if pl.expert.folded:
        report["expert_layout"] = {"etp": pl.expert.etp, "ep": pl.expert.ep, "edp": pl.expert.edp}
    if traffic is not None:
        report["cross_host_bytes_per_step"] = cross_host_bytes(pl, traffic)
    return report


def rank_rows(topo, limit: int | None = None):
    """The per-rank rows of the report, one at a time (``limit``: only the first ones)."""
    pl = _placement(topo)
    for r in range(pl.world if limit is None else min(limit, pl.world)):
        yield {"rank": r, "host": pl.host(r), "local_rank": pl.local_rank(r), **pl.coord(r)}


def describe(topo, traffic: TrafficModel | None = None) -> dict:
    """The machine-readable report of a mapping (the ``mt3d topo --json`` contract), in memory."""
    pl = _placement(topo)
    report = summary(pl, traffic)
    report["ranks"] = list(rank_rows(pl))
    report["groups"] = {ax: list(pl.groups(ax)) for ax in pl.report_groups}
    return report


def write_report_json(topo, traffic: TrafficModel | None, out) -> None:
    """Stream ``describe``'s JSON to ``out`` row by row (bounded memory for any world size)."""
    pl = _placement(topo)
    head = summary(pl, traffic)
    out.write(json.dumps(head)[:-1] + ', "ranks": [')
    for i, row in enumerate(rank_rows(pl)):
        out.write((", " if i else "") + json.dumps(row))
    out.write('], "groups": {')
    for a, ax in enumerate(pl.report_groups):
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


def format_report(topo, traffic: TrafficModel | None = None, max_rows: int = 64) -> str:
    """Human-readable summary of a mapping: the first ranks and groups, crossings, traffic."""
    pl = _placement(topo)
    report = summary(pl, traffic)
    axes = pl.axes
    lines = [
        f"world {report['world_size']} = "
        + " x ".join(f"{ax} {report[ax]}" for ax in axes)
        + f"   order {report['order']} (innermost first)   hosts {len(report['hosts'])}",
        "",
        f"{'rank':>6} {'host':<16} {'local':>5} " + " ".join(f"{ax:>4}" for ax in axes),
    ]
    for r in rank_rows(pl, max_rows):
        lines.append(
            f"{r['rank']:>6} {r['host']:<16} {r['local_rank']:>5} " + " ".join(f"{r[ax]:>4}" for ax in axes)
        )
    if pl.world > max_rows:
        lines.append(f"   ... {pl.world - max_rows} more ranks (use --json for all)")
    if pl.expert.folded:
        e = pl.expert
        lines.append(f"expert layout: etp {e.etp} x ep {e.ep} x edp {e.edp} folded over tp x cp x dp "
                     f"(experts split over etp, held by ep, replicated over edp)")  # fmt: skip
    lines.append("")
    for ax in pl.report_groups:
        count = pl.group_count(ax)
        first = [g for _, g in zip(range(8), pl.groups(ax))]
        shown = "  ".join(_short(g) for g in first) + ("  ..." if count > 8 else "")
        lines.append(f"{ax} groups ({count} of size {pl.size(ax)}): {shown}")
    lines.append("")
    cross = report["crossing"]
    lines.append(
        "groups crossing hosts: "
        + ", ".join(f"{ax} {cross[ax]}/{pl.group_count(ax)}" for ax in pl.report_groups)
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
