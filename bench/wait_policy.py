"""How the benchmarks keep one contender's idle threads off the next contender's cores.

An OpenMP runtime (torch's, DeepSpeedCPUAdam's) lets its threads spin for a while after a parallel region when
OMP_WAIT_POLICY is ACTIVE or unset (libgomp spins up to GOMP_SPINCOUNT iterations before it sleeps). On a
machine with as many cores as threads, whatever runs next shares its cores with those spinning threads. The
interleaved benchmarks therefore set OMP_WAIT_POLICY=PASSIVE (threads sleep as soon as they are idle) before
any OpenMP runtime is loaded, sleep a short pause after each contender's call, and record both.

nsp's own kernel pool (ffi/util/thread_pool.cc) does not spin: its workers block on a condition variable between
tasks, and the caller blocks on another until the last task is done.
"""

from __future__ import annotations

import os
import statistics

POLICIES = ("PASSIVE", "ACTIVE", "unset")
DEFAULT_POLICY = "PASSIVE"
DEFAULT_PAUSE_S = 0.2
NSP_POOL_SPINS = False  # ffi/util/thread_pool.cc: condition-variable waits only
NSP_POOL_NOTE = ("nsp's kernel pool blocks on condition variables between tasks (ffi/util/thread_pool.cc): it does "
                 "not spin")


def openmp_loaded() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (libgomp, libiomp, libomp)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp", "libomp")):
                    found.add(path)
    except OSError:
        pass
    return sorted(found)


def add_arguments(parser) -> None:
    """The options of an interleaved benchmark that keep contenders apart: --omp-wait-policy and --pause."""
    parser.add_argument("--omp-wait-policy", choices=POLICIES, default=None,
                        help="OMP_WAIT_POLICY for torch's and DeepSpeed's OpenMP threads (default: the "
                             "environment's, else PASSIVE)")
    parser.add_argument("--pause", type=float, default=DEFAULT_PAUSE_S,
                        help=f"seconds slept after each contender's call, before the next one "
                             f"(default {DEFAULT_PAUSE_S:g})")


def set_omp_wait_policy(policy: str | None) -> str:
    """Sets OMP_WAIT_POLICY for the OpenMP runtimes loaded later in this process; returns the policy in force.

    ``policy`` is PASSIVE, ACTIVE or "unset" (the variable removed: the runtime's default); None keeps what the
    environment says, else PASSIVE. Raises when an OpenMP runtime is already loaded with another policy: it read
    the variable when it started, so a change now would not take effect and the record would lie.
    """
    if policy is None:
        policy = os.environ.get("OMP_WAIT_POLICY", DEFAULT_POLICY)
    policy = policy if policy == "unset" else policy.upper()
    if policy not in POLICIES:
        raise ValueError(f"OMP_WAIT_POLICY must be one of {POLICIES}, not {policy!r}")
    current = os.environ.get("OMP_WAIT_POLICY", "unset").upper() if "OMP_WAIT_POLICY" in os.environ else "unset"
    loaded = openmp_loaded()
    if loaded and current != policy:
        raise RuntimeError(f"an OpenMP runtime is already loaded ({', '.join(loaded)}) with OMP_WAIT_POLICY="
                           f"{current}; set OMP_WAIT_POLICY={policy} in the environment instead")
    if policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = policy
    return policy


def record(policy: str, pause: float, idle_cpu: dict[str, list[float]] | None = None) -> dict:
    """The JSON fields that say how contenders were kept apart (and how much CPU each left running after it)."""
    out = {"omp_wait_policy": policy, "pause_s": pause, "nsp_pool_spins": NSP_POOL_SPINS,
           "nsp_pool_note": NSP_POOL_NOTE, "openmp_runtimes": openmp_loaded()}
    if idle_cpu:
        out["idle_cpu_s"] = idle_cpu
        out["idle_cpu_s_median"] = {k: statistics.median(v) for k, v in idle_cpu.items() if v}
    return out
