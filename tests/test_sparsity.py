"""The speed-of-light tile model of local attention: hand-counted tables, block sparsity, the GNA setting."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mt3d.bench.report import render
from mt3d.planner.sparsity import causal_block_sparse, key_ranges, off_diagonal_full, tiles

ROOT = Path(__file__).resolve().parents[1]


def test_sliding_window_tiles_by_hand():
    """n = 8, W = 4, tiles of 2: query tiles see key tiles {0}, {0,1}, {0,1,2}, {1,2,3}."""
    r = tiles(8, 4, 1, 1, 2, 2)
    assert (r.tiles_visited, r.tiles_dense, r.full_tiles) == (9, 10, 3)
    assert (r.pairs, r.pairs_dense) == (1 + 2 + 3 + 4 * 5, 36)
    assert r.bound == 10 / 9 and not r.perfectly_block_sparse


def test_blocked_and_strided_tiles_by_hand():
    blocked = tiles(8, 4, 4, 1, 2, 2)  # each query sees its block of 4 up to itself
    assert (blocked.tiles_visited, blocked.full_tiles, blocked.pairs) == (6, 2, 2 * (1 + 2 + 3 + 4))
    strided = tiles(10, 4, 3, 1, 1, 1)  # 1x1 tiles: visited tiles are the allowed pairs
    assert strided.tiles_visited == strided.pairs == strided.full_tiles
    start, end = key_ranges(10, 4, 3, True)
    assert [(int(start[i]), int(end[i])) for i in (0, 3, 5, 9)] == [(0, 0), (2, 3), (2, 5), (6, 9)]


def test_dilation_is_counted_as_permuted_groups():
    whole = tiles(37, 4, 2, 3, 4, 4)
    groups = [tiles(n_g, 4, 2, 1, 4, 4) for n_g in (13, 12, 12)]  # ceil((37 - g) / 3)
    assert whole.tiles_visited == sum(g.tiles_visited for g in groups)
    assert whole.pairs == sum(g.pairs for g in groups)


def test_perfectly_block_sparse_means_the_bound_is_the_flop_ratio():
    """Non-causal blocked attention with tiles dividing the block: every visited tile is full, and the
    bound 1 / (fraction of tiles visited) equals the FLOP ratio exactly."""
    r = tiles(16, 4, 4, 1, 4, 4, causal=False)
    assert r.perfectly_block_sparse and r.bound == 1 / r.tile_fraction == 1 / r.flop_fraction == 4
    assert not tiles(16, 4, 1, 1, 4, 4, causal=False).perfectly_block_sparse  # sliding never is
    for w, s, d in itertools.product((4, 8), (1, 4), (1, 2)):  # causal never is: the diagonal tiles
        assert not tiles(64, w, s, d, 4, 4).perfectly_block_sparse


def test_causal_block_sparsity_off_the_diagonal_matches_its_closed_form():
    for n, w, s, tq, tkv in itertools.product((48, 50, 64), (8, 12, 16), (1, 2, 4, 8), (2, 4, 8), (2, 4)):
        if s <= w and n >= 2 * w:
            r = tiles(n, w, s, 1, tq, tkv)
            assert off_diagonal_full(r) == causal_block_sparse(n, w, s, tq, tkv), (n, w, s, tq, tkv)


def test_the_published_gna_setting():
    """n = 32k, W = 2048, tiles 128 (Hassani et al. 2025; NATTEN's profiler): non-causal bounds against
    the 16x FLOP bound, stride 256 the smallest perfectly block-sparse stride; causal halves them."""
    bounds = {}
    for causal, s in itertools.product((False, True), (1, 128, 256, 2048)):
        r = tiles(32768, 2048, s, 1, 128, 128, causal=causal)
        bounds[causal, s] = round(r.bound, 2)
        assert r.perfectly_block_sparse == (not causal and s in (256, 2048))
    assert bounds[False, 1] == 15.11 and bounds[False, 256] == bounds[False, 2048] == 16.0
    assert bounds[True, 1] == 7.8 and bounds[True, 256] == 8.53 and bounds[True, 2048] == 15.12


def test_plan_reports_the_attention_speedup_of_local_layers():
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "plan", "--model", "gemma2-9b", "--gpus", "8", "--gpus-per-node", "8",
         "--gpu", "h100", "--seq-len", "32768", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    attn = json.loads(out.stdout)["attention"]
    # half the layers local (4096 of 32768): they visit ~1/4 of the causal tiles, the others all:
    # (0.24 + 1) / 2
    assert 0.6 < attn["tile_fraction"] < 0.64 and attn["attention_speedup_bound"] == pytest.approx(
        1 / attn["tile_fraction"]
    )


def test_pattern_benchmark_runs_and_renders():
    out = subprocess.run(
        [sys.executable, "-m", "mt3d.bench", "attention", "--part", "patterns", "--pattern-lens", "256",
         "--pattern-window", "32", "--strides", "8", "--reps", "1", "--heads", "2", "--head-dim", "16"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    names = [r["pattern"] for r in rec["patterns"]]
    assert names == ["dense causal", "sliding", "strided 8", "blocked", "dilated 2"]
    assert all(r["bound"] > 1 and r["seconds"] > 0 for r in rec["patterns"][1:])
    assert "| 256 | blocked | block-local |" in render([rec])
