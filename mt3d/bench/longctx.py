"""``longctx``: one long sequence per step at cp 1, 2 and 4, with and without sequence tiles.

Part ``memory``: each row trains two steps (fp32, one sample of ``--seq-len`` tokens per step) of the
tiny Llama below and of a "null" model (hidden 16) with the same layout, in separate processes, and
reports the heaviest rank's peak resident memory above its pre-model baseline (``bench.memory``'s
method): the difference is what the model costs at that layout, beside the planner's prediction
(``costs.memory_bytes`` with cp and ``tile_len``); the null model also has a 16-token vocabulary,
so the difference keeps the model's logits. Activations and logits are what a long sequence
costs, so the measured figure should fall about as 1/cp, and tiles should remove the MLP's inner
activations and all but one tile of the logits.

Part ``cap``: the same model at ``--cap-seq-len`` under an address-space cap (RLIMIT_AS, set in each
rank after its process group exists: the cap is what the rank may add to the address space it
holds before the model is built). The cap is ``--cap-mb``, or, by default, the midpoint between what
one process and cp 4 ranks add when uncapped (measured first). One process must fail to allocate
under it; cp 4 must train.
"""

from __future__ import annotations

from .common import emit, table
from .memory import predict
from .memory import worker as memory_worker

MODEL = dict(preset="tiny-llama", hidden=128, layers=4, heads=8, kv_heads=4, ffn=512)
NULL = dict(preset="tiny-llama", hidden=16, layers=4, heads=8, kv_heads=4, ffn=64)
VOCAB = 8192
"""A vocabulary large enough that the logits (seq x vocab) are a visible part of the activations."""
NULL_VOCAB = 16
"""The null model's: its logits are negligible, so the difference keeps the model's logits."""


def _run(model, cp: int, seq: int, tile_len: int, cap=None) -> dict:
    from ..parallel.spawn import spawn

    vocab = NULL_VOCAB if model is NULL else VOCAB
    out = spawn(cap_worker, cp, model, cp, seq, tile_len, vocab, cap, timeout=900)
    ok = all(r["ok"] for r in out)
    return {"ok": ok, "measured": max(r["measured"] for r in out) if ok else None,
            "vm_added": max(r["vm_added"] for r in out) if ok else None,
            "error": next((r["error"] for r in out if not r["ok"]), None)}  # fmt: skip


def cap_worker(model, cp: int, seq: int, tile_len: int, vocab: int, cap) -> dict:
    """``bench.memory.worker`` at (cp, tile_len), one sample per step (ZeRO-1)."""
    r = memory_worker(model, 1, 1, 1, False, False, seq, 1, 1, cp=cp, tile_len=tile_len, vocab=vocab, cap=cap)
    return {"vm_added": None, "error": None, **r}


def memory_rows(args) -> list[dict]:
    """Per-rank peak at each cp, untiled and tiled, beside the planner."""
    rows = []
    for cp in args.cp:
        for tile in (0, args.tile_len):
            full, null = _run(MODEL, cp, args.seq_len, tile), _run(NULL, cp, args.seq_len, tile)
            shape = (1, 1, 1, 1, False, False, args.seq_len, 1, 1)
            kw = dict(cp=cp, tile_len=tile)
            pred = (
                predict(MODEL, *shape, **kw, vocab=VOCAB)["rss"]
                - predict(NULL, *shape, **kw, vocab=NULL_VOCAB)["rss"]
            )
            measured = full["measured"] - null["measured"]
            rows.append({"cp": cp, "tile_len": tile, "peak_mb": full["measured"] / 1e6,
                         "fixed_mb": null["measured"] / 1e6, "measured_mb": measured / 1e6,
                         "predicted_mb": pred / 1e6, "ratio": measured / pred})  # fmt: skip
    base = {r["tile_len"]: r["measured_mb"] for r in rows if r["cp"] == args.cp[0]}
    for r in rows:
        r["vs_first_cp"] = r["measured_mb"] / base[r["tile_len"]]
    return rows


def cap_rows(args) -> tuple[list[dict], float]:
    """One process and cp 4 under one address-space cap (``--cap-mb`` or the measured midpoint)."""
    seq = args.cap_seq_len
    if args.cap_mb:
        cap = args.cap_mb * 1e6
    else:
        one, four = _run(MODEL, 1, seq, 0), _run(MODEL, 4, seq, 0)
        cap = (one["vm_added"] + four["vm_added"]) / 2
    rows = []
    for cp in (1, 4):
        r = _run(MODEL, cp, seq, 0, cap=int(cap))
        rows.append({"cp": cp, "seq_len": seq, "cap_mb": cap / 1e6, "trained": r["ok"],
                     "peak_mb": r["measured"] / 1e6 if r["ok"] else None,
                     "error": r["error"] or ""})  # fmt: skip
    return rows, cap


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can): each cp splits the sample into 2 cp chunks."""
    bad = [cp for cp in args.cp if args.seq_len % (2 * cp)]
    if bad:
        return f"--seq-len {args.seq_len} is not divisible by 2 x cp = {2 * bad[0]} (--cp {bad[0]})"
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench longctx``."""
    out: dict = {"model": MODEL, "vocab": VOCAB}
    if args.part in ("memory", "both"):
        rows = memory_rows(args)
        print(
            f"per-rank peak memory above the pre-model baseline, one {args.seq_len}-token sample, fp32, CPU"
        )
        print(table(rows, ["cp", "tile_len", "peak_mb", "fixed_mb", "measured_mb", "predicted_mb", "ratio",
                           "vs_first_cp"]))  # fmt: skip
        out.update(rows=rows, seq_len=args.seq_len)
    if args.part in ("cap", "both"):
        rows, cap = cap_rows(args)
        where = f"{cap / 1e6:.0f} MB per rank (RLIMIT_AS), {args.cap_seq_len} tokens"
        print(f"\nunder an address-space cap of {where}")
        print(table(rows, ["cp", "seq_len", "cap_mb", "trained", "peak_mb", "error"]))
        out.update(cap_rows=rows, cap_mb=cap / 1e6)
    return emit("longctx", out)


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table (the memory part; the cap rows follow it)."""
    from .report import _f

    rows = [[x["cp"], x["tile_len"], _f(x["measured_mb"]), _f(x["predicted_mb"]), _f(x["ratio"]),
             _f(x["vs_first_cp"])] for x in r.get("rows", [])]  # fmt: skip
    rows += [[x["cp"], f"cap {x['cap_mb']:.0f} MB", "trained" if x["trained"] else "failed", "", "", ""]
             for x in r.get("cap_rows", [])]  # fmt: skip
    return ["cp", "tile_len", "measured MB", "planner MB", "ratio", "vs first cp"], rows
