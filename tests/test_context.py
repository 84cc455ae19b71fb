"""Context parallelism: each exchange (all-to-all, all-gather, halo) equals single-process attention
in outputs and in the gradients of q, k and v, for causal, sliding, strided, dilated and blocked
patterns, with grouped-query attention and chunks that are no multiple of the window."""

import pytest
import torch

from mt3d.model.attention import LocalPattern, attend, reference_attention
from mt3d.parallel.spawn import spawn

PATTERNS = {
    "causal": None,
    "sliding": LocalPattern(5),
    "strided": LocalPattern(6, 3),
    "dilated": LocalPattern(4, 1, 2),
    "blocked": LocalPattern(4, 4),
    "strided+dilated": LocalPattern(6, 3, 2),
}


def _cases(cp):
    """(name, pattern, exchange, q heads, kv heads) checked at this cp."""
    out = []
    for name, pattern in PATTERNS.items():
        kinds = ["alltoall", "allgather"] + (["halo"] if pattern is not None else [])
        for kind in kinds:
            out.append((name, pattern, kind, 4, 2))  # GQA: 2 query heads per key/value head
    out.append(("causal", None, "alltoall", 4, 1))  # fewer key/value heads than cp: repeated
    return out


def _worker(cp_size, n, seed):
    import torch.distributed as dist

    from mt3d.parallel import context
    from mt3d.parallel.state import AxisGroup

    me = dist.get_rank()
    group = AxisGroup("cp", tuple(range(cp_size)), me, dist.new_group(list(range(cp_size))))
    results = {}
    for name, pattern, kind, hq, hk in _cases(cp_size):
        if kind == "halo" and pattern.history() > n // (2 * cp_size):
            continue
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, h, n, 8, generator=g, dtype=torch.float64) for h in (hq, hk, hk))
        dout = torch.randn(2, hq, n, 8, generator=g, dtype=torch.float64)
        local = [context.split_sequence(t, group, dim=2).requires_grad_() for t in (q, k, v)]
        kw = dict(pattern=pattern, scale=8**-0.5, softcap=None, dropout=0.0, attend=attend)
        out = context.attention(*local, group, kind, **kw)
        out.backward(context.split_sequence(dout, group, dim=2))
        results[(name, kind, hk)] = [out.detach(), *(t.grad for t in local)]
    return results


@pytest.mark.parametrize("cp,n", [(2, 52), (4, 56)])  # n / cp = 26, 14: no multiple of the windows
def test_every_exchange_equals_single_process_attention(cp, n):
    from mt3d.parallel.context import split_sequence
    from mt3d.parallel.state import AxisGroup

    per_rank = spawn(_worker, cp, cp, n, 3, timeout=300)
    checked = 0
    for name, pattern, kind, hq, hk in _cases(cp):
        if (name, kind, hk) not in per_rank[0]:
            continue
        g = torch.Generator().manual_seed(3)
        q, k, v = (
            torch.randn(2, h, n, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (hq, hk, hk)
        )
        dout = torch.randn(2, hq, n, 8, generator=g, dtype=torch.float64)
        ref = reference_attention(q, k, v, pattern, scale=8**-0.5)
        ref.backward(dout)
        want = [ref.detach(), q.grad, k.grad, v.grad]
        for rank, got in enumerate(per_rank):
            mine = AxisGroup("cp", tuple(range(cp)), rank, None)
            for what, a, b in zip(("out", "dq", "dk", "dv"), got[(name, kind, hk)], want):
                torch.testing.assert_close(
                    a, split_sequence(b, mine, dim=2), msg=f"{name} {kind} {what} rank {rank}"
                )
        checked += 1
    assert checked >= 15


# --- training: losses and gradient norms of one process, at every layout with cp ---------------
RTOL = 1e-5
GNA = {"window": 4, "stride": 2, "dilation": 2, "global_every": 2}  # W d - 1 = 7 keys: fits a chunk of 8


def _train(tmp_path, name, world, model, zero=1, tile_len=0, offload="none", **parallel):
    from mt3d.config import Offload

    from helpers import step_records, tiny_config, train_worker

    raw = tiny_config(tmp_path / name, model=model, zero=zero, recompute={"tile_len": tile_len})
    raw["zero_optimization"].update(Offload.from_label(offload, None).ds_keys())
    raw["mt3d"]["parallel"].update(parallel)
    return step_records(spawn(train_worker, world, raw, timeout=600)[0])


def _same(got, ref, what):
    assert [r["step"] for r in got] == [r["step"] for r in ref] and len(ref) == 5, what
    for a, b in zip(got, ref):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (
                f"{what} step {a['step']} {key}: {a[key]} vs {b[key]}"
            )


def _model(name):
    from helpers import TINY_GPT, TINY_LLAMA

    gemma = {"preset": "tiny-gemma2", "attention": {"window": 8, "global_every": 2}}  # W - 1 = 7 fits a chunk
    models = {"gpt": TINY_GPT, "llama": TINY_LLAMA, "gemma": gemma, "gna": {**TINY_GPT, "attention": GNA}}
    return models[name]


LAYOUTS = [  # (model, world, parallel keys): each exchange that applies, with tp (SP), pp and v
    ("gpt", 2, dict(context=2, context_exchange="alltoall")),
    ("gpt", 2, dict(context=2, zero=0)),  # dp 1: DeepSpeed's data axis (dp x cp) still averages gradients
    ("gpt", 2, dict(context=2, context_exchange="allgather", offload="opt-cpu")),  # DeepSpeedCPUAdam too
    ("llama", 4, dict(context=4)),  # auto: all-to-all (8 heads, 4 kv heads)
    ("llama", 4, dict(tensor=2, context=2, sequence_parallel=True, context_exchange="allgather")),
    ("llama", 4, dict(context=2, pipeline=2, virtual_stages=2)),  # interleaved 1F1B
    ("llama", 4, dict(context=2, pipeline=2, virtual_stages=2, schedule="zbv")),  # ZB-V: the split B and W
    # sequence tiles (train.recompute.tile_len) in the MLP (SP shards of 8 in tiles of 3, 3, 2) and
    # the loss (16 positions in tiles of 6, 5, 5), tied head
    ("gpt", 8, dict(tensor=2, context=2, pipeline=2, sequence_parallel=True, tile_len=6)),
    ("gemma", 2, dict(context=2, tile_len=5)),  # Gemma 2: local (halo) and global layers, soft-capping
    ("gna", 2, dict(context=2)),  # strided + dilated pattern through the halo
    ("llama", 2, dict(zero=2, tile_len=5)),  # tiles under ZeRO-2's gradient hooks (dp 2), untied head
]


@pytest.mark.parametrize(
    "name,world,parallel", LAYOUTS, ids=[f"{m}-{w}-{'-'.join(map(str, p.values()))}" for m, w, p in LAYOUTS]
)
def test_context_parallel_training_matches_one_process(tmp_path, reference_runs, name, world, parallel):
    ref = reference_runs[name] if name in reference_runs else _train(tmp_path, "ref", 1, _model(name))
    _same(_train(tmp_path, "cp", world, _model(name), **parallel), ref, f"{name} {parallel}")


def test_context_parallel_checkpoints_resume_exactly_and_reshard(tmp_path):
    """cp 2 resumes bit for bit; its checkpoint reshards to cp 1, and a cp 1 checkpoint to cp 4 (the cp
    ranks count in DeepSpeed's data axis: a reshard across cp is one across its dp)."""
    from helpers import TINY_LLAMA, run_grouped, tiny_config

    def config(name, world, **kw):
        raw = tiny_config(tmp_path / name, model=TINY_LLAMA, steps=6, save_interval=3, **kw)
        raw["mt3d"]["parallel"]["context"] = world
        return world, raw

    step3 = lambda name: str(tmp_path / name / "checkpoints" / "step_00000003")  # noqa: E731
    runs = run_grouped([
        config("cp2", 2), config("cp2again", 2, resume=step3("cp2")), config("cp1", 1),
        config("to1", 1, resume=step3("cp2")), config("to4", 4, resume=step3("cp1")),
    ], timeout=600)  # fmt: skip
    two, again, one, to1, to4 = [[(r["step"], r["loss"], r["grad_norm"]) for r in rs] for rs in runs]
    assert again == two[3:]  # bit for bit
    for got, want in ((to1, two[3:]), (to4, one[3:])):
        for (s, loss, gn), (s2, loss2, gn2) in zip(got, want, strict=True):
            assert s == s2 and abs(loss - loss2) <= RTOL * loss2 and abs(gn - gn2) <= RTOL * gn2, (got, want)


@pytest.mark.parametrize(
    "parallel,extra,match",
    [
        (dict(context=3), {}, "seq_len 32 divisible by 2 x cp = 6"),
        (
            dict(context=2, context_exchange="alltoall"),
            {"heads": 3, "hidden": 48},
            "heads / tp \\(3\\) divisible by cp",
        ),
        (
            dict(context=2, context_exchange="ring"),
            {},
            "context_exchange must be one of auto, alltoall, allgather",
        ),
        (dict(context=2), {"zero": 2}, "context parallelism runs inside DeepSpeed's pipeline engine"),
        (dict(context=2), {"seq_len": 128}, "exceeds the model's max_seq_len 64"),
        (
            dict(context=2, tensor=4, sequence_parallel=True),
            {"seq_len": 36, "world": 8},
            "seq_len / cp \\(18\\) divisible by tp \\(4\\)",
        ),
        (dict(context=2, expert=2), {"world": 8}, "expert parallelism"),
        (dict(context=1), {"zero": 3, "tile_len": 8}, "tile_len is not supported with ZeRO-3 yet"),
        (dict(context=1), {"tile_len": -1}, "recompute.tile_len must be >= 0, got -1"),
    ],
)
def test_bad_context_parallel_configs_are_one_line_before_process_groups(tmp_path, parallel, extra, match):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    from helpers import TINY_GPT, tiny_config

    model = {**TINY_GPT, **{k: extra[k] for k in ("heads", "hidden") if k in extra}}
    raw = tiny_config(
        tmp_path, model=model, zero=extra.get("zero", 1), recompute={"tile_len": extra.get("tile_len", 0)}
    )
    raw["mt3d"]["parallel"].update(parallel)
    raw["mt3d"]["data"]["seq_len"] = extra.get("seq_len", 32)
    run = from_dict(raw)
    world = extra.get("world", parallel["context"])
    with pytest.raises(ConfigError, match=match) as info:
        validate(run, world, resolve_model(run.mt3d.model))
    assert "\n" not in str(info.value)


def _eval_worker(path, text_ids, cp):
    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.model.inference import evaluate_tokens

    model = from_pretrained(path, cp=cp)
    return evaluate_tokens(model, text_ids, model.state, 24, 16)


def test_eval_at_cp_equals_one_process(tmp_path):
    """``mt3d eval --cp``: windows cut over the cp ranks (the last one padded) score the same loss."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.model.inference import evaluate_tokens

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 100, (70,), generator=torch.Generator().manual_seed(1))
    want = evaluate_tokens(
        from_pretrained(tmp_path / "hf"), ids, None or from_pretrained(tmp_path / "hf").state, 24, 16
    )
    for got in spawn(_eval_worker, 2, str(tmp_path / "hf"), ids, 2, timeout=300):
        assert got["tokens"] == want["tokens"] == 69
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
