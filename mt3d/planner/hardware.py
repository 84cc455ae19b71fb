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
    """Memory (HBM, or host RAM for the CPU profile), GB = 1e9 bytes, as the driver reports it
    (``nvidia-smi``'s memory.total in MiB x 1.048576): an "80 GB" H100 holds 81,559 MiB = 85.52 GB,
    which the predictions (also in 1e9 bytes) are held against, less ``reserved_gb``."""
    intra_gbps: float
    """GB/s per GPU inside a node (NVLink / NVSwitch bus bandwidth)."""
    inter_gbps: float
    """GB/s per GPU across nodes (InfiniBand / RoCE)."""
    reserved_gb: float = 2.0
    """Memory the framework and communication libraries hold whatever the model (CUDA context, NCCL)."""
    host_memory_gb: float = 1000.0
    """CPU memory per node (ZeRO-Offload's tier), GB."""
    nvme_gb: float = 15000.0
    """Local NVMe capacity per node (ZeRO-Infinity's tier), GB."""
    pcie_gbps: float = 25.0
    """GB/s per GPU between GPU and CPU memory, each way (achieved, not the link's nominal rate)."""
    nvme_gbps: float = 25.0
    """GB/s of the node's NVMe drives together (read and write alike)."""
    cpu_cores_per_gpu: int = 16
    """CPU cores per GPU that run the offloaded optimizer step (DeepSpeedCPUAdam)."""
    sms: int = 0
    """Streaming multiprocessors (0: no GEMM calibration; compute at a constant fraction of peak)."""
    gemm_tflops: float = 0.0
    """Maximum achievable 16-bit matmul TFLOP/s (the best over a sweep of large GEMM shapes)."""
    hbm_gbps: float = 0.0
    """HBM bandwidth, GB/s (data sheet)."""
    gemm_tflops_fp8: float = 0.0
    """Maximum achievable FP8 matmul TFLOP/s (e4m3 operands, bf16 out; 0: no FP8 GEMMs)."""


DENSE_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,  # fp16 tensor cores
}
"""Dense (non-sparse) bf16 tensor-core peaks in TFLOP/s, by a substring of the device name: the one
table the planner's presets and the training metrics' MFU read."""


def dense_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (``torch.cuda.get_device_name()``), or None."""
    for key, value in DENSE_PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


# GEMM ceilings (gemm_tflops): maximum achievable matmul FLOPS measured with a shape sweep, bf16,
# as published in Stas Bekman's ML Engineering book (A100 SXM 271.2 = 86.9% of peak, H100 SXM
# 794.5 = 80.3%). `python -m mt3d.bench gemm` measures them on the GPU at hand; no sweep of
# mt3d's own has fed these yet (no GPU was lent when they were set).
# The FP8 ceiling is mt3d's own sweep (`python -m mt3d.bench gemm --fp8`, one H200, 2026-11-27,
# docs/benchmarks/2026-11-27-h200-gpu-record.log): best 1382 TFLOP/s tensorwise (1327 rowwise), 1.74x
# that run's bf16 best (788), against a data-sheet ratio of 2x; the H100 shares the H200's SMs and clocks.
# Node defaults are those of NVIDIA's DGX systems (DGX A100: 1 TB RAM, 4 x 3.84 TB NVMe, PCIe 4,
# 2 x 64 cores; DGX H100/H200: 2 TB RAM, 8 x 3.84 TB NVMe, PCIe 5, 2 x 56 cores); `mt3d plan`
# overrides each with a flag.
# Memory: the driver's memory.total (81,559 MiB on an H100 SXM5 80GB, 81,920 on an A100 SXM4 80GB,
# 143,771 on an H200, read in the H200 record of docs/benchmarks/), not the marketing GB: an
# "80 GB" card holds 85.5e9 bytes, and sizing it as 80e9 refused layouts that ran (Llama 3.1 405B at
# tp 8 pp 9 cp 2 v 7 on H100s by 0.4 GB).
_H100 = Device(
    "H100-SXM5-80GB",
    DENSE_PEAK_TFLOPS["H100"],
    81_559 * 1.048576e-3,
    intra_gbps=360.0,
    inter_gbps=50.0,
    host_memory_gb=2000.0,
    nvme_gb=30000.0,
    pcie_gbps=50.0,
    nvme_gbps=50.0,
    cpu_cores_per_gpu=14,
    sms=132,
    gemm_tflops=794.5,
    hbm_gbps=3350.0,
    gemm_tflops_fp8=1382.0,
)  # fmt: skip
DEVICES: dict[str, Device] = {
    "a100-80gb": Device(
        "A100-SXM4-80GB",
        DENSE_PEAK_TFLOPS["A100"],
        81_920 * 1.048576e-3,
        intra_gbps=240.0,
        inter_gbps=25.0,
        sms=108,
        gemm_tflops=271.2,
        hbm_gbps=2039.0,
    ),
    "h100": _H100,
    # the H100's SMs, clocks and node, with more and faster HBM (the GEMM ceiling is the H100's figure)
    "h200": replace(_H100, name="H200-SXM-141GB", memory_gb=143_771 * 1.048576e-3, hbm_gbps=4800.0),
    "cpu": Device(
        "CPU (gloo)",
        0.1,
        16.0,
        intra_gbps=5.0,
        inter_gbps=1.0,
        reserved_gb=0.5,
        host_memory_gb=16.0,
        nvme_gb=100.0,
        pcie_gbps=5.0,
        nvme_gbps=1.0,
        cpu_cores_per_gpu=1,
    ),  # fmt: skip
}


def get_device(name: str, **overrides) -> Device:
    """A preset by name (a100-80gb, h100, h200, cpu), with fields overridden where given."""
    key = name.lower()
    if key not in DEVICES:
        raise UserError(f"unknown GPU type {name!r}; known: {', '.join(DEVICES)}")
    d = DEVICES[key]
    return replace(d, **{k: v for k, v in overrides.items() if v is not None})
