"""``nsp launch -n N -- CMD ...``: N local processes of one run, for tests and trials on one machine.

Each process gets ``JAX_COORDINATOR_ADDRESS`` (loopback, a free port), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` (what ``nsp.distributed.initialize`` reads) and its share of the CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``). Output lines are prefixed with ``[i]``. Ctrl-C (and
SIGTERM) is forwarded to every process; when one fails the others get ``GRACE_S`` seconds to stop on their own
(their watchdogs end them within the heartbeat bound) before they are killed. The exit status is the first
failed process's, or 0. Not a cluster scheduler: on a cluster, start one process per host with its scheduler.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 30.0  # after a process fails, how long the others may take to stop on their own


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def launch(command: list[str], num_processes: int, devices_per_process: int = 1, *,
           grace_s: float = GRACE_S, env: dict | None = None) -> int:
    """Runs ``command`` as ``num_processes`` processes of one run; returns the exit status (see the module)."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("need at least one process and one device per process")
    if not command:
        raise ValueError("no command to launch")
    address = f"127.0.0.1:{free_port()}"
    procs = []
    base = dict(os.environ if env is None else env)
    for i in range(num_processes):
        penv = dict(base, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(num_processes),
                    JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        flags = [f for f in penv.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        penv["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
        procs.append(subprocess.Popen(command, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    pumps = [threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", sys.stdout), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first_failure: tuple[int, int] | None = None
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                rc = p.poll()
                if rc not in (None, 0) and first_failure is None:
                    first_failure, failed_at = (i, rc), time.monotonic()
                    sys.stderr.write(f"nsp launch: process {i} failed ({_describe(rc)}); the others get "
                                     f"{grace_s:g} s to stop\n")
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        sys.stderr.write(f"nsp launch: killing process {i}\n")
                        os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in pumps:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    if first_failure is None:
        bad = [(i, rc) for i, rc in enumerate(codes) if rc != 0]
        first_failure = bad[0] if bad else None
    if first_failure is None:
        return 0
    i, rc = first_failure
    sys.stderr.write(f"nsp launch: failed: process {i} ({_describe(rc)}); exit statuses {codes}\n")
    return rc if rc > 0 else 128 - rc
