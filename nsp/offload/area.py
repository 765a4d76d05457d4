"""A spill area: the directory where offloaded activations wait for the backward pass.

``SpillArea(directory)`` makes a private subdirectory there (removed at ``close``) and opens it in the C++
engine (``ffi/spill_area.h``): each offloaded call site gets a stack of files that the forward pass pushes and
the backward pass pops, with the next ``read_ahead`` entries handed to the kernel to read in the background.
The files are scratch, never state: a run killed mid-step resumes from its store and checkpoints as always.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax

from nsp.primitives import spill as _spill


class SpillArea:
    """Offloaded activations' place on disk, for ``nsp.offload.offload``.

    Args:
      directory: an existing directory (a local disk, ideally NVMe); the area lives in a new subdirectory of it.
      read_ahead: entries the backward reads ahead of the one it needs (posix_fadvise: the kernel reads them
        into the page cache in the background; the process holds none of that memory).

    Use as a context manager, or call ``close()``. Raises ``ValueError`` for a directory that does not exist or
    cannot be written (said here, not mid-step).

    Example::

      with nsp.offload.SpillArea("/nvme/spill") as area:
          block_fn = nsp.offload.offload(block_fn, area)
    """

    def __init__(self, directory: str | os.PathLike, *, read_ahead: int = 2):
        parent = Path(directory)
        if not parent.is_dir():
            raise ValueError(f"spill directory {parent} does not exist (or is not a directory)")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"spill directory {parent} is not writable")
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, got {read_ahead}")
        self.path = Path(tempfile.mkdtemp(prefix="nsp-spill-", dir=parent))
        self.read_ahead = int(read_ahead)
        try:
            self.id = int(_spill.spill_open(str(self.path), self.read_ahead))
        except RuntimeError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise ValueError(str(e)) from None
        self._closed = False

    def stats(self) -> dict[str, int]:
        """``saves``, ``loads``, ``bytes_written``, ``bytes_read``, ``read_ahead_hints`` since the area opened (of
        the steps dispatched so far: waits for them)."""
        self._check_open()
        jax.effects_barrier()
        return dict(_spill.spill_stats(self.id))

    def free_bytes(self) -> int:
        """Free space on the area's file system."""
        return shutil.disk_usage(self.path).free

    def reset(self) -> None:
        """Forgets the entries on the stacks: after a step that raised between its forward and backward."""
        self._check_open()
        _spill.spill_reset(self.id)

    def close(self) -> None:
        """Removes the area's files and directory. Steps traced with it fail with a clear error afterwards."""
        if not self._closed:
            jax.effects_barrier()  # steps still running may be writing or reading the area
            self._closed = True
            _spill.spill_close(self.id)
            shutil.rmtree(self.path, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"spill area {self.path} is closed")

    def __enter__(self) -> SpillArea:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SpillArea({str(self.path)!r}, read_ahead={self.read_ahead}{', closed' if self._closed else ''})"
