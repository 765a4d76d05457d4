"""One optimizer step over N storage devices, three ways, on one model clock (``nsp.csd.clock``).

The schemes (Smart-Infinity (HPCA'24) §IV, Table I; M = bytes of the model in 16 bits = 2 x params):

  baseline     ZeRO-Infinity-style: the optimizer state (fp32 params, Adam m and v: 6M) lives on N SSDs striped
               as one RAID0 volume. Backward offloads the fp32 gradients (2M) to it over the shared link; the
               update reads state and gradients (8M) over the shared link into the host, updates them on the
               CPU and writes the state (6M) back over it.
  smartupdate  SmartUpdate with the transfer handler (SU+O): each device owns 1/N of the flattened state
               (§IV-D) and updates it in its accelerator. The state moves only between each device's SSD and
               accelerator (P2P); the shared link carries gradients down (2M) and updated params up (2M). Params
               go up first, overlapped with the rest of the update (§IV-B): they cost the update no time of their
               own unless the shared link is its bottleneck.
  smartcomp    SmartComp (SU+O+C): the same with Top-K gradients. A kept element travels as a value and an
               index, 4 bytes each, so density d moves 2d of the dense gradient's bytes: c% x 2M with c% = 2d
               (the paper's default d = 1%, c% = 2%, §VII-A). The updater still takes in a dense gradient's worth
               (it decompresses, then updates).

Dataflow of the near-storage schemes (``Setting.dataflow``):

  "paper"  Smart-Infinity's (Table I's SSD operations, Fig. 4(b)): the gradients are written to each device's
           SSD during backward and read back P2P by the update; the host reads the new params from the SSD.
           Each device has one set of buffers (§IV-B: its transfer handler preallocates one buffer per variable
           and reuses it, loading the next subgroup once the last was updated and its params written back), so
           its P2P transfers, its updater and, for SU+O+C, its Top-K decompressor (§V-B: a module of its own that
           fills the gradient buffer before the updater runs) take turns (``nsp.csd.clock``: ``in_turn``). The
           new params' trip to the host, read from the SSD by the host and sent over the host links, needs no
           buffer and runs beside the updater's turns (§IV-A: it "can be overlapped with update steps for other
           parameters").
  "nsp"    nsp's engine: the gradient shard goes straight into the device's buffers during the update, and the
           new params leave from them; neither touches the SSD. Its ``pages_in_flight`` buffer sets overlap
           reads, updates and writes, and its kernel decompresses Top-K gradients as it updates.

A step is: forward + backward (``Setting.compute_s``, the accelerator's seconds, the same for every scheme), for
SU+O+C the accelerator's Top-K selection (``Setting.compress_s``), then the gradient offload phase ("paper" dataflow
and the baseline), then the update phase; they run one after the other. The deferred write-back of m and v is not
hidden behind the next step's forward: the paper measured the transfer handler's whole gain at 4% (SU 1.54-1.60x,
SU+O 1.60-1.66x at 10 SSDs, §VII-C), and the model keeps it at what overlap inside the update gives.

    >>> from nsp.csd import LinkFigures, Setting, step_time
    >>> s = Setting(params=4_000_000_000, compute_s=3.0)
    >>> base = step_time("baseline", s, 10, LinkFigures())
    >>> near = step_time("smartcomp", s, 10, LinkFigures())
    >>> base.seconds > near.seconds
    True
"""

from __future__ import annotations

import dataclasses
import math

from nsp.csd.clock import DeviceLoad, Phase, PhaseTime, phase_time
from nsp.csd.figures import LinkFigures

SCHEMES = ("baseline", "smartupdate", "smartcomp")
LABELS = {"baseline": "BASE", "smartupdate": "SU+O", "smartcomp": "SU+O+C"}  # Smart-Infinity §VII-A's names
DATAFLOWS = ("paper", "nsp")

# Smart-Infinity §VII-A / §VII-K: 1% of the gradient kept (2% of its bytes with the indices).
DENSITY_DEFAULT = 0.01
# nsp's page (nsp.storage.PAGE_BYTES_DEFAULT, Angel-PTM's 4 MiB): the unit a phase streams in.
PAGE_BYTES_DEFAULT = 4 * 2**20
PARAM_BYTES = 4  # an fp32 param, gradient, m or v
STATES = 3  # Adam's p, m, v
KEPT_BYTES = 8  # a kept Top-K element: fp32 value + int32 index
# The phases that are the accelerator's compute, not transfer and update (``StepTime.update_s``).
ACCELERATOR_PHASES = ("forward+backward", "top-k compress")


def _seconds(value) -> bool:
    """Whether ``value`` is a finite, non-negative number of seconds (a bool is not)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value >= 0)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What is trained: its size, the accelerator's forward + backward seconds, and how gradients travel.

    Raises ``ValueError`` naming the field for a value out of range.
    """

    params: int  # trainable parameters (fp32 master copy on the devices)
    compute_s: float = 0.0  # forward + backward seconds per step on the accelerator (0: transfers and update only)
    density: float = DENSITY_DEFAULT  # smartcomp's kept fraction of the gradient
    dataflow: str = "paper"  # see the module docstring
    page_bytes: int = PAGE_BYTES_DEFAULT  # bytes of one state array's page
    compress_s: float = 0.0  # smartcomp: accelerator seconds per step to select the Top-K gradient (0: free)

    def __post_init__(self):
        if isinstance(self.params, bool) or not isinstance(self.params, int) or self.params <= 0:
            raise ValueError(f"Setting.params must be a positive integer, got {self.params!r}")
        for name in ("compute_s", "compress_s"):
            if not _seconds(getattr(self, name)):
                raise ValueError(f"Setting.{name} must be a finite number of seconds >= 0, got {getattr(self, name)!r}")
        if isinstance(self.density, bool) or not (isinstance(self.density, (int, float)) and 0 < self.density <= 1):
            raise ValueError(f"Setting.density must be in (0, 1], got {self.density!r}")
        if self.dataflow not in DATAFLOWS:
            raise ValueError(f"Setting.dataflow must be one of {DATAFLOWS}, got {self.dataflow!r}")
        if isinstance(self.page_bytes, bool) or not isinstance(self.page_bytes, int) or self.page_bytes <= 0:
            raise ValueError(f"Setting.page_bytes must be a positive integer, got {self.page_bytes!r}")

    @property
    def m_bytes(self) -> int:
        """M of Table I: the model's bytes in 16 bits."""
        return 2 * self.params


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step on the model clock: every phase's time, the step's ``seconds`` and the part that is transfer and
    update (``update_s``: every phase but the accelerator's, ``ACCELERATOR_PHASES``)."""

    scheme: str
    devices: int
    phases: tuple[PhaseTime, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def update_s(self) -> float:
        return sum(p.seconds for p in self.phases if p.name not in ACCELERATOR_PHASES)


def _check(scheme: str, devices: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")


def gradient_bytes(scheme: str, setting: Setting) -> float:
    """Bytes of gradient sent per step: 2M dense; c% x 2M = density x 8 B/param for smartcomp."""
    if scheme == "smartcomp":
        return setting.density * KEPT_BYTES * setting.params
    return float(PARAM_BYTES * setting.params)


def phases(scheme: str, setting: Setting, devices: int) -> list[Phase]:
    """The phases of one step of ``scheme`` on ``devices`` devices (module docstring), with their bytes.

        >>> [p.name for p in phases("baseline", Setting(params=1 << 20), 2)]
        ['forward+backward', 'gradient offload', 'update']
    """
    _check(scheme, devices)
    n, M = devices, setting.m_bytes
    state = 6 * M  # fp32 p, m, v
    params_up = 2 * M  # fp32 params
    dense_grad = 2 * M  # fp32 gradients
    grad = gradient_bytes(scheme, setting)  # what is sent: dense, or Top-K values + indices
    array_bytes = PARAM_BYTES * setting.params  # one state array
    pages_all = max(1, math.ceil(array_bytes / setting.page_bytes))
    pages_device = max(1, math.ceil(array_bytes / n / setting.page_bytes))

    def each(**load: float) -> tuple[DeviceLoad, ...]:
        return (DeviceLoad(**{k: v / n for k, v in load.items()}),) * n

    out = [Phase("forward+backward", compute_s=float(setting.compute_s))]
    if scheme == "smartcomp" and setting.compress_s > 0:
        # The accelerator selects the kept elements before anything is sent (§IV-C: "GPU compresses the gradients").
        out.append(Phase("top-k compress", compute_s=float(setting.compress_s)))
    if scheme == "baseline":
        # Backward writes the gradients to the RAID0 volume; the update reads state + gradients to the host and
        # writes the state back, all over the shared link and each SSD's host path.
        out.append(Phase("gradient offload", shared_down=dense_grad,
                         devices=each(link=dense_grad, host_write=dense_grad), subgroups=pages_all))
        out.append(Phase("update", shared_up=state + dense_grad, shared_down=state,
                         host_updater=state + dense_grad,
                         devices=each(link=2 * state + dense_grad, host_read=state + dense_grad, host_write=state),
                         subgroups=pages_all))
        return out
    if setting.dataflow == "paper":
        out.append(Phase("gradient offload", shared_down=grad, devices=each(link=grad, host_write=grad),
                         subgroups=pages_device))
        decompressed = dense_grad if scheme == "smartcomp" else 0.0
        out.append(Phase("update", shared_up=params_up,
                         devices=each(link=params_up, host_read=params_up, p2p_read=state + grad,
                                      p2p_write=state, updater=state + dense_grad, decompressor=decompressed),
                         subgroups=pages_device, in_turn=True))
    else:
        out.append(Phase("update", shared_down=grad, shared_up=params_up,
                         devices=each(link=grad + params_up, p2p_read=state, p2p_write=state,
                                      updater=state + dense_grad),
                         subgroups=pages_device))
    return out


def step_time(scheme: str, setting: Setting, devices: int, figures: LinkFigures | None = None) -> StepTime:
    """One step of ``scheme`` over ``devices`` devices on the model clock.

        >>> t = step_time("smartupdate", Setting(params=4_000_000_000), 1)
        >>> t.phases[-1].bottleneck                     # the paper's dataflow: SSD and updater take turns
        'ssd+updater'
        >>> step_time("smartupdate", Setting(params=4_000_000_000, dataflow="nsp"), 1).phases[-1].bottleneck
        'ssd'
    """
    figures = figures or LinkFigures()
    return StepTime(scheme, devices, tuple(phase_time(p, figures) for p in phases(scheme, setting, devices)))


def traffic(scheme: str, setting: Setting, devices: int) -> dict[str, float]:
    """Bytes per step on each link, summed over devices: ``shared_down``/``shared_up`` (the shared link, to and
    from the devices: Smart-Infinity Table I), ``device_link``, ``ssd_host_read``/``ssd_host_write`` (SSD bytes
    the host moves), ``p2p_read``/``p2p_write`` (inside the devices), ``updater``, ``decompressor`` and
    ``host_updater``; and ``per_device_p2p_read``/``per_device_p2p_write`` (one device's internal link).

        >>> t = traffic("smartupdate", Setting(params=100), 4)
        >>> t["shared_down"], t["shared_up"]           # 2M down, 2M up with M = 200 bytes
        (400.0, 400.0)
    """
    totals = {"shared_down": 0.0, "shared_up": 0.0, "host_updater": 0.0}
    load = DeviceLoad()
    first = DeviceLoad()
    for phase in phases(scheme, setting, devices):
        totals["shared_down"] += phase.shared_down
        totals["shared_up"] += phase.shared_up
        totals["host_updater"] += phase.host_updater
        for d in phase.devices:
            load = load + d
        if phase.devices:
            first = first + phase.devices[0]
    totals.update(device_link=load.link, ssd_host_read=load.host_read, ssd_host_write=load.host_write,
                  p2p_read=load.p2p_read, p2p_write=load.p2p_write, updater=load.updater,
                  decompressor=load.decompressor,
                  per_device_p2p_read=first.p2p_read, per_device_p2p_write=first.p2p_write)
    return totals


def table_one(scheme: str, setting: Setting) -> dict[str, float]:
    """Smart-Infinity Table I's shared-link bytes for ``scheme`` (any device count), from its formulas:
    ZeRO-Infinity 6M + 2M each way; SmartUpdate 2M each way; SmartComp c% x 2M down, 2M up.

        >>> table_one("baseline", Setting(params=100))
        {'shared_down': 1600.0, 'shared_up': 1600.0}
    """
    M = float(setting.m_bytes)
    if scheme == "baseline":
        return {"shared_down": 6 * M + 2 * M, "shared_up": 6 * M + 2 * M}
    if scheme == "smartupdate":
        return {"shared_down": 2 * M, "shared_up": 2 * M}
    if scheme == "smartcomp":
        c = 2 * setting.density  # c% of Table I: kept values and their indices
        return {"shared_down": c * 2 * M, "shared_up": 2 * M}
    raise ValueError(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")


def scaling(setting: Setting, devices: range | list[int], figures: LinkFigures | None = None,
            schemes: tuple[str, ...] = SCHEMES) -> list[dict]:
    """Per device count: each scheme's step and update seconds and its speedup over the baseline at that count.

        >>> rows = scaling(Setting(params=4_000_000_000, compute_s=3.0), [1, 10])
        >>> rows[1]["speedup"]["smartcomp"] > rows[0]["speedup"]["smartcomp"]
        True
    """
    figures = figures or LinkFigures()
    rows = []
    for n in devices:
        times = {s: step_time(s, setting, n, figures) for s in schemes}
        base = times.get("baseline")
        rows.append({
            "devices": n,
            "step_s": {s: t.seconds for s, t in times.items()},
            "update_s": {s: t.update_s for s, t in times.items()},
            "bottleneck": {s: t.phases[-1].bottleneck for s, t in times.items()},
            "speedup": {s: base.seconds / t.seconds for s, t in times.items()} if base else {},
        })
    return rows


def best(setting: Setting, max_devices: int, figures: LinkFigures | None = None,
         tolerance: float = 0.0) -> dict:
    """The scheme and device count (1..``max_devices``) with the shortest step; with ``tolerance`` > 0 the fewest
    devices whose step is within that fraction of the shortest.

        >>> best(Setting(params=4_000_000_000, compute_s=3.0), 10)["scheme"]
        'smartcomp'
    """
    if isinstance(max_devices, bool) or not isinstance(max_devices, int) or max_devices < 1:
        raise ValueError(f"max_devices must be a positive integer, got {max_devices!r}")
    figures = figures or LinkFigures()
    options = [(step_time(s, setting, n, figures).seconds, n, s) for s in SCHEMES for n in range(1, max_devices + 1)]
    fastest = min(t for t, _, _ in options)
    seconds, n, scheme = min((o for o in options if o[0] <= fastest * (1 + tolerance)), key=lambda o: (o[1], o[0]))
    return {"scheme": scheme, "devices": n, "step_s": seconds, "fastest_step_s": fastest}
