"""Smart-Infinity (HPCA'24)'s settings and published numbers, for reproducing its Fig. 11 on the model clock.

The paper gives no forward/backward times. The A5000's is derived from the one breakdown it states in numbers
(§VII-C: with GPT-2 8.4B on 6 SSDs, the baseline's update, with its optimizer-state traffic, is 75.57% of the
step): on the model clock the baseline's update phase takes U and its gradient offload O, so forward + backward
is U x (1 - 0.7557) / 0.7557 - O. Compute scales with the parameter count at a fixed batch (6 x params x tokens
FLOPs), so the A5000 figure for another size is that time x params / 8.4e9. The A100's is the A5000's divided by
the ratio of their peak dense FP16 tensor throughputs (NVIDIA datasheets: A100 312 TFLOPS; RTX A5000 222.2 TFLOPS
with 2:4 sparsity, 111.1 dense): a lower bound on its time, since an offloaded step is not all tensor-core work.

    >>> from nsp.csd import paper
    >>> a5000, a100 = (paper.compute_s(gpu, paper.GPT2_4B_PARAMS) for gpu in ("a5000", "a100"))
    >>> round(a5000, 2), round(a5000 / a100, 2)    # seconds of forward + backward; the A100 2.81x faster
    (3.5, 2.81)
"""

from __future__ import annotations

from nsp.csd.figures import LinkFigures
from nsp.csd.model import Setting, step_time

# "GPT-2 4.0B", the model of Fig. 11 (§VII-E). The paper gives no layer shape, and nsp's model configs have no
# 4.0B GPT, so the state is sized by the name: 4.0e9 params.
GPT2_4B_PARAMS = 4_000_000_000
DEVICES = range(1, 11)  # Fig. 11(a): 1 to 10 SmartSSDs

# §VII-C: the one breakdown in numbers (GPT-2 8.4B, 6 SSDs, A5000, baseline).
UPDATE_SHARE = 0.7557
UPDATE_SHARE_PARAMS = 8_400_000_000
UPDATE_SHARE_DEVICES = 6

# Peak dense FP16 tensor throughput, TFLOPS (NVIDIA datasheets; the A5000's 222.2 is quoted with 2:4 sparsity).
PEAK_TFLOPS = {"a5000": 222.2 / 2, "a100": 312.0}

# The speedups over the baseline at 10 SSDs that the paper states, with where it states them.
PUBLISHED_10_DEVICES = {
    "smartupdate": {"low": 1.60, "high": 1.66,
                    "source": "§VII-C (Fig. 9, A5000, GPT-2/BERT models incl. 4.0B): SU+O 1.60-1.66x at 10 SSDs"},
    "smartcomp": {"low": 1.85, "high": 1.98,
                  "source": "§VII-C (Fig. 9, A5000): SU+O+C 1.85-1.98x at 10 SSDs"},
    "smartcomp_a100": {"low": 2.11, "high": 2.11,
                       "source": "§VII-E (Fig. 11(b), A100, GPT-2 4.0B, 10 SSDs): 'up to 2.11x'"},
}

# What SmartComp adds on top of SU+O, as the paper states it (the ratio of the two speedups above, per model).
PUBLISHED_SMARTCOMP_OVER_SMARTUPDATE = {
    "low": 1.22, "high": 1.31,
    "source": "§VII-C (Fig. 9, A5000): SmartComp 1.22-1.31x additional speedup over SU+O, 10 SSDs",
}


def a5000_compute_s_per_param(figures: LinkFigures | None = None) -> float:
    """Forward + backward seconds per parameter on the A5000, derived from §VII-C's 75.57% (module docstring)."""
    setting = Setting(params=UPDATE_SHARE_PARAMS)
    t = step_time("baseline", setting, UPDATE_SHARE_DEVICES, figures or LinkFigures())
    by_name = {p.name: p.seconds for p in t.phases}
    update, offload = by_name["update"], by_name["gradient offload"]
    compute = update * (1 - UPDATE_SHARE) / UPDATE_SHARE - offload
    if compute <= 0:
        raise ValueError("these link figures leave no time for forward + backward at the paper's 75.57% update "
                         "share; give the compute time explicitly")
    return compute / UPDATE_SHARE_PARAMS


def compute_s(gpu: str, params: int, figures: LinkFigures | None = None) -> float:
    """Forward + backward seconds per step of a ``params``-sized GPT on ``gpu`` ("a5000" or "a100") in the paper's
    setting (module docstring for how they are derived)."""
    if gpu not in PEAK_TFLOPS:
        raise ValueError(f"unknown GPU setting {gpu!r}; valid: {', '.join(PEAK_TFLOPS)}")
    a5000 = a5000_compute_s_per_param(figures) * params
    return a5000 * PEAK_TFLOPS["a5000"] / PEAK_TFLOPS[gpu]
