"""Putting page files at new paths without copying them through Python: snapshots and restores both do it.

A hard link first (no byte moves; safe because the engine never writes into a page file another link shares), a
``FICLONE`` reflink when links fail (another file system: ``EXDEV``), else a kernel copy (``shutil.copy2``:
``sendfile`` / ``copy_file_range``). ``Placer`` counts what it did, for the caller's report. Also here: the new,
empty directories a snapshot or restore writes into, and their removal when it fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from nsp.storage.format import StoreError

MODES = ("auto", "link", "copy")
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_LINK_FALLBACK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


class Placer:
    """Puts files at new paths by hard link, falling back to reflink / kernel copy; counts what it did.

    ``mode``: ``"auto"`` (links, else reflinks/copies), ``"link"`` (links or an error), ``"copy"`` (never links).
    """

    def __init__(self, mode: str):
        check_mode(mode)
        self.mode = mode
        self.linking = mode != "copy"
        self.fallback_reason: str | None = None
        self.can_reflink = True
        self.linked = self.reflinked = self.copied = 0
        self.linked_bytes = self.reflinked_bytes = self.copied_bytes = 0

    def place(self, src: Path, dst: Path, size: int) -> None:
        if self.linking:
            try:
                os.link(src, dst)
                self.linked += 1
                self.linked_bytes += size
                return
            except OSError as e:
                if self.mode == "link" or e.errno not in _LINK_FALLBACK_ERRNOS:
                    raise StoreError(f"cannot hard-link {src} to {dst}: {e.strerror}") from e
                self.linking = False  # the same for every later file: stop trying
                self.fallback_reason = (f"hard links failed ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}; "
                                        f"{'another file system' if e.errno == errno.EXDEV else 'not supported'}): "
                                        "pages were copied")
        if self.can_reflink and self._reflink(src, dst):
            self.reflinked += 1
            self.reflinked_bytes += size
            return
        self.can_reflink = False  # failed once: the same for every later file
        shutil.copy2(src, dst)  # sendfile / copy_file_range: the kernel copies, not Python
        self.copied += 1
        self.copied_bytes += size

    @staticmethod
    def _reflink(src: Path, dst: Path) -> bool:
        try:
            sfd = os.open(src, os.O_RDONLY)
        except OSError:
            return False
        try:
            dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            os.close(sfd)
            return False
        ok = False
        try:
            fcntl.ioctl(dfd, _FICLONE, sfd)
            ok = True
        except OSError:
            pass
        finally:
            os.close(dfd)
            os.close(sfd)
        if ok:
            shutil.copystat(src, dst)
        else:
            os.unlink(dst)
        return ok

    def method(self) -> str:
        used = [name for name, n in (("link", self.linked), ("reflink", self.reflinked), ("copy", self.copied)) if n]
        return "+".join(used) or ("link" if self.linking else "copy")

    def info(self) -> dict:
        return {
            "method": self.method(),
            "fallback_reason": self.fallback_reason,
            "linked_files": self.linked, "linked_bytes": self.linked_bytes,
            "reflinked_files": self.reflinked, "reflinked_bytes": self.reflinked_bytes,
            "copied_files": self.copied, "copied_bytes": self.copied_bytes,
        }


def prepare_empty_dir(path: Path, what: str) -> bool:
    """Creates ``path`` (parents too) or accepts an existing empty directory; returns whether it existed."""
    if path.exists():
        if not path.is_dir():
            raise StoreError(f"{what} {path} exists and is not a directory")
        if any(path.iterdir()):
            raise StoreError(f"{what} {path} is not empty")
        return True
    try:
        path.mkdir(parents=True)
    except OSError as e:
        raise StoreError(f"cannot create {what} {path}: {e.strerror}") from None
    return False


def clear_dir(path: Path, existed: bool) -> None:
    """Removes what a failed snapshot/restore put under ``path`` (and ``path`` itself if we made it)."""
    if not path.exists():
        return
    if existed:
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
