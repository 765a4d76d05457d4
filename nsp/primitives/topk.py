"""Top-K gradient compression in plain JAX: keep the k entries of largest magnitude as ``(values, indices)``.

A compressed gradient is ``values`` (x's dtype, shape ``(k,)``) and ``indices`` (int32 flat positions into
``x.ravel()``, shape ``(k,)``, sorted ascending). The ascending order is a contract: the C++ decompress-and-update
kernel streams pages in order and walks the indices with them. Decompression is a scatter-ADD, so an index may
repeat only with a value that is harmless to add.

Everything here is plain JAX but ``"auto"`` on a CPU, which runs an exact selection in C++ (``ffi/xla/topk_select.cc``,
a radix select on the magnitudes' bits: nothing input-sized allocated, where the jnp paths materialise masks and
conversions on XLA:CPU, about 4 bytes per entry); it runs under ``jax.jit`` on CPU and GPU; ``k`` and ``method``
are static Python values.

Methods, and the trade-off between them (measured with ``python bench/topk.py`` on a 2-core CPU — a shared,
noisy developer machine —, 16M fp32 at ratio 1% (k=167773), jax 0.10.2; medians of 7 interleaved rounds, ranges
over two runs and two inputs, gaussian and Student-t with 2 degrees of freedom):

=============  ============  ============  =============================================================
method         time          L2 mass kept  what it does
=============  ============  ============  =============================================================
lax.top_k      0.73–0.94 s   100%          reference: ``lax.top_k`` on ``|x|`` plus a gather (unsorted)
``exact``      0.75–0.92 s   100%          ``lax.top_k``, then sort the k indices ascending
``approx``     0.74–0.92 s   100%          ``lax.approx_max_k``: an exact top-k on CPU/GPU (see below)
``threshold``  47–83 ms      100%          sampled threshold, candidate compaction, exact top-k among
                                           the candidates: 11–17x faster than ``lax.top_k``
=============  ============  ============  =============================================================

One fused read pass over the same 16M entries (the roofline) takes 5–12 ms.

``"auto"`` on a CPU is the C++ selection (``python bench/topk.py``, record ``bench/results/topk.json``, 16M fp32
at 1%, median of 7): 21 ms on the gaussian input and 19 ms on the Student-t one (20-22x ``lax.top_k``; the
threshold path 12-13x in the same run), 28-31 ms on ties and clusters, 102-104 ms where its full radix select runs
(0.5% non-zero, all equal: 1.35x and 0.94x ``lax.top_k``; the threshold path's fallback 0.79x).

On a GPU the balance differs (``python bench/topk.py --size N`` on an NVIDIA H200, jax 0.11.2, at 1%; records in
``bench/results/topk_gpu_<N>.json``): ``lax.top_k`` takes about 1 ms at 16M entries and grows with the size, while
the threshold path's many small steps take 1.4–2 ms at any size up to 128M. So the threshold path is 0.6x the
exact one at 16M, about even at 32M, 1.7x at 64M and 2.6x at 128M on the gaussian and Student-t inputs; where its
fallback runs (ties, sparse gradients) it costs the exact path's time on top. ``"auto"`` therefore takes the
threshold path off the CPU only from ``ACCELERATOR_THRESHOLD_MIN_SIZE`` (64M) entries on; on the CPU it takes the
C++ selection (exact, and without the jnp paths' input-sized temporaries).

Why ``threshold`` is fast and still exact: XLA's CPU top-k and sort are slow (``lax.top_k`` of 1% of 16M takes
~0.8 s; sorting 16M takes ~9 s), whereas one fused elementwise pass over the data takes a few ms. So the threshold
method touches the full array only in one comparison pass and does all selection work on a candidate set of
about 1.4k entries:

1. estimate the magnitude above which ~1.4k entries lie from a fixed pseudo-random sample of ``|x|``;
2. compact the positions passing that threshold into a buffer of capacity 2k (a bit-packed stream compaction:
   32 mask bits per word, a prefix sum over the words, a bit select per output slot — much cheaper than
   ``jnp.nonzero``, which costs ~300 ms here);
3. find the exact k-th largest candidate magnitude by bisection on its float bits, keep the candidates above it
   (ties broken towards lower positions, as ``lax.top_k`` does) and compact them again to exactly k.

If between k and 2k candidates pass, every entry of the true top-k is a candidate, so the result *is* the exact
top-k. If the sample misjudged (fewer than k or more than 2k pass: ties, adversarial layouts), a ``lax.cond``
falls back to ``exact``, so the output is always exactly the top-k and always has the fixed shape ``(k,)``. Under
``jax.vmap`` that ``cond`` becomes a ``select`` and both branches run, which costs the exact path's time.

Costs to know: compiling the threshold path takes ~3 s per input shape on 2 cores (the exact fallback is compiled
into it), so compress one flat shard rather than many differently shaped leaves. For a small k (< 4096) or a
small input (< 65536 entries) ``lax.top_k`` is already cheap, and ``threshold``/``auto`` use the exact path.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["METHODS", "kept_count", "resolve_method", "topk_compress", "topk_decompress", "topk_feedback"]

METHODS = ("auto", "exact", "approx", "threshold")

# Where the threshold path pays (measured on 2 cores, fp32): lax.top_k is cheap for a small k (16M entries with
# k=1678: 125 ms, the threshold path 185 ms, its sample being a tenth of the input), slow for a large one (k=4096:
# 145 ms against 103 ms; k=167773: 874 ms against 79 ms). Below 65536 entries sampling is pointless. Above ratio
# 1/4 the 2k candidate buffer no longer sits well inside the input.
THRESHOLD_MIN_SIZE = 65536
THRESHOLD_MIN_K = 4096
THRESHOLD_MAX_RATIO = 0.25
# Off the CPU ("auto" on a GPU or TPU) the threshold path pays only for big inputs (module docstring): on an H200
# it was about even with the exact path at 32M entries on easy inputs and 0.5x where its fallback ran (ties, sparse
# gradients); 1.7x at 64M.
ACCELERATOR_THRESHOLD_MIN_SIZE = 2**26
# The sample is drawn so that ~SAMPLE_HITS of its points lie above the candidate threshold (at least SAMPLE_MIN
# points, cheap for large inputs). Since the sampled positions are uniform and independent of the data, the
# number of entries above the threshold is then known to a relative standard deviation of ~1/sqrt(SAMPLE_HITS)
# = 6% whatever the data: aiming at 1.4k candidates puts k about 4.5 sigma below and the 2k capacity about 7
# sigma above (a miss costs time, not accuracy: see the fallback).
CANDIDATE_FACTOR = 1.4
CAPACITY_FACTOR = 2.0
SAMPLE_HITS = 256
SAMPLE_MIN = 32768

_WORD = 32  # mask bits packed per word in the stream compaction


def kept_count(size: int, *, ratio: float | None = None, k: int | None = None) -> int:
    """Number of entries Top-K keeps out of ``size``, from either ``ratio`` or ``k``.

    Args:
        size: number of entries in the tensor (>= 1).
        ratio: fraction to keep, ``0 < ratio <= 1``; gives ``max(1, ceil(ratio * size))``, at most ``size``.
        k: number to keep, ``1 <= k <= size``.

    Returns:
        The number of entries kept.

    Raises:
        ValueError: if not exactly one of ``ratio`` and ``k`` is given, or a value is out of range.
        TypeError: if ``size`` or ``k`` is not an int.

    Example:
        >>> kept_count(1000, ratio=0.01)
        10
        >>> kept_count(1000, k=7)
        7
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1 (Top-K of an empty tensor), got {size}")
    if ratio is not None and k is not None:
        raise ValueError(f"give exactly one of ratio or k, not both (ratio={ratio!r}, k={k!r})")
    if ratio is None and k is None:
        raise ValueError("give exactly one of ratio or k (got neither)")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"k must be an int, got {k!r}")
        if not 1 <= k <= size:
            raise ValueError(f"k must be in [1, size={size}], got k={k}")
        return int(k)
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got ratio={ratio!r}")
    product = float(ratio) * size
    # 0.07 * 100 is 7.000000000000001 in floating point; do not let that round up to 8.
    nearest = round(product)
    kept = nearest if abs(product - nearest) <= 1e-9 * max(1.0, product) else math.ceil(product)
    return int(min(size, max(1, kept)))


def topk_compress(
    x: jax.Array,
    *,
    ratio: float | None = None,
    k: int | None = None,
    method: str = "auto",
    recall_target: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Keeps the ``k`` entries of ``x`` with the largest magnitude.

    Works on ``x.ravel()`` for a floating-point array of any shape (fp32, bf16, fp16; fp64 takes the exact path).

    Args:
        x: floating-point array.
        ratio: fraction of entries to keep (see :func:`kept_count`); give this or ``k``.
        k: number of entries to keep; give this or ``ratio``.
        method: ``"exact"`` (``lax.top_k``), ``"approx"`` (``lax.approx_max_k``: XLA has a native approximate
            top-k only on TPU; on CPU and GPU it lowers to an exact top-k, so it is not faster there),
            ``"threshold"`` (sampled threshold + candidate compaction, exact result, much faster for a large k;
            it takes the exact path where that is as fast: below 65536 entries, k below 4096, or ratio above 1/4)
            or ``"auto"`` (on CPU an exact C++ selection; on other platforms ``"threshold"`` from
            ``ACCELERATOR_THRESHOLD_MIN_SIZE`` entries on, ``"exact"`` below, chosen when the computation is lowered
            for one). See the module docstring for measured speeds.
        recall_target: passed to ``lax.approx_max_k`` by ``"approx"``; ignored by the other methods.

    Returns:
        ``(values, indices)``: ``values`` has ``x``'s dtype and shape ``(k,)``; ``indices`` are int32 positions
        into ``x.ravel()``, shape ``(k,)``, sorted ascending.

    Raises:
        TypeError: if ``x`` is not floating point.
        ValueError: for an unknown method or a bad ``ratio``/``k``.

    Example:
        >>> x = jnp.array([[0.5, -3.0], [2.0, 0.1]])
        >>> values, indices = topk_compress(x, k=2)
        >>> values.tolist(), indices.tolist()
        ([-3.0, 2.0], [1, 2])
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods are {', '.join(map(repr, METHODS))}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"topk_compress needs a floating-point array, got dtype {x.dtype}")
    if x.size >= 2**31:
        raise ValueError(f"x has {x.size} entries; int32 indices address at most 2**31 - 1")
    kk = kept_count(x.size, ratio=ratio, k=k)
    return _compress(x.ravel(), k=kk, method=_resolve_method(method, x.size, kk, x.dtype), recall=recall_target)


def topk_decompress(
    values: jax.Array, indices: jax.Array, shape: int | Sequence[int], dtype: jnp.dtype | None = None
) -> jax.Array:
    """Dense array of ``shape`` with ``values`` added at the flat positions ``indices``, zeros elsewhere.

    Scatter-ADD semantics: a repeated index sums its values (zero-valued padding is harmless).

    Args:
        values: 1-D array of kept values.
        indices: 1-D integer array of flat positions, same length as ``values``; out-of-range ones are dropped.
        shape: shape of the dense result.
        dtype: dtype of the result; defaults to ``values.dtype``.

    Returns:
        The dense array.

    Example:
        >>> topk_decompress(jnp.array([-3.0, 2.0]), jnp.array([1, 2]), (2, 2)).tolist()
        [[0.0, -3.0], [2.0, 0.0]]
    """
    values, indices = jnp.asarray(values), jnp.asarray(indices)
    if values.ndim != 1 or indices.ndim != 1:
        raise ValueError(f"values and indices must be 1-D, got shapes {values.shape} and {indices.shape}")
    if values.shape != indices.shape:
        raise ValueError(f"values and indices must have the same length, got {values.size} and {indices.size}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    dtype = values.dtype if dtype is None else dtype
    dense = jnp.zeros(math.prod(shape), dtype).at[indices].add(values.astype(dtype), mode="drop")
    return dense.reshape(shape)


# --------------------------------------------------------------------------------------------------------------
# Dispatch


def _threshold_applies(size: int, k: int, dtype: jnp.dtype) -> bool:
    # The bit tricks order magnitudes as float32 bit patterns, exact for dtypes of at most 32 bits.
    small_float = jnp.dtype(dtype).itemsize <= 4
    return small_float and size >= THRESHOLD_MIN_SIZE and THRESHOLD_MIN_K <= k <= THRESHOLD_MAX_RATIO * size


def _resolve_method(method: str, size: int, k: int, dtype: jnp.dtype) -> str:
    """The method ``_compress`` runs: "auto" stays "auto" (chosen per platform when lowered) where the threshold
    path applies; "threshold" and "auto" are "exact" where it does not."""
    if method in ("auto", "threshold"):
        return method if _threshold_applies(size, k, dtype) else "exact"
    return method


@functools.partial(jax.jit, static_argnames=("k", "method", "recall"))
def _compress(flat: jax.Array, *, k: int, method: str, recall: float) -> tuple[jax.Array, jax.Array]:
    if method == "exact":
        return _exact(flat, k)
    if method == "approx":
        return _approx(flat, k, recall)
    if method == "auto":
        # Chosen when lowered, by the platform the computation runs on: only the chosen path is compiled.
        other = _exact if flat.size < ACCELERATOR_THRESHOLD_MIN_SIZE else _threshold_or_exact
        return lax.platform_dependent(flat, cpu=lambda f: _select_cpu(f, k), default=lambda f: other(f, k))
    return _threshold_or_exact(flat, k)


def resolve_method(method: str, size: int, k: int, dtype) -> str:
    """The method ``topk_compress(method=method)`` runs on ``size`` entries of ``dtype`` at ``k``: ``"auto"`` (the
    C++ selection on a CPU, chosen per platform when lowered), ``"threshold"``, ``"exact"`` or ``"approx"``."""
    return _resolve_method(method, size, k, jnp.dtype(dtype))


def topk_feedback(residual: jax.Array, grads: Sequence[jax.Array], *, k: int, shards: int = 1,
                  decay: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-K with error feedback, in place, on a CPU (``ffi/xla/topk_select.cc``, target ``nsp_topk_feedback``).

    ``residual`` (float32, ``shards`` equal shards) plus the gradient leaves (float32 or bfloat16, concatenated in
    order over the residual's first elements): each shard's ``k`` largest magnitudes are returned (``values``
    float32 and shard-local ``indices``, shard by shard, indices ascending within each) and the rest, times
    ``decay``, is the new residual -- written over ``residual``'s buffer (donate it to keep it in place). What
    ``flatten_padded(grads) + residual`` followed by ``topk_compress`` per shard gives, with no flat copy of the
    gradient or of the sum.

    Returns:
      ``(values, indices, residual)``.
    """
    grads = list(grads)
    total = sum(int(g.size) for g in grads)
    if residual.dtype != jnp.float32 or residual.ndim != 1 or residual.shape[0] % shards or total > residual.size:
        raise ValueError(f"the residual must be a float32 vector of {shards} equal shards holding the gradient's "
                         f"{total} entries, got {residual.dtype}{list(residual.shape)}")
    if any(g.dtype not in (jnp.float32, jnp.bfloat16) for g in grads):
        raise TypeError("gradient leaves must be float32 or bfloat16")
    size = residual.shape[0] // shards
    if not 1 <= k <= size:
        raise ValueError(f"k must be in [1, {size}], got {k}")
    call = jax.ffi.ffi_call(
        "nsp_topk_feedback",
        (jax.ShapeDtypeStruct(residual.shape, jnp.float32), jax.ShapeDtypeStruct((shards * k,), jnp.float32),
         jax.ShapeDtypeStruct((shards * k,), jnp.int32)),
        input_output_aliases={0: 0}, vmap_method="sequential")
    residual, values, indices = call(residual, *grads, shards=np.int64(shards), decay=np.float32(decay))
    return values, indices, residual


def _select_cpu(flat: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The exact top-k in C++ (``ffi/xla/topk_select.cc``): a radix select on the magnitudes' bits, nothing
    input-sized allocated (the jnp paths materialise masks and conversions on XLA:CPU, 4 bytes per entry)."""
    if flat.dtype not in (jnp.float32, jnp.bfloat16):
        return _threshold_or_exact(flat, k)
    call = jax.ffi.ffi_call("nsp_topk_select", (jax.ShapeDtypeStruct((k,), flat.dtype),
                                                jax.ShapeDtypeStruct((k,), jnp.int32)), vmap_method="sequential")
    return call(flat)


def _threshold_or_exact(flat: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    values, indices, ok = _threshold(flat, k)
    # Candidate count outside [k, capacity]: the sample misjudged the data; the exact path is always right.
    return lax.cond(ok, lambda: (values, indices), lambda: _exact(flat, k))


# --------------------------------------------------------------------------------------------------------------
# exact / approx: a top-k over everything, then put the kept entries in index order


def _exact(flat: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    _, indices = lax.top_k(jnp.abs(flat), k)
    return _in_index_order(flat, indices)


def _approx(flat: jax.Array, k: int, recall: float) -> tuple[jax.Array, jax.Array]:
    _, indices = lax.approx_max_k(jnp.abs(flat), k, recall_target=recall)
    return _in_index_order(flat, indices)


def _in_index_order(flat: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Sort the indices alone and gather the values after: for k=167773 that took 14 ms here, against 70 ms for
    # a two-operand (index, value) sort.
    indices = lax.sort(indices.astype(jnp.int32))
    return flat[indices], indices


# --------------------------------------------------------------------------------------------------------------
# threshold: sample -> candidates -> exact top-k among the candidates


def _threshold(flat: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact top-k through a sampled threshold; ``ok`` is False when the candidate count left [k, capacity]."""
    n = flat.size
    capacity = min(n, int(CAPACITY_FACTOR * k))
    bits = _magnitude_bits(flat)  # fused into the passes that read it; never materialised on its own

    cut = _candidate_cut(bits, k)
    cand_pos, cand_count = _compact(bits >= cut, capacity)
    ok = (cand_count >= k) & (cand_count <= capacity)

    # Slots past the candidate count hold junk positions: give them magnitude -1 so they are never kept.
    cand_bits = jnp.where(jnp.arange(capacity) < cand_count, bits[cand_pos], -1)
    kth = _kth_largest(cand_bits, k, lo=cut)
    keep = _keep_mask(cand_bits, kth, k)
    slot, _ = _compact(keep, k)  # exactly k set: every output slot is valid
    indices = cand_pos[slot]
    return flat[indices], indices, ok


def _magnitude_bits(a: jax.Array) -> jax.Array:
    """|a| as the int32 bit pattern of a float32: for non-negative floats the integer order is the float order.

    NaN lands above +inf, so NaNs count as the largest magnitudes (as in ``lax.top_k``).
    """
    return lax.bitcast_convert_type(jnp.abs(a.astype(jnp.float32)), jnp.int32)


def _sample_positions(n: int, count: int) -> jax.Array:
    """``count`` fixed pseudo-random positions in ``[0, n)`` (with repetition), the same for every call.

    A strided sample (every n/count-th entry) would alias with the layout of a flattened matrix: with a row
    length that divides the stride it sees a single column, and columns of a gradient can differ in scale by
    orders of magnitude. Hashing the sample number scatters the positions over rows and columns alike, needs no
    PRNG state, and is cheaper inside XLA than ``jax.random`` (an integer hash of an iota, then one gather).
    """
    h = jnp.arange(count, dtype=jnp.uint32)
    # An invertible 32-bit integer mixer (xor-shift / odd multiply rounds): consecutive inputs give scattered,
    # well-spread outputs.
    h = h * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)
    h = (h ^ (h >> 16)) * jnp.uint32(0x21F0AAAD)
    h = (h ^ (h >> 15)) * jnp.uint32(0x735A2D97)
    h = h ^ (h >> 15)
    return (h % jnp.uint32(n)).astype(jnp.int32)


def _sample_size(n: int, k: int) -> int:
    """Enough sample points that ~SAMPLE_HITS of them lie above the candidate threshold, at least SAMPLE_MIN."""
    return min(n, max(SAMPLE_MIN, math.ceil(SAMPLE_HITS * n / (CANDIDATE_FACTOR * k))))


def _candidate_cut(bits: jax.Array, k: int) -> jax.Array:
    """Magnitude (as float bits) above which about ``CANDIDATE_FACTOR * k`` entries of the input are expected."""
    n = bits.size
    sample_size = _sample_size(n, k)
    sample = bits[_sample_positions(n, sample_size)]
    hits = min(sample_size, max(1, round(CANDIDATE_FACTOR * k * sample_size / n)))
    return _kth_largest(sample, hits)


def _kth_largest(bits: jax.Array, k: int, lo: jax.Array | int = 0) -> jax.Array:
    """The k-th largest of non-negative int32 ``bits`` by bisection: the largest t with ``count(bits >= t) >= k``.

    Each step is one fused compare-and-count pass; far cheaper on XLA CPU than ``lax.top_k`` (which takes ~120 ms
    to find the 160k-th largest of 320k) or a sort. ``lo`` is a known lower bound (``count(bits >= lo) >= k``);
    the loop runs about log2(max - lo) steps.
    """
    lo = jnp.asarray(lo, jnp.int32)
    hi = jnp.maximum(jnp.max(bits), lo)

    def step(bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2  # hi - lo < 2**31: no overflow
        enough = jnp.sum(bits >= mid, dtype=jnp.int32) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo, _ = lax.while_loop(lambda b: b[0] < b[1], step, (lo, hi))
    return lo


def _keep_mask(bits: jax.Array, kth: jax.Array, k: int) -> jax.Array:
    """Exactly k entries: all above ``kth``, then the lowest-position ones equal to it (``lax.top_k``'s tie rule)."""
    above = bits > kth
    tied = bits == kth
    room = k - jnp.sum(above, dtype=jnp.int32)
    return above | (tied & (jnp.cumsum(tied, dtype=jnp.int32) <= room))


def _compact(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Positions of the set entries of a 1-D ``mask``, ascending, in a buffer of ``capacity``; and their count.

    Slots past the count (or past ``capacity`` set entries, which are dropped) hold arbitrary in-range positions.

    Stream compaction without ``jnp.nonzero`` (a prefix sum and scatter over every entry, ~300 ms for 16M here):
    pack the mask into 32-bit words in one fused pass, prefix-sum the per-word popcounts (32x fewer entries),
    find the word holding each output slot's set bit, and select that bit inside the word.
    """
    n = mask.size
    n_words = -(-n // _WORD)
    lanes = jnp.pad(mask, (0, n_words * _WORD - n)).reshape(n_words, _WORD).astype(jnp.uint32)
    words = jnp.sum(lanes << jnp.arange(_WORD, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)  # disjoint bits: + is |
    counts = lax.population_count(words).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts  # output slot of each word's first set bit
    # Word of each slot: mark the first slot of every non-empty word with its number, then carry it forward with
    # a running max. (~10 ms for 512k words here, against ~30 ms for a binary search per slot.)
    first = jnp.where(counts > 0, starts, capacity)  # empty words, and words past capacity, are dropped
    marks = jnp.zeros(capacity, jnp.int32).at[first].max(jnp.arange(n_words, dtype=jnp.int32), mode="drop")
    word = lax.cummax(marks)
    slot = jnp.arange(capacity, dtype=jnp.int32)
    rank = slot - starts[word]  # which set bit of its word slot j is
    positions = jnp.minimum(word * _WORD + _select_bit(words[word], rank), n - 1)
    return positions, starts[-1] + counts[-1]


def _select_bit(words: jax.Array, rank: jax.Array) -> jax.Array:
    """Position of the ``rank``-th (0-based) set bit of each uint32 word, by halving the word five times."""
    pos = jnp.zeros(words.shape, jnp.int32)
    rank = rank.astype(jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = lax.population_count((words >> pos.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1))
        low = low.astype(jnp.int32)
        go_high = rank >= low
        pos = jnp.where(go_high, pos + width, pos)
        rank = jnp.where(go_high, rank - low, rank)
    return pos
