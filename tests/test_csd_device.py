"""The csd backend: an emulated computational-storage device per shard. Its results are the memory and file tiers'
(bit for bit), its files are the file tier's, its link counters are the bytes moved (and Table I's), its model
clock is deterministic and follows its figures, and its injected faults fail one update cleanly."""

from __future__ import annotations

import filecmp
import functools
import json

import numpy as np
import pytest
import tensorstore as ts

import nsp.storage as storage
from nsp import _nsp_ffi
from nsp.csd import LinkFigures, Setting, device_options, table_one, traffic
from nsp.storage.format import array_dir

from backend_cases import KINDS, PAGE, PAGE_ELEMS, assert_runs_match, memory_store, open_device, params, run, states


def csd(path, **kw):
    return open_device(path, **kw)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_csd_matches_memory(tmp_path, kind):
    spec, how = KINDS[kind]
    with memory_store(2) as mem, csd(tmp_path / "c") as dev:
        assert dev.backend == "csd"
        assert_runs_match(mem, dev, spec, how, compare=functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=0))
        for name, want in states(mem, spec).items():
            np.testing.assert_allclose(states(dev, spec)[name], want, rtol=1e-6, atol=0, err_msg=name)


def test_csd_matches_file_bit_for_bit_in_its_files_too(tmp_path):
    spec = storage.OptimizerSpec("adamw", weight_decay=0.05)
    with storage.open(tmp_path / "f", tier="file", num_shards=2, page_bytes=PAGE) as f, csd(tmp_path / "c") as c:
        for how in ("dense", "topk", "bf16"):
            first = 1 + 3 * ("dense", "topk", "bf16").index(how)
            assert_runs_match(f, c, spec, how, first=first, compare=np.testing.assert_array_equal)
        for name, want in states(f, spec).items():
            np.testing.assert_array_equal(states(c, spec)[name], want)
        version = c.version
    for shard in range(2):
        for state in ("param", "mu", "nu"):
            a = array_dir(tmp_path / "f" / "shards" / f"{shard:05d}", version % 2, state) / "c"
            b = array_dir(tmp_path / "c" / "shards" / f"{shard:05d}", version % 2, state) / "c"
            names = sorted(p.name for p in a.iterdir())
            assert names == sorted(p.name for p in b.iterdir())
            assert filecmp.cmpfiles(a, b, names, shallow=False)[0] == names  # the same page files, byte for byte
        manifests = [json.loads((tmp_path / t / "shards" / f"{shard:05d}" / "MANIFEST.json").read_text())
                     for t in ("f", "c")]
        assert manifests[0]["checksums"] == manifests[1]["checksums"]
    # Plain tensorstore reads the csd store's arrays; reopened, it runs on csd again, verifies, and steps on.
    spec_ts = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(
        array_dir(tmp_path / "c" / "shards" / "00000", version % 2, "param"))}}
    with storage.open(tmp_path / "c") as c:
        assert (c.tier, c.backend) == ("csd", "csd") and c.verify()["problems"] == []
        np.testing.assert_array_equal(ts.open(spec_ts).result().read().result(), c.read()[:c.layout.shard_size])
        assert c.shard_stats()[0]["backend"]["model_updates"] == 0  # a new device: its clock starts at open


def deltas(before: list[dict], after: list[dict]) -> list[dict]:
    return [{**{k: a[k] - b[k] for k in a if k != "backend"},
             "backend": {k: a["backend"][k] - b["backend"][k] for k in a["backend"]}} for b, a in zip(before, after)]


@pytest.mark.parametrize("devices", [1, 4])
def test_link_bytes_are_the_bytes_moved_and_table_one(tmp_path, devices):
    """Without checksums a page file is exactly a page, so the counted bytes meet the formulas exactly."""
    total = devices * 3 * PAGE_ELEMS  # three whole pages per device: no padding
    spec = storage.OptimizerSpec("adam")
    with csd(tmp_path / "c", num_shards=devices, checksum=False) as c:
        c.initialize(params(total), spec)
        for step in (1, 2):  # the first update writes new page files into slot 1, the second rewrites them
            before = c.shard_stats()
            run(c, spec, "dense", steps=1, first=step)
            per_device = deltas(before, c.shard_stats())
            setting = Setting(params=total, dataflow="nsp", page_bytes=PAGE)
            formulas, model = table_one("smartupdate", setting), traffic("smartupdate", setting, devices)
            for d in per_device:
                dev = d["backend"]
                # What the device charged is what the engine counted moving: pages from each I/O call's return
                # value, the host link where the gradient was consumed and the params handed out.
                assert dev["bytes_read_link"] == d["internal_read_bytes"] > 0
                assert dev["bytes_write_link"] == d["internal_write_bytes"] > 0
                assert dev["bytes_host_in"] == d["shared_in_bytes"] and dev["bytes_host_out"] == d["shared_out_bytes"]
                # ... and Table I's per-device share: 2M down, 2M up; 6M of state each way inside; state + dense
                # gradient through the updater.
                assert dev["bytes_host_in"] == formulas["shared_down"] / devices
                assert dev["bytes_host_out"] == formulas["shared_up"] / devices
                assert dev["bytes_read_link"] == model["per_device_p2p_read"]
                assert dev["bytes_write_link"] == model["per_device_p2p_write"]
                assert dev["bytes_updater"] == model["updater"] / devices
                assert dev["busy_seconds_shared_link"] == pytest.approx(
                    (dev["bytes_host_in"] + dev["bytes_host_out"]) / (LinkFigures().shared_gbps * 1e9 / devices))


def flow_shop(pages: list[list[float]], window: int) -> float:
    """The pipeline the device's clock runs, worked out here: stages read, gradient in, update, params out, write
    on the SSD, host link, updater, host link and SSD; each stage in page order; a read needs a free buffer set (the
    page ``window`` before written); the operation that can start first goes first (ties: the later stage)."""
    resource = (0, 1, 2, 1, 0)
    n = len(pages)
    end = [[None] * 5 for _ in range(n)]
    nxt, free = [0] * 5, [0.0] * 3
    while nxt[4] < n:
        options = []
        for k in range(5):
            i = nxt[k]
            if i >= n:
                continue
            if k == 0:
                if i >= window and end[i - window][4] is None:
                    continue
                ready = end[i - window][4] if i >= window else 0.0
            else:
                if end[i][k - 1] is None:
                    continue
                ready = end[i][k - 1]
            options.append((max(ready, free[resource[k]]), -k))
        start, k = min(options)
        k = -k
        i = nxt[k]
        end[i][k] = start + pages[i][k]
        free[resource[k]] = end[i][k]
        nxt[k] += 1
    return end[-1][4]


def test_model_clock_is_the_page_pipeline_deterministic_and_follows_its_figures(tmp_path):
    spec, window, elements = storage.OptimizerSpec("adam"), 2, 4 * PAGE_ELEMS + 1000  # 5 pages, the last partial
    figures = LinkFigures(p2p_read_gbps=2.0, p2p_write_gbps=1.0, updater_gbps=7.0, shared_gbps=6.0,
                          device_link_gbps=3.9)
    opts = {k: getattr(figures, k) for k in ("p2p_read_gbps", "p2p_write_gbps", "updater_gbps", "shared_gbps",
                                             "device_link_gbps")}

    def device_stats(name, **override):
        with csd(tmp_path / name, num_shards=1, checksum=False, pages_in_flight=window,
                 backend_options={**opts, **override}) as c:
            c.initialize(params(elements), spec)
            run(c, spec, "dense", steps=2)
            return c.shard_stats()[0]["backend"]

    a, b = device_stats("a"), device_stats("b")
    assert a == b  # the same configuration and pages: the same model seconds, to the bit

    def page_seconds(elems: int) -> list[float]:
        # Whole page files (p, m, v) in and out of storage; the page's own elements over the host link (fp32
        # gradient in, fp32 params out, at the slower of the device's link and its share of the shared one); p, m,
        # v and the gradient through the updater.
        host = min(figures.device_link_gbps, figures.shared_gbps) * 1e9
        return [3 * PAGE / (figures.p2p_read_gbps * 1e9), 4 * elems / host, 16 * elems / (figures.updater_gbps * 1e9),
                4 * elems / host, 3 * PAGE / (figures.p2p_write_gbps * 1e9)]

    want = flow_shop([page_seconds(PAGE_ELEMS)] * 4 + [page_seconds(1000)], window)
    assert a["model_seconds_last_update"] == pytest.approx(want, rel=1e-12)
    assert a["model_seconds_total"] == pytest.approx(2 * want, rel=1e-12)
    assert a["model_updates"] == 2 and a["pages_in_flight"] == window
    # (The schedule itself: reads and writes share the SSD, so buffer sets cannot overlap them; the updater and
    # the host link run beside the SSD when there are buffer sets to spare.)
    assert flow_shop([[1, 0, 0, 0, 1]] * 3, 1) == 6 and flow_shop([[1, 0, 0, 0, 1]] * 3, 3) == 6
    assert flow_shop([[1, 0, 1, 0, 0]] * 3, 1) == 6 and flow_shop([[1, 0, 1, 0, 0]] * 3, 2) == 4
    slower = device_stats("c", p2p_write_gbps=0.5)
    assert slower["model_seconds_last_update"] > a["model_seconds_last_update"]
    assert slower["busy_seconds_write_link"] == pytest.approx(2 * a["busy_seconds_write_link"])
    assert slower["bytes_write_link"] == a["bytes_write_link"]


def test_device_options_are_every_figure_and_checked(tmp_path):
    text = device_options(LinkFigures(), faults={"fail_kernel_at": 2})
    assert text.count("=") == 7 and "shared_gbps=5.78" in text and text.endswith("fail_kernel_at=2")
    with pytest.raises(ValueError, match="unknown csd option"):
        csd(tmp_path / "a", backend_options={"p2p_speed": 1})
    with pytest.raises(ValueError, match="shared_gbps must be a positive"):
        csd(tmp_path / "b", backend_options={"shared_gbps": -1})
    with pytest.raises(ValueError, match="counts operations from 1"):
        csd(tmp_path / "c", backend_options={"fail_read_at": 0})
    # The device itself holds no defaults: a figure left out, or a bad one, fails its open.
    root = tmp_path / "raw"
    root.mkdir()
    for options, why in (("p2p_read_gbps=1", "figure 'device_link_gbps' is missing"),
                         (device_options().replace("updater_gbps=7.0", "updater_gbps=-7"),
                          "figure 'updater_gbps' must be a positive number of GB/s, got '-7'"),
                         (device_options() + ";speed=3", "unknown option 'speed'"),
                         (device_options().replace("ssd_overlap=0.0", "ssd_overlap=1.5"),
                          "figure 'ssd_overlap' must be a fraction in \\[0, 1\\], got '1.5'")):
        with pytest.raises(RuntimeError, match=rf"^backend csd not available: .*csd device 0 \({root}\): {why}"):
            _nsp_ffi.ShardEngine("csd", str(root), 4096, 1024, 2, [True, True, True], True,
                                 backend_options=options)


@pytest.mark.parametrize("fault, at, what", [
    ("fail_read_at", 2, r"reading page \d+ of state '(param|mu|nu)' in slot 0"),
    ("fail_write_at", 3, r"writing page \d+ of state '(param|mu|nu)' in slot 1"),
    ("fail_kernel_at", 2, r"the update kernel on page \d+ \(states param, mu, nu\)"),
])
def test_an_injected_fault_fails_one_update_cleanly(tmp_path, fault, at, what):
    spec = storage.OptimizerSpec("adam")
    with csd(tmp_path / "c") as c:
        c.initialize(params(), spec)
        committed = c.read()
    # Counted from the device's open: here, from this reopen, so the k-th operation is the update's.
    with csd(tmp_path / "c", backend_options={fault: at}) as c, \
            memory_store(2) as mem:
        mem.initialize(params(), spec)
        with pytest.raises(storage.StoreError, match=rf"update from version 0 failed; version 0 is intact: csd device "
                           rf"[01] \({tmp_path}/c/shards/0000[01]\): {what} failed: injected fault \({fault}={at}"):
            run(c, spec, "dense", steps=1)
        assert c.version == 0 and c.held_versions() == [0]
        np.testing.assert_array_equal(c.read(), committed)
        assert c.verify()["problems"] == []
        # The fault struck once: the same step now succeeds, and is the memory tier's.
        assert_runs_match(mem, c, spec, "dense", steps=2, compare=np.testing.assert_array_equal)
        assert c.shard_stats()[0]["backend"]["model_failed_updates"] == 1


def test_a_jitted_optax_step_runs_on_csd_as_on_file(tmp_path):
    """The training path: nsp.optim.adam inside jax.jit, one store shard (the gradient's leaves go in as they are
    and the new params come back over them); the device charges what the engine counted on the host link."""
    import jax
    import optax

    import nsp.optim

    results, stats = {}, {}
    for tier in ("file", "csd"):
        with storage.open(tmp_path / tier, tier=tier, page_bytes=PAGE) as store:
            tx = nsp.optim.adam(1e-2, store=store)
            p = {"w": np.asarray(params()["w"]), "b": np.asarray(params()["b"])}
            state = tx.init(p)

            @jax.jit
            def step(p, state, g, tx=tx):
                updates, state = tx.update(g, state, p)
                return optax.apply_updates(p, updates), state

            for t in range(1, 3):
                g = jax.tree.map(lambda x, t=t: np.full_like(x, 0.01 * t) + x * 1e-3, p)
                p, state = step(p, state, g)
            results[tier] = jax.tree.map(np.asarray, p)
            stats[tier] = store.shard_stats()[0]
    jax.tree.map(np.testing.assert_array_equal, results["csd"], results["file"])
    dev = stats["csd"]["backend"]
    assert dev["bytes_host_in"] == stats["csd"]["shared_in_bytes"] > 0
    assert dev["bytes_host_out"] == stats["csd"]["shared_out_bytes"] > 0
    assert dev["model_updates"] == 2 and dev["model_seconds_total"] > 0
