"""The computational-storage model: deterministic, Table I's bytes, the shared link's saturation, overrides, clear
errors, the measured-traffic clock against a real store's counters, and ``nsp plan``."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nsp import storage
from nsp.cli import main
from nsp.csd import (DeviceLoad, LinkFigures, Phase, Setting, paper, phase_time, scaling, step_time, table_one,
                     traffic)
from nsp.csd.measured import measured_update_s, model_update_time, phase_from_stats, shard_deltas

GPT2_4B = Setting(params=4_000_000_000, compute_s=3.5)


@pytest.mark.parametrize("scheme", ["baseline", "smartupdate", "smartcomp"])
@pytest.mark.parametrize("dataflow", ["paper", "nsp"])
def test_the_clock_is_deterministic(scheme, dataflow):
    setting = Setting(params=1_234_567_891, compute_s=2.25, dataflow=dataflow)
    figures = LinkFigures(shared_gbps=7.5, ssd_overlap=0.3)
    first = [step_time(scheme, setting, n, figures) for n in range(1, 11)]
    again = [step_time(scheme, setting, n, LinkFigures(shared_gbps=7.5, ssd_overlap=0.3)) for n in range(1, 11)]
    assert first == again  # every phase's seconds, bottleneck and busy times, exactly


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("scheme", ["baseline", "smartupdate", "smartcomp"])
@pytest.mark.parametrize("dataflow", ["paper", "nsp"])
def test_shared_link_bytes_equal_table_one(scheme, devices, dataflow):
    setting = Setting(params=3_000_000, density=0.01, dataflow=dataflow)
    M = 2 * setting.params
    got = traffic(scheme, setting, devices)
    expected = {"baseline": (8 * M, 8 * M), "smartupdate": (2 * M, 2 * M), "smartcomp": (0.02 * 2 * M, 2 * M)}
    assert (got["shared_down"], got["shared_up"]) == pytest.approx(expected[scheme], rel=1e-12)
    assert got["shared_down"] == pytest.approx(table_one(scheme, setting)["shared_down"], rel=1e-12)
    assert got["shared_up"] == pytest.approx(table_one(scheme, setting)["shared_up"], rel=1e-12)


@pytest.mark.parametrize("devices", [1, 8])
def test_internal_bytes_per_device(devices):
    setting = Setting(params=3_000_000)
    M = 2 * setting.params
    # nsp's engine: each device reads and writes its 1/N of p, m, v (6M) and nothing else over its internal link.
    nsp_flow = traffic("smartupdate", Setting(params=setting.params, dataflow="nsp"), devices)
    assert nsp_flow["per_device_p2p_read"] == pytest.approx(6 * M / devices, rel=1e-12)
    assert nsp_flow["per_device_p2p_write"] == pytest.approx(6 * M / devices, rel=1e-12)
    assert nsp_flow["ssd_host_read"] == nsp_flow["ssd_host_write"] == 0
    # The paper's: gradients staged on the SSD (written by the host, read P2P), params read back by the host.
    paper_flow = traffic("smartupdate", setting, devices)
    assert paper_flow["per_device_p2p_read"] == pytest.approx(8 * M / devices, rel=1e-12)
    assert paper_flow["ssd_host_write"] == pytest.approx(2 * M, rel=1e-12)
    assert paper_flow["ssd_host_read"] == pytest.approx(2 * M, rel=1e-12)
    # The baseline moves everything over the host path: 8M read and 8M written on the SSDs, none P2P.
    base = traffic("baseline", setting, devices)
    assert (base["ssd_host_read"], base["ssd_host_write"]) == pytest.approx((8 * M, 8 * M), rel=1e-12)
    assert base["p2p_read"] == base["p2p_write"] == 0


def test_baseline_saturates_at_the_shared_link_while_near_storage_keeps_scaling():
    rows = {r["devices"]: r for r in scaling(GPT2_4B, range(1, 11))}
    base = [rows[n]["update_s"]["baseline"] for n in range(1, 11)]
    # Scales until the shared link saturates (Smart-Infinity: near 4 SSDs), then stops.
    assert base[3] < 0.5 * base[0]
    assert base[9] > 0.95 * base[4]
    assert rows[10]["bottleneck"]["baseline"] == "shared link"
    for scheme in ("smartupdate", "smartcomp"):
        near = [rows[n]["update_s"][scheme] for n in range(1, 11)]
        assert all(b < a for a, b in zip(near, near[1:])), f"{scheme} must keep improving: {near}"
        assert near[9] < 0.6 * near[4]
        assert rows[10]["speedup"][scheme] > 1.5
    # At 1 device SmartUpdate has no bandwidth to gain: it is at or slightly below the baseline.
    assert 0.85 <= rows[1]["speedup"]["smartupdate"] <= 1.0
    # A wider shared link moves the baseline's saturation point out: the flat part came from that link.
    wide = {r["devices"]: r for r in scaling(GPT2_4B, [5, 10], LinkFigures(shared_gbps=4 * 5.78))}
    assert wide[10]["update_s"]["baseline"] < 0.7 * wide[5]["update_s"]["baseline"]


def test_a_device_with_one_buffer_set_takes_turns():
    """In an ``in_turn`` phase a device's P2P transfers, updater and decompressor add up (they share its buffers),
    while the host's own transfers from its SSD fill the SSD's idle time during the updater's turn."""
    figures = LinkFigures()
    second = {"p2p_read": figures.p2p_read_gbps * 1e9, "host_read": figures.ssd_read_gbps * 1e9,
              "updater": figures.updater_gbps * 1e9, "decompressor": figures.decompressor_gbps * 1e9}

    def seconds(in_turn, **load_s):
        load = DeviceLoad(**{k: v * second[k] for k, v in load_s.items()})
        t = phase_time(Phase("update", devices=(load,), subgroups=10**6, in_turn=in_turn), figures)
        return round(t.seconds, 4), t.bottleneck

    assert seconds(False, p2p_read=1, updater=2) == (2.0, "updater")  # side by side: the longer one
    assert seconds(True, p2p_read=1, updater=2) == (3.0, "ssd+updater")  # in turn: both
    assert seconds(True, p2p_read=1, updater=1, decompressor=0.5) == (2.5, "ssd+updater+decompressor")
    assert seconds(True, p2p_read=1, host_read=1, updater=1) == (2.0, "ssd+updater")  # the host read fits the gap
    assert seconds(True, p2p_read=1, host_read=3, updater=1) == (4.0, "ssd")  # or the SSD alone decides


def test_the_papers_devices_take_turns_while_nsps_overlap():
    """Smart-Infinity's devices have one buffer set (§IV-B); nsp's engine streams pages through several sets and
    overlaps reads, updates and writes. The decompressor is a stage of the paper's SU+O+C only: nsp's kernel
    decompresses as it updates."""
    for scheme in ("smartupdate", "smartcomp"):
        paper_update = step_time(scheme, GPT2_4B, 1).phases[-1]
        assert paper_update.seconds > 1.02 * paper_update.busy["ssd"]  # the updater's turns show
        nsp_update = step_time(scheme, Setting(params=GPT2_4B.params, dataflow="nsp"), 1).phases[-1]
        assert nsp_update.busy["decompressor"] == 0
        assert nsp_update.seconds == pytest.approx(nsp_update.busy["ssd"], rel=0.01)  # the others hide behind it
        assert nsp_update.bottleneck == "ssd"
    assert step_time("smartupdate", GPT2_4B, 1).phases[-1].bottleneck == "ssd+updater"
    assert step_time("smartcomp", GPT2_4B, 1).phases[-1].bottleneck == "ssd+updater+decompressor"
    # The decompressor's figure moves the paper's SU+O+C, by the dense gradient's bytes over it, and nothing else.
    slow = LinkFigures(decompressor_gbps=LinkFigures().decompressor_gbps / 2)
    gained = step_time("smartcomp", GPT2_4B, 1, slow).seconds - step_time("smartcomp", GPT2_4B, 1).seconds
    assert gained == pytest.approx(4 * GPT2_4B.params / (slow.decompressor_gbps * 1e9) / 2, rel=0.01)
    assert step_time("smartupdate", GPT2_4B, 1, slow) == step_time("smartupdate", GPT2_4B, 1)
    nsp_flow = Setting(params=GPT2_4B.params, dataflow="nsp")
    assert step_time("smartcomp", nsp_flow, 1, slow) == step_time("smartcomp", nsp_flow, 1)


def test_overrides_take_effect():
    default = step_time("baseline", GPT2_4B, 10)
    faster_link = step_time("baseline", GPT2_4B, 10, LinkFigures().with_overrides(shared_gbps=2 * 5.78))
    assert faster_link.phases[-1].busy["shared link"] == pytest.approx(default.phases[-1].busy["shared link"] / 2,
                                                                       rel=1e-12)
    assert faster_link.seconds < default.seconds - 8.0  # the update was the shared link's: ~19.4 s -> ~9.7 s
    su = step_time("smartupdate", GPT2_4B, 10)
    su_fast_write = step_time("smartupdate", GPT2_4B, 10, LinkFigures(p2p_write_gbps=2.08))
    assert su_fast_write.seconds < su.seconds - 1.0
    assert step_time("smartupdate", Setting(params=GPT2_4B.params, compute_s=10.0), 10).seconds == \
        pytest.approx(su.seconds + 6.5, rel=1e-12)
    assert LinkFigures.parse_overrides(["shared_gbps=16", "ssd_overlap=0.5"]) == {"shared_gbps": 16.0,
                                                                                 "ssd_overlap": 0.5}
    with pytest.raises(ValueError, match="unknown link figure.*nope.*valid: device_link_gbps"):
        LinkFigures().with_overrides(nope=1.0)
    with pytest.raises(ValueError, match="NAME=GBPS"):
        LinkFigures.parse_overrides(["shared_gbps"])


@pytest.mark.parametrize("field", ["device_link_gbps", "p2p_read_gbps", "p2p_write_gbps", "ssd_read_gbps",
                                   "ssd_write_gbps", "updater_gbps", "decompressor_gbps", "host_updater_gbps",
                                   "shared_gbps"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "5"])
def test_bad_bandwidth_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"LinkFigures.{field} must be a positive finite bandwidth"):
        LinkFigures(**{field: value})


def test_bad_settings_name_their_field():
    with pytest.raises(ValueError, match="ssd_overlap must be a fraction"):
        LinkFigures(ssd_overlap=1.5)
    with pytest.raises(ValueError, match="Setting.params"):
        Setting(params=0)
    with pytest.raises(ValueError, match="Setting.compute_s"):
        Setting(params=10, compute_s=-1.0)
    with pytest.raises(ValueError, match="Setting.density"):
        Setting(params=10, density=0.0)
    for bad in (-0.5, float("nan"), "1", True):
        with pytest.raises(ValueError, match="Setting.compress_s"):
            Setting(params=10, compress_s=bad)
        with pytest.raises(ValueError, match="Setting.compute_s"):
            Setting(params=10, compute_s=bad)
    with pytest.raises(ValueError, match="Setting.dataflow"):
        Setting(params=10, dataflow="magic")
    for devices in (0, -2, 1.5):
        with pytest.raises(ValueError, match="devices must be a positive integer"):
            step_time("smartupdate", Setting(params=10), devices)
    with pytest.raises(ValueError, match="unknown scheme"):
        step_time("raid", Setting(params=10), 1)


def test_compute_time_reproduces_the_papers_update_share():
    # nsp.csd.paper derives the A5000's forward + backward from §VII-C's 75.57% (GPT-2 8.4B, 6 SSDs): fed back
    # into the model, the baseline's update is that share of its step again.
    setting = Setting(params=paper.UPDATE_SHARE_PARAMS, compute_s=paper.compute_s("a5000", paper.UPDATE_SHARE_PARAMS))
    t = step_time("baseline", setting, paper.UPDATE_SHARE_DEVICES)
    update = {p.name: p.seconds for p in t.phases}["update"]
    assert update / t.seconds == pytest.approx(paper.UPDATE_SHARE, rel=1e-9)
    assert paper.compute_s("a100", 10**9) == pytest.approx(paper.compute_s("a5000", 10**9) * 111.1 / 312, rel=1e-9)


def test_top_k_selection_is_accelerator_time_of_smartcomp_only():
    # The GPU's Top-K runs after backward, before anything is sent: it lengthens SU+O+C's step by exactly its
    # seconds, is not transfer-and-update time, and leaves the other schemes alone.
    plain, paid = GPT2_4B, dataclasses.replace(GPT2_4B, compress_s=0.75)
    for n in (1, 10):
        before, after = step_time("smartcomp", plain, n), step_time("smartcomp", paid, n)
        assert [p.name for p in after.phases][:2] == ["forward+backward", "top-k compress"]
        assert after.seconds == pytest.approx(before.seconds + 0.75, rel=1e-12)
        assert after.update_s == pytest.approx(before.update_s, rel=1e-12)
        for scheme in ("baseline", "smartupdate"):
            assert step_time(scheme, paid, n) == step_time(scheme, plain, n)


def test_paper_top_k_seconds_are_the_measured_selection_carried_to_the_paper_gpus():
    # nsp.csd.paper: 2 bytes per param up and 6 per kept param down the GPU's PCIe 4.0 x16 link at 31.5 GB/s times
    # the share of peak the H200's upload reached, then the H200's measured selection rate scaled by memory
    # bandwidth (A100 1555, A5000 768, H200 4800 GB/s).
    n = 10**9
    link = 31.5e9 * 55.19 / 63.0
    for gpu, bandwidth in (("a100", 1555), ("a5000", 768)):
        want = (2 * n + 6 * 0.01 * n) / link + n / (40.12e9 * bandwidth / 4800)
        assert paper.compress_s(gpu, n) == pytest.approx(want, rel=1e-12), gpu
        assert paper.nsp_compress_s(gpu, n) == pytest.approx(n / (36.64e9 * bandwidth / 4800), rel=1e-12), gpu
    assert paper.default_compress_s("a100", n, "paper") == paper.compress_s("a100", n)
    assert paper.default_compress_s("a100", n, "nsp") == paper.nsp_compress_s("a100", n)
    assert paper.compress_s("a100", n, density=0.1) > paper.compress_s("a100", n)  # more kept values come back
    for fn in (paper.compress_s, paper.nsp_compress_s):
        with pytest.raises(ValueError, match="unknown GPU setting"):
            fn("h100", n)


def test_paper_top_k_figures_are_the_committed_gpu_measurements():
    # The constants nsp.csd.paper carries are the committed records' numbers, so a new measurement cannot go
    # unnoticed, nor a figure be typed in without one.
    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    sc = json.loads((results / "smartcomp_topk.json").read_text())
    assert sc["device"] == "cuda" and sc["gpu"]["name"] == paper.SELECT_GPU
    assert round(sc["select_gelem_per_s"], 2) == paper.SELECT_GELEM_PER_S
    assert round(sc["host_link_upload_gbps"], 2) / 63.0 == paper.LINK_SHARE_OF_PEAK
    topk = json.loads((results / "topk_gpu_67108864.json").read_text())
    assert topk["platform"] == "gpu" and topk["device_kind"] == paper.SELECT_GPU
    auto = [r["median_ms"] for r in topk["rows"] if r["method"] == "nsp auto" and not r["hard"]]
    assert round(topk["size"] / max(auto) / 1e6, 2) == paper.NSP_TOPK_GELEM_PER_S


def _stats(shared_in, shared_out, read, write, pages, ns):
    return {"shared_in_bytes": shared_in, "shared_out_bytes": shared_out, "internal_read_bytes": read,
            "internal_write_bytes": write, "pages_read": pages, "update_ns": ns}


def test_measured_clock_charges_each_shard_to_its_links():
    before = [_stats(0, 0, 0, 0, 0, 0)] * 2
    after = [_stats(1e9, 1e9, 3e9, 3e9, 300, 4_000_000_000), _stats(1e9, 1e9, 3e9, 3e9, 300, 5_000_000_000)]
    figures = LinkFigures(p2p_read_gbps=3.0, p2p_write_gbps=1.5, shared_gbps=1.0, device_link_gbps=10.0,
                          updater_gbps=8.0)
    busy = model_update_time(before, after, figures).busy
    assert busy["ssd"] == pytest.approx(3.0 / 3.0 + 3.0 / 1.5)
    assert busy["shared link"] == pytest.approx(4.0 / 1.0)  # both shards' bytes in and out contend on it
    assert busy["device link"] == pytest.approx(2.0 / 10.0)
    assert busy["updater"] == pytest.approx(4.0 / 8.0)  # p, m, v read plus a dense gradient's worth
    assert phase_from_stats(before, after).subgroups == 100
    assert measured_update_s(before, after) == 5.0
    with pytest.raises(ValueError, match="went backwards"):
        shard_deltas(after, before)
    with pytest.raises(ValueError, match="same shards"):
        shard_deltas(before, after[:1])


def test_a_real_stores_counted_traffic_is_table_ones(tmp_path):
    n_shards, page = 2, 64 << 10
    n = 2 * (page // 4) * 3  # three whole pages per shard
    store = storage.open(tmp_path / "s", tier="file", num_shards=n_shards, page_bytes=page)
    try:
        store.initialize({"w": np.linspace(-1, 1, n, dtype=np.float32)}, storage.OptimizerSpec("adam"))
        grad = np.full(n, 1e-3, np.float32)
        store.update(grad, version=0, lr=1e-3, step=1)  # the first update also reads a few bytes of set-up, once
        before = store.shard_stats()
        store.update(grad, version=1, lr=1e-3, step=2)
        after = store.shard_stats()
    finally:
        store.close()
    phase = phase_from_stats(before, after)
    model = traffic("smartupdate", Setting(params=n, dataflow="nsp"), n_shards)
    assert phase.shared_down == model["shared_down"]
    assert phase.shared_up == model["shared_up"]
    # Each page file carries its CRC-32C (4 bytes) beside the state: bytes that moved, which Table I does not count.
    for device, counted in zip(phase.devices, shard_deltas(before, after)):
        assert counted["pages_read"] == 3 * 3  # p, m, v: three pages each
        assert device.p2p_read == model["per_device_p2p_read"] + 4 * counted["pages_read"]
        assert device.p2p_write == model["per_device_p2p_write"] + 4 * counted["pages_read"]
    assert model_update_time(before, after, LinkFigures()).seconds > 0


def test_nsp_plan_prints_a_prediction(capsys):
    assert main(["plan", "--params", "4e9", "--devices", "10", "--gpu", "a5000", "--dataflow", "paper"]) == 0
    out = capsys.readouterr().out
    assert "SU+O+C" in out and "traffic per step" in out and "best over 1..10 devices: SU+O+C on 10" in out
    assert f"SU+O+C's Top-K {paper.compress_s('a5000', 4 * 10**9):.2f} s" in out  # the paper's GPU sorts
    assert main(["plan", "--params", "4e9", "--gpu", "a5000", "--compress-s", "2.5"]) == 0
    assert "SU+O+C's Top-K 2.50 s" in capsys.readouterr().out
    assert main(["plan", "--params", "4e9", "--gpu", "a5000"]) == 0  # nsp's dataflow: its own Top-K, where it is
    assert f"SU+O+C's Top-K {paper.nsp_compress_s('a5000', 4 * 10**9):.2f} s" in capsys.readouterr().out
    assert main(["plan", "--params", "4e9"]) == 0  # no GPU named: none unless given
    assert "Top-K" not in capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "--model", "tiny", "--devices", "2", "--figure", "shared_gbps=16"]) == 0
    assert "shared_gbps=16" in capsys.readouterr().out


def test_nsp_plan_reports_bad_figures(capsys):
    assert main(["plan", "--params", "1e9", "--figure", "p2p_write_gbps=-1"]) == 2
    assert "LinkFigures.p2p_write_gbps must be a positive finite bandwidth" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--devices", "0"]) == 2
    assert "devices must be a positive integer" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--compress-s", "-1"]) == 2
    assert "Setting.compress_s must be" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["__init__", "clock", "figures", "model", "measured", "paper", "plan"])
def test_docstring_examples_hold(module):
    name = "nsp.csd" if module == "__init__" else f"nsp.csd.{module}"
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0
