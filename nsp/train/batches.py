"""Batches from a token array: the held-out split and deterministic random windows.

Batches are a pure function of (seed, step): ``Batcher.batch(step)`` draws its window starts from
``np.random.default_rng([seed, step])``, so resuming at step N replays exactly the stream a run that
never stopped would have seen, and a checkpoint needs no data-loader state beyond the step.  Each row
is ``seq_len + 1`` tokens (inputs ``row[:-1]``, targets ``row[1:]``) and never runs past the end of
the tokens.

The held-out split is the last ``held_out_fraction`` of the tokens, contiguous, so no training window
overlaps the held-out text.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from nsp.train.tokens import DataError, TokenData, is_integer

__all__ = ["Batcher", "split"]


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
    if not is_integer(seq_len) or seq_len < 1:
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
            if not is_integer(value) or value < low:
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
        if not is_integer(step) or step < 0:
            raise DataError(f"step must be an integer >= 0, got {step!r}")
        rng = np.random.default_rng([self.seed, int(step)])
        return rng.integers(0, self.num_windows, size=self.batch_size, dtype=np.int64)

    def batch(self, step: int, rows: slice | None = None) -> np.ndarray:
        """The windows of ``step`` as ``int32``, shape ``(batch_size, seq_len + 1)``; with ``rows``, only those rows
        of it (one process's part of a global batch: the same windows, no tokens read for the other rows)."""
        starts = self.starts(step)
        index = (starts if rows is None else starts[rows])[:, None] + self._offsets[None, :]
        return np.asarray(self.tokens[index], dtype=np.int32)

    def iter_from(self, step: int) -> Iterator[np.ndarray]:
        """``batch(step)``, ``batch(step + 1)``, ... without end."""
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_from(self.start_step)
