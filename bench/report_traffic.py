"""Section 1 of the report, traffic per optimizer step (Smart-Infinity Table I): the measurement and its tables.

``run_traffic`` steps each configuration twice on real file-tier stores in a temporary folder and counts the
bytes of the second step: DeepSpeed's own optimizer swap (bench/deepspeed_swap.py) as the baseline, counted by
its swapper, by its aio calls (``CountedAio``) and by the OS; nsp near-storage dense and Top-K at ``RATIOS``,
counted by the store and by the OS. ``traffic_formulas`` gives Table I's values; ``traffic_rows`` and
``baseline_rows`` set the measurement beside them, as the report prints and renders them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax

import deepspeed_swap
from common import START_GIT, build_info

import nsp.optim
import nsp.storage
from nsp.primitives import get_num_threads

RATIOS = (0.10, 0.05, 0.02, 0.01)  # Top-K densities of Smart-Infinity's Table IV: section 1's rows, section 2's runs

# 1,024,000 params makes c x N whole for every ratio (so the formula is a whole number of bytes), fills one store
# shard with no padding, and cuts into 4 whole pages of 256,000 fp32 entries (1,024,000 bytes, a multiple of 4096),
# so that no page file carries zarr padding either; it is also a whole number of DeepSpeed's aio alignment
# (AIO_ALIGNED_BYTES = 1024 bytes = 256 fp32 entries), so its swap files carry no padding.
TRAFFIC_PARAMS = 1_024_000
TRAFFIC_PAGE_BYTES = 1_024_000
TRAFFIC_LR = 1e-3
TRAFFIC_BETAS, TRAFFIC_EPS = (0.9, 0.999), 1e-8  # nsp.optim.adam's defaults, which the nsp rows run


# ---- the OS's count of the bytes ---------------------------------------------------------------------------------

def proc_io() -> dict[str, int]:
    """This process's I/O counters: rchar / wchar are the bytes its read / write system calls moved (all threads)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":")
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


class IoDelta:
    """Bytes this process's system calls read and wrote between ``start`` and ``stop``, less what reading
    /proc/self/io itself adds to rchar (measured on an empty interval just before).

    ``stop`` also sets ``storage``: the bytes this process sent to and fetched from the block layer in that interval
    (read_bytes / write_bytes). That is the OS's count for I/O that bypasses read and write system calls, such as
    DeepSpeed's aio (io_submit on O_DIRECT files); a read served from the page cache adds nothing to it."""

    def start(self) -> None:
        a = proc_io()
        self.probe = proc_io().get("rchar", 0) - a.get("rchar", 0)
        self.io0 = proc_io()

    def stop(self) -> tuple[int, int]:
        io1 = proc_io()
        self.storage = (io1.get("read_bytes", 0) - self.io0.get("read_bytes", 0),
                        io1.get("write_bytes", 0) - self.io0.get("write_bytes", 0))
        return (io1.get("rchar", 0) - self.io0.get("rchar", 0) - self.probe,
                io1.get("wchar", 0) - self.io0.get("wchar", 0))


def exact(value: Fraction) -> int | float:
    """A formula value as an int when it is a whole number of bytes."""
    return int(value) if value.denominator == 1 else float(value)


# ---- the measurement ---------------------------------------------------------------------------------------------

class CountedAio:
    """One of the aio handles of DeepSpeed's swapper, counting the bytes of every read and write it is handed (the
    tensor given to ``async_pread`` / ``async_pwrite``), split by swap file: a sub-group's gradient file or its
    state files (p, m, v). Everything else is the handle's own."""

    def __init__(self, handle, gradient_paths: list[str]):
        self._handle = handle
        self._gradient_paths = set(gradient_paths)
        self.read = {"state": 0, "gradient": 0}
        self.written = {"state": 0, "gradient": 0}

    def _kind(self, path: str) -> str:
        return "gradient" if path in self._gradient_paths else "state"

    def async_pread(self, buffer, path, *args):
        self.read[self._kind(path)] += buffer.numel() * buffer.element_size()
        return self._handle.async_pread(buffer, path, *args)

    def async_pwrite(self, buffer, path, *args):
        self.written[self._kind(path)] += buffer.numel() * buffer.element_size()
        return self._handle.async_pwrite(buffer, path, *args)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def adam_reference(p0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Adam (no weight decay, bias-corrected, eps outside the root) in float64: what the baseline's params should be
    after ``grads``."""
    p, m, v = p0.astype(np.float64), np.zeros(p0.size), np.zeros(p0.size)
    (b1, b2), eps = TRAFFIC_BETAS, TRAFFIC_EPS
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * np.square(g, dtype=np.float64)
        p = p - TRAFFIC_LR * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def measure_baseline(workdir: str, p0: np.ndarray, grads: list[np.ndarray], swap_gradient: bool,
                     deepspeed: dict) -> dict:
    """One optimizer step of DeepSpeed's optimizer swap (``bench/deepspeed_swap.py``) in ZeRO's serial arrangement
    (PartitionedOptimizerSwapper: one aio handle; per sub-group p, m, v swapped in, DeepSpeedCPUAdam, swapped out)
    at DeepSpeed's default sub_group_size and aio settings. ``swap_gradient``: the gradient is first swapped out
    to its files and read back with each sub-group's state (ZeRO-Infinity's gradient offload to NVMe); otherwise
    it is copied from host memory. The second step is measured (the first sets up DeepSpeedCPUAdam's state).

    Bytes are counted three ways: the swapper's own counters (``bytes_read`` / ``bytes_written``, added up at each
    of its aio calls), the handle's calls split into state and gradient files (``CountedAio``), and the OS's
    count of what this process sent to and fetched from the block layer (DeepSpeed's aio reads and writes its
    files O_DIRECT through io_submit, which read and write system calls, rchar / wchar, do not see)."""
    path = os.path.join(workdir, "baseline_swap" if swap_gradient else "baseline")
    swap = deepspeed_swap.DeepSpeedOptimizerSwap(
        path, p0, sub_group_numel=int(deepspeed["sub_group_size_default"]), pipelined=False, lr=TRAFFIC_LR,
        betas=TRAFFIC_BETAS, eps=TRAFFIC_EPS, threads=get_num_threads(), swap_gradient=swap_gradient)
    try:
        handle = CountedAio(swap.read_handle, swap.grad_paths)
        swap.read_handle = swap.write_handle = handle  # the serial arrangement has one handle for both
        swap.step(grads[0])
        read0, written0 = swap.bytes_read, swap.bytes_written
        calls0 = (dict(handle.read), dict(handle.written))
        io = IoDelta()
        io.start()
        swap.step(grads[1])
        os_read, os_written = io.stop()
        storage_read, storage_written = io.storage
        read, written = swap.bytes_read - read0, swap.bytes_written - written0
        calls_read = {k: v - calls0[0][k] for k, v in handle.read.items()}
        calls_written = {k: v - calls0[1][k] for k, v in handle.written.items()}
        # The state the step left in the swap files: its change from p0 against Adam's, relative.
        moved = swap.read_params().astype(np.float64) - p0
        want = adam_reference(p0, grads) - p0
        update_rel_err = float(np.linalg.norm(moved - want) / np.linalg.norm(want))
        return {
            "to_store": written, "from_store": read,
            "state_read": calls_read["state"], "state_written": calls_written["state"],
            "grad_read": calls_read["gradient"], "grad_written": calls_written["gradient"],
            "counters_agree": calls_read["state"] + calls_read["gradient"] == read
                              and calls_written["state"] + calls_written["gradient"] == written,
            "os_read": os_read, "os_written": os_written,
            "os_storage_read": storage_read, "os_storage_written": storage_written,
            "numel": int(p0.size), "swapped_numel": int(sum(g[2] for g in swap.groups)),
            "update_rel_err": update_rel_err, "deepspeed": swap.describe(),
        }
    finally:
        swap.close()


def measure_nsp(workdir: str, p0: np.ndarray, grads: list[np.ndarray], ratio: float | None) -> dict:
    """One step of ``nsp.optim.adam(store=<file tier>)`` (Top-K compressed at ``ratio``), jitted as a user would;
    the second step is measured (the first compiles)."""
    name = "nsp_dense" if ratio is None else f"nsp_topk_{ratio:g}"
    store = nsp.storage.open(os.path.join(workdir, name), tier="file", page_bytes=TRAFFIC_PAGE_BYTES)
    try:
        compression = None if ratio is None else nsp.optim.TopK(ratio)
        tx = nsp.optim.adam(TRAFFIC_LR, store=store, compression=compression)
        params = {"w": jnp.asarray(p0)}
        opt_state = tx.init(params)

        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        params, opt_state = jax.block_until_ready(step(params, opt_state, {"w": jnp.asarray(grads[0])}))
        g = {"w": jnp.asarray(grads[1])}  # on the device before the counters start
        store.barrier()
        store.reset_stats()
        io = IoDelta()
        io.start()
        params, opt_state = jax.block_until_ready(step(params, opt_state, g))
        store.barrier()
        os_read, os_written = io.stop()
        s = store.stats()
        return {
            "to_store": s["shared_in_bytes"], "from_store": s["shared_out_bytes"],
            "internal_read": s["internal_read_bytes"], "internal_write": s["internal_write_bytes"],
            "pages_read": s["pages_read"], "pages_written": s["pages_written"], "updates": s["updates"],
            "os_read": os_read, "os_written": os_written,
            "os_storage_read": io.storage[0], "os_storage_written": io.storage[1],
            "total": store.layout.total, "padded_total": store.layout.padded_total,
            "pages_per_state": store.layout.pages_per_shard * store.num_shards,
        }
    finally:
        store.close()


def traffic_formulas(n: int) -> dict[str, dict[str, Fraction | None]]:
    """Smart-Infinity Table I with M = 2 bytes x params (16-bit model size) and fp32 transport (2M per tensor)."""
    M = Fraction(2 * n)
    out = {
        "baseline": {"to_store": 6 * M + 2 * M, "from_store": 6 * M + 2 * M,  # state + grads each way
                     "internal_read": None, "internal_write": None},
        "dense": {"to_store": 2 * M, "from_store": 2 * M, "internal_read": 6 * M, "internal_write": 6 * M},
    }
    for c in RATIOS:
        out[f"topk_{c:g}"] = {"to_store": Fraction(str(c)) * n * (4 + 4), "from_store": 2 * M,
                              "internal_read": 6 * M, "internal_write": 6 * M}
    return out


def run_traffic(args, command: str) -> dict:
    """Section 1: measures every configuration's bytes per step on real file-tier stores in a temporary folder
    (``args.dir``; seeded by ``args.seed``); ``command`` is the command line the record names."""
    n = TRAFFIC_PARAMS
    rng = np.random.default_rng(args.seed)
    p0 = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))
    grads = [rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2) for _ in range(2)]
    print("  DeepSpeed (the baseline): loading its async_io and cpu_adam ops (the first use compiles them, "
          "minutes) ...", flush=True)
    deepspeed = deepspeed_swap.status()
    if not deepspeed["available"]:
        print(f"  DeepSpeed not available: {deepspeed['reason']} -- the baseline rows are left out", flush=True)
    workdir = tempfile.mkdtemp(prefix=".nsp_report_", dir=args.dir)
    try:
        measured = {}
        for key, swap_gradient in (("baseline", False), ("baseline_swap", True)):
            if not deepspeed["available"]:
                measured[key] = {"unavailable": f"DeepSpeed not available: {deepspeed['reason']}"}
                continue
            try:
                measured[key] = measure_baseline(workdir, p0, grads, swap_gradient, deepspeed)
            except Exception as e:  # noqa: BLE001  (what DeepSpeed raises varies; the row says what it was)
                measured[key] = {"unavailable": f"DeepSpeed not available: its optimizer swap failed here: "
                                                f"{type(e).__name__}: {e}"}
                print(f"  {key}: {measured[key]['unavailable']}", flush=True)
        measured["dense"] = measure_nsp(workdir, p0, grads, None)
        for c in RATIOS:
            measured[f"topk_{c:g}"] = measure_nsp(workdir, p0, grads, c)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"params": n, "page_bytes": TRAFFIC_PAGE_BYTES, "seed": args.seed, "measured": measured,
            "deepspeed": deepspeed, "command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git": START_GIT, "build": build_info()}


# ---- its tables --------------------------------------------------------------------------------------------------

TRAFFIC_LABELS = {
    "dense": "(b) nsp near-storage update, dense (SmartUpdate)",
    **{f"topk_{c:g}": f"(c) nsp near-storage + Top-K {c:.0%} (SmartComp)" for c in RATIOS},
}
SHORT_LABELS = {"dense": "(b) nsp dense", **{f"topk_{c:g}": f"(c) nsp Top-K {c:.0%}" for c in RATIOS}}
BASELINE_TAGS = {"baseline": "(a)", "baseline_swap": "(a')"}


def deepspeed_name(traffic: dict) -> str | None:
    """'DeepSpeed <version>' of the baseline rows; None for a record made before they ran DeepSpeed's swapper."""
    if "deepspeed" not in traffic:
        return None
    version = traffic["deepspeed"].get("version")  # unknown when DeepSpeed could not be imported
    return f"DeepSpeed {version}" if version else "DeepSpeed"


def traffic_label(key: str, traffic: dict, short: bool = False) -> str:
    """A row's label; the baseline's names the DeepSpeed version whose optimizer swap it ran."""
    if not key.startswith("baseline"):
        return (SHORT_LABELS if short else TRAFFIC_LABELS)[key]
    swapped = key == "baseline_swap"
    tag = BASELINE_TAGS[key]
    ds = deepspeed_name(traffic)
    if ds is None:  # an older record: the baseline was then modelled with nsp's own engine
        return (f"{tag} baseline host updater modelled with nsp's engine (older record), gradient "
                + ("swapped" if swapped else "in host RAM"))
    if short:
        return f"{tag} {ds} swap, grad " + ("swapped" if swapped else "in RAM")
    if swapped:
        return (f"{tag} baseline: {ds}'s optimizer swap, serial, + gradient swapped out to its files and read back "
                "(ZeRO-Infinity's gradient offload to NVMe)")
    return (f"{tag} baseline: {ds}'s optimizer swap, serial (p, m, v swapped in, DeepSpeedCPUAdam, swapped out), "
            "gradient in host RAM")


def traffic_rows(traffic: dict) -> tuple[list[dict], list[dict]]:
    """(shared-link rows, internal-link rows) with the formula value and whether they match to the byte. A baseline
    row that could not be measured (DeepSpeed not available) says why and has no numbers; the baseline has no
    internal link (see ``baseline_rows`` for its OS check)."""
    n = traffic["params"]
    M = 2 * n
    formulas = traffic_formulas(n)
    shared, internal = [], []
    for key, m in traffic["measured"].items():
        label = traffic_label(key, traffic)
        if "unavailable" in m:
            shared.append({"config": f"{BASELINE_TAGS[key]} baseline, {deepspeed_name(traffic)}'s optimizer swap: "
                                     f"{m['unavailable']} (left out)", "key": key, "match": "-"})
            continue
        f = formulas["baseline" if key.startswith("baseline") else key]
        total = m["to_store"] + m["from_store"]
        f_total = f["to_store"] + f["from_store"]
        match = m["to_store"] == f["to_store"] and m["from_store"] == f["from_store"]
        shared.append({
            "config": label, "key": key, "to": m["to_store"], "from": m["from_store"], "total": total,
            "total_m": f"{total / M:.4g} M", "formula_to": exact(f["to_store"]), "formula_from": exact(f["from_store"]),
            "formula_total": exact(f_total), "formula_m": f"{float(f_total) / M:.4g} M",
            "match": "yes" if match else f"no ({(total - float(f_total)) / M:+.4g} M)",
        })
        if "internal_read" in m:
            imatch = m["internal_read"] == f["internal_read"] and m["internal_write"] == f["internal_write"]
            internal.append({
                "config": label, "key": key, "read": m["internal_read"], "write": m["internal_write"],
                "pages": f"{m['pages_read']} / {m['pages_written']}",
                "formula": f"{exact(f['internal_read']):,} / {exact(f['internal_write']):,}",
                "match": "yes" if imatch else "no", "os_read": m["os_read"], "os_written": m["os_written"],
                "os_extra": f"{m['os_read'] - m['internal_read']:+,} / {m['os_written'] - m['internal_write']:+,}",
            })
    return shared, internal


def baseline_rows(traffic: dict) -> list[dict]:
    """The measured baseline rows' byte counts side by side: the swapper's counters, its aio calls by swap file,
    and the OS's counts (system calls; block layer)."""
    rows = []
    for key, m in traffic["measured"].items():
        if not key.startswith("baseline") or "unavailable" in m or "os_storage_read" not in m:
            continue
        r, w = m["os_storage_read"], m["os_storage_written"]
        rows.append({
            "config": traffic_label(key, traffic, short=True), "key": key,
            "swapper": f"{m['from_store']:,} / {m['to_store']:,}",
            "state": f"{m['state_read']:,} / {m['state_written']:,}",
            "grad": f"{m['grad_read']:,} / {m['grad_written']:,}",
            "agree": "yes" if m["counters_agree"] else "no",
            "os_sys": f"{m['os_read']:,} / {m['os_written']:,}", "os_block": f"{r:,} / {w:,}",
            "os_extra": f"{r - m['from_store']:+,} / {w - m['to_store']:+,}",
            "update_err": m["update_rel_err"],
        })
    return rows


SHARED_COLUMNS = [("config", "configuration", ""), ("to", "to store (B)", ",d"), ("from", "from store (B)", ",d"),
                  ("total", "total (B)", ",d"), ("total_m", "total / M", ""),
                  ("formula_total", "formula total (B)", ",.12g"), ("formula_m", "formula / M", ""),
                  ("match", "match", "")]
INTERNAL_COLUMNS = [("config", "configuration", ""), ("read", "read (B)", ",d"), ("write", "written (B)", ",d"),
                    ("pages", "pages r / w", ""), ("formula", "formula r / w (B)", ""), ("match", "match", ""),
                    ("os_read", "OS rchar (B)", ",d"), ("os_written", "OS wchar (B)", ",d"),
                    ("os_extra", "OS - counted r / w (B)", "")]
BASELINE_COLUMNS = [("config", "configuration", ""), ("swapper", "swapper counters r / w (B)", ""),
                    ("state", "aio calls, p m v files r / w (B)", ""),
                    ("grad", "aio calls, gradient files r / w (B)", ""), ("agree", "calls = counters", ""),
                    ("os_sys", "OS rchar / wchar (B)", ""), ("os_block", "OS block layer r / w (B)", ""),
                    ("os_extra", "OS block - counters r / w (B)", ""),
                    ("update_err", "update vs Adam (rel. err)", ".2g")]
