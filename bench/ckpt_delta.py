"""Checkpoint delta size against the full checkpoint (``nsp ckpt delta``), for three kinds of training.

    python bench/ckpt_delta.py --dir /tmp/x      # about a minute on 2 cores

The ``small`` GPT (3.3M params) on 64 KiB pages (about 200 pages per state):

  dense      ``nsp train --model small``, AdamW: every param, mu and nu moves each step, so every page changes
             (a delta is about as big as the checkpoint: expected)
  topk-lazy  the same with ``--topk 0.01 --topk-lazy``: only the entries sent each step move, but 1% of a page's
             entries is enough to change the page
  frozen     a store of the same GPT's params with a lazy Adam, trained on one block's leaves only (the rest frozen:
             zero gradient), checkpointed through the orbax manager: only the pages holding that block change

Each prints ``delta: X MB of Y MB (Z%), N of M pages`` for one step and for two steps apart (one delta, not two),
applies the delta and checks the rebuilt checkpoint is the new one, byte for byte. For ``dense`` it also resumes
``nsp train`` from a run directory holding only the rebuilt step and checks it ends where resuming from the
original does.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from nsp.cli import main as nsp
from nsp.storage import delta


def corpus(path: Path) -> str:
    import collections
    import json as json_mod

    path.write_text(inspect.getsource(collections) + inspect.getsource(json_mod.decoder))
    return str(path)


MODEL = "small"


def train(run: Path, data: str, *extra: str) -> None:
    args = ["train", "--model", MODEL, "--data", data, "--run-dir", str(run), "--batch", "4", "--seq", "64",
            "--steps", "3", "--ckpt-every", "1", "--keep-checkpoints", "10", "--page-mib", "0.0625",
            "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1000", *extra]
    if nsp(args) != 0:
        raise SystemExit(f"nsp {' '.join(args)} failed")


def same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files)


def measure(name: str, ckpt: Path, work: Path, pairs=((1, 2), (1, 3))) -> list[dict]:
    rows = []
    for old, new in pairs:
        out = work / f"{name}-delta-{old}-{new}"
        manifest = delta.make_delta(ckpt / str(old), ckpt / str(new), out)
        rebuilt = work / f"{name}-rebuilt-{old}-{new}" / str(new)
        rebuilt.parent.mkdir()
        delta.apply_delta(ckpt / str(old), out, rebuilt, mode="copy")
        ok = same_files(rebuilt, ckpt / str(new))
        s = manifest.stats
        state_pages = [e for e in manifest.files if e.page]
        state_sent = sum(e.bytes for e in state_pages if e.source == "delta")
        state_full = sum(e.bytes for e in state_pages)
        print(f"{name:9s} step {old} -> {new}: {s.summary()}; optimizer state pages "
              f"{100 * state_sent / state_full:.1f}%; rebuilt byte-identical: {ok}")
        rows.append({"case": name, "old": old, "new": new, **{k: v for k, v in s.__dict__.items()},
                     "ratio": s.ratio, "state_ratio": state_sent / state_full, "rebuilt_identical": ok})
    return rows


def resume_from_rebuilt(run: Path, data: str, work: Path) -> bool:
    """``nsp train --resume`` from a run directory that holds only step 3 rebuilt from step 1 + a delta, against
    the same resume from the original step 3: both end at the same loss."""
    copy = work / "resumed-rebuilt"
    (copy / "ckpt").mkdir(parents=True)
    shutil.copy(run / "config.json", copy / "config.json")
    shutil.copytree(work / "dense-rebuilt-1-3" / "3", copy / "ckpt" / "3")
    orig = work / "resumed-original"
    (orig / "ckpt").mkdir(parents=True)
    shutil.copy(run / "config.json", orig / "config.json")
    shutil.copytree(run / "ckpt" / "3", orig / "ckpt" / "3")
    losses = []
    for r in (copy, orig):
        train(r, data, "--resume", "--steps", "4", "--store-dir", str(r / "store"))
        rows = [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses.append([row["loss"] for row in rows if "loss" in row][-1])
    print(f"resume from the rebuilt step 3 -> step 4 loss {losses[0]!r}; from the original {losses[1]!r}")
    return losses[0] == losses[1]


def frozen(work: Path) -> Path:
    """The tiny GPT's params in a lazy Adam store, trained on one block only, checkpointed at steps 1-3."""
    import jax
    from flax import nnx

    import nsp.storage as storage
    from nsp.models import GPT, get_config
    from nsp.storage import checkpoint as ckpt
    from nsp.train.data import ByteTokenizer

    cfg = get_config(MODEL, vocab_size=ByteTokenizer().vocab_size)
    _, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.tree_util.tree_map(lambda x: x, nnx.to_pure_dict(params))
    manager = ckpt.make_checkpoint_manager(work / "frozen" / "ckpt", max_to_keep=None)
    rng = np.random.default_rng(0)
    with storage.open(work / "frozen" / "store", tier="file", num_shards=1, page_bytes=64 * 1024) as store:
        store.initialize(params, storage.OptimizerSpec("adamw", lazy=True))
        layout = store.layout
        def block(leaf):  # ['h'][i][...]: transformer block i
            return int(leaf.path.split("]")[1][1:]) if leaf.path.startswith("['h']") else None

        last = max(b for b in map(block, layout.leaves) if b is not None)
        trained = [leaf for leaf in layout.leaves if block(leaf) == last]
        n = sum(leaf.size for leaf in trained)
        print(f"frozen: training the {len(trained)} leaves of block {last} ({n} of {layout.total} params, "
              f"{100 * n / layout.total:.1f}%), the rest frozen")
        for s in (1, 2, 3):
            g = np.zeros(layout.padded_total, np.float32)
            for leaf in trained:
                g[leaf.offset:leaf.offset + leaf.size] = rng.standard_normal(leaf.size)
            store.update(g, version=s - 1, lr=1e-3, step=s)
            ckpt.save_checkpoint(manager, s, store, None, {"step": s})
    manager.close()
    return work / "frozen" / "ckpt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="working directory (default: a temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="nsp-ckpt-delta-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = corpus(work / "corpus.txt")
        rows = []
        train(work / "dense", data)
        rows += measure("dense", work / "dense" / "ckpt", work)
        train(work / "topk", data, "--topk", "0.01", "--topk-lazy")
        rows += measure("topk-lazy", work / "topk" / "ckpt", work)
        rows += measure("frozen", frozen(work), work)
        resumed = resume_from_rebuilt(work / "dense", data, work)
        print(json.dumps({"rows": rows, "resume_from_rebuilt_matches": resumed}, indent=1))
        return 0 if resumed and all(r["rebuilt_identical"] for r in rows) else 1
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
