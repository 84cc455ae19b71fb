"""``muon``: convergence of Muon (``"optimizer": {"type": "Muon"}``) beside AdamW, on this machine.

The same tiny Llama, seed, data (the synthetic corpus) and schedule (20 warm-up steps to each run's
peak rate, then constant) trained for ``--steps`` steps with AdamW at ``--adam-lr`` and with Muon at
``--muon-lr`` on the blocks' matrices (AdamW at ``--adam-lr`` on the rest), weight decay 0.1 both.
Reported: each run's first loss and final loss (the mean of the last tenth of the steps) and Muon's
ratio to AdamW's, and a plot of the curves (``--plot``).
"""

from __future__ import annotations

import datetime

from .common import bench_run_config, emit, table
from .fp8 import curve_worker, plot


def config(name: str, args) -> dict:
    """The run of one optimizer: "adamw" or "muon"."""
    model = {"preset": "tiny-llama", "hidden": args.hidden, "ffn": 2 * args.hidden, "kv_heads": 4}
    raw = bench_run_config(model=model, global_batch=16, micro=4, seq_len=64, zero=0,
                           save_dir=f"/tmp/mt3d-bench-muon-{name}")  # fmt: skip
    betas, decay = [0.9, 0.95], 0.1
    if name == "muon":
        params = {"lr": args.muon_lr, "adam_lr": args.adam_lr, "momentum": 0.95, "betas": betas,
                  "weight_decay": decay}  # fmt: skip
        raw["optimizer"] = {"type": "Muon", "params": params}
    else:
        raw["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": args.adam_lr, "betas": betas, "weight_decay": decay},
        }
    peak = raw["optimizer"]["params"]["lr"]  # Muon's: the AdamW half keeps adam_lr / lr of the schedule
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_max_lr": peak}}
    return raw


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench muon``."""
    from ..parallel.spawn import spawn

    curves = {name: spawn(curve_worker, 1, config(name, args), args.steps, timeout=3600)[0]
              for name in ("adamw", "muon")}  # fmt: skip
    tail = max(1, args.steps // 10)
    final = {name: sum(c[-tail:]) / tail for name, c in curves.items()}
    rows = [{"run": name, "first_loss": c[0], "final_loss": final[name],
             "vs_adamw": final[name] / final["adamw"]} for name, c in curves.items()]  # fmt: skip
    print(
        f"tiny Llama (hidden {args.hidden}), {args.steps} steps of the synthetic corpus; AdamW lr "
        f"{args.adam_lr:g}, Muon lr {args.muon_lr:g}; final loss = mean of the last {tail} steps"
    )
    print(table(rows, ["run", "first_loss", "final_loss", "vs_adamw"]))
    if args.plot:
        plot(curves, args.plot, "Muon beside AdamW (tiny Llama, synthetic corpus, CPU)")
        print(f"plot: {args.plot}")
    return emit("muon", {"steps": args.steps, "hidden": args.hidden, "adam_lr": args.adam_lr,
                         "muon_lr": args.muon_lr, "rows": rows, "curves": curves,
                         "date": datetime.date.today().isoformat()})  # fmt: skip


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [[x["run"], _f(x["first_loss"]), _f(x["final_loss"]), _f(x["vs_adamw"])] for x in r["rows"]]
    return ["run", "first loss", "final loss", "vs AdamW"], rows
