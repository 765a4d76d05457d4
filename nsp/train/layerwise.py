"""Setting up a GPT too big to hold in fp32: built one part at a time, straight into the store.

A GPT-3 2.7B in fp32 is 10 GB of params; with the fp32 copy that ``tx.init`` writes into the store and the bf16
copy the step keeps, a plain ``GPT(config, rngs=nnx.Rngs(seed))`` set-up would peak at about 1.5x that before the
first step. Here the model exists only abstractly (``nnx.eval_shape``: shapes, no values) while
``StateStore.initialize_from`` asks for the params leaf by leaf: ``LayerwiseInit`` builds the part of the model
that holds the leaf asked for (the token embedding, one block, ...; ``nsp.models.gpt.gpt_parts``) with the RNG
stream counter where the whole model's construction would have it, so every value is the one the whole model
would hold, bit for bit. At most one part is alive in fp32 at a time (a block of the 2.7B: 315 MB); the trainer
keeps only a bf16 copy of each leaf for the step.

``SetupProgress`` prints what ``initialize_from`` reports (MB and pages written, MB/s, ETA) and
``peak_rss_bytes`` what the process has held at most.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

import nsp.rss
from nsp.models import GPTConfig, abstract_gpt
from nsp.models.gpt import gpt_parts


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far (``nsp.rss.peak_bytes``: since it started, or since
    the offload planner's profiling ended)."""
    return nsp.rss.peak_bytes()


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class LayerwiseInit:
    """The params of ``GPT(config, rngs=nnx.Rngs(seed))``, one leaf at a time, without building the whole model.

    ``abstract`` is the params' state (``jax.ShapeDtypeStruct`` leaves) and ``graphdef`` the model's graph, as
    ``nnx.split(GPT(...), nnx.Param)`` gives them. ``init(i)`` returns leaf ``i`` (in ``jax.tree_util.tree_leaves``
    order) as a float32 numpy array, equal bit for bit to that leaf of the whole model: the part holding it is
    built alone from ``nnx.Rngs(seed)`` with the stream counter set to the draws of the parts built before it.
    Leaves are best asked for in increasing order (what ``StateStore.initialize_from`` does): a part is built
    once while its leaves are asked for, and dropped when a leaf of another part is. With ``keep`` (a dtype),
    each leaf given is also kept in that dtype: ``kept_params()`` is then the whole params tree in ``keep`` (bf16
    for the step) once every leaf was asked for.

    Parts are built op by op, as ``GPT.__init__`` runs: under ``jax.jit`` XLA folds the initializers' scale into
    the normal draw's own constants, which moves about a quarter of the values by an ulp.

    Raises ``ValueError`` for a config with dropout (its dropout layers hold RNG state; the named configs have
    none).
    """

    def __init__(self, config: GPTConfig, seed: int = 0, *, keep: Any = None):
        self.config = config
        self.seed = int(seed)
        self.keep = None if keep is None else np.dtype(keep)
        self.graphdef, self.abstract = nnx.split(abstract_gpt(config), nnx.Param)
        self._parts = gpt_parts(config)
        # Draws of each part, counted on a model of the same structure but tiny sizes (a draw's count does not
        # depend on the shapes drawn): the first draw of part k is the sum of the draws of parts 0..k-1.
        probe = gpt_parts(_tiny_like(config))
        self._first_draw, count = {}, 0
        for (path, _), (_, build) in zip(self._parts, probe):
            self._first_draw[path] = count
            rngs = nnx.Rngs(self.seed)
            build(rngs)
            count += int(rngs.default.count[...])
        self._build = dict(self._parts)
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(self.abstract)
        self.shapes = [tuple(x.shape) for _, x in flat]
        self._part_of = [self._part_path(path) for path, _ in flat]  # leaf index -> its part's path
        self._first_leaf = {}
        for i, part in enumerate(self._part_of):
            self._first_leaf.setdefault(part, i)
        self._current: tuple | None = None
        self._leaves: list[np.ndarray] = []
        self._kept: list[Any] = [None] * len(self._part_of)

    def _part_path(self, path) -> tuple:
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        for part, _ in self._parts:
            if keys[:len(part)] == part:
                return part
        raise ValueError(f"params leaf {jax.tree_util.keystr(path)} belongs to no part of gpt_parts")

    @property
    def num_leaves(self) -> int:
        return len(self._part_of)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    def build_part(self, path: tuple) -> tuple[list[np.ndarray], list[Any] | None]:
        """The float32 leaves of the part at ``path`` (``("h", 3)``, ...), in its own ``tree_leaves`` order, and
        (with ``keep``) the same leaves in ``keep``."""
        rngs = nnx.Rngs(self.seed)
        rngs.default.count[...] = self._first_draw[path]
        leaves = jax.tree_util.tree_leaves(nnx.state(self._build[path](rngs), nnx.Param))
        kept = None if self.keep is None else [x.astype(self.keep) for x in leaves]
        return [np.asarray(x) for x in leaves], kept

    def __call__(self, i: int) -> np.ndarray:
        part = self._part_of[i]
        if part != self._current:
            self._leaves, self._current = [], None  # the previous part goes before the next one is built
            self._leaves, kept = self.build_part(part)
            self._current = part
            if kept is not None:
                first = self._first_leaf[part]
                self._kept[first:first + len(kept)] = kept
        leaf = self._leaves[i - self._first_leaf[part]]
        if tuple(leaf.shape) != self.shapes[i]:  # gpt_parts and GPT.__init__ out of step
            raise ValueError(f"leaf {i} of part {part} has shape {leaf.shape}; the model's is {self.shapes[i]}")
        return leaf

    def kept_params(self) -> Any:
        """The params tree in ``keep`` (what the step holds), once every leaf was asked for; hands it over (this
        object keeps no reference)."""
        if self.keep is None:
            raise ValueError("LayerwiseInit(keep=None) keeps no copy of the params")
        missing = [i for i, x in enumerate(self._kept) if x is None]
        if missing:
            raise ValueError(f"{len(missing)} leaves were never asked for (the first: {missing[0]})")
        kept, self._kept = self._kept, [None] * len(self._kept)
        return jax.tree_util.tree_unflatten(self.treedef, kept)

    def close(self) -> None:
        """Drops the part held (call when every leaf was given)."""
        self._leaves, self._current = [], None


def _tiny_like(config: GPTConfig) -> GPTConfig:
    """A config of the same structure (layers, bias, dropout) with tiny shapes: for counting RNG draws."""
    import dataclasses

    return dataclasses.replace(config, vocab_size=8, block_size=8, n_head=1, n_embd=8)


class SetupProgress:
    """A ``progress(done_bytes, total_bytes)`` callback for ``StateStore.initialize_from`` that logs MB and pages
    written of the total, the rate and the time left, at most every ``every_s`` seconds (and at the end)."""

    def __init__(self, log: Callable[[str], None], page_bytes: int, every_s: float = 5.0):
        self.log, self.page_bytes, self.every_s = log, page_bytes, every_s
        self.t0 = time.perf_counter()
        self._last = self.t0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < self.every_s:
            return
        self._last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        pages = -(-total // self.page_bytes)
        self.log(f"set-up: {done / 1e6:,.0f} of {total / 1e6:,.0f} MB written ({100 * done / max(total, 1):.0f}%, "
                 f"page {done // self.page_bytes} of {pages}), {rate / 1e6:.0f} MB/s, "
                 f"{'done' if done >= total else f'ETA {eta:.0f} s'} | peak RSS {fmt_gib(peak_rss_bytes())}")
