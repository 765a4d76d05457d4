"""The store update's CUDA handler (ffi/xla/cuda/cuda_stage.cc), run on the CPU against the software model of the CUDA
entry points it uses (ffi/xla/cuda/cuda_model.cc, built into a temporary directory with the system C++ compiler).

tests/cuda_handler_cases.py runs every kind of update (adam/adamw/sgd/adagrad, gradient leaves, bf16 params,
bf16 gradients, Top-K, lazy Top-K, staleness 0 and 1, adopted params, a NaN skip, two devices in shard_map, and
failing copies) twice, each in a fresh process: once through the CPU handler, once with ``NSP_CUDA_MODEL`` set,
so that every store update goes through the CUDA handler (staging into pinned buffers, copies on the model's
stream, delayed). The two must agree bit for bit."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from backend_cases import ROOT
from backend_cases import compile_shared as _compile_shared

CASES = Path(__file__).with_name("cuda_handler_cases.py")
KINDS = ["adam", "adamw", "sgd", "adagrad", "adam_bf16", "adam_stale1", "adam_nan", "adam_adopt", "adam_bf16_grads",
         "adamw_topk", "adam_topk_lazy", "mesh_adam", "mesh_sgd_stale1", "mesh_adamw_topk"]
STEPS = {"adam_stale1": 4, "adam_nan": 4, "adam_adopt": 4, "mesh_adam": 5}
SHARDS = {"mesh_adam": 2, "mesh_sgd_stale1": 2, "mesh_adamw_topk": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    where = tmp_path_factory.mktemp("cuda_model")
    return _compile_shared([ROOT / "ffi/xla/cuda/cuda_model.cc"], where / "libnsp_cuda_model.so",
                           what="the CUDA model")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """Both runs of every case, side by side: (plain results, model results, model info)."""
    procs = {}
    for name, extra in (("plain", {}), ("model", {"NSP_CUDA_MODEL": str(model), "NSP_CUDA_MODEL_DELAY_US": "50"})):
        out = tmp_path_factory.mktemp(name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NSP_CUDA")}
        env.update(extra, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
        procs[name] = (out, subprocess.Popen([sys.executable, str(CASES), str(out)], env=env, cwd=ROOT,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    loaded = {}
    for name, (out, proc) in procs.items():
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"the {name} run failed:\n{text[-4000:]}"
        loaded[name] = (dict(np.load(out / "results.npz")), json.loads((out / "info.json").read_text()))
    assert not loaded["plain"][1]["_model"] and loaded["model"][1]["_model"]
    return loaded["plain"][0], loaded["model"][0], loaded["model"][1]


@pytest.mark.parametrize("kind", KINDS + ["fail_down", "fail_up"])
def test_the_cuda_handler_matches_the_cpu_path_bit_for_bit(runs, kind):
    plain, model, _ = runs
    keys = sorted(k for k in plain if k.startswith(kind + "/") and "after_failure" not in k)
    assert keys and keys == sorted(k for k in model if k.startswith(kind + "/") and "after_failure" not in k)
    for key in keys:
        np.testing.assert_array_equal(model[key], plain[key], err_msg=key)


@pytest.mark.parametrize("kind", KINDS)
def test_every_update_went_through_the_cuda_handler_and_the_model(runs, kind):
    _, _, info = runs
    counters = info[kind]["counters"]
    previous = info[KINDS[KINDS.index(kind) - 1]]["counters"][-1]["handler"] if KINDS.index(kind) else None
    calls = counters[-1]["handler"]["calls"] - (previous["calls"] if previous else 0)
    assert calls == STEPS.get(kind, 3) * SHARDS.get(kind, 1)
    handler, model = counters[-1]["handler"], counters[-1]["model"]
    # Every copy the handler made is one the model ran, each with its host side in a pinned buffer.
    assert model["unpinned"] == 0 and handler["failed_copies"] == 0
    assert model["copies"] == handler["copies_down"] + handler["copies_up"]
    assert (model["bytes_d2h"], model["bytes_h2d"]) == (handler["bytes_down"], handler["bytes_up"])
    assert model["host_allocs"] == handler["pinned_allocs"] and model["host_frees"] == 0
    # One synchronisation down per call (two when it adopts params), one wait for the copies up (CPU only).
    syncs = handler["syncs"] - (previous["syncs"] if previous else 0)
    adopting = {"adam_adopt": 2, "mesh_adam": 2}.get(kind, 0)
    assert syncs == 2 * calls + adopting


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_buffers_are_allocated_once_and_reused(runs, kind):
    counters = runs[2][kind]["counters"]
    allocs = [c["handler"]["pinned_allocs"] for c in counters]
    # The first step allocates a pair of buffer sets per device; a step that adopts params for the first time
    # adds their buffer; nothing after that.
    first_adopt = {"adam_adopt": 2, "mesh_adam": 4}.get(kind)
    settled = allocs[first_adopt - 1:] if first_adopt else allocs
    assert len(set(settled)) == 1, allocs


def test_bf16_params_go_up_as_two_bytes_a_parameter(runs):
    info = runs[2]
    for kind, width in (("adam_bf16", 2), ("adam", 4)):
        counters, n = info[kind]["counters"], info[kind]["params"]
        ups = np.diff([c["handler"]["params_bytes_up"] for c in counters])
        assert list(ups) == [width * n] * (len(counters) - 1), (kind, ups)
    # bf16 gradients of fp32 params go down as bf16: 2 bytes a gradient element.
    c = info["adam_bf16_grads"]["counters"]
    downs = np.diff([x["handler"]["bytes_down"] for x in c])
    assert list(downs) == [6 * 4 + 2 * info["adam_bf16_grads"]["padded"]] * (len(c) - 1)


def test_a_failing_copy_names_the_shard_and_the_copy_and_the_next_step_succeeds(runs):
    plain, model, info = runs
    down, up = info["fail_down"], info["fail_up"]
    # Down: the step never ran; the committed version and its state are untouched.
    assert len(down["errors"]) == 1 and down["attempts"] == 4
    msg = down["errors"][0]
    assert "shard 0" in msg and "copying the gradient leaf 0 down" in msg and "on demand" in msg, msg
    assert "the store is unchanged" in msg
    after = info["fail_down/after_failure"]
    assert after["version_before"] == after["version_after"] == 1 and after["param_unchanged"] and after["m_unchanged"]
    np.testing.assert_array_equal(model["fail_down/store_after_failure"], plain["fail_down/store_step1"])
    # Up: the step ran and committed (its version is whole); the step run again replays it.
    assert len(up["errors"]) == 1 and up["attempts"] == 4
    msg = up["errors"][0]
    assert "shard 0" in msg and "copying the new params leaf 0 up" in msg and "replays" in msg, msg
    assert info["fail_up/after_failure"]["version_after"] == 2
    # The copies queued before the failing one (the version's, made slow for this step) landed before the call
    # returned its error: XLA frees a failed call's results, and a later write into them corrupts the heap.
    assert info["fail_up/after_failure"]["pending_copies"] == 0
    assert info["fail_down/after_failure"]["pending_copies"] == 0
    np.testing.assert_array_equal(model["fail_up/store_after_failure"], plain["fail_up/store_step2"])
    # And the steps after the failure agree with the CPU path's (test above), ending at the same version.
    assert int(model["fail_up/version"]) == int(plain["fail_up/version"]) == 3


@pytest.mark.parametrize("platform,version", [("tpu", "tpu v5"), ("gpu", "rocm 6.2"), ("METAL", "")])
def test_a_platform_without_a_handler_fails_at_trace_time_naming_it(platform, version):
    su = importlib.import_module("nsp.primitives.store_update")  # the module (the package exports the function)

    device = types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version))
    mesh = types.SimpleNamespace(devices=np.array([device], dtype=object))
    want = {"tpu": "'tpu'", "gpu": "'rocm'", "METAL": "'metal'"}[platform]
    with pytest.raises(NotImplementedError, match=f"no handler for the {want} platform.*CPU and CUDA"):
        su._check_platform(mesh)
    assert su._platform(types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(
        platform_version="cuda 12030"))) == "cuda"
    su._check_platform(None)  # the CPU


def test_without_the_model_the_cpu_handlers_serve_the_cpu():
    from nsp.primitives import _ffi

    if _ffi.CUDA_MODEL is not None:
        pytest.skip("this process runs under the CUDA model")
    assert _ffi.cuda_stats()["calls"] == 0
