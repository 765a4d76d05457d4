"""The params fingerprint of the storage transforms: whether the params given to ``update`` are the ones the
previous update led to.

A fingerprint is one uint32 per params leaf: the wrapping sum over the leaf's words of murmur3's finaliser (a
bijection) of ``word ^ (position * 0x9E3779B9)``. A 1-, 2- or 4-byte element is one word (its bits, zero-extended),
an 8-byte one two (low word first). Integer sums are associative, so however the sum is cut up the result is the
same bits: any single changed element always changes the hash, several cancel out with probability about 2**-32.

It must cost no params-sized memory (the storage transform's step holds the gradient and little else), so it is
computed where each platform does that well:

- **CPU**: in C++ (``ffi/xla/params_hash.cc``: ``nsp_params_hash``, ``nsp_next_params_update[_flat]``),
  reading each leaf where it lies on the kernels' thread pool. XLA:CPU fuses no integer elementwise work into a
  reduction, so a jnp hash of a leaf writes a uint32 per element; cut into chunks in a loop, XLA hoists whole-leaf
  conversions out of the loop (bf16 ops are computed in float32 there), which cost 4-8 bytes per parameter.
- **elsewhere** (GPU): the same hash in jnp, whole leaves at once, which XLA fuses into one reduction per leaf:
  one read of the leaf, no temporaries, no loop.

Both give the same bits (tests compare them), so a state made on one platform checks params on the other.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import nsp.primitives  # noqa: F401  (registers the FFI targets)
from nsp.primitives.store_update import explicit_axes

#: What the params may be rounded to between ``init`` and the first update (besides their own dtype); the
#: codes are the ``cast`` attribute of ``nsp_params_hash``.
INIT_CASTS = (jnp.float32, jnp.bfloat16, jnp.float16)
WIDTH = 1 + len(INIT_CASTS)

_CAST_CODES = {jnp.dtype(jnp.float32): 1, jnp.dtype(jnp.bfloat16): 2, jnp.dtype(jnp.float16): 3}
#: Float dtypes the C++ hash converts itself (float64 params keep their roundings in XLA).
_CXX_FLOATS = tuple(_CAST_CODES)
_GOLDEN = 0x9E3779B9


def _leaf_bits(x: jax.Array) -> jax.Array:
    """The leaf's bits as flat uint32 words: its own bit patterns, zero-extended (8-byte values give two words).

    Only bitcasts and integer conversions: a float conversion here could be dropped by XLA's excess-precision
    rewrites (``f32 -> bf16 -> f32`` pairs), and the hash must see exactly the bits the params hold."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if jnp.issubdtype(x.dtype, jnp.complexfloating) or size not in (1, 2, 4, 8):
        raise TypeError(f"nsp optimizers cannot fingerprint params of dtype {x.dtype}")
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _mix_sum(words: jax.Array) -> jax.Array:
    """The hash of a leaf's words (jnp: XLA fuses the mixing into the sum on a GPU)."""
    pos = jax.lax.iota(jnp.uint32, words.shape[0])
    h = words ^ (pos * jnp.uint32(_GOLDEN))
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return jnp.sum(h, dtype=jnp.uint32)


def _stack(hashes: list[jax.Array]) -> jax.Array:
    return jnp.stack(hashes) if hashes else jnp.zeros((0,), jnp.uint32)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


# ---- jnp: every platform but the CPU ---------------------------------------------------------------------------

def _hash_jnp(x: jax.Array, cast=None) -> jax.Array:
    if cast is not None and _is_float(x):
        x = x.astype(cast)
    return _mix_sum(_leaf_bits(x))


def _next_params_jnp(p: jax.Array, t: jax.Array, wide: bool) -> jax.Array:
    return _mix_sum(_leaf_bits(next_params(p, t, wide)))


# ---- C++: the CPU ----------------------------------------------------------------------------------------------

def _ffi_hash(leaves: list[jax.Array], target: str, count: int, **attrs) -> jax.Array:
    """``count`` hashes of ``leaves`` by the C++ target ``target``."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((count,), jnp.uint32), vmap_method="sequential")
    return call(*leaves, **{k: np.int32(v) for k, v in attrs.items()})


def _hash_cpu(leaves: list[jax.Array], cast=None) -> jax.Array:
    """Per leaf: the C++ hash, but for float64 leaves with a cast (jnp on the CPU: rare, x64 params only)."""
    code = 0 if cast is None else _CAST_CODES[jnp.dtype(cast)]
    by_cxx = [i for i, x in enumerate(leaves) if code == 0 or not _is_float(x) or x.dtype in _CXX_FLOATS]
    out = [None] * len(leaves)
    if by_cxx:
        hashes = _ffi_hash([leaves[i] for i in by_cxx], "nsp_params_hash", len(by_cxx), cast=code)
        for j, i in enumerate(by_cxx):
            out[i] = hashes[j]
    for i, x in enumerate(leaves):
        if out[i] is None:
            out[i] = _hash_jnp(x, cast)
    return _stack(out)


def _landed_hash(params: list[jax.Array], updates: list[jax.Array]) -> jax.Array:
    """Per leaf, the hash of where float32 ``updates`` take bf16/f16 ``params``: the params
    ``optax.apply_updates`` gives, ``p + u`` in float32 rounded back to the params' dtype. That is the new params
    ``t`` the updates were made from (``update_in_params_dtype``) unless ``t`` is below ``|p| / 2**16`` (a param
    stepping onto or across zero): there ``t - p`` is inexact in float32 and the sum lands on a neighbour of
    ``t``, which the fingerprint must expect, or the next update would take the params for changed ones.

    Hashed from the next params themselves, as the step's own ``optax.apply_updates`` computes them (XLA merges
    the two: a hash reading ``p`` in a call of its own made XLA keep a copy of the params for it, 1.6-1.9 bytes
    per parameter)."""
    return _hash_cpu([jnp.asarray(p + u).astype(p.dtype) for p, u in zip(params, updates)])


def _updates_cpu(params: list[jax.Array], new: list[jax.Array], wide: bool):
    """``(updates, hashes)`` on the CPU. For params narrower than float32 with ``wide`` updates the updates stay jnp
    (XLA fuses them into ``optax.apply_updates``) and the hash is that of where they land (``_landed_hash``).
    Otherwise C++ computes the updates and the hash of where they lead in one pass, writing each update over its
    new params when their dtypes match.

    One edge: a step from or to an infinite param (``p + (inf - p)`` is NaN, whose bits XLA and C++ need not
    share) makes the next update see params that differ from the fingerprint and adopt them (the step is still the
    one optax would take: it starts from the params given)."""
    updates, hashes = [None] * len(params), [None] * len(params)
    narrow = [i for i, p in enumerate(params)
              if wide and p.dtype in _CXX_FLOATS and p.dtype != jnp.dtype(jnp.float32)]
    if narrow:
        for i in narrow:
            updates[i] = update_in_params_dtype(new[i], params[i], wide)
        h = _landed_hash([params[i] for i in narrow], [updates[i] for i in narrow])
        for j, i in enumerate(narrow):
            hashes[i] = h[j]
    by_cxx = [i for i, (p, t) in enumerate(zip(params, new))
              if hashes[i] is None and p.dtype in _CXX_FLOATS and t.dtype in (jnp.dtype(jnp.float32), p.dtype)
              and p.size == t.size and (not wide or p.dtype == jnp.dtype(jnp.float32))]
    if by_cxx:
        out_types = [jax.ShapeDtypeStruct((len(by_cxx),), jnp.uint32)]
        out_types += [jax.ShapeDtypeStruct(params[i].shape, params[i].dtype) for i in by_cxx]
        count = len(by_cxx)
        aliases = {count + j: 1 + j for j, i in enumerate(by_cxx)
                   if new[i].dtype == params[i].dtype and new[i].shape == params[i].shape}
        call = jax.ffi.ffi_call("nsp_next_params_update", out_types, input_output_aliases=aliases,
                                vmap_method="sequential")
        outs = call(*[params[i] for i in by_cxx], *[new[i] for i in by_cxx])
        for j, i in enumerate(by_cxx):
            hashes[i], updates[i] = outs[0][j], outs[1 + j]
    for i, (p, t) in enumerate(zip(params, new)):
        if hashes[i] is None:
            updates[i] = update_in_params_dtype(t, p, wide)
            hashes[i] = _next_params_jnp(p, t, wide)
    return updates, _stack(hashes)


def _explicit_mesh() -> bool:
    """Whether the computation is traced under a mesh with Explicit axes (shardings are part of the types)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and explicit_axes(mesh)


def _spec(x: jax.Array) -> P:
    """``x``'s partition spec under an Explicit mesh (P() when its type carries none)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None) or P()


def _by_platform(cpu, other, specs=None):
    """``cpu()`` when the computation runs on a CPU, else ``other()`` (decided at lowering). Under an Explicit
    mesh both branches' outputs are resharded to ``specs`` (a pytree of PartitionSpecs like the outputs: the
    params' own for updates, replicated for hashes), so that their types agree whatever each branch computed."""
    if specs is not None and _explicit_mesh():
        def settle(branch):
            return lambda: jax.tree_util.tree_map(jax.sharding.reshard, branch(), specs,
                                                  is_leaf=lambda x: isinstance(x, P))
        cpu, other = settle(cpu), settle(other)
    return jax.lax.platform_dependent(cpu=cpu, default=other)


# ---- what the storage transform uses ---------------------------------------------------------------------------

def next_params(p: jax.Array, t: jax.Array, wide: bool = False) -> jax.Array:
    """``optax.apply_updates(p, u)`` for the update ``u`` the storage transform returns for new params ``t``
    (``update_in_params_dtype``)."""
    u = update_in_params_dtype(t, p, wide)
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)


def update_in_params_dtype(new: jax.Array, param: jax.Array, wide: bool = False) -> jax.Array:
    """The update that ``optax.apply_updates`` turns into the store's new fp32 master rounded to the params' dtype
    (``t``).

    By default it is ``t - p`` in the params' dtype (optax's rule): ``p + (t - p)`` is exactly ``t`` whenever the
    difference is exact in that dtype (Sterbenz: ``t`` and ``p`` within a factor of 2 of each other). A step
    larger than that (a param near zero, or crossing it) needs a ``u`` finer than the dtype holds at ``u``'s size:
    ``p + u`` then lands within an ulp of ``t``, as ``p + (t - p)`` does in optax's own arithmetic.

    ``wide`` (``float32_updates``): for params narrower than float32 (bfloat16, float16) the update is ``t - p`` in
    float32, where the difference of two such numbers is exact while their exponents differ by at most 16 (and,
    with ``p`` far below ``t``, off by less than a float32 ulp of ``t``: nothing that moves ``t`` off its own grid
    point), so the sum rounded back to the params' dtype is ``t``: the params depend on the master alone. Not
    where ``t`` is far below ``p`` (``|t| < |p| / 2**16``: a param stepping onto or across zero, rare at small
    learning rates): no float32 ``u`` takes ``p`` exactly there, and the sum lands on a neighbour of ``t``. The
    fingerprint expects exactly that landing (``_landed_hash``), so the next update does not mistake it for a
    change; a run resumed from the store then starts from ``t`` itself (the master's rounding), a last-bit
    difference in those params from the run it continues."""
    target = new.astype(param.dtype)
    promoted = jnp.promote_types(param.dtype, jnp.float32)
    update = target.astype(promoted) - param.astype(promoted)
    return update if wide else update.astype(param.dtype)


@jax.jit
def fingerprint(params) -> jax.Array:
    """uint32 ``[leaves]``: each params leaf's hash."""
    leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return _by_platform(lambda: _hash_cpu(leaves), lambda: _stack([_hash_jnp(x) for x in leaves]), P())


@jax.jit
def init_fingerprint(params) -> jax.Array:
    """``[leaves, WIDTH]``: the params as given, and rounded to each of ``INIT_CASTS``."""
    leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    if not leaves:
        return jnp.zeros((0, WIDTH), jnp.uint32)
    casts = (None, *INIT_CASTS)
    return _by_platform(
        lambda: jnp.stack([_hash_cpu(leaves, cast) for cast in casts], axis=1),
        lambda: jnp.stack([_stack([_hash_jnp(x, cast) for x in leaves]) for cast in casts], axis=1), P())


def updates_and_expected(params, new_params, wide: bool = False):
    """``(updates, expected)``: the updates the storage transform returns for new params ``new_params``
    (``update_in_params_dtype`` of each leaf, a tree like ``params``) and the ``[leaves, WIDTH]`` fingerprint of
    ``optax.apply_updates(params, updates)``, computed without materialising the next params.

    Every write over the params comes after the fingerprint's read of them (the updates are its results), so a
    step that donates its params and writes the next ones over them needs no copy of the params."""
    ps = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    ts = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(new_params)]
    treedef = jax.tree_util.tree_structure(params)
    if not ps:
        return jax.tree_util.tree_unflatten(treedef, []), jnp.zeros((0, WIDTH), jnp.uint32)

    def other():
        return ([update_in_params_dtype(t, p, wide) for p, t in zip(ps, ts)],
                _stack([_next_params_jnp(p, t, wide) for p, t in zip(ps, ts)]))

    updates, fp = _by_platform(lambda: _updates_cpu(ps, ts, wide), other, ([_spec(p) for p in ps], P()))
    return jax.tree_util.tree_unflatten(treedef, updates), jnp.broadcast_to(fp[:, None], (fp.shape[0], WIDTH))


def updates_and_expected_flat(params, new_flat: jax.Array, offsets: list[int], wide: bool = False):
    """``updates_and_expected`` for new params given as one flat vector (a store layout's: leaf ``l`` at
    ``offsets[l]``). On the CPU, when the flat vector has the params' one dtype (float32 or bfloat16: the store
    update returns it so), nothing params-sized is made: the updates are written over the flat vector (or, for
    ``wide`` updates of bf16 params, computed from its slices inside ``optax.apply_updates``)."""
    ps = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    treedef = jax.tree_util.tree_structure(params)
    if not ps:
        return jax.tree_util.tree_unflatten(treedef, []), jnp.zeros((0, WIDTH), jnp.uint32)

    if _explicit_mesh():
        # The store's flat params come sharded over its axis; the leaves cut from them are whole (as the params
        # are under a data-parallel mesh): gather them first, as XLA does by itself on an Auto mesh.
        new_flat = jax.sharding.reshard(new_flat, P())

    def leaf(flat, i):
        return flat[offsets[i]: offsets[i] + ps[i].size].reshape(ps[i].shape)

    def by_leaves():
        return updates_and_expected(params, jax.tree_util.tree_unflatten(
            treedef, [leaf(new_flat, i) for i in range(len(ps))]), wide)

    dtype = new_flat.dtype
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) or any(p.dtype != dtype for p in ps):
        return by_leaves()

    def cpu():
        if wide and dtype != jnp.dtype(jnp.float32):
            updates = [update_in_params_dtype(leaf(new_flat, i), p, wide) for i, p in enumerate(ps)]
            return updates, _landed_hash(ps, updates)
        call = jax.ffi.ffi_call("nsp_next_params_update_flat",
                                (jax.ShapeDtypeStruct((len(ps),), jnp.uint32),
                                 jax.ShapeDtypeStruct(new_flat.shape, dtype)),
                                input_output_aliases={len(ps): 1}, vmap_method="sequential")
        hashes, flat_updates = call(*ps, new_flat, offsets=np.asarray(offsets, np.int64))
        return [leaf(flat_updates, i) for i in range(len(ps))], hashes

    def other():
        updates, expected = by_leaves()
        return jax.tree_util.tree_leaves(updates), expected[:, 0]

    updates, fp = _by_platform(cpu, other, ([_spec(p) for p in ps], P()))
    return jax.tree_util.tree_unflatten(treedef, updates), jnp.broadcast_to(fp[:, None], (fp.shape[0], WIDTH))


def params_changed(expected: jax.Array, params) -> jax.Array:
    """Whether ``params`` differ from the ones the ``[leaves, WIDTH]`` fingerprint ``expected`` describes (a
    bool, traced under jit)."""
    fp = fingerprint(params)
    if expected.shape != (fp.shape[0], WIDTH):
        raise ValueError(f"this StorageState fingerprints {expected.shape[0]} params leaves, the params have "
                         f"{fp.shape[0]}: pass the state tx.init made for these params")
    return jnp.logical_not(jnp.all(jnp.any(fp[:, None] == expected, axis=1)))
