"""Update-kernel throughput: nsp fused_update against optax, torch and the memory roofline, in one run.

    python bench/update_kernel.py            # 64M fp32 params, 2 threads, median of 7
    python bench/update_kernel.py --size 16M --threads 1 --repeats 5
    python bench/update_kernel.py --size 512M --contenders nsp,torch,probes --no-crc   # a subset (memory)

bench/kernel_sweep.py runs this file in fresh processes over sizes, thread counts, ISAs and page sizes, several
times each, and reports the median and spread of the ratios across runs.

Contenders (all updating the same number of fp32 Adam parameters in place, interleaved, median of N):
  nsp dense fp32     fused_update(kind="adam") under jax.jit with donated state (28 B/param moved)
  nsp bf16 grads     the same with a bfloat16 gradient (26 B/param)
  nsp top-k 1%       the same with a 1% Top-K compressed gradient, decompressed inside the kernel (~24 B/param)
  nsp eager          fused_update called without jax.jit, as a user coming from torch first calls it, on a state
                     of its own: nothing is donated, so the kernel writes new p, m, v beside the caller's (28
                     B/param), into the arrays of the call before last, which the loop has dropped
  optax.adam         under jax.jit on CPU, params and state donated (what a JAX user would otherwise run)
  torch fused Adam   torch.optim.Adam(fused=True) on CPU, when torch is installed (pip install ".[bench]")
  DeepSpeedCPUAdam   when deepspeed is installed (its cpu_adam op builds on first use)
  roofline probes    streaming loops reading p, g, m, v and writing p, m, v (28 B/param), same threads: nsp's
                     stream probe (nsp.primitives.stream_roofline) and numpy in place (p += g, m += g, v += g per
                     64K-element chunk, so g is read from memory once; one Python thread per kernel thread)

Page checksums: the CRC-32C the file tier computes over every page it writes and reads, on a 4 MiB page, once per
implementation this CPU has (portable table, SSE4.2 crc32, PCLMUL folds, VPCLMULQDQ folds on 256-bit and 512-bit
registers), each in a process of its own (NSP_CRC32C_ISA is read at import), in interleaved rounds, median GB/s.

The memory roofline is an upper bound, so it is the best of several streaming probes: the two above and the
Adam implementations that stream the same 28 B/param (torch fused Adam, DeepSpeedCPUAdam). "vs roofline" divides
by the best of them; the JSON records every probe.

Arrays: every contender streams arrays of its own, so that none finds another's data in the last-level cache
(at 16M params, 256 MB of state, a contender that ran right after another on the same arrays found part of them
there). Where four such sets would not fit in half the RAM (512M params here), the probes, torch fused Adam and
DeepSpeedCPUAdam share one set of host arrays p, g, m, v instead (each updates it in place; DeepSpeed keeps its
moments in arrays of its own); the record says which (shared_host_arrays). nsp's and optax's state are XLA
buffers of their own.

Calls per sample (--calls, default auto): each timed sample is that many back-to-back calls (the time reported is
per call), enough that one sample moves at least 0.5 GB: at 1M params a single call takes well under a
millisecond, where timer and thread wake-up noise would swamp it.

Memory pages (--memory-pages, bench/page_backing.py): every contender's arrays on the same kind of page, 2 MiB
transparent huge pages by default (the record gives each one's measured share). Left to themselves, numpy's
arrays (torch's here, and the probes') get huge pages and XLA's (nsp's, optax's) do not, which alone made nsp
0.90x as fast here.

Spinning threads: OMP_WAIT_POLICY is set (default PASSIVE) before torch or DeepSpeed load their OpenMP runtime,
and every call is followed by a pause (default 0.2 s) before the next contender runs; the JSON records both, and
the CPU time this process used during each pause (threads of the last contender still running). Run with
--omp-wait-policy ACTIVE or unset to see what spinning threads do to the ratios.

Each timed sample starts the same way for every contender (each step recorded, each can be turned off):
  order       the contenders run in a fresh (seeded) order each round (--order shuffled), so none always follows
              the same one
  cache reset a read of a buffer twice the last-level cache's size (--cache-reset-mib), so that no call finds
              another contender's dirty lines to write back first (bench/cache_reset.py)
  pre-touch   a read of the contender's own arrays (--pre-touch): memory idle for a fraction of a second is slow
              to touch again on these virtual machines (a 64 MB array read 5.6 ms back to back, 35.8 ms after 1 s
              idle), and in interleaved rounds every contender's arrays idle while the others run. Without it
              nsp's 64M update took 105-111 ms here, with it 51-58 ms (the others alike); the read leaves the last
              part of the contender's own arrays in the cache, as a training loop's previous step would
  warm call   the contender's own call on a small state (--warm-call, WARM_ELEMS params), so that its threads are
              awake, as after a training step's backward pass. After the pause, waking the threads of a jitted
              call cost 1-4 ms here (a 2-vCPU virtual machine): a jitted call on 1K elements took 1.2 ms after a
              sleep and 25 us back to back, which at 64M params was 5-10% of nsp's time and none of the kernel's.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_reset  # noqa: E402
import page_backing  # noqa: E402
import wait_policy  # noqa: E402
from adam_steps import nsp_adam_step, torch_fused_adam  # noqa: E402
from common import median, print_table, time_interleaved, write_json  # noqa: E402

from nsp.primitives import fused_update, kernel_isa, kernel_time, set_num_threads, stream_roofline  # noqa: E402

LR = 1e-3
#: --contenders groups: nsp dense fp32; nsp's other variants (bf16 gradient, Top-K, eager); the rest one each.
CONTENDER_GROUPS = ("nsp", "nsp-variants", "optax", "torch", "deepspeed", "probes")
DS = "DeepSpeedCPUAdam"
TORCH = "torch fused Adam"
SAMPLE_BYTES = 0.5e9  # --calls auto: a timed sample moves at least this many bytes
#: --warm-call: the size of each contender's warm-up state, enough that each splits it over two threads (nsp's
#: kernels split at 64K elements per task)
WARM_ELEMS = 1 << 18
NSP_PROBE = "roofline probe: nsp stream (28 B/param)"
NUMPY_PROBE = "roofline probe: numpy in place (28 B/param)"
EAGER = "nsp dense fp32, eager (no jit)"
NSP = "nsp dense fp32"
ROOFLINE_PROBES = (NSP_PROBE, NUMPY_PROBE, "torch fused Adam", "DeepSpeedCPUAdam")
CRC_ISAS = ("portable", "sse4.2", "pclmul", "vpclmul-avx2", "vpclmul-avx512")  # ffi/util/crc32c.cc, slowest first
CRC_PAGE_BYTES = 4 << 20

# One CRC-32C implementation's time per 4 MiB page: the median of 7 batches of calls, after a warm-up call.
_CRC_PROBE = r"""
import time
import numpy as np
from nsp import _nsp_ffi
_nsp_ffi.kernel_isa()  # raises when NSP_CRC32C_ISA names an implementation this CPU lacks
page = np.random.default_rng(0).integers(0, 256, {page_bytes}, dtype=np.uint8)
_nsp_ffi.crc32c(page)
per_call = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range({calls}):
        _nsp_ffi.crc32c(page)
    per_call.append((time.perf_counter() - t) / {calls})
print(sorted(per_call)[3])
"""


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def nsp_contenders(n: int, rng: np.random.Generator, ratio: float, arrays: dict, variants: bool = True,
                   warm: dict | None = None):
    """Three nsp variants sharing one state (each call is one in-place Adam step), and the eager one (only the
    dense one without ``variants``); ``arrays`` receives, per contender, a function listing the arrays it
    streams, and ``warm`` its warm-up call (the same step on a small state of its own)."""
    state = {
        "p": jnp.asarray(rng.standard_normal(n, np.float32)),
        "m": jnp.zeros(n, jnp.float32),
        "v": jnp.zeros(n, jnp.float32),
        "t": 0,
    }
    grad = jnp.asarray(rng.standard_normal(n, np.float32))
    step = nsp_adam_step(LR)

    def run(call, state=state):
        def fn():
            state["t"] += 1
            out = call(state["t"])
            state["p"], state["m"], state["v"] = jax.block_until_ready(out)

        return fn

    def streams(s, *extra):
        return lambda: [s["p"], s["m"], s["v"], *extra]

    arrays["nsp dense fp32"] = streams(state, grad)
    dense = {"nsp dense fp32": run(lambda t: step(state["p"], grad, state["m"], state["v"], t))}
    small = {"p": jnp.ones(WARM_ELEMS, jnp.float32), "m": jnp.zeros(WARM_ELEMS, jnp.float32),
             "v": jnp.zeros(WARM_ELEMS, jnp.float32), "t": 0}
    small_grad = jnp.full(WARM_ELEMS, 1e-3, jnp.float32)
    warm_jit = run(lambda t: step(small["p"], small_grad, small["m"], small["v"], t), small)
    if warm is not None:
        warm["nsp dense fp32"] = warm_jit
    if not variants:
        return dense, 0
    grad_bf16 = grad.astype(jnp.bfloat16)
    k = max(1, int(n * ratio))
    idx = jnp.asarray(np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32))
    vals = jnp.asarray(rng.standard_normal(k, np.float32))

    # The eager contender steps a state of its own, as a user's eager loop would: the jitted calls donate (delete)
    # the arrays they are given, which would leave the eager calls no dropped arrays of their own to reuse.
    eager_state = {"p": state["p"].copy(), "m": state["m"].copy(), "v": state["v"].copy(), "t": 0}

    def eager(t):
        s = eager_state
        return fused_update(s["p"], grad, s["m"], s["v"], kind="adam", step=t, lr=LR)[:3]

    topk = f"nsp top-k {ratio:.0%}"
    if warm is not None:
        # The eager contender warms up with the jitted call too: same threads. An eager call on the small state
        # would put its outputs in the pool of arrays eager calls reuse (nsp.primitives._eager_buffers) and push
        # out one the timed call needs, which then pays a fresh array's page faults.
        warm.update({"nsp bf16 grads": warm_jit, topk: warm_jit, EAGER: warm_jit})
    arrays.update({EAGER: streams(eager_state, grad), "nsp bf16 grads": streams(state, grad_bf16),
                   topk: streams(state, vals, idx)})
    return {
        **dense,
        EAGER: run(eager, eager_state),
        "nsp bf16 grads": run(lambda t: step(state["p"], grad_bf16, state["m"], state["v"], t)),
        topk: run(lambda t: step(state["p"], vals, state["m"], state["v"], t, idx)),
    }, k


def optax_contender(n: int, rng: np.random.Generator):
    opt = optax.adam(LR)
    params = jnp.asarray(rng.standard_normal(n, np.float32))
    grad = jnp.asarray(rng.standard_normal(n, np.float32))
    box = {"p": params, "s": opt.init(params)}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def fn():
        box["p"], box["s"] = jax.block_until_ready(step(box["p"], box["s"], grad))

    def streams():
        return [box["p"], grad, *(x for x in jax.tree.leaves(box["s"]) if x.size == n)]

    small_grad = jnp.full(WARM_ELEMS, 1e-3, jnp.float32)
    small = {"p": jnp.ones(WARM_ELEMS, jnp.float32)}
    small["s"] = opt.init(small["p"])

    def warm():
        small["p"], small["s"] = jax.block_until_ready(step(small["p"], small["s"], small_grad))

    return fn, streams, warm


def torch_contender(shared: list[np.ndarray], threads: int):
    p, g, m, v = shared
    step, note = torch_fused_adam(p, g, m, v, threads=threads, lr=LR)
    if step is None:
        return None, note, None, None
    small_step, _ = torch_fused_adam(*probe_arrays(WARM_ELEMS), threads=threads, lr=LR)
    t = [0]

    def fn():
        t[0] += 1
        step(t[0])

    def warm():
        small_step(t[0] + 1)

    return fn, note, lambda: [p, g, m, v], warm


def deepspeed_contender(shared: list[np.ndarray], threads: int):
    n = shared[0].size
    try:
        import deepspeed
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        torch.set_num_threads(threads)  # its OpenMP loop runs in torch's OpenMP runtime (loaded first)
        p = torch.nn.Parameter(torch.from_numpy(shared[0]))  # zero-copy: the shared host arrays
        p.grad = torch.from_numpy(shared[1])
        opt = DeepSpeedCPUAdam([p], lr=LR, adamw_mode=False)
        small_p, small_g = probe_arrays(WARM_ELEMS)[:2]
        small = torch.nn.Parameter(torch.from_numpy(small_p))
        small.grad = torch.from_numpy(small_g)
        small_opt = DeepSpeedCPUAdam([small], lr=LR, adamw_mode=False)
    except Exception as e:  # noqa: BLE001  (deepspeed raises various errors when its ops cannot build)
        return None, (f"unavailable ({type(e).__name__}: {e}; apt-get install -y libaio-dev && pip install "
                      "'.[bench]')"), None, None

    def fn():
        opt.step()

    def streams():  # its moments exist from the first step on
        return [p, p.grad, *(x for x in opt.state[p].values() if hasattr(x, "numel") and x.numel() == n)]

    return fn, f"deepspeed {deepspeed.__version__}, {threads} threads", streams, small_opt.step


def probe_arrays(n: int) -> list[np.ndarray]:
    """p, g, m, v for a streaming probe, each written once so that each has pages of its own. An array never written
    (np.zeros of this size) reads as the kernel's one shared zero page: a g left so streams from cache, not memory,
    and the probe then moves 24 B/param, not 28 (at 64M params it took 14.1 ms that way against 21.6 ms with g
    written, in one interleaved run)."""
    return [np.full(n, 1e-3, np.float32) for _ in range(4)]


def nsp_stream_probe(arrays: list[np.ndarray]):
    small = probe_arrays(WARM_ELEMS)

    def fn():
        stream_roofline(*arrays)

    return fn, lambda: arrays, lambda: stream_roofline(*small)


NUMPY_CHUNK = 1 << 16  # elements: g's chunk (256 KiB) stays in cache for its three uses


def numpy_stream_probe(arrays: list[np.ndarray], threads: int):
    """p += g, m += g, v += g in place, chunk by chunk (so each array crosses the memory bus once: 28 B/param), on
    ``threads`` Python threads over disjoint ranges (numpy releases the GIL inside each add)."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="numpy-stream")  # idle workers block, never spin

    def call(arrays):
        p, g, m, v = arrays
        n = p.size
        per = -(-n // threads // NUMPY_CHUNK) * NUMPY_CHUNK

        def part(lo):
            hi = min(n, lo + per)
            for s in range(lo, hi, NUMPY_CHUNK):
                e = min(hi, s + NUMPY_CHUNK)
                gs = g[s:e]
                np.add(p[s:e], gs, out=p[s:e])
                np.add(m[s:e], gs, out=m[s:e])
                np.add(v[s:e], gs, out=v[s:e])

        for f in [pool.submit(part, lo) for lo in range(0, n, per)]:
            f.result()

    small = probe_arrays(2 * threads * NUMPY_CHUNK)  # a chunk or two for every thread
    return lambda: call(arrays), lambda: arrays, lambda: call(small)


def crc32c_rates(rounds: int, calls: int = 16) -> dict[str, float | str]:
    """GB/s of each CRC-32C implementation on a 4 MiB page (the median over ``rounds`` interleaved rounds, each a
    fresh process per implementation), or why it did not run (the CPU lacks it)."""
    code = _CRC_PROBE.format(page_bytes=CRC_PAGE_BYTES, calls=calls)
    seconds: dict[str, list[float]] = {}
    missing: dict[str, str] = {}
    for _ in range(rounds):
        for isa in CRC_ISAS:
            if isa in missing:
                continue
            env = {**os.environ, "NSP_CRC32C_ISA": isa}
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                lines = proc.stderr.strip().splitlines()
                missing[isa] = lines[-1] if lines else f"exited {proc.returncode}"
                continue
            seconds.setdefault(isa, []).append(float(proc.stdout.strip()))
    return {isa: (CRC_PAGE_BYTES / median(seconds[isa]) / 1e9 if isa in seconds else missing[isa])
            for isa in CRC_ISAS}


def parse_groups(text: str) -> set[str]:
    groups = set(CONTENDER_GROUPS) if text == "all" else {g.strip() for g in text.split(",") if g.strip()}
    unknown = groups - set(CONTENDER_GROUPS)
    if unknown or not groups:
        raise ValueError(f"--contenders: unknown {sorted(unknown) or 'empty list'}; choose from "
                         f"{', '.join(CONTENDER_GROUPS)} or all")
    return groups


def repeated(fn, calls: int):
    """``fn`` run ``calls`` times back to back: one timed sample."""
    if calls == 1:
        return fn

    def sample():
        for _ in range(calls):
            fn()

    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M", help="parameters (e.g. 64M, 16M, 1000000)")
    parser.add_argument("--threads", type=int, default=2, help="threads for nsp, torch and the roofline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-K density of the compressed contender")
    parser.add_argument("--contenders", default="all",
                        help=f"comma-separated groups to run, of {', '.join(CONTENDER_GROUPS)} (default all)")
    parser.add_argument("--calls", type=int, default=0,
                        help="back-to-back calls per timed sample (default: enough to move 0.5 GB)")
    parser.add_argument("--no-crc", action="store_true", help="skip the page-checksum rates")
    parser.add_argument("--order", choices=("shuffled", "fixed"), default="shuffled",
                        help="contender order in each timed round: drawn afresh (seeded) or always the same")
    parser.add_argument("--warm-call", action=argparse.BooleanOptionalAction, default=True,
                        help="right before each timed sample, the same contender's call on a small state of its own "
                             f"({WARM_ELEMS} params), so that its threads are awake as after a training step's "
                             "backward pass (default on)")
    parser.add_argument("--pre-touch", action=argparse.BooleanOptionalAction, default=True,
                        help="right before each timed sample, after the cache reset, read the contender's own arrays "
                             "once (bench/cache_reset.pre_touch: idle memory is slow to touch again on a virtual "
                             "machine; default on)")
    parser.add_argument("--cache-reset-mib", type=int, default=-1,
                        help="before each timed call, read a buffer of this many MiB of nobody's data, so that the "
                             "previous contender's lines (dirty ones among them) are out of the last-level cache "
                             "(0: off; default: twice the last-level cache)")
    wait_policy.add_arguments(parser)
    page_backing.add_arguments(parser)
    parser.add_argument("--json", default=None, help="where to write the JSON record")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the protocol reports a median of at least 5)")
    try:
        groups = parse_groups(args.contenders)
    except ValueError as e:
        parser.error(str(e))
    if args.calls < 0:
        parser.error("--calls must be >= 1 (or 0: auto)")
    page_backing.apply(args.memory_pages)  # may restart this process, before any array exists
    policy = wait_policy.set_omp_wait_policy(args.omp_wait_policy)  # before torch loads its OpenMP runtime
    n = parse_size(args.size)
    calls = args.calls or max(1, -(-int(SAMPLE_BYTES) // (28 * n)))
    set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    arrays: dict = {}  # per contender, a function listing the arrays it streams (for their pages' record)
    warm: dict = {}  # per contender, its warm-up call: the same work on a small state of its own
    contenders: dict = {}
    k = 0
    if groups & {"nsp", "nsp-variants"}:
        contenders, k = nsp_contenders(n, rng, args.ratio, arrays, variants="nsp-variants" in groups, warm=warm)
    notes = {}
    if "optax" in groups:
        name = "optax.adam (jit, donated)"
        contenders[name], arrays[name], warm[name] = optax_contender(n, rng)
    # One set of host arrays per contender, unless four would not fit in half the RAM (then one shared set).
    share = 4 * 16 * n > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    shared = probe_arrays(n) if share and groups & {"torch", "deepspeed", "probes"} else []

    def host_arrays():
        return shared or probe_arrays(n)

    host = {TORCH: lambda: torch_contender(host_arrays(), args.threads),
            DS: lambda: deepspeed_contender(host_arrays(), args.threads)}
    for name, group in ((TORCH, "torch"), (DS, "deepspeed")):
        if group in groups:
            fn, note, streams, warm_fn = host[name]()
            notes[name] = note
            if fn is not None:
                contenders[name], arrays[name], warm[name] = fn, streams, warm_fn
    if "probes" in groups:
        contenders[NSP_PROBE], arrays[NSP_PROBE], warm[NSP_PROBE] = nsp_stream_probe(host_arrays())
        contenders[NUMPY_PROBE], arrays[NUMPY_PROBE], warm[NUMPY_PROBE] = numpy_stream_probe(host_arrays(),
                                                                                            args.threads)
    timed = {name: repeated(fn, calls) for name, fn in contenders.items()}
    # nsp dense fp32's time inside the kernel, per timed sample (nsp.primitives.kernel_time): its jitted call's
    # time less the dispatch around it, judged against the same probes.
    inside: list[float] = []
    if NSP in timed:
        whole = timed[NSP]

        def nsp_dense_timed():
            _, s0 = kernel_time()
            whole()
            inside.append(kernel_time()[1] - s0)

        timed[NSP] = nsp_dense_timed

    print(f"fp32 Adam update of {n / 2**20:.0f}M params, {args.threads} threads, kernel ISA {kernel_isa()}, "
          f"median of {args.repeats} interleaved rounds of {calls} call(s) each, OMP_WAIT_POLICY={policy}, "
          f"{args.pause:g} s pause between contenders")
    idle_cpu: dict[str, list[float]] = {}
    reset_mib = args.cache_reset_mib if args.cache_reset_mib >= 0 else 2 * cache_reset.llc_mib()
    reset = cache_reset.CacheReset(reset_mib) if reset_mib else None
    before = {name: cache_reset.before_call(reset, warm[name] if args.warm_call else None,
                                arrays[name] if args.pre_touch else None) for name in timed}
    orders: list[list[str]] = []
    samples = time_interleaved(timed, repeats=args.repeats, warmup=2, pause=args.pause, idle_cpu=idle_cpu,
                               before=before, orders=orders,
                               shuffle_seed=0 if args.order == "shuffled" else None)
    times = {name: [t / calls for t in ts] for name, ts in samples.items()}
    med = {name: median(ts) for name, ts in times.items()}
    inside = inside[-args.repeats:]  # the timed rounds (the warm-up calls ran first)
    kernel_only = [t / calls for t in inside]
    huge = {name: page_backing.huge_share(arrays[name]()) for name in contenders}
    bytes_per_param = {
        "nsp dense fp32": 28.0,
        "nsp bf16 grads": 26.0,
        f"nsp top-k {args.ratio:.0%}": 24.0 + 8.0 * k / n,
    }
    # The memory roofline: the best of the streaming probes (each moves 28 B/param). The pure probes (streaming
    # loops with no Adam in them) are the target's reference; the Adam contenders join them as the upper bound.
    probes = {name: n * 28.0 / med[name] / 1e9 for name in ROOFLINE_PROBES if name in med}
    best_probe = max(probes, key=probes.get) if probes else None
    pure = [name for name in (NSP_PROBE, NUMPY_PROBE) if name in med]
    best_pure = min(pure, key=med.get) if pure else None
    roofline_gbs = probes[best_probe] if best_probe else None
    ref = med.get("nsp dense fp32")
    rows = []
    for name, t in med.items():
        bpp = bytes_per_param.get(name, 28.0)
        rows.append({
            "contender": name,
            "ms": t * 1e3,
            "gparams": n / t / 1e9,
            "bpp": f"{bpp:g}",
            "gbs": n * bpp / t / 1e9,
            "vs_nsp": ref / t if ref else None,
            "roof": "best probe" if name == best_probe else ("probe" if name in probes else ""),
            "idle": median(idle_cpu[name]) * 1e3 if idle_cpu.get(name) else None,
            "huge": huge[name] * 100,
        })
    for name, note in notes.items():
        if name not in med:
            rows.append({"contender": f"{name}: {note}"})
    print_table(
        "Adam update throughput",
        rows,
        [("contender", "contender", ""), ("ms", "median ms", ".2f"), ("gparams", "Gparam/s", ".3f"),
         ("bpp", "B/param", ""), ("gbs", "GB/s moved", ".1f"), ("vs_nsp", "speed vs nsp dense", ".2f"),
         ("roof", "roofline", ""), ("idle", "CPU ms in pause", ".1f"), ("huge", "% on huge pages", ".0f")],
    )
    if kernel_only and best_pure:
        paired = median([p / k for p, k in zip(times[best_pure], kernel_only)])
        print(f"\n  nsp dense fp32 inside the kernel (nsp.primitives.kernel_time): "
              f"{median(kernel_only) * 1e3:.2f} ms of "
              f"the call's {ref * 1e3:.2f} ms; {paired:.3f} of the best pure probe's speed (per round)")
    nsp_pct = n * 28.0 / ref / 1e9 / roofline_gbs * 100 if ref and roofline_gbs else None
    above = []
    if nsp_pct is not None:
        print(f"\n  memory roofline = the best of {len(probes)} streaming probes: {roofline_gbs:.1f} GB/s "
              f"({best_probe}); nsp dense fp32 moves {n * 28.0 / ref / 1e9:.1f} GB/s = {nsp_pct:.1f}% of it")
        above = [name for name in med if name not in probes
                 and n * bytes_per_param.get(name, 28.0) / med[name] / 1e9 > roofline_gbs]
        if above:
            print(f"  note: {', '.join(above)} moved more GB/s than the best probe: the probes understate the memory "
                  f"roofline in this run")
    print(f"  CPU ms in pause: CPU time this process used in the {args.pause:g} s after the contender's sample "
          f"(threads still running); {wait_policy.NSP_POOL_NOTE}")
    print(f"  memory pages: --memory-pages {args.memory_pages} (THP mode {page_backing.thp_mode()}, GLIBC_TUNABLES="
          f"{os.environ.get('GLIBC_TUNABLES', '') or '(unset)'}); % on huge pages: the share of each contender's "
          f"streamed bytes on 2 MiB pages, from /proc/self/smaps")

    checks = []

    def ratio_line(label, num, den, target):
        if num in med and den in med:
            r = med[den] / med[num]
            checks.append({"check": label, "ratio": r, "target": target, "met": r >= target})
            print(f"  {label}: {r:.2f}x (target >= {target:.2f}x) {'ok' if r >= target else 'MISSED'}")

    print("\nTargets (this run; bench/kernel_sweep.py judges them on the median of several runs)")
    ratio_line("nsp dense vs DeepSpeedCPUAdam", "nsp dense fp32", DS, 1.05)
    ratio_line("nsp dense vs torch fused Adam", "nsp dense fp32", TORCH, 1.05)
    if best_pure:
        ratio_line("nsp dense vs best pure streaming probe", "nsp dense fp32", best_pure, 0.95)
    ratio_line("nsp bf16 grads vs torch fused Adam (fp32)", "nsp bf16 grads", TORCH, 1.05)
    ratio_line(f"nsp top-k {args.ratio:.0%} vs torch fused dense", f"nsp top-k {args.ratio:.0%}", TORCH, 1.15)
    ratio_line("nsp eager vs nsp jitted", EAGER, "nsp dense fp32", 0.5)
    ratio_line("nsp bf16 grads vs nsp fp32 grads", "nsp bf16 grads", "nsp dense fp32", 1.05)
    ratio_line("nsp dense vs optax.adam", "nsp dense fp32", "optax.adam (jit, donated)", 1.0)

    crc = {}
    if not args.no_crc:
        crc = crc32c_rates(args.repeats)
        print(f"\nPage checksum: CRC-32C of a {CRC_PAGE_BYTES >> 20} MiB page, GB/s (median of {args.repeats} "
              f"interleaved rounds, a process per implementation)")
        for isa, rate in crc.items():
            print(f"  {isa:16s} " + (f"{rate:6.1f}" if isinstance(rate, float) else f"not run: {rate}"))
    path = write_json(
        "update_kernel",
        {"size": n, "threads": args.threads, "repeats": args.repeats, "calls_per_sample": calls,
         "isa": kernel_isa(), "contender_groups": sorted(groups), "shared_host_arrays": share,
         "order": args.order, "orders": orders, "cache_reset_mib": reset_mib, "warm_call": args.warm_call,
         "pre_touch": args.pre_touch,
         "warm_call_params": WARM_ELEMS if args.warm_call else 0,
         "times_s": times, "median_s": med, "nsp_dense_inside_kernel_s": kernel_only, "notes": notes, "checks": checks,
         "bytes_per_param": {name: bytes_per_param.get(name, 28.0) for name in med},
         "roofline_probes_gbs": probes, "roofline_probe": best_probe, "roofline_gbs": roofline_gbs,
         "best_pure_probe": best_pure,
         "nsp_dense_pct_of_roofline": nsp_pct, "faster_than_roofline": above,
         **({"crc32c_page_bytes": CRC_PAGE_BYTES, "crc32c_gbps": crc} if crc else {}),
         **wait_policy.record(policy, args.pause, idle_cpu), **page_backing.record(args.memory_pages, huge)},
        args.json,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
