"""ZeRO-3 checkpoints whose optimizer states were offloaded to NVMe: an index written at save time
so that mt3d's reader (export-hf, eval, generate) finds the fp32 weights in DeepSpeed's swap files,
and a workaround (of the pinned DeepSpeed) that finishes loading them on resume.

DeepSpeed saves such states as a copy of each rank's swap files (``offloaded_tensors/rank<NN>/``,
named after internal parameter ids) and leaves empty tensors in ``*_optim_states.pt``.
``write_swap_index`` records, per ``*_optim_states.pt`` file, which swap file holds each sub-group's
fp32 weights and how many elements are its own; ``swapped_flats`` reads them back, and
``mt3d.checkpoint.reshard.convert_for_resume`` writes an ordinary copy for a run without NVMe
optimizer offload, from ``converted_optimizer_states``.

With ``offload_optimizer.device: nvme`` DeepSpeed's ``load_checkpoint`` skips the ZeRO checkpoint
files altogether and copies the saved swap files (``offloaded_tensors/rank*``) over the run's own.
What that restores is only the fp32 master weights of the swapped sub-groups:

* the Adam moments of swapped sub-groups stay on disk unread: the optimizer of a freshly built
  engine has no state for them yet, so DeepSpeed's swapper swaps in the weights alone, and the first
  step after the resume starts new moments from zero with a step count of 1;
* sub-groups too small to swap (below its 1 MiB threshold: typically the no-weight-decay group of
  norms and biases) are kept in memory and saved in ``*_optim_states.pt`` as usual, but never loaded:
  their weights, moments and step count stay at their initial values;
* parameters that were gathered before the load keep their initial full values until released;
* the optimizer's parameter groups keep the hyper-parameters the fresh scheduler gave them, not the
  saved ones (the learning rate of the next step): with any LR scheduler the resumed run drifts
  from its second step (tp 2 x dp 2: step 6's loss 6.0731 instead of 5.9837).

Measured (tests/test_offload.py): the resumed losses differ from an unstopped run's from the first
resumed step (tp 1 x dp 2: 6.0931 vs 6.0964, then 6.395 vs 6.172; tp 2 x dp 2: 6.0948 vs 6.0964).
``finish_nvme_resume`` loads the in-memory sub-groups from the rank's ``*_optim_states.pt``, has
the swapper read the saved moments of the swapped ones (with the step count saved beside them) and
releases stale gathered parameters. tests/test_offload.py checks that the resume is then bit-exact,
and that without this (``MT3D_NVME_RESUME_WORKAROUND=0``) it still is not: when that fails,
DeepSpeed restores these itself and this file can go.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DISABLE = "MT3D_NVME_RESUME_WORKAROUND"
"""Set to 0 to resume as DeepSpeed alone does (the upstream-watch test does, to see it still differs)."""


INDEX = "nvme_index"
"""Directory of the per-rank index files in a checkpoint."""


def write_swap_index(engine, ckpt_dir: Path) -> None:
    """Record, for this rank's ``*_optim_states.pt``, where each sub-group's fp32 weights are: in the
    file (``swap`` None) or in a swap file copied under ``offloaded_tensors/`` (checkpoint-relative)."""
    if not engine.zero_nvme_offload_optimizer():
        return
    import json

    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    opt = engine.optimizer
    optim_file = Path(engine._get_zero_ckpt_name(str(ckpt_dir.parent), ckpt_dir.name)).name
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    swap_dir = f"offloaded_tensors/rank{dp_index_to_str(rank)}"
    groups = []
    index = _state_index(opt)
    for sub, flat in enumerate(opt.fp32_partitioned_groups_flat):
        swapped = opt._swappable_optimizer_subgroup(sub)
        groups.append({
            "numel": int(opt.fp16_partitioned_groups_flat_numel[sub]),
            "swap": f"{swap_dir}/{flat.ds_id}.tensor.swp" if swapped else None,
            "state_index": index[sub],
        })  # fmt: skip
    (ckpt_dir / INDEX).mkdir(exist_ok=True)
    (ckpt_dir / INDEX / f"{optim_file}.json").write_text(json.dumps({"sub_groups": groups}))


def _read_swap(path: Path, numel: int) -> torch.Tensor:
    """The first ``numel`` fp32 elements of a swap file (the rest is alignment padding)."""
    return torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32).clone()


def read_index(ckpt_dir: Path, name: str, files: dict) -> list[dict]:
    """The sub-groups an NVMe swap index (``name``, checkpoint-relative) lists, checked against the
    checkpoint's manifest ``files``: every swap file it names (and its moments' files) is listed
    there, so inside the checkpoint (``inputs.entry_inside``), and holds the elements it claims."""
    import json

    from ..errors import CheckpointError

    where = ckpt_dir / name
    try:
        groups = json.loads(where.read_text())["sub_groups"]
        if not isinstance(groups, list):
            raise TypeError("sub_groups is not a list")
        for g in groups:
            if not (isinstance(g["numel"], int) and g["numel"] > 0 and isinstance(g["state_index"], int)):
                raise TypeError(f"bad sub-group entry {g!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{where} is not an mt3d NVMe swap index ({e}); use another checkpoint"
        ) from None
    for g in groups:
        if g.get("swap") is None:
            continue
        swap = g["swap"]
        for entry in (swap, *(str(Path(swap).with_name(f"{k}-{Path(swap).name}")) for k in MOMENTS)):
            if entry not in files:
                raise CheckpointError(f"{where} lists {entry!r}, which the checkpoint's manifest does not")
            size = (ckpt_dir / entry).stat().st_size
            if size < 4 * g["numel"]:
                raise CheckpointError(
                    f"{where} says {entry} holds {g['numel']} fp32 elements but it has {size} bytes "
                    "(tampered)"
                )
    return groups


MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's states, which DeepSpeed swaps beside each fp32 weight file as ``<state>-<file>``."""


def swapped_flats(ckpt_dir: Path, optim_file: str, flats: list, files: dict) -> list:
    """``flats`` (the fp32 groups of ``optim_file``) with each swapped sub-group read from its swap file;
    ``files``: the checkpoint manifest's file table (every file read must be listed there)."""
    from ..errors import CheckpointError

    name = f"{INDEX}/{optim_file}.json"
    if name not in files:
        if any(f.numel() == 0 for f in flats) and any(n.startswith("offloaded_tensors/") for n in files):
            raise CheckpointError(
                f"{ckpt_dir}: its ZeRO-3 weights are in NVMe swap files without mt3d's index ({name}): "
                "written by another tool; resume it with the same NVMe offload and save again"
            )
        return flats
    groups = read_index(ckpt_dir, name, files)
    if len(groups) != len(flats):
        raise CheckpointError(
            f"{ckpt_dir / name} lists {len(groups)} sub-groups, {optim_file} has {len(flats)}"
        )
    return [flat if g.get("swap") is None else _read_swap(ckpt_dir / g["swap"], g["numel"])
            for flat, g in zip(flats, groups)]  # fmt: skip


def converted_optimizer_states(src: Path, name: str, files: dict, step_default: int) -> dict:
    """``src/name`` (a ``*_optim_states.pt``) with the fp32 weights, moments and step of every swapped
    sub-group read in from its swap files."""
    from ..errors import CheckpointError
    from .safe import safe_torch_load

    index = f"{INDEX}/{name}.json"
    if index not in files:
        raise CheckpointError(f"{src}: no {index}: cannot convert its NVMe optimizer states")
    groups = read_index(src, index, files)
    sd = safe_torch_load(src / name)
    zero = sd["optimizer_state_dict"]
    state = zero["optimizer_state_dict"]["state"]
    steps = [st["step"] for st in state.values() if "step" in st]
    step = steps[0] if steps else step_default
    for sub, g in enumerate(groups):
        if g.get("swap") is None:
            continue
        swap = src / g["swap"]
        zero["fp32_flat_groups"][sub] = _read_swap(swap, g["numel"])
        state[g["state_index"]] = {
            "step": step,
            **{k: _read_swap(swap.with_name(f"{k}-{swap.name}"), g["numel"]) for k in MOMENTS},
        }
    return sd


def deepspeed_restores_nvme_states(opt) -> bool:
    """Whether DeepSpeed already gave every sub-group of ``opt`` its optimizer state (upstream fix)."""
    return all(opt.optimizer.state.get(flat) for flat in opt.fp32_partitioned_groups_flat)


def _state_index(opt) -> dict[int, int]:
    """Sub-group -> its index in the optimizer's ``state_dict`` (groups in order, then sub-groups)."""
    index, out = 0, {}
    for group in range(len(opt.optimizer.param_groups)):
        for sub, g in sorted(opt.sub_group_to_group_id.items()):
            if g == group:
                out[sub] = index
                index += 1
    return out


def restore_param_groups(optimizer, saved_groups: list[dict]) -> None:
    """Put the saved hyper-parameters of every parameter group (the learning rate the scheduler set
    for the next step, betas, weight decay, ...) back into ``optimizer``. DeepSpeed skips the
    optimizer's ``load_state_dict`` altogether with NVMe offload, so its groups keep the values the
    freshly built scheduler gave them: the first resumed step's loss still matches (it is computed
    before that step's update), every later one drifts."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def finish_nvme_resume(engine, load_dir: Path, tag: str) -> bool:
    """After ``engine.load_checkpoint``: restore what DeepSpeed left out (see the module doc).
    Returns whether anything was restored (False: no NVMe optimizer offload, or nothing missing)."""
    if not engine.zero_nvme_offload_optimizer() or os.environ.get(DISABLE) == "0":
        return False
    opt = engine.optimizer
    from .safe import safe_torch_load

    saved = safe_torch_load(engine._get_zero_ckpt_name(str(load_dir), tag))["optimizer_state_dict"]
    restore_param_groups(opt.optimizer, saved["optimizer_state_dict"]["param_groups"])
    if deepspeed_restores_nvme_states(opt):
        return True
    states = saved["optimizer_state_dict"]["state"]
    flats = saved["fp32_flat_groups"]
    steps = [s["step"] for s in states.values() if "step" in s]
    step = int(steps[0]) if steps else int(engine.global_steps - engine.skipped_steps)
    index = _state_index(opt)
    timers: set = set()
    for sub, flat in enumerate(opt.fp32_partitioned_groups_flat):
        if opt._swappable_optimizer_subgroup(sub):
            # Give the optimizer empty moments of the right size: the swapper then reads the saved
            # ones from their swap files at the next swap-in, and writes them back at swap-out.
            numel = opt.fp16_partitioned_groups_flat_numel[sub]
            opt.optimizer.state[flat] = {
                "step": step,
                "exp_avg": torch.zeros(numel, dtype=flat.dtype),
                "exp_avg_sq": torch.zeros(numel, dtype=flat.dtype),
            }
            opt._prepare_sub_group(sub, timers)
            opt._release_sub_group(sub, timers)
            continue
        flat.data.copy_(flats[sub].to(flat.dtype))
        state = states.get(index[sub], {})
        opt.optimizer.state[flat] = {
            k: (v.to(flat.device, flat.dtype).clone() if torch.is_tensor(v) else v) for k, v in state.items()
        }
        opt._reassign_or_swap_out_partitioned_parameters(sub)  # 16-bit partition from the fp32 master
    # Parameters still gathered from before the load hold their initial values: release them, so the
    # next use gathers the restored partitions; parameters every rank keeps whole are gathered now.
    opt._partition_all_parameters()
    if opt.persistent_parameters:
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
    return True
