"""Traffic counters count the bytes that moved, where they moved: checked against the kernel's own count."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from nsp import storage

PAGE = 64 << 10


def _io() -> tuple[dict[str, int], int]:
    """The process's I/O counters, and the bytes this very read added to rchar once its text was made."""
    with open(f"/proc/{os.getpid()}/io", "rb") as f:
        text = f.read()
    return {k: int(v) for k, v in (line.split(b":") for line in text.splitlines())}, len(text)


def _store(tmp_path, **kw):
    store = storage.open(tmp_path / "s", tier="file", page_bytes=PAGE, **kw)
    store.initialize({"w": jnp.linspace(-1, 1, 300_000, dtype=jnp.float32)}, storage.OptimizerSpec("adam"))
    return store


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")
def test_internal_counts_match_the_kernels_io_accounting(tmp_path):
    store = _store(tmp_path)
    layout = store.layout
    grad = np.sin(np.arange(layout.padded_total, dtype=np.float32))
    store.update(grad, version=0, lr=1e-3, step=1)  # the first update also reads a few bytes of set-up, once
    store.reset_stats()
    manifest = store.shard_paths[0] / "MANIFEST.json"
    before, own_read = _io()
    store.update(grad, version=1, lr=1e-3, step=2)
    after, _ = _io()
    stats = store.stats()
    # rchar/wchar: what the read and write system calls of this process returned. The update's only other
    # write is its commit's manifest (written to a temporary file, then renamed).
    assert after[b"rchar"] - before[b"rchar"] - own_read == stats["internal_read_bytes"]
    assert after[b"wchar"] - before[b"wchar"] == stats["internal_write_bytes"] + manifest.stat().st_size
    # Three states, every page read and written: the page data plus each file's zarr padding and CRC trailer
    # (and, for direct writes, the block padding the file is cut back from).
    pages = 3 * layout.pages_per_shard
    assert stats["pages_read"] == stats["pages_written"] == pages
    data = 3 * layout.shard_size * 4
    assert data + pages * 4 <= stats["internal_read_bytes"] <= data + pages * (4 + 4096)
    assert data + pages * 4 <= stats["internal_write_bytes"] <= data + pages * (4 + 4096)
    # The shared link: the fp32 gradient in, the fp32 params out.
    assert stats["shared_in_bytes"] == layout.padded_total * 4
    assert stats["shared_out_bytes"] == layout.padded_total * 4
    store.close()


def test_a_short_read_fails_the_step_and_is_counted(tmp_path):
    store = _store(tmp_path)
    layout = store.layout
    page = store.shard_paths[0] / "slot0" / "nu" / "c" / "2"
    size = page.stat().st_size
    os.truncate(page, size - 1000)  # the next read of this page returns 1000 bytes short
    store.reset_stats()
    with pytest.raises(storage.StoreError, match=r"slot0/nu/c/2 is truncated"):
        store.update(np.ones(layout.padded_total, np.float32), version=0, lr=1e-3, step=1)
    stats = store.stats()
    # What was read before the step failed is counted, the short read with what it returned: not a multiple
    # of whole page files.
    assert stats["internal_read_bytes"] > 0
    assert stats["internal_read_bytes"] % size != 0
    assert stats["updates"] == 0
    assert json.loads((store.shard_paths[0] / "MANIFEST.json").read_text())["version"] == 0
    store.close()
