"""Multi-process runs on JAX's own distributed runtime: one process per host, one store shard per device.

``coordination`` holds the coordination service's client, its barriers and ``DistributedError``; on it,
``runtime`` joins the run (``jax.distributed.initialize``) and lays every process's devices out in one mesh, and
``agree`` makes the processes agree on the committed version, on the checkpoint steps each holds and on
failures; ``watchdog`` ends a process whose peer died, and ``stop`` one whose peer stopped the run on a failure
of its own (with that peer's message); ``local_restore`` rebuilds a process's own shards from its
part of a checkpoint (``nsp.storage``'s restore); ``launch`` starts N local processes (``nsp launch``).
"""

from nsp.distributed.agree import Unanswered, agree_committed, agree_steps, agree_version, all_succeed, barrier
from nsp.distributed.runtime import (DistributedError, finish, global_devices, initialize, is_multiprocess,
                                     local_shards)
from nsp.distributed import stop
from nsp.distributed.watchdog import CLOCK, PEER_LOST_EXIT, PEER_STOPPED_EXIT

__all__ = ["CLOCK", "DistributedError", "PEER_LOST_EXIT", "PEER_STOPPED_EXIT", "Unanswered", "agree_committed",
           "agree_steps", "agree_version", "all_succeed", "barrier", "finish", "global_devices", "initialize",
           "is_multiprocess", "local_shards", "stop"]
