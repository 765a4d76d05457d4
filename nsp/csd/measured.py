"""A real store's measured traffic on the model clock: the time an update would take if each store shard were a
computational-storage device with the given link figures.

The data path is real (any store on disk, one shard per device directory); only time is modelled, here in one
phase from the store's counters. The ``csd`` tier's devices keep their own clock page by page instead
(``shard_stats()[i]["backend"]``; ``nsp.emulate`` sets it beside the plan). Between two reads
of ``store.shard_stats()`` each shard counted what it moved: gradient bytes in and param bytes out (its host
traffic), and the pages of state it read and wrote (its internal traffic). On the model clock:

  shared link    every shard's bytes in and out
  device link    its own bytes in and out
  ssd            its internal reads at the P2P read figure, its internal writes at the P2P write figure
  updater        its internal reads plus one more array's worth (the dense gradient the updater takes in beside
                 p, m, v: ``(states + 1) / states`` of the state bytes read)

in one update phase streaming one page of each state at a time (``subgroups`` = pages read / ``states``). See
``nsp.csd.clock`` for how the phase's time follows.

    >>> before = [{"shared_in_bytes": 0, "shared_out_bytes": 0, "internal_read_bytes": 0,
    ...            "internal_write_bytes": 0, "pages_read": 0, "update_ns": 0}]
    >>> after = [{"shared_in_bytes": 4e8, "shared_out_bytes": 4e8, "internal_read_bytes": 12e8,
    ...           "internal_write_bytes": 12e8, "pages_read": 300, "update_ns": 2_000_000_000}]
    >>> from nsp.csd import LinkFigures
    >>> t = model_update_time(before, after, LinkFigures(p2p_read_gbps=1.2, p2p_write_gbps=1.2))
    >>> round(t.seconds, 2), t.bottleneck        # 2 s of SSD traffic, plus one page's fill on the other links
    (2.01, 'ssd')
"""

from __future__ import annotations

from nsp.csd.clock import DeviceLoad, Phase, PhaseTime, phase_time
from nsp.csd.figures import LinkFigures

COUNTERS = ("shared_in_bytes", "shared_out_bytes", "internal_read_bytes", "internal_write_bytes", "pages_read",
            "update_ns")


def shard_deltas(before: list[dict], after: list[dict]) -> list[dict[str, int]]:
    """Per shard, what each of ``COUNTERS`` counted between two ``store.shard_stats()`` readings.

    Raises ``ValueError`` when the readings are of different shard counts or a counter went backwards (stats
    reset in between).
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"the two readings must be of the same shards, got {len(before)} and {len(after)}")
    out = []
    for i, (b, a) in enumerate(zip(before, after)):
        delta = {k: a[k] - b[k] for k in COUNTERS}
        negative = [k for k, v in delta.items() if v < 0]
        if negative:
            raise ValueError(f"shard {i}: counters {negative} went backwards between the readings (reset_stats?)")
        out.append(delta)
    return out


def phase_from_stats(before: list[dict], after: list[dict], *, states: int = 3) -> Phase:
    """The update phase the counted traffic makes on the model clock (module docstring); ``states``: state
    arrays per param (3 for Adam's p, m, v)."""
    if states < 1:
        raise ValueError(f"states must be >= 1, got {states}")
    deltas = shard_deltas(before, after)
    devices = tuple(
        DeviceLoad(link=d["shared_in_bytes"] + d["shared_out_bytes"], p2p_read=d["internal_read_bytes"],
                   p2p_write=d["internal_write_bytes"], updater=d["internal_read_bytes"] * (states + 1) / states)
        for d in deltas)
    subgroups = max(1, max(d["pages_read"] for d in deltas) // states)
    return Phase("update", shared_down=sum(d["shared_in_bytes"] for d in deltas),
                 shared_up=sum(d["shared_out_bytes"] for d in deltas), devices=devices, subgroups=subgroups)


def model_update_time(before: list[dict], after: list[dict], figures: LinkFigures, *,
                      states: int = 3) -> PhaseTime:
    """The model clock's time for the traffic counted between two ``store.shard_stats()`` readings (one update),
    on ``figures``.

    Example::

        s0 = store.shard_stats()
        store.update(grad, version=store.version, lr=1e-3, step=store.version + 1)
        t = model_update_time(s0, store.shard_stats(), LinkFigures(p2p_read_gbps=1.6, p2p_write_gbps=3.6))
    """
    return phase_time(phase_from_stats(before, after, states=states), figures)


def measured_update_s(before: list[dict], after: list[dict]) -> float:
    """Wall seconds the store's engines spent updating between the readings (its slowest shard's, as shards
    update in parallel)."""
    return max(d["update_ns"] for d in shard_deltas(before, after)) / 1e9
