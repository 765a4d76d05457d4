"""What a run says when it stops partway on a failure of its storage or of a step (``stopped``): a full disk under
the store, the checkpoints or the spill directory, an I/O error, a step that raised.

The store is crash-safe on its own: an update that fails commits nothing, so the store keeps its last committed
version whole, and a checkpoint that fails leaves the earlier ones. What the user needs is the one line of the
error (not the JAX traceback around it), what was kept, and how to go on: ``stopped`` builds that message, as a
``RunStopped`` the command prints (``nsp train``: ``nsp train: error: ...``, a non-zero exit status).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import jax

import nsp.distributed
import nsp.storage
from nsp.distributed.watchdog import duration
from nsp.train import store_resume
from nsp.train.config import RunStopped, TrainConfig, TrainError

#: XLA's status code before a custom call's error ("INVALID_ARGUMENT: "), and the call's name ("nsp.store_update: ",
#: "nsp_spill_save: ").
_PREFIXES = re.compile(r"^(?:[A-Z_]+: )?(?:nsp[._][a-z_]+: )?")
#: tensorstore's detail after an OS error's text (" [os_error_code='28']").
_DETAILS = re.compile(r" \[os_error_code='?\d+'?\]")
#: tensorstore's failed write of a checkpoint's file (under its key and database): the file and the reason.
_TENSORSTORE_WRITE = re.compile(r'.*Failed writing: "([^"]+)": Failed to write \d+ bytes to file \d+: (.+)$')
_NO_SPACE = ("No space left on device", "not enough disk")
#: The error of one of nsp's custom calls (the store update, the spill area), XLA's status code before it.
_NSP_CALL = re.compile(r"^(?:[A-Z_]+: )?nsp[._][a-z_]+: ")
#: A step of the wall clock seen this recently explains a wait that timed out.
_CLOCK_STEP_RECENT_S = 60.0
#: Room for a checkpoint's metadata beyond its arrays (orbax's files and directories, the snapshot's JSON).
_CHECKPOINT_MARGIN = 1 << 20


def storage_error(error: BaseException) -> BaseException | None:
    """The failure of storage or of a step that ``error`` is or was raised from (orbax wraps what its save thread
    raised; a jitted step raises a custom call's error as a ``JaxRuntimeError``), else None: a bug or a wrong
    argument, which keeps its traceback."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (OSError, nsp.storage.StoreError, jax.errors.JaxRuntimeError)):
            return error
        error = error.__cause__ or error.__context__
    return None


def is_own(error: BaseException) -> bool:
    """Whether ``error`` (one of ``storage_error``'s) is this process's own failure. In a multi-process run a
    step also raises a ``JaxRuntimeError`` when a collective fails because a peer went away; one of nsp's custom
    calls (the store update, the spill area) names itself in its error, and that one is this process's."""
    if not isinstance(error, jax.errors.JaxRuntimeError) or jax.process_count() == 1:
        return True
    return bool(_NSP_CALL.match(str(error).strip()))


@contextlib.contextmanager
def checkpoint_save():
    """Around a checkpoint's save: what the save raises comes out as a ``StoreError`` (``stopped`` reports it; a
    ``TrainError``, the processes disagreeing, stays one, and so does a ``JaxRuntimeError``, a collective that
    failed), and the errors orbax logs meanwhile are held back.

    orbax logs the error of each of its save threads, traceback and all, as it happens, then raises it again from
    the save (tensorstore's ``ValueError`` for a full disk): the run reports that error once, in its message. A
    save that succeeds puts the held records out after all.
    """
    logger = logging.getLogger("absl")  # orbax logs through absl's logger
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield
    except (TrainError, nsp.storage.StoreError, OSError, jax.errors.JaxRuntimeError):
        raise  # (a collective of the save that failed: is_own tells a peer gone from this process's own failure)
    except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise what they raise; all of it is the save's)
        raise nsp.storage.StoreError(one_line(e)) from e
    else:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)
    finally:
        logger.removeFilter(hold)


def check_checkpoint_room(ckpt_dir: Path, train_state: Any, store) -> None:
    """Raises ``StoreError`` when the file system of ``ckpt_dir`` has too little free space for a checkpoint of
    ``train_state`` and ``store``, before anything of it is written.

    orbax writes the train state from threads through tensorstore; a disk that fills under them leaves tracebacks
    of those threads on the terminal however the save's own error is reported. The figure: the train state's
    bytes, the store's pages when they are copied (the checkpoint on another file system than the store's shards)
    and a margin for the metadata, the snapshot's file list and the blocks files round up to."""
    ckpt_dir = Path(ckpt_dir)
    need = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(train_state))
    pages = 0
    if store.root is not None and store.initialized:
        pages = len(store.local_shards) * store.layout.pages_per_shard * sum(store.optimizer.states_used())
        device = _device(ckpt_dir)
        if any(_device(shard) != device for shard in store.local_shard_paths):
            need += pages * store.page_bytes
    need += _CHECKPOINT_MARGIN + 512 * pages
    free = shutil.disk_usage(_existing(ckpt_dir)).free
    if free < need:
        raise nsp.storage.StoreError(
            f"not enough disk for it in {ckpt_dir}/: its file system has {free / 1e6:,.1f} MB free, the checkpoint "
            f"takes up to {need / 1e6:,.1f} MB (nothing of it was written)")


def _existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists())


def _device(path: Path) -> int:
    return _existing(Path(path)).stat().st_dev


def one_line(error: BaseException) -> str:
    """The error's own line: the first of its message, without XLA's status code and the custom call's name."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    line = _DETAILS.sub("", _PREFIXES.sub("", lines[0]))
    written = _TENSORSTORE_WRITE.match(line)  # the file and the OS's reason, of tensorstore's three layers of text
    return f"cannot write {written[1]}: {written[2]}" if written else line


def stopped(error: BaseException, *, config: TrainConfig, doing: str, store, manager: Any = None,
            spill: Any = None) -> RunStopped:
    """The ``RunStopped`` of a run that failed at ``doing`` (``step 7``, ``the checkpoint of step 6``) with
    ``error`` (one of ``storage_error``'s). ``store``: the run's store (read for its committed version, before it is
    closed); ``manager``: the checkpoint manager when the run saves checkpoints; ``spill``: the run's spill area
    (``--offload-activations``), or None."""
    line = one_line(error)
    clock = _clock_step(error, line)
    if clock is not None:  # orbax timed a wait by the wall clock, which stepped: nothing is wrong with the disks
        line += (f" (this host's wall clock had just jumped by {duration(clock)}, and orbax times its waits by the "
                 "wall clock)")
    where = _where(line, config, store, spill)
    no_space = any(text in line for text in _NO_SPACE) or getattr(error, "errno", None) == errno.ENOSPC
    version = _version(store)
    kept = []
    if version is not None:
        only = f" --shards {','.join(map(str, store.local_shards))}" if store.is_partial else ""
        kept.append(f"the store at version {version}, committed and whole (what failed committed nothing; "
                    f"nsp store verify {store.root}{only} checks it)" if store.root is not None
                    else f"the store at version {version} (the memory tier: it ends with this process)")
    resume = None
    if config.checkpoints:
        last = _latest_checkpoint(manager)
        if last is not None:
            kept.append(f"the checkpoint of step {last} ({Path(config.run_dir) / 'ckpt' / str(last)})")
            resume = f"it continues from the checkpoint of step {last}"
        else:
            kept.append("no checkpoint")
            resume = "with no checkpoint it starts the run afresh"
    elif store_resume.why_not(config) is None and version is not None:
        try:
            resume = (f"it continues from the store's version {version}, at step "
                      f"{store_resume.step_to_resume(Path(config.run_dir), version)}")
        except ValueError:
            resume = None
    if clock is not None:
        fix = None  # nothing to mend: the clock stands where it was set
    elif no_space:
        fix = (f"free space on the file system of {where[0]} ({_free(where[1])} free now)" if where
               else "free space on the run's disks")
    else:
        fix = "remove the cause"
    if resume:
        go_on = f"to go on: {fix + ', then run' if fix else 'run'} the same command with --resume ({resume})"
    else:
        go_on = (f"to go on: {fix or 'nothing to mend'}; the run cannot be resumed ("
                 + (store_resume.why_not(config) or "nothing was saved") + "): start it again")
    lines = [f"{doing} failed: {line}",
             "kept: " + ("; ".join(kept) if kept else "nothing (the run saves no checkpoints)"), go_on]
    return RunStopped("\n".join(lines))


def _clock_step(error: BaseException, line: str) -> float | None:
    """The step of this host's wall clock just before ``error``, when ``error`` is a wait that timed out (orbax
    measures its waits' timeouts by the wall clock: a step forward ends them at once); else None."""
    timed_out, seen = False, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        timed_out = timed_out or isinstance(error, TimeoutError)
        error = error.__cause__ or error.__context__
    if not (timed_out or "timed out" in line):
        return None
    return nsp.distributed.CLOCK.step(within_s=_CLOCK_STEP_RECENT_S)


def _where(line: str, config: TrainConfig, store, spill) -> tuple[str, Path] | None:
    """``(what, directory)`` of the run's directory that the error's path lies in: the spill directory, the store
    (or one of its shards), the checkpoints, the run directory; None when the line names none of them."""
    run_dir = Path(config.run_dir)
    places: list[tuple[str, Path]] = []
    if spill is not None:
        places.append((f"the spill directory (--spill-dir) {spill.path.parent}", spill.path.parent))
    if store is not None and store.root is not None:
        for shard in store.external_shards:
            places.append((f"the store's shard {shard}", shard))
        places.append((f"the store {store.root}", Path(store.root)))
    places += [(f"the checkpoint directory {run_dir / 'ckpt'}", run_dir / "ckpt"),
               (f"the run directory {run_dir}", run_dir)]
    for what, directory in places:
        for form in {str(directory), str(directory.absolute()), str(directory.resolve())}:
            if re.search(re.escape(form) + r"(?=[/:\s,)'\"]|$)", line):
                return what, directory
    return None


def _version(store) -> int | None:
    if store is None:
        return None
    try:
        return store.version
    except nsp.storage.StoreError:  # a background update failed: the engines still hold the committed version
        return None


def _latest_checkpoint(manager) -> int | None:
    if manager is None:
        return None
    try:
        manager.reload()  # a failed save leaves only its temporary directory: the latest step is a finished one
        return manager.latest_step()
    except Exception:  # noqa: BLE001  (the message is what is left to give; it says no checkpoint)
        return None


def _free(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(_existing(directory)).free / 1e6:,.1f} MB"
    except OSError:
        return "unknown"
