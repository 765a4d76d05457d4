"""A GPT language model in Flax NNX, top to bottom: config, named sizes, layers, model, loss, sampling.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nsp.models import GPT, get_config, cross_entropy_loss, generate
    >>> model = GPT(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 64), jnp.int32)     # int [B, T] with T <= block_size
    >>> model(tokens).shape                        # float32 logits [B, T, vocab_size]
    (2, 64, 256)

Architecture (GPT-2): token + learned position embeddings, dropout, ``n_layer`` pre-LayerNorm blocks
(``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, MLP 4x wide with tanh-GELU), a final LayerNorm, and an output
projection tied to the token embedding (``logits = h @ wte.T``). Init as GPT-2: weights N(0, 0.02), the two
projections that write into the residual stream N(0, 0.02 / sqrt(2 * n_layer)), biases 0, LayerNorm scale 1.

Precision. Parameters are stored in ``config.param_dtype`` (float32). ``config.dtype`` is the compute dtype of
the matmuls (float32, or bfloat16 for the "bf16 compute" option). As with torch autocast, the residual stream stays
in the parameter dtype, LayerNorm statistics and the attention softmax are computed in float32, and the logits
come back in float32 whatever the compute dtype.

Dropout and RNG state. With ``dropout == 0`` (the default) the model holds no RNG state at all: ``nnx.state(model)``
is exactly its ``nnx.Param`` leaves, which keeps a pure ``nnx.split -> jax.jit -> nnx.merge`` step simple. With
``dropout > 0`` every dropout layer forks its own stream from the ``rngs`` given to the constructor (stream
``"dropout"``, else ``"default"``) and that stream's counter is model state that a pure step must carry forward;
alternatively pass ``rngs=`` (an ``nnx.Rngs`` or a key) to ``GPT.__call__`` per step.

Big models without memory. Construct abstractly: ``abstract_gpt(get_config("gpt3-175b"))`` (which is
``nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))``) builds the module tree with ``jax.ShapeDtypeStruct``
leaves and allocates nothing; ``count_params`` on it equals ``GPTConfig.num_params()``. Use the abstract state
(``nnx.state(abstract_gpt(cfg))``) to plan shardings or storage layouts before materialising anything. With
flax 0.12.8 / jax 0.10.2 abstract construction time grows quadratically with depth (each RNG draw inside the trace
makes flax ask a tracer for ``.sharding``, and jax builds an error message by walking the whole trace): ~1 s for
gpt2-124m, ~8 s for gpt2-1.5b, ~30 s for gpt3-175b on 2 CPU cores.

Performance notes (CPU). Call the model under ``jax.jit``/``nnx.jit``: eager calls compile every primitive apart.
For bf16 compute, ``GPTConfig(f32_accum=True)`` (off by default) writes the Linear matmuls as bf16 x bf16 -> fp32
dots, forward and backward, which XLA:CPU runs natively; without it XLA keeps an fp32 copy of every weight through
the backward pass (2 to 2.5 bytes per parameter more memory in a training step).
With ``dropout > 0``, XLA:CPU compiles threefry dropout masks slowly (seconds per attention-dropout layer); keys made
with ``jax.random.key(seed, impl="rbg")`` compile several times faster.

This module imports only jax, flax, numpy and the standard library, so it can be used without the rest of nsp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "GPTConfig",
    "CONFIGS",
    "get_config",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "GPT",
    "abstract_gpt",
    "gpt_parts",
    "count_params",
    "cross_entropy_loss",
    "generate",
]


# ----------------------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes and options of a GPT. Frozen (hashable); derive variants with ``dataclasses.replace`` or
    ``get_config(name, **overrides)``. Invalid values raise ``ValueError`` at construction."""

    vocab_size: int = 50257  # number of distinct token ids (GPT-2 BPE: 50257; byte-level data: 256)
    block_size: int = 1024  # context length: the longest sequence the model accepts (size of the position table)
    n_layer: int = 12  # number of transformer blocks
    n_head: int = 12  # attention heads per block; head width is n_embd // n_head
    n_embd: int = 768  # width of the residual stream (d_model)
    dropout: float = 0.0  # dropout rate on embeddings, attention probabilities and residual branches; 0 = off
    bias: bool = True  # biases in the Linear and LayerNorm layers (GPT-2 has them)
    dtype: Any = jnp.float32  # compute dtype of the matmuls: float32, or bfloat16 for bf16 compute
    param_dtype: Any = jnp.float32  # storage dtype of the parameters (and of the residual stream)
    # Opt-in, default off (off = the plain lax.dot_general, bit-identical to before the option existed). True: the
    # Linear layers' matmuls are dots of compute-dtype operands with a float32 result declared explicitly
    # (preferred_element_type), rounded to the compute dtype, and their backward pass (a custom VJP) computes
    # dx = g @ W.T and dW = x.T @ g the same way. Same math as the default (fp32 accumulation, rounded to the
    # compute dtype at the same points; XLA may skip some default roundings, xla_allow_excess_precision), but
    # with bf16 compute XLA:CPU runs the bf16 dots as they are instead of converting every weight to an fp32 copy
    # that it keeps alive until the backward pass: a training step's temporaries drop from ~4.5 to ~2.0 bytes
    # per parameter with bf16 params, to ~2.5 with fp32 params (width 1024). See _f32_accum_dot_general.
    f32_accum: bool = False
    # The MLP's nonlinearity: "gelu" (GPT-2's tanh approximation) or "relu" (OPT's). After a ReLU about half of
    # the MLP's hidden activations are exact zeros, which activation offload's sparse format stores compactly.
    activation: str = "gelu"
    # 0: a language model. > 0: the model also gets a sequence classifier (``GPT.classify``): the residual stream
    # after the last block, averaged over the positions, the final LayerNorm, then a Linear to ``num_classes``
    # logits. Its leaves (``cls``) are built after all the others, so the language model's leaves hold the same
    # values as in a model without it, and a pretrained language model's checkpoint starts a classifier.
    num_classes: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"the nearest valid n_head values are {_divisors_near(self.n_embd, self.n_head)}"
            )
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, (int, np.integer)) \
                or self.num_classes < 0 or self.num_classes == 1:
            raise ValueError(f"GPTConfig.num_classes must be 0 (a language model) or at least 2, got "
                             f"{self.num_classes!r}")
        if not isinstance(self.f32_accum, (bool, np.bool_)):
            raise ValueError(f"GPTConfig.f32_accum must be a bool, got {self.f32_accum!r}")
        object.__setattr__(self, "f32_accum", bool(self.f32_accum))
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"GPTConfig.activation must be 'gelu' or 'relu', got {self.activation!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        # Normalise dtypes (accepts jnp.bfloat16, np.float32, "bfloat16", ...) to numpy dtype objects.
        for name in ("dtype", "param_dtype"):
            try:
                dt = jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(f"GPTConfig.{name}: not a dtype: {getattr(self, name)!r}") from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"GPTConfig.{name} must be a floating dtype, got {dt}")
            object.__setattr__(self, name, dt)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count computed analytically (equals ``count_params`` of the built model).

        The output projection is tied to the token embedding, so it adds nothing. With ``non_embedding=True`` both
        embedding tables (token and position) are left out, the "N" of Kaplan et al. 2020 (note: nanoGPT's
        ``non_embedding`` leaves out only the position table)."""
        C, b = self.n_embd, int(self.bias)
        layer_norm = C + b * C  # scale (+ bias)
        attn = (C * 3 * C + b * 3 * C) + (C * C + b * C)  # c_attn (q, k, v) + c_proj
        mlp = (C * 4 * C + b * 4 * C) + (4 * C * C + b * C)  # c_fc + c_proj
        blocks = self.n_layer * (2 * layer_norm + attn + mlp)
        embeddings = self.vocab_size * C + self.block_size * C
        classifier = C * self.num_classes + b * self.num_classes
        return blocks + layer_norm + classifier + (0 if non_embedding else embeddings)


def _divisors_near(n: int, k: int) -> list[int]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return sorted(divisors, key=lambda d: (abs(d - k), d))[:2]


def _family(sizes: dict[str, tuple[int, int, int]], **shared: Any) -> dict[str, GPTConfig]:
    """Configs of one model family: ``sizes`` maps a name to its ``(n_layer, n_head, n_embd)``, and every
    member takes the fields in ``shared`` (vocabulary, context length, bias)."""
    return {name: GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, **shared)
            for name, (n_layer, n_head, n_embd) in sizes.items()}


CONFIGS: dict[str, GPTConfig] = {
    # Byte-level toy sizes. tiny: for tests (~0.12M params, a step takes milliseconds on a CPU).
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    # small: the default for a CPU demo training run (~3.3M params).
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256),
    # GPT-2 (Radford et al. 2019), with the sizes of the released checkpoints: (n_layer, n_head, n_embd).
    **_family({"gpt2-124m": (12, 12, 768), "gpt2-355m": (24, 16, 1024),
               "gpt2-774m": (36, 20, 1280), "gpt2-1.5b": (48, 25, 1600)},
              vocab_size=50257, block_size=1024, bias=True),
    # GPT-3 (Brown et al. 2020, Table 2.1), dense attention throughout (the paper alternates dense and locally
    # banded sparse layers; that changes no parameter count). Two rows of the table are inconsistent and are read
    # as d_model = n_head * d_head with the listed d_head = 128: GPT-3 XL lists 24 heads with d_model 2048 (we use
    # 16 heads), GPT-3 13B lists d_model 5140 (we use 5120 = 40 * 128).
    **_family({"gpt3-125m": (12, 12, 768), "gpt3-350m": (24, 16, 1024),
               "gpt3-760m": (24, 16, 1536), "gpt3-1.3b": (24, 16, 2048),
               "gpt3-2.7b": (32, 32, 2560), "gpt3-6.7b": (32, 32, 4096),
               "gpt3-13b": (40, 40, 5120), "gpt3-175b": (96, 96, 12288)},
              vocab_size=50257, block_size=2048, bias=True),
    # Not a row of GPT-3's table: 6.7B's width (32 heads of 128) at 23 of its 32 layers, the step between 2.7B and
    # 6.7B that a one-slot file-tier store fits on an 80 GB disk (bench/max_model.py --full --slots 1).
    **_family({"gpt3-4.8b": (23, 32, 4096)}, vocab_size=50257, block_size=2048, bias=True),
}


def get_config(name: str, **overrides: Any) -> GPTConfig:
    """The named config from ``CONFIGS`` with fields replaced, e.g. ``get_config("gpt2-124m", vocab_size=256)``.

    Raises ``ValueError`` for an unknown name or field, or when the result is invalid."""
    if name not in CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; valid names: {', '.join(CONFIGS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(CONFIGS[name], **overrides)


# ----------------------------------------------------------------------------------------------------------------
# Layers


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def _dropout_rngs(config: GPTConfig, rngs: nnx.Rngs) -> nnx.Rngs | None:
    # No RNG state in the model when dropout is off (see the module docstring).
    return rngs if config.dropout > 0 else None


def _layer_norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # GPT-2's epsilon; two-pass variance (like torch) rather than E[x^2] - E[x]^2.
    return nnx.LayerNorm(
        config.n_embd, epsilon=1e-5, use_bias=config.bias, use_fast_variance=False,
        dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
    )


def _classifier(config: GPTConfig, rngs: nnx.Rngs) -> nnx.Linear:
    # Initialised as the model's other Linear layers: weights N(0, 0.02), bias 0.
    return nnx.Linear(config.n_embd, config.num_classes, use_bias=config.bias, dtype=config.dtype,
                      param_dtype=config.param_dtype, kernel_init=_normal(0.02),
                      bias_init=nnx.initializers.zeros_init(), rngs=rngs)


@jax.custom_vjp
def _f32_accum_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [K, N]``: a dot with a float32 result, rounded to the operands' dtype."""
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(jnp.result_type(x, w))


def _f32_accum_matmul_fwd(x, w):
    return _f32_accum_matmul(x, w), (x, w)


def _f32_accum_matmul_bwd(res, g):
    # The cotangent g comes in the output's (compute) dtype; both products are dots of compute-dtype operands
    # with float32 results, rounded to the dtype of the primal they belong to (as JAX's own transpose would).
    x, w = res
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = jax.lax.dot_general(x2, g2, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_f32_accum_matmul.defvjp(_f32_accum_matmul_fwd, _f32_accum_matmul_bwd)


def _f32_accum_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                           out_sharding=None):
    """The ``dot_general`` of the Linear layers under ``GPTConfig.f32_accum`` (only nnx.Linear's contraction).

    Why: XLA:CPU has no bf16 x bf16 -> bf16 dot. Given one (what ``jnp.dot`` of two bf16 arrays is), it converts
    both operands to float32 and dots those; for a weight that is a float32 copy of the whole matrix, and XLA
    schedules the copies early and shares them with the backward pass's ``g @ W.T``, so with bf16 params the
    copies of all layers' weights are alive at once. A dot that asks for a float32 result from bf16 operands
    (``preferred_element_type=float32``) XLA:CPU runs as it is (YNNPACK), so neither pass copies a weight; the
    backward pass is written out (custom VJP) because JAX's transpose would dot a float32 cotangent with the bf16
    weight, which brings the copy back. Only ``dW = x.T @ g`` still upcasts its (activation-sized) operands."""
    if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())):
        raise ValueError(f"GPTConfig.f32_accum's dot_general serves nnx.Linear's x[..., K] @ w[K, N] only; "
                         f"got dimension numbers {dimension_numbers}")
    if precision is not None or preferred_element_type is not None or out_sharding is not None:
        raise ValueError("GPTConfig.f32_accum's dot_general sets its own result type: it takes no precision, "
                         "preferred_element_type or out_sharding")
    return _f32_accum_matmul(lhs, rhs)


def _linear(config: GPTConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    # Without f32_accum, nnx.Linear's own default (lax.dot_general): the model stays as it was, bit for bit.
    options = {"dot_general": _f32_accum_dot_general} if config.f32_accum else {}
    return nnx.Linear(
        d_in, d_out, use_bias=config.bias, dtype=config.dtype, param_dtype=config.param_dtype,
        kernel_init=_normal(std), bias_init=nnx.initializers.zeros_init(), rngs=rngs, **options,
    )


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention where position t attends to positions <= t.

    Written out with einsums and an explicit causal mask rather than ``jax.nn.dot_product_attention``: on a CPU there
    is no fused kernel to gain (a forward+backward at B=8, T=256, 4x64 heads took 53 ms written out vs 94 ms with
    ``dot_product_attention(is_causal=True)`` on 2 cores), and only the explicit form can apply dropout to the
    attention probabilities (nanoGPT's ``attn_dropout``). Scores and softmax are in float32."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        C = config.n_embd
        self.n_head = config.n_head
        self.c_attn = _linear(config, C, 3 * C, 0.02, rngs)  # q, k, v for all heads in one matmul
        self.c_proj = _linear(config, C, C, 0.02 / math.sqrt(2 * config.n_layer), rngs)  # writes the residual
        self.attn_dropout = nnx.Dropout(config.dropout, rngs=_dropout_rngs(config, rngs))
        self.resid_dropout = nnx.Dropout(config.dropout, rngs=_dropout_rngs(config, rngs))

    def __call__(self, x: jax.Array, *, deterministic: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)  # each [B, T, C] in the compute dtype
        q, k, v = (a.reshape(B, T, H, D) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(D)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))  # [query, key]: key <= query
        att = jnp.where(causal, att, -jnp.inf)  # the diagonal is always kept, so no row is all -inf
        att = jax.nn.softmax(att, axis=-1)
        att = self.attn_dropout(att, deterministic=deterministic, rngs=rngs)
        y = jnp.einsum("bhqk,bkhd->bqhd", att.astype(v.dtype), v).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y), deterministic=deterministic, rngs=rngs)


class MLP(nnx.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU (tanh approximation, as GPT-2; or ReLU, as OPT, with
    ``activation="relu"``) -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        C = config.n_embd
        self.c_fc = _linear(config, C, 4 * C, 0.02, rngs)
        self.c_proj = _linear(config, 4 * C, C, 0.02 / math.sqrt(2 * config.n_layer), rngs)  # writes the residual
        self.dropout = nnx.Dropout(config.dropout, rngs=_dropout_rngs(config, rngs))
        self.relu = config.activation == "relu"

    def __call__(self, x: jax.Array, *, deterministic: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = jax.nn.relu(self.c_fc(x)) if self.relu else jax.nn.gelu(self.c_fc(x), approximate=True)
        return self.dropout(self.c_proj(x), deterministic=deterministic, rngs=rngs)


class Block(nnx.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        # x stays in the parameter dtype; the branches compute in config.dtype and are promoted on the add.
        x = x + self.attn(self.ln_1(x), deterministic=deterministic, rngs=rngs)
        x = x + self.mlp(self.ln_2(x), deterministic=deterministic, rngs=rngs)
        return x


# ----------------------------------------------------------------------------------------------------------------
# The model


class GPT(nnx.Module):
    """GPT language model: ``GPT(config, rngs=nnx.Rngs(seed))``; ``model(tokens) -> logits``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        embed = functools.partial(
            nnx.Embed, features=config.n_embd, dtype=config.param_dtype, param_dtype=config.param_dtype,
            embedding_init=_normal(0.02), rngs=rngs,
        )
        self.wte = embed(config.vocab_size)  # token embedding, also the (tied) output projection
        self.wpe = embed(config.block_size)  # learned position embedding
        self.drop = nnx.Dropout(config.dropout, rngs=_dropout_rngs(config, rngs))
        self.h = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = _layer_norm(config, rngs)
        if config.num_classes:
            self.cls = _classifier(config, rngs)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        deterministic: bool = True,
        rngs: nnx.Rngs | jax.Array | None = None,
        block_call: Callable[[nnx.Module, jax.Array], jax.Array] | None = None,
    ) -> jax.Array:
        """Logits (float32, ``[B, T, vocab_size]``) for int tokens ``[B, T]`` with ``T <= block_size``.

        ``deterministic=False`` turns dropout on (a no-op when ``config.dropout == 0``). Dropout keys come from
        ``rngs`` when given (an ``nnx.Rngs`` or a PRNG key, split across the layers), else from the streams the
        model was built with. ``block_call(block, x)``, when given, applies each block instead of
        ``block(x, ...)``: e.g. ``nsp.offload.offload_blocks(area)``, which spills the blocks' residuals to disk
        (deterministic blocks only)."""
        cfg = self.config
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, time], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
        B, T = tokens.shape
        if T > cfg.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {cfg.block_size}: crop the input to the last "
                f"{cfg.block_size} tokens"
            )
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            rngs = nnx.Rngs(dropout=rngs)

        x = self.drop(self.embed(tokens), deterministic=deterministic, rngs=rngs)
        x = self.blocks(x, 0, cfg.n_layer, deterministic=deterministic, rngs=rngs, block_call=block_call)
        return self.head(x)

    # The three stages of ``__call__``, for running a model in two parts: a frozen backbone's features computed
    # where the data is (``embed`` then ``blocks(x, 0, n)``), the rest trained from them (``blocks(x, n, n_layer)``
    # then ``head``): ``nsp.train.features``.

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token plus position embeddings of int tokens ``[B, T]``: ``[B, T, C]`` in the param dtype."""
        return self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]

    def blocks(self, x: jax.Array, start: int, stop: int, *, deterministic: bool = True,
               rngs: nnx.Rngs | None = None,
               block_call: Callable[[nnx.Module, jax.Array], jax.Array] | None = None) -> jax.Array:
        """Blocks ``start .. stop - 1`` applied to the residual stream ``x`` ``[B, T, C]`` (as ``__call__``)."""
        for block in self.h[start:stop]:
            if block_call is None:
                x = block(x, deterministic=deterministic, rngs=rngs)
            else:
                x = block_call(block, x)
        return x

    def head(self, x: jax.Array) -> jax.Array:
        """Float32 logits ``[B, T, vocab_size]`` of the residual stream after the last block: the final
        LayerNorm and the tied output projection."""
        x = self.ln_f(x)  # compute dtype
        wte = self.wte.embedding[...].astype(self.config.dtype)
        return jnp.einsum("btc,vc->btv", x, wte, preferred_element_type=jnp.float32)  # tied output projection

    # Sequence classification (``config.num_classes > 0``): ``classify(pool(blocks(embed(tokens))))``. Pooling comes
    # before the final LayerNorm so that everything up to the pooled vector can be a frozen backbone's output: one
    # ``[C]`` vector per sequence is what an extractor then sends (``nsp.train.features``).

    def pool(self, x: jax.Array) -> jax.Array:
        """The residual stream ``[B, T, C]`` averaged over its positions (in float32): ``[B, C]`` in its dtype."""
        return jnp.mean(x.astype(jnp.float32), axis=1).astype(x.dtype)

    def classify(self, pooled: jax.Array) -> jax.Array:
        """Float32 class logits ``[B, num_classes]`` of pooled sequences ``[B, C]`` (``pool``)."""
        if not self.config.num_classes:
            raise ValueError("GPT.classify needs a model built with GPTConfig(num_classes=K), K >= 2")
        return self.cls(self.ln_f(pooled)).astype(jnp.float32)


def abstract_gpt(config: GPTConfig) -> GPT:
    """A GPT whose parameters are ``jax.ShapeDtypeStruct`` (nothing allocated, nothing computed): for parameter
    counts, sharding plans and storage layouts of models too big to build. ``nnx.eval_shape`` under the hood."""
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def gpt_parts(config: GPTConfig) -> list[tuple[tuple[str | int, ...], Any]]:
    """The parts ``GPT.__init__`` builds, in the order it builds them: ``[(path, build)]`` where ``path`` is the
    part's place in ``nnx.state(GPT(...))`` (``("wte",)``, ``("h", 3)``, ...) and ``build(rngs)`` makes that part
    alone, drawing from ``rngs`` exactly what it draws inside the whole model.

    For models too big to build at once: a part built from ``nnx.Rngs(seed)`` whose stream counter starts where
    the parts before it left it (each draw is ``fold_in(key, count)``) holds the same values, bit for bit, as in
    ``GPT(config, rngs=nnx.Rngs(seed))`` (``nsp.train.layerwise`` does this; tests/test_big_model_setup.py checks
    it). Only for ``dropout == 0``: dropout layers with RNG state are parts of their own. Keep this list in step
    with ``GPT.__init__``."""
    if config.dropout > 0:
        raise ValueError("gpt_parts serves models without dropout (dropout layers hold RNG state of their own)")
    embed = functools.partial(
        nnx.Embed, features=config.n_embd, dtype=config.param_dtype, param_dtype=config.param_dtype,
        embedding_init=_normal(0.02),
    )
    return [
        (("wte",), lambda rngs: embed(config.vocab_size, rngs=rngs)),
        (("wpe",), lambda rngs: embed(config.block_size, rngs=rngs)),
        *[(("h", i), lambda rngs: Block(config, rngs=rngs)) for i in range(config.n_layer)],
        (("ln_f",), lambda rngs: _layer_norm(config, rngs)),
        *([(("cls",), lambda rngs: _classifier(config, rngs))] if config.num_classes else []),
    ]


def count_params(model: nnx.Module) -> int:
    """Number of scalars in the ``nnx.Param`` leaves of a model (concrete or abstract)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------------------------------------------
# Loss and sampling


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (in nats, float32) of ``logits [..., V]`` against int ``targets [...]``."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits shape {logits.shape} does not match targets shape {targets.shape} + [vocab]")
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(log_z - target_logit)


def generate(
    model: GPT,
    prompt_tokens: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng: jax.Array | int,
) -> jax.Array:
    """Sample ``max_new_tokens`` tokens after ``prompt_tokens`` and return prompt + samples.

    ``prompt_tokens``: int ``[B, T0]`` (or ``[T0]``, then the result is 1-D too), ``T0 >= 1``; the result has
    ``T0 + max_new_tokens`` tokens per row. Each new token is drawn from ``softmax(logits / temperature)`` of the
    last position, restricted to the ``top_k`` most likely tokens if given; ``temperature=0`` picks the argmax.
    The context is cropped to the last ``block_size`` tokens. ``rng`` (a PRNG key or an int seed) fixes the draw:
    same model, prompt, arguments and rng -> same tokens. Dropout is off. The whole loop is one jitted
    ``lax.fori_loop`` (compiled once per shape/arguments); there is no KV cache, so each new token costs one
    forward pass over the (cropped) context — fine for demos, not for serving."""
    cfg = model.config
    prompt = jnp.asarray(prompt_tokens)
    if not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens must be integers, got dtype {prompt.dtype}")
    squeeze = prompt.ndim == 1
    if squeeze:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt_tokens must have shape [T0] or [batch, T0] with T0 >= 1, got {prompt.shape}")
    if int(max_new_tokens) < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and int(top_k) < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    top_k = None if top_k is None else min(int(top_k), cfg.vocab_size)
    prompt = prompt.astype(jnp.int32)
    if int(max_new_tokens) == 0:
        return prompt[0] if squeeze else prompt
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.key(int(rng))
    graphdef, state = nnx.split(model)
    out = _generate(
        graphdef, state, prompt, rng, jnp.float32(max(temperature, 1e-6)),
        block_size=cfg.block_size, max_new_tokens=int(max_new_tokens), top_k=top_k, greedy=temperature == 0,
    )
    return out[0] if squeeze else out


@functools.partial(jax.jit, static_argnames=("graphdef", "block_size", "max_new_tokens", "top_k", "greedy"))
def _generate(graphdef, state, prompt, rng, temperature, *, block_size, max_new_tokens, top_k, greedy):
    B, T0 = prompt.shape
    total = T0 + max_new_tokens
    W = min(total, block_size)  # fixed window: causal attention makes the not-yet-written tail harmless
    tokens = jnp.zeros((B, total), jnp.int32).at[:, :T0].set(prompt)

    def step(i, tokens):  # writes token i from the window ending at token i - 1
        start = jnp.maximum(i - W, 0)
        window = jax.lax.dynamic_slice_in_dim(tokens, start, W, axis=1)
        logits = nnx.merge(graphdef, state)(window, deterministic=True)
        logits = jax.lax.dynamic_index_in_dim(logits, i - 1 - start, axis=1, keepdims=False)  # [B, V]
        if greedy:
            new = jnp.argmax(logits, axis=-1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            new = jax.random.categorical(jax.random.fold_in(rng, i), logits, axis=-1)
        return tokens.at[:, i].set(new.astype(jnp.int32))

    return jax.lax.fori_loop(T0, total, step, tokens)

