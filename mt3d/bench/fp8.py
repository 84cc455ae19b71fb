"""``fp8``: convergence of FP8 training (``train.fp8``) beside bf16, on this machine.

The same tiny Llama, seed, data (the synthetic corpus, whose entropy floor is known) and optimizer
trained for ``--steps`` steps in bf16 and with each FP8 recipe (tensorwise, rowwise, blockwise,
mxfp8) in the blocks' linears; a recipe whose tiles the width does not fill (blockwise: 128, mxfp8:
32; ``rules.fp8_shape_conflict``) is skipped and named. Reported: each run's final loss (the mean of
the last tenth of the steps, which smooths batch noise) and its ratio to bf16's (the target is within
2%), and a plot of the curves (``--plot``). The speed of FP8 is a GPU matter:
``python -m mt3d.bench gpu --fp8 ...``.
"""

from __future__ import annotations

import datetime

from .common import bench_run_config, build_engine, emit, table, train_step

RECIPES = (None, "tensorwise", "rowwise", "blockwise", "mxfp8")


def curve_worker(raw: dict, steps: int) -> list[float]:
    """Train ``raw`` for ``steps`` steps in this one-rank group; the loss of every step."""
    _, layout, rt, engine, data, _ = build_engine(raw)
    return [train_step(engine, layout, rt, data, layout.micro_batch, k) for k in range(steps)]


def config(recipe: str | None, args) -> dict:
    """The run of one recipe (None: bf16 alone)."""
    model = {"preset": "tiny-llama", "hidden": args.hidden, "ffn": 2 * args.hidden, "kv_heads": 4}
    raw = bench_run_config(model=model, global_batch=16, micro=4, seq_len=64, bf16=True,
                           save_dir="/tmp/mt3d-bench-fp8")  # fmt: skip
    raw["optimizer"]["params"]["lr"] = args.lr
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 20}}
    if recipe:
        raw["mt3d"]["train"]["fp8"] = {"recipe": recipe}
    return raw


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench fp8``."""
    from ..config import resolve_model
    from ..config.rules import fp8_shape_conflict
    from ..parallel.spawn import spawn

    curves, skipped = {}, {}
    for recipe in RECIPES:
        raw = config(recipe, args)
        why = recipe and fp8_shape_conflict(resolve_model(raw["mt3d"]["model"]), 1, 4 * 64, recipe)
        if why:
            skipped[recipe] = why
            print(f"skipped {recipe}: {why}")
            continue
        curves[recipe or "bf16"] = spawn(curve_worker, 1, raw, args.steps, timeout=3600)[0]
    tail = max(1, args.steps // 10)
    final = {name: sum(c[-tail:]) / tail for name, c in curves.items()}
    rows = [{"run": name, "first_loss": c[0], "final_loss": final[name],
             "vs_bf16": final[name] / final["bf16"]} for name, c in curves.items()]  # fmt: skip
    print(f"tiny Llama (hidden {args.hidden}), {args.steps} steps of the synthetic corpus, lr {args.lr:g}; "
          f"final loss = mean of the last {tail} steps")  # fmt: skip
    print(table(rows, ["run", "first_loss", "final_loss", "vs_bf16"]))
    if args.plot:
        plot(curves, args.plot)
        print(f"plot: {args.plot}")
    return emit("fp8", {"steps": args.steps, "hidden": args.hidden, "lr": args.lr, "rows": rows,
                        "curves": curves, "skipped": skipped,
                        "date": datetime.date.today().isoformat()})  # fmt: skip


def plot(curves: dict[str, list[float]], path: str,
         title: str = "FP8 linears beside bf16 (tiny Llama, synthetic corpus, CPU)") -> None:  # fmt: skip
    """The loss curves, one line per run, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [[x["run"], _f(x["first_loss"]), _f(x["final_loss"]), _f(x["vs_bf16"])] for x in r["rows"]]
    return ["run", "first loss", "final loss", "vs bf16"], rows
