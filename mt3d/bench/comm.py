"""``comm``: every collective of a training step, against 8*b*s*h*(t-1)/t elements per layer (TP; with
sequence parallelism 10*b*s*h*(t-1)/t: the backward all-gathers the linears' kept input shards again),
against the volume of each context-parallel exchange (``--cp``) and of expert parallelism's
all-to-all (``--ep``).

Each configuration trains one step of a model with L blocks and one with 2L blocks under
``CollectiveLog`` (which records what really goes through torch.distributed, DeepSpeed's calls
included). The difference between the two runs is exactly the blocks' traffic, so per layer and
micro-batch: calls by operation, and elements each rank moves (ring: 2(t-1)/t of the buffer for
all-reduce, (t-1)/t for all-gather and reduce-scatter), against the theory. Collectives outside the
blocks (embedding, LM head, loss, gradient reduction) are listed per step.

Context parallelism (``--cp``): per layer and micro-batch, the elements each cp rank sends (mean
over the ranks) for each exchange, beside ``planner.traffic.cp_layer_elements`` (the planner's
volumes): all-to-all 2 f (b s/cp)(2q + 2kv') d, all-gather 4 f b s kv d, halo 8 f b (W d - 1) kv d,
f = (cp-1)/cp; the halo is measured at two sequence lengths (its volume does not grow with s). "gdn":
a model of Gated DeltaNet layers, whose chunks' state maps and convolution halo are exchanged
(``planner.traffic.cp_gdn_elements``), also at two lengths.

Expert parallelism (``--ep``): one MoE layer's forward and backward at ep ranks (the layer alone),
tokens built so that every expert gets the same number of assignments, its all-to-all elements per
rank beside ``planner.traffic.ep_layer_elements``, f = (ep-1)/ep: each token sent once per rank
holding any of its experts (mt3d's dispatch), f D T (4 h + 4 k) + f ep with D the ranks a token
reaches (``ep_ranks_per_token``), and once per assignment, f (4 T k h + E), at each ``--ep-top-k``.
"""

from __future__ import annotations

import math
from collections import Counter

from ..planner.traffic import cp_gdn_elements, cp_layer_elements, ep_layer_elements
from .common import bench_run_config, build_engine, emit, table


def tp_layer_elements(bsh: int, tp: int, sp: bool) -> float:
    """Elements one rank moves per transformer layer and micro-batch over TP (FORMULAS.md): 4
    all-reduces, 8 bsh (t-1)/t; with SP 4 all-gathers and 4 reduce-scatters of the same bytes, plus the
    2 all-gathers of the QKV and MLP-in inputs' kept shards in the backward (``_ShardSavingLinear``;
    overlapped with the input-gradient GEMMs): 10 bsh (t-1)/t."""
    return (10 if sp else 8) * bsh * (tp - 1) / tp


def moved(op: str, numel: int, n: int) -> float:
    """Elements one rank sends in a ring implementation of ``op`` over ``n`` ranks (an all-to-all
    keeps 1/n of its input; a receive sends nothing)."""
    if n <= 1 or op in ("recv", "irecv"):
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n * numel
    if op.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        return (n - 1) / n * numel
    return float(numel)


CP_MODEL = dict(preset="tiny-llama", hidden=64, heads=8, kv_heads=2, ffn=128)  # head_dim 8, GQA
CP_WINDOW = 4  # the halo rows' model: every layer local with W = 4, so W d - 1 = 3 keys
CP_KINDS = ("alltoall", "allgather", "halo", "gdn")
CP_GDN = dict(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16)
"""The "gdn" rows' model: every block a Gated DeltaNet layer (``traffic.cp_gdn_elements``)."""
CP_OPS = ("all_to_all_single", "all_gather", "all_gather_single", "all_gather_into_tensor",
          "reduce_scatter_single", "reduce_scatter_tensor", "isend", "irecv")  # fmt: skip


def cp_worker(kind: str, cp: int, layers: int, seq: int, micro: int, accum: int) -> dict:
    """One step under the collective recorder at cp ranks; each rank's exchange calls in its cp group."""
    from ..data.loader import StepBatches
    from ..parallel.commlog import CollectiveLog

    model = {**CP_MODEL, "layers": layers}
    if kind == "halo":
        model["attention"] = {"window": CP_WINDOW}
    if kind == "gdn":
        model["linear_attention"] = CP_GDN
    raw = bench_run_config(model=model, seq_len=seq, micro=micro, global_batch=micro * accum, zero=0,
                           context=cp, exchange="auto" if kind in ("halo", "gdn") else kind)  # fmt: skip
    _, layout, rt, engine, data, cfg = build_engine(raw)

    def step(k):
        it = StepBatches(data.train, global_batch=layout.global_batch, micro_batch=micro,
                         grad_accum=layout.grad_accum, dp_rank=0, start_step=k, cp=rt.state.cp)  # fmt: skip
        engine.train_batch(data_iter=it)

    step(0)
    with CollectiveLog() as log:
        step(1)
    ranks = tuple(rt.state.cp.ranks)
    calls = [(c.op, c.numel) for c in log.calls if c.ranks == ranks and c.op in CP_OPS]
    return {
        "calls": calls,
        "head_dim": cfg.head_dim,
        "history": cfg.patterns[0].history() if kind == "halo" else 0,
    }


def cp_rows(args) -> list[dict]:
    """Per layer and micro-batch: elements each cp rank sends (mean over the ranks) for each exchange
    at each cp, beside ``cp_layer_elements``; the halo also at twice the sequence (its volume does not
    grow)."""
    rows = []
    for cp in args.cp:
        for kind in CP_KINDS:
            for s in (
                (args.cp_seq_len, 2 * args.cp_seq_len) if kind in ("halo", "gdn") else (args.cp_seq_len,)
            ):
                rows.append(_cp_row(kind, cp, s, args.micro, args.accum, args.layers))
    return rows


def _cp_row(kind: str, cp: int, s: int, b: int, m: int, layers: int) -> dict:
    """One exchange at one cp: runs with ``layers`` and twice as many blocks; the difference per block."""
    from ..parallel.spawn import spawn

    res = {n: spawn(cp_worker, cp, kind, cp, n, s, b, m, timeout=600) for n in (layers, 2 * layers)}
    sent = {n: sum(moved(op, k, cp) for r in res[n] for op, k in r["calls"]) / cp for n in res}
    per_layer = (sent[2 * layers] - sent[layers]) / (layers * m)
    info = res[layers][0]
    q, kv = CP_MODEL["heads"], CP_MODEL["kv_heads"]
    if kind == "gdn":
        from ..model.gdn import GdnSpec

        theory = cp_gdn_elements(cp, b, GdnSpec(**CP_GDN))
    else:
        theory = cp_layer_elements(kind, cp, b, s, q, kv, info["head_dim"], info["history"])
    calls = [Counter(op for op, _ in res[n][0]["calls"]) for n in (layers, 2 * layers)]
    per_call = " ".join(f"{k}:{v / (layers * m):g}" for k, v in sorted((calls[1] - calls[0]).items()))
    return {"cp": cp, "kind": kind, "seq_len": s, "elements_per_layer": per_layer, "theory": theory,
            "ratio": per_layer / theory, "calls_per_layer_per_micro": per_call}  # fmt: skip


def worker(tp: int, sp: bool, layers: int, hidden: int, seq: int, micro: int, accum: int) -> dict:
    """One step under the collective recorder; returns the TP-group collectives seen by rank 0."""
    import torch.distributed as dist

    from ..data.loader import StepBatches
    from ..parallel.commlog import CollectiveLog

    model = dict(preset="tiny", hidden=hidden, layers=layers, heads=4, max_seq_len=seq)
    raw = bench_run_config(model=model, tp=tp, seq_len=seq, micro=micro, global_batch=micro * accum,
                           sequence_parallel=sp)  # fmt: skip
    _, layout, rt, engine, data, _ = build_engine(raw)

    def step(k):
        it = StepBatches(data.train, global_batch=layout.global_batch, micro_batch=micro,
                         grad_accum=layout.grad_accum, dp_rank=0, start_step=k)  # fmt: skip
        engine.train_batch(data_iter=it)

    step(0)  # first step: shapes and buckets set up
    with CollectiveLog() as log:
        step(1)
    ranks = tuple(rt.state.tp.ranks)
    calls = [(c.op, c.numel) for c in log.calls if c.ranks == ranks and tp > 1]
    other = [(c.op, c.numel, len(c.ranks)) for c in log.calls if c.ranks != ranks]
    return {"calls": calls, "other": other, "rank": dist.get_rank()}


EP_MODEL = dict(hidden=32, expert_ffn=32)


def ep_worker(ep: int, tokens: int, experts: int, top_k: int, dedup: bool) -> dict:
    """One MoE layer's forward and backward at ep ranks under the recorder, each token sent once per
    rank holding any of its experts (``dedup``) or once per assignment (``parallel.expert_dispatch``
    "assignment"). Token i chooses the i-th k-subset of the experts (all C(E, k) in turn; ``tokens`` a
    multiple of their count) through a router that reads one dimension per expert, so every expert gets
    the same load and the mean number of ranks a token reaches is exactly ``ep_ranks_per_token``'s
    expectation."""
    import itertools

    import torch
    import torch.distributed as dist

    from ..model.blocks import BuildContext
    from ..model.config import ModelConfig
    from ..model.moe import SparseMoE
    from ..parallel.commlog import CollectiveLog
    from ..parallel.state import AxisGroup

    h, e, k = EP_MODEL["hidden"], experts, top_k
    moe = dict(experts=e, top_k=k, expert_ffn=EP_MODEL["expert_ffn"])
    cfg = ModelConfig.from_dict(dict(hidden=h, layers=1, heads=4, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False, moe=moe))  # fmt: skip
    rank = dist.get_rank()
    group = AxisGroup("ep", tuple(range(ep)), rank, dist.new_group(list(range(ep))))
    layer = SparseMoE(cfg, BuildContext(tp=AxisGroup.alone("tp"), ep=group), 0)
    layer.dedup = dedup  # forced, top-1 included (a config's "rank" at top-1 sends per assignment)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :e] = 10 * torch.eye(e)
    subsets = list(itertools.combinations(range(e), k))
    x = torch.zeros(1, tokens, h)
    for i in range(tokens):
        for j, expert in enumerate(subsets[i % len(subsets)]):
            x[0, i, expert] = 1.0 - 0.1 * j
    x.requires_grad_()
    with CollectiveLog() as log:
        y, _ = layer(x)
        y.sum().backward()
    calls = [(c.op, c.numel) for c in log.calls if c.ranks == group.ranks and c.op == "all_to_all_single"]
    return {"calls": calls}


def ep_rows(args) -> list[dict]:
    """Per MoE layer and micro-batch: all-to-all elements each ep rank sends (mean over the ranks), for
    each ep and top-k, each token sent once per rank (dedup) and once per assignment."""
    from ..parallel.spawn import spawn

    rows = []
    h, e, t = EP_MODEL["hidden"], args.ep_experts, args.ep_tokens
    for ep in args.ep:
        for k in args.ep_top_k:
            for dedup in (True, False):
                res = spawn(ep_worker, ep, ep, t, e, k, dedup, timeout=600)
                sent = sum(moved(op, n, ep) for r in res for op, n in r["calls"]) / ep
                theory = ep_layer_elements(ep, t, k, h, e, dedup=dedup)
                dispatch = "dedup" if dedup else "per-assignment"
                rows.append({"ep": ep, "experts": e, "top_k": k, "dispatch": dispatch, "tokens": t,
                             "calls": len(res[0]["calls"]), "elements_per_layer": sent, "theory": theory,
                             "ratio": sent / theory})  # fmt: skip
    return rows


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can): tp divides the TP rows' 4 heads and the width,
    cp the cp rows' heads and (twice over) their sequence, ep the ep rows' experts."""
    for tp in args.tp:
        if 4 % tp or args.hidden % tp:
            return f"--tp {tp} does not divide the TP rows' 4 heads (or --hidden {args.hidden})"
        if args.seq_len % tp:
            return f"--tp {tp} does not divide --seq-len {args.seq_len} (the SP rows split it)"
    for cp in args.cp:
        if args.cp_seq_len % (2 * cp) or CP_MODEL["heads"] % cp:
            return (f"--cp {cp} needs --cp-seq-len ({args.cp_seq_len}) divisible by {2 * cp} and divides the "
                    f"cp rows' {CP_MODEL['heads']} heads")  # fmt: skip
    for ep in args.ep:
        if args.ep_experts % ep:
            return f"--ep {ep} does not divide --ep-experts {args.ep_experts}"
    for k in args.ep_top_k if args.ep else ():
        if k > args.ep_experts:
            return f"--ep-top-k {k} is more than --ep-experts {args.ep_experts}"
        subsets = math.comb(args.ep_experts, k)
        if args.ep_tokens % subsets:
            return (f"--ep-tokens {args.ep_tokens} is not a multiple of the {subsets} {k}-subsets of "
                    f"{args.ep_experts} experts (each token takes one in turn)")  # fmt: skip
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench comm``."""
    from ..parallel.spawn import spawn

    cp = []
    if args.cp:
        cp = cp_rows(args)
        heads = f"{CP_MODEL['heads']} heads, {CP_MODEL['kv_heads']} kv heads"
        print(
            f"cp exchange per layer and micro-batch, elements sent per rank (mean), b={args.micro}, {heads}"
        )
        print(
            table(
                cp,
                [
                    "cp",
                    "kind",
                    "seq_len",
                    "calls_per_layer_per_micro",
                    "elements_per_layer",
                    "theory",
                    "ratio",
                ],
            )
        )
    ep = []
    if args.ep:
        ep = ep_rows(args)
        kind = f"{args.ep_experts} experts, h={EP_MODEL['hidden']}"
        print(f"ep all-to-all per MoE layer (forward + backward), elements sent per rank (mean), {kind}")
        cols = ["ep", "top_k", "dispatch", "tokens", "calls", "elements_per_layer", "theory", "ratio"]
        print(table(ep, cols))
    rows, out = [], []
    b, s, h, m, L = args.micro, args.seq_len, args.hidden, args.accum, args.layers
    bsh = b * s * h
    for tp in args.tp:
        for sp in (False, True):
            res = {n: spawn(worker, tp, tp, sp, n, h, s, b, m, timeout=600)[0] for n in (L, 2 * L)}
            c1, c2 = Counter(res[L]["calls"]), Counter(res[2 * L]["calls"])
            diff = c2 - c1
            per_layer = {f"{op}x{numel}": n / (L * m) for (op, numel), n in diff.items()}
            big = sum(moved(op, numel, tp) * n for (op, numel), n in diff.items() if numel == bsh) / (L * m)
            small = sum(moved(op, numel, tp) * n for (op, numel), n in diff.items() if numel != bsh) / (L * m)
            theory = tp_layer_elements(bsh, tp, sp)
            row = {
                "tp": tp,
                "sp": sp,
                "calls_per_layer_per_micro": " ".join(f"{k}:{v:g}" for k, v in sorted(per_layer.items())),
                "elements_per_layer": big,
                "theory": theory,
                "ratio": big / theory,
                "norm_grad_elements": small,
            }
            rows.append(row)
            outside = {
                f"{op}x{numel}": n for (op, numel), n in (c1 - diff).items()
            }  # c1 = L layers + the rest
            out.append({**row, "per_layer": per_layer, "tp_calls_outside_blocks_per_step": outside})
    if rows:
        print(
            f"TP collectives per transformer layer and micro-batch (b={b}, s={s}, h={h}; theory 8bsh(t-1)/t, "
            "10bsh(t-1)/t with SP)"
        )
        print(table(rows, ["tp", "sp", "calls_per_layer_per_micro", "elements_per_layer", "theory", "ratio",
                           "norm_grad_elements"]))  # fmt: skip
    return emit("comm", {"rows": out, "cp_rows": cp, "ep_rows": ep, "b": b, "s": s, "h": h, "accum": m,
                         "layers": L})  # fmt: skip


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README (the cp table when only cp was run)."""
    from .report import _f

    if r.get("cp_rows") and not r["rows"]:
        keys = ("cp", "kind", "seq_len", "calls_per_layer_per_micro")
        rows = [[*(x[k] for k in keys), _f(x["elements_per_layer"]), _f(x["theory"]), f"{x['ratio']:.2f}"]
                for x in r["cp_rows"]]  # fmt: skip
        return [
            "cp",
            "exchange",
            "seq",
            "calls per layer per micro-batch",
            "elements sent",
            "theory",
            "ratio",
        ], rows
    rows = [
        [
            x["tp"],
            x["sp"],
            x["calls_per_layer_per_micro"],
            _f(x["elements_per_layer"]),
            _f(x["theory"]),
            f"{x['ratio']:.2f}",
        ]
        for x in r["rows"]
    ]
    return ["tp", "SP", "calls per layer per micro-batch", "elements moved", "8bsh(t-1)/t", "ratio"], rows
