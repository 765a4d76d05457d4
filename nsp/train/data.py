"""Data pipeline for ``nsp train``: byte tokens, a corpus every machine has, deterministic batches.

Choices
-------
* **Byte-level tokens (vocab 256).**  ``ByteTokenizer`` maps text to its UTF-8 bytes and back.  No
  tokenizer files to download or version, any text (or any bytes) is representable, and the
  embedding table is tiny, which suits the small models this library trains in tests and demos.
  Pre-tokenized data with a larger vocabulary comes in as a token file (``.npy`` of ``uint16``).
* **Default corpus: the Python standard library's own sources.**  ``sysconfig.get_paths()["stdlib"]``
  holds megabytes of real, well-formed text (about 12 MB in ~730 ``*.py`` files on CPython 3.11)
  on every machine that runs this code, so ``nsp train`` works offline with no download step, and
  the loss curve means something (it is not random data).  Included: every ``*.py`` file under the
  stdlib directory, in the order of its relative POSIX path.  Excluded: any directory named
  ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idle_test`` or ``__pycache__`` (and so
  everything under it: ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/test``,
  ``ctypes/test``, ...), and files that cannot be read.  Files are joined with ``SEPARATOR``.
* **A token cache.**  Text sources (the stdlib, a text file, a directory of text files) are
  tokenized once into ``<cache_dir>/<kind>-<key>.bin`` (flat raw ``uint8`` tokens, memory-mapped
  when used) plus a JSON sidecar ``<kind>-<key>.json`` (source, file count, token count and a
  fingerprint: sha256 over the sorted relative paths, sizes and mtimes of the inputs).  The key is a
  hash of the source, so different sources never share files.  The cache is reused when the
  fingerprint and the token count match, else rebuilt.  Both files are written to a temporary file
  in the cache dir and renamed into place (``.bin`` first, the sidecar last, as the commit), so a
  killed process leaves at worst a stale ``.tmp`` file, never a torn cache.  The cache dir is the
  ``cache_dir`` argument, else ``$NSP_CACHE_DIR``, else ``~/.cache/nsp/data``.
* **Token files are memory-mapped, not copied**: ``.bin`` = raw ``uint8`` tokens, ``.npy`` =
  1-D ``uint8`` or ``uint16`` array.
* **Batches are a pure function of (seed, step).**  ``Batcher.batch(step)`` draws its window starts
  from ``np.random.default_rng([seed, step])``, so resuming at step N replays exactly the stream a
  run that never stopped would have seen, and a checkpoint needs no data-loader state beyond the
  step.  Each row is ``seq_len + 1`` tokens (inputs ``row[:-1]``, targets ``row[1:]``) and never
  runs past the end of the tokens.
* **Held-out split**: the last ``held_out_fraction`` of the tokens, contiguous, so no training window
  overlaps the held-out text.

Nothing here prints; what happened (cache hit, build time, file count) is in ``TokenData.info``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import numpy as np

__all__ = [
    "CACHE_ENV",
    "SEPARATOR",
    "STDLIB_EXCLUDED_DIRS",
    "Batcher",
    "ByteTokenizer",
    "DataError",
    "TokenData",
    "default_cache_dir",
    "load_tokens",
    "split",
    "stdlib_files",
]

# Environment variable that overrides the default cache dir.
CACHE_ENV = "NSP_CACHE_DIR"
# Placed between the files of a multi-file corpus (not after the last one).
SEPARATOR = b"\n\n"
# Directory names never descended into when collecting the stdlib corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# A file is treated as text when its first this-many bytes hold no NUL byte.
TEXT_SNIFF_BYTES = 8192
# Bumped when the cache layout or the way text is turned into tokens changes (part of the fingerprint).
_CACHE_FORMAT = 1
# uint16 token files without an explicit vocab size get max+1 rounded up to a multiple of this.
_VOCAB_ROUND = 64

PathLike = Union[str, "os.PathLike[str]"]


class DataError(ValueError):
    """Bad training data: a missing path, an empty or too-short corpus, an unsupported file."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode`` gives ``uint8`` tokens, ``decode`` replaces invalid UTF-8."""

    vocab_size = 256

    def encode(self, text: str | bytes | bytearray | memoryview) -> np.ndarray:
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, (bytes, bytearray, memoryview)):
            raise TypeError(f"ByteTokenizer.encode takes str or bytes, not {type(text).__name__}")
        return np.frombuffer(bytes(text), dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(
                f"byte tokens must be in [0, 255], got values in [{array.min()}, {array.max()}]")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Tokens to train on.

    ``tokens`` is a 1-D ``uint8`` or ``uint16`` array, memory-mapped from the cache or the token file;
    ``vocab_size`` is 256 for byte tokens; ``source`` says where they came from; ``info`` holds how
    they were obtained (``cache_hit``, ``build_seconds``, ``file_count``, ``cache_path``, ...).
    """

    tokens: np.ndarray
    vocab_size: int
    source: str
    num_tokens: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return self.num_tokens


# ---------------------------------------------------------------------------------------------------
# Loading


def default_cache_dir() -> Path:
    """``$NSP_CACHE_DIR`` if set (and not empty), else ``~/.cache/nsp/data``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "nsp" / "data"


def load_tokens(
    data: PathLike | None = None,
    *,
    cache_dir: PathLike | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
) -> TokenData:
    """Load training tokens.

    ``data``: ``None`` (or ``""``) = the Python stdlib sources; a text file; a directory of text files;
    or a token file (``.bin`` raw ``uint8``, ``.npy`` 1-D ``uint8``/``uint16``, memory-mapped).
    Text is byte-tokenized into the cache (``cache_dir``, else ``$NSP_CACHE_DIR``, else
    ``~/.cache/nsp/data``) and reused while its inputs are unchanged.

    ``seq_len``: when given, at least one window of ``seq_len + 1`` tokens is required (else 2 tokens).
    ``vocab_size``: for token files, the vocabulary size (checked against the largest token); by
    default 256 for ``uint8`` and the largest token + 1 rounded up to a multiple of 64 for ``uint16``.
    For text it may be left out or be at least 256.

    Raises ``DataError`` naming the path for anything unusable.
    """
    if seq_len is not None and (not _is_int(seq_len) or seq_len < 1):
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
        raise DataError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if data is None or (isinstance(data, str) and data == ""):
        result = _load_stdlib(cache)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise DataError(f"training data {str(path)!r} does not exist")
        if path.is_dir():
            result = _load_directory(path, cache)
        elif not path.is_file():
            raise DataError(f"training data {str(path)!r} is neither a regular file nor a directory")
        elif path.suffix.lower() == ".bin":
            result = _load_bin(path, vocab_size)
        elif path.suffix.lower() == ".npy":
            result = _load_npy(path, vocab_size)
        else:
            result = _load_text_file(path, cache)

    if vocab_size is not None and result.info["kind"] in ("stdlib", "dir", "file"):
        if vocab_size < 256:
            raise DataError(f"{result.source}: byte tokens need vocab_size >= 256, got {vocab_size}")
        result = dataclasses.replace(result, vocab_size=vocab_size)

    need = (seq_len if seq_len is not None else 1) + 1
    if result.num_tokens < need:
        raise DataError(
            f"{result.source}: {result.num_tokens} tokens, fewer than one training window needs "
            f"({need} = seq_len + 1)")
    return result


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _load_bin(path: Path, vocab_size: int | None) -> TokenData:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {str(path)!r} is empty")
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    vocab = _token_vocab(tokens, vocab_size, path)
    return TokenData(tokens, vocab, f"token file {path}", int(tokens.shape[0]),
                     {"kind": "bin", "path": str(path), "cache_hit": None})


def _load_npy(path: Path, vocab_size: int | None) -> TokenData:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"token file {str(path)!r} is not a readable .npy array: {err}") from None
    if not isinstance(tokens, np.ndarray) or tokens.dtype not in (np.uint8, np.uint16):
        dtype = getattr(tokens, "dtype", type(tokens).__name__)
        raise DataError(
            f"token file {str(path)!r} has unsupported dtype {dtype} (supported: uint8, uint16)")
    if tokens.ndim != 1:
        raise DataError(f"token file {str(path)!r} must be 1-D, got shape {tokens.shape}")
    if tokens.shape[0] == 0:
        raise DataError(f"token file {str(path)!r} is empty")
    vocab = _token_vocab(tokens, vocab_size, path)
    return TokenData(tokens, vocab, f"token file {path}", int(tokens.shape[0]),
                     {"kind": "npy", "path": str(path), "cache_hit": None})


def _token_vocab(tokens: np.ndarray, vocab_size: int | None, path: Path) -> int:
    if tokens.dtype == np.uint8 and vocab_size is None:
        return 256
    largest = int(tokens.max())  # one pass over the file; an out-of-range id would be clipped silently
    if vocab_size is None:
        return -(-(largest + 1) // _VOCAB_ROUND) * _VOCAB_ROUND
    if vocab_size <= largest:
        raise DataError(
            f"token file {str(path)!r} holds token id {largest}, not below vocab_size {vocab_size}")
    return vocab_size


# --- text sources through the cache ---------------------------------------------------------------


def stdlib_files(root: PathLike | None = None) -> list[tuple[str, Path]]:
    """The default corpus: ``(relative POSIX path, path)`` of every ``*.py`` under the stdlib directory,
    sorted by relative path, skipping directories named in ``STDLIB_EXCLUDED_DIRS``."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    return _walk(base, lambda name: name.endswith(".py"), lambda name: name in STDLIB_EXCLUDED_DIRS)


def _walk(base: Path, keep_file, skip_dir) -> list[tuple[str, Path]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(base):  # does not follow directory symlinks
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for name in filenames:
            if keep_file(name):
                path = Path(dirpath) / name
                found.append((path.relative_to(base).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _stat_files(files: list[tuple[str, Path]]) -> list[tuple[str, Path, os.stat_result]]:
    """Regular files among ``files`` with their stat (unstat-able ones are dropped)."""
    out = []
    for rel, path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((rel, path, st))
    return out


def _fingerprint(kind: str, entries: list[tuple[str, Path, os.stat_result]]) -> str:
    digest = hashlib.sha256(f"nsp-data/{_CACHE_FORMAT}/{kind}/{SEPARATOR!r}\n".encode())
    for rel, _, st in entries:
        digest.update(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _load_stdlib(cache_dir: Path) -> TokenData:
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = _stat_files(stdlib_files(root))
    if not entries:
        raise DataError(
            f"no Python source files found under the stdlib directory {str(root)!r}; "
            "pass a text file, directory or token file as the training data instead")
    source = f"python stdlib sources {root}"
    return _cached_text(source, "stdlib", str(root), entries, cache_dir, sniff=False)


def _load_directory(path: Path, cache_dir: Path) -> TokenData:
    root = path.resolve()
    # Hidden files and directories (.git, .venv, ...) are skipped, and so is the cache dir itself.
    entries = _stat_files(_walk(root, lambda name: not name.startswith("."),
                                lambda name: name.startswith(".")))
    try:
        cache_resolved = cache_dir.resolve()
        entries = [e for e in entries if cache_resolved not in e[1].resolve().parents]
    except OSError:
        pass
    if not entries:
        raise DataError(f"training data directory {str(path)!r} holds no regular files")
    return _cached_text(f"text files under {path}", "dir", str(root), entries, cache_dir, sniff=True)


def _load_text_file(path: Path, cache_dir: Path) -> TokenData:
    resolved = path.resolve()
    st = resolved.stat()
    if st.st_size == 0:
        raise DataError(f"training text file {str(path)!r} is empty")
    head = _read_head(path)
    if b"\0" in head:
        raise DataError(
            f"training data {str(path)!r} is not a text file (NUL bytes) and not a token file; "
            "supported: text files, directories of text files, .bin (uint8) and .npy (uint8/uint16)")
    return _cached_text(f"text file {path}", "file", str(resolved), [(str(resolved), resolved, st)],
                        cache_dir, sniff=False)


def _read_head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(TEXT_SNIFF_BYTES)


def _read_bytes(path: Path) -> bytes:
    """Whole file contents (a separate function so tests can make a build fail half-way)."""
    with open(path, "rb") as f:
        return f.read()


def _cached_text(source: str, kind: str, identity: str, entries, cache_dir: Path,
                 *, sniff: bool) -> TokenData:
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
                if sniff and b"\0" in _read_head(path):
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


# ---------------------------------------------------------------------------------------------------
# Split and batches


def _as_array(tokens) -> np.ndarray:
    array = tokens.tokens if isinstance(tokens, TokenData) else tokens
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    if array.ndim != 1:
        raise DataError(f"tokens must be 1-D, got shape {array.shape}")
    return array


def split(tokens, held_out_fraction: float = 0.05, *, seq_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)`` views of ``tokens`` (an array or ``TokenData``): the last
    ``held_out_fraction`` is held out, contiguous.  Each part must hold one window of ``seq_len + 1``
    tokens (``DataError`` otherwise).  Slices of a memmap stay memory-mapped."""
    array = _as_array(tokens)
    if not 0 < held_out_fraction < 1:
        raise DataError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    if not _is_int(seq_len) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    n = int(array.shape[0])
    held = int(round(n * held_out_fraction))
    window = seq_len + 1
    if held < window or n - held < window:
        raise DataError(
            f"{n} tokens split {n - held} train / {held} held out (held_out_fraction="
            f"{held_out_fraction}): each part needs at least one window of {window} tokens "
            f"(seq_len + 1); use more data, a shorter seq_len or another fraction")
    return array[: n - held], array[n - held:]


class Batcher:
    """Random windows of ``tokens``: ``batch(step)`` is an ``int32`` array ``(batch_size, seq_len + 1)``
    whose window starts depend only on ``(seed, step)``, so any step can be (re)drawn at any time.

    Iterating yields ``batch(start_step)``, ``batch(start_step + 1)``, ... without end.
    """

    def __init__(self, tokens, batch_size: int, seq_len: int, seed: int, *, start_step: int = 0):
        self.tokens = _as_array(tokens)
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1),
                                 ("seed", seed, 0), ("start_step", start_step, 0)):
            if not _is_int(value) or value < low:
                raise DataError(f"{name} must be an integer >= {low}, got {value!r}")
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.start_step = int(start_step)
        n = int(self.tokens.shape[0])
        if n < self.seq_len + 1:
            raise DataError(
                f"{n} tokens, fewer than one window of seq_len + 1 = {self.seq_len + 1} tokens")
        # Number of valid window starts: 0 .. n - (seq_len + 1).
        self.num_windows = n - self.seq_len
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def starts(self, step: int) -> np.ndarray:
        """The ``batch_size`` window starts of ``step`` (``int64``)."""
        if not _is_int(step) or step < 0:
            raise DataError(f"step must be an integer >= 0, got {step!r}")
        rng = np.random.default_rng([self.seed, int(step)])
        return rng.integers(0, self.num_windows, size=self.batch_size, dtype=np.int64)

    def batch(self, step: int) -> np.ndarray:
        index = self.starts(step)[:, None] + self._offsets[None, :]
        return np.asarray(self.tokens[index], dtype=np.int32)

    def iter_from(self, step: int) -> Iterator[np.ndarray]:
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_from(self.start_step)
