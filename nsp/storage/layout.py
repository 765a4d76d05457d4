"""How a parameter pytree maps onto a store: flatten, partition into equal shards, cut shards into pages.

All trainable leaves are flattened in JAX's canonical pytree order (``jax.tree_util.tree_flatten_with_path``:
dict keys sorted, sequences in order) into one fp32 vector. That vector is cut into ``num_shards`` equal shards
(the last padded with zeros, which no update ever moves), one per store shard / mesh device, and every shard
into pages of ``page_elems`` elements. The layout is model-agnostic: only sizes matter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PAGE_BYTES_DEFAULT = 4 * 2**20  # 4 MiB pages (Angel-PTM)
# Page sets a file-tier shard streams through: with fewer, the readers wait on the writer (4 measured ~20% slower
# than 8 on an update of 1.1 GiB of state; 16 and 32 gained nothing more). 8 x 3 x 4 MiB = 96 MiB per shard.
PAGES_IN_FLIGHT_DEFAULT = 8
_STATE_ITEMSIZE = 4  # master params and moments are fp32


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf: its tree path, shape, dtype and place in the flat vector."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The flattened, partitioned, paged shape of a store's state."""

    leaves: tuple[Leaf, ...]
    num_shards: int
    page_elems: int

    @property
    def total(self) -> int:
        """Real (unpadded) number of parameters."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def shard_size(self) -> int:
        """Elements per shard (every shard has the same size; the last one is zero-padded)."""
        return max(1, -(-self.total // self.num_shards))

    @property
    def padded_total(self) -> int:
        return self.shard_size * self.num_shards

    @property
    def pages_per_shard(self) -> int:
        return -(-self.shard_size // self.page_elems)

    @classmethod
    def from_tree(cls, params: Any, *, num_shards: int, page_bytes: int = PAGE_BYTES_DEFAULT) -> Layout:
        """Builds the layout of ``params`` (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        check_page_bytes(page_bytes)
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        if not flat:
            raise ValueError("the params tree has no leaves")
        leaves, offset = [], 0
        for path, leaf in flat:
            name = jax.tree_util.keystr(path)
            dtype = np.dtype(leaf.dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"parameter {name} has dtype {dtype}; only floating-point leaves can be trained")
            shape = tuple(int(d) for d in leaf.shape)
            leaves.append(Leaf(name, shape, dtype.name, offset))
            offset += math.prod(shape)
        # A shard smaller than a page gets a page of its own size (in 4 KiB steps): a store of a few hundred
        # params should not read and write megabytes a step.
        shard = max(1, -(-offset // int(num_shards)))
        page_elems = min(page_bytes // _STATE_ITEMSIZE, -(-shard // _MIN_PAGE_ELEMS) * _MIN_PAGE_ELEMS)
        return cls(tuple(leaves), int(num_shards), page_elems)

    def to_json(self) -> dict:
        return {
            "num_shards": self.num_shards,
            "page_elems": self.page_elems,
            "total": self.total,
            "shard_size": self.shard_size,
            "leaves": [
                {"path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype, "offset": leaf.offset}
                for leaf in self.leaves
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        leaves = tuple(Leaf(d["path"], tuple(d["shape"]), d["dtype"], int(d["offset"])) for d in data["leaves"])
        return cls(leaves, int(data["num_shards"]), int(data["page_elems"]))

    def describe_difference(self, other: Layout) -> str | None:
        """None when ``other`` is the same layout, else what differs (for error messages)."""
        if self.num_shards != other.num_shards:
            return f"{self.num_shards} shards vs {other.num_shards}"
        if self.page_elems != other.page_elems:
            return f"pages of {self.page_elems} vs {other.page_elems} elements"
        if len(self.leaves) != len(other.leaves):
            return f"{len(self.leaves)} leaves vs {len(other.leaves)}"
        for a, b in zip(self.leaves, other.leaves):
            if (a.path, a.shape) != (b.path, b.shape):
                return f"leaf {a.path} {a.shape} vs {b.path} {b.shape}"
        return None

    def flatten(self, tree: Any, dtype=jnp.float32) -> jax.Array:
        """The padded flat vector (``padded_total`` elements) of a tree shaped like the layout."""
        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) != len(self.leaves):
            raise ValueError(f"tree has {len(leaves)} leaves, the layout has {len(self.leaves)}")
        parts = []
        for leaf, spec in zip(leaves, self.leaves):
            if tuple(leaf.shape) != spec.shape:
                raise ValueError(f"leaf {spec.path} has shape {tuple(leaf.shape)}, the layout says {spec.shape}")
            parts.append(jnp.ravel(leaf).astype(dtype))
        pad = self.padded_total - self.total
        if pad:
            parts.append(jnp.zeros((pad,), dtype))
        return jnp.concatenate(parts)

    def gather(self, leaves: list[np.ndarray], begin: int, n: int) -> np.ndarray:
        """Elements ``[begin, begin + n)`` of the padded flat vector of ``leaves`` (host arrays in layout
        order) as fp32, copying only those elements (zeros in the padding)."""
        out = np.zeros(n, np.float32)
        end = begin + n
        for leaf, spec in zip(leaves, self.leaves):
            lo, hi = max(begin, spec.offset), min(end, spec.offset + spec.size)
            if lo < hi:
                out[lo - begin : hi - begin] = np.ravel(leaf)[lo - spec.offset : hi - spec.offset]
        return out

    def unflatten(self, flat: Any, treedef_like: Any, dtype=None) -> Any:
        """Splits a flat vector back into a tree with the structure of ``treedef_like``."""
        treedef = jax.tree_util.tree_structure(treedef_like)
        out = []
        for spec in self.leaves:
            piece = flat[spec.offset : spec.offset + spec.size].reshape(spec.shape)
            out.append(piece.astype(dtype or spec.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)


#: Pages are whole 4 KiB blocks (O_DIRECT), so a page shrunk to a small shard keeps a multiple of this many elements.
_MIN_PAGE_ELEMS = 4096 // 4


def check_page_bytes(page_bytes: int) -> None:
    if page_bytes < 4096 or page_bytes % 4096:
        raise ValueError(f"page_bytes must be a positive multiple of 4096, got {page_bytes}")
