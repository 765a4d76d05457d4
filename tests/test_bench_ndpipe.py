"""bench/ndpipe.py's ``--cores split``: the software model of NDPipe's separate servers pins the trainer and the
extractors to CPUs of their own, and a child started with a role's ``preexec_fn`` really runs on those CPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ndpipe  # noqa: E402


def test_split_cores_gives_each_role_half_and_no_cpu_to_both():
    assert ndpipe.split_cores({0, 1}) == {"trainer": {0}, "extractors": {1}}
    roles = ndpipe.split_cores({3, 5, 8, 9, 12})
    assert roles["trainer"] == {3, 5} and roles["extractors"] == {8, 9, 12}
    with pytest.raises(SystemExit, match="at least 2 usable CPUs"):
        ndpipe.split_cores({0})


def test_a_pinned_child_runs_on_its_roles_cpus(monkeypatch):
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("one usable CPU: nothing to split")
    roles = ndpipe.split_cores(set(usable))
    monkeypatch.setattr(ndpipe, "ROLE_CPUS", roles)
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    for role, cpus in roles.items():
        out = subprocess.run(show, capture_output=True, text=True, check=True, preexec_fn=ndpipe._pin(role)).stdout
        assert out.strip() == str(sorted(cpus)), role
    monkeypatch.setattr(ndpipe, "ROLE_CPUS", {"trainer": None, "extractors": None})
    assert ndpipe._pin("trainer") is None  # --cores shared: no pinning


def test_repeated_passes_merge_into_medians_and_keep_each_pass():
    def pass_(full, serial, pipelined):
        return [{"task": "t", "schedule": "full", "extractors": 0, "seconds": full},
                {"task": "t", "schedule": "ndpipe", "extractors": 1, "seconds": pipelined, "overlap_s": 1.0},
                {"task": "t", "schedule": "ndpipe-serial", "extractors": 1, "seconds": serial, "overlap_s": 0.0}]

    rows = ndpipe.merge_repeats([pass_(60.0, 30.0, 20.0), pass_(90.0, 33.0, 30.0), pass_(63.0, 36.0, 24.0)])
    full, pipelined, serial = rows
    assert full["seconds"] == 63.0 and full["seconds_runs"] == [60.0, 90.0, 63.0]
    assert pipelined["seconds"] == 24.0 and serial["seconds"] == 33.0
    assert pipelined["speedup_vs_serial"] == 33.0 / 24.0  # from the medians ...
    assert pipelined["speedup_vs_serial_runs"] == [30.0 / 20.0, 33.0 / 30.0, 36.0 / 24.0]  # ... and pass by pass
    assert pipelined["speedup_vs_full"] == 63.0 / 24.0 and "speedup_vs_serial" not in serial
