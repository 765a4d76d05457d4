"""StateStore: an optimizer's fp32 state in a storage tier, sharded, paged, versioned, updated in place.

A store holds, for a flattened parameter vector cut into equal shards (see ``layout.py``), the fp32 master
params and the optimizer's moments. Each shard has two version slots: an update reads committed version ``t``
from one slot, writes version ``t+1`` into the other through the C++ engine, makes it durable, and only then
commits ``t+1`` (an atomic manifest rename per shard). A crash therefore leaves ``t`` or ``t+1`` whole, and
replaying an update from ``t`` gives the same bytes. A ``memory`` store opened with ``in_place=True`` keeps one
copy instead (both slots name it): updates run in place, in half the RAM, and cannot be replayed.

On disk (``file`` tier) every state array of every slot is a zarr v3 array that plain ``tensorstore.open``
reads: one chunk per page, raw little-endian fp32 plus a CRC-32C trailer::

    ROOT/nsp_store.json                   store id, layout, optimizer, tier, shard paths (written once, atomically)
    ROOT/LOCK, SHARD/LOCK                 held by the single writer (every shard is locked, wherever it lives)
    SHARD/SHARD.json                      {"store": id, "shard": i, "root": ROOT}: whose shard this is
    SHARD/MANIFEST.json                   {"store", "shard", "version": t, "checksums": each page's CRC-32C per slot}
    SHARD/slot{0,1}/{param,mu,nu}/        zarr v3 arrays (zarr.json + c/<page>)

SHARD is ``ROOT/shards/00000`` (recorded relative to ROOT, so a copied or moved store opens its own shards) or a
directory given as ``shard_paths[i]`` outside ROOT (recorded absolute). Every shard knows its store: a shard of
another store is refused at open, and the manifest ties each page's checksum to its store, shard, state, page
and version, so a valid page put in another page's place is reported as damage.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import dataclasses
import errno
import fcntl
import json
import os
import sys
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from nsp import _nsp_ffi
from nsp.primitives.fused_update import KINDS, _DEFAULT_EPS
from nsp.storage.layout import PAGE_BYTES_DEFAULT, PAGES_IN_FLIGHT_DEFAULT, Layout, check_page_bytes
from nsp.storage.metadata import (FORMAT_VERSION, LOCK, MANIFEST, METADATA, SHARD_ID, STATES, TIERS, StoreError,
                                  check_manifest, check_metadata, check_shard_id)

_INIT_CHUNK_BYTES = 16 << 20  # initialize writes the state this many bytes at a time


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which update the store runs and with which (static) hyperparameters.

    ``lr`` and ``step`` are not here: they are given to every update, so schedules work.
    """

    kind: str = "adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    lazy: bool = False  # entries with a zero gradient keep param and state (see nsp.primitives.fused_update)
    initial_nu: float = 0.0  # AdaGrad's initial accumulator (optax: 0.1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown optimizer kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if self.eps is None:
            object.__setattr__(self, "eps", _DEFAULT_EPS[self.kind])

    def states_used(self) -> tuple[bool, bool, bool]:
        mu = self.kind in ("adam", "adamw") or (self.kind == "sgd" and self.momentum != 0.0)
        nu = self.kind in ("adam", "adamw", "adagrad")
        return (True, mu, nu)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_json(path: Path, data: dict) -> None:
    """Write-to-temp, fsync, rename, fsync the directory: readers see the old or the new file, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with builtins.open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _read_json(path: Path, what: str) -> dict:
    try:
        with builtins.open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StoreError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{what} {path} is corrupt or truncated ({e})") from None


def _effects_barrier() -> None:
    """Waits for the side-effecting computations this thread dispatched (jitted steps run asynchronously)."""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001  (a failed step raises its error to its own caller, from its outputs)
        pass


class _Lifetime:
    """What a store must release, apart from the store object so that a finalizer can hold it.

    The C++ side keeps each engine alive while its registry handle or a running step holds it, so nothing here
    can free an engine under a step. What remains is the order: the handles stay registered until the steps
    already dispatched have run, or a queued step would find its store gone.
    """

    def __init__(self, num_shards: int):
        self.engines: list[Any] = []  # _nsp_ffi.ShardEngine, one per shard
        self.handles: list[int] = []  # their registry handles, once a jitted step asked for them
        self.lock_fds: list[int] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=num_shards, thread_name_prefix="nsp-shard")
        self.released = False

    def release(self, *, from_finalizer: bool = False) -> list[Exception]:
        """Waits for dispatched steps and background updates, then lets go of everything; returns the errors of
        background updates (they have nowhere else to go)."""
        if self.released:
            return []
        self.released = True
        # A finalizer can run on a pool thread (garbage collection happens wherever Python allocates): never
        # join the pool from there.
        self.pool.shutdown(wait=not from_finalizer)
        if self.handles:
            _effects_barrier()
        errors = []
        for engine in self.engines:
            try:
                engine.wait()
            except RuntimeError as e:
                errors.append(e)
        for handle in self.handles:
            _nsp_ffi.unregister_engine(handle)
        for engine in self.engines:
            engine.release()
        self.handles, self.engines = [], []
        for fd in self.lock_fds:
            os.close(fd)  # closing the descriptor drops the flock
        self.lock_fds = []
        return errors

    def release_dropped(self) -> None:
        """The finalizer of a store dropped without ``close()`` (also run at interpreter exit)."""
        for error in self.release(from_finalizer=True):
            print(f"nsp: a background update of a store dropped without close() failed: {error}", file=sys.stderr)


class StateStore:
    """Sharded, paged, versioned optimizer state in one storage tier. Create with ``nsp.storage.open``."""

    def __init__(self, root: Path | None, tier: str, num_shards: int, page_bytes: int,
                 shard_paths: list[Path], pages_in_flight: int, checksum: bool, in_place: bool = False,
                 store_id: str | None = None):
        self.root = root
        self.store_id = store_id or uuid.uuid4().hex  # whose shards these are (SHARD.json, every manifest)
        self.tier = tier
        self.num_shards = num_shards
        self.page_bytes = page_bytes
        self.shard_paths = shard_paths
        self.pages_in_flight = pages_in_flight
        self.checksum = checksum
        self.in_place = in_place  # memory tier only: one copy of the state, updated in place (no replay)
        self.layout: Layout | None = None
        self.optimizer: OptimizerSpec | None = None
        self.staleness = 0  # set by the nsp.optim transform that drives the store
        self._closed = False
        # Engines, handles, locks and threads live in their own object, released by close() or, for a store
        # dropped without close(), by a finalizer that runs only once the steps already dispatched are done.
        self._life = _Lifetime(num_shards)
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

    def _acquire_locks(self) -> None:
        """Locks the store and every shard it will write, wherever the shard lives: a second writer on any of
        them is refused, whichever store directory it came through."""
        for directory in [self.root, *self.shard_paths]:
            self._lock(directory / LOCK, directory)

    def _lock(self, path: Path, what: Path) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open the writer lock {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                holder = path.read_text().strip() or "another process"
                where = f"store {self.root}" if what == self.root else f"shard {what} (of store {self.root})"
                raise StoreError(f"{where} is already open for writing by {holder}") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._life.lock_fds.append(fd)

    @property
    def external_shards(self) -> list[Path]:
        """Shards that live outside the store's directory (on another disk, say): a copy of the directory does
        not include them."""
        return [p for p in self.shard_paths if self.root is not None and not _inside(p, self.root)]

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

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    @property
    def initialized(self) -> bool:
        return self.layout is not None

    def barrier(self) -> None:
        """Waits for the updates already dispatched to this store (jitted steps run asynchronously) and every
        background step (``staleness=1``) to commit; raises the first background step's error."""
        if self._life.handles:
            _effects_barrier()
        errors = []
        for engine in self._engines:
            try:
                engine.wait()
            except RuntimeError as e:
                errors.append(e)
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

    def ffi_handles(self) -> list[int]:
        """Handles that name this store's shard engines inside jitted code (``nsp.primitives.store_update``)."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet: call initialize(params, optimizer) first")
        if not self._life.handles:
            self._life.handles = [e.register() for e in self._engines]
        return list(self._life.handles)

    # ---- creation --------------------------------------------------------------------------------------------

    def initialize(self, params: Any, optimizer: OptimizerSpec) -> int:
        """Writes the layout of ``params`` and their values as version 0, or checks an existing store matches.

        Returns the committed version. Raises ``StoreError`` (and writes nothing) when the store already holds
        a different layout or another optimizer.
        """
        self._check_open()
        layout = Layout.from_tree(params, num_shards=self.num_shards, page_bytes=self.page_bytes)
        if self.initialized:
            diff = self.layout.describe_difference(layout)
            if diff:
                raise StoreError(f"store {self.root or '(memory)'} holds a different layout: {diff}")
            if self.optimizer != optimizer:
                raise StoreError(
                    f"store {self.root or '(memory)'} was created for {self.optimizer}, not {optimizer}"
                )
            return self.version
        self.layout, self.optimizer = layout, optimizer
        self._make_engines(create=True)
        used = optimizer.states_used()
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
        # Written a few pages at a time, straight from the leaves: no flat copy of the model is ever made.
        chunk = layout.page_elems * max(1, _INIT_CHUNK_BYTES // (4 * layout.page_elems))

        def init_shard(i):
            engine = self._engines[i]
            begin = i * layout.shard_size
            size = min(chunk, layout.shard_size)
            mu0, nu0 = np.zeros(size, np.float32), np.full(size, optimizer.initial_nu, np.float32)
            for at in range(0, layout.shard_size, chunk):
                n = min(chunk, layout.shard_size - at)
                page = at // layout.page_elems
                engine.write_pages(0, 0, page, layout.gather(leaves, begin + at, n))
                if used[1]:
                    engine.write_pages(0, 1, page, mu0[:n])
                if used[2]:
                    engine.write_pages(0, 2, page, nu0[:n])
            engine.sync(0)

        try:
            list(self._pool.map(init_shard, range(self.num_shards)))
            for engine in self._engines:
                engine.commit(0)
            if self.root is not None:
                # Written last: a store without metadata is an empty one, whatever else a crash left behind.
                _atomic_write_json(self.root / METADATA, self._metadata())
        except (RuntimeError, OSError) as e:
            self.layout = self.optimizer = None
            self._engines = []
            raise StoreError(f"cannot initialize store {self.root or '(memory)'}: {e}") from e
        return 0

    def _metadata(self) -> dict:
        return {
            "format": "nsp-store",
            "format_version": FORMAT_VERSION,
            "store_id": self.store_id,
            "tier": self.tier,
            "page_bytes": self.page_bytes,
            "checksum": self.checksum,
            "shard_paths": [_recorded_path(p, self.root) for p in self.shard_paths],
            "layout": self.layout.to_json(),
            "optimizer": dataclasses.asdict(self.optimizer),
        }

    def _make_engines(self, create: bool, version: int = 0, checksums: list[dict] | None = None) -> None:
        """One engine per shard at committed ``version``; ``checksums``: each shard's page checksums per slot
        and state, from its manifest (reads then check every page against them)."""
        used = list(self.optimizer.states_used())
        backend = "memory" if self.tier == "memory" else "file"
        if backend == "file" and create:
            for shard in self.shard_paths:
                self._create_arrays(shard, used)
        self._engines = []
        for i, shard in enumerate(self.shard_paths or [None] * self.num_shards):
            engine = _nsp_ffi.ShardEngine(backend, str(shard) if shard else "", self.layout.shard_size,
                                          self.layout.page_elems, self.pages_in_flight, used, self.checksum,
                                          in_place=self.in_place)
            engine.set_manifest(str(shard / MANIFEST) if shard else "", version, self.store_id, i)
            for slot, states in (checksums[i] if checksums else {}).items():
                for state, crcs in states.items():
                    if state != "version":
                        engine.set_page_checksums(slot, STATES.index(state), crcs)
            self._engines.append(engine)

    def _create_arrays(self, shard: Path, used: list[bool]) -> None:
        """Creates every slot's state arrays through tensorstore (it owns the format; the engine follows it)."""
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.checksum:
            codecs.append({"name": "crc32c"})
        for slot in (0, 1):
            for state, is_used in zip(STATES, used):
                if not is_used:
                    continue
                path = shard / f"slot{slot}" / state
                spec = {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": str(path)},
                    "metadata": {
                        "shape": [self.layout.shard_size],
                        "data_type": "float32",
                        "chunk_grid": {"name": "regular",
                                       "configuration": {"chunk_shape": [self.layout.page_elems]}},
                        "chunk_key_encoding": {"name": "default"},
                        "codecs": codecs,
                        "fill_value": 0.0,
                        "attributes": {"nsp": {"state": state, "slot": slot}},
                    },
                }
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
            (a fresh array's first touch costs about as much as the kernel's pass). Needs ``params_out``.

        Returns:
          ``{"params": flat fp32, "params_bf16": flat bf16}`` (those asked for), ``layout.padded_total`` long, and
          ``"skipped"``: True when the gradient held NaN or Inf, in which case the store is untouched (still at
          ``version``) and the params are that version's.
        """
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet: call initialize(params, optimizer) first")
        if version not in self.held_versions():
            raise StoreError(f"the store no longer holds version {version}: it holds {self.held_versions()} "
                             f"(committed: {self.version})")
        n, shard_size = self.num_shards, self.layout.shard_size
        kw_shards = self._split_grads(grad, indices, values)
        if params_into is not None:
            if not params_out:
                raise ValueError("params_into needs params_out=True")
            if (not isinstance(params_into, np.ndarray) or params_into.dtype != np.float32
                    or params_into.shape != (n * shard_size,) or not params_into.flags.c_contiguous
                    or not params_into.flags.writeable):
                what = (f"{params_into.dtype}{list(params_into.shape)}" if isinstance(params_into, np.ndarray)
                        else type(params_into).__name__)
                raise ValueError(f"params_into must be a writeable, C-contiguous float32 array of "
                                 f"{n * shard_size} elements (layout.padded_total), got {what}")
        params = params_into if params_into is not None else (
            np.empty(n * shard_size, np.float32) if params_out else None)
        # One multithreaded C++ pass per array (numpy's isfinite is one thread plus a temporary as big as the
        # gradient); bf16 arrays travel as uint16 bit patterns, which all_finite reads as bf16.
        finite = all(_nsp_ffi.all_finite(a) for kw in kw_shards for k, a in kw.items() if k != "indices")
        if not finite:  # skip the step on every shard: the store stays at `version`
            if version != self.version:
                raise StoreError(f"cannot skip from version {version}: the store is at {self.version}")
            list(self._pool.map(lambda i: self._engines[i].skip(
                version, None if params is None else params[i * shard_size:(i + 1) * shard_size]), range(n)))
            out = {"skipped": True}
            if params is not None:
                out["params"] = params
            if bf16_out:
                import ml_dtypes

                out["params_bf16"] = self.read("param").astype(ml_dtypes.bfloat16)
            return out
        params16 = np.empty(n * shard_size, np.uint16) if bf16_out else None
        o = self.optimizer
        hyper = (KINDS[o.kind], float(lr), int(step), o.b1, o.b2, o.eps, o.weight_decay, o.momentum, o.nesterov,
                 o.lazy)

        def run(i):
            # Each shard reads `version`, writes the other slot, syncs and commits version + 1 on its own.
            sl = slice(i * shard_size, (i + 1) * shard_size)
            self._engines[i].step(
                version, *hyper, **kw_shards[i],
                params_out=None if params is None else params[sl],
                params_bf16_out=None if params16 is None else params16[sl],
            )

        futures = [self._pool.submit(run, i) for i in range(n)]
        errors = [f.exception() for f in futures]
        errors = [e for e in errors if e is not None]
        if errors:
            raise StoreError(f"update from version {version} failed; version {self.version} is intact: "
                             f"{errors[0]}") from errors[0]
        out = {"skipped": False}
        if params is not None:
            out["params"] = params
        if params16 is not None:
            import ml_dtypes

            out["params_bf16"] = params16.view(ml_dtypes.bfloat16)
        return out

    def _split_grads(self, grad, indices, values) -> list[dict]:
        import ml_dtypes

        n, shard_size = self.num_shards, self.layout.shard_size

        def as_kw(arr, name):
            arr = np.asarray(arr)
            if arr.dtype == ml_dtypes.bfloat16:
                return {f"{name}_bf16": np.ascontiguousarray(arr).view(np.uint16)}
            if arr.dtype != np.float32:
                raise TypeError(f"{name} must be float32 or bfloat16, got {arr.dtype}")
            return {name: np.ascontiguousarray(arr)}

        if grad is not None:
            parts = list(grad) if isinstance(grad, (list, tuple)) else None
            if parts is None:
                flat = np.asarray(grad).reshape(-1)
                if flat.size != n * shard_size:
                    raise ValueError(f"grad has {flat.size} elements; the store holds {n} shards x {shard_size} "
                                     f"= {n * shard_size} (layout.flatten pads to that)")
                parts = [flat[i * shard_size:(i + 1) * shard_size] for i in range(n)]
            if len(parts) != n:
                raise ValueError(f"got {len(parts)} gradient shards for {n} store shards")
            return [as_kw(p, "grad") for p in parts]
        if indices is None or values is None:
            raise ValueError("update needs either grad or both indices and values")
        if len(indices) != n or len(values) != n:
            raise ValueError(f"compressed gradients need one (indices, values) pair per shard ({n})")
        out = []
        for idx, val in zip(indices, values):
            idx = np.asarray(idx)
            if idx.dtype != np.int32:
                raise TypeError(f"indices must be int32, got {idx.dtype}")
            out.append({"indices": np.ascontiguousarray(idx), **as_kw(val, "values")})
        return out

    # ---- reading -----------------------------------------------------------------------------------------------

    def read(self, state: str = "param", version: int | None = None) -> np.ndarray:
        """The padded flat fp32 vector of ``state`` at ``version`` (default: the committed one)."""
        self._check_open()
        if not self.initialized:
            raise StoreError("the store holds no state yet")
        if state not in STATES or not self.optimizer.states_used()[STATES.index(state)]:
            raise ValueError(f"{self.optimizer.kind} keeps no state {state!r}")
        version = self.version if version is None else version
        if version not in self.held_versions():
            raise StoreError(f"the store no longer holds version {version} (it holds {self.held_versions()})")
        out = np.empty(self.layout.padded_total, np.float32)
        size = self.layout.shard_size
        list(self._pool.map(
            lambda i: self._engines[i].read_state(version % 2, STATES.index(state), out[i * size:(i + 1) * size]),
            range(self.num_shards)))
        return out

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
        slowest shard); ``wait_ns``, the time staleness-1 steps held their callers (waiting for the previous
        background update, copying the gradient): the part of the update staleness did not hide;
        ``buffer_bytes``, the engines' page buffers.
        """
        per_shard = [engine.stats() for engine in self._engines]
        totals: dict[str, int] = {}
        for shard in per_shard:
            for key, value in shard.items():
                totals[key] = totals.get(key, 0) + value
        # Shards update in parallel: a step takes as long as its slowest shard, and counts once, not per shard.
        for key in ("updates", "update_ns", "skipped", "wait_ns"):
            totals[key] = max((shard[key] for shard in per_shard), default=0)
        totals["buffer_bytes"] = sum(e.buffer_bytes for e in self._engines)
        return totals

    def reset_stats(self) -> None:
        for engine in self._engines:
            engine.reset_stats()

    def __repr__(self) -> str:
        where = self.root or "memory"
        tier = self.tier + (", in place" if self.in_place else "")
        return (f"StateStore({where}, tier={tier}, shards={self.num_shards}, version={self.version}, "
                f"optimizer={self.optimizer.kind if self.optimizer else None})")


def open(  # noqa: A001  (mirrors tensorstore.open / builtins.open on purpose)
    path: str | os.PathLike | None = None,
    *,
    tier: str | None = None,
    num_shards: int | None = None,
    page_bytes: int | None = None,
    shard_paths: list[str | os.PathLike] | None = None,
    pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT,
    checksum: bool = True,
    in_place: bool = False,
) -> StateStore:
    """Opens the store at ``path``, or creates an empty one there.

    Args:
      path: the store's directory (``file``/``csd`` tiers); ``None`` for the ``memory`` tier.
      tier: ``"memory"`` (host RAM), ``"file"`` (NVMe/SSD) or ``"csd"`` (for now the file tier with one
        engine worker per shard, like one computational-storage device per shard). Default: ``"file"`` with a
        path, ``"memory"`` without.
      num_shards: equal shards the flattened state is cut into (one per mesh device / storage device);
        default 1 for a new store.
      page_bytes: page (and zarr chunk) size; 4 MiB by default for a new store.
      For an existing store, ``None`` accepts what it was created with; a value must match it.
      shard_paths: one directory per shard (each on its own disk, say); default ``path/shards/NNNNN``.
      pages_in_flight: buffers the file tier streams through per shard (peak extra memory is
        ``pages_in_flight x 3 x page_bytes`` per shard; 8 by default).
      checksum: CRC-32C per page (zarr v3 ``crc32c`` codec), verified on every read.
      in_place: ``memory`` tier only. ``False`` (default) keeps two version slots: an update reads version
        ``t`` and writes ``t+1`` beside it, so the step can be replayed from ``t``. ``True`` keeps one copy of
        the state and updates it in place: half the RAM (12 instead of 24 B/param for Adam) and the kernel's
        speed (no second copy to write), but a step cannot be replayed; updating from the version before the
        committed one is then an error like any stale version.

    Returns:
      A ``StateStore``. An existing store is checked against the arguments; a new one holds no state until
      ``initialize``.

    Example::

      store = nsp.storage.open("/nvme/run1/store", tier="file", num_shards=2)
      store.initialize(params, nsp.storage.OptimizerSpec("adamw", weight_decay=0.1))
    """
    asked_tier = tier
    if tier is None:
        tier = "file" if path is not None else "memory"
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    if page_bytes is not None:
        check_page_bytes(page_bytes)
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if pages_in_flight < 2:
        raise ValueError(f"pages_in_flight must be >= 2, got {pages_in_flight}")
    if in_place and tier != "memory":
        raise ValueError(f"in_place=True is for the memory tier; the {tier} tier keeps two version slots so "
                         "that a crash leaves a whole committed version")
    if tier == "memory":
        if path is not None or shard_paths:
            raise ValueError("the memory tier keeps its state in RAM: pass no path or shard_paths")
        return StateStore(None, tier, num_shards or 1, page_bytes or PAGE_BYTES_DEFAULT, [], pages_in_flight,
                          checksum, in_place)
    if path is None:
        raise ValueError(f"the {tier} tier needs a directory path")
    root = Path(path).absolute()
    if root.exists() and not root.is_dir():
        raise StoreError(f"store path {root} exists and is not a directory")
    parent = root.parent
    if not parent.exists():
        raise StoreError(f"cannot create store {root}: directory {parent} does not exist")
    try:
        root.mkdir(exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create store directory {root}: {e.strerror}") from None
    if not os.access(root, os.W_OK):
        raise StoreError(f"store directory {root} is not writable")
    meta_path = root / METADATA
    if meta_path.exists():
        return _open_existing(root, asked_tier, num_shards, page_bytes, shard_paths, pages_in_flight)
    num_shards = num_shards or 1
    page_bytes = page_bytes or PAGE_BYTES_DEFAULT
    if shard_paths is not None:
        if len(shard_paths) != num_shards:
            raise ValueError(f"got {len(shard_paths)} shard_paths for {num_shards} shards")
        shards = [Path(p).absolute() for p in shard_paths]
        if len(set(shards)) != len(shards):
            raise ValueError(f"shard_paths names one directory twice: {[str(p) for p in shards]}")
    else:
        shards = [root / "shards" / f"{i:05d}" for i in range(num_shards)]
    store = StateStore(root, tier, num_shards, page_bytes, shards, pages_in_flight, checksum)
    for i, shard in enumerate(shards):
        _claim_shard(store, i, shard)
    try:
        store._acquire_locks()
        for i, shard in enumerate(shards):
            _atomic_write_json(shard / SHARD_ID, {"store": store.store_id, "shard": i, "root": str(root)})
    except BaseException:
        store._life.release()
        raise
    _say_external(store)
    return store


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _recorded_path(shard: Path, root: Path) -> str:
    """How nsp_store.json records a shard: relative to the root when it lives under it (so a copied or moved store
    opens its own shards), absolute otherwise (a directory the user placed on purpose)."""
    return str(shard.relative_to(root)) if _inside(shard, root) else str(shard)


def _say_external(store: StateStore) -> None:
    if store.external_shards:
        warnings.warn(f"store {store.root} keeps shards outside its directory: "
                      f"{[str(p) for p in store.external_shards]}; a copy of {store.root} does not include them "
                      "(nsp store copy does)", ExternalShardsWarning, stacklevel=3)


class ExternalShardsWarning(UserWarning):
    """A store keeps some shards outside its directory (said at open, since a copy of the directory lacks them)."""


def _claim_shard(store: StateStore, index: int, shard: Path) -> None:
    """A new store's shard directory: created, or empty, or a leftover of an unfinished creation of this same
    store directory. A shard of another store is refused before anything is written into it."""
    try:
        shard.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create shard directory {shard}: {e.strerror}") from None
    ident = shard / SHARD_ID
    if ident.exists():
        owner = _read_json(ident, "shard identity")
        if not (isinstance(owner, dict) and owner.get("root") == str(store.root)):
            raise StoreError(f"cannot create store {store.root}: shard directory {shard} belongs to the store at "
                             f"{owner.get('root') if isinstance(owner, dict) else '?'} (id "
                             f"{owner.get('store') if isinstance(owner, dict) else '?'}); pick another directory")
    elif any(p.name != LOCK for p in shard.iterdir()):
        raise StoreError(f"cannot create store {store.root}: shard directory {shard} is not empty")


def _open_existing(root: Path, tier, num_shards, page_bytes, shard_paths, pages_in_flight) -> StateStore:
    # Everything read from disk is checked before anything is opened for writing.
    meta = check_metadata(_read_json(root / METADATA, "store metadata"), str(root / METADATA))
    layout = meta["layout"]
    tier = meta["tier"] if tier is None else tier
    num_shards = layout.num_shards if num_shards is None else num_shards
    page_bytes = meta["page_bytes"] if page_bytes is None else page_bytes
    for name, asked, held in (("tier", tier, meta["tier"]), ("num_shards", num_shards, layout.num_shards),
                              ("page_bytes", page_bytes, meta["page_bytes"])):
        if asked != held:
            raise StoreError(f"store {root} was created with {name}={held!r}, opened with {name}={asked!r}")
    try:
        optimizer = OptimizerSpec(**meta["optimizer"])
    except (TypeError, ValueError) as e:
        raise StoreError(f"{root / METADATA}: field 'optimizer' is invalid: {e}") from None
    shards = [root / p for p in meta["shard_paths"]]  # an absolute path stays as it is
    if shard_paths is not None and [Path(p).absolute() for p in shard_paths] != shards:
        raise StoreError(f"store {root} keeps its shards at {[str(s) for s in shards]}")
    store_id = meta["store_id"]
    for i, shard in enumerate(shards):
        ident = shard / SHARD_ID
        if not ident.is_file():
            raise StoreError(f"{root / METADATA}: field 'shard_paths' names {shard} as shard {i}, but it holds no "
                             f"shard ({ident} is missing)")
        check_shard_id(_read_json(ident, "shard identity"), str(ident), store_id, i, root,
                       external=not _inside(shard, root))
    store = StateStore(root, tier, num_shards, page_bytes, shards, pages_in_flight, meta["checksum"],
                       store_id=store_id)
    try:
        store._acquire_locks()
        store.layout, store.optimizer = layout, optimizer
        version, checksums = _recover_version(store)
        _check_pages_present(store, version)
        _check_checksums_recorded(store, version, checksums)
        store._make_engines(create=False, version=version, checksums=checksums)
    except BaseException:
        store._life.release()
        raise
    _say_external(store)
    return store


def _check_pages_present(store: StateStore, version: int) -> None:
    """Every page of the committed version must exist (a version is committed only once all its pages are
    durable): a manifest naming a version whose slot lacks pages is a damaged store, said at open."""
    pages = store.layout.pages_per_shard
    for shard in store.shard_paths:
        for state, used in zip(STATES, store.optimizer.states_used()):
            if not used:
                continue
            chunks = shard / f"slot{version % 2}" / state / "c"
            present = sum(1 for p in chunks.iterdir() if p.name.isdigit()) if chunks.is_dir() else 0
            if present < pages:
                raise StoreError(f"store {store.root}: its manifest names version {version}, but "
                                 f"{chunks} holds {present} of its {pages} pages: the store is damaged")


def _check_checksums_recorded(store: StateStore, version: int, checksums: list[dict]) -> None:
    """Each manifest records the checksum of every page of the committed version, for the version its slot
    holds (a manifest naming a version its slot does not hold is damage)."""
    used = store.optimizer.states_used()
    for shard, tables in zip(store.shard_paths, checksums):
        recorded = tables.get(version % 2, {})
        missing = [s for s, u in zip(STATES, used) if u and s not in recorded]
        if store.checksum and missing:
            raise StoreError(f"{shard / MANIFEST} records no page checksums of {missing} for version {version}: "
                             "the store is damaged")
        if recorded and recorded["version"] != version:
            raise StoreError(f"{shard / MANIFEST}: field 'version' names version {version}, but the slot it lives "
                             f"in holds version {recorded['version']}: the store is damaged")


def _recover_version(store: StateStore) -> tuple[int, list[dict]]:
    """The committed version, and each shard's page checksums. Every shard commits on its own, so a crash
    between shard commits leaves some one version ahead. Those never started another update (the next one needs
    every shard's commit first), so their other slot still holds the older version whole: they roll back to it."""
    used = store.optimizer.states_used()
    manifests = []
    for i, shard in enumerate(store.shard_paths):
        path = shard / MANIFEST
        manifests.append(check_manifest(_read_json(path, "shard manifest"), str(path), store.store_id, i,
                                        store.layout.pages_per_shard, used))
    versions = [m["version"] for m in manifests]
    low, high = min(versions), max(versions)
    if high - low > 1:
        raise StoreError(f"shard versions {versions} differ by more than one step: the store is inconsistent")
    for shard, m in zip(store.shard_paths, manifests):
        if m["version"] != low:
            tables = {str(slot): states for slot, states in m["checksums"].items()}
            _atomic_write_json(shard / MANIFEST, {"store": store.store_id, "shard": store.shard_paths.index(shard),
                                                  "version": low, "checksums": tables})
    return low, [m["checksums"] for m in manifests]
