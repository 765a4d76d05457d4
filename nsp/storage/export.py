"""Export: a checkpoint that plain orbax reads on one process, without nsp (the fp32 master params and the moments
as pytrees shaped like the original parameter tree), written from a snapshot (``snapshot.py``) or a checkpoint step
(of one process, or of many: every process's part is read, ``reshard.ItemSource``)."""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from nsp.storage.format import StoreError, atomic_write_json
from nsp.storage.layout import Layout
from nsp.storage.reshard import ItemSource
from nsp.storage.snapshot import SNAPSHOT

_KEY_TOKEN = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def path_keys(path: str) -> list[str]:
    """``"['dense']['kernel']"`` → ``["dense", "kernel"]`` (jax keystr paths; indices become strings): where a
    leaf sits in the exported trees (``export.json`` records them per leaf)."""
    keys, pos = [], 0
    while pos < len(path):
        m = _KEY_TOKEN.match(path, pos)
        if m is None:
            return [path]  # not a path we can split: keep it whole as one key
        keys.append(str(ast.literal_eval(m.group(1))) if m.group(1) is not None else m.group(2))
        pos = m.end()
    return keys or [path]


def _nest(layout: Layout, flat: np.ndarray) -> dict:
    tree: dict = {}
    for leaf in layout.leaves:
        node = tree
        keys = path_keys(leaf.path)
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.ascontiguousarray(flat[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape))
    return tree


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Writes a checkpoint that plain orbax reads, without nsp.

    ``checkpoint_dir`` is a checkpoint step directory (``.../<step>`` with a ``store`` item, written by one process
    or several: their parts are read together into one tree) or a snapshot.
    ``out_dir`` (must not exist) gets::

      out_dir/params/      orbax StandardCheckpointer pytree: fp32 master params, original shapes, nested dicts
                           keyed by the parameter paths (sequence indices become string keys "0", "1", ...)
      out_dir/opt_state/   orbax StandardCheckpointer pytree {"mu": tree, "nu": tree} (the moments the
                           optimizer keeps; absent for plain SGD)
      out_dir/train_state/ the step's train_state item (hard links/copies of orbax's own files), if any
      out_dir/export.json  version, optimizer, leaves (path, shape, original dtype), the step's meta

    Restore with ``ocp.StandardCheckpointer().restore(out_dir / "params")``.
    """
    src = Path(checkpoint_dir).absolute()
    out = Path(out_dir).absolute()
    if out.exists():
        raise StoreError(f"export directory {out} already exists")
    if not out.parent.exists():
        raise StoreError(f"cannot create {out}: directory {out.parent} does not exist")
    snap = src / "store" if (src / "store" / SNAPSHOT).exists() or (src / "store").is_dir() else src
    # A lone process's snapshot or every process's part of a multi-process step, read as one vector per state.
    source = ItemSource(snap)
    source.check()  # a missing part is named before anything is written
    meta = source.meta
    layout = Layout.from_json(meta["layout"])
    out.mkdir()
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(out / "params", _nest(layout, source.read("param")))
        moments = {s: _nest(layout, source.read(s)) for s in ("mu", "nu") if s in source.states}
        if moments:
            ckptr.save(out / "opt_state", moments)
        ckptr.wait_until_finished()
        ckptr.close()
        step_meta = None
        if snap != src:
            if (src / "train_state").is_dir():
                shutil.copytree(src / "train_state", out / "train_state", copy_function=link_or_copy)
            if (src / "meta").is_dir():
                try:
                    step_meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(src / "meta")
                except Exception:  # noqa: BLE001  (a meta item orbax cannot read is left out, not fatal)
                    step_meta = None
        record = {
            "format": "nsp-export",
            "version": source.version,
            "optimizer": meta["optimizer"],
            "leaves": [{"path": leaf.path, "keys": path_keys(leaf.path), "shape": list(leaf.shape),
                        "dtype": leaf.dtype} for leaf in layout.leaves],
            "params": "params", "opt_state": "opt_state" if moments else None,
            "meta": step_meta,
        }
        atomic_write_json(out / "export.json", record)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return record


def link_or_copy(src: str, dst: str) -> str:
    """``shutil.copytree``'s ``copy_function``: a hard link where the file system allows one, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst
