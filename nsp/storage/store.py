"""StateStore: an optimizer's fp32 state in a storage tier, sharded, paged, versioned, updated in place.

A store holds, for a flattened parameter vector cut into equal shards (see ``layout.py``), the fp32 master
params and the optimizer's moments. Each shard has two version slots: an update reads committed version ``t``
from one slot, writes version ``t+1`` into the other through the C++ engine, makes it durable, and only then
commits ``t+1`` (an atomic manifest rename per shard). A crash therefore leaves ``t`` or ``t+1`` whole, and
replaying an update from ``t`` gives the same bytes. A ``memory`` store opened with ``in_place=True`` keeps one
copy instead (both slots name it): updates run in place, in half the RAM, and cannot be replayed.

On disk (``file`` and ``csd`` tiers) every state array of every slot is a zarr v3 array that plain
``tensorstore.open`` reads; ``format.py`` describes the files. Each shard's engine runs on a backend: ``memory`` or
``file``, built in, or a backend library loaded by name (the ``csd`` tier's emulated device, or a vendor's), whose
devices keep the same files in their shard's directory. Every shard knows its store: a shard of another store is
refused at open
(``opening.py``, which also creates new stores and recovers existing ones), and the manifest ties each page's
checksum to its store, shard, state, page and version, so a valid page put in another page's place is reported as
damage. Snapshots, restores and identity changes use only this module's public API.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterator, Sequence
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from nsp.storage.creation import StoreCreation
# METADATA stays importable from here: nsp.storage.store.METADATA names a store's metadata file.
from nsp.storage.format import (METADATA, STATES, TIER_BACKENDS, StoreError, inside, lock_store,  # noqa: F401
                                recorded_path, slot_of, store_metadata)
from nsp.storage.handle import StoreHandle
from nsp.storage.layout import Layout, Leaf
from nsp.storage.lifetime import Lifetime
from nsp.storage.optimizer import OptimizerSpec
from nsp.storage.out_buffers import OutputBuffers
from nsp.storage.update import run_update


class StateStore(StoreCreation):
    """Sharded, paged, versioned optimizer state in one storage tier. Create with ``nsp.storage.open``.

    Its methods by concern: here the lifecycle (locks, close, versions, the handle), reading and statistics;
    creating state (``initialize``, ``initialize_from``, ``restart``, ``attach``, ``load_state``) in
    ``creation.py``; the eager ``update`` in ``update.py``, the Python side of the one door into the engine.
    """

    def __init__(self, root: Path | None, tier: str, num_shards: int, page_bytes: int,
                 shard_paths: list[Path], pages_in_flight: int, checksum: bool, in_place: bool = False,
                 store_id: str | None = None, backend: str | None = None, backend_options: str = "",
                 local_shards: Sequence[int] | None = None, slots: int = 2, redo_window: int = 16):
        self.root = root
        self.store_id = store_id or uuid.uuid4().hex  # whose shards these are (SHARD.json, every manifest)
        self.tier = tier
        # What runs each shard: the tier's own backend, or a backend library by name, opened with these options
        # ("key=value;..."; for csd, nsp.csd.device_options). Options are given at each open, never recorded.
        self.backend = backend or TIER_BACKENDS[tier]
        self.backend_options = backend_options
        self.num_shards = num_shards
        self.page_bytes = page_bytes
        self.shard_paths = shard_paths
        # The shards this process opens, locks, updates and snapshots: all of them, or (one process of several,
        # nsp.distributed) those of its own devices. The others' engines live in the other processes.
        self.local_shards = tuple(range(num_shards)) if local_shards is None else tuple(sorted(local_shards))
        if not self.local_shards or not all(0 <= i < num_shards for i in self.local_shards):
            raise ValueError(f"local_shards must name some of the {num_shards} shards, got {local_shards}")
        self.pages_in_flight = pages_in_flight
        self.checksum = checksum
        self.in_place = in_place  # memory tier only: one copy of the state, updated in place (no replay)
        # file tier: 1 keeps one slot and a redo journal (ffi/engine/redo_journal.h), switching `redo_window`
        # pages in at a time; 2 keeps two version slots
        self.slots = slots
        self.redo_window = redo_window
        self.layout: Layout | None = None
        self.optimizer: OptimizerSpec | None = None
        self._staleness = 0  # how updates run, as initialize was told (StoreHandle.staleness)
        # Where a store rebuilt by nsp.storage.restore.restore_store came from and how its pages got there
        # (snapshot, version, method, file counts); None for any other store.
        self.restore_info: dict | None = None
        self._closed = False
        self._outputs = OutputBuffers()  # the eager update's result arrays, recycled once their holders drop them
        # Engines, handles, locks and threads live in their own object, released by close() or, for a store
        # dropped without close(), by a finalizer that runs only once the steps already dispatched are done.
        self._life = Lifetime(len(self.local_shards))
        weakref.finalize(self, self._life.release_dropped)

    @property
    def _engines(self) -> list[Any]:
        return self._life.engines

    @_engines.setter
    def _engines(self, engines: list[Any]) -> None:
        self._life.engines = engines

    @property
    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._life.pool

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def acquire_locks(self) -> None:
        """Takes the writer locks of the store and of every shard it will write, wherever the shard lives
        (``format.lock_store``); ``close`` drops them. ``nsp.storage.open`` calls it: a second writer is refused."""
        self._life.lock_fds += lock_store(self.root, self.local_shard_paths)

    @property
    def is_partial(self) -> bool:
        """Whether this process holds only some of the shards (one process of several)."""
        return len(self.local_shards) != self.num_shards

    @property
    def local_shard_paths(self) -> list[Path]:
        """The directories of the shards this process holds (``local_shards``; empty for the memory tier)."""
        return [self.shard_paths[i] for i in self.local_shards] if self.shard_paths else []

    def _check_whole(self, what: str) -> None:
        if self.is_partial:
            raise StoreError(f"{what} needs every shard; this process holds shards {list(self.local_shards)} of "
                             f"{self.num_shards} (the others live in the other processes)")

    @property
    def external_shards(self) -> list[Path]:
        """Shards that live outside the store's directory (on another disk, say): a copy of the directory does
        not include them."""
        return [p for p in self.local_shard_paths if self.root is not None and not inside(p, self.root)]

    def close(self) -> None:
        """Waits for the steps already dispatched to this store, then releases its engines, their buffers and
        threads, and its locks. Idempotent.

        Raises:
          StoreError: a background (``staleness=1``) update failed; everything is released all the same, and
            the store's committed version is the one before that update.
        """
        if self._closed:
            return
        self._closed = True
        self._outputs.clear()
        errors = self._life.release()
        if errors:
            raise StoreError(f"a background update failed before the store closed; its version was not "
                             f"committed: {errors[0]}")

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    @property
    def initialized(self) -> bool:
        return self.layout is not None

    def barrier(self) -> None:
        """Waits for the updates already dispatched to this store (jitted steps run asynchronously) and every
        background step (``staleness=1``) to commit; raises the first background step's error."""
        errors = self._life.wait()
        if errors:
            raise StoreError(f"a background update failed; version {self.version} is intact: {errors[0]}")

    @property
    def version(self) -> int | None:
        """The committed version (shards commit one by one; the store's version is the lowest)."""
        if not self._engines:
            return None
        self.barrier()
        return min(e.version for e in self._engines)

    def held_versions(self) -> list[int]:
        """Versions the store can read or update from: the committed one, and the one before it while every
        shard's other slot still holds it (only after a step completed in this process: an update that starts,
        fails or is killed overwrites it, and a reopened store does not vouch for it)."""
        v = self.version
        if v is None:
            return []
        previous_ok = v > 0 and all(e.version == v and e.previous_valid for e in self._engines)
        return [v - 1, v] if previous_ok else [v]

    def handle(self) -> StoreHandle:
        """What ``nsp.primitives.store_update`` needs of this store: its shard engines' handles (they name the
        engines inside jitted code), layout, optimizer and staleness."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet: call initialize(params, optimizer) first")
        if not self._life.handles:
            self._life.handles = [e.register() for e in self._engines]
        # Position i names shard i's engine. Another process's shard gets 0 (no engine): the update's custom call
        # looks an engine up by its device's axis index, and runs only on this process's devices.
        engines = [0] * self.num_shards
        for i, handle in zip(self.local_shards, self._life.handles):
            engines[i] = handle
        return StoreHandle(tuple(engines), self.layout, self.optimizer, self._staleness)

    # ---- creation: initialize, initialize_from, restart, attach, load_state (creation.py) --------------------

    def metadata(self) -> dict:
        """What ``nsp_store.json`` holds for this store (a memory store writes none; its snapshots do)."""
        return store_metadata(store_id=self.store_id, tier=self.tier, backend=self.backend,
                              page_bytes=self.page_bytes, checksum=self.checksum,
                              shard_paths=[recorded_path(p, self.root) for p in self.shard_paths],
                              layout=self.layout.to_json(), optimizer=dataclasses.asdict(self.optimizer),
                              slots=self.slots)

    def slot_of(self, version: int) -> int:
        """The version slot that holds ``version`` (slot 0 always in a one-slot store)."""
        return slot_of(self.slots, version)

    # ---- updates ---------------------------------------------------------------------------------------------

    def update(self, grad: Any = None, *, version: int, lr: float, step: int, indices: Any = None,
               values: Any = None, params_out: bool = True, bf16_out: bool = False,
               params_into: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Runs one optimizer step on every shard, reading ``version`` and committing ``version + 1``.

        Args:
          grad: dense gradient, the padded flat vector (``layout.padded_total`` elements, fp32 or bf16) — or a
            list with one array per shard.
          version: the version this update reads: the committed one, or the one before it (a replay, which
            rewrites the same next version).
          lr: learning rate of this step.
          step: 1-based step number (bias correction).
          indices, values: instead of ``grad``: per-shard lists of sorted shard-local int32 positions and their
            values (Top-K compressed gradients).
          params_out: return the new fp32 params.
          bf16_out: return a bf16 copy of the new params.
          params_into: a float32, C-contiguous array of ``layout.padded_total`` elements to write the new params
            into (and return as ``"params"``) instead of the result array the store hands out. Without it the
            result comes on a recycled, page-aligned buffer (``nsp.storage.out_buffers``: reused only once every
            reference to an earlier result is gone), as fast as this. One that starts on a 64-byte line
            (``out_buffers.aligned_empty``; numpy's large arrays start 16 bytes past one) is written with
            streaming stores, 4 B/param instead of 8. Needs ``params_out``.

        Returns:
          ``{"params": flat fp32, "params_bf16": flat bf16}`` (those asked for), ``layout.padded_total`` long, and
          ``"skipped"``: True when the gradient held NaN or Inf, in which case the store stays at ``version``
          and the params are that version's. A one-shard store checks a dense gradient inside the update pass
          itself (``engine.checks_finite_in_pass``): a skip found there has overwritten part of the other slot,
          so the version before ``version`` can no longer be replayed (``held_versions()``).
        """
        return run_update(self, grad, version=version, lr=lr, step=step, indices=indices, values=values,
                          params_out=params_out, bf16_out=bf16_out, params_into=params_into)

    # ---- reading -----------------------------------------------------------------------------------------------

    def read(self, state: str = "param", version: int | None = None) -> np.ndarray:
        """The padded flat fp32 vector of ``state`` at ``version`` (default: the committed one)."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        if state not in STATES or not self.optimizer.states_used()[STATES.index(state)]:
            raise ValueError(f"{self.optimizer.kind} keeps no state {state!r}")
        self._check_whole("read()")
        version = self.version if version is None else version
        if version not in self.held_versions():
            raise StoreError(f"the store no longer holds version {version} (it holds {self.held_versions()})")
        out = np.empty(self.layout.padded_total, np.float32)
        size = self.layout.shard_size
        list(self._pool.map(
            lambda i: self._engines[i].read_state(self.slot_of(version), STATES.index(state),
                                                  out[i * size:(i + 1) * size]),
            range(self.num_shards)))
        return out

    def read_shard(self, state: str, shard: int, version: int | None = None) -> np.ndarray:
        """Shard ``shard``'s fp32 ``state`` at ``version`` (default: the committed one); a shard this process holds."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        if shard not in self.local_shards:
            raise StoreError(f"shard {shard} is not one of this process's shards {list(self.local_shards)}")
        version = self.version if version is None else version
        if version not in self.held_versions():
            raise StoreError(f"the store no longer holds version {version} (it holds {self.held_versions()})")
        out = np.empty(self.layout.shard_size, np.float32)
        self._engines[self.local_shards.index(shard)].read_state(self.slot_of(version), STATES.index(state), out)
        return out

    def read_leaves(self, state: str = "param", version: int | None = None) -> Iterator[tuple[Leaf, np.ndarray]]:
        """``(leaf, fp32 array of its shape)`` for every leaf of ``state`` at ``version`` (default: the committed
        one), in layout order, each read from only the pages it spans: a model's state comes back one leaf at a
        time, never whole (resuming a big model from its store). Every shard a leaf spans must be this
        process's."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        if state not in STATES or not self.optimizer.states_used()[STATES.index(state)]:
            raise ValueError(f"{self.optimizer.kind} keeps no state {state!r}")
        version = self.version if version is None else version
        if version not in self.held_versions():
            raise StoreError(f"the store no longer holds version {version} (it holds {self.held_versions()})")
        size, page = self.layout.shard_size, self.layout.page_elems
        for leaf in self.layout.leaves:
            out = np.empty(leaf.size, np.float32)
            begin, end = leaf.offset, leaf.offset + leaf.size
            while begin < end:  # the leaf's part in each shard it spans
                shard, at = divmod(begin, size)
                if shard not in self.local_shards:
                    raise StoreError(f"leaf {leaf.path} lies partly in shard {shard}, which is not one of this "
                                     f"process's shards {list(self.local_shards)}")
                upto = min(end - shard * size, size)  # where this part ends, within the shard
                first = at // page
                n = min(-(-upto // page) * page, size) - first * page  # whole pages (the shard's last one short)
                pages = np.empty(n, np.float32)
                engine = self._engines[self.local_shards.index(shard)]
                engine.read_pages(self.slot_of(version), STATES.index(state), first, pages)
                skip = first * page  # where the pages start, within the shard
                out[begin - leaf.offset:shard * size + upto - leaf.offset] = pages[at - skip:upto - skip]
                begin = shard * size + upto
            yield leaf, out.reshape(leaf.shape)

    def verify(self) -> dict[str, Any]:
        """Reads every page of every state of the committed version, checking its CRC-32C.

        Returns ``{"version", "pages", "bytes", "problems"}``; each problem names the state, page and shard.
        """
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        version = self.version
        used = [i for i, u in enumerate(self.optimizer.states_used()) if u]
        jobs = [(engine, state) for engine in self._engines for state in used]
        problems = [p for found in self._pool.map(lambda job: job[0].verify(self.slot_of(version), job[1]), jobs)
                    for p in found]
        pages = len(jobs) * self.layout.pages_per_shard
        return {"version": version, "pages": pages, "bytes": len(jobs) * self.layout.shard_size * 4,
                "problems": problems}

    def stats(self) -> dict[str, int]:
        """Traffic and time since open (or ``reset_stats``).

        Bytes on the shared link (``shared_in_bytes``: grads in, ``shared_out_bytes``: params out) and on the
        internal one (``internal_read_bytes``/``internal_write_bytes``, ``pages_read``/``pages_written``, and
        ``pages_read_direct``: the file tier's pages read with direct I/O, the rest through the page cache);
        ``updates`` and ``skipped`` steps; ``update_ns``, the wall time of the updates (each step as long as its
        slowest shard), of which ``sync_ns`` made the new version's pages durable and ``commit_ns`` recorded it
        (the manifest); ``wait_ns``, the time staleness-1 steps held their callers (waiting for the previous
        background update, copying the gradient): the part of the update staleness did not hide;
        ``params_adopted``, the steps that started from the caller's params instead of the store's master (the
        params had changed since the update that led to them; ``nsp.optim.scale_by_storage``);
        ``buffer_bytes``, the engines' page buffers.
        """
        per_shard = self.shard_stats()
        totals: dict[str, int] = {}
        for shard in per_shard:
            for key, value in shard.items():
                if key != "backend":  # each device's own figures stay per shard
                    totals[key] = totals.get(key, 0) + value
        # Shards update in parallel: a step takes as long as its slowest shard, and counts once, not per shard.
        for key in ("updates", "update_ns", "sync_ns", "commit_ns", "skipped", "wait_ns"):
            totals[key] = max((shard[key] for shard in per_shard), default=0)
        totals["buffer_bytes"] = sum(e.buffer_bytes for e in self._engines)
        return totals

    def shard_stats(self) -> list[dict[str, Any]]:
        """``stats()`` of each shard on its own (its engine's counters: bytes on the shared link and on that
        shard's internal link, pages, updates, time), in shard order: what a per-device model charges to each
        device's links. ``"backend"``: the figures the shard's backend reports about itself, name -> float (empty
        for ``memory`` and ``file``). A ``csd`` device's, since it was opened (``reset_stats`` leaves them):
        ``model_seconds_last_update`` and ``model_seconds_total`` (its model clock: the updates' page pipelines on
        its link figures, never wall time), ``busy_seconds_*`` and ``bytes_*`` per resource (``read_link``,
        ``write_link``, ``updater``, ``shared_link``/``device_link``; ``host_in``/``host_out`` bytes), its
        figures, and the ``page_reads``, ``page_writes`` and ``kernels`` it ran (what its faults count)."""
        return [{**engine.stats(), "backend": {} if self._built_in else engine.backend_stats()}
                for engine in self._engines]

    def progress(self) -> dict[str, Any]:
        """Where the running (or last) update is, over this process's shards, for a progress display: safe to call
        from another thread while an update runs (inside a jitted step too). Keys: ``running`` (an update is under
        way on some shard), ``pages_done`` and ``pages_total`` (summed over the shards), ``bytes_done`` and
        ``bytes_total`` (the state bytes those pages move: each page of every state the optimizer keeps, read and
        written), ``elapsed_s``
        (since the earliest shard's update began), ``updates_begun`` (the fewest over the shards: changes when the
        next update starts)."""
        self._check_open()
        shards = [engine.progress() for engine in self._engines]
        states = sum(self.optimizer.states_used()) if self.optimizer is not None else 0
        done = sum(p["pages_done"] for p in shards)
        total = sum(p["pages_total"] for p in shards)
        return {"running": any(p["running"] for p in shards), "pages_done": done, "pages_total": total,
                "bytes_done": 2 * states * done * self.page_bytes,
                "bytes_total": 2 * states * total * self.page_bytes,
                "elapsed_s": max((p["elapsed_ns"] for p in shards), default=0) / 1e9,
                "updates_begun": min((p["updates_begun"] for p in shards), default=0)}

    @property
    def _built_in(self) -> bool:
        """Whether the shards run on a built-in backend (memory, file) rather than a backend library."""
        return self.backend in ("memory", "file")

    def reset_stats(self) -> None:
        for engine in self._engines:
            engine.reset_stats()

    def __repr__(self) -> str:
        where = self.root or "memory"
        tier = self.tier + (", in place" if self.in_place else "")
        if self.backend != TIER_BACKENDS[self.tier]:
            tier += f", backend={self.backend}"
        return (f"StateStore({where}, tier={tier}, shards={self.num_shards}, version={self.version}, "
                f"optimizer={self.optimizer.kind if self.optimizer else None})")
