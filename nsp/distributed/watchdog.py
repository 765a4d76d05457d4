"""Ending a process whose peers stopped answering, with a message instead of a hang or an abort.

JAX's coordination service tracks each process by heartbeats. With ``jax_enable_recoverability`` it marks a
silent process dead instead of aborting all the others; ``PeerWatchdog`` asks it which processes live (once a
second) and, when one is gone or the service itself cannot be reached, prints which and exits with
``PEER_LOST_EXIT``. A collective waiting for a dead peer never returns; this thread is what ends it. A peer that
stopped the run on a failure of its own announced why (``stop.py``): the watchdog then ends this process with
that peer's message (``PEER_STOPPED_EXIT``), at its next poll.
"""

from __future__ import annotations

import threading

from nsp.distributed import stop

PEER_LOST_EXIT = 75  # exit status of a process whose peer died (EX_TEMPFAIL: resume the run with --resume)
PEER_STOPPED_EXIT = 1  # exit status of a process whose peer stopped the run on a failure (the peer's message says)
POLL_S = 1.0


class PeerWatchdog(threading.Thread):
    """Polls the coordination service's live processes; ends this process when one is missing."""

    def __init__(self, client, process_index: int, process_count: int, heartbeat_timeout_s: float):
        super().__init__(name="nsp-peer-watchdog", daemon=True)
        self._client = client
        self._me = process_index
        self._all = list(range(process_count))
        self._timeout = heartbeat_timeout_s
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                if not stop.stopping():  # a process stopping on its own failure says so itself
                    peer = stop.announced(self._client)
                    if peer is not None and not self._stopped.is_set():
                        stop.leave(stop.peer_stopped_message(self._me, *peer), PEER_STOPPED_EXIT)
                live = self._client.get_live_nodes(self._all)
            except Exception as e:  # noqa: BLE001  (the service is gone: process 0 died or the network broke)
                if self._stopped.is_set():
                    return
                self._die(f"lost the coordination service (process 0 or the network): {str(e).splitlines()[0]}")
            missing = [p for p in self._all if p not in live]
            if missing and not self._stopped.is_set():
                self._die(f"process(es) {missing} stopped answering for {self._timeout:g} s (died or hung)")

    def _die(self, why: str) -> None:
        exit_peer_lost(self._me, why)


def exit_peer_lost(process_index: int, why: str) -> None:
    """Prints why this process stops (a peer or the service is gone) and exits with ``PEER_LOST_EXIT`` at once:
    a normal exit would wait, in the runtime's shutdown, for the peer that is gone. A peer that announced why it
    stopped (``stop.py``) is named with its message instead."""
    try:
        peer = stop.announced()
    except Exception:  # noqa: BLE001  (the service is gone: no peer can be asked)
        peer = None
    if peer is not None:
        stop.leave(stop.peer_stopped_message(process_index, *peer), PEER_STOPPED_EXIT)
    stop.leave(peer_lost_message(process_index, why), PEER_LOST_EXIT)


def peer_lost_message(process_index: int, why: str) -> str:
    """What a process that stops because a peer or the service is gone prints (one line)."""
    return (f"nsp: error: process {process_index}: {why}; stopping. The last checkpoint is intact: rerun the same "
            "command with --resume")
