"""Labelled chunks of source for ``nsp train --task classify`` (``nsp.train.labels``), and the GPT's classifier."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from nsp.models import GPT, get_config
from nsp.train.data import DataError
from nsp.train.labels import ClassBatcher, load_source


def _tree(root, sizes: dict[str, list[int]]):
    for package, files in sizes.items():
        (root / package).mkdir(parents=True)
        for i, n in enumerate(files):
            # Each file's bytes say which package and file they are, so a chunk can be traced back.
            (root / package / f"m{i:02d}.py").write_bytes(bytes([65 + len(package) % 26]) * n)
    (root / "top_level.py").write_bytes(b"x" * 500)  # at the top: no package, left out


def test_classes_are_the_biggest_packages_and_held_out_files_are_never_trained_on(tmp_path):
    _tree(tmp_path, {"big": [300] * 12, "mid": [200] * 5, "small": [100] * 4, "few": [900] * 3,
                     "short": [10] * 8})
    source = load_source(str(tmp_path), classes=3, seq=50)
    # "few" has too few files to hold any out, "short" no file of a whole sequence: neither is a class.
    assert source.names == ("big", "mid", "small")
    for train, held in zip(source.train, source.held_out):
        assert len(held.starts) - 1 >= 1 and len(train.starts) - 1 >= 3
    assert len(source.held_out[0].starts) - 1 == 1 and len(source.train[0].starts) - 1 == 11  # every 10th file
    with pytest.raises(DataError, match="--classes 4 needs that many"):
        load_source(str(tmp_path), classes=4, seq=50)
    with pytest.raises(DataError, match="must be a directory"):
        load_source(str(tmp_path / "top_level.py"), classes=2, seq=50)


def test_batches_are_a_function_of_seed_and_step_and_never_cross_a_file(tmp_path):
    root = tmp_path
    for c, package in enumerate(("aa", "bb")):
        (root / package).mkdir()
        for i in range(5):  # file i of class c holds the byte 10 * c + i throughout
            (root / package / f"f{i}.py").write_bytes(bytes([10 * c + i]) * (40 + 7 * i))
    source = load_source(str(root), classes=2, seq=32)
    batcher = ClassBatcher(source.train, batch_size=64, seq_len=32, seed=3)
    a, b = batcher.batch(5), batcher.batch(5)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], batcher.batch(6)["tokens"])
    assert a["tokens"].shape == (64, 32) and a["labels"].shape == (64,)
    for row, label in zip(a["tokens"], a["labels"]):
        assert len(set(row.tolist())) == 1  # one file's bytes: no window crosses a file's end
        assert row[0] // 10 == label  # and the file is of the row's class
    assert 0 < a["labels"].mean() < 1  # both classes drawn
    rows = batcher.batch(5, slice(8, 16))
    np.testing.assert_array_equal(rows["tokens"], a["tokens"][8:16])


def test_a_classifier_leaves_the_language_model_as_it_was():
    lm = GPT(get_config("tiny"), rngs=nnx.Rngs(0))
    clf = GPT(get_config("tiny", num_classes=3), rngs=nnx.Rngs(0))
    lm_state, clf_state = nnx.to_pure_dict(nnx.state(lm, nnx.Param)), nnx.to_pure_dict(nnx.state(clf, nnx.Param))
    assert set(clf_state) - set(lm_state) == {"cls"}
    # The classifier's head is built last: every other leaf is the same, bit for bit.
    without_head = {k: v for k, v in clf_state.items() if k != "cls"}
    for x, y in zip(jax.tree_util.tree_leaves(lm_state), jax.tree_util.tree_leaves(without_head), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tokens = np.zeros((2, 16), np.int32)
    assert clf.classify(clf.pool(clf.blocks(clf.embed(tokens), 0, 2))).shape == (2, 3)
    with pytest.raises(ValueError, match="num_classes"):
        lm.classify(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="num_classes must be 0"):
        get_config("tiny", num_classes=1)
    assert get_config("tiny", num_classes=3).num_params() == sum(x.size for x in jax.tree_util.tree_leaves(clf_state))


def test_the_classification_loss_from_per_token_and_pooled_features_is_the_loss_from_tokens():
    from nsp.train.step import loss_fn, loss_from_features

    graphdef, params = nnx.split(GPT(get_config("tiny", num_classes=4), rngs=nnx.Rngs(1)), nnx.Param)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (4, 16)).astype(np.int32), "labels": np.array([0, 1, 2, 3], np.int32)}
    model = nnx.merge(graphdef, params)
    want = float(loss_fn(graphdef, params, batch))
    per_token = model.blocks(model.embed(batch["tokens"]), 0, 1)
    pooled = model.pool(model.blocks(per_token, 1, 2))
    for first, x in ((1, per_token), (2, pooled)):
        got = float(loss_from_features(graphdef, params, {"x": x, "labels": batch["labels"]}, first))
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert abs(want - np.log(4)) < 0.5  # a fresh head: about chance
