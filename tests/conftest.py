"""Test-wide setup: four CPU devices, so sharded steps run on a real multi-device mesh; one compilation cache for
the whole session; fixtures the training tests share."""

import atexit
import inspect
import os
import shutil
import tempfile

import pytest

# Must happen before JAX initialises its backends (conftest is imported before any test module).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

# JAX's persistent compilation cache in a directory of this session's own, handed down to every `nsp train`
# subprocess through the environment: the many short training runs (resume, kill, fault and multi-process tests)
# compile the same tiny steps, and a run that finds them compiled starts in half the time. A cached executable is
# the one XLA would build again, so results are unchanged; the directory goes when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="nsp-tests-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_jax_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """The token cache (NSP_CACHE_DIR) in the test's own directory: no test sees another's cached tokens."""
    monkeypatch.setenv("NSP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path):
    """A few hundred KB of real text (stdlib sources), so training runs stay fast."""
    import collections
    import json as json_mod

    path = tmp_path / "corpus.txt"
    path.write_text(inspect.getsource(collections) + inspect.getsource(json_mod.decoder))
    return str(path)


# The files that take longest (minutes of end-to-end runs each), first: `make test` hands whole files to its
# pytest-xdist workers in collection order, and a long file handed out last leaves the other workers idle while
# it runs. Longest first keeps them busy to the end. Order only; every test is independent of the others.
_LONG_FIRST = (
    "test_readme_commands.py", "test_fault_campaign.py", "test_distributed.py", "test_big_model_setup.py",
    "test_clock_jump.py", "test_disk_full.py", "test_gpu_step_bench.py", "test_share_nothing.py", "test_train.py",
    "test_features.py", "test_optim.py", "test_train_failures.py", "test_freeze.py", "test_offload_planner.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
