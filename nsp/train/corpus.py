"""From the ``data`` argument of a run to ``TokenData``: the default corpus, text sources, token files.

Default corpus: the Python standard library's own sources.  ``sysconfig.get_paths()["stdlib"]``
holds megabytes of real, well-formed text (about 12 MB in ~730 ``*.py`` files on CPython 3.11) on
every machine that runs this code, so ``nsp train`` works offline with no download step, and the
loss curve means something (it is not random data).  Included: every ``*.py`` file under the stdlib
directory, in the order of its relative POSIX path.  Excluded: any directory named
``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idle_test`` or ``__pycache__`` (and so
everything under it: ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/test``,
``ctypes/test``, ...), and files that cannot be read.

Text sources go through ``nsp.train.token_cache``.  Token files are memory-mapped, not copied:
``.bin`` = raw ``uint8`` tokens, ``.npy`` = 1-D ``uint8`` or ``uint16`` array.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sysconfig
from pathlib import Path
from typing import Union

import numpy as np

from nsp.train.token_cache import Entry, cached_text, default_cache_dir, read_head
from nsp.train.tokens import DataError, TokenData, is_integer

__all__ = ["STDLIB_EXCLUDED_DIRS", "PathLike", "load_tokens", "stdlib_files"]

# Directory names never descended into when collecting the stdlib corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# uint16 token files without an explicit vocab size get max+1 rounded up to a multiple of this.
_VOCAB_ROUND = 64

PathLike = Union[str, "os.PathLike[str]"]


def load_tokens(
    data: PathLike | None = None,
    *,
    cache_dir: PathLike | None = None,
    seq_len: int | None = None,
    vocab_size: int | None = None,
) -> TokenData:
    """Load training tokens.

    Text is byte-tokenized into the cache (``cache_dir``, else ``$NSP_CACHE_DIR``, else
    ``~/.cache/nsp/data``) and reused while its inputs are unchanged.

    Args:
        data: ``None`` (or ``""``) = the Python stdlib sources; a text file; a directory of text
            files; or a token file (``.bin`` raw ``uint8``, ``.npy`` 1-D ``uint8``/``uint16``,
            memory-mapped).
        cache_dir: Directory of the token cache.
        seq_len: When given, at least one window of ``seq_len + 1`` tokens is required (else 2
            tokens).
        vocab_size: For token files, the vocabulary size (checked against the largest token); by
            default 256 for ``uint8`` and the largest token + 1 rounded up to a multiple of 64 for
            ``uint16``.  For text it may be left out or be at least 256.

    Returns:
        The tokens, with ``info`` saying how they were obtained.

    Raises:
        DataError: Naming the path, for anything unusable.
    """
    if seq_len is not None and (not is_integer(seq_len) or seq_len < 1):
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    if vocab_size is not None and (not is_integer(vocab_size) or vocab_size < 1):
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


# --- token files -----------------------------------------------------------------------------------


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


# --- text sources ----------------------------------------------------------------------------------


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


def _stat_files(files: list[tuple[str, Path]]) -> list[Entry]:
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


def _load_stdlib(cache_dir: Path) -> TokenData:
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = _stat_files(stdlib_files(root))
    if not entries:
        raise DataError(
            f"no Python source files found under the stdlib directory {str(root)!r}; "
            "pass a text file, directory or token file as the training data instead")
    source = f"python stdlib sources {root}"
    return cached_text(source, "stdlib", str(root), entries, cache_dir, sniff=False)


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
    return cached_text(f"text files under {path}", "dir", str(root), entries, cache_dir, sniff=True)


def _load_text_file(path: Path, cache_dir: Path) -> TokenData:
    resolved = path.resolve()
    st = resolved.stat()
    if st.st_size == 0:
        raise DataError(f"training text file {str(path)!r} is empty")
    head = read_head(path)
    if b"\0" in head:
        raise DataError(
            f"training data {str(path)!r} is not a text file (NUL bytes) and not a token file; "
            "supported: text files, directories of text files, .bin (uint8) and .npy (uint8/uint16)")
    return cached_text(f"text file {path}", "file", str(resolved), [(str(resolved), resolved, st)],
                       cache_dir, sniff=False)
