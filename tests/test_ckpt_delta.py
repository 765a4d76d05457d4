"""Checkpoint deltas (``nsp.storage.delta``, ``nsp ckpt delta|apply``): only what changed is sent, the rebuild is
NEW bit for bit and restores, and a wrong base or a damaged delta is refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import nsp.storage as storage
from nsp.cli import main
from nsp.storage import checkpoint as ckpt
from nsp.storage import delta
from test_checkpoint import PAGE, STATES, grad_for, lr_for, make_params, new_store, read_all, step


def train_state(s):
    return {"step": jnp.asarray(s, jnp.int32), "w": jnp.arange(64, dtype=jnp.float32) * s}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run's checkpoints at steps 1, 2, 3 (dense AdamW: every page changes each step), the state of each
    version, and the params of the update after step 3."""
    root = tmp_path_factory.mktemp("run")
    manager = ckpt.make_checkpoint_manager(root / "ckpt", max_to_keep=None)
    states = {}
    with new_store(root / "live") as live:
        for s in (1, 2, 3):
            step(live, s - 1)
            states[s] = read_all(live)
            ckpt.save_checkpoint(manager, s, live, train_state(s), {"step": s})
        next_params = step(live, 3)
    manager.close()
    return {"root": root, "ckpt": root / "ckpt", "states": states, "next_params": next_params}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dir_set(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir()}


def test_delta_two_steps_apart_rebuilds_new_bit_for_bit_and_restores(run, tmp_path):
    old, new = run["ckpt"] / "1", run["ckpt"] / "3"
    manifest = delta.make_delta(old, new, tmp_path / "d13")  # v -> v+2 in one delta
    assert (manifest.old.step, manifest.old.version, manifest.new.step, manifest.new.version) == (1, 1, 3, 3)
    assert manifest.old.store_id == manifest.new.store_id
    stats = manifest.stats
    # Dense Adam rewrites every page of every state; the small files that stay (zarr.json, ...) are not sent.
    layout = json.loads((new / "store" / "SNAPSHOT.json").read_text())["layout"]
    assert stats.total_pages == manifest.new.pages == 2 * 3 * layout["pages_per_shard"]
    assert stats.delta_pages == stats.total_pages
    assert 0 < stats.delta_files < stats.total_files and stats.delta_bytes < stats.full_bytes
    sent = {e.path for e in manifest.files if e.source == "delta"}
    assert "store/shards/00000/param/zarr.json" not in sent and "store/SNAPSHOT.json" in sent
    assert {p.relative_to(tmp_path / "d13" / "files").as_posix()
            for p in (tmp_path / "d13" / "files").rglob("*") if p.is_file()} == sent
    # The manifest on disk names both versions and every file's checksum.
    record = json.loads((tmp_path / "d13" / "DELTA.json").read_text())
    assert record["old"]["fingerprint"] == manifest.old.fingerprint and record["new"]["step"] == 3
    assert record["stats"]["ratio"] == pytest.approx(stats.delta_bytes / stats.full_bytes)
    assert all(len(f["sha256"]) == 64 for f in record["files"])

    (tmp_path / "rebuilt").mkdir()
    out = tmp_path / "rebuilt" / "3"
    delta.apply_delta(old, tmp_path / "d13", out)
    assert tree_bytes(out) == tree_bytes(new) and dir_set(out) == dir_set(new)
    assert sorted(p.name for p in (tmp_path / "rebuilt").iterdir()) == ["3"]  # no temporary left beside it
    # The rebuilt step restores like the original: same state, verified pages, the same next update.
    manager = ckpt.make_checkpoint_manager(tmp_path / "rebuilt", max_to_keep=None)
    store, state, meta = ckpt.restore_checkpoint(manager, 3, tmp_path / "restored", train_state(0))
    with store:
        assert store.version == 3 and meta == {"step": 3} and int(state["step"]) == 3
        assert store.verify()["problems"] == []
        for s in STATES:
            np.testing.assert_array_equal(store.read(s), run["states"][3][s], err_msg=s)
        np.testing.assert_array_equal(step(store, 3), run["next_params"])
    manager.close()


def test_frozen_leaves_send_only_their_pages(tmp_path):
    """A lazy store whose gradient is zero outside one leaf: only the pages holding that leaf change (bare
    snapshots this time, not checkpoint steps)."""
    spec = storage.OptimizerSpec("adam", lazy=True)
    with storage.open(tmp_path / "live", tier="file", num_shards=2, page_bytes=PAGE) as live:
        live.initialize(make_params(), spec)
        layout = live.layout
        trained = next(leaf for leaf in layout.leaves if leaf.path == "['blocks'][0]")
        for v in range(3):
            g = np.zeros(layout.padded_total, np.float32)
            g[trained.offset:trained.offset + trained.size] = grad_for(v + 1, layout)[:trained.size]
            live.update(g, version=v, lr=lr_for(v + 1), step=v + 1)
            if v in (0, 2):
                ckpt.snapshot_store(live, tmp_path / f"snap{v + 1}")
        v3 = read_all(live)
    manifest = delta.make_delta(tmp_path / "snap1", tmp_path / "snap3", tmp_path / "d")
    flat = np.arange(trained.offset, trained.offset + trained.size)
    expected = set(zip((flat // layout.shard_size).tolist(),
                       ((flat % layout.shard_size) // layout.page_elems).tolist()))
    sent = {(int(m[1]), int(m[3]), m[2]) for e in manifest.files if e.source == "delta" and e.page
            for m in [re.search(r"shards/(\d+)/(\w+)/c/(\d+)$", e.path)]}
    assert sent == {(sh, p, s) for sh, p in expected for s in STATES}
    assert manifest.stats.delta_pages == 3 * len(expected) < manifest.stats.total_pages / 2
    delta.apply_delta(tmp_path / "snap1", tmp_path / "d", tmp_path / "out", mode="copy")
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "snap3")
    with ckpt.restore_store(tmp_path / "out", tmp_path / "restored") as restored:
        assert restored.verify()["problems"] == []
        for s in STATES:
            np.testing.assert_array_equal(restored.read(s), v3[s])


def test_cli_prints_the_sizes_and_refuses_an_existing_out(run, tmp_path, capsys):
    old, new = str(run["ckpt"] / "2"), str(run["ckpt"] / "3")
    assert main(["ckpt", "delta", old, new, str(tmp_path / "d")]) == 0
    printed = capsys.readouterr().out
    m = re.search(r"delta: ([\d.]+) MB of ([\d.]+) MB \(([\d.]+)%\), (\d+) of (\d+) pages", printed)
    assert m, printed
    assert float(m[1]) <= float(m[2]) and int(m[4]) == int(m[5]) > 0
    assert main(["ckpt", "apply", str(run["ckpt"] / "2"), str(tmp_path / "d"), str(tmp_path / "out")]) == 0
    assert "checksums verified" in capsys.readouterr().out
    assert tree_bytes(tmp_path / "out") == tree_bytes(Path(new))
    assert main(["ckpt", "apply", old, str(tmp_path / "d"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "output directory" in err and "already exists" in err
    assert main(["ckpt", "delta", old, new, str(tmp_path / "d")]) == 1
    assert "delta directory" in capsys.readouterr().err
    assert main(["ckpt", "apply", old, str(tmp_path / "d")]) == 2
    assert "give BASE DELTA OUT" in capsys.readouterr().err
    assert main(["ckpt", "delta", str(tmp_path / "nowhere"), new, str(tmp_path / "d2")]) == 1
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "d2").exists()


def refused(base, delta_dir, out, match):
    with pytest.raises(storage.StoreError, match=match):
        delta.apply_delta(base, delta_dir, out)
    assert not Path(out).exists()
    assert not [p for p in Path(out).parent.iterdir() if p.name.startswith(f".{Path(out).name}.tmp")]


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)  # real copies: changing one must not change the original
    return dst


def test_apply_refuses_a_wrong_base(run, tmp_path):
    old, new = run["ckpt"] / "1", run["ckpt"] / "3"
    delta.make_delta(old, new, tmp_path / "d")
    out = tmp_path / "out"
    refused(run["ckpt"] / "2", tmp_path / "d", out, r"holds another step \(store \w+, step 2, version 2; the "
            r"delta needs store \w+, step 1, version 1\)")
    refused(new, tmp_path / "d", out, "holds another step")
    # Another store (same params, same step): the other store's id is named.
    manager = ckpt.make_checkpoint_manager(tmp_path / "other", max_to_keep=None)
    with new_store(tmp_path / "live2") as other:
        step(other, 0)
        ckpt.save_checkpoint(manager, 1, other, train_state(1), {"step": 1})
    manager.close()
    refused(tmp_path / "other" / "1", tmp_path / "d", out, "a checkpoint of another store")
    # The same store and step, but a file that differs (the step's meta rewritten): named.
    changed = copy_tree(old, tmp_path / "changed" / "1")
    (changed / "meta" / "metadata").write_text('{"step": 7}')
    refused(changed, tmp_path / "d", out, r"its files differ .*1 differ, e\.g\. meta/metadata")
    # A base page whose bytes rotted under an intact manifest (the fingerprint goes by the recorded CRC-32C):
    # caught when the rebuilt file is checked. The delta of a checkpoint to itself takes every page from the base.
    same = delta.make_delta(old, old, tmp_path / "same")
    assert same.stats.delta_pages == 0 and same.stats.delta_files == 0 and same.stats.delta_bytes == 0
    rotten = copy_tree(old, tmp_path / "rotten" / "1")
    kept = next(e for e in same.files if e.page and "/nu/" in e.path)
    with open(rotten / kept.path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))
    refused(rotten, tmp_path / "same", out, f"base {rotten} is damaged: page {re.escape(kept.path)} fails its "
            "checksum")
    refused(tmp_path / "nowhere", tmp_path / "d", out, "does not exist")
    refused(tmp_path / "d", tmp_path / "d", out, "is a checkpoint delta, not a checkpoint")
    refused(tmp_path / "d" / "files", tmp_path / "d", out, r"files/store is damaged: nsp_store\.json is missing")


def test_apply_refuses_a_damaged_delta(run, tmp_path):
    old, new = run["ckpt"] / "1", run["ckpt"] / "3"
    delta.make_delta(old, new, tmp_path / "good")
    manifest = delta.load_delta(tmp_path / "good")
    page = next(e for e in manifest.files if e.source == "delta" and e.page and "/mu/" in e.path)
    out = tmp_path / "out"

    flipped = copy_tree(tmp_path / "good", tmp_path / "flipped")
    with open(flipped / "files" / page.path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    refused(old, flipped, out, f"delta {flipped} is damaged: page {re.escape(page.path)} fails its checksum")

    missing = copy_tree(tmp_path / "good", tmp_path / "missing")
    (missing / "files" / page.path).unlink()
    refused(old, missing, out, f"page {re.escape(page.path)} is missing")

    short = copy_tree(tmp_path / "good", tmp_path / "short")
    with open(short / "files" / page.path, "r+b") as f:
        f.truncate(page.bytes - 1)
    refused(old, short, out, f"page {re.escape(page.path)} has {page.bytes - 1} bytes, expected {page.bytes}")

    truncated = copy_tree(tmp_path / "good", tmp_path / "truncated")
    text = (truncated / "DELTA.json").read_text()
    (truncated / "DELTA.json").write_text(text[:len(text) // 2])
    refused(old, truncated, out, "delta manifest .*DELTA.json is corrupt or truncated")

    (truncated / "DELTA.json").unlink()
    refused(old, truncated, out, "not a complete checkpoint delta: DELTA.json is missing")

    gutted = copy_tree(tmp_path / "good", tmp_path / "gutted")
    record = json.loads((gutted / "DELTA.json").read_text())
    del record["new"]
    (gutted / "DELTA.json").write_text(json.dumps(record))
    refused(old, gutted, out, "delta manifest .* is damaged")

    # The good delta still applies: none of the above touched it.
    delta.apply_delta(old, tmp_path / "good", out)
    assert tree_bytes(out) == tree_bytes(new)


def test_delta_refuses_what_is_not_a_checkpoint(run, tmp_path):
    with pytest.raises(storage.StoreError, match="already exists"):
        delta.make_delta(run["ckpt"] / "1", run["ckpt"] / "2", run["ckpt"] / "3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(storage.StoreError, match="is not an nsp checkpoint"):
        delta.make_delta(tmp_path / "empty", run["ckpt"] / "2", tmp_path / "d")
    # An unfinished snapshot inside a step (no SNAPSHOT.json in its store item's parts) is refused too.
    partial = copy_tree(run["ckpt"] / "2", tmp_path / "partial" / "2")
    (partial / "store" / "shards" / "00001" / "nu" / "c" / "0").unlink()
    with pytest.raises(storage.StoreError, match="damaged: shards/00001/nu/c/0 is missing"):
        delta.make_delta(run["ckpt"] / "1", partial, tmp_path / "d")
    assert sorted(os.listdir(tmp_path)) == ["empty", "partial"]  # no delta, no temporary
