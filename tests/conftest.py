"""Test-wide setup: four CPU devices, so sharded steps run on a real multi-device mesh; fixtures the training
tests share."""

import inspect
import os

import pytest

# Must happen before JAX initialises its backends (conftest is imported before any test module).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


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
