"""PyTorch side of ddpwire: device choice, the gradient buffer, demo models and data, the trainer.

Needs the optional ``[torch]`` extra (torch and scikit-learn); the core
``ddpwire`` package never imports this one.
"""
from .buffer import (
    BLOCK_COMPONENTS,
    NON_BLOCK_COMPONENTS,
    Component,
    GradientBuffer,
    Segment,
    block_segment,
)
from .data import ArrayDataset, ShardSampler, digits_split, token_sequences
from .device import DEVICE_ENV, DeviceChoice, choose_device
from .local_steps import DiLoCo, nesterov_outer
from .models import Block, DigitsMLP, RMSNorm, TinyTransformer
from .trainer import (
    BatchFn,
    DataParallelTrainer,
    StepResult,
    StepTimings,
    WorkerLike,
    classification_batch,
    evaluate,
)

import torch.distributed as _dist

__all__ = [
    "BLOCK_COMPONENTS",
    "NON_BLOCK_COMPONENTS",
    "Component",
    "GradientBuffer",
    "Segment",
    "block_segment",
    "ArrayDataset",
    "ShardSampler",
    "digits_split",
    "token_sequences",
    "DEVICE_ENV",
    "DiLoCo",
    "nesterov_outer",
    "DeviceChoice",
    "choose_device",
    "Block",
    "DigitsMLP",
    "RMSNorm",
    "TinyTransformer",
    "BatchFn",
    "DataParallelTrainer",
    "StepResult",
    "StepTimings",
    "WorkerLike",
    "classification_batch",
    "evaluate",
]

# torch builds without distributed support (some mobile and minimal wheels)
# still get the trainer; the backend needs torch.distributed
if _dist.is_available():
    from .backend import BACKEND, DdpwireProcessGroup, DdpwireWork, register
    from .balanced import BalancedBatchSampler, balanced_hook

    register()
    __all__ += ["BACKEND", "BalancedBatchSampler", "balanced_hook", "DdpwireProcessGroup",
                "DdpwireWork", "register"]
