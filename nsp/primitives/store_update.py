"""The host-offload primitive: each device hands its gradient shard to its own store shard, inside jit.

``store_update`` is an XLA FFI custom call with side effects, run under ``jax.shard_map`` so that device ``d``
calls with only its local gradient shard and ``jax.lax.axis_index`` selects store shard ``d``: nothing is
gathered to one device. The call reads the store's committed ``version``, streams that shard's pages through the
update kernel, makes the new version durable, commits it, and returns the new params shard (what comes back up
the shared link) and the new version. What is checked before the call (the gradient's dtype and size, the
NaN/Inf skip, the adopt operands) is ``nsp.storage.update``'s, shared with the eager ``StateStore.update``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from nsp.primitives import _ffi  # noqa: F401  (registers the FFI targets)
from nsp.storage.handle import StoreHandle
from nsp.storage.update import (CHECK_IN_HANDLER, check_dense_size, check_gradient_dtype, check_indices_dtype,
                                gradient_finite, params_operands)


class StoreUpdateResult(NamedTuple):
    """What ``store_update`` returns.

    Attributes:
      params: the new fp32 params, flat and padded like the store's layout (sharded like the gradient).
      version: the version the store committed (an int32 scalar).
      params_bf16: a bf16 copy of ``params`` when asked for, else None.
    """

    params: jax.Array
    version: jax.Array
    params_bf16: jax.Array | None


def _handle(store) -> StoreHandle:
    """The store's handle: ``store`` is one, or a ``StateStore`` that gives it (``handle()``)."""
    return store if isinstance(store, StoreHandle) else store.handle()


def _platform(device) -> str:
    """``device``'s platform as the FFI registrations name it: ``cpu``, ``cuda``, ``rocm``, ``tpu``, ..."""
    platform = str(device.platform).lower()
    if platform == "gpu":  # CUDA and ROCm devices both say "gpu"; their client tells them apart
        version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        platform = "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return platform


def _step_device(mesh: Mesh | None = None):
    """The device the step is traced for: the mesh's first, else JAX's default device."""
    if mesh is not None:
        return mesh.devices.flat[0]
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices(device)[0] if isinstance(device, str) else jax.devices()[0]
    return device


def _check_platform(mesh: Mesh | None) -> None:
    """Fails at trace time where the store update has no handler (only the CPU and CUDA devices have one)."""
    device = _step_device(mesh)
    platform = _platform(device)
    if platform not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"nsp's store update has no handler for the {platform!r} platform (device {device}): it runs on CPU "
            "and CUDA devices only. Run the step on those (e.g. JAX_PLATFORMS=cpu, or a CUDA device), or keep "
            "the optimizer state on the device with optax")


def _context_mesh():
    """The mesh the step is traced under (``jax.set_mesh``), when it spans more than one device; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def _share(x: jax.Array, axes) -> jax.Array:
    """``x`` of the one device along ``axes`` that computed it (the others hold zeros), on every device: an
    integer sum of its bits (exact, and -0.0 stays -0.0, where a float sum would give +0.0)."""
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
    if x.dtype == width:
        return jax.lax.psum(x, axes)
    return jax.lax.bitcast_convert_type(jax.lax.psum(jax.lax.bitcast_convert_type(x, width), axes), x.dtype)


def _on_one_device(mesh, call, operands: list[jax.Array], out_types) -> list[jax.Array]:
    """``call(*operands)`` for a single-shard store inside a step traced under a multi-device ``mesh``: one device
    (the first on every axis) updates the store, and every device takes its results, bit for bit.

    A side-effecting call needs a placement under a mesh: run on every device, the single shard would be updated
    once per device. The results travel as integers (an integer sum with zeros is exact, and keeps -0.0)."""
    specs = (P(),) * len(operands)
    operands = [jax.sharding.reshard(x, P()) if explicit_axes(mesh) else x for x in operands]

    def local(*ops):
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in mesh.axis_names])
        outs = jax.lax.cond(first, lambda: tuple(call(*ops)),
                            lambda: tuple(jnp.zeros(t.shape, t.dtype) for t in out_types))
        return tuple(_share(o, mesh.axis_names) for o in outs)

    return list(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(),) * len(out_types),
                              check_vma=False)(*operands))


def explicit_axes(mesh) -> bool:
    """Whether ``mesh`` (concrete or abstract) has Explicit axes (``jax.make_mesh``'s default in current JAX):
    shardings are then part of the arrays' types and are changed with ``jax.sharding.reshard``."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()) or ())


def _attrs(handle: StoreHandle) -> dict:
    return dict(handles=np.asarray(handle.engines, np.int64), staleness=np.int32(handle.staleness),
                hyper=handle.spec.hyper_attrs())


def store_update(
    store: StoreHandle | Any,
    grad: jax.Array | None = None,
    *,
    version: jax.typing.ArrayLike,
    lr: jax.typing.ArrayLike,
    step: jax.typing.ArrayLike,
    values: jax.Array | None = None,
    indices: jax.Array | None = None,
    mesh: Mesh | None = None,
    axis_name: str | None = None,
    params_bf16: bool = False,
    params: list[jax.Array] | None = None,
    adopt: jax.typing.ArrayLike = False,
    params_dtype: Any = jnp.float32,
) -> StoreUpdateResult:
    """Runs one optimizer step of ``store`` on a (sharded) gradient, inside or outside ``jax.jit``.

    Args:
      store: an initialized store's ``StoreHandle`` (or the ``nsp.storage.StateStore``, whose ``handle()`` is
        taken); its shard count equals the mesh axis size. Its staleness decides how the update runs: 0 (exact:
        the call returns the params this step produced) or 1 (bounded staleness: the call returns at once with
        the params of the previous step and this step streams in the background, so the next forward/backward
        overlaps it; its version is committed by the next call or ``store.barrier()``).
      grad: dense gradient: the padded flat vector of ``store.layout`` (fp32 or bf16).
      version: the store version this step reads (traced is fine; the optax state carries it).
      lr: learning rate (traced).
      step: 1-based step number (traced).
      values, indices: instead of ``grad``: Top-K compressed gradients, ``k`` per shard concatenated in shard
        order (``num_shards * k`` entries), indices shard-local, sorted within each shard.
      mesh, axis_name: the mesh and the axis the state is sharded over (one store shard per device on it).
        Without a mesh the store must have a single shard.
      params_bf16: also return a bf16 copy of the params (half the bytes up the shared link).
      params_dtype: the dtype of the returned ``params``: float32, or bfloat16 (then the only params returned,
        half the bytes up the shared link and no float32 copy in the step's memory; not with ``params_bf16``).
      params: the params tree's leaves in the layout's order (whole, not sharded: every device reads its shard's
        part), for ``adopt``.
      adopt: a (traced) bool: start this step from ``params`` instead of from the committed version's params
        (the caller changed its params since the step that led to them; m and v stay the store's). Costs the
        params' bytes down the shared link; read only when set. Not with ``staleness=1``.

    Returns:
      ``StoreUpdateResult(params, version, params_bf16)``. A gradient with NaN or Inf skips the step: the store
      is untouched, ``version`` is unchanged and ``params`` are the committed ones (counted in
      ``store.stats()["skipped"]``).
    """
    handle = _handle(store)
    layout = handle.layout
    shards = layout.num_shards
    if (mesh is None) != (axis_name is None):
        raise ValueError("pass both mesh and axis_name, or neither")
    if mesh is not None and mesh.shape[axis_name] != shards:
        raise ValueError(f"mesh axis {axis_name!r} has {mesh.shape[axis_name]} devices; the store has {shards} "
                         "shards (one per device)")
    if mesh is None and shards != 1:
        raise ValueError(f"the store has {shards} shards: pass the mesh and axis they are spread over")
    dense = grad is not None
    if dense == (values is not None or indices is not None):
        raise ValueError("pass either grad, or values and indices")
    if dense:
        check_dense_size(layout, grad.shape, flat=True)
        operands = [grad]
    else:
        if values is None or indices is None or values.shape != indices.shape or values.ndim != 1:
            raise ValueError("compressed gradients need 1-D values and indices of equal length")
        if values.shape[0] % shards:
            raise ValueError(f"{values.shape[0]} compressed entries do not split evenly over {shards} shards")
        check_indices_dtype(indices.dtype)
        operands = [values, indices]
    check_gradient_dtype(operands[0].dtype)

    _check_platform(mesh)
    params_dtype = jnp.dtype(params_dtype)
    if params_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"params_dtype must be float32 or bfloat16, got {params_dtype}")
    if params_bf16 and params_dtype != jnp.dtype(jnp.float32):
        raise ValueError("params_bf16 adds a bf16 copy to float32 params: with params_dtype=bfloat16 it is not needed")
    out_types = [jax.ShapeDtypeStruct((layout.shard_size,), params_dtype), jax.ShapeDtypeStruct((), jnp.int32)]
    if params_bf16:
        out_types.append(jax.ShapeDtypeStruct((layout.shard_size,), jnp.bfloat16))
    call = jax.ffi.ffi_call(
        "nsp_store_update_dense" if dense else "nsp_store_update_sparse", out_types, has_side_effect=True
    )
    attrs = _attrs(handle)
    adopt, params_in = params_operands(params, adopt)
    scalars = [jnp.asarray(lr, jnp.float32), jnp.asarray(step, jnp.int32), jnp.asarray(version, jnp.int32)]

    # A step whose gradient holds NaN or Inf (an overflowed loss scale, a diverged batch) is skipped by every
    # shard alike: the store stays as it is and the params come back unchanged.
    scalars.append(jnp.asarray(gradient_finite(operands[:1]), jnp.int32))
    scalars.append(adopt)

    def local(lr_, step_, version_, apply_, adopt_, *ops):
        shard = jnp.int32(0) if mesh is None else jax.lax.axis_index(axis_name).astype(jnp.int32)
        outs = call(lr_, step_, version_, shard, apply_, adopt_, *ops, **attrs)
        return tuple(outs[:1]) + (outs[1][None],) + tuple(outs[2:])

    others = () if mesh is None else tuple(a for a in mesh.axis_names if a != axis_name)
    if others:
        # The mesh has axes beside the store's: the devices along them hold the same shard. One of them (the
        # first on every other axis) updates it; the others take its results (as integers: exact, -0.0 kept).
        per_device = local
        out_shapes = [jax.ShapeDtypeStruct((layout.shard_size,), params_dtype), jax.ShapeDtypeStruct((1,), jnp.int32)]
        out_shapes += [jax.ShapeDtypeStruct((layout.shard_size,), jnp.bfloat16)] * params_bf16

        def local(*args):  # noqa: F811  (the lead device's call, shared along the other axes)
            lead = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in others])
            outs = jax.lax.cond(lead, lambda: per_device(*args),
                                lambda: tuple(jnp.zeros(t.shape, t.dtype) for t in out_shapes))
            return tuple(_share(o, others) for o in outs)

    context = _context_mesh() if mesh is None else None
    if context is not None:
        def single(lr_, step_, version_, apply_, adopt_, *ops):
            outs = call(lr_, step_, version_, jnp.int32(0), apply_, adopt_, *ops, **attrs)
            return tuple(outs[:1]) + (outs[1][None],) + tuple(outs[2:])

        shapes = [out_types[0], jax.ShapeDtypeStruct((1,), jnp.int32)] + out_types[2:]
        outs = _on_one_device(context, single, [*scalars, *operands, *params_in], shapes)
    elif mesh is None:
        outs = local(*scalars, *operands, *params_in)
    else:
        n_out = len(out_types)
        outs = jax.shard_map(
            local, mesh=mesh,
            in_specs=(P(),) * len(scalars) + (P(axis_name),) * len(operands) + (P(),) * len(params_in),
            out_specs=(P(axis_name),) * n_out,
            check_vma=False,
        )(*scalars, *operands, *params_in)
    # Every shard commits on its own; the store's version is the lowest they report.
    return StoreUpdateResult(outs[0], jnp.min(outs[1]), outs[2] if params_bf16 else None)


def check_gradient_leaves(layout, grads: list[jax.Array]) -> None:
    """Raises a clear error unless ``grads`` are ``layout``'s leaves: as many, of its shapes, all float32 or all
    bfloat16 (what the leaves and staged updates take)."""
    if len(grads) != len(layout.leaves):
        raise ValueError(f"{len(grads)} gradient leaves, the store's layout has {len(layout.leaves)}")
    dtype = grads[0].dtype if grads else None
    if dtype not in (jnp.float32, jnp.bfloat16) or any(g.dtype != dtype for g in grads):
        dtypes = sorted({str(g.dtype) for g in grads})
        raise TypeError(f"gradient leaves must all be float32 or all bfloat16, got {dtypes}")
    for g, spec in zip(grads, layout.leaves):
        if tuple(g.shape) != spec.shape:
            raise ValueError(f"gradient leaf {spec.path} has shape {tuple(g.shape)}, the layout says {spec.shape}")


def store_update_leaves(
    store: StoreHandle | Any,
    grads: list[jax.Array],
    *,
    version: jax.typing.ArrayLike,
    lr: jax.typing.ArrayLike,
    step: jax.typing.ArrayLike,
    params: list[jax.Array] | None = None,
    adopt: jax.typing.ArrayLike = False,
) -> tuple[list[jax.Array], jax.Array]:
    """``store_update`` for a single-shard store, taking the gradient as the params tree's leaves.

    The memory-lean form of the update (one device, one store shard): the gradient is not concatenated into a
    flat vector, and each leaf's new params are written over that leaf's gradient (the FFI call aliases each
    result to its gradient operand), so the update needs no memory beyond the gradient it consumes. Inside
    ``jax.jit`` the gradient leaves must not be used after this call (XLA would copy them first).

    Args:
      store: an initialized single-shard store's ``StoreHandle`` (or the store).
      grads: the gradient's leaves in the store layout's order, all float32 or all bfloat16.
      version, lr, step, params, adopt: as for ``store_update``.

    Returns:
      ``(params, version)``: the new params leaves in the gradient's dtype, and the version the store committed.
      A gradient with NaN or Inf skips the step (the committed params come back, ``version`` is unchanged).
      On a two-slot memory store the check runs inside the update's own pass; a step skipped there has
      partly overwritten the slot of the version before the committed one, so that version can no longer be
      replayed afterwards.
    """
    handle = _handle(store)
    layout = handle.layout
    if layout.num_shards != 1:
        raise ValueError(f"store_update_leaves needs a single-shard store; this one has {layout.num_shards} shards "
                         "(use store_update with a mesh)")
    check_gradient_leaves(layout, grads)

    _check_platform(None)
    # apply = -1: the handler checks the leaves for NaN/Inf itself (inside the update pass on a two-slot memory
    # store, else a vectorised C++ pass first: both faster than XLA's reduction), and skips the step if any is found.
    adopt, params_in = params_operands(params, adopt)
    scalars = [jnp.asarray(lr, jnp.float32), jnp.asarray(step, jnp.int32), jnp.asarray(version, jnp.int32),
               jnp.int32(0), jnp.int32(CHECK_IN_HANDLER), adopt]
    out_types = [jax.ShapeDtypeStruct((), jnp.int32)] + [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in grads]
    first = len(scalars)
    call = jax.ffi.ffi_call("nsp_store_update_pieces", out_types, has_side_effect=True,
                            input_output_aliases={first + i: 1 + i for i in range(len(grads))})
    context = _context_mesh()
    if context is not None:
        outs = _on_one_device(context, functools.partial(call, **_attrs(handle)), [*scalars, *grads, *params_in],
                              out_types)
    else:
        outs = call(*scalars, *grads, *params_in, **_attrs(handle))
    return list(outs[1:]), outs[0]
