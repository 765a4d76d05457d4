"""SmartComp's Top-K selection on a GPU, timed as Smart-Infinity's released code runs it.

    python bench/smartcomp_topk.py                       # sub-groups of 16M, 64M and 256M fp16 elements
    python bench/smartcomp_topk.py --sizes 64M --repeats 5 --json /tmp/smartcomp_topk.json

Needs torch and a CUDA GPU; it exits with a message saying so otherwise (``--device cpu`` runs the same steps on
the CPU, a smoke run of the script whose numbers say nothing about a GPU). The CSD model (``nsp.csd.paper``)
charges SU+O+C for choosing its Top-K on the GPU. Its released code (AIS-SNU/smart-infinity,
``deepspeed/runtime/swap_tensor/optimizer_utils.py``) does, for each gradient sub-group it swaps out:

  upload    the fp16 gradient, from the host's page-locked swap buffer to the GPU (``.to('cuda')``)
  select    ``abs().sort(descending=True)``, the first k = density x N indices, and a gather of their values
  download  the k values (fp16) and positions (int32) back to the host

Each phase is timed alone (the GPU synchronised before and after), median of ``--repeats`` after a warm-up call,
on random normal gradients. Beside them the record gives the GPU's memory bandwidth as a device-to-device copy
(bytes read + written) and the host link's as a page-locked upload of 1 GiB, so that a rate measured on this GPU
can be carried to the paper's GPUs by the ratio of their bandwidths (``nsp.csd.paper.compress_s``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, print_table, write_json  # noqa: E402

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64M' -> 67108864; a plain integer as is."""
    text = text.strip()
    mult = UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if mult > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (e.g. 64M, 268435456)")
    return int(digits) * mult


def timed(fn, repeats: int, sync) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up call, the GPU idle before and after
    (``sync`` waits for it)."""
    fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16M,64M,256M", help="sub-group sizes in fp16 elements, comma separated")
    ap.add_argument("--density", type=float, default=0.01, help="share of the elements kept (the paper's 1%%)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (the measurement) or cpu (a smoke run of the script)")
    ap.add_argument("--json", default=None, help="where the record goes (default bench/results/smartcomp_topk.json)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if not 0 < args.density <= 1:
        ap.error(f"--density must be in (0, 1], got {args.density}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        import torch
    except ImportError:
        sys.exit("bench/smartcomp_topk.py needs torch with CUDA (pip install torch); torch is not installed")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench/smartcomp_topk.py needs a CUDA GPU; torch.cuda.is_available() is False on this machine "
                 "(--device cpu runs a smoke run of the script)")

    dev = torch.device(args.device)
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        gpu = {"name": props.name, "memory_bytes": props.total_memory,
               "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda, "torch": torch.__version__}
        print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__} (CUDA "
              f"{torch.version.cuda}); density {args.density:g}, median of {args.repeats}")
    else:
        gpu = {"name": "none: --device cpu, a smoke run", "torch": torch.__version__}
        print(f"CPU smoke run (--device cpu): the numbers say nothing about a GPU; density {args.density:g}")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pin = cuda  # page-locked host buffers need a CUDA runtime

    # The GPU's memory bandwidth (device-to-device copy, bytes read + written) and the host link's (page-locked
    # upload), each the best of the repeats: the figures the paper's GPUs are scaled by.
    probe = torch.empty(2**30, dtype=torch.uint8, device=dev)
    probe_dst = torch.empty_like(probe)
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=pin)
    copy_s = min(timed(lambda: probe_dst.copy_(probe), args.repeats, sync))
    upload_probe_s = min(timed(lambda: probe.copy_(host, non_blocking=True), args.repeats, sync))
    memory_gbps = 2 * probe.numel() / copy_s / 1e9
    link_gbps = host.numel() / upload_probe_s / 1e9
    probe = probe_dst = host = None  # freed (not del: the timed lambdas above still name them)
    print(f"memory: device-to-device copy {memory_gbps:.0f} GB/s (read + written); host link: page-locked upload "
          f"{link_gbps:.1f} GB/s")

    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n in sizes:
        k = max(1, int(args.density * n))
        grad_host = torch.randn(n, generator=gen, dtype=torch.float32).to(torch.float16)
        grad_host = grad_host.pin_memory() if pin else grad_host
        values_host = torch.empty(k, dtype=torch.float16, pin_memory=pin)
        positions_host = torch.empty(k, dtype=torch.int32, pin_memory=pin)
        grad = grad_host.to(dev)
        state: dict[str, torch.Tensor] = {}

        def upload():
            state["grad"] = grad_host.to(dev)

        def select():
            _, idx = grad.abs().sort(descending=True)
            positions = idx[:k]
            state["values"] = grad[positions]
            state["positions"] = positions.to(torch.int32)

        def download():
            values_host.copy_(state["values"])
            positions_host.copy_(state["positions"])

        up = timed(upload, args.repeats, sync)
        sel = timed(select, args.repeats, sync)
        down = timed(download, args.repeats, sync)
        # The selection is right: the kept magnitudes are the k largest.
        kept = values_host.float().abs()
        cut = grad.float().abs().kthvalue(n - k + 1).values.item()
        if kept.min().item() < cut:
            sys.exit(f"selection check failed at {n} elements: a kept magnitude {kept.min().item()} is below the "
                     f"k-th largest {cut}")
        rows.append({"elements": n, "k": k, "upload_s": median(up), "select_s": median(sel),
                     "download_s": median(down), "upload_times_s": up, "select_times_s": sel,
                     "download_times_s": down, "upload_gbps": 2 * n / median(up) / 1e9,
                     "select_gelem_per_s": n / median(sel) / 1e9})
        grad = grad_host = state = None  # freed before the next size (the closures above name them)
        if cuda:
            torch.cuda.empty_cache()

    print_table("SmartComp Top-K on the GPU, per sub-group (median)", rows, [
        ("elements", "elements", "d"), ("k", "k", "d"), ("upload_s", "upload s", ".4f"),
        ("upload_gbps", "upload GB/s", ".1f"), ("select_s", "select s", ".4f"),
        ("select_gelem_per_s", "select G elem/s", ".2f"), ("download_s", "download s", ".5f")])
    largest = max(rows, key=lambda r: r["elements"])
    payload = {"device": args.device, "gpu": gpu, "density": args.density, "repeats": args.repeats,
               "memory_copy_gbps": memory_gbps, "host_link_upload_gbps": link_gbps, "rows": rows,
               "select_gelem_per_s": largest["select_gelem_per_s"], "select_elements": largest["elements"]}
    out = write_json("smartcomp_topk", payload, args.json)
    print(f"wrote {out}")
    print(f"select (abs, sort, gather) at {largest['elements']} elements: {largest['select_gelem_per_s']:.2f} G "
          f"elem/s on {gpu['name']} with {memory_gbps:.0f} GB/s of memory copy")


if __name__ == "__main__":
    main()
