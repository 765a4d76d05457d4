"""The on-disk cache of byte-tokenized text, so a text corpus is tokenized once and then memory-mapped.

Text sources (the stdlib, a text file, a directory of text files) are tokenized once into
``<cache_dir>/<kind>-<key>.bin`` (flat raw ``uint8`` tokens, memory-mapped when used) plus a JSON
sidecar ``<kind>-<key>.json`` (source, file count, token count and a fingerprint: sha256 over the
sorted relative paths, sizes and mtimes of the inputs).  The key is a hash of the source, so
different sources never share files.  The cache is reused when the fingerprint and the token count
match, else rebuilt.  Both files are written to a temporary file in the cache dir and renamed into
place (``.bin`` first, the sidecar last, as the commit), so a killed process leaves at worst a stale
``.tmp`` file, never a torn cache.  The cache dir is the ``cache_dir`` argument, else
``$NSP_CACHE_DIR``, else ``~/.cache/nsp/data``.  Files are joined with ``SEPARATOR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nsp.train.tokens import DataError, TokenData

__all__ = [
    "CACHE_ENV",
    "SEPARATOR",
    "TEXT_SNIFF_BYTES",
    "cached_text",
    "default_cache_dir",
    "read_head",
]

# Environment variable that overrides the default cache dir.
CACHE_ENV = "NSP_CACHE_DIR"
# Placed between the files of a multi-file corpus (not after the last one).
SEPARATOR = b"\n\n"
# A file is treated as text when its first this-many bytes hold no NUL byte.
TEXT_SNIFF_BYTES = 8192
# Bumped when the cache layout or the way text is turned into tokens changes (part of the fingerprint).
_CACHE_FORMAT = 1

# One input file: (relative path, path, its stat when the corpus was collected).
Entry = tuple[str, Path, os.stat_result]


def default_cache_dir() -> Path:
    """``$NSP_CACHE_DIR`` if set (and not empty), else ``~/.cache/nsp/data``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "nsp" / "data"


def read_head(path: Path) -> bytes:
    """The first ``TEXT_SNIFF_BYTES`` bytes of ``path``, enough to tell text from binary."""
    with open(path, "rb") as f:
        return f.read(TEXT_SNIFF_BYTES)


def _read_bytes(path: Path) -> bytes:
    """Whole file contents (a separate function so tests can make a build fail half-way)."""
    with open(path, "rb") as f:
        return f.read()


def _fingerprint(kind: str, entries: list[Entry]) -> str:
    digest = hashlib.sha256(f"nsp-data/{_CACHE_FORMAT}/{kind}/{SEPARATOR!r}\n".encode())
    for rel, _, st in entries:
        digest.update(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def cached_text(source: str, kind: str, identity: str, entries: list[Entry], cache_dir: Path,
                *, sniff: bool) -> TokenData:
    """Byte tokens of the files in ``entries`` joined by ``SEPARATOR``, from the cache or built into it.

    Args:
        source: Where the text comes from, for messages and the sidecar.
        kind: ``"stdlib"``, ``"dir"`` or ``"file"``; names the cache files and enters the fingerprint.
        identity: The source's resolved path; with ``kind`` it keys the cache files.
        entries: The input files in corpus order, with the stat the fingerprint is taken from.
        cache_dir: Directory of the cache files (created when a build needs it).
        sniff: Skip files whose first bytes hold a NUL (binary files in a directory of text).

    Returns:
        ``TokenData`` memory-mapped from the ``.bin``, ``info`` holding the sidecar plus ``cache_hit``,
        ``cache_path``, ``meta_path`` and ``load_seconds``.

    Raises:
        DataError: The cache dir cannot be created, no file is readable, the text is empty, or the
            cache was replaced while loading.
    """
    t0 = time.perf_counter()
    key = hashlib.sha256(f"{kind}\0{identity}".encode("utf-8", "surrogateescape")).hexdigest()[:16]
    bin_path = cache_dir / f"{kind}-{key}.bin"
    json_path = cache_dir / f"{kind}-{key}.json"
    fingerprint = _fingerprint(kind, entries)

    meta = _read_meta(json_path)
    hit = (
        meta is not None
        and meta.get("format") == _CACHE_FORMAT
        and meta.get("fingerprint") == fingerprint
        and isinstance(meta.get("num_tokens"), int)
        and meta["num_tokens"] > 0
        and _size_or_none(bin_path) == meta["num_tokens"]
    )
    if not hit:
        meta = _build_cache(source, kind, entries, fingerprint, bin_path, json_path, cache_dir,
                            sniff=sniff)
    tokens = np.memmap(bin_path, dtype=np.uint8, mode="r")
    if tokens.shape[0] != meta["num_tokens"]:  # replaced under us by a concurrent build of other inputs
        raise DataError(f"token cache {str(bin_path)!r} changed while loading; try again")
    info = dict(meta)
    info.update(cache_hit=bool(hit), cache_path=str(bin_path), meta_path=str(json_path),
                load_seconds=time.perf_counter() - t0)
    return TokenData(tokens, 256, source, int(meta["num_tokens"]), info)


def _read_meta(json_path: Path) -> dict | None:
    try:
        with open(json_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _build_cache(source, kind, entries, fingerprint, bin_path: Path, json_path: Path,
                 cache_dir: Path, *, sniff: bool) -> dict:
    t0 = time.perf_counter()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the token cache dir {str(cache_dir)!r} ({err}); "
            f"pass cache_dir or set ${CACHE_ENV}") from None

    readable, used, skipped, count = 0, 0, 0, 0
    with _AtomicFile(bin_path) as out:
        for _, path, _ in entries:
            try:
                if sniff and b"\0" in read_head(path):
                    skipped += 1
                    continue
                content = _read_bytes(path)
            except OSError:
                skipped += 1
                continue
            readable += 1
            if not content:  # empty files add nothing, not even a separator
                continue
            if used:
                out.write(SEPARATOR)
                count += len(SEPARATOR)
            out.write(content)
            count += len(content)
            used += 1
        if readable == 0:
            what = "readable text files (files with NUL bytes count as binary)" if sniff else "readable files"
            raise DataError(f"{source}: no {what}")
        if count == 0:
            raise DataError(f"{source}: the text is empty (0 tokens)")

    meta = {
        "format": _CACHE_FORMAT,
        "source": source,
        "kind": kind,
        "fingerprint": fingerprint,
        "file_count": used,
        "skipped_files": skipped,
        "num_tokens": count,
        "dtype": "uint8",
        "vocab_size": 256,
        "separator": SEPARATOR.decode(),
        "python": sys.version.split()[0],
        "build_seconds": round(time.perf_counter() - t0, 4),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with _AtomicFile(json_path) as out:  # the sidecar is the commit: written only after the .bin
        out.write(json.dumps(meta, indent=1).encode())
    return meta


class _AtomicFile:
    """Write to a temp file next to ``path``; on success fsync and rename over ``path``, on any error
    (including KeyboardInterrupt) delete the temp file and leave ``path`` as it was."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                os.chmod(self.tmp, 0o644)  # mkstemp makes it 0600; a cache may be shared
                os.replace(self.tmp, self.path)
        except BaseException:
            _unlink(self.tmp)
            raise
        if exc_type is not None:
            _unlink(self.tmp)
        return False


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
