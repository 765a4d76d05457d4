"""Setting a store up: initialize_from (leaf by leaf, bounded memory) writes what initialize writes, and the disk
a store needs is checked (nsp.storage.space) before anything is written."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nsp.storage as storage
from nsp.storage import space
from nsp.storage import creation
from nsp.storage.format import METADATA
from nsp.storage.snapshot import snapshot_store

PAGE = 4096  # 1024 elements a page: leaves span pages, and pages span leaves
ADAM = storage.OptimizerSpec("adam")
SPECS = [ADAM, storage.OptimizerSpec("sgd", momentum=0.9), storage.OptimizerSpec("adagrad", initial_nu=0.1)]
# Odd sizes: some leaves smaller than a page, some several pages long, a bf16 one and an empty one.
SHAPES = {"a": ((37, 61), np.float32), "b": ((5,), np.float32), "c": ((3000,), ml_dtypes.bfloat16),
          "d": ((0,), np.float32), "e": ((2, 1025), np.float32), "f": ((700,), np.float32), "g": ((4099,), np.float32)}


def leaf_values(i: int) -> np.ndarray:
    """Leaf ``i`` (in tree_leaves order), made afresh on every call: the test keeps no copy of it."""
    name = sorted(SHAPES)[i]
    shape, dtype = SHAPES[name]
    return np.random.default_rng(i).standard_normal(shape).astype(np.float32).astype(dtype)


def make_params() -> dict:
    return {name: jnp.asarray(leaf_values(i)) for i, name in enumerate(sorted(SHAPES))}


def abstract_params() -> dict:
    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in SHAPES.items()}


def open_store(path, tier, **kw):
    kw.setdefault("num_shards", 3)
    kw.setdefault("page_bytes", PAGE)
    return storage.open(None if tier == "memory" else path, tier=tier, **kw)


def files_under(root):
    """Relative path -> bytes of every file under ``root``."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def states_of(store):
    used = store.optimizer.states_used()
    return {s: store.read(s) for s, u in zip(("param", "mu", "nu"), used) if u}


@pytest.fixture
def small_chunks(monkeypatch):
    """initialize writes one page at a time: every leaf spans several writes, every write several leaves."""
    monkeypatch.setattr(creation, "_INIT_CHUNK_BYTES", PAGE)


# ---- initialize_from -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_initialize_from_writes_what_initialize_writes(tmp_path, monkeypatch, tier, spec):
    with open_store(tmp_path / "whole", tier) as whole:
        assert whole.initialize(make_params(), spec) == 0
        expected = states_of(whole)
    monkeypatch.setattr(creation, "_INIT_CHUNK_BYTES", 2 * PAGE)  # other write boundaries, same bytes
    with open_store(tmp_path / "lazy", tier) as lazy:
        assert lazy.initialize_from(abstract_params(), leaf_values, spec) == 0
        assert lazy.layout == whole.layout
        got = states_of(lazy)
    assert sorted(got) == sorted(expected)
    for state in expected:
        assert got[state].tobytes() == expected[state].tobytes(), state
    if tier == "memory":
        return
    a, b = files_under(tmp_path / "whole"), files_under(tmp_path / "lazy")
    assert sorted(a) == sorted(b)
    pages = [p for p in a if "/slot0/" in p and "/c/" in p]
    assert len(pages) == 3 * whole.layout.pages_per_shard * sum(spec.states_used())
    for path in a:
        name = os.path.basename(path)
        if name in ("LOCK", "SHARD.json"):
            continue  # who holds the lock, and which store (each its own id) the shard belongs to
        if name in ("MANIFEST.json", METADATA):
            da, db = json.loads(a[path]), json.loads(b[path])
            for key in ("store", "store_id"):
                da.pop(key, None)
                db.pop(key, None)
            assert da == db, path
        else:
            assert a[path] == b[path], path
    with storage.open(tmp_path / "lazy") as reopened:
        assert reopened.verify()["problems"] == []
        assert reopened.read("param").tobytes() == expected["param"].tobytes()


def test_produce_is_called_in_order_once_each_and_leaves_are_let_go(tmp_path, small_chunks):
    calls, alive, most_alive = [], [], [0]

    def produce(i):
        calls.append(i)
        # Leaves the store still holds when it asks for the next one.
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in alive))
        values = leaf_values(i)
        alive.append(weakref.ref(values))
        return values

    with open_store(tmp_path / "s", "file", num_shards=2) as store:
        store.initialize_from(abstract_params(), produce, ADAM)
        assert calls == list(range(len(SHAPES)))
        # A one-page write needs at most the leaf it ends in and the one it began in: never the model.
        assert 1 <= most_alive[0] <= 2, most_alive[0]
        gc.collect()
        assert [i for i, ref in enumerate(alive) if ref() is not None] == []  # nothing kept after set-up
        np.testing.assert_array_equal(store.read("param"), store.layout.flatten(make_params()))


def test_initialize_from_on_an_initialized_store_checks_it_and_asks_for_nothing(tmp_path):
    with open_store(tmp_path / "s", "file") as store:
        store.initialize(make_params(), ADAM)
        asked = []
        assert store.initialize_from(abstract_params(), asked.append, ADAM) == 0
        assert asked == []
        other = {**abstract_params(), "b": jax.ShapeDtypeStruct((6,), np.float32)}
        with pytest.raises(storage.StoreError, match="different layout"):
            store.initialize_from(other, asked.append, ADAM)
        with pytest.raises(storage.StoreError, match="was created for"):
            store.initialize_from(abstract_params(), asked.append, storage.OptimizerSpec("sgd"))
        assert asked == []


def test_a_process_holding_some_shards_gets_every_leaf_and_writes_its_own(small_chunks):
    with open_store(None, "memory") as whole:
        whole.initialize(make_params(), ADAM)
        expected = [whole.read_shard("param", i) for i in range(3)]
    calls = []
    with open_store(None, "memory", shards=[1]) as part:
        part.initialize_from(abstract_params(), lambda i: calls.append(i) or leaf_values(i), ADAM)
        assert calls == list(range(len(SHAPES)))
        assert part.read_shard("param", 1).tobytes() == expected[1].tobytes()


@pytest.mark.parametrize("tier", ["memory", "file"])
@pytest.mark.parametrize("bad, match", [
    (lambda i: leaf_values(i).reshape(-1) if i == 4 else leaf_values(i), r"leaf 4 \(\['e'\]\).*float32\[2050\].*"
                                                                          r"float32\[2, 1025\]"),
    (lambda i: leaf_values(i).astype(np.float32) if i == 2 else leaf_values(i), r"leaf 2 .*float32\[3000\].*"
                                                                                r"bfloat16\[3000\]"),
    (lambda i: leaf_values(i) if i < 6 else np.zeros((4098,), np.float32), r"leaf 6 .*\[4098\].*\[4099\]"),
], ids=["shape", "dtype", "last-leaf"])
def test_a_wrong_leaf_commits_nothing(tmp_path, small_chunks, tier, bad, match):
    path = tmp_path / "s"
    with open_store(path, tier) as store:
        with pytest.raises(storage.StoreError, match=match):
            store.initialize_from(abstract_params(), bad, ADAM)
        assert not store.initialized and store.version is None
        if tier == "file":
            assert not (path / METADATA).exists()
            assert not any((path / "shards" / f"{i:05d}" / "MANIFEST.json").exists() for i in range(3))
        # Nothing half-made stays: the same store initializes once the leaves are right.
        assert store.initialize_from(abstract_params(), leaf_values, ADAM) == 0
        np.testing.assert_array_equal(store.read("param"), store.layout.flatten(make_params()))


def test_an_error_in_produce_leaves_the_store_uninitialized(tmp_path):
    def produce(i):
        if i == 3:
            raise KeyError("no such leaf")
        return leaf_values(i)

    with open_store(tmp_path / "s", "file") as store:
        with pytest.raises(KeyError):
            store.initialize_from(abstract_params(), produce, ADAM)
        assert not store.initialized
        assert not (tmp_path / "s" / METADATA).exists()


@pytest.mark.parametrize("spec", [ADAM, storage.OptimizerSpec("sgd")], ids=lambda s: s.kind)
def test_progress_counts_the_bytes_written_up_to_the_total(tmp_path, small_chunks, spec):
    seen = []
    with open_store(tmp_path / "s", "file") as store:
        store.initialize_from(abstract_params(), leaf_values, spec, progress=lambda d, t: seen.append((d, t)))
        total = 3 * store.layout.shard_size * 4 * sum(spec.states_used())
    assert len(seen) == 3 * store.layout.pages_per_shard  # one call per one-page write
    assert {t for _, t in seen} == {total}
    done = [d for d, _ in seen]
    assert done == sorted(done) and len(set(done)) == len(done) and done[-1] == total


# ---- the disk a store needs --------------------------------------------------------------------------------------


def disk_bytes(paths, seen=None):
    """Bytes the files (and directories) under ``paths`` take on disk, each inode once."""
    seen = set() if seen is None else seen
    total = 0
    for top in paths:
        for directory, dirs, names in os.walk(top):
            for name in [*dirs, *names, None]:
                st = os.lstat(directory if name is None else os.path.join(directory, name))
                if name in dirs:
                    continue  # counted as its own `directory`
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def page_disk_bytes(paths):
    """Bytes the page files (``.../c/<page>``) under ``paths`` take on disk, each inode once."""
    seen, total = set(), 0
    for top in paths:
        for directory, _, names in os.walk(top):
            if os.path.basename(directory) != "c":
                continue
            for name in names:
                st = os.lstat(os.path.join(directory, name))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


@pytest.mark.parametrize("checksum", [True, False])
def test_required_bytes_is_what_the_store_takes_on_disk(tmp_path, checksum):
    path = tmp_path / "s"
    with open_store(path, "file", checksum=checksum) as store:
        store.initialize(make_params(), ADAM)
        grad = np.zeros(store.layout.padded_total, np.float32)
        store.update(grad, version=0, lr=0.1, step=1)  # both version slots now hold pages
        layout = store.layout
    block = os.statvfs(path).f_frsize
    per_version = space.version_bytes(layout, ADAM, checksum=checksum, block_bytes=block)
    assert per_version == 3 * layout.pages_per_shard * -(-(PAGE + 4 * checksum) // block) * block
    # The pages: exactly two versions per shard.
    assert page_disk_bytes([path]) == 3 * 2 * per_version
    # Everything: at most the figure, and below it by no more than the metadata bound.
    needed = space.required_bytes(layout, ADAM, checksum=checksum, checkpoints=0, block_bytes=block)
    slack = 3 * space.shard_metadata_bytes(layout, ADAM, block_bytes=block) + space.root_metadata_bytes(
        layout, block_bytes=block)
    used = disk_bytes([path])
    assert needed - slack <= used <= needed
    assert space.required_bytes(layout, ADAM, checksum=checksum, block_bytes=block) == needed + 3 * per_version


def test_a_live_checkpoint_costs_one_version_of_pages(tmp_path):
    """A snapshot links the committed pages; once the store has written that slot again (two updates on), the
    store and its snapshot hold three versions' pages: what checkpoints=1 counts, no more."""
    path = tmp_path / "s"
    with open_store(path, "file") as store:
        store.initialize(make_params(), ADAM)
        grad = np.full(store.layout.padded_total, 0.5, np.float32)
        store.update(grad, version=0, lr=0.1, step=1)
        snapshot_store(store, tmp_path / "snap", mode="link")
        for step in (2, 3):
            store.update(grad, version=step - 1, lr=0.1, step=step)
        layout = store.layout
    block = os.statvfs(path).f_frsize
    pages = page_disk_bytes([path, tmp_path / "snap"])
    per_version = space.version_bytes(layout, ADAM, block_bytes=block)
    assert pages == 3 * 3 * per_version  # 3 shards x (two slots + the snapshot's)
    assert pages == 3 * (space.shard_bytes(layout, ADAM, checkpoints=1, block_bytes=block)
                         - space.shard_metadata_bytes(layout, ADAM, block_bytes=block))


class _Usage:
    def __init__(self, free):
        self.total, self.used, self.free = 10**12, 10**12 - free, free


def test_too_little_space_is_said_before_anything_is_written(tmp_path, monkeypatch):
    path = tmp_path / "s"
    store = open_store(path, "file", num_shards=2)
    with store:
        layout = storage.Layout.from_tree(abstract_params(), num_shards=2, page_bytes=PAGE)
        needed = space.required_bytes(layout, ADAM, block_bytes=os.statvfs(path).f_frsize)
        free = needed - 1
        monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(free))
        for call in (lambda: store.initialize(make_params(), ADAM),
                     lambda: store.initialize_from(abstract_params(), leaf_values, ADAM)):
            with pytest.raises(storage.StoreError) as err:
                call()
            message = str(err.value)
            # Both shards and the metadata share one file system: their figures add up.
            assert f"needs {space.format_bytes(needed)} ({needed:,} bytes)" in message
            assert f"has {space.format_bytes(free)} ({free:,} bytes) free" in message
            assert f"file system of {path / 'shards' / '00000'} (shards 0, 1 and the store's metadata)" in message
            for option in ("a smaller model", "--store-dir", "memory tier", "versions of param/mu/nu",
                           "Fewer version slots is not available"):
                assert option in message
            assert not store.initialized
            assert not (path / METADATA).exists()
            assert not list(path.glob("shards/*/slot*")) and not list(path.glob("shards/*/MANIFEST.json"))
        monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(needed))  # just enough
        assert store.initialize_from(abstract_params(), leaf_values, ADAM) == 0


def test_a_tiny_store_always_fits_a_real_disk(tmp_path):
    with open_store(tmp_path / "s", "file") as store:
        layout = storage.Layout.from_tree(abstract_params(), num_shards=3, page_bytes=PAGE)
        needs = storage.check_free_space(store.shard_paths, layout, ADAM, root=store.root)
        assert len(needs) == 1 and needs[0].shards == (0, 1, 2) and needs[0].holds_root
        assert 0 < needs[0].needed < needs[0].free
        store.initialize(make_params(), ADAM)


def test_leftovers_of_an_unfinished_creation_count_as_free(tmp_path, monkeypatch):
    """A failed set-up leaves page files behind; the next one replaces them, so their space is free to it."""
    path = tmp_path / "s"
    with open_store(path, "file") as store:
        with pytest.raises(storage.StoreError, match="leaf 6"):
            store.initialize_from(abstract_params(), lambda i: leaf_values(i) if i < 6 else None, ADAM)
        leftover = disk_bytes(sorted(path.glob("shards/*/slot*")))
        assert leftover > 0
        monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(10**9))
        needs = storage.check_free_space(store.shard_paths, storage.Layout.from_tree(
            abstract_params(), num_shards=3, page_bytes=PAGE), ADAM, root=store.root)
        # The slots' files count, not their directories (a new store makes those again).
        files = sum(os.lstat(p).st_blocks * 512 for p in path.glob("shards/*/slot*/**/*") if p.is_file())
        assert needs[0].free == 10**9 + files


def _mount_tmpfs(path, size):
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_shards_on_two_file_systems_are_checked_apart(tmp_path):
    """A shard on a small disk is refused even when the other disk has room for everything."""
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "64k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        shard_paths = [tmp_path / "big" / "0", small / "1"]
        with pytest.warns(storage.ExternalShardsWarning):
            store = open_store(tmp_path / "s", "file", num_shards=2, shard_paths=shard_paths)
        with store:
            with pytest.raises(storage.StoreError) as err:
                store.initialize(make_params(), ADAM)
            message = str(err.value)
            assert f"file system of {small / '1'} (shard 1)" in message
            assert "shard 0" not in message  # its disk has room
            assert not store.initialized and not list(small.glob("1/slot*"))
    finally:
        subprocess.run(["umount", str(small)])
