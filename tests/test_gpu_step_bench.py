"""bench/gpu_step.py runs end to end on the CPU (--quick) and writes a complete record; its larger-size planner
leaves out what does not fit the time left."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_step.py"


@pytest.mark.slow  # about a minute on 2 cores: eleven contenders compiled and timed, and the params check
def test_quick_run_writes_a_record_with_every_contender(tmp_path):
    out = tmp_path / "gpu_step.json"
    # Without the larger size (its planner is checked on its own below): the suite has a time budget.
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--larger", "none", "--out", str(out), "--dir",
                           str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_step
    finally:
        sys.path.remove(str(ROOT / "bench"))

    # What every record carries (bench/common.py) and what this one adds.
    for key in ("command", "git", "machine", "versions", "build", "platform", "device_kind", "device", "nsp",
                "config", "params_check", "probe", "sizes", "skipped", "summary"):
        assert key in record, key
    assert record["benchmark"] == "gpu_step" and record["status"] == "done"
    assert record["nsp"]["import"] == "ok" and record["nsp"]["kernel_isa"] in ("avx512", "avx2-fma", "portable")
    assert record["platform"] == "cpu" and "platform_note" in record  # said honestly

    check = record["params_check"]
    assert check["status"] == "passed", check
    assert check["steps"] == 20 and check["device_updates"] == check["reference_updates"] == 20
    assert check["bitwise_equal"] and check["end_to_end"]["bitwise_equal"]  # CPU against CPU: the same bits

    assert record["probe"]["down_GBps"] > 0 and record["probe"]["up_GBps"] > 0
    size = record["sizes"]["tiny"]
    assert size["rounds"] == 5 and size["batch"] == 8 and size["seq"] == 64
    assert set(size["contenders"]) == set(gpu_step.CONTENDERS)
    for name, rec in size["contenders"].items():
        assert rec["status"] == "ok", (name, rec["status"])
        assert len(rec["times_s"]) == 5 and rec["step_ms"] > 0
        if name == gpu_step.FWD_BWD:
            continue
        split, link = rec["split"], rec["link"]
        assert split["fwd_bwd_ms"] == size["contenders"][gpu_step.FWD_BWD]["step_ms"]
        assert split["update_ms"] >= 0 and split["update_source"]
        assert rec["x_nsp"] > 0
        if name.startswith("nsp"):
            stats = rec["stats"]
            assert stats["updates"] == 5 * rec["steps_per_call"]
            assert stats["params_adopted"] == 0
            assert link["up_bytes"] > 0 and split["down_ms"] >= 0 and split["up_ms"] > 0
            assert (link["down_bytes"] < link["up_bytes"]) == ("Top-K" in name)  # compressed grads go down
            assert "drain_ms" in rec and "steady_step_ms" in rec
            if ", s1," in name:
                assert 0.0 <= rec["hidden_share"] <= 1.0
    pinned = size["contenders"][gpu_step.OPTAX_PINNED]
    assert pinned["link"]["down_bytes"] == pinned["state_bytes"] > 0
    targets = size["targets"]
    assert targets["contender"] == gpu_step.REFERENCE
    for key in ("hides", "vs_hbm", "vs_pinned_host"):
        assert targets[key]["status"].split(":")[0] in ("met", "MISSED", "not judged"), targets[key]
    assert "fwd_bwd_at_least_update" in targets["regime"]
    # The larger size was not asked for, and the record says so.
    assert "small" not in record["sizes"] and "--larger none" in record["skipped"]["larger size"]
    assert "params check: passed" in done.stdout


def test_larger_size_plan_leaves_out_the_optional_contenders_first(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_step
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import jax

    device = jax.devices("cpu")[0]
    contenders = {name: {"status": "ok", "step_ms": 1.0, "setup_s": 1.0, "warmup_s": 0.5, "times_s": [0.5] * 5}
                  for name in gpu_step.CONTENDERS}
    first = {"model": "tiny", "params": 120_576, "batch": 8, "seq": 64, "timing_s": {"compile": 11.0},
             "contenders": contenders}
    # tiny -> small: 2x the layers, ~27x the params; each contender costs ~1 s at tiny.
    model, left_out, estimates = gpu_step.plan_larger(first, ["small"], 64, 8, device, 1e6, str(tmp_path))
    assert model == "small" and left_out == []
    whole = estimates["small"]["estimate_all_s"]
    model, left_out, estimates = gpu_step.plan_larger(first, ["small"], 64, 8, device, whole * 0.8, str(tmp_path))
    assert model == "small" and left_out and left_out == list(gpu_step.OPTIONAL_ORDER[:len(left_out)])
    assert estimates["small"]["estimate_s"] <= whole * 0.8
    model, left_out, estimates = gpu_step.plan_larger(first, ["small"], 64, 8, device, 1.0, str(tmp_path))
    assert model is None and estimates["small"]["estimate_s"] > 1.0
