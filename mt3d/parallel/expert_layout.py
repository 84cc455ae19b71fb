"""The expert layout of a pipeline stage: expert tensor (etp) x expert (ep) x expert data (edp)
parallelism over the same ranks as the attention layout (tp x cp x dp), as Megatron-Core's "parallel
folding" lays them out.

Read by ``mt3d.parallel.axes`` (``derive_degrees``, ``grid_shape``, ``deepspeed_sizes``), the rank
mapper's ``Placement`` (its 'ep', 'edp', 'etp' and 'tpo' groups, the ep coordinate, DeepSpeed's grid),
``ParallelState``, the model (``SparseMoE``: experts over etp, tokens shared out over tpo), the config
(``mt3d.parallel.expert_tensor``, ``rules.folding_conflict``), the training loop's loss mean, the
checkpoints (``model_rank``: where an expert's files are; ``ds.universal._convert_folded``) and the
planner. Folded layouts train equal to one process at ZeRO 0-2 (ZeRO-0:
``mt3d.ds.experts.reduce_folded``), with or without a capacity, resume exactly and reshard (ZeRO 1-2:
no ZeRO-0 checkpoint reshards, folded or not) (tests/test_moe.py). Their ranks must ascend in each
group (``config.placement_rules.order_conflict``). Not yet: a reshard into experts split over part of
the TP group (refused in one line: ``mt3d.checkpoint.reshard.folded_reshard_conflict``).

The ranks of a stage are listed innermost first in the attention grid's own nesting with the ep part
of dp moved next to tp: tp, then ``g`` ranks of dp (the grid's 'ep' dimension: the ep ranks the
mapper places within dp, as it always has), then cp, then the rest of dp. Position ``i`` in that list
is decomposed innermost first: expert-TP rank ``i mod etp``, expert rank ``(i / etp) mod ep``,
expert-data rank ``i / (etp ep)``. So:

* ``etp`` = tp and ep dividing dp (``g`` = ep): the layout of every mt3d run before folding, the ep
  ranks those of the grid's 'ep' dimension, the edp ranks cp x dp / ep;
* ``etp`` = 1 (whole experts, Megatron-Core's recommendation): ep folds over the tp ranks first (inside
  an NVLink island), then over dp's ``g``, then cp, then the rest of dp.

``g`` is the part of ep beyond tp / etp that dp can hold: gcd(dp, ep etp / gcd(ep etp, tp)).

DeepSpeed's pipeline grid wants ranks holding the same weights in its 'data' axis: a rank's weights
are its tp shard of the dense layers and its (ep, etp) share of the experts, both functions of
``i mod L``, L = lcm(tp, etp ep); so the grid's 'model' axis is ``i mod L`` and 'data' ``i / L``. For the
layouts before folding this is exactly the grid mt3d always gave DeepSpeed (model = ep rank x tp + tp
rank, data = dp / ep rank x cp + cp rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError


class ExpertLayoutError(UserError):
    """Expert degrees that cannot be laid over the stage's ranks; the message names the fix."""


@dataclass(frozen=True)
class ExpertLayout:
    """The expert degrees of a run and where the expert ranks sit in its attention grid."""

    tp: int
    cp: int
    dp: int
    ep: int
    etp: int

    @classmethod
    def resolve(cls, tp: int, cp: int, dp: int, ep: int, etp: int | None = None, *,
                experts: int | None = None, expert_ffn: int | None = None) -> ExpertLayout:  # fmt: skip
        """The layout of these degrees (``etp`` None: tp, the layout before folding), or one line on
        why they cannot form one: etp must divide tp, etp x ep the stage's tp x cp x dp ranks, ep the
        routed ``experts`` and etp the expert inner size ``expert_ffn`` (when given)."""
        etp = tp if etp is None else etp
        for name, value in (("expert", ep), ("expert_tensor", etp)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ExpertLayoutError(f"mt3d.parallel.{name} must be a positive integer, got {value!r}")
        if tp % etp:
            raise ExpertLayoutError(
                f"mt3d.parallel.expert_tensor = {etp} must divide tensor = {tp} (experts split within "
                f"a tensor-parallel group); use 1 (whole experts) or a divisor of {tp}"
            )
        stage = tp * cp * dp
        if stage % (etp * ep):
            raise ExpertLayoutError(
                f"expert_tensor x expert = {etp} x {ep} must divide tensor x context x data = "
                f"{tp} x {cp} x {dp} = {stage} (a pipeline stage's ranks); change expert or expert_tensor"
            )
        layout = cls(tp, cp, dp, ep, etp)
        why = layout.fit_conflict(experts, expert_ffn)
        if why:
            raise ExpertLayoutError(why)
        return layout

    def fit_conflict(self, experts: int | None = None, expert_ffn: int | None = None) -> str | None:
        """Why a model's routed experts cannot be laid out here (None: they can): ep must divide the
        ``experts`` and etp their inner size ``expert_ffn`` (each checked when given)."""
        if experts is not None and experts % self.ep:
            return f"model.moe.experts ({experts}) is not divisible by expert = {self.ep}"
        if expert_ffn is not None and expert_ffn % self.etp:
            return f"the experts' inner size ({expert_ffn}) is not divisible by expert_tensor = {self.etp}"
        return None

    @property
    def folded(self) -> bool:
        """Whether the layout differs from the one before folding (etp = tp, ep within dp)."""
        return self.etp != self.tp or self.dp % self.ep != 0

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (their gradients reduce, their ZeRO states partition, over them)."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def grid_ep(self) -> int:
        """``g``: the ep ranks within dp, the size of the placement grid's 'ep' dimension."""
        beyond = self.etp * self.ep // math.gcd(self.etp * self.ep, self.tp)
        return math.gcd(self.dp, beyond)

    @property
    def model_ranks(self) -> int:
        """L = lcm(tp, etp ep): the distinct sets of weights in a stage (DeepSpeed's 'model' axis)."""
        return math.lcm(self.tp, self.etp * self.ep)

    def stage_order(self, grid: np.ndarray) -> np.ndarray:
        """[pp, stage ranks]: each stage's ranks in the expert layout's list order, from a placement
        grid [pp, dp / g, g, cp, tp] (``axes.GRID`` with ``g`` = ``grid_ep``)."""
        pp, dpe, g, cp, tp = grid.shape
        if (g, cp, tp, dpe * g) != (self.grid_ep, self.cp, self.tp, self.dp):
            raise ValueError(f"grid {grid.shape} is not this layout's ({self})")
        return grid.transpose(0, 1, 3, 2, 4).reshape(pp, -1)  # innermost: tp, g, cp, dp / g

    def expert_grid(self, grid: np.ndarray) -> np.ndarray:
        """[pp, edp, ep, etp]: the global rank at each expert coordinate."""
        return self.stage_order(grid).reshape(grid.shape[0], self.edp, self.ep, self.etp)

    def rows(self, grid: np.ndarray, name: str) -> np.ndarray:
        """[groups, size]: every group of ``name`` over the placement grid: 'etp', 'ep', 'edp', or
        'tpo' (the ranks of a TP group with the same expert-TP rank: tp / etp of them)."""
        if name == "tpo":
            flat = self.stage_order(grid)
            tpo = flat.reshape(grid.shape[0], -1, self.tp // self.etp, self.etp)
            return np.moveaxis(tpo, 2, -1).reshape(-1, self.tp // self.etp)
        eg = self.expert_grid(grid)
        axis = {"edp": 1, "ep": 2, "etp": 3}[name]
        return np.moveaxis(eg, axis, -1).reshape(-1, eg.shape[axis])

    def groups(self, grid: np.ndarray, name: str) -> list[list[int]]:
        """``rows`` as lists."""
        return self.rows(grid, name).tolist()

    def model_rank(self, expert_rank: int, etp_rank: int) -> int:
        """The first DeepSpeed 'model' coordinate (position mod L) holding expert rank ``expert_rank``'s
        experts split ``etp_rank`` of etp: ``expert_rank x etp + etp_rank`` (e x tp + t before folding).
        A rank's dense weights are its TP shard ``position mod tp``: model coordinate t holds shard t."""
        return expert_rank * self.etp + etp_rank

    def expert_coordinates(self, model_rank: int) -> tuple[int, int]:
        """(expert rank, expert-TP rank) of the experts at DeepSpeed 'model' coordinate ``model_rank``."""
        return (model_rank // self.etp) % self.ep, model_rank % self.etp

    def deepspeed_grid(self, grid: np.ndarray) -> np.ndarray:
        """[pipe, data, model] for DeepSpeed's ProcessTopology: 'model' the weights a rank holds
        (position mod L), 'data' the ranks holding the same ones."""
        flat = self.stage_order(grid)
        return flat.reshape(grid.shape[0], -1, self.model_ranks)


__all__ = ["ExpertLayout", "ExpertLayoutError"]


HOST_GROUPS = ("ep_node", "ep_rail")
"""The ep groups split by host (``host_blocks``): the ep ranks on one host ('ep_node') and the ep ranks
at the same place on each host ('ep_rail'), the two hops of ``parallel.expert_dispatch`` "node"."""


def host_blocks(ep_rows: np.ndarray, host_of: np.ndarray) -> np.ndarray | None:
    """[ep groups, hosts, ranks per host]: each ep group's ranks (``ep_rows`` [groups, ep]) split by
    host (its hosts in the order of their first rank in the group, each host's ranks in ep order), the
    split ``parallel.expert_dispatch`` "node" routes by; None when some ep group has different numbers
    of ranks on its hosts (or the groups differ in their hosts' count)."""
    out = []
    for row in ep_rows:
        hosts = host_of[row]
        blocks = [row[hosts == h] for h in dict.fromkeys(hosts.tolist())]
        if len({len(b) for b in blocks}) != 1:
            return None
        out.append(np.stack(blocks))
    return np.stack(out) if len({b.shape for b in out}) == 1 else None


def host_rows(ep_rows: np.ndarray, host_of: np.ndarray, name: str) -> np.ndarray:
    """[groups, size] of ``name`` in ``HOST_GROUPS``: 'ep_node' the blocks of ``host_blocks``, 'ep_rail'
    their ranks at each place; without a split (one host, or uneven) the ep groups and single ranks."""
    blocks = host_blocks(ep_rows, host_of)
    if blocks is None or blocks.shape[1] == 1:
        return ep_rows if name == "ep_node" else ep_rows.reshape(-1, 1)
    if name == "ep_node":
        return blocks.reshape(-1, blocks.shape[2])
    return blocks.transpose(0, 2, 1).reshape(-1, blocks.shape[1])
