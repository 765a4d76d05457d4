"""Checkpoints from the storage tier: hard-link snapshots, bit-exact restore, orbax CheckpointManager, export."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import nsp.storage as storage
from nsp.storage import checkpoint as ckpt
from nsp.storage.export import path_keys
from nsp.storage.placement import Placer

PAGE = 16 * 1024
STATES = ("param", "mu", "nu")
SPEC = storage.OptimizerSpec("adamw", weight_decay=0.01)


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {"kernel": jnp.asarray(rng.standard_normal((300, 400)), jnp.float32),
                  "bias": jnp.asarray(rng.standard_normal(400), jnp.float32)},
        "blocks": [jnp.asarray(rng.standard_normal((150, 200)), jnp.float32),
                   jnp.asarray(rng.standard_normal((77,)), jnp.bfloat16)],
    }


def grad_for(step, layout):
    g = np.random.default_rng(1000 + step).standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0.0
    return g


def lr_for(step):
    return 1e-2 / step


def new_store(path, tier="file", num_shards=2):
    store = storage.open(None if tier == "memory" else path, tier=tier, num_shards=num_shards, page_bytes=PAGE)
    store.initialize(make_params(), SPEC)
    return store


def step(store, version):
    """The update that reads ``version`` and commits ``version + 1``; returns the new params."""
    return store.update(grad_for(version + 1, store.layout), version=version, lr=lr_for(version + 1),
                        step=version + 1)["params"]


def read_all(store):
    return {s: store.read(s) for s in STATES}


def plain_read(snapshot_dir, state, num_shards):
    """The padded flat vector of ``state``, with tensorstore alone (no nsp code)."""
    parts = []
    for i in range(num_shards):
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                       "path": str(Path(snapshot_dir) / "shards" / f"{i:05d}" / state)}}
                      ).result()
        parts.append(arr.read().result())
    return np.concatenate(parts)


def page_files(directory):
    return sorted(p for p in Path(directory).rglob("c/*") if p.name.isdigit())


def test_snapshot_is_frozen_and_restore_is_bit_exact(tmp_path):
    with new_store(tmp_path / "live") as live:
        for v in range(3):
            step(live, v)
        v3 = read_all(live)
        info = ckpt.snapshot_store(live, tmp_path / "snap")
        assert info["version"] == 3 and info["method"] == "link" and info["copied_bytes"] == 0
        step(live, 3)
        v4_live = read_all(live)
        step(live, 4)
        assert live.version == 5
        # The live store moved on twice (both slots rewritten); the snapshot still holds version 3.
        for s in STATES:
            np.testing.assert_array_equal(plain_read(tmp_path / "snap", s, 2), v3[s], err_msg=s)
            assert not np.array_equal(live.read(s), v3[s])
        with ckpt.restore_store(tmp_path / "snap", tmp_path / "restored") as restored:
            assert restored.version == 3 and restored.layout == live.layout and restored.optimizer == SPEC
            for s in STATES:
                np.testing.assert_array_equal(restored.read(s), v3[s], err_msg=s)
            # The next update from the restored store is the live store's 4th update, bit for bit.
            np.testing.assert_array_equal(step(restored, 3), v4_live["param"])
            for s in STATES:
                np.testing.assert_array_equal(restored.read(s), v4_live[s], err_msg=s)
        # Updating the restored store (whose pages are links into the snapshot) left the snapshot alone too.
        for s in STATES:
            np.testing.assert_array_equal(plain_read(tmp_path / "snap", s, 2), v3[s], err_msg=s)
    # A restored store is an ordinary store: it reopens at its version.
    with storage.open(tmp_path / "restored", tier="file", num_shards=2, page_bytes=PAGE) as again:
        assert again.version == 4


def test_snapshot_is_hard_links_and_copies_nothing(tmp_path):
    with new_store(tmp_path / "live") as live:
        step(live, 0)
        slot = live.version % 2
        live_pages = [p for shard in live.shard_paths for p in page_files(shard / f"slot{slot}")]
        info = ckpt.snapshot_store(live, tmp_path / "snap")
        snap_pages = page_files(tmp_path / "snap")
        assert len(snap_pages) == len(live_pages) == 2 * 3 * live.layout.pages_per_shard
        assert info["linked_files"] == len(snap_pages)
        assert info["linked_bytes"] == sum(p.stat().st_size for p in snap_pages)
        assert info["copied_bytes"] == 0 and info["reflinked_bytes"] == 0 and info["fallback_reason"] is None
        shard0 = live.shard_paths[0] / f"slot{slot}" / "mu" / "c" / "3"
        snap0 = tmp_path / "snap" / "shards" / "00000" / "mu" / "c" / "3"
        assert os.stat(shard0).st_ino == os.stat(snap0).st_ino
        assert all(p.stat().st_nlink == 2 for p in snap_pages)
        # Two updates later the store has replaced that page (rename: a new inode); the snapshot keeps the old.
        step(live, 1)
        step(live, 2)
        assert os.stat(shard0).st_ino != os.stat(snap0).st_ino
        assert os.stat(snap0).st_nlink == 1
        # A page nothing else links is rewritten in place (its blocks are allocated already): same inode.
        replaced = os.stat(shard0).st_ino
        step(live, 3)
        step(live, 4)
        assert os.stat(shard0).st_ino == replaced and os.stat(shard0).st_nlink == 1
        # SNAPSHOT.json lists every file with its size, and the store metadata travels with it.
        record = json.loads((tmp_path / "snap" / "SNAPSHOT.json").read_text())
        assert record["version"] == 1 and record["layout"]["num_shards"] == 2
        assert {f["path"] for f in record["files"]} >= {str(p.relative_to(tmp_path / "snap")) for p in snap_pages}
        assert json.loads((tmp_path / "snap" / "nsp_store.json").read_text())["layout"] == live.layout.to_json()


def test_snapshot_copies_when_links_fail(tmp_path, recwarn):
    with new_store(tmp_path / "live") as live:
        step(live, 0)
        expected = read_all(live)
        copy_info = ckpt.snapshot_store(live, tmp_path / "copy", mode="copy")
        assert copy_info["method"] in ("copy", "reflink") and copy_info["linked_files"] == 0
        assert all(p.stat().st_nlink == 1 for p in page_files(tmp_path / "copy"))
        shm = Path("/dev/shm")
        if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("no second file system (/dev/shm) to provoke EXDEV")
        other = Path(tempfile.mkdtemp(dir=shm))
        try:
            info = ckpt.snapshot_store(live, other / "snap")
            assert info["linked_files"] == 0 and info["method"] in ("copy", "reflink")
            assert "EXDEV" in info["fallback_reason"] and "another file system" in info["fallback_reason"]
            assert any("pages were copied" in str(w.message) for w in recwarn)
            with pytest.raises(storage.StoreError, match="cannot hard-link"):
                ckpt.snapshot_store(live, other / "strict", mode="link")
            assert not (other / "strict").exists()  # a failed snapshot leaves nothing behind
            step(live, 1)
            for s in STATES:
                np.testing.assert_array_equal(plain_read(other / "snap", s, 2), expected[s])
                np.testing.assert_array_equal(plain_read(tmp_path / "copy", s, 2), expected[s])
            # And back across file systems: restore copies too.
            with ckpt.restore_store(other / "snap", tmp_path / "restored") as restored:
                assert restored.restore_info["linked_files"] == 0
                for s in STATES:
                    np.testing.assert_array_equal(restored.read(s), expected[s])
        finally:
            shutil.rmtree(other, ignore_errors=True)


def test_memory_tier_snapshot_restores_into_both_tiers(tmp_path):
    with new_store(None, tier="memory") as mem:
        step(mem, 0)
        step(mem, 1)
        v2 = read_all(mem)
        info = ckpt.snapshot_store(mem, tmp_path / "snap")
        assert info["method"] == "tensorstore" and info["version"] == 2
        next_params = step(mem, 2)
        v3 = read_all(mem)
    for s in STATES:
        np.testing.assert_array_equal(plain_read(tmp_path / "snap", s, 2), v2[s])
    with ckpt.restore_store(tmp_path / "snap", tmp_path / "as_file", tier="file") as as_file, \
            ckpt.restore_store(tmp_path / "snap", tier="memory") as as_mem:
        for restored in (as_file, as_mem):
            assert restored.version == 2
            for s in STATES:
                np.testing.assert_array_equal(restored.read(s), v2[s])
            np.testing.assert_array_equal(step(restored, 2), next_params)
            for s in STATES:
                np.testing.assert_array_equal(restored.read(s), v3[s])
        # And a file-tier snapshot goes back into memory.
        ckpt.snapshot_store(as_file, tmp_path / "snap3")
    with ckpt.restore_store(tmp_path / "snap3", tier="memory") as again:
        assert again.version == 3
        np.testing.assert_array_equal(again.read("nu"), v3["nu"])


def test_checkpoint_manager_keeps_n_and_leaves_the_live_store(tmp_path):
    manager = ckpt.make_checkpoint_manager(tmp_path / "ckpts", max_to_keep=2)
    expected = {}
    with new_store(tmp_path / "live") as live:
        for s in range(1, 6):
            step(live, s - 1)
            expected[s] = read_all(live)
            out = ckpt.save_checkpoint(manager, s, live, {"step": jnp.asarray(s)}, {"step": s})
            assert out["saved"] and out["version"] == s and out["snapshot"]["method"] == "link"
        assert manager.all_steps() == [4, 5]
        assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["4", "5"]
        # The deleted checkpoints took only their links: the live store reads as before...
        for s in STATES:
            np.testing.assert_array_equal(live.read(s), expected[5][s])
        # ... its committed pages are linked once more (by step 5), and nothing else holds them.
        slot = live.version % 2
        assert all(p.stat().st_nlink == 2 for shard in live.shard_paths for p in page_files(shard / f"slot{slot}"))
        step(live, 5)
    manager.close()
    # A fresh manager (a new process, say) restores the kept steps.
    manager = ckpt.make_checkpoint_manager(tmp_path / "ckpts", max_to_keep=2)
    store, train_state, meta = ckpt.restore_checkpoint(manager, 4, tmp_path / "r4", {"step": jnp.asarray(0)})
    with store:
        assert store.version == 4 and meta == {"step": 4} and int(train_state["step"]) == 4
        for s in STATES:
            np.testing.assert_array_equal(store.read(s), expected[4][s])
    manager.close()


def test_train_state_meta_round_trip_and_export(tmp_path):
    train_state = {
        "opt": {"count": jnp.asarray(3, jnp.int32), "residual": jnp.arange(10, dtype=jnp.float32) / 7},
        "data_position": np.asarray([12, 34], np.int64),
        "params_bf16": jnp.ones((4, 5), jnp.bfloat16) * 1.5,
    }
    meta = {"step": 3, "run": "tiny", "lr": 0.01, "nested": {"tokens": [1, 2, 3]}}
    manager = ckpt.make_checkpoint_manager(tmp_path / "ckpts", max_to_keep=3)
    with new_store(tmp_path / "live") as live:
        for v in range(3):
            step(live, v)
        expected = read_all(live)
        ckpt.save_checkpoint(manager, 3, live, train_state, meta)
        layout = live.layout
    template = {"opt": {"count": jnp.asarray(0, jnp.int32), "residual": jnp.zeros(10)},
                "data_position": np.zeros(2, np.int64), "params_bf16": jnp.zeros((4, 5), jnp.bfloat16)}
    store, restored_state, restored_meta = ckpt.restore_checkpoint(manager, None, tmp_path / "restored", template)
    with store:
        assert store.version == 3
        np.testing.assert_array_equal(store.read("param"), expected["param"])
    assert restored_meta == meta
    for got, want in zip(jax_leaves(restored_state), jax_leaves(train_state)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    manager.close()

    # Export: plain orbax reads the master params (fp32, original shapes) and the moments, no nsp involved.
    record = ckpt.export_checkpoint(tmp_path / "ckpts" / "3", tmp_path / "export")
    assert record["version"] == 3 and record["meta"] == meta
    params = ocp.StandardCheckpointer().restore(tmp_path / "export" / "params")
    moments = ocp.StandardCheckpointer().restore(tmp_path / "export" / "opt_state")
    originals = make_params()
    assert set(params) == {"dense", "blocks"} and set(params["blocks"]) == {"0", "1"}
    for leaf in layout.leaves:
        keys = path_keys(leaf.path)
        got = params
        for key in keys:
            got = got[key]
        assert got.dtype == np.float32 and got.shape == leaf.shape
        np.testing.assert_array_equal(np.asarray(got).ravel(), expected["param"][leaf.offset:leaf.offset + leaf.size])
        for s in ("mu", "nu"):
            m = moments[s]
            for key in keys:
                m = m[key]
            np.testing.assert_array_equal(np.asarray(m).ravel(), expected[s][leaf.offset:leaf.offset + leaf.size])
    assert params["dense"]["kernel"].shape == originals["dense"]["kernel"].shape
    assert params["blocks"]["1"].shape == originals["blocks"][1].shape  # a bf16 leaf, exported as fp32 master
    # The step's train state came along as its own orbax checkpoint.
    exported_state = ocp.StandardCheckpointer().restore(tmp_path / "export" / "train_state", template)
    np.testing.assert_array_equal(np.asarray(exported_state["data_position"]), [12, 34])


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_save_returns_with_the_snapshot_complete_even_when_async(tmp_path):
    manager = ckpt.make_checkpoint_manager(tmp_path / "ckpts", max_to_keep=2)
    with new_store(tmp_path / "live") as live:
        step(live, 0)
        v1 = read_all(live)
        ckpt.save_checkpoint(manager, 1, live, {"x": jnp.zeros(1000)}, {"step": 1}, wait=False)
        step(live, 1)  # right away, while orbax may still be writing the train state
        step(live, 2)
        manager.wait_until_finished()
    for s in STATES:
        np.testing.assert_array_equal(plain_read(tmp_path / "ckpts" / "1" / "store", s, 2), v1[s])
    manager.close()


def test_bad_input_gives_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(storage.StoreError, match="does not exist"):
        ckpt.restore_store(tmp_path / "nowhere", tmp_path / "r")
    with new_store(tmp_path / "live") as live:
        step(live, 0)
        ckpt.snapshot_store(live, tmp_path / "snap")
        # A snapshot needs an empty destination.
        with pytest.raises(storage.StoreError, match="not empty"):
            ckpt.snapshot_store(live, tmp_path / "snap")
        # A snapshot that fails half-way leaves nothing that could pass for a snapshot.
        calls = {"n": 0}
        real_place = Placer.place

        def failing_place(self, src, dst, size):
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError(28, "No space left on device")
            return real_place(self, src, dst, size)

        monkeypatch.setattr(Placer, "place", failing_place)
        with pytest.raises(OSError, match="No space left"):
            ckpt.snapshot_store(live, tmp_path / "half")
        monkeypatch.undo()
        assert not (tmp_path / "half").exists()
        # An uninitialized or closed store cannot be snapshotted.
        with storage.open(tmp_path / "empty", tier="file", num_shards=2, page_bytes=PAGE) as empty:
            with pytest.raises(storage.StoreError, match="holds no state"):
                ckpt.snapshot_store(empty, tmp_path / "e")
        # Restoring over the live store while it is open is refused, even with overwrite=True.
        with pytest.raises(storage.StoreError, match="open for writing"):
            ckpt.restore_store(tmp_path / "snap", tmp_path / "live", overwrite=True)
    assert live.version is None  # closed
    with pytest.raises(storage.StoreError, match="closed"):
        ckpt.snapshot_store(live, tmp_path / "c")

    # A partial snapshot (no SNAPSHOT.json: interrupted before its last write) is refused.
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "snap", partial, copy_function=os.link)
    (partial / "SNAPSHOT.json").unlink()
    with pytest.raises(storage.StoreError, match="not a complete nsp snapshot: SNAPSHOT.json is missing"):
        ckpt.restore_store(partial, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    # A damaged one (a page gone) too, naming the file.
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "snap", damaged, copy_function=os.link)
    (damaged / "shards" / "00001" / "nu" / "c" / "2").unlink()
    with pytest.raises(storage.StoreError, match=r"damaged: shards/00001/nu/c/2 is missing"):
        ckpt.restore_store(damaged, tmp_path / "r")
    with pytest.raises(storage.StoreError, match="checkpoint step directory"):
        (tmp_path / "step" / "store").mkdir(parents=True)
        shutil.copy(tmp_path / "snap" / "SNAPSHOT.json", tmp_path / "step" / "store")
        ckpt.load_snapshot_info(tmp_path / "step")

    # Restoring onto an existing store needs overwrite=True; then it replaces it.
    with pytest.raises(storage.StoreError, match="already holds a store; pass overwrite=True"):
        ckpt.restore_store(tmp_path / "snap", tmp_path / "live")
    with storage.open(tmp_path / "live", tier="file", num_shards=2, page_bytes=PAGE) as live:
        step(live, 1)
        v1_next = read_all(live)
    with ckpt.restore_store(tmp_path / "snap", tmp_path / "live", overwrite=True) as back:
        assert back.version == 1
        step(back, 1)
        for s in STATES:
            np.testing.assert_array_equal(back.read(s), v1_next[s])
    # A non-empty directory that is no store is never deleted.
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("...")
    with pytest.raises(storage.StoreError, match="holds no nsp store: refusing to delete"):
        ckpt.restore_store(tmp_path / "snap", tmp_path / "precious", overwrite=True)
    assert (tmp_path / "precious" / "thesis.tex").exists()
    with pytest.raises(ValueError, match="memory tier"):
        ckpt.restore_store(tmp_path / "snap", tmp_path / "m", tier="memory")
    # Restore from a manager step that does not exist.
    manager = ckpt.make_checkpoint_manager(tmp_path / "ckpts")
    with pytest.raises(storage.StoreError, match="no checkpoint"):
        ckpt.restore_checkpoint(manager, None, tmp_path / "r")
    manager.close()
    # Export needs a fresh directory and a complete snapshot.
    with pytest.raises(storage.StoreError, match="SNAPSHOT.json is missing"):
        ckpt.export_checkpoint(partial, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(storage.StoreError, match="already exists"):
        ckpt.export_checkpoint(tmp_path / "snap", tmp_path / "precious")
