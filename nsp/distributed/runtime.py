"""Joining JAX's distributed runtime: one process per host, every host's devices in one mesh.

``initialize`` calls ``jax.distributed.initialize`` when the process is one of several: explicit arguments (``nsp
train --coordinator ADDR:PORT --num-processes N --process-id I``), the ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables (what ``nsp launch`` sets), or a cluster JAX detects itself
(SLURM, Open MPI, Kubernetes). A lone process with none of these is left exactly as it was: no runtime, no
watchdog. Once joined, a ``PeerWatchdog`` (``watchdog.py``) ends the process with a clear message when a peer
stops answering, and on every process but 0 an abort guard does the same when process 0's coordination service
goes away (JAX's client would otherwise end the process with a bare SIGABRT before Python could say why).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import jax

from nsp.distributed.coordination import DistributedError, barrier, client, service_client
from nsp.distributed.watchdog import PEER_LOST_EXIT, PeerWatchdog, peer_lost_message

__all__ = ["DistributedError", "client", "finish", "global_devices", "initialize", "is_multiprocess",
           "local_shards"]

HEARTBEAT_TIMEOUT_S = 10  # a peer silent this long is dead (JAX's own default is 100 s)
INIT_TIMEOUT_S = 120  # every process must have joined within this long
GUARD_PROBE_MS = 2000  # how long the abort guard waits for the coordination service to accept a connection
INIT_FAILED_EXIT = 2  # a process that could not join the run (nothing answered at its coordinator)

_WATCHDOG: PeerWatchdog | None = None


def _cluster_detected() -> bool:
    """Whether the environment names a multi-process job that ``jax.distributed.initialize()`` can read."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1")) or 1) > 1:
        return True
    if env.get("OMPI_MCA_orte_hnp_uri") and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    return bool(env.get("KUBERNETES_SERVICE_HOST") and env.get("JOB_COMPLETION_INDEX") is not None)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, init_timeout_s: int = INIT_TIMEOUT_S, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
    """Joins the run's other processes, when there are any; returns whether this process is one of several.

    Args:
      coordinator: ``host:port`` of process 0's coordination service (else ``JAX_COORDINATOR_ADDRESS``, else what
        JAX detects).
      num_processes, process_id: the run's process count and this process's index (else ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID``, else detected).
      init_timeout_s: how long to wait for every process to join; past it this raises ``DistributedError``.
      heartbeat_timeout_s: a peer silent this long counts as dead: the watchdog then ends this process (exit
        status ``watchdog.PEER_LOST_EXIT``) with a message naming it, so the run stops within about this bound.

    Idempotent. Must run before anything touches JAX's devices.
    """
    global _WATCHDOG
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None and process_id is None and not _cluster_detected():
        return False
    if num_processes == 1 and coordinator is None:
        return False
    # A dead peer is reported by our watchdog (a clear message, a chosen exit status) rather than by the
    # coordination service aborting every other process: the service only marks it dead.
    jax.config.update("jax_enable_recoverability", True)
    cannot_join = (f"process {process_id if process_id is not None else '?'} could not join the run at "
                   f"{coordinator or '(detected coordinator)'} within {init_timeout_s} s (a process never started, "
                   "crashed before joining, or the address is wrong)")
    # JAX's client does not raise when nothing answers at the coordinator's address: past the timeout it aborts
    # the process (SIGABRT, after a C++ stack trace). So a process that is not the service's host first waits for
    # the address to accept a connection, and says so itself when nothing does; the abort guard covers the rest
    # (the service going away during the join: this message, INIT_FAILED_EXIT, after JAX's own lines).
    deadline = time.monotonic() + init_timeout_s
    if coordinator is not None and process_id:
        if not _wait_for_service(coordinator, deadline):
            raise DistributedError(f"{cannot_join}: nothing answers at {coordinator}")
    if coordinator is not None:
        _install_abort_guard(coordinator, f"nsp: error: {cannot_join}: nothing answers at {coordinator}\n",
                             INIT_FAILED_EXIT)
    try:
        init_timeout_s = max(1, int(deadline - time.monotonic()))  # the whole join within the one bound
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=init_timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    except Exception as e:  # noqa: BLE001  (jaxlib raises its own runtime error types)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"{cannot_join}: {first}") from None
    finally:
        if coordinator is not None:
            from nsp import engine

            engine.remove_abort_guard()
    _WATCHDOG = PeerWatchdog(service_client(), jax.process_index(), jax.process_count(), heartbeat_timeout_s)
    _WATCHDOG.start()
    if jax.process_index() != 0:
        _guard_against_service_loss()
    return jax.process_count() > 1


def _guard_against_service_loss() -> None:
    """When process 0 dies, JAX's client aborts this process as soon as it polls the coordination service
    (SIGABRT, "Terminating process because the JAX distributed service detected fatal errors"), often before the
    watchdog or a failed collective can say so. The guard (C++, ffi/util/abort_guard.cc) catches that abort and, only
    when the service's address no longer accepts connections, prints the watchdog's message and exits with
    ``PEER_LOST_EXIT``; any other abort stays an abort."""
    from jax._src import distributed as _distributed

    address = _distributed.global_state.coordinator_address or ""
    why = f"lost the coordination service at {address} (process 0 died, or the network broke)"
    if not _install_abort_guard(address, peer_lost_message(jax.process_index(), why) + "\n", PEER_LOST_EXIT):
        print(f"nsp: cannot resolve the coordinator {address!r}; if process 0 dies, JAX's runtime will abort this "
              "process without nsp's message", file=sys.stderr)


def _wait_for_service(address: str, deadline: float) -> bool:
    """Whether the coordination service at ``address`` (``host:port``) accepts a connection before ``deadline``
    (``time.monotonic``); its host may start after this process. An address that does not resolve: True (JAX's
    join then says what is wrong with it)."""
    host, _, port = address.rpartition(":")
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return True
        except (ValueError, socket.gaierror):
            return True
        except OSError:  # refused, unreachable, timed out: not (yet) there
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def _install_abort_guard(address: str, message: str, exit_code: int) -> bool:
    """Installs the abort guard (``ffi/util/abort_guard.cc``) for the coordination service at ``address``
    (``host:port``): an abort while that address accepts no connection prints ``message`` and exits with
    ``exit_code``. Returns False (no guard: an abort stays JAX's own) when the address does not resolve."""
    from nsp import engine

    host, _, port = address.rpartition(":")
    try:
        numeric = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, ValueError):
        return False
    engine.install_abort_guard(numeric, int(port), GUARD_PROBE_MS, message, exit_code)
    return True


def finish(barrier_timeout_s: int = 600) -> None:
    """Ends this process's part of the run: waits for every process to get here, stops the watchdog (peers
    leaving from now on are expected), and leaves the runtime. A no-op for a lone process."""
    global _WATCHDOG
    if not jax.distributed.is_initialized():
        return
    barrier("nsp-finish", barrier_timeout_s)
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None
    from nsp import engine

    engine.remove_abort_guard()  # the service going away from now on is the run ending, not a loss
    # Process 0 hosts the coordination service: it leaves last, once the others have disconnected (a service
    # that goes away under a disconnecting client aborts that client).
    if jax.process_index() == 0:
        deadline = time.monotonic() + barrier_timeout_s
        others = list(range(1, jax.process_count()))
        while time.monotonic() < deadline:
            try:
                if not set(service_client().get_live_nodes(others)):
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.05)
        # A task counts as gone once its disconnect starts; its ShutdownTask call still needs the service.
        time.sleep(2.0)
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001  (the run's work is done; say so rather than fail)
        print(f"nsp: leaving the distributed runtime: {e}", file=sys.stderr)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def global_devices() -> list:
    """Every process's devices, each process's contiguous and in process order: mesh position ``i`` (and so store
    shard ``i``) lives on the process that owns device ``i``."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def local_shards(num_shards: int, devices: list | None = None) -> tuple[int, ...]:
    """The store shards this process owns: the mesh positions of its addressable devices."""
    devices = global_devices() if devices is None else devices
    if len(devices) != num_shards:
        raise DistributedError(f"{num_shards} store shards for {len(devices)} devices: one shard per device")
    me = jax.process_index()
    return tuple(i for i, d in enumerate(devices) if d.process_index == me)
