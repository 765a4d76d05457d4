"""``nsp plan``'s prediction set beside the emulated devices: one real update on N ``csd`` store shards.

It lives beside ``nsp.csd``, not in it: ``nsp.csd`` models the devices and says what options a ``csd`` store
hands each one (``nsp.storage`` uses that when it opens one), while this module runs a real store on them, so it
sits above both ``nsp.storage`` and ``nsp.primitives``.

``nsp.csd.model`` predicts a step from formulas: each resource's bytes over its bandwidth, one phase, a pipeline
fill and drain of one page. The ``csd`` tier runs the real thing: a store with one shard per emulated device, each
reading and writing its own pages, running the real kernel and charging every page's operations to its links on
the device's model clock (a page-by-page pipeline, ``ffi/backends/csd/csd_clock.h``). ``check_plan`` runs one update of the
same state on that tier and compares the two; they agree when the formulas describe what the engine does.

    >>> import tempfile
    >>> from nsp.csd import LinkFigures, Setting
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     row = check_plan("smartupdate", Setting(params=1 << 20, page_bytes=1 << 16), 2, LinkFigures(), tmp)
    >>> abs(row["ratio"] - 1) < 0.10
    True
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

import nsp.storage
from nsp.csd.figures import LinkFigures
from nsp.csd.model import Setting, step_time
from nsp.primitives import kept_count

EMULATED = ("smartupdate", "smartcomp")  # the baseline's host updater is not a device: nothing to emulate
PLAN_TOLERANCE = 0.10  # how far plan and emulator may differ (relative to the emulator)
LR = 1e-3


def _gradient(scheme: str, store, setting: Setting, rng: np.random.Generator) -> dict:
    """A step's gradient as the scheme sends it: dense, or each shard's Top-K (sorted positions, values)."""
    n = store.layout.padded_total
    dense = (rng.random(n, np.float32) - np.float32(0.5)) * np.float32(1e-2)
    if scheme == "smartupdate":
        return {"grad": dense}
    shard = store.layout.shard_size
    k = kept_count(shard, ratio=setting.density)
    indices, values = [], []
    for s in range(store.num_shards):
        part = dense[s * shard:(s + 1) * shard]
        kept = np.sort(np.argpartition(np.abs(part), shard - k)[shard - k:]).astype(np.int32)
        indices.append(kept)
        values.append(part[kept])
    return {"indices": indices, "values": values}


def emulated_update(scheme: str, setting: Setting, devices: int, figures: LinkFigures, directory: str | None = None,
                    *, pages_in_flight: int | None = None, seed: int = 0) -> dict:
    """Runs one update of ``setting``'s Adam state on ``devices`` emulated devices (a ``csd`` store in a temporary
    folder under ``directory``) and returns each device's model seconds (``per_device_s``), the update's
    (``emulated_s``: the slowest device, as devices update side by side) and the bytes each device's links moved.

    Raises ``ValueError`` for a scheme with no device to emulate (the baseline).
    """
    if scheme not in EMULATED:
        raise ValueError(f"scheme {scheme!r} has no device to emulate; valid: {', '.join(EMULATED)}")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="nsp-emulate-", dir=directory) as tmp:
        kw = {} if pages_in_flight is None else {"pages_in_flight": pages_in_flight}
        store = nsp.storage.open(os.path.join(tmp, "store"), tier="csd", num_shards=devices,
                                 page_bytes=setting.page_bytes, backend_options=figures.as_dict(), **kw)
        try:
            p0 = rng.random(setting.params, np.float32) - np.float32(0.5)
            store.initialize({"w": p0}, nsp.storage.OptimizerSpec("adam"))
            store.update(**_gradient(scheme, store, setting, rng), version=store.version, lr=LR,
                         step=store.version + 1)
            backends = [s["backend"] for s in store.shard_stats()]
        finally:
            store.close()
    per_device = [b["model_seconds_last_update"] for b in backends]
    return {"scheme": scheme, "devices": devices, "params": setting.params, "per_device_s": per_device,
            "emulated_s": max(per_device), "backend_stats": backends}


def check_plan(scheme: str, setting: Setting, devices: int, figures: LinkFigures, directory: str | None = None,
               **kw) -> dict:
    """``emulated_update`` beside the model's update time for the same state, devices and figures (nsp's own
    dataflow, no forward/backward): ``predicted_s``, ``emulated_s``, ``ratio`` (predicted / emulated) and
    ``holds`` (within ``PLAN_TOLERANCE``)."""
    setting = dataclasses.replace(setting, dataflow="nsp", compute_s=0.0)
    predicted = step_time(scheme, setting, devices, figures)
    row = emulated_update(scheme, setting, devices, figures, directory, **kw)
    ratio = predicted.update_s / row["emulated_s"]
    return {**row, "predicted_s": predicted.update_s, "bottleneck": predicted.phases[-1].bottleneck,
            "ratio": ratio, "holds": abs(ratio - 1) <= PLAN_TOLERANCE}
