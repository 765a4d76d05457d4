"""The axdimm backend (libnsp_backend_axdimm.so): an AXDIMM module per shard (a DIMM with an FPGA and two DRAM
channels) in front of the shard's NVMe page files, run here against the software model of the AXDIMM runtime
(ffi/backends/axdimm/axdimm_model.cc, built into a temporary directory with the system C++ compiler and given to the
backend with its library= option). Its results are the memory tier's for every kind, both channels compute, a module
smaller than the state evicts pages already updated in the step first and still updates correctly, each way it can be
unavailable says why, and each injected fault fails one update cleanly."""

from __future__ import annotations

import numpy as np
import pytest
from backend_cases import (KINDS, PAGE, assert_close, assert_runs_match, memory_store, model_sources, open_device,
                           params, run, states)
from backend_cases import compile_shared as _compile_shared

import nsp.storage as storage


def compile_shared(sources, out):
    return _compile_shared(sources, out, what="the AXDIMM model")


@pytest.fixture(scope="module")
def axdimm(tmp_path_factory):
    """The AXDIMM model library, as the backend's library= option."""
    where = tmp_path_factory.mktemp("axdimm_model")
    lib = compile_shared(model_sources("axdimm_model"), where / "libaxdimm_model.so")
    return {"library": str(lib)}


@pytest.fixture(autouse=True)
def no_model_settings(monkeypatch):
    for name in ("NSP_AXDIMM_MODEL_FAIL_KERNEL_AT", "NSP_AXDIMM_MODEL_FAIL_COPY_AT", "NSP_AXDIMM_MODEL_BYTES",
                 "NSP_AXDIMM_MODEL_RANKS", "NSP_AXDIMM_LIBRARY"):
        monkeypatch.delenv(name, raising=False)


def on_axdimm(path, options, **kw):
    return open_device(path, "axdimm", options, **kw)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_axdimm_matches_memory(tmp_path, axdimm, kind):
    spec, how = KINDS[kind]
    with memory_store(2) as mem, \
            on_axdimm(tmp_path / "a", axdimm) as dev:
        assert dev.backend == "axdimm"
        assert_runs_match(mem, dev, spec, how)
        stats = [s["backend"] for s in dev.shard_stats()]
        for name, want in states(mem, spec).items():
            assert_close(states(dev, spec)[name], want, name)
        assert dev.verify()["problems"] == []
    pages = 3 * 2  # updates x pages of a shard
    for s in stats:
        if spec.kind in ("adam", "adamw"):
            # The module's kernel ran every page, pages alternating over the two channels; from the second update
            # on, the pages the module still held came from it, not from NVMe.
            assert (s["launches_channel0"], s["launches_channel1"], s["host_kernels"]) == (pages / 2, pages / 2, 0)
            assert s["module_hits"] == 2 * 2 * 3 and s["pages_loaded"] == 2 * 3
            assert s["pages_evicted"] == 0
        else:  # the module's kernel is Adam's: other kinds run on the host, beside the module
            assert (s["launches_channel0"], s["launches_channel1"], s["host_kernels"]) == (0, 0, pages)


@pytest.mark.parametrize("held", [3, 6])
def test_a_module_smaller_than_the_state_evicts_updated_pages_first(tmp_path, axdimm, monkeypatch, held):
    """8 pages of p, m, v on one shard; the module holds `held` pages of them (half per channel) and a gradient per
    channel: every update streams the state through it, evicting pages already updated in the step before others."""
    page_set = 3 * PAGE
    monkeypatch.setenv("NSP_AXDIMM_MODEL_BYTES", str(held * page_set + 2 * PAGE))
    spec = storage.OptimizerSpec("adamw", weight_decay=0.1)
    with memory_store(1) as mem, \
            on_axdimm(tmp_path / "a", axdimm, num_shards=1) as dev:
        elements = 8 * PAGE // 4
        mem.initialize(params(elements), spec)
        dev.initialize(params(elements), spec)
        assert_runs_match(mem, dev, spec, "dense")
        for name, want in states(mem, spec).items():
            assert_close(states(dev, spec)[name], want, name)
        assert dev.verify()["problems"] == []
        s = dev.shard_stats()[0]["backend"]
    assert s["resident_pages"] <= held and s["pages_evicted"] > 0
    assert s["launches_channel0"] == s["launches_channel1"] == 3 * 4 and s["host_kernels"] == 0
    assert s["pages_evicted"] == s["pages_evicted_updated"] + s["pages_evicted_other"]
    # A page updated in this step is the one to go: the others (read for this step, or still holding the committed
    # version for the next read) stay. The pages of the last step that are evicted are "other".
    assert s["pages_evicted_updated"] > s["pages_evicted_other"]
    if held == 6:
        # Three pages per channel, four to update: each update after the first finds two of a channel's pages still
        # in the module (evicting least recently used would have thrown each out just before its turn).
        assert s["module_hits"] >= 2 * 3 * 2


def test_each_way_axdimm_is_unavailable_says_why(tmp_path, axdimm):
    def refused(options, why, name):
        with on_axdimm(tmp_path / name, options, num_shards=1) as store, pytest.raises(
                storage.StoreError, match=rf"^backend axdimm not available: .*axdimm device 0 \(.*\): {why}"):
            store.initialize(params(), storage.OptimizerSpec("adam"))

    refused({}, r"cannot load the AXDIMM runtime 'libaxdimm\.so' .*: .*libaxdimm\.so", "default")
    refused({"library": str(tmp_path / "nowhere" / "libaxdimm.so")},
            rf"cannot load the AXDIMM runtime '{tmp_path}/nowhere/libaxdimm.so' .*: .*No such file", "missing")
    partial = tmp_path / "partial.cc"
    partial.write_text('extern "C" int nspAxdimmOpen(const char*, void**) { return 0; }\n')
    lib = compile_shared([partial], tmp_path / "libpartial.so")
    refused({"library": str(lib)}, rf"the AXDIMM runtime '{lib}' lacks the symbol nspAxdimmClose", "symbol")
    refused({**axdimm, "device": ""}, r"opening the module  failed \(1\): axdimm model: nspAxdimmOpen: a device "
                                      r"path", "device")
    refused({**axdimm, "cards": "2"}, r"unknown option 'cards'", "option")


@pytest.mark.parametrize("variable, at, what", [
    ("NSP_AXDIMM_MODEL_FAIL_KERNEL_AT", 2, r"the update kernel on page \d+ \(channel [01]\) failed: axdimm model: "
                                           r"nspAxdimmWait: injected kernel fault in launch 2"),
    # The first copy is a page's state going into the module as it is read.
    ("NSP_AXDIMM_MODEL_FAIL_COPY_AT", 1, r"reading page \d+ of state '(param|mu|nu)' in slot 0 failed: loading it "
                                         r"into channel [01] failed: the copy into the module failed \(6\): axdimm "
                                         r"model: nspAxdimmMemcpyH2X: injected copy fault"),
])
def test_an_injected_fault_fails_one_update_cleanly(tmp_path, axdimm, monkeypatch, variable, at, what):
    spec = storage.OptimizerSpec("adam")
    with on_axdimm(tmp_path / "a", axdimm, num_shards=1) as dev:
        dev.initialize(params(), spec)
        committed = dev.read()
    monkeypatch.setenv(variable, str(at))  # read when the module opens: counted from this reopen
    with on_axdimm(tmp_path / "a", axdimm, num_shards=1) as dev, \
            memory_store(1) as mem:
        mem.initialize(params(), spec)
        with pytest.raises(storage.StoreError, match=rf"version 0 is intact: .*axdimm device 0 \({tmp_path}/a/shards/"
                           rf"00000\): {what}"):
            run(dev, spec, "dense", steps=1)
        assert dev.version == 0 and dev.held_versions() == [0]
        np.testing.assert_array_equal(dev.read(), committed)
        assert dev.verify()["problems"] == []
        assert_runs_match(mem, dev, spec, "dense", steps=2)
        assert dev.shard_stats()[0]["backend"]["failed_kernels"] == (1 if "KERNEL" in variable else 0)


def test_a_copy_out_of_the_module_that_fails_fails_the_update(tmp_path, axdimm, monkeypatch):
    """A copy fault on the way back (the new state out of the module): the last copies of an update are the last
    computed page's p, m, v; the update fails naming that page, and the next one is right."""
    spec = storage.OptimizerSpec("adam")
    with on_axdimm(tmp_path / "a", axdimm, num_shards=1) as dev:
        dev.initialize(params(), spec)
    # 3 pages: per page 3 loads, a gradient and 3 copies back = 7 copies; the 21st is the last page's v.
    monkeypatch.setenv("NSP_AXDIMM_MODEL_FAIL_COPY_AT", "21")
    with on_axdimm(tmp_path / "a", axdimm, num_shards=1) as dev, \
            memory_store(1) as mem:
        mem.initialize(params(), spec)
        with pytest.raises(storage.StoreError, match=r"version 0 is intact: .*axdimm device 0 .*: the update kernel on "
                           r"page \d+ \(channel [01]\) failed: state 'nu': the copy out of the module failed \(6\): "
                           r"axdimm model: nspAxdimmMemcpyX2H: injected copy fault"):
            run(dev, spec, "dense", steps=1)
        assert dev.version == 0
        assert_runs_match(mem, dev, spec, "dense", steps=2)
