"""Creating a store's state: ``StateStore``'s methods that write a first version or take one over.

``initialize``/``initialize_from`` write version 0 from the params (a few pages at a time, straight from the
leaves: no flat copy of the model), ``restart`` writes the next version afresh (what optax's ``init`` means on a
store that holds a state), ``attach`` and ``load_state`` take over a state that exists already (opening and
restoring stores); each makes the shard engines through the compiled engine (``nsp.engine``). ``StateStore``
(``store.py``) gets them from ``StoreCreation``, kept apart so that each file holds one concern.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from nsp import engine as native
from nsp.storage.format import (MANIFEST, METADATA, RESTARTS, STATES, StoreError, array_dir, atomic_write_json,
                                read_json, zarr_spec)
from nsp.storage.layout import Layout
from nsp.storage.optimizer import OptimizerSpec
from nsp.storage.space import check_free_space

_INIT_CHUNK_BYTES = 16 << 20  # initialize writes the state this many bytes at a time


class StoreCreation:
    """``StateStore``'s creation methods (the attributes they use are ``StateStore``'s)."""

    def initialize(self, params: Any, optimizer: OptimizerSpec, *, staleness: int = 0,
                   checkpoint_margin: int = 1, stage_itemsize: int = 0) -> int:
        """Writes the layout of ``params`` and their values as version 0, or checks an existing store matches.

        ``staleness``: how the updates will run (0: each returns its own params; 1: in the background, returning
        the previous step's), handed to the update primitives in ``handle()``. Returns the committed version.
        Raises ``StoreError`` (and writes nothing) when the store already holds a different layout or another
        optimizer, or when its disks lack the space it needs (``nsp.storage.space``). ``initialize_from`` writes
        the same bytes from one leaf at a time.
        """
        leaves = jax.tree_util.tree_leaves(params)
        return self.initialize_from(params, lambda i: leaves[i], optimizer, staleness=staleness,
                                    checkpoint_margin=checkpoint_margin, stage_itemsize=stage_itemsize)

    def initialize_from(self, abstract_params: Any, produce: Callable[[int], Any], optimizer: OptimizerSpec, *,
                        staleness: int = 0, progress: Callable[[int, int], None] | None = None,
                        checkpoint_margin: int = 1, stage_itemsize: int = 0) -> int:
        """``initialize`` from the params' shapes, asking for their values one leaf at a time: setting up never
        holds the whole model, only the leaves the pages being written need.

        Args:
          abstract_params: a pytree of ``jax.ShapeDtypeStruct`` (or arrays) giving the layout, as ``initialize``'s
            params do.
          produce: ``produce(i)`` gives the values of leaf ``i`` (in ``jax.tree_util.tree_leaves(abstract_params)``
            order) as a numpy or JAX array of that leaf's shape and dtype. It is called for i = 0, 1, 2, ... in
            order, each exactly once (a process holding some of the shards is asked for every leaf all the same,
            and drops those its shards lack at once), and the store lets go of a leaf as soon as its elements are
            copied into the pages being written. Not called when the store holds state already.
          optimizer: the update the store runs.
          staleness: as for ``initialize``.
          progress: ``progress(done_bytes, total_bytes)``, called after each chunk of pages is written (the state
            bytes of version 0 this process writes: every state the optimizer keeps), ending at the total.
          checkpoint_margin: versions of pages that live checkpoints may add to the disk's need (a snapshot keeps
            the pages it links, so the second update after it writes those pages anew; ``nsp.storage.space``).
            0 when no update will follow a checkpoint while this store lives (a run that saves only at its end).
          stage_itemsize: bytes per element of the gradient its updates will stage on its disk (2: bf16, 4: fp32;
            ``nsp.optim``'s ``stage_gradients``), counted in the disk it needs; 0: they will not.

        Returns:
          The committed version: 0, or an existing store's.

        Raises:
          StoreError: the store holds another layout or optimizer; its disks lack the space it needs (said before
            any state is written); a leaf from ``produce`` has another shape or dtype than the layout's; writing
            failed. Nothing is committed then: the store stays uninitialized and writes no metadata.
        """
        self._check_open()
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {staleness}")
        self._staleness = int(staleness)
        layout = Layout.from_tree(abstract_params, num_shards=self.num_shards, page_bytes=self.page_bytes)
        if self.initialized:
            diff = self.layout.describe_difference(layout)
            if diff:
                raise StoreError(f"store {self.root or '(memory)'} holds a different layout: {diff}. A store holds "
                                 "one optimizer's state: give each optimizer (each part of an optax.partition, "
                                 "each model) its own store")
            if self.optimizer != optimizer:
                raise StoreError(
                    f"store {self.root or '(memory)'} was created for {self.optimizer}, not {optimizer}: give each "
                    "optimizer its own store"
                )
            return self.version
        if self.tier != "memory":  # every backend on disk keeps the file tier's files
            check_free_space(self.shard_paths, layout, optimizer, root=self.root, shards=self.local_shards,
                             checksum=self.checksum, checkpoints=checkpoint_margin, slots=self.slots,
                             redo_window=self.redo_window, stage_itemsize=stage_itemsize)
        self.layout, self.optimizer = layout, optimizer
        asked_page_bytes, self.page_bytes = self.page_bytes, layout.page_elems * 4  # less when a shard is smaller
        try:
            self._make_engines(create=True)
        except BaseException:
            self.layout = self.optimizer = None  # no engines: the store stays uninitialized
            self.page_bytes = asked_page_bytes
            raise
        try:
            self._write_first_version(produce, progress)
            for engine in self._engines:
                engine.commit(0)
            if self.root is not None:
                # Written last: a store without metadata is an empty one, whatever else a crash left behind.
                atomic_write_json(self.root / METADATA, self.metadata())
        except BaseException as e:
            self._drop_engines()
            self.page_bytes = asked_page_bytes
            if isinstance(e, (RuntimeError, OSError)) and not isinstance(e, StoreError):
                raise StoreError(f"cannot initialize store {self.root or '(memory)'}: {e}") from e
            raise
        return 0

    def _drop_engines(self) -> None:
        """Lets go of the engines of an initialization that failed: the store is uninitialized again."""
        for engine in self._engines:
            engine.release()
        self._engines = []
        self.layout = self.optimizer = None

    def restart(self, params: Any, optimizer: OptimizerSpec, *, staleness: int = 0,
                produce: Callable[[int], Any] | None = None,
                progress: Callable[[int, int], None] | None = None) -> int:
        """Starts the optimizer afresh from ``params`` on a store that holds a state already: what ``tx.init`` does
        on such a store (optax's ``init``: a fresh state from these params). Writes the params, zeroed moments and
        ``initial_nu`` as the next version (into the slot beside the committed one, so a crash keeps the old state
        whole), commits it, and stops the old version from being replayed: an optax state that still names it
        fails its next update with a clear error instead of overwriting the new state.

        With ``produce`` (as for ``initialize_from``), ``params`` may be abstract and the values are asked for one
        leaf at a time; ``progress`` as there.

        Returns the new committed version. Raises ``StoreError`` for another layout or optimizer (a store holds one
        optimizer's state: give each its own), or for a store whose shards live in several processes.
        """
        self._check_open()
        if produce is None:
            leaves = jax.tree_util.tree_leaves(params)
            produce = leaves.__getitem__
        if not self.initialized:
            return self.initialize_from(params, produce, optimizer, staleness=staleness, progress=progress)
        if staleness not in (0, 1):
            raise ValueError(f"staleness must be 0 or 1, got {staleness}")
        layout = Layout.from_tree(params, num_shards=self.num_shards, page_bytes=self.page_bytes)
        diff = self.layout.describe_difference(layout)
        if diff or self.optimizer != optimizer:
            what = f"holds a different layout: {diff}" if diff else f"was created for {self.optimizer}, not {optimizer}"
            raise StoreError(f"store {self.root or '(memory)'} {what}. A store holds one optimizer's state: give "
                             "each optimizer (each model, each part of an optax.partition) its own store")
        if len(self.local_shards) != self.num_shards:
            raise StoreError(f"store {self.root or '(memory)'} has shards in other processes: a fresh init of it "
                             "needs every process; open a new store for the new run")
        if self.slots == 1:
            raise StoreError(f"store {self.root} keeps one version slot: a fresh init over its state would overwrite "
                             "the only copy before the new one is whole; open a new store for the new run")
        self.barrier()
        version = self.version + 1
        # Recorded before the commit: a crash between the two leaves a restart newer than the committed version,
        # which base_version() ignores.
        self._restarts = sorted(set(self.restarts()) | {version})
        if self.root is not None:
            atomic_write_json(self.root / RESTARTS, {"restarts": self._restarts})
        try:
            self._write_first_version(produce, progress, slot=self.slot_of(version))
            for engine in self._engines:
                engine.commit(version)
                engine.forget_previous()
        except (RuntimeError, OSError) as e:
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"cannot restart store {self.root or '(memory)'}: {e}; version {version - 1} is "
                             "intact") from e
        self._staleness = int(staleness)
        return version

    def restarts(self) -> list[int]:
        """The versions at which ``restart`` began the optimizer afresh (a file-tier store keeps them in
        ``restarts.json`` beside its metadata)."""
        if getattr(self, "_restarts", None) is None:
            self._restarts = []
            path = None if self.root is None else self.root / RESTARTS
            if path is not None and path.exists():
                self._restarts = [int(v) for v in read_json(path, "store restarts")["restarts"]]
        return list(self._restarts)

    def base_version(self, version: int | None = None) -> int:
        """The version the optimizer's run that reached ``version`` (default: the committed one) started from:
        0, or the latest restart at or below it. ``version - base_version()`` updates were applied since."""
        version = self.version if version is None else version
        return max([0] + [v for v in self.restarts() if v <= version])

    def _write_first_version(self, produce: Callable[[int], Any], progress: Callable[[int, int], None] | None,
                             slot: int = 0) -> None:
        """Writes version 0 (or, restarting, the next version into ``slot``) of this process's shards: the params
        from ``produce`` (``_Leaves``), zeroed moments and ``initial_nu``, a few pages at a time in flat-vector
        order, then syncs each shard.

        The next chunk is gathered while the pool writes the one before it; each engine runs one write at a time
        (its chunks in order), and a shard's sync runs beside the next shard's writes."""
        layout, used = self.layout, self.optimizer.states_used()
        # Written a few pages at a time, straight from the leaves: no flat copy of the model is ever made.
        chunk = layout.page_elems * max(1, _INIT_CHUNK_BYTES // (4 * layout.page_elems))
        size = min(chunk, layout.shard_size)
        mu0, nu0 = np.zeros(size, np.float32), np.full(size, self.optimizer.initial_nu, np.float32)
        leaves = _Leaves(layout, produce)
        states = sum(used)
        total, done = len(self.local_shards) * layout.shard_size * 4 * states, 0
        in_flight: list[tuple[concurrent.futures.Future, int, Any]] = []  # (write, its bytes, its engine)

        def write(engine, page, params, last):
            engine.write_pages(slot, 0, page, params)
            if used[1]:
                engine.write_pages(slot, 1, page, mu0[:params.size])
            if used[2]:
                engine.write_pages(slot, 2, page, nu0[:params.size])
            if last:
                engine.sync(slot)

        def settle(engine=None):
            """Waits for the writes in flight to ``engine`` (to every engine without one), telling ``progress``."""
            nonlocal done
            for entry in [entry for entry in in_flight if engine is None or entry[2] is engine]:
                in_flight.remove(entry)
                entry[0].result()
                done += entry[1]
                if progress is not None:
                    progress(done, total)

        try:
            for local, i in enumerate(self.local_shards):
                engine, begin = self._engines[local], i * layout.shard_size
                for at in range(0, layout.shard_size, chunk):
                    n = min(chunk, layout.shard_size - at)
                    params = leaves.gather(begin + at, n)
                    settle(engine)  # one write at a time per engine, its pages in order
                    last = at + n == layout.shard_size
                    in_flight.append((self._pool.submit(write, engine, at // layout.page_elems, params, last),
                                      n * 4 * states, engine))
            leaves.finish()
            settle()
        finally:
            # On an error, no write may still run once the engines are let go.
            concurrent.futures.wait([future for future, _, _ in in_flight])

    def attach(self, layout: Layout, optimizer: OptimizerSpec, version: int,
               checksums: list[dict] | None = None) -> None:
        """Takes over state that exists already at committed ``version``, instead of writing version 0 as
        ``initialize`` does: the shard engines are made over the shards' arrays as they are on disk (memory tier:
        zeros, filled by ``load_state``). ``checksums``: each shard's page checksums per slot and state, from its
        manifest (reads then check every page against them). For opening and restoring stores; the caller has
        checked that the arrays hold that version."""
        self._check_open()
        if self.initialized:
            raise StoreError(f"store {self.root or '(memory)'} holds state already")
        self.layout, self.optimizer = layout, optimizer
        try:
            self._make_engines(create=False, version=version, checksums=checksums)
        except BaseException:
            self.layout = self.optimizer = None
            raise

    def load_state(self, state: str, shard: int, values: np.ndarray) -> None:
        """Writes ``values`` (fp32, ``layout.shard_size`` elements) as ``state`` of shard ``shard`` in the committed
        version, outside any update: how a restore fills a memory store after ``attach``."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        if self.tier != "memory":
            raise StoreError("load_state fills a memory store; a file store is restored by placing its files")
        if shard not in self.local_shards:
            raise StoreError(f"shard {shard} is not one of this process's shards {list(self.local_shards)}")
        self._engines[self.local_shards.index(shard)].write_state(self.slot_of(self.version), STATES.index(state),
                                                                  values)

    def _make_engines(self, create: bool, version: int = 0, checksums: list[dict] | None = None) -> None:
        """One engine per shard at committed ``version``; ``checksums``: each shard's page checksums per slot
        and state, from its manifest (reads then check every page against them)."""
        used = list(self.optimizer.states_used())
        if self.tier != "memory" and create:  # every backend on disk keeps the file tier's arrays
            for shard in self.local_shard_paths:
                self._create_arrays(shard, used)
        self._engines = []
        for i in self.local_shards:
            shard = self.shard_paths[i] if self.shard_paths else None
            # A backend library's device is told its shard, the store's device count and its options.
            device = {} if self._built_in else dict(backend_options=self.backend_options, shard=i,
                                                    num_shards=self.num_shards)
            try:
                engine = native.ShardEngine(self.backend, str(shard) if shard else "", self.layout.shard_size,
                                              self.layout.page_elems, self.pages_in_flight, used, self.checksum,
                                              in_place=self.in_place, slots=self.slots, **device)
            except RuntimeError as e:  # "backend <name> not available: <why>"
                for made in self._engines:
                    made.release()
                self._engines = []
                raise StoreError(str(e)) from None
            engine.set_manifest(str(shard / MANIFEST) if shard else "", version, self.store_id, i)
            if self.slots == 1:  # the store's shards in this process step together (JournalBarrier)
                engine.set_one_slot(len(self.local_shards), self.redo_window)
            for slot, states in (checksums[len(self._engines)] if checksums else {}).items():
                for state, crcs in states.items():
                    if state != "version":
                        engine.set_page_checksums(slot, STATES.index(state), crcs)
            self._engines.append(engine)

    def _create_arrays(self, shard: Path, used: list[bool]) -> None:
        """Creates every slot's state arrays through tensorstore (it owns the format; the engine follows it)."""
        for slot in range(self.slots):
            for state, is_used in zip(STATES, used):
                if not is_used:
                    continue
                path = array_dir(shard, slot, state)
                spec = zarr_spec(path, self.layout.shard_size, self.layout.page_elems, self.checksum, state, slot)
                ts.open(spec, create=True, delete_existing=True).result()
                (path / "c").mkdir(exist_ok=True)


class _Leaves:
    """The params' leaves as ``StateStore.initialize_from`` asks ``produce`` for them: each once, in layout order,
    checked against the layout, and held only while the chunk being gathered needs it (a leaf that ends inside
    the chunk is let go once the chunk is gathered; one that goes on past it stays for the next)."""

    def __init__(self, layout: Layout, produce: Callable[[int], Any]):
        self.layout = layout
        self.produce = produce
        self.next = 0  # the next leaf to ask for
        self.held: dict[int, np.ndarray] = {}  # leaf index -> its values, flat

    def gather(self, begin: int, n: int) -> np.ndarray:
        """Elements ``[begin, begin + n)`` of the padded flat vector as fp32 (``Layout.gather``); chunks must
        come in increasing order."""
        end = begin + n
        leaves = self.layout.leaves
        while self.next < len(leaves) and leaves[self.next].offset < end:
            if leaves[self.next].offset + leaves[self.next].size > begin:
                self.held[self.next] = self._take(self.next)
            else:  # it lies in another process's shards: checked, and let go at once
                self._take(self.next)
            self.next += 1
        out = self.layout.gather([self.held.get(i) for i in range(len(leaves))], begin, n)
        for i in [i for i in self.held if leaves[i].offset + leaves[i].size <= end]:
            del self.held[i]
        return out

    def finish(self) -> None:
        """Asks for (and checks) the leaves no chunk needed: those past this process's last shard, and empty
        ones at the end."""
        while self.next < len(self.layout.leaves):
            self._take(self.next)
            self.next += 1
        self.held.clear()

    def _take(self, i: int) -> np.ndarray:
        spec = self.layout.leaves[i]
        values = np.asarray(self.produce(i))
        if values.shape != spec.shape or values.dtype.name != spec.dtype:
            raise StoreError(f"leaf {i} ({spec.path}) was produced as {values.dtype.name}{list(values.shape)}; "
                             f"the layout says {spec.dtype}{list(spec.shape)}")
        return np.ravel(values)  # a view when contiguous; else one copy, not one per chunk
