"""The DeepSpeed classes its checkpoints pickle, which mt3d's safe loader allows by name."""

from __future__ import annotations


def allowed_globals() -> list:
    """Classes a DeepSpeed checkpoint may contain besides tensors and containers (plain data
    holders: loss-scaler settings, the ZeRO stage enum, a parameter fragment's address, the
    shape of a fused tensor's parts in universal checkpoints)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, LossScalerBase
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScalerBase, LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, SubparamShape]
