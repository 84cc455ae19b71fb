"""Where ZeRO keeps the model states of one rank: bytes on the GPU, in CPU memory and on NVMe, and
the bytes that move between them per step (ZeRO-Offload, ZeRO-Infinity), as the pinned DeepSpeed
lays them out.

``params`` is the rank's model slice Psi' = Psi / (tp * pp); ZeRO partitions it over dp ranks,
n = Psi' / d. With mixed-precision Adam a parameter has a 16-bit weight (p = 2 bytes) and gradient
(g = 2), an fp32 master (m = 4) and two fp32 moments (o = 8): the ZeRO paper's 16 bytes.

* No offload: ``costs.model_state_bytes`` on the GPU. ZeRO-3 also keeps gathered parameters alive
  between uses: up to ``stage3_max_live_parameters`` (1e9 elements) of them, and everything when
  the rank's slice is smaller (``stage3_max_reuse_distance`` is 1e9 elements too).
* Optimizer on CPU (``opt-cpu``, ZeRO 1-3): the fp32 master, the moments and an fp32 gradient
  partition live in CPU memory, m + o + 4 bytes per element of n; ZeRO 1/2 add a 16-bit staging
  copy (p), ZeRO-3 a 16-bit gradient buffer (g): 18 n bytes in both cases.
* Optimizer on NVMe (``opt-nvme``, ZeRO-3): master, moments and fp32 gradients are files,
  16 n bytes; CPU memory keeps the 16-bit gradient buffer and the pinned swap buffers
  (buffer_count 4 x sub_group_size x 4 bytes; mt3d writes sub_group_size 1e8 for NVMe).
* Parameters too (``cpu``/``nvme``, ZeRO-3): the 16-bit partition moves to that tier as well; the
  GPU keeps only gathered parameters and buffers. NVMe parameter swapping has pinned buffers of
  buffer_count 5 x buffer_size 1e8 elements, and DeepSpeed keeps up to ``max_in_cpu`` (1e9)
  elements of parameters in pinned CPU memory anyway (counted here).
"""

from __future__ import annotations

OFFLOAD_OPTIONS = ("none", "opt-cpu", "opt-nvme", "cpu", "nvme")
# the pinned DeepSpeed's defaults (runtime/zero/config.py, offload_config.py)
MAX_LIVE_PARAMETERS = 1e9
SUB_GROUP_SIZE = 1e9
OPTIMIZER_SWAP_BUFFERS = 4
PARAM_SWAP_ELEMENTS = 5 * 1e8
MAX_IN_CPU = 1e9


def offload_rule(zero_stage: int, offload: str) -> str | None:
    """Why ``offload`` (an ``Offload.label``) cannot run at ``zero_stage``: ``config.offload_conflict``'s
    short phrasing (an NVMe path is assumed)."""
    from ..config import Offload, offload_conflict

    return offload_conflict(zero_stage, Offload.from_label(offload, "/nvme"), short=True)


def tier_bytes(params: float, dp: int, zero_stage: int, prec, offload: str = "none",
               sub_group_size: float | None = None,
               live: float | None = None) -> dict[str, float]:  # fmt: skip
    """Bytes of model states of one rank on ``gpu``, ``cpu`` and ``nvme`` (see the module doc).
    ``sub_group_size``: DeepSpeed's (default: what mt3d writes for NVMe offload); ``live``: the bytes
    of parameters ZeRO-3 holds gathered (default: DeepSpeed's max_live_parameters of them)."""
    from ..config import NVME_SUB_GROUP_SIZE
    from .layout import model_state_bytes

    if sub_group_size is None:
        sub_group_size = NVME_SUB_GROUP_SIZE if "nvme" in offload else SUB_GROUP_SIZE

    why = offload_rule(zero_stage, offload)
    if why or offload not in OFFLOAD_OPTIONS:
        raise ValueError(why or f"offload must be one of {OFFLOAD_OPTIONS}, got {offload!r}")
    p, g, m, o = prec.param, prec.grad, prec.master, prec.optim
    n = params / dp
    gathered = (min(params, MAX_LIVE_PARAMETERS) * p if live is None else live) if zero_stage == 3 else 0.0
    if offload == "none":
        return {"gpu": model_state_bytes(params, dp, zero_stage, prec) + gathered, "cpu": 0.0, "nvme": 0.0}
    fp32_states = (m + o + 4) * n  # master, moments, fp32 gradient partition
    swap_buffers = OPTIMIZER_SWAP_BUFFERS * min(n, sub_group_size) * 4
    if zero_stage in (1, 2):  # opt-cpu
        grads = g * params if zero_stage == 1 else g * n
        return {"gpu": p * params + grads, "cpu": fp32_states + p * n, "nvme": 0.0}
    if offload == "opt-cpu":
        return {"gpu": p * n + gathered, "cpu": fp32_states + g * n, "nvme": 0.0}
    if offload == "opt-nvme":
        return {"gpu": p * n + gathered, "cpu": g * n + swap_buffers, "nvme": fp32_states}
    if offload == "cpu":
        return {"gpu": gathered, "cpu": fp32_states + (g + p) * n, "nvme": 0.0}
    return {  # nvme: parameters and optimizer states
        "gpu": gathered,
        "cpu": g * n + swap_buffers + (PARAM_SWAP_ELEMENTS + min(n, MAX_IN_CPU)) * p,
        "nvme": fp32_states + p * n,
    }


def offload_traffic(params: float, dp: int, zero_stage: int, prec, offload: str,
                    recompute: bool = False) -> dict[str, float]:  # fmt: skip
    """Bytes one rank moves per step over PCIe (GPU <-> CPU) and to/from NVMe, and the elements
    the CPU optimizer updates. Gradients go down once; updated 16-bit weights come back once;
    offloaded parameters are fetched for every forward (twice with recompute) and the backward;
    NVMe optimizer states are read and written once each, the fp32 gradient written and read."""
    if offload == "none":
        return {"pcie": 0.0, "nvme": 0.0, "cpu_adam_elements": 0.0}
    p, g, m, o = prec.param, prec.grad, prec.master, prec.optim
    n = params / dp
    pcie = (g + p) * n
    nvme = 0.0
    if offload in ("cpu", "nvme"):
        passes = 3 if recompute else 2
        pcie += passes * p * n
        if offload == "nvme":
            nvme += passes * p * n + p * n  # reads, and the write of the updated weights
    if offload in ("opt-nvme", "nvme"):
        nvme += 2 * (m + o) * n + 2 * 4 * n
    return {"pcie": pcie, "nvme": nvme, "cpu_adam_elements": n}
