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
from collections.abc import Callable, Iterator, Sequence
import uuid
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from nsp import engine as native
from nsp.storage.format import (MANIFEST, METADATA, RESTARTS, STATES, TIER_BACKENDS, StoreError, array_dir,
                                atomic_write_json, inside, lock_store, read_json, recorded_path, store_metadata,
                                zarr_spec)
from nsp.storage.handle import StoreHandle
from nsp.storage.layout import Layout, Leaf
from nsp.storage.lifetime import Lifetime
from nsp.storage.optimizer import OptimizerSpec
from nsp.storage.space import check_free_space
from nsp.storage.update import run_update

_INIT_CHUNK_BYTES = 16 << 20  # initialize writes the state this many bytes at a time


class StateStore:
    """Sharded, paged, versioned optimizer state in one storage tier. Create with ``nsp.storage.open``."""

    def __init__(self, root: Path | None, tier: str, num_shards: int, page_bytes: int,
                 shard_paths: list[Path], pages_in_flight: int, checksum: bool, in_place: bool = False,
                 store_id: str | None = None, backend: str | None = None, backend_options: str = "",
                 local_shards: Sequence[int] | None = None):
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
        self.layout: Layout | None = None
        self.optimizer: OptimizerSpec | None = None
        self._staleness = 0  # how updates run, as initialize was told (StoreHandle.staleness)
        # Where a store rebuilt by nsp.storage.restore.restore_store came from and how its pages got there
        # (snapshot, version, method, file counts); None for any other store.
        self.restore_info: dict | None = None
        self._closed = False
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

    # ---- creation --------------------------------------------------------------------------------------------

    def initialize(self, params: Any, optimizer: OptimizerSpec, *, staleness: int = 0,
                   checkpoint_margin: int = 1) -> int:
        """Writes the layout of ``params`` and their values as version 0, or checks an existing store matches.

        ``staleness``: how the updates will run (0: each returns its own params; 1: in the background, returning
        the previous step's), handed to the update primitives in ``handle()``. Returns the committed version.
        Raises ``StoreError`` (and writes nothing) when the store already holds a different layout or another
        optimizer, or when its disks lack the space it needs (``nsp.storage.space``). ``initialize_from`` writes
        the same bytes from one leaf at a time.
        """
        leaves = jax.tree_util.tree_leaves(params)
        return self.initialize_from(params, lambda i: leaves[i], optimizer, staleness=staleness,
                                    checkpoint_margin=checkpoint_margin)

    def initialize_from(self, abstract_params: Any, produce: Callable[[int], Any], optimizer: OptimizerSpec, *,
                        staleness: int = 0, progress: Callable[[int, int], None] | None = None,
                        checkpoint_margin: int = 1) -> int:
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
                             checksum=self.checksum, checkpoints=checkpoint_margin)
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

    def restart(self, params: Any, optimizer: OptimizerSpec, *, staleness: int = 0) -> int:
        """Starts the optimizer afresh from ``params`` on a store that holds a state already: what ``tx.init`` does
        on such a store (optax's ``init``: a fresh state from these params). Writes the params, zeroed moments and
        ``initial_nu`` as the next version (into the slot beside the committed one, so a crash keeps the old state
        whole), commits it, and stops the old version from being replayed: an optax state that still names it
        fails its next update with a clear error instead of overwriting the new state.

        Returns the new committed version. Raises ``StoreError`` for another layout or optimizer (a store holds one
        optimizer's state: give each its own), or for a store whose shards live in several processes.
        """
        self._check_open()
        if not self.initialized:
            return self.initialize(params, optimizer, staleness=staleness)
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
        self.barrier()
        version = self.version + 1
        leaves = jax.tree_util.tree_leaves(params)
        # Recorded before the commit: a crash between the two leaves a restart newer than the committed version,
        # which base_version() ignores.
        self._restarts = sorted(set(self.restarts()) | {version})
        if self.root is not None:
            atomic_write_json(self.root / RESTARTS, {"restarts": self._restarts})
        try:
            self._write_first_version(lambda i: leaves[i], None, slot=version % 2)
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

    def metadata(self) -> dict:
        """What ``nsp_store.json`` holds for this store (a memory store writes none; its snapshots do)."""
        return store_metadata(store_id=self.store_id, tier=self.tier, backend=self.backend,
                              page_bytes=self.page_bytes, checksum=self.checksum,
                              shard_paths=[recorded_path(p, self.root) for p in self.shard_paths],
                              layout=self.layout.to_json(), optimizer=dataclasses.asdict(self.optimizer))

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
        self._engines[self.local_shards.index(shard)].write_state(self.version % 2, STATES.index(state), values)

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
                                              in_place=self.in_place, **device)
            except RuntimeError as e:  # "backend <name> not available: <why>"
                for made in self._engines:
                    made.release()
                self._engines = []
                raise StoreError(str(e)) from None
            engine.set_manifest(str(shard / MANIFEST) if shard else "", version, self.store_id, i)
            for slot, states in (checksums[len(self._engines)] if checksums else {}).items():
                for state, crcs in states.items():
                    if state != "version":
                        engine.set_page_checksums(slot, STATES.index(state), crcs)
            self._engines.append(engine)

    def _create_arrays(self, shard: Path, used: list[bool]) -> None:
        """Creates every slot's state arrays through tensorstore (it owns the format; the engine follows it)."""
        for slot in (0, 1):
            for state, is_used in zip(STATES, used):
                if not is_used:
                    continue
                path = array_dir(shard, slot, state)
                spec = zarr_spec(path, self.layout.shard_size, self.layout.page_elems, self.checksum, state, slot)
                ts.open(spec, create=True, delete_existing=True).result()
                (path / "c").mkdir(exist_ok=True)

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
            into (and return as ``"params"``) instead of a fresh array: a loop of updates then allocates nothing
            (a fresh array's first touch costs about as much as the kernel's pass, and several times more on a
            virtual machine that hands freed memory back to its host: ``bench/store_update.py``'s "numpy in and
            out" row against its "params_into reused" row). Needs ``params_out``.

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
            lambda i: self._engines[i].read_state(version % 2, STATES.index(state), out[i * size:(i + 1) * size]),
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
        self._engines[self.local_shards.index(shard)].read_state(version % 2, STATES.index(state), out)
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
                self._engines[self.local_shards.index(shard)].read_pages(version % 2, STATES.index(state), first,
                                                                         pages)
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
        problems = [p for found in self._pool.map(lambda job: job[0].verify(version % 2, job[1]), jobs)
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
