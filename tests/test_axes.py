"""The parallel axes declared once: the table, degrees and orders, and the rank mapper over four and
five axes (pure: no processes), plus the groups ParallelState builds from them (spawned ranks)."""

import itertools
import time

import numpy as np
import pytest

from mt3d.parallel.axes import AXES, DEFAULT_ORDER, AxisError, derive_degrees, parse_order, shown
from mt3d.parallel.hosts import Host, TopologyError, parse_islands
from mt3d.parallel.topology import COMBINED, place, uniform_crossing


def test_the_table_declares_every_axis_once():
    names = [a.name for a in AXES]
    assert names == ["tp", "cp", "ep", "dp", "pp"] and DEFAULT_ORDER == "tp-cp-ep-dp-pp"
    assert {a.ds_axis for a in AXES} == {"model", "data", "pipe"}
    assert [a.name for a in AXES if a.within] == ["ep"]
    assert shown({"tp": 2, "cp": 1, "ep": 1, "dp": 4, "pp": 2}) == ("tp", "dp", "pp")
    assert shown({"tp": 1, "cp": 2, "ep": 4, "dp": 4, "pp": 1}) == ("tp", "cp", "ep", "dp", "pp")


def test_degrees_and_orders():
    want = {"tp": 2, "cp": 2, "ep": 4, "dp": 8, "pp": 2}
    assert derive_degrees(64, {"tp": 2, "cp": 2, "ep": 4, "pp": 2}) == want
    with pytest.raises(AxisError, match="world size 12 is not divisible by tp\\*cp\\*pp = 2\\*2\\*2"):
        derive_degrees(12, {"tp": 2, "cp": 2, "pp": 2})
    # ep need not divide dp (it folds over tp x cp x dp), but etp x ep must divide a stage's ranks
    assert derive_degrees(8, {"tp": 2, "ep": 4, "pp": 2}, expert_tensor=1)["dp"] == 2
    with pytest.raises(AxisError, match=r"expert_tensor x expert = 2 x 4 must divide .* = 4 .*; change it"):
        derive_degrees(8, {"tp": 2, "ep": 4, "pp": 2}, fix="change it")
    assert parse_order("tp-dp-pp") == ("tp", "cp", "ep", "dp", "pp")  # left-out axes at their default place
    assert parse_order("dp-tp-pp") == ("dp", "tp", "cp", "ep", "pp")
    assert parse_order("tp-ep-cp-dp-pp") == ("tp", "ep", "cp", "dp", "pp")
    for bad in ("tp-pp", "tp-dp-pp-dp", "tp-xp-dp-pp"):
        with pytest.raises(AxisError, match="permutation of tp-dp-pp"):
            parse_order(bad)


def check_partitions(pl):
    """Every axis and combined group partitions the ranks; ep groups sit inside dp groups; the
    coordinate of every rank maps back to it."""
    world = pl.world
    for ax in (*pl.axes, *COMBINED):
        flat = sorted(r for g in pl.groups(ax) for r in g)
        assert flat == list(range(world)), ax
    dp_of = {r: i for i, g in enumerate(pl.groups("dp")) for r in g}
    for g in pl.groups("ep"):
        assert len({dp_of[r] for r in g}) == 1  # an ep group is a subset of one dp group
    for g in pl.groups("dense"):
        assert len(g) == pl.dp * pl.cp
    for r in range(world):
        assert pl.rank_of(**pl.coord(r)) == r
    for ax in pl.axes:  # the coordinate along an axis is the position in its group
        for g in pl.groups(ax):
            assert [pl.coord(r)[ax] for r in g] == list(range(len(g)))


@pytest.mark.parametrize(
    "world,gpn,degrees",
    [
        (32, 8, dict(tp=2, cp=2, pp=2)),  # four axes (dp 4)
        (32, 8, dict(tp=2, ep=2, pp=2)),  # four axes, ep within dp
        (64, 8, dict(tp=2, cp=2, ep=2, pp=2)),  # five axes
        (64, 16, dict(tp=4, cp=2, ep=4, pp=1)),
        (48, 8, dict(tp=2, cp=3, ep=2, pp=2)),  # cp groups of 3 do not fill a host
    ],
)
def test_four_and_five_axes_partition_the_ranks_and_keep_heavy_axes_inside_hosts(world, gpn, degrees):
    pl = place(world, gpus_per_node=gpn, warn=False, **degrees)
    check_partitions(pl)
    assert pl.crossing("tp") == 0
    per_host_tp_groups = gpn // pl.tp
    if per_host_tp_groups % pl.cp == 0:
        assert pl.crossing("cp") == 0  # whole cp groups fit: none crosses
    if per_host_tp_groups % (pl.cp * pl.ep) == 0:
        assert pl.crossing("ep") == 0
    cp_hosts = [len({pl.host(r) for r in g}) for g in pl.groups("cp")]
    assert pl.crossing("cp") == sum(n > 1 for n in cp_hosts)  # counted when they cannot fit


def test_cp_groups_that_cannot_fit_are_counted_and_tp_keeps_its_islands():
    islands = parse_islands("0,2;1,3;4,6;5,7")
    pl = place(32, 2, 2, gpus_per_node=8, islands=islands, cp=2, warn=False)
    check_partitions(pl)
    assert pl.island_crossing_tp() == 0 and [0, 2] in list(pl.groups("tp"))
    hosts = (Host("a", 6), Host("b", 6), Host("c", 4))  # 3, 3 and 2 TP pairs: cp 2 leaves one pair alone
    pl = place(16, 2, 1, hosts=hosts, cp=2, warn=False)
    check_partitions(pl)
    # one cp block is assembled from the leftover pairs of a and b: its two cp groups (one per tp rank) cross
    assert pl.crossing("tp") == 0 and pl.crossing("cp") == 2
    crossing = next(g for g in pl.groups("cp") if pl.host(g[0]) != pl.host(g[1]))
    assert [pl.host(r) for r in crossing] == ["a", "b"]


def test_any_order_of_five_axes_is_a_bijection():
    for order in itertools.permutations(("cp", "ep", "dp", "pp")):
        pl = place(32, 2, 2, gpus_per_node=32, order="-".join(("tp", *order)), cp=2, ep=2, warn=False)
        check_partitions(pl)
        assert pl.order == "-".join(("tp", *order))
    natural = place(16, 2, 1, gpus_per_node=16, order="cp-tp-dp-pp", cp=2, warn=False)
    check_partitions(natural)
    assert list(natural.groups("tp"))[0] == [0, 2]  # cp innermost: TP partners two apart


def test_groups_whose_order_matters_must_ascend_as_torch_numbers_them(capsys):
    """torch numbers a process group's members by ascending global rank, mt3d by coordinate: every order
    of the axes and the islands of the tour agree; NVLink islands listed out of order, or whole experts
    folded over islands that interleave the hosts' ranks, are refused in one line before any group
    (and ``mt3d topo`` says so)."""
    from mt3d.cli import main
    from mt3d.config.rules import order_conflict

    for order in itertools.permutations(("cp", "ep", "dp", "pp")):
        pl = place(32, 2, 2, gpus_per_node=32, order="-".join(("tp", *order)), cp=2, ep=2, warn=False)
        assert order_conflict(pl) is None
    islands = parse_islands("0,2;1,3;4,6;5,7")
    assert order_conflict(place(32, 2, 2, gpus_per_node=8, islands=islands, cp=2, warn=False)) is None
    for tour, kw, axis, group in (("2,3;0,1", dict(cp=2), "cp", [2, 0]),
                                  ("1,3;0,2", dict(ep=2), "ep", [1, 0]),
                                  ("0,2;1,3", dict(ep=4, expert_tensor=1), "ep", [0, 2, 1, 3])):  # fmt: skip
        why = order_conflict(place(4, 2, 1, gpus_per_node=4, islands=parse_islands(tour), warn=False, **kw))
        assert why.startswith(f"the rank placement lists the {axis} group {group} out of ascending"), why
    capsys.readouterr()
    argv = ["topo", "--world-size", "4", "--tp", "2", "--ep", "4", "--etp", "1", "--islands", "0,2;1,3"]
    assert main(argv) == 0
    assert "note: mt3d train refuses this placement: the rank placement lists the ep group [0, 2, 1, 3]" in (
        capsys.readouterr().err
    )


def test_deepspeed_sees_cp_in_its_data_axis_and_ep_in_its_model_axis():
    """cp ranks hold the same weights (DeepSpeed reduces and partitions over them); ep ranks hold
    different experts, so each writes its own files: they count in DeepSpeed's 'model' axis."""
    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.axes import deepspeed_sizes

    topo = map_ranks(32, 2, 2, gpus_per_node=8, cp=2, ep=2)
    sizes = deepspeed_sizes(topo.placement.degrees)
    assert (
        sizes
        == {"pipe": 2, "data": topo.dp // topo.ep * topo.cp, "model": topo.tp * topo.ep}
        == {"pipe": 2, "data": 4, "model": 4}
    )
    assert [topo.get_dim(a) for a in ("pipe", "data", "model")] == [2, 4, 4]
    # edp (the ranks holding the same experts: expert ZeRO states) is DeepSpeed's 'data' axis
    data = {tuple(sorted(g)) for g in topo.get_axis_comm_lists("data")}
    assert data == {tuple(sorted(g)) for g in topo.groups("edp")}
    for r in range(32):
        c, ds = topo.coord(r), topo.get_coord(r)
        assert ds.model == c["ep"] * topo.tp + c["tp"]  # the checkpoint files' model index
        assert ds.data == c["dp"] // topo.ep * topo.cp + c["cp"]


def test_a_million_ranks_on_five_axes_in_seconds():
    t0 = time.perf_counter()
    pl = place(2**20, 8, 16, gpus_per_node=8, cp=4, ep=8)
    crossing = {ax: pl.crossing(ax) for ax in pl.axes}
    elapsed = time.perf_counter() - t0
    assert elapsed < 5, elapsed
    assert crossing["tp"] == 0 and crossing["pp"] == pl.group_count("pp")
    assert crossing["cp"] == pl.group_count("cp")  # 4 x tp 8 = 32 GPUs: no cp group fits an 8-GPU host
    assert pl.grid.shape == (16, 256, 8, 4, 8)
    assert np.array_equal(np.sort(pl.grid.ravel()), np.arange(2**20))


@pytest.mark.parametrize("cp,ep", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_the_planners_closed_form_crossing_agrees_on_uniform_hosts(cp, ep):
    checked = 0
    for gpn in (4, 8, 16):
        for world in (gpn, 2 * gpn, 4 * gpn, 8 * gpn):
            for tp, pp in itertools.product((1, 2, 4), (1, 2, 4)):
                if gpn % tp or world % (tp * cp * pp) or (world // (tp * cp * pp)) % ep:
                    continue
                pl = place(world, tp, pp, gpus_per_node=gpn, cp=cp, ep=ep, warn=False)
                want = {ax: pl.crossing(ax) > 0 for ax in pl.axes}
                assert uniform_crossing(world, gpn, tp, pp, cp=cp, ep=ep) == want, (world, gpn, tp, pp)
                checked += 1
    assert checked > 10


def test_topo_command_shows_cp_and_ep(capsys):
    import json

    from mt3d.cli import main

    assert main(["topo", "--world-size", "32", "--gpus-per-node", "8", "--tp", "2", "--cp", "2", "--ep", "2",
                 "--pp", "2", "--json"]) == 0  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert (rep["tp"], rep["cp"], rep["ep"], rep["dp"], rep["pp"]) == (2, 2, 2, 4, 2)
    assert rep["order"] == "tp-cp-ep-dp-pp" and set(rep["groups"]) == {"tp", "cp", "ep", "dp", "pp"}
    assert set(rep["crossing"]) == {"tp", "cp", "ep", "dp", "pp"} and rep["crossing"]["cp"] == 0
    assert all({"tp", "cp", "ep", "dp", "pp"} <= set(r) for r in rep["ranks"])
    dp_groups = [set(g) for g in rep["groups"]["dp"]]
    assert all(any(set(g) <= d for d in dp_groups) for g in rep["groups"]["ep"])
    assert main(["topo", "--world-size", "32", "--tp", "2", "--cp", "2", "--ep", "2", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 32 = tp 2 x cp 2 x ep 2 x dp 4 x pp 2" in text and "cp groups (16 of size 2)" in text
    with pytest.raises(TopologyError, match="expert_tensor x expert = 2 x 4 must divide"):
        place(8, 2, 2, ep=4)
    # whole experts folded over tp x dp inside a host: the ep groups stay there, edp's cross
    assert main(["topo", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--ep", "8", "--etp", "1",
                 "--json"]) == 0  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert rep["expert_layout"] == {"etp": 1, "ep": 8, "edp": 2}
    assert rep["groups"]["ep"] == [list(range(8)), list(range(8, 16))] and len(rep["groups"]["edp"]) == 8
    assert (rep["crossing"]["ep"], rep["crossing"]["edp"], rep["crossing"]["tp"]) == (0, 8, 0)
    assert main(["topo", "--world-size", "16", "--tp", "2", "--ep", "8", "--etp", "1"]) == 0
    assert "expert layout: etp 1 x ep 8 x edp 2" in capsys.readouterr().out
    assert "ep_node" not in rep["groups"]  # ep groups inside a host: nothing to split
    # an ep group of 16 over two hosts: its split by host (expert_dispatch "node"): 8 ranks a host, and
    # the rails of one rank per host, which alone cross
    assert main(["topo", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--ep", "16",
                 "--etp", "1", "--json"]) == 0  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert rep["groups"]["ep_node"] == [list(range(8)), list(range(8, 16))]
    assert rep["groups"]["ep_rail"] == [[r, r + 8] for r in range(8)]
    assert (rep["crossing"]["ep"], rep["crossing"]["ep_node"], rep["crossing"]["ep_rail"]) == (1, 0, 8)


def _state_worker(degrees):
    import torch
    import torch.distributed as dist

    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.state import ParallelState

    topo = map_ranks(dist.get_world_size(), **degrees)
    state = ParallelState.build(topo)
    me = dist.get_rank()
    out = {name: state.groups[name].ranks for name in state.groups}
    # each group really is a process group over its ranks: a sum over it counts its members
    for name in ("cp", "ep", "dense", "edp"):
        g = state.groups[name]
        x = torch.ones(1)
        if g.size > 1:
            dist.all_reduce(x, group=g.group)
        out[f"{name}_sum"] = int(x.item())
    out["hooks"] = (
        state.get_sequence_parallel_world_size(),
        state.get_sequence_data_parallel_world_size(),
        state.get_data_parallel_world_size(),
    )
    out["rank"] = me
    return out


def test_parallel_state_builds_every_axis_and_the_combined_groups():
    from mt3d.parallel.spawn import spawn
    from mt3d.parallel.topology import place

    degrees = {"tp": 1, "pp": 1, "cp": 2, "ep": 2}
    pl = place(8, **degrees)
    results = spawn(_state_worker, 8, degrees, timeout=120)
    for res in results:
        me = res["rank"]
        for name in ("tp", "cp", "ep", "dp", "pp", "dense", "edp"):
            want = next(g for g in pl.groups(name) if me in g)
            assert list(res[name]) == want, (name, me)
            if f"{name}_sum" in res:
                assert res[f"{name}_sum"] == len(want)
        assert res["hooks"] == (2, 8, 4)  # cp, dp x cp, dp
