"""Resharding: a checkpoint's store cut again for another shard count or process count.

Each state of a store (``param``, ``mu``, ``nu``) is one fp32 vector of the layout's ``padded_total`` elements, the
real ones first and zeros after, cut into ``num_shards`` equal contiguous shards (``layout.py``). A run of N
processes x D devices has N*D shards, and its checkpoint holds them in N parts (``store/process-NNNNN``; the item
itself for one process). Another layout needs the same vectors cut again: the leaves, and so the real elements,
are the same; only the shard count changes (with it the shard size, the padding, and for shards smaller than a page
the page size). Nothing else in a store depends on it: the optimizer update is elementwise, and the version and the
step are the same for every shard. So each new shard is one range of the old vectors: ``ItemSource`` reads exactly
that range from the old shards' pages (each page's CRC-32C checked against its trailer and against the checksum the
shard's manifest recorded, where the snapshot has one) and ``write_snapshot`` writes it as the new shard's pages, as
a snapshot that ``restore.py`` restores like any other. Pages in the store's own format (``format.zarr_spec``) are
read and written directly, several at a time (the copy is bound by the disk, not by a library's per-chunk work);
arrays in any other zarr v3 format go through tensorstore.

- ``restore_resharded``: what a process of a run resumed on another layout does: builds a snapshot of its own new
  shards beside its store, restores it (hard links), removes it; the memory tier loads the ranges straight in.
- ``nsp.storage.reshard_checkpoint`` (``nsp ckpt reshard``) does a whole checkpoint step offline.
- ``ItemSource.read`` serves any range of a multi-process item (``export.py`` reads whole vectors through it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts

from nsp import engine as native
from nsp.storage.format import (METADATA, StoreError, atomic_write_json, fsync_dir, fsync_file, page_files,
                                read_json, shard_dir, trailer_checksums, zarr_spec)
from nsp.storage.layout import PAGES_IN_FLIGHT_DEFAULT, Layout
from nsp.storage.opening import open as open_store
from nsp.storage.restore import restore_store
from nsp.storage.snapshot import (CHECKSUMS, SNAPSHOT, SNAPSHOT_FORMAT, SNAPSHOT_FORMAT_VERSION, _layout_summary,
                                  load_snapshot_info)
from nsp.storage.store import OptimizerSpec, StateStore

#: The chunk cache tensorstore reads old pages through (shared by every array of a source).
SOURCE_CACHE_BYTES = 512 * 2**20
#: Through tensorstore: new arrays being copied at once by one ``write_snapshot``, and files being fsynced at once.
ARRAYS_IN_FLIGHT = 2
FSYNC_THREADS = 8
#: Pages copied at once by ``_copy_pages`` (each: its old pages read, checked, the new one written and fsynced).
COPY_THREADS = 8
#: Consecutive new pages one thread copies in a row.
PAGES_PER_JOB = 4


def page_bytes_of(layout: Layout) -> int:
    """The ``page_bytes`` a store of ``layout`` records: its pages' size, which is less than the size asked for
    when a shard is smaller than a page (more shards than the source had can make each one smaller)."""
    return layout.page_elems * 4


def layout_for(layout: Layout, num_shards: int, page_bytes: int) -> Layout:
    """``layout``'s leaves cut into ``num_shards`` shards, with the page size ``Layout.from_tree`` picks for that
    count (so a run on the new layout finds exactly this layout in its store)."""
    like = [jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype)) for leaf in layout.leaves]
    page_elems = Layout.from_tree(like, num_shards=num_shards, page_bytes=page_bytes).page_elems
    return Layout(layout.leaves, int(num_shards), page_elems)


def process_shards(num_shards: int, processes: int, process: int) -> list[int]:
    """The shards process ``process`` of ``processes`` holds: its devices' (contiguous, the same count each)."""
    if processes < 1 or num_shards % processes:
        raise StoreError(f"{num_shards} shards cannot be split evenly over {processes} processes (each process "
                         "holds the shards of its devices, the same number each)")
    per = num_shards // processes
    return list(range(process * per, (process + 1) * per))


@dataclasses.dataclass
class Part:
    """One process's part of a store item: where it is, whether it is there whole, and the shards it holds."""

    process: int | None  # None: the item is one lone process's snapshot
    path: Path
    present: bool
    shards: list[int]
    problem: str | None = None  # why a part that should be there is not usable
    info: dict | None = None


class ItemSource:
    """The state vectors of a checkpoint's store item (a snapshot, or the ``process-NNNNN`` parts of one), read
    by range of the flat vector whichever parts hold it.

    Parts that are missing or unfinished are recorded (``parts``, ``missing_shards``), not refused: ``read``
    refuses a range that needs one, naming the process whose part it is. ``check()`` refuses any.
    """

    def __init__(self, item_dir: str | os.PathLike, *, processes: int | None = None):
        """``processes``: how many processes wrote the item (the step's meta records it), to name parts that
        are missing altogether; by default what the parts present imply."""
        self.path = Path(item_dir).absolute()
        if not self.path.is_dir():
            raise StoreError(f"checkpoint store item {self.path} does not exist")
        self.parts: list[Part] = []
        if (self.path / SNAPSHOT).exists() or not any(self.path.glob("process-*")):
            info = load_snapshot_info(self.path)  # raises naming what is wrong with a lone snapshot
            self.parts.append(Part(None, self.path, True, _held(info), info=info))
        else:
            for part in sorted(p for p in self.path.glob("process-*") if p.is_dir()):
                try:
                    info = load_snapshot_info(part)
                except StoreError as e:
                    self.parts.append(Part(int(part.name.split("-")[1]), part, False, [], str(e)))
                    continue
                self.parts.append(Part(int(part.name.split("-")[1]), part, True, _held(info), info=info))
        good = [p for p in self.parts if p.present]
        if not good:
            raise StoreError(f"checkpoint store item {self.path} holds no complete part: "
                             + "; ".join(p.problem or p.path.name for p in self.parts))
        first = good[0].info
        for p in good[1:]:
            for key in ("version", "layout", "optimizer", "page_bytes", "checksum", "states"):
                if p.info.get(key) != first.get(key):
                    raise StoreError(f"checkpoint store item {self.path} is inconsistent: {p.path.name} holds "
                                     f"{key} {p.info.get(key)!r}, {good[0].path.name} {first.get(key)!r}")
        self.info = first
        self.meta = read_json(good[0].path / METADATA, "snapshot store metadata")
        self.layout = Layout.from_json(self.meta["layout"])
        self.version = int(first["version"])
        self.states = list(first["states"])
        n = self.layout.num_shards
        self._where = {i: p.path for p in good for i in p.shards}
        self.missing_shards = [i for i in range(n) if i not in self._where]
        # Parts absent altogether: the processes a run of `processes` had that left no directory at all.
        per = len(good[0].shards) if good[0].process is not None else n
        count = processes or (n // per if per and n % per == 0 else len(self.parts))
        if good[0].process is not None:
            seen = {p.process for p in self.parts}
            for q in range(count):
                if q not in seen:
                    self.parts.append(Part(q, self.path / f"process-{q:05d}", False, [],
                                           "the part is missing (no directory)"))
            self.parts.sort(key=lambda p: p.process)
        self._per = per
        self._arrays: dict[tuple[int, str], ts.TensorStore] = {}
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": SOURCE_CACHE_BYTES}})
        self._tables: dict[tuple[int, str], list[int] | None] = {}
        self._verified: set[tuple[int, str]] = set()

    def describe_parts(self) -> list[dict]:
        """Each part (every process's, missing ones too): which process wrote it, whether it is there whole, the
        shards it holds (or should hold), and what is wrong with it."""
        n = self.layout.num_shards
        out = []
        for p in self.parts:
            shards = p.shards if p.present else [i for i in range(n) if p.process is not None
                                                  and self.owner(i) == p.process]
            out.append({"process": 0 if p.process is None else p.process, "path": str(p.path),
                        "present": p.present, "shards": shards,
                        **({"problem": p.problem} if p.problem else {})})
        return out

    def owner(self, shard: int) -> int:
        """The process whose part holds (or should hold) ``shard``."""
        return shard // self._per if self._per else 0

    def check(self) -> None:
        """Raises ``StoreError`` when any shard's part is missing or unfinished."""
        if self.missing_shards:
            i = self.missing_shards[0]
            raise StoreError(self._missing_message(i))

    def _missing_message(self, shard: int) -> str:
        q = self.owner(shard)
        problem = next((p.problem for p in self.parts if p.process == q), None) or "missing"
        return (f"checkpoint store item {self.path}: shard {shard} of {self.layout.num_shards} is in no complete "
                f"part: process {q}'s part (process-{q:05d}): {problem} (the checkpoint directory must be one "
                "every process of the run wrote into, and every part must have finished)")

    def _array(self, shard: int, state: str) -> ts.TensorStore:
        key = (shard, state)
        if key not in self._arrays:
            if shard not in self._where:
                raise StoreError(self._missing_message(shard))
            snap = self._where[shard]
            self._verify(snap, shard, state)
            # Opened in one context with a chunk cache: old and new page boundaries rarely align, so most old pages
            # feed two new ones, and are read and checked once, not twice.
            self._arrays[key] = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                                         "path": str(shard_dir(snap, shard) / state)}},
                                        open=True, read=True, context=self._context).result()
        return self._arrays[key]

    def _verify(self, snap: Path, shard: int, state: str) -> None:
        """Each page's CRC-32C trailer against the checksum its shard's manifest recorded for this version (a
        file-tier snapshot keeps them): a page swapped for another valid page would read without error."""
        recorded = shard_dir(snap, shard) / CHECKSUMS
        if not recorded.exists():
            return
        tables = read_json(recorded, "snapshot page checksums").get("checksums") or {}
        if state not in tables:
            return
        found = trailer_checksums(shard_dir(snap, shard) / state)
        if found != [int(c) for c in tables[state]]:
            bad = next((k for k, (a, b) in enumerate(zip(found, tables[state])) if a != b), min(len(found),
                                                                                                 len(tables[state])))
            raise StoreError(f"snapshot {snap}: page {bad} of {state} in shard {shard} does not hold what the "
                             "shard's manifest recorded (damaged or replaced)")

    def pieces(self, state: str, begin: int, end: int) -> list[tuple[int, ts.TensorStore]]:
        """Where elements ``[begin, end)`` of ``state``'s flat vector are: ``(offset from begin, old shard's
        array cut to the range)`` for each old shard they overlap, real elements only (the rest is zeros)."""
        size = self.layout.shard_size
        out = []
        lo, stop = begin, min(end, self.layout.total)  # past the real elements everything is zero
        while lo < stop:
            shard = lo // size
            hi = min(stop, (shard + 1) * size)
            out.append((lo - begin, self._array(shard, state)[lo - shard * size:hi - shard * size]))
            lo = hi
        return out

    def raw_pages(self) -> bool:
        """Whether every array of every part is in the store's own page format (``format.zarr_spec``: one file per
        page of ``page_elems`` little-endian fp32, and a CRC-32C trailer when the store keeps checksums): then
        pages are read directly (``page``), not through tensorstore."""
        expected = zarr_spec(Path("."), 1, self.layout.page_elems, bool(self.meta["checksum"]), "param", 0)
        want = expected["metadata"]
        for shard, snap in self._where.items():
            for state in self.states:
                got = read_json(shard_dir(snap, shard) / state / "zarr.json", "snapshot array metadata")
                if (got.get("codecs") != want["codecs"] or got.get("data_type") != want["data_type"]
                        or got.get("chunk_grid") != want["chunk_grid"]
                        or got.get("chunk_key_encoding") != want["chunk_key_encoding"]):
                    return False
        return True

    def page(self, shard: int, state: str, k: int) -> np.ndarray:
        """Page ``k`` of old shard ``shard``'s ``state`` (``page_elems`` elements), its CRC-32C trailer checked and
        checked against the manifest's record; an absent page (never written: zeros) is zeros. The result lives
        in this thread's read buffer: use it before the thread's next ``page``."""
        if shard not in self._where:
            raise StoreError(self._missing_message(shard))
        path = shard_dir(self._where[shard], shard) / state / "c" / str(k)
        n = self.layout.page_elems
        checksum = bool(self.meta["checksum"])
        expected = n * 4 + (4 if checksum else 0)
        raw = _thread_buffer("read", expected + 1)  # one byte more: a longer file shows
        # Where old and new page boundaries differ, consecutive new pages share an old page: the thread's last
        # page is still in its buffer.
        if getattr(_BUFFERS, "last", None) == (id(self), shard, state, k):
            return raw[:n * 4].view(np.float32)
        _BUFFERS.last = None
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(raw))
                got += f.readinto(memoryview(raw)[got:]) if got < expected else 0
        except FileNotFoundError:
            return np.zeros(n, np.float32)
        if got != expected:
            raise StoreError(f"page {path} has {'more than ' if got > expected else ''}{got} bytes, expected "
                             f"{expected}")
        if checksum:
            crc = native.crc32c(raw[:n * 4])
            trailer = int.from_bytes(raw[n * 4:expected].tobytes(), "little")
            recorded = self._recorded(shard, state)
            if crc != trailer:
                raise StoreError(f"page {path} is damaged: its CRC-32C is {crc:08x}, its trailer says {trailer:08x}")
            if recorded is not None and (k >= len(recorded) or int(recorded[k]) != crc):
                raise StoreError(f"snapshot {self._where[shard]}: page {k} of {state} in shard {shard} does not "
                                 "hold what the shard's manifest recorded (damaged or replaced)")
        _BUFFERS.last = (id(self), shard, state, k)
        return raw[:n * 4].view(np.float32)

    def _recorded(self, shard: int, state: str) -> list[int] | None:
        key = (shard, state)
        if key not in self._tables:
            path = shard_dir(self._where[shard], shard) / CHECKSUMS
            tables = read_json(path, "snapshot page checksums").get("checksums") or {} if path.exists() else {}
            self._tables[key] = tables.get(state)
        return self._tables[key]

    def read_pages(self, state: str, begin: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """``read`` page by page (``page``): elements ``[begin, end)`` of ``state``'s flat vector, into ``out``
        when given (which must hold zeros past the real elements)."""
        out = np.zeros(end - begin, np.float32) if out is None else out
        size, n = self.layout.shard_size, self.layout.page_elems
        lo, stop = begin, min(end, self.layout.total)
        while lo < stop:
            shard, offset = divmod(lo, size)
            k = offset // n
            hi = min(stop, shard * size + min(size, (k + 1) * n))
            page = self.page(shard, state, k)
            out[lo - begin:hi - begin] = page[offset - k * n:offset - k * n + hi - lo]
            lo = hi
        return out

    def read(self, state: str, begin: int = 0, end: int | None = None) -> np.ndarray:
        """Elements ``[begin, end)`` of ``state``'s flat vector (default: the whole padded vector)."""
        if state not in self.states:
            raise ValueError(f"the checkpoint holds no state {state!r} (it holds {self.states})")
        end = self.layout.padded_total if end is None else end
        out = np.zeros(end - begin, np.float32)
        reads = [(at, piece.read()) for at, piece in self.pieces(state, begin, end)]
        for at, future in reads:
            data = future.result()
            out[at:at + data.shape[0]] = data
        return out


_BUFFERS = threading.local()


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """A uint8 buffer of at least ``nbytes`` that this thread reuses (its first ``nbytes``)."""
    buf = getattr(_BUFFERS, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(nbytes, np.uint8)
        setattr(_BUFFERS, name, buf)
    return buf[:nbytes]


def _held(info: dict) -> list[int]:
    return list(info.get("local_shards", range(info["layout"]["num_shards"])))


# ---- writing the new shards --------------------------------------------------------------------------------------


def write_snapshot(source: ItemSource, dest: str | os.PathLike, num_shards: int, *,
                   shards: Sequence[int] | None = None, pool: concurrent.futures.Executor | None = None) -> dict:
    """Writes a snapshot of ``source``'s state cut into ``num_shards`` shards at ``dest`` (new; built under a
    temporary name beside it and renamed into place, so ``dest`` exists only complete): all of them, or only
    ``shards`` (one process's part). ``pool``: the threads that copy pages (default: ``COPY_THREADS`` of its
    own); several snapshots written at once share one. Returns its description (``load_snapshot_info``'s, with
    ``seconds`` and ``read_bytes``/``written_bytes``)."""
    t0 = time.perf_counter()
    dest = Path(dest).absolute()
    if dest.exists():
        raise StoreError(f"{dest} already exists")
    if not dest.parent.is_dir():
        raise StoreError(f"cannot create {dest}: directory {dest.parent} does not exist")
    new = layout_for(source.layout, num_shards, int(source.meta["page_bytes"]))
    local = list(range(num_shards)) if shards is None else sorted(int(s) for s in shards)
    if any(not 0 <= s < num_shards for s in local):
        raise StoreError(f"shards {local} are not all among the {num_shards} shards")
    for j in local:  # every old shard this needs must be there before anything is written
        lo, hi = j * new.shard_size, min((j + 1) * new.shard_size, source.layout.total)
        for i in range(lo // source.layout.shard_size, -(-hi // source.layout.shard_size)) if lo < hi else ():
            if i in source.missing_shards:
                raise StoreError(source._missing_message(i))
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        # The store's own page format is copied page by page (``_copy_pages``); anything else through tensorstore.
        if not source.raw_pages():
            files = _copy_through_tensorstore(source, new, tmp, local)
        elif pool is None:
            with concurrent.futures.ThreadPoolExecutor(COPY_THREADS) as own:
                files = _copy_pages(source, new, tmp, local, own)
        else:
            files = _copy_pages(source, new, tmp, local, pool)
        fsync_dir(tmp / "shards")
        meta = dict(source.meta, layout=new.to_json(), page_bytes=page_bytes_of(new))
        atomic_write_json(tmp / METADATA, meta)
        record = {
            "format": SNAPSHOT_FORMAT, "format_version": SNAPSHOT_FORMAT_VERSION, "version": source.version,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": {"resharded_from": str(source.path), "num_shards": source.layout.num_shards},
            "page_bytes": page_bytes_of(new), "checksum": bool(source.meta["checksum"]),
            "layout": _layout_summary(new), "optimizer": source.info["optimizer"], "states": source.states,
            "arrays": "shards/{shard:05d}/{state}",
            **({"local_shards": local} if shards is not None else {}),
            "method": "reshard", "fallback_reason": None, "linked_files": 0, "linked_bytes": 0,
            "reflinked_files": 0, "reflinked_bytes": 0, "copied_files": len(files),
            "copied_bytes": sum(f["bytes"] for f in files),
            "num_files": len(files), "total_bytes": sum(f["bytes"] for f in files), "files": files,
        }
        atomic_write_json(tmp / SNAPSHOT, record)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = load_snapshot_info(dest, check_files=False)
    info.pop("files", None)
    info["seconds"] = time.perf_counter() - t0
    info["written_bytes"] = record["total_bytes"]
    info["read_bytes"] = len(local) * new.shard_size * 4 * len(source.states)
    return info


def _copy_pages(source: ItemSource, new: Layout, snap: Path, local: list[int],
                pool: concurrent.futures.Executor) -> list[dict]:
    """The new shards' arrays in snapshot ``snap``, page by page: each new page assembled from the old pages it
    overlaps (``ItemSource.page``: read whole, CRC-32C checked), its own CRC-32C trailer appended, written and
    fsynced, by the threads of ``pool`` (file I/O and the CRC release the GIL: the disk and the cores overlap). Each array's ``zarr.json`` is tensorstore's, so the arrays are plain zarr v3 as ever."""
    checksum = bool(source.meta["checksum"])
    n = new.page_elems
    jobs = []
    for j in local:
        for state in source.states:
            path = shard_dir(snap, j) / state
            ts.open(zarr_spec(path, new.shard_size, n, checksum, state, source.version % 2, sync=False),
                    create=True).result()  # writes zarr.json (and nothing else)
            (path / "c").mkdir(exist_ok=True)
            # Runs of consecutive pages, each copied by one thread in order (sharing the old pages between them).
            jobs += [(path, state, j, k) for k in range(0, new.pages_per_shard, PAGES_PER_JOB)]

    def write(job) -> None:
        path, state, j, first = job
        for k in range(first, min(first + PAGES_PER_JOB, new.pages_per_shard)):
            write_page(path, state, j, k)

    def write_page(path: Path, state: str, j: int, k: int) -> None:
        begin = j * new.shard_size + k * n
        count = min(n, new.shard_size - k * n)
        # Each thread reuses its buffers (a fresh 4 MiB array costs a thousand page faults and a zeroing).
        buf = _thread_buffer("write", n * 4 + 4)
        page = buf[:n * 4].view(np.float32)
        real = max(0, min(count, source.layout.total - begin))
        page[real:] = 0.0  # past the real elements, and past the shard's end (zarr stores an edge chunk whole)
        source.read_pages(state, begin, begin + real, out=page[:real])
        size = n * 4
        if checksum:
            buf[size:size + 4] = np.frombuffer(native.crc32c(buf[:size]).to_bytes(4, "little"), np.uint8)
            size += 4
        fd = os.open(path / "c" / str(k), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(buf)[:size]
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    for done in [pool.submit(write, job) for job in jobs]:
        done.result()
    files = []
    for path in dict.fromkeys(job[0] for job in jobs):
        fsync_file(path / "zarr.json")
        for d in (path / "c", path, path.parent):
            fsync_dir(d)
        files += _array_files(snap, path)
    return files


def _copy_through_tensorstore(source: ItemSource, new: Layout, snap: Path, local: list[int]) -> list[dict]:
    """The new shards' arrays in snapshot ``snap`` through tensorstore (old pages into new ones chunk by chunk on
    its own threads, checking and computing each page's CRC-32C), for arrays in any zarr v3 format. A few arrays at
    a time, each made durable as soon as it is written: the disk writes one back while the next is copied."""
    files: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(FSYNC_THREADS) as syncs:
        synced, in_flight = [], []
        for j in local:
            for state in source.states:
                in_flight.append(_start_copy(source, new, snap, j, state))
                if len(in_flight) >= ARRAYS_IN_FLIGHT:
                    synced += _finish_copy(snap, in_flight.pop(0), syncs, files)
        while in_flight:
            synced += _finish_copy(snap, in_flight.pop(0), syncs, files)
        for f in synced:
            f.result()
    return files


def _start_copy(source: ItemSource, new: Layout, snap: Path, j: int, state: str) -> tuple[Path, list]:
    """Starts writing new shard ``j``'s ``state`` array in snapshot ``snap`` from the old shards' arrays: returns
    the array's directory and the write futures."""
    path = shard_dir(snap, j) / state
    spec = zarr_spec(path, new.shard_size, new.page_elems, bool(source.meta["checksum"]), state,
                     source.version % 2, sync=False)  # made durable once, by fsync_files
    spec["store_data_equal_to_fill_value"] = True  # every page a file, as the store keeps them, zeros or not
    arr = ts.open(spec, create=True).result()
    base = j * new.shard_size
    futures, covered = [], 0
    for at, piece in source.pieces(state, base, base + new.shard_size):
        n = piece.shape[0]
        futures.append(arr[at:at + n].write(piece.translate_to[at]))
        covered = at + n
    if covered < new.shard_size:  # the padding (past the real elements): zeros, written as pages like the rest
        futures.append(arr[covered:].write(np.zeros(new.shard_size - covered, np.float32)))
    return path, futures


def _finish_copy(snap: Path, job: tuple[Path, list], syncs: concurrent.futures.Executor,
                 files: list[dict]) -> list[concurrent.futures.Future]:
    """Waits for one array's copy, lists its files into ``files`` and starts their fsyncs (returned)."""
    path, futures = job
    for f in futures:
        f.result()
    written = _array_files(snap, path)
    files += written
    paths = [snap / f["path"] for f in written]
    return ([syncs.submit(fsync_file, p) for p in paths]
            + [syncs.submit(lambda: [fsync_dir(d) for d in (path / "c", path, path.parent)])])


def _array_files(snap: Path, path: Path) -> list[dict]:
    rel = path.relative_to(snap)
    return ([{"path": f"{rel}/zarr.json", "bytes": (path / "zarr.json").stat().st_size}]
            + [{"path": f"{rel}/c/{name}", "bytes": size} for name, size in page_files(path)])


def fsync_files(paths: list[Path], threads: int = 8) -> None:
    """fsync of every file, several at a time: the disk gets more than one file's writeback to work on."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fsync_file, paths))


# ---- restoring a process's shards on another layout ----------------------------------------------------------------


def restore_resharded(item_dir: str | os.PathLike, store_path: str | os.PathLike | None, num_shards: int, *,
                      shards: Sequence[int] | None = None, tier: str = "file", overwrite: bool = False,
                      pages_in_flight: int = PAGES_IN_FLIGHT_DEFAULT) -> StateStore:
    """Restores a checkpoint's store item, written on any layout, as ``num_shards`` shards: all of them, or only
    ``shards`` (this process's, one of several), at ``store_path`` (``None`` for the memory tier). The file tiers
    get a snapshot of those shards written beside ``store_path`` and restored from it by hard link
    (``restore_store``), then removed; the memory tier loads the ranges straight in. Bit-identical: every element
    of the new shards is the old vector's."""
    source = ItemSource(item_dir)
    t0 = time.perf_counter()
    if tier == "memory":
        store = _restore_memory(source, num_shards, shards, pages_in_flight)
    else:
        if store_path is None:
            raise ValueError(f"the {tier} tier needs a store_path")
        root = Path(store_path).absolute()
        staging = root.with_name(f".{root.name}.reshard-{uuid.uuid4().hex[:8]}")
        try:
            write_snapshot(source, staging, num_shards, shards=shards)
            store = restore_store(staging, root, tier=tier, overwrite=overwrite, mode="auto",
                                  pages_in_flight=pages_in_flight, shards=shards)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # the store keeps its own links to the pages
    store.restore_info = {"snapshot": str(source.path), "version": source.version, "method": "reshard",
                          "from_shards": source.layout.num_shards, "seconds": time.perf_counter() - t0}
    return store


def _restore_memory(source: ItemSource, num_shards: int, shards: Sequence[int] | None,
                    pages_in_flight: int) -> StateStore:
    new = layout_for(source.layout, num_shards, int(source.meta["page_bytes"]))
    store = open_store(None, tier="memory", num_shards=num_shards, page_bytes=page_bytes_of(new),
                       pages_in_flight=pages_in_flight, checksum=bool(source.meta["checksum"]),
                       shards=None if shards is None else list(shards))
    try:
        store.attach(new, OptimizerSpec(**source.meta["optimizer"]), source.version)
        for j in range(num_shards) if shards is None else shards:
            for state in source.states:
                store.load_state(state, j, source.read(state, j * new.shard_size, (j + 1) * new.shard_size))
    except BaseException:
        store.close()
        raise
    return store
