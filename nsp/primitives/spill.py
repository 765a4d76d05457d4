"""The activation-offload primitives: push a layer's residuals to a spill area, pop them back.

``spill_save`` and ``spill_load`` are side-effecting XLA FFI calls (``ffi/xla/spill_ffi.cc``) over a spill area
the engine holds (``ffi/offload/spill_area.h``; opened with ``spill_open``). ``nsp.offload`` builds its ``custom_vjp``
wrapper from them; they are public for other wrappers (a remat policy, a scan body of one's own).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from nsp import engine
from nsp.primitives import _ffi  # noqa: F401  (registers the FFI targets)


def spill_open(directory: str, read_ahead: int, write_behind: int = 1, image_limit: int = 256 << 20,
               io: str = "auto") -> int:
    """Opens a spill area over an existing, writable ``directory``; returns its id. ``read_ahead``: entries read
    ahead of the backward; ``write_behind``: entries waiting in memory for their write (0: each push writes before
    it returns); ``image_limit``: the largest entry (bytes) that moves as an image on the area's I/O thread;
    ``io``: ``"auto"`` (direct I/O where the file system takes it, unless ``NSP_NO_DIRECT_IO`` is set),
    ``"direct"`` or ``"buffered"``. Raises ``RuntimeError`` naming the directory otherwise."""
    return int(engine.spill_open(str(directory), int(read_ahead), int(write_behind), int(image_limit), str(io)))


def spill_close(area: int) -> None:
    """Closes area ``area`` and removes the files it wrote."""
    engine.spill_close(int(area))


def spill_reset(area: int) -> None:
    """Forgets the entries on area ``area``'s stacks (after a step that failed between pushes and pops)."""
    engine.spill_reset(int(area))


def spill_stats(area: int) -> dict[str, int]:
    """Counters of area ``area``: ``saves``, ``loads``, ``bytes_written``, ``bytes_read`` (of the entries pushed
    and popped, as stored), ``array_bytes`` (of the arrays saved, in memory), ``arrays_sparse``,
    ``disk_bytes_written``, ``disk_bytes_read`` (what reached or came from the disk: an entry popped before its
    write is done never does), ``read_ahead`` (entries read before their pop), ``loads_from_memory``,
    ``save_waits`` (pushes that waited for a write) and ``direct_io`` (1: files move by O_DIRECT)."""
    return dict(engine.spill_stats(int(area)))


def spill_save(area: int, slot: int, arrays: Sequence[jax.Array], *, sparse: bool = False) -> jax.Array:
    """Pushes ``arrays`` onto call site ``slot``'s stack in area ``area``; returns the entry's token (int32).
    ``sparse``: store each 2- or 4-byte array in the bit-vector sparse format where that is smaller (lossless;
    ``ffi/offload/spill_codec.h``)."""
    call = jax.ffi.ffi_call("nsp_spill_save", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
    return call(*arrays, area=int(area), slot=int(slot), sparse=bool(sparse))


def spill_load(area: int, slot: int, token: jax.Array, after: jax.Array,
               like: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """Pops the entry ``token`` names from call site ``slot``'s stack: arrays shaped as ``like``. ``after`` is any
    array the read must wait for (the backward's cotangent at that layer); it is not read."""
    call = jax.ffi.ffi_call("nsp_spill_load", [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in like],
                            has_side_effect=True)
    return list(call(token, after, area=int(area), slot=int(slot)))
