"""Workaround (DeepSpeed 0.19.8): finish loading a ZeRO-3 checkpoint whose optimizer states were
offloaded to NVMe.

With ``offload_optimizer.device: nvme`` DeepSpeed's ``load_checkpoint`` skips the ZeRO checkpoint
files altogether and copies the saved swap files (``offloaded_tensors/rank*``) over the run's own.
What that restores is only the fp32 master weights of the swapped sub-groups:

* the Adam moments of swapped sub-groups stay on disk unread: the optimizer of a freshly built
  engine has no state for them yet, so DeepSpeed's swapper swaps in the weights alone, and the first
  step after the resume starts new moments from zero with a step count of 1;
* sub-groups too small to swap (below its 1 MiB threshold: typically the no-weight-decay group of
  norms and biases) are kept in memory and saved in ``*_optim_states.pt`` as usual, but never loaded:
  their weights, moments and step count stay at their initial values;
* parameters that were gathered before the load keep their initial full values until released.

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


def finish_nvme_resume(engine, load_dir: Path, tag: str) -> bool:
    """After ``engine.load_checkpoint``: restore what DeepSpeed left out (see the module doc).
    Returns whether anything was restored (False: no NVMe optimizer offload, or nothing missing)."""
    if not engine.zero_nvme_offload_optimizer() or os.environ.get(DISABLE) == "0":
        return False
    opt = engine.optimizer
    if deepspeed_restores_nvme_states(opt):
        return False
    from .safe import safe_torch_load

    saved = safe_torch_load(engine._get_zero_ckpt_name(str(load_dir), tag))["optimizer_state_dict"]
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
