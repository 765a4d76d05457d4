"""The update path: the one Python door into the shard engines' update, whichever way it is called.

A store is updated eagerly (``StateStore.update``, numpy in and out, on the calling thread) or inside a jitted
step (``nsp.primitives.store_update`` and ``store_update_leaves``, an XLA FFI custom call per device shard). Both
ask the engine for the same step, and what is checked on the Python side of that line is written here, once:

- the gradient: float32 or bfloat16 (``check_gradient_dtype``); dense, the store's padded flat vector
  (``check_dense_size``); Top-K compressed, int32 shard-local indices (``check_indices_dtype``);
- the NaN/Inf skip: a step whose gradient (dense, or the Top-K values) holds a NaN or an Inf is skipped by every
  shard alike, the store staying at its version (``gradient_finite``: one C++ pass over host arrays, a reduction
  over traced ones; or, where ``CHECK_IN_HANDLER`` is passed, the engine's own pass);
- the version: an update reads a version the store still holds (``check_version_held``; inside jit the engine
  says so itself, as it alone knows when the step runs), and a skip leaves the committed one (``check_skip``);
- adopting the caller's params (``params_operands``): the flag and the params leaves the engine takes, in one
  dtype.

``run_update`` is ``StateStore.update``'s body on these checks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from nsp import engine as native
from nsp.storage.format import StoreError
from nsp.storage.layout import Layout

if TYPE_CHECKING:
    from nsp.storage.store import StateStore

#: The ``apply`` operand that has the engine check the gradient for NaN/Inf itself (inside its update pass where
#: it can, else a vectorised C++ pass first) instead of being told the result.
CHECK_IN_HANDLER = -1

_GRADIENT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


# ---- checks ------------------------------------------------------------------------------------------------------


def check_gradient_dtype(dtype: Any, what: str = "gradients") -> None:
    """A gradient (dense, or Top-K values) travels as float32 or bfloat16."""
    if np.dtype(dtype) not in _GRADIENT_DTYPES:
        raise TypeError(f"{what} must be float32 or bfloat16, got {dtype}")


def check_indices_dtype(dtype: Any) -> None:
    """Top-K positions are int32, shard-local."""
    if np.dtype(dtype) != np.dtype(np.int32):
        raise TypeError(f"indices must be int32, got {dtype}")


def check_dense_size(layout: Layout, shape: tuple[int, ...], *, flat: bool) -> None:
    """A dense gradient is the store's padded flat vector (``layout.flatten``): of that shape (``flat``), or of
    that many elements."""
    size = math.prod(shape)
    if (tuple(shape) == (layout.padded_total,)) if flat else size == layout.padded_total:
        return
    got = f"{size} elements" if len(shape) == 1 or not flat else f"shape {tuple(shape)}"
    raise ValueError(f"grad has {got}; the store holds {layout.num_shards} shards x {layout.shard_size} = "
                     f"{layout.padded_total}: pass the padded flat vector (layout.flatten pads to that)")


def gradient_finite(operands: list[Any]) -> bool | jax.Array:
    """Whether every gradient operand (the dense gradient, or the Top-K values; never the indices) is finite: a
    step with a NaN or an Inf is skipped by every shard. Host arrays are checked by one multithreaded C++ pass each
    (bf16 arrays as their uint16 bit patterns; numpy's isfinite is one thread plus a temporary as big as the
    gradient): a bool. JAX arrays by a reduction in the step: an int32 flag, 1 when finite."""
    if all(isinstance(x, np.ndarray) for x in operands):
        return all(native.all_finite(x.view(np.uint16) if x.dtype == jnp.bfloat16 else x) for x in operands)
    flags = [jnp.all(jnp.isfinite(x)) for x in operands]
    return jnp.stack(flags).all().astype(jnp.int32) if len(flags) > 1 else flags[0].astype(jnp.int32)


def check_version_held(store: StateStore, version: int) -> None:
    """An update reads a version the store still holds: the committed one, or the one before it (a replay)."""
    if version not in store.held_versions():
        raise StoreError(f"the store no longer holds version {version}: it holds {store.held_versions()} "
                         f"(committed: {store.version})")


def check_skip(store: StateStore, version: int) -> None:
    """A skipped step leaves the store at its committed version, so it must have been asked of that version."""
    if version != store.version:
        raise StoreError(f"cannot skip from version {version}: the store is at {store.version}")


def params_operands(params: list[Any] | None, adopt: Any) -> tuple[jax.Array, list[jax.Array]]:
    """The ``adopt`` flag and the params leaves the engine takes when it adopts the caller's params (float32 or
    bfloat16, one dtype; others cast to float32)."""
    if params is None:
        return jnp.int32(0), []
    leaves = list(params)
    dtype = leaves[0].dtype if leaves and all(x.dtype == leaves[0].dtype for x in leaves) else None
    if dtype not in (jnp.float32, jnp.bfloat16):
        leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
    return jnp.asarray(adopt).astype(jnp.int32), leaves


# ---- the eager update --------------------------------------------------------------------------------------------


def split_grads(layout: Layout, grad: Any, indices: Any, values: Any) -> list[dict]:
    """The gradient as each shard's keyword arguments to its engine (``grad``/``grad_bf16``, or ``indices`` with
    ``values``/``values_bf16``): a dense vector cut into shards, or per-shard lists as given."""
    import ml_dtypes

    n, shard_size = layout.num_shards, layout.shard_size

    def as_kw(arr, name):
        arr = np.asarray(arr)
        check_gradient_dtype(arr.dtype, name)
        if arr.dtype == ml_dtypes.bfloat16:
            return {f"{name}_bf16": np.ascontiguousarray(arr).view(np.uint16)}
        return {name: np.ascontiguousarray(arr)}

    if grad is not None:
        parts = list(grad) if isinstance(grad, (list, tuple)) else None
        if parts is None:
            flat = np.asarray(grad).reshape(-1)
            check_dense_size(layout, flat.shape, flat=False)
            parts = [flat[i * shard_size:(i + 1) * shard_size] for i in range(n)]
        if len(parts) != n:
            raise ValueError(f"got {len(parts)} gradient shards for {n} store shards")
        return [as_kw(p, "grad") for p in parts]
    if indices is None or values is None:
        raise ValueError("update needs either grad or both indices and values")
    if len(indices) != n or len(values) != n:
        raise ValueError(f"compressed gradients need one (indices, values) pair per shard ({n})")
    out = []
    for idx, val in zip(indices, values):
        idx = np.asarray(idx)
        check_indices_dtype(idx.dtype)
        out.append({"indices": np.ascontiguousarray(idx), **as_kw(val, "values")})
    return out


def run_update(store: StateStore, grad: Any = None, *, version: int, lr: float, step: int, indices: Any = None,
               values: Any = None, params_out: bool = True, bf16_out: bool = False,
               params_into: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``StateStore.update`` (its docstring says what it does)."""
    store._check_open()
    if not store.initialized:
        raise StoreError("the store holds no state yet: call initialize(params, optimizer) first")
    store._check_whole("update() outside jit")
    check_version_held(store, version)
    n, shard_size = store.num_shards, store.layout.shard_size
    kw_shards = split_grads(store.layout, grad, indices, values)
    if params_into is not None:
        if not params_out:
            raise ValueError("params_into needs params_out=True")
        if (not isinstance(params_into, np.ndarray) or params_into.dtype != np.float32
                or params_into.shape != (n * shard_size,) or not params_into.flags.c_contiguous
                or not params_into.flags.writeable):
            what = (f"{params_into.dtype}{list(params_into.shape)}" if isinstance(params_into, np.ndarray)
                    else type(params_into).__name__)
            raise ValueError(f"params_into must be a writeable, C-contiguous float32 array of "
                             f"{n * shard_size} elements (layout.padded_total), got {what}")
    # A fresh-looking result on a recycled buffer (nsp.storage.out_buffers): the first touch of a new array would
    # cost several times the update itself.
    params = params_into if params_into is not None else (
        store._outputs.take(n * shard_size, np.float32) if params_out else None)
    engines, pool = store._engines, store._pool
    # One shard with a dense gradient checks it for NaN/Inf inside its update pass (the engine stops at the
    # first one and commits nothing), so no pass of its own runs first with the disk idle. Shards that must
    # skip together, and Top-K values, are checked before the update (gradient_finite).
    in_pass = (n == 1 and "indices" not in kw_shards[0] and version == store.version
               and engines[0].checks_finite_in_pass)
    finite = in_pass or gradient_finite([a for kw in kw_shards for k, a in kw.items() if k != "indices"])
    if not finite:  # skip the step on every shard: the store stays at `version`
        check_skip(store, version)
        list(pool.map(lambda i: engines[i].skip(
            version, None if params is None else params[i * shard_size:(i + 1) * shard_size]), range(n)))
        out = {"skipped": True}
        if params is not None:
            out["params"] = params
        if bf16_out:
            import ml_dtypes

            out["params_bf16"] = store.read("param").astype(ml_dtypes.bfloat16)
        return out
    params16 = store._outputs.take(n * shard_size, np.uint16) if bf16_out else None
    hyper = store.optimizer.hyper_attrs()

    def run(i) -> bool:
        # Each shard reads `version`, writes the other slot, syncs and commits version + 1 on its own; True when
        # its pass found the gradient not finite (then it committed nothing and its outputs hold `version`).
        sl = slice(i * shard_size, (i + 1) * shard_size)
        engine = engines[i]
        return (engine.step_if_finite if in_pass else engine.step)(
            version, float(lr), int(step), hyper, **kw_shards[i],
            params_out=None if params is None else params[sl],
            params_bf16_out=None if params16 is None else params16[sl],
        )

    futures = [pool.submit(run, i) for i in range(n)]
    errors = [f.exception() for f in futures]
    errors = [e for e in errors if e is not None]
    if errors:
        raise StoreError(f"update from version {version} failed; version {store.version} is intact: "
                         f"{errors[0]}") from errors[0]
    out = {"skipped": any(f.result() for f in futures)}
    if params is not None:
        out["params"] = params
    if params16 is not None:
        import ml_dtypes

        out["params_bf16"] = params16.view(ml_dtypes.bfloat16)
    return out
