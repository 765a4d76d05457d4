"""The README's two commands, `make train` and `make test`, on a clean clone of this repository.

The clone is of the committed HEAD, as a newcomer gets it, not of the working tree. Its first command sets up
everything (a fresh .venv, nsp installed into it, the C++ kernels built), the second must set up nothing. The
settings are short (a tiny model for 5 steps, a few tests), but the set-up is real: a few minutes on 2 cores,
with downloads served by pip's cache after the first time. Marked `slow`; the plain `make test` (what CI runs)
includes it, `make test PYTEST_ARGS="-m 'not slow'"` leaves it out.
"""

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Set for the clone's own `make test`, which must never clone again.
INNER_ENV = "NSP_README_COMMANDS_INNER"

TRAIN_ARGS = "--model tiny --steps 5 --seq 64"
# A few fast tests, the C++ update kernel (through the XLA FFI) and a store on disk among them.
QUICK_TESTS = [
    "tests/test_data.py::test_byte_tokenizer_round_trip",
    "tests/test_fused_update.py::test_first_step_bias_correction",
    "tests/test_storage.py::test_metadata_describes_the_layout",
]
SETUP_LINES = ("creating .venv", "installing nsp", "rebuilding nsp")

# Variables a surrounding make, virtual environment or pytest run would hand down, which a newcomer's shell lacks
# (MAKEFLAGS carries the outer make's command-line variables, such as PYTEST_ARGS; tests/conftest.py sets
# XLA_FLAGS and the JAX compilation cache's).
_INHERITED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME",
              "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR",
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def _newcomer_env():
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env[INNER_ENV] = "1"
    return env


def _run(cmd, cwd, env, timeout):
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, time.monotonic() - start


def _explain(cmd, rc, out, seconds, clone):
    text = f"`{' '.join(cmd)}` exited {rc} after {seconds:.0f} s; its output ends:\n{out[-4000:]}"
    log = clone / ".venv" / "nsp-install.log"
    if log.exists() and any(line in out for line in SETUP_LINES):
        text += f"\n--- {log.name} ends:\n{log.read_text(errors='replace')[-3000:]}"
    return text


@pytest.mark.slow
def test_readme_commands_on_a_clean_clone():
    if os.environ.get(INNER_ENV):
        pytest.skip("inside the clean clone's own `make test`: not cloning again")
    missing = [tool for tool in ("git", "make") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the README's commands need {' and '.join(missing)}, not found on PATH")
    if not (REPO / ".git").exists():
        pytest.fail(f"{REPO} is not a git checkout: nothing to clone")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, stdout=subprocess.PIPE,
                          text=True).stdout.strip()

    env = _newcomer_env()
    with tempfile.TemporaryDirectory(prefix="nsp-readme-") as tmp:
        clone = Path(tmp) / "nsp"
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", head], check=True)

        # The README's order; the first command sets everything up.
        train = ["make", "train", f"ARGS={TRAIN_ARGS}"]
        rc, out, seconds = _run(train, clone, env, timeout=1800)
        assert rc == 0, _explain(train, rc, out, seconds, clone)
        assert "creating .venv" in out and "installing nsp" in out, out[-4000:]
        assert re.search(r"step\s+5/5\b.*\bloss [0-9.]+", out), out[-4000:]

        # The second sets up nothing.
        test = ["make", "test", "PYTEST_ARGS=" + " ".join(QUICK_TESTS)]
        rc, out, seconds = _run(test, clone, env, timeout=600)
        assert rc == 0, _explain(test, rc, out, seconds, clone)
        assert not any(line in out for line in SETUP_LINES), out[-4000:]
        assert re.search(rf"\b{len(QUICK_TESTS)} passed\b", out), out[-4000:]

        # And a third time nothing is out of date (`make -q` exits 0 only when there is nothing to do).
        rc = subprocess.run(["make", "-q", "setup"], cwd=clone, env=env).returncode
        assert rc == 0, "`make -q setup` says the set-up is out of date right after `make train` and `make test`"

        # A selection that matches no tests is a failure, not a pass.
        empty = ["make", "test", "PYTEST_ARGS=-k no_test_is_called_this"]
        rc, out, seconds = _run(empty, clone, env, timeout=600)
        assert rc != 0 and "collected no tests" in out, _explain(empty, rc, out, seconds, clone)
