"""The link figures of a computational-storage system: what each device's links, SSD and updater move per second,
and what the host link that all devices share moves.

Every figure but ``ssd_overlap`` (a fraction) is in GB/s (1 GB = 1e9 bytes), and every one is overridable; the
defaults describe the Samsung SmartSSD system of Smart-Infinity (HPCA'24) §VII-A, each cited where it is set.

    >>> from nsp.csd import LinkFigures
    >>> LinkFigures().p2p_write_gbps
    1.04
    >>> LinkFigures().with_overrides(shared_gbps=16.0).shared_gbps
    16.0
"""

from __future__ import annotations

import dataclasses
import math

GB = 1e9  # bytes in the GB of every figure here (decimal, as disk and PCIe figures are quoted)

# Xilinx Vitis_Accel_Examples, host/p2p_bandwidth/README.rst: its log of a SmartSSD (U.2 platform,
# xilinx_u2_gen3x4) moving 128 MB buffers between the SSD and the FPGA's memory by P2P.
P2P_READ_GBPS = 2.36  # SSD -> FPGA, 128 MB buffers (2.15 GB/s at 4 MiB)
P2P_WRITE_GBPS = 1.04  # FPGA -> SSD, 128 MB buffers (1.02 GB/s at 4 MiB)

# The bandwidth of one SSD moving the baseline's traffic: it reads and writes equal volumes per step (8M each,
# Smart-Infinity Table I), so its throughput over the step is the harmonic mean of its read and write rates.
_BASELINE_MIX_GBPS = 2 / (1 / P2P_READ_GBPS + 1 / P2P_WRITE_GBPS)  # 1.444 GB/s

# Smart-Infinity §III (Fig. 3(b)) and §VII-E (Fig. 11(a)): the baseline stops scaling beyond 4 SSDs, "whose
# aggregate SSD bandwidth reaches roughly that of the PCIe system interconnect". The shared link is therefore set
# to what 4 SSDs move at the baseline's mix. It stands for the whole host path (expansion uplink, root port, RAID
# layer) as the paper's baseline met it, not for a PCIe Gen3 x16 uplink's raw 15.75 GB/s: the paper reports where
# the baseline saturates, not why.
SATURATION_DEVICES = 4
SHARED_GBPS = round(SATURATION_DEVICES * _BASELINE_MIX_GBPS, 2)  # 5.78 GB/s


@dataclasses.dataclass(frozen=True)
class LinkFigures:
    """Bandwidths of one system's links, in GB/s (and how far its SSDs overlap reads with writes). Devices are
    alike: every device gets the per-device figures.

    Raises ``ValueError`` naming the field when a figure is not a positive finite number.
    """

    # Each device's own link to the host: PCIe Gen3 x4 (Smart-Infinity §VII-A: each SmartSSD's SSD and FPGA sit on
    # a Gen3 x4 bus) = 8 GT/s x 4 lanes x 128/130 encoding / 8 bits.
    device_link_gbps: float = 8 * 4 * 128 / 130 / 8
    # SSD -> accelerator and accelerator -> SSD inside a device, peer to peer (Xilinx's SmartSSD P2P example, above).
    p2p_read_gbps: float = P2P_READ_GBPS
    p2p_write_gbps: float = P2P_WRITE_GBPS
    # The same SSD read and written by the host (the baseline's path). Smart-Infinity §II-B: a single CSD gives no
    # bandwidth boost because SSD-to-FPGA and SSD-to-host traffic pass through the same PCIe lanes; so the host
    # path gets the P2P figures.
    ssd_read_gbps: float = P2P_READ_GBPS
    ssd_write_gbps: float = P2P_WRITE_GBPS
    # The accelerator's updater, in bytes of optimizer state plus dense gradient it takes in per second
    # (Smart-Infinity §VII-H, Fig. 14 text: "above 7GB/s").
    updater_gbps: float = 7.0
    # The accelerator's Top-K decompressor, in bytes of dense gradient it writes per second, where it is a stage of
    # its own: Smart-Infinity's (§V-B) fills the gradient buffer before the updater runs. Smart-Infinity §VII-H
    # (Fig. 14 text): it "slightly surpasses the throughput of the SSD read"; set to the SSD's read figure, the floor
    # of that statement (as 7.0 is the updater's). nsp's kernel decompresses as it updates, so nsp's dataflow and
    # the emulated device have no such stage.
    decompressor_gbps: float = P2P_READ_GBPS
    # The host CPU's updater (the baseline's), same unit. The paper gives no figure; this is nsp's dense Adam on
    # 2 vCPUs (DESIGN.md §4: 1.44-1.68 Gparam/s x 16 B/param), a floor for the paper's 2 x 48-core host (Table II).
    host_updater_gbps: float = 24.0
    # The host link all devices share, both directions drawing on one pool (SHARED_GBPS above).
    shared_gbps: float = SHARED_GBPS
    # The fraction of the shorter of an SSD's read and write times that runs at the same time as the longer
    # (0: the SSD serves reads and writes in turn; 1: both at full speed at once). Not a bandwidth. 0 by default:
    # the P2P example measured reads and writes apart, and nothing in the seeds says a SmartSSD does both at once.
    ssd_overlap: float = 0.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if field.name == "ssd_overlap":
                if not (number and 0 <= value <= 1):
                    raise ValueError(f"LinkFigures.ssd_overlap must be a fraction in [0, 1], got {value!r}")
            elif not (number and value > 0):
                raise ValueError(f"LinkFigures.{field.name} must be a positive finite bandwidth in GB/s, "
                                 f"got {value!r}")
            object.__setattr__(self, field.name, float(value))

    def with_overrides(self, **figures: float) -> LinkFigures:
        """These figures with some replaced, e.g. ``LinkFigures().with_overrides(shared_gbps=16.0)``.

        Raises ``ValueError`` for an unknown field (naming the valid ones) or an invalid value.
        """
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(figures) - set(valid))
        if unknown:
            raise ValueError(f"unknown link figure(s) {unknown}; valid: {', '.join(valid)}")
        return dataclasses.replace(self, **figures)

    @staticmethod
    def parse_overrides(items: list[str]) -> dict[str, float]:
        """``["shared_gbps=16", "p2p_read_gbps=3.2"]`` as ``{"shared_gbps": 16.0, ...}`` (for command lines).

        Raises ``ValueError`` for an item that is not ``NAME=NUMBER``.

            >>> LinkFigures.parse_overrides(["shared_gbps=16"])
            {'shared_gbps': 16.0}
        """
        out = {}
        for item in items:
            name, sep, value = item.partition("=")
            try:
                if not sep:
                    raise ValueError
                out[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"a link figure is NAME=GBPS (e.g. shared_gbps=16), got {item!r}") from None
        return out

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
