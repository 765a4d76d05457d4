"""One-slot stores (``nsp.storage.open(..., slots=1)``): one copy of the state on disk and a redo journal.

Each update is compared bit for bit with a two-slot store given the same gradients; real processes are killed
(SIGKILL, through the fault-injecting backend's variables) inside the journal's write, inside an update's window,
between a window's journal record and its renames, at the commit, and inside recovery itself; the reopened store
must hold version t or t+1 whole, exactly the two-slot store's bytes of that version. Tiny stores: pages of 4 KiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from nsp import storage
from nsp.storage import OptimizerSpec, StoreError
from nsp.storage.restore import restore_store
from nsp.storage.snapshot import snapshot_store

PAGE = 4096  # 1024 fp32 per page
SPEC = OptimizerSpec("adamw", weight_decay=0.01)
STEPS = 4


def make_params():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((40, 70)).astype(np.float32), "b": rng.standard_normal(1500).astype(np.float32)}


def grad_for(step, layout):
    return np.random.default_rng(100 + step).standard_normal(layout.padded_total).astype(np.float32)


def compressed_for(step, layout):
    """Top-K-like pairs: per shard, sorted shard positions and their values."""
    rng = np.random.default_rng(200 + step)
    idx = [np.sort(rng.choice(layout.shard_size, 150, replace=False)).astype(np.int32)
           for _ in range(layout.num_shards)]
    return idx, [rng.standard_normal(150).astype(np.float32) for _ in range(layout.num_shards)]


def do_step(store, step):
    if step % 2:
        return store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
    idx, val = compressed_for(step, store.layout)
    return store.update(indices=idx, values=val, version=step - 1, lr=0.01, step=step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every version's p, m, v as a two-slot store computes them."""
    path = tmp_path_factory.mktemp("ref") / "store"
    states = []
    with storage.open(path, num_shards=2, page_bytes=PAGE) as store:
        store.initialize(make_params(), SPEC)
        states.append({s: store.read(s) for s in ("param", "mu", "nu")})
        for step in range(1, STEPS + 1):
            do_step(store, step)
            states.append({s: store.read(s) for s in ("param", "mu", "nu")})
    return states


def assert_version_whole(store, reference, version):
    for state in ("param", "mu", "nu"):
        np.testing.assert_array_equal(store.read(state), reference[version][state], err_msg=f"{state} v{version}")


def open_one(path, **kw):
    kw.setdefault("num_shards", 2)
    kw.setdefault("page_bytes", PAGE)
    kw.setdefault("redo_window", 2)
    return storage.open(path, slots=1, **kw)


def test_one_slot_steps_equal_two_slot_steps(tmp_path, reference):
    with open_one(tmp_path / "s") as store:
        store.initialize(make_params(), SPEC)
        assert store.layout.pages_per_shard > 2  # several windows per update
        for step in range(1, STEPS + 1):
            out = do_step(store, step)
            np.testing.assert_array_equal(out["params"], reference[step]["param"])
        assert_version_whole(store, reference, STEPS)
        assert store.verify()["problems"] == []
        assert store.held_versions() == [STEPS]  # no replay: one copy
    meta = json.loads((tmp_path / "s" / "nsp_store.json").read_text())
    assert meta["slots"] == 1
    shard = tmp_path / "s" / "shards" / "00000"
    assert not (shard / "slot1").exists() and not (shard / "redo.journal").exists()
    assert sorted(os.listdir(shard / "slot0" / "param" / "c")) == [str(i) for i in range(3)]
    with storage.open(tmp_path / "s") as store:  # reopening knows it keeps one slot
        assert store.slots == 1 and store.version == STEPS
        assert_version_whole(store, reference, STEPS)
        with pytest.raises(RuntimeError, match=f"version {STEPS - 1}"):
            do_step(store, STEPS)  # a replay of the last step: a one-slot store keeps no version before
    with pytest.raises(StoreError, match="slots=1, opened with slots=2"):
        storage.open(tmp_path / "s", slots=2)


def test_one_slot_refuses_what_it_cannot_keep(tmp_path):
    with pytest.raises(ValueError, match="file tier"):
        storage.open(None, tier="memory", slots=1)
    with pytest.raises(ValueError, match="slots must be 1 or 2"):
        storage.open(tmp_path / "x", slots=3)
    with open_one(tmp_path / "s") as store:
        store.initialize(make_params(), SPEC)
        with pytest.raises(StoreError, match="one version slot"):
            store.restart(make_params(), SPEC)


def test_required_bytes_counts_one_slot(tmp_path):
    layout = storage.Layout.from_tree(jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"w": np.zeros((1024, 1 << 20), np.float32)}),
        num_shards=1)
    two = storage.required_bytes(layout, SPEC, checkpoints=0)
    one = storage.required_bytes(layout, SPEC, checkpoints=0, slots=1, redo_window=16)
    state = 3 * 1024 * (1 << 22)
    # One slot, plus the journal (the gradient: one state's size at most) and 16 pages of 3 states in flight.
    assert one < 0.7 * two
    # (each page file also takes a 4 KiB block for its checksum trailer: 12 MiB here, and metadata)
    assert state + state // 3 + 16 * 3 * (4 << 20) <= one < state + state // 3 + 16 * 3 * (4 << 20) + (32 << 20)
    with_ckpt = storage.required_bytes(layout, SPEC, checkpoints=1, slots=1, redo_window=16)
    assert with_ckpt - one >= state  # a live checkpoint keeps one version of the pages


# ---- kills ---------------------------------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_oneslot import do_step, open_one
    from pathlib import Path
    path = Path({path!r})
    with open_one(path) as store:
        for step in range(store.version + 1, {steps} + 1):
            do_step(store, step)
""")


def run_worker(path, env_extra, steps=STEPS):
    code = WORKER.format(tests=os.path.dirname(__file__), path=str(path), steps=steps)
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def killed_store(tmp_path, env_extra, reference):
    path = tmp_path / "s"
    with open_one(path) as store:
        store.initialize(make_params(), SPEC)
    proc = run_worker(path, env_extra)
    assert proc.returncode == -9, proc.stderr[-2000:]
    return path


# Each kill point: (variable, occurrence). Two shards of 3 pages, windows of 2 pages: an update makes 2 windows
# per shard (switches), 9 page writes per shard, one journal per shard.
KILLS = [
    ("NSP_DEBUG_KILL_IN_JOURNAL", 1), ("NSP_DEBUG_KILL_IN_JOURNAL", 4),  # halfway through a shard's journal
    ("NSP_DEBUG_KILL_AFTER_WRITES", 4), ("NSP_DEBUG_KILL_AFTER_WRITES", 14),  # inside a window, steps 1 and 2
    ("NSP_DEBUG_KILL_AT_SWITCH", 2), ("NSP_DEBUG_KILL_AT_SWITCH", 7),  # record durable, renames not done
    ("NSP_DEBUG_KILL_AT_COMMIT", 1), ("NSP_DEBUG_KILL_AT_COMMIT", 4),  # every page in, manifest not yet
]


@pytest.mark.parametrize("var,at", KILLS)
def test_a_kill_leaves_t_or_t_plus_one_whole(tmp_path, reference, var, at):
    path = killed_store(tmp_path, {var: str(at)}, reference)
    with storage.open(path) as store:  # recovery
        version = store.version
        assert_version_whole(store, reference, version)
        assert store.verify()["problems"] == []
        for step in range(version + 1, STEPS + 1):  # and it steps on, bit for bit
            do_step(store, step)
        assert_version_whole(store, reference, STEPS)
    shard = path / "shards" / "00000" / "slot0" / "param" / "c"
    assert sorted(os.listdir(shard)) == ["0", "1", "2"]  # no scratch left behind


# Shard 0's journal of step 2 is durable (its step waits in the barrier for shard 1's); shard 1 is halfway through
# writing its own: the kill comes then. Made so by stepping shard 0's engine alone, not by a race.
HALF_JOURNALED = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from test_oneslot import grad_for, open_one
    from nsp.storage.update import split_grads
    path = Path({path!r})
    with open_one(path) as store:
        kw = split_grads(store.layout, grad_for(2, store.layout), None, None)
        hyper = store.optimizer.hyper_attrs()
        threading.Thread(target=lambda: store._engines[0].step(1, 0.01, 2, hyper, **kw[0]), daemon=True).start()
        while not (path / "shards" / "00000" / "redo.journal").exists():
            time.sleep(0.01)
        (path / "shards" / "00001" / "redo.journal.tmp").write_bytes(b"half a journal")
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_kill_before_every_shard_journaled_keeps_version_t(tmp_path, reference):
    """A kill after one shard's journal became durable but before another's: no page was switched in anywhere, so
    the store stays at t (the durable journal is dropped): redone, it would take shard 0 alone to t+1."""
    path = tmp_path / "s"
    with open_one(path) as store:
        store.initialize(make_params(), SPEC)
        do_step(store, 1)
    code = HALF_JOURNALED.format(tests=os.path.dirname(__file__), path=str(path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (path / "shards" / "00000" / "redo.journal").exists()
    assert not (path / "shards" / "00001" / "redo.journal").exists()
    with storage.open(path) as store:
        assert store.version == 1
        assert_version_whole(store, reference, 1)
        assert store.verify()["problems"] == []
        for step in range(2, STEPS + 1):
            do_step(store, step)
        assert_version_whole(store, reference, STEPS)
    for shard in ("00000", "00001"):
        assert not [p for p in os.listdir(path / "shards" / shard) if p.startswith("redo.journal")]


def test_a_journal_with_windows_recorded_beside_a_shard_without_one_is_damage(tmp_path, reference):
    """Shard 0 recorded a window (pages of t+1 are in) while shard 1, at the same version, holds no journal: that
    cannot come of a kill (the barrier), so the open refuses, naming both, and changes nothing."""
    path = killed_store(tmp_path, {"NSP_DEBUG_KILL_AT_SWITCH": "1"}, reference)  # step 1: a record, no renames
    for shard in ("00000", "00001"):
        assert (path / "shards" / shard / "redo.journal").exists()
    # The killed shard recorded a window; the other may have too. The larger journal holds a record (equal
    # gradients, equal headers: a journal grows only by its records).
    recorded = max(("00000", "00001"), key=lambda s: (path / "shards" / s / "redo.journal").stat().st_size)
    other = "00001" if recorded == "00000" else "00000"
    (path / "shards" / other / "redo.journal").unlink()
    before = (path / "shards" / recorded / "redo.journal").read_bytes()
    with pytest.raises(StoreError, match=rf"shard\(s\) \[{int(recorded)}\] switched in pages of version 1 .* "
                                         rf"shard\(s\) \[{int(other)}\] hold no journal"):
        storage.open(path)
    assert (path / "shards" / recorded / "redo.journal").read_bytes() == before


def test_a_journal_whose_gradient_is_damaged_is_refused_not_redone(tmp_path, reference):
    """A flipped bit in a journal's gradient: recovery would redo a wrong update, so the open refuses it, naming
    the journal (the look at every shard's journal before recovery skips that checksum; the redo does not)."""
    path = killed_store(tmp_path, {"NSP_DEBUG_KILL_AT_SWITCH": "1"}, reference)  # step 1: dense, journals whole
    journal = path / "shards" / "00000" / "redo.journal"
    data = bytearray(journal.read_bytes())
    data[4096] ^= 0x01  # inside the dense gradient (header < 4 KiB, gradient 4 bytes x a shard's elements)
    journal.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"redo journal .*00000/redo.journal fails its checksum"):
        storage.open(path)


@pytest.mark.parametrize("kill_in_recovery", [1, 3])
def test_a_kill_inside_recovery_is_recovered(tmp_path, reference, kill_in_recovery):
    path = killed_store(tmp_path, {"NSP_DEBUG_KILL_AFTER_WRITES": "12"}, reference)  # step 2, first window
    assert (path / "shards" / "00000" / "redo.journal").exists()
    proc = run_worker(path, {"NSP_DEBUG_KILL_AFTER_WRITES": str(kill_in_recovery)}, steps=0)  # open = recover
    assert proc.returncode == -9, proc.stderr[-2000:]
    with storage.open(path) as store:
        assert store.version in (1, 2)
        assert_version_whole(store, reference, store.version)


# ---- checkpoints ---------------------------------------------------------------------------------------------------


def test_snapshot_of_a_one_slot_store_keeps_its_version(tmp_path, reference):
    """A snapshot hard-links the only slot's pages; the updates after it switch fresh files in by rename, so the
    linked files keep the snapshot's bytes (they are never written in place)."""
    with open_one(tmp_path / "s") as store:
        store.initialize(make_params(), SPEC)
        do_step(store, 1)
        info = snapshot_store(store, tmp_path / "snap", mode="link")
        linked = tmp_path / "snap" / "shards" / "00000" / "param" / "c" / "0"
        assert os.stat(linked).st_nlink == 2
        before = linked.read_bytes()
        for step in (2, 3):
            do_step(store, step)
        assert linked.read_bytes() == before and os.stat(linked).st_nlink == 1
        assert_version_whole(store, reference, 3)
    assert info["version"] == 1
    with restore_store(tmp_path / "snap", tmp_path / "r", mode="link") as restored:
        assert restored.slots == 1 and restored.version == 1
        assert_version_whole(restored, reference, 1)
        do_step(restored, 2)  # steps on from the restored version; the snapshot stays as it was
        assert_version_whole(restored, reference, 2)
        assert restored.verify()["problems"] == []
    assert linked.read_bytes() == before


def test_one_slot_checkpoint_export_verify_and_plain_tensorstore(tmp_path, reference, capsys):
    """What a two-slot store offers around its state works on a one-slot store too: tensorstore alone reads the
    committed version (in slot 0, ``format.slot_of``), ``nsp store verify`` checks it and finds a flipped bit, an
    orbax checkpoint of it restores bit for bit to a one-slot store that steps on, and ``nsp ckpt export`` writes
    the master and moments that plain orbax reads."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    from nsp.cli import main as nsp_main
    from nsp.storage import checkpoint as ckpt
    from nsp.storage.export import path_keys
    from nsp.storage.format import slot_of

    run = tmp_path / "run"
    manager = ckpt.make_checkpoint_manager(run / "ckpt", max_to_keep=2)
    with open_one(run / "store") as store:
        store.initialize(make_params(), SPEC)
        do_step(store, 1)
        ckpt.save_checkpoint(manager, 1, store, {"data_position": np.asarray([7], np.int64)}, {"step": 1})
        do_step(store, 2)  # the checkpoint keeps version 1 while the store moves on
        layout, size, shard_dirs = store.layout, store.layout.shard_size, store.shard_paths
    manager.close()
    # No nsp code: tensorstore finds version 2 in slot 0 of each shard.
    assert slot_of(1, 2) == 0
    for i, shard_dir in enumerate(shard_dirs):
        assert json.loads((shard_dir / "MANIFEST.json").read_text())["version"] == 2
        for state in ("param", "mu", "nu"):
            arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(shard_dir / "slot0" / state)}}
                          ).result()
            assert arr.shape == (size,)
            np.testing.assert_array_equal(arr.read().result(), reference[2][state][i * size:(i + 1) * size])

    assert nsp_main(["store", "verify", str(run / "store")]) == 0
    assert "version 2" in capsys.readouterr().out
    bad = shard_dirs[1] / "slot0" / "nu" / "c" / "0"
    data = bytearray(bad.read_bytes())
    data[64] ^= 1
    bad.write_bytes(bytes(data))
    assert nsp_main(["store", "verify", str(run / "store")]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "'nu', page 0 of shard" in out and "1 corrupt page(s)" in out

    # The checkpoint was linked before the flip was written (to a fresh file: the update renamed its pages in).
    manager = ckpt.make_checkpoint_manager(run / "ckpt", max_to_keep=2)
    restored, state, meta = ckpt.restore_checkpoint(manager, 1, tmp_path / "restored",
                                                    {"data_position": np.zeros(1, np.int64)})
    manager.close()
    with restored:
        assert restored.slots == 1 and restored.version == 1 and meta == {"step": 1}
        np.testing.assert_array_equal(np.asarray(state["data_position"]), [7])
        assert_version_whole(restored, reference, 1)
        do_step(restored, 2)
        assert_version_whole(restored, reference, 2)
        assert restored.verify()["problems"] == []

    assert nsp_main(["ckpt", "export", "--run-dir", str(run), "--step", "1", "--out", str(tmp_path / "x")]) == 0
    params = ocp.StandardCheckpointer().restore(tmp_path / "x" / "params")
    moments = ocp.StandardCheckpointer().restore(tmp_path / "x" / "opt_state")
    for leaf in layout.leaves:
        for state, tree in (("param", params), ("mu", moments["mu"]), ("nu", moments["nu"])):
            for key in path_keys(leaf.path):
                tree = tree[key]
            assert tree.shape == leaf.shape
            np.testing.assert_array_equal(np.asarray(tree).ravel(),
                                          reference[1][state][leaf.offset:leaf.offset + leaf.size])
