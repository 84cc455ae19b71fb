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


def _train(tmp_path, name, world, model, **parallel):
    from helpers import step_records, tiny_config, train_worker

    raw = tiny_config(tmp_path / name, model=model)
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
    ("gpt", 2, dict(context=2, context_exchange="allgather")),
    ("llama", 4, dict(context=4)),  # auto: all-to-all (8 heads, 4 kv heads)
    ("llama", 4, dict(tensor=2, context=2, sequence_parallel=True, context_exchange="allgather")),
    ("llama", 4, dict(context=2, pipeline=2, virtual_stages=2)),  # interleaved 1F1B
    ("gpt", 8, dict(tensor=2, context=2, pipeline=2, sequence_parallel=True)),
    ("gemma", 2, dict(context=2)),  # Gemma 2: local (halo) and global layers, soft-capping
    ("gna", 2, dict(context=2)),  # strided + dilated pattern through the halo
]


@pytest.mark.parametrize(
    "name,world,parallel", LAYOUTS, ids=[f"{m}-{w}-{'-'.join(map(str, p.values()))}" for m, w, p in LAYOUTS]
)
def test_context_parallel_training_matches_one_process(tmp_path, reference_runs, name, world, parallel):
    ref = reference_runs[name] if name in reference_runs else _train(tmp_path, "ref", 1, _model(name))
    _same(_train(tmp_path, "cp", world, _model(name), **parallel), ref, f"{name} {parallel}")
