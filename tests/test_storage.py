"""StateStore: format (plain tensorstore reads it), equality with in-RAM updates, versions, crashes, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import nsp.storage as storage
from nsp.primitives import fused_update

PAGE = 16 * 1024  # small pages: several per shard, and a partial last one
SPECS = {
    "adam": storage.OptimizerSpec("adam"),
    "adamw": storage.OptimizerSpec("adamw", b1=0.8, weight_decay=0.1),
    "sgd": storage.OptimizerSpec("sgd", momentum=0.9, nesterov=True),
    "adagrad": storage.OptimizerSpec("adagrad", initial_nu=0.1),
    "adamw_lazy": storage.OptimizerSpec("adamw", b1=0.8, weight_decay=0.1, lazy=True),
}


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {"kernel": jnp.asarray(rng.standard_normal((123, 97)), jnp.float32),
                  "bias": jnp.asarray(rng.standard_normal(97), jnp.float32)},
        "embed": jnp.asarray(rng.standard_normal((50, 64)), jnp.bfloat16),
    }


def grad_for(step, layout, dtype=np.float32):
    g = np.random.default_rng(1000 + step).standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0.0  # padding never receives gradient
    return g.astype(dtype)


def compressed_for(step, layout, ratio=0.02):
    """Per-shard sorted local indices and values, plus the dense equivalent."""
    rng = np.random.default_rng(2000 + step)
    size, dense, idx_list, val_list = layout.shard_size, np.zeros(layout.padded_total, np.float32), [], []
    for shard in range(layout.num_shards):
        real = min(size, max(0, layout.total - shard * size))
        k = max(1, int(real * ratio))
        idx = np.sort(rng.choice(real, size=k, replace=False)).astype(np.int32)
        val = rng.standard_normal(k).astype(np.float32)
        dense[shard * size + idx] = val
        idx_list.append(idx)
        val_list.append(val)
    return idx_list, val_list, dense


class Reference:
    """The same steps with fused_update on the whole padded vector in RAM."""

    def __init__(self, layout, params, spec):
        self.spec = spec
        self.p = jnp.asarray(layout.flatten(params))
        self.m = jnp.zeros_like(self.p)
        self.v = jnp.full_like(self.p, spec.initial_nu)

    def step(self, grad, step, lr):
        s = self.spec
        out = fused_update(self.p, jnp.asarray(grad), self.m, self.v, kind=s.kind, step=step, lr=lr, b1=s.b1,
                           b2=s.b2, eps=s.eps, weight_decay=s.weight_decay, momentum=s.momentum,
                           nesterov=s.nesterov, lazy=s.lazy)
        self.p = out.param
        self.m = out.mu if out.mu is not None else self.m
        self.v = out.nu if out.nu is not None else self.v


def open_store(tmp_path, tier, **kw):
    kw.setdefault("num_shards", 3)
    kw.setdefault("page_bytes", PAGE)
    return storage.open(None if tier == "memory" else tmp_path / "store", tier=tier, **kw)


@pytest.mark.parametrize("tier", ["memory", "memory-in-place", "file"])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_store_steps_equal_in_ram_steps(tmp_path, tier, kind):
    params, spec = make_params(), SPECS[kind]
    kw = {"in_place": True} if tier == "memory-in-place" else {}
    with open_store(tmp_path, tier.split("-")[0], **kw) as store:
        store.initialize(params, spec)
        ref = Reference(store.layout, params, spec)
        for step in range(1, 6):
            lr = 0.01 / step
            if step % 2:
                grad = grad_for(step, store.layout)
                out = store.update(grad, version=step - 1, lr=lr, step=step)
            else:
                idx, val, grad = compressed_for(step, store.layout)
                out = store.update(indices=idx, values=val, version=step - 1, lr=lr, step=step)
            ref.step(grad, step, lr)
            np.testing.assert_array_equal(out["params"], np.asarray(ref.p), err_msg=f"step {step}")
        np.testing.assert_array_equal(store.read("param"), np.asarray(ref.p))
        used = spec.states_used()
        if used[1]:
            np.testing.assert_array_equal(store.read("mu"), np.asarray(ref.m))
        if used[2]:
            np.testing.assert_array_equal(store.read("nu"), np.asarray(ref.v))
        assert store.version == 5


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_update_writes_params_into_a_caller_buffer(tmp_path, tier):
    """params_into: every step (and a skipped one) lands in the same caller array, equal to a fresh-array store's
    result; a wrong buffer is refused before anything runs."""
    params, spec = make_params(), SPECS["adam"]
    with open_store(tmp_path, tier) as store:
        store.initialize(params, spec)
        ref = Reference(store.layout, params, spec)
        buf = np.full(store.layout.padded_total, np.nan, np.float32)
        for step in (1, 2):
            out = store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step, params_into=buf)
            ref.step(grad_for(step, store.layout), step, 0.01)
            assert out["params"] is buf
            np.testing.assert_array_equal(buf, np.asarray(ref.p))
        bad = grad_for(3, store.layout)
        bad[0] = np.nan
        buf[:] = 0
        assert store.update(bad, version=2, lr=0.01, step=3, params_into=buf)["params"] is buf
        np.testing.assert_array_equal(buf, np.asarray(ref.p))  # skipped: the committed params
        n = store.layout.padded_total
        for wrong in (np.zeros(n, np.float64), np.zeros(n - 1, np.float32), np.zeros((2, n), np.float32)[:, 0],
                      [0.0] * n):
            with pytest.raises(ValueError, match="params_into must be"):
                store.update(grad_for(3, store.layout), version=2, lr=0.01, step=3, params_into=wrong)
        with pytest.raises(ValueError, match="needs params_out"):
            store.update(grad_for(3, store.layout), version=2, lr=0.01, step=3, params_out=False,
                         params_into=np.zeros(n, np.float32))
        assert store.version == 2 and store.stats()["updates"] == 2
        assert store.stats()["wait_ns"] == 0  # only a staleness-1 step waits for a background update


def test_bf16_gradients_and_bf16_params_out(tmp_path):
    params, spec = make_params(), SPECS["adamw"]
    with open_store(tmp_path, "file") as store:
        store.initialize(params, spec)
        ref = Reference(store.layout, params, spec)
        grad = grad_for(1, store.layout, ml_dtypes.bfloat16)
        out = store.update(grad, version=0, lr=0.01, step=1, bf16_out=True)
        ref.step(jnp.asarray(grad), 1, 0.01)
        np.testing.assert_array_equal(out["params"], np.asarray(ref.p))
        assert out["params_bf16"].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(out["params_bf16"], np.asarray(ref.p.astype(jnp.bfloat16)))


def test_pages_larger_than_one_disk_request_round_trip(tmp_path):
    """A 4 MiB page moves as several requests (ffi/backends/page_file.h: kMaxRequestBytes): every piece lands where it
    belongs, read and written, the partial last page included. The file tier matches the memory tier bit for bit
    over steps that read back what the previous one wrote, and tensorstore reads the committed pages with their
    checksums intact."""
    page = 4 * 2**20
    n = 2 * page // 4 + 12345  # two whole pages and a partial third
    rng = np.random.default_rng(7)
    params = {"w": jnp.asarray(rng.standard_normal(n, np.float32))}
    with storage.open(tmp_path / "store", tier="file", page_bytes=page) as store, \
            storage.open(None, tier="memory", page_bytes=page) as ref:
        for s in (store, ref):
            s.initialize(params, SPECS["adam"])
        for step in (1, 2, 3):
            g = rng.standard_normal(store.layout.padded_total).astype(np.float32)
            got = store.update(g, version=step - 1, lr=0.01, step=step)
            want = ref.update(g, version=step - 1, lr=0.01, step=step)
            np.testing.assert_array_equal(got["params"], want["params"])
        expected = {s: ref.read(s) for s in ("param", "mu", "nu")}
        for s, want in expected.items():
            np.testing.assert_array_equal(store.read(s), want)
        shard_dir = store.shard_paths[0]
        assert store.verify()["problems"] == []
    version = __import__("json").loads((shard_dir / "MANIFEST.json").read_text())["version"]
    for state, want in expected.items():
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                      "path": str(shard_dir / f"slot{version % 2}" / state)}}).result()
        np.testing.assert_array_equal(arr.read().result()[:n], want[:n])


def test_plain_tensorstore_reads_and_writes_the_store(tmp_path):
    params = make_params()
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(params, SPECS["adam"])
        for step in (1, 2, 3):
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
        expected = {s: store.read(s) for s in ("param", "mu", "nu")}
        size = store.layout.shard_size
        shard_dirs = store.shard_paths
    # No nsp code from here on: tensorstore alone finds the committed version's arrays.
    for shard, shard_dir in enumerate(shard_dirs):
        version = __import__("json").loads((shard_dir / "MANIFEST.json").read_text())["version"]
        for state in ("param", "mu", "nu"):
            arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                          "path": str(shard_dir / f"slot{version % 2}" / state)}}
                          ).result()
            assert arr.dtype == ts.float32 and arr.shape == (size,)
            np.testing.assert_array_equal(arr.read().result(), expected[state][shard * size:(shard + 1) * size])
    # And the other way: the engine parses a page tensorstore wrote (its checksum is intact), and, since the
    # manifest ties each page to what the engine wrote there, reports it as a page put in another's place.
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(shard_dirs[1] / "slot1" / "mu")}}
                  ).result()
    arr[5:9] = np.asarray([1, 2, 3, 4], np.float32)
    with storage.open(tmp_path / "store", tier="file", num_shards=2, page_bytes=PAGE) as store:
        assert store.version == 3
        problems = store.verify()["problems"]
        assert len(problems) == 1 and "slot1/mu/c/0" in problems[0] and "is intact but is not the page" in problems[0]


def test_metadata_describes_the_layout(tmp_path):
    import json

    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adamw"])
        total = store.layout.total
    meta = json.loads((tmp_path / "store" / "nsp_store.json").read_text())
    assert meta["layout"]["total"] == total == 123 * 97 + 97 + 50 * 64
    assert [leaf["path"] for leaf in meta["layout"]["leaves"]] == ["['dense']['bias']", "['dense']['kernel']",
                                                                    "['embed']"]
    assert meta["optimizer"]["kind"] == "adamw" and meta["optimizer"]["weight_decay"] == 0.1
    assert meta["layout"]["page_elems"] == PAGE // 4 and meta["layout"]["num_shards"] == 3


def test_replay_gives_the_same_bytes_and_old_versions_are_refused(tmp_path):
    params = make_params()
    with open_store(tmp_path, "file") as store:
        store.initialize(params, SPECS["adam"])
        for step in (1, 2):
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
        first = {s: store.read(s) for s in ("param", "mu", "nu")}
        # Replay step 2 from version 1: the same bytes again, committed version 2.
        out = store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
        assert store.version == 2
        np.testing.assert_array_equal(out["params"], first["param"])
        for s in ("param", "mu", "nu"):
            np.testing.assert_array_equal(store.read(s), first[s])
        with pytest.raises(storage.StoreError, match="no longer holds version 0"):
            store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        with pytest.raises(storage.StoreError, match="no longer holds version 7"):
            store.read("param", version=7)


def test_in_place_memory_store_updates_one_copy_and_refuses_replays(tmp_path):
    params = make_params()
    with open_store(tmp_path, "memory", in_place=True) as store:
        assert "in place" in repr(store)
        store.initialize(params, SPECS["adam"])
        ref = Reference(store.layout, params, SPECS["adam"])
        for step in (1, 2):
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
            ref.step(grad_for(step, store.layout), step, 0.01)
        assert store.held_versions() == [2]  # one copy: the version before is gone
        with pytest.raises(storage.StoreError, match="no longer holds version 1"):
            store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
        # The refused replay wrote nothing, and a non-finite gradient skips the step untouched.
        bad = grad_for(3, store.layout)
        bad[5] = np.nan
        assert store.update(bad, version=2, lr=0.01, step=3)["skipped"]
        for state, expected in (("param", ref.p), ("mu", ref.m), ("nu", ref.v)):
            np.testing.assert_array_equal(store.read(state), np.asarray(expected))
        assert store.version == 2
    with pytest.raises(ValueError, match="in_place=True is for the memory tier"):
        storage.open(tmp_path / "f", tier="file", in_place=True)


def test_engine_buffers_are_bounded_by_pages_in_flight(tmp_path):
    with open_store(tmp_path, "file", num_shards=1, pages_in_flight=3) as store:
        store.initialize({"w": jnp.zeros(300_000)}, SPECS["adam"])
        assert store.layout.pages_per_shard > 3  # more pages than buffers
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        # 3 buffer sets x 3 states x one page (+ its checksum, rounded up to 4 KiB for direct I/O), whatever the
        # model size.
        assert store.stats()["buffer_bytes"] == 3 * 3 * (PAGE + 4096)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel grants no transparent huge pages")
def test_memory_tier_state_lies_on_huge_pages():
    """The update streams the memory tier's state: it is allocated on transparent huge pages
    (ffi/backends/backend.cc)."""
    code = textwrap.dedent("""
        import numpy as np, nsp.storage as storage

        def huge():
            with open("/proc/self/smaps_rollup") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("AnonHugePages:"))

        p = np.ones(16 << 20, np.float32)
        before = huge()
        store = storage.open(tier="memory")
        store.initialize({"w": p}, storage.OptimizerSpec("adam"))
        print(huge() - before)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    assert proc.returncode == 0, proc.stderr
    state_bytes = 2 * 3 * 4 * (16 << 20)  # two version slots of p, m, v
    # The kernel may refuse a few huge pages (memory too fragmented to compact): most must be granted.
    assert int(proc.stdout.split()[-1]) >= state_bytes // 2


def test_traffic_counters_follow_table_1(tmp_path):
    """Smart-Infinity Table I with M = 2 bytes x params (fp16 model size) and fp32 transport (2M per vector)."""
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        n = store.layout.padded_total
        M = 2 * n
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        s = store.stats()
        # SmartUpdate: 2M grads in, 2M params out on the shared link; the state stays inside (6M read + 6M write),
        # counted as the page files moved: plus each file's CRC-32C trailer (and zarr's padding of a shard's last
        # page, and direct I/O's block padding of what it writes).
        assert (s["shared_in_bytes"], s["shared_out_bytes"]) == (2 * M, 2 * M)
        files = 3 * store.layout.pages_per_shard * store.num_shards
        for key in ("internal_read_bytes", "internal_write_bytes"):
            assert 6 * M + 4 * files <= s[key] <= 6 * M + (4 + PAGE + 4096) * files, key
        store.reset_stats()
        # bf16 transport halves the shared link: M grads in, M params out.
        store.update(grad_for(2, store.layout, ml_dtypes.bfloat16), version=1, lr=0.01, step=2,
                     params_out=False, bf16_out=True)
        s = store.stats()
        assert (s["shared_in_bytes"], s["shared_out_bytes"]) == (M, M)
        store.reset_stats()
        # SmartComp: only the kept values (and their int32 indices) go down: ratio c of 2M, plus 4 B per index.
        idx, val, _ = compressed_for(3, store.layout, ratio=0.01)
        k = sum(len(i) for i in idx)
        store.update(indices=idx, values=val, version=2, lr=0.01, step=3)
        s = store.stats()
        assert s["shared_in_bytes"] == k * 4 + k * 4
        assert s["shared_out_bytes"] == 2 * M


def test_update_time_is_split_into_stream_sync_and_commit(tmp_path):
    """stats() splits an update's wall time: the sync that made the new version durable and the commit that recorded
    it are parts of update_ns, each timed per update (a skipped step neither syncs nor commits)."""
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.reset_stats()
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        s = store.stats()
        assert s["updates"] == 1
        assert 0 < s["sync_ns"] and 0 < s["commit_ns"]
        assert s["sync_ns"] + s["commit_ns"] < s["update_ns"]  # the page stream took the rest
        store.reset_stats()
        bad = grad_for(2, store.layout)
        bad[0] = np.nan
        store.update(bad, version=1, lr=0.01, step=2)
        s = store.stats()
        assert s["skipped"] == 1 and (s["sync_ns"], s["commit_ns"]) == (0, 0)


def test_second_writer_is_refused(tmp_path):
    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adam"])
        proc = subprocess.run(
            [sys.executable, "-c", "import nsp.storage as s, sys; "
             f"s.open(sys.argv[1], tier='file', num_shards=3, page_bytes={PAGE})", str(tmp_path / "store")],
            capture_output=True, text=True)
        assert proc.returncode != 0
        assert "already open for writing by pid" in proc.stderr
    # Closed: the lock is free again.
    storage.open(tmp_path / "store", tier="file", num_shards=3, page_bytes=PAGE).close()


def test_opening_with_another_layout_is_refused(tmp_path):
    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adam"])
    with pytest.raises(storage.StoreError, match="num_shards=3, opened with num_shards=2"):
        storage.open(tmp_path / "store", tier="file", num_shards=2, page_bytes=PAGE)
    with storage.open(tmp_path / "store", tier="file", num_shards=3, page_bytes=PAGE) as store:
        with pytest.raises(storage.StoreError, match="different layout"):
            store.initialize({"w": jnp.zeros(10)}, SPECS["adam"])
        with pytest.raises(storage.StoreError, match="was created for"):
            store.initialize(make_params(), SPECS["sgd"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(grad=np.zeros(5, np.float32)), ValueError, "grad has 5 elements"),
        (dict(grad="int"), TypeError, "float32 or bfloat16"),
        (dict(indices=[np.asarray([3, 1], np.int32)] * 3, values=[np.ones(2, np.float32)] * 3), storage.StoreError,
         "sorted ascending"),
        (dict(indices=[np.asarray([1], np.int64)] * 3, values=[np.ones(1, np.float32)] * 3), TypeError, "int32"),
        (dict(), ValueError, "needs either grad"),
    ],
)
def test_bad_update_input_leaves_the_committed_version(tmp_path, kwargs, error, match):
    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adam"])
        before = store.read("param")
        if isinstance(kwargs.get("grad"), str):
            kwargs["grad"] = np.zeros(store.layout.padded_total, np.int32)
        with pytest.raises(error, match=match):
            store.update(version=0, lr=0.1, step=1, **kwargs)
        assert store.version == 0
        np.testing.assert_array_equal(store.read("param"), before)


def test_bad_paths(tmp_path):
    with pytest.raises(storage.StoreError, match="does not exist"):
        storage.open(tmp_path / "missing" / "store", tier="file")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(storage.StoreError, match="not a directory"):
        storage.open(tmp_path / "afile", tier="file")
    with pytest.raises(ValueError, match="unknown tier"):
        storage.open(tmp_path / "s", tier="tape")
    with pytest.raises(ValueError, match="multiple of 4096"):
        storage.open(tmp_path / "s", page_bytes=1000)


def _mount_tmpfs(path, options):
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_fails_cleanly_and_keeps_the_committed_version(tmp_path):
    """A write that runs out of space: a clear error, version 0 intact and readable. Uses a tiny tmpfs when
    this machine lets us mount one, else the fault-injecting backend's ENOSPC (NSP_DEBUG_FAIL_WRITES_AFTER)."""
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(200_000), jnp.float32)}
    mnt = tmp_path / "tiny"
    mounted = _mount_tmpfs(mnt, "size=16m")
    path = (mnt if mounted else tmp_path) / "store"
    try:
        with storage.open(path, tier="file", page_bytes=PAGE * 16) as store:
            store.initialize(params, SPECS["adam"])  # set-up checks the space both versions need: it is there
        if mounted:  # then the disk shrinks under the store: version 0 (3.2 MB of p/m/v pages) fits, 1 does not
            subprocess.run(["mount", "-o", "remount,size=5m", str(mnt)], check=True)
        else:
            os.environ["NSP_DEBUG_FAIL_WRITES_AFTER"] = "3"
        with storage.open(path, tier="file", page_bytes=PAGE * 16) as store:
            with pytest.raises(storage.StoreError, match="No space left on device"):
                store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
            assert store.version == 0
            np.testing.assert_array_equal(store.read("param")[:200_000], np.asarray(params["w"]))
        with storage.open(path, tier="file", page_bytes=PAGE * 16) as store:
            assert store.version == 0
    finally:
        os.environ.pop("NSP_DEBUG_FAIL_WRITES_AFTER", None)
        if mounted:
            subprocess.run(["umount", str(mnt)])


def test_read_only_directory_is_refused(tmp_path):
    mnt = tmp_path / "ro"
    if not _mount_tmpfs(mnt, "ro,size=1m"):
        pytest.skip("cannot mount a read-only tmpfs here (as root, permission bits do not make a directory "
                    "read-only)")
    try:
        with pytest.raises(storage.StoreError, match="Read-only file system"):
            storage.open(mnt / "store", tier="file")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_corrupt_page_names_the_state_and_page(tmp_path):
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        page = store.shard_paths[0] / "slot1" / "nu" / "c" / "1"
        data = bytearray(page.read_bytes())
        data[10] ^= 0x40
        page.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match=r"checksum mismatch: state 'nu', page 1 of shard"):
            store.read("nu")
        with pytest.raises(storage.StoreError, match="checksum mismatch"):
            store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
        assert store.version == 1



def test_missing_page_is_an_error_never_zeros(tmp_path):
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        page = store.shard_paths[0] / "slot1" / "mu" / "c" / "2"
        page.unlink()
        with pytest.raises(RuntimeError, match=r"page file .*slot1/mu/c/2 is missing: the store is damaged"):
            store.read("mu")
        assert any("slot1/mu/c/2 is missing" in p for p in store.verify()["problems"])
        with pytest.raises(storage.StoreError, match="is missing"):
            store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
    # Reopening names the damage at once: the manifest's version lacks a page.
    damage = r"manifest names version 1, but .*slot1/mu/c holds \d+ of its \d+ pages"
    with pytest.raises(storage.StoreError, match=damage):
        storage.open(tmp_path / "store")


def _set_manifest_version(shard, version):
    """Rewrites a shard manifest's version, keeping its identity and checksums."""
    import json

    manifest = json.loads((shard / "MANIFEST.json").read_text())
    (shard / "MANIFEST.json").write_text(json.dumps(dict(manifest, version=version)))


def test_manifest_naming_a_version_the_store_lacks_is_refused(tmp_path):
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        shards = store.shard_paths
    for shard in shards:  # as if the manifests ran ahead of the pages (version 7 lives in slot 1: never written)
        _set_manifest_version(shard, 7)
    with pytest.raises(storage.StoreError, match=r"manifest names version 7, but .*slot1/param/c holds 0 of its"):
        storage.open(tmp_path / "store")

_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    import nsp.storage as storage
    path, steps = sys.argv[1], int(sys.argv[2])
    n = 1_500_003
    store = storage.open(path, tier="file", num_shards=2, page_bytes=64 * 1024)
    if not store.initialized:
        store.initialize({"w": np.random.default_rng(0).standard_normal(n).astype(np.float32)},
                         storage.OptimizerSpec("adamw", weight_decay=0.01))
    layout = store.layout
    while store.version < steps:
        step = store.version + 1
        g = np.random.default_rng(step).standard_normal(layout.padded_total).astype(np.float32)
        g[layout.total:] = 0
        store.update(g, version=step - 1, lr=1e-3, step=step)
        print(step, flush=True)
    store.close()
""")


def _writer(path, target, **kw):
    return subprocess.Popen([sys.executable, "-c", _WRITER, path, str(target)], stdout=subprocess.PIPE, text=True,
                            **kw)


def _kill_reference():
    n = 1_500_003
    layout = storage.Layout.from_tree({"w": jnp.zeros(n)}, num_shards=2, page_bytes=64 * 1024)
    return layout, Reference(layout, {"w": jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))},
                             storage.OptimizerSpec("adamw", weight_decay=0.01))


def _reference_step(ref, layout, step):
    g = np.random.default_rng(step).standard_normal(layout.padded_total).astype(np.float32)
    g[layout.total:] = 0
    ref.step(g, step, 1e-3)


def _assert_states_equal(store, expected, msg):
    """p, m and v, bit for bit; expected maps a state name to its array."""
    for state, want in expected.items():
        np.testing.assert_array_equal(store.read(state), np.asarray(want), err_msg=f"{msg}: state {state}")


KILL_STEPS_PER_RUN = 6  # each trial's run aims this many steps past the version it starts from
KILL_MAX_DELAY_S = 0.6  # a trial's first kill lands within this long after its run's first update
KILL_ATTEMPTS = 4  # a run that finished before its kill is retried with a quarter of the delay, the last with none


def test_kill_during_updates_leaves_a_whole_committed_version(tmp_path):
    """SIGKILL a writer mid-run, four times over the same store: each kill must land (exit -9, committed version
    below the run's target, no printed step lost), the committed version must equal the in-RAM steps in p, m and
    v, and the resumed run must land where an uninterrupted run lands."""
    path = str(tmp_path / "store")
    rng = np.random.default_rng(7)
    layout, ref = _kill_reference()
    version = 0
    for trial in range(4):
        delay = float(rng.uniform(0.0, KILL_MAX_DELAY_S))
        for attempt in range(KILL_ATTEMPTS):
            target = version + KILL_STEPS_PER_RUN
            with open(tmp_path / f"trial{trial}.{attempt}.err", "w+") as err:
                proc = _writer(path, target, stderr=err)
                first = proc.stdout.readline()  # at least one update done in this run
                time.sleep(delay)  # then somewhere inside a later update or commit
                proc.send_signal(signal.SIGKILL)  # a no-op when the run has already exited
                printed = first.split() + proc.communicate()[0].split()
                err.seek(0)
                assert first and proc.returncode in (0, -signal.SIGKILL), (
                    f"trial {trial}: the writer failed on its own (exit {proc.returncode}):\n{err.read()[-3000:]}")
            with storage.open(path, tier="file", num_shards=2, page_bytes=64 * 1024) as store:
                before, version = version, store.version
                assert before <= version <= target, f"trial {trial}: version {before} -> {version}, target {target}"
                last = int(printed[-1])
                assert last <= version <= last + 1, (
                    f"trial {trial}: committed version {version}, but the run printed step {last} last")
                for step in range(before + 1, version + 1):
                    _reference_step(ref, layout, step)
                _assert_states_equal(store, {"param": ref.p, "mu": ref.m, "nu": ref.v},
                                     f"trial {trial}, attempt {attempt}, version {version}")
            if proc.returncode == -signal.SIGKILL and version < target:
                break  # the kill landed mid-run
            delay = 0.0 if attempt == KILL_ATTEMPTS - 2 else delay / 4  # the run finished first: kill sooner
        else:
            pytest.fail(f"trial {trial}: in {KILL_ATTEMPTS} runs no kill landed before the run finished "
                        f"(last exit {proc.returncode}, version {version} of target {target})")
    # The run resumes to the end, landing exactly where an uninterrupted run lands, in p, m and v.
    target = version + KILL_STEPS_PER_RUN
    subprocess.run([sys.executable, "-c", _WRITER, path, str(target)], check=True, capture_output=True)
    clean = str(tmp_path / "clean")
    subprocess.run([sys.executable, "-c", _WRITER, clean, str(target)], check=True, capture_output=True)
    for step in range(version + 1, target + 1):
        _reference_step(ref, layout, step)
    with storage.open(path, tier="file", num_shards=2, page_bytes=64 * 1024) as store, \
            storage.open(clean, tier="file", num_shards=2, page_bytes=64 * 1024) as uninterrupted:
        assert store.version == uninterrupted.version == target
        _assert_states_equal(store, {state: uninterrupted.read(state) for state in ("param", "mu", "nu")},
                             "resumed vs uninterrupted run")
        _assert_states_equal(store, {"param": ref.p, "mu": ref.m, "nu": ref.v}, "resumed vs in-RAM steps")


@pytest.mark.parametrize("variable", ["NSP_DEBUG_KILL_AT_COMMIT", "NSP_DEBUG_KILL_AFTER_WRITES"])
def test_injected_kill_lands_where_its_variable_says(tmp_path, variable):
    """The fault-injecting backend bench/fault_campaign.py aims with kills where asked: just before the
    process's Nth commit (two shards: two commits per update), or at a shard's page write after its first N
    (three per page of the shard and update). Aimed into the second update of a run, it leaves version 1, whole."""
    path = str(tmp_path / "store")
    subprocess.run([sys.executable, "-c", _WRITER, path, "0"], check=True, capture_output=True)  # version 0 only
    layout, ref = _kill_reference()
    n = 3 if variable == "NSP_DEBUG_KILL_AT_COMMIT" else 3 * layout.pages_per_shard + 1
    proc = _writer(path, 3, stderr=subprocess.PIPE, env={**os.environ, variable: str(n)})
    printed, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL and printed.split() == ["1"], (proc.returncode, printed, err[-3000:])
    with storage.open(path, tier="file", num_shards=2, page_bytes=64 * 1024) as store:
        assert store.version == 1
        _reference_step(ref, layout, 1)
        _assert_states_equal(store, {"param": ref.p, "mu": ref.m, "nu": ref.v}, f"killed by {variable}={n}")


def test_a_shard_committed_ahead_rolls_back(tmp_path):
    """A crash between shard commits leaves one shard a version ahead; opening rolls it back."""
    import json

    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        v1 = store.read("param")
        store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
        shard0 = store.shard_paths[0]
    _set_manifest_version(shard0, 1)  # shard 1 still says 2
    with storage.open(tmp_path / "store", tier="file", num_shards=2, page_bytes=PAGE) as store:
        assert store.version == 1
        np.testing.assert_array_equal(store.read("param"), v1)


@pytest.mark.parametrize("content, match", [("{trunc", "corrupt or truncated"), (None, "is missing")])
def test_damaged_metadata_or_manifest_is_a_clear_error(tmp_path, content, match):
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(make_params(), SPECS["adam"])
        manifest = store.shard_paths[0] / "MANIFEST.json"
    good = manifest.read_text()
    if content is None:
        manifest.unlink()
    else:
        manifest.write_text(content)
    with pytest.raises(storage.StoreError, match=match):
        storage.open(tmp_path / "store", tier="file", num_shards=1, page_bytes=PAGE)
    # The failed open released its lock.
    manifest.write_text(good)
    storage.open(tmp_path / "store", tier="file", num_shards=1, page_bytes=PAGE).close()


def test_after_a_failed_update_the_version_before_is_no_longer_replayable(tmp_path):
    """An update from v overwrites the slot that held v - 1; once it has started, v - 1 is gone even if the
    update fails, and the store must say so rather than replay from a half-written slot."""
    params = make_params()
    with open_store(tmp_path, "file") as store:
        store.initialize(params, SPECS["adam"])
        for step in (1, 2):
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
        assert store.held_versions() == [1, 2]
        assert store.layout.pages_per_shard == 2  # 3 states x 2 pages = 6 page writes per shard and update
    os.environ["NSP_DEBUG_FAIL_WRITES_AFTER"] = "8"  # the second update after reopening fails part-way
    try:
        with open_store(tmp_path, "file") as store:
            assert store.held_versions() == [2]  # a reopened store does not vouch for the slot beside
            store.update(grad_for(3, store.layout), version=2, lr=0.01, step=3)
            assert store.held_versions() == [2, 3]
            v3 = store.read("param")
            with pytest.raises(storage.StoreError, match="No space left"):
                store.update(grad_for(4, store.layout), version=3, lr=0.01, step=4)
            assert store.version == 3 and store.held_versions() == [3]
            with pytest.raises(storage.StoreError, match="no longer holds version 2"):
                store.update(grad_for(3, store.layout), version=2, lr=0.01, step=3)
            with pytest.raises(storage.StoreError, match="no longer holds version 2"):
                store.read("param", version=2)
            np.testing.assert_array_equal(store.read("param"), v3)
    finally:
        os.environ.pop("NSP_DEBUG_FAIL_WRITES_AFTER")


def test_verify_reports_each_corrupt_page_and_the_cli_exits_non_zero(tmp_path):
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        report = store.verify()
        assert report["problems"] == [] and report["version"] == 1
        assert report["pages"] == 2 * 3 * store.layout.pages_per_shard
        bad = store.shard_paths[1] / "slot1" / "mu" / "c" / "0"
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    with storage.open(tmp_path / "store") as store:  # layout arguments come from the store itself
        problems = store.verify()["problems"]
    assert len(problems) == 1 and "state 'mu', page 0 of shard" in problems[0] and "00001" in problems[0]
    proc = subprocess.run([sys.executable, "-m", "nsp.cli", "store", "verify", str(tmp_path / "store")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout and "1 corrupt page(s)" in proc.stdout


def test_close_leaves_no_threads_or_file_descriptors(tmp_path):
    import threading

    def fds():
        return len(os.listdir("/proc/self/fd"))

    baseline_threads, baseline_fds = threading.active_count(), fds()
    for _ in range(3):
        store = open_store(tmp_path, "file")
        if not store.initialized:
            store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(store.version + 1, store.layout), version=store.version, lr=0.01,
                     step=store.version + 1)
        with pytest.raises(storage.StoreError):
            store.update(grad_for(1, store.layout), version=99, lr=0.01, step=1)  # errors leak nothing either
        store.close()
    assert threading.active_count() == baseline_threads
    assert fds() == baseline_fds


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_gradient_skips_the_step_and_leaves_the_store_untouched(tmp_path, bad):
    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        before = {s: store.read(s) for s in ("param", "mu", "nu")}
        g = grad_for(2, store.layout)
        g[17] = bad
        out = store.update(g, version=1, lr=0.01, step=2)
        assert out["skipped"] and store.version == 1 and store.stats()["skipped"] == 1
        np.testing.assert_array_equal(out["params"], before["param"])
        for s in ("param", "mu", "nu"):
            np.testing.assert_array_equal(store.read(s), before[s])
        assert not store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)["skipped"]
        assert store.version == 2


@pytest.mark.parametrize("tier", ["file", "memory", "csd"])
@pytest.mark.parametrize("where", ["first page", "last page"])
def test_one_shard_checks_the_gradient_inside_its_update_pass(tmp_path, tier, where):
    """A one-shard store finds a NaN/Inf in its update pass (no pass over the gradient before it): pages before
    the bad one were already updated into the other slot, which stays uncommitted, so the committed version, its
    params and every later step are exactly as if the bad gradient never came; only the version before the
    committed one is gone. The csd tier's device has no check of its own: the host checks each page first."""
    import ml_dtypes

    path = None if tier == "memory" else tmp_path / "store"
    with storage.open(path, tier=tier, num_shards=1, page_bytes=PAGE) as store, \
            storage.open(None, tier="memory", num_shards=2, page_bytes=PAGE) as ref:
        for s in (store, ref):
            s.initialize(make_params(), SPECS["adamw"])
            s.update(grad_for(1, s.layout), version=0, lr=0.01, step=1)
        assert store.layout.shard_size > 3 * (PAGE // 4)  # 4 pages: those before the last are updated first
        assert store.held_versions() == [0, 1]
        before = {s: store.read(s) for s in ("param", "mu", "nu")}
        for dtype, bad in ((np.float32, np.nan), (ml_dtypes.bfloat16, np.inf)):
            g = grad_for(2, store.layout, dtype)
            g[3 if where == "first page" else store.layout.total - 1] = bad
            buf = np.full(store.layout.padded_total, 7.0, np.float32)
            out = store.update(g, version=1, lr=0.01, step=2, params_into=buf, bf16_out=True)
            assert out["skipped"] and store.version == 1 and out["params"] is buf
            np.testing.assert_array_equal(buf, before["param"])  # the committed params, not the half pass's
            np.testing.assert_array_equal(out["params_bf16"], before["param"].astype(ml_dtypes.bfloat16))
            for s in ("param", "mu", "nu"):
                np.testing.assert_array_equal(store.read(s), before[s])
            assert store.held_versions() == [1], "the other slot was partly overwritten: version 0 is gone"
        assert store.stats()["skipped"] == 2 and store.stats()["updates"] == 1
        for step in (2, 3):
            got = store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
            want = ref.update(grad_for(step, ref.layout), version=step - 1, lr=0.01, step=step)
            assert not got["skipped"]
            np.testing.assert_allclose(got["params"], want["params"], rtol=1e-6, atol=1e-7)
        for s in ("param", "mu", "nu"):
            np.testing.assert_allclose(store.read(s), ref.read(s), rtol=1e-6, atol=1e-7)


def test_several_shards_check_the_gradient_before_the_update(tmp_path):
    """Shards must skip together, so a store of several checks the whole gradient before any shard starts: a
    skip there touches no slot, and the version before stays replayable."""
    with open_store(tmp_path, "file", num_shards=2) as store:
        store.initialize(make_params(), SPECS["adam"])
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        g = grad_for(2, store.layout)
        g[store.layout.total - 1] = np.nan
        assert store.update(g, version=1, lr=0.01, step=2)["skipped"]
        assert store.held_versions() == [0, 1]


@pytest.mark.parametrize("variable", ["NSP_BUFFERED_WRITES", "NSP_NO_DIRECT_IO", "NSP_REPLACE_PAGES",
                                      "NSP_NO_SLOT_LAYOUT", "NSP_READ_MODE=buffered", "NSP_READ_MODE=direct"])
def test_other_io_paths_give_the_same_bytes(tmp_path, monkeypatch, variable):
    """Buffered writes (opt-out of direct writes), fully buffered I/O (opt-out of direct reads and writes),
    replacing every page (opt-out of in-place rewrites), page files left to the writers (opt-out of the slot
    layout) and either read mode fixed store exactly the same state."""
    variable, _, value = variable.partition("=")
    monkeypatch.setenv(variable, value or "1")
    params, spec = make_params(), SPECS["adamw"]
    with open_store(tmp_path, "file") as store:
        store.initialize(params, spec)
        ref = Reference(store.layout, params, spec)
        for step in (1, 2, 3):
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
            ref.step(grad_for(step, store.layout), step, 0.01)
        for state, expected in (("param", ref.p), ("mu", ref.m), ("nu", ref.v)):
            np.testing.assert_array_equal(store.read(state), np.asarray(expected))
    monkeypatch.delenv(variable)
    with storage.open(tmp_path / "store") as store:  # and the default path reads it back
        assert store.verify()["problems"] == []
        np.testing.assert_array_equal(store.read("param"), np.asarray(ref.p))


def test_slot_layout_replaces_only_pages_about_to_be_written_and_spares_snapshots(tmp_path):
    """The file tier makes a slot's missing, snapshot-shared or wrong-sized page files before writing them (in
    read order): afterwards every page file of both slots is whole and unshared, nothing temporary is left, and a
    snapshot that hard-linked the pages an update then rewrote still holds its own bytes."""
    from nsp.storage.snapshot import snapshot_store

    params, spec = make_params(), SPECS["adamw"]
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(params, spec)
        store.update(grad_for(1, store.layout), version=0, lr=0.01, step=1)
        # Slot 1 holds version 1; link it into a snapshot, then step twice: the second step writes slot 1 again.
        snap = tmp_path / "snap"
        snapshot_store(store, snap, mode="link")
        linked = sorted(p for p in snap.rglob("*") if p.is_file() and p.stat().st_nlink > 1)
        assert linked, "the snapshot should share page files with the store"
        before = {p: p.read_bytes() for p in linked}
        store.update(grad_for(2, store.layout), version=1, lr=0.01, step=2)
        store.update(grad_for(3, store.layout), version=2, lr=0.01, step=3)
        assert all(p.read_bytes() == b for p, b in before.items()), "a snapshot's page changed"
        assert all(p.stat().st_nlink == 1 for p in linked), "the store still shares pages the update rewrote"
        shard = tmp_path / "store" / "shards" / "00000"
        pages = [p for p in shard.rglob("c/*") if p.is_file()]
        assert pages and not [p for p in shard.rglob("*.nsp-tmp")]
        sizes = {p.stat().st_size for p in pages}
        assert len(sizes) == 1 and all(p.stat().st_nlink == 1 for p in pages)
        assert store.verify()["problems"] == []


@pytest.mark.parametrize("call", ["read_pages", "write_pages", "page_checksums", "set_page_checksums"])
@pytest.mark.parametrize(("slot", "state"), [(2, 0), (-1, 0), (0, 3), (1, -1)])
def test_engine_page_calls_reject_a_bad_slot_or_state(tmp_path, call, slot, state):
    params, spec = make_params(), SPECS["adamw"]
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(params, spec)
        engine = store._engines[0]
        buf = np.zeros(store.layout.page_elems, np.float32)
        args = {"read_pages": (0, buf), "write_pages": (0, buf), "page_checksums": (), "set_page_checksums": ([],)}
        with pytest.raises(Exception, match=f"{call}: slot must be 0 or 1 and state 0 \\(param\\)"):
            getattr(engine, call)(slot, state, *args[call])


def _direct_io_works(directory) -> bool:
    """Whether the file system under ``directory`` accepts O_DIRECT (tmpfs does not)."""
    probe = os.path.join(directory, "direct-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.parametrize("mode", ["auto", "direct", "buffered"])
def test_read_mode_picks_direct_or_buffered_reads_per_update(tmp_path, monkeypatch, mode):
    """NSP_READ_MODE: auto (the default) reads the first two updates direct and the third buffered (a trial, timed
    against the second), then every page the way that made its update faster. direct and buffered fix it. Where the
    file system refuses O_DIRECT, every read is buffered."""
    if mode != "auto":
        monkeypatch.setenv("NSP_READ_MODE", mode)
    direct_ok = _direct_io_works(tmp_path)
    with open_store(tmp_path, "file", num_shards=1) as store:
        store.initialize(make_params(), SPECS["adam"])
        pages = 3 * store.layout.pages_per_shard
        direct_per_update = []
        for step in range(1, 6):
            before = store.stats()["pages_read_direct"]
            store.update(grad_for(step, store.layout), version=step - 1, lr=0.01, step=step)
            direct_per_update.append(store.stats()["pages_read_direct"] - before)
        assert store.stats()["pages_read"] == 5 * pages
    if not direct_ok:
        assert direct_per_update == [0] * 5
    elif mode == "direct":
        assert direct_per_update == [pages] * 5
    elif mode == "buffered":
        assert direct_per_update == [0] * 5
    else:
        assert direct_per_update[:3] == [pages, pages, 0]
        assert direct_per_update[3] == direct_per_update[4] and direct_per_update[3] in (0, pages)


def test_unknown_read_mode_fails_where_the_file_tier_is_opened(tmp_path, monkeypatch):
    """NSP_READ_MODE takes auto, direct or buffered: any other value fails where the file tier's engines are made
    (opening a store that holds state, or giving a new one its state), naming the variable, its value and the
    valid choices, instead of reading as auto."""
    message = r"NSP_READ_MODE='fastest' is not one of auto, direct, buffered"
    with open_store(tmp_path, "file") as store:
        store.initialize(make_params(), SPECS["adam"])
    monkeypatch.setenv("NSP_READ_MODE", "fastest")
    with pytest.raises(ValueError, match=message):
        storage.open(tmp_path / "store")
    (tmp_path / "new").mkdir()
    with open_store(tmp_path / "new", "file") as store:
        with pytest.raises(ValueError, match=message):
            store.initialize(make_params(), SPECS["adam"])
        assert not store.initialized  # no half-made store: with the variable fixed, initialize works
        monkeypatch.setenv("NSP_READ_MODE", "direct")
        store.initialize(make_params(), SPECS["adam"])
        assert store.version == 0
    monkeypatch.setenv("NSP_READ_MODE", "")  # empty reads as unset: auto
    with storage.open(tmp_path / "store") as store:
        assert store.verify()["problems"] == []


def _crc32c_reference(data: bytes) -> int:
    """Bit-at-a-time CRC-32C (reflected Castagnoli polynomial), straight from its definition."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_page_checksum_is_crc32c():
    """The engine's CRC-32C (PCLMUL-folded blocks of 5632 bytes beside crc32, then three interleaved crc32 lanes
    joined by table shifts) against a bit-at-a-time reference, on lengths around the block and lane boundaries,
    at an odd offset, and continued across calls."""
    from nsp import _nsp_ffi

    assert _nsp_ffi.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the standard check value
    block = 64 * 64 + 8 * 3 * 64
    data = np.random.default_rng(3).integers(0, 256, 3 * block + 3 * 4096 + 78, dtype=np.uint8)[1:]
    for n in (0, 1, 7, 8, 4096, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 9, block - 1, block, block + 1,
              2 * block + 3 * 4096, data.size):
        assert _nsp_ffi.crc32c(data[:n]) == _crc32c_reference(data[:n].tobytes()), n
    head = _nsp_ffi.crc32c(data[:5000])
    assert _nsp_ffi.crc32c(data[5000:], crc=head) == _crc32c_reference(data.tobytes())


def test_all_finite_finds_nan_and_inf_anywhere():
    """The multithreaded NaN/Inf check store.update runs first: positions across a vector long enough to be
    split across threads, both signs, the largest finite values (which must pass), bf16 bit patterns, empty.
    test_kernel_isa.py runs it under every ISA the CPU has."""
    import ml_dtypes

    from nsp import _nsp_ffi

    n = (1 << 17) + 3  # several tasks, and a tail
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    assert _nsp_ffi.all_finite(x) and _nsp_ffi.all_finite(np.zeros(0, np.float32))
    x[[0, n // 2, n - 1]] = [np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny]
    assert _nsp_ffi.all_finite(x)
    # Every lane of the first vectors and of the last ones (the SIMD scans' unrolled body and their tail), and
    # short vectors that are all tail.
    for pos in (*range(0, 300, 7), n // 2, *range(n - 300, n, 5), n - 2, n - 1):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[pos] = bad
            assert not _nsp_ffi.all_finite(y), (pos, bad)
    for size in (1, 3, 15, 16, 17, 63, 64, 65, 129):
        for pos in {0, size // 2, size - 1}:
            y = x[:size].copy()
            assert _nsp_ffi.all_finite(y), size
            y[pos] = np.nan
            assert not _nsp_ffi.all_finite(y), (size, pos)
    b = np.random.default_rng(1).standard_normal(n).astype(ml_dtypes.bfloat16)
    b[[0, n - 1]] = np.array([ml_dtypes.finfo(ml_dtypes.bfloat16).max] * 2, ml_dtypes.bfloat16)
    assert _nsp_ffi.all_finite(b.view(np.uint16))
    for pos in (*range(0, 300, 7), n // 3, *range(n - 300, n, 5), n - 1):
        for bad in (np.nan, np.inf, -np.inf):
            c = b.copy()
            c[pos] = bad
            assert not _nsp_ffi.all_finite(c.view(np.uint16)), (pos, bad)
    with pytest.raises(TypeError, match="float32 values, or bfloat16"):
        _nsp_ffi.all_finite(np.zeros(4, np.float64))


def test_non_finite_bf16_gradient_skips_the_step(tmp_path):
    import ml_dtypes

    with open_store(tmp_path, "memory") as store:
        store.initialize(make_params(), SPECS["adam"])
        g = grad_for(1, store.layout).astype(ml_dtypes.bfloat16)
        g[-1] = np.inf
        out = store.update(g, version=0, lr=0.01, step=1)
        assert out["skipped"] and store.version == 0
        assert not store.update(grad_for(1, store.layout).astype(ml_dtypes.bfloat16), version=0, lr=0.01,
                                step=1)["skipped"]


_STREAMING_SCRIPT = r"""
import hashlib, sys
import numpy as np
import nsp.storage
rng = np.random.default_rng(0)
params = {"w": rng.standard_normal(100_003).astype(np.float32)}
with nsp.storage.open(tier="memory", page_bytes=16 * 1024) as store:
    store.initialize(params, nsp.storage.OptimizerSpec("adamw", weight_decay=0.1))
    for step in (1, 2, 3):
        grad = rng.standard_normal(store.layout.padded_total).astype(np.float32)
        out = store.update(grad, version=step - 1, lr=0.01, step=step)
    digest = hashlib.sha256(out["params"].tobytes())
    for state in ("param", "mu", "nu"):
        digest.update(store.read(state).tobytes())
print(digest.hexdigest())
"""


def test_streaming_stores_give_the_same_bytes():
    """Non-temporal stores into the other slot and the params copy (the default; NSP_STREAMING_STORES=0 turns them
    off) only change how the bytes reach memory."""
    digests = []
    for value in ("0", None):
        env = {k: v for k, v in os.environ.items() if k != "NSP_STREAMING_STORES"}
        if value:
            env["NSP_STREAMING_STORES"] = value
        proc = subprocess.run([sys.executable, "-c", _STREAMING_SCRIPT], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        digests.append(proc.stdout.strip())
    assert digests[0] == digests[1] and len(digests[0]) == 64
