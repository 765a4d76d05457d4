"""Watching long updates: a thread that reports how far a store's running update has got.

An update of a multi-gigabyte store streams every page of its state from disk and back, which takes minutes; the
engine counts the pages it has done (``StateStore.progress``, safe to read while the update runs inside a jitted
step). ``UpdateWatcher`` polls that count and, for each update that has run longer than ``after_s``, reports a
line every ``every_s``: pages done of total, bytes moved, the rate so far, and the time left at that rate.

    >>> with nsp.storage.progress.UpdateWatcher(store, print):   # doctest: +SKIP
    ...     params, opt_state, loss = train_step(params, opt_state, batch)
    update: 412/1024 pages (40%), 5.1 of 12.9 GB, 1.32 GB/s, ETA 6 s
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from nsp.storage.format import StoreError


def describe_progress(p: dict[str, Any]) -> str:
    """One line for ``StateStore.progress()``'s dict: pages and bytes done of total, rate, time left."""
    done, total = p["pages_done"], max(p["pages_total"], 1)
    rate = p["bytes_done"] / p["elapsed_s"] if p["elapsed_s"] > 0 else 0.0
    left = (p["bytes_total"] - p["bytes_done"]) / rate if rate > 0 else float("inf")
    eta = f"{left:.0f} s" if left != float("inf") else "?"
    return (f"update: {done}/{p['pages_total']} pages ({done / total:.0%}), {p['bytes_done'] / 1e9:.1f} of "
            f"{p['bytes_total'] / 1e9:.1f} GB, {rate / 1e9:.2f} GB/s, ETA {eta}")


class UpdateWatcher:
    """Reports each long update of ``store`` through ``report`` (a callable taking one line) from its own thread.

    Args:
      store: a ``StateStore`` (its ``progress()`` is read; nothing else is touched).
      report: called with each line (``print``, a logger's method).
      every_s: seconds between two lines about one update.
      after_s: an update is reported once it has run this long (short updates stay silent).
      poll_s: how often the count is read.

    Use as a context manager, or ``start()``/``stop()``. The thread ends by itself when the store closes.
    """

    def __init__(self, store, report: Callable[[str], None] = print, *, every_s: float = 10.0,
                 after_s: float = 10.0, poll_s: float = 0.25):
        self._store, self._report = store, report
        self._every, self._after, self._poll = every_s, after_s, poll_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nsp-update-watcher", daemon=True)

    def start(self) -> UpdateWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> UpdateWatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        reported: tuple[int, float] | None = None  # (update, when) of the last line
        while not self._stopped.wait(self._poll):
            try:
                p = self._store.progress()
            except StoreError:  # the store closed: nothing more to watch
                return
            if not p["running"] or p["elapsed_s"] < self._after:
                continue
            now = time.monotonic()
            if reported is not None and reported[0] == p["updates_begun"] and now - reported[1] < self._every:
                continue
            reported = (p["updates_begun"], now)
            self._report(describe_progress(p))
