"""Checkpoint deltas: a new version of a checkpoint sent as what changed since an old one, and rebuilt from it.

A storage server that holds checkpoint OLD of a run and needs NEW gets ``make_delta(OLD, NEW, DELTA)`` and
rebuilds NEW with ``apply_delta(OLD, DELTA, OUT)``, bit for bit. OLD and NEW may be any two checkpoints (a
server at step v asked for v+k gets one delta, not k). A checkpoint is a checkpoint step directory
(``ckpt/<step>``: the ``store`` item, a snapshot or one part per process, beside orbax's ``train_state`` and
``meta`` items) or a bare snapshot (``snapshot.py``). A delta is a directory::

    DELTA/DELTA.json     the manifest (written last): both versions' identities, every file of NEW with its
                         size, SHA-256 and source, the sizes (delta vs full)
    DELTA/files/<path>   each file of NEW that OLD does not hold as is, at its path in NEW

**What changed.** Page files (``shards/NNNNN/STATE/c/<page>`` of a snapshot) are compared first by the CRC-32C
the snapshot's manifest (``CHECKSUMS.json``) records for them: a different checksum is a changed page, and OLD's
page is not read. Equal checksums are confirmed by the bytes (unless both are links to the same file), so a
checksum collision cannot make a delta that rebuilds something else. Pages without a recorded checksum, and every
other file (orbax's, the snapshot's JSON files), are compared by their bytes (SHA-256).

**Identity.** A checkpoint is named by its store id(s), its store version, its step (the step directory's name,
when it is one) and a fingerprint: the SHA-256 of its file list, each file with its size and digest (a page's
recorded CRC-32C, any other file's SHA-256). The fingerprint reads only the small files, so the server checks its
base cheaply; ``apply_delta`` refuses a base that is another store, another version or other bytes, naming which.
The rebuilt checkpoint is checked file by file against NEW's SHA-256s (so a damaged base page is caught too) and
as a whole against NEW's fingerprint and ``result_sha256`` before it is renamed into place.

Both directions write into a temporary directory beside the destination and rename it at the end: nothing
partial is ever left under the destination's name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

from nsp.storage.format import METADATA, StoreError, atomic_write_json, fsync_dir, fsync_file, read_json
from nsp.storage.placement import Placer, check_mode
from nsp.storage.snapshot import CHECKSUMS, SNAPSHOT, load_snapshot_info

DELTA = "DELTA.json"
DELTA_FORMAT = "nsp-checkpoint-delta"
DELTA_FORMAT_VERSION = 1
FILES = "files"  # the delta's payload directory
_CHUNK = 1 << 20
_PAGE = re.compile(r"shards/(\d{5})/([a-z]+)/c/(\d+)$")


class FileRecord(NamedTuple):
    """One file of a checkpoint: its path (relative to the checkpoint), size, SHA-256 (None when not computed),
    the CRC-32C its manifest records (pages only; None when none is recorded), and whether it is a page file."""

    path: str
    bytes: int
    sha256: str | None
    crc32c: int | None
    page: bool

    def digest(self) -> str:
        """What the fingerprint takes of this file: the recorded CRC-32C of a page, else the SHA-256."""
        if self.crc32c is not None:
            return f"crc32c:{self.crc32c:08x}"
        if self.sha256 is None:
            raise ValueError(f"{self.path}: no digest computed")
        return f"sha256:{self.sha256}"


class CheckpointId(NamedTuple):
    """Which checkpoint this is: store id(s), store version, step (None when the directory names none), the
    fingerprint (see the module docstring), and its file, page and byte counts."""

    store_id: str
    version: int
    step: int | None
    fingerprint: str
    files: int
    pages: int
    bytes: int

    def describe(self) -> str:
        step = f"step {self.step}, " if self.step is not None else ""
        return f"store {self.store_id}, {step}version {self.version}"


class DeltaEntry(NamedTuple):
    """One file of NEW in a delta: where it comes from (``"delta"``: ``DELTA/files/<path>``; ``"base"``: the
    base checkpoint's file at the same path), its size, SHA-256 and recorded CRC-32C, and whether it is a page."""

    path: str
    bytes: int
    sha256: str
    crc32c: int | None
    page: bool
    source: str


@dataclasses.dataclass(frozen=True)
class DeltaStats:
    """How big the delta is against the whole of NEW: bytes and page files."""

    delta_bytes: int
    full_bytes: int
    delta_pages: int
    total_pages: int
    delta_files: int
    total_files: int

    @property
    def ratio(self) -> float:
        return self.delta_bytes / self.full_bytes if self.full_bytes else 0.0

    def summary(self) -> str:
        return (f"delta: {self.delta_bytes / 1e6:.2f} MB of {self.full_bytes / 1e6:.2f} MB ({100 * self.ratio:.1f}%), "
                f"{self.delta_pages} of {self.total_pages} pages")


@dataclasses.dataclass(frozen=True)
class DeltaManifest:
    """The content of ``DELTA.json``: the two versions, NEW's directories and files (each with its source), OLD's
    file digests (to name what differs in a wrong base), the sizes, and ``result_sha256`` (``tree_sha256`` of NEW)."""

    old: CheckpointId
    new: CheckpointId
    dirs: list[str]
    files: list[DeltaEntry]
    old_digests: dict[str, str]
    stats: DeltaStats
    result_sha256: str
    created: str

    def to_json(self) -> dict:
        return {
            "format": DELTA_FORMAT, "format_version": DELTA_FORMAT_VERSION, "created": self.created,
            "old": self.old._asdict(), "new": self.new._asdict(),
            "stats": {**dataclasses.asdict(self.stats), "ratio": self.stats.ratio},
            "result_sha256": self.result_sha256,
            "dirs": self.dirs,
            "files": [e._asdict() for e in self.files],
            "old_digests": self.old_digests,
        }

    @classmethod
    def from_json(cls, data: Any, where: Path) -> DeltaManifest:
        """Parses ``DELTA.json``; a wrong format or a missing field is a ``StoreError`` naming ``where``."""
        if not isinstance(data, dict) or data.get("format") != DELTA_FORMAT:
            raise StoreError(f"{where} is not an nsp checkpoint delta manifest")
        if data.get("format_version") != DELTA_FORMAT_VERSION:
            raise StoreError(f"delta {where} has format version {data.get('format_version')}; this nsp reads "
                             f"{DELTA_FORMAT_VERSION}")
        try:
            stats = {k: v for k, v in data["stats"].items() if k != "ratio"}
            return cls(old=CheckpointId(**data["old"]), new=CheckpointId(**data["new"]), dirs=list(data["dirs"]),
                       files=[DeltaEntry(**e) for e in data["files"]], old_digests=dict(data["old_digests"]),
                       stats=DeltaStats(**stats), result_sha256=data["result_sha256"], created=data["created"])
        except (KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"delta manifest {where} is damaged: {type(e).__name__} {e}") from None


# ---- reading a checkpoint ----------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def find_snapshots(root: Path) -> list[Path]:
    """The snapshots a checkpoint holds: ``root`` itself, its ``store`` item, or that item's process parts.
    Each must be complete (``load_snapshot_info`` with its files checked)."""
    if not root.exists():
        raise StoreError(f"checkpoint {root} does not exist")
    if not root.is_dir():
        raise StoreError(f"checkpoint {root} is not a directory")
    if (root / DELTA).exists():
        raise StoreError(f"{root} is a checkpoint delta, not a checkpoint")
    item = root / "store"
    if (root / SNAPSHOT).exists():
        snaps = [root]
    elif (item / SNAPSHOT).exists() or not item.is_dir():
        snaps = [item]
    else:
        snaps = sorted(p for p in item.glob("process-*") if p.is_dir()) or [item]
    if not item.is_dir() and not (root / SNAPSHOT).exists():
        raise StoreError(f"{root} is not an nsp checkpoint: it holds no store snapshot ({SNAPSHOT}, or a store "
                         "item)")
    for snap in snaps:
        load_snapshot_info(snap, check_files=True)
    return snaps


def recorded_crcs(snap: Path) -> dict[str, int]:
    """The CRC-32C the snapshot's manifests record for each of its pages, by path relative to ``snap``
    (``shards/NNNNN/STATE/c/<page>``); empty for a snapshot that records none (checksums off, memory tier)."""
    version = int(read_json(snap / SNAPSHOT, "snapshot description")["version"])
    crcs: dict[str, int] = {}
    for table_file in sorted(snap.glob(f"shards/*/{CHECKSUMS}")):
        recorded = read_json(table_file, "snapshot page checksums")
        tables = recorded.get("checksums") or {}
        if recorded.get("version") != version or tables.get("version", version) != version:
            continue  # checksums of another version: of no use to compare this one
        shard = table_file.parent.name
        for state, values in tables.items():
            if isinstance(values, list):
                crcs.update({f"shards/{shard}/{state}/c/{page}": int(crc) for page, crc in enumerate(values)})
    return crcs


def list_files(root: Path) -> tuple[list[str], list[str]]:
    """Every directory and regular file under ``root``, as sorted relative paths. A symbolic link or any other
    kind of file is refused: a checkpoint holds none, and a delta could not rebuild it."""
    dirs, files = [], []
    for parent, dnames, fnames in os.walk(root):
        here = Path(parent)
        for name in dnames + fnames:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                raise StoreError(f"checkpoint {root} holds a symbolic link {rel}: not supported")
            if path.is_dir():
                dirs.append(rel)
            elif path.is_file():
                files.append(rel)
            else:
                raise StoreError(f"checkpoint {root} holds {rel}, which is not a regular file")
    return sorted(dirs), sorted(files)


def scan_checkpoint(root: Path, *, hash_pages: bool) -> tuple[list[str], list[FileRecord]]:
    """A checkpoint's directories and files. Every non-page file is hashed (SHA-256); a page is hashed only with
    ``hash_pages`` or when its manifest records no CRC-32C for it."""
    snaps = find_snapshots(root)
    crcs: dict[str, int] = {}
    for snap in snaps:
        prefix = snap.relative_to(root).as_posix()
        for rel, crc in recorded_crcs(snap).items():
            crcs[f"{prefix}/{rel}" if prefix != "." else rel] = crc
    dirs, names = list_files(root)
    records = []
    for rel in names:
        path = root / rel
        page = _PAGE.search(rel) is not None and any(_under(rel, snap.relative_to(root)) for snap in snaps)
        crc = crcs.get(rel) if page else None
        sha = file_sha256(path) if hash_pages or crc is None else None
        records.append(FileRecord(rel, path.stat().st_size, sha, crc, page))
    return dirs, records


def _under(rel: str, snap_rel: Path) -> bool:
    prefix = snap_rel.as_posix()
    return prefix == "." or rel.startswith(prefix + "/")


def checkpoint_step(root: Path) -> int | None:
    """The step a checkpoint step directory names (orbax names them by step), None for any other directory."""
    return int(root.name) if root.name.isdigit() and (root / "store").is_dir() else None


def checkpoint_identity(root: Path, records: list[FileRecord]) -> CheckpointId:
    """A checkpoint's identity (see ``CheckpointId``) from its files as ``scan_checkpoint`` listed them."""
    snaps = find_snapshots(root)
    versions = {int(read_json(s / SNAPSHOT, "snapshot description")["version"]) for s in snaps}
    if len(versions) != 1:
        raise StoreError(f"checkpoint {root} is inconsistent: its snapshots hold versions {sorted(versions)}")
    store_ids = sorted({str(read_json(s / METADATA, "snapshot store metadata").get("store_id")) for s in snaps})
    return CheckpointId(store_id=",".join(store_ids), version=versions.pop(), step=checkpoint_step(root),
                        fingerprint=fingerprint(records), files=len(records),
                        pages=sum(r.page for r in records), bytes=sum(r.bytes for r in records))


def fingerprint(records: list[FileRecord]) -> str:
    """The SHA-256 of a file list: each file's path, size and digest (``FileRecord.digest``), in path order."""
    listing = [[r.path, r.bytes, r.digest()] for r in sorted(records)]
    return hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()


def tree_sha256(records: list[FileRecord] | list[DeltaEntry]) -> str:
    """The SHA-256 of a file list by every file's own SHA-256: the strong checksum of a whole checkpoint."""
    listing = [[r.path, r.bytes, r.sha256] for r in sorted(records)]
    return hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()


# ---- making a delta ----------------------------------------------------------------------------------------------


def same_bytes(old_root: Path, old: FileRecord, new_root: Path, new: FileRecord) -> bool:
    """Whether OLD's file holds exactly NEW's bytes. Pages go by their recorded CRC-32C first: different ones
    settle it without reading OLD's page; equal ones are confirmed by the bytes unless both are one file."""
    if old.bytes != new.bytes:
        return False
    if old.crc32c is not None and new.crc32c is not None and old.crc32c != new.crc32c:
        return False
    a, b = (old_root / old.path).stat(), (new_root / new.path).stat()
    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
        return True
    return (old.sha256 or file_sha256(old_root / old.path)) == new.sha256


def plan_delta(old_root: Path, old: list[FileRecord], new_root: Path, new: list[FileRecord]) -> list[DeltaEntry]:
    """Where each file of NEW comes from: OLD's file at the same path when it holds the same bytes, else the
    delta."""
    by_path = {r.path: r for r in old}
    entries = []
    for r in new:
        o = by_path.get(r.path)
        source = "base" if o is not None and same_bytes(old_root, o, new_root, r) else "delta"
        entries.append(DeltaEntry(r.path, r.bytes, r.sha256, r.crc32c, r.page, source))
    return entries


def delta_stats(entries: list[DeltaEntry]) -> DeltaStats:
    sent = [e for e in entries if e.source == "delta"]
    return DeltaStats(delta_bytes=sum(e.bytes for e in sent), full_bytes=sum(e.bytes for e in entries),
                      delta_pages=sum(e.page for e in sent), total_pages=sum(e.page for e in entries),
                      delta_files=len(sent), total_files=len(entries))


def make_delta(old_dir: str | os.PathLike, new_dir: str | os.PathLike, out_dir: str | os.PathLike) -> DeltaManifest:
    """Writes the delta that turns checkpoint ``old_dir`` into ``new_dir`` at ``out_dir`` (must not exist).

    Returns the manifest (also ``out_dir/DELTA.json``); ``manifest.stats.summary()`` is the one-line size report.
    Raises ``StoreError`` when a checkpoint is missing, incomplete or not one, or ``out_dir`` exists.
    """
    old_root, new_root, out = Path(old_dir).absolute(), Path(new_dir).absolute(), Path(out_dir).absolute()
    check_new_dir(out, "delta directory")
    old_dirs, old_records = scan_checkpoint(old_root, hash_pages=False)
    new_dirs, new_records = scan_checkpoint(new_root, hash_pages=True)
    entries = plan_delta(old_root, old_records, new_root, new_records)
    manifest = DeltaManifest(
        old=checkpoint_identity(old_root, old_records), new=checkpoint_identity(new_root, new_records),
        dirs=new_dirs, files=entries, old_digests={r.path: r.digest() for r in old_records},
        stats=delta_stats(entries), result_sha256=tree_sha256(new_records),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    with building(out) as tmp:
        for e in entries:
            if e.source == "delta":
                dst = tmp / FILES / e.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(new_root / e.path, dst)
                fsync_file(dst)
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            fsync_dir(d)
        atomic_write_json(tmp / DELTA, manifest.to_json())  # last: its presence makes the delta complete
    return manifest


# ---- applying a delta --------------------------------------------------------------------------------------------


def load_delta(delta_dir: str | os.PathLike) -> DeltaManifest:
    """Reads a delta's manifest and checks every file it ships: present, of its size, of its SHA-256. Raises
    ``StoreError`` naming the damage (a truncated manifest, a missing file, a page whose checksum fails)."""
    delta = Path(delta_dir).absolute()
    if not delta.is_dir():
        raise StoreError(f"delta {delta} does not exist or is not a directory")
    if not (delta / DELTA).exists():
        raise StoreError(f"{delta} is not a complete checkpoint delta: {DELTA} is missing")
    manifest = DeltaManifest.from_json(read_json(delta / DELTA, "delta manifest"), delta / DELTA)
    for e in manifest.files:
        if e.source == "delta":
            check_file(delta / FILES / e.path, e, f"delta {delta} is damaged")
    return manifest


def check_file(path: Path, entry: DeltaEntry, problem: str) -> None:
    """``path`` must hold ``entry``'s bytes (size, then SHA-256); else ``StoreError`` ``"{problem}: ..."``."""
    kind = "page" if entry.page else "file"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{problem}: {kind} {entry.path} is missing") from None
    if size != entry.bytes:
        raise StoreError(f"{problem}: {kind} {entry.path} has {size} bytes, expected {entry.bytes}")
    got = file_sha256(path)
    if got != entry.sha256:
        raise StoreError(f"{problem}: {kind} {entry.path} fails its checksum (SHA-256 {got[:16]}..., expected "
                         f"{entry.sha256[:16]}...)")


def check_base(base: Path, manifest: DeltaManifest) -> None:
    """``base`` must be the delta's OLD checkpoint: the same store, version and fingerprint. Raises
    ``StoreError`` saying which differs (and, for other bytes, which files)."""
    _, records = scan_checkpoint(base, hash_pages=False)
    got, want = checkpoint_identity(base, records), manifest.old
    what = f"{base} is not the version this delta applies to"
    if got.store_id != want.store_id:
        raise StoreError(f"{what}: it is a checkpoint of another store ({got.describe()}; the delta needs "
                         f"{want.describe()})")
    if got.version != want.version or (got.step is not None and want.step is not None and got.step != want.step):
        raise StoreError(f"{what}: it holds another step ({got.describe()}; the delta needs {want.describe()})")
    if got.fingerprint != want.fingerprint:
        held = {r.path: r.digest() for r in records}
        differ = sorted(p for p in held.keys() | manifest.old_digests.keys()
                        if held.get(p) != manifest.old_digests.get(p))
        raise StoreError(f"{what}: {want.describe()}, but its files differ from the delta's OLD "
                         f"({len(differ)} differ, e.g. {', '.join(differ[:3])})")


def apply_delta(base_dir: str | os.PathLike, delta_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                mode: str = "auto") -> DeltaManifest:
    """Rebuilds the delta's NEW checkpoint at ``out_dir`` (must not exist) from ``base_dir`` (its OLD) and the
    delta, bit for bit.

    Every file is checked against NEW's SHA-256 once in place, and the whole against NEW's fingerprint, before
    the temporary directory is renamed to ``out_dir``. ``mode``: how files get there (``placement.Placer``):
    ``"auto"`` hard-links them where it can (neither nsp nor orbax ever writes into a checkpoint's files), else
    copies; ``"copy"`` always copies. Raises ``StoreError`` naming the problem: ``out_dir`` exists, the base is
    another store, step or content, the delta is damaged.
    """
    check_mode(mode)
    base, delta, out = Path(base_dir).absolute(), Path(delta_dir).absolute(), Path(out_dir).absolute()
    check_new_dir(out, "output directory")
    manifest = load_delta(delta)
    check_base(base, manifest)
    placer = Placer(mode)
    with building(out) as tmp:
        for d in manifest.dirs:
            (tmp / d).mkdir(parents=True, exist_ok=True)
        for e in manifest.files:
            src, problem = ((delta / FILES / e.path, f"delta {delta} is damaged") if e.source == "delta"
                            else (base / e.path, f"base {base} is damaged"))
            placer.place(src, tmp / e.path, e.bytes)
            check_file(tmp / e.path, e, problem)
        if placer.copied or placer.reflinked:
            for e in manifest.files:
                fsync_file(tmp / e.path)
        check_result(tmp, manifest)
        for d in sorted(manifest.dirs, key=lambda p: -p.count("/")):
            fsync_dir(tmp / d)
    return manifest


def check_result(root: Path, manifest: DeltaManifest) -> None:
    """The rebuilt checkpoint holds exactly NEW's files and reads as a complete checkpoint of NEW's identity."""
    dirs, records = scan_checkpoint(root, hash_pages=True)
    if dirs != sorted(manifest.dirs) or [r.path for r in records] != sorted(e.path for e in manifest.files):
        raise StoreError(f"the rebuilt checkpoint {root} does not hold NEW's files and directories")
    if fingerprint(records) != manifest.new.fingerprint or tree_sha256(records) != manifest.result_sha256:
        raise StoreError(f"the rebuilt checkpoint {root} does not match NEW's checksums")


# ---- directories written whole or not at all ---------------------------------------------------------------------


def check_new_dir(path: Path, what: str) -> None:
    if path.exists() or path.is_symlink():
        raise StoreError(f"{what} {path} already exists")
    if not path.parent.is_dir():
        raise StoreError(f"cannot create {what} {path}: directory {path.parent} does not exist")


class building:
    """``with building(out) as tmp``: a fresh temporary directory beside ``out``, renamed to ``out`` when the
    block succeeds and removed when it fails (nothing is ever left at ``out`` half-written)."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)  # a leftover of this process id's earlier, killed attempt
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            fsync_dir(self.tmp)
            if self.out.exists():
                raise StoreError(f"{self.out} appeared while it was being written")
            os.rename(self.tmp, self.out)
            fsync_dir(self.out.parent)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
