"""The emulated computational-storage device's settings: the options string a ``csd`` store hands each device.

A ``csd`` store (``nsp.storage.open(path, tier="csd")``) runs every shard on the ``csd`` backend, a plugin shipped
with nsp (``nsp/backends/libnsp_backend_csd.so``): a device with its own directory, worker and update kernel (its
results are the ``file`` tier's, bit for bit) and a model clock that charges each real page read, page write,
kernel and host transfer to the device's links (``StateStore.shard_stats()[i]["backend"]`` reports it). The
clock's figures are ``LinkFigures``'; the device holds no defaults of its own, so this module is where they come
from: every figure is always sent.

    >>> from nsp.csd import LinkFigures
    >>> device_options(LinkFigures(shared_gbps=8.0)).split(";")[-2]
    'shared_gbps=8.0'
    >>> device_options(LinkFigures(), faults={"fail_read_at": 3}).endswith("fail_read_at=3")
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nsp.csd.figures import LinkFigures

# The figures the device's model clock uses (the others describe the host-updater baseline).
DEVICE_FIGURES = ("device_link_gbps", "p2p_read_gbps", "p2p_write_gbps", "updater_gbps", "shared_gbps",
                  "ssd_overlap")
# Faults for tests: the k-th (1-based, counted from the device's open) kernel, page read or page write of a device
# fails once, with an error naming the device, the page, the state and the cause.
FAULTS = ("fail_kernel_at", "fail_read_at", "fail_write_at")


def device_options(figures: LinkFigures | None = None, faults: Mapping[str, int] | None = None) -> str:
    """The options string of a ``csd`` device: every figure of ``DEVICE_FIGURES`` from ``figures`` (default
    ``LinkFigures()``), then the ``faults`` asked for.

    Raises:
      ValueError: a fault that is not one of ``FAULTS``, or whose count is not a positive integer.
    """
    figures = figures or LinkFigures()
    items = [f"{name}={getattr(figures, name)!r}" for name in DEVICE_FIGURES]
    for name, k in (faults or {}).items():
        if name not in FAULTS:
            raise ValueError(f"unknown csd fault {name!r}; valid: {', '.join(FAULTS)}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"csd fault {name} counts operations from 1, got {k!r}")
        items.append(f"{name}={k}")
    return ";".join(items)


def store_device_options(options: Mapping[str, Any] | None = None) -> str:
    """The options string for a store's ``backend_options`` on the ``csd`` backend: figure overrides (any field
    of ``LinkFigures``, over its defaults) and faults (``FAULTS``), in one mapping.

        >>> store_device_options({"p2p_read_gbps": 3.0}).split(";")[1]
        'p2p_read_gbps=3.0'

    Raises:
      ValueError: a key that is neither a figure nor a fault (the valid ones named), or a value out of range.
    """
    options = dict(options or {})
    figure_names = {f.name for f in dataclasses.fields(LinkFigures)}
    unknown = sorted(k for k in options if k not in figure_names and k not in FAULTS)
    if unknown:
        raise ValueError(f"unknown csd option(s) {unknown}; valid: the figures of nsp.csd.LinkFigures "
                         f"({', '.join(sorted(figure_names))}) and the faults {', '.join(FAULTS)}")
    figures = LinkFigures().with_overrides(**{k: v for k, v in options.items() if k in figure_names})
    return device_options(figures, {k: v for k, v in options.items() if k in FAULTS})
