"""Smart-Infinity (HPCA'24)'s settings and published numbers, for reproducing its Fig. 11 on the model clock.

The paper gives no forward/backward times. The A5000's is derived from the one breakdown it states in numbers
(§VII-C: with GPT-2 8.4B on 6 SSDs, the baseline's update, with its optimizer-state traffic, is 75.57% of the
step): on the model clock the baseline's update phase takes U and its gradient offload O, so forward + backward
is U x (1 - 0.7557) / 0.7557 - O. Compute scales with the parameter count at a fixed batch (6 x params x tokens
FLOPs), so the A5000 figure for another size is that time x params / 8.4e9. The A100's is the A5000's divided by
the ratio of their peak dense FP16 tensor throughputs (NVIDIA datasheets: A100 312 TFLOPS; RTX A5000 222.2 TFLOPS
with 2:4 sparsity, 111.1 dense): a lower bound on its time, since an offloaded step is not all tensor-core work.

SU+O+C also pays for selecting the Top-K on the GPU, which the paper does not time. Its released code
(AIS-SNU/smart-infinity, ``deepspeed/runtime/swap_tensor/optimizer_utils.py``) copies each fp16 gradient subgroup
from the host's page-locked swap buffer back to the GPU, sorts all of it by magnitude (``abs().sort()``), gathers
the top 1% and copies those values and their int32 positions back. ``bench/smartcomp_topk.py`` times exactly that
with torch on a GPU; ``compress_s`` carries the committed measurement (``bench/results/smartcomp_topk.json``, an
NVIDIA H200) to the paper's GPUs:

- the selection (abs, sort, gather) streams memory, so its rate is scaled by the ratio of the GPUs' memory
  bandwidths (datasheets: H200 4800, A100 40GB 1555, RTX A5000 768 GB/s);
- the upload of 2 bytes per param and the download of 6 bytes per kept param run at the paper GPUs' PCIe 4.0 x16
  peak (datasheets: 31.5 GB/s) times the share of its link's peak the H200's page-locked upload reached (PCIe
  5.0 x16, 63.0 GB/s).

nsp's own dataflow selects its Top-K where the gradient already is, with ``nsp.primitives.topk_compress``: no trip
back from the host. ``nsp_compress_s`` charges that at the rate ``bench/topk.py`` measured on the same H200 (64M
fp32 entries a shard, method "auto", the slower of its two realistic inputs), scaled the same way.

    >>> from nsp.csd import paper
    >>> a5000, a100 = (paper.compute_s(gpu, paper.GPT2_4B_PARAMS) for gpu in ("a5000", "a100"))
    >>> round(a5000, 2), round(a5000 / a100, 2)    # seconds of forward + backward; the A100 2.81x faster
    (3.5, 2.81)
    >>> [round(paper.compress_s(gpu, paper.GPT2_4B_PARAMS), 2) for gpu in ("a5000", "a100")]
    [0.92, 0.61]
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

# SU+O+C's Top-K on the GPU (module docstring): the fp16 gradient's trip back up, a full sort of it, the kept
# values (fp16) and positions (int32) back down.
GRADIENT_UPLOAD_BYTES = 2  # per param: the fp16 gradient, host swap buffer -> GPU
KEPT_DOWNLOAD_BYTES = 6  # per kept param
GPU_LINK_GBPS = 31.5  # PCIe 4.0 x16, both GPUs (NVIDIA datasheets)
MEMORY_GBPS = {"a5000": 768.0, "a100": 1555.0}  # NVIDIA datasheets (A100 40GB)
# Measured by bench/smartcomp_topk.py (bench/results/smartcomp_topk.json; tests/test_csd_model.py checks these
# against it): the selection of a 256M-element sub-group, and the page-locked upload, on an NVIDIA H200.
SELECT_GELEM_PER_S = 40.12  # abs().sort(descending=True) + the gather of the kept values, G elements/s
SELECT_GPU = "NVIDIA H200"
SELECT_GPU_MEMORY_GBPS = 4800.0  # H200 datasheet
LINK_SHARE_OF_PEAK = 55.19 / 63.0  # the H200's page-locked upload over its PCIe 5.0 x16 peak
# nsp's Top-K ("auto", the threshold path there) on that H200: 64M fp32 entries, the slower of the gaussian and
# Student-t inputs (bench/results/topk_gpu_67108864.json; at 128M it ran at 68 G elements/s, at 32M, on the exact
# path, at 18).
NSP_TOPK_GELEM_PER_S = 36.64

# The speedups over the baseline at 10 SSDs that the paper states, with where it states them.
PUBLISHED_10_DEVICES = {
    "smartupdate": {"low": 1.60, "high": 1.66,
                    "source": "§VII-C (Fig. 9, A5000, GPT-2/BERT models incl. 4.0B): SU+O 1.60-1.66x at 10 SSDs"},
    "smartcomp": {"low": 1.85, "high": 1.98,
                  "source": "§VII-C (Fig. 9, A5000): SU+O+C 1.85-1.98x at 10 SSDs"},
    "smartcomp_a100": {"low": 2.11, "high": 2.11,
                       "source": "§VII-E (Fig. 11(b), A100, GPT-2 4.0B, 10 SSDs): 'up to 2.11x'"},
}

# Fig. 11(a) itself: each scheme's speedup over the baseline on 1 SSD, per device count, read off the chart in the
# authors' camera-ready PDF (AIS-SNU/smart-infinity, assets/; by pixel, about +-0.05). The seed's text gives only
# the 10-device ratios above; these show the curves' absolute height, for comparison, not as targets.
FIG_11A_READ = {
    "source": "Fig. 11(a) of the camera-ready PDF (AIS-SNU/smart-infinity assets/), read off the chart, +-0.05",
    "a5000": {"baseline": {1: 1.00, 2: 1.50, 4: 2.22, 6: 2.25, 8: 2.25, 10: 2.27},
              "smartupdate": {1: 0.80, 2: 1.48, 4: 2.55, 6: 2.92, 8: 3.25, 10: 3.63},
              "smartcomp": {1: 0.88, 2: 1.62, 4: 2.80, 6: 3.44, 8: 3.75, 10: 4.41}},
    "a100": {"baseline": {1: 1.00, 2: 1.57, 4: 2.26, 6: 2.43, 8: 2.40, 10: 2.47},
             "smartupdate": {1: 0.86, 2: 1.45, 4: 2.58, 6: 3.18, 8: 3.80, 10: 4.46},
             "smartcomp": {1: 0.75, 2: 1.38, 4: 2.64, 6: 3.33, 8: 4.38, 10: 5.25}},
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


def _check_gpu(gpu: str) -> None:
    if gpu not in PEAK_TFLOPS:
        raise ValueError(f"unknown GPU setting {gpu!r}; valid: {', '.join(PEAK_TFLOPS)}")


def _on_paper_gpu(gelem_per_s: float, gpu: str) -> float:
    """Elements per second on ``gpu`` of a memory-bound GPU step measured at ``gelem_per_s`` on the H200: the rate
    carried by the ratio of their memory bandwidths."""
    _check_gpu(gpu)
    return gelem_per_s * 1e9 * MEMORY_GBPS[gpu] / SELECT_GPU_MEMORY_GBPS


def compute_s(gpu: str, params: int, figures: LinkFigures | None = None) -> float:
    """Forward + backward seconds per step of a ``params``-sized GPT on ``gpu`` ("a5000" or "a100") in the paper's
    setting (module docstring for how they are derived)."""
    _check_gpu(gpu)
    a5000 = a5000_compute_s_per_param(figures) * params
    return a5000 * PEAK_TFLOPS["a5000"] / PEAK_TFLOPS[gpu]


def compress_s(gpu: str, params: int, density: float = 0.01) -> float:
    """Seconds per step SU+O+C's GPU spends selecting the Top-K of a ``params``-sized gradient on ``gpu`` as the
    paper's released code does: upload it, sort it, gather the kept ``density`` and send it back (module docstring:
    measured on an H200, carried to ``gpu`` by datasheet ratios)."""
    link = GPU_LINK_GBPS * 1e9 * LINK_SHARE_OF_PEAK
    moved = GRADIENT_UPLOAD_BYTES * params + KEPT_DOWNLOAD_BYTES * density * params
    return moved / link + params / _on_paper_gpu(SELECT_GELEM_PER_S, gpu)


def nsp_compress_s(gpu: str, params: int) -> float:
    """Seconds per step nsp's dataflow spends selecting the Top-K of a ``params``-sized gradient on ``gpu``, where
    the gradient is (module docstring: measured on an H200, carried to ``gpu`` by memory bandwidth)."""
    return params / _on_paper_gpu(NSP_TOPK_GELEM_PER_S, gpu)


def default_compress_s(gpu: str, params: int, dataflow: str, density: float = 0.01) -> float:
    """SU+O+C's Top-K seconds when none is given: ``compress_s`` for the paper's dataflow, ``nsp_compress_s`` for
    nsp's, whose gradients make no trip back from the host."""
    return compress_s(gpu, params, density) if dataflow == "paper" else nsp_compress_s(gpu, params)
