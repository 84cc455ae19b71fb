"""DeepSpeed's universal checkpoints, which mt3d reshards through: its converter run in-process,
and the reshards it gets wrong, refused up front.

``ds_to_universal``'s ``main`` is called with an argparse namespace (its command-line entry point),
in the calling process: no process group needed. tests/test_checkpoint.py runs the refused reshards
past ``unsupported_reshard`` and fails when DeepSpeed starts getting them right.
"""

from __future__ import annotations

import argparse
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..config.layout import DENSE_PARTITION
from ..errors import CheckpointError
from ..model.moe import expert_index
from ..versions import running_version


def convert(source: Path, out: Path, workers: int = 1, layout: dict | None = None) -> None:
    """Run DeepSpeed's ds_to_universal in-process (no process group needed); ``layout``: the
    source's saved layout (an expert-parallel one is converted through a view of its files:
    ``_convert_joined``, ``_convert_folded`` for a folded expert layout or, for checkpoints from
    before dense states spanned the ep ranks, ``_convert_per_ep_rank``)."""
    from ..parallel.axes import expert_layout

    layout = layout or {}
    ep = int(layout.get("ep", 1))
    if ep > 1 and expert_layout(layout).folded:
        _convert_folded(source, out, layout, workers)
    elif ep > 1 and layout.get("dense_partition") == DENSE_PARTITION:
        _convert_joined(source, out, int(layout["tp"]), ep, workers)
    elif ep > 1:
        _convert_per_ep_rank(source, out, int(layout["tp"]), ep, workers)
    else:
        tmp = out.with_name(out.name + ".tmp")
        _run_converter(source, tmp, workers)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    pad_param_groups(out)


GROUP_SLOTS = 8
"""mt3d's optimizer groups, by position: dense with weight decay, dense without, then (under expert
parallelism with ZeRO) experts with, experts without (``training.engine.param_groups``,
``mt3d.ds.experts.expert_groups``), each split in Muon's and AdamW's halves under Muon
(``training.muon.build``); or there, with weight decay 0, dense and experts (at most eight
either way: ``mt3d.config.layout.PARAM_GROUPS``)."""


def pad_param_groups(out: Path) -> None:
    """Give the universal checkpoint ``out`` a settings entry for every group slot. DeepSpeed's loader
    pairs the run's parameter groups with the checkpoint's by position and loads only the pairs
    (``zip``): a run with expert groups resuming a checkpoint without them (another ep, or a pipeline
    stage 0 holding no expert) would leave its experts' states unloaded. A missing expert slot takes
    the settings of the dense slot with the same decay."""
    import torch

    from .safe import safe_torch_load

    path = out / "zero" / "optimizer_state.pt"
    state = safe_torch_load(path)
    groups = state.get("param_groups") or []
    if not groups or len(groups) >= GROUP_SLOTS:
        return
    while len(groups) < GROUP_SLOTS:
        groups.append({k: v for k, v in groups[len(groups) - 2].items() if k not in ("moe", "name")})
    torch.save(state, path)


GROUP_IDENTITY = ("weight_decay", "moe", "name", "use_muon", "momentum", "ns_method", "lr_scale")
"""What a parameter group is under mt3d's grouping (decay class, expert group, Muon's half or AdamW's),
kept through a universal load (``own_group_settings``)."""


@contextmanager
def own_group_settings(engine):
    """While open, a universal load of ``engine`` leaves its optimizer groups' ``GROUP_IDENTITY`` as
    they are. DeepSpeed's universal loader reads each parameter's states by name but copies every
    saved group's settings onto the run's group at the same position; where the groups differ (a
    checkpoint grouped by weight decay resumed with one group each, ``mt3d.config.layout.PARAM_GROUPS``,
    or one without expert groups) a group would take another's weight decay or expert marks."""
    opt = engine.optimizer
    kept = [{k: g[k] for k in GROUP_IDENTITY if k in g} for g in getattr(opt, "optimizer", opt).param_groups]
    try:
        yield
    finally:  # the groups as they are now: a loader may have replaced them
        for g, own in zip(getattr(opt, "optimizer", opt).param_groups, kept, strict=True):
            for k in GROUP_IDENTITY:
                g.pop(k, None)
            g.update(own)


def _run_converter(source: Path, tmp: Path, workers: int) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(tmp),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    try:
        ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"converting {source} to DeepSpeed's universal format failed: {e}") from e
    (tmp.parent / "latest_universal").unlink(missing_ok=True)  # pointer the converter writes; not used


def _convert_per_ep_rank(source: Path, out: Path, tp: int, ep: int, workers: int) -> None:
    """Universal form of an expert-parallel checkpoint.

    ep ranks count in DeepSpeed's 'model' axis (``mt3d.ds.experts``), so the checkpoint has tp x ep
    model ranks, which ds_to_universal would take for TP slices and merge (it fails on experts only
    some ranks hold). Instead each ep rank's files are presented to it as a tp-only checkpoint (a
    directory of links, model rank e * tp + t renamed t, pipeline-major file index p * tp * ep + e *
    tp + t renamed p * tp + t), converted, and the results are joined: dense parameters (equal on
    every ep rank) from ep rank 0, each expert (named by its global index) from the rank that held
    it. The links are checked: every expert a view's files name belongs to that view's ep rank."""
    work = out.with_name(out.name + ".ep")
    shutil.rmtree(work, ignore_errors=True)
    parts = []
    for e in range(ep):
        view = work / f"view{e}"
        view.mkdir(parents=True)
        for f in source.iterdir():
            name = _renamed_for_ep_rank(f.name, e, tp, ep)
            if name is None:
                continue
            if name.startswith("mp_rank_"):  # the parallel sizes it records: tp-only
                _write_tp_only_model_states(f, view / name, tp)
            else:
                (view / name).symlink_to(f.resolve())
        parts.append(work / f"universal{e}")
        _run_converter(view, parts[-1], workers)
    for e, part in enumerate(parts):
        experts = [(j, d) for d in (part / "zero").iterdir() if (j := expert_index(d.name)) is not None]
        held = {j for j, _ in experts}  # contiguous, the same in every sparse layer of the rank
        wrong = next((j for j in sorted(held) if j // len(held) != e), None)
        if wrong is not None:
            shutil.rmtree(work, ignore_errors=True)
            raise CheckpointError(
                f"{source}: expert {wrong} found in ep rank {e}'s files; the checkpoint's rank order is not "
                "the one mt3d writes, so it cannot be resharded (resume it in its own layout)"
            )
        if e > 0:
            for _, d in experts:
                d.rename(parts[0] / "zero" / d.name)
    shutil.rmtree(out, ignore_errors=True)
    parts[0].rename(out)
    shutil.rmtree(work, ignore_errors=True)


def _convert_joined(source: Path, out: Path, tp: int, ep: int, workers: int) -> None:
    """Universal form of an expert-parallel checkpoint whose dense optimizer states are partitioned
    over all dp x cp ranks (``mt3d.ds.experts``). Its files are presented to the converter as one
    tp-only checkpoint (a directory of links): each optimizer file, named by its dp x cp rank and its
    model rank p * tp * ep + e * tp + t, is renamed to model rank p * tp + t, so the converter sees
    dp x cp partitions per (pp, tp) rank, holding every dense fragment once and each expert's in the
    files of the ranks that held it (in the same order: both groups rank by global rank); the
    (weightless) model-states file of each (pp, tp) rank lists the parameter shapes of every ep
    rank's experts; the layer files are ep rank 0's (the converter reads only their names)."""
    work = out.with_name(out.name + ".ep")
    shutil.rmtree(work, ignore_errors=True)
    view = work / "view"
    view.mkdir(parents=True)
    models: dict[str, list[tuple[int, Path]]] = {}  # view name -> (ep rank, model-states file)
    for f in sorted(source.iterdir()):
        m = re.fullmatch(
            r"((?:bf16_|fp16_)?zero_pp_rank_\d+_)?mp_rank_(\d+)_(model|optim)_states\.pt", f.name
        )
        if m:
            p, model = divmod(int(m.group(2)), tp * ep)
            name = f"{m.group(1) or ''}mp_rank_{p * tp + model % tp:02d}_{m.group(3)}_states.pt"
            if m.group(1):
                (view / name).symlink_to(f.resolve())
            else:
                models.setdefault(name, []).append((model // tp, f))
        elif (name := _renamed_for_ep_rank(f.name, 0, tp, ep)) is not None:
            (view / name).symlink_to(f.resolve())
    for name, files in models.items():
        first, *others = [f for _, f in sorted(files)]  # ep rank 0's file is the one rewritten
        _write_tp_only_model_states(first, view / name, tp, also=others)
    try:
        _run_converter(view, out.with_name(out.name + ".tmp"), workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    out.with_name(out.name + ".tmp").rename(out)


def _convert_folded(source: Path, out: Path, layout: dict, workers: int) -> None:
    """Universal form of a checkpoint with a folded expert layout (``parallel.expert_layout``: files
    of a rank at DeepSpeed's 'model' coordinate m, the position mod lcm(tp, etp ep), hold dense TP
    shard m mod tp and the experts of expert rank e, expert-TP rank r = ``expert_coordinates(m)``; each
    optimizer file records its stage and m, ``experts.COORDINATE``, which its number does not say
    under every rank order).

    Dense weights: the converter reads a tp-only view (a directory like ``_convert_joined``'s), each
    optimizer file renamed to its dense ZeRO rank and model rank p tp + m mod tp, rewritten without its
    expert groups' fragments; the model-states and layer files of the coordinates m < tp (dense shard
    m), rewritten without experts. Experts: every file's expert fragments are laid out as the
    converter lays out its own (``<name>/<r>/<state>.<edp ZeRO rank>``; the ZeRO ranks each file
    recorded, ``experts.PARTITION_RANKS``) and merged over etp by the converter's own merge step, with
    the checkpoint's universal info (split and fused-part metadata the universal loader slices by)."""
    import torch
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    from ..parallel.axes import expert_layout
    from .safe import safe_torch_load

    lay = expert_layout(layout)
    tp = lay.tp
    work = out.with_name(out.name + ".fold")
    shutil.rmtree(work, ignore_errors=True)
    view, frags = work / "view", work / "experts"
    view.mkdir(parents=True)
    shapes: dict[str, dict[int, object]] = {}  # expert parameter -> etp rank -> its shape there
    info: dict = {}
    tmp = out.with_name(out.name + ".tmp")
    try:
        coordinate: dict[int, tuple[int, int]] = {}  # file number -> (stage, 'model' coordinate)
        for f in sorted(source.iterdir(), key=lambda f: "_optim_" not in f.name):  # optimizer files first
            m = re.fullmatch(r"((?:bf16_|fp16_)?)zero_pp_rank_\d+_mp_rank_(\d+)_optim_states\.pt", f.name)
            if m:
                state = safe_torch_load(f)
                ranks, p, model = _recorded(state, f)
                coordinate[int(m.group(2))] = (p, model)
                _split_expert_fragments(state, f, frags, lay.expert_coordinates(model)[1], ranks)
                name = (
                    f"{m.group(1)}zero_pp_rank_{ranks[0]}_mp_rank_{p * tp + model % tp:02d}_optim_states.pt"
                )
                torch.save(state, view / name)
            elif (layer := re.fullmatch(r"layer_\d+-model_(\d+)-model_states\.pt", f.name)) and int(
                layer.group(1)
            ) < tp:  # the converter reads their names only
                (view / f.name).symlink_to(f.resolve())
            elif (m := re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", f.name)) and int(
                m.group(1)
            ) in coordinate:
                p, model = coordinate[int(m.group(1))]
                state = safe_torch_load(f)
                for group in state.get("param_shapes") or []:
                    for n, shape in group.items():
                        if expert_index(n) is not None:
                            shapes.setdefault(n, {})[lay.expert_coordinates(model)[1]] = shape
                info = info or dict(state.get("universal_checkpoint_info") or {})
                if model < tp:
                    _write_dense_model_states(
                        state, view / f"mp_rank_{p * tp + model:02d}_model_states.pt", tp
                    )
        _run_converter(view, tmp, workers)
        for name, per in shapes.items():
            missing = sorted(set(range(lay.etp)) - set(per))
            if missing:
                raise CheckpointError(f"{source}: {name} is missing from the files of expert-TP ranks "
                                      f"{missing}; the checkpoint is incomplete")  # fmt: skip
            slice_shapes = [per[i] for i in range(lay.etp)]
            merge_tp_slices(info, str(tmp / "zero"), str(frags), lay.etp, (name, slice_shapes))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _recorded(state: dict, path: Path) -> tuple[list[int], int, int]:
    """What an optimizer file of a folded layout records beside DeepSpeed's state: its rank's ZeRO rank
    in each group's ZeRO group (``experts.PARTITION_RANKS``), its pipeline stage and DeepSpeed 'model'
    coordinate (``experts.COORDINATE``), which neither its name nor its number says under every rank
    order."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    from .experts import COORDINATE, PARTITION_RANKS

    osd = state[OPTIMIZER_STATE_DICT]
    ranks, where = osd.get(PARTITION_RANKS), osd.get(COORDINATE)
    if ranks is None or not where:
        raise CheckpointError(
            f"{path} does not record its rank's ZeRO ranks and coordinates (saved before mt3d could reshard "
            "folded expert layouts): resume it at the saved layout, or export it with `mt3d export-hf` and "
            "fine-tune from that directory with model.from_hf"
        )
    return list(ranks), int(where["pipe"]), int(where["model"])


def _split_expert_fragments(state: dict, path: Path, frags: Path, etp_rank: int, ranks: list[int]) -> None:
    """Move the expert groups' fragments of one optimizer file (``state``, loaded from ``path``; its ZeRO
    rank in each group's ZeRO group ``ranks``) out to ``frags`` in the converter's layout
    (``<name>/<etp_rank>/<state>.<edp ZeRO rank>``), leaving the groups without fragments."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.checkpoint.ds_to_universal import dump_param_fragment

    osd = state[OPTIMIZER_STATE_DICT]
    mappings = osd[PARAM_SLICE_MAPPINGS]
    for g, mapping in enumerate(mappings):
        experts = [n for n in mapping if expert_index(n) is not None]
        if not experts:
            continue
        if len(experts) != len(mapping):
            raise CheckpointError(f"{path}: optimizer group {g} mixes experts and dense weights")
        flat = {
            "exp_avg": osd[BASE_OPTIMIZER_STATE]["state"][g]["exp_avg"],
            "exp_avg_sq": osd[BASE_OPTIMIZER_STATE]["state"][g]["exp_avg_sq"],
            "fp32": osd[SINGLE_PARTITION_OF_FP32_GROUPS][g],
        }
        if "step" in osd[BASE_OPTIMIZER_STATE]["state"][g]:
            flat["step"] = osd[BASE_OPTIMIZER_STATE]["state"][g]["step"]
        for n in experts:
            frag = mapping[n]
            for key, tensor in flat.items():
                dump_param_fragment(str(frags), etp_rank, ranks[g], key, tensor, n, frag.start, frag.numel)
        mappings[g] = type(mapping)()


def _write_dense_model_states(state: dict, dest: Path, tp: int) -> None:
    """``state`` (a model-states file of a folded layout) as a tp-only one without experts: parallel
    sizes tp x pp, no expert in its parameter shapes, universal info or module weights."""
    import torch

    state = _tp_only(state, tp, dest.name)
    shapes = [
        {n: s for n, s in g.items() if expert_index(n) is None} for g in state.get("param_shapes") or []
    ]
    state["param_shapes"] = [g for g in shapes if g]
    state["universal_checkpoint_info"] = _only_held(state.get("universal_checkpoint_info") or {}, set())
    if state.get("module"):
        state["module"] = {n: t for n, t in state["module"].items() if expert_index(n) is None}
    torch.save(state, dest)


def _tp_only(state: dict, tp: int, where) -> dict:
    """A copy of model-states ``state`` (read from ``where``) recording model-parallel sizes tp x pp:
    ds_to_universal reads the TP degree from them."""
    dims = dict(state.get("checkpoint_parallel_dimensions") or {})
    if "tp_degree" not in dims or "pp_degree" not in dims:
        raise CheckpointError(f"{where} records no parallel dimensions; it cannot be resharded")
    dims["tp_degree"] = tp
    return dict(state, checkpoint_parallel_dimensions=dims, mp_world_size=tp * dims["pp_degree"])


def _write_tp_only_model_states(source: Path, dest: Path, tp: int, also: list[Path] | None = None) -> None:
    """A copy of a pipeline checkpoint's (weightless) model-states file whose recorded model-parallel
    sizes are tp instead of tp x ep: ds_to_universal reads the TP degree from them. Without ``also``
    it describes only the experts it names (the universal info filtered to them); ``also``: the same
    file of the other ep ranks, whose experts' shapes are added."""
    import torch

    from .safe import safe_torch_load

    state = _tp_only(safe_torch_load(source), tp, source)
    if also is not None:
        shapes = state.get("param_shapes") or []
        for other in also:
            shapes = shapes + [{n: s for n, s in group.items() if expert_index(n) is not None}
                               for group in safe_torch_load(other).get("param_shapes") or []]  # fmt: skip
        state["param_shapes"] = [group for group in shapes if group]
    else:
        held = {j for shapes in state.get("param_shapes") or [] for n in shapes
                if (j := expert_index(n)) is not None}  # fmt: skip
        # the converter (strict) wants every name pattern used: those of other ranks' experts go
        state["universal_checkpoint_info"] = _only_held(state.get("universal_checkpoint_info") or {}, held)
    torch.save(state, dest)


def _only_held(obj, held: set[int]):
    """``obj`` (universal info: lists of patterns, {"patterns": [...]} entries, dicts keyed by pattern)
    without what names experts outside ``held``."""
    if isinstance(obj, list):
        kept = [_only_held(x, held) for x in obj if not _names_other_expert(x, held)]
        return [x for x in kept if not (isinstance(x, dict) and x.get("patterns") == [])]
    if isinstance(obj, dict):
        return {k: _only_held(v, held) for k, v in obj.items() if not _names_other_expert(k, held)}
    return obj


PATTERN_EXPERT = re.compile(r"experts\\\.(\d+)\\\.")
"""An expert index in a universal-info name pattern (``...experts\\.3\\.down...``)."""


def _names_other_expert(pattern, held: set[int]) -> bool:
    """Whether a universal-info name pattern is about an expert this rank does not hold."""
    m = PATTERN_EXPERT.search(pattern) if isinstance(pattern, str) else None
    return m is not None and int(m.group(1)) not in held


def _renamed_for_ep_rank(name: str, e: int, tp: int, ep: int) -> str | None:
    """The name ep rank ``e``'s copy of file ``name`` takes in its tp-only view (None: not its file)."""
    m = re.fullmatch(r"layer_(\d+)-model_(\d+)-model_states\.pt", name)
    if m:
        model = int(m.group(2))
        return f"layer_{m.group(1)}-model_{model % tp:02d}-model_states.pt" if model // tp == e else None
    m = re.fullmatch(r"((?:bf16_|fp16_)?zero_pp_rank_\d+_)?mp_rank_(\d+)_(model|optim)_states\.pt", name)
    if m:
        index = int(m.group(2))
        p, model = divmod(index, tp * ep)
        if model // tp != e:
            return None
        return f"{m.group(1) or ''}mp_rank_{p * tp + model % tp:02d}_{m.group(3)}_states.pt"
    return None


def unsupported_reshard(saved: dict, target: dict) -> str | None:
    """Why mt3d refuses to move a checkpoint from layout ``saved`` to ``target`` (None: it does not).

    Layouts are dicts with tp, pp, dp and zero_stage. Measured with the pinned DeepSpeed, every reshard
    that involves ZeRO-3 goes wrong: a ZeRO-3 checkpoint has no module or layer files, so ZeRO 0-2
    cannot load its universal form (``assert len(self.ckpt_list) > 0``); ZeRO-3's universal loader
    looks for ZeRO-3 model files, so no ZeRO 0-2 checkpoint loads into it; it slices tensor
    parallelism only for AutoTP modules (a size mismatch at another tp); and at another dp it loads
    but training drifts from the second step on (grad norm 1.4066 instead of 1.3984 on the tiny
    model; one cause is that it copies param group 0's settings, weight decay included, into every
    group). A checkpoint saved without ZeRO has no ``*_optim_states.pt`` files, which the converter
    needs (``FileNotFoundError``): it resumes at its own layout only. Among ZeRO 1-2 sources every
    layout works and is tested. Refusing up front gives the way out instead of an assertion or a
    silently different run; tests/test_checkpoint.py runs the refused moves past this guard and fails
    when DeepSpeed starts getting them right.
    """
    way = (
        "or export it with `mt3d export-hf` and fine-tune from that directory with model.from_hf "
        "(weights kept, optimizer state restarted)"
    )
    if saved["zero_stage"] == 0:
        return (
            f"it was saved without ZeRO (stage 0), whose optimizer states DeepSpeed {running_version()}'s "
            f"universal converter cannot read: resume it in the layout it was saved in "
            f"(tensor={saved['tp']}, pipeline={saved['pp']}, dp={saved['dp']}), {way}"
        )
    if saved["zero_stage"] != 3 and target["zero_stage"] != 3:
        return None
    if saved["zero_stage"] == 3:
        return (
            f"DeepSpeed {running_version()} cannot reshard ZeRO-3 states correctly: resume it in the layout "
            f"it was saved in (zero_optimization.stage=3, tensor={saved['tp']} and dp={saved['dp']}, "
            f"pipeline=1), {way}"
        )
    return (
        f"it was saved with ZeRO-{saved['zero_stage']} and DeepSpeed {running_version()} cannot load it into "
        "ZeRO-3: "
        f"resume with zero_optimization.stage 1 or 2 (any tp/pp/dp), {way}"
    )
