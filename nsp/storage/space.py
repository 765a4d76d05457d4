"""How much disk a store on disk needs, and whether its file systems have it, said before anything is written.

A ``file`` or ``csd`` store (and any backend library's: they all keep the file tier's files, see ``format.py``)
holds, in every shard directory:

- its pages: ``VERSION_SLOTS`` (two: an update writes version ``t+1`` beside ``t``, so a crash leaves one whole)
  copies of every state the optimizer keeps (``OptimizerSpec.states_used``: param, and mu/nu), each
  ``pages_per_shard`` page files of ``page_bytes`` plus a 4-byte CRC-32C trailer with checksums. Every page is
  written whole (the last one of a shard too, padded), and every file takes whole blocks of its file system, so a
  4 MiB page with its trailer takes 4 MiB + 4 KiB on a 4 KiB-block disk;
- or, for a one-slot store (``slots=1``), one copy of them plus its redo journal (``ffi/engine/redo_journal.h``:
  the update's gradient, at most 4 bytes per element, and a record per window of pages) and the scratch of one
  window in flight (``redo_window`` pages of every state, written beside the old ones before they are switched in);
- for a store whose updates take their gradient staged on its disk (``stage_gradients``, ``stage_itemsize``: 2
  for bf16, 4 for fp32), the stage file beside each shard's pages (``gradient.stage``: the gradient, then the new
  params over it); a one-slot store's journal then holds a checksum per page of that file, not a copy;
- room for checkpoints: a snapshot hard-links the committed slot's page files, and the engine replaces a linked
  file (a fresh file renamed over it) instead of rewriting it in place, so while a snapshot lives the shard can
  hold one more version of its pages (``checkpoints``: how many snapshots may pin their own pages at once);
- its metadata: directories, ``LOCK``, ``SHARD.json``, the arrays' ``zarr.json``, the manifest (a checksum per
  page, state and slot) and the temporary copy each commit writes beside it; and at the store's root
  ``nsp_store.json`` (the layout: one entry per leaf) and its temporary copy. These are bounded from above
  (``shard_metadata_bytes``, ``root_metadata_bytes``): the figure is what the store takes at most, never less.

``check_free_space`` adds the shards up per file system (shards on one disk share its free space), counts as free
what a new store replaces (leftover arrays of an unfinished creation), and raises ``StoreError`` naming the
figures and the ways out when a file system falls short. Several processes sharing a disk (one machine running
several processes of a job) each see the whole disk free: each checks only its own shards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from nsp.storage.format import STATES, StoreError
from nsp.storage.layout import Layout
from nsp.storage.optimizer import OptimizerSpec

VERSION_SLOTS = 2  # every store on disk keeps two versions of its state (format.py): one survives a crash
BLOCK_BYTES_DEFAULT = 4096  # the block a file system allocates, when no directory says otherwise
_CRC_TRAILER_BYTES = 4  # the zarr crc32c codec's trailer on every page file
# Upper bounds of what the metadata files hold, per item (generous: the bound must never fall short).
_DIR_ENTRY_BYTES = 64  # one page file's name in its directory (ext4: 8 bytes + the name, rounded to 4)
_MANIFEST_CRC_BYTES = 11  # one page checksum in a manifest: up to 10 digits and a comma
_JOURNAL_HEADER_BYTES = 4096  # a redo journal's header (hyperparameters) and its checksum, rounded up
_RECORD_FIXED_BYTES = 28  # a journal record's magic, page range and checksum
_MANIFEST_FIXED_BYTES = 1024  # a manifest's store id, shard, version and keys
_LEAF_JSON_BYTES = 512  # one leaf in nsp_store.json (path, shape, dtype, offset), beyond its path's length
_METADATA_FIXED_BYTES = 4096  # the rest of nsp_store.json (ids, tier, shard paths, optimizer)


def _blocks(n: int, block: int) -> int:
    """``n`` bytes rounded up to whole blocks (what a file of ``n`` bytes takes on disk)."""
    return -(-n // block) * block


def _states(optimizer: OptimizerSpec) -> int:
    return sum(1 for used in optimizer.states_used() if used)


def page_file_bytes(page_bytes: int, *, checksum: bool = True, block_bytes: int = BLOCK_BYTES_DEFAULT) -> int:
    """What one page file takes on disk: the page, its checksum trailer, rounded up to whole blocks."""
    return _blocks(page_bytes + (_CRC_TRAILER_BYTES if checksum else 0), block_bytes)


def version_bytes(layout: Layout, optimizer: OptimizerSpec, *, checksum: bool = True,
                  block_bytes: int = BLOCK_BYTES_DEFAULT) -> int:
    """What one version of one shard's pages takes on disk: every state the optimizer keeps, every page."""
    page = page_file_bytes(layout.page_elems * 4, checksum=checksum, block_bytes=block_bytes)
    return _states(optimizer) * layout.pages_per_shard * page


def shard_metadata_bytes(layout: Layout, optimizer: OptimizerSpec, *,
                         block_bytes: int = BLOCK_BYTES_DEFAULT, slots: int = VERSION_SLOTS) -> int:
    """An upper bound of what one shard's metadata takes on disk: its directories, small files, and the manifest
    with the temporary copy each commit renames over it."""
    states, pages = _states(optimizer), layout.pages_per_shard
    if slots == 1:  # one slot's arrays, whose page directories also name the window's scratch pages
        pages *= 2
    # The shard, its two slots, and per slot and state an array directory (zarr.json beside it) and the
    # directory of its pages, which grows with their names.
    dirs = (3 + slots * states) * block_bytes
    dirs += slots * states * _blocks(max(1, pages * _DIR_ENTRY_BYTES), block_bytes)
    files = (2 + slots * states) * block_bytes  # LOCK, SHARD.json, each array's zarr.json
    manifest = _MANIFEST_FIXED_BYTES + slots * states * pages * _MANIFEST_CRC_BYTES
    return dirs + files + 2 * _blocks(manifest, block_bytes)


def root_metadata_bytes(layout: Layout, *, block_bytes: int = BLOCK_BYTES_DEFAULT) -> int:
    """An upper bound of what the store's root takes on disk besides its shards: the root and its ``shards/``
    directory, ``LOCK``, and ``nsp_store.json`` (one entry per leaf) with its temporary copy."""
    described = _METADATA_FIXED_BYTES + sum(_LEAF_JSON_BYTES + len(leaf.path) for leaf in layout.leaves)
    return 3 * block_bytes + 2 * _blocks(described, block_bytes)


def shard_bytes(layout: Layout, optimizer: OptimizerSpec, *, checksum: bool = True, checkpoints: int = 1,
                block_bytes: int = BLOCK_BYTES_DEFAULT, slots: int = VERSION_SLOTS, redo_window: int = 16,
                stage_itemsize: int = 0) -> int:
    """What one shard takes on disk at most: its version slots (two; or one, with its redo journal and a window
    of scratch pages), ``checkpoints`` more versions of its pages (the pages live snapshots keep), its gradient
    stage file when its updates stage their gradient (``stage_itemsize`` bytes per element; 0: they do not), and
    its metadata (without the root's)."""
    if checkpoints < 0:
        raise ValueError(f"checkpoints must be >= 0, got {checkpoints}")
    if slots not in (1, 2):
        raise ValueError(f"slots must be 1 or 2, got {slots}")
    if stage_itemsize not in (0, 2, 4):
        raise ValueError(f"stage_itemsize must be 0 (no staged gradient), 2 (bf16) or 4 (fp32), got {stage_itemsize}")
    pages = version_bytes(layout, optimizer, checksum=checksum, block_bytes=block_bytes)
    meta = shard_metadata_bytes(layout, optimizer, block_bytes=block_bytes, slots=slots)
    stage = _blocks(stage_itemsize * layout.shard_size, block_bytes)
    if slots == 2:
        return (VERSION_SLOTS + checkpoints) * pages + stage + meta
    return (1 + checkpoints) * pages + stage + meta + journal_bytes(
        layout, optimizer, redo_window=redo_window, checksum=checksum, block_bytes=block_bytes,
        staged=stage_itemsize > 0)


def journal_bytes(layout: Layout, optimizer: OptimizerSpec, *, redo_window: int = 16, checksum: bool = True,
                  block_bytes: int = BLOCK_BYTES_DEFAULT, staged: bool = False) -> int:
    """What a one-slot shard's update adds at most: its redo journal (the gradient as given: dense, at most fp32;
    compressed pairs take 8 bytes each, so as much while they send at most half the elements, as Top-K does; a
    staged gradient: a checksum per page of the stage file, which is counted apart; a header; a record per
    window) and one window of scratch pages."""
    states, pages = _states(optimizer), layout.pages_per_shard
    window = min(max(1, redo_window), pages)
    records = -(-pages // window) * (_RECORD_FIXED_BYTES + 4 * states * window)
    gradient = 4 * pages if staged else 4 * layout.shard_size
    journal = _blocks(_JOURNAL_HEADER_BYTES + gradient + records, block_bytes)
    page = page_file_bytes(layout.page_elems * 4, checksum=checksum, block_bytes=block_bytes)
    return journal + window * states * page


def required_bytes(layout: Layout, optimizer: OptimizerSpec, *, checksum: bool = True, checkpoints: int = 1,
                   shards: int | None = None, block_bytes: int = BLOCK_BYTES_DEFAULT, slots: int = VERSION_SLOTS,
                   redo_window: int = 16, stage_itemsize: int = 0) -> int:
    """The disk a store needs at most, all its shards on one file system of ``block_bytes`` blocks: for a plan
    or a command line to print before creating it (``check_free_space`` checks each file system's part).

    Args:
      layout: the store's layout (``Layout.from_tree`` of the params or of their ``jax.ShapeDtypeStruct``).
      optimizer: what the store runs (which states it keeps).
      checksum: whether the pages carry a CRC-32C trailer (the store's ``checksum``, on by default).
      checkpoints: snapshots that may keep their own copy of the pages at once (a snapshot links the committed
        pages; once the store has moved on, those are extra). 0: no checkpoints on this disk.
      shards: how many of the layout's shards (default: all of them).
      block_bytes: the file system's allocation block.
      slots: the store's version slots (1: one copy of the state and a redo journal; ``nsp.storage.open``).
      redo_window: a one-slot store's pages in flight per shard (their scratch is counted).
      stage_itemsize: bytes per element of a gradient the updates stage on the store's disk (2: bf16, 4: fp32;
        ``nsp.optim``'s ``stage_gradients``); 0: they do not.
    """
    shards = layout.num_shards if shards is None else shards
    per_shard = shard_bytes(layout, optimizer, checksum=checksum, checkpoints=checkpoints, block_bytes=block_bytes,
                            slots=slots, redo_window=redo_window, stage_itemsize=stage_itemsize)
    return shards * per_shard + root_metadata_bytes(layout, block_bytes=block_bytes)


def memory_bytes(layout: Layout, optimizer: OptimizerSpec, *, in_place: bool = False) -> int:
    """The RAM a ``memory`` store of this layout holds: its states, in two version slots (one ``in_place``)."""
    return (1 if in_place else VERSION_SLOTS) * _states(optimizer) * layout.padded_total * 4


@dataclasses.dataclass(frozen=True)
class FileSystemNeed:
    """What a store needs of one file system, and what that file system has.

    ``directory``: one of the store's directories on it (where the free space was asked); ``shards``: the shards
    it holds; ``holds_root``: whether the store's metadata lives there too; ``needed``: bytes the store will take
    there at most; ``free``: bytes free for an unprivileged writer, plus what the new store replaces (leftovers
    of an unfinished creation).
    """

    directory: Path
    device: int
    shards: tuple[int, ...]
    holds_root: bool
    needed: int
    free: int

    @property
    def short(self) -> bool:
        return self.needed > self.free


def check_free_space(shard_paths: Sequence[str | os.PathLike], layout: Layout, optimizer: OptimizerSpec, *,
                     root: str | os.PathLike | None = None, shards: Sequence[int] | None = None,
                     checksum: bool = True, checkpoints: int = 1, slots: int = VERSION_SLOTS,
                     redo_window: int = 16, stage_itemsize: int = 0) -> list[FileSystemNeed]:
    """Checks that every file system the store's shards (and its root) live on can hold what it will write there.

    Args:
      shard_paths: each shard's directory (``StateStore.shard_paths``); one that does not exist yet is asked
        about through its nearest existing parent.
      layout, optimizer, checksum, checkpoints, slots, redo_window, stage_itemsize: as for ``required_bytes``.
      root: the store's directory, where ``nsp_store.json`` lives (None: count no root metadata).
      shards: the shards to count (default: all; one process of several counts its own).

    Returns:
      One ``FileSystemNeed`` per file system, in the order their first shard comes.

    Raises:
      StoreError: some file system has less free space than the store needs there; the message names, for each,
        the bytes needed and free and a directory on it, and what can be done instead.
    """
    shards = range(len(shard_paths)) if shards is None else shards
    groups: dict[int, dict] = {}
    for i in shards:
        directory = _existing(Path(shard_paths[i]))
        group = groups.setdefault(os.stat(directory).st_dev, {"directory": directory, "shards": [], "root": False,
                                                               "reclaimable": 0})
        group["shards"].append(i)
        group["reclaimable"] += _replaced_bytes(Path(shard_paths[i]))
    if root is not None:
        directory = _existing(Path(root))
        groups.setdefault(os.stat(directory).st_dev, {"directory": directory, "shards": [], "root": False,
                                                      "reclaimable": 0})["root"] = True
    needs = []
    for device, group in groups.items():
        block = _block_bytes(group["directory"])
        needed = len(group["shards"]) * shard_bytes(layout, optimizer, checksum=checksum, checkpoints=checkpoints,
                                                    block_bytes=block, slots=slots, redo_window=redo_window,
                                                    stage_itemsize=stage_itemsize)
        if group["root"]:
            needed += root_metadata_bytes(layout, block_bytes=block)
        free = shutil.disk_usage(group["directory"]).free + group["reclaimable"]
        needs.append(FileSystemNeed(group["directory"], device, tuple(group["shards"]), group["root"], needed, free))
    short = [need for need in needs if need.short]
    if short:
        raise StoreError(_shortage_message(short, layout, optimizer, checkpoints, slots))
    return needs


def format_bytes(n: int) -> str:
    """``n`` bytes for a person, with one decimal: GB from a tenth of a GB up, else MB, or kB below a tenth of an
    MB (powers of ten, as disks are sold)."""
    if n >= 10**8:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 10**5 else f"{n / 1e3:.1f} kB"


def _shortage_message(short: list[FileSystemNeed], layout: Layout, optimizer: OptimizerSpec,
                      checkpoints: int, slots: int = VERSION_SLOTS) -> str:
    states = [s for s, used in zip(STATES, optimizer.states_used()) if used]
    where = "; ".join(
        f"the file system of {need.directory} ({_what_lives(need)}) needs {format_bytes(need.needed)} "
        f"({need.needed:,} bytes) and has {format_bytes(need.free)} ({need.free:,} bytes) free"
        for need in short)
    ram = memory_bytes(layout, optimizer)
    kept = (f", plus room for the pages of {checkpoints} live checkpoint{'s' if checkpoints > 1 else ''}"
            if checkpoints else "")
    if slots == 1:
        kept_how = (f"Each shard keeps one version of {'/'.join(states)} ({layout.shard_size:,} fp32 elements each, in "
                    f"pages of {_page_size(layout.page_elems * 4)}), its redo journal and a window of scratch "
                    f"pages{kept}. ")
    else:
        kept_how = (f"Each shard keeps {VERSION_SLOTS} versions of {'/'.join(states)} ({layout.shard_size:,} fp32 "
                    f"elements each, in pages of {_page_size(layout.page_elems * 4)}){kept}. Fewer version slots is not "
                    f"available to a store made with two; a new one-slot store (slots=1, nsp train --slots 1) "
                    f"keeps one, with a redo journal so that a kill still leaves a whole version. ")
    return (f"not enough disk for the store: {where}. {kept_how}"
            f"Instead: a smaller model; another store directory (--store-dir, or shard_paths spread over several "
            f"disks) on a file system with the space; or the memory tier if RAM allows ({format_bytes(ram)}, "
            f"{format_bytes(ram // VERSION_SLOTS)} with in_place=True)")


def _page_size(page_bytes: int) -> str:
    return f"{page_bytes >> 20} MiB" if page_bytes % 2**20 == 0 else f"{page_bytes >> 10} KiB"


def _what_lives(need: FileSystemNeed) -> str:
    parts = []
    if need.shards:
        parts.append(f"shard{'s' if len(need.shards) > 1 else ''} {', '.join(map(str, need.shards))}")
    if need.holds_root:
        parts.append("the store's metadata")
    return " and ".join(parts)


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (where a directory to be made will live)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _block_bytes(directory: Path) -> int:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return BLOCK_BYTES_DEFAULT
    return stat.f_frsize or stat.f_bsize or BLOCK_BYTES_DEFAULT


def _replaced_bytes(shard: Path) -> int:
    """What the shard's version slots already take (an unfinished creation's leftovers): a new store deletes
    those arrays before writing, so their space is free to it. Files another link shares stay."""
    total = 0
    for slot in range(VERSION_SLOTS):
        for directory, _, files in os.walk(shard / f"slot{slot}"):
            for name in files:
                try:
                    stat = os.lstat(os.path.join(directory, name))
                except OSError:
                    continue
                if stat.st_nlink == 1:
                    total += stat.st_blocks * 512
    return total
