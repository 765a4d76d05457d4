"""The compiled train step's temporaries, per parameter: nsp's step beside its own forward/backward and optax's.

    python bench/step_memory.py                  # a 4-layer GPT 1024 wide (51M params), bf16 params for nsp
    python bench/step_memory.py --layers 2 --width 512

Nothing runs: each step is compiled and XLA's ``compiled.memory_analysis().temp_size_in_bytes`` read (XLA's
default passes, no flags). Rows:

  fwd/bwd          ``jax.value_and_grad`` of the loss alone, bf16 params (its gradient is an output, not a temporary)
  optax.adamw      ``nsp train``'s step builder around ``optax.adamw``, fp32 params (what optax users run)
  nsp ...          ``nsp train``'s step builder around ``nsp.optim.adamw`` on a store of each tier, bf16 params,
                   dense and Top-K 1% (error feedback), staleness 0 and 1
  nsp file staged  the same, file tier, ``stage_gradients=True`` (the gradient staged on the store's disk leaf by
                   leaf, the new params read back leaf by leaf), with and without ``clip_norm``: it should hold
                   well under the forward/backward + the whole gradient

The bound nsp's step is held to (``tests/test_step_memory.py`` guards it on a smaller GPT): the forward/backward's
temporaries + the bf16 gradient it consumes (2 bytes per parameter) + 0.3 bytes per parameter. The record goes to
``bench/results/step_memory.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

SLACK_PER_PARAM = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import nsp.optim
    import nsp.storage
    from nsp.models import GPT
    from nsp.models.gpt import GPTConfig
    from nsp.train.trainer import loss_fn, make_train_step

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                    n_embd=args.width, dtype=jnp.bfloat16, f32_accum=True)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jnp.zeros((1, args.seq + 1), jnp.int32)

    def per_param(compiled) -> float:
        return compiled.memory_analysis().temp_size_in_bytes / n

    rows = []
    fwd_bwd = per_param(jax.jit(jax.value_and_grad(functools.partial(loss_fn, graphdef))).lower(bf16, tokens)
                        .compile())
    bound = fwd_bwd + 2.0 + SLACK_PER_PARAM
    rows.append({"step": "fwd/bwd", "params": "bf16", "temp_b_per_param": fwd_bwd})
    tx = optax.adamw(1e-4)
    rows.append({"step": "optax.adamw", "params": "fp32", "temp_b_per_param": per_param(
        make_train_step(graphdef, tx)[0].lower(params, tx.init(params), tokens).compile())})
    for tier in ("memory", "file"):
        for topk in (False, True):
            for staleness in (0, 1):
                with tempfile.TemporaryDirectory() as tmp:
                    store = nsp.storage.open(tmp if tier == "file" else None, tier=tier)
                    try:
                        kw = {"compression": nsp.optim.TopK(0.01)} if topk else {}
                        tx = nsp.optim.adamw(1e-4, store=store, staleness=staleness, **kw)
                        state = tx.init(params)
                        temp = per_param(make_train_step(graphdef, tx)[0].lower(bf16, state, tokens).compile())
                    finally:
                        store.close()
                rows.append({"step": f"nsp {tier} {'top-k 1%' if topk else 'dense'} s{staleness}", "params": "bf16",
                             "temp_b_per_param": temp, "within_bound": "yes" if temp <= bound else "NO"})
    for tier in ("memory", "file"):  # nsp train --bf16-params's updates (float32_updates)
        with tempfile.TemporaryDirectory() as tmp:
            store = nsp.storage.open(tmp if tier == "file" else None, tier=tier)
            try:
                tx = nsp.optim.adamw(1e-4, store=store, float32_updates=True)
                state = tx.init(params)
                temp = per_param(make_train_step(graphdef, tx)[0].lower(bf16, state, tokens).compile())
            finally:
                store.close()
        rows.append({"step": f"nsp {tier} dense s0 f32-updates", "params": "bf16", "temp_b_per_param": temp,
                     "within_bound": "yes" if temp <= bound else "NO"})
    # float32_updates: what nsp train --bf16-params runs (the updates land bf16 params on the master's rounding).
    for clip, wide in ((None, False), (1.0, False), (None, True), (1.0, True)):
        with tempfile.TemporaryDirectory() as tmp:
            store = nsp.storage.open(tmp, tier="file")
            try:
                tx = nsp.optim.adamw(1e-4, store=store, stage_gradients=True, clip_norm=clip, float32_updates=wide)
                state = tx.init(params)
                temp = per_param(make_train_step(graphdef, tx)[0].lower(bf16, state, tokens).compile())
            finally:
                store.close()
        rows.append({"step": "nsp file staged" + (" clip" if clip else "") + (" f32-updates" if wide else ""),
                     "params": "bf16", "temp_b_per_param": temp, "within_bound": "yes" if temp <= bound else "NO"})
    print_table(f"compiled step temporaries, GPT {args.layers} x {args.width} ({n / 1e6:.1f}M params), batch 1 x "
                f"{args.seq}; nsp's bound: fwd/bwd + bf16 gradient + {SLACK_PER_PARAM} = {bound:.2f} B/param",
                rows, [("step", "step", "s"), ("params", "params", "s"), ("temp_b_per_param", "temp (B/param)", ".2f"),
                       ("within_bound", "within bound", "s")])
    write_json("step_memory", {"layers": args.layers, "width": args.width, "seq": args.seq, "params": n,
                               "bound_b_per_param": bound, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
