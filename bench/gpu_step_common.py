"""bench/gpu_step.py's shared pieces: the progress log (``log``, timed from the script's start), the contenders'
names and the benchmark's settings, how an error is recorded, ``import nsp`` (its failure recorded, not raised), the
device's memories, and the model and optimizers every contender steps.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO  # noqa: E402

NAME = "gpu_step"
FWD_BWD = "forward/backward"
OPTAX_HBM = "optax.adamw (HBM)"
OPTAX_PINNED = "optax.adamw (pinned_host)"
REFERENCE = "nsp memory, s1, dense"  # the headline nsp contender: the targets are judged on it
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
TOPK_RATIO = 0.01
CHECK_TOLERANCE = 1e-6  # relative, when the kernel ISA is not "portable" (there: bit for bit)
HIDE_TARGET, HBM_RATIO_TARGET = 0.80, 1.20
STATE_BYTES_PER_PARAM = 24  # an nsp store: p, m, v in fp32, two version slots
# What is left out first when the whole set does not fit the time left (the rest is the core set).
OPTIONAL_ORDER = ("nsp file, s1, Top-K 1%", "nsp file, s0, Top-K 1%", "nsp file, s1, dense", "nsp file, s0, dense",
                  "nsp memory, s1, Top-K 1%", "nsp memory, s0, Top-K 1%")


def nsp_name(tier: str, staleness: int, topk: bool) -> str:
    return f"nsp {tier}, s{staleness}, {'Top-K 1%' if topk else 'dense'}"


NSP_VARIANTS = [(tier, staleness, topk) for tier in ("memory", "file") for topk in (False, True)
                for staleness in (0, 1)]
CONTENDERS = [FWD_BWD, OPTAX_HBM, OPTAX_PINNED] + [nsp_name(*v) for v in NSP_VARIANTS]


def short_error(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
    return text if len(text) <= limit else text[:limit] + " ..."


def failed(e: BaseException) -> str:
    return "failed: " + short_error(e)


# ---- nsp ------------------------------------------------------------------------------------------------------

try:
    import nsp  # noqa: F401
    import nsp.optim
    import nsp.primitives
    import nsp.storage
    from flax import nnx
    from nsp.models import GPT, get_config
    from nsp.train.trainer import loss_fn, make_train_step  # noqa: F401  (the contenders' and the check's)

    NSP_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (the record says so; nothing else can run)
    NSP_IMPORT_ERROR = e
    traceback.print_exc()
    nsp = loss_fn = make_train_step = None  # what the other parts import by name; main stops before using them


def nsp_info() -> dict[str, Any]:
    if NSP_IMPORT_ERROR is not None:
        return {"import": failed(NSP_IMPORT_ERROR)}
    out: dict[str, Any] = {"import": "ok"}
    here = os.path.dirname(os.path.abspath(nsp.__file__))
    out["installed_from_this_tree"] = os.path.realpath(here).startswith(os.path.realpath(str(REPO)))
    for key, fn in (("kernel_isa", nsp.primitives.kernel_isa), ("num_threads", nsp.primitives.get_num_threads),
                    ("engine_cpus", nsp.primitives.engine_cpus)):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001
            out[key] = failed(e)
    try:
        import importlib.metadata

        out["version"] = importlib.metadata.version("nsp")
    except Exception:  # noqa: BLE001
        out["version"] = None
    return out


# ---- the device -----------------------------------------------------------------------------------------------

def memory_kinds(device) -> list[str]:
    try:
        return [m.kind for m in device.addressable_memories()]
    except Exception:  # noqa: BLE001
        return []


def device_kind_name(device) -> str:
    """The device's own memory kind (``"device"`` on a GPU; XLA:CPU names it too)."""
    try:
        return device.default_memory().kind
    except Exception:  # noqa: BLE001
        return "device"


def shardings(device):
    """(device-memory sharding, pinned_host sharding) of a one-device mesh over ``device``, as MaxText builds them."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array([device]), ("data",))
    return (NamedSharding(mesh, P(), memory_kind=device_kind_name(device)),
            NamedSharding(mesh, P(), memory_kind="pinned_host"))


def device_memory(device) -> dict[str, Any] | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not stats:
        return None
    return {k: stats[k] for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size")
            if k in stats}


def host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---- the model ------------------------------------------------------------------------------------------------

def model_config(name: str, seq: int):
    cfg = get_config(name)
    return cfg if cfg.block_size >= seq else get_config(name, block_size=seq)


def host_model(name: str, seq: int):
    """(graphdef, params as numpy arrays, config): the same model for every contender, built on the CPU."""
    cfg = model_config(name, seq)
    with jax.default_device(jax.devices("cpu")[0]):
        graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        params = jax.tree_util.tree_map(np.asarray, params)
    return graphdef, params, cfg


def n_params_of(params) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def optax_tx():
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WEIGHT_DECAY))


def nsp_tx(store, staleness: int, topk: bool):
    compression = nsp.optim.TopK(TOPK_RATIO) if topk else None
    return optax.chain(optax.clip_by_global_norm(CLIP),
                       nsp.optim.adamw(LR, weight_decay=WEIGHT_DECAY, store=store, compression=compression,
                                       staleness=staleness))


