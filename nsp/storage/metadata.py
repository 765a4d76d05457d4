"""Checks of what a store reads from disk: ``nsp_store.json``, each shard's ``SHARD.json`` and ``MANIFEST.json``.

These files come from disk, so a damaged or hostile one must not steer nsp: every field is checked (type, range,
consistency with the layout and with the other files) before anything is opened for writing, and anything off
is a ``StoreError`` that names the file and the field. What the files are is ``format.py``'s.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from nsp.storage.format import FORMAT_VERSION, STATES, TIERS, StoreError
from nsp.storage.layout import Layout, Leaf

_MAX_SHARDS = 1 << 16
_MAX_PAGE_BYTES = 1 << 30  # 1 GiB pages: far past any sensible size, and a buffer the engine can allocate
_MAX_ELEMENTS = 1 << 44    # 16 Ti parameters
_DTYPES = ("float32", "bfloat16", "float16", "float64")
_STORE_ID = re.compile(r"[0-9a-f]{32}")
_BACKEND = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a backend name is part of its library's file name


def _field(where: str, name: str, problem: str) -> StoreError:
    return StoreError(f"{where}: field {name!r} {problem}")


def _int(where: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _field(where, name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _field(where, name, f"must be in [{low}, {high}], got {value}")
    return value


def check_store_id(where: str, value: Any, name: str = "store") -> str:
    if not isinstance(value, str) or not _STORE_ID.fullmatch(value):
        raise _field(where, name, f"must be a store id (32 hex digits), got {value!r}")
    return value


def check_metadata(meta: Any, where: str) -> dict:
    """Checks ``nsp_store.json``; returns it with ``layout`` as a ``Layout``."""
    if not isinstance(meta, dict):
        raise StoreError(f"{where} is not a JSON object")
    if meta.get("format") != "nsp-store":
        raise StoreError(f"{where} is not an nsp store")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{where} has format version {meta.get('format_version')!r}; this nsp reads "
                         f"{FORMAT_VERSION} (version 1 stores predate per-shard identity: restore them from an "
                         "export with the nsp that wrote them)")
    out = dict(meta)
    out["store_id"] = check_store_id(where, meta.get("store_id"), "store_id")
    if meta.get("tier") not in TIERS:
        raise _field(where, "tier", f"must be one of {TIERS}, got {meta.get('tier')!r}")
    backend = meta.get("backend")  # absent in stores written before backends were recorded
    if backend is not None and not (isinstance(backend, str) and _BACKEND.fullmatch(backend)):
        raise _field(where, "backend", f"must be a backend name (letters, digits, '_', '-'), got {backend!r}")
    page_bytes = _int(where, "page_bytes", meta.get("page_bytes"), 4096, _MAX_PAGE_BYTES)
    if page_bytes % 4096:
        raise _field(where, "page_bytes", f"must be a multiple of 4096, got {page_bytes}")
    if not isinstance(meta.get("checksum"), bool):
        raise _field(where, "checksum", f"must be true or false, got {meta.get('checksum')!r}")
    if "slots" in meta and (isinstance(meta["slots"], bool) or meta["slots"] not in (1, 2)):
        raise _field(where, "slots", f"must be 1 or 2 (version slots), got {meta['slots']!r}")
    layout = check_layout(meta.get("layout"), where)
    if layout.page_elems * 4 != page_bytes:
        raise _field(where, "layout.page_elems", f"is {layout.page_elems}, but page_bytes {page_bytes} holds "
                     f"{page_bytes // 4}")
    out["layout"] = layout
    paths = meta.get("shard_paths")
    if not isinstance(paths, list) or len(paths) != layout.num_shards or not all(isinstance(p, str) for p in paths):
        raise _field(where, "shard_paths", f"must list {layout.num_shards} paths, got {paths!r}")
    for p in paths:
        if not p or "\0" in p or (not Path(p).is_absolute() and ".." in Path(p).parts):
            raise _field(where, "shard_paths", f"holds {p!r}: a path inside the store must not leave it")
    if len(set(paths)) != len(paths):
        raise _field(where, "shard_paths", f"names one directory twice: {paths}")
    opt = meta.get("optimizer")
    if not isinstance(opt, dict):
        raise _field(where, "optimizer", f"must be an object, got {opt!r}")
    out["optimizer"] = opt
    return out


def check_layout(data: Any, where: str) -> Layout:
    if not isinstance(data, dict):
        raise _field(where, "layout", f"must be an object, got {data!r}")
    num_shards = _int(where, "layout.num_shards", data.get("num_shards"), 1, _MAX_SHARDS)
    page_elems = _int(where, "layout.page_elems", data.get("page_elems"), 1024, _MAX_PAGE_BYTES // 4)
    leaves_json = data.get("leaves")
    if not isinstance(leaves_json, list) or not leaves_json:
        raise _field(where, "layout.leaves", "must be a non-empty list")
    leaves, offset = [], 0
    for i, d in enumerate(leaves_json):
        name = f"layout.leaves[{i}]"
        if not isinstance(d, dict) or not isinstance(d.get("path"), str) or d.get("dtype") not in _DTYPES:
            raise _field(where, name, f"must have a path and a dtype in {_DTYPES}, got {d!r}")
        shape = d.get("shape")
        if not isinstance(shape, list) or len(shape) > 32:
            raise _field(where, f"{name}.shape", f"must be a list of dimensions, got {shape!r}")
        dims = tuple(_int(where, f"{name}.shape", x, 0, _MAX_ELEMENTS) for x in shape)
        if math.prod(dims) > _MAX_ELEMENTS:
            raise _field(where, f"{name}.shape", f"holds {math.prod(dims)} elements, more than {_MAX_ELEMENTS}")
        if _int(where, f"{name}.offset", d.get("offset"), 0, _MAX_ELEMENTS) != offset:
            raise _field(where, f"{name}.offset", f"is {d.get('offset')}, the leaves before it end at {offset}")
        leaves.append(Leaf(d["path"], dims, d["dtype"], offset))
        offset += math.prod(dims)
    layout = Layout(tuple(leaves), num_shards, page_elems)
    if offset < 1:
        raise _field(where, "layout.leaves", "hold no elements")
    for name in ("total", "shard_size"):
        if data.get(name) != getattr(layout, name):
            raise _field(where, f"layout.{name}", f"is {data.get(name)!r}, the leaves give {getattr(layout, name)}")
    return layout


def check_shard_id(data: Any, where: str, store_id: str, shard: int, root: Path, external: bool) -> None:
    """A shard's ``SHARD.json`` must name this store and this shard index. A shard outside the store's root must
    also name this root: a copied or moved store must not write the shards another store owns."""
    if not isinstance(data, dict):
        raise StoreError(f"{where} is not a JSON object")
    owner = check_store_id(where, data.get("store"))
    index = _int(where, "shard", data.get("shard"), 0, _MAX_SHARDS)
    owner_root = data.get("root")
    if not isinstance(owner_root, str):
        raise _field(where, "root", f"must be the owning store's directory, got {owner_root!r}")
    same_root = Path(owner_root).resolve() == Path(root).resolve()  # a path through a symlink is the same store
    if owner != store_id or (external and not same_root):
        raise StoreError(
            f"shard {Path(where).parent} belongs to the store at {owner_root} (id {owner}); the store at {root} "
            f"(id {store_id}) names it too. Two stores never share a shard: copy a store with `nsp store copy "
            f"SRC DST`; if you moved this store, `nsp store reidentify {root}` makes it the shard's owner")
    if index != shard:
        raise _field(where, "shard", f"is {index}, but the store lists this directory as shard {shard}")


def check_manifest(data: Any, where: str, store_id: str, shard: int, pages: int, used: tuple[bool, ...],
                   slots: int = 2) -> dict:
    """Checks a shard's ``MANIFEST.json``; returns ``{"version": int, "checksums": {slot: {"version": the version
    that slot holds, state: [crc]}}}``."""
    if not isinstance(data, dict):
        raise StoreError(f"{where} is not a JSON object")
    version = _int(where, "version", data.get("version"), 0, (1 << 31) - 2)
    if check_store_id(where, data.get("store")) != store_id:
        raise _field(where, "store", f"names store {data.get('store')}, not this store ({store_id})")
    if _int(where, "shard", data.get("shard"), 0, _MAX_SHARDS) != shard:
        raise _field(where, "shard", f"is {data.get('shard')}, but this is shard {shard}")
    tables = data.get("checksums", {})
    if not isinstance(tables, dict) or not set(tables) <= ({"0", "1"} if slots == 2 else {"0"}):
        raise _field(where, "checksums", "must map slots '0' and '1' to per-state checksum lists" if slots == 2
                     else "must map slot '0' (the store keeps one slot) to per-state checksum lists")
    checksums: dict[int, dict[str, list[int]]] = {}
    for slot, states in tables.items():
        if not isinstance(states, dict):
            raise _field(where, f"checksums.{slot}", "must map states to checksum lists")
        held = _int(where, f"checksums.{slot}.version", states.get("version"), -1, (1 << 31) - 2)
        if held >= 0 and slots == 2 and held % 2 != int(slot):
            raise _field(where, f"checksums.{slot}.version", f"is {held}, which lives in slot {held % 2}")
        checksums.setdefault(int(slot), {})["version"] = held
        for state, crcs in states.items():
            if state == "version":
                continue
            name = f"checksums.{slot}.{state}"
            if state not in STATES or not used[STATES.index(state)]:
                raise _field(where, name, "names a state this store does not keep")
            if not isinstance(crcs, list) or len(crcs) != pages:
                raise _field(where, name, f"must list {pages} page checksums")
            for crc in crcs:
                if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32:
                    raise _field(where, name, f"holds {crc!r}, not a 32-bit checksum")
            checksums.setdefault(int(slot), {})[state] = crcs
    return {"version": version, "checksums": checksums}
