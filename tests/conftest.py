"""Test-wide setup: four CPU devices, so sharded steps run on a real multi-device mesh."""

import os

# Must happen before JAX initialises its backends (conftest is imported before any test module).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
