"""``HostMemory``: the spill target where JAX's memory kinds move arrays between an accelerator and host memory.

On a GPU, each device has a ``pinned_host`` memory beside its own; ``jax.device_put(x, jax.memory.Space.Host)``
inside a jitted function makes XLA copy ``x`` there (on its own stream, overlapping compute), and
``jax.memory.Space.Device`` brings it back. ``nsp.offload.offload(fn, HostMemory())`` sends ``fn``'s residuals
there in the forward pass and back in the backward pass: the accelerator's memory holds none of them in between,
and no disk is involved (FlashNeuron's SSD path is ``SpillArea``; this is the one for residuals that fit in the
host's RAM).

On a CPU the devices' memory already is host memory: the platform lists the memory kinds, the moves compile and
cost nothing, and nothing is saved (``moves_data`` says so). Use a ``SpillArea`` there to take residuals out of
RAM.
"""

from __future__ import annotations

from typing import Any

import jax

#: The memory kind the residuals wait in.
HOST_KIND = "pinned_host"


class HostMemory:
    """A spill target in the host memory of each device (``pinned_host``), through JAX's memory kinds.

    Args:
      devices: the devices the step runs on (default: ``jax.devices()``); each must have a ``pinned_host``
        memory, else ``ValueError`` names the device and the kinds it has.

    Example::

      block = nsp.offload.offload(block_fn, nsp.offload.HostMemory())
      loss, grads = jax.value_and_grad(lambda p: loss_of(block, p))(params)
    """

    def __init__(self, devices: Any = None):
        devices = list(devices if devices is not None else jax.devices())
        for d in devices:
            kinds = sorted(m.kind for m in d.addressable_memories())
            if HOST_KIND not in kinds:
                raise ValueError(f"device {d} has no {HOST_KIND} memory (it has {', '.join(kinds) or 'none'}): "
                                 "offload to a spill directory (nsp.offload.SpillArea) instead")
        self.platform = devices[0].platform if devices else "cpu"

    @property
    def moves_data(self) -> bool:
        """Whether moving to host memory frees accelerator memory (False on a CPU: it is host memory already)."""
        return self.platform != "cpu"

    def save(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """The forward pass's side: ``arrays`` moved to host memory."""
        return [jax.device_put(x, jax.memory.Space.Host) for x in arrays]

    def load(self, arrays: list[jax.Array], after: jax.Array) -> list[jax.Array]:
        """The backward pass's side: ``arrays`` back in device memory. ``after`` (the cotangent arriving at the
        layer) is grouped with them so the copies back belong to this layer's backward, not hoisted to its start."""
        arrays, _ = jax.lax.optimization_barrier((arrays, after))
        return [jax.device_put(x, jax.memory.Space.Device) for x in arrays]

    def close(self) -> None:
        """Nothing to remove (as ``SpillArea.close``, for code that closes either)."""

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostMemory(platform={self.platform!r})"
