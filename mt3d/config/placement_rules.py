"""The rank placement's rules, checked once the mapper has placed the ranks and before any process
group exists (``config.rules`` re-exports them)."""

from __future__ import annotations

ORDERED = ("tp", "cp", "ep", "etp", "tpo", "ep_node", "ep_rail")
"""Groups whose members' order the collectives read (sequence and tensor shards gathered in rank order,
the experts' owners, the ring)."""


def order_conflict(placement) -> str | None:
    """Why ``placement`` (a ``parallel.topology.Placement``) cannot run (None: it can): a group whose
    members' order the collectives read (``ORDERED``) lists its ranks out of ascending order, as NVLink
    islands given out of order (``parallel.islands`` '2,3;0,1') make them. torch numbers a process
    group's members by ascending global rank, mt3d by their coordinate, so gathers, all-to-alls and the
    experts' owners would disagree between the two."""
    folded = placement.expert.folded
    for axis in (a for a in ORDERED if a in placement.report_groups or (a == "tpo" and folded)):
        for ranks in placement.groups(axis):
            if ranks != sorted(ranks):
                return (f"the rank placement lists the {axis} group {ranks} out of ascending rank order "
                        "(torch numbers a group's members in ascending order, mt3d by coordinate): change "
                        "mt3d.parallel.islands, parallel.order or parallel.expert_tensor so that its groups' "
                        "ranks ascend")  # fmt: skip
    return None
