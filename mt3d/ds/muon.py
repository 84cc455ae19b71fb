"""Where each weight sits in the flat partitions of DeepSpeed's ZeRO 1-2 and bf16 optimizers, for an
optimizer mt3d builds (Muon, ``mt3d.training.muon``) that needs whole matrices.

Both wrappers flatten each parameter group into one buffer (ZeRO in its round-robin order, with
per-parameter alignment padding: ``round_robin_bit16_offsets``; the bf16 optimizer in group order,
unpadded), cut it into equal partitions over the group's data-parallel ranks and hand the client
optimizer one fp32 tensor per group: this rank's partition, whose ``.grad`` is the partition of the
reduced, clipped gradient. ``attach`` records, per such tensor, the weights of its group with their
offsets, the partition size and the group's data-parallel process group (``FlatLayout``); the client
then all-gathers what it needs. Read from the pinned DeepSpeed's attributes, in this one place;
tests/test_muon.py trains every wrapper against one process, so a changed layout fails there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class FlatLayout:
    """One parameter group's flat buffer: its weights with their start offsets, this rank's place."""

    params: tuple[tuple[torch.nn.Parameter, int], ...]
    partition: int
    """Elements of each rank's partition (the buffer is ``partition x world`` long, padded)."""
    rank: int
    world: int
    group: object
    """The data-parallel process group the partitions are spread over."""


def _zero_layouts(zero) -> dict[int, FlatLayout]:
    out = {}
    for i, params in enumerate(zero.round_robin_bit16_groups):
        group = zero.real_dp_process_group[i]
        starts = zero.round_robin_bit16_offsets[i]
        out[id(zero.single_partition_of_fp32_groups[i])] = FlatLayout(
            tuple(zip(params, (int(s) for s in starts), strict=True)), int(zero.partition_size[i]),
            dist.get_rank(group=group), dist.get_world_size(group=group), group,
        )  # fmt: skip
    return out


def _bf16_layouts(bf16) -> dict[int, FlatLayout]:
    out = {}
    for i, params in enumerate(bf16.bf16_groups):
        group = bf16.real_dp_process_group[i]
        starts, at = [], 0
        for p in params:
            starts.append(at)
            at += p.numel()
        partition = bf16.fp32_groups_flat_partition[i]
        out[id(partition)] = FlatLayout(
            tuple(zip(params, starts, strict=True)), partition.numel(), dist.get_rank(group=group),
            dist.get_world_size(group=group), group,
        )  # fmt: skip
    return out


def attach(wrapper) -> None:
    """Give the client optimizer inside ``wrapper`` (the engine's optimizer) the ``FlatLayout`` of each
    flat partition it steps, as ``client.flat`` (nothing when DeepSpeed steps the weights themselves:
    ZeRO-0 in fp32)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        wrapper.optimizer.flat = _zero_layouts(wrapper)
    elif isinstance(wrapper, BF16_Optimizer):
        wrapper.optimizer.flat = _bf16_layouts(wrapper)
