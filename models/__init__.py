"""Flax NNX models trained with nsp (installed as ``nsp.models``; no nsp imports here)."""

from .gpt import (
    CONFIGS,
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    abstract_gpt,
    count_params,
    cross_entropy_loss,
    generate,
    get_config,
)

__all__ = [
    "CONFIGS",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "abstract_gpt",
    "count_params",
    "cross_entropy_loss",
    "generate",
    "get_config",
]
