"""The model clock: how long a phase of a step takes on given links, from the bytes it moves on each.

A phase is a set of transfers and computations that run together and end together (a step's backward pass, its
update). Its bytes are charged to resources, each busy for bytes / bandwidth:

  shared link     the host link all devices share: every device's host traffic, both directions, one pool
                  (transfers on it contend: N devices moving X bytes each keep it busy N x X / bandwidth)
  device link     each device's own link to the host (its host traffic only)
  ssd             each device's SSD: host-path reads and writes at the SSD's figures, P2P ones at the P2P
                  figures; reads and writes take turns except for the ``ssd_overlap`` fraction of the shorter
                  of the two, which runs beside the longer: busy = read + write - overlap x min(read, write)
  updater         each device's updater (bytes of state and gradient it takes in)
  decompressor    each device's Top-K decompressor, where it is a stage of its own (bytes of dense gradient it
                  writes)
  host updater    the host CPU's updater (the baseline's)
  compute         the accelerator's forward/backward, in seconds (no bytes)

Devices work in parallel, so a per-device resource counts as its busiest device. The phase streams its bytes in
``subgroups`` equal units through all its resources at once (a pipeline: while one unit is read, the one before is
updated and the one before that written), so it lasts as long as its busiest resource plus one unit's time on every
other resource (the pipeline's fill and drain):

    seconds = max(busy) + (sum(busy) - max(busy)) / subgroups

A phase whose devices have one buffer set (``Phase.in_turn``) cannot overlap a device's work on its buffers: the
next subgroup is read into them only after the last one was updated and its params written back. Its SSD's P2P
transfers, its updater and its decompressor then take turns; the host's own transfers from and to its SSD (the new
params read back) use no buffer and fill the SSD's idle time while the updater works. The device counts as one
resource, busy for max(its SSD's seconds, P2P + updater + decompressor seconds), named by what decides it
("ssd+updater", or "ssd" where the SSD alone is busier); the links to the host still run beside it.

Nothing else enters: no latencies, no randomness. The same phase on the same figures always takes the same time.

    >>> from nsp.csd import LinkFigures
    >>> from nsp.csd.clock import DeviceLoad, Phase, phase_time
    >>> t = phase_time(Phase("update", devices=(DeviceLoad(p2p_read=2.36e9),)), LinkFigures())
    >>> round(t.seconds, 6), t.bottleneck
    (1.0, 'ssd')
"""

from __future__ import annotations

import dataclasses

from nsp.csd.figures import GB, LinkFigures

RESOURCES = ("compute", "shared link", "device link", "ssd", "updater", "decompressor", "host updater")
# The resources of one device that take turns in an ``in_turn`` phase (module docstring).
IN_TURN = ("ssd", "updater", "decompressor")


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    """Bytes one device moves in a phase, by where they move."""

    link: float = 0.0  # over the device's own host link, both directions
    host_read: float = 0.0  # read from its SSD by the host
    host_write: float = 0.0  # written to its SSD by the host
    p2p_read: float = 0.0  # read from its SSD into its accelerator
    p2p_write: float = 0.0  # written from its accelerator to its SSD
    updater: float = 0.0  # taken in by its updater
    decompressor: float = 0.0  # dense gradient written by its decompressor (a stage of its own)

    def __add__(self, other: DeviceLoad) -> DeviceLoad:
        return DeviceLoad(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class Phase:
    """What a phase does: seconds of compute, bytes on the shared link and the host updater, each device's load."""

    name: str
    compute_s: float = 0.0
    shared_down: float = 0.0  # host -> devices over the shared link
    shared_up: float = 0.0  # devices -> host over the shared link
    host_updater: float = 0.0
    devices: tuple[DeviceLoad, ...] = ()
    subgroups: int = 1  # units the bytes stream in (see the module docstring)
    in_turn: bool = False  # one buffer set per device: its P2P transfers, updater and decompressor take turns


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    """A phase's time on the model clock: ``seconds``, the resource that decided it, and every resource's busy
    seconds (``busy``)."""

    name: str
    seconds: float
    bottleneck: str
    busy: dict[str, float]


def _ssd_seconds(read: float, write: float, overlap: float) -> float:
    """An SSD's busy seconds for ``read`` and ``write`` seconds of transfers (reads and writes in turn but for the
    ``overlap`` fraction of the shorter)."""
    return read + write - overlap * min(read, write)


def _device_seconds(d: DeviceLoad, f: LinkFigures) -> dict[str, float]:
    """Seconds one device's own resources are busy with load ``d``; ``ssd p2p``: its SSD's P2P transfers alone."""
    p2p_read, p2p_write = d.p2p_read / f.p2p_read_gbps / GB, d.p2p_write / f.p2p_write_gbps / GB
    read = d.host_read / f.ssd_read_gbps / GB + p2p_read
    write = d.host_write / f.ssd_write_gbps / GB + p2p_write
    return {
        "device link": d.link / (f.device_link_gbps * GB),
        "ssd": _ssd_seconds(read, write, f.ssd_overlap),
        "ssd p2p": _ssd_seconds(p2p_read, p2p_write, f.ssd_overlap),
        "updater": d.updater / (f.updater_gbps * GB),
        "decompressor": d.decompressor / (f.decompressor_gbps * GB),
    }


def busy_seconds(phase: Phase, figures: LinkFigures,
                 per_device: list[dict[str, float]] | None = None) -> dict[str, float]:
    """Seconds each resource of ``RESOURCES`` is busy in ``phase`` (a per-device resource: its busiest device);
    ``per_device``: the devices' own seconds (``_device_seconds``), when the caller has them already."""
    f = figures
    if per_device is None:
        per_device = [_device_seconds(d, f) for d in phase.devices]

    def worst(resource: str) -> float:
        return max((d[resource] for d in per_device), default=0.0)

    return {
        "compute": phase.compute_s,
        "shared link": (phase.shared_down + phase.shared_up) / (f.shared_gbps * GB),
        "device link": worst("device link"),
        "ssd": worst("ssd"),
        "updater": worst("updater"),
        "decompressor": worst("decompressor"),
        "host updater": phase.host_updater / (f.host_updater_gbps * GB),
    }


def _contending(busy: dict[str, float], per_device: list[dict[str, float]]) -> dict[str, float]:
    """The resources that run side by side in an ``in_turn`` phase: ``busy``, with the device resources
    (``IN_TURN``) merged into one (module docstring) on its busiest device, named by the parts that decide it."""
    turn_parts = ["ssd"] + [r for r in ("updater", "decompressor") if busy[r] > 0]
    turns, ssd = 0.0, 0.0
    for seconds in per_device:
        turn = seconds["ssd p2p"] + seconds["updater"] + seconds["decompressor"]
        if max(turn, seconds["ssd"]) > max(turns, ssd):
            turns, ssd = turn, seconds["ssd"]
    name = "+".join(turn_parts) if turns >= ssd else "ssd"
    return {**{r: s for r, s in busy.items() if r not in IN_TURN}, name: max(turns, ssd)}


def phase_time(phase: Phase, figures: LinkFigures) -> PhaseTime:
    """``phase``'s time on ``figures``: its busiest resource plus one subgroup on the others, the device's own
    resources taking turns in an ``in_turn`` phase (module docstring). ``busy`` keeps every resource apart.

        >>> from nsp.csd import LinkFigures
        >>> phase_time(Phase("forward", compute_s=2.0), LinkFigures()).seconds
        2.0
        >>> load = (DeviceLoad(p2p_read=2.36e9, updater=7e9),)   # 1 s of SSD reads, 1 s of updates
        >>> phase_time(Phase("update", devices=load, subgroups=100), LinkFigures()).seconds   # side by side
        1.01
        >>> t = phase_time(Phase("update", devices=load, subgroups=100, in_turn=True), LinkFigures())
        >>> round(t.seconds, 6), t.bottleneck                                                # in turn
        (2.0, 'ssd+updater')
    """
    if phase.subgroups < 1:
        raise ValueError(f"Phase.subgroups must be >= 1, got {phase.subgroups}")
    per_device = [_device_seconds(d, figures) for d in phase.devices]
    busy = busy_seconds(phase, figures, per_device)
    lanes = _contending(busy, per_device) if phase.in_turn else busy
    bottleneck = max(lanes, key=lanes.get)
    peak = lanes[bottleneck]
    seconds = peak + (sum(lanes.values()) - peak) / phase.subgroups
    return PhaseTime(phase.name, seconds, bottleneck, busy)
