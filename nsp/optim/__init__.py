"""Optax transforms with optimizer state in a storage tier (``nsp.storage``) and Top-K compression."""

from nsp.optim.accumulate import MultiStepsState, multi_steps
from nsp.optim.alias import adagrad, adam, adamw, sgd
from nsp.optim.compress import TOPK_ADAM_BETAS, Compressed, TopK, TopKState, topk_compress
from nsp.optim.compensation import resuming
from nsp.optim.init_from import init_from
from nsp.optim.plateau import ReduceOnPlateauState, reduce_on_plateau
from nsp.optim.storage import (
    StorageState,
    scale_by_storage,
    scale_by_storage_adagrad,
    scale_by_storage_adam,
    scale_by_storage_adamw,
    scale_by_storage_sgd,
)

__all__ = [
    "Compressed",
    "MultiStepsState",
    "ReduceOnPlateauState",
    "StorageState",
    "TOPK_ADAM_BETAS",
    "TopK",
    "TopKState",
    "adagrad",
    "adam",
    "adamw",
    "init_from",
    "multi_steps",
    "reduce_on_plateau",
    "resuming",
    "scale_by_storage",
    "scale_by_storage_adagrad",
    "scale_by_storage_adam",
    "scale_by_storage_adamw",
    "scale_by_storage_sgd",
    "sgd",
    "topk_compress",
]
