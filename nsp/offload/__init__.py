"""Activations to storage (FlashNeuron): a layer's backward-pass residuals wait in a spill area on disk."""

from nsp.offload.area import SpillArea
from nsp.offload.blocks import offload_blocks
from nsp.offload.wrap import MIN_SPILL_BYTES, offload, spilled_bytes

__all__ = ["MIN_SPILL_BYTES", "SpillArea", "offload", "offload_blocks", "spilled_bytes"]
