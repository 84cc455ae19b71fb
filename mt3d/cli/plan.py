"""``mt3d plan``: the layouts of a model on a cluster, ranked by predicted step time (its flags live
in ``mt3d.planner.args``, which the planner benchmark parses too)."""

from __future__ import annotations

import argparse
import json
import sys

from ..planner.args import PLAN_DESCRIPTION, PLAN_EXAMPLES, add_plan_arguments, plan_inputs, plan_model
from .common import writable_output


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="rank (tp, pp, dp, micro-batch, ZeRO, recompute, SP) layouts by predicted memory and time",
        description=PLAN_DESCRIPTION,
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """``mt3d plan``."""
    from ..planner.output import explain, explain_infeasible, format_plan, write_config
    from ..planner.search import plan

    writable_output(args.write_config, "--write-config")
    cfg, section, defaults = plan_model(args.model)
    inputs = plan_inputs(args, cfg, defaults)
    result = plan(cfg, inputs.pop("cluster"), **inputs)
    if args.write_config:
        write_config(result, args.write_config, section, cfg, defaults.get("data"))
    if args.json:
        slim = {
            **result,
            "feasible": [{k: v for k, v in r.items() if k != "memory"} for r in result["feasible"]],
        }
        print(json.dumps(slim))
    else:
        print(format_plan(result, args.top))
        if args.explain and result["feasible"]:
            print("\n" + explain(result["feasible"][0]))
        if args.write_config:
            print(f"wrote {args.write_config}")
    if not result["feasible"]:
        if not args.json:
            print(explain_infeasible(result), file=sys.stderr)
        return 1
    return 0
