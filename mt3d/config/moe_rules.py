"""The mixture-of-experts layout rules (read from ``mt3d.config.rules`` too): expert parallelism,
folded expert layouts, the expert dispatch, ZeRO and the overlapped reduction with experts."""

from __future__ import annotations


def overlap_moe_conflict(grad_reduce: bool, pp: int) -> str | None:
    """Why ``mt3d.train.overlap.grad_reduce`` cannot run with a sparse model at this pp (None: it can):
    its stages pass (hidden states, router statistics), and DeepSpeed's pipeline engine runs one
    backward per tensor passed, so a gradient upstream of a router is finished twice per micro-batch."""
    if grad_reduce and pp > 1:
        return ("mt3d.train.overlap.grad_reduce is not supported with a mixture-of-experts model at "
                f"pipeline {pp} (DeepSpeed's engine runs one backward per tensor the stages pass); set it "
                "false")  # fmt: skip
    return None


def expert_conflict(spec, ep: int) -> str | None:
    """Why the experts of ``spec`` (a ``MoESpec`` or None) cannot be split over ep ranks (None: they can)."""
    if ep == 1:
        return None
    if spec is None:
        return f"a model without experts cannot use expert parallelism: set parallel.expert {ep} to 1"
    if spec.experts % ep:
        return f"model.moe.experts = {spec.experts} is not divisible by parallel.expert {ep}"
    return None


def folding_conflict(spec, degrees: dict[str, int], zero_stage: int, seq_len: int | None = None,
                     sp: bool = False) -> str | None:  # fmt: skip
    """Why a folded expert layout (``parallel.expert_layout``: expert_tensor below tensor, or ep not
    dividing dp) cannot run here (None: it can, or the layout is not folded). Built: ZeRO-0 (the pipeline
    engine, pp 1: ``mt3d.ds.experts.reduce_folded``), ZeRO-1 (the pipeline engine) and ZeRO-2 (the
    regular engine, pp 1), with or without a capacity. Without SP the
    tp / etp ranks holding the same tokens share out a rank's ``seq_len`` / cp positions, which they must
    divide."""
    from ..parallel.axes import expert_layout

    layout = expert_layout(degrees)
    if not layout.folded:
        return None
    etp = layout.etp
    if spec is None:
        return f"parallel.expert_tensor {etp} needs a model with experts: leave it unset"
    why = layout.fit_conflict(expert_ffn=spec.expert_ffn)
    if why:
        return why
    if degrees["ep"] == 1:  # the TP ranks would share out the tokens with no expert group to sum over
        return (f"parallel.expert_tensor {etp} below tensor {degrees['tp']} folds whole experts over an "
                "expert-parallel group: set parallel.expert > 1, or leave expert_tensor unset")  # fmt: skip
    if zero_stage not in (0, 1, 2):
        return (f"ZeRO stage {zero_stage} with a folded expert layout is not supported yet (expert_tensor "
                f"{etp}, expert {degrees['ep']} over tensor x context x data trains at ZeRO stages 0-2): "
                "set zero_optimization.stage 0, 1 or 2")  # fmt: skip
    share, local = degrees["tp"] // etp, (seq_len or 0) // degrees.get("cp", 1)
    if seq_len is not None and not sp and local % share:
        return (f"data.seq_len / context = {local} tokens are not divisible by tensor / expert_tensor = "
                f"{share} (the TP ranks share out each sequence's routing): change seq_len or turn on "
                "sequence_parallel")  # fmt: skip
    return None


DISPATCHES = ("rank", "node", "assignment")
"""``mt3d.parallel.expert_dispatch``'s values (``model.moe_exchange``)."""


def dispatch_conflict(dispatch: str, ep: int, model=None, chunks: int = 1) -> str | None:
    """Why ``mt3d.parallel.expert_dispatch`` cannot run as configured (None: it can; whether the ep
    groups split evenly over the hosts is known once the hosts are, ``training.runtime.setup``)."""
    if dispatch not in DISPATCHES:
        return f"mt3d.parallel.expert_dispatch must be one of {', '.join(DISPATCHES)}, got {dispatch!r}"
    if dispatch != "rank" and (ep == 1 or (model is not None and model.moe is None)):
        how = "over hosts" if dispatch == "node" else "once per expert"
        return (f"mt3d.parallel.expert_dispatch {dispatch!r} routes tokens to experts {how}: it needs a "
                "model with experts and parallel.expert > 1; set it to 'rank' (or leave it out)")  # fmt: skip
    if dispatch == "assignment" and chunks > 1:
        return ("mt3d.parallel.expert_dispatch 'assignment' sends each token once per expert in one piece; "
                f"mt3d.train.overlap.dispatch_chunks {chunks} pipelines the once-per-rank dispatch: set "
                "expert_dispatch 'rank' or dispatch_chunks 1")  # fmt: skip
    return None


def chunks_conflict(chunks: int, ep: int, model=None) -> str | None:
    """Why ``mt3d.train.overlap.dispatch_chunks`` cannot run as configured (None: it can)."""
    key = "mt3d.train.overlap.dispatch_chunks"
    if chunks < 1:
        return f"{key} must be >= 1, got {chunks}"
    if chunks > 1 and (ep == 1 or (model is not None and model.moe is None)):
        return (f"{key} {chunks} pipelines the expert-parallel all-to-all: it needs a model with experts and "
                "parallel.expert > 1; set it to 1 (or leave it out)")  # fmt: skip
    return None


def dispatch_hosts_conflict(dispatch: str, placement) -> str | None:
    """Why ``expert_dispatch`` cannot route over the hosts of ``placement`` (a
    ``parallel.topology.Placement``; None: it can): "node" splits each ep group by host evenly."""
    if dispatch == "node" and placement.ep_host_blocks() is None:
        return ("mt3d.parallel.expert_dispatch 'node' needs each ep group to have the same number of ranks "
                "on each of its hosts; change the hosts' slots, parallel.order or parallel.expert, or use "
                "'rank'")  # fmt: skip
    return None


def moe_conflict(zero_stage: int, ep: int = 1) -> str | None:
    """Why a mixture-of-experts model cannot run at this layout (None: it can; ZeRO 0-2 at any ep)."""
    if zero_stage == 3:
        return (
            "mixture-of-experts models are not supported with ZeRO-3 yet (each rank gathers only the "
            "experts its tokens visit): use zero_optimization.stage 0-2"
        )
    return None
