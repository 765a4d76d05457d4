"""Activations to storage (FlashNeuron): a layer's backward-pass residuals wait in a spill area on disk
(``SpillArea``), or in host memory through JAX's memory kinds (``HostMemory``, for accelerators)."""

from nsp.offload.area import SpillArea
from nsp.offload.blocks import offload_blocks
from nsp.offload.host import HostMemory
from nsp.offload.wrap import MIN_SPILL_BYTES, offload, spilled_bytes

__all__ = ["MIN_SPILL_BYTES", "HostMemory", "SpillArea", "offload", "offload_blocks", "spilled_bytes"]
