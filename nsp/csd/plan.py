"""What N computational-storage devices would give a model, before buying any: ``nsp plan``'s prediction.

For a parameter count, a device count and link figures it gives, from the model of ``nsp.csd.model``: each
scheme's step time (and the part that is transfer and update), the bytes each link moves per step, and the scheme
and device count with the shortest step (and the fewest devices within a tolerance of it).

    >>> from nsp.csd import LinkFigures, Setting
    >>> from nsp.csd.plan import plan, format_plan
    >>> p = plan(Setting(params=1_500_000_000, dataflow="nsp"), devices=4, figures=LinkFigures())
    >>> p["best"]["scheme"] in ("smartupdate", "smartcomp")
    True
    >>> print(format_plan(p).splitlines()[0])
    plan: 1.50e+09 params (fp32 state 18.0 GB), 4 devices, dataflow 'nsp', forward + backward 0.00 s
"""

from __future__ import annotations

from nsp.csd.figures import LinkFigures
from nsp.csd.model import LABELS, SCHEMES, Setting, best, step_time, traffic

TOLERANCE_DEFAULT = 0.05  # "fewest devices within 5% of the fastest"


def plan(setting: Setting, devices: int, figures: LinkFigures, *, max_devices: int | None = None,
         tolerance: float = TOLERANCE_DEFAULT) -> dict:
    """The prediction for ``setting`` on ``devices`` devices, and the best over 1..``max_devices`` (default
    ``devices``).

    Returns a dict: ``setting``, ``devices``, ``figures``, ``schemes`` (per scheme: ``step_s``, ``update_s``,
    ``bottleneck``, ``speedup`` over the baseline, ``traffic`` bytes per link), ``best`` (shortest step) and
    ``enough`` (the fewest devices within ``tolerance`` of it).
    """
    max_devices = max_devices or devices
    schemes = {}
    for s in SCHEMES:
        t = step_time(s, setting, devices, figures)
        schemes[s] = {"step_s": t.seconds, "update_s": t.update_s, "bottleneck": t.phases[-1].bottleneck,
                      "traffic": traffic(s, setting, devices)}
    for s in SCHEMES:
        schemes[s]["speedup"] = schemes["baseline"]["step_s"] / schemes[s]["step_s"]
    return {"setting": setting, "devices": devices, "figures": figures, "schemes": schemes,
            "best": best(setting, max_devices, figures), "max_devices": max_devices, "tolerance": tolerance,
            "enough": best(setting, max_devices, figures, tolerance=tolerance)}


def format_plan(p: dict) -> str:
    """``plan``'s result as the text ``nsp plan`` prints."""
    setting, n = p["setting"], p["devices"]
    lines = [f"plan: {setting.params:.2e} params (fp32 state {12 * setting.params / 1e9:.1f} GB), "
             f"{n} device{'s' * (n != 1)}, dataflow {setting.dataflow!r}, "
             f"forward + backward {setting.compute_s:.2f} s"
             + (f", SU+O+C's Top-K {setting.compress_s:.2f} s" if setting.compress_s else ""),
             "link figures (GB/s): " + ", ".join(f"{k}={v:g}" for k, v in p["figures"].as_dict().items()), "",
             f"{'scheme':<8} {'step s':>9} {'update s':>9} {'x BASE':>7}  bottleneck"]
    for s in SCHEMES:
        r = p["schemes"][s]
        lines.append(f"{LABELS[s]:<8} {r['step_s']:>9.2f} {r['update_s']:>9.2f} {r['speedup']:>7.2f}  "
                     f"{r['bottleneck']}")
    lines += ["", f"traffic per step, GB (per device: / {n})",
              f"{'scheme':<8} {'shared down':>11} {'shared up':>9} {'dev. links':>10} {'SSD host r/w':>13} "
              f"{'P2P r/w':>13}"]
    for s in SCHEMES:
        t = {k: v / 1e9 for k, v in p["schemes"][s]["traffic"].items()}
        lines.append(f"{LABELS[s]:<8} {t['shared_down']:>11.2f} {t['shared_up']:>9.2f} {t['device_link']:>10.2f} "
                     f"{t['ssd_host_read']:>6.1f}/{t['ssd_host_write']:<6.1f} "
                     f"{t['p2p_read']:>6.1f}/{t['p2p_write']:<6.1f}")
    b, e = p["best"], p["enough"]
    lines += ["", f"best over 1..{p['max_devices']} devices: {LABELS[b['scheme']]} on {b['devices']} "
                  f"({b['step_s']:.2f} s per step); fewest devices within {p['tolerance']:.0%} of it: "
                  f"{LABELS[e['scheme']]} on {e['devices']} ({e['step_s']:.2f} s)"]
    return "\n".join(lines)
