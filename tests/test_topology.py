"""Rank mapper: pure tests, no processes."""

import hashlib
import itertools
import json
import subprocess
import sys
import warnings

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from mt3d.ds.topology import map_ranks
from mt3d.parallel.hosts import Host, parse_hostfile, parse_islands, parse_nvidia_smi_topo, read_hostfile
from mt3d.parallel.topology import TopologyError
from mt3d.planner.report import describe, format_report
from mt3d.planner.traffic import TrafficModel, cross_host_bytes


def check_bijection(topo):
    """Every rank has exactly one coordinate and every axis partitions the ranks."""
    assert sorted(topo.mapping.values()) == list(range(topo.world))
    for ax in ("tp", "dp", "pp"):
        flat = sorted(r for g in topo.groups(ax) for r in g)
        assert flat == list(range(topo.world)), ax
    for r in range(topo.world):
        assert topo.rank_of(**topo.coord(r)) == r


@pytest.mark.parametrize(
    "world,tp,pp,gpn",
    [(1, 1, 1, 1), (8, 2, 2, 8), (16, 2, 2, 8), (16, 4, 2, 8), (32, 8, 2, 8), (24, 2, 3, 8), (64, 1, 4, 8)],
)
def test_default_order_reproduces_deepspeed(world, tp, pp, gpn):
    topo = map_ranks(world, tp, pp, gpus_per_node=gpn)
    ref = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    assert topo.mapping == ref.mapping
    for ax, ds in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
        assert topo.groups(ax) == ref.get_axis_comm_lists(ds)
    check_bijection(topo)


def _digest(topo):
    rows = sorted((rank, c.model, c.data, c.pipe) for c, rank in topo.mapping.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _mixed_hosts():
    """300 hosts: 200 8-GPU boxes and 100 4-GPU boxes interleaved (2000 ranks)."""
    return tuple(Host(f"h{i}", 8 if i % 3 else 4) for i in range(300))


def test_mtnlg_layouts_keep_tp_inside_nodes():
    # MT-NLG: tp 8 inside a DGX node, pp 35; 280 nodes (dp 8) and 560 nodes (dp 16).
    for nodes in (280, 560):
        topo = map_ranks(nodes * 8, 8, 35, gpus_per_node=8)
        assert topo.crossing("tp") == 0
        assert topo.crossing("pp") == topo.tp * topo.dp  # every pipeline spans nodes
        check_bijection(topo)
    # 512 nodes x 8 = 4096 ranks, tp 8 x pp 16 x dp 32; and tp 4: DP pairs fit inside a node.
    big = map_ranks(4096, 8, 16, gpus_per_node=8)
    assert (big.crossing("tp"), big.dp) == (0, 32)
    check_bijection(big)
    tp4 = map_ranks(4096, 4, 16, gpus_per_node=8)
    assert tp4.crossing("tp") == 0
    assert tp4.crossing("dp") == len(tp4.groups("dp"))  # dp 64 cannot fit in 8 GPUs
    check_bijection(tp4)


def test_golden_digests_of_large_layouts():
    # Regression lock: a change to any of these placements must be deliberate.
    uniform = map_ranks(2240, 8, 35, gpus_per_node=8)
    assert _digest(uniform) == _digest(PipeModelDataParallelTopology(num_pp=35, num_mp=8, num_dp=8))
    assert _digest(uniform) == "17236750e07a7ebb"
    assert _digest(map_ranks(4096, 8, 16, gpus_per_node=8)) == "b5c7c5e82f6c9741"
    mixed = map_ranks(2000, 4, 20, hosts=_mixed_hosts())
    assert mixed.crossing("tp") == 0
    assert _digest(mixed) == "29bf33c09e17b610"
    pairs = map_ranks(4096, 2, 8, gpus_per_node=8, islands=parse_islands("0,4;1,5;2,6;3,7"))
    assert pairs.island_crossing_tp() == 0
    assert _digest(pairs) == "a9c42a42a1b7bc25"


def test_uneven_hostfile_keeps_tp_inside_hosts_and_first_fits_dp():
    hosts = parse_hostfile("a slots=4\nb slots=8  # big box\n\nc slots=4\n")
    assert [h.slots for h in hosts] == [4, 8, 4]
    topo = map_ranks(16, 2, 2, hosts=hosts)
    check_bijection(topo)
    assert topo.crossing("tp") == 0
    # The 4 TP pairs of one pipeline stage (2 DP groups, one per TP rank) fit whole on host b
    # only; the other stage's must span a and c.
    assert topo.crossing("dp") == 2
    natural = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=4)
    host_of = [0] * 4 + [1] * 8 + [2] * 4
    natural_cross = sum(len({host_of[r] for r in g}) > 1 for g in natural.get_axis_comm_lists("data"))
    assert natural_cross == 4  # the plain row-major layout splits all of them
    dp_on_b = [g for g in topo.groups("dp") if {topo.host(r) for r in g} == {"b"}]
    assert len(dp_on_b) == 2


def test_uneven_hosts_that_cannot_hold_whole_tp_groups():
    hosts = (Host("x", 6), Host("y", 2))
    with pytest.raises(TopologyError, match="multiples of tp"):
        map_ranks(8, 4, 1, hosts=hosts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topo = map_ranks(8, 4, 1, hosts=hosts, allow_crossing=True)
    assert topo.crossing("tp") == 1  # minimal: one group spans x and y
    assert any("cross hosts" in str(w.message) for w in caught)
    check_bijection(topo)


def test_tp_larger_than_node_is_refused_with_a_fix():
    with pytest.raises(TopologyError, match="smaller tp|allow_crossing"):
        map_ranks(16, 8, 1, gpus_per_node=4)


def test_nvlink_pairs_place_tp_groups_on_islands():
    islands = parse_islands("0,2;1,3;4,6;5,7")
    topo = map_ranks(16, 2, 2, gpus_per_node=8, islands=islands)
    check_bijection(topo)
    assert topo.island_crossing_tp() == 0
    assert [0, 2] in topo.groups("tp") and [9, 11] in topo.groups("tp")
    # Without islands the default pairs (0,1) would straddle two islands.
    plain = map_ranks(16, 2, 2, gpus_per_node=8)
    plain.islands = islands
    assert plain.island_crossing_tp() == 8
    # tp 4 > island size: groups stay in the node, pairs adjacent inside each group.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t4 = map_ranks(8, 4, 1, gpus_per_node=8, islands=islands)
    assert t4.groups("tp") == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert t4.island_crossing_tp() == 2 and any("islands" in n for n in t4.notes)


NVSMI_PAIRS = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV4\tSYS\tSYS\t0-15\t0\t\tN/A
GPU1\tNV4\t X \tSYS\tSYS\t0-15\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNV4\t16-31\t1\t\tN/A
GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_parse_nvidia_smi_topo():
    assert parse_nvidia_smi_topo(NVSMI_PAIRS) == ((0, 1), (2, 3))
    full = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\tCPU Affinity\n"
    for i in range(8):
        full += f"GPU{i}\t" + "\t".join(" X " if i == j else "NV18" for j in range(8)) + "\t0-63\n"
    assert parse_nvidia_smi_topo(full) == (tuple(range(8)),)
    pcie = NVSMI_PAIRS.replace("NV4", "PHB")
    assert parse_nvidia_smi_topo(pcie) == ((0,), (1,), (2,), (3,))
    with pytest.raises(TopologyError, match="GPU0"):
        parse_nvidia_smi_topo("hello\nworld\n")
    with pytest.raises(TopologyError, match="rows"):
        parse_nvidia_smi_topo(NVSMI_PAIRS.split("GPU3\tSYS")[0])


@pytest.mark.parametrize("order", ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))])
def test_every_order_is_accepted_when_tp_stays_inside_nodes(order):
    topo = map_ranks(16, 2, 2, gpus_per_node=16, order=order)
    check_bijection(topo)
    assert topo.crossing("tp") == 0


def test_non_tp_first_order_uses_row_major_and_refuses_crossing():
    topo = map_ranks(8, 2, 2, gpus_per_node=8, order="dp-tp-pp")
    assert topo.groups("tp")[0] == [0, 2]  # dp innermost: TP partners are 2 apart
    with pytest.raises(TopologyError, match="put tp innermost"):
        map_ranks(16, 2, 1, gpus_per_node=8, order="dp-tp-pp")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=12, tp=8), "not divisible by tp\\*pp"),
        (dict(world_size=8, tp=2, order="tp-dp"), "permutation"),
        (dict(world_size=8, tp=0), "positive"),
        (dict(world_size=8, hosts=(Host("a", 4),)), "4 slots but world size is 8"),
        (dict(world_size=12, gpus_per_node=8), "hostfile"),
        (dict(world_size=8, islands=[[0, 1], [1, 2]]), "disjoint"),
    ],
)
def test_impossible_requests_name_the_fix(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        map_ranks(**kwargs)


def test_hostfile_errors(tmp_path):
    with pytest.raises(TopologyError, match="hostfile:2"):
        parse_hostfile("a slots=4\nb slots four\n")
    with pytest.raises(TopologyError, match="twice"):
        parse_hostfile("a slots=4\na slots=4\n")
    with pytest.raises(TopologyError, match="no hosts"):
        parse_hostfile("# only a comment\n")
    with pytest.raises(TopologyError, match="not found"):
        read_hostfile(tmp_path / "missing")
    f = tmp_path / "hosts"
    f.write_text("w0 slots=2\nw1 slots=2\n")
    assert read_hostfile(f) == (Host("w0", 2), Host("w1", 2))


def test_cross_host_bytes_follow_formulas():
    topo = map_ranks(16, 2, 2, gpus_per_node=8)  # tp and dp inside nodes, pp across
    tm = TrafficModel(
        layers=24, hidden=1024, seq_len=1024, micro_batch=2, micro_batches=8, params=350_000_000
    )
    b = cross_host_bytes(topo, tm)
    act = 2 * 1024 * 1024 * 2
    assert b["tp"] == 0 and b["dp"] == 0
    assert b["pp"] == len(topo.groups("pp")) * 2 * act * 8
    # Put DP across nodes instead (pp innermost after tp): now DP rings cross, PP does not.
    topo2 = map_ranks(16, 2, 2, gpus_per_node=4, order="tp-pp-dp")
    b2 = cross_host_bytes(topo2, tm)
    assert b2["pp"] == 0 and b2["tp"] == 0
    n = topo2.dp
    per_group = 4 * 2 * (n - 1) / n * (350_000_000 / 4 * 2)  # 4 host changes in a ring of 4 hosts
    assert b2["dp"] == pytest.approx(len(topo2.groups("dp")) * per_group)


def test_describe_matches_the_json_contract():
    topo = map_ranks(8, 2, 2, gpus_per_node=4)
    rep = json.loads(json.dumps(describe(topo)))
    assert {"world_size", "tp", "pp", "dp", "order", "ranks", "groups", "crossing"} <= set(rep)
    assert set(rep["ranks"][0]) == {"rank", "host", "local_rank", "tp", "dp", "pp"}
    assert rep["crossing"] == {"tp": 0, "dp": 0, "pp": 4}
    assert rep["ranks"][5] == {"rank": 5, "host": "node1", "local_rank": 1, "tp": 1, "dp": 0, "pp": 1}
    text = format_report(topo)
    assert "pp 4/4" in text and "node1" in text


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mt3d", *args], capture_output=True, text=True, timeout=120)


def test_cli_topo_json_and_errors(tmp_path):
    out = run_cli("topo", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2", "--pp", "2", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["dp"] == 4 and rep["crossing"]["tp"] == 0 and len(rep["ranks"]) == 16
    out = run_cli("topo", "--world-size", "8", "--tp", "2", "--model", "gpt2-small", "--json")
    assert "cross_host_bytes_per_step" in json.loads(out.stdout)
    bad = run_cli("topo", "--world-size", "12", "--tp", "8")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "divisible" in bad.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=6\nb slots=2\n")
    bad = run_cli("topo", "--hostfile", str(hostfile), "--tp", "4")
    assert bad.returncode == 2 and "allow-crossing" in bad.stderr
    assert run_cli("topo", "--hostfile", str(hostfile), "--tp", "4", "--allow-crossing").returncode == 0
    bad = run_cli("topo", "--world-size", "8", "--tp", "2", "--model", "tiny", "--grad-accum", "0")
    assert bad.returncode == 2 and "--grad-accum" in bad.stderr
    helptext = run_cli("topo", "--help")
    assert helptext.returncode == 0 and "examples:" in helptext.stdout


def test_the_planners_closed_form_crossing_agrees_with_the_mapper():
    from mt3d.parallel.topology import place, uniform_crossing

    checked = 0
    for gpn in (1, 2, 4, 8, 16):
        for world in range(1, 129):
            if world > gpn and world % gpn:
                continue
            for tp in (t for t in (1, 2, 4, 8, 16) if min(gpn, world) % t == 0 and world % t == 0):
                for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
                    pl = place(world, tp, pp, gpus_per_node=gpn, warn=False)
                    want = {ax: pl.crossing(ax) > 0 for ax in ("tp", "dp", "pp")}
                    assert uniform_crossing(world, gpn, tp, pp) == want, (world, gpn, tp, pp)
                    checked += 1
    assert checked > 1000


def test_a_million_ranks_are_summarised_without_materialising_them():
    import time

    from mt3d.parallel.topology import MAX_WORLD, TopologyError, place

    t0 = time.perf_counter()
    pl = place(2**20, 8, 64, gpus_per_node=8)
    text = format_report(pl)
    assert time.perf_counter() - t0 < 10
    assert "groups crossing hosts: tp 0/131072, dp 512/512, pp 16384/16384" in text
    assert "(2048 ranks)" in text and len(text) < 20_000  # long groups are elided
    with pytest.raises(TopologyError, match=f"exceeds mt3d's limit of {MAX_WORLD} ranks"):
        place(2**30, 8, 64, gpus_per_node=8)
