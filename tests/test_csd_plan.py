"""nsp plan against the emulated devices: the formulas of nsp.csd.model and a real update on csd store shards, whose
model clock schedules every page on the SSD, host link and updater, agree within 10% whatever limits the step."""

import pytest

from nsp import cli
from nsp.csd import LinkFigures, Setting
from nsp.emulate import PLAN_TOLERANCE, check_plan, emulated_update

PAGE = 1 << 20  # 1 MiB pages: 4 per state and device below, so fill and drain weigh as much as they ever do

# Figures that make each resource the bottleneck in turn (the defaults: the SSD's P2P write).
FIGURES = {
    "ssd": LinkFigures(),
    "ssd overlapping": LinkFigures(ssd_overlap=0.6),
    "shared link": LinkFigures(shared_gbps=0.5),
    "device link": LinkFigures(device_link_gbps=0.3),
    "updater": LinkFigures(updater_gbps=0.8),
}


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("scheme", ["smartupdate", "smartcomp"])
@pytest.mark.parametrize("limit", list(FIGURES))
def test_plan_predicts_the_emulated_update(tmp_path, limit, scheme, devices):
    setting = Setting(params=(1 << 22) * devices, page_bytes=PAGE, density=0.01)
    row = check_plan(scheme, setting, devices, FIGURES[limit], str(tmp_path))
    assert row["holds"], row
    assert abs(row["ratio"] - 1) <= PLAN_TOLERANCE
    # The devices are alike and update side by side: each one's clock gives the same time.
    assert max(row["per_device_s"]) == pytest.approx(min(row["per_device_s"]), rel=0.02)
    if devices == 3 and scheme == "smartupdate" and not limit.startswith("ssd"):
        assert row["bottleneck"] == limit  # the figures do limit what they are meant to


def test_the_shared_link_slows_more_devices_and_only_it(tmp_path):
    """Devices that share a narrow host link each get a fair share of it: three take three times one's time, while
    on wide links they take one's time (each has its own SSD and updater)."""
    narrow, wide = LinkFigures(shared_gbps=0.5), LinkFigures()

    def seconds(figures, devices):
        return emulated_update("smartupdate", Setting(params=(1 << 22) * devices, page_bytes=PAGE), devices,
                               figures, str(tmp_path))["emulated_s"]

    assert seconds(narrow, 3) == pytest.approx(3 * seconds(narrow, 1), rel=0.1)
    assert seconds(wide, 3) == pytest.approx(seconds(wide, 1), rel=0.05)


def test_the_baseline_has_no_device_to_emulate(tmp_path):
    with pytest.raises(ValueError, match="no device to emulate"):
        emulated_update("baseline", Setting(params=1 << 20), 1, LinkFigures(), str(tmp_path))


def test_nsp_plan_check_prints_both_and_exits_by_the_tolerance(tmp_path, capsys):
    args = ["plan", "--params", "4e9", "--devices", "2", "--check", str(tmp_path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "emulated csd devices" in out and "plan within 10% of the emulator: yes" in out
    for label in ("SU+O ", "SU+O+C"):
        check = out.split("emulated csd devices")[1]  # the check's table, after the plan's own
        line = next(x for x in check.splitlines() if x.startswith(label))
        plan_s, emulated_s, ratio = map(float, line.split()[1:])
        assert ratio == pytest.approx(plan_s / emulated_s, abs=1e-3)
