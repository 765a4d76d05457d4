"""Ending a process whose peers stopped answering, with a message instead of a hang or an abort.

JAX's coordination service tracks each process by heartbeats. With ``jax_enable_recoverability`` it marks a
silent process dead instead of aborting all the others; ``PeerWatchdog`` asks it which processes live (once a
second) and, when one is gone or the service itself cannot be reached, prints which and exits with
``PEER_LOST_EXIT``. A collective waiting for a dead peer never returns; this thread is what ends it. A peer that
stopped the run on a failure of its own announced why (``stop.py``): the watchdog then ends this process with
that peer's message (``PEER_STOPPED_EXIT``), at its next poll.

The service times heartbeats by the wall clock of its host (process 0's), not a monotonic one: a step of that
clock by more than the heartbeat timeout, forward or back (a clock set by hand, an NTP step after a suspend), reads
to it as every process having gone silent, and it marks them all dead, this process too. The runtime cannot go on
from there (its barriers and key-value store refuse a dead process), so the run stops; the watchdog tells that
case (this process itself among the lost, though it runs) from a dead peer, and says when this host's wall clock
jumped just before (``CLOCK_STEP_S``: it compares the wall clock with the monotonic one at every poll). Steps
smaller than the heartbeat timeout pass unnoticed (nsp itself times everything by the monotonic clock).
"""

from __future__ import annotations

import threading
import time

from nsp.distributed import stop

PEER_LOST_EXIT = 75  # exit status of a process whose peer died (EX_TEMPFAIL: resume the run with --resume)
PEER_STOPPED_EXIT = 1  # exit status of a process whose peer stopped the run on a failure (the peer's message says)
POLL_S = 1.0
CLOCK_STEP_S = 1.0  # the wall clock moved this much more (or less) than the monotonic one between two polls: a step
CLOCK_STEP_RECENT_S = 30.0  # a step seen this recently explains a run that stops
_CLOCK_WHY = ("JAX's distributed runtime times its heartbeats and barriers by the wall clock of process 0's host: a "
              "step of that clock by more than the heartbeat timeout, forward or back, reads to it as every "
              "process's death, and the run cannot go on")


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
            CLOCK.sample()
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
                self._die(self._why_lost(missing))

    def _why_lost(self, missing: list[int]) -> str:
        if self._me not in missing:
            return f"process(es) {missing} stopped answering for {self._timeout:g} s (died or hung)"
        # The service lost this process too, which runs: its judgement went wrong, not the processes.
        return (f"JAX's coordination service took process(es) {missing} for dead, this one too, though it runs: "
                + _CLOCK_WHY + " (or the service stalled that long)")

    def _die(self, why: str) -> None:
        exit_peer_lost(self._me, why)


class ClockWatch:
    """Steps of this host's wall clock, seen by comparing it with the monotonic clock at each ``sample`` (the
    watchdog's polls; anyone may sample more often): between two samples the two move alike but for a step (NTP
    slews the wall clock by 0.5 ms a second at most)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._skew = _skew()
        self._step: tuple[float, float] | None = None  # the last step: (seconds, monotonic time it was seen)

    def sample(self) -> None:
        with self._lock:
            skew = _skew()
            if abs(skew - self._skew) > CLOCK_STEP_S:
                self._step = (skew - self._skew, time.monotonic())
            self._skew = skew

    def step(self, within_s: float) -> float | None:
        """The wall clock's last step (seconds, signed) when it was seen within the last ``within_s`` seconds
        (this call samples first), else None."""
        self.sample()
        with self._lock:
            if self._step is not None and time.monotonic() - self._step[1] <= within_s:
                return self._step[0]
        return None


def _skew() -> float:
    return time.time() - time.monotonic()  # the wall clock less the monotonic one: constant but for steps


CLOCK = ClockWatch()


def duration(seconds: float) -> str:
    """``+3 h 0 min 0 s``, ``-12.0 s``: a signed span, for a person."""
    sign, left = ("+" if seconds >= 0 else "-"), abs(seconds)
    if left < 60:
        return f"{sign}{left:.1f} s"
    h, rest = divmod(int(round(left)), 3600)
    m, s = divmod(rest, 60)
    return sign + (f"{h} h {m} min {s} s" if h else f"{m} min {s} s")


def exit_peer_lost(process_index: int, why: str) -> None:
    """Prints why this process stops (a peer or the service is gone) and exits with ``PEER_LOST_EXIT`` at once:
    a normal exit would wait, in the runtime's shutdown, for the peer that is gone. A peer that announced why it
    stopped (``stop.py``) is named with its message instead; a step of this host's wall clock just before is said
    to be the cause (see the module)."""
    step = CLOCK.step(within_s=CLOCK_STEP_RECENT_S)
    if step is not None:
        why = f"this host's wall clock jumped by {duration(step)}, and " + _CLOCK_WHY
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
