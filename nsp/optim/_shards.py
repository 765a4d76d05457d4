"""Running a per-shard function over the flattened state: in a Python loop on one device, or under shard_map."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nsp.primitives.store_update import explicit_axes


def shard_flat(flat: jax.Array, mesh: Mesh | None, axis_name: str | None) -> jax.Array:
    """Splits the flat vector over the mesh axis (each device holds its own shard): a sharding constraint for
    XLA on an Auto mesh, a reshard on an Explicit one."""
    if mesh is None:
        return flat
    sharding = NamedSharding(mesh, P(axis_name))
    if explicit_axes(mesh):
        return jax.sharding.reshard(flat, sharding)
    return jax.lax.with_sharding_constraint(flat, sharding)


def map_shards(fn: Callable, num_shards: int, mesh: Mesh | None, axis_name: str | None, *flats: jax.Array):
    """Applies ``fn`` to shard ``s`` of each flat vector, for every ``s``; concatenates the results.

    With a mesh, each device runs ``fn`` on its own shard (``shard_map``); without one, the shards are sliced
    in order on the one device.
    """
    if mesh is not None:
        n_out = len(jax.eval_shape(fn, *(jax.ShapeDtypeStruct((x.shape[0] // num_shards,), x.dtype) for x in flats)))
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(axis_name),) * len(flats),
                             out_specs=(P(axis_name),) * n_out, check_vma=False)(*flats)
    size = [x.shape[0] // num_shards for x in flats]
    parts = [fn(*(x[s * n:(s + 1) * n] for x, n in zip(flats, size))) for s in range(num_shards)]
    return tuple(jnp.concatenate(outs) for outs in zip(*parts))
