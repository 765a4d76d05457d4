"""A spill area: the directory where offloaded activations wait for the backward pass.

``SpillArea(directory)`` makes a private subdirectory there (removed at ``close``) and opens it in the C++
engine (``ffi/offload/spill_area.h``): each offloaded call site gets a stack of files that the forward pass
pushes and the backward pass pops. For entries of up to ``image_limit_bytes``, the step's threads only copy: the
area's own I/O thread writes each entry behind the forward pass and reads the next ``read_ahead`` entries ahead
of the backward, by direct I/O where the file system takes it (no page-cache copy, none of the kernel's
write-back work on the step's cores). Larger entries move on the step's thread through the page cache, so that
the area's own memory stays bounded. The files are scratch, never state: a run killed mid-step resumes from its
store and checkpoints as always.
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
      read_ahead: entries read ahead of the backward's pop of them (into memory by the I/O thread; a larger
        entry by the kernel, into the page cache).
      write_behind: entries whose images may wait in memory for their write while the forward goes on (a push
        beyond that waits for the oldest write); 0: each push writes before it returns. Entries the backward pops
        before their write is done are taken from memory, their write dropped.
      image_limit_bytes: the largest entry (one offloaded call's residuals, as stored) that moves as an image on
        the I/O thread; larger ones are written and read on the step's thread, through the page cache.
      direct_io: None (direct I/O where the file system takes it, unless ``NSP_NO_DIRECT_IO`` is set), True
        (required: a file system that refuses O_DIRECT, such as tmpfs, is an error here) or False (the page
        cache, each file dropped from it once read).

    The memory it holds at most: ``max(read_ahead, write_behind, 1)`` images of up to ``image_limit_bytes``,
    kept for reuse between steps (a fresh buffer is pages the kernel must fault in and zero).

    Use as a context manager, or call ``close()``. Raises ``ValueError`` for a directory that does not exist or
    cannot be written, or bad settings (said here, not mid-step).

    Example::

      with nsp.offload.SpillArea("/nvme/spill") as area:
          block_fn = nsp.offload.offload(block_fn, area)
    """

    def __init__(self, directory: str | os.PathLike, *, read_ahead: int = 1, write_behind: int = 1,
                 image_limit_bytes: int = 256 * 2**20, direct_io: bool | None = None):
        parent = Path(directory)
        if not parent.is_dir():
            raise ValueError(f"spill directory {parent} does not exist (or is not a directory)")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"spill directory {parent} is not writable")
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, got {read_ahead}")
        if write_behind < 0:
            raise ValueError(f"write_behind must be >= 0, got {write_behind}")
        if image_limit_bytes < 0:
            raise ValueError(f"image_limit_bytes must be >= 0, got {image_limit_bytes}")
        if direct_io not in (None, True, False):
            raise ValueError(f"direct_io must be None, True or False, got {direct_io!r}")
        self.path = Path(tempfile.mkdtemp(prefix="nsp-spill-", dir=parent))
        self.read_ahead = int(read_ahead)
        self.write_behind = int(write_behind)
        self.image_limit_bytes = int(image_limit_bytes)
        io = {None: "auto", True: "direct", False: "buffered"}[direct_io]
        try:
            self.id = int(_spill.spill_open(str(self.path), self.read_ahead, self.write_behind,
                                                self.image_limit_bytes, io))
        except RuntimeError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise ValueError(str(e)) from None
        self._closed = False

    def stats(self) -> dict[str, int]:
        """The area's counters since it opened (``nsp.primitives.spill.spill_stats``), of the steps dispatched so
        far: waits for them."""
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

    @property
    def direct_io(self) -> bool:
        """Whether the area's files move by direct I/O (O_DIRECT)."""
        return bool(self.stats()["direct_io"])

    def __repr__(self) -> str:
        return (f"SpillArea({str(self.path)!r}, read_ahead={self.read_ahead}, write_behind={self.write_behind}"
                f"{', closed' if self._closed else ''})")
