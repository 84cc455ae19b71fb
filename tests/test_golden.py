"""Golden files made with main before the parallel axes were declared once (tests/golden): the rank
mapper's placements of three-axis layouts and a (tp 2, pp 2, dp 2) ZeRO-1 checkpoint, which today's
code must print and resume exactly as the code that made them did; and ep 2 ZeRO-1 checkpoints from
before dense optimizer states spanned the ep ranks and from before their groups followed the weight
decay (tests/golden/make_ep_checkpoint_fixture.py)."""

import copy
import gzip
import json
import shutil
from pathlib import Path

import pytest

from mt3d.parallel.spawn import spawn

from helpers import step_records, train_worker

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
TOPO_CASES = json.loads((GOLDEN / "topo" / "cases.json").read_text())


@pytest.mark.parametrize("name", sorted(TOPO_CASES))
def test_topo_json_prints_the_placements_it_always_printed(name, capsys, monkeypatch):
    from mt3d.cli import main

    monkeypatch.chdir(ROOT)  # the cases name hostfiles relative to the repository
    assert main(["topo", *TOPO_CASES[name], "--json"]) == 0
    want = json.loads(gzip.open(GOLDEN / "topo" / f"{name}.json.gz").read())
    got = json.loads(capsys.readouterr().out)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key


def _run(expected, tmp_path, name, world, **parallel):
    raw = copy.deepcopy(expected["config"])
    src = tmp_path / "ckpt" / "step_00000003"
    if not src.exists():
        shutil.copytree(GOLDEN / "checkpoint_v1" / "step_00000003", src)
    raw["mt3d"]["parallel"].update(parallel)
    raw["mt3d"]["train"].update(save_dir=str(tmp_path / name), resume=str(src))
    raw["mt3d"]["data"]["cache_dir"] = str(tmp_path / "cache")
    got = step_records(spawn(train_worker, world, raw, timeout=600)[0])
    return [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in got]


def _assert_same_run(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), (g, w)


def test_a_checkpoint_of_the_three_axis_code_resumes_exactly_and_reshards(tmp_path):
    """The golden run's last three steps, resumed from its step-3 checkpoint at the same layout and
    resharded to one rank. Within 1e-6, not bit for bit: the checkpoint carries the rounding of the CPU
    that made it. The key bias's gradient is zero but for rounding (softmax ignores a constant added to
    a query's every score), and Adam turns that noise into steps of +-lr: on a Xeon with AVX-512 FP16
    the same code's own step-3 key biases differ from the checkpoint's in sign, its other weights by
    a median of 31 ulps, and the resumed step 6's loss by one ulp (4.810022354 against 4.810022831),
    while a resume that loses state is off by far more. Bit-exact resume on the machine that saved the
    checkpoint: test_checkpoint.py::test_resume_is_exact."""
    expected = json.loads((GOLDEN / "checkpoint_v1" / "expected.json").read_text())
    _assert_same_run(_run(expected, tmp_path, "same", 8), expected["unstopped"][3:])
    _assert_same_run(_run(expected, tmp_path, "one", 1, tensor=1, pipeline=1), expected["reshard_1_1_1"])


def _resume_ep_fixture(name: str, src: Path, tmp_path: Path, **train):
    """Resume the fixture ``name``'s step 3 (copied to ``src``) in ``tmp_path / "run"``; its steps
    match the run that made it within 1e-6. Returns (the config, the step records)."""
    expected = json.loads((GOLDEN / name / "expected.json").read_text())
    raw = copy.deepcopy(expected["config"])
    raw["mt3d"]["train"].update(save_dir=str(tmp_path / "run"), resume=str(src), **train)
    got = step_records(spawn(train_worker, 2, raw, timeout=600)[0])
    want = expected["unstopped"][3:]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), (g, w)
    return raw, got


def test_an_expert_parallel_checkpoint_from_before_dense_states_spanned_ep_resumes(tmp_path):
    """tests/golden/checkpoint_ep_v1 (ep 2, ZeRO-1, each ep rank's dense optimizer states whole): the
    layout it records has no ``dense_partition``, so today's code loads it through the universal
    path (each ep rank's files converted on their own) into states partitioned over dp x cp, and
    goes on as the code that made it did."""
    from mt3d.checkpoint.manifest import read_manifest

    src = tmp_path / "ckpt" / "step_00000003"
    shutil.copytree(GOLDEN / "checkpoint_ep_v1" / "step_00000003", src)
    assert "dense_partition" not in read_manifest(src)["meta"]["layout"]
    _resume_ep_fixture("checkpoint_ep_v1", src, tmp_path, save_at_end=True)
    saved = read_manifest(tmp_path / "run" / "checkpoints" / "step_00000006")["meta"]["layout"]
    assert saved["dense_partition"] == "dp x cp"


def _optimizer_groups(step: Path) -> list:
    import torch

    sd = torch.load(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    groups = sd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    return [(g["weight_decay"], bool(g.get("moe"))) for g in groups]


def test_an_expert_parallel_checkpoint_grouped_by_weight_decay_resumes_with_one_group_each(tmp_path):
    """tests/golden/checkpoint_ep_v2 (ep 2, ZeRO-1, weight decay 0, three optimizer groups: dense
    matrices, dense norms, experts) resumed by today's code, which groups by weight decay only where
    it has one (dense and experts one group each): its saved layout says nothing of the groups, so it
    loads through the universal path and goes on as the code that made it did; the run's own
    checkpoints record the grouping, hold two groups (the experts' still marked as such) and resume
    rigidly, bit for bit, and through the universal path again into groups by weight decay."""
    from mt3d.checkpoint.manifest import read_manifest
    from mt3d.config.layout import PARAM_GROUPS

    src = tmp_path / "ckpt" / "step_00000003"
    shutil.copytree(GOLDEN / "checkpoint_ep_v2" / "step_00000003", src)
    assert "param_groups" not in read_manifest(src)["meta"]["layout"]
    assert _optimizer_groups(src) == [(0.0, False), (0.0, False), (0.0, True)]
    raw, got = _resume_ep_fixture("checkpoint_ep_v2", src, tmp_path, save_interval=2)
    step4 = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert read_manifest(step4)["meta"]["layout"]["param_groups"] == PARAM_GROUPS[True]
    assert _optimizer_groups(step4) == [(0.0, False), (0.0, True)]
    raw["mt3d"]["train"].update(save_dir=str(tmp_path / "again"), resume=str(step4), save_interval=0)
    again = step_records(spawn(train_worker, 2, raw, timeout=600)[0])
    assert [(r["loss"], r["grad_norm"]) for r in again] == [(r["loss"], r["grad_norm"]) for r in got[1:]]
    # with weight decay again, groups by decay: through the universal path, each group keeps its own
    # decay and expert mark (DeepSpeed's loader would give each the settings of the saved group at its
    # position: the dense norms the experts' mark)
    raw["optimizer"]["params"]["weight_decay"] = 0.1
    raw["mt3d"]["train"].update(save_dir=str(tmp_path / "decay"), save_at_end=True)
    spawn(train_worker, 2, raw, timeout=600)
    step6 = tmp_path / "decay" / "checkpoints" / "step_00000006"
    assert read_manifest(step6)["meta"]["layout"]["param_groups"] == PARAM_GROUPS[False]
    assert _optimizer_groups(step6) == [(0.1, False), (0.0, False), (0.1, True)]
