"""The parallel axes, declared once.

Every part of mt3d that enumerates axes (the rank mapper, ParallelState, config validation, the
planner's search, checkpoint coordinates, ``mt3d topo``, metrics and run.json) reads ``AXES``.
Adding an axis is a row here plus that axis's own semantics (how the model splits over it).

An axis of size 1 costs nothing: no process group is made for it, and the optional ones (cp, ep)
appear in coordinates, keys and reports only when larger than 1, so three-axis layouts read,
save and print exactly as before these axes existed.

Expert parallelism is laid over a pipeline stage's tp x cp x dp ranks by the expert layout
(``expert_layout``: etp x ep x edp, Megatron-Core's "parallel folding"); in the placement grid the
'ep' dimension holds the part of ep within dp (all of it when ep divides dp and experts split over
tp, the layout before folding: an ep group a subset of a dp group, expert weights reduced over the
dp / ep x cp ranks holding the same experts). Context parallelism is an axis of its own whose ranks
also average dense gradients with dp (Megatron's dp x cp group).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .expert_layout import ExpertLayout, ExpertLayoutError


class AxisError(UserError):
    """Degrees that cannot form a layout; the message names the fix."""


@dataclass(frozen=True)
class Axis:
    """One parallel axis of a run."""

    name: str
    """Short name used everywhere: coordinates, groups, reports (tp, cp, ep, dp, pp)."""
    key: str | None
    """``mt3d.parallel`` key that sets its degree (None: derived from the world size: dp)."""
    splits: str
    """What the axis splits."""
    gradients: str
    """How gradients are reduced over its ranks."""
    placement: str
    """Where the rank mapper prefers its groups (innermost axes first)."""
    ds_axis: str
    """The axis of DeepSpeed's ``ProcessTopology`` (pipe, data, model) its ranks count in. DeepSpeed's
    pipeline grid knows only those three: it reduces gradients and partitions ZeRO states over its
    'data' groups and writes one set of checkpoint files per 'model' coordinate. cp folds into 'data'
    (its ranks hold the same weights); ep into 'model', because ep ranks hold different experts: each
    writes its own files, and ``mt3d.ds.experts`` adds the reduction of dense gradients over ep."""
    optional: bool = False
    """Shown in coordinates, keys and reports only when its degree is above 1."""
    within: str | None = None
    """The axis whose groups this one subdivides (ep within dp), or None."""
    digits: int = 3
    """Width of its coordinate in checkpoint file names (``rng/pp000_dp00000_tp000``)."""


AXES: tuple[Axis, ...] = (
    Axis(
        "tp",
        "tensor",
        "attention heads, KV groups, the MLP and the vocabulary (Megatron tensor slicing)",
        "none over tp: each rank owns its shard; replicated weights with partial gradients "
        "(sequence-parallel norms, q/k norms) are summed over tp by hooks",
        "inside an NVLink island, else inside a host",
        "model",
    ),
    Axis(
        "cp",
        "context",
        "each sample's sequence (context parallelism, load-balanced for causal attention)",
        "dense gradients averaged over dp x cp (the group ZeRO partitions over)",
        "inside a host when whole groups fit",
        "data",
        optional=True,
    ),
    Axis(
        "ep",
        "expert",
        "the experts of mixture-of-experts layers (each rank holds num_experts / ep)",
        "dense gradients with dp; expert gradients over the edp ranks holding the same experts",
        "inside a host when whole groups fit",
        "model",
        optional=True,
        within="dp",
    ),
    Axis(
        "dp",
        None,
        "the global batch (ZeRO partitions optimizer states, gradients or parameters over it)",
        "averaged (reduce-scatter / all-reduce)",
        "inside a host when whole groups fit",
        "data",
        digits=5,
    ),
    Axis(
        "pp",
        "pipeline",
        "the layers into pipeline stages (DeepSpeed's pipeline engine)",
        "none over pp: each stage owns its layers; the tied embedding's gradient is summed",
        "across hosts (the lightest traffic)",
        "pipe",
    ),
)
BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}
NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
DEFAULT_ORDER = "-".join(NAMES)
"""Innermost first: tp inside NVLink islands, then cp, ep and dp inside hosts, pp across them."""

GRID: tuple[str, ...] = tuple(reversed(NAMES))
"""Dimensions of a placement grid, outermost first; the 'ep' dimension holds the part of ep within dp
(``ExpertLayout.grid_ep``: ep before folding), the 'dp' one the rest of dp."""


def degree_keys() -> dict[str, str]:
    """``mt3d.parallel`` key -> axis name, for the axes whose degree is configured."""
    return {a.key: a.name for a in AXES if a.key}


def shown(degrees: dict[str, int]) -> tuple[str, ...]:
    """The axes a report, a key or a coordinate names for these degrees (optional ones only when > 1)."""
    return tuple(a.name for a in AXES if not a.optional or degrees.get(a.name, 1) > 1)


def derive_degrees(
    world: int,
    given: dict[str, int],
    *,
    by_key: bool = False,
    fix: str = "change the degrees",
    expert_tensor: int | None = None,
) -> dict[str, int]:
    """Every axis's degree: ``given`` for the configured axes (missing ones 1), dp what remains.

    The one home of the rule that the world is divisible by the model-parallel product; the expert
    degrees are checked by the expert layout (``expert_layout.ExpertLayout.resolve``: etp divides tp,
    etp x ep divides tp x cp x dp). ``expert_tensor`` (etp; None: tp) is kept in the result as
    ``etp`` only when it differs from tp (a folded layout). Messages name the axes by their config
    keys when ``by_key`` (``tensor*pipeline``), else by name (``tp*pp``), and end with ``fix``.
    """
    for name, value in given.items():
        if name not in BY_NAME or BY_NAME[name].key is None:
            known = ", ".join(degree_keys().values())
            raise AxisError(f"unknown or derived axis {name!r} (configured axes: {known})")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise AxisError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world <= 0:
        raise AxisError(f"world size must be a positive integer, got {world!r}")
    degrees = {a.name: (given.get(a.name, 1) if a.key else 1) for a in AXES}
    split = [a for a in AXES if a.key and a.within is None]  # the model-parallel axes
    product = 1
    for a in split:
        product *= degrees[a.name]
    if world % product:
        named = [a for a in split if not a.optional or degrees[a.name] > 1]
        names = "*".join(a.key if by_key else a.name for a in named)
        values = "*".join(str(degrees[a.name]) for a in named)
        raise AxisError(
            f"world size {world} is not divisible by {names} = {values}; "
            f"launch a multiple of {product} processes or {fix}"
        )
    degrees["dp"] = world // product
    etp = expert_tensor if expert_tensor is not None else degrees["tp"]
    if degrees["ep"] > 1 or etp != degrees["tp"]:
        try:
            ExpertLayout.resolve(degrees["tp"], degrees["cp"], degrees["dp"], degrees["ep"], etp)
        except ExpertLayoutError as e:
            raise AxisError(f"{e}; {fix}" if fix not in str(e) else str(e)) from None
    if etp != degrees["tp"]:
        degrees["etp"] = etp
    return degrees


def expert_layout(degrees: dict[str, int]) -> ExpertLayout:
    """The expert layout of derived degrees (``derive_degrees``)."""
    return ExpertLayout(degrees["tp"], degrees.get("cp", 1), degrees["dp"], degrees.get("ep", 1),
                        degrees.get("etp", degrees["tp"]))  # fmt: skip


def deepspeed_sizes(degrees: dict[str, int]) -> dict[str, int]:
    """The sizes of DeepSpeed's three axes for these degrees: 'model' the distinct sets of weights of a
    stage (lcm(tp, etp x ep): tp x ep before folding), 'data' the ranks holding each
    (``ExpertLayout.deepspeed_grid``; cp's ranks count in 'data', ep's in 'model')."""
    model = expert_layout(degrees).model_ranks
    stage = degrees["tp"] * degrees.get("cp", 1) * degrees["dp"]
    return {"pipe": degrees["pp"], "data": stage // model, "model": model}


def grid_shape(degrees: dict[str, int]) -> tuple[int, ...]:
    """The placement grid's shape (``GRID`` order): the grid's 'ep' dimension is the part of ep the
    data-parallel ranks hold (``ExpertLayout.grid_ep``; all of it before folding), and 'dp' the rest."""
    sizes = dict(degrees)
    g = expert_layout(degrees).grid_ep
    sizes["ep"], sizes["dp"] = g, degrees["dp"] // g
    return tuple(sizes[name] for name in GRID)


def parse_order(order: str) -> tuple[str, ...]:
    """An axis order such as ``"tp-dp-pp"`` (innermost first) as every axis, innermost first.

    Axes it leaves out take their place in ``DEFAULT_ORDER`` (right after the nearest axis before
    them there); an axis named twice, or a name that is no axis, is an error.
    """
    parts = [p.strip().lower() for p in str(order).split("-")]
    unknown = [p for p in parts if p not in BY_NAME]
    if unknown or len(set(parts)) != len(parts) or not {"tp", "dp", "pp"} <= set(parts):
        raise AxisError(
            f"order must be a permutation of tp-dp-pp, with cp and ep anywhere when used "
            f"(innermost first, default {DEFAULT_ORDER}), got {order!r}"
        )
    full = list(parts)
    for i, name in enumerate(NAMES):
        if name in full:
            continue
        before = [n for n in NAMES[:i] if n in full]
        full.insert(full.index(before[-1]) + 1 if before else 0, name)
    return tuple(full)


def order_label(order: tuple[str, ...], degrees: dict[str, int]) -> str:
    """The order as reports print it: the axes ``shown`` for these degrees."""
    keep = set(shown(degrees))
    return "-".join(a for a in order if a in keep)


__all__ = [
    "AXES",
    "BY_NAME",
    "DEFAULT_ORDER",
    "GRID",
    "NAMES",
    "Axis",
    "AxisError",
    "deepspeed_sizes",
    "degree_keys",
    "derive_degrees",
    "expert_layout",
    "grid_shape",
    "order_label",
    "parse_order",
    "shown",
]
