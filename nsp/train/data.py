"""Data pipeline for ``nsp train``: byte tokens, a corpus every machine has, deterministic batches.

The public names of the pipeline, gathered from the modules that each do one part of it:

* ``nsp.train.tokens``: ``ByteTokenizer`` (UTF-8 bytes as tokens, vocab 256), ``TokenData`` (the
  tokens with where they came from) and ``DataError``.
* ``nsp.train.corpus``: ``load_tokens`` turns the ``data`` argument (nothing = the Python standard
  library's sources, a text file, a directory of text files, or a ``.bin``/``.npy`` token file) into
  ``TokenData``; ``stdlib_files`` lists the default corpus.
* ``nsp.train.token_cache``: text is tokenized once into a memory-mapped cache, written so that a
  killed process never leaves a torn one (``default_cache_dir``, ``CACHE_ENV``, ``SEPARATOR``).
* ``nsp.train.batches``: ``split`` holds out the contiguous tail; ``Batcher.batch(step)`` is a pure
  function of (seed, step), so resuming at step N replays the stream a run that never stopped saw.

Nothing here prints; what happened (cache hit, build time, file count) is in ``TokenData.info``.
"""

from __future__ import annotations

from nsp.train.batches import Batcher, split
from nsp.train.corpus import STDLIB_EXCLUDED_DIRS, load_tokens, stdlib_files
from nsp.train.token_cache import CACHE_ENV, SEPARATOR, default_cache_dir
from nsp.train.tokens import ByteTokenizer, DataError, TokenData

# Importable from here as well, though outside ``__all__``: the path type and the text-sniff length.
from nsp.train.corpus import PathLike  # noqa: F401
from nsp.train.token_cache import TEXT_SNIFF_BYTES  # noqa: F401

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
