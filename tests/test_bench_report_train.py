"""The report's training section (bench/report_train.py) scores held-out batches through the train step's own
metrics function: a change to what that function returns must fail here, not an hour into `bench/report.py`."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import report_train  # noqa: E402

from nsp.train.setup import init_model  # noqa: E402
from nsp.train.step import loss_fn, make_train_step  # noqa: E402


def test_held_out_loss_is_the_mean_of_the_step_metrics_loss():
    args = types.SimpleNamespace(model="tiny", steps=1, batch=2, seq=16, seed=0, eval_batches=2)
    config = report_train.train_config(args)
    graphdef, params = init_model(config, 64)
    _, evaluate = make_train_step(graphdef, optax.sgd(0.1))
    rng = np.random.default_rng(0)
    batches = [jax.numpy.asarray(rng.integers(0, 64, (2, 17)), jax.numpy.int32) for _ in range(2)]

    got = report_train.mean_held_out_loss(evaluate, params, batches)

    want = np.mean([float(loss_fn(graphdef, params, b)) for b in batches])
    assert isinstance(got, float) and np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-5)
