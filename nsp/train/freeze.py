"""Fine-tuning with part of the model frozen (``--freeze REGEX``, ``--freeze-layers N``) and from another run's
params (``--init-from``).

A frozen leaf is kept out of the store and out of the backward pass: the step splits the params into a trainable
and a frozen tree (``Freeze.split``), differentiates the loss with respect to the trainable one only (so XLA never
builds the frozen weights' gradients, nor the backward pass of frozen blocks that nothing trainable lies below),
and hands only the trainable tree to the optax chain, whose store then holds the fp32 master and moments of the
trainable leaves alone. The frozen leaves go through the step as plain inputs and come back as they were, bit for
bit; checkpoints save the whole params tree, so ``--resume`` and ``nsp sample`` see the frozen leaves too.

Leaves are named by their path in the params tree, keys joined by ``/``: the store's leaf
``['h'][0]['attn']['c_attn']['kernel'].value`` is ``h/0/attn/c_attn/kernel`` (the nnx Variable's ``value``
dropped), in a checkpoint's saved tree as in the model's. The names are those of ``nsp ckpt export``'s trees (``nsp.storage.export.path_keys``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from nsp.storage.export import path_keys
from nsp.storage.format import StoreError
from nsp.train.config import TrainConfig, TrainError

#: The leaves ``--freeze-layers`` freezes besides the first N blocks: the token and position embeddings.
EMBEDDINGS = ("wte", "wpe")
_BLOCK = re.compile(r"h/(\d+)/")


def leaf_name(path) -> str:
    """``h/0/attn/c_attn/kernel``: the keys of a ``jax.tree_util`` key path joined by ``/``, without the nnx
    Variable's trailing ``value`` (an attribute in the params tree, a key in the tree a checkpoint saved)."""
    keys = path_keys(jax.tree_util.keystr(tuple(path)))
    return "/".join(keys[:-1] if len(keys) > 1 and keys[-1] == "value" else keys)


def leaf_names(params) -> list[str]:
    """The names of ``params``'s leaves, in the store's layout order (``jax.tree_util`` flattening order)."""
    return [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


@dataclasses.dataclass(frozen=True)
class Freeze:
    """Which leaves of a params tree are frozen (by name: ``leaf_name``). Hashable: the jitted step closes over
    it. ``Freeze()`` freezes nothing (``split`` then hands back the whole tree as trainable)."""

    names: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.names)

    def split(self, params) -> tuple[Any, Any]:
        """``(trainable, frozen)``: two trees shaped like ``params``, each with ``None`` where the other holds a
        leaf. The trainable tree's leaves keep their paths, so the store's layout names them as in the whole
        model; ``merge`` puts the two back together."""
        def pick(frozen):
            return lambda path, x: x if (leaf_name(path) in self.names) == frozen else None

        return (jax.tree_util.tree_map_with_path(pick(False), params),
                jax.tree_util.tree_map_with_path(pick(True), params))

    @staticmethod
    def merge(trainable, frozen):
        """The whole params tree from ``split``'s two halves."""
        return jax.tree_util.tree_map(lambda t, f: t if f is None else f, trainable, frozen,
                                      is_leaf=lambda x: x is None)


def resolve(config: TrainConfig, params) -> Freeze:
    """The leaves of ``params`` (arrays or abstract) that ``config.freeze`` and ``config.freeze_layers`` freeze.

    Raises:
      TrainError: the regex matches no leaf, ``--freeze-layers`` exceeds the model's blocks, or every leaf would
        be frozen (nothing left to train).
    """
    names = leaf_names(params)
    frozen: set[str] = set()
    if config.freeze:
        pattern = re.compile(config.freeze)
        matched = {n for n in names if pattern.search(n)}
        if not matched:
            raise TrainError(f"--freeze {config.freeze!r} matches no parameter of model {config.model!r}; its "
                             f"leaves are named like {', '.join(names[:3])}, ... ({len(names)} in all)")
        frozen |= matched
    if config.freeze_layers:
        frozen |= _first_layers(names, config.freeze_layers, config.model)
    if frozen and frozen.issuperset(names):
        raise TrainError(f"--freeze/--freeze-layers freeze all {len(names)} parameter leaves of model "
                         f"{config.model!r}: nothing is left to train")
    return Freeze(frozenset(frozen))


def _first_layers(names: list[str], n: int, model: str) -> set[str]:
    """The embeddings' leaves and those of blocks ``0 .. n - 1``."""
    blocks = {int(m.group(1)) for name in names if (m := _BLOCK.match(name))}
    if n > len(blocks):
        raise TrainError(f"--freeze-layers {n}: model {model!r} has {len(blocks)} blocks")
    return {name for name in names
            if name.split("/")[0] in EMBEDDINGS or ((m := _BLOCK.match(name)) and int(m.group(1)) < n)}


def describe(freeze: Freeze, params) -> str:
    """``"0.05M of 0.12M params trainable (12 of 28 leaves frozen)"`` for the set-up's log."""
    trainable, frozen = freeze.split(params)
    count = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    return (f"{count(trainable) / 1e6:.2f}M of {(count(trainable) + count(frozen)) / 1e6:.2f}M params trainable "
            f"({len(freeze.names)} of {len(leaf_names(params))} leaves frozen: out of the store and the backward "
            "pass)")


# ---- --init-from: another run's params as the starting point -------------------------------------------------------


def checkpoint_step_dir(source: str | Path) -> Path:
    """The checkpoint step directory ``--init-from`` names: ``source`` itself when it is one (``RUN/ckpt/STEP``),
    else the latest complete checkpoint of the run ``source`` (or of its ``ckpt`` directory)."""
    from nsp.storage import checkpoint as ckpt

    source = Path(source)
    if (source / "train_state").is_dir():
        return source
    ckpt_dir = source / "ckpt" if (source / "ckpt").is_dir() else source
    if not ckpt_dir.is_dir():
        raise TrainError(f"--init-from {source}: no such run or checkpoint directory")
    manager = ckpt.make_checkpoint_manager(ckpt_dir, max_to_keep=None)
    try:
        step = manager.latest_step()
    finally:
        manager.close()
    if step is None:
        raise TrainError(f"--init-from {source}: holds no complete checkpoint (in {ckpt_dir})")
    return ckpt_dir / str(step)


def load_params(source: str | Path, template) -> Any:
    """The params saved with the checkpoint ``source`` names (``checkpoint_step_dir``), as a tree shaped like
    ``template`` (this run's fresh params) in its dtypes. A classifier's head (``cls``, ``--task classify``) that
    the checkpoint lacks (a pretrained language model's) keeps ``template``'s fresh values; where the template is
    abstract (``jax.ShapeDtypeStruct`` leaves, ``setup.abstract_model``: a process that never runs the head) the
    head is zeros.

    Raises:
      TrainError: no checkpoint there, or its params are another model's (a leaf missing, extra or of another
        shape: the message names it).
    """
    from nsp.storage import checkpoint as ckpt

    step_dir = checkpoint_step_dir(source)
    try:
        saved = ckpt.load_train_state(step_dir)["params"]
    except (StoreError, KeyError) as e:
        raise TrainError(f"--init-from {step_dir}: no params to load ({e})") from None
    by_name = {leaf_name(path): x for path, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, like in paths:
        name = leaf_name(path)
        if name not in by_name and name.split("/")[0] == "cls":
            # A classifier on a language model: the new head starts fresh (zeros from an abstract template).
            abstract = isinstance(like, jax.ShapeDtypeStruct)
            leaves.append(jnp.zeros(like.shape, like.dtype) if abstract else jnp.asarray(like))
            continue
        if name not in by_name:
            raise TrainError(f"--init-from {step_dir}: the checkpoint has no leaf {name} {tuple(like.shape)} "
                             "(a model of another config)")
        got = by_name.pop(name)
        if tuple(got.shape) != tuple(like.shape):
            raise TrainError(f"--init-from {step_dir}: leaf {name} has shape {tuple(got.shape)} there, "
                             f"{tuple(like.shape)} in this model (a model of another config)")
        leaves.append(jnp.asarray(got).astype(like.dtype))
    if by_name:
        raise TrainError(f"--init-from {step_dir}: the checkpoint has leaves this model lacks: "
                         f"{', '.join(sorted(by_name)[:5])} (a model of another config)")
    return jax.tree_util.tree_unflatten(treedef, leaves)
