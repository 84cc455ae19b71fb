"""Golden files made with main before the parallel axes were declared once (tests/golden): the rank
mapper's placements of three-axis layouts and a (tp 2, pp 2, dp 2) ZeRO-1 checkpoint, which today's
code must print and resume exactly as the code that made them did."""

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


def test_a_checkpoint_of_the_three_axis_code_resumes_exactly_and_reshards(tmp_path):
    expected = json.loads((GOLDEN / "checkpoint_v1" / "expected.json").read_text())
    assert _run(expected, tmp_path, "same", 8) == expected["unstopped"][3:]  # bit for bit
    resharded = _run(expected, tmp_path, "one", 1, tensor=1, pipeline=1)
    for got, want in zip(resharded, expected["reshard_1_1_1"], strict=True):
        assert got["step"] == want["step"]
        for key in ("loss", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (got, want)
