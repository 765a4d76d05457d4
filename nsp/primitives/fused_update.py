"""The fused optimizer update: one C++ pass over fp32 state, called through the XLA FFI.

``fused_update`` applies one step of Adam, AdamW, SGD (with optional momentum / Nesterov) or AdaGrad to an fp32
master parameter and its optimizer state. It reads ``param``, the gradient and the state once and writes them
once, optionally emitting a bf16 copy of the new parameter in the same pass. The gradient can be dense
(fp32 or bf16) or Top-K compressed as ``(values, indices)``; compressed gradients are decompressed block by
block inside the kernel, never as a separate dense array.

The math matches optax (``optax.adam``, ``optax.adamw``, ``optax.sgd``, ``optax.adagrad``) up to float
rounding; ``weight_decay`` is decoupled for AdamW and an L2 term added to the gradient for the other kinds
(as ``optax.chain(optax.add_decayed_weights(wd), optax.adam(...))``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nsp.primitives import _eager_buffers
from nsp.primitives import _ffi  # noqa: F401  (registers the FFI targets)
from nsp.spec import DEFAULT_EPS, check_kind, hyper_attrs, uses_mu, uses_nu


class FusedUpdateResult(NamedTuple):
    """What ``fused_update`` returns.

    Attributes:
      param: the updated fp32 parameter, shaped like the input.
      mu: the updated first-moment / momentum state, or the input unchanged (``None`` included) for kinds that
        keep none (AdaGrad, plain SGD).
      nu: the updated second-moment / accumulator state, or the input unchanged for kinds that keep none (SGD).
      param_bf16: a bfloat16 copy of ``param`` written in the same pass when ``bf16_out=True``, else ``None``.
    """

    param: jax.Array
    mu: jax.Array | None
    nu: jax.Array | None
    param_bf16: jax.Array | None


def fused_update(
    param: jax.Array,
    grad: jax.Array,
    mu: jax.Array | None = None,
    nu: jax.Array | None = None,
    *,
    kind: str,
    step: jax.typing.ArrayLike,
    lr: jax.typing.ArrayLike,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float | None = None,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    nesterov: bool = False,
    lazy: bool = False,
    indices: jax.Array | None = None,
    sort_indices: bool = False,
    bf16_out: bool = False,
) -> FusedUpdateResult:
    """Applies one optimizer step to an fp32 parameter and its state in a single fused pass.

    Args:
      param: fp32 master parameter, any shape.
      grad: the gradient: dense, shaped like ``param`` (float32 or bfloat16); or, when ``indices`` is given,
        the 1-D Top-K values (float32 or bfloat16).
      mu: fp32 first moment (Adam/AdamW) or momentum trace (SGD with ``momentum``), shaped like ``param``.
      nu: fp32 second moment (Adam/AdamW) or sum of squares (AdaGrad), shaped like ``param``.
      kind: ``"adam"``, ``"adamw"``, ``"sgd"`` or ``"adagrad"``.
      step: the 1-based number of this update (bias correction uses ``b1**step``); a traced int is fine.
      lr: learning rate; a traced scalar, so schedules work under ``jit`` without recompiling.
      b1: Adam/AdamW first-moment decay.
      b2: Adam/AdamW second-moment decay.
      eps: Adam/AdamW: added to ``sqrt(nu_hat)``; AdaGrad: added to ``nu`` under the square root. Defaults to
        optax's (1e-8 for Adam/AdamW, 1e-7 for AdaGrad).
      weight_decay: decoupled for AdamW; an L2 term added to the gradient otherwise.
      momentum: SGD momentum; 0 is plain SGD (no state).
      nesterov: SGD Nesterov momentum.
      lazy: elements whose gradient is exactly zero keep their param and state (no momentum step, no decay of
        ``mu``/``nu``, no weight decay), like LazyAdam; bias correction still counts every step. Meant for
        compressed gradients: only the sent entries move. ``False`` is the usual dense update.
      indices: flat int32 positions into ``param`` of the compressed gradient ``grad``, sorted ascending
        (``nsp.primitives.topk_compress`` returns them so). Repeated positions add up; zero-valued padding is
        harmless.
      sort_indices: sort ``(indices, grad)`` by position first (for indices from e.g. ``jax.lax.top_k``).
      bf16_out: also return a bfloat16 copy of the new parameter, written in the same pass.

    Returns:
      A ``FusedUpdateResult(param, mu, nu, param_bf16)``.

    Raises:
      ValueError / TypeError: for mismatched shapes or dtypes, bad hyperparameters, and (when they are concrete)
        out-of-range or unsorted indices, before the kernel runs. Under ``jit`` the kernel itself rejects bad
        indices before it writes anything.

    For an in-place update, call it under ``jax.jit`` and donate ``param``, ``mu`` and ``nu``::

      @functools.partial(jax.jit, donate_argnums=(0, 2, 3))
      def step_fn(p, g, m, v, t, lr):
          return nsp.primitives.fused_update(p, g, m, v, kind="adam", step=t, lr=lr)[:3]

      p, m, v = step_fn(p, g, m, v, 1, 1e-3)

    Called eagerly it still runs as one compiled call, and writes into the arrays of the call before last that
    the caller has dropped (none are fresh memory after the second call of a loop
    ``p, m, v = fused_update(p, g, m, v, ...)[:3]``); ``nsp.primitives.release_eager_buffers()`` frees those it
    keeps for that.

    The kernel streams the state from memory, so the pages it lies on count: over 64M params it ran at
    0.90-0.91x on 4 KiB pages of its speed on 2 MiB transparent huge pages. Where the kernel's THP mode is
    ``madvise`` (Debian's default), XLA's buffers stay on 4 KiB pages unless Python is started with
    ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35 or later). The memory tier's state is on huge pages
    by itself.
    """
    check_kind(kind)
    eps = DEFAULT_EPS[kind] if eps is None else float(eps)
    _check_hyperparams(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, momentum=momentum)
    param = jnp.asarray(param)
    if param.dtype != jnp.float32:
        raise TypeError(f"param must be float32 (the fp32 master copy), got {param.dtype}")
    shape, n = param.shape, param.size
    need_mu, need_nu = uses_mu(kind, momentum), uses_nu(kind)
    mu_state = _state_operand("mu", mu, shape, need_mu, kind)
    nu_state = _state_operand("nu", nu, shape, need_nu, kind)
    lr = _scalar("lr", lr, jnp.float32)
    step = _scalar("step", step, jnp.int32)
    if not isinstance(step, jax.core.Tracer) and int(step) < 1:
        raise ValueError(f"step must be >= 1 (the 1-based number of this update), got {int(step)}")

    grad = jnp.asarray(grad)
    if grad.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"gradients must be float32 or bfloat16, got {grad.dtype}")
    if indices is None:
        if grad.shape != shape:
            raise ValueError(f"grad shape {grad.shape} does not match param shape {shape}")
        target, operands = "nsp_fused_update_dense", [grad]
    else:
        # Checked before conversion: jnp.asarray would silently narrow int64 to int32.
        idx_dtype = indices.dtype if hasattr(indices, "dtype") else np.asarray(indices).dtype
        if np.dtype(idx_dtype) != np.int32:
            raise TypeError(f"indices must be int32 flat positions, got {idx_dtype}")
        indices = jnp.asarray(indices)
        if indices.ndim != 1 or grad.ndim != 1 or indices.shape != grad.shape:
            raise ValueError(
                f"compressed gradients need 1-D values and indices of equal length, got values {grad.shape} "
                f"and indices {indices.shape}"
            )
        if sort_indices:
            indices, grad = jax.lax.sort_key_val(indices, grad)
        elif not isinstance(indices, jax.core.Tracer):
            _check_indices(np.asarray(indices), n)
        target, operands = "nsp_fused_update_sparse", [grad, indices]

    hyper = hyper_attrs(kind, b1, b2, eps, weight_decay, momentum, nesterov, lazy)
    operands = [param, *operands, mu_state, nu_state, lr, step]
    # Called eagerly, the update still runs as one compiled call (cached per shape and hyperparameters): op by
    # op, every reshape and the kernel's non-donated in/out aliasing would each copy the state again.
    # Eagerly a dense, non-lazy update also writes fresh outputs in its one pass instead of aliasing them: the
    # caller's arrays cannot be donated, and aliasing them would copy each state before the kernel's pass.
    eager = not any(isinstance(x, jax.core.Tracer) for x in operands)
    alias = not (eager and indices is None and not lazy)
    static = (target, bf16_out, tuple(sorted(hyper.items())), alias)  # hashable: a jit static argument
    if not eager:
        outs = _kernel(*static, *operands)
    else:
        # The outputs go into the memory of arrays earlier eager calls returned and the caller has dropped
        # (_eager_buffers: no fresh pages to fault in); where there are none yet, into new arrays.
        avals = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (param, mu_state, nu_state) if x.size]
        if bf16_out:
            avals.append(jax.ShapeDtypeStruct(shape, jnp.bfloat16))
        devices = param.devices()
        scratch = _eager_buffers.take(avals, next(iter(devices))) if len(devices) == 1 else []
        outs = _kernel_into_jit(tuple(scratch), *static, *operands) if scratch else _kernel_jit(*static, *operands)
        _eager_buffers.hold(outs)
    new_param, new_mu, new_nu, param_bf16 = outs
    return FusedUpdateResult(new_param, new_mu if need_mu else mu, new_nu if need_nu else nu, param_bf16)


def _kernel(target: str, bf16_out: bool, attrs: tuple, alias: bool, param, *rest):
    """The FFI call on flat operands, reshaped back: param, grad (or values, indices), mu, nu, lr, step; ``attrs``
    holds ``hyper_attrs``'s dict as sorted items. With ``alias`` the outputs are the param and state operands,
    updated in place (donated, under jit); without, the kernel reads them and writes every element of new outputs
    (dense, non-lazy updates only)."""
    *operands, mu, nu, lr, step = rest
    shape, n = param.shape, param.size
    mu_flat, nu_flat = mu.reshape(-1), nu.reshape(-1)
    if target == "nsp_fused_update_dense":
        operands = [operands[0].reshape(-1)]
    out_types = [
        jax.ShapeDtypeStruct((n,), jnp.float32),
        jax.ShapeDtypeStruct(mu_flat.shape, jnp.float32),
        jax.ShapeDtypeStruct(nu_flat.shape, jnp.float32),
    ]
    if bf16_out:
        out_types.append(jax.ShapeDtypeStruct((n,), jnp.bfloat16))
    args = [lr, step, param.reshape(-1), *operands, mu_flat, nu_flat]
    mu_pos = len(args) - 2
    call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential",
                            input_output_aliases={2: 0, mu_pos: 1, mu_pos + 1: 2} if alias else None)
    outs = call(*args, hyper=dict(attrs))
    return (outs[0].reshape(shape), outs[1].reshape(mu.shape), outs[2].reshape(nu.shape),
            outs[3].reshape(shape) if bf16_out else None)


_kernel_jit = jax.jit(_kernel, static_argnums=(0, 1, 2, 3))


def _kernel_into(scratch: tuple, target: str, bf16_out: bool, attrs: tuple, alias: bool, *operands):
    """``_kernel`` with ``scratch`` donated: XLA gives each output the buffer of a scratch array of its shape and
    dtype (the values are never read)."""
    del scratch
    return _kernel(target, bf16_out, attrs, alias, *operands)


_kernel_into_jit = jax.jit(_kernel_into, static_argnums=(1, 2, 3, 4), donate_argnums=(0,), keep_unused=True)


def _check_hyperparams(*, b1: float, b2: float, eps: float, weight_decay: float, momentum: float) -> None:
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay), ("momentum", momentum)):
        if not float(value) >= 0.0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _state_operand(name: str, state, shape, needed: bool, kind: str) -> jax.Array:
    """The fp32 operand for one optimizer state; an empty array when the kind keeps no such state."""
    if not needed:
        return jnp.zeros((0,), jnp.float32)
    if state is None:
        raise ValueError(f"optimizer kind {kind!r} needs the state {name!r}; got None")
    state = jnp.asarray(state)
    if state.shape != shape:
        raise ValueError(f"{name} shape {state.shape} does not match param shape {shape}")
    if state.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {state.dtype}")
    return state


def _scalar(name: str, value, dtype) -> jax.Array:
    value = jnp.asarray(value)
    if value.ndim != 0:
        raise ValueError(f"{name} must be a scalar, got shape {value.shape}")
    if dtype == jnp.int32 and not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer, got {value.dtype}")
    return value.astype(dtype)


def _check_indices(indices: np.ndarray, size: int) -> None:
    """Range and order checks for concrete indices, with the kernel's messages, before anything runs."""
    if indices.size == 0:
        return
    bad = np.flatnonzero((indices < 0) | (indices >= size))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"index {int(indices[j])} at position {j} is out of range for a parameter of {size} elements"
        )
    down = np.flatnonzero(np.diff(indices) < 0)
    if down.size:
        j = int(down[0]) + 1
        raise ValueError(
            f"indices must be sorted ascending: index {int(indices[j])} at position {j} follows "
            f"{int(indices[j - 1])} (pass sort_indices=True, or compress with nsp.primitives.topk_compress)"
        )
