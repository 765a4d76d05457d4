"""An update's progress can be watched from another thread while it runs (pages done of total, time since it
began), whether the engine streams pages (file tier) or updates them in place (memory tier)."""

import threading
import time

import numpy as np
import pytest

import nsp.storage

PAGE_ELEMS = 1024  # 4 KiB pages: many pages, so that a poller sees the count move


def _store(tier, tmp_path, n_pages=64):
    n = n_pages * PAGE_ELEMS
    store = nsp.storage.open(None if tier == "memory" else tmp_path / "s", tier=tier, page_bytes=4 * PAGE_ELEMS,
                             pages_in_flight=2)
    store.initialize({"w": np.linspace(-1, 1, n, dtype=np.float32)}, nsp.storage.OptimizerSpec("adam"))
    return store, np.full(n, 1e-3, np.float32)


def _progress(store):
    return store._engines[0].progress()


def test_store_progress_sums_its_shards(tmp_path):
    store = nsp.storage.open(tmp_path / "s", tier="file", num_shards=3, page_bytes=4 * PAGE_ELEMS)
    with store:
        n = 3 * 10 * PAGE_ELEMS
        store.initialize({"w": np.zeros(n, np.float32)}, nsp.storage.OptimizerSpec("adam"))
        assert store.progress() == {"running": False, "pages_done": 0, "pages_total": 0, "bytes_done": 0,
                                    "bytes_total": 0, "elapsed_s": 0.0, "updates_begun": 0}
        store.update(np.full(n, 1e-3, np.float32), version=0, lr=1e-3, step=1)
        p = store.progress()
        assert not p["running"] and p["updates_begun"] == 1
        assert p["pages_done"] == p["pages_total"] == 30
        assert p["bytes_done"] == p["bytes_total"] == 2 * 3 * 30 * 4 * PAGE_ELEMS  # p, m, v: read and written
        assert p["elapsed_s"] > 0


@pytest.mark.parametrize("tier", ["file", "memory"])
def test_progress_after_an_update_counts_every_page(tier, tmp_path):
    store, grad = _store(tier, tmp_path)
    with store:
        before = _progress(store)
        assert before["updates_begun"] == 0 and not before["running"] and before["pages_done"] == 0
        store.update(grad, version=0, lr=1e-3, step=1)
        p = _progress(store)
        assert p["updates_begun"] == 1 and not p["running"]
        assert p["pages_total"] == store.layout.pages_per_shard == 64
        assert p["pages_done"] == p["pages_total"]
        assert p["elapsed_ns"] > 0
        store.update(grad, version=1, lr=1e-3, step=2)
        assert _progress(store)["updates_begun"] == 2


def test_progress_moves_while_a_file_update_runs(tmp_path):
    """A poller on another thread sees the update running with a page count between 0 and the total."""
    store, grad = _store("file", tmp_path, n_pages=512)
    with store:
        seen = []
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                seen.append(_progress(store))
                time.sleep(0.0005)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            store.update(grad, version=0, lr=1e-3, step=1)
        finally:
            stop.set()
            poller.join()
        running = [p for p in seen if p["running"]]
        assert running, "the poller never saw the update running"
        done = [p["pages_done"] for p in running]
        assert done == sorted(done), "pages done went backwards"
        assert all(0 <= d <= 512 for d in done)
        assert any(0 < d < 512 for d in done), f"never saw a partial count: {sorted(set(done))[:10]}"
        # elapsed time grows while it runs
        elapsed = [p["elapsed_ns"] for p in running]
        assert elapsed == sorted(elapsed)



def test_update_watcher_reports_a_long_update_with_rate_and_eta(tmp_path):
    store, grad = _store("file", tmp_path, n_pages=2048)
    lines = []
    with store:
        with nsp.storage.UpdateWatcher(store, lines.append, every_s=0.0, after_s=0.0, poll_s=0.001):
            store.update(grad, version=0, lr=1e-3, step=1)
            store.update(grad, version=1, lr=1e-3, step=2)
    assert lines, "no progress line for two updates of 2048 pages"
    assert all(line.startswith("update: ") and "/2048 pages" in line and "GB/s, ETA" in line for line in lines), lines


def test_update_watcher_stays_quiet_for_short_updates_and_ends_with_the_store(tmp_path):
    store, grad = _store("file", tmp_path)
    lines = []
    watcher = nsp.storage.UpdateWatcher(store, lines.append, after_s=60.0, poll_s=0.001).start()
    store.update(grad, version=0, lr=1e-3, step=1)
    store.close()
    watcher._thread.join(timeout=10)
    assert not watcher._thread.is_alive(), "the watcher kept running after its store closed"
    assert lines == []


def test_describe_progress():
    line = nsp.storage.progress.describe_progress(
        {"running": True, "pages_done": 25, "pages_total": 100, "bytes_done": 2e9, "bytes_total": 8e9,
         "elapsed_s": 2.0, "updates_begun": 3})
    assert line == "update: 25/100 pages (25%), 2.0 of 8.0 GB, 1.00 GB/s, ETA 6 s"
