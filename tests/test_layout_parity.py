"""Any (tp, pp, dp) layout trains exactly like tp = pp = dp = 1 (fp32, same seed, batch and data)."""

import pytest

from helpers import TINY_GPT, TINY_LLAMA, run_grouped, tiny_config

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 1)]
GQA_LAYOUTS = [(2, 2, 2), (4, 2, 1)]  # GQA at tp 2 and 4 (one kv head per rank); each axis alone: gpt2
RTOL = 1e-5


@pytest.mark.parametrize("arch,model", [("gpt2", TINY_GPT), ("llama-gqa", TINY_LLAMA)])
def test_every_layout_matches_the_single_process_run(tmp_path, arch, model, reference_runs):
    ref = reference_runs["gpt" if arch == "gpt2" else "llama"]  # run_layout(tmp_path, model, 1, 1, 1)
    assert len(ref) == 5 and ref[-1]["loss"] < ref[0]["loss"]
    layouts = LAYOUTS[1:] if arch == "gpt2" else GQA_LAYOUTS
    runs = run_grouped(
        [
            (tp * pp * dp, tiny_config(tmp_path / f"run_{tp}{pp}{dp}", model=model, tp=tp, pp=pp))
            for tp, pp, dp in layouts
        ]
    )
    for (tp, pp, dp), got in zip(layouts, runs, strict=True):
        assert [r["step"] for r in got] == [r["step"] for r in ref]
        for a, b in zip(got, ref):
            for key in ("loss", "grad_norm"):
                rel = abs(a[key] - b[key]) / abs(b[key])
                assert rel <= RTOL, (
                    f"{arch} tp={tp} pp={pp} dp={dp} step {a['step']} {key}: {a[key]} vs {b[key]}"
                )
