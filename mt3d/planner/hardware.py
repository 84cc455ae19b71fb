"""Cluster descriptions for the planner: accelerator peak, memory and link bandwidths.

Bandwidths are per GPU and per direction, as achieved by a ring collective (bus bandwidth), not
the marketing bidirectional totals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UserError


@dataclass(frozen=True)
class Device:
    """One accelerator type and the links around it."""

    name: str
    peak_tflops: float
    """Dense bf16 peak (no sparsity)."""
    memory_gb: float
    """Usable memory (HBM, or host RAM for the CPU profile), GB = 1e9 bytes."""
    intra_gbps: float
    """GB/s per GPU inside a node (NVLink / NVSwitch bus bandwidth)."""
    inter_gbps: float
    """GB/s per GPU across nodes (InfiniBand / RoCE)."""
    reserved_gb: float = 2.0
    """Memory the framework and communication libraries hold whatever the model (CUDA context, NCCL)."""


DEVICES = {
    "a100-80gb": Device("A100-SXM4-80GB", 312.0, 80.0, intra_gbps=240.0, inter_gbps=25.0),
    "h100": Device("H100-SXM5-80GB", 989.0, 80.0, intra_gbps=360.0, inter_gbps=50.0),
    "h200": Device("H200-SXM-141GB", 989.0, 141.0, intra_gbps=360.0, inter_gbps=50.0),
    "cpu": Device("CPU (gloo)", 0.1, 16.0, intra_gbps=5.0, inter_gbps=1.0, reserved_gb=0.5),
}


def get_device(name: str, **overrides) -> Device:
    """A preset by name (a100-80gb, h100, h200, cpu), with fields overridden where given."""
    key = name.lower()
    if key not in DEVICES:
        raise UserError(f"unknown GPU type {name!r}; known: {', '.join(DEVICES)}")
    d = DEVICES[key]
    return replace(d, **{k: v for k, v in overrides.items() if v is not None})
