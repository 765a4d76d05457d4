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
