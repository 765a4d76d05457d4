"""Resharding a checkpoint's store: the state of N shards written by P processes, cut again into M shards for P'
processes, reads back bit for bit in every tier; the next update on the new cut equals the update on the old one;
a missing part is named and nothing is written; the offline command re-cuts the train state's flat vectors."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import nsp.storage as storage
from nsp.optim import TopKState
from nsp.storage import StoreError
from nsp.storage.reshard import ItemSource, layout_for, process_shards, restore_resharded, write_snapshot
from nsp.storage.reshard_checkpoint import reshard_checkpoint
from nsp.storage.snapshot import snapshot_store
from nsp.train.reshard import FlatRecut

PAGE = 16 * 1024
STATES = ("param", "mu", "nu")
SPEC = storage.OptimizerSpec("adamw", weight_decay=0.01)


def make_params():
    rng = np.random.default_rng(0)
    # 30,031 elements: no shard count used here divides it, so every cut pads differently.
    return {"a": jnp.asarray(rng.standard_normal((100, 300)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(31), jnp.float32)}


def update(store, version):
    rng = np.random.default_rng(100 + version)
    g = rng.standard_normal(store.layout.padded_total).astype(np.float32)
    g[store.layout.total:] = 0.0
    return store.update(g, version=version, lr=1e-2, step=version + 1)


@pytest.fixture(scope="module")
def item(tmp_path_factory):
    """A store item as a 2-process run leaves it (``process-0000{0,1}``, 2 shards each, version 2), and the state
    it holds (the real elements of each state)."""
    base = tmp_path_factory.mktemp("reshard")
    store = storage.open(base / "store", tier="file", num_shards=4, page_bytes=PAGE)
    store.initialize(make_params(), SPEC)
    for v in range(2):
        update(store, v)
    total = store.layout.total
    expected = {s: store.read(s)[:total].copy() for s in STATES}
    store.close()
    for p in range(2):  # each process snapshots only its own shards
        with storage.open(base / "store", shards=process_shards(4, 2, p)) as part:
            snapshot_store(part, base / "item" / f"process-{p:05d}")
    return base / "item", expected


def assert_holds(stores, expected):
    """Partial stores that together hold every shard hold ``expected``'s real elements of each state, bit for bit,
    and zeros in the padding."""
    total = stores[0].layout.total
    for s in STATES:
        flat = np.concatenate([st.read_shard(s, i) for st in stores for i in st.local_shards])
        assert not flat[total:].any(), "the padding must be zeros"
        np.testing.assert_array_equal(flat[:total], expected[s], err_msg=s)


@pytest.mark.parametrize("tier", ["memory", "file", "csd"])
@pytest.mark.parametrize("num_shards,processes", [(1, 1), (3, 3), (6, 2)])
def test_restore_on_another_layout_is_bit_exact(item, tmp_path, tier, num_shards, processes):
    item_dir, expected = item
    stores = []
    try:
        for p in range(processes):
            shards = process_shards(num_shards, processes, p) if processes > 1 else None
            stores.append(restore_resharded(item_dir, None if tier == "memory" else tmp_path / f"s{p}", num_shards,
                                            shards=shards, tier=tier))
        assert all(st.version == 2 and st.num_shards == num_shards for st in stores)
        assert stores[0].layout == layout_for(ItemSource(item_dir).layout, num_shards, PAGE)
        assert_holds(stores, expected)
    finally:
        for st in stores:
            st.close()
    assert not list(tmp_path.glob(".*reshard*")), "the staging snapshot is removed"


def test_next_update_on_the_new_cut_equals_the_old(item, tmp_path):
    """The update is elementwise: one more step on 3 shards gives what it gives on the checkpoint's 4."""
    item_dir, _ = item
    old = restore_resharded(item_dir, tmp_path / "old", 4)
    new = restore_resharded(item_dir, tmp_path / "new", 3)
    try:
        rng = np.random.default_rng(7)
        g = rng.standard_normal(old.layout.total).astype(np.float32)
        for st in (old, new):
            padded = np.zeros(st.layout.padded_total, np.float32)
            padded[:len(g)] = g
            st.update(padded, version=2, lr=1e-2, step=3)
        for s in STATES:
            np.testing.assert_array_equal(new.read(s)[:len(g)], old.read(s)[:len(g)], err_msg=s)
    finally:
        old.close()
        new.close()


def test_a_missing_part_is_named_and_nothing_is_written(item, tmp_path):
    item_dir, _ = item
    damaged = tmp_path / "item"
    shutil.copytree(item_dir / "process-00000", damaged / "process-00000")
    source = ItemSource(damaged)
    assert [(p["process"], p["present"], p["shards"]) for p in source.describe_parts()] == [
        (0, True, [0, 1]), (1, False, [2, 3])]
    with pytest.raises(StoreError, match=r"shard 2 of 4 .*process 1's part \(process-00001\)"):
        restore_resharded(damaged, tmp_path / "store", 1)
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob(".*"))
    # A new shard that needs only the part present can still be made.
    snap = write_snapshot(source, tmp_path / "half", 2, shards=[0])
    assert snap["local_shards"] == [0]
    with pytest.raises(StoreError, match="already exists"):
        write_snapshot(source, tmp_path / "half", 2, shards=[0])


def test_a_replaced_page_is_refused(item, tmp_path):
    """A page swapped for another valid page passes its own CRC trailer but not the manifest's record."""
    item_dir, _ = item
    shutil.copytree(item_dir, tmp_path / "item")
    pages = tmp_path / "item" / "process-00000" / "shards" / "00000" / "param" / "c"
    (pages / "0").unlink()
    shutil.copyfile(tmp_path / "item" / "process-00000" / "shards" / "00000" / "mu" / "c" / "0", pages / "0")
    with pytest.raises(StoreError, match="page 0 of param in shard 0"):
        restore_resharded(tmp_path / "item", tmp_path / "store", 2)


def test_flat_recut_of_the_topk_residual():
    total = 10
    same = FlatRecut(total, saved_shards=4, num_shards=6)  # padded 12 either way: nothing to do
    assert same.saved == same.new == 12 and same.saved_like("anything") == "anything"
    recut = FlatRecut(total, saved_shards=4, num_shards=7)  # padded 12 -> 14
    assert (recut.saved, recut.new) == (12, 14)
    template = {"x": (TopKState(jnp.zeros(14)), TopKState(jnp.zeros(0)))}
    like = recut.saved_like(template)
    assert like["x"][0].residual.shape == (12,) and like["x"][1].residual.shape == (0,)
    saved = {"x": (TopKState(jnp.arange(1, 13, dtype=jnp.float32).at[10:].set(0)), TopKState(jnp.zeros(0)))}
    out = recut(saved)
    np.testing.assert_array_equal(out["x"][0].residual, np.r_[np.arange(1, 11), np.zeros(4)].astype(np.float32))


def test_offline_reshard_of_a_checkpoint_step(item, tmp_path):
    """``reshard_checkpoint``: the store split into the new processes' parts, a flat train-state vector re-cut,
    the meta's counts updated; the result is a checkpoint orbax's manager lists."""
    item_dir, expected = item
    step = tmp_path / "ckpt" / "5"
    step.mkdir(parents=True)
    shutil.copytree(item_dir, step / "store")
    layout = ItemSource(step / "store").layout
    residual = np.zeros(layout.padded_total, np.float32)
    residual[:layout.total] = np.arange(layout.total)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(step / "train_state", {"opt_state": [{"residual": residual}, {"count": np.int32(3)}]})
    ckptr.wait_until_finished()
    (step / "meta").mkdir()
    (step / "meta" / "metadata").write_text(json.dumps({"step": 5, "num_shards": 4, "process_count": 2}))
    done = reshard_checkpoint(tmp_path / "ckpt", tmp_path / "out", 7)  # the newest step of a checkpoint dir
    assert (done["step"], done["from_shards"], done["from_processes"], done["num_shards"]) == (5, 4, 2, 7)
    assert done["train_state_recut"] == ["['opt_state'][0]['residual']"]
    new = layout_for(layout, 7, PAGE)
    got = ocp.StandardCheckpointer().restore(tmp_path / "out" / "5" / "train_state")
    assert got["opt_state"][0]["residual"].shape == (new.padded_total,)
    np.testing.assert_array_equal(got["opt_state"][0]["residual"][:layout.total], residual[:layout.total])
    assert not np.asarray(got["opt_state"][0]["residual"][layout.total:]).any()
    meta = json.loads((tmp_path / "out" / "5" / "meta" / "metadata").read_text())
    assert (meta["num_shards"], meta["process_count"]) == (7, 1)
    source = ItemSource(tmp_path / "out" / "5" / "store")
    assert source.layout.num_shards == 7
    for s in STATES:
        np.testing.assert_array_equal(source.read(s)[:layout.total], expected[s])
    with pytest.raises(StoreError, match="cannot be split evenly over 2"):
        reshard_checkpoint(step, tmp_path / "out2", 7, processes=2)
    assert not (tmp_path / "out2").exists()
    with pytest.raises(StoreError, match="already exists"):
        reshard_checkpoint(step, tmp_path / "out", 2)


def test_arrays_in_another_zarr_format_go_through_tensorstore(item, tmp_path, monkeypatch):
    """The page-by-page copy reads only the store's own page format; anything else is copied by tensorstore,
    bit for bit too."""
    item_dir, expected = item
    assert ItemSource(item_dir).raw_pages()
    monkeypatch.setattr(ItemSource, "raw_pages", lambda self: False)
    stores = [restore_resharded(item_dir, tmp_path / f"s{p}", 3, shards=[p]) for p in range(3)]
    try:
        assert_holds(stores, expected)
    finally:
        for st in stores:
            st.close()


def test_nsp_ckpt_reshard_command(item, tmp_path, capsys):
    from nsp.cli import main

    item_dir, expected = item
    shutil.copytree(item_dir, tmp_path / "ckpt" / "2" / "store")
    assert main(["ckpt", "reshard", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "--shards" in capsys.readouterr().err
    assert main(["ckpt", "reshard", str(tmp_path / "ckpt" / "2"), str(tmp_path / "out"), "--shards", "6",
                 "--processes", "3"]) == 0
    assert "4 shards on 2 process(es) -> 6 on 3" in capsys.readouterr().out
    parts = sorted(p.name for p in (tmp_path / "out" / "2" / "store").iterdir())
    assert parts == ["process-00000", "process-00001", "process-00002"]
    source = ItemSource(tmp_path / "out" / "2" / "store")
    np.testing.assert_array_equal(source.read("nu")[:source.layout.total], expected["nu"])
    assert main(["ckpt", "reshard", str(tmp_path / "ckpt" / "2"), str(tmp_path / "out"), "--shards", "2"]) == 1
    assert "already exists" in capsys.readouterr().err
