"""Labelled data for ``nsp train --task classify``: chunks of source code and the top-level package each comes from.

NDPipe fine-tunes classifiers on data whose labels the data set itself gives. Here the data set is a tree of
source files (the Python standard library by default, or ``--data DIR``), and a chunk's label is the top-level
directory its file lies in (``email``, ``asyncio``, ``xml``, ...): something the model has to read the chunk to
tell, with nothing to annotate by hand.

- **Classes**: the ``classes`` top-level directories holding the most bytes of source, among those with at least
  ``MIN_FILES`` files of a whole sequence or more (ties broken by name); files directly at the top are left out.
- **Held out by file**: within each class, every ``HOLD_OUT_EVERY``-th file (in path order, at least one) is held
  out, so no held-out chunk shares a file with a training chunk.
- **Balanced batches**: each row of a batch draws its class uniformly, then a window of ``seq`` tokens uniformly
  among all the windows of that class's files (no window crosses a file's end). A batch is a function of
  ``(seed, step)``, like ``nsp.train.batches.Batcher``'s, so resume replays it. Balanced sampling makes held-out
  accuracy the mean of the per-class recalls; chance is ``1 / classes``.

Tokens are the files' UTF-8 bytes (vocab 256), as for the language model.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import numpy as np

from nsp.train.corpus import STDLIB_EXCLUDED_DIRS, stdlib_files
from nsp.train.tokens import DataError

MIN_FILES = 4  # a class needs files enough to hold some out
HOLD_OUT_EVERY = 10  # every 10th file of a class (in path order) is held out


@dataclasses.dataclass(frozen=True)
class LabelledFiles:
    """The files of one class and of one split, their bytes concatenated with where each file starts."""

    tokens: np.ndarray  # uint8, the files one after the other
    starts: np.ndarray  # int64 [files + 1]: file i is tokens[starts[i]:starts[i + 1]]

    def windows(self, seq: int) -> np.ndarray:
        """Cumulative window counts ``[files + 1]``: file ``i`` holds ``max(0, length - seq + 1)`` windows."""
        lengths = np.diff(self.starts)
        return np.concatenate([[0], np.cumsum(np.maximum(lengths - seq + 1, 0))])


@dataclasses.dataclass(frozen=True)
class LabelledSource:
    """A source tree split into classes and into training and held-out files (module docstring)."""

    root: str
    names: tuple[str, ...]  # class i's top-level directory
    train: tuple[LabelledFiles, ...]
    held_out: tuple[LabelledFiles, ...]

    @property
    def vocab_size(self) -> int:
        return 256


def load_source(data: str, classes: int, seq: int) -> LabelledSource:
    """The labelled source tree ``data`` (empty: the Python stdlib, as ``nsp train``'s default corpus lists it).

    Raises:
      DataError: ``data`` is not a directory, or holds fewer than ``classes`` top-level directories with
        ``MIN_FILES`` files of at least ``seq`` bytes (the message lists what it found).
    """
    if data:
        root = Path(data).expanduser()
        if not root.is_dir():
            raise DataError(f"--task classify: --data {data!r} must be a directory of source trees (each file is "
                            "labelled by its top-level directory)")
        files = _files_under(root)
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
    by_class: dict[str, list[bytes]] = {}
    for rel, path in files:
        top, sep, _ = rel.partition("/")
        if not sep:
            continue  # a file at the top has no package to tell
        try:
            text = path.read_bytes()
        except OSError:
            continue
        if len(text) >= seq:
            by_class.setdefault(top, []).append(text)
    eligible = sorted(((sum(map(len, texts)), name) for name, texts in by_class.items() if len(texts) >= MIN_FILES),
                      key=lambda item: (-item[0], item[1]))
    if len(eligible) < classes:
        found = ", ".join(f"{name} ({size:,} B)" for size, name in eligible[:10]) or "none"
        raise DataError(f"--task classify: {root} has {len(eligible)} top-level directories with {MIN_FILES} or more "
                        f"files of at least {seq} bytes ({found}); --classes {classes} needs that many")
    names = tuple(sorted(name for _, name in eligible[:classes]))
    train, held = [], []
    for name in names:
        texts = by_class[name]
        held_idx = set(range(HOLD_OUT_EVERY - 1, len(texts), HOLD_OUT_EVERY)) or {len(texts) - 1}
        held.append(_concat([t for i, t in enumerate(texts) if i in held_idx]))
        train.append(_concat([t for i, t in enumerate(texts) if i not in held_idx]))
    return LabelledSource(str(root), names, tuple(train), tuple(held))


def _files_under(root: Path) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(p.startswith(".") or p in STDLIB_EXCLUDED_DIRS for p in rel.parts) or not path.is_file():
            continue
        found.append((rel.as_posix(), path))
    return found


def _concat(texts: list[bytes]) -> LabelledFiles:
    starts = np.concatenate([[0], np.cumsum([len(t) for t in texts])]).astype(np.int64)
    return LabelledFiles(np.frombuffer(b"".join(texts), dtype=np.uint8), starts)


class ClassBatcher:
    """Balanced labelled batches: ``batch(step, rows)`` is ``{"tokens": int32 [batch, seq], "labels": int32
    [batch]}``, a function of ``(seed, step)`` (module docstring)."""

    def __init__(self, parts: tuple[LabelledFiles, ...], batch_size: int, seq_len: int, seed: int):
        self.parts, self.batch_size, self.seq_len, self.seed = parts, int(batch_size), int(seq_len), int(seed)
        self._windows = [p.windows(self.seq_len) for p in parts]
        for i, w in enumerate(self._windows):
            if w[-1] == 0:
                raise DataError(f"--task classify: class {i} has no file of {self.seq_len} tokens or more")
        self._offsets = np.arange(self.seq_len, dtype=np.int64)

    def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(step)])
        labels = rng.integers(0, len(self.parts), size=self.batch_size)
        picks = rng.random(self.batch_size)
        starts = np.empty(self.batch_size, dtype=np.int64)
        for r, (label, u) in enumerate(zip(labels, picks)):
            windows, part = self._windows[label], self.parts[label]
            k = min(int(u * windows[-1]), int(windows[-1]) - 1)  # the k-th window of the class
            f = int(np.searchsorted(windows, k, side="right")) - 1  # in file f
            starts[r] = part.starts[f] + (k - windows[f])
        tokens = np.stack([self.parts[label].tokens[s + self._offsets] for label, s in zip(labels, starts)])
        out = {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}
        return out if rows is None else {k: v[rows] for k, v in out.items()}
