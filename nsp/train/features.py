"""Near-data fine-tuning (NDPipe's FT-DMP): a frozen backbone's features computed where the data is, and the
trainable top trained from them.

``nsp features`` runs the frozen part of a pretrained GPT (the embeddings and the first ``--freeze-layers N``
blocks, from ``--init-from``) forward over the batches a run would train on, and writes what comes out of block
``N - 1`` (the residual stream, ``[rows, seq, width]``) with the batches' tokens as tensorstore arrays: one pair
per extractor process (``process-PPPPP/features``, ``process-PPPPP/tokens``), each written only by its process,
next to the data that process serves. ``nsp launch -n P -- nsp features ...`` runs P extractors, process ``p``
taking steps ``p, p + P, ...``. The dtype is bf16 by default (half the bytes, lossy), recorded in
``features.json``; ``--features-dtype float32`` keeps them as the model computes them (lossless for an fp32 model).

``nsp train --features DIR`` (the Tuner) trains from them: each step reads its batch's features and tokens,
runs blocks ``N ..`` and the head, and differentiates with respect to the trainable params only, as a run with
``--freeze-layers N`` does; the frozen leaves come from ``--init-from`` as usual and must be the ones the
features were computed with (``features.json`` holds their SHA-256). Trained from fp32 features, the params are
those of ``nsp train --init-from ... --freeze-layers N`` on the same batches, bit for bit.

Per token, features are larger than the tokens they come from (``width`` values against one byte): the bytes
moved grow, what shrinks is the compute the Tuner does (``FeatureMeta.bytes_*`` records both sizes). A classifier
(``--task classify``) whose backbone is every block sends one pooled ``[width]`` vector per sequence instead
(``GPT.pool``): smaller than the sequence's tokens once ``seq`` exceeds ``width`` times the dtype's bytes, and the
Tuner then runs only the final LayerNorm and the classifier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nsp.train.config import TrainConfig, TrainError

FORMAT = "nsp-features"
FORMAT_VERSION = 1
META = "features.json"
DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class FeatureMeta:
    """What ``features.json`` records: how the features were made, so a Tuner can check it trains on the same.

    Attributes:
      blocks: the frozen blocks (the features are block ``blocks - 1``'s output); the embeddings are frozen too.
      dtype: the features' dtype (``bfloat16`` or ``float32``).
      model, width, seq, batch, seed, data: the run they serve (its batches are a function of seed and step).
      steps: steps extracted (rows ``steps * batch``).
      runs, steps_per_run: the steps in ``runs`` sub-datasets of ``steps_per_run`` consecutive steps, extracted
        in order; each process marks each run done (``process-PPPPP/run-RRRRR.done``), so a Tuner can train on
        run r while run r + 1 is extracted (NDPipe's pipelined FT-DMP).
      rows_per_device: rows of a batch each device computed (the batch split over the extractor's devices): a
        Tuner whose devices take as many rows each trains on its own features bit for bit.
      processes: extractor processes; process ``p`` holds steps ``p, p + processes, ...``.
      source: the checkpoint step directory the backbone came from.
      backbone_sha256: SHA-256 over the frozen leaves' names, shapes, dtypes and bytes.
      bytes_features, bytes_tokens: the features' bytes and the tokens' (int32 in the arrays; one byte each as
        text).
      task: ``lm`` (the second array holds each row's tokens) or ``classify`` (it holds each row's label).
      classes: the classifier's classes (``classify``), else 0.
      pooled: the features are one ``[width]`` vector per sequence, the blocks' output averaged over its
        positions (``classify`` with every block frozen: ``GPT.pool``), not one per token.
    """

    blocks: int
    dtype: str
    model: str
    width: int
    seq: int
    batch: int
    seed: int
    data: str
    steps: int
    processes: int
    rows_per_device: int
    source: str
    runs: int
    steps_per_run: int
    backbone_sha256: str
    bytes_features: int
    bytes_tokens: int
    task: str = "lm"
    classes: int = 0
    pooled: bool = False
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> FeatureMeta:
        path = Path(directory) / META
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TrainError(f"--features {directory}: no {META} (not written by nsp features, or its process 0 "
                             "has not started)") from None
        except (OSError, ValueError) as e:
            raise TrainError(f"--features {directory}: cannot read {META}: {e}") from None
        if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise TrainError(f"--features {directory}: {META} is not nsp features format {FORMAT_VERSION}")
        return cls(**data)


def backbone_sha256(params, freeze) -> str:
    """SHA-256 over the frozen leaves of ``params`` (names in order, shapes, dtypes, bytes)."""
    from nsp.train.freeze import leaf_name

    digest = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = leaf_name(path)
        if name in freeze.names:
            a = np.asarray(x)
            digest.update(f"{name}|{a.shape}|{a.dtype}|".encode())
            digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def process_share() -> tuple[int, int]:
    """``(process index, process count)`` of an extractor: what ``nsp launch`` sets (``JAX_PROCESS_ID``,
    ``JAX_NUM_PROCESSES``), else one process."""
    count = int(os.environ.get("JAX_NUM_PROCESSES", "1") or 1)
    index = int(os.environ.get("JAX_PROCESS_ID", "0") or 0)
    if not 0 <= index < count:
        raise TrainError(f"process {index} of {count}: JAX_PROCESS_ID must be in 0 .. JAX_NUM_PROCESSES - 1")
    return index, count


def _array_spec(path: Path, shape: tuple[int, ...], dtype: str, chunk: tuple[int, ...]) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": list(shape), "data_type": dtype,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}}}}


def _process_dir(directory: Path, index: int) -> Path:
    return directory / f"process-{index:05d}"


def extract(config: TrainConfig, out: str | os.PathLike, *, dtype: str = "bfloat16", runs: int = 1,
            log: Callable[[str], None] = print) -> FeatureMeta:
    """Runs the frozen backbone of ``config`` (``--init-from``, ``--freeze-layers``) over this process's share of
    the batches of steps ``0 .. config.steps - 1`` and writes its features and tokens under ``out`` (module
    docstring), in ``runs`` sub-datasets of consecutive steps, each marked done as it is written. Process 0
    writes ``features.json`` first (what the set will hold), so a Tuner can start on the first run.

    Raises:
      TrainError: no ``--init-from`` or ``--freeze-layers``, another ``--freeze`` (the features are those of the
        first blocks), an unknown dtype, ``out`` holding another extraction.
    """
    import tensorstore as ts

    from nsp.train import freeze as freeze_lib
    from nsp.train.setup import abstract_model, load_data, model_config

    if not config.init_from or config.freeze_layers < 1:
        raise TrainError("nsp features needs --init-from (the pretrained model) and --freeze-layers N (the "
                         "backbone whose features it writes)")
    if config.freeze:
        raise TrainError("nsp features: the features are those of the first --freeze-layers blocks; --freeze "
                         "REGEX does not apply")
    if dtype not in DTYPES:
        raise TrainError(f"--features-dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if not 1 <= runs <= config.steps:
        raise TrainError(f"--features-runs {runs}: between 1 and --steps ({config.steps})")
    index, count = process_share()
    directory = Path(out)
    mine_dir = _process_dir(directory, index)
    if mine_dir.exists() or (index == 0 and (directory / META).exists()):
        raise TrainError(f"{directory} already holds features: remove it or give another --features-out")
    data = load_data(config)
    vocab = int(data.tokens.vocab_size)
    width = model_config(config, vocab).n_embd
    # Every param the backbone runs comes from the checkpoint: the model's shape is all the template needs.
    graphdef, template = abstract_model(config, vocab)
    params = freeze_lib.load_params(config.init_from, template)
    frozen = freeze_lib.resolve(config, params)
    source = str(freeze_lib.checkpoint_step_dir(config.init_from))
    n = config.freeze_layers

    # Each device computes its rows of a batch, as the Tuner's devices will: a matmul's rounding can depend on
    # how many rows it multiplies, so the same split is what makes the features the run's own, bit for bit.
    devices = jax.devices()
    split = len(devices) if len(devices) > 1 and config.batch % len(devices) == 0 else 1
    rows_in = None
    if split > 1:
        mesh = jax.make_mesh((split,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
        rows_in = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    classify = config.task == "classify"
    pooled = classify and n == model_config(config, vocab).n_layer  # only the classifier is left to train
    targets = "labels" if classify else "tokens"

    @jax.jit
    def backbone(params, tokens):
        model = nnx.merge(graphdef, params)
        x = model.blocks(model.embed(tokens if classify else tokens[:, :-1]), 0, n)
        return (model.pool(x) if pooled else x).astype(dtype)

    steps = list(range(index, config.steps, count))
    rows = len(steps) * config.batch
    per_run = -(-config.steps // runs)
    row_shape = (width,) if pooled else (config.seq, width)
    meta = FeatureMeta(blocks=n, dtype=dtype, model=config.model, width=width, seq=config.seq, batch=config.batch,
                       seed=config.seed, data=config.data, steps=config.steps, processes=count,
                       rows_per_device=config.batch // split, source=source, runs=runs, steps_per_run=per_run,
                       backbone_sha256=backbone_sha256(params, frozen),
                       bytes_features=config.steps * config.batch * int(np.prod(row_shape)) * jnp.dtype(dtype).itemsize,
                       bytes_tokens=config.steps * config.batch * (config.seq + (0 if classify else 1)),
                       task=config.task, classes=config.classes if classify else 0, pooled=pooled)
    mine_dir.mkdir(parents=True)
    if index == 0:
        _write_json(directory / META, meta.to_json())
    features = ts.open(_array_spec(mine_dir / "features", (rows, *row_shape), dtype, (config.batch, *row_shape)),
                       create=True).result()
    target_shape = () if classify else (config.seq + 1,)
    tokens = ts.open(_array_spec(mine_dir / targets, (rows, *target_shape), "int32", (config.batch, *target_shape)),
                     create=True).result()
    log(f"features: blocks 0-{n - 1} of {config.model}{' pooled' if pooled else ''} from {source}, {len(steps)} of "
        f"{config.steps} steps "
        f"(process {index} of {count}, each batch over {split} device{'s' if split > 1 else ''}), {dtype}, into "
        f"{mine_dir}")
    t0, last, done_run = time.perf_counter(), 0.0, -1
    for i, step in enumerate(steps):
        batch = data.train_batches.batch(step)
        inputs, target = (batch["tokens"], batch["labels"]) if classify else (batch, batch)
        x = backbone(params, jax.device_put(inputs, rows_in) if rows_in is not None else jnp.asarray(inputs))
        at = slice(i * config.batch, (i + 1) * config.batch)
        writes = [features[at].write(np.asarray(x)), tokens[at].write(target)]
        for w in writes:
            w.result()
        run = step // per_run
        last_of_run = i + 1 == len(steps) or steps[i + 1] // per_run != run
        if last_of_run:  # this process's part of the run is written: a Tuner may read it
            for r in range(done_run + 1, run + 1):
                _write_json(mine_dir / _run_marker(r), {"process": index, "run": r})
            done_run = run
        if time.perf_counter() - last > 10 or i + 1 == len(steps):
            last = time.perf_counter()
            log(f"features: {i + 1}/{len(steps)} steps (run {run + 1} of {runs}), "
                f"{(i + 1) * config.batch / (last - t0):,.0f} sequences/s")
    for r in range(done_run + 1, runs):  # runs with none of this process's steps
        _write_json(mine_dir / _run_marker(r), {"process": index, "run": r})
    _write_json(mine_dir / "done.json", {"process": index, "steps": steps})
    if index == 0:
        log(f"features: {meta.steps} steps x {meta.batch} sequences into {directory} ({meta.bytes_features / 1e6:,.2f} "
            f"MB of features for {meta.bytes_tokens / 1e6:,.2f} MB of tokens)")
    return meta


def _run_marker(run: int) -> str:
    return f"run-{run:05d}.done"


def _write_json(path: Path, data: dict) -> None:
    """``data`` to ``path``, whole or not at all (a reader polling for it never sees a part)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class FeatureBatches:
    """The Tuner's training batches: ``batch(step, rows)`` is ``{"x": features, "tokens": tokens}`` (``{"x",
    "labels"}`` for ``--task classify``) of that step
    (the rows a run drawing ``Batcher.batch(step)`` would have seen), read from the extractors' arrays.

    A step whose run its extractor has not marked done yet is waited for (extraction running beside the Tuner:
    the pipelined schedule), at most ``wait_s`` seconds without the extractor marking anything; ``waited_s`` is
    the time spent so."""

    def __init__(self, directory: str | os.PathLike, meta: FeatureMeta, *, wait_s: float = 600.0):
        self.directory, self.meta, self.wait_s = Path(directory), meta, wait_s
        self._parts: dict[int, tuple[Any, Any]] = {}
        self._targets = "labels" if meta.task == "classify" else "tokens"
        self._ready: set[tuple[int, int]] = set()
        self.waited_s = 0.0

    def _part(self, p: int) -> tuple[Any, Any]:
        import tensorstore as ts

        if p not in self._parts:
            part = _process_dir(self.directory, p)
            try:
                self._parts[p] = tuple(
                    ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(part / name)}},
                            open=True).result() for name in ("features", self._targets))
            except ValueError as e:
                raise TrainError(f"--features {self.directory}: process {p}'s part cannot be opened: {e}") from None
        return self._parts[p]

    def _wait(self, p: int, run: int) -> None:
        if (p, run) in self._ready:
            return
        marker = _process_dir(self.directory, p) / _run_marker(run)
        t0 = time.perf_counter()
        progress = lambda: len(list(_process_dir(self.directory, p).glob("run-*.done")))  # noqa: E731
        seen, since, checked = progress(), time.monotonic(), time.monotonic()
        while not marker.exists():
            time.sleep(0.02)
            if time.monotonic() - checked < 1.0 and self.wait_s >= 1.0:
                continue  # the marker is checked often, the extractor's progress (a directory listing) once a second
            checked = time.monotonic()
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self.wait_s:
                raise TrainError(f"--features {self.directory}: extractor process {p} marked nothing for "
                                 f"{self.wait_s:.0f} s and run {run + 1} of {self.meta.runs} is not done (is it "
                                 "running?)")
        self.waited_s += time.perf_counter() - t0
        self._ready.add((p, run))

    def batch(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        if not 0 <= step < self.meta.steps:
            raise TrainError(f"--features {self.directory}: holds steps 0 .. {self.meta.steps - 1}, step {step} asked")
        p, i = step % self.meta.processes, step // self.meta.processes
        self._wait(p, step // self.meta.steps_per_run)
        features, tokens = self._part(p)
        at = slice(i * self.meta.batch, (i + 1) * self.meta.batch)
        x, t = features[at].read().result(), tokens[at].read().result()
        if rows is not None:
            x, t = x[rows], t[rows]
        return {"x": np.asarray(x), self._targets: np.asarray(t)}


def open_for(config: TrainConfig) -> tuple[FeatureMeta, FeatureBatches]:
    """The features ``config.features`` names, checked against the run: the same blocks, batch, sequence, seed,
    data and model, and enough steps.

    Raises:
      TrainError: naming what differs.
    """
    meta = FeatureMeta.read(config.features)
    wanted = {"blocks (--freeze-layers)": (meta.blocks, config.freeze_layers), "batch": (meta.batch, config.batch),
              "seq": (meta.seq, config.seq), "seed": (meta.seed, config.seed), "data": (meta.data, config.data),
              "model": (meta.model, config.model), "task": (meta.task, config.task),
              "classes": (meta.classes, config.classes if config.task == "classify" else 0)}
    for name, (there, here) in wanted.items():
        if there != here:
            raise TrainError(f"--features {config.features}: made with {name} {there!r}, this run has {here!r}")
    if config.steps > meta.steps:
        raise TrainError(f"--features {config.features}: holds {meta.steps} steps, the run asks for {config.steps}")
    return meta, FeatureBatches(config.features, meta)


def check_backbone(config: TrainConfig, meta: FeatureMeta, params, freeze) -> None:
    """Refuses a run whose frozen leaves are not those the features were computed with."""
    if backbone_sha256(params, freeze) != meta.backbone_sha256:
        raise TrainError(f"--features {config.features}: computed with another backbone ({meta.source}) than this "
                         f"run's frozen params (--init-from {config.init_from})")
