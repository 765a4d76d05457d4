"""Every shard knows its store; copies, moves, shared shards and damaged metadata are handled, never trusted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from nsp import storage
from nsp.cli import main as cli
from nsp.storage import identity

PAGE = 4096
ADAM = storage.OptimizerSpec("adam")


def params():
    return {"a": jnp.linspace(-1, 1, 3000, dtype=jnp.float32), "b": jnp.ones((40, 30), jnp.float32)}


def grad(step, layout):
    return np.sin(np.arange(layout.padded_total, dtype=np.float32) * 0.01 * step)


def make_store(path, steps=2, **kw):
    store = storage.open(path, tier="file", page_bytes=PAGE, **kw)
    store.initialize(params(), ADAM)
    for step in range(1, steps + 1):
        store.update(grad(step, store.layout), version=step - 1, lr=0.01, step=step)
    return store


def files_of(root):
    """Every file's bytes under root, lock files aside (opening a store writes its pid there)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "LOCK"}


def test_a_copied_store_writes_its_own_shards(tmp_path):
    make_store(tmp_path / "run1").close()
    before = files_of(tmp_path / "run1")
    subprocess.run(["cp", "-a", str(tmp_path / "run1"), str(tmp_path / "run2")], check=True)
    with storage.open(tmp_path / "run2") as copy:
        assert all(str(p).startswith(str(tmp_path / "run2")) for p in copy.shard_paths)
        copy.update(grad(3, copy.layout), version=2, lr=0.01, step=3)
        assert copy.version == 3
    assert files_of(tmp_path / "run1") == before
    with storage.open(tmp_path / "run1") as original:
        assert original.version == 2


def test_a_moved_store_resumes_bit_exactly(tmp_path):
    with make_store(tmp_path / "ref", steps=3) as ref:
        expected = {s: ref.read(s) for s in ("param", "mu", "nu")}
    make_store(tmp_path / "a", steps=2).close()
    os.rename(tmp_path / "a", tmp_path / "moved")
    with storage.open(tmp_path / "moved") as store:
        store.update(grad(3, store.layout), version=2, lr=0.01, step=3)
        for s in ("param", "mu", "nu"):
            np.testing.assert_array_equal(store.read(s), expected[s])


_HOLDER = textwrap.dedent("""
    import sys, time
    from nsp import storage
    store = storage.open(sys.argv[1])
    print("OPEN", flush=True)
    time.sleep(60)
""")


def test_a_second_writer_on_a_shard_is_refused_whichever_store_it_came_through(tmp_path):
    external = tmp_path / "nvme" / "shard0"
    make_store(tmp_path / "a", shard_paths=[external]).close()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "a")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "OPEN"
        # The same store through another path to it: the lock, not the path, decides.
        os.symlink(tmp_path / "a", tmp_path / "alias")
        with pytest.raises(storage.StoreError, match=rf"already open for writing by pid {holder.pid}"):
            storage.open(tmp_path / "alias")
        # A copy of the directory still names the external shard: refused, naming both stores.
        shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("LOCK"))
        with pytest.raises(storage.StoreError, match=rf"belongs to the store at {tmp_path / 'a'}.*{tmp_path / 'b'}"):
            storage.open(tmp_path / "b")
        # A new store asked to use that shard directory: refused before anything is written there.
        before = files_of(external)
        with pytest.raises(storage.StoreError, match="belongs to the store at"):
            storage.open(tmp_path / "c", shard_paths=[external])
        assert files_of(external) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_shard_of_another_store_is_refused(tmp_path):
    make_store(tmp_path / "a").close()
    make_store(tmp_path / "b").close()
    a_id = json.loads((tmp_path / "a" / "nsp_store.json").read_text())["store_id"]
    shutil.rmtree(tmp_path / "b" / "shards" / "00000")
    shutil.copytree(tmp_path / "a" / "shards" / "00000", tmp_path / "b" / "shards" / "00000")
    with pytest.raises(storage.StoreError, match=rf"belongs to the store at {tmp_path / 'a'} \(id {a_id}\).*"
                                                 rf"{tmp_path / 'b'}"):
        storage.open(tmp_path / "b")


def test_store_copy_and_reidentify_give_new_identities(tmp_path, capsys):
    make_store(tmp_path / "a", shard_paths=[tmp_path / "nvme" / "s0"]).close()
    a_id = json.loads((tmp_path / "a" / "nsp_store.json").read_text())["store_id"]
    assert cli(["store", "copy", str(tmp_path / "a"), str(tmp_path / "copy")]) == 0
    meta = json.loads((tmp_path / "copy" / "nsp_store.json").read_text())
    assert meta["store_id"] != a_id and meta["shard_paths"] == ["shards/00000"]
    with storage.open(tmp_path / "copy") as copy, storage.open(tmp_path / "a") as original:
        np.testing.assert_array_equal(copy.read("nu"), original.read("nu"))
        assert copy.external_shards == [] and original.external_shards == [tmp_path / "nvme" / "s0"]
    # A store moved with a shard outside it: refused until it is re-identified as the shard's owner.
    os.rename(tmp_path / "a", tmp_path / "moved")
    with pytest.raises(storage.StoreError, match="reidentify"):
        storage.open(tmp_path / "moved")
    assert cli(["store", "reidentify", str(tmp_path / "moved")]) == 0
    with storage.open(tmp_path / "moved") as moved:
        assert moved.version == 2 and moved.store_id != a_id


def test_external_shards_are_named_at_open(tmp_path):
    with pytest.warns(storage.ExternalShardsWarning, match="nvme"):
        make_store(tmp_path / "a", shard_paths=[tmp_path / "nvme" / "s0"]).close()


# ---- metadata is checked, not trusted ---------------------------------------------------------------------------

_META_MUTATIONS = {
    "page_bytes": [2 ** 50, -4096, "4096", None, 4097],
    "checksum": ["yes", None],
    "tier": ["tape", 3],
    "store_id": ["x", None, 5],
    "shard_paths": [["../../etc"], ["/etc"], [], "shards/00000", [3]],
    "layout.total": [-5, 10 ** 20, "1", None],
    "layout.shard_size": [1, -1],
    "layout.num_shards": [0, -1, 10 ** 9, 2.5],
    "layout.page_elems": [-1, 2 ** 40, 7],
    "layout.leaves.0.shape": [[-3000], [2 ** 60], ["a"], None],
    "layout.leaves.0.offset": [5, -1],
    "layout.leaves.0.dtype": ["int8", None],
    "layout.leaves": [[], None, "x"],
    "optimizer.kind": ["rmsprop", None],
    "optimizer": [None, {"bogus": 1}],
}
_MANIFEST_MUTATIONS = {
    "version": [-1, "2", None, 2 ** 40, 3],
    "store": ["0" * 32, None],
    "shard": [1, -1, "0"],
    "checksums.0.param": [[1, 2], "x", [-1] * 3],
    "checksums.0": ["x"],
    "checksums": [{"7": {}}, "x"],
}


def _set(data, dotted, value):
    keys = dotted.split(".")
    for key in keys[:-1]:
        data = data[int(key)] if isinstance(data, list) else data[key]
    data[int(keys[-1]) if isinstance(data, list) else keys[-1]] = value


def test_every_metadata_field_is_checked(tmp_path):
    make_store(tmp_path / "s").close()
    meta_path = tmp_path / "s" / "nsp_store.json"
    manifest_path = tmp_path / "s" / "shards" / "00000" / "MANIFEST.json"
    cases = [(meta_path, k, v) for k, vs in _META_MUTATIONS.items() for v in vs]
    cases += [(manifest_path, k, v) for k, vs in _MANIFEST_MUTATIONS.items() for v in vs]
    for path, key, value in cases:
        good = path.read_text()
        data = json.loads(good)
        _set(data, key, value)
        path.write_text(json.dumps(data))
        before = files_of(tmp_path)
        try:
            with pytest.raises(storage.StoreError) as err:
                storage.open(tmp_path / "s").close()
                pytest.fail(f"{path.name}: {key} = {value!r} was accepted")
            field = key.split(".")[-1] if not key.split(".")[-1].isdigit() else key.split(".")[-2]
            message = str(err.value)
            assert (field in message or key.split(".")[0] in message or "belongs to" in message
                    or "pages" in message), (key, value, message)
            assert files_of(tmp_path) == before, (key, value)  # nothing written
        finally:
            path.write_text(good)
    with storage.open(tmp_path / "s") as store:  # the untouched store still opens
        assert store.version == 2


# ---- a checksum knows which page it guards ----------------------------------------------------------------------

def test_a_page_from_the_other_slot_or_place_is_damage(tmp_path):
    make_store(tmp_path / "s", steps=2).close()  # version 2 in slot 0, version 1 in slot 1
    shard = tmp_path / "s" / "shards" / "00000"
    live, twin = shard / "slot0" / "mu" / "c" / "0", shard / "slot1" / "mu" / "c" / "0"
    shutil.copyfile(twin, live)  # a valid page of version 1 over its twin of version 2
    with storage.open(tmp_path / "s") as store:
        problems = store.verify()["problems"]
        assert len(problems) == 1 and "slot0/mu/c/0" in problems[0] and "not the page written" in problems[0]
        with pytest.raises(storage.StoreError, match="slot0/mu/c/0.*not the page written"):
            store.update(grad(3, store.layout), version=2, lr=0.01, step=3)
        assert store.version == 2

    make_store(tmp_path / "t", steps=2).close()
    pages = tmp_path / "t" / "shards" / "00000" / "slot0" / "param" / "c"
    a, b = (pages / "0").read_bytes(), (pages / "1").read_bytes()
    assert a != b
    (pages / "0").write_bytes(b)  # two intact pages swapped
    (pages / "1").write_bytes(a)
    with storage.open(tmp_path / "t") as store:
        problems = store.verify()["problems"]
        assert len(problems) == 2 and all("not the page written" in p for p in problems)
        with pytest.raises(storage.StoreError, match="not the page written"):
            store.update(grad(3, store.layout), version=2, lr=0.01, step=3)


def test_a_copy_keeps_where_each_optimizer_run_began(tmp_path):
    """``restarts.json`` (the versions ``restart`` began afresh at) goes with the copy: without it the copy would
    count its updates from version 0 (``base_version``) and a resumed optimizer would take the wrong step count."""
    with make_store(tmp_path / "a") as store:
        store.restart(params(), ADAM)  # version 3: a new optimizer run
        store.update(grad(1, store.layout), version=3, lr=0.01, step=1)
        assert store.base_version() == 3
    assert cli(["store", "copy", str(tmp_path / "a"), str(tmp_path / "copy")]) == 0
    with storage.open(tmp_path / "copy") as copy:
        assert copy.version == 4 and copy.restarts() == [3] and copy.base_version() == 3
