"""What training data is made of: byte tokens, the ``TokenData`` that carries them, and ``DataError``.

Byte-level tokens (vocab 256): ``ByteTokenizer`` maps text to its UTF-8 bytes and back.  No tokenizer
files to download or version, any text (or any bytes) is representable, and the embedding table is
tiny, which suits the small models this library trains in tests and demos.  Pre-tokenized data with
a larger vocabulary comes in as a token file (``.npy`` of ``uint16``, see ``nsp.train.corpus``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["ByteTokenizer", "DataError", "TokenData", "is_integer"]


class DataError(ValueError):
    """Bad training data: a missing path, an empty or too-short corpus, an unsupported file."""


def is_integer(value) -> bool:
    """Whether ``value`` is a Python or NumPy integer (``bool`` is not: ``True`` is no step count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode`` gives ``uint8`` tokens, ``decode`` replaces invalid UTF-8."""

    vocab_size = 256

    def encode(self, text: str | bytes | bytearray | memoryview) -> np.ndarray:
        """The UTF-8 bytes of ``text`` (or the bytes themselves) as a new ``uint8`` array.

        Raises:
            TypeError: ``text`` is neither ``str`` nor bytes-like.
        """
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, (bytes, bytearray, memoryview)):
            raise TypeError(f"ByteTokenizer.encode takes str or bytes, not {type(text).__name__}")
        return np.frombuffer(bytes(text), dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        """The text of byte ``tokens``; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: a token lies outside [0, 255].
        """
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(
                f"byte tokens must be in [0, 255], got values in [{array.min()}, {array.max()}]")
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Tokens to train on.

    Attributes:
        tokens: 1-D ``uint8`` or ``uint16`` array, memory-mapped from the cache or the token file.
        vocab_size: 256 for byte tokens.
        source: Where the tokens came from, for messages.
        num_tokens: Length of ``tokens``.
        info: How they were obtained (``cache_hit``, ``build_seconds``, ``file_count``,
            ``cache_path``, ...).
    """

    tokens: np.ndarray
    vocab_size: int
    source: str
    num_tokens: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return self.num_tokens
