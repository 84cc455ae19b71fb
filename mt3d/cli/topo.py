"""``mt3d topo``: the rank mapping of a layout, every group and which groups cross hosts."""

from __future__ import annotations

import argparse
import sys

from ..inputs import (
    positive_int,
    read_text,
    world_size,
)
from .common import UsageError

# --- topo ----------------------------------------------------------------------------------
TOPO_EXAMPLES = """examples:
  mt3d topo --world-size 16 --gpus-per-node 8 --tp 2 --pp 2
  mt3d topo --world-size 2240 --gpus-per-node 8 --tp 8 --pp 35 --model mtnlg-530b --json
  mt3d topo --hostfile launch/hostfile.example --tp 2 --pp 2
  mt3d topo --world-size 8 --tp 2 --islands '0,2;1,3;4,6;5,7'
  mt3d topo --world-size 64 --gpus-per-node 8 --tp 2 --cp 2 --ep 2 --pp 2
  mt3d topo --world-size 16 --gpus-per-node 8 --tp 2 --ep 8 --etp 1
  nvidia-smi topo -m > topo.txt; mt3d topo --world-size 8 --tp 2 --nvidia-smi-topo topo.txt
"""


def _add_topo(sub) -> None:
    p = sub.add_parser(
        "topo",
        help="show the rank mapping, every group, and which groups cross hosts",
        description="Show how ranks map to (tp, dp, pp) coordinates and hosts, every process group, "
        "and how many groups cross host boundaries.",
        epilog=TOPO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=world_size, help="total ranks (default: the hostfile's slots)")
    p.add_argument(
        "--gpus-per-node", type=positive_int, help="ranks per host for uniform hosts (default: one host)"
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('host slots=N' per line); hosts may be uneven")
    from ..parallel.axes import AXES, DEFAULT_ORDER

    for axis in AXES:
        if axis.key:  # one flag per configured axis: --tp, --cp, --ep, --pp
            p.add_argument(f"--{axis.name}", type=positive_int, default=1,
                           help=f"{axis.key} degree: splits {axis.splits} (default 1)")  # fmt: skip
    p.add_argument(
        "--etp", type=positive_int, default=None,
        help="expert-tensor degree (mt3d.parallel.expert_tensor): ranks splitting one expert (default: "
        "--tp); below --tp, or with --ep not dividing dp, ep folds over tp x cp x dp",
    )  # fmt: skip
    p.add_argument(
        "--order", default=DEFAULT_ORDER, help=f"axis nesting, innermost first (default {DEFAULT_ORDER})"
    )
    p.add_argument("--islands", help="NVLink islands as local ranks, e.g. '0,1;2,3;4,5;6,7'")
    p.add_argument(
        "--nvidia-smi-topo", metavar="FILE", help="file with 'nvidia-smi topo -m' output to find islands"
    )
    p.add_argument(
        "--allow-crossing", action="store_true", help="warn instead of failing when TP must cross hosts"
    )
    p.add_argument("--model", help="preset name, for the cross-host traffic estimate (e.g. gpt3-1.3b)")
    p.add_argument(
        "--seq-len", type=positive_int, help="sequence length for the estimate (default: the model's)"
    )
    p.add_argument(
        "--micro-batch", type=positive_int, default=1, help="micro-batch size for the estimate (default 1)"
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="micro-batches per step for the estimate (default 1)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (groups, crossings, bytes) instead of tables",
    )
    p.set_defaults(func=cmd_topo)


def cmd_topo(args: argparse.Namespace) -> int:
    """``mt3d topo``."""
    from pathlib import Path

    from ..parallel import hosts as H
    from ..parallel import topology as T
    from ..planner import report as R
    from ..planner.traffic import TrafficModel
    from ..presets import get_preset

    hosts = H.read_hostfile(args.hostfile) if args.hostfile else None
    world = (
        args.world_size if args.world_size is not None else (sum(h.slots for h in hosts) if hosts else None)
    )
    if world is None:
        raise UsageError("give --world-size or --hostfile")
    islands = None
    if args.islands and args.nvidia_smi_topo:
        raise UsageError("give --islands or --nvidia-smi-topo, not both")
    if args.islands:
        islands = H.parse_islands(args.islands)
    elif args.nvidia_smi_topo:
        path = Path(args.nvidia_smi_topo)
        if not path.is_file():
            raise FileNotFoundError(f"nvidia-smi topo file not found: {path}")
        islands = H.parse_nvidia_smi_topo(read_text(path, "nvidia-smi topo output"))
    from ..parallel.axes import degree_keys

    topo = T.place(
        world,
        gpus_per_node=args.gpus_per_node,
        hosts=hosts,
        order=args.order,
        islands=islands,
        allow_crossing=args.allow_crossing,
        expert_tensor=args.etp,
        **{name: getattr(args, name) for name in degree_keys().values()},
    )
    traffic = None
    if args.model:
        from ..config.rules import context_sequence_conflict, expert_conflict

        cfg = get_preset(args.model)
        cfg.check_parallel(args.tp, args.pp)
        seq = args.seq_len or cfg.max_seq_len
        why = expert_conflict(cfg.moe_spec, args.ep) or context_sequence_conflict(
            args.cp, args.tp, seq, False
        )
        if why:
            raise UsageError(f"--model {args.model}: {why}")
        traffic = TrafficModel(
            layers=cfg.layers,
            hidden=cfg.hidden,
            seq_len=seq,
            micro_batch=args.micro_batch,
            micro_batches=args.grad_accum,
            params=cfg.num_params(),
        )
    if args.json:  # streamed: the per-rank listing never sits in memory
        R.write_report_json(topo, traffic, sys.stdout)
    else:
        print(R.format_report(topo, traffic))
    from ..config.rules import order_conflict

    why = order_conflict(topo)
    if why:  # shown here, refused by a training run before its process groups
        print(f"note: mt3d train refuses this placement: {why}", file=sys.stderr)
    return 0
