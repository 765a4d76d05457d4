"""Stopping a multi-process run on one process's failure, with that failure's message on every process.

A process whose own storage or step fails (a full disk, an I/O error) says so itself: what failed, what was kept,
how to go on. Its peers know nothing of it: they wait in their next collective until its exit breaks the
connections, or until its heartbeats stop, and would then say only that it stopped answering. So the process
that stops ``announce``s its message in the coordination service's key-value store (``nsp/stopped/P``) before it
leaves; every other process's ``PeerWatchdog`` looks for such a record at each poll (once a second), and a
process whose collective failed looks before it blames a lost peer (``announced``): each ends with the stopping
process's message, naming it (``peer_stopped_message``), and its own exit status.

``leave`` ends a process at once (``os._exit``: a normal exit would wait in the runtime's shutdown for peers
that are gone), with one message however many threads get there; process 0, the coordination service's host,
first waits until the others left (``LEAVE_WAIT_S`` at most), since the service going away under a live process
makes JAX's client abort it before it could say why. ``begin`` marks a process that is stopping on a failure of
its own: its watchdog then leaves the message to it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from nsp.distributed.coordination import client

STOPPED = "nsp/stopped/"  # + the process index: the message of a process that stopped the run
LEFT = "nsp/left/"  # + the process index: set by each process as it leaves after a stop
LEAVE_WAIT_S = 10.0  # how long process 0 waits for the others to leave before it takes the service down

_LEAVING = threading.Lock()  # held by the thread that leaves: one message, one exit
_STOPPING = threading.Event()  # this process stops on a failure of its own (begin)


def begin() -> None:
    """Marks this process as stopping on a failure of its own: its watchdog leaves the message to it (a peer's
    announcement is not what this process reports)."""
    _STOPPING.set()


def stopping() -> bool:
    return _STOPPING.is_set()


def leaving() -> bool:
    """Whether some thread of this process is leaving (``leave``): it has said why."""
    return _LEAVING.locked()


def announce(message: str) -> None:
    """Records in the coordination service that this process stops the run, and why (``message``, what it
    prints). A no-op alone or once the runtime is gone."""
    begin()
    c = client()
    if c is None:
        return
    try:
        c.key_value_set(f"{STOPPED}{jax.process_index()}", message)
    except Exception:  # noqa: BLE001  (the service is gone: the peers learn of this process's end anyway)
        pass


def announced(c=None) -> tuple[int, str] | None:
    """``(process, message)`` of the lowest other process that announced its stop, or None."""
    c = c if c is not None else client()
    if c is None:
        return None
    me = jax.process_index()
    found = []
    for key, value in c.key_value_dir_get(STOPPED):
        index = key.rstrip("/").rsplit("/", 1)[-1]
        if index.isdigit() and int(index) != me:
            found.append((int(index), value))
    return min(found) if found else None


def peer_stopped_message(process_index: int, peer: int, message: str) -> str:
    """What a process prints that stops because process ``peer`` stopped the run with ``message``."""
    said = "\n".join(f"  {line}" for line in message.strip().splitlines())
    return f"nsp: error: process {process_index}: stopping, because process {peer} stopped the run:\n{said}"


def leave(message: str | None, status: int) -> None:
    """Prints ``message`` (to stderr; None: nothing) and ends this process at once with ``status``; see the
    module. The first thread to get here is the one that leaves: any other waits here until the process is gone."""
    _LEAVING.acquire()
    try:
        try:  # an output nobody reads any more (a closed pipe) must not keep the process alive
            sys.stdout.flush()
            if message is not None:
                print(message, file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001
            pass
        c = client()
        if c is not None:
            me, n = jax.process_index(), jax.process_count()
            c.key_value_set(f"{LEFT}{me}", "")
            if me == 0:
                _wait_for_the_others(c, n)
    except Exception:  # noqa: BLE001  (the service is gone: there is nobody to wait for)
        pass
    finally:
        os._exit(status)


def _wait_for_the_others(c, n: int) -> None:
    """Waits until every other process left (its ``LEFT`` key) or is dead, ``LEAVE_WAIT_S`` at most. The
    service's verdict of dead counts only while it holds this process alive (after a step of its host's wall
    clock it takes every process for dead: see ``watchdog.py``)."""
    others = set(range(1, n))
    deadline = time.monotonic() + LEAVE_WAIT_S
    while others and time.monotonic() < deadline:
        left = {int(k.rstrip("/").rsplit("/", 1)[-1]) for k, _ in c.key_value_dir_get(LEFT)}
        others -= left
        if others:
            live = set(c.get_live_nodes(list(range(n))))
            if 0 in live:
                others &= live
            time.sleep(0.05)
    time.sleep(0.2)  # a process that set its key exits right after it


def stop_run(message: str, status: int) -> None:
    """In a multi-process run: announces ``message`` (this process's failure, printed already) to the others and
    ends the process with ``status`` (no return). Alone, or once the runtime was left (every process already
    stopped together), returns at once."""
    if client() is None:
        return
    announce(message)
    leave(None, status)
